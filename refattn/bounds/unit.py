"""Unit roundoff and Higham's gamma_n per floating dtype: the one definition in refattn.

``u = 2**-p`` for a format of p significand bits (float64 53, float32 24, float16 11,
bfloat16 8) and Higham's (*Accuracy and Stability of Numerical Algorithms*, 2nd ed., Lemma 3.1)

.. math:: \\gamma_n = \\frac{n u}{1 - n u}, \\qquad n u < 1,

the bound on the relative error of n successive roundings.
"""

from __future__ import annotations

from ..exact.rounding import format_of

__all__ = ["UNIT_ROUNDOFF", "ETA", "unit_roundoff", "gamma"]

#: Unit roundoff of float64.
UNIT_ROUNDOFF = 2.0**-53
#: The smallest subnormal float64: the absolute error floor of an underflowing result.
ETA = 2.0**-1074


def unit_roundoff(dtype="float64") -> float:
    """``u = 2**-p`` for a float dtype (float64, float32, float16, bfloat16).

    >>> unit_roundoff("float64") == 2.0**-53, unit_roundoff("bfloat16")
    (True, 0.00390625)
    """
    return format_of(dtype).unit_roundoff


def gamma(n, dtype="float64") -> float:
    """Higham's gamma_n = n u / (1 - n u): bound on the relative error of n roundings.

    >>> gamma(1) == 2.0**-53 / (1 - 2.0**-53)
    True
    """
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma: n * u = {nu} >= 1, the bound is void (n={n}, dtype={dtype})")
    return nu / (1 - nu)
