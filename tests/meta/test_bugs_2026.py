"""Each bug of tests/planted/bugs_2026.py fails at least five cases of its suite, and every
failing case is named by a diagnosis; the correct twin of the kernel bugs passes the same
cases (no false alarm)."""

from __future__ import annotations

import pytest

from oracle.run.validate import validate
from tests.helpers import assert_caught_and_named
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

SPARSE = [
    "sparse-sentinels-*",
    "sparse-duplicates-*",
    "sparse-past-end-*",
    "sparse-empty-rows-*",
    "sparse-causal-br-*",
]
MLA = ["mla-decode-H8K1-*", "mla-decode-kv-lengths-*", "grad-mla-*"]
QV = ["qv-H4K1-*", "qv-causal-gqa-*", "grad-qv-*"]
#: the bugs written on :func:`bugs_2026.correct_twin` (one line of it changed), the cheap ones
#: in the default tier
TWIN_BUGS = {
    "sparse_indices_off_by_one": ("default", SPARSE, ("float32",), "index off by one"),
    "sparse_lse_in_base2": ("default", SPARSE, ("float32",), "lse in log2 units"),
    "nvfp4_nibbles_swapped": (
        "default",
        ["fp4-nvfp4-tensor-*"],
        ("float32", "bfloat16"),
        "packed nibbles swapped",
    ),
    "mla_scale_of_key_width": (
        "default",
        MLA,
        ("float32", "float64"),
        "scale of the key width 1/sqrt(",
    ),
    "qv_dropped": ("default", QV, ("float32", "float64"), "qv term missing"),
}
SLOW = {"mla_scale_of_key_width", "qv_dropped"}


def _failures(impl, suite, cases, dtypes):
    results = []
    for dtype in dtypes:
        report = validate(
            impl, suite=suite, dtype=dtype, cases=cases, progress=False, isolate=False
        )
        results += report.results
    return results


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_fails_and_is_named(bug):
    suite, cases, dtypes, name = BUGS[bug]
    assert_caught_and_named(_failures(getattr(bugs, bug), suite, cases, dtypes), name)


def _marked(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


@pytest.mark.parametrize("bug", _marked(TWIN_BUGS))
def test_kernel_bug_fails_and_is_named(bug):
    suite, cases, dtypes, name = TWIN_BUGS[bug]
    assert_caught_and_named(_failures(getattr(bugs, bug), suite, cases, dtypes), name)


@pytest.mark.parametrize("bug", _marked(TWIN_BUGS))
def test_correct_twin_passes_the_same_cases(bug):
    suite, cases, dtypes, _ = TWIN_BUGS[bug]
    results = _failures(bugs.correct_twin, suite, cases, dtypes)
    assert results and all(r.verdict == "pass" for r in results), [
        (r.name, r.verdict, r.diagnosis) for r in results if r.verdict != "pass"
    ]
