"""Quantised k and v in the Numba CPU kernels: the codes are dequantised tile by tile as the
kernels load their key blocks (:mod:`.numba_cpu`).

float8 inputs (with ``*_descale``) and fp4 ones (NVFP4 / MXFP4 block scales) reach the
kernels as :class:`refattn.quantized.QuantisedRows`: one-byte codes (B, K, S, D), one float64
factor per block of n features (B, K, S, D / n) and the 256-entry value table. The kernels
take them as the tuple ``(codes, factors, table)`` in place of the k or v array, and
:func:`load_keys_t` / :func:`load_values` (the loads of the decode and forward kernels)
compute each element of a loaded tile as

.. math::

    x_{s d} = \\mathrm{table}[\\mathrm{codes}_{s d}] \\cdot \\mathrm{factors}_{s \\lfloor d / n
    \\rfloor}

in float64 (exact: :mod:`refattn.blockscale`) and round it once to the compute dtype, the
value that a k or v dequantised whole and cast to the compute dtype holds: the results are
bit-identical to those of the dequantised inputs, and a decode step streams 1 byte per element
instead of 8, with no (B, K, S, D) float64 copy. Arrays take the plain loads
(:func:`~._cpu_tiles.load_rows_t`, :func:`~._cpu_tiles.load_rows`), so one kernel body
serves both.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._cpu_tiles import load_rows, load_rows_t
from ._simd import JIT, KERNEL_OPTIONS, as_float

__all__ = ["load_keys_t", "load_values", "codes_abs_max", "dequantised_rows"]

_OPTS = KERNEL_OPTIONS


if JIT:
    from numba import types
    from numba.core.extending import overload

    def load_keys_t(k, b, g, start, count, out):
        """out[:, :count] = k[b, g, start:start+count].T (zero-padded columns), k an array
        or quantised rows ``(codes, factors, table)`` (dequantised here)."""
        raise NotImplementedError("compiled code only (numba overload)")

    def load_values(v, b, g, start, count, out):
        """out[:count, :E] = v[b, g, start:start+count] (zero padding); returns whether every
        loaded value is finite; v an array or quantised rows."""
        raise NotImplementedError("compiled code only (numba overload)")

    @overload(load_keys_t, jit_options=_OPTS)
    def _load_keys_t(k, b, g, start, count, out):
        if isinstance(k, types.Array) and k.dtype == types.uint16:
            return _keys_from_bf16
        if isinstance(k, types.Array):
            return lambda k, b, g, start, count, out: load_rows_t(k[b, g], start, count, out)
        if isinstance(k, types.BaseTuple):
            return _keys_from_codes
        return None

    @overload(load_values, jit_options=_OPTS)
    def _load_values(v, b, g, start, count, out):
        if isinstance(v, types.Array) and v.dtype == types.uint16:
            return _values_from_bf16
        if isinstance(v, types.Array):
            return lambda v, b, g, start, count, out: load_rows(v[b, g], start, count, out)
        if isinstance(v, types.BaseTuple):
            return _values_from_codes
        return None

else:  # pragma: no cover  (NUMBA_DISABLE_JIT: the same loads in Python)

    def load_keys_t(k, b, g, start, count, out):
        """out[:, :count] = k[b, g, start:start+count].T (zero-padded columns)."""
        if isinstance(k, tuple):
            return _keys_from_codes(k, b, g, start, count, out)
        if k.dtype == np.uint16:
            return _keys_from_bf16(k, b, g, start, count, out)
        return load_rows_t(k[b, g], start, count, out)

    def load_values(v, b, g, start, count, out):
        """out[:count, :E] = v[b, g, start:start+count]; whether every value is finite."""
        if isinstance(v, tuple):
            return _values_from_codes(v, b, g, start, count, out)
        if v.dtype == np.uint16:
            return _values_from_bf16(v, b, g, start, count, out)
        return load_rows(v[b, g], start, count, out)


@njit(**_OPTS)
def _bf16(bits):
    """The float32 value of bfloat16 ``bits`` (a uint16): exact (the bits shifted into the
    high half of a float32)."""
    return as_float(np.int32(np.int32(bits) << np.int32(16)))


def _keys_from_bf16(k, b, g, start, count, out):
    """:func:`load_keys_t` of bfloat16 k passed as its uint16 bits (widened exactly)."""
    src = k[b, g]
    feats = src.shape[1]
    for c in range(count):
        srow = src[start + c]
        for x in range(feats):
            out[x, c] = _bf16(srow[x])
    for x in range(out.shape[0]):
        for c in range(count, out.shape[1]):
            out[x, c] = 0


def _values_from_bf16(v, b, g, start, count, out):
    """:func:`load_values` of bfloat16 v passed as its uint16 bits (widened exactly)."""
    src = v[b, g]
    feats = src.shape[1]
    finite = True
    for c in range(count):
        srow = src[start + c]
        orow = out[c]
        for x in range(feats):
            value = _bf16(srow[x])
            orow[x] = value
            finite &= math.isfinite(value)
        for x in range(feats, out.shape[1]):
            orow[x] = 0
    for c in range(count, out.shape[0]):
        out[c, :] = 0
    return finite


def _keys_from_codes(k, b, g, start, count, out):
    """:func:`load_keys_t` of quantised rows."""
    codes, factors, table = k[0][b, g], k[1][b, g], k[2]
    feats, nblocks = codes.shape[1], factors.shape[1]
    size = feats // nblocks
    for c in range(count):
        crow = codes[start + c]
        frow = factors[start + c]
        for j in range(nblocks):
            f = frow[j]
            for x in range(j * size, (j + 1) * size):
                out[x, c] = table[crow[x]] * f  # exact in float64, then one rounding
    for x in range(out.shape[0]):
        for c in range(count, out.shape[1]):
            out[x, c] = 0


def _values_from_codes(v, b, g, start, count, out):
    """:func:`load_values` of quantised rows."""
    codes, factors, table = v[0][b, g], v[1][b, g], v[2]
    feats, nblocks = codes.shape[1], factors.shape[1]
    size = feats // nblocks
    finite = True
    for c in range(count):
        crow = codes[start + c]
        frow = factors[start + c]
        orow = out[c]
        for j in range(nblocks):
            f = frow[j]
            for x in range(j * size, (j + 1) * size):
                orow[x] = table[crow[x]] * f  # exact in float64, then one rounding
                finite &= math.isfinite(orow[x])  # in the compute dtype, as a cast array
        for x in range(feats, out.shape[1]):
            orow[x] = 0
    for c in range(count, out.shape[0]):
        out[c, :] = 0
    return finite


@njit(parallel=True, **_OPTS)
def _abs_max(codes, factors, magnitude, best):
    """best[r] = max over the finite values of row r: per block, the largest |table[code]|
    (``magnitude``: -1 for a NaN or infinite code) times |factor| (exact, and monotone)."""
    rows = codes.shape[0]
    size = codes.shape[1] // factors.shape[1]
    for r in prange(rows):
        top = 0.0
        for j in range(factors.shape[1]):
            block = -1.0
            for x in range(j * size, (j + 1) * size):
                block = max(block, magnitude[codes[r, x]])
            value = block * abs(factors[r, j])
            if block >= 0 and value > top and math.isfinite(value):
                top = value
        best[r] = top


def codes_abs_max(rows) -> float:
    """max |x| over the finite values of :class:`refattn.quantized.QuantisedRows` (0 when
    there are none), without forming the values.

    Examples
    --------
    >>> import ml_dtypes
    >>> from refattn.quantized import quantised_rows
    >>> k = np.array([[[1.5, -6.0]]], ml_dtypes.float8_e4m3fn)
    >>> codes_abs_max(quantised_rows(k, np.array(0.5, np.float32), None, "k"))
    3.0
    """
    codes = rows.codes.reshape(-1, rows.codes.shape[-1])
    factors = rows.factors.reshape(-1, rows.factors.shape[-1])
    best = np.zeros(codes.shape[0])
    if best.size and codes.shape[1]:
        with np.errstate(invalid="ignore"):
            magnitude = np.where(np.isfinite(rows.table), np.abs(rows.table), -1.0)
        _abs_max(codes, factors, magnitude, best)
    return float(best.max(initial=0.0))


@njit(parallel=True, **_OPTS)
def _dequantise(codes, factors, table, out):
    rows = codes.shape[0]
    size = codes.shape[1] // factors.shape[1]
    for r in prange(rows):
        for j in range(factors.shape[1]):
            f = factors[r, j]
            for x in range(j * size, (j + 1) * size):
                out[r, x] = table[codes[r, x]] * f  # exact in float64, then one rounding


def dequantised_rows(rows, dtype) -> np.ndarray:
    """The values of :class:`refattn.quantized.QuantisedRows` in ``dtype`` (each exact in
    float64, then rounded once: the same array as the float64 values cast to ``dtype``).

    Examples
    --------
    >>> import ml_dtypes
    >>> from refattn.quantized import quantised_rows
    >>> k = np.array([[[1.5, -6.0]]], ml_dtypes.float8_e4m3fn)
    >>> dequantised_rows(quantised_rows(k, None, None, "k"), np.float32).tolist()
    [[[1.5, -6.0]]]
    """
    out = np.empty(rows.codes.shape, dtype)
    if out.size:
        flat = out.reshape(-1, out.shape[-1])
        codes = rows.codes.reshape(-1, rows.codes.shape[-1])
        _dequantise(codes, rows.factors.reshape(-1, rows.factors.shape[-1]), rows.table, flat)
    return out
