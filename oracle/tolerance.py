"""The one tolerance policy of refattn (the only place tolerances are defined).

Everything here derives from a format's unit roundoff ``u = 2**-p`` and the case's
conditioning; nothing is a guessed literal.

* :func:`unit_roundoff` -- ``u`` of a dtype.
* :func:`gamma` -- Higham's ``gamma_n = n u / (1 - n u)``, the bound on the relative error of
  ``n`` successive roundings (Higham, *Accuracy and Stability of Numerical Algorithms*, Lemma 3.1).
* :func:`ulp` / :func:`ulp_distance` -- units in the last place of a format.
"""

from __future__ import annotations

import numpy as np

from refattn.exact.rounding import format_of

__all__ = ["unit_roundoff", "gamma", "ulp", "ulp_distance"]


def unit_roundoff(dtype) -> float:
    """``u = 2**-p`` for a float dtype (float64, float32, float16, bfloat16)."""
    return format_of(dtype).unit_roundoff


def gamma(n, dtype="float64") -> float:
    """Higham's gamma_n = n u / (1 - n u): bound on the relative error of n roundings."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma: n * u = {nu} >= 1, the bound is void (n={n}, dtype={dtype})")
    return nu / (1 - nu)


def ulp(x, dtype) -> np.ndarray:
    """Spacing of ``dtype`` at |x| (the subnormal spacing below the normal range)."""
    fmt = format_of(dtype)
    x = np.abs(np.asarray(x, dtype=np.float64))
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.where(x > 0, x, 1.0)))
    exponent = np.maximum(exponent, fmt.emin)
    return np.ldexp(1.0, (exponent - (fmt.p - 1)).astype(int))


def ulp_distance(value, truth, dtype) -> np.ndarray:
    """|value - truth| in units of the ``dtype`` ulp at the truth (inf where one is NaN)."""
    value = np.asarray(value, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        same = (value == truth) | (np.isnan(value) & np.isnan(truth))
        dist = np.abs(value - truth) / ulp(truth, dtype)
    return np.where(same, 0.0, np.where(np.isnan(dist), np.inf, dist))
