"""Exact paths of :mod:`refattn.hopfield` (continuous modern Hopfield networks, Ramsauer et
al.): the energy (E) and ``steps`` updates (U) of the exact inputs, rounded once.
"""

from __future__ import annotations

import numpy as np
from mpmath import iv, mp

from .numbers import NotRational, dot, is_zero
from .rows import UNKNOWN, batch_rows, exact_grads, exact_rows

__all__ = ["energy", "retrieve", "retrieve_vjp"]


def _energy_exact(ops, state, patterns, beta, constant):
    scores = [beta * dot(x, state) for x in patterns]
    value = dot(state, state) / 2 - ops.lse(scores) / beta
    if constant:
        value = value + ops.log(ops.scalar(len(patterns))) / beta
        value = value + _max_norm2(ops, patterns) / 2
    return value


def _update_exact(ops, state, patterns, beta):
    weights = ops.softmax([beta * dot(x, state) for x in patterns])
    dim = len(state)
    return np.array(
        [
            sum((w * patterns[j][d] for j, w in enumerate(weights) if not is_zero(w)), 0)
            for d in range(dim)
        ],
        dtype=object,
    )


def _max_norm2(ops, patterns):
    """M^2 = max_j ||x_j||^2 (an enclosure of the max on the interval path)."""
    norms = [dot(x, x) for x in patterns]
    if ops.rational:
        return max(norms)
    lo = max(mp.make_mpf(n._mpi_[0]) for n in norms)
    hi = max(mp.make_mpf(n._mpi_[1]) for n in norms)
    return iv.mpf([lo, hi])


def energy(xi, patterns, beta, constant, dtype):
    """E(xi) (..., L) rounded once; xi (..., L, D) and patterns (..., S, D) share the batch."""
    batch, length = xi.shape[:-2], xi.shape[-2]

    def row_energy(ops, row):
        b, i = row
        return [
            _energy_exact(
                ops, ops.array(xi[b][i]), ops.array(patterns[b]), ops.scalar(beta), constant
            )
        ]

    rows = batch_rows(batch, length)
    table = exact_rows(rows, row_energy, dtype, "hopfield.energy")
    return table.reshape(batch + (length,))


def retrieve(xi, patterns, beta, steps, want_trace, dtype):
    """(states (..., L, D), energies (..., L, steps + 1) or None) after ``steps`` updates,
    rounded once."""
    batch = xi.shape[:-2]
    length, dim = xi.shape[-2:]

    def row_states(ops, row):
        b, i = row
        pats, beta_x = ops.array(patterns[b]), ops.scalar(beta)
        state = ops.array(xi[b][i])
        energies = [_energy_exact(ops, state, pats, beta_x, False)] if want_trace else []
        for _ in range(steps):
            state = _update_exact(ops, state, pats, beta_x)
            if want_trace:
                energies.append(_energy_exact(ops, state, pats, beta_x, False))
        return list(state) + energies

    rows = batch_rows(batch, length)
    table = exact_rows(rows, row_states, dtype, "hopfield.retrieve")
    states = table[:, :dim].reshape(batch + (length, dim))
    if not want_trace:
        return states, None
    return states, table[:, dim:].reshape(batch + (length, steps + 1))


def _update_backward(ops, state, patterns, beta, grad, dpatterns):
    """Cotangent of the state before one update (U) from ``grad`` after it; adds the update's
    pattern cotangent (as keys and as values) into ``dpatterns``.

    dP_j = grad . x_j, dS_j = P_j sum_{k != j} P_k (dP_j - dP_k) (exactly 0 for a lone
    pattern), d state = beta sum_j dS_j x_j, dX_j += P_j grad + beta dS_j state.
    """
    weights = ops.softmax([beta * dot(x, state) for x in patterns])
    cols = [j for j, w in enumerate(weights) if not is_zero(w)]
    dots = {j: dot(grad, patterns[j]) for j in cols}
    dim = len(state)
    dstate = [0] * dim
    for j in cols:
        inner = sum((weights[k] * (dots[j] - dots[k]) for k in cols if k != j), 0)
        dscore = 0 if is_zero(inner) else weights[j] * inner
        for d in range(dim):
            dpatterns[j][d] = dpatterns[j][d] + weights[j] * grad[d]
            if not is_zero(dscore):
                dpatterns[j][d] = dpatterns[j][d] + beta * dscore * state[d]
                dstate[d] = dstate[d] + beta * dscore * patterns[j][d]
    return dstate


def retrieve_vjp(xi, patterns, grad_out, beta, steps, shapes, dtype):
    """(dxi, dX) of ``steps`` updates, summed to ``shapes`` and rounded once."""
    batch = xi.shape[:-2]
    length, dim = xi.shape[-2:]
    units = patterns.shape[-2]

    def batch_grads(ops, b):
        pats, beta_x = ops.array(patterns[b]), ops.scalar(beta)
        dxi = []
        dpats = [[0] * dim for _ in range(units)]
        grads = ops.array(grad_out[b])
        for i in range(length):
            try:
                states = [ops.array(xi[b][i])]
                for _ in range(steps - 1):
                    states.append(_update_exact(ops, states[-1], pats, beta_x))
                grad = list(grads[i])
                for state in reversed(states):
                    grad = _update_backward(ops, state, pats, beta_x, grad, dpats)
            except NotRational:  # rational mode: this row reaches its dxi and every pattern
                if not ops.rational:
                    raise
                grad = [UNKNOWN] * dim
                dpats = [[UNKNOWN] * dim for _ in range(units)]
            dxi.append(grad)
        return dxi, dpats

    return exact_grads(
        batch, batch_grads, [(length, dim), (units, dim)], shapes, dtype, "hopfield.retrieve_vjp"
    )
