"""The sparse-key (gather) backward of the Numba CPU kernels (:mod:`.numba_cpu`).

The vjp of :mod:`._cpu_gather`'s forward: each query row visits its listed keys only (the same
sorted, de-duplicated list inside the row's structural interval), recomputes the final scores
of the gathered positions as the forward does, and applies FlashAttention-2's backward
(Dao 2023, Algorithm 2) per gathered key j, with ``P_ij = exp(t_ij - lse_i)``, ``z_ij`` the
dropout factor (kept / (1 - p)) and ``delta_i = dO_i . O_i - dlse_i``:

.. math::

    dP_{ij} = z_{ij}\\, dO_i \\cdot v_j, \\quad dS_{ij} = P_{ij}(dP_{ij} - \\delta_i), \\quad
    dq_i \\mathrel{+}= s\\, c'_{ij} dS_{ij} k_j, \\quad
    dk_j \\mathrel{+}= s\\, c'_{ij} dS_{ij} q_i, \\quad dv_j \\mathrel{+}= z_{ij} P_{ij} dO_i

(c' the softcap derivative; dbias_ij = dS_ij on allowed positions).

Determinism: a work unit is a (batch, kv head) pair; it runs its query rows in increasing
order and, per row, the group's query heads in increasing order and the listed keys in
increasing order, so every sum (over E for dP, over keys for dq, over (row, head) for dk and
dv) has an order fixed by the shapes and the lists: bit-identical for any number of threads.
Parallelism is over B K units only (a DeepSeek Sparse Attention decode step, K = 1, runs on one
thread); memory O(T) per unit besides the outputs.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, parallel_chunksize, prange

from ._args import (
    DIM_BATCH,
    DIM_KV_HEADS,
    DIM_LENGTH,
    FOPT_KEEP_SCALE,
    FOPT_SCALE,
    FOPT_SOFTCAP,
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
from ._cpu_gather import row_keys
from ._cpu_scores import row_interval
from ._cpu_tiles import exp_compute
from ._simd import KERNEL_OPTIONS, fma

__all__ = ["gather_backward"]

_OPTS = KERNEL_OPTIONS


@njit(**_OPTS)
def _score(qrow, krow, b, h, i, j, opts, fopts, terms):
    """(allowed, final score t, d softcap / d raw) of position (i, j): the q.k chain of fused
    multiply-adds over D, then the forward's order (scale -> softcap -> + bias -> + ALiBi)."""
    bias, bstr = terms[TERM_BIAS], terms[TERM_BIAS_STRIDES]
    mask, mstr, slopes = terms[TERM_MASK], terms[TERM_MASK_STRIDES], terms[TERM_SLOPES]
    ty = qrow.dtype.type  # every step rounds to the compute dtype (float32 stays float32)
    if opts[OPT_HAS_MASK] != 0 and mask[mstr[0] * b + mstr[1] * h + mstr[2] * i + mstr[3] * j] == 0:
        return False, ty(0), ty(0)
    raw = ty(0)
    for x in range(qrow.shape[0]):
        raw = fma(qrow[x], krow[x], raw)
    t = ty(raw * fopts[FOPT_SCALE])
    deriv = ty(1)
    if opts[OPT_HAS_SOFTCAP] != 0:
        cap = fopts[FOPT_SOFTCAP]
        th = ty(math.tanh(t / cap))
        t = ty(cap * th)
        deriv = ty(1) - th * th
    if opts[OPT_HAS_BIAS] != 0:
        bv = bias[bstr[0] * b + bstr[1] * h + bstr[2] * i + bstr[3] * j]
        if bv == -np.inf:
            return False, t, deriv
        t = ty(t + bv)
    if opts[OPT_HAS_ALIBI] != 0:
        t = ty(t - slopes[h] * abs(i + opts[OPT_OFFSET] - j))
    return t != -np.inf, t, deriv


@njit(**_OPTS)
def _row_grads(index, cols, count, tensors, saved, opts, fopts, terms, grads):
    """The gradients of row i of head h = ``index`` over its ``count`` listed keys ``cols``:
    dq_i (final), dk and dv of the gathered keys accumulated, dbias written when there is a
    bias. ``tensors`` = (q, k, v, dO); ``saved`` = (lse, delta)."""
    b, g, h, i = index
    q, k, v, grad_out = tensors
    lse, delta = saved
    dq, dk, dv, dbias = grads
    row_lse = lse[b, h, i]
    if row_lse == -np.inf:  # an empty row: zero gradients
        return
    drop, dstr = terms[TERM_DROP], terms[TERM_DROP_STRIDES]
    has_drop, has_bias = opts[OPT_HAS_DROPOUT] != 0, opts[OPT_HAS_BIAS] != 0
    keep_scale, scale = fopts[FOPT_KEEP_SCALE], fopts[FOPT_SCALE]
    qrow, dorow, dqrow = q[b, h, i], grad_out[b, h, i], dq[b, h, i]
    ty = q.dtype.type  # the compute dtype of every step (see _score)
    d_i = delta[b, h, i]
    for c in range(count):
        j = cols[c]
        krow, vrow = k[b, g, j], v[b, g, j]
        ok, t, deriv = _score(qrow, krow, b, h, i, j, opts, fopts, terms)
        if not ok:
            continue
        p = ty(exp_compute(ty(t - row_lse)))
        kept = not has_drop or drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * j] != 0
        dp = ty(0)
        if kept:
            for e in range(vrow.shape[0]):
                dp = fma(dorow[e], vrow[e], dp)
            dp = ty(dp * keep_scale)
            w = ty(p * keep_scale)
            dvrow = dv[b, g, j]
            for e in range(vrow.shape[0]):
                dvrow[e] = fma(w, dorow[e], dvrow[e])
        ds = ty(p * ty(dp - d_i))
        if has_bias:
            dbias[b, h, i, j] = ds
        dt = ty(ty(ds * deriv) * scale)
        dkrow = dk[b, g, j]
        for x in range(qrow.shape[0]):
            dqrow[x] = fma(dt, krow[x], dqrow[x])
            dkrow[x] = fma(dt, qrow[x], dkrow[x])


@njit(parallel=True, **_OPTS)
def _gather_backward_units(tensors, saved, group_heads, listed, dims, opts, fopts, terms, grads):
    """Every (batch, kv head) unit in parallel; rows, heads and keys in increasing order."""
    batch, kv_heads, length = dims[DIM_BATCH], dims[DIM_KV_HEADS], dims[DIM_LENGTH]
    for unit in prange(batch * kv_heads):
        b = unit // kv_heads
        g = unit % kv_heads
        cols = np.empty(listed.shape[3], np.int64)
        for i in range(length):
            lo, hi = row_interval(np.int64(i), dims, opts)
            count = row_keys(listed[b, g, i], lo, hi, cols)
            for t in range(group_heads.shape[1]):
                index = (np.int64(b), np.int64(g), group_heads[g, t], np.int64(i))
                _row_grads(index, cols, count, tensors, saved, opts, fopts, terms, grads)


def gather_backward(listed, args, saved, grads):
    """Accumulate the gather vjp into ``grads`` = (dq (B, H, L, D), dk (B, K, S, D), dv (B, K,
    S, E), dbias (B, H, L, S) or a dummy), all zeroed by the caller: ``listed`` the sorted
    (B, K, L, T) lists, ``args`` :func:`~refattn.kernels._args.kernel_arguments`, ``saved`` =
    (dO (B, H, L, E), lse (B, H, L) with -inf on empty rows, delta (B, H, L))."""
    q, k, v, kv_head, dims, opts, fopts, terms = args
    grad_out, lse, delta = saved
    heads, kv_heads = len(kv_head), k.shape[1]
    group_heads = np.array(
        [[h for h in range(heads) if kv_head[h] == g] for g in range(kv_heads)], np.int64
    )
    with parallel_chunksize(1):
        _gather_backward_units(
            (q, k, v, grad_out), (lse, delta), group_heads, listed, dims, opts, fopts, terms, grads
        )
