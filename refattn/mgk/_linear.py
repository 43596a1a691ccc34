"""Transformer-MLK: linear attention with a mixture of linear keys (:func:`linear_attention`)
and its vector-Jacobian product."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .. import _checks
from ..broadcast import reduce_to
from ..exact import mgk as exact
from ._inputs import (
    LM_EPS,
    MGKGrads,
    cotangent,
    linear_problem,
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
    q, keys, v, batch, pi, form, allowed = linear_problem(
        q, keys, v, pi, feature_map, mlk_form, mask, causal, window, align
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
    shapes = tuple(np.shape(a) for a in (q, keys, v))
    q, keys, v, batch, pi, form, allowed = linear_problem(
        q, keys, v, pi, feature_map, mlk_form, mask, causal, window, align
    )
    go = cotangent(grad_out, q, v, batch)
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
