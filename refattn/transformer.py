"""Transformer pieces from the lecture notes: multi-head attention, layer norm, sinusoidal
positions, feed-forward, encoder and decoder blocks (float64 and exact paths).

Sources (``../shared/seeds``; the notes carry no equation numbers, so sections are cited):

* [L17] lecture 17 notes (003): "Multihead attention", "Masked Multi-head attention",
  "Other layers" (layer normalization, positional embedding).
* [AMT] "Attention Mechanisms and the Transformer" (004): "Self-Attention" (the multi-head
  display ``q_i^r = W_q^r x_i, ..., y_i = W_y concat[y_i^1, y_i^2, ...]``) and "Transformers"
  (the Transformer block, Figure 2).

Shape letters as in :mod:`refattn`, plus M (model width, the last axis of ``x``), N (width of
the key/value source ``x_kv`` or ``memory``), P (output width of ``W_O``), F (hidden width of
the feed-forward layer).

Conventions pinned here (see also :func:`multihead_attention`):

* Row vectors: ``x`` is (..., L, M) and a projection is ``x @ W + b`` with ``W`` (M, P). The
  notes' column form ``q = W_q x`` is ``W = W_q^T`` here (torch's ``nn.Linear`` stores the
  same ``W_q`` as ``weight`` and computes ``x @ weight.T``).
* Head split: head h of a projection is its columns ``h*D:(h+1)*D`` (torch
  ``nn.MultiheadAttention``, the notes' "concat"): heads are contiguous column blocks.
* Exact path: every output element is the exact real value of the *whole* composition
  (projections, attention, residuals, norms, feed-forward) rounded once to ``out_dtype``.
  It requires finite inputs and parameters and is meant for small shapes (Python loops over
  intervals; measured on this 2-core machine: an encoder block with L=8, M=16, H=4, F=32
  takes about 0.07 s, with L=16, M=32, F=64 about 0.5 s).
* Readings of the notes: [AMT] writes ``y_i^r = sum_j W_ij^r v_j`` (no head index on v) and
  scales by ``1/sqrt(d)``; [L17] by ``1/sqrt(d_k)``. Here each head uses its own values
  ``v_j^r`` and the default scale is ``1/sqrt(D)`` with D the per-head key width.
  [L17]'s masked form ``softmax((Q^T K + M)/sqrt(d_k))`` (M of 0/-inf) equals removing the
  masked keys, which is what ``mask``/``causal`` do. [L17]'s layer norm has a gain g and no
  shift or eps; ``beta`` and ``eps`` (inside the square root, torch's placement) are
  additions, ``eps=0`` and no ``beta`` give the notes' formula. [AMT]'s block states
  "self-attention + residual, LayerNorm, MLPs, LayerNorm"; the MLP's residual is Vaswani's.
* float64 error: :func:`refattn.bounds.transformer_forward_bound` gives an a-priori
  (first-order) bound on the float64 path's error for every function here, by running error
  analysis along the same composition (:func:`composition`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np
import scipy.special

from . import _checks
from ._tape import Tape, backward_pass
from .exact import transformer as X

__all__ = [
    "AttentionParams",
    "FeedForwardParams",
    "NormParams",
    "EncoderParams",
    "DecoderParams",
    "multihead_attention",
    "layer_norm",
    "sinusoidal_positions",
    "feed_forward",
    "encoder_block",
    "decoder_block",
    "Composition",
    "composition",
    "Float64Ops",
    "random_attention_params",
    "random_encoder_params",
    "random_decoder_params",
    "Float64VJPOps",
    "LayerNormGrads",
    "FeedForwardGrads",
    "MultiheadAttentionGrads",
    "EncoderGrads",
    "DecoderGrads",
    "layer_norm_vjp",
    "feed_forward_vjp",
    "multihead_attention_vjp",
    "encoder_block_vjp",
    "decoder_block_vjp",
]

ACTIVATIONS = ("relu", "gelu")
NORMS = ("post", "pre")
LAYOUTS = ("interleave", "concat")
ATTENTION_KEYWORDS = (
    "scale",
    "bias",
    "mask",
    "causal",
    "window",
    "align",
    "softcap",
    "alibi_slopes",
    "gqa",
    "dropout_mask",
    "dropout_p",
    "empty_rows",
)


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class AttentionParams:
    """Weights of one multi-head attention layer ([AMT] "Self-Attention", multi-head display).

    Attributes
    ----------
    W_Q : (M, H*D)    W_K : (N, K*D)    W_V : (N, K*E)    W_O : (H*E, P)
    b_Q : (H*D,) or None, b_K : (K*D,), b_V : (K*E,), b_O : (P,)
    num_heads : int, H
    num_kv_heads : int or None, K (None: K = H)
    """

    W_Q: np.ndarray
    W_K: np.ndarray
    W_V: np.ndarray
    W_O: np.ndarray
    b_Q: np.ndarray | None = None
    b_K: np.ndarray | None = None
    b_V: np.ndarray | None = None
    b_O: np.ndarray | None = None
    num_heads: int = 1
    num_kv_heads: int | None = None


@dataclass(frozen=True)
class FeedForwardParams:
    """Position-wise feed-forward ``act(x @ W1 + b1) @ W2 + b2``: W1 (M, F), W2 (F, M)."""

    W1: np.ndarray
    b1: np.ndarray | None
    W2: np.ndarray
    b2: np.ndarray | None
    activation: str = "relu"


@dataclass(frozen=True)
class NormParams:
    """Layer-norm gain ``gamma`` (M,), shift ``beta`` (M,) (None: 1 and 0) and ``eps``."""

    gamma: np.ndarray | None = None
    beta: np.ndarray | None = None
    eps: float = 1e-5


@dataclass(frozen=True)
class EncoderParams:
    """One encoder block: self-attention, feed-forward, and the two layer norms."""

    attn: AttentionParams
    ffn: FeedForwardParams
    norm1: NormParams
    norm2: NormParams


@dataclass(frozen=True)
class DecoderParams:
    """One decoder block: masked self-attention, cross-attention, feed-forward, three norms."""

    self_attn: AttentionParams
    cross_attn: AttentionParams
    ffn: FeedForwardParams
    norm1: NormParams
    norm2: NormParams
    norm3: NormParams


# ----------------------------------------------------------------------------- validation


def _matrix(value, name, rows=None, source="its input"):
    arr = _checks.float_array(value, name)
    if arr.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D weight matrix, got shape {arr.shape}")
    if rows is not None and arr.shape[0] != rows:
        raise ValueError(
            f"{name}: expected {rows} rows (the width of {source}), got shape {arr.shape}"
        )
    return arr


def _vector(value, name, size):
    if value is None:
        return None
    arr = _checks.float_array(value, name)
    if arr.shape not in ((size,), ()):
        raise ValueError(f"{name}: expected shape ({size},) or (), got shape {arr.shape}")
    return arr


def _count(value, name):
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def _heads_of(cols, heads, name, what, heads_name="num_heads"):
    if cols % heads:
        raise ValueError(
            f"{name}: {cols} columns do not split into {heads_name} = {heads} heads ({what} = "
            "columns / heads)"
        )
    return cols // heads


def _check_attention(x_q, x_kv, p: AttentionParams) -> AttentionParams:
    """Validate shapes; returns the params with arrays (input dtypes kept)."""
    heads = _count(p.num_heads, "num_heads")
    kv_heads = heads if p.num_kv_heads is None else _count(p.num_kv_heads, "num_kv_heads")
    if heads % kv_heads:
        raise ValueError(
            f"num_heads: {heads} is not a multiple of num_kv_heads {kv_heads} (GQA needs H % K "
            "== 0)"
        )
    W_Q = _matrix(p.W_Q, "W_Q", x_q.shape[-1], f"x_q {x_q.shape}")
    W_K = _matrix(p.W_K, "W_K", x_kv.shape[-1], f"x_kv {x_kv.shape}")
    W_V = _matrix(p.W_V, "W_V", x_kv.shape[-1], f"x_kv {x_kv.shape}")
    dim = _heads_of(W_Q.shape[1], heads, "W_Q", "D")
    if W_K.shape[1] != kv_heads * dim:
        raise ValueError(
            f"W_K: expected {kv_heads * dim} columns (num_kv_heads {kv_heads} x D {dim} from "
            f"W_Q {W_Q.shape}), got shape {W_K.shape}"
        )
    vdim = _heads_of(W_V.shape[1], kv_heads, "W_V", "E", "num_kv_heads")
    W_O = _matrix(p.W_O, "W_O", heads * vdim)
    return AttentionParams(
        W_Q,
        W_K,
        W_V,
        W_O,
        _vector(p.b_Q, "b_Q", W_Q.shape[1]),
        _vector(p.b_K, "b_K", W_K.shape[1]),
        _vector(p.b_V, "b_V", W_V.shape[1]),
        _vector(p.b_O, "b_O", W_O.shape[1]),
        heads,
        kv_heads,
    )


def _check_ffn(x, p: FeedForwardParams) -> FeedForwardParams:
    _checks.choice(p.activation, "activation", ACTIVATIONS)
    W1 = _matrix(p.W1, "W1", x.shape[-1], f"x {x.shape}")
    W2 = _matrix(p.W2, "W2", W1.shape[1], f"the hidden layer: W1 {W1.shape}")
    return FeedForwardParams(
        W1, _vector(p.b1, "b1", W1.shape[1]), W2, _vector(p.b2, "b2", W2.shape[1]), p.activation
    )


def _check_norm(width, p: NormParams, prefix="") -> NormParams:
    eps = _checks.real_scalar(p.eps, prefix + "eps")
    if eps < 0:
        raise ValueError(f"{prefix}eps: expected eps >= 0, got {eps!r}")
    return NormParams(
        _vector(p.gamma, prefix + "gamma", width), _vector(p.beta, prefix + "beta", width), eps
    )


def _input(x, name, ndim_min=2):
    return _checks.float_array(x, name, ndim_min=ndim_min)


def _attention_keywords(kwargs: dict) -> dict:
    unknown = sorted(set(kwargs) - set(ATTENTION_KEYWORDS))
    if unknown:
        raise TypeError(
            f"{unknown[0]}: not an attention keyword accepted here; expected some of "
            f"{list(ATTENTION_KEYWORDS)}"
        )
    return kwargs


def _require_finite(arrays: dict) -> None:
    for name, arr in arrays.items():
        if arr is not None and not np.isfinite(_checks.as_float64(arr)).all():
            raise ValueError(
                f"{name}: the exact path needs finite values (shape {arr.shape}, dtype "
                f"{arr.dtype.name}); NaN/Inf are only supported on the float64 path"
            )


def _arrays_of(obj, prefix="") -> dict:
    """Named arrays of a params dataclass (nested), for finiteness checks and conversion."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, np.ndarray):
            out[prefix + f.name] = value
        elif hasattr(value, "__dataclass_fields__"):
            out.update(_arrays_of(value, prefix + f.name + "."))
    return out


def _convert(obj, fn):
    """The params dataclass with every array replaced by ``fn(array)`` (nested)."""
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, np.ndarray):
            changes[f.name] = fn(value)
        elif hasattr(value, "__dataclass_fields__"):
            changes[f.name] = _convert(value, fn)
    return replace(obj, **changes)


# ----------------------------------------------------------------------------- two backends


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
        return 0.5 * x * (1.0 + scipy.special.erf(x / math.sqrt(2.0)))

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
        from .attention import attention  # imported late: refattn.attention imports refattn

        return attention(q, k, v, **kwargs, precision="float64")

    @staticmethod
    def positions(length, dim, base, layout):
        return _positions_float64(length, dim, base, layout)


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
        return g * (0.5 * (1.0 + scipy.special.erf(x / math.sqrt(2.0))) + x * density)

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
        from .attention import attention_vjp  # imported late, as Float64Ops.attention

        return tuple(attention_vjp(q, k, v, g, **kwargs, precision="float64"))[:3]


def _mha(ops, x_q, x_kv, p: AttentionParams, kwargs):
    q = _split_heads(ops.linear(x_q, p.W_Q, p.b_Q), p.num_heads)
    k = _split_heads(ops.linear(x_kv, p.W_K, p.b_K), p.num_kv_heads)
    v = _split_heads(ops.linear(x_kv, p.W_V, p.b_V), p.num_kv_heads)
    return ops.linear(_merge_heads(ops.attention(q, k, v, kwargs)), p.W_O, p.b_O)


def _ffn(ops, x, p: FeedForwardParams):
    return ops.linear(ops.activation(ops.linear(x, p.W1, p.b1), p.activation), p.W2, p.b2)


def _encoder(ops, x, p: EncoderParams, norm, kwargs):
    def attend(h):
        return _mha(ops, h, h, p.attn, kwargs)

    if norm == "post":
        h = ops.layer_norm(x + attend(x), p.norm1)
        return ops.layer_norm(h + _ffn(ops, h, p.ffn), p.norm2)
    h = x + attend(ops.layer_norm(x, p.norm1))
    return h + _ffn(ops, ops.layer_norm(h, p.norm2), p.ffn)


def _decoder(ops, x, memory, p: DecoderParams, norm, self_kwargs, cross_kwargs):
    def self_attend(h):
        return _mha(ops, h, h, p.self_attn, self_kwargs)

    def cross_attend(h):
        return _mha(ops, h, memory, p.cross_attn, cross_kwargs)

    if norm == "post":
        h = ops.layer_norm(x + self_attend(x), p.norm1)
        h = ops.layer_norm(h + cross_attend(h), p.norm2)
        return ops.layer_norm(h + _ffn(ops, h, p.ffn), p.norm3)
    h = x + self_attend(ops.layer_norm(x, p.norm1))
    h = h + cross_attend(ops.layer_norm(h, p.norm2))
    return h + _ffn(ops, ops.layer_norm(h, p.norm3), p.ffn)


def _unchanged(out):
    return out


class Composition(NamedTuple):
    """A validated call of one of this module's functions as a composition of operations.

    ``chain(ops, *inputs.values(), params)`` evaluates it over the operations ``ops``
    (``linear``, ``activation``, ``layer_norm``, ``attention``, ``positions``, and ``+`` of
    values): :class:`Float64Ops` (the float64 path), the exact path's enclosures
    (:class:`refattn.exact.transformer.EnclosureOps`), or error-tracking operations
    (:func:`refattn.bounds.transformer_forward_bound`). ``finish`` maps the chain's value to
    the returned array.
    """

    chain: Callable
    inputs: dict
    params: object
    what: str
    finish: Callable = _unchanged


def _float64(plan: Composition) -> Composition:
    """The composition with its inputs and parameters widened to float64."""
    inputs = {name: _checks.as_float64(a) for name, a in plan.inputs.items()}
    params = plan.params
    if hasattr(params, "__dataclass_fields__"):
        params = _convert(params, _checks.as_float64)
    return plan._replace(inputs=inputs, params=params)


def _run(plan: Composition, precision, out_dtype):
    """Evaluate ``plan`` on the chosen path.

    float64: inputs and params widened to float64. exact: converted to point intervals once,
    the chain enclosed at each working precision, rounded once by the Ziv loop.
    """
    precision = _checks.precision(precision)
    if precision == "float64":
        plan = _float64(plan)
        return plan.finish(plan.chain(Float64Ops, *plan.inputs.values(), plan.params))
    dtype = _checks.out_dtype(out_dtype)
    _require_finite(plan.inputs)
    _require_finite(_arrays_of(plan.params))
    out = X.round_composition(
        plan.chain, list(plan.inputs.values()), plan.params, dtype, plan.what, map_params=_convert
    )
    return plan.finish(out)


# ----------------------------------------------------------------------------- public API


def multihead_attention(
    x_q,
    x_kv,
    W_Q,
    W_K,
    W_V,
    W_O,
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
):
    """Multi-head (self or cross) attention, [L17] "Multihead attention", [AMT] "Self-Attention".

    .. math::

        \\mathrm{multihead}(x_q, x_{kv}) = \\mathrm{concat}(\\mathrm{head}_0, \\dots,
            \\mathrm{head}_{H-1})\\, W_O + b_O, \\qquad
        \\mathrm{head}_h = \\mathrm{attention}(x_q W_Q^{(h)} + b_Q^{(h)},\\;
            x_{kv} W_K^{(g(h))} + b_K^{(g(h))},\\; x_{kv} W_V^{(g(h))} + b_V^{(g(h))})

    where ``W^{(h)}`` is the column block ``h*D:(h+1)*D`` (``h*E:(h+1)*E`` for values) and
    ``g(h)`` the kv head of query head h (``gqa``, as in :func:`refattn.attention`).

    Parameters
    ----------
    x_q : (..., L, M) float array
        Queries' source. ``x_kv``: (..., S, N), or None for self-attention (``x_kv = x_q``).
        Leading dims broadcast.
    W_Q, W_K, W_V, W_O : (M, H*D), (N, K*D), (N, K*E), (H*E, P) float arrays
    b_Q, b_K, b_V, b_O : (H*D,), (K*D,), (K*E,), (P,) float arrays, optional
    num_heads, num_kv_heads : int
        H and K (default K = H; K < H is GQA, K = 1 is MQA).
    precision : {"float64", "exact"}
    out_dtype : dtype, optional
        Exact path only: float64 (default), float32, float16, bfloat16.
    **attention_kwargs
        Any of ``scale, bias, mask, causal, window, align, softcap, alibi_slopes, gqa,
        dropout_mask, dropout_p, empty_rows`` with the meaning of :func:`refattn.attention`;
        ``bias``/``mask`` broadcast to (..., H, L, S). The default scale is ``1/sqrt(D)``
        with D the *per-head* width ([L17]'s ``sqrt(d_k)``).

    Returns
    -------
    (..., L, P) ndarray

    Notes
    -----
    The float64 path projects with BLAS matmuls and calls :func:`refattn.attention`; its
    error is bounded by :func:`refattn.bounds.transformer_forward_bound`. The exact path encloses
    the whole chain (see :mod:`refattn.exact.transformer`) and rounds once.
    [L17]'s masked attention ``softmax((Q^T K + M)/sqrt(d_k))`` with ``M`` in {0, -inf} is
    ``mask=`` here (``bias=-inf`` is the same): excluded keys are removed from the sums.

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> x, eye = np.eye(2), np.eye(2)
    >>> T.multihead_attention(x, None, eye, eye, eye, eye, num_heads=1, scale=0.0).tolist()
    [[0.5, 0.5], [0.5, 0.5]]
    >>> np.round(T.multihead_attention(x, None, eye, eye, eye, eye, num_heads=2), 4).tolist()
    [[0.7311, 0.5], [0.5, 0.7311]]
    """
    plan = _mha_plan(
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
    return _run(plan, precision, out_dtype)


def _mha_plan(
    x_q,
    x_kv,
    W_Q,
    W_K,
    W_V,
    W_O,
    *,
    b_Q=None,
    b_K=None,
    b_V=None,
    b_O=None,
    num_heads,
    num_kv_heads=None,
    **attention_kwargs,
) -> Composition:
    x_q = _input(x_q, "x_q")
    x_kv = x_q if x_kv is None else _input(x_kv, "x_kv")
    params = _check_attention(
        x_q, x_kv, AttentionParams(W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, num_heads, num_kv_heads)
    )
    kwargs = _attention_keywords(attention_kwargs)

    def chain(ops, xq, xkv, p):
        return _mha(ops, xq, xkv, p, kwargs)

    return Composition(chain, {"x_q": x_q, "x_kv": x_kv}, params, "multihead_attention")


def layer_norm(x, *, gamma=None, beta=None, eps=1e-5, axis=-1, precision="float64", out_dtype=None):
    """Layer normalisation, [L17] "Other layers": ``h_i <- g/sigma (h_i - mu)``.

    .. math::

        y_i = \\gamma_i \\frac{x_i - \\mu}{\\sqrt{\\sigma^2 + \\epsilon}} + \\beta_i, \\qquad
        \\mu = \\frac1M \\sum_i x_i, \\quad \\sigma^2 = \\frac1M \\sum_i (x_i - \\mu)^2

    Parameters
    ----------
    x : float array, normalised along ``axis`` (width M)
    gamma, beta : (M,) float arrays, optional
        Gain (the notes' ``g``) and shift (not in the notes; torch/Vaswani). None: 1 and 0.
    eps : float >= 0
        Added to the variance inside the square root (torch ``nn.LayerNorm``), taken at its
        exact binary (float64) value. ``eps=0`` is the notes' formula exactly.
    axis : int
        The normalised axis (its width M must be >= 1).
    precision, out_dtype : as :func:`multihead_attention`

    Notes
    -----
    The variance is the *biased* one (divide by M, the notes' ``1/H``; torch's LayerNorm too).
    Rows with a NaN or Inf give a NaN row on both paths (``inf - inf``); a constant row with
    ``eps=0`` is ``0/0`` = NaN. The float64 path is the two-pass formula (mean, then the
    centred second moment); its error bound is :func:`refattn.bounds.transformer_forward_bound`.
    Rows with max |x| outside [2**-400, 2**400] are first scaled by a power of two (the
    result is scale-invariant), so the squares neither overflow nor underflow: e.g.
    ``[1e200, -1e200, 0]`` gives ``[1.2247..., -1.2247..., 0]`` with a finite bound.
    The exact path computes the mean and variance as exact rationals: only the square root
    is enclosed.

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> T.layer_norm(np.array([1.0, 3.0]), eps=0.0).tolist()
    [-1.0, 1.0]
    >>> T.layer_norm(np.array([1.0, 2.0, 4.0]), precision="exact", out_dtype="float16").dtype
    dtype('float16')
    """
    plan = _layer_norm_plan(x, gamma=gamma, beta=beta, eps=eps, axis=axis)
    precision = _checks.precision(precision)
    if precision == "float64":
        return _run(plan, precision, out_dtype)
    dtype = _checks.out_dtype(out_dtype)
    p = plan.params
    _require_finite({"gamma": p.gamma, "beta": p.beta})
    moved = plan.inputs["x"]
    rows = _checks.as_float64(moved).reshape(-1, moved.shape[-1])
    out = X.round_layer_norm(rows, p.gamma, p.beta, p.eps, dtype)
    return plan.finish(out.reshape(moved.shape))


def _layer_norm_plan(x, *, gamma=None, beta=None, eps=1e-5, axis=-1) -> Composition:
    x = _checks.float_array(x, "x", ndim_min=1)
    axis = _checks.axis(axis)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis: {axis} is out of range for x of shape {x.shape}")
    if x.shape[axis] == 0:
        raise ValueError(
            f"x: the normalised axis {axis} has width 0 (shape {x.shape}); "
            "expected at least one element"
        )
    moved = np.moveaxis(x, axis, -1)
    p = _check_norm(moved.shape[-1], NormParams(gamma, beta, eps))

    def chain(ops, h, params):
        return ops.layer_norm(h, params)

    return Composition(chain, {"x": moved}, p, "layer_norm", lambda out: np.moveaxis(out, -1, axis))


def sinusoidal_positions(
    length, dim, base=10000, layout="interleave", *, precision="float64", out_dtype=None
):
    """Sinusoidal position table, [L17] "Other layers" (positional embedding; Vaswani 2017).

    .. math::

        PE_{pos, 2i} = \\sin(pos / b^{2i/d}), \\qquad PE_{pos, 2i+1} = \\cos(pos / b^{2i/d})

    Parameters
    ----------
    length : int >= 0
        Positions 0 .. length-1.
    dim : even int >= 2
        d (odd widths are rejected: the notes pair every sine with a cosine).
    base : float > 0
        b, taken at its exact binary value (default 10000).
    layout : {"interleave", "concat"}
        "interleave": sine of frequency i at column 2i, cosine at 2i+1 (the notes, Vaswani).
        "concat": all sines (columns 0..d/2-1) then all cosines (d/2..d-1), as in
        tensor2tensor and several other implementations.
    precision, out_dtype : as :func:`multihead_attention`

    Returns
    -------
    (length, dim) ndarray

    Notes
    -----
    float64 path: ``angle = pos * base**(-(2i/d))`` with NumPy's pow, then sin/cos; its
    error bound is :func:`refattn.bounds.transformer_forward_bound` (grows with pos). Other
    implementations compute the frequencies as ``exp(2i * (-log(b)/d))`` (the torch tutorial)
    and round differently; the exact path is the arbiter.
    Exact path: the angles ``pos * exp(-(2i/d) log b)`` are exact reals (2i/d an exact
    rational), and each sin/cos is rounded once.

    Examples
    --------
    >>> import refattn.transformer as T
    >>> T.sinusoidal_positions(2, 2).tolist()
    [[0.0, 1.0], [0.8414709848078965, 0.5403023058681398]]
    """
    plan = _positions_plan(length, dim, base, layout)
    precision = _checks.precision(precision)
    if precision == "float64":
        return _run(plan, precision, out_dtype)
    return X.round_positions(*plan.params, _checks.out_dtype(out_dtype))


def _positions_plan(length, dim, base=10000, layout="interleave") -> Composition:
    length = _nonnegative_int(length, "length")
    dim = _nonnegative_int(dim, "dim")
    if dim < 2 or dim % 2:
        raise ValueError(f"dim: expected an even width >= 2 (sine/cosine pairs), got {dim}")
    base = _checks.real_scalar(base, "base", positive=True)
    _checks.choice(layout, "layout", LAYOUTS)

    def chain(ops, params):
        return ops.positions(*params)

    return Composition(chain, {}, (length, dim, base, layout), "sinusoidal_positions")


def _nonnegative_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return int(value)


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


def _positions_float64(length, dim, base, layout):
    half = dim // 2
    inv_freq = np.power(base, -(2.0 * np.arange(half)) / dim)
    angle = np.arange(length, dtype=np.float64)[:, None] * inv_freq
    return _positions_layout(np.sin(angle), np.cos(angle), layout)


def feed_forward(x, W1, b1, W2, b2, activation="relu", *, precision="float64", out_dtype=None):
    """Position-wise feed-forward ([AMT] "Transformers": "a set of standard MLPs").

    .. math:: \\mathrm{FFN}(x) = \\mathrm{act}(x W_1 + b_1) W_2 + b_2

    Parameters
    ----------
    x : (..., L, M) float array
    W1, b1, W2, b2 : (M, F), (F,) or None, (F, P), (P,) or None
    activation : {"relu", "gelu"}
        "gelu" is the exact-erf form ``x/2 (1 + erf(x/sqrt 2))`` (torch ``approximate="none"``),
        *not* the tanh approximation.
    precision, out_dtype : as :func:`multihead_attention`

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> T.feed_forward(np.array([[1.0, -1.0]]), np.eye(2), None, np.eye(2), None).tolist()
    [[1.0, 0.0]]
    """
    return _run(_ffn_plan(x, W1, b1, W2, b2, activation), precision, out_dtype)


def _ffn_plan(x, W1, b1, W2, b2, activation="relu") -> Composition:
    x = _input(x, "x", ndim_min=1)
    params = _check_ffn(x, FeedForwardParams(W1, b1, W2, b2, activation))
    return Composition(_ffn, {"x": x}, params, "feed_forward")


def encoder_block(
    x,
    params: EncoderParams,
    *,
    norm="post",
    mask=None,
    precision="float64",
    out_dtype=None,
    **attention_kwargs,
):
    """One Transformer encoder block ([AMT] "Transformers", Figure 2; Vaswani 2017).

    .. math::

        \\text{post:}\\; h = \\mathrm{LN}_1(x + \\mathrm{MHA}(x)),\\;
            y = \\mathrm{LN}_2(h + \\mathrm{FFN}(h)) \\qquad
        \\text{pre:}\\; h = x + \\mathrm{MHA}(\\mathrm{LN}_1(x)),\\;
            y = h + \\mathrm{FFN}(\\mathrm{LN}_2(h))

    Parameters
    ----------
    x : (..., L, M) float array
    params : EncoderParams
        ``attn`` maps width M to M (P = M), ``ffn`` M -> F -> M.
    norm : {"post", "pre"}
        "post" (default) is the lectures' and Vaswani's block. "pre" (GPT-2 style) adds no
        final norm: in pre-LN stacks that norm follows the last block, not each block.
    mask : bool array broadcastable to (..., H, L, L), optional (True = attend)
    precision, out_dtype : as :func:`multihead_attention`
    **attention_kwargs
        Further keywords for the self-attention (as :func:`multihead_attention`).

    Notes
    -----
    No dropout (inference). The exact path is the exact value of the whole block, rounded
    once.

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> p = T.random_encoder_params(4, 2, 8, seed=0)
    >>> T.encoder_block(np.ones((3, 4)), p).shape
    (3, 4)
    """
    plan = _encoder_plan(x, params, norm=norm, mask=mask, **attention_kwargs)
    return _run(plan, precision, out_dtype)


def _encoder_plan(x, params, *, norm="post", mask=None, **attention_kwargs) -> Composition:
    x = _input(x, "x")
    _checks.choice(norm, "norm", NORMS)
    params = _check_encoder(x, params)
    kwargs = _attention_keywords(dict(attention_kwargs, mask=mask))

    def chain(ops, h, p):
        return _encoder(ops, h, p, norm, kwargs)

    return Composition(chain, {"x": x}, params, "encoder_block")


def _check_encoder(x, p):
    if not isinstance(p, EncoderParams):
        raise TypeError(f"params: expected an EncoderParams, got {type(p).__name__}")
    width = x.shape[-1]
    attn = _check_attention(x, x, p.attn)
    _check_model_width(attn.W_O, width, "params.attn.W_O")
    ffn = _check_ffn(x, p.ffn)
    _check_model_width(ffn.W2, width, "params.ffn.W2")
    return EncoderParams(
        attn,
        ffn,
        _check_norm(width, p.norm1, "params.norm1."),
        _check_norm(width, p.norm2, "params.norm2."),
    )


def _check_model_width(W, width, name):
    if W.shape[1] != width:
        raise ValueError(
            f"{name}: a residual block needs output width M = {width}, got shape {W.shape}"
        )


def decoder_block(
    x,
    memory,
    params: DecoderParams,
    *,
    norm="post",
    self_mask=None,
    memory_mask=None,
    precision="float64",
    out_dtype=None,
):
    """One Transformer decoder block ([L17] "Masked Multi-head attention"; Vaswani 2017).

    .. math::

        \\text{post:}\\; h_1 = \\mathrm{LN}_1(x + \\mathrm{MHA}_{causal}(x, x)),\\;
        h_2 = \\mathrm{LN}_2(h_1 + \\mathrm{MHA}(h_1, m)),\\;
        y = \\mathrm{LN}_3(h_2 + \\mathrm{FFN}(h_2))

    ("pre": ``h_1 = x + MHA_causal(LN_1 x)``, ``h_2 = h_1 + MHA(LN_2 h_1, m)``,
    ``y = h_2 + FFN(LN_3 h_2)``; the memory m is not normalised by the block.)

    Parameters
    ----------
    x : (..., L, M) float array
    memory : (..., S, N) float array (the encoder output)
    params : DecoderParams
    norm : {"post", "pre"}
    self_mask : bool array broadcastable to (..., H, L, L), optional
        Combined (AND) with the causal mask ``j <= i`` (top-left aligned), which is always on.
    memory_mask : bool array broadcastable to (..., H, L, S), optional
    precision, out_dtype : as :func:`multihead_attention`

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> p = T.random_decoder_params(4, 2, 8, seed=0)
    >>> T.decoder_block(np.ones((3, 4)), np.ones((5, 4)), p).shape
    (3, 4)
    """
    plan = _decoder_plan(x, memory, params, norm=norm, self_mask=self_mask, memory_mask=memory_mask)
    return _run(plan, precision, out_dtype)


def _decoder_plan(x, memory, params, *, norm="post", self_mask=None, memory_mask=None):
    x = _input(x, "x")
    memory = _input(memory, "memory")
    _checks.choice(norm, "norm", NORMS)
    params = _check_decoder(x, memory, params)
    self_kwargs = {"mask": self_mask, "causal": True}
    cross_kwargs = {"mask": memory_mask}

    def chain(ops, h, m, p):
        return _decoder(ops, h, m, p, norm, self_kwargs, cross_kwargs)

    return Composition(chain, {"x": x, "memory": memory}, params, "decoder_block")


def _check_decoder(x, memory, p):
    if not isinstance(p, DecoderParams):
        raise TypeError(f"params: expected a DecoderParams, got {type(p).__name__}")
    width = x.shape[-1]
    self_attn = _check_attention(x, x, p.self_attn)
    _check_model_width(self_attn.W_O, width, "params.self_attn.W_O")
    cross_attn = _check_attention(x, memory, p.cross_attn)
    _check_model_width(cross_attn.W_O, width, "params.cross_attn.W_O")
    ffn = _check_ffn(x, p.ffn)
    _check_model_width(ffn.W2, width, "params.ffn.W2")
    norms = [_check_norm(width, getattr(p, n), f"params.{n}.") for n in ("norm1", "norm2", "norm3")]
    return DecoderParams(self_attn, cross_attn, ffn, *norms)


def composition(function, *args, **kwargs) -> Composition:
    """The validated float64 composition that ``function(*args, **kwargs)`` evaluates.

    ``function`` is one of :func:`multihead_attention`, :func:`layer_norm`,
    :func:`sinusoidal_positions`, :func:`feed_forward`, :func:`encoder_block`,
    :func:`decoder_block`; the arguments are validated as by the function (without
    ``precision``/``out_dtype``) and widened to float64. Evaluating the result over
    :class:`Float64Ops` gives the function's float64 path; over other operations, another
    analysis of the same computation (:func:`refattn.bounds.transformer_forward_bound`).

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> plan = T.composition(T.layer_norm, np.array([1.0, 3.0]), eps=0.0)
    >>> plan.finish(plan.chain(T.Float64Ops, *plan.inputs.values(), plan.params)).tolist()
    [-1.0, 1.0]
    """
    plans = {
        multihead_attention: _mha_plan,
        layer_norm: _layer_norm_plan,
        sinusoidal_positions: _positions_plan,
        feed_forward: _ffn_plan,
        encoder_block: _encoder_plan,
        decoder_block: _decoder_plan,
    }
    if function not in plans:
        names = ", ".join(f.__name__ for f in plans)
        raise ValueError(
            f"function: expected one of {names} of refattn.transformer, got {function!r}"
        )
    return _float64(plans[function](*args, **kwargs))


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
    plan = _float64(plan)
    g = _checks.as_float64(_checks.float_array(grad_out, "grad_out"))
    inputs = list(plan.inputs.values())
    if precision == "float64":
        flat = backward_pass(
            Tape(Float64VJPOps()), plan.chain, inputs, plan.params, g, _unchanged, _convert
        )
    else:
        _require_finite(dict(plan.inputs, grad_out=g))
        _require_finite(_arrays_of(plan.params))
        names = list(_arrays_of(plan.params))
        zeros = {len(inputs) + k for k, name in enumerate(names) if name in zero_names}
        flat = X.round_vjp(
            plan.chain,
            inputs,
            plan.params,
            g,
            _checks.out_dtype(out_dtype),
            plan.what + "_vjp",
            map_params=_convert,
            zero_arrays=zeros,
        )
    rest = iter(flat[len(inputs) :])
    return flat[: len(inputs)], _convert(plan.params, lambda _: next(rest))


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
    plan = _layer_norm_plan(x, gamma=gamma, beta=beta, eps=eps, axis=axis)
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
    plan = _ffn_plan(x, W1, b1, W2, b2, activation)
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
    plan = _mha_plan(
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
    >>> p = T.random_encoder_params(4, 2, 8, seed=0)
    >>> grads = T.encoder_block_vjp(np.ones((3, 4)), p, np.ones((3, 4)))
    >>> grads.dx.shape, grads.dparams.ffn.W1.shape
    ((3, 4), (4, 8))
    """
    plan = _encoder_plan(x, params, norm=norm, mask=mask, **attention_kwargs)
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
    >>> p = T.random_decoder_params(4, 2, 8, seed=0)
    >>> grads = T.decoder_block_vjp(np.ones((3, 4)), np.ones((5, 4)), p, np.ones((3, 4)))
    >>> grads.dmemory.shape, grads.dparams.cross_attn.W_K.shape
    ((5, 4), (4, 4))
    """
    plan = _decoder_plan(x, memory, params, norm=norm, self_mask=self_mask, memory_mask=memory_mask)
    (dx, dmemory), dparams = _vjp(
        plan, grad_out, precision, out_dtype, _key_bias_zeros({}, "self_attn.", "cross_attn.")
    )
    return DecoderGrads(dx, dmemory, dparams)


# ----------------------------------------------------------------------------- random params


def _normal(rng, shape, std, dtype):
    return (rng.standard_normal(shape) * std).astype(dtype)


def random_attention_params(
    model_dim,
    num_heads,
    *,
    seed,
    num_kv_heads=None,
    head_dim=None,
    kv_dim=None,
    out_dim=None,
    bias=True,
    dtype="float64",
):
    """Random :class:`AttentionParams`: weights N(0, 1/fan_in), biases N(0, 0.1^2).

    ``head_dim`` D = E defaults to ``model_dim // num_heads``; ``kv_dim`` N and ``out_dim`` P
    default to ``model_dim``. Values are drawn in float64 and cast to ``dtype`` (the cast
    values are then the exact inputs of the exact path).
    """
    rng = np.random.default_rng(seed)
    kv_heads = num_kv_heads or num_heads
    dim = head_dim or max(1, model_dim // num_heads)
    kv_dim = kv_dim or model_dim
    out_dim = out_dim or model_dim

    def b(n):
        return _normal(rng, (n,), 0.1, dtype) if bias else None

    return AttentionParams(
        W_Q=_normal(rng, (model_dim, num_heads * dim), model_dim**-0.5, dtype),
        W_K=_normal(rng, (kv_dim, kv_heads * dim), kv_dim**-0.5, dtype),
        W_V=_normal(rng, (kv_dim, kv_heads * dim), kv_dim**-0.5, dtype),
        W_O=_normal(rng, (num_heads * dim, out_dim), (num_heads * dim) ** -0.5, dtype),
        b_Q=b(num_heads * dim),
        b_K=b(kv_heads * dim),
        b_V=b(kv_heads * dim),
        b_O=b(out_dim),
        num_heads=num_heads,
        num_kv_heads=kv_heads,
    )


def _random_ffn(rng, model_dim, ffn_dim, activation, dtype):
    return FeedForwardParams(
        W1=_normal(rng, (model_dim, ffn_dim), model_dim**-0.5, dtype),
        b1=_normal(rng, (ffn_dim,), 0.1, dtype),
        W2=_normal(rng, (ffn_dim, model_dim), ffn_dim**-0.5, dtype),
        b2=_normal(rng, (model_dim,), 0.1, dtype),
        activation=activation,
    )


def _random_norm(rng, model_dim, dtype):
    return NormParams(
        gamma=(1 + _normal(rng, (model_dim,), 0.1, "float64")).astype(dtype),
        beta=_normal(rng, (model_dim,), 0.1, dtype),
    )


def random_encoder_params(
    model_dim, num_heads, ffn_dim, *, seed, num_kv_heads=None, activation="relu", dtype="float64"
):
    """Random :class:`EncoderParams` (see :func:`random_attention_params`); gamma ~ 1 +
    N(0, 0.1^2), beta ~ N(0, 0.1^2), eps = 1e-5. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**32, size=2)
    return EncoderParams(
        attn=random_attention_params(
            model_dim, num_heads, seed=int(seeds[0]), num_kv_heads=num_kv_heads, dtype=dtype
        ),
        ffn=_random_ffn(rng, model_dim, ffn_dim, activation, dtype),
        norm1=_random_norm(rng, model_dim, dtype),
        norm2=_random_norm(rng, model_dim, dtype),
    )


def random_decoder_params(
    model_dim,
    num_heads,
    ffn_dim,
    *,
    seed,
    memory_dim=None,
    num_kv_heads=None,
    activation="relu",
    dtype="float64",
):
    """Random :class:`DecoderParams`; ``memory_dim`` N (default ``model_dim``)."""
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**32, size=2)
    return DecoderParams(
        self_attn=random_attention_params(
            model_dim, num_heads, seed=int(seeds[0]), num_kv_heads=num_kv_heads, dtype=dtype
        ),
        cross_attn=random_attention_params(
            model_dim,
            num_heads,
            seed=int(seeds[1]),
            num_kv_heads=num_kv_heads,
            kv_dim=memory_dim or model_dim,
            dtype=dtype,
        ),
        ffn=_random_ffn(rng, model_dim, ffn_dim, activation, dtype),
        norm1=_random_norm(rng, model_dim, dtype),
        norm2=_random_norm(rng, model_dim, dtype),
        norm3=_random_norm(rng, model_dim, dtype),
    )
