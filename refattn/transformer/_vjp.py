"""Vector-Jacobian products of the transformer pieces (:mod:`refattn.transformer`).

Each ``*_vjp`` validates its call as the forward function does (the same ``*_plan``), then
runs the composition's reverse pass: on the float64 path over
:class:`~refattn.transformer.Float64VJPOps`, on the exact path the exact derivative of the
whole composition enclosed and rounded once (:func:`refattn.exact.transformer.round_vjp`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _checks
from .._tape import Tape, backward_pass
from ..exact import transformer as X
from ._forward import (
    Composition,
    decoder_plan,
    encoder_plan,
    ffn_plan,
    layer_norm_plan,
    mha_plan,
    unchanged,
    widen_to_float64,
)
from ._ops import Float64VJPOps
from ._params import DecoderParams, EncoderParams, arrays_of, convert, require_finite

# ----------------------------------------------------------------------------- gradients


class LayerNormGrads(NamedTuple):
    """Gradients of :func:`layer_norm`: dx (x's shape), dgamma and dbeta (their shapes, None
    when not given)."""

    dx: np.ndarray
    dgamma: np.ndarray | None
    dbeta: np.ndarray | None


class FeedForwardGrads(NamedTuple):
    """Gradients of :func:`feed_forward` (None for an absent bias)."""

    dx: np.ndarray
    dW1: np.ndarray
    db1: np.ndarray | None
    dW2: np.ndarray
    db2: np.ndarray | None


class MultiheadAttentionGrads(NamedTuple):
    """Gradients of :func:`multihead_attention`; ``dx_kv`` is None for self-attention
    (``x_kv=None``: ``dx_q`` then holds both uses of x), the ``db_*`` None for absent biases."""

    dx_q: np.ndarray
    dx_kv: np.ndarray | None
    dW_Q: np.ndarray
    dW_K: np.ndarray
    dW_V: np.ndarray
    dW_O: np.ndarray
    db_Q: np.ndarray | None
    db_K: np.ndarray | None
    db_V: np.ndarray | None
    db_O: np.ndarray | None


class EncoderGrads(NamedTuple):
    """Gradients of :func:`encoder_block`: dx and ``dparams``, an :class:`EncoderParams` whose
    arrays are the gradients of the corresponding parameters (None where a parameter is
    None; eps, activation and head counts are copied)."""

    dx: np.ndarray
    dparams: EncoderParams


class DecoderGrads(NamedTuple):
    """Gradients of :func:`decoder_block`: dx, dmemory and ``dparams`` (a
    :class:`DecoderParams` of gradients, as :class:`EncoderGrads`)."""

    dx: np.ndarray
    dmemory: np.ndarray
    dparams: DecoderParams


def _key_bias_zeros(kwargs, *prefixes):
    """Parameter names of key biases whose gradient is exactly zero: without a softcap,
    ``db_K = s sum_i q_i sum_j dS_ij`` and every row of ``dS = P (dP - Delta)`` sums to
    ``Delta - Delta = 0`` (softmax is invariant to a shift shared by a row's scores)."""
    if kwargs.get("softcap") is not None:
        return set()
    return {prefix + "b_K" for prefix in prefixes}


def _vjp(plan: Composition, grad_out, precision, out_dtype, zero_names=frozenset()):
    """(gradients of the plan's inputs, params dataclass of gradients) of
    ``sum(grad_out * output)``.

    float64: the composition's backward pass with :class:`Float64VJPOps` (analytic NumPy
    derivatives, :func:`refattn.attention_vjp` for attention). exact: the exact derivative of
    the whole composition, enclosed and rounded once (:func:`refattn.exact.transformer
    .round_vjp`).
    """
    precision = _checks.precision(precision)
    plan = widen_to_float64(plan)
    g = _checks.as_float64(_checks.float_array(grad_out, "grad_out"))
    inputs = list(plan.inputs.values())
    if precision == "float64":
        flat = backward_pass(
            Tape(Float64VJPOps()), plan.chain, inputs, plan.params, g, unchanged, convert
        )
    else:
        require_finite(dict(plan.inputs, grad_out=g))
        require_finite(arrays_of(plan.params))
        names = list(arrays_of(plan.params))
        zeros = {len(inputs) + k for k, name in enumerate(names) if name in zero_names}
        flat = X.round_vjp(
            plan.chain,
            inputs,
            plan.params,
            g,
            _checks.out_dtype(out_dtype),
            plan.what + "_vjp",
            map_params=convert,
            zero_arrays=zeros,
        )
    rest = iter(flat[len(inputs) :])
    return flat[: len(inputs)], convert(plan.params, lambda _: next(rest))


def layer_norm_vjp(
    x, grad_out, *, gamma=None, beta=None, eps=1e-5, axis=-1, precision="float64", out_dtype=None
) -> LayerNormGrads:
    """Vector-Jacobian product of :func:`layer_norm` ([L17] "Other layers").

    With ``sigma = sqrt(var + eps)``, ``xhat = (x - mu) / sigma`` and ``dxhat = g * gamma``
    (``g = grad_out``), per row:

    .. math::

        dx = \\frac{1}{\\sigma}\\Big(\\widehat{dx} - \\mathrm{mean}(\\widehat{dx})
             - \\hat x\\, \\mathrm{mean}(\\widehat{dx}\\, \\hat x)\\Big), \\qquad
        d\\gamma = \\sum_{rows} g\\, \\hat x, \\qquad d\\beta = \\sum_{rows} g

    Parameters
    ----------
    x, gamma, beta, eps, axis
        As :func:`layer_norm`.
    grad_out : float array, the shape of x
        Cotangent of the output.
    precision : {"float64", "exact"}
        "float64": the formula above in NumPy (rows rescaled by a power of two as in the
        forward). "exact": the exact derivative enclosed in interval arithmetic and rounded
        once to ``out_dtype`` (finite inputs; an exactly zero gradient element other than a
        structural one, e.g. from a zero cotangent row, cannot be decided and raises
        :class:`refattn.exact.rounding.UndecidedRoundingError`).
    out_dtype : dtype, optional

    Returns
    -------
    LayerNormGrads
        ``dx``, ``dgamma`` (None without gamma), ``dbeta`` (None without beta).

    Notes
    -----
    No a-priori bound of the float64 gradient is available in :mod:`refattn.bounds`; the tests
    compare it with the exact path using a first-order estimate.

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> T.layer_norm_vjp(np.array([1.0, 3.0]), np.array([1.0, 0.0]), eps=0.0).dx.tolist()
    [0.0, 0.0]
    >>> grads = T.layer_norm_vjp(np.array([1.0, 2.0, 4.0]), np.ones(3), gamma=np.ones(3),
    ...                          eps=0.0)
    >>> np.round(grads.dgamma, 6).tolist(), grads.dbeta
    ([-1.069045, -0.267261, 1.336306], None)
    """
    plan = layer_norm_plan(x, gamma=gamma, beta=beta, eps=eps, axis=axis)
    g = _checks.float_array(grad_out, "grad_out")
    if g.shape != plan.inputs["x"].shape[:-1] + (
        plan.inputs["x"].shape[-1],
    ) and g.shape != np.shape(x):
        raise ValueError(f"grad_out: expected the shape of x {np.shape(x)}, got {g.shape}")
    moved = np.moveaxis(g, _checks.axis(axis), -1) if g.shape == np.shape(x) else g
    (dx,), dparams = _vjp(plan, moved, precision, out_dtype)
    return LayerNormGrads(plan.finish(dx), dparams.gamma, dparams.beta)


def feed_forward_vjp(
    x, W1, b1, W2, b2, grad_out, activation="relu", *, precision="float64", out_dtype=None
) -> FeedForwardGrads:
    """Vector-Jacobian product of :func:`feed_forward`.

    .. math::

        h = x W_1 + b_1, \\quad dW_2 = \\mathrm{act}(h)^T g, \\quad db_2 = \\textstyle\\sum g,
        \\quad dh = (g W_2^T) \\odot \\mathrm{act}'(h), \\quad dW_1 = x^T dh, \\quad
        db_1 = \\textstyle\\sum dh, \\quad dx = dh\\, W_1^T

    (sums over every row of every batch). ``relu'(0) = 0`` (torch's choice); GELU's
    derivative is ``Phi(h) + h phi(h)`` of the exact-erf form.

    Parameters
    ----------
    x, W1, b1, W2, b2, activation
        As :func:`feed_forward`.
    grad_out : float array (..., L, P)
    precision, out_dtype
        As :func:`layer_norm_vjp` (exact: with ReLU, a pre-activation that is exactly 0 has
        slope 0; one that only an enclosure straddles is refined by the Ziv loop).

    Returns
    -------
    FeedForwardGrads

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> grads = T.feed_forward_vjp(np.array([[1.0, -1.0]]), np.eye(2), None, np.eye(2), None,
    ...                            np.ones((1, 2)))
    >>> grads.dx.tolist(), grads.dW2.tolist()
    ([[1.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]])
    """
    plan = ffn_plan(x, W1, b1, W2, b2, activation)
    (dx,), dp = _vjp(plan, grad_out, precision, out_dtype)
    return FeedForwardGrads(dx, dp.W1, dp.b1, dp.W2, dp.b2)


def multihead_attention_vjp(
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
    precision="float64",
    out_dtype=None,
    **attention_kwargs,
) -> MultiheadAttentionGrads:
    """Vector-Jacobian product of :func:`multihead_attention`.

    Reverse pass of the projections (``dW = x^T dY``, ``dx = dY W^T``, ``db = sum dY``), the
    head merge/split (index maps) and, per head, attention's backward pass
    (:func:`refattn.attention_vjp`'s equations: ``dV = P'^T dO``,
    ``dS = P (dP - Delta)``, ``dQ = s dS K``, ``dK = s dS^T Q``).

    Parameters
    ----------
    x_q, x_kv, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, num_heads, num_kv_heads,
    **attention_kwargs
        As :func:`multihead_attention`. Masks, bias, ALiBi slopes and the dropout mask get no
        gradient.
    grad_out : float array (..., L, P)
    precision : {"float64", "exact"}
        "exact": the exact derivative of the whole layer (projections, attention, output
        projection) enclosed in interval arithmetic and rounded once; ``empty_rows="nan"``
        with an empty row is rejected (NaN outputs).
    out_dtype : dtype, optional

    Returns
    -------
    MultiheadAttentionGrads
        ``dx_kv`` is None for self-attention (``x_kv=None``); gradients of broadcast inputs
        are summed back to their shapes.

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> x, eye = np.eye(2), np.eye(2)
    >>> grads = T.multihead_attention_vjp(x, None, eye, eye, eye, eye, np.ones((2, 2)),
    ...                                   num_heads=1, scale=0.0)
    >>> grads.dx_q.tolist(), grads.dx_kv
    ([[1.0, 1.0], [1.0, 1.0]], None)
    """
    plan = mha_plan(
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
    if x_kv is None:  # one input used twice: its two gradients are summed before rounding
        chain = plan.chain
        plan = plan._replace(
            chain=lambda ops, xq, p: chain(ops, xq, xq, p), inputs={"x_q": plan.inputs["x_q"]}
        )
    inputs, p = _vjp(plan, grad_out, precision, out_dtype, _key_bias_zeros(attention_kwargs, ""))
    dx_kv = None if x_kv is None else inputs[1]
    return MultiheadAttentionGrads(
        inputs[0], dx_kv, p.W_Q, p.W_K, p.W_V, p.W_O, p.b_Q, p.b_K, p.b_V, p.b_O
    )


def encoder_block_vjp(
    x,
    params: EncoderParams,
    grad_out,
    *,
    norm="post",
    mask=None,
    precision="float64",
    out_dtype=None,
    **attention_kwargs,
) -> EncoderGrads:
    """Vector-Jacobian product of :func:`encoder_block` (reverse pass through the residuals,
    layer norms, feed-forward and self-attention; see :func:`layer_norm_vjp`,
    :func:`feed_forward_vjp`, :func:`multihead_attention_vjp`).

    Parameters
    ----------
    x, params, norm, mask, **attention_kwargs
        As :func:`encoder_block`.
    grad_out : float array (..., L, M)
    precision, out_dtype
        As :func:`multihead_attention_vjp`: "exact" is the exact derivative of the whole
        block rounded once (small shapes: Python loops over intervals).

    Returns
    -------
    EncoderGrads
        ``dx`` and ``dparams`` (an :class:`EncoderParams` of gradients).

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> eye, ffn = np.eye(4), T.FeedForwardParams(np.eye(4, 8), None, np.eye(8, 4), None)
    >>> attn = T.AttentionParams(eye, eye, eye, eye, num_heads=2)  # W_Q, W_K, W_V, W_O
    >>> p = T.EncoderParams(attn, ffn, norm1=T.NormParams(), norm2=T.NormParams())
    >>> grads = T.encoder_block_vjp(np.ones((3, 4)), p, np.ones((3, 4)))
    >>> grads.dx.shape, grads.dparams.ffn.W1.shape
    ((3, 4), (4, 8))
    """
    plan = encoder_plan(x, params, norm=norm, mask=mask, **attention_kwargs)
    (dx,), dparams = _vjp(
        plan, grad_out, precision, out_dtype, _key_bias_zeros(attention_kwargs, "attn.")
    )
    return EncoderGrads(dx, dparams)


def decoder_block_vjp(
    x,
    memory,
    params: DecoderParams,
    grad_out,
    *,
    norm="post",
    self_mask=None,
    memory_mask=None,
    precision="float64",
    out_dtype=None,
) -> DecoderGrads:
    """Vector-Jacobian product of :func:`decoder_block` (as :func:`encoder_block_vjp`, with
    the gradient of the memory through the cross-attention's keys and values).

    Parameters
    ----------
    x, memory, params, norm, self_mask, memory_mask
        As :func:`decoder_block`.
    grad_out : float array (..., L, M)
    precision, out_dtype
        As :func:`encoder_block_vjp`.

    Returns
    -------
    DecoderGrads
        ``dx``, ``dmemory`` and ``dparams`` (a :class:`DecoderParams` of gradients).

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> eye, ffn = np.eye(4), T.FeedForwardParams(np.eye(4, 8), None, np.eye(8, 4), None)
    >>> attn = T.AttentionParams(eye, eye, eye, eye, num_heads=2)  # W_Q, W_K, W_V, W_O
    >>> p = T.DecoderParams(attn, attn, ffn, T.NormParams(), T.NormParams(), T.NormParams())
    >>> grads = T.decoder_block_vjp(np.ones((3, 4)), np.ones((5, 4)), p, np.ones((3, 4)))
    >>> grads.dmemory.shape, grads.dparams.cross_attn.W_K.shape
    ((5, 4), (4, 4))
    """
    plan = decoder_plan(x, memory, params, norm=norm, self_mask=self_mask, memory_mask=memory_mask)
    (dx, dmemory), dparams = _vjp(
        plan, grad_out, precision, out_dtype, _key_bias_zeros({}, "self_attn.", "cross_attn.")
    )
    return DecoderGrads(dx, dmemory, dparams)


# ----------------------------------------------------------------------------- random params
