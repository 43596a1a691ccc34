"""Transformer-MGK and Transformer-MLK: attention with a mixture of Gaussian keys per position.

Nguyen, Nguyen, Le, Nguyen, Tran, Baraniuk, Ho & Osher, "Improving Transformers with
Probabilistic Attention Keys", ICML 2022 (seed 001, a set of notes on the paper). The notes
number no equation; refattn cites their displays in order of appearance:

* (N1) the mixture ``p(q_i) = sum_j pi_j N(q_i | k_j, sigma^2 I)``;
* (N2) the posterior ``p(t_j = 1 | q_i)`` (the attention weight);
* (N3) its normalised-inner-product form; (N4) the per-key mixture over components r;
* (N5) the MGK posterior in inner-product form, (N6) its Gaussian-kernel relaxation;
* (N7) the MGK output ``h_i = sum_j P(t_j = 1 | q_i) v_j``;
* (N8) the E-step, (N9) the hard (max) assignment.

**Sign pinned.** The notes print the MGK exponents as ``exp(||q_i - k_jr||^2 / 2 sigma^2)``
without the minus sign (N6)-(N9). A Gaussian density ``N(q | k, sigma^2)`` has
``exp(-||q - k||^2 / (2 sigma^2))`` and that is what refattn computes; the printed sign would make
far keys win. Scores are log-space throughout:

.. math::

    s_{ij} = \\operatorname{lse}_r\\Big(\\log \\pi_{jr}
              - \\frac{\\|q_i - k_{jr}\\|^2}{2\\sigma^2_{jr}}\\Big) \\ \\text{(soft)},\\qquad
    s_{ij} = \\max_r\\Big(- \\frac{\\|q_i - k_{jr}\\|^2}{2\\sigma^2_{jr}}\\Big) \\ \\text{(hard)},

then ``h_i = sum_j softmax_j(s_ij) v_j`` over the allowed keys. The public transformer-mgk code
forms ``sum_r pi exp(.)`` directly and returns 0/0 = NaN (or 0) once every exponential of a row
underflows; here every exponential is of a max-shifted score.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import _checks
from .broadcast import reduce_to
from .exact import mgk as exact
from .logspace import log_softmax, logsumexp, softmax
from .masks import allowed_mask

__all__ = [
    "attention",
    "attention_vjp",
    "em_update_pi",
    "linear_attention",
    "linear_attention_vjp",
    "EMResult",
    "MGKGrads",
    "MODES",
    "FEATURE_MAPS",
    "MLK_FORMS",
    "PI_UPDATES",
    "LM_EPS",
]

MODES = ("soft", "hard")
BACKENDS = ("numpy", "numba")
FEATURE_MAPS = ("elu+1",)
#: ``linear_attention(mlk_form=...)``: refattn's mixture of kernels, and the two readings of
#: the public transformer-mgk code (see :func:`linear_attention`).
MLK_FORMS = ("mixture", "lra", "lm")
#: ``em_update_pi(pi_update=...)``: refattn's joint responsibilities, or the public code's
#: per-key average (see :func:`em_update_pi`).
PI_UPDATES = ("joint", "per_key")
#: The constant the public language-modelling code adds to the MLK denominator
#: (``mlk_form="lm"``), taken at its float64 value.
LM_EPS = exact.LM_EPS


class MGKGrads(NamedTuple):
    """Result of :func:`attention_vjp` and :func:`linear_attention_vjp`.

    dq : (..., L, D), dkeys : (..., S, R, D), dv : (..., S, E), each in its argument's shape.
    """

    dq: np.ndarray
    dkeys: np.ndarray
    dv: np.ndarray


class EMResult(NamedTuple):
    """Result of :func:`em_update_pi`.

    pi : (..., S, R) the updated mixture weights.
    responsibilities : (..., L, S, R) p(t_j = 1, z_r = 1 | q_i) (0 at excluded (i, j)).
    """

    pi: np.ndarray
    responsibilities: np.ndarray


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _inputs(q, keys, v):
    q = _checks.float_array(q, "q", ndim_min=2)
    keys = _checks.float_array(keys, "keys", ndim_min=3)
    if keys.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"keys: expected shape (..., S, R, D) with D = {q.shape[-1]} (as q "
            f"{q.shape}), got {keys.shape}"
        )
    arrays = [q.shape[:-2], keys.shape[:-3]]
    if v is not None:
        v = _checks.float_array(v, "v", ndim_min=2)
        if v.shape[-2] != keys.shape[-3]:
            raise ValueError(
                f"v: expected S = {keys.shape[-3]} rows (as keys {keys.shape}), got shape {v.shape}"
            )
        arrays.append(v.shape[:-2])
    try:
        batch = np.broadcast_shapes(*arrays)
    except ValueError:
        raise ValueError(
            f"leading (batch) dimensions do not broadcast: q {q.shape}, keys {keys.shape}"
            + ("" if v is None else f", v {v.shape}")
        ) from None
    q = np.broadcast_to(q, batch + q.shape[-2:])
    keys = np.broadcast_to(keys, batch + keys.shape[-3:])
    if v is not None:
        v = np.broadcast_to(v, batch + v.shape[-2:])
    return q, keys, v, batch


def _sigma2(sigma2, shape):
    """(array float64 broadcast to (..., S, R), varies over (S, R))."""
    if np.ndim(sigma2) == 0 and not isinstance(sigma2, np.ndarray):
        wide = np.asarray(_checks.real_scalar(sigma2, "sigma2"))
    else:
        wide = _checks.as_float64(_checks.float_array(sigma2, "sigma2"))
    if not np.isfinite(wide).all() or (wide <= 0).any():
        raise ValueError(
            f"sigma2: expected finite variances > 0, got min "
            f"{np.nanmin(wide)!r} (shape {wide.shape})"
        )
    wide = _checks.broadcast(wide, shape, "sigma2", "(..., S, R)")
    flat = wide.reshape(shape[:-2] + (-1,))
    return wide, bool(flat.shape[-1] > 1 and (flat != flat[..., :1]).any())


def _distribution_slack(dtype, count):
    """Tolerance on sum(pi) = 1: ``count`` roundings of the input's own format."""
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7}.get(np.dtype(dtype).name)
    return count * (eps if eps is not None else float(np.finfo(dtype).eps))


def _log_pi(log_pi, shape):
    """log pi_jr, broadcast to (..., S, R); each key's mixture must be a distribution."""
    components = shape[-1]
    if log_pi is None:
        return np.full(shape, -math.log(components)), np.float64
    arr = _checks.float_array(log_pi, "log_pi", ndim_min=2)
    wide = _checks.as_float64(arr)
    if np.isnan(wide).any() or np.isposinf(wide).any():
        raise ValueError(
            f"log_pi: NaN or +inf found (shape {wide.shape}); expected log mixture weights"
        )
    wide = _checks.broadcast(wide, shape, "log_pi", "(..., S, R)")
    totals = logsumexp(wide, axis=-1)
    slack = _distribution_slack(arr.dtype, components + 2)
    if not (np.abs(totals) <= slack).all():
        worst = totals.ravel()[np.argmax(np.abs(totals).ravel())]
        raise ValueError(
            f"log_pi: each key's weights must be a distribution over R = "
            f"{components} components (logsumexp 0 within {slack:.3g}); got a "
            f"logsumexp of {worst!r}"
        )
    return wide, arr.dtype


def _pi(pi, shape, distribution=True):
    arr = _checks.float_array(pi, "pi", ndim_min=2)
    wide = _checks.as_float64(arr)
    if not np.isfinite(wide).all() or (wide < 0).any():
        raise ValueError(f"pi: expected mixture weights >= 0 and finite (shape {wide.shape})")
    wide = _checks.broadcast(wide, shape, "pi", "(..., S, R)")
    if not distribution:
        return wide
    sums = wide.sum(axis=-1)
    slack = _distribution_slack(arr.dtype, shape[-1] + 1)
    if not (np.abs(sums - 1) <= slack).all():
        worst = sums.ravel()[np.argmax(np.abs(sums - 1).ravel())]
        raise ValueError(
            f"pi: each key's weights must sum to 1 over R = {shape[-1]} "
            f"components (within {slack:.3g}); got a sum of {worst!r}"
        )
    return wide


# --------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------


def _component_terms64(q, keys, log_pi, sigma2, sigma_varies, mode, normalized):
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
    if v is None:
        raise TypeError("v: expected a float array (..., S, E), got None")
    q, keys, v, batch = _inputs(q, keys, v)
    comp_shape = batch + keys.shape[-3:-1]
    sigma2, sigma_varies = _sigma2(sigma2, comp_shape)
    log_pi, _ = _log_pi(log_pi, comp_shape)
    if backend == "numba":
        from .kernels import announce_compile, variants
        from .kernels.variants import mgk_attention

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
    allowed = _checks.broadcast(
        allowed_mask(length, units, mask=mask, causal=causal, window=window, align=align),
        batch + (length, units),
        "mask",
        "(..., L, S) of q and keys",
    )
    q64, keys64, v64 = (_checks.as_float64(a) for a in (q, keys, v))
    poisoned = _row_poisoned(q64, keys64, v64, allowed)
    if precision == "float64":
        terms = _component_terms64(
            _clean(q64), _clean(keys64), log_pi, sigma2, sigma_varies, mode, normalized
        )
        scores = _scores64(terms, mode)
        weights = _weights64(scores, allowed & ~np.isneginf(scores), row_eps)
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


def _vjp_inputs(q, keys, v, grad_out):
    """Validated (q, keys, v, batch, grad_out broadcast to (..., L, E)); all finite."""
    if v is None:
        raise TypeError("v: expected a float array (..., S, E), got None")
    q, keys, v, batch = _inputs(q, keys, v)
    go = _checks.float_array(grad_out, "grad_out", ndim_min=2)
    go = _checks.broadcast(go, batch + (q.shape[-2], v.shape[-1]), "grad_out", "(..., L, E)")
    for name, arr in (("q", q), ("keys", keys), ("v", v), ("grad_out", go)):
        if not np.isfinite(_checks.as_float64(arr)).all():
            raise ValueError(f"{name}: the vjp expects finite values (shape {arr.shape})")
    return q, keys, v, batch, go


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
    log_pi, sigma2, mode, normalized, mask, causal, window, align, row_eps
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
    q, keys, v, batch, go = _vjp_inputs(q, keys, v, grad_out)
    comp_shape = batch + keys.shape[-3:-1]
    sigma2, sigma_varies = _sigma2(sigma2, comp_shape)
    log_pi, _ = _log_pi(log_pi, comp_shape)
    length, units = q.shape[-2], keys.shape[-3]
    allowed = _checks.broadcast(
        allowed_mask(length, units, mask=mask, causal=causal, window=window, align=align),
        batch + (length, units),
        "mask",
        "(..., L, S) of q and keys",
    )
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
    terms = _component_terms64(q, keys, log_pi, sigma2, sigma_varies, mode, normalized)
    scores = _scores64(terms, mode)
    where = allowed & ~np.isneginf(scores)
    weights = _weights64(scores, where, row_eps)
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


def _weights64(scores, where, row_eps):
    """softmax_j(s_ij) over ``where``; with ``row_eps`` > 0 the normaliser gains row_eps."""
    if not row_eps:
        return softmax(scores, axis=-1, where=where)
    lse = logsumexp(scores, axis=-1, where=where)
    log_den = np.logaddexp(lse, math.log(row_eps))[..., None]
    return np.where(where, np.exp(np.where(where, scores, 0.0) - log_den), 0.0)


def em_update_pi(
    q, keys, *, log_pi, sigma2, mask=None, pi_update="joint", precision="float64", out_dtype=None
):
    """One EM step for the mixture weights pi of Transformer-MGK (notes (N8)).

    E-step: the joint responsibility of key j and its component r for query i (uniform key
    prior, the minus sign of the Gaussian exponent pinned),

    .. math::

        \\rho_{ijr} = p(t_j = 1, z_r = 1 \\mid q_i) =
            \\frac{\\pi_{jr} \\mathcal N(q_i \\mid k_{jr}, \\sigma^2_{jr})}
                 {\\sum_{j' \\in A_i} \\sum_{r'} \\pi_{j'r'}
                  \\mathcal N(q_i \\mid k_{j'r'}, \\sigma^2_{j'r'})};

    (the notes' (N8) prints a sum over r in the numerator and no minus sign; refattn reads it
    as the standard E-step of the two-level mixture, key prior uniform as in (N2)). M-step
    (maximising the expected complete log-likelihood subject to sum_r pi_jr = 1; the notes
    learn pi by gradient descent instead):

    .. math:: \\pi^{new}_{jr} = \\frac{\\sum_i \\rho_{ijr}}{\\sum_i \\sum_{r'} \\rho_{ijr'}} .

    The Gaussian normaliser ``(2 pi sigma2_jr)^(-D/2)`` is included (it is part of N). A key
    that no query may attend (all its (i, j) excluded) keeps its pi.

    Parameters
    ----------
    q : array (..., L, D)
    keys : array (..., S, R, D)
    log_pi : array (..., S, R)
        Current log weights (each key's a distribution).
    sigma2 : float or array (..., S, R), > 0
    mask : bool array broadcastable to (..., L, S), optional
    pi_update : {"joint", "per_key"}
        "joint" (default): the M-step above. "per_key": the public code's update (repository
        minhtannguyen/transformer-mgk, file language-modeling/lmtool-fwms/src/mem_transformer.py,
        class MGKAttn, soft mode), which averages over the queries the *per-key*
        responsibilities ``p(z_r = 1 | t_j = 1, q_i) = softmax_r(log pi_jr + log N(q_i | k_jr,
        sigma2_jr))``: ``pi_jr = mean_{i: (i, j) allowed} p(z_r | t_j, q_i)``. It weighs every
        query equally instead of by ``p(t_j | q_i)`` (the two pi differ by 0.11 on the
        two-query example of tests/concepts/test_mgk_vjp.py). The public code also adds 1e-6 to the
        per-key normaliser, omits the Gaussian normaliser (the same when sigma2 is shared) and
        averages over every query; refattn keeps the normaliser, adds nothing and averages
        over the allowed queries.
    precision, out_dtype : as :func:`attention`.

    Returns
    -------
    EMResult(pi (..., S, R), responsibilities (..., L, S, R)); with ``pi_update="per_key"``
    the responsibilities are the per-key ones ``p(z_r | t_j, q_i)`` (0 at excluded (i, j)).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import mgk
    >>> q = np.array([[0.0], [0.0]]); keys = np.array([[[0.0], [50.0]]])
    >>> res = mgk.em_update_pi(q, keys, log_pi=np.log(np.array([[0.5, 0.5]])), sigma2=1.0)
    >>> res.pi.tolist()
    [[1.0, 0.0]]
    """
    precision = _checks.precision(precision)
    pi_update = _checks.choice(pi_update, "pi_update", PI_UPDATES)
    q, keys, _, batch = _inputs(q, keys, None)
    comp_shape = batch + keys.shape[-3:-1]
    sigma2, sigma_varies = _sigma2(sigma2, comp_shape)
    log_pi, _ = _log_pi(log_pi, comp_shape)
    for name, arr in (("q", q), ("keys", keys)):
        if not np.isfinite(_checks.as_float64(arr)).all():
            raise ValueError(f"{name}: expected finite values (shape {arr.shape})")
    length, units, comps = q.shape[-2], keys.shape[-3], keys.shape[-2]
    allowed = _checks.broadcast(
        allowed_mask(length, units, mask=mask),
        batch + (length, units),
        "mask",
        "(..., L, S) of q and keys",
    )
    if precision == "float64" and pi_update == "per_key":
        terms = _component_terms64(
            _checks.as_float64(q),
            _checks.as_float64(keys),
            log_pi,
            sigma2,
            sigma_varies,
            "soft",
            True,
        )
        resp = softmax(terms, axis=-1, where=~np.isneginf(terms)) * allowed[..., None]
        count = allowed.sum(axis=-2)[..., None]  # (..., S, 1) allowed queries per key
        with np.errstate(invalid="ignore"):
            pi = np.where(count > 0, resp.sum(axis=-3) / np.maximum(count, 1), np.exp(log_pi))
        return EMResult(pi, resp)
    if precision == "float64":
        terms = _component_terms64(
            _checks.as_float64(q),
            _checks.as_float64(keys),
            log_pi,
            sigma2,
            sigma_varies,
            "soft",
            True,
        )
        flat = terms.reshape(terms.shape[:-2] + (-1,))
        where = (np.repeat(allowed, comps, axis=-1)) & ~np.isneginf(flat)
        log_resp = log_softmax(flat, axis=-1, where=where).reshape(terms.shape)
        col = np.moveaxis(log_resp, -3, -1)  # (..., S, R, L)
        log_num = logsumexp(col, axis=-1, where=~np.isneginf(col))  # (..., S, R)
        log_den = logsumexp(log_num, axis=-1, where=~np.isneginf(log_num))  # (..., S)
        keep = np.isneginf(log_den)[..., None]
        with np.errstate(invalid="ignore"):
            pi = np.where(
                keep, np.exp(log_pi), np.exp(log_num - np.where(keep, 0.0, log_den[..., None]))
            )
        return EMResult(pi, np.exp(log_resp))

    return EMResult(
        *exact.em_update_pi(
            q, keys, log_pi, sigma2, sigma_varies, allowed, pi_update, _checks.out_dtype(out_dtype)
        )
    )


def _elu1_64(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _delu1_64(x):
    return np.where(x > 0, 1.0, np.exp(np.minimum(x, 0.0)))


def linear_attention(
    q,
    keys,
    v,
    *,
    pi,
    feature_map="elu+1",
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    mlk_form="mixture",
    precision="float64",
    out_dtype=None,
):
    """Transformer-MLK: linear attention with a mixture of linear keys (Nguyen et al. 2022).

    .. math::

        h_i = \\frac{\\phi(q_i)^\\top \\sum_{j \\in A_i} \\big(\\sum_r \\pi_{jr}
                \\phi(k_{jr})\\big) v_j^\\top}
               {\\phi(q_i)^\\top \\sum_{j \\in A_i} \\sum_r \\pi_{jr} \\phi(k_{jr})},
        \\qquad \\phi(x) = \\operatorname{elu}(x) + 1 .

    The mixture is formed **after** the feature map: MLK replaces each Gaussian kernel of the
    soft MGK posterior (N6) by the linear kernel ``phi(q).phi(k_jr)``, and the mixture of
    kernels ``sum_r pi_jr phi(q).phi(k_jr)`` equals ``phi(q).(sum_r pi_jr phi(k_jr))`` by
    linearity, whereas ``phi(sum_r pi_jr k_jr)`` would be the kernel of a single averaged key
    (phi is not linear).

    Parameters
    ----------
    q : array (..., L, D)
    keys : array (..., S, R, D)
    v : array (..., S, E)
    pi : array (..., S, R)
        Mixture weights (>= 0; with ``mlk_form="mixture"`` each key's summing to 1 within R+1
        roundings of its dtype; the public-code forms take them as given, their code clamps
        to [0, 1] and does not normalise).
    feature_map : {"elu+1"}
    mask, causal, window, align
        The allowed set A_i, exactly as :func:`refattn.attention`
        (:func:`refattn.masks.allowed_mask`); a padding mask is a ``(..., 1, S)`` mask. A row
        with no allowed key gives 0.
    mlk_form : {"mixture", "lra", "lm"}
        "mixture" (default): refattn's reading above. The public transformer-mgk code
        (repository minhtannguyen/transformer-mgk) has two others:

        * "lra" (file lra/attention_linear.py, LinearAttention): the raw keys are mixed
          *before* the feature map, there is no normaliser, and the features are scaled by
          the inverse fourth root of the sequence lengths:
          ``h_i = (L S)^(-1/4) sum_{j in A_i} phi(q_i).phi(sum_r pi_jr k_jr) v_j``;
        * "lm" (file language-modeling/lmtool-fwms/src/mem_transformer.py, the two-key linear
          layers): every feature vector is normalised to sum 1 over d,
          ``phihat(x) = phi(x) / sum_d phi(x)_d``, mixed after the map, the output scaled by
          ``1/sqrt(D)`` and :data:`LM_EPS` added to the denominator:
          ``h_i = D^(-1/2) phihat(q_i).N_i / (phihat(q_i).sum_j m_j + 1e-5)`` with ``m_j =
          sum_r pi_jr phihat(k_jr)``, ``N_i = sum_{j in A_i} m_j v_j^T``.
    precision, out_dtype : as :func:`attention`.

    Returns
    -------
    array (..., L, E). With causal=True, row i equals the non-causal output of row i on the
    prefix q[:i+1], keys[:i+1], v[:i+1] (bit for bit on the exact path).

    Notes
    -----
    float64 error ("mixture"): numerator and denominator are sums of non-negative kernels
    times values, each kernel with relative error gamma_n, n = D + R + S + 4, so the quotient
    (a convex combination of the v_j) errs by at most ``2 gamma_{2n+2} max|v|``
    (:func:`refattn.bounds.ratio_bound`). No bound is stated for the public-code forms.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import mgk
    >>> q = np.zeros((1, 1)); keys = np.array([[[0.0]], [[1.0]]]); v = np.array([[0.0], [3.0]])
    >>> mgk.linear_attention(q, keys, v, pi=np.ones((2, 1))).tolist()  # phi = 1 and 2
    [[2.0]]
    """
    precision = _checks.precision(precision)
    _checks.choice(feature_map, "feature_map", FEATURE_MAPS)
    form = _checks.choice(mlk_form, "mlk_form", MLK_FORMS)
    if v is None:
        raise TypeError("v: expected a float array (..., S, E), got None")
    q, keys, v, batch = _inputs(q, keys, v)
    pi = _pi(pi, batch + keys.shape[-3:-1], form == "mixture")
    for name, arr in (("q", q), ("keys", keys), ("v", v)):
        if not np.isfinite(_checks.as_float64(arr)).all():
            raise ValueError(f"{name}: expected finite values (shape {arr.shape})")
    length, units = q.shape[-2], keys.shape[-3]
    allowed = _checks.broadcast(
        allowed_mask(length, units, mask=mask, causal=causal, window=window, align=align),
        batch + (length, units),
        "mask",
        "(..., L, S) of q and keys",
    )
    if precision == "exact":
        return exact.linear_attention(q, keys, v, pi, allowed, form, _checks.out_dtype(out_dtype))
    q64, keys64, v64 = (_checks.as_float64(a) for a in (q, keys, v))
    if form == "mixture" and mask is None and window is None and align == "top_left":
        return _mixture_prefix64(q64, keys64, v64, pi, causal)
    feats = _features64(q64, keys64, pi, form)
    kernels = np.where(allowed, feats.a @ np.swapaxes(feats.m, -1, -2), 0.0)  # (..., L, S)
    num = kernels @ v64
    if form == "lra":
        return num
    scale, eps = (1 / math.sqrt(q.shape[-1]), LM_EPS) if form == "lm" else (1.0, 0.0)
    den = kernels.sum(axis=-1, keepdims=True) + eps
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, scale * num / den, 0.0)


def _mixture_prefix64(q64, keys64, v64, pi, causal):
    """The default reading without a mask: cumulative sums over keys (no (L, S) array)."""
    length, units = q64.shape[-2], keys64.shape[-3]
    phi_q = _elu1_64(q64)
    mixed = np.einsum("...sr,...srd->...sd", pi, _elu1_64(keys64))
    outer = mixed[..., :, :, None] * v64[..., :, None, :]  # (..., S, D, E)
    if causal:
        states = np.cumsum(outer, axis=-3)
        norms = np.cumsum(mixed, axis=-2)
        last = np.minimum(np.arange(length), units - 1)
        states, norms = states[..., last, :, :], norms[..., last, :]
        num = np.einsum("...ld,...lde->...le", phi_q, states)
        den = np.einsum("...ld,...ld->...l", phi_q, norms)
    else:
        num = phi_q @ outer.sum(axis=-3)
        den = np.einsum("...ld,...d->...l", phi_q, mixed.sum(axis=-2))
    return num / den[..., None]


class _Features64(NamedTuple):
    """Query features a (..., L, D), key features m (..., S, D) and the maps taking their
    cotangents back to q and keys (float64 twin of refattn.exact.mgk's features)."""

    a: np.ndarray
    m: np.ndarray
    back_q: object
    back_k: object


def _features64(q, keys, pi, form):
    length, units = q.shape[-2], keys.shape[-3]
    phi_q, dphi_q = _elu1_64(q), _delu1_64(q)
    if form == "lra":
        cq, ck = length**-0.25, units**-0.25
        mixed = np.einsum("...sr,...srd->...sd", pi, keys)

        def back_k(dm):
            return pi[..., None] * (dm * ck * _delu1_64(mixed))[..., None, :]

        return _Features64(phi_q * cq, _elu1_64(mixed) * ck, lambda da: da * cq * dphi_q, back_k)
    phi_k, dphi_k = _elu1_64(keys), _delu1_64(keys)
    if form == "lm":
        qsum, ksum = phi_q.sum(-1, keepdims=True), phi_k.sum(-1, keepdims=True)
        a, hat_k = phi_q / qsum, phi_k / ksum
    else:
        qsum = ksum = None
        a, hat_k = phi_q, phi_k

    def through_norm(dhat, hat, total):
        if total is None:
            return dhat
        return (dhat - (dhat * hat).sum(-1, keepdims=True)) / total

    def back_q(da):
        return through_norm(da, a, qsum) * dphi_q

    def back_k(dm):
        dhat = pi[..., None] * dm[..., :, None, :]
        return through_norm(dhat, hat_k, ksum) * dphi_k

    return _Features64(a, np.einsum("...sr,...srd->...sd", pi, hat_k), back_q, back_k)


def linear_attention_vjp(
    q,
    keys,
    v,
    grad_out,
    *,
    pi,
    feature_map="elu+1",
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    mlk_form="mixture",
    precision="float64",
    out_dtype=None,
):
    """Vector-Jacobian product of :func:`linear_attention` with respect to q, keys and v.

    With kernels ``kappa_ij = a_i . m_j`` (``a``, ``m`` the query and key features of the
    form), ``h_i = c N_i / (Dn_i + e)``, ``N_i = sum_{j in A_i} kappa_ij v_j``, ``Dn_i =
    sum_{j in A_i} kappa_ij`` (c = 1, e = 0 for "mixture"; D^-1/2 and 1e-5 for "lm"; "lra"
    is ``h_i = N_i``):

    .. math::

        \\bar\\kappa_{ij} = \\frac{c\\,(e\\,\\bar h_i\\cdot v_j + \\sum_k \\kappa_{ik}\\,
            \\bar h_i\\cdot(v_j - v_k))}{(Dn_i + e)^2},\\quad
        \\bar v_j = \\sum_i \\frac{c\\,\\kappa_{ij}}{Dn_i + e} \\bar h_i,\\quad
        \\bar a_i = \\sum_j \\bar\\kappa_{ij} m_j,\\quad
        \\bar m_j = \\sum_i \\bar\\kappa_{ij} a_i,

    then through the feature maps (``phi'(x) = 1`` for x > 0, ``e^x`` otherwise; phi is
    differentiable at 0). pi is a constant here (no gradient).

    Parameters
    ----------
    q, keys, v, pi, feature_map, mask, causal, window, align, mlk_form
        As :func:`linear_attention`.
    grad_out : array (..., L, E)
    precision : {"float64", "exact"}
    out_dtype : dtype, optional (exact path)

    Returns
    -------
    MGKGrads(dq (..., L, D), dkeys (..., S, R, D), dv (..., S, E)), each summed back to its
    argument's shape.

    Notes
    -----
    float64 path: the formulas above in NumPy. First-order error bound per element
    (``mlk_form="mixture"``): :func:`refattn.bounds.mlk_vjp_bound`; none is stated for the
    public-code forms.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import mgk
    >>> q = np.zeros((1, 1)); keys = np.array([[[0.0]], [[1.0]]]); v = np.array([[0.0], [3.0]])
    >>> mgk.linear_attention_vjp(q, keys, v, np.ones((1, 1)), pi=np.ones((2, 1))).dv.tolist()
    [[0.3333333333333333], [0.6666666666666666]]
    """
    precision = _checks.precision(precision)
    _checks.choice(feature_map, "feature_map", FEATURE_MAPS)
    form = _checks.choice(mlk_form, "mlk_form", MLK_FORMS)
    shapes = tuple(np.shape(a) for a in (q, keys, v))
    q, keys, v, batch, go = _vjp_inputs(q, keys, v, grad_out)
    pi = _pi(pi, batch + keys.shape[-3:-1], form == "mixture")
    length, units = q.shape[-2], keys.shape[-3]
    allowed = _checks.broadcast(
        allowed_mask(length, units, mask=mask, causal=causal, window=window, align=align),
        batch + (length, units),
        "mask",
        "(..., L, S) of q and keys",
    )
    if precision == "exact":
        return MGKGrads(
            *exact.linear_attention_vjp(
                q, keys, v, go, pi, allowed, form, shapes, _checks.out_dtype(out_dtype)
            )
        )
    q64, keys64, v64, go64 = (_checks.as_float64(a) for a in (q, keys, v, go))
    feats = _features64(q64, keys64, pi, form)
    kernels = np.where(allowed, feats.a @ np.swapaxes(feats.m, -1, -2), 0.0)
    dots = go64 @ np.swapaxes(v64, -1, -2)  # (..., L, S)
    if form == "lra":
        dkernels, weights = dots, np.ones(kernels.shape[:-1] + (1,))
    else:
        scale, eps = (1 / math.sqrt(q.shape[-1]), LM_EPS) if form == "lm" else (1.0, 0.0)
        den = kernels.sum(axis=-1, keepdims=True) + eps
        safe = np.where(den > 0, den, 1.0)
        out = scale * (kernels @ v64) / safe
        dkernels = (scale * dots - (go64 * out).sum(-1, keepdims=True)) / safe
        weights = scale / safe
    dkernels = np.where(allowed, dkernels, 0.0)
    dv = np.swapaxes(kernels * weights, -1, -2) @ go64
    dq = feats.back_q(dkernels @ feats.m)
    dkeys = feats.back_k(np.swapaxes(dkernels, -1, -2) @ feats.a)
    return MGKGrads(
        *(reduce_to(g, shape) for g, shape in zip((dq, dkeys, dv), shapes, strict=True))
    )
