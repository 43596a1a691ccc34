"""The merge_states case family: refattn and a correct implementation written from the
description pass every merge-default case (stacked and pairwise conventions); each planted
merge bug fails at least 5 cases and is named by the diagnosis."""

from __future__ import annotations

import pytest

import refattn
from oracle.conventions.merge import adapt
from oracle.run.validate import validate
from tests.planted.merge_impls import BROKEN_MERGES, merge_ok, merge_pair_ok

MIN_FAILURES = 5


def _run(impl, dtype="float32", cases=None):
    return validate(
        impl, suite="merge-default", dtype=dtype, progress=False, cases=cases, isolate=False
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "impl",
    [refattn.merge_states, merge_ok, adapt(merge_pair_ok, "pair")],
    ids=["refattn", "from-the-description", "pairwise"],
)
def test_correct_implementations_pass_every_case(impl):
    report = _run(impl)
    assert report.passed, [(r.name, r.message) for r in report.results if r.verdict != "pass"]


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(BROKEN_MERGES))
def test_each_planted_bug_fails_and_is_named(bug):
    failing = []
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        failing += [r for r in _run(BROKEN_MERGES[bug], dtype).results if r.verdict != "pass"]
    assert len(failing) >= MIN_FAILURES, f"{bug}: only {len(failing)} failing cases"
    named = [r for r in failing if any(note.startswith(bug) for note in r.diagnosis)]
    assert named, f"{bug}: no failing case names it: {[r.diagnosis for r in failing]}"


def _smoke(impl):
    return validate(impl, suite="merge-smoke", dtype="float32", progress=False, isolate=False)


def test_smoke_correct_pairwise_passes_and_each_bug_is_named():
    """Default tier: the smoke cases (float32); the slow tests above run merge-default in
    every dtype (>= 5 failures per bug)."""
    report = _smoke(adapt(merge_pair_ok, "pair"))
    assert report.passed, [(r.name, r.message) for r in report.results if r.verdict != "pass"]
    for bug, impl in BROKEN_MERGES.items():
        failing = [r for r in _smoke(impl).results if r.verdict != "pass"]
        assert any(n.startswith(bug) for r in failing for n in r.diagnosis), bug


@pytest.mark.peers("torch")
@pytest.mark.parametrize("convention", ["stacked", "pair"])
def test_torch_merge_from_the_description_passes(convention):
    from tests.naive import merge_torch

    impl = merge_torch.merge_states if convention == "stacked" else merge_torch.merge_state
    report = validate(
        adapt(impl, convention, "torch"),
        suite="merge-smoke",
        dtype="float32",
        progress=False,
        isolate=False,
    )
    assert report.passed, [(r.name, r.message) for r in report.results if r.verdict != "pass"]
