"""A precision loss is not named as a convention that hardly changes the case's output: on
``k-small-logits-*`` (logits ~0.06, a near-uniform softmax) ``scale**2`` or a missing late
rescale moves the output less than a bfloat16 sum does, so a kernel summing in bfloat16 must
not be diagnosed "scale squared" (or any other reading): a reading is named only when it fits
materially better than the pinned convention (oracle.diagnose.diagnosis.FIT_MARGIN). The real
scale-squared bug stays named (tests/meta/test_diagnoses_issue25.py)."""

from __future__ import annotations

import pytest

from oracle.run.validate import validate
from tests.planted import diagnosis_impls as planted

CASES = ["k-small-logits-H2K2-L65S129-*-f32", "k-small-logits-H2K2-L65S129-*-f64"]


@pytest.mark.parametrize("kernel", ["bf16_score_sums", "bf16_accumulation"])
def test_bf16_sums_are_not_named_as_a_reading(kernel):
    report = validate(
        getattr(planted, kernel),
        suite="kernel",
        dtype=None,
        cases=CASES,
        progress=False,
        isolate=False,
        diagnose_budget=float("inf"),  # every reading tried, whatever the machine's load
    )
    assert [r.verdict for r in report.results] == ["fail", "fail"], report.results
    for result in report.results:
        assert not any("matches" in d for d in result.diagnosis), result.explain()


def test_the_squared_scale_bug_is_still_named_on_the_same_case():
    report = validate(
        planted.squared_scale,
        suite="kernel",
        dtype=None,
        cases=CASES,
        progress=False,
        isolate=False,
    )
    for result in report.results:
        assert result.verdict == "fail", result.explain()
        assert any("scale squared" in d for d in result.diagnosis), result.explain()
