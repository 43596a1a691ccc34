"""The query-block forward of the Numba CPU kernels (:mod:`.numba_cpu`).

Work units are (batch, head, block of :data:`~._cpu_tiles.BLOCK_Q` query rows), run with
``prange``; each streams over the key blocks its rows may read (their structural key
intervals, :func:`refattn.spec.key_interval`) with the online softmax, after the key blocks
were packed once per (batch, kv head) (K transposed, V padded: pure copies).
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
    DIM_LENGTH,
    DIM_VDIM,
    FOPT_KEEP_SCALE,
    FOPT_SCALE,
    OPT_EMPTY_ROWS_NAN,
    OPT_HAS_DROPOUT,
    TERM_DROP,
    TERM_DROP_STRIDES,
)
from ._cpu_scores import (
    dropout_weights,
    finish_scores,
    first_key_block,
    raw_scores_suffice,
    row_interval,
)
from ._cpu_tiles import (
    BLOCK_K,
    BLOCK_Q,
    exp_compute,
    load_rows,
    load_rows_t,
    matmul_n,
    matmul_n_rows4,
    matmul_t,
    matmul_t_rows4,
    padded,
)
from ._simd import (
    KERNEL_OPTIONS,
    fma,
    lanes,
    vadd,
    vexp,
    vload,
    vmax,
    vmuls,
    vstore,
    vsubs,
    vsum,
    vtop,
    vzero,
)

__all__ = ["forward_blocks", "softmax_row", "softmax_rows4"]

_OPTS = KERNEL_OPTIONS


@njit(**_OPTS)
def _pack_block(k, v, unit, packed):
    """Key block ``unit`` (of every (batch, kv head)) of :func:`_pack_keys`."""
    k_t, v_blk, v_finite = packed
    kv_heads, keys = k.shape[1], k.shape[2]
    nkb = k_t.shape[2]
    b = unit // (kv_heads * nkb)
    g = (unit // nkb) % kv_heads
    n = unit % nkb
    c0 = n * BLOCK_K
    nc = min(BLOCK_K, keys - c0)
    load_rows_t(k[b, g], c0, nc, k_t[b, g, n])
    v_finite[b, g, n] = load_rows(v[b, g], c0, nc, v_blk[b, g, n])


@njit(parallel=True, **_OPTS)
def _pack_keys(k, v, k_t, v_blk, v_finite):
    """Pack every key block once per (batch, kv head): k_t[b, g, n] = K block n transposed
    (D, BLOCK_K), v_blk[b, g, n] = V block n (BLOCK_K, E padded), zero-padded; v_finite[b,
    g, n] says whether the block's values are all finite. Pure copies (no arithmetic)."""
    for unit in prange(k.shape[0] * k.shape[1] * k_t.shape[2]):
        _pack_block(k, v, unit, (k_t, v_blk, v_finite))


@njit(**_OPTS)
def _pack_keys_serial(k, v, k_t, v_blk, v_finite):
    """:func:`_pack_keys` on one thread: for small inputs, where a parallel region's start
    (and, on a busy machine, waiting for a second thread) costs more than the copies."""
    for unit in range(k.shape[0] * k.shape[1] * k_t.shape[2]):
        _pack_block(k, v, unit, (k_t, v_blk, v_finite))


#: Up to this many elements of K and V together are packed on one thread (about a
#: millisecond of copies).
SERIAL_PACK = 1 << 21


@njit(**_OPTS)
def _rescale(r, m_new, row_total, state):
    """Row ``r`` of the online softmax state ``(m, total, acc)`` takes a key block with
    maximum ``m_new`` and exp sum ``row_total``: rescale by exp(m_old - m_new) when the
    maximum moved, then add."""
    m, total, acc = state
    m_old = m[r]
    if m_new != m_old:
        alpha = exp_compute(m_old - m_new)
        total[r] = total[r] * alpha
        arow = acc[r]
        width = lanes(arow)
        for e0 in range(0, arow.shape[0], width):
            vstore(arow, e0, vmuls(vload(arow, e0), alpha))
        m[r] = m_new
    total[r] = total[r] + row_total


@njit(**_OPTS)
def _scaled_top(row, factor):
    """max(row[:BLOCK_K] * factor) ignoring NaN (the lane-wise maxima, then :func:`vtop`)."""
    width = lanes(row)
    x = vmuls(vload(row, 0), factor)
    for c in range(width, BLOCK_K, width):
        x = vmax(x, vmuls(vload(row, c), factor))
    return vtop(x)


@njit(**_OPTS)
def softmax_row(s, p, r, factor, state):
    """p[r] = exp(s[r] * factor - m_new) for one tile row, m_new the row's running maximum;
    the exp sum in the documented lane order (lane w sums the keys w mod W, then the lanes
    in order) goes into the state (:func:`_rescale`)."""
    row = s[r]
    prow = p[r]
    m_new = max(state[0][r], _scaled_top(row, factor))
    if m_new == -np.inf:
        prow[:] = 0
        return
    width = lanes(row)
    part = vzero(prow)
    for c in range(0, BLOCK_K, width):
        e = vexp(vsubs(vmuls(vload(row, c), factor), m_new))
        vstore(prow, c, e)
        part = vadd(part, e)
    _rescale(r, m_new, vsum(part), state)


@njit(**_OPTS)
def softmax_rows4(s, p, r, factor, state):
    """:func:`softmax_row` of rows r..r+3 interleaved: four independent chains of maxima,
    exps and lane sums keep the vector units busy where one row's chain would stall on
    latency. The same operations per row, so the same bits."""
    m = state[0]
    width = lanes(s)
    s0, s1, s2, s3 = s[r], s[r + 1], s[r + 2], s[r + 3]
    x0, x1 = vmuls(vload(s0, 0), factor), vmuls(vload(s1, 0), factor)
    x2, x3 = vmuls(vload(s2, 0), factor), vmuls(vload(s3, 0), factor)
    for c in range(width, BLOCK_K, width):
        x0 = vmax(x0, vmuls(vload(s0, c), factor))
        x1 = vmax(x1, vmuls(vload(s1, c), factor))
        x2 = vmax(x2, vmuls(vload(s2, c), factor))
        x3 = vmax(x3, vmuls(vload(s3, c), factor))
    n0, n1 = max(m[r], vtop(x0)), max(m[r + 1], vtop(x1))
    n2, n3 = max(m[r + 2], vtop(x2)), max(m[r + 3], vtop(x3))
    if n0 == -np.inf or n1 == -np.inf or n2 == -np.inf or n3 == -np.inf:
        for i in range(4):  # a row with no allowed key so far: one at a time
            softmax_row(s, p, r + i, factor, state)
        return
    p0, p1, p2, p3 = p[r], p[r + 1], p[r + 2], p[r + 3]
    a0, a1, a2, a3 = vzero(p0), vzero(p0), vzero(p0), vzero(p0)
    for c in range(0, BLOCK_K, width):
        e0 = vexp(vsubs(vmuls(vload(s0, c), factor), n0))
        e1 = vexp(vsubs(vmuls(vload(s1, c), factor), n1))
        e2 = vexp(vsubs(vmuls(vload(s2, c), factor), n2))
        e3 = vexp(vsubs(vmuls(vload(s3, c), factor), n3))
        vstore(p0, c, e0)
        vstore(p1, c, e1)
        vstore(p2, c, e2)
        vstore(p3, c, e3)
        a0, a1, a2, a3 = vadd(a0, e0), vadd(a1, e1), vadd(a2, e2), vadd(a3, e3)
    _rescale(r, n0, vsum(a0), state)
    _rescale(r + 1, n1, vsum(a1), state)
    _rescale(r + 2, n2, vsum(a2), state)
    _rescale(r + 3, n3, vsum(a3), state)


@njit(**_OPTS)
def _reach(row, r0, c0, nc, dims, opts):
    """How many leading columns of a key block the four rows ``row``.. of a query block may
    read: the last one's structural hi (hi grows with the row), clamped to [0, nc]."""
    _, hi = row_interval(r0 + row + 3, dims, opts)
    return max(0, min(nc, hi - c0))


@njit(**_OPTS)
def _trimmed(r0, nr, c0, nc, dims, opts):
    """Whether a tile's four-row groups skip the trailing keys no row of the group may read
    (a causal diagonal): whole groups only, and only when the first group stops short."""
    return nr % 4 == 0 and _reach(0, r0, c0, nc, dims, opts) < nc


@njit(**_OPTS)
def _scores_trimmed(q_t, k_t, dim, nr, r0, c0, nc, dims, opts, s):
    """:func:`matmul_t` of a :func:`_trimmed` tile: each four-row group computes the tiles
    holding the columns it may read (the same chain per element); the others are left
    stale, as score finishing sets every excluded position to -inf without reading it."""
    for row in range(0, nr, 4):
        matmul_t_rows4(q_t, k_t, dim, row, _reach(row, r0, c0, nc, dims, opts), s)


@njit(**_OPTS)
def _values_trimmed(weights, v_blk, nr, r0, c0, nc, dims, opts, acc):
    """:func:`matmul_n` of a :func:`_trimmed` tile with finite values: each four-row group
    stops its fma chains after the keys it may read. The skipped terms have weight +0, and
    fma(+0, v, a) is a for every a but -0 (then +0 when v's sign bit is clear), so the
    skipped chain is replayed for the elements that are zero: the same bits."""
    epad = acc.shape[1]
    for row in range(0, nr, 4):
        need = _reach(row, r0, c0, nc, dims, opts)
        matmul_n_rows4(weights, v_blk, need, row, epad, acc)
        if need == nc:
            continue
        for r in range(row, row + 4):
            arow, wrow = acc[r], weights[r]
            zeros = 0
            for e in range(epad):  # a branch-free count first (zeros are rare)
                zeros += arow[e] == 0
            if zeros == 0:
                continue
            for e in range(epad):
                if arow[e] == 0:
                    a = arow[e]
                    for x in range(need, nc):
                        a = fma(wrow[x], v_blk[x, e], a)
                    arow[e] = a


@njit(**_OPTS)
def _forward_unit(q, packed, kv_head, unit, nqb, dims, opts, fopts, terms, out, lse):
    """One (batch, head, query block): ``packed`` = (K^T blocks, V blocks, V block finite)
    from :func:`_packed_keys`; ``terms`` as in :func:`~._cpu_scores.finish_scores`."""
    k_pack, v_pack, v_fin = packed
    drop, dstr = terms[TERM_DROP], terms[TERM_DROP_STRIDES]
    heads, length, keys = dims[DIM_HEADS], dims[DIM_LENGTH], dims[DIM_KEYS]
    dim, vdim = dims[DIM_DIM], dims[DIM_VDIM]
    b = unit // (heads * nqb)
    h = (unit // nqb) % heads
    r0 = (unit % nqb) * BLOCK_Q
    nr = min(BLOCK_Q, length - r0)
    rows = nr  # short blocks (decode: L = 1) compute their live rows only
    g = kv_head[h]
    dt = q.dtype
    epad = v_pack.shape[4]
    q_t = np.empty((dim, BLOCK_Q), dt)
    s = np.empty((BLOCK_Q, BLOCK_K), dt)
    p = np.zeros((BLOCK_Q, BLOCK_K), dt)
    pd = np.zeros((BLOCK_Q, BLOCK_K), dt)
    deriv = np.empty((BLOCK_Q, BLOCK_K), dt)
    acc = np.zeros((BLOCK_Q, epad), dt)
    m = np.full(BLOCK_Q, -np.inf, dt)
    total = np.zeros(BLOCK_Q, dt)
    one = np.ones(1, dt)[0]
    state = (m, total, acc)
    load_rows_t(q[b, h], r0, nr, q_t)
    has_drop = opts[OPT_HAS_DROPOUT] != 0
    # the key blocks that the [lo, hi) intervals of the block's rows reach (lo and hi grow
    # with the row)
    first = first_key_block(r0, dims, opts, BLOCK_K)
    _, hi_last = row_interval(r0 + nr - 1, dims, opts)
    for c0 in range(first, hi_last, BLOCK_K):
        nc = min(BLOCK_K, keys - c0)
        kb = c0 // BLOCK_K
        k_t = k_pack[b, g, kb]
        v_blk = v_pack[b, g, kb]
        v_finite = v_fin[b, g, kb]
        trimmed = _trimmed(r0, nr, c0, nc, dims, opts)
        if trimmed:
            _scores_trimmed(q_t, k_t, dim, nr, r0, c0, nc, dims, opts, s)
        else:
            matmul_t(q_t, k_t, dim, rows, BLOCK_K, s, True)
        factor = one  # x * 1 is x: the scores in s are final
        if raw_scores_suffice(nr, nc, r0, c0, dims, opts, fopts, BLOCK_K):
            clean, factor = True, fopts[FOPT_SCALE]
        else:
            clean = finish_scores(s, nr, nc, r0, c0, b, h, dims, opts, fopts, terms, deriv)
        full4 = nr - nr % 4
        for r in range(0, full4, 4):
            softmax_rows4(s, p, r, factor, state)
        for r in range(full4, nr):
            softmax_row(s, p, r, factor, state)
        weights = p
        if has_drop:
            dropout_weights(p, pd, nr, nc, r0, c0, b, h, drop, dstr)
            weights = pd
        if trimmed and v_finite:
            _values_trimmed(weights, v_blk, nr, r0, c0, nc, dims, opts, acc)
        elif v_finite or (clean and not has_drop):
            matmul_n(weights, v_blk, nc, rows, epad, acc)
        else:
            # a non-finite value row may only reach the rows that keep it
            for r in range(nr):
                for c in range(nc):
                    if s[r, c] == -np.inf:
                        continue
                    j = c0 + c
                    if (
                        has_drop
                        and drop[dstr[0] * b + dstr[1] * h + dstr[2] * (r0 + r) + dstr[3] * j] == 0
                    ):
                        continue
                    w = weights[r, c]
                    for e in range(vdim):
                        acc[r, e] = fma(w, v_blk[c, e], acc[r, e])
    keep_scale = fopts[FOPT_KEEP_SCALE]
    nan_rows = opts[OPT_EMPTY_ROWS_NAN] != 0
    for r in range(nr):
        i = r0 + r
        orow = out[b, h, i]
        if m[r] == -np.inf:
            fill = np.nan if nan_rows else 0.0
            for e in range(vdim):
                orow[e] = fill
            lse[b, h, i] = np.nan if nan_rows else -np.inf
            continue
        inv = keep_scale / total[r]
        arow = acc[r]
        for e in range(vdim):
            orow[e] = arow[e] * inv
        lse[b, h, i] = m[r] + math.log(total[r])


@njit(parallel=True, **_OPTS)
def _forward_units(q, packed, kv_head, dims, opts, fopts, terms, out, lse):
    batch, heads, length = dims[DIM_BATCH], dims[DIM_HEADS], dims[DIM_LENGTH]
    nqb = -(-length // BLOCK_Q)
    for u in prange(batch * heads * nqb):
        # each (batch, head)'s query blocks last to first: under a causal mask the last read
        # the most key blocks, so the units handed out last (one at a time) are the shortest;
        # consecutive units share the head's packed key blocks (kept in L2)
        unit = np.int64(u) + nqb - 1 - 2 * (np.int64(u) % nqb)
        _forward_unit(q, packed, kv_head, unit, nqb, dims, opts, fopts, terms, out, lse)


def _packed_keys(k, v):
    """(K^T blocks, V blocks, V block finite) of every key block (:func:`_pack_keys`)."""
    batch, kv_heads, keys, dim = k.shape
    nkb = -(-keys // BLOCK_K)
    k_pack = np.empty((batch, kv_heads, nkb, dim, BLOCK_K), k.dtype)
    v_pack = np.empty((batch, kv_heads, nkb, BLOCK_K, padded(v.shape[3], v.dtype)), v.dtype)
    v_fin = np.empty((batch, kv_heads, nkb), np.bool_)
    if k_pack.size or v_pack.size:
        pack = _pack_keys_serial if k.size + v.size <= SERIAL_PACK else _pack_keys
        pack(k, v, k_pack, v_pack, v_fin)
    return k_pack, v_pack, v_fin


def forward_blocks(q, k, v, kv_head, dims, opts, fopts, terms, out, lse):
    """Pack the key blocks (:func:`_pack_keys`), then run the query-block units into
    ``out`` (B, H, L, E) and ``lse`` (B, H, L); the arguments are
    :func:`~refattn.kernels._args.kernel_arguments`."""
    packed = _packed_keys(k, v)
    with parallel_chunksize(1):
        _forward_units(q, packed, kv_head, dims, opts, fopts, terms, out, lse)
