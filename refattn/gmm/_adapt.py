"""Inference-time adaptation of :mod:`refattn.gmm`: the keys (:func:`adapt_keys`, eqs.
(21)-(29)) and the unit priors (:func:`adapt_priors`, eqs. (30)-(34)) by EM over a batch."""

from __future__ import annotations

import numpy as np

from .. import _checks
from ..exact import gmm as exact
from ._float64 import keys_states64, priors_states64, widened
from ._model import (
    ATTENTION_FORMS,
    KEY_FORMS,
    PRIOR_FORMS,
    build_model,
    iteration_count,
    unit_parameter,
)


def _check_gamma(gamma, batch, units):
    return unit_parameter(gamma, "gamma", batch, units, allow_zero=True, allow_inf=True)[0]


def adapt_keys(
    queries,
    keys0,
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
    """Inference-time MAP adaptation of the keys to a batch of queries (eqs. (21)-(29)).

    E-step (eq. (23)) with the current keys xi^t, then the M-step with the Gaussian key prior
    of eq. (25) centred on the **initial** keys xi^0 (not on xi^t):

    .. math::

        \\text{"paper"}:\\ \\xi_k^{t+1} = \\frac{\\gamma}{\\alpha + \\gamma}\\xi_k^0
            + \\frac{\\alpha}{\\alpha + \\gamma}\\bar q_k \\ \\ (28), \\qquad
            \\bar q_k = \\frac{\\sum_i w_k^i q_i}{\\sum_i w_k^i} \\ \\ (29)

        \\text{"map"}:\\ \\xi_k^{t+1} = \\frac{\\gamma \\xi_k^0 + \\alpha \\sum_i w_k^i q_i}
            {\\gamma + \\alpha \\sum_i w_k^i}

    Eq. (28) solves eq. (26), whose prior term sits inside the sum over queries: the log-prior
    is counted once per unit of responsibility W_k = sum_i w_k^i. The MAP form counts it once,
    as the MAP objective of eq. (21), ``log p(lambda) + sum_i log p(q_i | lambda)``, does
    (its EM step maximises ``log p(lambda) + sum_i sum_j w_j^i log p(q_i, u_j | lambda)``).
    Eq. (24) as printed does not: it puts ``log p(lambda)`` inside the double sum, where it
    is counted once per query. "paper" and "map" **coincide when W_k = 1**, when
    gamma = 0 and when gamma = inf. **gamma -> 0** (uninformative prior) gives xi_k = q̄_k in
    both forms: with ``prior="magnitude"`` this is the Double Normalized Attention (DNA) of Ding
    et al. (2020), the case the paper names. gamma = inf returns xi^0 exactly.

    ``form="map_recentred"`` is the reading of the authors' public code
    (apple/ml-probabilistic-attention, ``probabilisticattention.py``, its key-adaptation
    loop): the "map" step with the prior centred on the **current** keys xi^t instead of
    xi^0, i.e. ``iters`` chained one-iteration "map" adaptations. It equals "map" for
    ``iters=1``.

    **The public code's key E-step** (same file, ``update_weights``, which the key loop calls
    again after every key update) is the attention E-step at the current keys, so it keeps
    every term of the attention weights; three options give it:

    * ``values=mu, beta=beta`` with ``prior="magnitude"``: the prior keeps
      ``+beta_u ||mu_u||^2 / 2`` (eq. (15) in full; without values the E-step drops it, a
      relative difference of 0.29 in the keys after 3 iterations at alpha = 1/sqrt(D),
      beta = 0.5, inputs ~ N(0, 1), L = 6, S = 5, D = 4, E = 3);
    * ``values=mu, beta=beta, v_init=v``: the value likelihood ``-beta_u ||v_i - mu_u||^2 / 2``
      of query i's value enters its responsibilities (eq. (5) with the value term, i.e.
      ``w_u^i = p(u | q_i, v_i)``; 0.33 relative on the same problem when left out);
    * ``e_step="unnormalised"``: no normaliser ``(D/2) log alpha_u`` (nor ``(E/2) log beta_u``
      with v_init) in the responsibilities, as ``attention(form="unnormalised")``; it matters
      for per-unit alpha (0.12 relative with alpha_u ~ U(0.3, 3)).

    ``form="map_recentred", e_step="unnormalised"`` with these inputs reproduces the public
    loop (``key_adaptation=True``, ``key_adaptation_iters=iters``, ``zeta_prior_precision``
    = gamma, or gamma = 0 when it is None; ``pi=None``; per-unit or shared alpha and beta;
    ``magnitude_priors`` = ``prior="magnitude"``; no positional embeddings) within 4e-16
    relative in float64 (tests/concepts/test_gmm_public.py). The public code's 1e-20 added
    to the sum of the max-shifted weights (a sum >= 1) changes no float64 weight.

    Parameters
    ----------
    queries : array (..., L, D)
    keys0 : array (..., S, D)
        Initial keys xi^0 (also the prior's centre).
    alpha : float or array (..., S), > 0
    gamma : float or array (..., S), >= 0, inf allowed
        Key-prior precision of eq. (25).
    prior : {"uniform", "magnitude"} or array (..., S) of log p(u)
        Unit prior of the E-step. "magnitude" is ``p(u) ∝ exp(alpha ||xi^t_u||^2 / 2)`` (eq.
        (15) without values; with ``values``, plus ``beta_u ||mu_u||^2 / 2``) evaluated at
        the current keys; the M-step, as eqs. (26)-(28), does not differentiate the prior.
    iters : int >= 1
    form : {"paper", "map", "map_recentred"}
        The M-step.
    values : array (..., S, E), optional
        Expected values mu_u of the units (constants here). Default None: the E-step has no
        value terms (eq. (23)).
    beta : float or array (..., S), >= 0
        Value precisions (eq. (8)); used only with ``values``.
    v_init : array (..., L, E), optional
        Values v_i whose likelihood ``N(v_i; mu_u, beta_u^-1 I)`` enters the responsibilities
        of query i (needs ``values``).
    e_step : {"paper", "unnormalised"}
        "paper" (default): the responsibilities with the Gaussian normalisers (D/2) log
        alpha_u and (E/2) log beta_u (they cancel when the precisions are shared).
        "unnormalised": without them (the public code).
    precision, out_dtype : as :func:`attention`.

    Notes
    -----
    float64: responsibilities are log-softmax values and ``q̄_k`` is formed as
    ``sum_i exp(log w_ik - log W_k) q_i`` with ``log W_k`` a max-shifted lse, so no unit's
    responsibility underflows to 0/0; one iteration errs by at most
    :func:`refattn.bounds.mixture_bound` (n = L + S, values max|q| + max|xi^0|) in the
    "paper" form, times L + 1 in the "map" forms.

    Returns
    -------
    array (..., S, D): xi^iters. A unit with no responsibility at all (W_k = 0 exactly, only
    possible with a -inf log prior) keeps its key.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> queries = np.array([[2.0, 0.0]]); keys0 = np.array([[0.0, 0.0]])
    >>> gmm.adapt_keys(queries, keys0, alpha=1.0, gamma=1.0).tolist()
    [[1.0, 0.0]]
    """
    precision = _checks.precision(precision)
    m, gamma, form, iters = keys_problem(
        queries, keys0, alpha, gamma, prior, iters, form, values, beta, v_init, e_step
    )
    if precision == "float64":
        return keys_states64(widened(m), gamma, form, iters)[-1]
    return exact.adapt_keys(m, gamma, form, iters, _checks.out_dtype(out_dtype))


def keys_problem(
    queries,
    keys0,
    alpha,
    gamma,
    prior,
    iters,
    form,
    values=None,
    beta=0.0,
    v_init=None,
    e_step="paper",
):
    """Validated (model, gamma (B..., S), form, iters) of :func:`adapt_keys`: the model holds
    the E-step's reading (``form`` = e_step), the values and v_init (B..., L, E) if given."""
    form = _checks.choice(form, "form", KEY_FORMS)
    e_step = _checks.choice(e_step, "e_step", ATTENTION_FORMS)
    if values is None and (v_init is not None or np.any(np.asarray(beta) != 0)):
        raise ValueError(
            "values: v_init and beta > 0 add value terms to the key E-step, which need the "
            "expected values mu_u (..., S, E); pass values or leave v_init=None, beta=0"
        )
    m = build_model(
        queries,
        keys0,
        values,
        alpha,
        beta,
        prior,
        need_values=values is not None,
        names=("queries", "keys0"),
    )
    m = m._replace(form=e_step)
    if v_init is not None:
        v_init = _checks.finite_array(v_init, "v_init", 2)
        want = m.q.shape[:-1] + (m.values.shape[-1],)
        m = m._replace(v_init=_checks.broadcast(v_init, want, "v_init", "(..., L, E)"))
    iters = iteration_count(iters)
    gamma = _check_gamma(gamma, m.keys.shape[:-2], m.keys.shape[-2])
    return m, gamma, form, iters


def _check_pi0(pi0, batch, units):
    arr = _checks.float_array(pi0, "pi0", ndim_min=1)
    wide = _checks.as_float64(arr)
    if wide.shape[-1] != units:
        raise ValueError(
            f"pi0: expected S = {units} entries on the last axis, got shape {wide.shape}"
        )
    if not np.isfinite(wide).all() or (wide < 0).any():
        raise ValueError(
            f"pi0: expected a distribution over units (finite, >= 0), got "
            f"min {np.nanmin(wide)!r} (shape {wide.shape})"
        )
    sums = wide.sum(axis=-1)
    slack = units * np.finfo(arr.dtype if arr.dtype.itemsize >= 4 else np.float32).eps
    if arr.dtype.name in ("float16", "bfloat16"):
        slack = units * 2.0**-7
    if (np.abs(sums - 1) > slack).any():
        worst = sums.ravel()[np.argmax(np.abs(sums - 1).ravel())]
        raise ValueError(
            f"pi0: expected a distribution over units (sum 1 within {slack:.3g}), "
            f"got a sum of {worst!r} (shape {wide.shape})"
        )
    return _checks.broadcast(wide, batch + (units,), "pi0", "(..., S)")


def _check_eta(eta, pi0):
    if np.ndim(eta) == 0 and not isinstance(eta, np.ndarray):
        value = _checks.real_scalar(eta, "eta")
        if value < 0:
            raise ValueError(f"eta: expected a concentration >= 0, got {value}")
        return "scaled", value
    arr = _checks.as_float64(_checks.float_array(eta, "eta", ndim_min=1))
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError(f"eta: expected finite Dirichlet parameters >= 0, shape {arr.shape}")
    return "array", _checks.broadcast(arr, pi0.shape, "eta", "(..., S)")


def adapt_priors(
    queries, keys, *, alpha, eta, pi0, iters=1, form="paper", precision="float64", out_dtype=None
):
    """Inference-time adaptation of the unit priors pi with a Dirichlet prior (eqs. (30)-(34)).

    .. math::

        \\pi_k^{t+1} = \\frac{\\bar w_k (1 + \\eta_k)}{\\sum_j \\bar w_j (1 + \\eta_j)} \\ \\ (33),
        \\qquad \\bar w_j = \\sum_i w_j^i \\ \\ (34)

    with w_j^i = p(u_j | q_i, pi^t) (eq. (23), Gaussian query likelihood of precision alpha).
    ``form="map"`` is the once-counted Dirichlet MAP ``pi_k ∝ w̄_k + eta_k``: eq. (31) as
    printed multiplies the log-prior eta_k log pi_k by the responsibilities, like eq. (26).

    Parameters
    ----------
    queries : array (..., L, D)
    keys : array (..., S, D)
    alpha : float or array (..., S), > 0
    eta : float or array (..., S), >= 0
        A scalar is the constant of the paper's ``eta ∝ pi^0``: eta_k = eta * pi0_k. An array
        is eta itself.
    pi0 : array (..., S)
        Initial priors: a distribution (>= 0, summing to 1 within S units of its dtype's
        epsilon); it is used normalised exactly.
    iters : int >= 1
    form : {"paper", "map"}
    precision, out_dtype : as :func:`attention`.

    Returns
    -------
    array (..., S): pi^iters.

    Notes
    -----
    The paper's form does not tend to pi^0 as eta -> inf (it tends to ``w̄ * pi0``
    renormalised); the "map" form does. float64: w̄_k is ``exp(lse_i log w_ik)``, each
    iteration within :func:`refattn.bounds.mixture_bound` (n = L + S, value scale 2).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> queries = np.array([[0.0], [0.0], [5.0]]); keys = np.array([[0.0], [5.0]])
    >>> gmm.adapt_priors(queries, keys, alpha=100.0, eta=0.0, pi0=np.array([0.5, 0.5])).round(
    ...     6).tolist()
    [0.666667, 0.333333]
    """
    precision = _checks.precision(precision)
    m, pi0, eta_kind, eta_value, form, iters = priors_problem(
        queries, keys, alpha, eta, pi0, iters, form
    )
    if precision == "float64":
        return priors_states64(widened(m), pi0, eta_kind, eta_value, form, iters)[0][-1]
    return exact.adapt_priors(
        m, pi0, eta_kind, eta_value, form, iters, _checks.out_dtype(out_dtype)
    )


def priors_problem(queries, keys, alpha, eta, pi0, iters, form):
    """Validated (model, pi0, eta kind, eta value, form, iters) of :func:`adapt_priors`."""
    form = _checks.choice(form, "form", PRIOR_FORMS)
    m = build_model(
        queries, keys, None, alpha, 0.0, "uniform", need_values=False, names=("queries", "keys")
    )
    iters = iteration_count(iters)
    pi0 = _check_pi0(pi0, m.keys.shape[:-2], m.keys.shape[-2])
    eta_kind, eta_value = _check_eta(eta, pi0)
    return m, pi0, eta_kind, eta_value, form, iters
