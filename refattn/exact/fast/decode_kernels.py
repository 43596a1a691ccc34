"""The compiled decode step of the fast exact forward (:mod:`refattn.exact.fast.decode` states
the algorithm and its bounds): a few query rows against long keys, with k and v read in place.

One work item is one (batch row, kv head) plane: the query rows of every query head of its
group (``G L`` rows of ``qa``) share each load of a key row and of a value block. The keys and
values are read from their storage dtype as integer bits (bfloat16 and float16 as int16,
float32 as int32, float64 as int64) and widened exactly to float64 as they load
(:func:`widen`). Each key row's facts come in the same pass: its range and the exponent of its
least ulp from the stored bits (:func:`_bits_ulp`; the lowest set bit, :func:`_bits_facts`,
only where the ulp does not prove the dot products exact), its 2-norm bound from the widened
row (:func:`_norm`); float64 keys by :func:`_row_facts` on the values. Each value block
(SUM_BLOCK keys) is widened into a (SUM_BLOCK, E padded) tile with the range, max |v_je| and
sum of squares per feature. No float64 copy of k or v and no transposed K^T is built.

Each row's arithmetic is fixed by the shapes alone (8 lanes per dot product and norm, value
blocks aligned on the key index, every chain from +0 in a fixed order), so no bit depends on
the thread count or on which rows share an item.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ...kernels._cpu_tiles import matmul_n
from ...kernels._simd import (
    as_bits,
    as_float,
    vadd,
    vfmav,
    vlane,
    vload,
    vmax,
    vmuls,
    vsum,
    vzero,
)
from . import doubledouble as D
from ._params import (
    P_GAMMA_DIM,
    P_GAMMA_SUM,
    P_HAS_SINK,
    P_KEEP_ERR,
    P_KEEP_HI,
    P_KEEP_LO,
    P_SCALE_ERR,
    P_SCALE_HI,
    P_SCALE_LO,
    P_SINK,
    P_SLOPE,
    P_SOFTCAP,
    R_HAS_BIAS,
    R_HAS_KEEP,
    R_HAS_MASK,
    R_ROWS_HI,
    R_ROWS_LO,
)
from .allowed_set import key_state
from .dense_dots import EXACT_SCALE, KEY_TILE
from .forward_kernels import (
    CUT,
    EMPTY,
    OK,
    RHO_MAX,
    SUM_BLOCK,
    TINY,
    UNDECIDED,
    bias_in_range,
    finish_row,
    row_weights,
    score_d,
)
from .rounding_decision import decide_one

__all__ = [
    "BF16",
    "F16",
    "F32",
    "F64",
    "HALF_SCALES",
    "widen",
    "decode_serial",
    "decode_parallel",
]

#: Storage kinds of k and v (how :func:`widen` reads their bits).
BF16, F16, F32, F64 = 0, 1, 2, 3
#: ``2**(max(e, 1) - 25)`` per float16 exponent field e, NaN for e = 31 (Inf and NaN: out of
#: range, so the plane goes to the referee): a float16 of field e and significand m is
#: ``(m + 1024 [e > 0]) * HALF_SCALES[e]``, an exact product.
HALF_SCALES = np.array([2.0 ** (max(e, 1) - 25) for e in range(31)] + [np.nan])

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")
#: The per-row helpers, inlined into their loops (a call per key row would cost more than the
#: row's arithmetic: the row views' reference counts).
_INLINE = dict(_JIT, inline="always")
#: float64 lanes of a 64-byte vector (:func:`refattn.kernels._simd.lanes`).
_LANES = 8


@numba.jit(**_INLINE)
def widen(w, kind, half):
    """The float64 value of one stored element of bits ``w`` (an int16, int32 or int64) of
    storage ``kind`` (exact: every bfloat16, float16 and float32 is a float64; Inf and NaN
    stay out of range)."""
    if kind == BF16:  # the bits shifted into the high half of a float32
        return np.float64(as_float(np.int32(np.int32(w) << np.int32(16))))
    if kind == F16:
        x = np.int64(w)
        field = (x >> 10) & 31
        mant = (x & 1023) + (1024 if field != 0 else 0)
        mag = float(mant) * half[field]
        return -mag if (x >> 15) & 1 else mag
    if kind == F32:
        return np.float64(as_float(np.int32(w)))
    return as_float(np.int64(w))


@numba.jit(**_INLINE)
def _inside(x):
    """Zero, or a magnitude in [SAFE_MIN, SAFE_MAX] (False for Inf and NaN)."""
    m = abs(x)
    return m == 0.0 or (m >= D.SAFE_MIN and m <= D.SAFE_MAX)


@numba.jit(**_INLINE)
def _widen_row(src, kind, half, dst):
    """dst[:n] = the float64 values of the n stored elements ``src`` (:func:`widen`, one loop
    per storage kind, so that each vectorises)."""
    n = src.shape[0]
    if kind == BF16:
        for d in range(n):
            dst[d] = np.float64(as_float(np.int32(np.int32(src[d]) << np.int32(16))))
    elif kind == F16:
        for d in range(n):
            dst[d] = widen(src[d], kind, half)
    elif kind == F32:
        for d in range(n):
            dst[d] = np.float64(as_float(np.int32(src[d])))
    else:
        for d in range(n):
            dst[d] = as_float(np.int64(src[d]))


#: (significand bits, exponent mask, bias) of the kinds read as int16 / int32 bits.
_FORMATS = ((7, 0xFF, 127), (10, 0x1F, 15), (23, 0xFF, 127))


@numba.jit(**_INLINE)
def _norm(row):
    """An upper bound of the 2-norm of ``row`` (D padded with zeros to whole vectors):
    ``fl(sum_d x_d^2)^(1/2) (1 + 2**-30) + 2**-1000`` with the squares summed by fma in 8
    lanes (lane l over d = l mod 8, in order), then the lanes in order. Every square passes
    through at most D roundings (adding an exact zero rounds nothing), so the float sum errs
    by at most gamma_D < 2**-30 relative for D < 2**22 (Higham 2002, eq. (3.5), any order of
    the sum); 2**-1000 covers underflow."""
    acc = vzero(row)
    for c in range(0, row.shape[0], _LANES):
        x8 = vload(row, c)
        acc = vfmav(x8, x8, acc)
    return math.sqrt(vsum(acc)) * (1.0 + 2.0**-30) + 2.0**-1000


@numba.jit(**_JIT)
def _bits_facts(src, kind):
    """``(ok, g)`` of one stored row of bfloat16, float16 or float32 bits (int16 / int32):
    ``ok`` no Inf or NaN (every finite value of these formats is zero or of magnitude in
    [2**-149, 2**128], inside [SAFE_MIN, SAFE_MAX]); ``g`` the exponent of the lowest set bit
    of the row's elements (0 for a zero row): ``max(e, 1) - bias - p + log2(lsb)`` per nonzero
    element of exponent field e and significand m (with its implicit bit), ``lsb = m & -m``
    (its exponent read from the float32 ``lsb``, exact), as
    :func:`refattn.exact.fast.facts.row_fact` reads it from the float64 bits. Integer
    operations only (the loop vectorises)."""
    mbits, emask, bias = _FORMATS[kind]
    frac = np.int32((1 << mbits) - 1)
    absmask = np.int32((1 << (mbits + 8 if kind != F16 else mbits + 5)) - 1)
    none = np.int32(1 << 20)
    bad = np.int32(0)
    low = none
    for d in range(src.shape[0]):
        w = np.int32(src[d])
        field = (w >> np.int32(mbits)) & np.int32(emask)
        mant = (w & frac) | (np.int32(field != 0) << np.int32(mbits))
        lsb = mant & -mant
        lz = (as_bits(np.float32(lsb)) >> np.int32(23)) - np.int32(127)
        value = max(field, np.int32(1)) + lz
        value = none if (w & absmask) == 0 else value
        low = min(low, value)
        bad |= np.int32(field == emask)
    g = 0 if low == none else np.int64(low) - bias - mbits
    return bad == 0, g


@numba.jit(**_INLINE)
def _bits_ulp(src, kind):
    """``(ok, g)`` of :func:`_bits_facts` with ``g`` a lower bound: the exponent of the least
    ulp of the row's nonzero elements (``max(e, 1) - bias - p``; every element is a multiple of
    its ulp), so that ``norm / 2**g`` bounds the exactness scale from above. Cheaper (no
    lowest set bit); where it proves the dot products exact, so does the exact scale."""
    mbits, emask, bias = _FORMATS[kind]
    absmask = np.int32((1 << (mbits + 8 if kind != F16 else mbits + 5)) - 1)
    none = np.int32(1 << 20)
    bad = np.int32(0)
    low = none
    for d in range(src.shape[0]):
        w = np.int32(src[d])
        field = (w >> np.int32(mbits)) & np.int32(emask)
        value = field if field > 0 else np.int32(1)
        value = none if (w & absmask) == 0 else value
        low = value if value < low else low
        bad |= np.int32(field == emask)
    g = 0 if low == none else np.int64(low) - bias - mbits
    return bad == 0, g


@numba.jit(**_INLINE)
def _pow2(n):
    """2**n for -1022 <= n <= 1023 (from its bits: exact, no libm call)."""
    return as_float(np.int64(n + 1023) << np.int64(52))


@numba.jit(**_INLINE)
def _widen_checked(src, kind, half, row):
    """:func:`_widen_row` with :func:`_bits_ulp`'s ``(ok, g)`` (bfloat16: one fused loop;
    float64: ``(True, 0)``, its range checked on the values by the caller)."""
    if kind == F64:  # its range is checked on the float64 values
        _widen_row(src, kind, half, row)
        return True, 0
    if kind != BF16:
        _widen_row(src, kind, half, row)
        return _bits_ulp(src, kind)
    none = np.int32(1 << 20)
    bad = np.int32(0)
    low = none
    for d in range(src.shape[0]):
        w = np.int32(src[d])
        row[d] = np.float64(as_float(np.int32(w << np.int32(16))))
        field = (w >> np.int32(7)) & np.int32(0xFF)
        value = field if field > 0 else np.int32(1)
        value = none if (w & np.int32(0x7FFF)) == 0 else value
        low = value if value < low else low
        bad |= np.int32(field == 0xFF)
    g = 0 if low == none else np.int64(low) - 134
    return bad == 0, g


@numba.jit(**_JIT)
def _row_facts(row, bits, scratch):
    """``(ok, norm, scale)`` of one widened float64 row (``row`` (D padded with zeros to whole
    vectors), ``bits`` its int64 view), as :func:`refattn.exact.fast.facts.row_fact` states
    them: ``ok`` every element zero or of magnitude in [SAFE_MIN, SAFE_MAX]; ``norm``
    (:func:`_norm`); ``scale`` = ``norm / 2**g`` with ``g`` the exponent of the lowest set bit
    of the row's elements (``norm`` for a zero row): the value of each element's lowest set
    bit is the element itself where its stored significand is zero, else ``|x| - |x'|`` with
    ``x'`` its bits less the lowest set one (an exact difference within one binade).
    ``scratch`` = (low, bad) (8,) lanes."""
    low, bad = scratch
    frac = np.int64(0xFFFFFFFFFFFFF)
    absmask = np.int64(0x7FFFFFFFFFFFFFFF)
    low[:] = np.inf
    bad[:] = 0
    for c in range(0, row.shape[0], _LANES):
        for lane in range(_LANES):
            m = abs(row[c + lane])
            inside = (m == 0.0) | ((m >= D.SAFE_MIN) & (m <= D.SAFE_MAX))
            bad[lane] |= np.int64(not inside)
            w = bits[c + lane] & absmask
            cleared = as_float(w & (w - 1))
            lb = m if (w & frac) == 0 else m - cleared
            lb = np.inf if m == 0.0 else lb
            low[lane] = lb if lb < low[lane] else low[lane]
    norm = _norm(row)
    least = np.inf
    worst = 0
    for lane in range(_LANES):
        least = min(least, low[lane])
        worst |= bad[lane]
    return worst == 0, norm, norm if least == np.inf else norm / least


@numba.jit(**_JIT)
def _range_ok(plane, kind, half, j0, j1):
    """Whether every element of rows j0 .. j1 - 1 of ``plane`` (S, D or E) bits is in range:
    the keys outside every row's interval, read only for the same plane test as the dense
    step's (a NaN anywhere in k or v sends the plane to the referee)."""
    good = True
    for j in range(j0, j1):
        src = plane[j]
        for d in range(src.shape[0]):
            good = good and _inside(widen(src[d], kind, half))
    return good


@numba.jit(**_INLINE)
def _dot_error(sab, dim):
    """A rigorous bound of the error of a :func:`_key_pass` dot product from ``sab``, the float
    sum of the magnitudes of its rounded results (the D lane fma results and the 7 partial sums
    of the lanes): each rounding errs by at most ``u`` times its result's magnitude (Higham
    2002, eq. (2.5); the running error bound of sec. 3.1), so ``|error| <= u sab_exact`` with
    ``sab_exact <= sab (1 + 4 n u)`` (a float sum of n <= D + 16 nonnegative terms errs by at
    most gamma_n, Higham 2002, eq. (3.5), and 1 / (1 - gamma_n) <= 1 + 4 n u), the rounding
    of ``u sab`` covered by BOUND_SAFETY, plus 2**-1074 per rounding for results in the
    subnormal range."""
    n = dim + 16
    return (D.U * sab) * (1.0 + 4.0 * n * D.U) * D.BOUND_SAFETY + (n + 1) * 2.0**-1074


@numba.jit(**_JIT)
def _key_pass(kp, kind, half, keys, queries, kfacts, s, err):
    """The dot products ``s[r, j - lo] = q_r . k_j`` of every row with the keys lo <= j < hi
    (``keys`` = (lo, hi)), each key row widened from ``kp`` (S, D) bits as it loads, with its
    :func:`_row_facts` (norm bound, exactness scale) into ``kfacts`` = (kn, ks) at j - lo. Each
    dot product is 8 lane fma chains (lane l over d = l mod 8, from +0, in order) whose lanes
    are then added in order: every product passes through at most D roundings (adding an exact
    zero of the padding rounds nothing), so ``|error| <= gamma_D |q_r|.|k_j|`` (Higham 2002,
    eq. (3.5), which holds for any order of the sum), and the sum is exact where the exactness
    scales prove every partial sum representable (any order: each partial sum is a multiple of
    the scales' unit below ``||q|| ||k||``). ``queries`` = (qa (R, D padded to whole vectors,
    zeros past D), R, the rows' largest exactness scale: a key's exact scale is computed only
    where :func:`_bits_ulp`'s bound does not prove every row's chain exact). Returns whether
    every key is in range."""
    lo, hi = keys
    qa, nrows, qs_max = queries
    kn, ks = kfacts
    krow = np.zeros(qa.shape[1])
    bits = krow.view(np.int64)
    scratch = (np.empty(_LANES), np.empty(_LANES, np.int64))
    good = True
    for j in range(lo, hi):
        src = kp[j]
        ok, g = _widen_checked(src, kind, half, krow)
        if kind == F64:
            ok, kn[j - lo], ks[j - lo] = _row_facts(krow, bits, scratch)
        else:  # the facts from the stored bits; the exact scale only where it matters
            norm = _norm(krow)
            scale = norm * _pow2(-g)
            if not qs_max * scale < EXACT_SCALE:
                ok, g = _bits_facts(src, kind)
                scale = norm * _pow2(-g)
            kn[j - lo], ks[j - lo] = norm, scale
        good = good and ok
        if kind == F32 or kind == F64:  # with the magnitudes of every rounded result
            for r in range(nrows):
                s[r, j - lo], err[r, j - lo] = _dot_mag(qa[r], krow)
            continue
        for r in range(nrows):
            qrow = qa[r]
            acc = vzero(krow)
            for c in range(0, krow.shape[0], _LANES):
                acc = vfmav(vload(qrow, c), vload(krow, c), acc)
            s[r, j - lo] = vsum(acc)
    return good


@numba.jit(**_INLINE)
def _dot_mag(qrow, krow):
    """``(s, sab)``: :func:`_key_pass`'s dot product of two padded rows and the float sum of
    the magnitudes of its rounded results (each lane's fma results, then the partial sums of
    the lanes in order): :func:`_dot_error` bounds its error."""
    acc = vzero(krow)
    mags = vzero(krow)
    for c in range(0, krow.shape[0], _LANES):
        acc = vfmav(vload(qrow, c), vload(krow, c), acc)
        mags = vadd(mags, vmax(acc, vmuls(acc, -1.0)))
    total = vlane(acc, 0)
    sab = 0.0
    for lane in range(1, _LANES):
        total += vlane(acc, lane)
        sab += abs(total)
    return total, vsum(mags) + sab


@numba.jit(**_INLINE)
def _bf16_values(src, row, vsq, vmax):
    """One bfloat16 value row: ``row`` its float64 values, ``vsq[e] = fma(v_e, v_e, vsq[e])``,
    ``vmax[e] = max(vmax[e], |v_e|)``; whether it holds no Inf or NaN (one loop)."""
    bad = np.int32(0)
    for e in range(src.shape[0]):
        w = np.int32(src[e])
        x = np.float64(as_float(np.int32(w << np.int32(16))))
        row[e] = x
        m = abs(x)
        vsq[e] = D.fma(x, x, vsq[e])
        vmax[e] = m if m > vmax[e] else vmax[e]
        bad |= np.int32(((w >> np.int32(7)) & np.int32(0xFF)) == 0xFF)
    return bad == 0


@numba.jit(**_JIT)
def _value_pass(vp, kind, half, keys, weights, vfacts, sums):
    """``nsum[r, e] = sum_j p[r, j - lo] v_je`` over lo <= j < hi, blocked as the dense step's
    values (each SUM_BLOCK block of the key index one fma chain from +0 in key order, the
    register tiles of :func:`refattn.kernels._cpu_tiles.matmul_n`, added to nsum at the block's
    end), each block widened from ``vp`` (S, E) bits into a (SUM_BLOCK, E padded) tile; with
    the values' facts ``vfacts`` = (vmax, vsq): max |v_je| and the sum of squares in key order
    per feature. ``weights`` = (p (R, .), R); ``sums`` = (nsum, nb, asum, mag): (R, E padded)
    each, with ``mag`` also ``asum[r, e] = sum_j p[r, j - lo] |v_je|`` by the same blocked sums
    (the dense second pass's A_e, read from the same tiles). Returns
    whether every value is in range."""
    lo, hi = keys
    p, nrows = weights
    vmax, vsq = vfacts
    nsum, nb, asum, mag = sums
    vdim = vp.shape[1]
    epad = nsum.shape[1]
    tile = np.zeros((SUM_BLOCK, epad))
    atile = np.zeros((SUM_BLOCK, epad if mag else 0))
    nsum[:] = 0.0
    asum[:] = 0.0
    good = True
    c0 = lo
    while c0 < hi:
        c1 = min(hi, (c0 // SUM_BLOCK + 1) * SUM_BLOCK)
        for t in range(c1 - c0):
            row = tile[t]
            src = vp[c0 + t]
            if kind == BF16:  # one fused loop
                good = _bf16_values(src, row, vsq, vmax) and good
            else:
                ok, _ = _widen_checked(src, kind, half, row)
                if kind == F64:
                    ok = _range_ok(vp, kind, half, c0 + t, c0 + t + 1)
                good = good and ok
                for e in range(vdim):  # per feature: fma of the squares, max |v|
                    x = row[e]
                    m = abs(x)
                    vsq[e] = D.fma(x, x, vsq[e])
                    vmax[e] = m if m > vmax[e] else vmax[e]
            if mag:
                for e in range(vdim):
                    atile[t, e] = abs(row[e])
        nb[:] = 0.0
        matmul_n(p[:, c0 - lo :], tile, c1 - c0, nrows, epad, nb)
        for r in range(nrows):
            for e in range(epad):
                nsum[r, e] += nb[r, e]
        if mag:  # A_e = sum_j e_j |v_je| by the same blocked sums
            nb[:] = 0.0
            matmul_n(p[:, c0 - lo :], atile, c1 - c0, nrows, epad, nb)
            for r in range(nrows):
                for e in range(epad):
                    asum[r, e] += nb[r, e]
        c0 = c1
    return good


@numba.jit(**_JIT)
def _row_scores(index, r, lo, facts, pr, rule, work):
    """The scores (t, err) of row r (query row i of head h, batch row b: ``index`` = (b, h,
    i)) over its key interval in place of its dot products in ``s``, each key's state (0
    excluded, 1 dropped, 2 kept) in ``state``; returns (max score, bias out of range). The
    same score and radius as the dense step's (:func:`refattn.exact.fast.dense_dots.
    plain_scores`, :func:`refattn.exact.fast.forward_kernels.score_d`): the dot product's
    error ``gamma_D ||q_i|| ||k_j||``, zero where ``qs_i ks_j < 2**52`` proves the chain
    exact; with ``mag`` (float32 and float64 keys) the smaller of that and :func:`_dot_error`
    of the magnitude sum ``err`` holds on entry. ``facts`` = (qn_r, qs_r, kn, ks, mag, D),
    ``work`` = (s, err, state)."""
    b, h, i = index
    qn_r, qs_r, kn, ks, mag, dim = facts
    s, err, state = work
    r0, r1 = rule[R_ROWS_LO][b, i] - lo, rule[R_ROWS_HI][b, i] - lo
    gdim = pr[P_GAMMA_DIM]
    rule_arrays = rule[R_HAS_MASK] or rule[R_HAS_BIAS] or rule[R_HAS_KEEP]
    has_bias = rule[R_HAS_BIAS]
    srow, erow, strow = s[r], err[r], state[r]
    top = -np.inf
    if not rule_arrays and pr[P_SOFTCAP] == 0.0 and pr[P_SLOPE] == 0.0:
        u = 1.01 * D.U
        scale_hi = pr[P_SCALE_HI]
        c1 = abs(scale_hi)
        c2 = abs(pr[P_SCALE_LO]) + pr[P_SCALE_ERR]
        for jj in range(r0, r1):
            gd = 0.0 if qs_r * ks[jj] < EXACT_SCALE else gdim
            sj = srow[jj]
            derr = gd * qn_r * kn[jj]
            if mag and gd != 0.0:  # the running bound where it is tighter
                derr = min(derr, _dot_error(erow[jj], dim))
            t = sj * scale_hi
            erow[jj] = c1 * derr + (abs(sj) + derr) * c2 + u * abs(t)
            srow[jj] = t
            strow[jj] = 2
            top = max(top, t)
        return top, False
    bad = False
    for jj in range(r0, r1):
        j = lo + jj
        st, bv = key_state(rule, b, h, i, j)
        strow[jj] = st
        if st == 0:
            continue
        if has_bias and not bias_in_range(bv):
            bad = True
        derr = 0.0 if qs_r * ks[jj] < EXACT_SCALE else gdim * qn_r * kn[jj]
        if mag and derr != 0.0:  # the running bound where it is tighter
            derr = min(derr, _dot_error(erow[jj], dim))
        t, e = score_d(i, j, srow[jj], derr, 1.0, pr, bv, has_bias, 1.0)
        srow[jj], erow[jj] = t, e
        top = max(top, t)
    return top, bad


@numba.jit(**_JIT)
def _row_exps(r, span, top, want_w, work, sums, values):
    """The exponentials of row r's keys (``span`` = (r0, r1) its interval relative to lo)
    into ``p`` (0 where a key carries no value or lies outside the interval, up to the
    plane's key count), with the row's Z (blocked: restarting at multiples of SUM_BLOCK of the
    key index), sum of e^2, tiny count, |v| sums of the keys below CUT and rho, as the dense
    step's: the shifted scores ``x = t - top`` with radius ``(err + 1.01 u |x|) BOUND_SAFETY``
    (kept in s, err for the weights), keys below CUT as TINY each, ``e = exp_d(x)`` with
    relative error EXP_D_REL. ``work`` = (s, err, state, p), ``sums`` = (z, e2, tiny, tiny_v,
    rho) per row, ``values`` = (vp bits, kind, half, lo)."""
    r0, r1 = span
    s, err, state, p = work
    z, e2, tiny, tiny_v, rho = sums
    vp, kind, half, lo = values
    u = 1.01 * D.U
    srow, erow, strow, prow = s[r], err[r], state[r], p[r]
    prow[:] = 0.0
    zr = 0.0
    zb = 0.0
    sq = 0.0
    for jj in range(r0, r1):
        if ((lo + jj) % SUM_BLOCK) == 0:  # blocked sums: gamma_{B + S/B}, not gamma_S
            zr += zb
            zb = 0.0
        st = strow[jj]
        if st == 0:
            continue  # adds an exact 0 to the sums
        x = srow[jj] - top
        xe = (erow[jj] + u * abs(x)) * D.BOUND_SAFETY
        if want_w:
            srow[jj], erow[jj] = x, xe  # the shifted scores, kept for the weights
        if x < CUT:
            tiny[r] += TINY
            if st == 2:
                src = vp[lo + jj]
                for e in range(tiny_v.shape[1]):
                    tiny_v[r, e] += abs(widen(src[e], kind, half))
            continue
        rho[r] = max(rho[r], (D.EXP_D_REL + 2.0 * xe) * (1.0 + RHO_MAX))
        ex = D.exp_d_core(x)  # CUT <= x <= 0: in exp_d's domain
        zb += ex
        sq += ex * ex
        prow[jj] = ex if st == 2 else 0.0
    z[r] = zr + zb
    e2[r] = sq


@numba.jit(**_JIT)
def _finish_out(index, z, sums, prm, target, out):
    """out = N / Z * keep_scale from double N and Z, rounded to the target: the quotient and
    the product by keep_hi each rounded once (``u`` times the result's magnitude added to the
    radius: Higham 2002, eq. (2.5)), ``|N/Z - n/z| <= (nr + |n/z| zr) / (z - zr)`` (the
    quotient of enclosures), ``|keep - keep_hi| <= |keep_lo| + keep_err``; each element
    decided by :func:`~refattn.exact.fast.rounding_decision.decide_one`. ``z`` = (Z, radius),
    ``sums`` = (N (E,), N radius (E,)). Returns whether every element is decided."""
    b, h, i = index
    zh, zr = z
    ns, nr = sums
    _, _, p, emin, maxf = target
    keep_hi, keep_lo, keep_err = prm[P_KEEP_HI], prm[P_KEEP_LO], prm[P_KEEP_ERR]
    kabs = abs(keep_hi) + abs(keep_lo) + keep_err
    klo = abs(keep_lo) + keep_err
    zlow = zh - zr
    ok = True
    for e in range(ns.shape[0]):
        oh = ns[e] / zh
        orad = (nr[e] + abs(oh) * 1.0000001 * zr) / zlow + D.U * abs(oh)
        x = oh * keep_hi
        rad = (orad * kabs + abs(oh) * klo + D.U * abs(x)) * D.BOUND_SAFETY
        value, dec = decide_one(x, 0.0, rad, p, emin, maxf)
        out[b, h, i, e] = value
        ok = ok and dec
    return ok


@numba.jit(**_JIT)
def _finish(index, r, row, facts, pr, target, results):
    """Status of row r (``index`` = (b, h, i)) from its sums: Z with the sink's term and its
    radius ``(gamma + rho) Z (1 + gamma) + tiny``, N's radius ``(gamma + rho) A_e (1 + gamma)
    (1 + rho) + TINY |v|`` with ``A_e <= min(vmax_e (Z + zr), (sum_j e_j^2)^(1/2) ||v_e||)``
    (Cauchy-Schwarz) and, with ``mag``, ``A_e <= fl(sum_j e_j |v_je|) (1 + 4 gamma)`` (the
    blocked float sum of nonnegative terms, as the dense second pass), then lse
    (:func:`~refattn.exact.fast.forward_kernels.finish_row`), out (:func:`_finish_out`) and
    the weights. ``row`` = (top, span, lo, s, err, state, nsum row, asum row, mag);
    ``facts`` = (z, e2, tiny, tiny_v, rho, vmax, vnorm)."""
    top, span, lo, s, err, state, nrow, arow, mag = row
    z, e2, tiny, tiny_v, rho, vmax, vnorm = facts
    want_w = target[1]
    vdim = vmax.shape[0]
    u = 1.01 * D.U
    gsum = pr[P_GAMMA_SUM]
    zr_ = z[r]
    if pr[P_HAS_SINK] != 0.0:  # the sink's term enters Z after the keys' blocks
        x = pr[P_SINK] - top
        if x < CUT:
            tiny[r] += TINY
        else:
            rho[r] = max(
                rho[r], (D.EXP_D_REL + 2.0 * u * abs(x) * D.BOUND_SAFETY) * (1.0 + RHO_MAX)
            )
            zr_ += D.exp_d(x)
    if not rho[r] <= RHO_MAX:
        return UNDECIDED
    gg = gsum + rho[r]
    zrad = (gg * zr_ * (1.0 + gsum) + tiny[r]) * D.BOUND_SAFETY
    zsum, root, grow = zr_ + zrad, math.sqrt(e2[r]), (1.0 + gsum) * (1.0 + rho[r])
    nr = np.empty(vdim)
    for e in range(vdim):
        acc = min(vmax[e] * zsum, root * vnorm[e])
        if mag:  # its blocked float sum of nonnegative terms is within gamma of A_e:
            # the value is at most the sum / (1 - gsum) <= the sum (1 + 4 gsum)
            acc = min(acc, arow[e] * (1.0 + 4.0 * gsum))
        nr[e] = (gg * acc * grow) * D.BOUND_SAFETY + TINY * tiny_v[r, e]
    ok, lz_h, lz_l, lz_r = finish_row(
        index, top, (zr_, 0.0, zrad), (nr[:0], nr[:0], nr[:0]), pr, target, results
    )
    if ok:
        ok = _finish_out(index, (zr_, zrad), (nrow[:vdim], nr), pr, target, results[0])
    if ok and want_w:
        r0, r1 = span
        shifted = (s[r, r0:r1], np.zeros(r1 - r0), err[r, r0:r1])
        ok = row_weights(
            index, lo + r0, state[r, r0:r1], shifted, (lz_h, lz_l, lz_r), target, results[2]
        )
    return OK if ok else UNDECIDED


@numba.jit(**_JIT)
def _queries(b, heads, q, qa, qfacts):
    """The float64 query rows of the heads ``heads`` of batch row b as the rows of ``qa``
    (R, D padded with zeros to whole vectors; row r = head index * L + i) with their
    :func:`_row_facts` into ``qfacts`` = (ok, qn, qs) (R,)."""
    qok, qn, qs = qfacts
    length, dim = q.shape[2], q.shape[3]
    qrow = np.zeros(qa.shape[1])
    bits = qrow.view(np.int64)
    scratch = (np.empty(_LANES), np.empty(_LANES, np.int64))
    for hh in range(heads.shape[0]):
        for i in range(length):
            r = hh * length + i
            qrow[:dim] = q[b, heads[hh], i]
            qok[r], qn[r], qs[r] = _row_facts(qrow, bits, scratch)
            qa[r] = qrow


@numba.jit(**_JIT)
def _interval(rule, b, length):
    """The union [lo, hi) of the key intervals of batch row b's rows (hi >= lo)."""
    lo = rule[R_ROWS_LO][b, 0]
    hi = rule[R_ROWS_HI][b, 0]
    for i in range(1, length):
        lo = min(lo, rule[R_ROWS_LO][b, i])
        hi = max(hi, rule[R_ROWS_HI][b, i])
    return lo, max(hi, lo)


@numba.jit(**_JIT)
def _plane_ok(kp, vp, kind, half, keys):
    """Whether the keys and values outside [lo, hi) (``keys`` = (lo, hi)) are in range."""
    lo, hi = keys
    count = kp.shape[0]
    good = _range_ok(kp, kind, half, 0, lo) and _range_ok(kp, kind, half, hi, count)
    return good and _range_ok(vp, kind, half, 0, lo) and _range_ok(vp, kind, half, hi, count)


@numba.jit(**_JIT)
def _decode_item(b, g, inputs, rule, target, results):
    """The decode step of every query row of kv plane (b, g) (the rows of each query head h
    with kv_head[h] = g); writes their status. ``inputs`` = (q float64 (B, H, L, D), k bits
    (B, K, S, D), v bits (B, K, S, E), kind, half, prm (B, H, 16), plane_ok (B, H), kv_head
    (H,))."""
    q, k, v, kind, half, prm, plane_ok, kvh = inputs
    status = results[3]
    length, dim = q.shape[2], q.shape[3]
    vdim = v.shape[3]
    heads = np.flatnonzero(kvh == g)
    nrows = heads.shape[0] * length
    lo, hi = _interval(rule, b, length)
    n = hi - lo
    width = max(n, 1)
    epad = max(KEY_TILE, -(-vdim // KEY_TILE) * KEY_TILE)
    qa = np.zeros((nrows, -(-dim // _LANES) * _LANES))
    qok, qn, qs = np.empty(nrows, np.bool_), np.empty(nrows), np.empty(nrows)
    _queries(b, heads, q, qa, (qok, qn, qs))
    kp, vp = k[b, g], v[b, g]
    kn, ks = np.empty(max(n, 1)), np.empty(max(n, 1))
    s, err = np.zeros((nrows, width)), np.zeros((nrows, width))
    state = np.zeros((nrows, width), np.int8)
    qs_max = qs.max() if nrows else 0.0
    good = _key_pass(kp, kind, half, (lo, hi), (qa, nrows, qs_max), (kn, ks), s, err)
    good = good and _plane_ok(kp, vp, kind, half, (lo, hi))
    # a row runs on when its plane is in range (NaN, Inf or huge inputs: the referee's)
    runs = np.zeros(nrows, np.bool_)
    for r in range(nrows):
        hh = r // length
        runs[r] = good and plane_ok[b, heads[hh]] and qok[hh * length : (hh + 1) * length].all()
    tops = np.full(nrows, -np.inf)
    p = np.zeros((nrows, width))
    z, e2, tiny, rho = np.zeros(nrows), np.zeros(nrows), np.zeros(nrows), np.zeros(nrows)
    tiny_v = np.zeros((nrows, vdim))
    for r in range(nrows):
        h, i = heads[r // length], r % length
        if not runs[r]:
            continue
        pr = prm[b, h]
        facts = (qn[r], qs[r], kn, ks, kind == F32 or kind == F64, dim)
        top, bad = _row_scores((b, h, i), r, lo, facts, pr, rule, (s, err, state))
        if pr[P_HAS_SINK] != 0.0:  # the sink: one more logit in the max and in Z, no value
            top = max(top, pr[P_SINK])
        tops[r] = top
        runs[r] = not bad  # a bias out of range: the row is the referee's
        if bad or top == -np.inf:
            continue
        span = (rule[R_ROWS_LO][b, i] - lo, rule[R_ROWS_HI][b, i] - lo)
        work = (s, err, state, p)
        sums = (z, e2, tiny, tiny_v, rho)
        _row_exps(r, span, top, target[1], work, sums, (vp, kind, half, lo))
    vmax, vsq = np.zeros(epad), np.zeros(epad)
    nsum, nb = np.zeros((nrows, epad)), np.zeros((nrows, epad))
    mag = kind == F32 or kind == F64  # dot products rarely exact: the tighter A_e too
    asum = np.zeros((nrows, epad) if mag else (nrows, 0))
    sums = (nsum, nb, asum, mag)
    good = _value_pass(vp, kind, half, (lo, hi), (p, nrows), (vmax, vsq), sums)
    vnorm = np.sqrt(vsq[:vdim]) * (1.0 + 2.0**-30) + 2.0**-1000  # as _norm
    facts = (z, e2, tiny, tiny_v, rho, vmax[:vdim], vnorm)
    for r in range(nrows):
        h, i = heads[r // length], r % length
        if not (good and runs[r]):
            status[b, h, i] = UNDECIDED
        elif tops[r] == -np.inf:
            status[b, h, i] = EMPTY
        else:
            span = (rule[R_ROWS_LO][b, i] - lo, rule[R_ROWS_HI][b, i] - lo)
            row = (tops[r], span, lo, s, err, state, nsum[r], asum[r], mag)
            status[b, h, i] = _finish((b, h, i), r, row, facts, prm[b, h], target, results)


@numba.jit(**_JIT)
def decode_serial(items, inputs, rule, target, results):
    """:func:`decode_parallel` on one thread (small steps: a parallel region would cost more
    than it saves)."""
    for t in range(items.shape[0]):
        _decode_item(items[t, 0], items[t, 1], inputs, rule, target, results)


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def decode_parallel(items, inputs, rule, target, results):
    """The decode step of the kv planes ``items`` ((n, 2): b, g), in parallel over them; the
    argument records are those of :func:`_decode_item`, ``rule`` =
    :meth:`refattn.exact.fast.allowed_set.AllowedRule.kernel_args`, ``target`` = (want_lse,
    want_weights, p, emin, max_finite), ``results`` = (out, lse, weights, status)."""
    for t in prange(items.shape[0]):
        _decode_item(items[t, 0], items[t, 1], inputs, rule, target, results)
