"""Per-row facts of the fast exact engine's float64 inputs (range, 2-norm bound, exactness scale)

Whether every value is in the first steps' range, a bound on each row's 2-norm, and its
exactness scale (the exponent of the lowest set bit), computed in one compiled pass over q,
K (with K^T) and V.

They decide which planes the first steps of :mod:`refattn.exact.fast.forward` take and give
the ``gamma_D |q||k|`` dot-product bounds and the exactness test of
:func:`refattn.exact.fast.forward_kernels.forward_d`.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from . import doubledouble as D
from .forward_kernels import KEY_TILE

__all__ = ["plane_key_facts", "plane_value_facts", "row_fact", "row_facts"]


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def plane_key_facts(k, kT, norms, scales, ok):
    """K^T (B, K, D, S + pad; the pad untouched) of k (B, K, S, D) float64 and the
    :func:`row_facts` of every key row, in parallel over chunks of KEY_TILE keys of every
    plane (one pass over k)."""
    batch, heads, keys, dim = k.shape
    chunks = -(-keys // KEY_TILE)
    for t in prange(batch * heads * chunks):
        b = t // (heads * chunks)
        g = (t // chunks) % heads
        j0 = (t % chunks) * KEY_TILE
        j1 = min(keys, j0 + KEY_TILE)
        kp = k[b, g]
        bits = kp.view(np.int64)
        for j in range(j0, j1):
            ok[b, g, j], norms[b, g, j], scales[b, g, j] = row_fact(kp[j], bits[j])
        dst = kT[b, g]
        for d in range(dim):
            for j in range(j0, j1):
                dst[d, j] = kp[j, d]


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def plane_value_facts(v, vnorm, vmax, ok):
    """Per feature e < vnorm.shape[2] of every plane of v (B, K, S, E) float64, E a multiple
    of KEY_TILE: ``ok`` (all finite, nonzero magnitudes in [SAFE_MIN, SAFE_MAX]), ``vnorm``
    (the 2-norm bound of :func:`row_facts`, the squares summed over the keys in order) and
    ``vmax`` (max |v_je|), in parallel over chunks of KEY_TILE features of every plane (one
    pass over v, no transpose; lanes over features)."""
    batch, heads, keys, epad = v.shape
    vdim = vnorm.shape[2]
    chunks = epad // KEY_TILE
    for t in prange(batch * heads * chunks):
        b = t // (heads * chunks)
        g = (t // chunks) % heads
        e0 = (t % chunks) * KEY_TILE
        vp = v[b, g]
        acc = np.zeros(KEY_TILE)
        big = np.zeros(KEY_TILE)
        bad = np.zeros(KEY_TILE, np.int8)
        for j in range(keys):
            row = vp[j, e0 : e0 + KEY_TILE]
            for e in range(KEY_TILE):
                x = row[e]
                m = abs(x)
                inside = m == 0.0 or (m >= D.SAFE_MIN and m <= D.SAFE_MAX)
                bad[e] |= 0 if inside else 1
                acc[e] += x * x
                big[e] = max(big[e], m)
        for e in range(min(KEY_TILE, vdim - e0)):
            ok[b, g, e0 + e] = bad[e] == 0
            vnorm[b, g, e0 + e] = math.sqrt(acc[e]) * (1.0 + 2.0**-30) + 2.0**-1000
            vmax[b, g, e0 + e] = big[e]


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def row_facts(x, bits, norms, scales, ok):
    """Per row of x (N, D) (``bits``: the same array viewed as int64), in a fixed order:
    ``ok`` (all finite, nonzero magnitudes in [SAFE_MIN, SAFE_MAX]), ``norms`` (an upper bound
    of the 2-norm: the float sum of squares errs by at most gamma_D < 2**-30 relative for
    D < 2**22, covered by the factor 1 + 2**-30; 2**-1000 covers underflow) and ``scales``
    (:func:`exactness_scales`: the exponent of the lowest set bit from the bit pattern)."""
    for n in prange(x.shape[0]):
        ok[n], norms[n], scales[n] = row_fact(x[n], bits[n])


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy")
def row_fact(a, bits):
    """``(ok, norm, scale)`` of one row ``a`` (D,) (``bits``: viewed as int64), as
    :func:`row_facts` states them."""
    frac_mask = (1 << 52) - 1
    good = True
    acc = 0.0
    low = 1 << 40
    for d in range(a.shape[0]):
        x = a[d]
        m = abs(x)
        if not (m == 0.0 or (m >= D.SAFE_MIN and m <= D.SAFE_MAX)):
            good = False
        acc += x * x
        if m != 0.0:
            w = bits[d]
            biased = (w >> 52) & 0x7FF
            mant = w & frac_mask
            if biased != 0:
                mant |= 1 << 52
            else:
                biased = 1  # subnormal: the same scale as the smallest normal
            tz = np.int64(D.trailing_zeros(mant))  # the lowest set bit (mant != 0)
            low = min(low, biased - 1075 + tz)
    norm = math.sqrt(acc) * (1.0 + 2.0**-30) + 2.0**-1000
    g = 0 if low == 1 << 40 else low  # a zero row: its products are all 0
    return good, norm, np.ldexp(norm, -g)
