"""Loop twins of refattn.hopfield (Ramsauer et al.): the energy and the retrieval update.

Loop-level mpmath evaluations at :data:`~naive.gmm.DPS` digits; nothing here imports refattn.
"""

from __future__ import annotations

import mpmath

from .gmm import DPS
from .mp import exact_mul, exact_sum, lse, mp, softmax_weights

__all__ = ["naive_energy", "naive_retrieve"]


def _dot(x, y):
    return mpmath.fsum(a * b for a, b in zip(x, y, strict=True))


def naive_energy(state, patterns, beta, constant=False):
    beta = mp(beta)
    scores = [beta * _dot(x, state) for x in patterns]
    value = _dot(state, state) / 2 - lse(scores) / beta
    if constant:
        value += mpmath.log(len(patterns)) / beta + max(_dot(x, x) for x in patterns) / 2
    return value


def naive_retrieve(xi, X, beta, steps):
    """States and energies E(xi^0..xi^steps) per row, as mpf."""
    with mpmath.workdps(DPS):
        patterns = [[mp(a) for a in row] for row in X]
        states, energies = [], []
        for row in xi:
            state = list(row)
            trace = [naive_energy([mp(a) for a in state], patterns, beta)]
            for _ in range(steps):
                scores = [mp(beta) * _dot(x, [mp(a) for a in state]) for x in patterns]
                weights = softmax_weights(scores)
                state = [
                    exact_sum(exact_mul(w, x[d]) for w, x in zip(weights, X, strict=True))
                    for d in range(len(state))
                ]
                trace.append(naive_energy([mp(a) for a in state], patterns, beta))
            states.append(state)
            energies.append(trace)
        return states, energies
