"""Exact paths of :mod:`refattn.gmm`: every output the exact value of the stated finite EM
computation, rounded once (:func:`refattn.exact.rows.exact_rows`).

The functions take the validated model of :mod:`refattn.gmm` (its inputs at their exact binary
values, broadcast to a common batch) and evaluate each row in the number systems of
:mod:`refattn.exact.numbers`; the equations are those of the float64 path (Movellan & Gabbur
eqs. (13)-(14), (23), (28)-(29), (33)-(34)).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .autodiff import primal
from .numbers import NotRational, dot, is_zero, sqdist
from .rows import batch_rows, exact_rows, exact_vjp_rows

__all__ = [
    "attention",
    "log_posterior",
    "adapt_keys",
    "adapt_priors",
    "attention_vjp",
    "adapt_keys_vjp",
    "adapt_priors_vjp",
]


class _ExactModel(NamedTuple):
    q: np.ndarray
    keys: np.ndarray
    values: np.ndarray | None
    alpha: np.ndarray
    beta: np.ndarray
    log_prior: np.ndarray | None
    alpha_log: list | None
    beta_log: list | None


def _exact_model(ops, m, b):
    """Inputs of batch element b in the number system ``ops`` (cached per precision by caller)."""
    q, keys = ops.array(m.q[b]), ops.array(m.keys[b])
    values = None if m.values is None else ops.array(m.values[b])
    alpha, beta = ops.array(m.alpha[b]), ops.array(m.beta[b])
    log_prior = None
    if m.log_prior is not None:
        log_prior = [None if np.isneginf(x) else ops.scalar(x) for x in m.log_prior[b]]
    alpha_log = [ops.log(a) for a in alpha] if m.alpha_varies else None
    beta_log = [ops.log(x) for x in beta] if m.beta_varies and m.form == "paper" else None
    return _ExactModel(q, keys, values, alpha, beta, log_prior, alpha_log, beta_log)


def _query_logits_exact(m, x: _ExactModel, qrow, allowed=None, normalised=None):
    """Exact twin of :func:`refattn.gmm`'s float64 query logits for one query row: list over
    units (None = excluded by a -inf prior or by ``allowed``, the row of the allowed set).
    ``normalised`` (default: the paper form) adds the normalisers (D/2) log alpha_u."""
    dim = len(qrow)
    if normalised is None:
        normalised = m.form == "paper"
    out = []
    for u in range(len(x.keys)):
        if allowed is not None and not allowed[u]:
            out.append(None)
            continue
        alpha = x.alpha[u]
        if m.kind == "magnitude":
            logit = alpha * dot(x.keys[u], qrow)
            if x.values is not None:
                logit = logit + x.beta[u] * dot(x.values[u], x.values[u]) / 2
            if m.alpha_varies:
                logit = logit - alpha * dot(qrow, qrow) / 2
        else:
            if m.kind == "array" and x.log_prior[u] is None:
                out.append(None)
                continue
            logit = -alpha * sqdist(qrow, x.keys[u]) / 2
            if m.kind == "array":
                logit = logit + x.log_prior[u]
        if m.alpha_varies and normalised:
            logit = logit + x.alpha_log[u] * dim / 2
        out.append(logit)
    return out


def _value_logits_exact(m, x: _ExactModel, v, beta_log=None):
    """-beta_u/2 |v - mu_u|^2, plus (E/2) log beta_u when ``beta_log`` (per unit) is given."""
    out = []
    for u in range(len(x.values)):
        logit = -x.beta[u] * sqdist(v, x.values[u]) / 2
        if beta_log is not None:
            logit = logit + beta_log[u] * len(v) / 2
        out.append(logit)
    return out


def _log_posterior_exact(ops, m, x: _ExactModel, a, v):
    """log p(v | q) of the model (the normalised density, whatever the EM form)."""
    beta_log = [ops.log(b) for b in x.beta] if m.beta_varies else None
    b = _value_logits_exact(m, x, v, beta_log)
    joint = ops.lse([None if s is None else s + t for s, t in zip(a, b, strict=False)])
    marginal = ops.lse(a)
    dim_v = len(v)
    const = -ops.log_2pi() * dim_v / 2
    if not m.beta_varies:
        const = const + ops.log(x.beta[0]) * dim_v / 2
    return joint - marginal + const


def _mix(weights, values):
    """sum_u w_u mu_u, an object vector (E,)."""
    dim_v = values.shape[1]
    return np.array(
        [sum((w * values[u, e] for u, w in enumerate(weights) if w != 0), 0) for e in range(dim_v)],
        dtype=object,
    )


def _em_row(ops, m, x: _ExactModel, b, i, v_init, iters, want_trace=False):
    """(v_iters (E,), trace) of query row i of batch element b, model inputs ``x``."""
    allowed = None if m.allowed is None else m.allowed[b][i]
    a = _query_logits_exact(m, x, x.q[i], allowed)
    dim_v = x.values.shape[1]
    if all(s is None for s in a):  # an empty row: out 0 or NaN (refattn's empty_rows)
        fill = 0 if m.empty_rows == "zero" else math.nan
        return [fill] * dim_v, [math.nan] * (iters if want_trace else 0)
    v = None if v_init is None else ops.array(v_init[b][i])
    trace = []
    for _ in range(iters):
        if v is None:
            logits = a
        else:
            vb = _value_logits_exact(m, x, v, x.beta_log)
            logits = [None if s is None else s + t for s, t in zip(a, vb, strict=False)]
        if x.beta_log is not None:  # eq. (12) with per-unit beta: weights w_u beta_u / sum
            logits = [None if s is None else s + t for s, t in zip(logits, x.beta_log, strict=True)]
        v = _mix(ops.softmax(logits), x.values)
        if want_trace:
            trace.append(_trace_entry(ops, m, x, i, allowed, v))
    return list(v), trace


def _trace_entry(ops, m, x, i, allowed, v):
    try:
        a = _query_logits_exact(m, x, x.q[i], allowed, normalised=True)
        return _log_posterior_exact(ops, m, x, a, v)
    except NotRational:
        return None


def _attention_row_exact(ops, m, v_init, iters, want_trace, row):
    b, i = row
    v, trace = _em_row(ops, m, _exact_model(ops, m, b), b, i, v_init, iters, want_trace)
    return v + trace


def _key_logits_exact(m, x: _ExactModel, qrow, v_rows, i):
    """The key E-step logits of query i: the query logits, plus the value likelihood of v_i
    (with its normaliser (E/2) log beta_u in the paper form) when ``adapt_keys`` has v_init."""
    a = _query_logits_exact(m, x, qrow)
    if v_rows is None:
        return a
    b = _value_logits_exact(m, x, v_rows[i], x.beta_log)
    return [None if s is None else s + t for s, t in zip(a, b, strict=True)]


def _adapt_keys_exact(ops, m, gamma, form, iters, b, x=None):
    x = _exact_model(ops, m, b) if x is None else x
    keys0 = x.keys
    keys = keys0.copy()
    units, dim = keys.shape
    v_rows = None if m.v_init is None else [ops.array(row) for row in m.v_init[b]]
    for _ in range(iters):
        xt = x._replace(keys=keys)
        weights = [
            ops.softmax(_key_logits_exact(m, xt, qrow, v_rows, i)) for i, qrow in enumerate(x.q)
        ]
        new = keys.copy()
        for k in range(units):
            if math.isinf(gamma[b][k]):
                continue  # the limit gamma -> inf: the prior pins the key at xi^0
            total = sum((w[k] for w in weights), 0)
            if is_zero(primal(total)):
                continue  # no responsibility (a -inf prior): the key is unchanged
            g, a = ops.scalar(gamma[b][k]), x.alpha[k]
            # one responsible query: q-bar_k is that query exactly (w / W = 1 identically;
            # on intervals w / w is not a point, and the key would be a rounding midpoint
            # that no precision decides, e.g. eq. (28) with a single query)
            sole = [i for i, w in enumerate(weights) if not is_zero(primal(w[k]))]
            for d in range(dim):
                weighted = sum((w[k] * x.q[i][d] for i, w in enumerate(weights)), 0)
                q_bar = x.q[sole[0]][d] if len(sole) == 1 else weighted / total
                if form == "paper":  # as printed: its coefficients are exact for gamma = 0
                    new[k, d] = g / (a + g) * keys0[k, d] + a / (a + g) * q_bar
                elif gamma[b][k] == 0:  # both MAP forms: q-bar_k (the DNA limit)
                    new[k, d] = q_bar
                else:
                    centre = keys if form == "map_recentred" else keys0
                    new[k, d] = (g * centre[k, d] + a * weighted) / (g + a * total)
        keys = new
    return list(keys.ravel())


def _adapt_priors_exact(ops, m, pi0_row, eta_kind, eta_value, form, iters, b, x=None):
    x = _exact_model(ops, m, b) if x is None else x
    raw = ops.array(pi0_row)
    total0 = sum(raw, 0)
    pi = [p / total0 for p in raw]
    if eta_kind == "scaled":
        eta = [ops.scalar(eta_value) * p for p in pi]
    else:
        eta = list(ops.array(eta_value[b]))
    units = len(pi)
    for _ in range(iters):
        log_pi = [None if is_zero(primal(p)) else ops.log(p) for p in pi]
        m_arr = m._replace(kind="array")
        weights = []
        for qrow in x.q:
            xt = x._replace(log_prior=log_pi)
            weights.append(ops.softmax(_query_logits_exact(m_arr, xt, qrow)))
        w_bar = [sum((w[k] for w in weights), 0) for k in range(units)]
        if form == "paper":
            mass = [w_bar[k] * (1 + eta[k]) for k in range(units)]
        else:
            mass = [w_bar[k] + eta[k] for k in range(units)]
        norm = sum(mass, 0)
        pi = [x_ / norm for x_ in mass]
    return pi


def attention(m, v_init, iters, want_trace, dtype):
    """(values (..., L, E), trace (..., L, iters) or None) of ``iters`` EM steps, rounded once."""
    batch, length, dim_v = m.q.shape[:-2], m.q.shape[-2], m.values.shape[-1]
    table = exact_rows(
        batch_rows(batch, length),
        lambda ops, row: _attention_row_exact(ops, m, v_init, iters, want_trace, row),
        dtype,
        "gmm.attention",
    )
    values = table[:, :dim_v].reshape(batch + (length, dim_v))
    trace = table[:, dim_v:].reshape(batch + (length, iters)) if want_trace else None
    return values, trace


def log_posterior(m, v, dtype):
    """log p(v | q) (..., L), rounded once."""

    def row_value(ops, row):
        b, i = row
        x = _exact_model(ops, m, b)
        return [
            _log_posterior_exact(ops, m, x, _query_logits_exact(m, x, x.q[i]), ops.array(v[b][i]))
        ]

    batch, length = m.q.shape[:-2], m.q.shape[-2]
    table = exact_rows(batch_rows(batch, length), row_value, dtype, "gmm.log_posterior")
    return table.reshape(batch + (length,))


def adapt_keys(m, gamma, form, iters, dtype):
    """The keys xi^iters (..., S, D) of the key adaptation, rounded once."""
    batch = m.keys.shape[:-2]

    def row_keys(ops, b):
        return _adapt_keys_exact(ops, m, gamma, form, iters, b)

    table = exact_rows(list(np.ndindex(*batch)), row_keys, dtype, "gmm.adapt_keys")
    return table.reshape(batch + m.keys.shape[-2:])


def adapt_priors(m, pi0, eta_kind, eta_value, form, iters, dtype):
    """The priors pi^iters (..., S) of the prior adaptation, rounded once."""
    batch, units = m.keys.shape[:-2], m.keys.shape[-2]

    def row_priors(ops, b):
        return _adapt_priors_exact(ops, m, pi0[b], eta_kind, eta_value, form, iters, b)

    table = exact_rows(list(np.ndindex(*batch)), row_priors, dtype, "gmm.adapt_priors")
    return table.reshape(batch + (units,))


# --------------------------------------------------------------------------------------------
# Vector-Jacobian products: the row evaluators above, differentiated as run
# (refattn.exact.autodiff), each gradient element rounded once by the same Ziv loop.
# --------------------------------------------------------------------------------------------


def _exact_vjp(m, inputs, run, grad, dtype, what):
    """:func:`refattn.exact.rows.exact_vjp_rows` over the model's fields ``inputs`` = ((field,
    array as passed), ...); ``run(ops, x, b)`` evaluates batch element b on model inputs x."""

    def run_model(ops, leaves, b):
        return run(ops, _exact_model(ops, m, b)._replace(**leaves), b)

    return exact_vjp_rows(
        m.q.shape[:-2], [(name, arr, 2) for name, arr in inputs], run_model, grad, dtype, what
    )


def attention_vjp(m, inputs, v_init, iters, grad, dtype):
    """(dq, dkeys, dvalues) of ``iters`` EM steps, each element rounded once."""
    length = m.q.shape[-2]

    def run(ops, x, b):
        out = []
        for i in range(length):
            out.extend(_em_row(ops, m, x, b, i, v_init, iters)[0])
        return out

    return _exact_vjp(m, inputs, run, grad, dtype, "gmm.attention_vjp")


def adapt_keys_vjp(m, inputs, gamma, form, iters, grad, dtype):
    """(dqueries, dkeys0) of the key adaptation, each element rounded once."""

    def run(ops, x, b):
        return _adapt_keys_exact(ops, m, gamma, form, iters, b, x)

    return _exact_vjp(m, inputs, run, grad, dtype, "gmm.adapt_keys_vjp")


def adapt_priors_vjp(m, inputs, pi0, eta_kind, eta_value, form, iters, grad, dtype):
    """(dqueries, dkeys) of the prior adaptation, each element rounded once."""

    def run(ops, x, b):
        return _adapt_priors_exact(ops, m, pi0[b], eta_kind, eta_value, form, iters, b, x)

    return _exact_vjp(m, inputs, run, grad, dtype, "gmm.adapt_priors_vjp")
