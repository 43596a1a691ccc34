"""The float64 path of :mod:`refattn.gmm` in log-space: logits, the EM iteration, and the
adaptation steps (every exponential is of a max-shifted score)."""

from __future__ import annotations

import math

import numpy as np

from .. import _checks
from ._model import Model


def widened(m: Model) -> Model:
    """The model with its arrays widened (exactly) to float64, for the float64 path: einsum
    and matmul do not take float16 / bfloat16 inputs uniformly."""
    return m._replace(
        q=_checks.as_float64(m.q),
        keys=_checks.as_float64(m.keys),
        values=None if m.values is None else _checks.as_float64(m.values),
        v_init=None if m.v_init is None else _checks.as_float64(m.v_init),
    )


def sqdist64(x, y):
    """||x_i - y_u||^2, (..., L, S), from the differences (no cancellation of large norms)."""
    diff = x[..., :, None, :] - y[..., None, :, :]
    return np.einsum("...lsd,...lsd->...ls", diff, diff)


def query_logits64(m: Model, q, keys):
    """log p(u) + log p(q | u) up to terms constant over u: (..., L, S).

    Logits beyond the float64 range (e.g. alpha ~ 1e308) would turn into -inf/NaN and
    silently wrong responsibilities: that is a ValueError naming alpha and beta instead.
    """
    try:
        with np.errstate(over="raise", invalid="raise"):
            return _query_logits64_unchecked(m, q, keys)
    except FloatingPointError:
        raise ValueError(
            "alpha, beta: the log-responsibilities alpha/2 |q - k|^2 (and beta/2 |v|^2) "
            f"exceed the float64 range (max alpha {float(np.max(m.alpha)):.3g}); the float64 "
            "path cannot represent them"
        ) from None


def _query_logits64_unchecked(m: Model, q, keys):
    alpha = m.alpha[..., None, :]
    dim = q.shape[-1]
    if m.kind == "magnitude":
        # eq. (15) x eq. (7): alpha xi.q - alpha/2 ||q||^2 + beta/2 ||mu||^2 (eqs. (17)-(18))
        logits = alpha * np.einsum("...ld,...sd->...ls", q, keys)
        if m.values is not None:
            norms = np.einsum("...se,...se->...s", m.values, m.values)
            logits = logits + (m.beta * norms / 2)[..., None, :]
        if m.alpha_varies:
            logits = logits - alpha / 2 * np.einsum("...ld,...ld->...l", q, q)[..., None]
    else:
        logits = -alpha / 2 * sqdist64(q, keys)
        if m.kind == "array":
            logits = logits + m.log_prior[..., None, :]
    if m.alpha_varies and m.form == "paper":
        logits = logits + dim / 2 * np.log(alpha)
    if m.allowed is not None:
        logits = np.where(m.allowed, logits, -np.inf)
    return logits


def value_logits64(m: Model, v):
    """log p(v | u) up to terms constant over u: (..., L, S)."""
    beta = m.beta[..., None, :]
    logits = -beta / 2 * sqdist64(v, m.values)
    if m.beta_varies and m.form == "paper":
        logits = logits + v.shape[-1] / 2 * np.log(beta)
    return logits


def lse64(x):
    return lse_where(x, np.isfinite(x) | np.isnan(x))


def lse_where(x, where):
    from ..logspace import logsumexp

    return logsumexp(x, axis=-1, where=where)


def softmax64(x):
    from ..logspace import softmax

    return softmax(x, axis=-1, where=~np.isneginf(x))


def _value_constant(m: Model, dim_v):
    """(E/2) log beta - (E/2) log 2 pi when beta is equal across units (else the beta part is
    already in the logits)."""
    const = -dim_v / 2 * math.log(2 * math.pi)
    if not m.beta_varies:
        const = const + dim_v / 2 * np.log(m.beta[..., :1])  # (..., 1)
    return const


def log_posterior64(m: Model, a, v):
    """log p(v | q) = lse(a + b(v)) - lse(a) + const (eq. (1) with (6)-(8))."""
    b = value_logits64(m, v)
    return lse64(a + b) - lse64(a) + _value_constant(m, v.shape[-1])


def em_logits64(m: Model, a, v):
    """The E-step logits of one iteration: a + log p(v | u), plus log beta_u when the M-step
    weights the units by their value precisions (eq. (12), per-unit beta, paper form)."""
    logits = a if v is None else a + value_logits64(m, v)
    if m.beta_varies and m.form == "paper":
        logits = logits + np.log(m.beta)[..., None, :]
    return logits


def _trace64(m: Model, v, empty):
    """log p(v | q) of the model (always the normalised density) per row, NaN on empty rows."""
    model = m._replace(form="paper")
    with np.errstate(invalid="ignore"):
        value = log_posterior64(model, query_logits64(model, model.q, model.keys), v)
    return np.where(empty, np.nan, value)


def attention64(m: Model, v_init, iters, tol, want_trace):
    a = query_logits64(m, m.q, m.keys)
    empty = np.isneginf(a).all(axis=-1)
    v = None if v_init is None else _checks.as_float64(v_init)
    shape = a.shape[:-1]
    active = np.ones(shape, dtype=bool)
    done = np.zeros(shape, dtype=np.int64)
    trace = np.full(shape + (iters,), np.nan) if want_trace else None
    for t in range(iters):
        new = softmax64(em_logits64(m, a, v)) @ m.values
        new = np.where(empty[..., None], 0.0, new)  # empty rows: out 0 (refattn's empty_rows)
        if v is not None:
            new = np.where(active[..., None], new, v)
        if tol is not None and v is not None:
            settled = np.max(np.abs(new - v), axis=-1) <= tol
        else:
            settled = np.zeros(shape, dtype=bool)
        done += active
        if want_trace:
            trace[..., t] = np.where(active, _trace64(m, new, empty), np.nan)
        v = new
        active &= ~settled
        if not active.any():
            break
    if m.empty_rows == "nan":
        v = np.where(empty[..., None], np.nan, v)
    return v, trace, done


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def responsibilities64(m: Model, keys, log_prior_now):
    """log w^i_k = log p(u_k | q_i) (eq. (23)), or log p(u_k | q_i, v_i) when the model has
    values v_i (``adapt_keys(v_init=...)``), (..., L, S)."""
    if log_prior_now is not None:
        m = m._replace(kind="array", log_prior=log_prior_now)
    logits = query_logits64(m, m.q, keys)
    if m.v_init is not None:
        logits = logits + value_logits64(m, m.v_init)
    from ..logspace import log_softmax

    return log_softmax(logits, axis=-1, where=~np.isneginf(logits))


def keys_update64(m: Model, keys0, keys, gamma, form):
    """One M-step of eqs. (28)-(29) ("paper") or the once-counted MAP form ("map")."""
    log_w = responsibilities64(m, keys, None)
    log_total = unit_totals64(log_w)
    responsible = np.isfinite(log_total)
    safe_total = np.where(responsible, log_total, 0.0)
    share = np.exp(np.where(np.isneginf(log_w), -np.inf, log_w - safe_total[..., None, :]))
    q_bar = np.einsum("...ls,...ld->...sd", share, _checks.as_float64(m.q))  # eq. (29)
    alpha, gam = m.alpha[..., None], gamma[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        if form == "paper":
            new = (gam * keys0 + alpha * q_bar) / (alpha + gam)  # eq. (28)
        else:  # the prior counted once, centred on xi^0 ("map") or on xi^t ("map_recentred")
            centre = keys if form == "map_recentred" else keys0
            ratio = prior_ratio64(gam, safe_total)
            new = np.where(
                np.isinf(ratio), centre, (ratio * centre + alpha * q_bar) / (ratio + alpha)
            )
    new = np.where(np.isinf(gam), keys0, new)
    return np.where(responsible[..., None], new, keys)


def prior_ratio64(gam, log_total):
    """gamma_k / W_k (..., S, 1) from log W_k, so that the MAP forms
    ``(gamma c + alpha W q-bar) / (gamma + alpha W) = (r c + alpha q-bar) / (r + alpha)`` never
    form 0/0 when W_k underflows; inf (the key stays at its centre) when r overflows."""
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = gam * np.exp(-log_total)[..., None]
    return np.where(gam == 0, 0.0, ratio)


def keys_states64(m: Model, gamma, form, iters):
    """[xi^0, xi^1, ..., xi^iters] of the float64 path."""
    states = [m.keys]
    for _ in range(iters):
        states.append(keys_update64(m, m.keys, states[-1], gamma, form))
    return states


def priors_states64(m: Model, pi0, eta_kind, eta_value, form, iters):
    """([pi^0, ..., pi^iters], eta (B..., S)) of the float64 path."""
    pi = pi0 / pi0.sum(axis=-1, keepdims=True)
    eta_arr = eta_value * pi if eta_kind == "scaled" else eta_value
    states = [pi]
    for _ in range(iters):
        w_bar = np.exp(unit_totals64(prior_responsibilities64(m, states[-1])))
        mass = w_bar * (1 + eta_arr) if form == "paper" else w_bar + eta_arr
        states.append(mass / mass.sum(axis=-1, keepdims=True))
    return states, eta_arr


def prior_responsibilities64(m: Model, pi):
    with np.errstate(divide="ignore"):
        return responsibilities64(m, m.keys, np.log(pi))


def unit_totals64(log_w):
    """log W_k = log sum_i w_ik (..., S), a max-shifted lse over the queries."""
    swapped = np.swapaxes(log_w, -1, -2)
    return lse_where(swapped, ~np.isneginf(swapped))
