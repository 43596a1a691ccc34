"""refattn.logsumexp / softmax / log_softmax: shift invariance, exclusion and special values.

The exact path against the independent mpmath twin in four dtypes and the float64 path within
its bound are the logspace rows of tests/registry.py (run by tests/test_registry.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import refattn
from tests.helpers import assert_same_bits
from tests.strategies import logspace_rows


@given(case=logspace_rows(), shift=st.integers(-20, 20))
def test_softmax_shift_invariance(case, shift):
    x, where = case
    x = np.round(x * 2.0**10) / 2.0**10  # on a grid where adding integers is exact
    assert_same_bits(
        refattn.softmax(x + shift, where=where, precision="exact"),
        refattn.softmax(x, where=where, precision="exact"),
        what="softmax",
    )


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
