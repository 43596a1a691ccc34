"""Deterministic Numba CPU kernel of the linear-attention recurrence in chunked form
(:func:`refattn.linear_attention` with ``backend="numba-chunked"``), forward and reverse mode.

The chunked (WY / UT-transform) form of the gated delta rule that flash-linear-attention's
chunk kernels compute (the chunkwise WY representation of Yang et al. 2024, "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length"; with gates, Yang, Kautz &
Hatamizadeh 2024, "Gated Delta Networks"; neither paper is among refattn's source documents, so
no equation numbers are cited), derived here for refattn's (D, E) state. Per sequence and value
head, per chunk of ``C`` steps r = 0 .. L-1 (L <= C) starting from the state S_0:

* cumulative log decays ``G_r = sum_{s <= r} log a_s`` (sequential, per key row for a vector
  gate; ``G_{-1} = 0``) and the decay ratios ``D_rj = exp(G_r - G_j)`` (j <= r);
* delta rule: the step's scaled residuals ``w_r = beta_r u_r`` solve the unit lower triangular
  system ``(I + A) W = R`` with ``A_rj = beta_r sum_d k_r[d] k_j[d] D_rj[d]`` (j < r) and
  ``R_r = beta_r (v_r - S_0^T (exp(G_r) * k_r))``, solved by forward substitution (row r after
  rows 0 .. r-1, j ascending); plain update: ``w_r = v_r``;
* outputs ``o_r = S_0^T (exp(G_r) * qs_r) + sum_{j <= r} (sum_d qs_r[d] k_j[d] D_rj[d]) w_j``
  (j ascending);
* the state once per chunk: ``S[d, :] <- exp(G_{L-1}[d]) S_0[d, :] + sum_j D_{L-1,j}[d]
  k_j[d] w_j`` (j ascending).

A scalar gate (or none: ``G = 0``) forms each ratio once per pair (r, j); a vector gate forms
one per key row. Every reduction runs in a fixed order set by the shapes, ``fastmath`` is off,
and one thread owns one (sequence, value head) from its first chunk to its last, so results do
not depend on the thread count. Compute dtype: the arrays' (float64 or float32). The error
bound (the cumulative sums' rounding, the decay ratios, the triangular solve's conditioning) is
:func:`refattn.bounds.linear.linear_chunked_forward_bound` (through
:func:`refattn.linear.forward_error_bound` with ``backend="numba-chunked"``).

Reverse mode (:func:`chunked_backward`): a chunked backward with boundary checkpoints, as
chunk kernels recompute the states at chunk boundaries before their backward. Per (sequence,
value head) the chunked forward above (outputs skipped) gives the states at the chunk
boundaries; then, from the last chunk to the first, the chunk's states are recomputed step by
step from its boundary state and each step is reversed from the last, by the recurrent kernel's
functions (:func:`refattn.kernels.linear_cpu.reverse_span`, the adjoint of the recurrence of
:func:`refattn.linear_attention`): a reverse recurrence within each chunk driven by the
boundary states, not the backward of the WY form. Memory O(T / C D E + C D E) per work
unit. The bound is :func:`refattn.bounds.linear.linear_chunked_vjp_bound` (the recurrent vjp's
with the chunked form's boundary-state errors carried through each chunk).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import linear_cpu

__all__ = ["chunked_forward", "chunked_backward", "CHUNK", "COMPUTE_DTYPES"]

_OPTS = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)
COMPUTE_DTYPES = ("float64", "float32")
#: flash-linear-attention's chunk size
CHUNK = 64


@njit(**_OPTS)
def _cumulative(cum, lg, c0, length):
    """cum[r + 1, :] = cum[r, :] + lg[c0 + r, :] (cum[0] = 0): G_r sits at row r + 1."""
    for x in range(cum.shape[1]):
        cum[0, x] = 0
    for r in range(length):
        for x in range(cum.shape[1]):
            cum[r + 1, x] = cum[r, x] + lg[c0 + r, x]


@njit(**_OPTS)
def _pair(x, y, cum, r, j, vector):
    """sum_d x[d] y[d] D_rj[d] (D_rj = exp(G_r - G_j); j = -1: exp(G_r)), d ascending."""
    acc = x[0] * 0
    if vector:
        for d in range(x.shape[0]):
            acc += x[d] * y[d] * math.exp(cum[r + 1, d] - cum[j + 1, d])
        return acc
    for d in range(x.shape[0]):
        acc += x[d] * y[d]
    return acc * math.exp(cum[r + 1, 0] - cum[j + 1, 0])


@njit(**_OPTS)
def _read_state(row, state, x, cum, r, vector, scaled):
    """row[e] = sum_d (exp(G_r[d]) x[d]) S_0[d, e] (d ascending); ``scaled``: work (D,)."""
    for d in range(x.shape[0]):
        scaled[d] = x[d] * math.exp(cum[r + 1, d if vector else 0])
    for e in range(row.shape[0]):
        row[e] = 0
    for d in range(x.shape[0]):
        for e in range(row.shape[0]):
            row[e] += scaled[d] * state[d, e]


@njit(**_OPTS)
def _residuals(state, seq, c0, length, cum, vector, work):
    """W (L, E) of the chunk: forward substitution of (I + A) W = R (delta rule)."""
    k, v, beta = seq[1], seq[2], seq[4]
    w, tri, scaled = work[1], work[2], work[3]
    for r in range(length):
        t = c0 + r
        _read_state(w[r], state, k[t], cum, r, vector, scaled)
        for e in range(w.shape[1]):
            w[r, e] = beta[t] * (v[t, e] - w[r, e])
        for j in range(r):
            tri[r, j] = beta[t] * _pair(k[t], k[c0 + j], cum, r, j, vector)
        for j in range(r):
            for e in range(w.shape[1]):
                w[r, e] = w[r, e] - tri[r, j] * w[j, e]


@njit(**_OPTS)
def _chunk(state, seq, out, c0, length, flags, work):
    """One chunk: outputs of its steps into ``out`` (T, E) (``flags = (has_beta, vector,
    outputs)``; without ``outputs`` only the state), then the state update in place.

    seq = (qs, k, v, lg, beta) of one (batch row, value head), each indexed by t first."""
    qs, k, v, lg = seq[0], seq[1], seq[2], seq[3]
    has_beta, vector, outputs = flags
    cum, w, scaled, row = work[0], work[1], work[3], work[4]
    _cumulative(cum, lg, c0, length)
    if has_beta:
        _residuals(state, seq, c0, length, cum, vector, work)
    else:
        for r in range(length):
            for e in range(w.shape[1]):
                w[r, e] = v[c0 + r, e]
    for r in range(length if outputs else 0):
        t = c0 + r
        _read_state(row, state, qs[t], cum, r, vector, scaled)
        for j in range(r + 1):
            p = _pair(qs[t], k[c0 + j], cum, r, j, vector)
            for e in range(row.shape[0]):
                row[e] += p * w[j, e]
        for e in range(row.shape[0]):
            out[t, e] = row[e]
    last = length - 1
    for d in range(state.shape[0]):
        gd = d if vector else 0
        keep = math.exp(cum[last + 1, gd])
        for e in range(state.shape[1]):
            state[d, e] = keep * state[d, e]
        for j in range(length):
            c = math.exp(cum[last + 1, gd] - cum[j + 1, gd]) * k[c0 + j, d]
            for e in range(state.shape[1]):
                state[d, e] += c * w[j, e]


@njit(**_OPTS)
def _chunk_work(state, chunk, gates):
    """The work arrays of :func:`_chunk` in ``state``'s dtype (``gates`` = 1 or D)."""
    dim, edim = state.shape
    return (
        np.zeros((chunk + 1, gates), dtype=state.dtype),
        np.zeros((chunk, edim), dtype=state.dtype),
        np.zeros((chunk, chunk), dtype=state.dtype),
        np.zeros(dim, dtype=state.dtype),
        np.zeros(edim, dtype=state.dtype),
    )


@njit(parallel=True, **_OPTS)
def _forward(ins, beta, h0, seg, chunk, has_beta, out, final):
    """ins = (qs, k, v, lg): (B, HV, T, D|E), lg (B, HV, T, 1 or D) natural log decays."""
    qs, k, v, lg = ins
    heads = v.shape[1]
    vector = lg.shape[3] > 1
    for unit in prange(seg.shape[0] * heads):
        n, j = unit // heads, unit % heads
        b, start, stop = seg[n, 0], seg[n, 1], seg[n, 2]
        state = h0[n, j].copy()
        work = _chunk_work(state, chunk, lg.shape[3])
        seq = (qs[b, j], k[b, j], v[b, j], lg[b, j], beta[b, j])
        for c0 in range(start, stop, chunk):
            length = min(chunk, stop - c0)
            _chunk(state, seq, out[b, j], c0, length, (has_beta, vector, True), work)
        final[n, j] = state


def chunked_forward(ins, beta, h0, seg, has_beta, chunk=CHUNK):
    """(o (B, HV, T, E), final (N, HV, D, E)) in the arrays' dtype (float64 or float32).

    ``ins = (qs, k, v, lg)``: scaled normalised queries, keys (B, HV, T, D), values
    (B, HV, T, E), natural-log decays (B, HV, T, 1) (scalar gate, zeros without gates) or
    (B, HV, T, D) (vector gate); ``beta`` (B, HV, T); ``h0`` (N, HV, D, E); ``seg`` (N, 3) int64
    rows (batch row, start, stop); ``chunk`` the chunk length C >= 1. All C-contiguous.
    """
    dtype = ins[0].dtype
    if dtype.name not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype: expected one of {list(COMPUTE_DTYPES)}, got {dtype}")
    if int(chunk) < 1:
        raise ValueError(f"chunk: expected a positive chunk length, got {chunk!r}")
    out = np.zeros(ins[2].shape, dtype=dtype)
    final = np.empty(h0.shape, dtype=dtype)
    if out.size or final.size:
        _forward(ins, beta, h0, seg, int(chunk), bool(has_beta), out, final)
    return out, final


@njit(parallel=True, **_OPTS)
def _backward(ins, lg, beta, states, seg, params, chunk, grads):
    """ins = (qs, k, v, a, do); lg as :func:`_forward`'s; states = (h0, dht); params as
    linear_cpu's [has gate, has beta, log(base)]; grads = (dqs, dk, dv, dg, dbeta, dh0)."""
    qs, k, v = ins[0], ins[1], ins[2]
    h0, dht = states
    heads = v.shape[1]
    has_beta, vector = params[1] != 0.0, lg.shape[3] > 1
    for unit in prange(seg.shape[0] * heads):
        n, j = unit // heads, unit % heads
        b, start, stop = seg[n, 0], seg[n, 1], seg[n, 2]
        chunks = (stop - start + chunk - 1) // chunk
        state = h0[n, j].copy()
        saved = np.empty((max(chunks, 1),) + state.shape, dtype=state.dtype)
        work = _chunk_work(state, chunk, lg.shape[3])
        seq = (qs[b, j], k[b, j], v[b, j], lg[b, j], beta[b, j])
        # the states at the chunk boundaries, by the chunked form (no outputs)
        for index in range(chunks):
            c0 = start + index * chunk
            saved[index] = state
            if index < chunks - 1:
                _chunk(state, seq, qs[b, j], c0, chunk, (has_beta, vector, False), work)
        rwork = linear_cpu.reverse_work(state, chunk, params[2])
        d_state = dht[n, j].copy()
        for index in range(chunks - 1, -1, -1):
            c0 = start + index * chunk
            rwork[6][0] = saved[index]
            span = (b, j, c0, min(c0 + chunk, stop))
            linear_cpu.reverse_span(grads[:5], d_state, span, ins, beta, params, rwork)
        grads[5][n, j] = d_state


def chunked_backward(ins, lg, beta, states, seg, params, chunk=CHUNK):
    """The reverse pass of the chunked form: (dqs, dk, dv, dg per key row (B, HV, T, D), dbeta,
    dh0) in the arrays' dtype.

    ``ins = (qs, k, v, a, do)`` as :func:`refattn.kernels.linear_cpu.linear_backward`'s (``a``
    the decays, ones without gates), ``lg`` the natural-log decays of :func:`chunked_forward`,
    ``states = (h0, dht)``, ``params`` float64 [has gate, has beta, log(base)].
    """
    dtype = ins[0].dtype
    if dtype.name not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype: expected one of {list(COMPUTE_DTYPES)}, got {dtype}")
    if int(chunk) < 1:
        raise ValueError(f"chunk: expected a positive chunk length, got {chunk!r}")
    grads = tuple(np.zeros(x.shape, dtype) for x in ins[:4])
    grads += (np.zeros(beta.shape, dtype), np.array(states[1], dtype=dtype, copy=True))
    if seg.shape[0] and ins[2].size:
        _backward(ins, lg, beta, states, seg, params, int(chunk), grads)
    return grads
