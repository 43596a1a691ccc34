"""Loop twins of refattn.gmm (Movellan & Gabbur): EM attention, key and prior adaptation.

Loop-level mpmath evaluations written from the paper's equations at :data:`DPS` digits, one
batch element at a time; nothing here imports refattn.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np

from .mp import (
    exact_div,
    exact_mul,
    exact_sum,
    lse,
    mp,
    per_unit,
    softmax_weights,
    squared_distance,
)

__all__ = [
    "DPS",
    "naive_gmm",
    "naive_adapt_keys",
    "naive_adapt_priors",
    "naive_log_prior",
    "naive_query_terms",
    "naive_value_terms",
    "naive_apple_adapt_keys",
    "APPLE_EPS",
    "PUBLIC_CODE_RTOL",
]

#: Decimal digits of the twins' mpmath evaluations.
DPS = 60


def naive_log_prior(prior, keys, values, alpha, beta):
    units = len(keys)
    if isinstance(prior, str) and prior == "uniform":
        return [mpmath.mpf(0)] * units
    if isinstance(prior, str):  # magnitude, eq. (15) up to log k
        return [
            alpha[u] / 2 * squared_distance(keys[u], 0 * keys[u])
            + beta[u] / 2 * squared_distance(values[u], 0 * values[u])
            for u in range(units)
        ]
    return [-mpmath.inf if np.isneginf(x) else mp(x) for x in prior]


def naive_query_terms(q_row, keys, values, alpha, beta, prior):
    """log p(u) + log p(q | u) with the full Gaussian normaliser, eq. (7)."""
    dim = len(q_row)
    log_p = naive_log_prior(prior, keys, values, alpha, beta)
    return [
        log_p[u]
        + dim / mpmath.mpf(2) * mpmath.log(alpha[u] / (2 * mpmath.pi))
        - alpha[u] / 2 * squared_distance(q_row, keys[u])
        for u in range(len(keys))
    ]


def naive_value_terms(v, values, beta):
    dim_v = len(v)
    return [
        dim_v / mpmath.mpf(2) * mpmath.log(beta[u] / (2 * mpmath.pi))
        - beta[u] / 2 * squared_distance(v, values[u])
        for u in range(len(values))
    ]


def _without_normalisers(terms, precisions, dim):
    """Take the Gaussian normalisers (dim/2) log(precision_u / 2 pi) back out of ``terms``."""
    return [
        t - dim / mpmath.mpf(2) * mpmath.log(p / (2 * mpmath.pi))
        for t, p in zip(terms, precisions, strict=True)
    ]


def naive_gmm(
    q,
    keys,
    values,
    *,
    alpha,
    beta,
    prior="uniform",
    v_init=None,
    iters=1,
    allowed=None,
    empty_rows="zero",
    normalisers=True,
):
    """Eqs. (13)-(14) for every query row, with v_init None -> w = p(u | q). Returns
    (values list of lists, trace list of lists) of mpf; trace only where beta > 0.

    ``allowed`` (L, S) bool: units a query may attend (a row with none gives 0 or NaN).
    ``normalisers=False`` is the reading without the Gaussian normalisers in the E-step and
    with the plain mean ``sum_u w_u mu_u`` as M-step (whatever the per-unit beta)."""
    units = len(keys)
    beta_in = np.broadcast_to(np.asarray(beta, dtype=np.float64), (units,))
    with mpmath.workdps(DPS):
        alpha_u, beta_u = per_unit(alpha, units), per_unit(beta, units)
        out, traces = [], []
        for i, q_row in enumerate(q):
            a = naive_query_terms(q_row, keys, values, alpha_u, beta_u, prior)
            if allowed is not None:
                a = [s if allowed[i][u] else -mpmath.inf for u, s in enumerate(a)]
            if all(s == -mpmath.inf for s in a):
                fill = Fraction(0) if empty_rows == "zero" else mpmath.nan
                out.append([fill] * values.shape[1])
                traces.append([mpmath.nan] * iters)
                continue
            e_step = a if normalisers else _without_normalisers(a, alpha_u, len(q_row))
            v = None if v_init is None else list(v_init[i])
            trace = []
            for _ in range(iters):
                if v is None or all(b == 0 for b in beta_u):
                    logits = e_step
                else:
                    terms = naive_value_terms(v, values, beta_u)
                    if not normalisers:
                        terms = _without_normalisers(terms, beta_u, values.shape[1])
                    logits = [s + t for s, t in zip(e_step, terms, strict=True)]
                weights = softmax_weights(logits)
                if len(set(beta_u)) > 1 and normalisers:  # the root of eq. (12), per-unit beta
                    weights = [exact_mul(w, b) for w, b in zip(weights, beta_in, strict=True)]
                total = exact_sum(weights)
                v = [
                    exact_div(
                        exact_sum(exact_mul(weights[u], values[u][e]) for u in range(units)), total
                    )
                    for e in range(values.shape[1])
                ]
                if all(b > 0 for b in beta_u):
                    joint = [
                        s + t for s, t in zip(a, naive_value_terms(v, values, beta_u), strict=True)
                    ]
                    trace.append(lse(joint) - lse(a))
            out.append(v)
            traces.append(trace)
        return out, traces


def naive_adapt_keys(queries, keys0, *, alpha, gamma, prior, iters, form):
    units, dim = keys0.shape
    with mpmath.workdps(DPS):
        alpha_u = per_unit(alpha, units)
        alpha_in = np.broadcast_to(np.asarray(alpha, dtype=np.float64), (units,))
        gamma_u = np.broadcast_to(np.asarray(gamma, dtype=np.float64), (units,))
        xi0 = [list(row) for row in keys0]
        xi = [row[:] for row in xi0]
        for _ in range(iters):
            weights = []
            for q_row in queries:
                log_p = (
                    [alpha_u[u] / 2 * mpmath.fsum(mp(x) ** 2 for x in xi[u]) for u in range(units)]
                    if prior == "magnitude"
                    else [mpmath.mpf(0)] * units
                )
                logits = [
                    log_p[u]
                    + dim / mpmath.mpf(2) * mpmath.log(alpha_u[u])
                    - alpha_u[u] / 2 * squared_distance(xi[u], q_row)
                    for u in range(units)
                ]
                weights.append(softmax_weights(logits))
            new = []
            for k in range(units):
                if math.isinf(gamma_u[k]):
                    new.append(xi0[k][:])
                    continue
                g, a = gamma_u[k], alpha_in[k]
                total = exact_sum(w[k] for w in weights)
                sums = [
                    exact_sum(exact_mul(w[k], q[d]) for w, q in zip(weights, queries, strict=True))
                    for d in range(dim)
                ]
                if form == "paper":
                    new.append(
                        [
                            exact_div(
                                exact_sum(
                                    [
                                        exact_mul(g, xi0[k][d]),
                                        exact_mul(a, exact_div(sums[d], total)),
                                    ]
                                ),
                                exact_sum([a, g]),
                            )
                            for d in range(dim)
                        ]
                    )
                else:  # "map": prior centred on xi^0; "map_recentred": on the current keys
                    centre = xi[k] if form == "map_recentred" else xi0[k]
                    new.append(
                        [
                            exact_div(
                                exact_sum([exact_mul(g, centre[d]), exact_mul(a, sums[d])]),
                                exact_sum([g, exact_mul(a, total)]),
                            )
                            for d in range(dim)
                        ]
                    )
            xi = new
        return xi


def naive_adapt_priors(queries, keys, *, alpha, eta, pi0, iters, form):
    units, dim = keys.shape
    with mpmath.workdps(DPS):
        alpha_u = per_unit(alpha, units)
        total0 = exact_sum(pi0)
        pi = [exact_div(p, total0) for p in pi0]
        eta_u = [exact_mul(eta, p) for p in pi] if np.ndim(eta) == 0 else list(eta)
        for _ in range(iters):
            w_bar = [Fraction(0)] * units
            for q_row in queries:
                logits = [
                    (mpmath.log(mp(pi[u])) if pi[u] > 0 else -mpmath.inf)
                    + dim / mpmath.mpf(2) * mpmath.log(alpha_u[u])
                    - alpha_u[u] / 2 * squared_distance(q_row, keys[u])
                    for u in range(units)
                ]
                weights = softmax_weights(logits)
                w_bar = [exact_sum([w_bar[u], weights[u]]) for u in range(units)]
            mass = (
                [exact_mul(w_bar[k], exact_sum([1, eta_u[k]])) for k in range(units)]
                if form == "paper"
                else [exact_sum([w_bar[k], eta_u[k]]) for k in range(units)]
            )
            norm = exact_sum(mass)
            pi = [exact_div(m, norm) for m in mass]
        return pi


# --------------------------------------------------------------------------------------------
# The authors' public code (apple/ml-probabilistic-attention, probabilisticattention.py),
# written from its description: ProbabilisticAttention.forward's weight update (update_weights)
# and its key-adaptation loop.
# --------------------------------------------------------------------------------------------

#: How closely an option that claims to reproduce a public configuration must agree with its
#: twin in float64: relative to the largest |twin| entry (issue 29's requirement). The twins
#: follow the public code's algebra at 60 digits; the options run refattn's log-space float64
#: path, so what remains is the float64 path's own rounding (about 1e-15 at these scales).
PUBLIC_CODE_RTOL = 1e-12

#: The constant the public Apple code adds to the sum of the max-shifted weights. That sum is
#: at least 1, so the constant moves a float64 weight by nothing at all (1 + 1e-20 == 1).
APPLE_EPS = 1e-20


def _apple_weights(q_row, keys, values, alpha_u, beta_u, v_row, magnitude):
    """One row of update_weights: the log-weights formed from the expanded squares, a max
    shift, exp, and the division by (sum + APPLE_EPS); no Gaussian normalisers."""
    logits = []
    q2 = mpmath.fsum(mp(x) ** 2 for x in q_row)
    for u in range(len(keys)):
        z2 = mpmath.fsum(mp(x) ** 2 for x in keys[u])
        qz = mpmath.fsum(mp(a) * mp(b) for a, b in zip(q_row, keys[u], strict=True))
        logit = -alpha_u[u] / 2 * (q2 + z2 - 2 * qz)
        if v_row is not None:
            v2 = mpmath.fsum(mp(x) ** 2 for x in v_row)
            mu2 = mpmath.fsum(mp(x) ** 2 for x in values[u])
            vmu = mpmath.fsum(mp(a) * mp(b) for a, b in zip(v_row, values[u], strict=True))
            logit += -beta_u[u] / 2 * (v2 + mu2 - 2 * vmu)
        if magnitude:  # magnitude_priors with pi None: log p(u) = alpha |zeta|^2/2 + beta |mu|^2/2
            logit += alpha_u[u] / 2 * z2
            if values is not None:
                logit += beta_u[u] / 2 * mpmath.fsum(mp(x) ** 2 for x in values[u])
        logits.append(logit)
    top = max(logits)
    shifted = [mpmath.exp(s - top) for s in logits]
    total = mpmath.fsum(shifted) + mp(APPLE_EPS)
    return [w / total for w in shifted]


def naive_apple_adapt_keys(
    queries, keys0, values=None, *, alpha, beta=0.0, gamma=None, prior="uniform", v_init=None, iters
):
    """The public code's key adaptation: ``iters`` times, the weights of update_weights at the
    current keys (value terms from ``values``/``v_init`` as that function forms them), then
    ``zeta = (gamma zeta + alpha sum_i w_i q_i) / (gamma + alpha sum_i w_i)`` per unit
    (``gamma=None``: ``zeta = sum_i w_i q_i / sum_i w_i``). Returns the keys as mpf lists."""
    units, dim = keys0.shape
    with mpmath.workdps(DPS):
        alpha_u, beta_u = per_unit(alpha, units), per_unit(beta, units)
        gamma_u = None if gamma is None else per_unit(gamma, units)
        zeta = [[mp(x) for x in row] for row in keys0]
        for _ in range(iters):
            weights = [
                _apple_weights(
                    q_row,
                    zeta,
                    values,
                    alpha_u,
                    beta_u,
                    None if v_init is None else v_init[i],
                    prior == "magnitude",
                )
                for i, q_row in enumerate(queries)
            ]
            new = []
            for u in range(units):
                total = mpmath.fsum(w[u] for w in weights)
                sums = [
                    mpmath.fsum(w[u] * mp(q[d]) for w, q in zip(weights, queries, strict=True))
                    for d in range(dim)
                ]
                if gamma_u is None:
                    new.append([s / total for s in sums])
                else:
                    g, a = gamma_u[u], alpha_u[u]
                    new.append(
                        [(g * zeta[u][d] + a * sums[d]) / (g + a * total) for d in range(dim)]
                    )
            zeta = new
        return zeta
