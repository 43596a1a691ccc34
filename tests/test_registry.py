"""Every function of tests/registry.py: the exact path is the naive twin rounded once (bit for
bit, in the requested dtype) and the float64 path lies within its documented a-priori bound of
the exact path."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from tests.helpers import assert_same_bits, assert_within
from tests.registry import REGISTRY


def _settings(examples):
    return settings() if examples is None else settings(max_examples=examples)


@pytest.mark.parametrize("entry", [pytest.param(e, id=n) for n, e in REGISTRY.items()])
def test_exact_is_the_rounded_naive_twin(entry):
    @_settings(entry.examples[0])
    @given(case=entry.strategy())
    def check(case):
        exact, naive = entry.exact(case), entry.naive(case)
        if entry.out_dtype is not None:
            assert exact["out"].dtype == entry.out_dtype(case), entry.label(case)
        for name, truth in naive.items():
            assert_same_bits(
                exact[name], truth, what=f"{entry.name} exact {name}", case=entry.label(case)
            )

    check()


@pytest.mark.parametrize(
    "entry", [pytest.param(e, id=n) for n, e in REGISTRY.items() if e.bound is not None]
)
def test_float64_within_its_bound(entry):
    @_settings(entry.examples[1])
    @given(case=(entry.bound_strategy or entry.strategy)())
    def check(case):
        fast, exact = entry.fast(case), entry.exact(case)
        for name, bound in entry.bound(case).items():
            assert_within(
                fast[name],
                exact[name],
                bound,
                what=f"{entry.name} float64 {name}",
                case=entry.label(case),
            )

    check()
