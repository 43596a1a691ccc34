"""The float64 NumPy recurrence of the linear-attention family, forward and reverse mode.

One step per token, vectorised over the sequences of a segment group and the value heads
(state S (n, HV, D, E)):

* decay ``S' = diag(a_t) S`` with ``a_t = exp(g_t)`` (or ``2**g_t``), scalar or per key row;
* delta rule (beta given): ``u_t = v_t - S'^T k_t``, ``S_t = S' + beta_t k_t u_t^T``;
  plain: ``S_t = S' + k_t v_t^T``;
* output ``o_t = S_t^T (scale q_t)`` (the state after the update).

The vjp walks the steps backwards, recomputing the states of each block of ``C ~ sqrt(T)``
steps from a checkpoint (memory O(sqrt(T) D E) per head instead of O(T D E)).
"""

from __future__ import annotations

import math

import numpy as np

from ._inputs import L2NORM_EPS, LinearCall

__all__ = ["normalized", "decays", "forward", "backward", "l2norm_backward"]


def normalized(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x * r, r)`` with ``r = 1 / sqrt(sum x^2 + eps)`` over the last axis (eps inside)."""
    r = 1.0 / np.sqrt(np.einsum("...d,...d->...", x, x) + L2NORM_EPS)
    return x * r[..., None], r


def l2norm_backward(x: np.ndarray, r: np.ndarray, dxn: np.ndarray) -> np.ndarray:
    """d/dx of ``x r(x)`` against ``dxn``: ``r (dxn - xn (xn . dxn))`` with ``xn = x r``."""
    xn = x * r[..., None]
    return r[..., None] * (dxn - xn * np.einsum("...d,...d->...", xn, dxn)[..., None])


def decays(call: LinearCall):
    """``a = base**g`` (None without gates) and ``log(base)`` (the chain factor of dg)."""
    if call.g is None:
        return None, 1.0
    if call.gate_base == "2":
        return np.exp2(call.g), math.log(2.0)
    return np.exp(call.g), 1.0


def _inputs(call: LinearCall):
    q, k = call.q, call.k
    if call.qk_l2norm:
        q, _ = normalized(q)
        k, _ = normalized(k)
    return q * call.scale, k


def _slice(x, b, start, stop):
    return None if x is None else x[b : b + 1, :, start:stop]


def _groups(call: LinearCall):
    """(batch rows, time slice, sequence indices) groups: one group of every batch row when
    the sequences are the batch rows, else one group per packed sequence."""
    if not call.packed:
        n = len(call.segments)
        return [(slice(0, n), slice(0, call.q.shape[2]), slice(0, n))]
    return [
        (slice(b, b + 1), slice(start, stop), slice(n, n + 1))
        for n, (b, start, stop) in enumerate(call.segments)
    ]


def _decay(state, a_t, vector):
    if a_t is None:
        return state
    return state * (a_t[..., :, None] if vector else a_t[..., None, None])


def _step(state, a_t, k_t, v_t, beta_t, vector):
    """(S_t, S', u_t) from S_{t-1}: decay then the delta-rule or plain update."""
    decayed = _decay(state, a_t, vector)
    if beta_t is None:
        return decayed + k_t[..., :, None] * v_t[..., None, :], decayed, None
    u = v_t - np.einsum("...de,...d->...e", decayed, k_t)
    return decayed + (beta_t[..., None] * k_t)[..., :, None] * u[..., None, :], decayed, u


def _at(x, t):
    return None if x is None else x[:, :, t]


def forward(call: LinearCall, *, keep_norms: bool = False):
    """(o (B, HV, T, E), final state (N, HV, D, E)[, state norms (B, HV, T)]).

    ``keep_norms``: also the Frobenius norms of every computed state S_t (the run-time input of
    :func:`refattn.bounds.linear_forward_bound`).
    """
    qs, k = _inputs(call)
    a, _ = decays(call)
    out = np.zeros(call.v.shape)
    norms = np.zeros(call.v.shape[:3])
    final = np.zeros(call.state_shape)
    for rows, span, seqs in _groups(call):
        state = np.zeros(final[seqs].shape) if call.h0 is None else call.h0[seqs].copy()
        for t in range(span.start, span.stop):
            state, _, _ = _step(
                state,
                _at(a[rows] if a is not None else None, t),
                k[rows, :, t],
                call.v[rows, :, t],
                _at(call.beta[rows] if call.beta is not None else None, t),
                call.vector_gate,
            )
            out[rows, :, t] = np.einsum("...de,...d->...e", state, qs[rows, :, t])
            if keep_norms:
                norms[rows, :, t] = np.sqrt(np.einsum("...de,...de->...", state, state))
        final[seqs] = state
    return (out, final, norms) if keep_norms else (out, final)


def _checkpoints(state, a, k, v, beta, vector, span, block):
    """The states before each block of ``block`` steps of ``span``."""
    saved = []
    for t in range(span.start, span.stop):
        if (t - span.start) % block == 0:
            saved.append(state.copy())
        state = _step(state, _at(a, t), k[:, :, t], v[:, :, t], _at(beta, t), vector)[0]
    return saved


def _step_backward(grads, d_state, before, t, ctx):
    """Reverse one step: accumulate the step's input gradients, return dS_{t-1}."""
    a, k, v, beta, qs, do, vector, log_base = ctx
    a_t, beta_t = _at(a, t), _at(beta, t)
    k_t, do_t = k[:, :, t], do[:, :, t]
    state, decayed, u = _step(before, a_t, k_t, v[:, :, t], beta_t, vector)
    d_state = d_state + qs[:, :, t][..., :, None] * do_t[..., None, :]
    grads["q"][:, :, t] = np.einsum("...de,...e->...d", state, do_t)
    if beta_t is None:
        grads["k"][:, :, t] = np.einsum("...de,...e->...d", d_state, v[:, :, t])
        grads["v"][:, :, t] = np.einsum("...de,...d->...e", d_state, k_t)
        d_decayed = d_state
    else:
        dsu = np.einsum("...de,...e->...d", d_state, u)
        du = beta_t[..., None] * np.einsum("...de,...d->...e", d_state, k_t)
        grads["beta"][:, :, t] = np.einsum("...d,...d->...", k_t, dsu)
        grads["v"][:, :, t] = du
        grads["k"][:, :, t] = beta_t[..., None] * dsu - np.einsum("...de,...e->...d", decayed, du)
        d_decayed = d_state - k_t[..., :, None] * du[..., None, :]
    if a_t is None:
        return d_state if beta_t is None else d_decayed
    if vector:
        grads["g"][:, :, t] = np.einsum("...de,...de->...d", d_decayed, before) * a_t * log_base
        return d_decayed * a_t[..., :, None]
    grads["g"][:, :, t] = np.einsum("...de,...de->...", d_decayed, before) * a_t * log_base
    return d_decayed * a_t[..., None, None]


def backward(call: LinearCall, do: np.ndarray, dht: np.ndarray | None) -> dict:
    """Gradients of ``sum(do * o) + sum(dht * final)`` with respect to the *normalised, scaled*
    inputs: {"q": d(scale q_n), "k": d k_n, "v", "g", "beta", "h0"} on the value heads."""
    qs, k = _inputs(call)
    a, log_base = decays(call)
    grads = {
        "q": np.zeros(call.q.shape),
        "k": np.zeros(call.k.shape),
        "v": np.zeros(call.v.shape),
        "g": None if call.g is None else np.zeros(call.g.shape),
        "beta": None if call.beta is None else np.zeros(call.beta.shape),
        "h0": np.zeros(call.state_shape),
    }
    for rows, span, seqs in _groups(call):
        part = {
            name: (None if value is None or name == "h0" else value[rows])
            for name, value in grads.items()
        }
        sub = [None if x is None else x[rows] for x in (a, k, call.v, call.beta, qs, do)]
        ctx = (*sub, call.vector_gate, log_base)
        start = np.zeros(grads["h0"][seqs].shape) if call.h0 is None else call.h0[seqs].copy()
        length = span.stop - span.start
        block = max(1, math.isqrt(max(length, 1)))
        saved = _checkpoints(start, sub[0], sub[1], sub[2], sub[3], call.vector_gate, span, block)
        d_state = np.zeros(start.shape) if dht is None else dht[seqs].copy()
        for index in range(len(saved) - 1, -1, -1):
            first = span.start + index * block
            last = min(first + block, span.stop)
            states = [saved[index]]
            for t in range(first, last - 1):
                states.append(
                    _step(
                        states[-1],
                        _at(sub[0], t),
                        sub[1][:, :, t],
                        sub[2][:, :, t],
                        _at(sub[3], t),
                        call.vector_gate,
                    )[0]
                )
            for t in range(last - 1, first - 1, -1):
                d_state = _step_backward(part, d_state, states[t - first], t, ctx)
        grads["h0"][seqs] = d_state
        for name, value in part.items():
            if value is not None:
                grads[name][rows] = value
    return grads
