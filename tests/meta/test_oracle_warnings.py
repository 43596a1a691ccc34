"""refattn's and the oracle's own arithmetic (fixture generation, judging, the fp4, merge,
sparse and lse diagnoses) raises no warning on cases whose truths and wrong outputs hold
-inf, +inf, NaN, empty rows or overflowing merges: under ``warnings.simplefilter("error")`` a
warning from that arithmetic would become an exception, and the case an "error" instead of a
named "fail". The planted bugs' own overflow (``merge_without_max``) is theirs to silence."""

from __future__ import annotations

import warnings

import pytest

from oracle.run.validate import validate
from tests.planted import bugs_2026 as bugs

RUNS = {
    "sparse_lse_in_base2": (
        "default",
        ["sparse-empty-rows-*-f32", "poison-inf-*-f32", "mask-empty-*-f32", "sinks-empty-*-f32"],
    ),
    "sentinel_clamped_to_zero": ("default", ["sparse-empty-rows-*-f32", "sparse-past-end-*-f32"]),
    "nvfp4_nibbles_swapped": ("default", ["fp4-nvfp4-zero-max-blocks-*", "fp4-mxfp4-*-f32"]),
    "merge_without_max": ("merge-default", ["merge-large-*", "merge-allempty-*", "merge-empty-*"]),
}


@pytest.mark.parametrize("bug", list(RUNS))
def test_no_warning_from_the_oracles_arithmetic(bug):
    suite, cases = RUNS[bug]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = validate(
            getattr(bugs, bug), suite=suite, dtype=None, cases=cases, progress=False, isolate=False
        )
    assert report.results
    assert not [(r.name, r.message) for r in report.results if r.verdict == "error"]
    assert any(r.verdict == "fail" for r in report.results)
