"""The fast exact engine's float64 key and value inputs straight from quantised codes.

When k and v reach :func:`refattn.exact.fast.fast_exact_forward` as
:class:`refattn.quantized.QuantisedRows` (float8 with descales, NVFP4 / MXFP4 block scales;
:mod:`refattn._kv_codes`), one compiled pass per input forms what the first steps read --
K^T (B, K, D, S) with each key row's facts (finite and in range, 2-norm bound, exactness
scale: :func:`~refattn.exact.fast.facts.row_fact`) and V (B, K, S, E) with each value
column's facts (in range, 2-norm bound over the keys, max |v|) -- instead of a whole float64
k and v from ``canonicalize``, a transposed copy of each and three more passes. Each element is
``table[code] * factor``, exact in float64 (:mod:`refattn.blockscale`): the values, and every
fact (the same sums in the same order), are those of the dequantised inputs.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from . import doubledouble as D

__all__ = ["codes_inputs"]

#: Keys per work unit of the K^T pass (a row block dequantised, then stored transposed).
_KEYS = 64


#: ``low`` of a zero code (no set bit): above every exponent.
_NO_BIT = 1 << 40


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy")
def _low_exponent(f):
    """The exponent of the lowest set bit of a positive normal float64 ``f``."""
    frac, exponent = math.frexp(f)
    mant = np.int64(frac * 2.0**53)  # exact: f = mant * 2**(exponent - 53)
    return exponent - 53 + np.int64(D.trailing_zeros(mant))


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def _keys(codes, factors, tables, k_t, facts, store):
    """K^T blocks of ``_KEYS`` keys per (b, g, block) unit; ``tables`` = (value, low exponent)
    of every code; ``facts`` = (ok, norms, scales) (B, K, S) of each key row as
    :func:`~refattn.exact.fast.facts.row_fact` computes them on the values: the
    same sum of squares in the same order (K^T written only when ``store``); every quantised
    value lies in [SAFE_MIN, SAFE_MAX]
    (:mod:`refattn.blockscale`), so a row is ok when that sum is finite; the lowest set bit
    of ``table[code] * factor`` is that of the code's value times that of the factor."""
    table, lows = tables
    ok, norms, scales = facts
    batch, kv_heads, keys, dim = codes.shape
    size = dim // factors.shape[3]
    nblk = -(-keys // _KEYS)
    for unit in prange(batch * kv_heads * nblk):
        b = unit // (kv_heads * nblk)
        g = (unit // nblk) % kv_heads
        c0 = (unit % nblk) * _KEYS
        n = min(_KEYS, keys - c0)
        buf = np.empty((_KEYS, dim))
        for c in range(n):
            crow, frow = codes[b, g, c0 + c], factors[b, g, c0 + c]
            acc = 0.0
            low = _NO_BIT
            for j in range(factors.shape[3]):
                f = frow[j]
                block_low = _NO_BIT
                for x in range(j * size, (j + 1) * size):
                    code = crow[x]
                    a = table[code] * f  # exact
                    buf[c, x] = a
                    acc += a * a
                    block_low = min(block_low, lows[code])
                if block_low != _NO_BIT and f > 0 and math.isfinite(f):
                    low = min(low, block_low + _low_exponent(f))
            norm = math.sqrt(acc) * (1.0 + 2.0**-30) + 2.0**-1000
            ok[b, g, c0 + c] = math.isfinite(acc)
            norms[b, g, c0 + c] = norm
            scales[b, g, c0 + c] = np.ldexp(norm, -(0 if low == _NO_BIT else low))
        if store:
            for x in range(dim):
                for c in range(n):
                    k_t[b, g, x, c0 + c] = buf[c, x]


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def _values(codes, factors, table, v, facts, store):
    """V per (b, g) unit; ``facts`` = (ok, norms, top) (B, K, E) of each value column: ok
    when its sum of squares is finite (see :func:`_keys`), the 2-norm bound of
    :func:`~refattn.exact.fast.facts.row_fact` over the keys in increasing order,
    and max |v| (V written only when ``store``)."""
    ok, norms, top = facts
    batch, kv_heads, keys, vdim = codes.shape
    size = vdim // factors.shape[3]
    for unit in prange(batch * kv_heads):
        b = unit // kv_heads
        g = unit % kv_heads
        acc = np.zeros(vdim)
        best = np.zeros(vdim)
        for s in range(keys):
            crow, frow = codes[b, g, s], factors[b, g, s]
            for j in range(factors.shape[3]):
                f = frow[j]
                for x in range(j * size, (j + 1) * size):
                    a = table[crow[x]] * f  # exact
                    if store:
                        v[b, g, s, x] = a
                    acc[x] += a * a
                    best[x] = max(best[x], abs(a))
        for x in range(vdim):
            ok[b, g, x] = math.isfinite(acc[x])
            norms[b, g, x] = math.sqrt(acc[x]) * (1.0 + 2.0**-30) + 2.0**-1000
            top[b, g, x] = best[x]


def codes_inputs(k_rows, v_rows, batch, pad=0, store=True):
    """``(kT, v, k_facts, v_facts)`` of quantised k and v (flat batch ``batch``): K^T
    (B, K, D, S + pad) (``pad`` zero keys past S: the dense step's layout, written in place
    rather than copied) and V (B, K, S, E) float64, ``k_facts`` = (ok, norms, scales)
    (B, K, S) of the key rows and ``v_facts`` = (ok, norms, max |v|) (B, K, E) of the value
    columns, as :class:`refattn.exact.fast.forward` computes them from the dequantised inputs.
    ``store=False``: the facts alone (kT (B, K, D, 0) and v (B, K, 0, E) empty), for a step
    that reads the codes themselves (:func:`refattn.exact.fast.forward_refine.code_planes`).

    Examples
    --------
    >>> import ml_dtypes
    >>> from refattn.quantized import quantised_rows
    >>> x = np.array([[[[1.5, -2.0], [0.5, 4.0]]]], ml_dtypes.float8_e4m3fn)
    >>> rows = quantised_rows(x, np.array(2.0, np.float32), None, "k")
    >>> kT, v, k_facts, v_facts = codes_inputs(rows, rows, 1)
    >>> kT[0, 0].tolist(), v_facts[2][0, 0].tolist()
    ([[3.0, 1.0], [-4.0, 8.0]], [3.0, 8.0])
    """
    kc = k_rows.codes.reshape((batch,) + k_rows.codes.shape[-3:])
    kf = k_rows.factors.reshape((batch,) + k_rows.factors.shape[-3:])
    vc = v_rows.codes.reshape((batch,) + v_rows.codes.shape[-3:])
    vf = v_rows.factors.reshape((batch,) + v_rows.factors.shape[-3:])
    _, kv_heads, keys, dim = kc.shape
    k_t = np.empty((batch, kv_heads, dim, keys + pad if store else 0))
    k_t[..., keys:] = 0.0
    k_facts = (
        np.empty(kc.shape[:3], np.bool_),
        np.empty(kc.shape[:3]),
        np.empty(kc.shape[:3]),
    )
    v = np.empty(vc.shape if store else vc.shape[:2] + (0,) + vc.shape[3:])
    v_facts = tuple(np.empty(vc.shape[:2] + vc.shape[3:], t) for t in (np.bool_, float, float))
    if kc.size:
        _keys(kc, kf, (k_rows.table, _low_exponents(k_rows.table)), k_t, k_facts, store)
    if vc.size:
        _values(vc, vf, v_rows.table, v, v_facts, store)
    return k_t, v, k_facts, v_facts


def _low_exponents(table):
    """int64 (256,): the exponent of the lowest set bit of each code's value (``_NO_BIT`` for
    zero, NaN and infinite values: a row holding one is not ok, whatever its scale)."""
    finite = np.isfinite(table) & (table != 0)
    frac, exps = np.frexp(np.where(finite, table, 1.0))
    mant = (np.abs(frac) * 2.0**53).astype(np.int64)
    trailing = np.log2(mant & -mant).astype(np.int64)  # exact: a power of two
    return np.where(finite, exps.astype(np.int64) - 53 + trailing, _NO_BIT)
