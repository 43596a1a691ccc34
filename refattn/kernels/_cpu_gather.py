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

A call with few units and many query heads per kv head (:func:`wide_units`: a DeepSeek Sparse
Attention decode step, H 128, K 1, L 1) runs its units one at a time with all the heads of
the group together and the work split inside the unit (:func:`_gather_wide`): the scores by
spans of listed keys (each key row loaded once and dotted with every head's query), the
softmax by blocks of heads, the weighted value sums by column tiles (each value slice read
once per span of keys for every head). Per-task head blocks would read every listed row once
per block instead.

Determinism: every reduction runs in an order fixed by the listed keys (increasing key
index) and the shapes (:mod:`._cpu_gather_tiles`): bit-identical for any number of threads,
any head blocking and either way of splitting the work (the split only decides which thread
computes an element). The order differs from the dense kernels' (which add the keys of
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
from ._cpu_gather_tiles import (
    KEY_CHUNK,
    lanes_const,
    raw_scores,
    row_top,
    rows_top4,
    score_span,
    weighted_rows,
    weighted_span,
    weighted_tail,
)
from ._cpu_scores import row_interval
from ._cpu_tiles import BLOCK_Q, row_max
from ._simd import (
    KERNEL_OPTIONS,
    fma,
    lanes,
    vadd,
    vexp,
    vload,
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
    if not (has_softcap or has_bias or has_mask or has_alibi):
        _scaled_rows(s, heads.shape[0], nc, scale, neg_inf)
        return True
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
def _scaled_rows(s, rows, nc, scale, neg_inf):
    """s[r, c] = s[r, c] * scale for c < nc and -inf past it (rows < ``rows``): the scores of
    :func:`_gathered_scores` without optional terms, a vector at a time (the same products)."""
    width = lanes_const(s)
    whole = nc - nc % width
    for r in range(rows):
        row = s[r]
        for c in range(0, whole, width):
            vstore(row, c, vmuls(vload(row, c), scale))
        for c in range(whole, nc):
            row[c] = row[c] * scale
        for c in range(nc, row.shape[0]):
            row[c] = neg_inf


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
    (the kv head's (S, D) and (S, >= E) rows); ``results`` = (out, lse). Returns max |x| over
    the key rows it read (:func:`listed_top`'s reading; ``minus_one`` -1 in their dtype)."""
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
    top = raw_scores(qt, kp, cols, count, rows, s, np.full(1, -1, q.dtype)[0])
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
    return top


@njit(parallel=True, **_OPTS)
def _gather_units(q, k, v, group_heads, listed, dims, opts, fopts, terms, results, tops, block):
    """Every (batch, kv head, query row, block of ``block`` query heads) unit, in parallel
    (one unit per task); ``results`` = (out, lse); tops[unit] the largest |x| of the key rows
    that the unit read (an argument of its own: written in the loop body, an array unpacked
    from a tuple kept its zeros)."""
    out, lse = results
    batch, kv_heads, length = dims[DIM_BATCH], dims[DIM_KV_HEADS], dims[DIM_LENGTH]
    group = group_heads.shape[1]
    nhb = -(-group // block)
    for unit in prange(batch * kv_heads * length * nhb):
        b = unit // (kv_heads * length * nhb)
        g = (unit // (length * nhb)) % kv_heads
        i = (unit // nhb) % length
        t0 = (unit % nhb) * block
        heads = group_heads[g, t0 : min(group, t0 + block)]
        tops[unit] = _gather_unit(
            q, k[b, g], v[b, g], heads, listed[b, g, i], b, i, dims, opts, fopts, terms, (out, lse)
        )


@njit(**_OPTS)
def _wide_rows(s, p, heads, r0, r1, where, opts, fopts, terms, state):
    """Heads [r0, r1) of a wide unit: final scores (:func:`_gathered_scores`) and the
    softmax weights (:func:`_softmax_rows`); returns whether none of their positions is
    excluded. ``where`` = (b, i, cols, count)."""
    b, i, cols, count = where
    m, total = state
    part = s[r0:r1]
    clean = _gathered_scores(part, heads[r0:r1], count, i, b, cols, 0, opts, fopts, terms)
    _softmax_rows(part, p[r0:r1], r1 - r0, m[r0:r1], total[r0:r1])
    return clean


@njit(parallel=True, **_OPTS)
def _gather_wide(q, k, v, group_heads, listed, dims, opts, fopts, terms, results, tops):
    """Every (batch, kv head, query row) unit in turn, each with all the query heads of its
    group at once and the work split inside it (the few-unit decode step): the scores by
    spans of :data:`~._cpu_gather_tiles.KEY_CHUNK` listed keys (each key row read once for
    all the heads), the softmax by blocks of :data:`SMALL_HEAD_BLOCK` heads, the weighted
    value sums by 4-vector column tiles (each value slice read once per span of keys for all
    the heads). Every element gets the operations of :func:`_gather_unit` (the same bits):
    the split decides only which thread computes it. ``results`` = (out, lse); tops[span]
    the largest |x| of the key rows read by the span (over all the units)."""
    out, lse = results
    tops[:] = 0
    minus_one = np.full(1, -1, q.dtype)[0]
    batch, kv_heads, length = dims[DIM_BATCH], dims[DIM_KV_HEADS], dims[DIM_LENGTH]
    dim, vdim = dims[DIM_DIM], dims[DIM_VDIM]
    group = group_heads.shape[1]
    width = lanes(q)
    tile = 4 * width
    has_drop = opts[OPT_HAS_DROPOUT] != 0
    nblocks = -(-group // SMALL_HEAD_BLOCK)
    for unit in range(batch * kv_heads * length):
        b = unit // (kv_heads * length)
        g = (unit // length) % kv_heads
        i = unit % length
        heads, kp, vp = group_heads[g], k[b, g], v[b, g]
        lo, hi = row_interval(i, dims, opts)
        cols = np.empty(listed.shape[3], np.int64)
        count = row_keys(listed[b, g, i], lo, hi, cols)
        cpad = max(width, -(-count // width) * width)
        qt = np.empty((group, dim), q.dtype)
        for r in range(group):
            qt[r] = q[b, heads[r], i]
        s = np.empty((group, cpad), q.dtype)
        for span in prange(-(-count // KEY_CHUNK)):
            c0 = span * KEY_CHUNK
            c1 = min(count, c0 + KEY_CHUNK)
            top = score_span(qt, kp, cols, c0, c1, group, s, minus_one, 0.0)
            tops[span] = max(tops[span], top)
        p = np.empty((group, cpad), q.dtype)
        state = (np.empty(group, q.dtype), np.empty(group, q.dtype))
        clean = np.empty(nblocks, np.bool_)
        for blk in prange(nblocks):
            r0 = blk * SMALL_HEAD_BLOCK
            r1 = min(group, r0 + SMALL_HEAD_BLOCK)
            clean[blk] = _wide_rows(
                s, p, heads, r0, r1, (b, i, cols, count), opts, fopts, terms, state
            )
        acc = np.empty((group, vdim), q.dtype)
        if clean.all() and not has_drop:
            for e in prange(vdim // tile):
                weighted_span(p, vp, cols, count, group, e * tile, acc)
            weighted_tail(p, vp, cols, count, group, vdim, acc)
        else:
            for blk in prange(nblocks):
                r0 = blk * SMALL_HEAD_BLOCK
                r1 = min(group, r0 + SMALL_HEAD_BLOCK)
                where = (b, i, heads[r0:r1], cols, count, has_drop)
                _accumulate_kept(s[r0:r1], p[r0:r1], vp, where, terms, vdim, acc[r0:r1])
        _write_rows(b, i, heads, (state[0], state[1], acc), opts, fopts, vdim, out, lse)


def gather_forward(listed, q, k, v, kv_head, dims, opts, fopts, terms, out, lse):
    """Run the gather forward into ``out`` (B, H, L, E) and ``lse`` (B, H, L): ``listed`` the
    (B, K, L, T) lists from :func:`sorted_indices`, the rest
    :func:`~refattn.kernels._args.kernel_arguments`. Returns max |x| over the key rows read
    (NaN skipped, Inf kept: :func:`listed_top`'s reading of the rows inside each query row's
    interval), what the range check of a plain call needs."""
    heads, kv_heads = int(dims[DIM_HEADS]), int(dims[DIM_KV_HEADS])
    # row g: the query heads of kv head g in increasing order (every group has H / K heads)
    group_heads = np.argsort(kv_head, kind="stable").reshape(kv_heads, heads // kv_heads)
    units = int(dims[DIM_BATCH]) * kv_heads * int(dims[DIM_LENGTH])
    with parallel_chunksize(1):
        if wide_units(units, heads // kv_heads):
            tops = np.empty(max(1, -(-listed.shape[3] // KEY_CHUNK)), q.dtype)
            results = (out, lse)
            _gather_wide(q, k, v, group_heads, listed, dims, opts, fopts, terms, results, tops)
        else:
            block = head_block(units, heads // kv_heads)
            tops = np.zeros(units * -(-(heads // kv_heads) // block), q.dtype)
            args = (group_heads, listed, dims, opts, fopts, terms, (out, lse), tops, block)
            _gather_units(q, k, v, *args)
    return float(tops.max())


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
                    best = rows_top4(r0, r1, r2, r3, minus_one, best)
                for t in range(full, count):
                    best = row_top(kb[rows[t]], minus_one, best)
    return best


#: Below this many (batch, kv head, query row) units, the query heads of a group are split
#: into blocks (at least :data:`SMALL_HEAD_BLOCK` heads, about :data:`FEW_TASKS` tasks) so
#: that a decode step (one row, one latent head, 16-128 query heads) has work for every
#: thread while each task still shares every listed key row among several heads.
FEW_UNITS = 16
SMALL_HEAD_BLOCK = 8
FEW_TASKS = 8
#: From this many query heads per kv head on, a few-unit call runs :func:`_gather_wide`.
WIDE_GROUP = 64


def wide_units(units: int, group: int) -> bool:
    """Whether the gather forward runs its units one at a time with all the heads of a group
    together and the work split inside each unit (:func:`_gather_wide`): few units, many
    heads sharing each key list (a decode step: with head blocks of 16 heads, H 128 would read
    every listed key and value row 8 times). Below :data:`WIDE_GROUP` heads the head blocks
    of :func:`head_block` are kept (one parallel region per call instead of three). Fixed by
    the shapes alone.

    Examples
    --------
    >>> wide_units(units=1, group=128), wide_units(units=1, group=16)
    (True, False)
    """
    return units < FEW_UNITS and group >= WIDE_GROUP


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
