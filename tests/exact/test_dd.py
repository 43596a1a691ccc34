"""refattn.exact.fast.doubledouble (double-double arithmetic, exp/log/tanh with stated bounds)
and the double-double rounding decision of refattn.exact.rounding, against mpmath at 250 bits
and the exact rational rounding."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refattn.exact.fast import doubledouble as D
from refattn.exact.fast.rounding_decision import decide_dd_fast
from refattn.exact.rounding import FORMATS, decide_dd, round_dd, round_exact

NAMES = sorted(FORMATS)
LN2_64 = math.log(2) / 64


def _exact(h, lo):
    return Fraction(float(h)) + Fraction(float(lo))


def _points(seed, low, high, count):
    rng = np.random.default_rng(seed)
    edges = np.arange(-64 * 9, 64 * 9) * LN2_64  # range-reduction boundaries k ln2/64
    halves = edges + LN2_64 / 2  # |r| at its largest
    pts = np.concatenate(
        [
            rng.uniform(low, high, count),
            edges,
            halves,
            np.nextafter(edges, np.inf),
            np.nextafter(halves, -np.inf),
        ]
    )
    return pts[(pts >= low) & (pts <= high)], rng


def test_error_free_transforms_are_exact():
    rng = np.random.default_rng(1)
    for a, b in rng.standard_normal((200, 2)) * np.exp2(rng.integers(-60, 60, (200, 2))):
        s, e = D.two_sum(a, b)
        assert _exact(s, e) == Fraction(a) + Fraction(b)
        p, e = D.two_prod(a, b)
        assert _exact(p, e) == Fraction(a) * Fraction(b)


@pytest.mark.parametrize(
    ("name", "bound"),
    [
        ("dd_add", D.DD_ADD_REL),
        ("dd_add_d", D.DD_ADD_D_REL),
        ("dd_mul", D.DD_MUL_REL),
        ("dd_mul_d", D.DD_MUL_D_REL),
        ("dd_div", D.DD_DIV_REL),
        ("dd_div_d", D.DD_DIV_D_REL),
    ],
)
def test_dd_operations_within_their_bounds(name, bound):
    rng = np.random.default_rng(2)
    fn = getattr(D, name)
    exact_op = {"add": lambda x, y: x + y, "mul": lambda x, y: x * y, "div": lambda x, y: x / y}[
        name.split("_")[1]
    ]
    for _ in range(300):
        xh, yh = rng.standard_normal(2) * np.exp2(rng.integers(-30, 30, 2))
        xh, xl = D.two_sum(xh, xh * rng.uniform(-1, 1) * 2.0**-54)
        yh, yl = D.two_sum(yh, yh * rng.uniform(-1, 1) * 2.0**-54)
        x, y = _exact(xh, xl), _exact(yh, yl)
        if name.endswith("_d"):
            got, want = fn(xh, xl, yh), exact_op(x, Fraction(yh))
        else:
            got, want = fn(xh, xl, yh, yl), exact_op(x, y)
        assert abs(_exact(*got) - want) <= Fraction(bound) * abs(want)


def test_exp_dd_within_exp_rel():
    pts, rng = _points(3, D.EXP_MIN_ARG, D.EXP_MAX_ARG, 1500)
    with mpmath.workprec(250):
        for x in pts:
            xl = float(x) * rng.uniform(-1, 1) * 2.0**-54
            h, lo = D.exp_dd(x, xl)
            truth = mpmath.exp(mpmath.mpf(float(x)) + mpmath.mpf(xl))
            err = abs(mpmath.mpf(h) + mpmath.mpf(lo) - truth)
            assert err <= D.EXP_REL * truth, (x, xl)


def test_log_dd_within_its_returned_bound():
    rng = np.random.default_rng(4)
    zs = np.concatenate(
        [
            np.exp(rng.uniform(-600, 590, 800)),
            [1.0, 1 + 2.0**-52, 1 - 2.0**-53],
            np.exp2(rng.integers(-800, 800, 100)).astype(float),
        ]
    )
    with mpmath.workprec(250):
        for z in zs:
            zl = z * rng.uniform(-1, 1) * 2.0**-54
            h, lo, err = D.log_dd(z, zl)
            truth = mpmath.log(mpmath.mpf(z) + mpmath.mpf(zl))
            assert math.isfinite(err)
            assert abs(mpmath.mpf(h) + mpmath.mpf(lo) - truth) <= err, z


def test_log_dd_refuses_outside_its_domain():
    assert D.log_dd(2.0**-900, 0.0)[2] == math.inf


def test_tanh_dd_within_tanh_abs():
    pts, _ = _points(5, -40.0, 40.0, 800)
    pts = np.concatenate([pts, [0.0, 2.0**-40, -(2.0**-40), 350.0, -350.0, 1e-300]])
    with mpmath.workprec(250):
        for x in pts:
            h, lo = D.tanh_dd(x, 0.0)
            err = abs(mpmath.mpf(h) + mpmath.mpf(lo) - mpmath.tanh(mpmath.mpf(float(x))))
            assert err <= D.TANH_ABS, x


def test_dd_of_exact_encloses_invsqrt():
    for n in (2, 3, 5, 64, 96, 128, 1000):
        hi, lo, err = D.dd_of_exact(("invsqrt", n))
        x = _exact(hi, lo)
        # (x - err)^2 n <= 1 <= (x + err)^2 n
        assert (x - Fraction(err)) ** 2 * n <= 1 <= (x + Fraction(err)) ** 2 * n


# ------------------------------------------------------------------------------ rounding
@st.composite
def dd_values(draw, fmt_name):
    """Double-doubles near values of the format: grid points, midpoints, and random."""
    fmt = FORMATS[fmt_name]
    exp = draw(st.integers(fmt.emin - fmt.p - 3, fmt.emax))
    mant = draw(st.integers(1 << fmt.p, (1 << (fmt.p + 1)) - 1))  # p+1 bits: midpoints
    hi = math.ldexp(mant, exp - fmt.p)
    if draw(st.booleans()):
        hi = math.ldexp(draw(st.floats(1.0, 2.0)), exp)
    lo = draw(st.sampled_from([0.0, 1.0, -1.0, 0.5, -0.5])) * math.ulp(hi) * 0.5
    sign = draw(st.sampled_from([1.0, -1.0]))
    return sign * hi, sign * lo


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_round_dd_matches_round_exact(name, data):
    hi, lo = data.draw(dd_values(name))
    got = round_dd(np.array([hi]), np.array([lo]), name)[0]
    want = round_exact(_exact(hi, lo), FORMATS[name])
    assert got == want and np.signbit(got) == np.signbit(want), (name, hi, lo, got, want)


@pytest.mark.parametrize("name", NAMES)
def test_decide_dd_decides_only_when_both_ends_agree(name):
    rng = np.random.default_rng(6)
    fmt = FORMATS[name]
    mids = rng.standard_normal(400) * np.exp2(rng.integers(-20, 20, 400))
    rads = np.abs(mids) * np.exp2(rng.integers(-100, -fmt.p + 2, 400).astype(float))
    values, decided = decide_dd(mids, np.zeros_like(mids), rads, name)
    for mid, rad, value, ok in zip(mids, rads, values, decided, strict=True):
        low = round_exact(Fraction(mid) - Fraction(rad), fmt)
        high = round_exact(Fraction(mid) + Fraction(rad), fmt)
        if ok:
            assert low == high == value
    assert decided.any() and not decided.all()


@pytest.mark.parametrize("name", NAMES)
def test_compiled_decide_dd_is_decide_dd_bit_for_bit(name):
    """The forward's compiled rounding decision equals decide_dd on every element: ordinary
    enclosures, midpoints (lo = 0 and +-tiny), exact zeros, underflow to +-0, overflow,
    subnormal and non-finite ends."""
    rng = np.random.default_rng(11)
    fmt = FORMATS[name]
    n = 3000
    mids = rng.standard_normal(n) * np.exp2(rng.integers(-150, 150, n).astype(float))
    grid = np.ldexp(
        np.floor(np.ldexp(mids, fmt.p - np.frexp(mids)[1])) + 0.5, np.frexp(mids)[1] - fmt.p
    )  # midpoints of the format's grid
    special = np.array(
        [
            0.0,
            -0.0,
            1e-320,
            -1e-320,
            2.0**-1074,
            1e308,
            -1.7e308,
            np.inf,
            np.nan,
            float(fmt.max_finite),
            2.0**-126,
            2.0**-149,
            2.0**-24,
        ]
    )
    his = np.concatenate([mids, grid, special])
    los = np.concatenate(
        [
            np.zeros(n),
            rng.choice([0.0, 1.0, -1.0], n) * np.abs(grid) * 2.0**-80,
            np.zeros(special.size),
        ]
    )
    rads = np.abs(his) * np.exp2(rng.integers(-110, -fmt.p + 3, his.size).astype(float))
    rads[::7] = 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        want, want_ok = decide_dd(his, los, rads, name)
    got, ok = decide_dd_fast(his, los, rads, fmt)
    np.testing.assert_array_equal(ok, want_ok)
    assert want_ok.any() and not want_ok.all()
    assert np.array_equal(got, want)  # undecided elements too (0 or the low end's rounding)
    assert np.array_equal(np.signbit(got), np.signbit(want))


def test_exp_d_within_exp_d_rel():
    pts, _ = _points(7, D.EXP_MIN_ARG, D.EXP_MAX_ARG, 1500)
    with mpmath.workprec(200):
        for x in pts:
            truth = mpmath.exp(mpmath.mpf(float(x)))
            assert abs(mpmath.mpf(D.exp_d(x)) - truth) <= D.EXP_D_REL * truth, x


def test_dot_bound_covers_compensated_sums():
    rng = np.random.default_rng(8)
    for n in (1, 7, 64, 1000):
        a = rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))
        b = rng.standard_normal(n)
        s = c = 0.0
        for x, y in zip(a, b, strict=True):
            p, ep = D.two_prod(x, y)
            s, es = D.two_sum(s, p)
            c += ep + es
        exact = sum(Fraction(x) * Fraction(y) for x, y in zip(a, b, strict=True))
        scale = sum(abs(Fraction(x) * Fraction(y)) for x, y in zip(a, b, strict=True))
        assert abs(_exact(s, c) - exact) <= Fraction(D.dot_bound(n)) * scale
