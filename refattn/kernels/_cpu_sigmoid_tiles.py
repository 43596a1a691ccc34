"""Tiled SIMD Numba CPU kernels of sigmoid attention (``normalizer="sigmoid"``): forward
(prefill and decode) and backward.

Sigmoid attention (Ramapuram et al. 2024, eq. (2)) has no row normaliser, so the forward is
``out = (sigma(T) o kappa) V / (1 - p)`` tile by tile with no online rescaling: a ``q . k``
score tile (:func:`~._cpu_tiles.matmul_t`), the final scores
(:func:`~._cpu_scores.finish_scores`), the elementwise sigmoid (:func:`~._simd.vsigmoid`,
lane by lane the operations of the scalar :func:`._cpu_sigmoid.sigmoid_compute`), then
``tile @ V`` into the row accumulators (:func:`~._cpu_tiles.matmul_n`), over the key blocks
each query block may read, in increasing order. Work units are (batch, head, block of
:data:`~._cpu_tiles.BLOCK_Q` query rows) as in :mod:`._cpu_forward`; a decode step
(L = 1) is one short block per (batch, head).

The backward units are (batch, kv head) pairs: the query heads of the group in increasing
order, their query blocks in increasing order, the key blocks in increasing order; per tile
``dP = dO V^T`` (sequential over E), ``dS = sigma(t) sigma(-t) kappa dP / (1 - p)`` (dbias),
``dT = dS (1 - tanh^2)`` with softcap, then ``dq += s dT K``, ``dk += s dT^T Q``,
``dv += (kappa sigma(T) / (1 - p))^T dO``. Each unit owns its dk, dv rows and its heads' dq
and dbias, so nothing is reduced afterwards.

Every element is computed by the same operations in the same order as the scalar reference
kernels of :mod:`._cpu_sigmoid` (fused multiply-adds sequential over D, over keys in increasing
order for out and dq, over (head, query row) for dk and dv; excluded and dropped positions add
exact zeros, which leave a sum that started at +0 unchanged), so the two agree bit for bit,
and no bit depends on the thread count. Non-finite values take the scalar path where a zero
weight could meet them (``0 * inf``). ``fastmath`` is off. Error bound:
:func:`refattn.bounds.sigmoid_forward_bound` / :func:`refattn.bounds.sigmoid_vjp_bound` with
the compute dtype.
"""

from __future__ import annotations

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
    FOPT_SCALE,
    OPT_EMPTY_ROWS_NAN,
    OPT_HAS_BIAS,
    OPT_HAS_DROPOUT,
    OPT_HAS_SOFTCAP,
    TERM_DROP,
    TERM_DROP_STRIDES,
    kernel_arguments,
)
from ._cpu_scores import finish_scores, first_key_block, raw_scores_suffice, row_interval
from ._cpu_tiles import (
    BLOCK_K,
    BLOCK_Q,
    load_rows,
    load_rows_t,
    matmul_n,
    matmul_t,
    padded,
)
from ._simd import KERNEL_OPTIONS, fma, lanes, vkeep, vload, vmul, vmuls, vsigmoid, vstore

__all__ = ["sigmoid_forward_tiled", "sigmoid_backward_tiled"]

_OPTS = KERNEL_OPTIONS


# --------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------
@njit(**_OPTS)
def _sigmoid_tile(s, w, nr, nc, factor, seen):
    """w[:nr] = sigma(s[:nr] * factor) lane-wise; seen[r] |= some score of row r among the
    first nc is not -inf (an allowed key)."""
    width = lanes(s)
    for r in range(nr):
        row = s[r]
        wrow = w[r]
        for c in range(0, s.shape[1], width):
            vstore(wrow, c, vsigmoid(vmuls(vload(row, c), factor)))
        if not seen[r]:
            for c in range(nc):
                if row[c] * factor != -np.inf:
                    seen[r] = True
                    break


@njit(**_OPTS)
def _drop_tile(w, nr, nc, r0, c0, b, h, drop, dstr):
    """Zero the dropped positions of w[:nr, :nc] in place."""
    for r in range(nr):
        i = r0 + r
        for c in range(nc):
            if drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * (c0 + c)] == 0:
                w[r, c] = 0


@njit(**_OPTS)
def _accumulate_scalar(s, w, v_blk, nr, nc, factor, acc, vdim):
    """acc[r] += w[r, c] v[c] over the allowed (non -inf) positions only (a block holding
    non-finite values: an excluded position must not meet them)."""
    for r in range(nr):
        for c in range(nc):
            if s[r, c] * factor == -np.inf:
                continue
            wv = w[r, c]
            for e in range(vdim):
                acc[r, e] = fma(wv, v_blk[c, e], acc[r, e])


@njit(**_OPTS)
def _forward_unit(q, packed, kv_head, unit, nqb, dims, opts, fopts, terms, out):
    """One (batch, head, query block) of the sigmoid forward; ``packed`` = (K^T blocks, V
    blocks, V block finite)."""
    k_pack, v_pack, v_fin = packed
    drop, dstr = terms[TERM_DROP], terms[TERM_DROP_STRIDES]
    heads, length, keys = dims[DIM_HEADS], dims[DIM_LENGTH], dims[DIM_KEYS]
    dim, vdim = dims[DIM_DIM], dims[DIM_VDIM]
    b = unit // (heads * nqb)
    h = (unit // nqb) % heads
    r0 = (unit % nqb) * BLOCK_Q
    nr = min(BLOCK_Q, length - r0)
    g = kv_head[h]
    dt = q.dtype
    epad = v_pack.shape[4]
    q_t = np.empty((dim, BLOCK_Q), dt)
    s = np.empty((BLOCK_Q, BLOCK_K), dt)
    w = np.zeros((BLOCK_Q, BLOCK_K), dt)
    deriv = np.zeros((BLOCK_Q, BLOCK_K), dt)
    acc = np.zeros((BLOCK_Q, epad), dt)
    seen = np.zeros(BLOCK_Q, np.bool_)
    one = np.ones(1, dt)[0]
    load_rows_t(q[b, h], r0, nr, q_t)
    has_drop = opts[OPT_HAS_DROPOUT] != 0
    first = first_key_block(r0, dims, opts, BLOCK_K)
    _, hi_last = row_interval(r0 + nr - 1, dims, opts)
    for c0 in range(first, hi_last, BLOCK_K):
        nc = min(BLOCK_K, keys - c0)
        kb = c0 // BLOCK_K
        matmul_t(q_t, k_pack[b, g, kb], dim, nr, BLOCK_K, s, True)
        factor = one  # x * 1 is x: the scores in s are final
        if raw_scores_suffice(nr, nc, r0, c0, dims, opts, fopts, BLOCK_K):
            clean, factor = True, fopts[FOPT_SCALE]
        else:
            clean = finish_scores(s, nr, nc, r0, c0, b, h, dims, opts, fopts, terms, deriv)
        _sigmoid_tile(s, w, nr, nc, factor, seen)
        if has_drop:
            _drop_tile(w, nr, nc, r0, c0, b, h, drop, dstr)
        if v_fin[b, g, kb] or (clean and not has_drop):
            matmul_n(w, v_pack[b, g, kb], nc, nr, epad, acc)
        else:
            if has_drop:  # a dropped position weighs 0 but must not meet inf / NaN either
                for r in range(nr):
                    for c in range(nc):
                        i, j = r0 + r, c0 + c
                        if drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * j] == 0:
                            s[r, c] = -np.inf
            _accumulate_scalar(s, w, v_pack[b, g, kb], nr, nc, factor, acc, vdim)
    keep = fopts[FOPT_KEEP_SCALE]
    fill = np.nan if opts[OPT_EMPTY_ROWS_NAN] != 0 else 0.0
    for r in range(nr):
        orow = out[b, h, r0 + r]
        for e in range(vdim):
            orow[e] = acc[r, e] * keep if seen[r] else fill


@njit(parallel=True, **_OPTS)
def _pack_keys(k, v, k_t, v_blk, v_finite):
    """Pack every key block once per (batch, kv head): k_t = K block transposed (D, BLOCK_K),
    v_blk = V block (BLOCK_K, E padded), zero-padded; v_finite: the block's values are all
    finite. Pure copies."""
    batch, kv_heads, keys = k.shape[0], k.shape[1], k.shape[2]
    nkb = k_t.shape[2]
    for unit in prange(batch * kv_heads * nkb):
        b = unit // (kv_heads * nkb)
        g = (unit // nkb) % kv_heads
        n = unit % nkb
        c0 = n * BLOCK_K
        nc = min(BLOCK_K, keys - c0)
        load_rows_t(k[b, g], c0, nc, k_t[b, g, n])
        v_finite[b, g, n] = load_rows(v[b, g], c0, nc, v_blk[b, g, n])


@njit(parallel=True, **_OPTS)
def _forward_units(q, packed, kv_head, dims, opts, fopts, terms, out):
    nqb = -(-dims[DIM_LENGTH] // BLOCK_Q)
    for unit in prange(dims[DIM_BATCH] * dims[DIM_HEADS] * nqb):
        _forward_unit(q, packed, kv_head, np.int64(unit), nqb, dims, opts, fopts, terms, out)


def sigmoid_forward_tiled(spec, dtype):
    """out (B, H, L, E) of a sigmoid spec in compute ``dtype`` by the tiled kernel."""
    q, k, v, kv_head, dims, opts, fopts, terms = kernel_arguments(spec, dtype)
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    out = np.zeros((batch, heads, length, vdim), dtype)
    if not out.size:
        return out
    nkb = max(-(-keys // BLOCK_K), 1)
    k_pack = np.zeros((batch, kv_heads, nkb, dim, BLOCK_K), dtype)
    v_pack = np.zeros((batch, kv_heads, nkb, BLOCK_K, padded(vdim, dtype)), dtype)
    v_fin = np.ones((batch, kv_heads, nkb), np.bool_)
    if keys:
        _pack_keys(k, v, k_pack, v_pack, v_fin)
    with parallel_chunksize(1):
        _forward_units(q, (k_pack, v_pack, v_fin), kv_head, dims, opts, fopts, terms, out)
    return out


# --------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------
@njit(**_OPTS)
def _grad_tiles(s, dp, nr, factor, fopts, ds, wk):
    """Per lane: w = sigma(t), ds = w sigma(-t) (dP / (1 - p)) (0 where excluded), wk = w /
    (1 - p); then (after the caller's dbias) the softcap and scale factors by
    :func:`_finish_ds`."""
    width = lanes(s)
    keep = fopts[FOPT_KEEP_SCALE]
    minus = -np.ones(1, s.dtype)[0]
    for r in range(nr):
        for c in range(0, s.shape[1], width):
            t = vmuls(vload(s[r], c), factor)
            w = vsigmoid(t)
            d = vmul(vmul(w, vsigmoid(vmuls(t, minus))), vmuls(vload(dp[r], c), keep))
            vstore(ds[r], c, vkeep(t, d))
            vstore(wk[r], c, vmuls(w, keep))


@njit(**_OPTS)
def _finish_ds(ds, deriv, nr, scale, has_softcap):
    """ds *= (1 - tanh^2) (softcap), then ds *= scale, lane-wise."""
    width = lanes(ds)
    for r in range(nr):
        for c in range(0, ds.shape[1], width):
            x = vload(ds[r], c)
            if has_softcap:
                x = vmul(x, vload(deriv[r], c))
            vstore(ds[r], c, vmuls(x, scale))


@njit(**_OPTS)
def _key_tile(tiles, blocks, b, h, r0, nr, c0, dims, opts, fopts, terms):
    """dS and kappa sigma / (1 - p) of one (query block, key block) tile into tiles[3], [4];
    ``tiles`` = (s, dp, deriv, q_t, ds, wk, do_t), ``blocks`` = (K^T, V^T) of the key block."""
    s, dp, deriv, q_t, ds, wk, do_t = tiles
    k_t, v_t = blocks
    keys, dim, vdim = dims[DIM_KEYS], dims[DIM_DIM], dims[DIM_VDIM]
    nc = min(BLOCK_K, keys - c0)
    one = np.ones(1, s.dtype)[0]
    matmul_t(q_t, k_t, dim, nr, BLOCK_K, s, True)
    factor = one
    if raw_scores_suffice(nr, nc, r0, c0, dims, opts, fopts, BLOCK_K):
        factor = fopts[FOPT_SCALE]
    else:
        finish_scores(s, nr, nc, r0, c0, b, h, dims, opts, fopts, terms, deriv)
    matmul_t(do_t, v_t, vdim, nr, BLOCK_K, dp, True)
    _grad_tiles(s, dp, nr, factor, fopts, ds, wk)
    if opts[OPT_HAS_DROPOUT] != 0:
        drop, dstr = terms[TERM_DROP], terms[TERM_DROP_STRIDES]
        _drop_tile(ds, nr, nc, r0, c0, b, h, drop, dstr)
        _drop_tile(wk, nr, nc, r0, c0, b, h, drop, dstr)
    return nc


@njit(**_OPTS)
def _backward_unit(q, packed, kv_head, unit, dims, opts, fopts, terms, grad_out, grads):
    """One (batch, kv head): ``packed`` = (K^T, K, V^T blocks); ``grads`` = (dq, dk padded,
    dv padded, dbias)."""
    kt_pack, k_pack, vt_pack = packed
    dq, dk, dv, dbias = grads
    heads, length, kv_heads = dims[DIM_HEADS], dims[DIM_LENGTH], dims[DIM_KV_HEADS]
    dim, vdim = dims[DIM_DIM], dims[DIM_VDIM]
    b = unit // kv_heads
    g = unit % kv_heads
    dt = q.dtype
    dpad, epad = k_pack.shape[4], dv.shape[3]
    q_blk = np.zeros((BLOCK_Q, dpad), dt)
    do_blk = np.zeros((BLOCK_Q, epad), dt)
    dq_acc = np.zeros((BLOCK_Q, dpad), dt)
    tiles = (
        np.empty((BLOCK_Q, BLOCK_K), dt),  # s
        np.empty((BLOCK_Q, BLOCK_K), dt),  # dp
        np.zeros((BLOCK_Q, BLOCK_K), dt),  # deriv
        np.empty((dim, BLOCK_Q), dt),  # q_t
        np.zeros((BLOCK_Q, BLOCK_K), dt),  # ds
        np.zeros((BLOCK_Q, BLOCK_K), dt),  # wk
        np.empty((vdim, BLOCK_Q), dt),  # do_t
    )
    ds, wk = tiles[4], tiles[5]
    has_bias = opts[OPT_HAS_BIAS] != 0
    has_softcap = opts[OPT_HAS_SOFTCAP] != 0
    scale = fopts[FOPT_SCALE]
    for h in range(heads):
        if kv_head[h] != g:
            continue
        for r0 in range(0, length, BLOCK_Q):
            nr = min(BLOCK_Q, length - r0)
            load_rows_t(q[b, h], r0, nr, tiles[3])
            load_rows_t(grad_out[b, h], r0, nr, tiles[6])
            load_rows(q[b, h], r0, nr, q_blk)
            load_rows(grad_out[b, h], r0, nr, do_blk)
            dq_acc[:] = 0
            first = first_key_block(r0, dims, opts, BLOCK_K)
            _, hi_last = row_interval(r0 + nr - 1, dims, opts)
            for c0 in range(first, hi_last, BLOCK_K):
                kb = c0 // BLOCK_K
                blocks = (kt_pack[b, g, kb], vt_pack[b, g, kb])
                nc = _key_tile(tiles, blocks, b, h, r0, nr, c0, dims, opts, fopts, terms)
                if has_bias:
                    for r in range(nr):
                        for c in range(nc):
                            dbias[b, h, r0 + r, c0 + c] = ds[r, c]
                _finish_ds(ds, tiles[2], nr, scale, has_softcap)
                matmul_n(ds, k_pack[b, g, kb], nc, nr, dpad, dq_acc)
                matmul_t(ds, q_blk, nr, nc, dpad, dk[b, g, c0 : c0 + BLOCK_K])
                matmul_t(wk, do_blk, nr, nc, epad, dv[b, g, c0 : c0 + BLOCK_K])
            for r in range(nr):
                for d in range(dim):
                    dq[b, h, r0 + r, d] = dq_acc[r, d]


@njit(parallel=True, **_OPTS)
def _pack_keys_backward(k, v, kt_pack, k_pack, vt_pack):
    """K^T (D, BLOCK_K), K (BLOCK_K, D padded) and V^T (E, BLOCK_K) blocks, zero-padded."""
    batch, kv_heads, keys = k.shape[0], k.shape[1], k.shape[2]
    nkb = kt_pack.shape[2]
    for unit in prange(batch * kv_heads * nkb):
        b = unit // (kv_heads * nkb)
        g = (unit // nkb) % kv_heads
        n = unit % nkb
        c0 = n * BLOCK_K
        nc = min(BLOCK_K, keys - c0)
        load_rows_t(k[b, g], c0, nc, kt_pack[b, g, n])
        load_rows(k[b, g], c0, nc, k_pack[b, g, n])
        load_rows_t(v[b, g], c0, nc, vt_pack[b, g, n])


@njit(parallel=True, **_OPTS)
def _backward_units(q, packed, kv_head, dims, opts, fopts, terms, grad_out, grads):
    for unit in prange(dims[DIM_BATCH] * dims[DIM_KV_HEADS]):
        _backward_unit(
            q, packed, kv_head, np.int64(unit), dims, opts, fopts, terms, grad_out, grads
        )


def sigmoid_backward_tiled(spec, grad_out, dtype):
    """(dq, dk, dv, dbias (B, H, L, S) or None) of a sigmoid spec in compute ``dtype`` by the
    tiled kernel; q, k, v and grad_out must be finite (the caller checks)."""
    q, k, v, kv_head, dims, opts, fopts, terms = kernel_arguments(spec, dtype)
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    nkb = max(-(-keys // BLOCK_K), 1)
    dpad, epad = padded(dim, dtype), padded(vdim, dtype)
    dq = np.zeros((batch, heads, length, dim), dtype)
    dk = np.zeros((batch, kv_heads, nkb * BLOCK_K, dpad), dtype)
    dv = np.zeros((batch, kv_heads, nkb * BLOCK_K, epad), dtype)
    has_bias = spec.bias is not None
    dbias = np.zeros((batch, heads, length, keys) if has_bias else (1, 1, 1, 1), dtype)
    grad_out = np.ascontiguousarray(grad_out, dtype)
    if length and keys:
        kt_pack = np.zeros((batch, kv_heads, nkb, dim, BLOCK_K), dtype)
        k_pack = np.zeros((batch, kv_heads, nkb, BLOCK_K, dpad), dtype)
        vt_pack = np.zeros((batch, kv_heads, nkb, vdim, BLOCK_K), dtype)
        _pack_keys_backward(k, v, kt_pack, k_pack, vt_pack)
        packed = (kt_pack, k_pack, vt_pack)
        _backward_units(q, packed, kv_head, dims, opts, fopts, terms, grad_out, (dq, dk, dv, dbias))
    dk = np.ascontiguousarray(dk[:, :, :keys, :dim])
    dv = np.ascontiguousarray(dv[:, :, :keys, :vdim])
    return dq, dk, dv, dbias if has_bias else None
