"""The sparse-key (gather) forward of the Numba CPU kernels (:mod:`.numba_cpu`).

With ``key_indices`` under the set reading (docs/conventions.md, "Sparse key indices") query
row i of kv head g may attend to the set ``I_{b,g,i}`` of its listed keys only. Instead of a
dense (B, K, L, S) mask and a walk over all S keys, each work unit (batch, kv head, query row,
block of up to ``BLOCK_Q`` query heads of the group, :func:`head_block`) visits the row's
listed keys alone: the list, sorted once on the host, is read in increasing key order with the
entries < 0, the repeated ones and those outside the row's structural interval ``[lo, hi)``
(:func:`refattn.spec.key_interval`) skipped. The listed key and value rows are read where
they lie (no gathered copy; a value that is the leading E features of the key, MLA's absorbed
form, is read from the key rows), and every query head of the unit shares each key row
(:mod:`._cpu_gather_tiles`: 4-head x 4-key register tiles of dot products, 4-head x 4-vector
tiles of the weighted value sum). The rest of the allowed set (mask, -inf bias) and the
optional terms are applied per gathered position exactly as
:func:`~refattn.kernels._cpu_scores.finish_scores` applies them. The row's T' <= T scores are
all held, so the softmax takes two passes and no rescaling (Milakov & Gimelshein 2018,
Algorithm 2, the safe softmax):

.. math::

    m = \\max_{j \\in I} s_j, \\qquad \\ell = \\sum_{j \\in I} e^{s_j - m}, \\qquad
    o = \\frac{\\kappa}{\\ell} \\sum_{j \\in I} e^{s_j - m} v_j

(kappa = 1/(1-p) under dropout). Memory: the sorted (B, K, L, T) lists and per unit the
scores and weights of its heads, O(H T) for a decode step; work O(H L T (D + E)).

Determinism: every reduction runs in an order fixed by the listed keys (increasing key
index) and the shapes (:mod:`._cpu_gather_tiles`): bit-identical for any number of threads
and any head blocking. The order differs from the dense kernels' (which add the keys of
64-key blocks of all S keys), so the two paths agree within
:func:`refattn.bounds.kernels.online_forward_bound` (no rescaling here: n_b = 0 suffices),
not bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, parallel_chunksize, prange

from ._args import (
    DIM_BATCH,
    DIM_DIM,
    DIM_HEADS,
    DIM_KV_HEADS,
    DIM_LENGTH,
    DIM_VDIM,
    FOPT_KEEP_SCALE,
    FOPT_NEG_INF,
    FOPT_SCALE,
    FOPT_SOFTCAP,
    OPT_EMPTY_ROWS_NAN,
    OPT_HAS_ALIBI,
    OPT_HAS_BIAS,
    OPT_HAS_DROPOUT,
    OPT_HAS_MASK,
    OPT_HAS_SOFTCAP,
    OPT_OFFSET,
    TERM_BIAS,
    TERM_BIAS_STRIDES,
    TERM_DROP,
    TERM_DROP_STRIDES,
    TERM_MASK,
    TERM_MASK_STRIDES,
    TERM_SLOPES,
)
from ._cpu_gather_tiles import lanes_const, raw_scores, weighted_rows
from ._cpu_scores import row_interval
from ._cpu_tiles import BLOCK_Q, row_max
from ._simd import (
    KERNEL_OPTIONS,
    fma,
    lanes,
    vadd,
    vbest,
    vexp,
    vload,
    vmax,
    vmuls,
    vstore,
    vsubs,
    vsum,
    vzero,
)

__all__ = ["gather_forward", "listed_top", "row_keys", "sorted_indices"]

_OPTS = KERNEL_OPTIONS


def sorted_indices(indices) -> np.ndarray:
    """The (B, K, L, T) index lists sorted along T (int64, C order): repeated entries are then
    adjacent and the ignored ones (< 0) first, so a kernel reads the set in one pass.

    Examples
    --------
    >>> sorted_indices(np.array([[[[3, -1, 1, 3]]]])).tolist()
    [[[[-1, 1, 3, 3]]]]
    """
    return np.sort(np.asarray(indices, np.int64), axis=-1)


@njit(**_OPTS)
def row_keys(listed, lo, hi, cols):
    """cols[:n] = the distinct entries of the sorted ``listed`` inside [lo, hi) (lo >= 0, so
    the ignored entries < 0 drop out), in increasing order; returns n."""
    count = 0
    last = np.int64(-1)
    for t in range(listed.shape[0]):
        j = listed[t]
        if j < lo or j >= hi or j == last:
            continue
        cols[count] = j
        count += 1
        last = j
    return count


@njit(**_OPTS)
def _gathered_scores(s, heads, nc, i, b, cols, c0, opts, fopts, terms):
    """Final scores of the gathered tile in place (the order and arithmetic of
    :func:`~refattn.kernels._cpu_scores.finish_scores`: scale -> softcap -> + bias -> +
    ALiBi -> mask), -inf at excluded positions and past ``nc``; row r is query head
    ``heads[r]`` at row i. Returns True when no gathered position is excluded."""
    bias, bstr = terms[TERM_BIAS], terms[TERM_BIAS_STRIDES]
    mask, mstr, slopes = terms[TERM_MASK], terms[TERM_MASK_STRIDES], terms[TERM_SLOPES]
    has_softcap, has_bias = opts[OPT_HAS_SOFTCAP] != 0, opts[OPT_HAS_BIAS] != 0
    has_mask, has_alibi = opts[OPT_HAS_MASK] != 0, opts[OPT_HAS_ALIBI] != 0
    scale, cap, neg_inf = fopts[FOPT_SCALE], fopts[FOPT_SOFTCAP], fopts[FOPT_NEG_INF]
    offset = opts[OPT_OFFSET]
    clean = True
    for r in range(heads.shape[0]):
        h = heads[r]
        row = s[r]
        slope = slopes[h] if has_alibi else 0.0
        for c in range(row.shape[0]):
            if c >= nc:
                row[c] = neg_inf
                continue
            j = cols[c0 + c]
            allowed = True
            if has_mask:
                allowed = mask[mstr[0] * b + mstr[1] * h + mstr[2] * i + mstr[3] * j] != 0
            t = -np.inf
            if allowed:
                t = row[c] * scale
                if has_softcap:
                    t = cap * math.tanh(t / cap)
                if has_bias:
                    bv = bias[bstr[0] * b + bstr[1] * h + bstr[2] * i + bstr[3] * j]
                    if bv == -np.inf:
                        allowed = False
                        t = -np.inf
                    else:
                        t = t + bv
                if allowed and has_alibi:
                    t = t - slope * abs(i + offset - j)
            clean &= allowed
            row[c] = t
    return clean


@njit(**_OPTS)
def _softmax_rows(s, p, rows, m, total):
    """p = exp(s - m) per row with m the row's maximum (NaN skipped) and total the lane sum
    of p in :func:`~refattn.kernels._cpu_tiles.row_sum`'s order; an empty row (m = -inf)
    gets p = 0, total = 0. ``s`` is padded with -inf to whole vectors."""
    width = lanes_const(s)
    for r in range(rows):
        row = s[r]
        prow = p[r]
        top = row_max(row, row.shape[0])
        m[r] = top
        if top == -np.inf:
            prow[:] = 0
            total[r] = 0
            continue
        part = vzero(prow)
        for c in range(0, row.shape[0], width):
            e = vexp(vsubs(vload(row, c), top))
            vstore(prow, c, e)
            part = vadd(part, e)
        total[r] = vsum(part)


@njit(**_OPTS)
def _accumulate_kept(s, p, vp, where, terms, vdim, acc):
    """acc[r, :] = sum over the kept positions c of p[r, c] vp[cols[c], :] (c increasing,
    one fused multiply-add per term, as :func:`~._cpu_gather_tiles.weighted_rows`), skipping
    the excluded (-inf score) and dropped positions, so that NaN/Inf there cannot reach the
    output. ``where`` = (b, i, heads, cols, count, has_drop)."""
    b, i, heads, cols, count, has_drop = where
    drop, dstr = terms[TERM_DROP], terms[TERM_DROP_STRIDES]
    acc[:] = 0
    for r in range(heads.shape[0]):
        h = heads[r]
        arow = acc[r]
        for c in range(count):
            if s[r, c] == -np.inf:
                continue
            j = cols[c]
            if has_drop and drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * j] == 0:
                continue
            w = p[r, c]
            vrow = vp[j]
            for e in range(vdim):
                arow[e] = fma(w, vrow[e], arow[e])


@njit(**_OPTS)
def _write_rows(b, i, heads, state, opts, fopts, vdim, out, lse):
    """out[b, h, i] = acc / total * keep_scale and lse = m + log(total) of each row of the
    unit; empty rows follow ``empty_rows`` (0 and -inf, or NaN)."""
    m, total, acc = state
    nan_rows = opts[OPT_EMPTY_ROWS_NAN] != 0
    keep_scale = fopts[FOPT_KEEP_SCALE]
    for r in range(heads.shape[0]):
        h = heads[r]
        orow = out[b, h, i]
        if m[r] == -np.inf:
            fill = np.nan if nan_rows else 0.0
            for e in range(vdim):
                orow[e] = fill
            lse[b, h, i] = np.nan if nan_rows else -np.inf
            continue
        inv = keep_scale / total[r]
        for e in range(vdim):
            orow[e] = acc[r, e] * inv
        lse[b, h, i] = m[r] + math.log(total[r])


@njit(**_OPTS)
def _gather_unit(q, kp, vp, heads, listed, b, i, dims, opts, fopts, terms, results):
    """One (batch, kv head, query row, block of the group's query heads ``heads``): the row's
    listed keys ``listed`` (sorted, :func:`sorted_indices`) read in place from ``kp``, ``vp``
    (the kv head's (S, D) and (S, >= E) rows); ``results`` = (out, lse)."""
    out, lse = results
    dim, vdim = dims[DIM_DIM], dims[DIM_VDIM]
    rows = heads.shape[0]
    width = lanes(q)
    lo, hi = row_interval(i, dims, opts)
    cols = np.empty(listed.shape[0], np.int64)
    count = row_keys(listed, lo, hi, cols)
    cpad = max(width, -(-count // width) * width)
    qt = np.empty((rows, dim), q.dtype)
    for r in range(rows):
        qt[r] = q[b, heads[r], i]
    s = np.empty((rows, cpad), q.dtype)
    raw_scores(qt, kp, cols, count, rows, s)
    clean = _gathered_scores(s, heads, count, i, b, cols, 0, opts, fopts, terms)
    p = np.empty((rows, cpad), q.dtype)
    state = (np.empty(rows, q.dtype), np.empty(rows, q.dtype), np.empty((rows, vdim), q.dtype))
    _softmax_rows(s, p, rows, state[0], state[1])
    has_drop = opts[OPT_HAS_DROPOUT] != 0
    if clean and not has_drop:  # every listed position allowed: the tile product
        weighted_rows(p, vp, cols, count, rows, vdim, state[2])
    else:
        where = (b, i, heads, cols, count, has_drop)
        _accumulate_kept(s, p, vp, where, terms, vdim, state[2])
    _write_rows(b, i, heads, state, opts, fopts, vdim, out, lse)


@njit(parallel=True, **_OPTS)
def _gather_units(q, k, v, group_heads, listed, dims, opts, fopts, terms, out, lse, block):
    """Every (batch, kv head, query row, block of ``block`` query heads) unit, in parallel
    (one unit per task)."""
    batch, kv_heads, length = dims[DIM_BATCH], dims[DIM_KV_HEADS], dims[DIM_LENGTH]
    group = group_heads.shape[1]
    nhb = -(-group // block)
    for unit in prange(batch * kv_heads * length * nhb):
        b = unit // (kv_heads * length * nhb)
        g = (unit // (length * nhb)) % kv_heads
        i = (unit // nhb) % length
        t0 = (unit % nhb) * block
        heads = group_heads[g, t0 : min(group, t0 + block)]
        _gather_unit(
            q, k[b, g], v[b, g], heads, listed[b, g, i], b, i, dims, opts, fopts, terms, (out, lse)
        )


def gather_forward(listed, q, k, v, kv_head, dims, opts, fopts, terms, out, lse):
    """Run the gather forward into ``out`` (B, H, L, E) and ``lse`` (B, H, L): ``listed`` the
    (B, K, L, T) lists from :func:`sorted_indices`, the rest
    :func:`~refattn.kernels._args.kernel_arguments`."""
    heads, kv_heads = int(dims[DIM_HEADS]), int(dims[DIM_KV_HEADS])
    # row g: the query heads of kv head g in increasing order (every group has H / K heads)
    group_heads = np.argsort(kv_head, kind="stable").reshape(kv_heads, heads // kv_heads)
    block = head_block(int(dims[DIM_BATCH]) * kv_heads * int(dims[DIM_LENGTH]), heads // kv_heads)
    with parallel_chunksize(1):
        _gather_units(q, k, v, group_heads, listed, dims, opts, fopts, terms, out, lse, block)


@njit(**_OPTS)
def _row_top(row, minus_one, best):
    """max(best, |x|) over the entries x of a contiguous row (NaN skipped; Inf kept);
    ``minus_one`` is -1 in the row's dtype."""
    width = lanes_const(row)
    whole = row.shape[0] - row.shape[0] % width
    acc = vzero(row)
    for x in range(0, whole, width):
        value = vload(row, x)
        acc = vmax(acc, vmax(value, vmuls(value, minus_one)))
    best = max(best, vbest(acc))
    for x in range(whole, row.shape[0]):
        if abs(row[x]) > best:
            best = abs(row[x])
    return best


@njit(**_OPTS)
def listed_top(k, listed, minus_one):
    """max |k[b, g, j, x]| over the rows j in [0, S) that ``listed`` (B, K, L, T) names for
    (b, g), NaN skipped (Inf is returned as Inf): what the gather forward reads of k. Rows are
    read once per listing, without a gathered copy (k's feature axis contiguous); ``minus_one``
    is -1 in k's dtype."""
    keys = k.shape[2]
    best = 0.0
    rows = np.empty(listed.shape[3], np.int64)
    for b in range(listed.shape[0]):
        for g in range(listed.shape[1]):
            kb = k[b, g]
            for i in range(listed.shape[2]):
                count = 0
                for t in range(listed.shape[3]):
                    j = listed[b, g, i, t]
                    if 0 <= j < keys:
                        rows[count] = j
                        count += 1
                full = count - count % 4
                for t in range(0, full, 4):  # four rows at once: four misses in flight
                    r0, r1, r2, r3 = kb[rows[t]], kb[rows[t + 1]], kb[rows[t + 2]], kb[rows[t + 3]]
                    best = _rows_top4(r0, r1, r2, r3, minus_one, best)
                for t in range(full, count):
                    best = _row_top(kb[rows[t]], minus_one, best)
    return best


@njit(**_OPTS)
def _rows_top4(r0, r1, r2, r3, minus_one, best):
    """:func:`_row_top` of four rows read side by side (the maximum is order-free)."""
    width = lanes_const(r0)
    whole = r0.shape[0] - r0.shape[0] % width
    a0 = a1 = vzero(r0)
    for x in range(0, whole, width):
        v0, v1, v2, v3 = vload(r0, x), vload(r1, x), vload(r2, x), vload(r3, x)
        a0 = vmax(a0, vmax(vmax(v0, vmuls(v0, minus_one)), vmax(v1, vmuls(v1, minus_one))))
        a1 = vmax(a1, vmax(vmax(v2, vmuls(v2, minus_one)), vmax(v3, vmuls(v3, minus_one))))
    best = max(best, vbest(vmax(a0, a1)))
    for row in (r0, r1, r2, r3):
        for x in range(whole, row.shape[0]):
            if abs(row[x]) > best:
                best = abs(row[x])
    return best


#: Below this many (batch, kv head, query row) units, the query heads of a group are split
#: into blocks (at least :data:`SMALL_HEAD_BLOCK` heads, about :data:`FEW_TASKS` tasks) so
#: that a decode step (one row, one latent head, 16-128 query heads) has work for every
#: thread while each task still shares every listed key row among several heads.
FEW_UNITS = 16
SMALL_HEAD_BLOCK = 8
FEW_TASKS = 8


def head_block(units: int, group: int) -> int:
    """Query heads per task, fixed by the shapes alone (never by the thread count). Each
    head's scores, softmax and sums are the same operations in any block (the 4-row tiles and
    the single rows of :mod:`._cpu_gather_tiles` give the same bits per element), so the
    blocking changes no bit, only the parallelism.

    Examples
    --------
    >>> head_block(units=1, group=16), head_block(units=1, group=128)
    (8, 16)
    >>> head_block(units=4096, group=16)
    64
    """
    if units < FEW_UNITS and group > SMALL_HEAD_BLOCK:
        per_task = -(-group // FEW_TASKS)
        return min(BLOCK_Q, max(SMALL_HEAD_BLOCK, -(-per_task // 2) * 2))
    return BLOCK_Q
