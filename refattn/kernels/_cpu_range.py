"""max |x| over the finite values of an array, read as its bits (the range check of the Numba
kernels, :func:`refattn._numba_path.check_numba_range`).

The magnitude of a finite IEEE value orders like its bits with the sign bit cleared, and those
bits are below the exponent-all-ones pattern exactly when the value is finite: integer maxima
over the raw bits (vectorised, as a float maximum with NaN rules is not) give the largest
finite magnitude, with no float32 copy of a bfloat16 or float16 k and no second pass unless a
NaN or an infinity is present. float32 and float64 take NumPy's float max and min (as fast,
no temporary).
"""

from __future__ import annotations

import numpy as np

__all__ = ["abs_max"]

#: bits dtype, magnitude mask, first non-finite magnitude (the exponent all ones)
_BFLOAT16 = (np.uint16, 0x7FFF, 0x7F80)
_FLOAT16 = (np.uint16, 0x7FFF, 0x7C00)

#: elements per pass (bounds the temporary of the masked bits)
_CHUNK = 1 << 20


def _top_bits(bits, mask, limit):
    """max over ``bits`` (uint16) of ``b & mask`` where that is below ``limit`` (0 when none
    is). Read as int16 the non-negative values are the positive ones, whose largest
    magnitude is the int16 maximum; every negative value's bits lie above the positive ones'
    as uint16, so the uint16 maximum is the negative value of largest magnitude: two SIMD
    reductions and no temporary, unless a NaN or an infinity needs the masked pass."""
    signed = int(bits.view(np.int16).max())
    unsigned = int(bits.max())
    best = max(signed, unsigned - 0x8000, 0)
    if best < limit:
        return best
    best = 0
    for start in range(0, bits.size, _CHUNK):  # a NaN or an infinity: the finite ones only
        part = np.bitwise_and(bits[start : start + _CHUNK], mask)
        best = max(best, int(part.max(where=part < limit, initial=0)))
    return best


def _float_top(x) -> float:
    """max |x| over the finite values of a float32 or float64 ``x``: its max and min (a
    second pass, over the finite values, only when one of them is not finite)."""
    high, low = np.max(x), np.min(x)
    if not (np.isfinite(high) and np.isfinite(low)):
        finite = np.isfinite(x)
        high = np.max(x, where=finite, initial=0.0)
        low = np.min(x, where=finite, initial=0.0)
    return float(max(high, -low, 0.0))


def abs_max(x) -> float:
    """max |x| over the finite values of ``x`` (0.0 when there are none): read from its bits
    for float16 and bfloat16, by NumPy's float maxima for float32 and float64 (other dtypes
    are widened to float32 first).

    Examples
    --------
    >>> import ml_dtypes
    >>> abs_max(np.array([1.5, -3.0, np.inf, np.nan], np.float32))
    3.0
    >>> abs_max(np.array([-2.5, 1.0], ml_dtypes.bfloat16)), abs_max(np.zeros(0))
    (2.5, 0.0)
    """
    x = np.asarray(x)
    name = x.dtype.name
    if name not in ("float64", "float32", "float16", "bfloat16"):
        x = x.astype(np.float32)
    if x.size == 0:
        return 0.0
    # a broadcast axis (stride 0) holds one distinct slice: read that one only
    x = x[tuple(slice(0, 1) if st == 0 else slice(None) for st in x.strides)]
    if x.itemsize > 2:  # float32, float64: NumPy's float maxima are as fast, no temporary
        return _float_top(x)
    kind, mask, limit = _FLOAT16 if x.dtype == np.float16 else _BFLOAT16
    bits = np.ascontiguousarray(x).reshape(-1).view(kind)
    top = np.array([_top_bits(bits, kind(mask), kind(limit))], kind)  # back to x's dtype
    return float(top.view(x.dtype)[0])
