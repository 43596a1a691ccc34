"""Every function of tests/registry.py: the exact path is the naive twin rounded once (bit for
bit) and the float64 path lies within its documented a-priori bound of the exact path."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from tests.helpers import assert_same_bits, assert_within
from tests.registry import REGISTRY

ENTRIES = [pytest.param(entry, id=name) for name, entry in REGISTRY.items()]


@pytest.mark.parametrize("entry", ENTRIES)
def test_exact_is_the_rounded_naive_twin(entry):
    @settings(max_examples=entry.examples[0])
    @given(case=entry.strategy())
    def check(case):
        assert_same_bits(entry.exact(case), entry.naive(case),
                         what=f"{entry.name} exact", case=entry.label(case))

    check()


@pytest.mark.parametrize("entry", ENTRIES)
def test_float64_within_its_bound(entry):
    @settings(max_examples=entry.examples[1])
    @given(case=(entry.bound_strategy or entry.strategy)())
    def check(case):
        assert_within(entry.fast(case), entry.exact(case), entry.bound(case),
                      what=f"{entry.name} float64", case=entry.label(case))

    check()
