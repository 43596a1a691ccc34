"""The whole-array structural intervals (refattn.spec's NumPy form of the rule) agree row by
row with :func:`refattn.spec.key_interval` and its Numba compilation."""

import itertools

import numpy as np
import pytest

from refattn.spec import WINDOW_CAP, key_interval, key_interval_jit, key_intervals, structural_mask

_SIDES = (None, 0, 1, 3, WINDOW_CAP)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("keys", [0, 1, 3, 8])
def test_key_intervals_follow_the_rule(causal, keys):
    for offset, left, right in itertools.product((-5, -1, 0, 2, 7, 2**40), _SIDES, _SIDES):
        lo, hi = key_intervals(9, offset, keys, causal=causal, window=(left, right))
        sides = tuple(-1 if s is None else s for s in (left, right))
        for i in range(9):
            expected = key_interval(i, offset, keys, causal, *sides)
            assert (int(lo[i]), int(hi[i])) == expected
            assert key_interval_jit(i, offset, keys, causal, *sides) == expected


def test_structural_mask_rows_are_their_intervals():
    mask = structural_mask(np.arange(6), np.arange(5), causal=True, window=(2, 1), offset=-1)
    lo, hi = key_intervals(6, -1, WINDOW_CAP, causal=True, window=(2, 1))
    columns = np.arange(5)[None, :]
    assert np.array_equal(mask, (columns >= lo[:, None]) & (columns < hi[:, None]))
