"""Every case of every oracle suite: the fast exact engine and the referee give the same bits.

``refattn.config.EXACT_ENGINE`` (forward) and ``EXACT_VJP_ENGINE`` (vjp) select "fast" (the
compiled first step, undecided rows / elements re-evaluated by the referee) or "referee" (the
arbitrary-precision engine alone). Each case's fixture truth (oracle.fixtures.golden.build: out,
lse and,
for gradient cases, dq, dk, dv, dbias in the case dtype and float64) is built under both and
compared bit for bit, NaN and the sign of zero included.

Tiers: the 36 smallest attention cases (smoke and the like, ~6 s each on a loaded 2-core
machine) are ``slow``; the other attention cases and the variants' cases (whose exact paths do
not go through these engines) are ``xslow`` (REFATTN_XSLOW=1).
"""

from __future__ import annotations

import contextlib

import pytest

from oracle import catalogue
from oracle.fixtures import golden
from refattn import config
from tests.helpers import assert_same_bits

SWITCHES = ("EXACT_ENGINE", "EXACT_VJP_ENGINE")
COST_LIMIT = 2**13  # batch * H * L * S * (D + E) (x4 with gradients): 36 cases, ~6 s each


def _cost(case) -> int:
    n = case.shapes
    return n.batch * n.H * n.L * n.S * (n.D + n.E) * (4 if case.grads else 1)


def _all_cases():
    cases = {}
    for name in catalogue.suite_names():
        for case in catalogue.suite(name):
            cases.setdefault(case.name, case)
    return [
        pytest.param(
            case,
            id=case.name,
            marks=pytest.mark.xslow
            if case.function != "attention" or _cost(case) > COST_LIMIT
            else pytest.mark.slow,
        )
        for case in cases.values()
    ]


@contextlib.contextmanager
def engines(name: str):
    saved = {attr: getattr(config, attr) for attr in SWITCHES if hasattr(config, attr)}
    for attr in saved:
        setattr(config, attr, name)
    try:
        yield
    finally:
        for attr, value in saved.items():
            setattr(config, attr, value)


@pytest.mark.parametrize("case", _all_cases())
def test_fast_engine_is_the_referee_bit_for_bit(case):
    with engines("referee"):
        referee = golden.build(case).truth
    with engines("fast"):
        fast = golden.build(case).truth
    assert sorted(fast) == sorted(referee), case.name
    for name, truth in referee.items():
        assert_same_bits(
            fast[name], truth, what=f"fast engine {name}", case=case.name, check_dtype=True
        )
