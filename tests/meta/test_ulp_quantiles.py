"""The report's ulp quantiles (:func:`oracle.judging.results.ulp_summary`) are numpy's."""

from __future__ import annotations

import numpy as np
import pytest

from oracle.judging.results import _quantiles, json_float, ulp_summary

QS = (0.5, 0.99)


def _numpy(ulps):
    if not ulps.size:
        return [None, None]
    return [json_float(np.quantile(ulps, q, method="higher")) for q in QS]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("special", [None, np.inf, np.nan])
def test_quantiles_are_numpys(dtype, special):
    rng = np.random.default_rng(7)
    sizes = [*range(0, 130), 199, 200, 201, 1000, 4097]
    for n in sizes:
        ulps = (rng.exponential(size=n) * rng.choice([1, 1e3], size=n)).astype(dtype)
        ulps[rng.random(n) < 0.2] = 0.5  # ties, as correctly rounded elements make
        if special is not None and n:
            ulps[rng.integers(n)] = special
        kept = ulps.copy()
        assert _quantiles(ulps, QS) == _numpy(ulps.copy()), (n, dtype, special)
        np.testing.assert_array_equal(ulps, kept)  # the input is not reordered


def test_summary_of_no_elements():
    summary = ulp_summary(0, 0, np.zeros(0, dtype=np.float32))
    assert (summary["ulp_median"], summary["ulp_p99"], summary["ulp_max"]) == (None,) * 3
