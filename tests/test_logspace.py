"""refattn.logsumexp / softmax / log_softmax: exact path against an independent mpmath
evaluation in four dtypes, the float64 path within its bound, exclusion and special values."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bits, assert_within
from hypothesis import given
from hypothesis import strategies as st
from naive.logspace import naive_logspace
from naive.rounding import round_stable

import refattn
from refattn.bounds import UNIT_ROUNDOFF, gamma

DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16,
          "bfloat16": ml_dtypes.bfloat16}


@st.composite
def rows(draw, max_len=7):
    n = draw(st.integers(1, max_len))
    seed = draw(st.integers(0, 2**32 - 1))
    spread = draw(st.sampled_from([0.0, 1.0, 30.0, 700.0]))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, n)) * spread
    where = rng.random((3, n)) < draw(st.sampled_from([1.0, 0.6]))
    return x, where


def _reference(x, where, dtype):
    finite = np.where(where & np.isfinite(x), x.astype(np.float64), 0.0)
    spread = finite.max() - finite.min()
    return tuple(round_stable(lambda dps, n=n: naive_logspace(x, where, dps)[n], dtype,
                              spread) for n in range(3))


@pytest.mark.parametrize("name", sorted(DTYPES))
@given(case=rows())
def test_exact_path_is_correctly_rounded(name, case):
    x, where = case
    dtype = DTYPES[name]
    x = x.astype(dtype)
    if not where.any(axis=1).all():
        where[:, 0] = True
    lse, soft, logsoft = _reference(x, where, dtype)
    assert_same_bits(refattn.logsumexp(x, where=where, precision="exact", out_dtype=dtype), lse,
                     what="lse", case=name)
    assert_same_bits(refattn.softmax(x, where=where, precision="exact", out_dtype=dtype), soft,
                     what="softmax", case=name)
    assert_same_bits(refattn.log_softmax(x, where=where, precision="exact", out_dtype=dtype),
                     logsoft, what="log_softmax", case=name)


@given(case=rows(max_len=40))
def test_float64_path_within_bound(case):
    """Blanchard, Higham & Higham 2021: |error| <= gamma_{n+3} + u |lse| for the log1p form;
    softmax entries exp(x - lse) then have relative error <= gamma_{n+5} + u (|lse| + |x - lse|)
    (lse's absolute error, the subtraction, the exponential)."""
    x, where = case
    n = x.shape[1]
    exact = refattn.logsumexp(x, where=where, precision="exact")
    got = refattn.logsumexp(x, where=where)
    finite = np.where(np.isfinite(exact), exact, 0.0)
    assert_within(got, exact, gamma(n + 3) + UNIT_ROUNDOFF * np.abs(finite), what="lse")
    p_exact = refattn.softmax(x, where=where, precision="exact")
    bound = p_exact * (gamma(n + 5) + UNIT_ROUNDOFF * (
        np.abs(finite)[:, None] + np.abs(np.where(where, x, 0) - finite[:, None])))
    assert_within(refattn.softmax(x, where=where), p_exact, bound, what="softmax")


@given(case=rows(), shift=st.integers(-20, 20))
def test_softmax_shift_invariance(case, shift):
    x, where = case
    x = np.round(x * 2.0**10) / 2.0**10  # on a grid where adding integers is exact
    assert_same_bits(refattn.softmax(x + shift, where=where, precision="exact"),
                     refattn.softmax(x, where=where, precision="exact"), what="softmax")


@pytest.mark.parametrize("precision", ["float64", "exact"])
def test_special_values(precision):
    x = np.array([[1.0, 2.0], [np.nan, 0.0], [np.inf, 0.0], [-np.inf, -np.inf], [5.0, np.nan]])
    where = np.array([[False, False], [True, True], [True, True], [True, True], [True, False]])
    lse = refattn.logsumexp(x, where=where, precision=precision)
    assert lse[0] == -np.inf and np.isnan(lse[1]) and lse[2] == np.inf and lse[3] == -np.inf
    assert lse[4] == 5.0  # the NaN is excluded
    p = refattn.softmax(x, where=where, precision=precision)
    assert (p[0] == 0).all() and (p[3] == 0).all() and p[4].tolist() == [1.0, 0.0]
    assert np.isnan(p[1]).all()
    lp = refattn.log_softmax(x, where=where, precision=precision)
    assert (lp[0] == -np.inf).all() and lp[4].tolist() == [0.0, -np.inf]


def test_axis_and_broadcast_where():
    x = np.arange(12.0).reshape(3, 4)
    where = np.array([True, False, True])[:, None]
    got = refattn.logsumexp(x, axis=0, where=where)
    want = refattn.logsumexp(x[[0, 2]].T)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="axis: 2 is out of range"):
        refattn.logsumexp(x, axis=2)
    with pytest.raises(TypeError, match="x: expected a float array"):
        refattn.logsumexp(np.arange(3))
