"""A-priori (first-order) error bounds of :mod:`refattn.transformer`'s float64 path.

Running forward error analysis along the same composition as the float64 path
(:func:`refattn.transformer.composition`): every operation maps the bound on its inputs' errors
through its Lipschitz constants and adds its own roundings, counted with Higham's gamma_n
(:func:`refattn.bounds.gamma`). See :func:`transformer_forward_bound`.
"""

from __future__ import annotations

import math

import numpy as np

from .. import transformer as T
from ..broadcast import reduce_to
from ..logspace import masked_logsumexp, masked_softmax
from ..spec import canonicalize
from ..transformer import Float64Ops, moment_exponent, scaled_moments
from .unit import ETA, UNIT_ROUNDOFF, gamma
from .unit import gamma as gamma_n

__all__ = [
    "Tracked",
    "TrackedOps",
    "transformer_forward_bound",
    "layer_norm_vjp_bound",
    "feed_forward_vjp_bound",
    "multihead_attention_vjp_bound",
]


class Tracked:
    """A float64 value and a first-order bound on its distance to the exact value.

    >>> t = Tracked(np.array([1.0]), np.array([0.0])) + Tracked(np.array([2.0]), np.array([0.0]))
    >>> t.val.tolist(), bool(t.err[0] == 3 * UNIT_ROUNDOFF)
    ([3.0], True)
    """

    __array_ufunc__ = None  # keep NumPy from broadcasting into an object array

    def __init__(self, val, err):
        self.val, self.err = val, err

    def __add__(self, other):
        val = self.val + other.val
        return Tracked(val, self.err + other.err + UNIT_ROUNDOFF * np.abs(val))

    def map(self, fn):
        return Tracked(fn(self.val), fn(self.err))


#: max |GELU'(x)| = max (Phi(x) + x phi(x)) <= 1 + phi(1) = 1 + 1/sqrt(2 pi e).
_GELU_LIPSCHITZ = 1 + 1 / math.sqrt(2 * math.pi * math.e)


class TrackedOps:
    """First-order forward error analysis of the float64 path (see
    :func:`transformer_forward_bound`): the operations of a
    :class:`refattn.transformer.Composition` on :class:`Tracked` values.

    Each op returns the float64 value and ``err`` = (error propagated from the inputs' errors)
    + (this op's rounding errors), with Higham's gamma_n = n u / (1 - n u) for n roundings.
    """

    @staticmethod
    def linear(x, W, b):
        width = W.shape[0] + (b is not None)  # dot product of M terms (+ the bias add)
        val = Float64Ops.linear(x.val, W, b)
        size = np.abs(x.val) @ np.abs(W) + (0.0 if b is None else np.abs(b))
        return Tracked(val, x.err @ np.abs(W) + gamma(width) * size)

    @staticmethod
    def activation(x, name):
        val = Float64Ops.activation(x.val, name)
        if name == "relu":  # exact, 1-Lipschitz
            return Tracked(val, x.err)
        # x/sqrt2 (2 roundings; erf' * |x| u <= u), erf (4 units), 1 + , *x, *0.5: gamma_8 |x|
        return Tracked(val, _GELU_LIPSCHITZ * x.err + gamma(8) * np.abs(x.val))

    @staticmethod
    def layer_norm(x, p):
        width = x.val.shape[-1]
        val = Float64Ops.layer_norm(x.val, p)
        gain = 1.0 if p.gamma is None else np.abs(p.gamma)
        # everything at the float64 path's power-of-two scale 2**-e (sigma and centred scale
        # alike; x, its error and the mean's rounding are scaled to match)
        centred, var, eps = scaled_moments(x.val, p.eps)
        shift = moment_exponent(x.val, p.eps)
        x_val, x_err = np.ldexp(x.val, -shift), np.ldexp(x.err, -shift)
        sigma = np.sqrt(var + eps)
        normed = np.abs(centred) / sigma
        # propagated: dy = g/sigma (dx - mean dx - yhat mean(yhat dx))
        mean_err = x_err.mean(axis=-1, keepdims=True)
        proj_err = (normed * x_err).mean(axis=-1, keepdims=True)
        propagated = gain / sigma * (x_err + mean_err + normed * proj_err)
        # rounding: mean gamma_{M+1} mean|x|; centring u|c|; variance gamma_{M+4} (relative);
        # sigma: half the variance's relative error + gamma_2; divide, gain, shift: 3 units
        mean_round = gamma(width + 1) * np.abs(x_val).mean(axis=-1, keepdims=True)
        sigma_rel = 0.5 * gamma(width + 4) * var / sigma**2 + gamma(2)
        rounding = (
            gain
            * (
                (mean_round + UNIT_ROUNDOFF * np.abs(centred)) / sigma
                + normed * (sigma_rel + gamma(2))
            )
            + UNIT_ROUNDOFF * np.abs(val)
            + 3 * ETA
        )  # division, gain and shift may each round a subnormal result by eta
        return Tracked(val, propagated + rounding)

    @staticmethod
    def attention(q, k, v, kwargs):
        spec = canonicalize(q.val, k.val, v.val, **kwargs)
        errs = canonicalize(q.err, k.err, v.err, **kwargs)  # same flattening of the errors
        out = Float64Ops.attention(q.val, k.val, v.val, kwargs)
        err = np.zeros(spec.batch_shape + spec.q.shape[1:3] + (spec.v.shape[-1],))
        flat = err.reshape((-1,) + err.shape[-3:])
        for b in range(spec.q.shape[0]):
            for h in range(spec.q.shape[1]):
                flat[b, h] = _attention_plane_bound(spec, errs, b, h)
        return Tracked(out, err)

    @staticmethod
    def positions(length, dim, base, layout):
        return Tracked(
            Float64Ops.positions(length, dim, base, layout),
            _positions_bound(length, dim, base, layout),
        )


def _attention_plane_bound(spec, errs, b, h):
    """Bound of one (L, E) plane: refattn.attention's own bound (its docstring), widened by
    the score terms |t| + |lse| (bias, ALiBi, softcap roundings), plus the propagated input
    errors: a score error e_ij moves the weight by w_ij (e_ij + max_k e_ik)."""
    g = spec.kv_head[h]
    q, k, v = spec.q[b, h], spec.k[b, g], spec.v[b, g]
    dq, dk, dv = errs.q[b, h], errs.k[b, g], errs.v[b, g]
    length, dim = q.shape
    keys = k.shape[0]
    allowed = spec.allowed(b, h)
    scale = abs(spec.scale_float)
    raw = scale * (q @ k.T)
    scores = raw if spec.softcap is None else spec.softcap * np.tanh(raw / spec.softcap)
    if spec.bias is not None:
        scores = scores + np.where(allowed, spec.bias[b, h], 0.0)
    if spec.alibi_slopes is not None:
        scores = scores + spec.alibi(h, b)
    with np.errstate(invalid="ignore", over="ignore"):
        lse = masked_logsumexp(scores, allowed)
    finite_lse = np.where(np.isfinite(lse), lse, 0.0)[:, None]
    weights = np.where(allowed, np.exp(np.where(allowed, scores, 0.0) - finite_lse), 0.0)
    if spec.dropout_mask is not None:
        weights = np.where(spec.dropout_mask[b, h], weights, 0.0) / (1.0 - spec.dropout_p)
    magnitude = scale * (np.abs(q) @ np.abs(k).T)
    own = (
        2
        * gamma(dim + 6)
        * (magnitude + np.abs(np.where(allowed, scores, 0.0)) + np.abs(finite_lse) + 1)
    )
    propagated = scale * (dq @ np.abs(k).T + np.abs(q) @ dk.T)
    propagated = np.where(allowed, propagated, 0.0)
    relative = own + propagated + propagated.max(axis=1, keepdims=True)
    return (weights * relative) @ np.abs(v) + weights @ dv + gamma(keys + 3) * (weights @ np.abs(v))


def _positions_bound(length, dim, base, layout):
    """|error| <= angle (gamma_3 + (2i/d) |log b| u) + gamma_2: the exponent 2i/d rounded once
    (its error times log b moves the power), pow and the product (one unit each, pow taken
    as within one ulp), sin/cos within one ulp. Column c holds frequency i = c // 2
    ("interleave") or c mod d/2 ("concat")."""
    half = dim // 2
    columns = np.arange(dim)
    frequency = columns // 2 if layout == "interleave" else columns % half
    exponent = 2.0 * frequency / dim
    angle = np.arange(length, dtype=np.float64)[:, None] * np.power(base, -exponent)
    return angle * (gamma(3) + exponent * abs(math.log(base)) * UNIT_ROUNDOFF) + gamma(2)


def transformer_forward_bound(function, *args, **kwargs) -> np.ndarray:
    """A priori bound on the float64 path's error: ``|function(*args, **kwargs) - exact|``.

    ``function`` is one of :func:`refattn.transformer.multihead_attention`, ``layer_norm``,
    ``sinusoidal_positions``, ``feed_forward``, ``encoder_block``, ``decoder_block``, called
    with the same arguments (``precision`` must be "float64"). Returns an array of the
    output's shape.

    Notes
    -----
    Running (first-order) forward error analysis along the same composition: every stage
    maps the bound on its inputs' errors through its Lipschitz constants and adds its own
    rounding errors as ``gamma_n = n u / (1 - n u)`` (Higham, *Accuracy and Stability*,
    Lemma 3.1; u = 2**-53) times the magnitudes involved:

    * ``x @ W + b``: ``err @ |W| + gamma_{M+1} (|x| @ |W| + |b|)`` (any summation order);
    * relu: the error passes; GELU: ``(1 + 1/sqrt(2 pi e)) err + gamma_8 |x|``;
    * residual add: both errors plus ``u |sum|``;
    * layer norm: ``|g|/sigma (e_i + mean e + |yhat_i| mean(|yhat| e))`` propagated, plus the
      mean, centring, variance, square-root and scaling roundings;
    * attention: :func:`refattn.bounds.float64_forward_bound`'s bookkeeping (with the score
      magnitude widened by ``|t| + |lse|`` to cover bias, ALiBi and softcap roundings) plus
      the propagated score errors ``s (e_q |k| + |q| e_k)`` (a weight moves by
      ``w_ij (e_ij + max_k e_ik)``) and ``w @ e_v``;
    * positions: ``angle (gamma_3 + (2i/d) |log b| u) + gamma_2``.

    The composition is :func:`refattn.transformer.composition`: the same validation and the
    same operations as the float64 path, evaluated on :class:`Tracked` values.
    Second-order terms (products of two errors, O(u^2)) are dropped; NaN/Inf inputs give a
    NaN bound.

    Examples
    --------
    >>> import refattn.transformer as T
    >>> bool(transformer_forward_bound(T.layer_norm, np.array([1.0, 2.0])).max() < 1e-14)
    True
    """
    if kwargs.pop("precision", "float64") != "float64":
        raise ValueError("precision: transformer_forward_bound bounds the float64 path only")
    kwargs.pop("out_dtype", None)
    plan = T.composition(function, *args, **kwargs)
    tracked = [Tracked(a, np.zeros_like(a)) for a in plan.inputs.values()]
    return plan.finish(plan.chain(TrackedOps, *tracked, plan.params).err)


#: max |GELU''(x)| = max phi(x) |2 - x^2| = 2 phi(0) = 2 / sqrt(2 pi).
_GELU_CURVATURE = 2 / math.sqrt(2 * math.pi)


def _row_sum(a):
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


def layer_norm_vjp_bound(x, grad_out, *, gamma=None, beta=None, eps=1e-5, axis=-1):
    """First-order bound on the float64 error of :func:`refattn.transformer.layer_norm_vjp`.

    Returns a :class:`refattn.transformer.LayerNormGrads` of element-wise bounds (None where
    the gradient is None). With the forward's roundings of ``xhat`` (mean ``gamma_{M+1}``,
    centring ``u``, variance ``gamma_{M+4}`` relative, square root and reciprocal
    ``gamma_2 + u``): ``e_xhat = |xhat| rho + e_c / sigma``; then the two means of the
    backward (``gamma_{M+1}``, ``gamma_{M+2}``), the three-term combination (``gamma_3``) and
    the final product by ``1/sigma`` each add their roundings to the propagated errors; dgamma
    and dbeta sum R rows (``gamma_{R+1}``, ``gamma_R``). Second-order terms are dropped.

    Examples
    --------
    >>> import numpy as np
    >>> bool(layer_norm_vjp_bound(np.array([1.0, 2.0]), np.ones(2)).dx.max() < 1e-14)
    True
    """
    plan = T.composition(T.layer_norm, x, gamma=gamma, beta=beta, eps=eps, axis=axis)
    x, p = plan.inputs["x"], plan.params
    g = np.moveaxis(np.asarray(grad_out, dtype=np.float64), axis, -1)
    width, rows = x.shape[-1], int(np.prod(x.shape[:-1], dtype=int))
    shift = moment_exponent(x, p.eps)
    centred, var, scaled_eps = scaled_moments(x, p.eps)
    sigma = np.sqrt(var + scaled_eps)
    xhat = centred / sigma
    centred_err = gamma_n(width + 1) * np.abs(np.ldexp(x, -shift)).mean(
        axis=-1, keepdims=True
    ) + UNIT_ROUNDOFF * np.abs(centred)
    rho = 0.5 * gamma_n(width + 4) * var / sigma**2 + gamma_n(3)
    xhat_err = np.abs(xhat) * (rho + UNIT_ROUNDOFF) + centred_err / sigma
    gain = 1.0 if p.gamma is None else p.gamma
    dxhat = g * gain
    dxhat_err = 0.0 if p.gamma is None else UNIT_ROUNDOFF * np.abs(dxhat)
    m1 = dxhat.mean(axis=-1, keepdims=True)
    m1_err = np.mean(dxhat_err + 0 * dxhat, axis=-1, keepdims=True) + gamma_n(width + 1) * np.abs(
        dxhat
    ).mean(axis=-1, keepdims=True)
    m2 = (dxhat * xhat).mean(axis=-1, keepdims=True)
    m2_err = (np.abs(dxhat) * xhat_err + dxhat_err * np.abs(xhat)).mean(
        axis=-1, keepdims=True
    ) + gamma_n(width + 2) * np.abs(dxhat * xhat).mean(axis=-1, keepdims=True)
    inner = dxhat - m1 - xhat * m2
    inner_err = (
        dxhat_err
        + m1_err
        + xhat_err * np.abs(m2)
        + np.abs(xhat) * m2_err
        + gamma_n(3) * (np.abs(dxhat) + np.abs(m1) + np.abs(xhat * m2))
    )
    dx_err = np.ldexp((inner_err + np.abs(inner) * (rho + 2 * UNIT_ROUNDOFF)) / sigma, -shift)
    dgamma = (
        None
        if p.gamma is None
        else _row_sum(np.abs(g) * xhat_err) + gamma_n(rows + 1) * _row_sum(np.abs(g * xhat))
    )
    dbeta = None if p.beta is None else gamma_n(rows) * _row_sum(np.abs(g))
    return T.LayerNormGrads(plan.finish(dx_err), dgamma, dbeta)


def feed_forward_vjp_bound(x, W1, b1, W2, b2, grad_out, activation="relu"):
    """First-order bound on the float64 error of :func:`refattn.transformer.feed_forward_vjp`.

    Returns a :class:`refattn.transformer.FeedForwardGrads` of element-wise bounds. The hidden
    layer ``h = x W1 + b1`` carries ``gamma_{M+1} (|x||W1| + |b1|)``; the activation adds
    GELU's ``(1 + 1/sqrt(2 pi e)) e_h + gamma_8 |h|`` (ReLU is exact); its slope errs by
    ``2/sqrt(2 pi) e_h + gamma_10 (|Phi| + |h phi|)`` (GELU) or, for ReLU, by 1 wherever
    ``|h| <= e_h`` (the sign is not certain; 0 elsewhere); every product ``A^T B`` or
    ``A B^T`` with propagated errors ``e_A``, ``e_B`` adds ``e_A |B| + |A| e_B + gamma_n |A||B|``
    (n the contraction length). Second-order terms are dropped.

    Examples
    --------
    >>> import numpy as np
    >>> b = feed_forward_vjp_bound(np.ones((1, 2)), np.eye(2), None, np.eye(2), None,
    ...                            np.ones((1, 2)))
    >>> bool(b.dx.max() < 1e-15), b.db1
    (True, None)
    """
    plan = T.composition(T.feed_forward, x, W1, b1, W2, b2, activation)
    x, p = plan.inputs["x"], plan.params
    g = np.asarray(grad_out, dtype=np.float64)
    rows = int(np.prod(x.shape[:-1], dtype=int))
    width, hidden_width = p.W1.shape
    h = Float64Ops.linear(x, p.W1, p.b1)
    h_err = gamma_n(width + 1) * (
        np.abs(x) @ np.abs(p.W1) + (0.0 if p.b1 is None else np.abs(p.b1))
    )
    a = Float64Ops.activation(h, p.activation)
    if p.activation == "relu":
        a_err, slope = h_err, (h > 0).astype(float)
        slope_err = (np.abs(h) <= h_err).astype(float)
    else:
        a_err = _GELU_LIPSCHITZ * h_err + gamma_n(8) * np.abs(h)
        density = np.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + Float64Ops.erf(h / math.sqrt(2)))
        slope = cdf + h * density
        slope_err = _GELU_CURVATURE * h_err + gamma_n(10) * (np.abs(cdf) + np.abs(h * density))
    t = g @ p.W2.T
    t_err = gamma_n(p.W2.shape[1]) * (np.abs(g) @ np.abs(p.W2.T))
    dh = t * slope
    dh_err = t_err * np.abs(slope) + np.abs(t) * slope_err + UNIT_ROUNDOFF * np.abs(dh)

    def flat(v):
        return v.reshape(-1, v.shape[-1])

    dW2 = flat(a_err).T @ flat(np.abs(g)) + gamma_n(rows) * (flat(np.abs(a)).T @ flat(np.abs(g)))
    dW1 = flat(np.abs(x)).T @ flat(dh_err) + gamma_n(rows) * (flat(np.abs(x)).T @ flat(np.abs(dh)))
    db1 = None if p.b1 is None else _row_sum(dh_err) + gamma_n(rows) * _row_sum(np.abs(dh))
    db2 = None if p.b2 is None else gamma_n(rows) * _row_sum(np.abs(g))
    dx = dh_err @ np.abs(p.W1.T) + gamma_n(hidden_width) * (np.abs(dh) @ np.abs(p.W1.T))
    return T.FeedForwardGrads(dx, dW1, db1, dW2, db2)


def _heads(x, count):
    """(..., L, count*D) -> (..., count, L, D) (head h is columns h*D:(h+1)*D)."""
    return np.moveaxis(x.reshape(x.shape[:-1] + (count, -1)), -2, -3)


def _unheads(x):
    """(..., count, L, D) -> (..., L, count*D)."""
    x = np.moveaxis(x, -3, -2)
    return x.reshape(x.shape[:-2] + (-1,))


def _plane_weights(spec, b, h):
    """float64 weights (L, S) of one plane (the float64 path's scores and masked softmax)."""
    g = spec.kv_head[h]
    scores = spec.scale_float * (
        np.asarray(spec.q[b, h], np.float64) @ np.asarray(spec.k[b, g], np.float64).T
    )
    if spec.bias is not None:
        scores = scores + np.where(np.isneginf(spec.bias[b, h]), 0.0, spec.bias[b, h])
    alibi = spec.alibi(h)
    if alibi is not None:
        scores = scores + alibi
    allowed = spec.allowed(b, h)
    _, weights = masked_softmax(scores, allowed)
    return weights, allowed


def _attention_vjp_propagated(q, k, v, do, errors, kwargs):
    """First-order change of attention's exact vjp (dq, dk, dv) when q, k, v, dO move by at
    most ``errors`` = (e_q, e_k, e_v, e_dO) (element-wise): scores ``s (e_q |k| + |q| e_k)``,
    weights ``P (e_t + sum_k P e_t)``, ``dP' = dO v^T``, ``Delta = sum P dP'``,
    ``dS = P (dP' - Delta)``, and the products of dq, dk, dv."""
    spec = canonicalize(q, k, v, **kwargs)
    flat = canonicalize(*errors[:3], **kwargs)  # the same flattening of the errors
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    full = spec.batch_shape + (heads, length, vdim)
    do_all = np.broadcast_to(do, full).reshape(batch, heads, length, vdim)
    edo_all = np.broadcast_to(errors[3], full).reshape(do_all.shape)
    out = [
        np.zeros((batch, heads, length, dim)),
        np.zeros((batch, kv_heads, keys, dim)),
        np.zeros((batch, kv_heads, keys, vdim)),
    ]
    s = abs(spec.scale_float)
    for b in range(batch):
        for h in range(heads):
            g = spec.kv_head[h]
            P, allowed = _plane_weights(spec, b, h)
            q_, k_, v_ = (
                np.asarray(a, np.float64) for a in (spec.q[b, h], spec.k[b, g], spec.v[b, g])
            )
            eq, ek, ev = (
                np.asarray(a, np.float64) for a in (flat.q[b, h], flat.k[b, g], flat.v[b, g])
            )
            dO, edO = do_all[b, h], edo_all[b, h]
            e_t = np.where(allowed, s * (eq @ np.abs(k_).T + np.abs(q_) @ ek.T), 0.0)
            e_P = P * (e_t + (P * e_t).sum(axis=1, keepdims=True))
            dP = np.where(allowed, dO @ v_.T, 0.0)
            e_dP = np.where(allowed, np.abs(dO) @ ev.T + edO @ np.abs(v_).T, 0.0)
            delta = (P * dP).sum(axis=1, keepdims=True)
            e_delta = (e_P * np.abs(dP) + P * e_dP).sum(axis=1, keepdims=True)
            dS = P * (dP - delta)
            e_dS = e_P * np.abs(dP - delta) + P * (e_dP + e_delta)
            out[0][b, h] = s * (e_dS @ np.abs(k_) + np.abs(dS) @ ek)
            out[1][b, g] += s * (e_dS.T @ np.abs(q_) + np.abs(dS).T @ eq)
            out[2][b, g] += e_P.T @ np.abs(dO) + P.T @ edO
    return tuple(spec.unflatten(x) for x in out)


def multihead_attention_vjp_bound(
    x_q,
    x_kv,
    W_Q,
    W_K,
    W_V,
    W_O,
    grad_out,
    *,
    b_Q=None,
    b_K=None,
    b_V=None,
    b_O=None,
    num_heads,
    num_kv_heads=None,
    **attention_kwargs,
):
    """First-order bound on the float64 error of
    :func:`refattn.transformer.multihead_attention_vjp`.

    Returns a :class:`refattn.transformer.MultiheadAttentionGrads` of element-wise bounds.
    Forward: the projections' ``gamma_{M+1} (|x||W| + |b|)`` and the attention output's
    :class:`TrackedOps` bound. Backward: ``dW_O``, ``db_O`` and ``dO = g W_O^T`` as products;
    attention's own rounding (:func:`refattn.bounds.float64_vjp_bound` at the computed q, k, v,
    dO) plus the first-order move of the exact vjp under the errors of q, k, v and dO (through
    the scores, the weights ``P (e_t + sum P e_t)``, ``dP'``, ``Delta`` and ``dS``); then the
    projections' products. Softcap and dropout are not covered (ValueError). Second-order
    terms are dropped.

    Examples
    --------
    >>> import numpy as np
    >>> eye = np.eye(2)
    >>> b = multihead_attention_vjp_bound(eye, None, eye, eye, eye, eye, np.ones((2, 2)),
    ...                                   num_heads=1)
    >>> bool(b.dx_q.max() < 1e-13), b.dx_kv, b.db_Q
    (True, None, None)
    """
    from .attention import float64_vjp_bound

    if (
        attention_kwargs.get("softcap") is not None
        or attention_kwargs.get("dropout_p")
        or attention_kwargs.get("dropout_mask") is not None
    ):
        raise ValueError("multihead_attention_vjp_bound: softcap and dropout are not covered")
    plan = T.composition(
        T.multihead_attention,
        x_q,
        x_kv,
        W_Q,
        W_K,
        W_V,
        W_O,
        b_Q=b_Q,
        b_K=b_K,
        b_V=b_V,
        b_O=b_O,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        **attention_kwargs,
    )
    xq, xkv, p = plan.inputs["x_q"], plan.inputs["x_kv"], plan.params
    g = np.asarray(grad_out, dtype=np.float64)
    kwargs = dict(attention_kwargs)

    def project(x, W, bias):
        err = gamma_n(W.shape[0] + 1) * (
            np.abs(x) @ np.abs(W) + (0.0 if bias is None else np.abs(bias))
        )
        return Float64Ops.linear(x, W, bias), err

    (q, eq), (k, ek), (v, ev) = (
        project(xq, p.W_Q, p.b_Q),
        project(xkv, p.W_K, p.b_K),
        project(xkv, p.W_V, p.b_V),
    )
    H, K = p.num_heads, p.num_kv_heads
    qh, kh, vh = _heads(q, H), _heads(k, K), _heads(v, K)
    eqh, ekh, evh = _heads(eq, H), _heads(ek, K), _heads(ev, K)
    o = TrackedOps.attention(Tracked(qh, eqh), Tracked(kh, ekh), Tracked(vh, evh), kwargs)
    o_val, o_err = _unheads(o.val), _unheads(o.err)
    rows = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    count = rows(g).shape[0]
    dW_O = rows(o_err).T @ rows(np.abs(g)) + gamma_n(count) * (
        rows(np.abs(o_val)).T @ rows(np.abs(g))
    )
    db_O = None if p.b_O is None else gamma_n(count) * np.abs(rows(g)).sum(axis=0)
    do = g @ p.W_O.T
    e_do = gamma_n(p.W_O.shape[1]) * (np.abs(g) @ np.abs(p.W_O.T))
    doh, e_doh = _heads(do, H), _heads(e_do, H)
    own = float64_vjp_bound(qh, kh, vh, doh, **kwargs)[:3]
    moved = _attention_vjp_propagated(qh, kh, vh, doh, (eqh, ekh, evh, e_doh), kwargs)
    computed = T.Float64VJPOps.attention_vjp(qh, kh, vh, kwargs, doh)

    def reduced(value, err, target):
        """A gradient broadcast over batch dimensions is summed back (one more rounding)."""
        if value.shape == target.shape:
            return _unheads(np.abs(value)), _unheads(err)
        summed = value.size // target.size
        magnitude = reduce_to(np.abs(value), target.shape)
        return _unheads(magnitude), _unheads(
            reduce_to(err, target.shape) + gamma_n(summed) * magnitude
        )

    (dq_abs, e_dq), (dk_abs, e_dk), (dv_abs, e_dv) = (
        reduced(c, a + b, t) for c, a, b, t in zip(computed, own, moved, (qh, kh, vh), strict=True)
    )

    def backward(x, W, bias, d_abs, e_d, batch_rows):
        dW = rows(np.abs(x)).T @ rows(e_d) + gamma_n(batch_rows) * (rows(np.abs(x)).T @ rows(d_abs))
        db = (
            None
            if bias is None
            else rows(e_d).sum(axis=0) + gamma_n(batch_rows) * rows(d_abs).sum(axis=0)
        )
        dx = e_d @ np.abs(W.T) + gamma_n(W.shape[1]) * (d_abs @ np.abs(W.T))
        return dx, dW, db

    dq_x, dW_Q, db_Q = backward(xq, p.W_Q, p.b_Q, dq_abs, e_dq, rows(dq_abs).shape[0])
    dk_x, dW_K, db_K = backward(xkv, p.W_K, p.b_K, dk_abs, e_dk, rows(dk_abs).shape[0])
    dv_x, dW_V, db_V = backward(xkv, p.W_V, p.b_V, dv_abs, e_dv, rows(dv_abs).shape[0])
    dx_kv = dk_x + dv_x + UNIT_ROUNDOFF * (dk_abs @ np.abs(p.W_K.T) + dv_abs @ np.abs(p.W_V.T))
    if x_kv is None:
        dx_q = (
            dq_x
            + dx_kv
            + UNIT_ROUNDOFF
            * (dq_abs @ np.abs(p.W_Q.T) + dk_abs @ np.abs(p.W_K.T) + dv_abs @ np.abs(p.W_V.T))
        )
        dx_kv = None
    else:
        dx_q = dq_x
    return T.MultiheadAttentionGrads(dx_q, dx_kv, dW_Q, dW_K, dW_V, dW_O, db_Q, db_K, db_V, db_O)
