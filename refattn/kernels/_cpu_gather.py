"""The sparse-key (gather) forward of the Numba CPU kernels (:mod:`.numba_cpu`).

With ``key_indices`` under the set reading (docs/conventions.md, "Sparse key indices") query
row i of kv head g may attend to the set ``I_{b,g,i}`` of its listed keys only. Instead of a
dense (B, K, L, S) mask and a walk over all S keys, each work unit (batch, kv head, query row,
block of up to ``BLOCK_Q`` query heads of the group) visits the row's listed keys alone: the
list, sorted once on the host, is read in increasing key order with the entries < 0, the
repeated ones and those outside the row's structural interval ``[lo, hi)``
(:func:`refattn.spec.key_interval`) skipped; blocks of ``BLOCK_K`` of those keys are gathered
into the same K^T and V tiles as the dense kernels use, and every query head of the group at
row i shares each gathered block (one tile of up to 64 rows). The rest of the allowed set
(mask, -inf bias) and the optional terms are applied per gathered position exactly as
:func:`~refattn.kernels._cpu_scores.finish_scores` applies them, and the online softmax
(Milakov & Gimelshein 2018, Algorithm 3) streams over the gathered blocks:

.. math::

    m^{(t)} = \\max(m^{(t-1)}, \\max_{j \\in J_t} s_j), \\qquad
    \\ell^{(t)} = \\ell^{(t-1)} e^{m^{(t-1)} - m^{(t)}} + \\sum_{j \\in J_t} e^{s_j - m^{(t)}},

with ``J_t`` the t-th block of the row's listed keys in increasing order. Memory: the sorted
(B, K, L, T) lists and per unit a few tiles, O(H T) for a decode step; work O(H L T (D + E)).

Determinism: every reduction runs in an order fixed by the listed keys (increasing key
index) and the shapes: bit-identical for any number of threads. The order differs from the
dense kernels' (which add the keys of 64-key blocks of all S keys), so the two paths agree
within :func:`refattn.bounds.kernels.online_forward_bound`, not bit for bit.
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
from ._cpu_scores import row_interval
from ._cpu_tiles import BLOCK_K, BLOCK_Q, exp_compute, matmul_n, matmul_t, pad, row_max
from ._simd import KERNEL_OPTIONS, fma, lanes, vadd, vexp, vload, vmuls, vstore, vsubs, vsum, vzero

__all__ = ["gather_forward", "row_keys", "sorted_indices"]

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
def _gather_block(kp, vp, cols, c0, nc, k_t, v_blk):
    """k_t[:, c] = kp[cols[c0 + c]] and v_blk[c] = vp[cols[c0 + c]] for c < nc (the rest and
    the padding columns zeroed); returns whether every gathered value is finite."""
    dim, vdim = kp.shape[1], vp.shape[1]
    finite = True
    for c in range(nc):
        j = cols[c0 + c]
        krow, vrow, orow = kp[j], vp[j], v_blk[c]
        for x in range(dim):
            k_t[x, c] = krow[x]
        for e in range(vdim):
            value = vrow[e]
            orow[e] = value
            finite &= math.isfinite(value)
        for e in range(vdim, v_blk.shape[1]):
            orow[e] = 0
    for c in range(nc, k_t.shape[1]):
        for x in range(dim):
            k_t[x, c] = 0
        v_blk[c, :] = 0
    return finite


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
def _softmax_step(s, p, rows, state):
    """One block of the online softmax: p = exp(s - m_new) lane-parallel (the lane sums in
    :func:`~refattn.kernels._cpu_tiles.row_sum`'s order), the accumulators rescaled when a
    row's maximum grows; ``state`` = (m, total, acc)."""
    m, total, acc = state
    width = lanes(s)
    epad = acc.shape[1]
    for r in range(rows):
        row = s[r]
        prow = p[r]
        m_old = m[r]
        m_new = max(m_old, row_max(row, row.shape[0]))
        if m_new == -np.inf:
            prow[:] = 0
            continue
        part = vzero(prow)
        for c in range(0, row.shape[0], width):
            e = vexp(vsubs(vload(row, c), m_new))
            vstore(prow, c, e)
            part = vadd(part, e)
        row_total = vsum(part)
        if m_new != m_old:
            alpha = exp_compute(m_old - m_new)
            total[r] = total[r] * alpha
            arow = acc[r]
            for e0 in range(0, epad, width):
                vstore(arow, e0, vmuls(vload(arow, e0), alpha))
            m[r] = m_new
        total[r] = total[r] + row_total


@njit(**_OPTS)
def _accumulate(s, p, pd, v_blk, nc, plain, where, terms, acc):
    """acc += weights @ v_blk over the block's nc gathered keys: ``weights`` = p, or p with
    the dropped positions zeroed (``pd``) under dropout; ``plain``: every value finite and no
    position excluded or dropped (the tile product), else only the kept positions are read
    (so that NaN/Inf at an excluded key cannot reach the output). ``where`` = (b, i, heads,
    cols, c0, has_drop)."""
    b, i, heads, cols, c0, has_drop = where
    drop, dstr = terms[TERM_DROP], terms[TERM_DROP_STRIDES]
    rows = heads.shape[0]
    weights = p
    if has_drop:
        for r in range(rows):
            h = heads[r]
            for c in range(nc):
                j = cols[c0 + c]
                keep = drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * j] != 0
                pd[r, c] = p[r, c] if keep else 0
            for c in range(nc, pd.shape[1]):
                pd[r, c] = 0
        weights = pd
    if plain:
        matmul_n(weights, v_blk, nc, rows, acc.shape[1], acc)
        return
    for r in range(rows):
        h = heads[r]
        for c in range(nc):
            if s[r, c] == -np.inf:
                continue
            j = cols[c0 + c]
            if has_drop and drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * j] == 0:
                continue
            w = weights[r, c]
            for e in range(v_blk.shape[1]):
                acc[r, e] = fma(w, v_blk[c, e], acc[r, e])


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
def _gather_unit(q, k, v, heads, listed, b, i, dims, opts, fopts, terms, results):
    """One (batch, kv head, query row, block of the group's query heads ``heads``): the row's
    listed keys ``listed`` (sorted, :func:`sorted_indices`) gathered in blocks of BLOCK_K;
    ``results`` = (out, lse)."""
    out, lse = results
    dim, vdim = dims[DIM_DIM], dims[DIM_VDIM]
    dt = q.dtype
    rows = heads.shape[0]
    epad = pad(vdim, lanes(q))
    q_t = np.zeros((dim, BLOCK_Q), dt)
    k_t = np.empty((dim, BLOCK_K), dt)
    v_blk = np.empty((BLOCK_K, epad), dt)
    s = np.empty((BLOCK_Q, BLOCK_K), dt)
    p = np.zeros((BLOCK_Q, BLOCK_K), dt)
    pd = np.zeros((BLOCK_Q, BLOCK_K), dt)
    state = (np.full(BLOCK_Q, -np.inf, dt), np.zeros(BLOCK_Q, dt), np.zeros((BLOCK_Q, epad), dt))
    for r in range(rows):
        src = q[b, heads[r], i]
        for x in range(dim):
            q_t[x, r] = src[x]
    lo, hi = row_interval(i, dims, opts)
    cols = np.empty(listed.shape[0], np.int64)
    count = row_keys(listed, lo, hi, cols)
    has_drop = opts[OPT_HAS_DROPOUT] != 0
    for c0 in range(0, count, BLOCK_K):
        nc = min(BLOCK_K, count - c0)
        finite = _gather_block(k, v, cols, c0, nc, k_t, v_blk)
        matmul_t(q_t, k_t, dim, rows, BLOCK_K, s, True)
        clean = _gathered_scores(s[:rows], heads, nc, i, b, cols, c0, opts, fopts, terms)
        _softmax_step(s, p, rows, state)
        where = (b, i, heads, cols, c0, has_drop)
        _accumulate(s, p, pd, v_blk, nc, finite and clean and not has_drop, where, terms, state[2])
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
    group_heads = np.array(
        [[h for h in range(heads) if kv_head[h] == g] for g in range(kv_heads)], np.int64
    )
    block = head_block(int(dims[DIM_BATCH]) * kv_heads * int(dims[DIM_LENGTH]), heads // kv_heads)
    with parallel_chunksize(1):
        _gather_units(q, k, v, group_heads, listed, dims, opts, fopts, terms, out, lse, block)


#: Below this many (batch, kv head, query row) units, the query heads of a group are split
#: into blocks of :data:`SMALL_HEAD_BLOCK` so that a decode step (one row, one latent head,
#: 16-128 query heads) has work for every thread.
FEW_UNITS = 16
SMALL_HEAD_BLOCK = 4


def head_block(units: int, group: int) -> int:
    """Query heads per task, fixed by the shapes alone (never by the thread count). Each
    head's scores, softmax and sums are the same operations in any block (the 4-row tiles and
    the single-row tail of :func:`~refattn.kernels._cpu_tiles.matmul_t` give the same bits
    per element), so the blocking changes no bit, only the parallelism.

    Examples
    --------
    >>> head_block(units=1, group=16), head_block(units=4096, group=16)
    (4, 64)
    """
    if units < FEW_UNITS and group > SMALL_HEAD_BLOCK:
        return SMALL_HEAD_BLOCK
    return BLOCK_Q
