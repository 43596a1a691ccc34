"""Independent rounding of exact values to a dtype (candidate search; no refattn code).

Examples
--------
>>> from fractions import Fraction
>>> round_to_dtype(Fraction(1, 3), "float16")
0.333251953125
"""

from __future__ import annotations

import math

import mpmath
import numpy as np

__all__ = ["to_float_array", "round_to_dtype", "round_nested", "round_stable", "exact_plus_small"]


def to_float_array(nested) -> np.ndarray:
    """Nested lists of mpf -> float64 array (each element rounded by mpmath)."""
    return np.array(nested, dtype=object).astype(float)


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _neighbours(x, dtype):
    dtype = np.dtype(dtype)
    bits = np.array([x], dtype=dtype).view(_UINT[dtype.itemsize])[0]
    out = []
    limit = 1 << (8 * dtype.itemsize)
    for step in (-1, 0, 1):
        pattern = int(bits) + step
        if not 0 <= pattern < limit:
            continue
        candidate = np.array([pattern], dtype=_UINT[dtype.itemsize]).view(dtype)[0]
        if np.isfinite(candidate):
            out.append(candidate)
    # across zero the neighbour of +0 downward is the smallest negative subnormal
    out.append(-np.array([x], dtype=dtype)[0])
    return out


def round_to_dtype(value, dtype):
    """Nearest value of ``dtype`` to an exact Fraction/int/mpf (ties to even), as float64.

    Python's ``float(Fraction)`` is correctly rounded to float64; for narrower dtypes the
    candidates around a first guess are compared exactly.
    """
    from fractions import Fraction

    if isinstance(value, mpmath.mpf):
        if mpmath.isnan(value):
            return math.nan
        if mpmath.isinf(value):
            return math.inf if value > 0 else -math.inf
        sign, man, exp, bc = value._mpf_  # (mpf.man_exp drops the sign)
        if man and exp + bc < -1100:  # |value| < 2**-1100: below half of every subnormal
            return -0.0 if sign else 0.0
        if man and exp + bc > 1100:  # |value| >= 2**1099: beyond every format's range
            return -math.inf if sign else math.inf
        value = (-1) ** sign * Fraction(int(man)) * Fraction(2) ** int(exp) if man else Fraction(0)
    value = Fraction(value)
    dtype = np.dtype(dtype)
    if value == 0:
        return 0.0
    if value.denominator > 1 << 1100 and abs(value) * (1 << 1100) < 1:  # (as above)
        return -0.0 if value < 0 else 0.0
    try:
        guess = float(value)
    except OverflowError:
        guess = math.inf if value > 0 else -math.inf
    if dtype == np.float64:
        return guess
    with np.errstate(over="ignore"):
        first = np.array([guess]).astype(dtype)[0]
    if not np.isfinite(first):
        first = np.array([math.copysign(float(_max_finite(dtype)), guess)]).astype(dtype)[0]
    best = None
    for cand in _neighbours(first, dtype):
        dist = abs(Fraction(float(cand)) - value)
        even = int(np.array([cand], dtype=dtype).view(_UINT[dtype.itemsize])[0]) % 2 == 0
        key = (dist, not even)
        if best is None or key < best[0]:
            best = (key, float(cand))
    top = _max_finite(dtype)
    half_ulp = (
        top - Fraction(float(_neighbours(np.array([float(top)]).astype(dtype)[0], dtype)[0]))
    ) / 2
    if abs(value) >= top + half_ulp:
        return math.inf if value > 0 else -math.inf
    return best[1]


def _max_finite(dtype):
    from fractions import Fraction

    import ml_dtypes

    info = (
        ml_dtypes.finfo(dtype)
        if np.dtype(dtype).kind == "V" or np.dtype(dtype).name == "bfloat16"
        else np.finfo(dtype)
    )
    return Fraction(float(info.max))


TINY = mpmath.mpf(2) ** -4000
HEAD_PREC = 8000  # bits of a head that is not exactly representable (error < 2**-6900)


def exact_plus_small(head, tail):
    """``head + tail`` as an mpf, for a ``head`` exact or computed at :data:`HEAD_PREC` bits
    and a small correction ``tail`` (possibly as tiny as ``exp(-1e9)``), added exactly.

    A ``tail`` below ``2**-4000`` in magnitude is replaced by ``+-2**-4000``: this cannot
    change the rounding of the sum, because ``head`` (a mean of float64 values over fewer
    than 2**100 keys times 1/(1 - p), or an exact score) is either a rounding boundary or at
    least ``2**-3000`` away from each (boundaries are multiples of ``2**-1075``), so only the
    sign of so small a tail matters (and ``head``'s own error, < 2**-6900, is far below).
    """
    if not (mpmath.isfinite(head) and mpmath.isfinite(tail)):
        return head + tail
    if tail != 0 and abs(tail) < TINY:
        tail = TINY if tail > 0 else -TINY
    return mpmath.fadd(head, tail, exact=True)


def round_nested(nested, dtype="float64") -> np.ndarray:
    """Round nested lists of exact values (mpf, Fraction, int) to ``dtype`` elementwise, as
    float64."""
    arr = np.array(nested, dtype=object)
    flat = [round_to_dtype(x, dtype) for x in arr.ravel()]
    return np.array(flat, dtype=np.float64).reshape(arr.shape)


SPREAD_CAP = 800.0  # beyond it the twins keep tiny terms apart (exact_plus_small)


def round_stable(compute, dtype, spread=0.0):
    """Round ``compute(dps)`` (nested mpf) to ``dtype`` with enough digits for the data.

    ``spread`` bounds the range of the exponents involved (e.g. max - min score): a term
    ``e**-spread`` can still move a result that lies near a rounding midpoint, so the
    reference works with ``60 + spread / ln(10)`` digits (spread capped at ``SPREAD_CAP``: the
    twins carry results near a boundary as exact part + small tail, :func:`exact_plus_small`),
    and confirms the bits at twice that.
    """
    digits = 60 + int(math.ceil(min(float(spread), SPREAD_CAP) / math.log(10)))
    first = round_nested(compute(digits), dtype)
    second = round_nested(compute(2 * digits), dtype)
    same = np.array_equal(first, second, equal_nan=True) and np.array_equal(
        np.signbit(first), np.signbit(second)
    )
    assert same, f"reference rounding differs between {digits} and {2 * digits} digits"
    return first
