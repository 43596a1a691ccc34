"""The 2025-26 signature presets: torch functions with the libraries' REAL signatures and
return values (tests/planted/library_2026.py) pass their cases through ``signature=`` with no
wrapper, in float32 and bfloat16; what a library cannot express is "unsupported", never a
fail. Case subsets (the full default run of each is too slow for this tier): the families
each library can express."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from oracle.catalogue import registry
from oracle.catalogue.case import Case, Shapes, seed_of
from oracle.conventions.merge import adapt
from oracle.conventions.signatures import Call, get
from oracle.diagnose.guidance import hint
from oracle.run.validate import resolve_impl, validate
from tests.planted import library_2026

pytestmark = pytest.mark.peers("torch")

LIB = "tests.planted.library_2026"
ATTENTION = {
    "flash_attn_3": ("flash_attn_func", ["basic-*", "causal-*", "qv-*", "fp8-*", "window-*"]),
    "flash_attn_3_kvcache": ("flash_attn_with_kvcache", ["kv-lengths-*", "qv-*", "decode-*"]),
    "flashmla_kvcache": ("flash_mla_with_kvcache", ["mla-decode-*", "basic-*"]),
    "flashinfer_trtllm_decode": ("trtllm_batch_decode_with_kv_cache", ["fp4-nvfp4-*"]),
}


def _verdicts(signature, dtype, cases=None):
    function, default_cases = ATTENTION[signature]
    report = validate(
        f"{LIB}:{function}",
        suite="default",
        dtype=dtype,
        cases=cases or default_cases,
        signature=signature,
        progress=False,
        isolate=False,
    )
    assert report.passed, [r.explain() for r in report.failures]
    return Counter(r.verdict for r in report.results)


@pytest.mark.parametrize("signature", list(ATTENTION))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_library_function_passes_through_its_preset(signature, dtype):
    verdicts = _verdicts(signature, dtype)
    assert set(verdicts) <= {"pass", "unsupported"}, verdicts
    if signature != "flashinfer_trtllm_decode" or dtype == "bfloat16":
        assert verdicts["pass"] >= 2, verdicts


def test_flash_attn_points_qv_and_descales_to_flash_attn_3():
    q = k = v = np.zeros((1, 2, 3, 4))
    for option in ("qv", "q_descale"):
        with pytest.raises(NotImplementedError, match="--signature flash_attn_3"):
            get("flash_attn").translate({option: np.zeros(1)}, Call.of(q, k, v, {}))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("function", ["merge_state", "merge_states"])
def test_flashinfer_merge_passes_merge_default(function, dtype):
    fn = adapt(resolve_impl(f"{LIB}:{function}")[0], f"flashinfer_{function}", "torch")
    report = validate(fn, suite="merge-default", dtype=dtype, progress=False, isolate=False)
    assert report.passed, [r.explain() for r in report.failures]
    verdicts = Counter(r.verdict for r in report.results)
    assert set(verdicts) <= {"pass", "unsupported"} and verdicts["pass"] >= 12, verdicts
    if dtype == "bfloat16":  # the float32 lses' conversion is far below bfloat16's rounding
        assert verdicts["unsupported"] == 0, verdicts


@pytest.mark.parametrize("function", ["merge_state", "merge_states"])
def test_flashinfer_merge_refuses_lses_its_float32_base2_s_would_move(function):
    """|lse| ~ 1e4: FlashInfer's float32 base-2 s (and merge_state's float32 intermediate S)
    would move the states' weights far past float32's rounding: not expressible, never a fail."""
    fn = adapt(resolve_impl(f"{LIB}:{function}")[0], f"flashinfer_{function}", "torch")
    report = validate(
        fn,
        suite="merge-default",
        dtype="float32",
        cases=["merge-large-pos-*", "merge-large-base2-*", "merge-random-*"],
        progress=False,
        isolate=False,
    )
    verdicts = {r.name.split("-P")[0]: r.verdict for r in report.results}
    assert verdicts["merge-large-pos"] == "unsupported" and verdicts["merge-random"] == "pass"
    pairwise = "unsupported" if function == "merge_state" else "pass"
    assert verdicts["merge-large-base2"] == pairwise, verdicts


@pytest.mark.slow
def test_flashmla_sparse_passes_the_mla_sparse_cases():
    verdicts = Counter()
    report = validate(
        f"{LIB}:flash_mla_sparse_fwd",
        suite="default",
        dtype="bfloat16",
        cases=["mla-sparse-prefill-*", "sparse-sentinels-*"],
        signature="flashmla_sparse",
        progress=False,
        isolate=False,
        diagnose=False,
    )
    verdicts.update(r.verdict for r in report.results)
    assert report.passed, [r.explain() for r in report.failures]
    assert verdicts["pass"] >= 1 and set(verdicts) <= {"pass", "unsupported"}, verdicts


@pytest.mark.parametrize(
    "function, preset",
    [
        ("flash_mla_sparse_fwd", "flashmla_sparse"),
        ("flash_mla_with_kvcache", "flashmla_kvcache"),
        ("trtllm_batch_decode_with_kv_cache", "flashinfer_trtllm_decode"),
        ("merge_state", "flashinfer_merge_state"),
        ("merge_states", "flashinfer_merge_states"),
        ("flash_attn_func", "flash_attn_3"),
        ("flash_attn_with_kvcache", "flash_attn_3_kvcache"),
    ],
)
def test_first_case_guidance_names_the_matching_preset(function, preset):
    said = hint(getattr(library_2026, function), [], {"layout": "bhld"})
    assert said is not None and said.endswith(f"--signature {preset}"), said


@pytest.fixture
def small_mla_sparse_suite():
    """Small MLA-shaped sparse cases (v = k[..., :E], K 1) with sentinels, duplicates, empty
    rows, past-the-end entries, causal bottom-right and ragged lengths, float32 and bfloat16
    (the mla-sparse-* cases of default are 8192 keys wide)."""
    cases = []
    rows = (
        ("sentinels", {"scale": 0.2}, "sentinels", {}),
        ("causal", {"scale": 0.2, "causal": True, "align": "bottom_right"}, "duplicates", {}),
        (
            "ragged",
            {"scale": 0.2, "empty_rows": "zero"},
            "past-end+empty-rows",
            {"kv_lengths": "ragged"},
        ),
    )
    for dtype in ("float32", "bfloat16"):
        for tag, options, kind, more in rows:
            name = f"presets-mla-sparse-{tag}-{dtype}"
            recipe = {"qkv": "gaussian", "latent_v": True, "key_indices": kind, "topk": 8}
            cases.append(
                Case(
                    name,
                    ("presets-mla-sparse",),
                    "conformance",
                    dtype,
                    Shapes(batch=2, H=4, K=1, L=3, S=40, D=24, E=16),
                    options=options,
                    recipe={**recipe, **more},
                    seed=seed_of(name),
                    description="small MLA-shaped sparse case",
                    function="attention",
                )
            )
    registry.register_suite("presets-mla-sparse", lambda: cases)
    yield "presets-mla-sparse"
    registry.unregister_suite("presets-mla-sparse")


def test_flashmla_sparse_passes_small_mla_sparse_cases(small_mla_sparse_suite):
    report = validate(
        f"{LIB}:flash_mla_sparse_fwd",
        suite=small_mla_sparse_suite,
        dtype=None,
        signature="flashmla_sparse",
        progress=False,
        isolate=False,
    )
    assert report.passed, [r.explain() for r in report.failures]
    assert [r.verdict for r in report.results] == ["pass"] * 6


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "function, signature",
    [("flash_mla_with_kvcache", "flashmla_kvcache"), ("flash_mla_sparse_fwd", "flashmla_sparse")],
)
def test_flashmla_passes_the_dsa_decode_cases(function, signature, dtype):
    """DSA decode on the paged latent cache (FlashMLA's sparse decode: ``indices`` into the
    656-byte fp8 cache) and the same cases through the sparse prefill's flat layout."""
    report = validate(
        f"{LIB}:{function}",
        suite="default",
        dtype=dtype,
        cases=["mla-dsa-decode-*"],
        signature=signature,
        progress=False,
        isolate=False,
    )
    assert report.passed, [r.explain() for r in report.failures]
    assert [r.verdict for r in report.results] == ["pass"] * 4
