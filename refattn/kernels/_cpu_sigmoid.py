"""Scalar per-row Numba CPU kernels of sigmoid attention (``normalizer="sigmoid"``): forward
and backward. The dispatch runs the tiled kernels of :mod:`._cpu_sigmoid_tiles` (the same
operations in the same order, so the same bits); these remain their reference and run the vjp
when an input holds inf or NaN.

With no normaliser there is no online rescaling: each output is a plain sum over keys,
``out_i = sum_j kappa_ij sigma(t_ij) v_j / (1 - p)``. The kernels are per-row loops (one
path for prefill and decode alike: a decode step is rows of L = 1), deterministic:

* forward work units are query rows (b, h, i), run with ``prange``; the scores of row i are
  ``q_i . k_j`` (fused multiply-adds, sequential over D), then the options of
  :func:`~._cpu_scores.finish_scores` (the one scoring of the CPU kernels: scale, softcap,
  bias, ALiBi and the allowed set, -inf marking an excluded key); ``sum_j`` runs over keys in
  increasing order, one fused multiply-add per term;
* backward units are (batch, kv head) pairs: the query heads of the group in increasing
  order, their rows in increasing order, keys in increasing order; each unit owns its dk, dv
  rows and its heads' dq and dbias, so no partials are reduced afterwards.

The sigmoid is ``1 / (1 + e^{-t})`` for ``t >= 0`` and ``e^t / (1 + e^t)`` otherwise with the
kernels' polynomial exponential (:func:`~._cpu_tiles.exp_compute`), and the derivative
``sigma(t) sigma(-t)``. ``fastmath`` is off. Error bound:
:func:`refattn.bounds.sigmoid_forward_bound` with the compute dtype.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

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
from ._cpu_scores import finish_scores
from ._cpu_tiles import exp_compute
from ._simd import KERNEL_OPTIONS, fma, lanes

__all__ = ["sigmoid_forward", "sigmoid_backward", "sigmoid_compute"]

_OPTS = KERNEL_OPTIONS


@njit(**_OPTS)
def sigmoid_compute(x, one):
    """sigma(x) in the compute dtype (``one`` = 1 in it): ``1 / (1 + e^{-x})`` for ``x >= 0``,
    ``e^x / (1 + e^x)`` otherwise (:func:`~._cpu_tiles.exp_compute`); never overflows.

    Examples
    --------
    >>> float(sigmoid_compute(np.float64(0.0), np.float64(1.0)))
    0.5
    """
    if x >= 0:
        return one / (one + exp_compute(-x))
    e = exp_compute(x)
    return e / (one + e)


@njit(**_OPTS)
def _zero(x):
    return np.zeros(1, x.dtype)[0]


@njit(**_OPTS)
def _scores(q, k, g, b, h, i, dims, opts, fopts, terms, s, deriv):
    """Final scores of row i into s[0, :S] (-inf where excluded), softcap's derivative into
    deriv[0, :S]."""
    keys, dim = dims[DIM_KEYS], dims[DIM_DIM]
    qrow = q[b, h, i]
    krows = k[b, g]
    for j in range(s.shape[1]):
        acc = _zero(q)
        if j < keys:
            for d in range(dim):
                acc = fma(qrow[d], krows[j, d], acc)
        s[0, j] = acc
    finish_scores(s, 1, keys, i, 0, b, h, dims, opts, fopts, terms, deriv)


@njit(**_OPTS)
def _forward_row(q, k, v, kv_head, unit, dims, opts, fopts, terms, out):
    heads, length, keys, vdim = dims[DIM_HEADS], dims[DIM_LENGTH], dims[DIM_KEYS], dims[DIM_VDIM]
    b = unit // (heads * length)
    h = (unit // length) % heads
    i = unit % length
    g = kv_head[h]
    dt = q.dtype
    width = max(-(-keys // lanes(q)), 1) * lanes(q)  # whole vectors for finish_scores
    s = np.empty((1, width), dt)
    deriv = np.empty((1, width), dt)
    acc = np.zeros(vdim, dt)
    one = np.ones(1, dt)[0]
    _scores(q, k, g, b, h, i, dims, opts, fopts, terms, s, deriv)
    drop, dstr = terms[TERM_DROP], terms[TERM_DROP_STRIDES]
    has_drop = opts[OPT_HAS_DROPOUT] != 0
    any_allowed = False
    for j in range(keys):
        t = s[0, j]
        if t == -np.inf:
            continue
        any_allowed = True
        if has_drop and drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * j] == 0:
            continue
        w = sigmoid_compute(t, one)
        for e in range(vdim):
            acc[e] = fma(w, v[b, g, j, e], acc[e])
    orow = out[b, h, i]
    if not any_allowed:
        fill = np.nan if opts[OPT_EMPTY_ROWS_NAN] != 0 else 0.0
        for e in range(vdim):
            orow[e] = fill
        return
    keep = fopts[FOPT_KEEP_SCALE]
    for e in range(vdim):
        orow[e] = acc[e] * keep


@njit(parallel=True, **_OPTS)
def _forward_rows(q, k, v, kv_head, dims, opts, fopts, terms, out):
    total = dims[DIM_BATCH] * dims[DIM_HEADS] * dims[DIM_LENGTH]
    for unit in prange(total):
        _forward_row(q, k, v, kv_head, np.int64(unit), dims, opts, fopts, terms, out)


@njit(**_OPTS)
def _backward_group(q, k, v, kv_head, unit, dims, opts, fopts, terms, grad_out, grads):
    dq, dk, dv, dbias = grads
    heads, length, kv_heads = dims[DIM_HEADS], dims[DIM_LENGTH], dims[DIM_KV_HEADS]
    keys, dim, vdim = dims[DIM_KEYS], dims[DIM_DIM], dims[DIM_VDIM]
    b = unit // kv_heads
    g = unit % kv_heads
    dt = q.dtype
    width = max(-(-keys // lanes(q)), 1) * lanes(q)  # whole vectors for finish_scores
    s = np.empty((1, width), dt)
    deriv = np.empty((1, width), dt)
    one = np.ones(1, dt)[0]
    drop, dstr = terms[TERM_DROP], terms[TERM_DROP_STRIDES]
    has_drop, has_softcap, has_bias = (
        opts[OPT_HAS_DROPOUT] != 0,
        opts[OPT_HAS_SOFTCAP] != 0,
        opts[OPT_HAS_BIAS] != 0,
    )
    scale, keep = fopts[FOPT_SCALE], fopts[FOPT_KEEP_SCALE]
    for h in range(heads):
        if kv_head[h] != g:
            continue
        for i in range(length):
            _scores(q, k, g, b, h, i, dims, opts, fopts, terms, s, deriv)
            do = grad_out[b, h, i]
            qrow = q[b, h, i]
            dqrow = dq[b, h, i]
            for j in range(keys):
                t = s[0, j]
                if t == -np.inf:
                    continue
                if has_drop and drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * j] == 0:
                    continue
                w = sigmoid_compute(t, one)
                dp = _zero(q)
                for e in range(vdim):
                    dp = fma(do[e], v[b, g, j, e], dp)
                    dv[b, g, j, e] = fma(w * keep, do[e], dv[b, g, j, e])
                ds = w * sigmoid_compute(-t, one) * (dp * keep)
                if has_bias:
                    dbias[b, h, i, j] = ds
                if has_softcap:
                    ds = ds * deriv[0, j]
                ds = ds * scale
                for d in range(dim):
                    dqrow[d] = fma(ds, k[b, g, j, d], dqrow[d])
                    dk[b, g, j, d] = fma(ds, qrow[d], dk[b, g, j, d])


@njit(parallel=True, **_OPTS)
def _backward_groups(q, k, v, kv_head, dims, opts, fopts, terms, grad_out, grads):
    for unit in prange(dims[DIM_BATCH] * dims[DIM_KV_HEADS]):
        _backward_group(q, k, v, kv_head, np.int64(unit), dims, opts, fopts, terms, grad_out, grads)


def sigmoid_forward(spec, dtype):
    """out (B, H, L, E) of a sigmoid spec in compute ``dtype`` (no lse)."""
    args = kernel_arguments(spec, dtype)
    batch, heads, _, length, _, _, vdim = spec.dims
    out = np.zeros((batch, heads, length, vdim), dtype)
    if out.size:
        _forward_rows(*args, out)
    return out


def sigmoid_backward(spec, grad_out, dtype):
    """(dq, dk, dv, dbias (B, H, L, S) or None) of a sigmoid spec in compute ``dtype``."""
    q, k, v, kv_head, dims, opts, fopts, terms = kernel_arguments(spec, dtype)
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    dq = np.zeros((batch, heads, length, dim), dtype)
    dk = np.zeros((batch, kv_heads, keys, dim), dtype)
    dv = np.zeros((batch, kv_heads, keys, vdim), dtype)
    has_bias = spec.bias is not None
    dbias = np.zeros((batch, heads, length, keys) if has_bias else (1, 1, 1, 1), dtype)
    grad_out = np.ascontiguousarray(grad_out, dtype)
    if length and keys:
        _backward_groups(q, k, v, kv_head, dims, opts, fopts, terms, grad_out, (dq, dk, dv, dbias))
    return dq, dk, dv, dbias if has_bias else None
