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
    matmul_t,
    padded,
    row_max_scaled,
)
from ._simd import KERNEL_OPTIONS, fma, lanes, vadd, vexp, vload, vmuls, vstore, vsubs, vsum, vzero

__all__ = ["forward_blocks"]

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
    width = lanes(q)
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
        matmul_t(q_t, k_t, dim, rows, BLOCK_K, s, True)
        factor = one  # x * 1 is x: the scores in s are final
        if raw_scores_suffice(nr, nc, r0, c0, dims, opts, fopts, BLOCK_K):
            clean, factor = True, fopts[FOPT_SCALE]
        else:
            clean = finish_scores(s, nr, nc, r0, c0, b, h, dims, opts, fopts, terms, deriv)
        for r in range(nr):
            row = s[r]
            prow = p[r]
            m_old = m[r]
            m_new = max(m_old, row_max_scaled(row, BLOCK_K, factor))
            if m_new == -np.inf:
                prow[:] = 0
                continue
            # exp of the tile row, lane-parallel; the lane sums in the row_sum order
            part = vzero(prow)
            for c in range(0, BLOCK_K, width):
                e = vexp(vsubs(vmuls(vload(row, c), factor), m_new))
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
        weights = p
        if has_drop:
            dropout_weights(p, pd, nr, nc, r0, c0, b, h, drop, dstr)
            weights = pd
        if v_finite or (clean and not has_drop):
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
    for unit in prange(batch * heads * nqb):
        _forward_unit(q, packed, kv_head, np.int64(unit), nqb, dims, opts, fopts, terms, out, lse)


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
