"""Vector-Jacobian products of :mod:`refattn.gmm`: the derivative of the finite EM
computation as run, by reverse accumulation (float64) or on the exact row evaluators."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _checks
from ..exact import gmm as exact
from ._adapt import keys_problem, priors_problem
from ._float64 import (
    em_logits64,
    keys_states64,
    keys_update64,
    prior_ratio64,
    prior_responsibilities64,
    priors_states64,
    query_logits64,
    responsibilities64,
    softmax64,
    unit_totals64,
    widened,
)
from ._forward import attention_problem
from ._model import Model, cotangent, passed_arrays, summed_to_arguments


class AttentionVJP(NamedTuple):
    """Gradients of ``sum(grad_out * attention(q, keys, values))``, shapes of the inputs."""

    dq: np.ndarray
    dkeys: np.ndarray
    dvalues: np.ndarray


class AdaptKeysVJP(NamedTuple):
    """Gradients of ``sum(grad_out * adapt_keys(queries, keys0))``, shapes of the inputs."""

    dqueries: np.ndarray
    dkeys0: np.ndarray


class AdaptPriorsVJP(NamedTuple):
    """Gradients of ``sum(grad_out * adapt_priors(queries, keys))``, shapes of the inputs."""

    dqueries: np.ndarray
    dkeys: np.ndarray


def _swap(x):
    return np.swapaxes(x, -1, -2)


def _query_logits_vjp64(m: Model, q, keys, dlogits):
    """(dq, dkeys, dvalues or None) of :func:`query_logits64` for the cotangent ``dlogits``
    (..., L, S), which is 0 wherever a unit is excluded (its weight is 0)."""
    scaled = m.alpha[..., None, :] * dlogits
    if m.kind == "magnitude":  # alpha xi.q (- alpha/2 |q|^2) (+ beta/2 |mu|^2)
        dq = scaled @ keys
        if m.alpha_varies:
            dq = dq - scaled.sum(axis=-1)[..., None] * q
        dkeys = _swap(scaled) @ q
        dvalues = None
        if m.values is not None:
            dvalues = (m.beta * dlogits.sum(axis=-2))[..., None] * m.values
        return dq, dkeys, dvalues
    diff = q[..., :, None, :] - keys[..., None, :, :]  # -alpha/2 |q - xi|^2
    dq = -np.einsum("...ls,...lsd->...ld", scaled, diff)
    dkeys = np.einsum("...ls,...lsd->...sd", scaled, diff)
    return dq, dkeys, None


def _softmax_vjp64(weights, dweights_times_weights):
    """d logits of a softmax over the last axis from ``c = w * dw``: c - w sum(c)."""
    c = dweights_times_weights
    return c - weights * c.sum(axis=-1, keepdims=True)


def _attention_vjp64(m: Model, v_init, iters, grad):
    """(dq, dkeys, dvalues) of ``iters`` EM steps (eqs. (13)-(14)) by reverse accumulation."""
    a = query_logits64(m, m.q, m.keys)
    empty = np.isneginf(a).all(axis=-1)
    iterates = [None if v_init is None else _checks.as_float64(v_init)]
    weights = []
    for _ in range(iters):
        weights.append(softmax64(em_logits64(m, a, iterates[-1])))
        iterates.append(weights[-1] @ m.values)
    g = np.where(empty[..., None], 0.0, grad)  # empty rows are constants
    dvalues = np.zeros_like(m.values)
    da = np.zeros_like(a)
    for t in reversed(range(iters)):
        w, new, old = weights[t], iterates[t + 1], iterates[t]
        dvalues = dvalues + _swap(w) @ g  # v = sum_u w_u mu_u
        spread = m.values[..., None, :, :] - new[..., :, None, :]  # mu_u - v_{t+1}
        dlogits = w * np.einsum("...lse,...le->...ls", spread, g)
        da = da + dlogits
        if old is None:
            break
        scaled = dlogits * m.beta[..., None, :]  # -beta_u/2 |v_t - mu_u|^2
        diff = old[..., :, None, :] - m.values[..., None, :, :]
        dvalues = dvalues + np.einsum("...ls,...lse->...se", scaled, diff)
        g = -np.einsum("...ls,...lse->...le", scaled, diff)
    dq, dkeys, dvalues_prior = _query_logits_vjp64(m, m.q, m.keys, da)
    if dvalues_prior is not None:
        dvalues = dvalues + dvalues_prior
    return dq, dkeys, dvalues


def _keys_update_vjp64(m: Model, keys, gamma, form, grad):
    """(dqueries, dkeys0, dkeys_t) of one step of :func:`keys_update64` at keys xi^t."""
    q, keys0 = m.q, m.keys
    log_w = responsibilities64(m, keys, None)
    log_total = unit_totals64(log_w)
    responsible = np.isfinite(log_total)[..., None]
    safe_total = np.where(responsible[..., 0], log_total, 0.0)
    share = np.exp(np.where(np.isneginf(log_w), -np.inf, log_w - safe_total[..., None, :]))
    alpha, gam = m.alpha[..., None], gamma[..., None]
    pinned = np.isinf(gam)
    active = responsible & ~pinned
    g = np.where(active, grad, 0.0)
    finite_gam = np.where(pinned, 0.0, gam)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if form == "paper":  # eq. (28): d/dS_k = alpha/((alpha+gamma) W_k)
            coef = alpha / (alpha + finite_gam)
            centre_coef = finite_gam / (alpha + finite_gam)
            ref = np.einsum("...ls,...ld->...sd", share, q)  # q-bar
        else:  # alpha w_ik / (gamma + alpha W_k) = alpha share_ik / (gamma / W_k + alpha)
            ratio = prior_ratio64(finite_gam, safe_total)
            coef = np.where(np.isinf(ratio), 0.0, alpha / (ratio + alpha))
            centre_coef = np.where(np.isinf(ratio), 1.0, ratio / (ratio + alpha))
            ref = keys_update64(m, keys0, keys, gamma, form)
    coef_share = share * _swap(coef)  # (..., L, S)
    dq = coef_share @ g
    c = coef_share * np.einsum("...lsd,...sd->...ls", q[..., :, None, :] - ref[..., None, :, :], g)
    w = np.exp(log_w)
    dq_logits, dkeys_t, _ = _query_logits_vjp64(m, q, keys, _softmax_vjp64(w, c))
    dcentre = np.where(active, centre_coef * grad, 0.0)
    dkeys0 = np.where(pinned & responsible, grad, 0.0)
    dkeys_t = dkeys_t + np.where(responsible, 0.0, grad)
    if form == "map_recentred":
        dkeys_t = dkeys_t + dcentre
    else:
        dkeys0 = dkeys0 + dcentre
    return dq + dq_logits, dkeys0, dkeys_t


def _keys_vjp64(m: Model, gamma, form, iters, grad):
    states = keys_states64(m, gamma, form, iters)
    dq = np.zeros_like(m.q)
    dkeys0 = np.zeros_like(m.keys)
    g = grad
    for keys in reversed(states[:-1]):
        dq_t, dkeys0_t, g = _keys_update_vjp64(m, keys, gamma, form, g)
        dq, dkeys0 = dq + dq_t, dkeys0 + dkeys0_t
    return dq, dkeys0 + g  # xi^0 is keys0


def _priors_update_vjp64(m: Model, pi, eta, form, grad):
    """(dqueries, dkeys, dpi^t) of one step of eqs. (33)-(34) at priors pi^t."""
    log_w = prior_responsibilities64(m, pi)
    w = np.exp(log_w)
    w_bar = np.exp(unit_totals64(log_w))
    mass = w_bar * (1 + eta) if form == "paper" else w_bar + eta
    norm = mass.sum(axis=-1, keepdims=True)
    new = mass / norm
    dmass = (grad - (grad * new).sum(axis=-1, keepdims=True)) / norm
    dw_bar = dmass * (1 + eta) if form == "paper" else dmass
    dlogits = _softmax_vjp64(w, w * dw_bar[..., None, :])
    with np.errstate(divide="ignore"):
        array_model = m._replace(kind="array", log_prior=np.log(pi))
    dq, dkeys, _ = _query_logits_vjp64(array_model, m.q, m.keys, dlogits)
    with np.errstate(divide="ignore", invalid="ignore"):
        dpi = np.where(pi > 0, dlogits.sum(axis=-2) / pi, 0.0)  # log pi_k enters the logits
    return dq, dkeys, dpi


def _priors_vjp64(m: Model, pi0, eta_kind, eta_value, form, iters, grad):
    states, eta = priors_states64(m, pi0, eta_kind, eta_value, form, iters)
    dq, dkeys = np.zeros_like(m.q), np.zeros_like(m.keys)
    g = grad
    for pi in reversed(states[:-1]):
        dq_t, dkeys_t, g = _priors_update_vjp64(m, pi, eta, form, g)
        dq, dkeys = dq + dq_t, dkeys + dkeys_t
    return dq, dkeys  # pi^0 is not differentiated (a keyword argument)


def attention_vjp(
    q,
    keys,
    values,
    grad_out,
    *,
    alpha,
    beta=0.0,
    prior="uniform",
    v_init=None,
    iters=1,
    form="paper",
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    empty_rows="zero",
    precision="float64",
    out_dtype=None,
):
    """Vector-Jacobian product of :func:`attention`: the gradients of ``sum(grad_out * v_T)``.

    The derivative of the stated finite computation, the ``iters`` EM steps of eqs. (13)-(14)
    (Movellan & Gabbur) as run, by reverse accumulation: with ``l_u`` the E-step logits,
    ``w = softmax(l)`` and ``v_{t+1} = sum_u w_u mu_u``,

    .. math::

        \\frac{\\partial L}{\\partial l_u} = w_u\\, g \\cdot (\\mu_u - v_{t+1}), \\qquad
        \\frac{\\partial L}{\\partial \\mu_u} \\mathrel{+}= w_u\\, g, \\qquad
        \\frac{\\partial L}{\\partial v_t} = -\\sum_u \\frac{\\partial L}{\\partial l_u}
            \\beta_u (v_t - \\mu_u),

    then through the query logits (eq. (14) or the magnitude prior's eqs. (17)-(18)) to q and
    the keys. v_init, alpha, beta and the prior are constants (not differentiated).

    Parameters
    ----------
    q : array (..., L, D)
    keys : array (..., S, D)
    values : array (..., S, E)
    grad_out : array (..., L, E)
        The cotangent of the output.
    alpha, beta, prior, v_init, iters, form, mask, causal, window, align, empty_rows
        As :func:`attention` (``tol``, ``return_trace`` and ``backend`` have no gradient).
    precision : {"float64", "exact"}
        "exact": each gradient element the exact derivative of the computation rounded once
        to ``out_dtype`` (the exact row evaluator differentiated as run on rigorous intervals,
        :mod:`refattn.exact.autodiff`, and the Ziv loop). "float64": the reverse pass above
        in NumPy with log-space weights; no a-priori bound is claimed. Measured against the
        exact path (300 random cases, L, S, D, E <= 5, inputs ~ N(0, s^2) with s up to 3,
        iters <= 3): errors up to 18 (attention_vjp), ~300 (adapt_keys_vjp) and 22
        (adapt_priors_vjp) times 2**-52 (max |exact gradient| + max |grad_out|), growing
        with the softmax condition 1 + 2 max|logit|; the tests hold it to a first-order
        estimate (tests/registry.py ``gmm_vjp_bound``).
    out_dtype : dtype, optional
        Exact path only.

    Returns
    -------
    AttentionVJP(dq, dkeys, dvalues), shaped as q, keys, values (gradients of arguments
    broadcast along the batch are summed). Empty rows (no allowed unit) are constants: they
    contribute nothing, whatever ``empty_rows``.

    Notes
    -----
    Exact path: one batch element is one row of the Ziv loop (all of it when an argument is
    broadcast along the batch, since its gradient sums over the batch before the rounding).
    A gradient that cancels exactly to 0 is returned as +0. A gradient that is exactly a
    rounding midpoint is settled by the rational fallback only when the batch element's
    whole computation is rational (all weights ties); otherwise the Ziv loop raises
    :class:`refattn.exact.UndecidedRoundingError` (single-unit rows and single-query key
    adaptation are evaluated exactly, so they do not).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> q = np.array([[0.0, 1.0]]); keys = np.array([[0.0, 1.0], [1.0, 0.0]])
    >>> values = np.array([[1.0], [0.0]])
    >>> gmm.attention_vjp(q, keys, values, np.ones((1, 1)), alpha=1.0).dvalues.round(6).tolist()
    [[0.731059], [0.268941]]
    """
    precision = _checks.precision(precision)
    m, v_init, iters = attention_problem(
        q,
        keys,
        values,
        alpha,
        beta,
        prior,
        form,
        mask,
        causal,
        window,
        align,
        empty_rows,
        v_init,
        iters,
    )
    grad = cotangent(grad_out, m.q.shape[:-1] + (m.values.shape[-1],), "(..., L, E)", 2)
    originals = passed_arrays([("q", q, 2), ("keys", keys, 2), ("values", values, 2)])
    if precision == "exact":
        return AttentionVJP(
            *exact.attention_vjp(m, originals, v_init, iters, grad, _checks.out_dtype(out_dtype))
        )
    m = widened(m)
    grads = _attention_vjp64(m, v_init, iters, _checks.as_float64(grad))
    return AttentionVJP(*summed_to_arguments(grads, originals))


def adapt_keys_vjp(
    queries,
    keys0,
    grad_out,
    *,
    alpha,
    gamma,
    prior="uniform",
    iters=1,
    form="paper",
    values=None,
    beta=0.0,
    v_init=None,
    e_step="paper",
    precision="float64",
    out_dtype=None,
):
    """Vector-Jacobian product of :func:`adapt_keys`: gradients of ``sum(grad_out * xi^T)``.

    The derivative of the ``iters`` E/M steps as run (eqs. (23), (28)-(29), or the MAP forms):
    per step, with ``S_k = sum_i w_ik q_i`` and ``W_k = sum_i w_ik``, the M-step's cotangent
    ``G_k`` gives (paper form, eq. (28))

    .. math::

        w_{ik} \\frac{\\partial L}{\\partial w_{ik}} = \\frac{\\alpha_k}{\\alpha_k + \\gamma_k}
            \\frac{w_{ik}}{W_k} (q_i - \\bar q_k) \\cdot G_k, \\qquad
        \\frac{\\partial L}{\\partial q_i} \\mathrel{+}= \\sum_k
            \\frac{\\alpha_k}{\\alpha_k + \\gamma_k} \\frac{w_{ik}}{W_k} G_k,

    (the MAP forms: ``alpha_k w_ik / (gamma_k + alpha_k W_k)`` and ``xi^{t+1}_k`` in place of
    ``q̄_k``), then through the softmax of eq. (23) to the queries and the current keys.

    Parameters
    ----------
    queries : array (..., L, D)
    keys0 : array (..., S, D)
    grad_out : array (..., S, D)
    alpha, gamma, prior, iters, form, values, beta, v_init, e_step
        As :func:`adapt_keys` (constants: values and v_init are not differentiated).
    precision, out_dtype : as :func:`attention_vjp`.

    Returns
    -------
    AdaptKeysVJP(dqueries, dkeys0), shaped as queries and keys0.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> queries = np.array([[2.0, 0.0]]); keys0 = np.array([[0.0, 0.0]])
    >>> gmm.adapt_keys_vjp(queries, keys0, np.ones((1, 2)), alpha=1.0, gamma=1.0).dqueries.tolist()
    [[0.5, 0.5]]
    """
    precision = _checks.precision(precision)
    m, gamma, form, iters = keys_problem(
        queries, keys0, alpha, gamma, prior, iters, form, values, beta, v_init, e_step
    )
    grad = cotangent(grad_out, m.keys.shape, "(..., S, D)", 2)
    originals = passed_arrays([("q", queries, 2), ("keys", keys0, 2)])
    if precision == "exact":
        return AdaptKeysVJP(
            *exact.adapt_keys_vjp(
                m, originals, gamma, form, iters, grad, _checks.out_dtype(out_dtype)
            )
        )
    grads = _keys_vjp64(widened(m), gamma, form, iters, _checks.as_float64(grad))
    return AdaptKeysVJP(*summed_to_arguments(grads, originals))


def adapt_priors_vjp(
    queries,
    keys,
    grad_out,
    *,
    alpha,
    eta,
    pi0,
    iters=1,
    form="paper",
    precision="float64",
    out_dtype=None,
):
    """Vector-Jacobian product of :func:`adapt_priors`: gradients of ``sum(grad_out * pi^T)``.

    The derivative of the ``iters`` steps of eqs. (33)-(34) as run: with ``m_k`` the masses
    (``w̄_k (1 + eta_k)`` or ``w̄_k + eta_k``) and ``pi_k = m_k / sum_j m_j``,

    .. math::

        \\frac{\\partial L}{\\partial m_k} = \\frac{G_k - \\sum_j G_j \\pi_j}{\\sum_j m_j},
        \\qquad \\frac{\\partial L}{\\partial \\log \\pi^t_k} = \\sum_i
            \\frac{\\partial L}{\\partial l_{ik}},

    through the softmax of eq. (23) (whose logits hold log pi^t) to the queries, the keys and
    the previous priors. pi0, eta and alpha are constants.

    Parameters
    ----------
    queries : array (..., L, D)
    keys : array (..., S, D)
    grad_out : array (..., S)
    alpha, eta, pi0, iters, form : as :func:`adapt_priors`.
    precision, out_dtype : as :func:`attention_vjp`.

    Returns
    -------
    AdaptPriorsVJP(dqueries, dkeys), shaped as queries and keys.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> queries = np.array([[0.0], [1.0]]); keys = np.array([[0.0], [1.0]])
    >>> grads = gmm.adapt_priors_vjp(queries, keys, np.array([1.0, -1.0]), alpha=1.0, eta=0.0,
    ...                              pi0=np.array([0.5, 0.5]))
    >>> bool(grads.dqueries.shape == (2, 1))
    True
    """
    precision = _checks.precision(precision)
    m, pi0, eta_kind, eta_value, form, iters = priors_problem(
        queries, keys, alpha, eta, pi0, iters, form
    )
    grad = cotangent(grad_out, m.keys.shape[:-1], "(..., S)", 1)
    originals = passed_arrays([("q", queries, 2), ("keys", keys, 2)])
    if precision == "exact":
        return AdaptPriorsVJP(
            *exact.adapt_priors_vjp(
                m,
                originals,
                pi0,
                eta_kind,
                eta_value,
                form,
                iters,
                grad,
                _checks.out_dtype(out_dtype),
            )
        )
    grads = _priors_vjp64(
        widened(m), pi0, eta_kind, eta_value, form, iters, _checks.as_float64(grad)
    )
    return AdaptPriorsVJP(*summed_to_arguments(grads, originals))
