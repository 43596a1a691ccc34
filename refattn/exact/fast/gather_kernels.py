"""The compiled first steps of the fast exact forward on gathered keys
(:mod:`refattn.exact.fast.gather` is the host side and states the algorithm).

A query row i of plane (b, h) visits only its listed keys: the distinct valid positions of
``key_indices[b, g, i]`` (g = kv_head[h]) inside the row's structural interval, ascending. The
keys every row of a kv-head plane lists are gathered once (their float64 rows, ``U <= S`` of
them; a decode step lists T), and each row's list holds positions in that gathered table.

* :func:`compact_lists`: each row's distinct valid positions, ascending.
* :func:`gather_d`: the double-precision step (targets of at most 24 bits) for a query row
  and up to :data:`HEAD_BLOCK` query heads of one kv head at once (they read the same list and
  share each load of its keys and values: a decode step's heads stream the gathered table
  once per work item, not once per eight heads).
  The dot products are blocked fma chains (:data:`DOT_BLOCK` features per block, then the
  block sums) whose error is bounded by ``u`` times the float sum of the magnitudes of every
  rounded partial result (each rounding errs by at most ``u |result|``, Higham 2002, eq.
  (4.3); :func:`dot_error`), far tighter than ``gamma_D ||q_i|| ||k_j||``; and
  ``A_e = sum_j e_j |v_je|`` is summed beside ``N_e`` (the same blocked sums), which bounds
  N's error more tightly than ``max_j |v_je| Z``. Both run lane-wise on register tiles
  (:mod:`refattn.exact.fast.gather_lanes`: the scalar loops' bits, lane by lane). For a
  float32 target (no lse, no weights, no keep scale) the outputs are decided from one-word
  quotients (:func:`float32_outputs`), first with ``max_j |v_je| Z``, and A_e is summed
  only for the features that bound leaves undecided.
* :func:`row_columns`, :func:`float32_out`, :func:`scatter_weights`: the pieces the
  double-double step (:mod:`refattn.exact.fast.gather_dd`) shares with this one.

Each row's arithmetic is fixed by its list and the shapes alone: no bit depends on the thread
count or on which rows share a work item.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ..._numba_cache import serial_twin
from ...kernels._simd import as_bits, as_float
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
from .gather_lanes import (
    magnitude_sum,
    source_dots,
    source_span,
    sums_rows,
    value_rows,
    weighted_block,
)

__all__ = [
    "compact_lists",
    "compact_lists_serial",
    "decode_dots",
    "dot_error",
    "exp_rel",
    "float32_out",
    "float32_outputs",
    "gather_d",
    "gather_d_serial",
    "row_columns",
    "scatter_weights",
    "DOT_BLOCK",
    "HEAD_BLOCK",
]

#: Features per block of the double-precision step's dot products.
DOT_BLOCK = 32

#: Query heads one work item of the double-precision step takes at most.
HEAD_BLOCK = 64

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")
_PAR = dict(_JIT, parallel=True)


@numba.jit(**_PAR)
def compact_lists(idx, lists, counts):
    """Per row r of ``idx`` (N, T) int64 (-1: not a position): its distinct positions,
    ascending, into ``lists[r, :counts[r]]`` (the set reading: a position listed twice once)."""
    for r in prange(idx.shape[0]):
        row = np.sort(idx[r])
        n = 0
        last = -1
        for t in range(row.shape[0]):
            x = row[t]
            if x > last:
                lists[r, n] = x
                n += 1
                last = x
        counts[r] = n


#: :func:`compact_lists` compiled without threads (the same loop body and bits), for the
#: small lists of a decode step (a cache entry of its own:
#: :func:`refattn._numba_cache.serial_twin`).
compact_lists_serial = serial_twin(compact_lists, _JIT)


@numba.jit(**_JIT)
def _row_columns(b, g, i, lists, keys_of, rule):
    """The gathered-table columns (ascending) of row i's listed keys inside its structural
    interval ``rows_lo[b, i] <= j < rows_hi[b, i]``."""
    local, counts = lists
    lo, hi = rule[R_ROWS_LO][b, i], rule[R_ROWS_HI][b, i]
    sel = local[b, g, i, : counts[b, g, i]]
    korig = keys_of[b, g]
    a = 0
    while a < sel.shape[0] and korig[sel[a]] < lo:
        a += 1
    z = a
    while z < sel.shape[0] and korig[sel[z]] < hi:
        z += 1
    return sel[a:z]


@numba.jit(**_JIT)
def _blocked_dots(qp, heads, nh, i, kcols, c0, j0, s, sab):
    """``s[rr, jj] = q_{heads[rr], i} . k_{c0 + jj}`` (``qp`` the batch row's (H, L, D)
    queries, ``kcols`` (D, >= c0 + n) keys) by fma chains of DOT_BLOCK features whose block
    sums are added in order, and ``sab[rr, jj]`` the float sum of the magnitudes of every
    rounded result (the partial sums of the chains and of the block sums): each rounding errs
    by at most u times its result's magnitude (Higham 2002, eq. (4.3)), so the dot product
    errs by at most ``u sab`` up to the rounding of sab itself and underflow. A zero q feature
    is skipped (fma(0, k, s) = s exactly: no rounding). Only the columns ``j0 <= jj < n`` are
    done here (:func:`refattn.exact.fast.gather_lanes.dot_tiles` does the same arithmetic
    lane-wise on the first ones)."""
    n = s.shape[1]
    dim = qp.shape[2]
    part = np.zeros((s.shape[0], n))
    pab = np.zeros((s.shape[0], n))
    for d0 in range(0, dim, DOT_BLOCK):
        for d in range(d0, min(d0 + DOT_BLOCK, dim)):
            row = kcols[d, c0 : c0 + n]
            for rr in range(nh):
                a = qp[heads[rr], i, d]
                if a == 0.0:
                    continue
                prow = part[rr]
                arow = pab[rr]
                for jj in range(j0, n):
                    x = D.fma(a, row[jj], prow[jj])
                    prow[jj] = x
                    arow[jj] += abs(x)
        for rr in range(nh):
            srow = s[rr]
            brow = sab[rr]
            prow = part[rr]
            arow = pab[rr]
            for jj in range(j0, n):
                t = srow[jj] + prow[jj]
                srow[jj] = t
                brow[jj] += arow[jj] + abs(t)
                prow[jj] = 0.0
                arow[jj] = 0.0


@numba.jit(**_JIT)
def dot_error(sab, gdim, dim):
    """The bound of a blocked fma dot product's error from its magnitude sum ``sab``
    (:func:`_blocked_dots`): ``u sab`` times ``1 + gdim`` (gdim bounds the relative error of
    sab's own float sum) and ``2**-1074`` per rounding for results in the subnormal range."""
    tiny = (dim + dim // DOT_BLOCK + 4) * 2.0**-1074
    return (D.U * sab) * (1.0 + gdim) * D.BOUND_SAFETY + tiny


@numba.jit(**_JIT)
def _d_scores(b, i, heads, cols, ks, inputs, rule, work):
    """The scores (t, err) of row i of the planes (b, heads[rr]) over the listed keys ``cols``
    (``ks`` their exactness scales) in place of their dot products, each key's state (0
    excluded, 1 dropped, 2 kept), each row's maximum and whether a bias value is out of
    range: ``work`` = (s, err, state, bad, top)."""
    q, _, _, _, _, qs, _, _, keys_of, prm, kvh = inputs
    has_mask, has_bias, has_keep = rule[R_HAS_MASK], rule[R_HAS_BIAS], rule[R_HAS_KEEP]
    s, err, state, bad, top = work  # err holds the dot products' magnitude sums
    dim = q.shape[3]
    g = kvh[heads[0]]
    korig = keys_of[b, g]
    rule_arrays = has_mask or has_bias or has_keep
    for rr in range(heads.shape[0]):
        h = heads[rr]
        pr = prm[b, h]
        gdim = pr[P_GAMMA_DIM]
        if not rule_arrays and pr[P_SOFTCAP] <= 0.0 and pr[P_SLOPE] == 0.0:
            _plain_scores(qs[b, h, i], ks, pr, dim, (s[rr], err[rr], state[rr]))
            for jj in range(cols.shape[0]):  # the maximum in key order (its bits, as below)
                t = s[rr, jj]
                if t > top[rr]:
                    top[rr] = t
            continue
        for jj in range(cols.shape[0]):
            c = cols[jj]
            j = korig[c]
            st, bv = 2, 0.0
            if rule_arrays:
                st, bv = key_state(rule, b, h, i, j)
            state[rr, jj] = st
            if st == 0:
                continue
            if has_bias and not bias_in_range(bv):
                bad[rr] = True
            # an fma chain proven exact (exactness_scales) carries no error; else the dot
            # product's error bound from its magnitude sum (score_d's gamma |q| |k| <- 1 x 1)
            derr = 0.0
            if qs[b, h, i] * ks[jj] >= 2.0**52:
                derr = dot_error(err[rr, jj], gdim, dim)
            t, e = score_d(i, j, s[rr, jj], derr, 1.0, pr, bv, has_bias, 1.0)
            s[rr, jj], err[rr, jj] = t, e
            if t > top[rr]:
                top[rr] = t


@numba.jit(**_JIT)
def _plain_scores(qs_i, ks, pr, dim, row):
    """:func:`_d_scores` of one row without mask, bias, dropout, softcap or ALiBi (every
    listed key kept): the score and radius of
    :func:`refattn.exact.fast.forward_kernels.score_d` (with ``qn_i = derr``, ``kn_j = gdim
    = 1``: the same operations in the same order, so the same bits) in a loop without a
    reduction or a call (it vectorises); ``row`` = (s, err, state) of the row, s and err
    holding its dot products and magnitude sums on entry."""
    srow, erow, strow = row
    scale_hi = pr[P_SCALE_HI]
    c1 = abs(scale_hi)
    c2 = abs(pr[P_SCALE_LO]) + pr[P_SCALE_ERR]
    gdim = pr[P_GAMMA_DIM]
    u = 1.01 * D.U
    for jj in range(ks.shape[0]):
        exact = not qs_i * ks[jj] >= 2.0**52
        derr = 0.0 if exact else dot_error(erow[jj], gdim, dim)
        sj = srow[jj]
        t = sj * scale_hi
        erow[jj] = c1 * derr + (abs(sj) + derr) * c2 + u * abs(t)
        srow[jj] = t
        strow[jj] = 2


@numba.jit(**_JIT)
def exp_rel(rel, xe):
    """A bound on the relative error ``|e^/e^x - 1|`` of ``e^ = exp(x^) (1 + eta)``, ``|eta|
    <= rel`` (the exponential's own error), when ``|x - x^| <= xe <= 1``: ``e^{+-d} - 1``
    is at most ``d (1 + d)`` in magnitude for 0 <= d <= 1 (the exponential series), so the
    error is at most ``rel + xe (1 + xe) (1 + rel)``; the factor ``1 + RHO_MAX`` covers the
    roundings of this expression (+inf past xe = 1: the row is then undecided).

    >>> exp_rel(0.0, 0.5)
    0.7500007152557373
    """
    if not xe <= 1.0:
        return np.inf
    return (rel + xe * (1.0 + xe) * (1.0 + rel)) * (1.0 + RHO_MAX)


@numba.jit(**_JIT)
def _d_sums(vp, cols, nh, want_w, work, sums):
    """Z and N_e of each row over the listed keys in blocked sums (SUM_BLOCK listed keys per
    block: each block's sums are fma chains from +0 over its keys in order, then added to the
    totals), with the tiny terms' counts and rho, each key's e^_j and whether it enters N kept
    for the magnitude sums A_e = sum_j e^_j |v_je| (:func:`_d_finish` sums them where they are
    needed): ``sums`` = (z, zb, nsum, ex, asum, use, tiny, tiny_v, rho); ``vp`` the plane's
    gathered (U, E) values. Each row's terms are its own (:func:`_d_block_row`), so the rows
    of a block are taken one after the other."""
    z, zb, nsum, ex, _, use, _, _, _ = sums
    n = cols.shape[0]
    for rr in range(nh):  # blocked sums: gamma_{B + n/B}, not gamma_n
        for j0 in range(0, n, SUM_BLOCK):
            zb[rr] = _d_block_row(vp, cols, (j0, min(j0 + SUM_BLOCK, n), rr), want_w, work, sums)
            z[rr] += zb[rr]
    for j0 in range(0, n, SUM_BLOCK):
        sums_rows(vp, cols, j0, min(j0 + SUM_BLOCK, n), nh, ex, use, nsum)


@numba.jit(**_JIT)
def _d_block_row(vp, cols, at, want_w, work, sums):
    """Row rr's terms of the keys j0 <= jj < j1 (``at`` = (j0, j1, rr)) for :func:`_d_sums`:
    each key's e^_j = exp(s_j - top) and whether it enters N, the tiny terms and rho; returns
    the block's Z sum (from +0, in key order).

    A block whose keys are all kept and at or above CUT (and no weights asked) takes a loop
    without branches or calls (it vectorises), then sums its e^_j in order; rho is the
    largest :func:`exp_rel` of the keys' xe, and exp_rel(rel, .) is nondecreasing for xe >= 0
    (each of its roundings is a monotone map; +inf past 1), so ``exp_rel(rel, max xe)`` is
    that largest value, bit for bit. The same bits as the key-by-key loop, which the other
    blocks take."""
    j0, j1, rr = at
    s, err, state, _, top = work
    _, _, _, ex, _, use, tiny, tiny_v, rho = sums
    srow, erow, strow, exrow, urow = s[rr], err[rr], state[rr], ex[rr], use[rr]
    u = 1.01 * D.U
    t = top[rr]
    zb = 0.0
    plain = True
    for jj in range(j0, j1):  # branch-free (a conjunction: it vectorises)
        x = srow[jj] - t
        plain = plain & (strow[jj] == 2) & (x >= CUT) & (x <= 0.0)
    if plain and not want_w:  # x in [CUT, 0]: inside exp_d's domain, so exp_d_core's bits
        top_bits = 0  # the largest xe in [0, 1] by its bits (ordered as the values there)
        big = False
        for jj in range(j0, j1):
            x = srow[jj] - t
            xe = (erow[jj] + u * abs(x)) * D.BOUND_SAFETY  # >= +0 (or NaN)
            top_bits = max(top_bits, as_bits(xe))
            big = big | (not xe <= 1.0)  # NaN too: exp_rel is then +inf, as below
            exrow[jj] = D.exp_d_core(x)
            urow[jj] = True
        xm = np.inf if big else as_float(top_bits)
        rho[rr] = max(rho[rr], exp_rel(D.EXP_D_REL, xm))
        for jj in range(j0, j1):
            zb += exrow[jj]
        return zb
    vdim = vp.shape[1]
    for jj in range(j0, j1):
        urow[jj] = False
        exrow[jj] = 0.0
        if strow[jj] == 0:
            continue
        x = srow[jj] - t
        xe = (erow[jj] + u * abs(x)) * D.BOUND_SAFETY
        if want_w:
            srow[jj], erow[jj] = x, xe  # the shifted scores, kept for the weights
        if x < CUT:
            tiny[rr] += TINY
            if strow[jj] == 2:
                vrow = vp[cols[jj]]
                for e in range(vdim):
                    tiny_v[rr, e] += abs(vrow[e])
            continue
        rho[rr] = max(rho[rr], exp_rel(D.EXP_D_REL, xe))
        exrow[jj] = D.exp_d(x)
        zb += exrow[jj]
        urow[jj] = strow[jj] == 2
    return zb


@numba.jit(**_JIT)
def _magnitudes(vp, cols, wrow, use, arow):
    """``arow[e]`` = A_e of one row for every feature (the blocked sums of
    :func:`refattn.exact.fast.gather_lanes.weighted_block`, lane-wise; its N sums are
    discarded)."""
    n = cols.shape[0]
    scratch = np.zeros(vp.shape[1])
    for j0 in range(0, n, SUM_BLOCK):
        weighted_block(vp, cols, j0, min(j0 + SUM_BLOCK, n), wrow, use, scratch, arow)


@numba.jit(**_JIT)
def _d_finish(index, rr, cols, plane, work, sums, prm, target, results):
    """Status of row i of plane (b, h) (row rr of the work item) from its sums: out and lse
    rounded, and the weights scattered to the listed keys (the rest of the row stays +0);
    ``plane`` = (key positions (U,), values (U, E), their maxima (E,)) of its kv-head plane.

    The error of N_e is bounded by ``(gsum + rho) X_e`` with ``X_e = sum_j e_j |v_je|``:
    ``X_e <= (1 + rho)(1 + gsum) A_e`` (A_e the float blocked sum of e^_j |v_je|) or, without
    summing, ``X_e <= vmax_e sum_j e_j <= vmax_e Z^ / ((1 - rho)(1 - gsum))`` (Z^ the float
    sum of the keys' e^_j, vmax_e the plane's largest |v_je|). For a float32 target the
    outputs are first decided with the second; A_e is summed only for the features it leaves
    undecided (the decided values are the exact results rounded either way)."""
    b, h, i = index
    korig, vp, vmax = plane
    s, err, state, bad, top = work
    z, _, nsum, ex, asum, use, tiny, tiny_v, rho = sums
    if bad[rr]:
        return UNDECIDED
    if top[rr] == -np.inf:
        return EMPTY
    pr = prm[b, h]
    gsum = pr[P_GAMMA_SUM]
    u = 1.01 * D.U
    zr_ = z[rr]
    rho_r = rho[rr]
    tiny_r = tiny[rr]
    if pr[P_HAS_SINK] != 0.0:  # the sink's term enters Z after the keys' blocks (gsum counts it)
        x = pr[P_SINK] - top[rr]
        if x < CUT:
            tiny_r += TINY
        else:
            rho_r = max(rho_r, exp_rel(D.EXP_D_REL, u * abs(x) * D.BOUND_SAFETY))
            zr_ += D.exp_d(x)
    if not rho_r <= RHO_MAX:
        return UNDECIDED
    gg = gsum + rho_r
    zrad = (gg * zr_ * (1.0 + gsum) + tiny_r) * D.BOUND_SAFETY
    keep_one = pr[P_KEEP_HI] == 1.0 and pr[P_KEEP_LO] == 0.0 and pr[P_KEEP_ERR] == 0.0
    if _float32_out(target) and keep_one:
        loose = gg * (1.0 + 2.0 * gsum) * (1.0 + 2.0 * rho_r) * z[rr] * D.BOUND_SAFETY
        nr = loose * vmax * D.BOUND_SAFETY + TINY * tiny_v[rr]
        flags = np.zeros(nsum.shape[1], np.bool_)
        count = float32_outputs(index, (zr_, zrad), (nsum[rr], nr), results[0], flags)
        if count <= 0:
            return OK if count == 0 else UNDECIDED
        tight = gg * (1.0 + gsum) * (1.0 + rho_r) * D.BOUND_SAFETY
        for e in range(flags.shape[0]):
            if flags[e]:
                a = magnitude_sum(vp, cols, cols.shape[0], SUM_BLOCK, ex[rr], use[rr], e)
                nr[e] = tight * a * D.BOUND_SAFETY + TINY * tiny_v[rr, e]
        count = float32_outputs(index, (zr_, zrad), (nsum[rr], nr), results[0], flags)
        return OK if count == 0 else UNDECIDED
    _magnitudes(vp, cols, ex[rr], use[rr], asum[rr])
    # sum_j e_j |v_je| <= (1 + rho)(1 + gsum) A_e (A_e: the float blocked sum of e^_j |v_je|)
    nr = (gg * asum[rr] * (1.0 + gsum) * (1.0 + rho_r)) * D.BOUND_SAFETY + TINY * tiny_v[rr]
    zeros = np.zeros(nsum.shape[1])
    ok, lz_h, lz_l, lz_r = finish_row(
        index, top[rr], (zr_, 0.0, zrad), (nsum[rr], zeros, nr), pr, target, results
    )
    if ok and target[1]:
        n = cols.shape[0]
        shifted = (s[rr, :n], np.zeros(n), err[rr, :n])
        ok = _scatter_weights(
            index, cols, korig, state[rr, :n], shifted, (lz_h, lz_l, lz_r), target, results[2]
        )
    return OK if ok else UNDECIDED


@numba.jit(**_JIT)
def _float32_out(target):
    """Whether a target asks for the outputs alone, rounded to float32 (24 bits, emin -126)."""
    want_lse, want_w, p, emin, _ = target
    return not want_lse and not want_w and p == 24 and emin == -126


@numba.jit(**_JIT)
def _float32_one(n, zh, zr, zlow, nr):
    """(value, decided) of one output N / Z rounded to float32 (:func:`float32_outputs`)."""
    o = n / zh
    a = abs(o)
    rad = ((nr + a * 1.0000001 * zr) / zlow + 2.0**-52 * a) * D.BOUND_SAFETY
    wide = rad * (1.0 + 2.0**-50) + 2.0**-50 * a + 2.0**-1070
    lo = np.float32(o - wide)
    hi = np.float32(o + wide)
    same = (lo == hi) & (math.copysign(1.0, lo) == math.copysign(1.0, hi))
    return np.float64(lo), same & (abs(lo) < np.inf)


@numba.jit(**_JIT)
def float32_outputs(index, z, sums, out, flags):
    """The outputs ``out[b, h, i, e] = N_e / Z`` of a row rounded to float32 from double
    enclosures (``z`` = (Z^, radius), ``sums`` = (N^ (E,), radii (E,))), no keep scale, for
    the features e with ``flags[e]`` (all when none is set); sets ``flags[e]`` where the
    enclosure leaves it undecided and returns their count (-1, all flagged, when the radius
    of Z is not below Z^ / 2).

    ``o = fl(N^ / Z^)``: ``|N/Z - o| <= (r_N + |N^/Z^| r_Z) / (Z^ - r_Z) + u |o|`` (the
    bound of :func:`refattn.exact.fast.forward_kernels.finish_row` on a one-word quotient),
    the whole widened by BOUND_SAFETY for the roundings of its own evaluation. The ends
    ``o -+ w`` (w widened by ``2**-50 (|o| + w)`` more, which covers the rounding of each
    end, and 2**-1070 for the subnormal range) enclose the exact value; each end is rounded
    to float32 by the IEEE conversion (round to nearest, ties to even: a monotone map), so
    when both ends round to the same finite float32, signs of zero included, so does every
    value between them: that float32 is the exact result rounded once. No libm call."""
    b, h, i = index
    zh, zr = z
    ns, nr = sums
    if not zr < 0.5 * zh:
        flags[:] = True
        return -1
    zlow = zh - zr
    every = True
    for e in range(flags.shape[0]):
        every = every and not flags[e]
    count = 0
    for e in range(ns.shape[0]):
        if every or flags[e]:
            value, same = _float32_one(ns[e], zh, zr, zlow, nr[e])
            out[b, h, i, e] = value
            flags[e] = not same
            count += not same
    return count


@numba.jit(**_JIT)
def _scatter_weights(index, cols, korig, state, shifted, log_z, target, w):
    """The weights of the listed keys (:func:`refattn.exact.fast.forward_kernels.row_weights`
    on the row's list) written at their key positions; returns whether all are decided."""
    b, h, i = index
    n = cols.shape[0]
    row = np.zeros((1, 1, 1, n))
    ok = row_weights((0, 0, 0), 0, state, shifted, log_z, target, row)
    for jj in range(n):
        w[b, h, i, korig[cols[jj]]] = row[0, 0, 0, jj]
    return ok


@numba.jit(**_JIT)
def _d_dots(b, i, heads, cols, inputs, source, work):
    """The dot products and magnitude sums ``work`` = (s, sab) of row i of the planes (b,
    heads[rr]) with the listed keys ``cols``, read from the kv-head plane's own rows
    (:func:`refattn.exact.fast.gather_lanes.source_dots`); returns the keys' exactness scales,
    or an empty array when some key is out of the first steps' range (only looked at when
    ``source`` asks for the keys' facts: else they are the gathered ``ksu``)."""
    q, _, _, _, _, _, ksu, _, _, _, kvh = inputs
    src, rows, _, fused, fs, fab, fks, place = source
    g = kvh[heads[0]]
    n = cols.shape[0]
    ks = np.empty(n)
    if fs.shape[3] > 0:  # formed by decode_dots: read per head, per column
        for jj in range(n):
            ks[jj] = fks[b, g, cols[jj]]
        for rr in range(heads.shape[0]):
            p = place[heads[rr]]
            for jj in range(n):
                work[0][rr, jj] = fs[b, g, p, cols[jj]]
                work[1][rr, jj] = fab[b, g, p, cols[jj]]
        return ks
    ok = np.ones(n if fused else 0, np.bool_)
    if not fused:
        for jj in range(n):
            ks[jj] = ksu[b, g, cols[jj]]
    if n > 0:
        qh = np.empty((heads.shape[0], q.shape[3]))
        for rr in range(heads.shape[0]):
            qh[rr] = q[b, heads[rr], i]
        facts = (ok, ks if fused else ks[:0])
        source_dots(qh, src[b, g], rows[b, g], cols, DOT_BLOCK, work[0], work[1], facts)
    for jj in range(ok.shape[0]):
        if not ok[jj]:
            return ks[:0]
    return ks


@numba.jit(**_JIT)
def _d_item(item, inputs, lists, rule, target, results, source):
    """Double-precision step of query row ``item[1]`` of batch row ``item[0]`` for the
    ``item[2]`` query heads ``item[3:]`` of one kv head (which share its list and each load of
    the listed keys and values). When ``source`` asks for the keys' facts and some listed key
    is out of range, the kv-head plane is flagged (``source[2][b, g]``) and the rows are left
    undecided (the referee takes them, as a plane whose gathered keys failed the check)."""
    b, i, nh = item[0], item[1], item[2]
    heads = item[3 : 3 + nh]
    _, _, vu, _, _, _, _, vmaxu, keys_of, prm, kvh = inputs
    g = kvh[heads[0]]
    cols = _row_columns(b, g, i, lists, keys_of, rule)
    n = cols.shape[0]
    vdim = vu.shape[3]
    s = np.zeros((nh, n))
    sab = np.zeros((nh, n))
    ks = _d_dots(b, i, heads, cols, inputs, source, (s, sab))
    status = results[3]
    if ks.shape[0] != n:
        source[2][b, g] = True
        for rr in range(nh):
            status[b, heads[rr], i] = UNDECIDED
        return
    work = (
        s,
        sab,
        np.zeros((nh, n), np.int8),
        np.zeros(nh, np.bool_),
        np.full(nh, -np.inf),
    )
    _d_scores(b, i, heads, cols, ks, inputs, rule, work)
    top = work[4]
    for rr in range(nh):
        pr = prm[b, heads[rr]]
        if pr[P_HAS_SINK] != 0.0:  # the sink: one more logit in the max and in Z, no value
            top[rr] = max(top[rr], pr[P_SINK])
    sums = (
        np.zeros(nh),
        np.zeros(nh),
        np.zeros((nh, vdim)),
        np.zeros((nh, n)),
        np.zeros((nh, vdim)),
        np.zeros((nh, n), np.bool_),
        np.zeros(nh),
        np.zeros((nh, vdim)),
        np.zeros(nh),
    )
    _d_sums(vu[b, g], cols, nh, target[1], work, sums)
    for rr in range(nh):
        h = heads[rr]
        plane = (keys_of[b, g], vu[b, g], vmaxu[b, g])
        status[b, h, i] = _d_finish((b, h, i), rr, cols, plane, work, sums, prm, target, results)


@numba.jit(**_PAR)
def gather_d(items, inputs, lists, rule, target, results, source):
    """Double-precision step (targets of at most 24 bits) over ``items`` ((n, 3 + HEAD_BLOCK):
    b, i, head count, heads of one kv head), in parallel.

    ``inputs`` = (q (B, H, L, D), kTu (B, K, D, U), vu (B, K, U, E) (the gathered keys and
    values), qn, knu (row norms), qs, ksu (exactness scales), vmaxu (B, K, E), keys_of
    (B, K, U) (the key position of each gathered column), prm (B, H, 16), kv_head (H,));
    ``lists`` = (local (B, K, L, T) columns of each row's distinct listed keys, ascending,
    counts (B, K, L)); ``rule``, ``target``, ``results``: as
    :func:`refattn.exact.fast.forward_kernels.forward_dd`; ``source`` = (key rows (B, K, S',
    D) float32 or float64, the row of each gathered column (B, K, U), flags (B, K) bool,
    facts): the dot products read the keys from those rows (no gathered float64 copy), and
    with ``facts`` each item forms its keys' range checks and exactness scales in the same
    pass and flags the kv-head planes with a key out of range (the gathered ``kTu``, ``knu``,
    ``ksu`` are then not read, nor filled),
    then the ``formed`` arrays s, sab (B, K, G, U), scales (B, K, U), place (H,) (each
    head's row in its group)): when they are not empty, the items read the dot products,
    magnitude sums and keys' scales that :func:`decode_dots` formed (the same bits) instead
    of forming them."""
    for r in prange(items.shape[0]):
        _d_item(items[r], inputs, lists, rule, target, results, source)


@numba.jit(**_JIT)
def _decode_task(task, q, group, source, values, formed):
    """:func:`decode_dots` of one task: columns ``task[2]:task[3]`` of kv-head plane
    (``task[0]``, ``task[1]``)."""
    b, g, c0, c1 = task[0], task[1], task[2], task[3]
    src, rows = source[0], source[1]
    vsrc, vrows, vu, vmax, vok = values
    fs, fab, fks, fok = formed
    heads = group[g]
    nh = 0
    while nh < heads.shape[0] and heads[nh] >= 0:
        nh += 1
    qh = np.empty((nh, q.shape[3]))
    for rr in range(nh):
        qh[rr] = q[b, heads[rr], 0]
    cols = np.arange(c0, c1)
    facts = (fok[b, g], fks[b, g])
    source_span(qh, src[b, g], rows[b, g], cols, c0, DOT_BLOCK, fs[b, g], fab[b, g], facts)
    vok[task[4]] = value_rows(vsrc[b, g], vrows[b, g, c0:c1], vu[b, g, c0:c1], vmax[task[4]])


@numba.jit(**_PAR)
def decode_dots(tasks, q, group, source, values, formed):
    """The first part of a decode step (query row 0) by spans of each kv-head plane's
    gathered columns, in parallel: ``tasks`` (n, 5) = (b, g, first column, end column, task
    number); each task forms, for its columns, the dot products and magnitude sums of every
    query head of the plane (``group`` (K, G): the heads of each kv head, -1 after them),
    the keys' range checks and exactness scales
    (:func:`refattn.exact.fast.gather_lanes.source_span`: each key's panel built once for
    all the heads) and the gathered values with their range
    check and their maxima (:func:`refattn.exact.fast.gather_lanes.value_rows`).

    ``source`` as :func:`gather_d`; ``values`` = (value rows (B, K, S', E), the row of each
    gathered column (B, K, U), vu (B, K, U, E), per task maxima (n, E) and range checks
    (n,)); ``formed`` = (s, sab (B, K, G, U), scales (B, K, U), ok (B, K, U)). Each element
    is the same operations as in :func:`gather_d`'s own pass (a key's lanes, a value's
    widening): the same bits for any split and thread count; the maxima of the tasks are
    combined by the host (a maximum: any order)."""
    for t in prange(tasks.shape[0]):
        _decode_task(tasks[t], q, group, source, values, formed)


#: :func:`gather_d` compiled without threads (the same loop body and bits), for the small
#: steps that run on the calling thread alone (a cache entry of its own:
#: :func:`refattn._numba_cache.serial_twin`).
gather_d_serial = serial_twin(gather_d, _JIT)

#: :func:`decode_dots` compiled without threads (the same loop body and bits), for the decode
#: steps whose first pass runs on the calling thread alone.
decode_dots_serial = serial_twin(decode_dots, _JIT)

#: The public names of the pieces the double-double step
#: (:mod:`refattn.exact.fast.gather_dd`) shares with the double-precision step.
row_columns = _row_columns
float32_out = _float32_out
scatter_weights = _scatter_weights
