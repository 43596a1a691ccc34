"""Exact paths of :mod:`refattn.hopfield` (continuous modern Hopfield networks, Ramsauer et
al.): the energy (E) and ``steps`` updates (U) of the exact inputs, rounded once.
"""

from __future__ import annotations

import numpy as np
from mpmath import iv, mp

from .numbers import dot, is_zero
from .rows import batch_rows, exact_rows

__all__ = ["energy", "retrieve"]


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
    return np.array([sum((w * patterns[j][d] for j, w in enumerate(weights)
                          if not is_zero(w)), 0) for d in range(dim)], dtype=object)


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
        return [_energy_exact(ops, ops.array(xi[b][i]), ops.array(patterns[b]),
                              ops.scalar(beta), constant)]

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
