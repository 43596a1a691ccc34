"""The kernel bugs of tests/planted/bugs_2026.py as one-line variants of the torch functions
with the libraries' real signatures (tests/planted/library_bugs_2026.py), run through the
library's preset with no wrapper: each fails at least five cases of its suite, every failing
case names it, and the correct library function passes the same cases (no false alarm)."""

from __future__ import annotations

import pytest

from oracle.run.validate import validate
from tests.helpers import assert_caught_and_named

pytestmark = pytest.mark.peers("torch")

LIB = "tests.planted.library_2026"
BUGS = "tests.planted.library_bugs_2026"
DSA = ["mla-dsa-decode-*"]
#: the sink joins FlashMLA's lse after the call (refattn's reading), so a base-2 lse with a
#: sink is no longer a plain log2 of the truth: the sink rows fail unnamed
DSA_NO_SINKS = ["mla-dsa-decode-H*", "mla-dsa-decode-h128-*", "mla-dsa-decode-ragged-*"]
MLA = ["mla-decode-H8K1-*", "mla-decode-kv-lengths-*", "mla-dsa-decode-*"]
QV = ["qv-H4K1-*", "qv-causal-gqa-*", "qv-mla-form-*"]

#: bug -> (library function it changes, preset, cases, the diagnosis that names it)
TORCH_BUGS = {
    "flash_mla_sparse_fwd_indices_off_by_one": (
        "flash_mla_sparse_fwd",
        "flashmla_sparse",
        DSA,
        "index off by one",
    ),
    "flash_mla_sparse_fwd_lse_in_base2": (
        "flash_mla_sparse_fwd",
        "flashmla_sparse",
        DSA_NO_SINKS,
        "lse in log2 units",
    ),
    "flash_mla_with_kvcache_scale_of_key_width": (
        "flash_mla_with_kvcache",
        "flashmla_kvcache",
        MLA,
        "scale of the key width 1/sqrt(",
    ),
    "flash_attn_func_qv_dropped": ("flash_attn_func", "flash_attn_3", QV, "qv term missing"),
    "trtllm_decode_nibbles_swapped": (
        "trtllm_batch_decode_with_kv_cache",
        "flashinfer_trtllm_decode",
        ["fp4-nvfp4-*"],
        "packed nibbles swapped",
    ),
}
FAST = {"flash_attn_func_qv_dropped", "trtllm_decode_nibbles_swapped"}
DTYPES = ("float32", "bfloat16")


def _results(function, signature, cases):
    results = []
    for dtype in DTYPES:
        report = validate(
            function,
            suite="default",
            dtype=dtype,
            cases=cases,
            signature=signature,
            progress=False,
            isolate=False,
        )
        results += report.results
    return results


def _marked(names):
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("bug", _marked(TORCH_BUGS))
def test_library_bug_fails_and_is_named(bug):
    _, signature, cases, name = TORCH_BUGS[bug]
    assert_caught_and_named(_results(f"{BUGS}:{bug}", signature, cases), name)


@pytest.mark.parametrize("bug", _marked(TORCH_BUGS))
def test_library_function_passes_the_same_cases(bug):
    function, signature, cases, _ = TORCH_BUGS[bug]
    results = _results(f"{LIB}:{function}", signature, cases)
    verdicts = [r.verdict for r in results]
    assert verdicts.count("pass") >= 5, verdicts
    assert set(verdicts) <= {"pass", "unsupported"}, [
        (r.name, r.verdict, r.diagnosis) for r in results if r.verdict != "pass"
    ]
