"""Deterministic Numba CPU kernels of the linear-attention recurrence
(:func:`refattn.linear_attention` with ``backend="numba"``), forward and reverse mode.

One work unit per (sequence, value head): a thread owns that state S (D, E) from the first step
to the last, so results do not depend on the thread count. Per step, in this order (the NumPy
path's operations; only its einsum reductions may sum in another order):

* decay ``S[d, :] *= a[d]`` (a scalar gate is broadcast over d: the same products);
* delta rule: ``pred[e] = sum_d S[d, e] k[d]`` (sequential in d), ``u = v - pred``,
  ``S[d, e] += (beta k[d]) u[e]``; plain: ``S[d, e] += k[d] v[e]``;
* ``o[e] = sum_d S[d, e] qs[d]`` (sequential in d) with ``qs = scale * q`` formed by the
  wrapper (after the l2norm, by the NumPy expressions of the float64 path).

``fastmath`` is off (no re-association, no contraction). The compute dtype is the arrays'
(float64, or float32: ``refattn.linear._kernels`` takes a ``compute_dtype``); the bound of either is
:func:`refattn.bounds.linear_forward_bound` with that ``dtype``. The reverse pass keeps a
checkpoint of S every ``floor(sqrt(T))`` steps and recomputes each block's states (memory
O(sqrt(T) D E) per work unit).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

__all__ = [
    "linear_forward",
    "linear_backward",
    "reverse_span",
    "reverse_work",
    "COMPUTE_DTYPES",
]

#: fastmath off (the reduction orders are fixed), no bounds checks, cached, GIL released
_OPTS = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)
COMPUTE_DTYPES = ("float64", "float32")
# params vector: has gate, has beta, log(base) (the chain factor of dg)
_GATE, _BETA, _LOG_BASE = 0, 1, 2


@njit(**_OPTS)
def _step(state, a, k, v, beta, has_beta, u):
    """One update of ``state`` (D, E) in place (``a`` is all ones without gates: the
    products by 1 are exact); ``u`` receives the delta-rule residual."""
    dim, edim = state.shape
    if has_beta:
        for e in range(edim):
            u[e] = 0
        for d in range(dim):
            for e in range(edim):
                state[d, e] = state[d, e] * a[d]
                u[e] += state[d, e] * k[d]
        for e in range(edim):
            u[e] = v[e] - u[e]
        for d in range(dim):
            scaled = beta * k[d]
            for e in range(edim):
                state[d, e] = state[d, e] + scaled * u[e]
    else:
        for d in range(dim):
            for e in range(edim):
                state[d, e] = state[d, e] * a[d] + k[d] * v[e]


@njit(parallel=True, **_OPTS)
def _forward(ins, beta, h0, seg, params, out, final):
    """ins = (qs, k, v, a) (B, HV, T, D|E); out (B, HV, T, E); final (N, HV, D, E)."""
    qs, k, v, a = ins
    heads, dim, edim = v.shape[1], k.shape[3], v.shape[3]
    has_beta = params[_BETA] != 0.0
    for unit in prange(seg.shape[0] * heads):
        n, j = unit // heads, unit % heads
        b, start, stop = seg[n, 0], seg[n, 1], seg[n, 2]
        state = h0[n, j].copy()
        u = np.empty(edim, dtype=state.dtype)
        row = np.empty(edim, dtype=state.dtype)
        for t in range(start, stop):
            _step(state, a[b, j, t], k[b, j, t], v[b, j, t], beta[b, j, t], has_beta, u)
            # o[e] = sum_d S[d, e] qs[d], sequential in d for every e (lanes over e)
            for e in range(edim):
                row[e] = 0
            for d in range(dim):
                for e in range(edim):
                    row[e] += state[d, e] * qs[b, j, t, d]
            out[b, j, t] = row
        final[n, j] = state


@njit(**_OPTS)
def _reverse_step(grads, d_state, before, t, place, ins, beta_t, params, work):
    """Reverse one step (see refattn.linear._float64._step_backward): gradients of step t
    into ``grads`` = (dqs, dk, dv, dg) and dbeta via ``work[4]``; d_state becomes dS_{t-1}."""
    qs, k, v, a, do = ins
    b, j = place
    dqs, dk, dv, dg = grads
    state, decayed, u, du, dsu = work[0], work[1], work[2][0], work[2][1], work[3][0]
    has_gate, has_beta = params[_GATE] != 0.0, params[_BETA] != 0.0
    dim, edim = state.shape
    zero = work[5][0]  # 0 in the compute dtype: accumulators stay in it
    log_base = work[5][1]
    state[:, :] = before
    _step(state, a[b, j, t], k[b, j, t], v[b, j, t], beta_t, has_beta, u)
    for d in range(dim):
        for e in range(edim):
            decayed[d, e] = before[d, e] * a[b, j, t, d]  # S', as the step formed it
    for d in range(dim):
        for e in range(edim):
            d_state[d, e] += qs[b, j, t, d] * do[b, j, t, e]
    for d in range(dim):
        acc = zero
        for e in range(edim):
            acc += state[d, e] * do[b, j, t, e]
        dqs[b, j, t, d] = acc
    for e in range(edim):
        du[e] = zero
    for d in range(dim):
        for e in range(edim):
            du[e] += d_state[d, e] * k[b, j, t, d]
    for e in range(edim):
        du[e] = beta_t * du[e] if has_beta else du[e]
        dv[b, j, t, e] = du[e]
    for d in range(dim):
        acc = zero
        for e in range(edim):
            acc += d_state[d, e] * (u[e] if has_beta else v[b, j, t, e])
        dsu[d] = acc
    if has_beta:
        total = zero
        for d in range(dim):
            total += k[b, j, t, d] * dsu[d]
        work[4][0] = total
        for d in range(dim):
            acc = zero
            for e in range(edim):
                acc += decayed[d, e] * du[e]
            dk[b, j, t, d] = beta_t * dsu[d] - acc
            for e in range(edim):
                d_state[d, e] = d_state[d, e] - k[b, j, t, d] * du[e]
    else:
        for d in range(dim):
            dk[b, j, t, d] = dsu[d]
    if has_gate:
        for d in range(dim):
            acc = zero
            for e in range(edim):
                acc += d_state[d, e] * before[d, e]
            dg[b, j, t, d] = acc * a[b, j, t, d] * log_base
            for e in range(edim):
                d_state[d, e] = d_state[d, e] * a[b, j, t, d]


@njit(**_OPTS)
def reverse_work(like, rows, log_base):
    """The work arrays of :func:`reverse_span` in ``like``'s dtype: ``rows`` recomputed states
    (rows, D, E) and the step's scratch; ``log_base`` the chain factor of dg."""
    dim, edim = like.shape
    return (
        np.empty((dim, edim), dtype=like.dtype),
        np.empty((dim, edim), dtype=like.dtype),
        np.empty((2, edim), dtype=like.dtype),
        np.empty((1, dim), dtype=like.dtype),
        np.empty(1, dtype=like.dtype),
        np.array([0.0, log_base]).astype(like.dtype),
        np.empty((max(rows, 1), dim, edim), dtype=like.dtype),
        np.empty(edim, dtype=like.dtype),
    )


@njit(**_OPTS)
def reverse_span(grads, d_state, span, ins, beta, params, work):
    """Reverse steps ``first .. last - 1`` of (b, j) (``span = (b, j, first, last)``) from the
    state before step ``first``, given in ``work[6][0]``: the span's states are recomputed
    forward (:func:`_step`) into ``work[6]``, then each step is reversed (:func:`_reverse_step`)
    from the last; ``grads = (dqs, dk, dv, dg, dbeta)``, ``d_state`` holds dS on entry (after
    step ``last - 1``) and dS before step ``first`` on exit."""
    qs, k, v, a, do = ins
    b, j, first, last = span
    has_beta = params[_BETA] != 0.0
    rows, u = work[6], work[7]
    for t in range(first, last - 1):
        here = rows[t - first + 1]
        here[:, :] = rows[t - first]
        _step(here, a[b, j, t], k[b, j, t], v[b, j, t], beta[b, j, t], has_beta, u)
    step_grads = (grads[0], grads[1], grads[2], grads[3])
    for t in range(last - 1, first - 1, -1):
        _reverse_step(
            step_grads, d_state, rows[t - first], t, (b, j), ins, beta[b, j, t], params, work
        )
        if has_beta:
            grads[4][b, j, t] = work[4][0]


@njit(parallel=True, **_OPTS)
def _backward(ins, beta, states, seg, params, grads, dbeta, dh0):
    """ins = (qs, k, v, a, do); states = (h0, dht); grads = (dqs, dk, dv, dg)."""
    qs, k, v, a, do = ins
    h0, dht = states
    heads = v.shape[1]
    has_beta = params[_BETA] != 0.0
    for unit in prange(seg.shape[0] * heads):
        n, j = unit // heads, unit % heads
        b, start, stop = seg[n, 0], seg[n, 1], seg[n, 2]
        length = stop - start
        block = max(1, int(math.sqrt(length)))
        while (block + 1) * (block + 1) <= length:
            block += 1
        while block * block > length and block > 1:
            block -= 1
        blocks = (length + block - 1) // block
        work = reverse_work(h0[n, j], block, params[_LOG_BASE])
        saved = np.empty((max(blocks, 1),) + h0[n, j].shape, dtype=h0.dtype)
        state = h0[n, j].copy()
        for t in range(start, stop):
            if (t - start) % block == 0:
                saved[(t - start) // block] = state
            _step(state, a[b, j, t], k[b, j, t], v[b, j, t], beta[b, j, t], has_beta, work[7])
        d_state = dht[n, j].copy()
        all_grads = (grads[0], grads[1], grads[2], grads[3], dbeta)
        for index in range(blocks - 1, -1, -1):
            first = start + index * block
            work[6][0] = saved[index]
            span = (b, j, first, min(first + block, stop))
            reverse_span(all_grads, d_state, span, ins, beta, params, work)
        dh0[n, j] = d_state


def _check_dtype(dtype):
    if np.dtype(dtype).name not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype: expected one of {list(COMPUTE_DTYPES)}, got {dtype!r}")


def linear_forward(ins, beta, h0, seg, params):
    """(o (B, HV, T, E), final (N, HV, D, E)) in the arrays' dtype (float64 or float32).

    ``ins = (qs, k, v, a)``: scaled normalised queries, keys (B, HV, T, D), values
    (B, HV, T, E), decays (B, HV, T, D) (ones without gates); ``beta`` (B, HV, T) (ignored
    without the delta rule); ``h0`` (N, HV, D, E); ``seg`` (N, 3) int64 rows (batch row,
    start, stop); ``params`` float64 [has gate, has beta, log(base)]. All C-contiguous.
    """
    dtype = ins[0].dtype
    _check_dtype(dtype)
    out = np.empty(ins[2].shape, dtype=dtype)  # every element is written: segments tile T
    final = np.empty(h0.shape, dtype=dtype)
    if out.size or final.size:
        _forward(ins, beta, h0, seg, params, out, final)
    return out, final


def linear_backward(ins, beta, states, seg, params):
    """The reverse pass: (dqs, dk, dv, dg per key row (B, HV, T, D), dbeta, dh0) in the
    arrays' dtype; ``ins = (qs, k, v, a, do)``, ``states = (h0, dht)``, the rest as
    :func:`linear_forward`."""
    dtype = ins[0].dtype
    _check_dtype(dtype)
    grads = tuple(np.zeros(x.shape, dtype) for x in ins[:4])
    dbeta = np.zeros(beta.shape, dtype)
    dh0 = np.zeros(states[0].shape, dtype)
    if seg.shape[0] and ins[2].size:
        _backward(ins, beta, states, seg, params, grads, dbeta, dh0)
    else:
        dh0[...] = states[1]
    return (*grads, dbeta, dh0)
