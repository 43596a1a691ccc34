"""The backward pass of the Numba CPU kernels (:mod:`.numba_cpu`).

Work units are (batch, head, query chunk) (one chunk per head when B H >= 8,
:func:`backward_chunks`), run with ``prange``; each recomputes the scores of its query blocks
against the key blocks they may read (packed once per (batch, kv head)), and accumulates dq
itself and dk, dv into its own partials, summed afterwards in increasing (head, chunk) order
(:func:`sum_parts`). delta = dO . O - dlse (:func:`delta_rows`) comes first.
"""

from __future__ import annotations

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
    OPT_HAS_BIAS,
    OPT_HAS_DROPOUT,
    OPT_HAS_SOFTCAP,
    TERM_DROP,
    TERM_DROP_STRIDES,
)
from ._cpu_scores import finish_scores, first_key_block, raw_scores_suffice, row_interval
from ._cpu_tiles import (
    BLOCK_K,
    BLOCK_Q,
    load_rows,
    load_rows_t,
    matmul_n,
    matmul_t,
    pad,
    padded,
)
from ._simd import KERNEL_OPTIONS, fma, lanes, vexp, vkeep, vload, vmul, vmuls, vstore, vsubs

__all__ = ["backward_chunks", "backward_units", "delta_rows", "sum_parts"]

#: heads are the cheapest units (no dk/dv partials to store and add); query chunks are only
#: added when there are fewer (batch, head) pairs than this.
_MIN_BACKWARD_UNITS = 8


_OPTS = KERNEL_OPTIONS


def backward_chunks(batch: int, heads: int, length: int, keys: int = 0) -> int:
    """Query chunks per (batch, head) of the backward pass (a function of the shape only).

    Enough chunks for :data:`_MIN_BACKWARD_UNITS` work units, but at most ``max(8, 2**19 /
    S)`` per head: each chunk keeps its own (S, D) and (S, E) partials of dk and dv, which
    are then added in chunk order (memory traffic that one chunk per head avoids).

    Examples
    --------
    >>> backward_chunks(1, 8, 1024, 1024), backward_chunks(1, 1, 65536, 65536)
    (1, 8)
    """
    nqb = -(-length // BLOCK_Q)
    wanted = -(-_MIN_BACKWARD_UNITS // max(1, batch * heads))
    cap = max(8, 2**19 // max(1, keys))
    return max(1, min(nqb, wanted, cap))


@njit(**_OPTS)
def _backward_unit(q, packed, kv_head, saved, unit, nchunks, dims, opts, fopts, terms, grads):
    """One (batch, head, query chunk): ``packed`` = (K^T, K, V^T blocks) from
    :func:`_pack_keys_backward`; ``saved`` = (dO, lse, delta); ``grads`` = (dq, dk partials, dv
    partials, dbias); ``terms`` as in :func:`~._cpu_scores.finish_scores`."""
    kt_pack, k_pack, vt_pack = packed
    grad_out, lse, delta = saved
    dq, dk_part, dv_part, dbias = grads
    drop, dstr = terms[TERM_DROP], terms[TERM_DROP_STRIDES]
    heads, length, keys = dims[DIM_HEADS], dims[DIM_LENGTH], dims[DIM_KEYS]
    dim, vdim = dims[DIM_DIM], dims[DIM_VDIM]
    nqb = -(-length // BLOCK_Q)
    b = unit // (heads * nchunks)
    h = (unit // nchunks) % heads
    chunk = unit % nchunks
    per_chunk = -(-nqb // nchunks)
    g = kv_head[h]
    dt = q.dtype
    width = lanes(q)
    dpad = pad(dim, width)
    epad = pad(vdim, width)
    q_t = np.empty((dim, BLOCK_Q), dt)
    q_blk = np.empty((BLOCK_Q, dpad), dt)
    do_t = np.empty((vdim, BLOCK_Q), dt)
    do_blk = np.empty((BLOCK_Q, epad), dt)
    s = np.empty((BLOCK_Q, BLOCK_K), dt)
    dp = np.empty((BLOCK_Q, BLOCK_K), dt)
    p = np.zeros((BLOCK_Q, BLOCK_K), dt)
    ds = np.zeros((BLOCK_Q, BLOCK_K), dt)
    deriv = np.empty((BLOCK_Q, BLOCK_K), dt)
    dq_acc = np.empty((BLOCK_Q, dpad), dt)
    has_softcap, has_bias, has_drop = (
        opts[OPT_HAS_SOFTCAP] != 0,
        opts[OPT_HAS_BIAS] != 0,
        opts[OPT_HAS_DROPOUT] != 0,
    )
    scale, keep_scale = fopts[FOPT_SCALE], fopts[FOPT_KEEP_SCALE]
    plain = not (has_softcap or has_bias or has_drop)
    one = np.ones(1, dt)[0]
    dk_out, dv_out = dk_part[b, h, chunk], dv_part[b, h, chunk]
    dk_out[:, :] = 0
    dv_out[:, :] = 0
    for qb in range(chunk * per_chunk, min(nqb, (chunk + 1) * per_chunk)):
        r0 = qb * BLOCK_Q
        nr = min(BLOCK_Q, length - r0)
        rows = nr
        load_rows_t(q[b, h], r0, nr, q_t)
        # a non-finite q or k at an allowed position already makes dS non-finite there;
        # zeroing it here keeps it out of the rows/keys that exclude it (0 * NaN)
        load_rows(q[b, h], r0, nr, q_blk, True)
        load_rows_t(grad_out[b, h], r0, nr, do_t)
        load_rows(grad_out[b, h], r0, nr, do_blk)
        for r in range(nr):
            if lse[b, h, r0 + r] == -np.inf:  # empty row: zero gradients
                q_blk[r, :] = 0
                do_blk[r, :] = 0
                q_t[:, r] = 0
                do_t[:, r] = 0
        dq_acc[:, :] = 0
        first = first_key_block(r0, dims, opts, BLOCK_K)
        _, hi_last = row_interval(r0 + nr - 1, dims, opts)
        for c0 in range(first, hi_last, BLOCK_K):
            nc = min(BLOCK_K, keys - c0)
            kb = c0 // BLOCK_K
            k_t, k_blk, v_t = kt_pack[b, g, kb], k_pack[b, g, kb], vt_pack[b, g, kb]
            matmul_t(q_t, k_t, dim, rows, BLOCK_K, s, True)
            factor = one  # x * 1 is x: the scores in s are final
            if plain and raw_scores_suffice(nr, nc, r0, c0, dims, opts, fopts, BLOCK_K):
                factor = scale
            else:
                finish_scores(s, nr, nc, r0, c0, b, h, dims, opts, fopts, terms, deriv)
            matmul_t(do_t, v_t, vdim, rows, BLOCK_K, dp, True)
            for r in range(nr):
                i = r0 + r
                row_lse = lse[b, h, i]
                srow, prow, dsrow, dprow = s[r], p[r], ds[r], dp[r]
                if row_lse == -np.inf:
                    prow[:] = 0
                    dsrow[:] = 0
                    continue
                d_i = delta[b, h, i]
                if plain:
                    # P, dS = P (dP z - delta), dropout scale and softmax scale, lane-parallel
                    # (the same operations per element as the general branch below)
                    for c in range(0, BLOCK_K, width):
                        sv = vmuls(vload(srow, c), factor)
                        pv = vexp(vsubs(sv, row_lse))
                        grad = vmul(pv, vsubs(vmuls(vload(dprow, c), keep_scale), d_i))
                        vstore(dsrow, c, vmuls(vkeep(sv, grad), scale))
                        vstore(prow, c, vmuls(pv, keep_scale))
                    continue
                for c in range(0, BLOCK_K, width):
                    vstore(prow, c, vexp(vsubs(vload(srow, c), row_lse)))
                for c in range(BLOCK_K):
                    grad = prow[c] * (dprow[c] * keep_scale - d_i)
                    dsrow[c] = grad if srow[c] != -np.inf else 0
                if has_drop:
                    for c in range(nc):
                        j = c0 + c
                        if drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * j] == 0:
                            dsrow[c] = (0 - prow[c] * d_i) if srow[c] != -np.inf else 0
                            prow[c] = 0
                        else:
                            prow[c] = prow[c] * keep_scale
                else:
                    for c in range(BLOCK_K):
                        prow[c] = prow[c] * keep_scale
                if has_bias:
                    for c in range(nc):
                        dbias[b, h, i, c0 + c] = dsrow[c]
                if has_softcap:
                    for c in range(nc):
                        if srow[c] != -np.inf:
                            dsrow[c] = dsrow[c] * deriv[r, c]
                for c in range(BLOCK_K):
                    dsrow[c] = dsrow[c] * scale
            matmul_n(ds, k_blk, nc, rows, dpad, dq_acc)
            matmul_t(ds, q_blk, nr, BLOCK_K, dpad, dk_out[c0 : c0 + BLOCK_K])
            matmul_t(p, do_blk, nr, BLOCK_K, epad, dv_out[c0 : c0 + BLOCK_K])
        for r in range(nr):
            dq[b, h, r0 + r, :] = dq_acc[r, :dim]


@njit(parallel=True, **_OPTS)
def _pack_keys_backward(k, v, kt_pack, k_pack, vt_pack):
    """Pack every key block once per (batch, kv head): K transposed (D, BLOCK_K), K with
    non-finite values stored as 0 (BLOCK_K, D padded), V transposed (E, BLOCK_K)."""
    batch, kv_heads, keys = k.shape[0], k.shape[1], k.shape[2]
    nkb = kt_pack.shape[2]
    for unit in prange(batch * kv_heads * nkb):
        b = unit // (kv_heads * nkb)
        g = (unit // nkb) % kv_heads
        n = unit % nkb
        c0 = n * BLOCK_K
        nc = min(BLOCK_K, keys - c0)
        load_rows_t(k[b, g], c0, nc, kt_pack[b, g, n])
        load_rows(k[b, g], c0, nc, k_pack[b, g, n], True)
        load_rows_t(v[b, g], c0, nc, vt_pack[b, g, n])


@njit(parallel=True, **_OPTS)
def _backward_units(q, packed, kv_head, saved, nchunks, dims, opts, fopts, terms, grads):
    batch, heads = dims[DIM_BATCH], dims[DIM_HEADS]
    for unit in prange(batch * heads * nchunks):
        _backward_unit(
            q, packed, kv_head, saved, np.int64(unit), nchunks, dims, opts, fopts, terms, grads
        )


def backward_units(q, k, v, kv_head, saved, nchunks, dims, opts, fopts, terms, grads):
    """Pack the key blocks (:func:`_pack_keys_backward`), then run the query-chunk units:
    ``saved`` = (dO, lse, delta), ``grads`` = (dq, dk partials, dv partials, dbias) are
    written; the rest is :func:`~refattn.kernels._args.kernel_arguments`."""
    batch, kv_heads, keys, dim = k.shape
    vdim = v.shape[3]
    nkb = -(-keys // BLOCK_K)
    kt_pack = np.empty((batch, kv_heads, nkb, dim, BLOCK_K), k.dtype)
    k_pack = np.empty((batch, kv_heads, nkb, BLOCK_K, padded(dim, k.dtype)), k.dtype)
    vt_pack = np.empty((batch, kv_heads, nkb, vdim, BLOCK_K), v.dtype)
    _pack_keys_backward(k, v, kt_pack, k_pack, vt_pack)
    packed = (kt_pack, k_pack, vt_pack)
    with parallel_chunksize(1):
        _backward_units(q, packed, kv_head, saved, nchunks, dims, opts, fopts, terms, grads)


@njit(parallel=True, **_OPTS)
def delta_rows(grad_out, out, grad_lse, has_grad_lse, delta):
    """delta_i = dO_i . O_i - dlse_i, sequential over E (FlashAttention-2, Algorithm 2)."""
    batch, heads, length, vdim = out.shape
    for bh in prange(batch * heads):
        b, h = bh // heads, bh % heads
        for i in range(length):
            delta[b, h, i] = 0
            for e in range(vdim):
                delta[b, h, i] = fma(grad_out[b, h, i, e], out[b, h, i, e], delta[b, h, i])
            if has_grad_lse:
                delta[b, h, i] = delta[b, h, i] - grad_lse[b, h, i]


@njit(parallel=True, **_OPTS)
def _reduce_parts(part, kv_head, kv_heads, feats, result):
    """result[b, g] = sum over (h with kv_head[h] == g, chunk) in increasing order."""
    batch, heads, nchunks, keys = part.shape[0], part.shape[1], part.shape[2], result.shape[2]
    for bg in prange(batch * kv_heads):
        b, g = bg // kv_heads, bg % kv_heads
        for h in range(heads):
            if kv_head[h] != g:
                continue
            for chunk in range(nchunks):
                for j in range(keys):
                    for x in range(feats):
                        result[b, g, j, x] += part[b, h, chunk, j, x]


def sum_parts(part, kv_head, kv_heads, keys, feats, length):
    """(B, K, S, F): the partials summed over the query heads of each kv head and the query
    chunks in increasing (head, chunk) order; one partial per kv head is the result itself
    (no copy when unpadded)."""
    batch, heads, nchunks = part.shape[:3]
    result = np.zeros((batch, kv_heads, keys, feats), part.dtype)
    if not (length and result.size):  # no unit ran: the partials were never written
        return result
    if heads == kv_heads and nchunks == 1:  # kv_head is the identity then
        whole = part[:, :, 0, :keys, :feats]
        return whole if whole.flags.c_contiguous else np.ascontiguousarray(whole)
    _reduce_parts(part, kv_head, kv_heads, feats, result)
    return result
