"""Per-row facts of the fast exact engine's float64 inputs (range, 2-norm bound, exactness scale)

Whether every value is in the first steps' range, a bound on each row's 2-norm, and its
exactness scale (the exponent of the lowest set bit), computed in one compiled pass over q,
K (with K^T) and V: :func:`input_facts` does all three in one parallel region, reading
float32, float64 or bfloat16 (as its uint16 bits) inputs and writing their float64 copies
(every value of those formats is a float64 exactly) -- the same values and facts, bit for bit,
as :func:`row_facts`, :func:`plane_key_facts` and :func:`plane_value_facts` of the float64
arrays.

They decide which planes the first steps of :mod:`refattn.exact.fast.forward` take and give
the ``gamma_D |q||k|`` dot-product bounds and the exactness test of
:func:`refattn.exact.fast.forward_kernels.forward_d`.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ..._numba_cache import serial_twin
from ...kernels._simd import JIT, as_float
from . import doubledouble as D
from .forward_kernels import KEY_TILE

__all__ = [
    "plane_key_facts",
    "plane_value_facts",
    "row_fact",
    "row_facts",
    "row_facts_serial",
    "input_facts",
    "widen",
    "Q_CHUNK",
]

#: Query rows per work item of :func:`input_facts`.
Q_CHUNK = 64

if JIT:
    from numba import types
    from numba.core.extending import overload

    def widen(x):  # float64(x) of a float32/float64 or of bfloat16 bits (uint16), dispatched below
        raise NotImplementedError

    @overload(widen)
    def _widen_overload(x):
        if x == types.uint16:  # bfloat16: the high half of a float32's bits (exact)
            return lambda x: np.float64(as_float(np.int32(np.int64(x) << 16)))
        if isinstance(x, types.Float):
            return lambda x: np.float64(x)
        return None

else:  # pragma: no cover - exercised by the NUMBA_DISABLE_JIT=1 test tier

    def widen(x):
        if isinstance(x, np.uint16):
            return float(np.array(np.uint32(x) << np.uint32(16)).view(np.float32))
        return float(x)


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


#: :func:`row_facts` compiled without threads (the same loop body and bits) for the small
#: passes: no parallel region and no change of the thread count around them (on a busy
#: machine either delays the call); a cache entry of its own
#: (:func:`refattn._numba_cache.serial_twin`).
row_facts_serial = serial_twin(
    row_facts, dict(nopython=True, cache=True, fastmath=False, error_model="numpy")
)


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


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def input_facts(src, dst, facts):
    """The float64 inputs of the dense first steps and their facts in one parallel region.

    ``src`` = (q (B, H, L, D), k (B, K, S, D), v (B, K, S, E)), C-contiguous, each float32,
    float64 or uint16 (the bits of bfloat16), read through :func:`widen` (exact);
    ``dst`` = (q64 (B, H, L, D), kT (B, K, D, S + pad; the pad untouched), v64 (B, K, S, Ep),
    Ep a multiple of KEY_TILE, the features past E set to 0); ``facts`` = ((ok, norm, scale)
    of q's rows (B, H, L), the same of k's rows (B, K, S), (ok, norm, max) of v's features
    (B, K, E)) -- :func:`row_fact` of each query and key row, :func:`plane_value_facts` of each
    feature, so the same bits. Work items: Q_CHUNK query rows, KEY_TILE keys (transposed into
    K^T) or KEY_TILE features of a plane, all in one ``prange`` (which items a thread takes
    changes no bit)."""
    q, k, v = src
    q64, kT, v64 = dst
    (q_ok, qn, qs), (k_ok, kn, ks), (v_ok, vnorm, vmax) = facts
    batch, heads, length, dim = q.shape
    kheads, keys = k.shape[1], k.shape[2]
    epad = v64.shape[3]
    qchunks = -(-length // Q_CHUNK)
    kchunks = -(-keys // KEY_TILE)
    nq = batch * heads * qchunks
    nk = batch * kheads * kchunks
    nv = batch * kheads * (epad // KEY_TILE)
    for t in prange(nq + nk + nv):
        if t < nq:
            bh, c = t // qchunks, t % qchunks
            b, h = bh // heads, bh % heads
            _query_chunk(q[b, h], q64[b, h], c * Q_CHUNK, (q_ok[b, h], qn[b, h], qs[b, h]))
        elif t < nq + nk:
            r = t - nq
            bg, c = r // kchunks, r % kchunks
            b, g = bg // kheads, bg % kheads
            _key_chunk(k[b, g], kT[b, g], c * KEY_TILE, (k_ok[b, g], kn[b, g], ks[b, g]))
        else:
            r = t - nq - nk
            chunks = epad // KEY_TILE
            bg, c = r // chunks, r % chunks
            b, g = bg // kheads, bg % kheads
            _value_chunk(v[b, g], v64[b, g], c * KEY_TILE, (v_ok[b, g], vnorm[b, g], vmax[b, g]))


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy")
def _query_chunk(qp, q64, i0, facts):
    """Rows i0 .. i0 + Q_CHUNK - 1 of one plane's queries widened into q64, with their
    :func:`row_fact`."""
    ok, norms, scales = facts
    bits = q64.view(np.int64)
    for i in range(i0, min(qp.shape[0], i0 + Q_CHUNK)):
        src, row = qp[i], q64[i]
        for d in range(row.shape[0]):
            row[d] = widen(src[d])
        ok[i], norms[i], scales[i] = row_fact(row, bits[i])


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy")
def _key_chunk(kp, kT, j0, facts):
    """Keys j0 .. j0 + KEY_TILE - 1 of one plane widened into K^T, with their
    :func:`row_fact` (from a widened copy of each row)."""
    ok, norms, scales = facts
    dim = kp.shape[1]
    j1 = min(kp.shape[0], j0 + KEY_TILE)
    row = np.empty(dim)
    bits = row.view(np.int64)
    for j in range(j0, j1):
        src = kp[j]
        for d in range(dim):
            x = widen(src[d])
            row[d] = x
            kT[d, j] = x
        ok[j], norms[j], scales[j] = row_fact(row, bits)


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy")
def _value_chunk(vp, v64, e0, facts):
    """Features e0 .. e0 + KEY_TILE - 1 of one plane's values widened into v64 (0 past E), with
    the facts of :func:`plane_value_facts` (the same loop: squares summed over the keys in
    order)."""
    ok, vnorm, vmax = facts
    keys, vdim = vp.shape
    n = max(0, min(KEY_TILE, vdim - e0))
    acc = np.zeros(KEY_TILE)
    big = np.zeros(KEY_TILE)
    bad = np.zeros(KEY_TILE, np.int8)
    for j in range(keys):
        src, row = vp[j], v64[j]
        for e in range(n):
            x = widen(src[e0 + e])
            row[e0 + e] = x
            m = abs(x)
            inside = m == 0.0 or (m >= D.SAFE_MIN and m <= D.SAFE_MAX)
            bad[e] |= 0 if inside else 1
            acc[e] += x * x
            big[e] = max(big[e], m)
        for e in range(n, KEY_TILE):
            row[e0 + e] = 0.0
    for e in range(n):
        ok[e0 + e] = bad[e] == 0
        vnorm[e0 + e] = math.sqrt(acc[e]) * (1.0 + 2.0**-30) + 2.0**-1000
        vmax[e0 + e] = big[e]
