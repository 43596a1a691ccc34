"""The oracle on fp4 cases: every planted misreading of NVFP4/MXFP4 block scales fails >= 5
default cases and is named; the correct reading and refattn's adapters pass."""

from __future__ import annotations

import fnmatch

import pytest

from oracle import catalogue
from oracle.fixtures import golden
from oracle.run.validate import validate
from tests.planted.fp4_impls import FP4_BROKEN, fp4_correct

_BUILT: dict = {}


def _fixtures(pattern):
    cases = [
        c
        for c in catalogue.suite("default")
        if c.recipe.get("fp4") and fnmatch.fnmatchcase(c.name, pattern)
    ]
    for case in cases:
        if case.name not in _BUILT:
            _BUILT[case.name] = golden.build(case)
    return [_BUILT[c.name] for c in cases]


def _run(impl, fixtures):
    report = validate(impl, fixtures=fixtures, dtype=None, progress=False, isolate=False)
    return [r for r in report.results if r.verdict != "pass"]


@pytest.mark.parametrize("name", sorted(FP4_BROKEN))
def test_planted_fp4_bug_is_caught_and_named(name):
    impl, label = FP4_BROKEN[name]
    failed = _run(impl, _fixtures("*-f32"))
    assert len(failed) >= 5, f"{name}: only {len(failed)} failing fp4 cases"
    unnamed = [r.case for r in failed if not any(label in d for d in r.diagnosis)]
    assert not unnamed, f"{name}: not diagnosed as {label!r} on {unnamed}"


@pytest.mark.parametrize("impl", [fp4_correct, "refattn-float64"], ids=["planted", "refattn"])
def test_correct_fp4_reading_passes(impl):
    assert _run(impl, _fixtures("*-f32")) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FP4_BROKEN))
def test_planted_fp4_bug_is_caught_in_every_dtype(name):
    impl, label = FP4_BROKEN[name]
    failed = _run(impl, _fixtures("*"))
    assert len(failed) >= 5
    assert all(any(label in d for d in r.diagnosis) for r in failed)
    assert _run(fp4_correct, _fixtures("*")) == []


@pytest.mark.peers("torch")
def test_torch_fp4_implementation_passes_every_fp4_case():
    """tests/naive/fp4_torch.py, written from the description, through framework="torch"
    (fp4 as uint8 codes, e8m0/e4m3 scales as torch float8), gradients included."""
    report = validate(
        "tests.naive.fp4_torch:attention",
        fixtures=_fixtures("*-f32"),
        dtype=None,
        grads=True,
        framework="torch",
        progress=False,
        isolate=False,
    )
    assert [r.case for r in report.results if r.verdict != "pass"] == []


def test_fp4_paged_convention():
    """The packed, paged fp4 cache (oracle/conventions/layouts_fp4.py): read low nibble first it
    passes
    every fp4 case; read high nibble first it fails them, diagnosed as swapped nibbles."""
    from tests.planted.fp4_impls import fp4_paged, fp4_paged_high_first

    fixtures = _fixtures("fp4-*-f32")

    def failures(impl):
        report = validate(
            impl, fixtures=fixtures, dtype=None, layout="fp4-paged", progress=False, isolate=False
        )
        return [r for r in report.results if r.verdict != "pass"]

    assert failures(fp4_paged) == []
    wrong = failures(fp4_paged_high_first)
    assert len(wrong) >= 5
    assert all(any("packed nibbles swapped" in d for d in r.diagnosis) for r in wrong)
