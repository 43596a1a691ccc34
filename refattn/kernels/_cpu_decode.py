"""The short-query (decode) forward of the Numba CPU kernels (:mod:`.numba_cpu`): key splits.

When the query rows of a whole kv-head group fit one tile (``(H/K) L <= BLOCK_Q``) and there is
more than one split of :data:`SPLIT_KEYS` keys, work units are (batch, kv head, key split): the
rows of all query heads of a group share each loaded key block, and each split leaves a partial
(max, sum, accumulator) per row, combined in increasing split order (the split size is fixed,
so the order depends on the shapes only).

With one query row per kv head (an MHA decode step) a transposed copy of each key block would
cost more than the products: k and v are then read in place (:func:`_dot_row`,
:func:`_values_row`; a bfloat16 k or v as its uint16 bits, widened exactly as it loads). Steps
of up to :data:`SERIAL_SPLITS` elements of k and v run on one thread.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, parallel_chunksize, prange

from ._args import (
    DIM_BATCH,
    DIM_DIM,
    DIM_HEADS,
    DIM_KEYS,
    DIM_KV_HEADS,
    DIM_LENGTH,
    DIM_VDIM,
    FOPT_KEEP_SCALE,
    OPT_EMPTY_ROWS_NAN,
    OPT_HAS_DROPOUT,
    TERM_DROP,
    TERM_DROP_STRIDES,
)
from ._cpu_codes import load_keys_t, load_values
from ._cpu_forward import softmax_row, softmax_rows4
from ._cpu_scores import dropout_weights, finish_scores, first_key_block, row_interval
from ._cpu_tiles import (
    BLOCK_K,
    BLOCK_Q,
    exp_compute,
    matmul_n,
    matmul_t,
    pad,
)
from ._simd import (
    JIT,
    KERNEL_OPTIONS,
    fma,
    lanes,
    vfma,
    vfmav,
    vload,
    vload_wide,
    vstore,
    vsum,
    vzero,
)

__all__ = ["SPLIT_KEYS", "split_keys", "forward_splits"]

#: Keys per split of the short-query (decode) path: a fixed size, so that the number of
#: splits and the order they are combined in depend on the key length only.
SPLIT_KEYS = 1024

_OPTS = KERNEL_OPTIONS


def split_keys(heads: int, kv_heads: int, length: int, keys: int) -> int:
    """Key splits of the short-query path (0: the query-block path runs); shapes only.

    The short-query path runs when the query rows of a whole kv-head group fit one tile
    (``(H / K) * L <= BLOCK_Q``) and there is more than one split of :data:`SPLIT_KEYS` keys.

    Examples
    --------
    >>> split_keys(32, 8, 1, 8192), split_keys(8, 8, 1024, 1024)
    (8, 0)
    """
    if (heads // kv_heads) * length > BLOCK_Q or keys <= SPLIT_KEYS:
        return 0
    return -(-keys // SPLIT_KEYS)


def _dot_row(qrow, k, b, g, c0, nc, srow):
    """srow[c] = q . k[b, g, c0 + c] for c < nc, 0 after (a one-row tile); q one row (D,)
    in the compute dtype, k in natural layout (float, or uint16 bfloat16 bits widened as they
    load). Lane w sums the features x = w mod W in increasing order (fused multiply-adds),
    then the lanes in increasing order: no transposed copy of the key block, which on a
    one-row tile costs more than the products. Four keys at a time (independent chains)."""
    src = k[b, g]
    width = lanes(qrow)
    dim = qrow.shape[0]
    full = nc - nc % 4
    for c in range(0, full, 4):
        k0, k1, k2, k3 = src[c0 + c], src[c0 + c + 1], src[c0 + c + 2], src[c0 + c + 3]
        a0, a1, a2, a3 = vzero(qrow), vzero(qrow), vzero(qrow), vzero(qrow)
        for x in range(0, dim, width):
            qx = vload(qrow, x)
            a0 = vfmav(qx, vload_wide(k0, x), a0)
            a1 = vfmav(qx, vload_wide(k1, x), a1)
            a2 = vfmav(qx, vload_wide(k2, x), a2)
            a3 = vfmav(qx, vload_wide(k3, x), a3)
        srow[c], srow[c + 1], srow[c + 2], srow[c + 3] = vsum(a0), vsum(a1), vsum(a2), vsum(a3)
    for c in range(full, nc):
        krow = src[c0 + c]
        acc = vzero(qrow)
        for x in range(0, dim, width):
            acc = vfmav(vload(qrow, x), vload_wide(krow, x), acc)
        srow[c] = vsum(acc)
    for c in range(nc, srow.shape[0]):
        srow[c] = 0
    return True


def _values_row(prow, srow, v, b, g, c0, nc, arow):
    """arow[:E] += sum_c prow[c] v[b, g, c0 + c] over the keys c < nc whose score is not
    -inf, sequential over c (one fused multiply-add per key and feature, lanes over
    features: the chain of :func:`~._cpu_tiles.matmul_n`), v read in place (float, or
    uint16 bfloat16 bits widened as they load); an excluded key's value row is not read,
    so a non-finite one reaches no row that excludes it."""
    src = v[b, g]
    width = lanes(arow)
    vdim = src.shape[1]
    for c in range(nc):
        if srow[c] == -np.inf:
            continue
        w = prow[c]
        vrow = src[c0 + c]
        for e in range(0, vdim, width):
            vstore(arow, e, vfma(w, vload_wide(vrow, e), vload(arow, e)))
    return True


if JIT:
    from numba import types
    from numba.core.extending import overload

    def in_place(x):
        """Whether k or v is an array (read in place by :func:`_dot_row`, :func:`_values_row`)
        rather than quantised rows (a compile-time constant)."""
        raise NotImplementedError("compiled code only (numba overload)")

    def row_scores(qrow, k, b, g, c0, nc, srow):
        """:func:`_dot_row` (k an array)."""
        raise NotImplementedError("compiled code only (numba overload)")

    def row_values(prow, srow, v, b, g, c0, nc, arow):
        """:func:`_values_row` (v an array)."""
        raise NotImplementedError("compiled code only (numba overload)")

    @overload(in_place, jit_options=_OPTS)
    def _in_place(x):
        value = isinstance(x, types.Array)
        return lambda x: value

    @overload(row_scores, jit_options=_OPTS)
    def _row_scores(qrow, k, b, g, c0, nc, srow):
        if isinstance(k, types.Array):
            return _dot_row
        return lambda qrow, k, b, g, c0, nc, srow: False  # never called (in_place)

    @overload(row_values, jit_options=_OPTS)
    def _row_values(prow, srow, v, b, g, c0, nc, arow):
        if isinstance(v, types.Array):
            return _values_row
        return lambda prow, srow, v, b, g, c0, nc, arow: False  # never called (in_place)

else:  # pragma: no cover  (NUMBA_DISABLE_JIT)

    def in_place(x):
        return not isinstance(x, tuple)

    row_scores = _dot_row
    row_values = _values_row


@njit(**_OPTS)
def _split_unit(q, k, v, group_heads, unit, nsplit, dims, opts, fopts, terms, parts):
    """One (batch, kv head, key split) of the short-query path: the L rows of every query
    head of the group form one tile, so each key block is loaded once per group. ``parts`` =
    (max, sum, accumulator) partials of every (b, h, row, split)."""
    part_m, part_total, part_acc = parts
    drop, dstr = terms[TERM_DROP], terms[TERM_DROP_STRIDES]
    kv_heads, length, keys = dims[DIM_KV_HEADS], dims[DIM_LENGTH], dims[DIM_KEYS]
    dim, vdim = dims[DIM_DIM], dims[DIM_VDIM]
    group = group_heads.shape[1]
    b = unit // (kv_heads * nsplit)
    g = (unit // nsplit) % kv_heads
    split = unit % nsplit
    rows = group * length
    dt = q.dtype
    width = lanes(q)
    epad = part_acc.shape[4]
    q_t = np.zeros((dim, BLOCK_Q), dt)
    k_t = np.empty((dim, BLOCK_K), dt)
    v_blk = np.empty((BLOCK_K, epad), dt)
    s = np.empty((BLOCK_Q, BLOCK_K), dt)
    p = np.zeros((BLOCK_Q, BLOCK_K), dt)
    pd = np.zeros((BLOCK_Q, BLOCK_K), dt)
    deriv = np.empty((BLOCK_Q, BLOCK_K), dt)
    acc = np.zeros((BLOCK_Q, epad), dt)
    m = np.full(BLOCK_Q, -np.inf, dt)
    total = np.zeros(BLOCK_Q, dt)
    one = np.ones(1, dt)[0]
    state = (m, total, acc)
    for t in range(group):
        src = q[b, group_heads[g, t]]
        for i in range(length):
            for x in range(dim):
                q_t[x, t * length + i] = src[i, x]
    has_drop = opts[OPT_HAS_DROPOUT] != 0
    # one query row (MHA decode): its scores as dot products of k's rows in place
    qrow = q[b, group_heads[g, 0], 0]
    direct = rows == 1 and dim % width == 0 and in_place(k)
    # and its weights times v's rows in place (no copy of the value block)
    direct_v = rows == 1 and vdim % width == 0 and not has_drop and in_place(v)
    first_row = np.int64(0)  # not a literal: one compiled row_interval, finish_scores, ...
    _, hi_last = row_interval(length - 1, dims, opts)
    start = max(split * SPLIT_KEYS, first_key_block(first_row, dims, opts, BLOCK_K))
    stop = min((split + 1) * SPLIT_KEYS, hi_last)
    for c0 in range(start, stop, BLOCK_K):
        nc = min(BLOCK_K, keys - c0)
        if direct:
            row_scores(qrow, k, b, g, c0, nc, s[0])
        else:
            load_keys_t(k, b, g, c0, nc, k_t)  # k, v: arrays or quantised rows (_cpu_codes)
            matmul_t(q_t, k_t, dim, rows, BLOCK_K, s, True)
        v_finite = direct_v or load_values(v, b, g, c0, nc, v_blk)
        clean = True
        for t in range(group):
            r0 = t * length
            clean &= finish_scores(
                s[r0 : r0 + length],
                length,
                nc,
                first_row,
                c0,
                b,
                group_heads[g, t],
                dims,
                opts,
                fopts,
                terms,
                deriv[r0 : r0 + length],
            )
        full4 = rows - rows % 4  # the forward's row softmax, the scores final (factor 1)
        for r in range(0, full4, 4):
            softmax_rows4(s, p, r, one, state)
        for r in range(full4, rows):
            softmax_row(s, p, r, one, state)
        weights = p
        if has_drop:
            for t in range(group):
                r0 = t * length
                dropout_weights(
                    p[r0 : r0 + length],
                    pd[r0 : r0 + length],
                    length,
                    nc,
                    first_row,
                    c0,
                    b,
                    group_heads[g, t],
                    drop,
                    dstr,
                )
            weights = pd
        if direct_v:
            row_values(p[0], s[0], v, b, g, c0, nc, acc[0])
        elif v_finite or (clean and not has_drop):
            matmul_n(weights, v_blk, nc, rows, epad, acc)
        else:
            for r in range(rows):
                h, i = group_heads[g, r // length], r % length
                for c in range(nc):
                    if s[r, c] == -np.inf:
                        continue
                    if (
                        has_drop
                        and drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * (c0 + c)] == 0
                    ):
                        continue
                    w = weights[r, c]
                    for e in range(vdim):
                        acc[r, e] = fma(w, v_blk[c, e], acc[r, e])
    for r in range(rows):
        h, i = group_heads[g, r // length], r % length
        part_m[b, h, i, split] = m[r]
        part_total[b, h, i, split] = total[r]
        for e in range(epad):
            part_acc[b, h, i, split, e] = acc[r, e]


@njit(**_OPTS)
def _combine_row(row, nsplit, parts, dims, opts, fopts, out, lse):
    """Row ``row`` of (B H L): the splits' partial (max, sum, accumulator) rescaled to the
    overall maximum and added with one fused multiply-add each, in increasing split order."""
    part_m, part_total, part_acc = parts
    heads, length, vdim = dims[DIM_HEADS], dims[DIM_LENGTH], dims[DIM_VDIM]
    b = row // (heads * length)
    h = (row // length) % heads
    i = row % length
    best = part_m[b, h, i, 0]  # never NaN (row maxima skip NaN)
    for t in range(1, nsplit):
        best = max(best, part_m[b, h, i, t])
    orow = out[b, h, i]
    if best == -np.inf:
        nan_rows = opts[OPT_EMPTY_ROWS_NAN] != 0
        fill = np.nan if nan_rows else 0.0
        for e in range(vdim):
            orow[e] = fill
        lse[b, h, i] = np.nan if nan_rows else -np.inf
        return
    total = np.zeros(1, part_m.dtype)[0]
    for e in range(vdim):
        orow[e] = 0
    for t in range(nsplit):
        m_t = part_m[b, h, i, t]
        if m_t == -np.inf:
            continue
        alpha = exp_compute(m_t - best)
        total = fma(alpha, part_total[b, h, i, t], total)
        for e in range(vdim):
            orow[e] = fma(alpha, part_acc[b, h, i, t, e], orow[e])
    inv = fopts[FOPT_KEEP_SCALE] / total
    for e in range(vdim):
        orow[e] = orow[e] * inv
    lse[b, h, i] = best + math.log(total)


def _split_parts(q, dims, nsplit):
    """Fresh (max, sum, accumulator) partials of every (b, h, row, split)."""
    batch, heads, length = (int(x) for x in dims[[DIM_BATCH, DIM_HEADS, DIM_LENGTH]])
    dt = q.dtype
    epad = int(pad(int(dims[DIM_VDIM]), 64 // dt.itemsize))
    return (
        np.empty((batch, heads, length, nsplit), dt),
        np.empty((batch, heads, length, nsplit), dt),
        np.empty((batch, heads, length, nsplit, epad), dt),
    )


@njit(parallel=True, **_OPTS)
def _split_forward(q, k, v, group_heads, nsplit, dims, opts, fopts, terms, parts, results):
    """Short-query forward: key splits of SPLIT_KEYS keys per (batch, kv head) run as
    independent units; their partial (max, sum, accumulator) are then combined per row in
    increasing split order (the split size is fixed, so the order depends on the shapes
    only). ``results`` = (out, lse)."""
    batch, heads, length = dims[DIM_BATCH], dims[DIM_HEADS], dims[DIM_LENGTH]
    for unit in prange(batch * dims[DIM_KV_HEADS] * nsplit):
        _split_unit(q, k, v, group_heads, np.int64(unit), nsplit, dims, opts, fopts, terms, parts)
    for row in prange(batch * heads * length):
        _combine_row(np.int64(row), nsplit, parts, dims, opts, fopts, results[0], results[1])


@njit(**_OPTS)
def _split_forward_serial(q, k, v, group_heads, nsplit, dims, opts, fopts, terms, parts, results):
    """:func:`_split_forward` on one thread (the same units, the same bits): for small
    steps, where a parallel region's start (and, on a busy machine, waiting for a second
    thread) costs more than the work."""
    batch, heads, length = dims[DIM_BATCH], dims[DIM_HEADS], dims[DIM_LENGTH]
    for unit in range(batch * dims[DIM_KV_HEADS] * nsplit):
        _split_unit(q, k, v, group_heads, np.int64(unit), nsplit, dims, opts, fopts, terms, parts)
    for row in range(batch * heads * length):
        _combine_row(np.int64(row), nsplit, parts, dims, opts, fopts, results[0], results[1])


#: Up to this many elements of K and V together (B K S (D + E)), a key-split step runs on
#: one thread.
SERIAL_SPLITS = 1 << 23


def forward_splits(nsplit, q, k, v, kv_head, dims, opts, fopts, terms, out, lse):
    """Run the ``nsplit`` key splits (:func:`split_keys`) per (batch, kv head) into ``out``
    (B, H, L, E) and ``lse`` (B, H, L); the other arguments are
    :func:`~refattn.kernels._args.kernel_arguments`."""
    heads, kv_heads = int(dims[DIM_HEADS]), int(dims[DIM_KV_HEADS])
    group_heads = np.array(
        [[h for h in range(heads) if kv_head[h] == g] for g in range(kv_heads)], np.int64
    )
    parts = _split_parts(q, dims, nsplit)
    batch, keys, dim, vdim = (int(dims[x]) for x in (DIM_BATCH, DIM_KEYS, DIM_DIM, DIM_VDIM))
    if batch * kv_heads * keys * (dim + vdim) <= SERIAL_SPLITS:  # k, v may be quantised rows
        _split_forward_serial(
            q, k, v, group_heads, nsplit, dims, opts, fopts, terms, parts, (out, lse)
        )
        return
    with parallel_chunksize(1):
        _split_forward(q, k, v, group_heads, nsplit, dims, opts, fopts, terms, parts, (out, lse))
