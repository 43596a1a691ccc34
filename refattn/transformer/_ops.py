"""The operations a transformer composition is evaluated over on the float64 path.

:class:`Float64Ops` (NumPy in float64, attention by :func:`refattn.attention`) and
:class:`Float64VJPOps` (their analytic vector-Jacobian products), the head split/merge, the
row scaling that keeps layer norm's squares in range, and the chains (multi-head attention,
feed-forward, encoder and decoder block) written once over any ``ops``: the exact path's
enclosures and the bounds' error tracking evaluate the same text.
"""

from __future__ import annotations

import math

import numpy as np

from ._params import AttentionParams, DecoderParams, EncoderParams, FeedForwardParams, NormParams


def _split_heads(x, heads):
    """(..., L, heads*D) -> (..., heads, L, D): head h is columns h*D:(h+1)*D."""
    if not isinstance(x, np.ndarray):  # a value with its error (refattn.bounds.transformer)
        return x.map(lambda a: _split_heads(a, heads))
    return np.moveaxis(x.reshape(x.shape[:-1] + (heads, -1)), -2, -3)


def _merge_heads(x):
    """(..., H, L, E) -> (..., L, H*E), head 0 first (the notes' concat)."""
    if not isinstance(x, np.ndarray):
        return x.map(_merge_heads)
    x = np.moveaxis(x, -3, -2)
    return x.reshape(x.shape[:-2] + (-1,))


_SAFE_EXPONENT = 400  # rows with max |x| in [2**-400, 2**400] are not rescaled (bits unchanged)


def moment_exponent(x, eps) -> np.ndarray:
    """Per-row power of two e (keepdims) such that x * 2**-e has no square that overflows or
    underflows; 0 for rows already in the safe range (their rounding is left unchanged)."""
    with np.errstate(invalid="ignore"):
        top = np.max(np.abs(x), axis=-1, keepdims=True, initial=0.0)
    exponent = np.frexp(np.where(np.isfinite(top) & (top > 0), top, 1.0))[1]
    if eps > 0:  # scaled eps stays finite (it then dominates a tiny variance anyway)
        exponent = np.maximum(exponent, (int(np.frexp(eps)[1]) - 1000) // 2)
    return np.where(np.abs(exponent) > _SAFE_EXPONENT, exponent, 0)


def scaled_moments(x, eps):
    """(centred, variance, eps), all scaled by the powers of two of :func:`moment_exponent`,
    so the normalised row ``centred / sqrt(variance + eps)`` is unchanged and finite.

    The mean is formed at the same scale (no overflow of the sum for |x| near the float64
    maximum).
    """
    exponent = moment_exponent(x, eps)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = np.ldexp(x, -exponent)
        centred = scaled - scaled.mean(axis=-1, keepdims=True)
        var = (centred * centred).mean(axis=-1, keepdims=True)
        return centred, var, np.ldexp(eps, -2 * exponent)


class Float64Ops:
    """The operations of the float64 path: NumPy in float64, attention by
    :func:`refattn.attention`. A :class:`Composition` is evaluated over these (or over the
    exact path's enclosures, or the bounds' error-tracking operations)."""

    @staticmethod
    def erf(x):
        """scipy.special.erf, imported on first use (scipy costs 0.2 s of ``import refattn``
        and only GELU needs it)."""
        from scipy.special import erf

        return erf(x)

    @staticmethod
    def linear(x, W, b):
        finite = np.isfinite(x).all(axis=-1)
        # rows holding NaN/Inf (e.g. masked memory rows) stay out of the matmul: whether a BLAS
        # kernel raises the invalid flag for them depends on the CPU, and their products are
        # formed elementwise instead, so the poison is kept and no warning is emitted
        out = x @ W if finite.all() else np.where(finite[..., None], x, 0.0) @ W
        if not finite.all():
            with np.errstate(invalid="ignore", over="ignore"):
                out[~finite] = (x[~finite][..., :, None] * W).sum(axis=-2)
        return out if b is None else out + b

    @staticmethod
    def activation(x, name):
        if name == "relu":
            return np.maximum(x, 0.0)
        return 0.5 * x * (1.0 + Float64Ops.erf(x / math.sqrt(2.0)))

    @staticmethod
    def layer_norm(x, p: NormParams):
        with np.errstate(invalid="ignore", divide="ignore"):  # inf - inf; 0/0 (eps = 0)
            centred, var, eps = scaled_moments(x, p.eps)
            out = centred / np.sqrt(var + eps)
        if p.gamma is not None:
            out = out * p.gamma
        return out if p.beta is None else out + p.beta

    @staticmethod
    def attention(q, k, v, kwargs):
        from ..attention import attention  # imported late: refattn.attention imports refattn

        return attention(q, k, v, **kwargs, precision="float64")

    @staticmethod
    def positions(length, dim, base, layout):
        return positions_float64(length, dim, base, layout)


class Float64VJPOps(Float64Ops):
    """:class:`Float64Ops` with the analytic NumPy vector-Jacobian product of every operation
    (the float64 path of the ``*_vjp`` functions)."""

    @staticmethod
    def zeros(shape):
        return np.zeros(shape)

    @staticmethod
    def linear_vjp(x, W, has_bias, g):
        rows_x, rows_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        return g @ W.T, rows_x.T @ rows_g, rows_g.sum(axis=0) if has_bias else None

    @staticmethod
    def activation_vjp(x, name, g):
        if name == "relu":
            return g * (x > 0)  # the slope at 0 is 0 (torch's choice)
        density = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        return g * (0.5 * (1.0 + Float64Ops.erf(x / math.sqrt(2.0))) + x * density)

    @staticmethod
    def layer_norm_vjp(x, p: NormParams, g):
        # the row's power-of-two scaling of the forward (scaled_moments) cancels in xhat; the
        # factor 1/sigma carries it back
        exponent = moment_exponent(x, p.eps)
        with np.errstate(invalid="ignore", divide="ignore"):
            centred, var, eps = scaled_moments(x, p.eps)
            inv_sigma = 1.0 / np.sqrt(var + eps)
            xhat = centred * inv_sigma
            dxhat = g if p.gamma is None else g * p.gamma
            dx = (
                dxhat
                - dxhat.mean(axis=-1, keepdims=True)
                - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
            ) * inv_sigma
        width = x.shape[-1]
        return (
            np.ldexp(dx, -exponent),
            (g * xhat).reshape(-1, width).sum(axis=0),
            g.reshape(-1, width).sum(axis=0),
        )

    @staticmethod
    def attention_vjp(q, k, v, kwargs, g):
        from ..attention import attention_vjp  # imported late, as Float64Ops.attention

        return tuple(attention_vjp(q, k, v, g, **kwargs, precision="float64"))[:3]


def _positions_layout(sines, cosines, layout):
    length, half = sines.shape
    table = np.empty((length, 2 * half))
    sin_cols, cos_cols = (
        (slice(0, None, 2), slice(1, None, 2))
        if layout == "interleave"
        else (slice(0, half), slice(half, None))
    )
    table[:, sin_cols] = sines
    table[:, cos_cols] = cosines
    return table


def positions_float64(length, dim, base, layout):
    half = dim // 2
    inv_freq = np.power(base, -(2.0 * np.arange(half)) / dim)
    angle = np.arange(length, dtype=np.float64)[:, None] * inv_freq
    return _positions_layout(np.sin(angle), np.cos(angle), layout)


def mha(ops, x_q, x_kv, p: AttentionParams, kwargs):
    q = _split_heads(ops.linear(x_q, p.W_Q, p.b_Q), p.num_heads)
    k = _split_heads(ops.linear(x_kv, p.W_K, p.b_K), p.num_kv_heads)
    v = _split_heads(ops.linear(x_kv, p.W_V, p.b_V), p.num_kv_heads)
    return ops.linear(_merge_heads(ops.attention(q, k, v, kwargs)), p.W_O, p.b_O)


def ffn(ops, x, p: FeedForwardParams):
    return ops.linear(ops.activation(ops.linear(x, p.W1, p.b1), p.activation), p.W2, p.b2)


def encoder(ops, x, p: EncoderParams, norm, kwargs):
    def attend(h):
        return mha(ops, h, h, p.attn, kwargs)

    if norm == "post":
        h = ops.layer_norm(x + attend(x), p.norm1)
        return ops.layer_norm(h + ffn(ops, h, p.ffn), p.norm2)
    h = x + attend(ops.layer_norm(x, p.norm1))
    return h + ffn(ops, ops.layer_norm(h, p.norm2), p.ffn)


def decoder(ops, x, memory, p: DecoderParams, norm, self_kwargs, cross_kwargs):
    def self_attend(h):
        return mha(ops, h, h, p.self_attn, self_kwargs)

    def cross_attend(h):
        return mha(ops, h, memory, p.cross_attn, cross_kwargs)

    if norm == "post":
        h = ops.layer_norm(x + self_attend(x), p.norm1)
        h = ops.layer_norm(h + cross_attend(h), p.norm2)
        return ops.layer_norm(h + ffn(ops, h, p.ffn), p.norm3)
    h = x + self_attend(ops.layer_norm(x, p.norm1))
    h = h + cross_attend(ops.layer_norm(h, p.norm2))
    return h + ffn(ops, ops.layer_norm(h, p.norm3), p.ffn)
