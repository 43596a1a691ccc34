"""Detection of the sparse key-selection bugs: each planted implementation of
tests/planted/sparse_impls.py fails >= 5 default cases and is named; the correct one and
refattn's float64 path fail none."""

from __future__ import annotations

import fnmatch

import pytest

from oracle import catalogue
from oracle.fixtures import golden
from oracle.run.validate import validate
from tests.planted.sparse_impls import SPARSE_BROKEN, sparse_textbook

_BUILT: dict = {}


def _fixtures(patterns):
    chosen = [
        case
        for case in catalogue.suite("default")
        if any(fnmatch.fnmatchcase(case.name, p) for p in patterns)
    ]
    for case in chosen:
        if case.name not in _BUILT:
            _BUILT[case.name] = golden.build(case)
    return [_BUILT[case.name] for case in chosen]


@pytest.mark.slow  # builds ~30 exact fixtures (minutes on 2 cores)
@pytest.mark.parametrize("name", sorted(SPARSE_BROKEN))
def test_sparse_bug_is_caught_and_named(name):
    broken = SPARSE_BROKEN[name]
    fixtures = _fixtures(broken.cases)
    assert len(fixtures) >= 5, f"{name}: only {len(fixtures)} cases match {broken.cases}"
    report = validate(broken.impl, fixtures=fixtures, dtype=None, progress=False)
    for result in report.results:
        assert result.verdict == "fail", f"{name}: {result.explain()}"
        assert any(broken.diagnosis in d for d in result.diagnosis), (
            f"{name}: expected diagnosis {broken.diagnosis!r}\n{result.explain()}"
        )


#: the small sparse cases of every dtype (the long ones: the slow test below)
SMALL = ("sparse-sentinels-*", "sparse-empty-rows-*", "sparse-blocks64-causal-*-f32")


@pytest.mark.slow
@pytest.mark.parametrize("impl", [sparse_textbook, "refattn-float64"], ids=["textbook", "f64"])
def test_no_false_alarm_on_small_sparse_cases(impl):
    report = validate(impl, fixtures=_fixtures(SMALL), dtype=None, strict=True, progress=False)
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert report.passed and not failed, "\n".join(failed)


@pytest.mark.slow
@pytest.mark.parametrize("impl", [sparse_textbook, "refattn-float64"], ids=["textbook", "f64"])
def test_no_false_alarm_on_every_sparse_case(impl):
    fixtures = _fixtures(("sparse-*", "grad-sparse-*", "fp8-*-sparse-*"))
    report = validate(impl, fixtures=fixtures, dtype=None, strict=True, progress=False)
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert report.passed and not failed, "\n".join(failed)


def test_implementation_without_key_indices_is_unsupported():
    """An implementation that does not take ``key_indices=`` reports the case "unsupported"
    (never a pass, never a failure)."""

    def dense_only(q, k, v, *, scale=None, return_lse=False):
        return sparse_textbook(q, k, v, scale=scale, return_lse=return_lse)

    report = validate(dense_only, fixtures=_fixtures(["sparse-topk1-*-f32"]), dtype=None)
    assert [r.verdict for r in report.results] == ["unsupported"], report.summary()
