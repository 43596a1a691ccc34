"""refattn.exact.rounding and refattn.exact.intervals: correct rounding (against an
independent candidate search), the Ziv loop's decisions, ties, zeros, and enclosures."""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refattn.exact import intervals as I
from refattn.exact.rounding import (
    FORMATS,
    UndecidedRoundingError,
    correctly_round,
    round_exact,
)
from tests.naive.rounding import round_to_dtype

NAMES = sorted(FORMATS)


@st.composite
def exact_values(draw, fmt_name):
    fmt = FORMATS[fmt_name]
    num = draw(st.integers(-(2**80), 2**80))
    den = draw(st.integers(1, 2**60))
    shift = draw(st.integers(fmt.emin - fmt.p - 20, fmt.emax + 4))
    return Fraction(num, den) * Fraction(2) ** shift


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_round_exact_matches_candidate_search(name, data):
    value = data.draw(exact_values(name))
    fmt = FORMATS[name]
    got, want = round_exact(value, fmt), round_to_dtype(value, fmt.dtype)
    assert got == want and np.signbit(got) == np.signbit(want), (name, value, got, want)


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_midpoints_round_to_even(name, data):
    fmt = FORMATS[name]
    bits = data.draw(st.integers(0, (1 << (8 * fmt.dtype.itemsize)) - 2))
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[fmt.dtype.itemsize]
    pair = np.array([bits, bits + 1], dtype=uint).view(fmt.dtype).astype(np.float64)
    if not np.isfinite(pair).all() or np.signbit(pair[0]) != np.signbit(pair[1]):
        return
    midpoint = (Fraction(pair[0]) + Fraction(pair[1])) / 2
    even = pair[0] if bits % 2 == 0 else pair[1]
    assert round_exact(midpoint, fmt) == even


@pytest.mark.parametrize("name", NAMES)
def test_overflow_threshold(name):
    fmt = FORMATS[name]
    top = fmt.max_finite
    half_ulp = Fraction(2) ** (fmt.emax - fmt.p)
    assert round_exact(top + half_ulp - Fraction(1, 2**2000), fmt) == float(top)
    assert round_exact(top + half_ulp, fmt) == np.inf  # the tie goes to the even "infinity"
    assert round_exact(-(top + half_ulp), fmt) == -np.inf


@pytest.mark.parametrize("name", NAMES)
def test_subnormal_boundary(name):
    fmt = FORMATS[name]
    smallest = Fraction(2) ** (fmt.emin - fmt.p + 1)
    assert round_exact(smallest / 2, fmt) == 0.0  # tie with zero: even is zero
    assert round_exact(smallest / 2 + Fraction(1, 2**3000), fmt) == float(smallest)
    assert np.signbit(round_exact(-smallest / 4, fmt))  # negative underflow keeps its sign


def _shrinking(value: Fraction):
    """Evaluator enclosing ``value`` by intervals of width 2**-prec around it."""

    def evaluate(prec):
        width = Fraction(1, 2**prec)
        return np.array([value - width], dtype=object), np.array([value + width], dtype=object)

    return evaluate


def test_ziv_decides_irrational_like_values():
    third = Fraction(1, 3)
    assert correctly_round(_shrinking(third), "float64")[0] == 1 / 3


def test_ziv_reports_undecidable_midpoints():
    midpoint = Fraction(1) + Fraction(1, 2**53)
    with pytest.raises(UndecidedRoundingError, match=r"value\[0\].*undecided"):
        correctly_round(_shrinking(midpoint), "float64", max_prec=256, what="value")


def test_ziv_fallback_settles_midpoints():
    midpoint = Fraction(1) + Fraction(1, 2**53)
    got = correctly_round(
        _shrinking(midpoint), "float64", max_prec=256, fallback=lambda index: midpoint
    )
    assert got[0] == 1.0


def test_ziv_exact_cancellation_is_positive_zero():
    # at 256 bits both ends of the enclosure of 0 round to zeros of opposite sign
    got = correctly_round(_shrinking(Fraction(0)), "float32", max_prec=256)
    assert got[0] == 0 and not np.signbit(got[0])


def test_ziv_passes_nan_and_inf_through():
    def evaluate(prec):
        values = np.array([np.nan, np.inf, -np.inf], dtype=object)
        return values, values

    got = correctly_round(evaluate, "bfloat16")
    assert np.isnan(float(got[0])) and got[1] == np.inf and got[2] == -np.inf


@given(x=st.floats(-30, 30, allow_nan=False), prec=st.sampled_from([60, 120, 300]))
def test_interval_functions_enclose(x, prec):
    with I.workprec(prec):
        point = I.point(x)
        results = {
            "exp": I.exp(point),
            "tanh": I.tanh(point),
            "erf": I.erf(point),
            "expm1": I.expm1(point),
            "log1p": I.log1p(I.point(abs(x))),
            "sqrt": I.sqrt(I.point(abs(x))),
        }
    with mpmath.workprec(prec + 200):
        exact = {
            "exp": mpmath.exp(x),
            "tanh": mpmath.tanh(x),
            "erf": mpmath.erf(x),
            "expm1": mpmath.expm1(x),
            "log1p": mpmath.log1p(abs(x)),
            "sqrt": mpmath.sqrt(abs(x)),
        }
        for name, enclosure in results.items():
            lo, hi = (mpmath.mpf(end) for end in enclosure._mpi_)
            assert lo <= exact[name] <= hi, (name, x, prec)


def test_workprec_restores_precision():
    before = mpmath.iv.prec
    with pytest.raises(RuntimeError), I.workprec(500):
        assert mpmath.iv.prec == 500
        raise RuntimeError
    assert mpmath.iv.prec == before
