"""Gaussian-mixture attention (:func:`attention`) and its objective (:func:`log_posterior`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _checks
from ..exact import gmm as exact
from ._float64 import attention64, log_posterior64, query_logits64, widened
from ._model import ATTENTION_FORMS, BACKENDS, allowed_set, build_model, iteration_count


class GMMResult(NamedTuple):
    """Result of :func:`attention` with ``return_trace=True``.

    values : (..., L, E) the final value estimates v_T.
    trace : (..., L, iters) log p(v_t | q) after iteration t (NaN after a row stopped on tol).
    iterations : (..., L) int, iterations performed per row.
    """

    values: np.ndarray
    trace: np.ndarray
    iterations: np.ndarray


# --------------------------------------------------------------------------------------------


def attention_problem(
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
):
    """The checked arguments of :func:`attention` and :func:`attention_vjp`: (the model with
    its allowed set, v_init broadcast to (B..., L, E) or None, the iteration count)."""
    m = build_model(q, keys, values, alpha, beta, prior)
    m = m._replace(
        form=_checks.choice(form, "form", ATTENTION_FORMS),
        empty_rows=_checks.choice(empty_rows, "empty_rows", ("zero", "nan")),
    )
    m = m._replace(allowed=allowed_set(m, mask, causal, window, align))
    if v_init is not None:
        v_init = _checks.finite_array(v_init, "v_init", 2)
        want = m.q.shape[:-1] + (m.values.shape[-1],)
        v_init = _checks.broadcast(v_init, want, "v_init", "(..., L, E)")
    return m, v_init, iteration_count(iters)


def attention(
    q,
    keys,
    values,
    *,
    alpha,
    beta=0.0,
    prior="uniform",
    v_init=None,
    iters=1,
    tol=None,
    return_trace=False,
    form="paper",
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    empty_rows="zero",
    precision="float64",
    out_dtype=None,
    backend="numpy",
):
    """Gaussian-mixture attention: MAP value inference by EM (Movellan & Gabbur eqs. (13)-(14)).

    For each query q_i the value estimate is refined ``iters`` times by

    .. math::

        v_{t+1} = \\sum_u w_u \\mu_u \\quad (13), \\qquad
        w_u \\propto p(u)\\, e^{-\\frac{\\alpha_u}{2}\\|q - \\xi_u\\|^2}
                 e^{-\\frac{\\beta_u}{2}\\|v_t - \\mu_u\\|^2}\\,
                 \\alpha_u^{D/2} \\beta_u^{E/2} \\quad (14),

    the normalisers alpha_u^(D/2) beta_u^(E/2) (eqs. (7)-(8)) cancelling when the precisions
    are equal across units, which is the paper's case. With per-unit beta the M-step is the
    root of eq. (12), ``beta_u`` inside the sum:
    ``v_{t+1} = sum_u w_u beta_u mu_u / sum_u w_u beta_u`` (eq. (13) needs equal beta; the
    unweighted mean would not be an EM step and can decrease log p(v | q)).
    With ``prior="magnitude"`` (eqs. (15)-(16)) the weights take the inner-product form
    ``w_u ∝ exp(alpha xi_u.q + beta mu_u.v_t)`` (eqs. (17)-(18)) and beta = 0 gives softmax
    attention with scale alpha (eqs. (19)-(20)).

    Parameters
    ----------
    q : array (..., L, D)
        Queries.
    keys : array (..., S, D)
        Unit keys xi_u.
    values : array (..., S, E)
        Expected values mu_u.
    alpha : float or array (..., S)
        Query precisions alpha_u > 0 (eq. (7)).
    beta : float or array (..., S)
        Value precisions beta_u >= 0 (eq. (8)); per-unit values that differ must be > 0.
    prior : {"uniform", "magnitude"} or array (..., S)
        p(u): uniform; eq. (15) ``p(u) ∝ exp(alpha_u ||xi_u||^2/2 + beta_u ||mu_u||^2/2)``; or
        an array of log p(u) (normalisation not needed: the posterior does not depend on it;
        -inf excludes a unit).
    v_init : array (..., L, E), optional
        v_0. None (default): the first E-step has **no value-likelihood term**:
        w_u = p(u | q), the value likelihood marginalised out. The first iterate is then
        plain softmax attention for the uniform prior (Gaussian scores) and for
        ``prior="magnitude"`` with beta = 0 (eq. (20)); with ``prior="magnitude"`` and
        beta > 0 the prior's ``beta_u ||mu_u||^2 / 2`` (eq. (15)) still weights the units, so
        it is not.
    iters : int >= 1
        EM iterations (the maximum when ``tol`` is given).
    tol : float, optional
        float64 path only: a row stops once ``max_e |v_{t+1} - v_t| <= tol`` (its later trace
        entries are NaN). Each row stops on its own residual, never on a batch-global one.
    return_trace : bool
        Also return log p(v_t | q) after every iteration (needs beta > 0; see
        :func:`log_posterior`), as a :class:`GMMResult`. The trace is the model's normalised
        density whatever ``form``; NaN on empty rows.
    form : {"paper", "unnormalised"}
        "paper" (default): as above. "unnormalised": the public code's reading
        (apple/ml-probabilistic-attention, ``probabilisticattention.py``): the E-step leaves
        out ``(D/2) log alpha_u`` and ``(E/2) log beta_u`` and the M-step is the plain mean
        ``v = sum_u w_u mu_u`` even for per-unit beta (that code runs one E/M step:
        ``iters=1``). Identical to "paper" when alpha and beta are equal across units.
    mask : bool array broadcastable to (..., L, S), optional
        True = query i may attend unit u (as :func:`refattn.attention`).
    causal : bool
        Allow only ``u <= i + o``.
    window : (left, right) or None
        Allow only ``i + o - left <= u <= i + o + right``.
    align : {"top_left", "bottom_right"}
        Offset o = 0 or S - L (:func:`refattn.masks.offset_of`).
    empty_rows : {"zero", "nan"}
        Rows with no allowed unit (mask, window, or a -inf prior on every allowed unit):
        values 0 or NaN (trace NaN).
    precision : {"float64", "exact"}
    out_dtype : dtype, optional
        Exact path: float64 (default), float32, float16, bfloat16.
    backend : {"numpy", "numba"}
        float64 path only (unmasked, paper form): "numba" runs the deterministic kernel
        :func:`refattn.kernels.variants.gmm_attention` (same operations, sequential sums;
        within the same error bound, bit-identical for any thread count).

    Returns
    -------
    values (..., L, E), or GMMResult(values, trace (..., L, iters), iterations (..., L)).

    Notes
    -----
    The exact path returns the exact value of ``iters`` EM iterations (not of the fixed
    point), every element rounded once. EM never decreases log p(v_t | q) (eq. (3): Dempster,
    Laird & Rubin), so the trace is non-decreasing from t = 1 on (and from t = 0 when v_init is
    given). The float64 path forms every weight as ``exp(logit - lse)`` with a max-shifted lse,
    so no weight underflows to 0/0 however negative the logits are; its error is bounded
    by :func:`refattn.bounds.mixture_bound`.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> q = np.array([[0.0, 1.0]]); keys = np.array([[0.0, 1.0], [1.0, 0.0]])
    >>> values = np.array([[1.0], [0.0]])
    >>> gmm.attention(q, keys, values, alpha=1.0).round(6).tolist()
    [[0.731059]]
    """
    precision = _checks.precision(precision)
    if _checks.choice(backend, "backend", BACKENDS) == "numba" and precision != "float64":
        raise ValueError(
            "backend: 'numba' runs the float64 path only; pass "
            "precision='float64' or backend='numpy'"
        )
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
    tol = _checks.iteration_tol(tol, precision, "`iters` iterations")
    if return_trace and (m.beta == 0).any():
        raise ValueError(
            "return_trace: log p(v | q) needs beta > 0 (beta = 0 makes p(v | u) "
            "improper); pass beta > 0 or return_trace=False"
        )
    if backend == "numba" and (
        m.allowed is not None or m.form != "paper" or m.empty_rows != "zero"
    ):
        raise ValueError(
            "backend: 'numba' runs the unmasked paper form only; pass "
            "backend='numpy' for mask/causal/window, form or empty_rows"
        )
    if precision == "float64":
        m = widened(m)
    if precision == "float64" and backend == "numba":
        from ..kernels import announce_compile, variants
        from ..kernels.variants import gmm_attention

        announce_compile(variants, names="gmm")
        v, trace, done = gmm_attention(m, v_init, iters, tol, return_trace)
        return GMMResult(v, trace, done) if return_trace else v
    if precision == "float64":
        v, trace, done = attention64(m, v_init, iters, tol, return_trace)
        return GMMResult(v, trace, done) if return_trace else v
    values_out, trace = exact.attention(
        m, v_init, iters, return_trace, _checks.out_dtype(out_dtype)
    )
    if not return_trace:
        return values_out
    return GMMResult(values_out, trace, np.full(trace.shape[:-1], iters, dtype=np.int64))


def log_posterior(
    v, q, keys, values, *, alpha, beta, prior="uniform", precision="float64", out_dtype=None
):
    """log p(v | q) of the Gaussian mixture, eqs. (1), (6)-(8), (15)-(16); the EM objective.

    .. math::

        \\log p(v \\mid q) = \\log \\sum_u p(u) p(q|u) p(v|u) - \\log \\sum_u p(u) p(q|u)

    The stated constant is zero: this is the normalised density of v (including
    ``-(E/2) log 2 pi`` and ``(E/2) log beta_u``). It does not depend on the normalisation of
    p(u) or on the query normaliser, which cancel.

    Parameters
    ----------
    v : array (..., L, E)
    q, keys, values, alpha, prior : as :func:`attention`.
    beta : float or array (..., S), > 0
    precision, out_dtype : as :func:`attention`.

    Returns
    -------
    array (..., L)

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> one = np.ones((1, 1))
    >>> round(float(gmm.log_posterior(one, one, one, one, alpha=1.0, beta=1.0)[0]), 6)
    -0.918939
    """
    precision = _checks.precision(precision)
    m = build_model(q, keys, values, alpha, beta, prior)
    if (m.beta == 0).any():
        raise ValueError("beta: log p(v | q) needs beta > 0 (beta = 0 is improper)")
    v = _checks.finite_array(v, "v", 2)
    v = _checks.broadcast(v, m.q.shape[:-1] + (m.values.shape[-1],), "v", "(..., L, E)")
    if precision == "float64":
        m = widened(m)
        return log_posterior64(m, query_logits64(m, m.q, m.keys), _checks.as_float64(v))
    return exact.log_posterior(m, v, _checks.out_dtype(out_dtype))
