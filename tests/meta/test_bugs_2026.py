"""Each bug of tests/planted/bugs_2026.py fails at least five cases of its suite, and every
failing case is named by a diagnosis."""

from __future__ import annotations

import pytest

from oracle.run.validate import validate
from tests.planted import bugs_2026 as bugs

BUGS = {
    "sentinel_clamped_to_zero": (
        "default",
        ["sparse-sentinels-*", "sparse-empty-rows-*", "sparse-causal-br-*"],
        ("float32", "float64"),
        "sentinel clamped to key 0 by a gather",
    ),
    "nvfp4_scales_per_32": (
        "default",
        ["fp4-nvfp4-*"],
        ("float32",),
        "block size misread",
    ),
    "merge_without_max": ("merge-default", None, ("float32", "float64"), "without the max"),
    "natural_merged_as_base2": ("merge-default", None, ("float64",), "merged as base 2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_fails_and_is_named(bug):
    suite, cases, dtypes, name = BUGS[bug]
    failures = []
    for dtype in dtypes:
        report = validate(
            getattr(bugs, bug),
            suite=suite,
            dtype=dtype,
            cases=cases,
            progress=False,
            isolate=False,
        )
        failures += [r for r in report.results if r.verdict == "fail"]
    assert len(failures) >= 5, [r.name for r in failures]
    unnamed = [r.name for r in failures if not any(name in d for d in r.diagnosis)]
    assert not unnamed, unnamed
