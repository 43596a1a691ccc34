"""Transformer-MGK attention (:func:`attention`) and its vector-Jacobian product: Gaussian
mixture keys, scores in log-space."""

from __future__ import annotations

import math

import numpy as np

from .. import _checks
from ..broadcast import reduce_to
from ..exact import mgk as exact
from ..logspace import logsumexp, softmax
from ._inputs import (
    BACKENDS,
    MODES,
    MGKGrads,
    allowed_set,
    cotangent,
    finite,
    gaussian_problem,
)


def component_terms64(q, keys, log_pi, sigma2, sigma_varies, mode, normalized):
    """Per-component log terms (..., L, S, R), up to terms constant over (j, r)."""
    diff = q[..., :, None, None, :] - keys[..., None, :, :, :]
    with np.errstate(over="ignore"):  # beyond the range: -inf terms weigh 0 (see the notes)
        terms = -np.einsum("...lsrd,...lsrd->...lsr", diff, diff) / (2 * sigma2[..., None, :, :])
    if mode == "soft":
        terms = terms + log_pi[..., None, :, :]
    if normalized and sigma_varies:
        terms = terms - q.shape[-1] / 2 * np.log(2 * math.pi * sigma2[..., None, :, :])
    return terms


def _scores64(terms, mode):
    if mode == "hard":
        return terms.max(axis=-1)
    return logsumexp(terms, axis=-1, where=~np.isneginf(terms))


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _row_poisoned(q, keys, v, allowed):
    """(..., L): rows with a non-finite q, or a non-finite allowed key/value."""
    bad_key = ~np.isfinite(keys).all(axis=(-1, -2))  # (..., S)
    bad = bad_key
    if v is not None:
        bad = bad | ~np.isfinite(v).all(axis=-1)
    return ~np.isfinite(q).all(axis=-1) | (allowed & bad[..., None, :]).any(axis=-1)


def _clean(x):
    return np.where(np.isfinite(x), x, 0.0)


def attention(
    q,
    keys,
    v,
    *,
    log_pi=None,
    sigma2=1.0,
    mode="soft",
    normalized=False,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    row_eps=0.0,
    pi_form="distribution",
    precision="float64",
    out_dtype=None,
    backend="numpy",
):
    """Transformer-MGK attention (Nguyen et al. 2022; notes (N6)-(N7), hard form (N9)).

    .. math::

        h_i = \\sum_j \\frac{e^{s_{ij}}}{\\sum_{j' \\in A_i} e^{s_{ij'}}} v_j,\\qquad
        s_{ij} = \\log \\sum_r \\pi_{jr}\\,
            e^{-\\|q_i - k_{jr}\\|^2 / (2\\sigma^2_{jr})}

    (soft; the exponent's minus sign is pinned, the notes omit it), ``s_ij = max_r(-||q_i -
    k_jr||^2 / (2 sigma2_jr))`` for ``mode="hard"`` (pi ignored, as the notes' (N9) says).
    ``normalized=True`` adds the Gaussian constant ``-(D/2) log(2 pi sigma2_jr)`` to every
    component (it cancels in the softmax unless sigma2 differs between components).

    Parameters
    ----------
    q : array (..., L, D)
    keys : array (..., S, R, D)
        R Gaussian means per key position.
    v : array (..., S, E)
    log_pi : array (..., S, R), optional
        Log mixture weights; each key's must be a distribution (logsumexp over R equal to 0
        within R+2 roundings of its dtype; used as given). Default uniform, -log R. -inf turns
        a component off.
    sigma2 : float or array (..., S, R), > 0
    mode : {"soft", "hard"}
    normalized : bool
    mask, causal, window, align
        The allowed set, exactly as :func:`refattn.attention` (:func:`refattn.masks.allowed_mask`);
        excluded positions are removed from every sum. A row with no allowed key gives 0.
        A NaN/Inf in an excluded key or value never reaches the output; one in an allowed key,
        value, or in q makes the row NaN.
    row_eps : float >= 0
        Adds ``row_eps`` to the row normaliser: ``P_ij = e^{s_ij} / (sum_{j' in A_i}
        e^{s_ij'} + row_eps)`` (weights then sum to less than 1 and the scores' absolute level
        matters). Default 0 (refattn's reading: the posterior (N2)). ``row_eps=1e-6`` is the
        public language-modelling code's soft MGK (repository minhtannguyen/transformer-mgk,
        file language-modeling/lmtool-fwms/src/mem_transformer.py, class MGKAttn), which adds
        1e-6 to the row sum of ``sum_r pi exp(.)``: every weight of row i shrinks by the
        factor ``Z_i / (Z_i + row_eps)``, ``Z_i = sum_j e^{s_ij}`` (about 9% at Z_i = 1e-5).
        Evaluated in log-space as ``exp(s_ij - logaddexp(lse_j s_ij, log row_eps))``.
    pi_form : {"distribution", "free"}
        "distribution" (default): each key's weights pi_jr must sum to 1 (the mixture of
        (N4)). "free": any non-negative weights (log_pi any real or -inf), used as given --
        the public code's ``update_mode="rbf2keys"`` (same file, class MGKAttn), which learns
        pi_0 and pi_1 of every key position as independent parameters and clamps each to [0,
        1] without normalising; that is the configuration the repository trains. With
        ``log_pi = log(clip([pi0, pi1], 0, 1))``, ``sigma2 = (sqrt(D), sqrt(D) / 3)``,
        ``normalized=False``, ``row_eps=1e-6``, ``causal=True, align="bottom_right"`` (the
        memory precedes the segment) it reproduces that attention within 4e-16 relative
        (tests/concepts/test_mgk_public.py); renormalising pi instead moves the output by
        0.08-0.17 relative (D = 16, input scales 0.5-1).
    precision : {"float64", "exact"}
    out_dtype : dtype, optional (exact path)
    backend : {"numpy", "numba"}
        float64 path only (and ``row_eps=0``): "numba" runs the deterministic streaming kernel
        :func:`refattn.kernels.variants.mgk_attention` (no (L, S, R) array; same operations,
        sequential sums; within the same error bound, bit-identical for any thread count).

    Returns
    -------
    array (..., L, E)

    Notes
    -----
    float64 error: every component term is a sum of D + 3 roundings, so with ``T`` the largest
    sum of absolute terms of a score, ``|out - exact| <= max|v| (4 gamma_{D+2} T +
    gamma_{3SR+10})`` to first order (:func:`refattn.bounds.mixture_bound` with n = S R).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import mgk
    >>> q = np.zeros((1, 1)); keys = np.array([[[0.0]], [[2.0]]]); v = np.array([[1.0], [0.0]])
    >>> mgk.attention(q, keys, v, sigma2=1.0).round(6).tolist()  # weights 1 : e^-2
    [[0.880797]]
    """
    precision = _checks.precision(precision)
    mode = _checks.choice(mode, "mode", MODES)
    row_eps = _row_eps(row_eps)
    if _checks.choice(backend, "backend", BACKENDS) == "numba" and precision != "float64":
        raise ValueError(
            "backend: 'numba' runs the float64 path only; pass "
            "precision='float64' or backend='numpy'"
        )
    if backend == "numba" and row_eps:
        raise ValueError(
            "backend: the numba kernel has no row_eps; pass row_eps=0 or backend='numpy'"
        )
    q, keys, v, batch, sigma2, sigma_varies, log_pi = gaussian_problem(
        q, keys, v, sigma2, log_pi, pi_form
    )
    if backend == "numba":
        from ..kernels import announce_compile, variants
        from ..kernels.variants import mgk_attention

        announce_compile(variants, names="mgk")
        return mgk_attention(
            q,
            keys,
            v,
            log_pi=log_pi,
            sigma2=sigma2,
            sigma_varies=sigma_varies,
            mode=mode,
            normalized=normalized,
            mask=mask,
            causal=causal,
            window=window,
            align=align,
        )
    length, units = q.shape[-2], keys.shape[-3]
    allowed = allowed_set(length, units, batch, mask, causal, window, align)
    q64, keys64, v64 = (_checks.as_float64(a) for a in (q, keys, v))
    poisoned = _row_poisoned(q64, keys64, v64, allowed)
    if precision == "float64":
        terms = component_terms64(
            _clean(q64), _clean(keys64), log_pi, sigma2, sigma_varies, mode, normalized
        )
        scores = _scores64(terms, mode)
        weights = guarded_softmax64(scores, allowed & ~np.isneginf(scores), row_eps)
        out = weights @ _clean(v64)
        return np.where(poisoned[..., None], np.nan, out)

    return exact.attention(
        q,
        _clean(keys64),
        v,
        log_pi,
        sigma2,
        sigma_varies,
        mode,
        normalized,
        allowed,
        poisoned,
        row_eps,
        _checks.out_dtype(out_dtype),
    )


def _hard_share(terms, scores):
    """d max_r / d t_r: 1/n on the n components attaining the max (ties split equally)."""
    top = (terms == scores[..., None]) & ~np.isneginf(terms)
    return top / np.maximum(top.sum(axis=-1, keepdims=True), 1)


def _softmax_backward(weights, dweights):
    """dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik) (also right with row_eps: d/ds_k of the
    normaliser Z + eps is e^{s_k})."""
    return weights * (dweights - (weights * dweights).sum(axis=-1, keepdims=True))


def attention_vjp(
    q,
    keys,
    v,
    grad_out,
    *,
    log_pi=None,
    sigma2=1.0,
    mode="soft",
    normalized=False,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    row_eps=0.0,
    pi_form="distribution",
    precision="float64",
    out_dtype=None,
):
    """Vector-Jacobian product of :func:`attention` with respect to q, keys and v.

    With ``P_ij`` the weights, ``rho_ijr = d s_ij / d t_ijr`` (soft: ``exp(t_ijr - s_ij)``,
    the component's share of key j's score; hard: see below) and ``t_ijr = ... - ||q_i -
    k_jr||^2 / (2 sigma2_jr)`` the component terms of (N6):

    .. math::

        dP_{ij} = \\bar h_i \\cdot v_j,\\quad
        dS_{ij} = P_{ij}\\big(dP_{ij} - \\textstyle\\sum_k P_{ik} dP_{ik}\\big),\\quad
        dt_{ijr} = dS_{ij}\\,\\rho_{ijr},

        \\bar q_i = -\\sum_{j,r} dt_{ijr} \\frac{q_i - k_{jr}}{\\sigma^2_{jr}},\\quad
        \\bar k_{jr} = \\sum_i dt_{ijr} \\frac{q_i - k_{jr}}{\\sigma^2_{jr}},\\quad
        \\bar v_j = \\sum_i P_{ij} \\bar h_i .

    **Hard mode at ties.** ``max_r`` is not differentiable where two components tie; refattn
    takes the subgradient that splits ``dS_ij`` equally over the n components attaining the
    max (``rho = 1/n`` on them, 0 elsewhere): the limit of the soft derivative as the
    temperature goes to 0, and independent of the components' order. Ties are exact
    comparisons of the exact terms on the exact path and of the computed terms in float64.

    Parameters
    ----------
    q, keys, v
        As :func:`attention` (finite values).
    grad_out : array (..., L, E)
        The cotangent of the output.
    log_pi, sigma2, mode, normalized, mask, causal, window, align, row_eps, pi_form
        As :func:`attention`; log_pi and sigma2 are constants here (no gradient).
    precision : {"float64", "exact"}
        "exact": every element the exact derivative, rounded once to out_dtype (rigorous
        enclosures and the Ziv loop, :mod:`refattn.exact.mgk`).
    out_dtype : dtype, optional (exact path)

    Returns
    -------
    MGKGrads(dq (..., L, D), dkeys (..., S, R, D), dv (..., S, E)), each summed back to its
    argument's shape where the batch dimensions broadcast.

    Notes
    -----
    float64 path: the analytic backward above in NumPy from log-space weights (no
    exponential of an unshifted score). First-order error bound per element:
    :func:`refattn.bounds.mgk_vjp_bound` (for ``row_eps=0``; in hard mode where the float64
    tie sets equal the exact ones).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import mgk
    >>> q = np.zeros((1, 1)); keys = np.array([[[0.0]], [[2.0]]]); v = np.array([[1.0], [0.0]])
    >>> g = mgk.attention_vjp(q, keys, v, np.ones((1, 1)))
    >>> [round(x, 6) for x in g.dv.ravel().tolist()]
    [0.880797, 0.119203]
    """
    precision = _checks.precision(precision)
    mode = _checks.choice(mode, "mode", MODES)
    row_eps = _row_eps(row_eps)
    shapes = tuple(np.shape(a) for a in (q, keys, v))
    q, keys, v, batch, sigma2, sigma_varies, log_pi = gaussian_problem(
        q, keys, v, sigma2, log_pi, pi_form
    )
    finite("the vjp expects finite values", ("q", q), ("keys", keys), ("v", v))
    go = cotangent(grad_out, q, v, batch)
    length, units = q.shape[-2], keys.shape[-3]
    allowed = allowed_set(length, units, batch, mask, causal, window, align)
    if precision == "exact":
        grads = exact.attention_vjp(
            q,
            keys,
            v,
            go,
            log_pi,
            sigma2,
            sigma_varies,
            mode,
            normalized,
            allowed,
            row_eps,
            _checks.out_dtype(out_dtype),
            shapes,
        )
    else:
        grads = _attention_vjp64(
            *(_checks.as_float64(a) for a in (q, keys, v, go)),
            log_pi,
            sigma2,
            sigma_varies,
            mode,
            normalized,
            allowed,
            row_eps,
        )
    return MGKGrads(*(reduce_to(g, shape) for g, shape in zip(grads, shapes, strict=True)))


def _attention_vjp64(
    q, keys, v, go, log_pi, sigma2, sigma_varies, mode, normalized, allowed, row_eps
):
    terms = component_terms64(q, keys, log_pi, sigma2, sigma_varies, mode, normalized)
    scores = _scores64(terms, mode)
    where = allowed & ~np.isneginf(scores)
    weights = guarded_softmax64(scores, where, row_eps)
    if mode == "soft":
        with np.errstate(invalid="ignore"):
            share = np.where(
                np.isneginf(terms) | ~where[..., None],
                0.0,
                np.exp(terms - np.where(where, scores, 0.0)[..., None]),
            )
    else:
        share = _hard_share(terms, scores) * where[..., None]
    dscores = _softmax_backward(weights, go @ np.swapaxes(v, -1, -2))
    coef = dscores[..., None] * share / sigma2[..., None, :, :]  # (..., L, S, R)
    diff = q[..., :, None, None, :] - keys[..., None, :, :, :]
    dq = -np.einsum("...lsr,...lsrd->...ld", coef, diff)
    dkeys = np.einsum("...lsr,...lsrd->...srd", coef, diff)
    dv = np.swapaxes(weights, -1, -2) @ go
    return dq, dkeys, dv


def _row_eps(row_eps):
    row_eps = _checks.real_scalar(row_eps, "row_eps")
    if row_eps < 0:
        raise ValueError(f"row_eps: expected a number >= 0, got {row_eps!r}")
    return row_eps


def guarded_softmax64(scores, where, row_eps):
    """softmax_j(s_ij) over ``where``; with ``row_eps`` > 0 the normaliser gains row_eps."""
    if not row_eps:
        return softmax(scores, axis=-1, where=where)
    lse = logsumexp(scores, axis=-1, where=where)
    log_den = np.logaddexp(lse, math.log(row_eps))[..., None]
    return np.where(where, np.exp(np.where(where, scores, 0.0) - log_den), 0.0)
