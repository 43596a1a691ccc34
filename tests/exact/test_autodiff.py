"""Tests of refattn.exact.autodiff: reverse-mode derivatives in the exact number systems.

Truth: derivatives written out by hand, exact (rationals) or enclosed (intervals).
"""

from __future__ import annotations

from fractions import Fraction

import mpmath
import pytest
from mpmath import iv

from refattn.exact import intervals as I
from refattn.exact.autodiff import AutodiffOps, Var, primal, vjp
from refattn.exact.numbers import INTERVAL, RATIONAL, NotRational


def test_rational_quotient_rule_is_exact():
    ops = AutodiffOps(RATIONAL)
    x, y = ops.variable(Fraction(3)), ops.variable(Fraction(5, 2))
    f = x * y / (x + y) - 1 / x
    dx, dy = vjp([f], [Fraction(1)], [x, y])
    # d/dx = y^2/(x+y)^2 + 1/x^2, d/dy = x^2/(x+y)^2
    assert dx == Fraction(5, 2) ** 2 / Fraction(11, 2) ** 2 + Fraction(1, 9)
    assert dy == Fraction(9) / Fraction(11, 2) ** 2


def test_cotangents_weight_several_outputs_and_constants_give_zero():
    ops = AutodiffOps(RATIONAL)
    x = ops.variable(Fraction(2))
    outputs = [x * x, 3 * x, ops.scalar(7.0), 0]
    (dx,) = vjp(outputs, [Fraction(1), Fraction(-2), Fraction(5), Fraction(1)], [x])
    assert dx == 2 * 2 - 2 * 3
    assert vjp([ops.scalar(1.0)], [Fraction(1)], [x]) == [0]


def test_rational_softmax_of_a_tie_has_the_exact_jacobian():
    ops = AutodiffOps(RATIONAL)
    t = [ops.variable(Fraction(1, 3)) for _ in range(3)]
    weights = ops.softmax(t + [None])
    assert weights[3] == 0 and all(primal(w) == Fraction(1, 3) for w in weights[:3])
    grads = vjp(weights[:1], [Fraction(1)], t)
    assert grads == [Fraction(2, 9), Fraction(-1, 9), Fraction(-1, 9)]


def test_rational_system_refuses_transcendental_values():
    ops = AutodiffOps(RATIONAL)
    with pytest.raises(NotRational):
        ops.exp(ops.variable(Fraction(1)))


def test_interval_derivatives_enclose_the_truth():
    ops = AutodiffOps(INTERVAL)
    with I.workprec(80):
        x = ops.variable(iv.mpf(0.75))
        y = ops.variable(iv.mpf(-0.5))
        lse = ops.lse([x, y, None])
        f = ops.exp(x) * ops.log(x + 2) + lse
        dx, dy = vjp([f], [iv.mpf(1)], [x, y])
    with mpmath.workdps(40):
        x0, y0 = mpmath.mpf(0.75), mpmath.mpf(-0.5)
        soft_x = mpmath.exp(x0) / (mpmath.exp(x0) + mpmath.exp(y0))
        want_dx = mpmath.exp(x0) * mpmath.log(x0 + 2) + mpmath.exp(x0) / (x0 + 2) + soft_x
        want_dy = 1 - soft_x
    for got, want in ((dx, want_dx), (dy, want_dy)):
        assert got.a <= want <= got.b
        assert got.delta < mpmath.mpf(2) ** -60


def test_a_single_present_term_has_weight_exactly_one():
    ops = AutodiffOps(INTERVAL)
    with I.workprec(60):
        t = ops.variable(iv.mpf([0.1, 0.2]))  # a wide interval: t - t is not 0
        weights = ops.softmax([None, t])
        (dt,) = vjp([weights[1]], [iv.mpf(1)], [t])
    assert weights[0] == 0 and primal(weights[1]) == 1 and dt == 0


def test_deep_tapes_do_not_recurse():
    ops = AutodiffOps(RATIONAL)
    x = ops.variable(Fraction(1))
    y = x
    for _ in range(5000):
        y = y + x
    assert vjp([y], [Fraction(1)], [x]) == [5001]
    assert isinstance(y, Var)
