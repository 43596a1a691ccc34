"""Tiled kernels (tests/planted/tiled_kernels.py): the correct ones pass both tolerance tiers, the
broken ones fail with the right diagnosis; accuracy grades name what a kernel does."""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from oracle import catalogue
from oracle.fixtures import golden
from oracle.reading.baseline import textbook_attention
from oracle.run.validate import validate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.planted.tiled_kernels import TILED_BROKEN, flash, split_kv, tiled  # noqa: E402

#: broken kernel -> the default cases it must fail (five or more of one dtype it affects: the
#: smallest kernel-scale cases of default that carry its bug class)
_TILES = (
    "k-tile-H2K2-L65S65-*-f32",
    "k-tile-causal-H2K2-L65S65-*-f32",
    "k-causal-l-gt-s-B2H2K2-L70S64-*-f32",
    "k-causal-l-gt-s-H4K2-L100S40-*-f32",
    "l-lt-s-*-f32",
)
CASES = {
    "tile_off_by_one": ("k-tile-H2K2-L64S64-*-f32", *_TILES[:3], "l-lt-s-*-f32"),
    "partial_tile": (
        *_TILES[:2],
        "k-causal-l-gt-s-H2K2-L130S70-*-f32",
        "k-tile-H2K2-L129S129-*-f32",
        "l-lt-s-*-f32",
    ),
    "partial_query_tile": _TILES[:4] + ("k-tile-H2K2-L129S129-*-f32",),
    "no_late_rescale": (
        "l-lt-s-*-f32",
        "k-window-l-gt-s-*-f32",
        "k-tile-H2K2-L129S129-*-f32",
        "k-peaky-late-*-f32",
        "decode-*-f32",
    ),
    "split_combine": (
        "decode-*-f32",
        "k-tile-H2K2-L257S257-*-f32",
        "k-peaky-late-*-f32",
        "k-uniform-*-f32",
        "k-sink-*-f32",
    ),
    "accumulate_float16": (
        "basic-H2K2-L24S40-*-f32",
        "d-ne-e-*-f32",
        "scale-*-f32",
        "k-tile-H2K2-L65S65-*-f32",
    ),
    "accumulate_bfloat16": (
        "basic-H2K2-L24S40-*-f32",
        "d-ne-e-*-f32",
        "scale-*-f32",
        "k-tile-H2K2-L65S65-*-f32",
    ),
    "lse_log2": ("basic-*-f32", "l-lt-s-*-f32", "scale-*-f32", "k-tile-H2K2-L64S64-*-f32"),
    "causal_offset": (
        "causal-br-empty-H*-f32",
        "causal-br-empty-nan-*-f32",
        "k-causal-l-gt-s-B2H2K2-L70S64-*-f32",
        "k-causal-l-gt-s-H4K2-L100S40-*-f32",
        "k-window-l-gt-s-*-f32",
    ),
}

_CORRECT = (
    "basic-*",
    "l-lt-s-*",
    "decode-*",
    "long-*",
    "causal-*",
    "mask-*",
    "gqa-*",
    "bias-*",
    "softcap-*",
    "alibi-*",
    "dropout-*",
    "cancel-*",
    "gap-*",
    "window-*",
    "k-tile-H2K2-L65S65-*",
    "gauss-s0.25-*",
)


@pytest.fixture(scope="module")
def fixtures():
    patterns = {p for ps in CASES.values() for p in ps} | set(_CORRECT)
    chosen = [
        c
        for c in catalogue.suite("default")
        if c.function == "attention"
        and any(fnmatch.fnmatchcase(c.name, p) for p in patterns)
        and (not c.name.startswith("k-") or c.dtype in ("float32", "float16"))
        and c.shapes.S <= 4096  # the 2k-128k-key long rows: oracle.power's (slow) tests
    ]
    return {c.name: golden.build(c) for c in chosen}


def _pick(fixtures, patterns):
    return [f for n, f in fixtures.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


@pytest.mark.parametrize("tier", ["default", "tight"])
@pytest.mark.parametrize("impl", [tiled, flash, split_kv], ids=lambda f: f.__name__)
def test_correct_tiled_kernels_pass(impl, tier, fixtures):
    chosen = _pick(fixtures, _CORRECT)
    report = validate(
        impl, fixtures=chosen, dtype=None, progress=False, strict=True, tolerance=tier
    )
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("name", sorted(TILED_BROKEN))
def test_broken_tiled_kernel_fails_with_diagnosis(name, fixtures):
    impl, diagnosis = TILED_BROKEN[name]
    chosen = _pick(fixtures, CASES[name])
    assert len(chosen) >= 5, (name, [f.case.name for f in chosen])
    report = validate(impl, fixtures=chosen, dtype=None, progress=False)
    for result in report.results:
        assert result.verdict == "fail", f"{name}: {result.explain()}"
        assert any(diagnosis in d for d in result.diagnosis), (
            f"{name}: expected {diagnosis!r}\n{result.explain()}"
        )


def test_tight_tier_catches_half_accumulation(fixtures):
    """float16 accumulation on near-uniform rows (sums of nearly equal terms) passes the
    default tier and fails the tight one."""
    impl, _ = TILED_BROKEN["accumulate_float16"]
    chosen = _pick(fixtures, ("gauss-s0.25-*-f16",))
    assert validate(impl, fixtures=chosen, dtype=None, progress=False).passed
    tight = validate(impl, fixtures=chosen, dtype=None, progress=False, tolerance="tight")
    assert not tight.passed, tight.summary()


def test_grades_name_flash_attention(fixtures):
    chosen = _pick(fixtures, ("basic-*-f16", "l-lt-s-*-f16", "long-*-f16"))
    report = validate(flash, fixtures=chosen, dtype=None, progress=False)
    grade = report.grades()["float16"]["out"]
    assert grade["consistent_with"][0].startswith("P rounded to float16 before P@V"), grade
    assert 0 < grade["correctly_rounded"] < 1 and grade["ulp_median"] <= grade["ulp_p99"]
    data = json.loads(report.to_json())
    assert data["grades"]["float16"]["out"]["elements"] == grade["elements"]
    assert "Accuracy grades" in report.summary()


def test_tolerance_tier_is_checked():
    with pytest.raises(ValueError, match="tolerance"):
        validate(
            "refattn-float64", suite="smoke", cases="basic-*", tolerance="loose", progress=False
        )


def _float32_textbook(q, k, v, **options):
    options.pop("return_lse", None)
    low = {
        n: (x.astype(np.float32) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x)
        for n, x in options.items()
    }
    return textbook_attention(
        q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), dtype="float32", **low
    ).out


def test_float64_computed_in_float32_is_named(fixtures):
    """The pinned convention at float32 accuracy is preferred over a named alternative."""
    chosen = _pick(fixtures, ("basic-*-f64", "cancel-*-f64"))
    report = validate(_float32_textbook, fixtures=chosen, dtype=None, progress=False)
    for result in report.results:
        assert result.verdict == "fail", result.explain()
        assert any("float32 accuracy" in d for d in result.diagnosis), result.explain()
        assert not any("no scale" in d for d in result.diagnosis), result.explain()


def _leaky(q, k, v, mask=None, **options):
    """Masks the weights but multiplies every value: NaN at a masked key leaks (0 * NaN)."""
    options.pop("return_lse", None)
    base = textbook_attention(q, k, v, mask=mask, dtype="float64", **options)
    return np.matmul(base.weights, np.asarray(v, dtype=np.float64))


def test_bfloat16_poison_note():
    case = catalogue.get("poison-nan-padding-B2H2K2-L5S10-D8E8-bf16")
    report = validate(_leaky, fixtures=[golden.build(case)], dtype=None, progress=False)
    notes = report.results[0].diagnosis
    assert any("poison at excluded positions reached the output" in d for d in notes), notes


def _perturbed_rows(select):
    """The float64 textbook with the rows ``select(q, k, v, options)`` (a bool (..., H, L))
    off by a relative 2**-4: an error no modelled alternative (nor a narrower precision)
    explains."""

    def impl(q, k, v, **options):
        options.pop("return_lse", None)
        out = textbook_attention(q, k, v, dtype="float64", **options).out
        rows = select(q, k, v, options)
        return np.where(rows[..., None], out * (1 + 2.0**-4), out).astype(q.dtype)

    return impl


def _late_max(q, k, v, options):
    base = textbook_attention(q, k, v, dtype="float64", **options)
    return np.argmax(np.where(base.allowed, base.weights, -1.0), axis=-1) >= 64


def test_concentration_names_late_max_rows_and_the_partial_query_tile():
    """When nothing modelled fits, the diagnosis says where the failing rows concentrate."""
    fixture = golden.build(catalogue.get("k-tiles-H2K2-L200S300-D64E64-f32"))
    late = validate(
        _perturbed_rows(_late_max), fixtures=[fixture], dtype=None, progress=False
    ).results[0]
    assert late.verdict == "fail"
    assert any("max past the first tile of 64 keys" in d for d in late.diagnosis), late.explain()
    tail = validate(
        _perturbed_rows(lambda q, k, v, o: np.arange(q.shape[-2]) >= 192),
        fixtures=[fixture],
        dtype=None,
        progress=False,
    ).results[0]
    assert any("partial query tile of 64 (rows 192..199)" in d for d in tail.diagnosis), (
        tail.explain()
    )
    assert not any("max past the first tile" in d for d in tail.diagnosis), tail.explain()
