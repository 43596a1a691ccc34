"""Parameters of the transformer pieces and their validation (:mod:`refattn.transformer`).

The parameter dataclasses (weights of one attention layer, feed-forward layer, layer norm,
encoder and decoder block), the option names each function accepts, and the checks every
public function runs on its arguments before either path sees them (shapes in the letters of
:mod:`refattn.transformer`; every error names the argument and its shape).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from .. import _checks
from ..spec import OPTIONS

ACTIVATIONS = ("relu", "gelu")
NORMS = ("post", "pre")
LAYOUTS = ("interleave", "concat")
#: The options of :func:`refattn.attention` the transformer functions pass through (their
#: ``**attention_kwargs``): the rows of :data:`refattn.spec.OPTIONS` marked ``core``.
ATTENTION_KEYWORDS = tuple(option.name for option in OPTIONS if option.core)


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


def check_attention(
    x_q, x_kv, p: AttentionParams, prefix="", sources=("x_q", "x_kv")
) -> AttentionParams:
    """Validate shapes; returns the params with arrays (input dtypes kept). Errors name each
    field as ``prefix + field`` (e.g. ``params.cross_attn.W_K``) and the inputs by
    ``sources``, the names the caller gave them."""
    q_name, kv_name = sources
    heads = _count(p.num_heads, prefix + "num_heads")
    kv_heads = heads if p.num_kv_heads is None else _count(p.num_kv_heads, prefix + "num_kv_heads")
    if heads % kv_heads:
        raise ValueError(
            f"{prefix}num_heads: {heads} is not a multiple of num_kv_heads {kv_heads} (GQA needs "
            "H % K == 0)"
        )
    W_Q = _matrix(p.W_Q, prefix + "W_Q", x_q.shape[-1], f"{q_name} {x_q.shape}")
    W_K = _matrix(p.W_K, prefix + "W_K", x_kv.shape[-1], f"{kv_name} {x_kv.shape}")
    W_V = _matrix(p.W_V, prefix + "W_V", x_kv.shape[-1], f"{kv_name} {x_kv.shape}")
    dim = _heads_of(W_Q.shape[1], heads, prefix + "W_Q", "D", prefix + "num_heads")
    if W_K.shape[1] != kv_heads * dim:
        raise ValueError(
            f"{prefix}W_K: expected {kv_heads * dim} columns (num_kv_heads {kv_heads} x D {dim} "
            f"from W_Q {W_Q.shape}), got shape {W_K.shape}"
        )
    vdim = _heads_of(W_V.shape[1], kv_heads, prefix + "W_V", "E", prefix + "num_kv_heads")
    W_O = _matrix(p.W_O, prefix + "W_O", heads * vdim)
    return AttentionParams(
        W_Q,
        W_K,
        W_V,
        W_O,
        _vector(p.b_Q, prefix + "b_Q", W_Q.shape[1]),
        _vector(p.b_K, prefix + "b_K", W_K.shape[1]),
        _vector(p.b_V, prefix + "b_V", W_V.shape[1]),
        _vector(p.b_O, prefix + "b_O", W_O.shape[1]),
        heads,
        kv_heads,
    )


def check_ffn(x, p: FeedForwardParams, prefix="") -> FeedForwardParams:
    _checks.choice(p.activation, prefix + "activation", ACTIVATIONS)
    W1 = _matrix(p.W1, prefix + "W1", x.shape[-1], f"x {x.shape}")
    W2 = _matrix(p.W2, prefix + "W2", W1.shape[1], f"the hidden layer: W1 {W1.shape}")
    b1 = _vector(p.b1, prefix + "b1", W1.shape[1])
    return FeedForwardParams(W1, b1, W2, _vector(p.b2, prefix + "b2", W2.shape[1]), p.activation)


def check_norm(width, p: NormParams, prefix="") -> NormParams:
    eps = _checks.real_scalar(p.eps, prefix + "eps")
    if eps < 0:
        raise ValueError(f"{prefix}eps: expected eps >= 0, got {eps!r}")
    return NormParams(
        _vector(p.gamma, prefix + "gamma", width), _vector(p.beta, prefix + "beta", width), eps
    )


def float_input(x, name, ndim_min=2):
    return _checks.float_array(x, name, ndim_min=ndim_min)


def attention_keywords(kwargs: dict) -> dict:
    unknown = sorted(set(kwargs) - set(ATTENTION_KEYWORDS))
    if unknown:
        raise TypeError(
            f"{unknown[0]}: not an attention keyword accepted here; expected some of "
            f"{list(ATTENTION_KEYWORDS)}"
        )
    return kwargs


def require_finite(arrays: dict) -> None:
    for name, arr in arrays.items():
        if arr is not None and not np.isfinite(_checks.as_float64(arr)).all():
            raise ValueError(
                f"{name}: the exact path needs finite values (shape {arr.shape}, dtype "
                f"{arr.dtype.name}); NaN/Inf are only supported on the float64 path"
            )


def arrays_of(obj, prefix="") -> dict:
    """Named arrays of a params dataclass (nested), for finiteness checks and conversion."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, np.ndarray):
            out[prefix + f.name] = value
        elif hasattr(value, "__dataclass_fields__"):
            out.update(arrays_of(value, prefix + f.name + "."))
    return out


def convert(obj, fn):
    """The params dataclass with every array replaced by ``fn(array)`` (nested)."""
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, np.ndarray):
            changes[f.name] = fn(value)
        elif hasattr(value, "__dataclass_fields__"):
            changes[f.name] = convert(value, fn)
    return replace(obj, **changes)


# ----------------------------------------------------------------------------- two backends


def _check_fields(p, kinds: dict) -> None:
    """Each field of a block's params holds the dataclass it needs (else a TypeError naming
    ``params.<field>``, not an AttributeError from inside the chain)."""
    for name, kind in kinds.items():
        value = getattr(p, name)
        if not isinstance(value, kind):
            raise TypeError(f"params.{name}: expected {kind.__name__}, got {type(value).__name__}")


def check_encoder(x, p):
    if not isinstance(p, EncoderParams):
        raise TypeError(f"params: expected an EncoderParams, got {type(p).__name__}")
    _check_fields(
        p,
        {
            "attn": AttentionParams,
            "ffn": FeedForwardParams,
            "norm1": NormParams,
            "norm2": NormParams,
        },
    )
    width = x.shape[-1]
    attn = check_attention(x, x, p.attn, "params.attn.", ("x", "x"))
    _check_model_width(attn.W_O, width, "params.attn.W_O")
    ffn = check_ffn(x, p.ffn, "params.ffn.")
    _check_model_width(ffn.W2, width, "params.ffn.W2")
    return EncoderParams(
        attn,
        ffn,
        check_norm(width, p.norm1, "params.norm1."),
        check_norm(width, p.norm2, "params.norm2."),
    )


def _check_model_width(W, width, name):
    if W.shape[1] != width:
        raise ValueError(
            f"{name}: a residual block needs output width M = {width}, got shape {W.shape}"
        )


def check_decoder(x, memory, p):
    if not isinstance(p, DecoderParams):
        raise TypeError(f"params: expected a DecoderParams, got {type(p).__name__}")
    _check_fields(
        p,
        {
            "self_attn": AttentionParams,
            "cross_attn": AttentionParams,
            "ffn": FeedForwardParams,
            **{norm: NormParams for norm in ("norm1", "norm2", "norm3")},
        },
    )
    width = x.shape[-1]
    self_attn = check_attention(x, x, p.self_attn, "params.self_attn.", ("x", "x"))
    _check_model_width(self_attn.W_O, width, "params.self_attn.W_O")
    cross_attn = check_attention(x, memory, p.cross_attn, "params.cross_attn.", ("x", "memory"))
    _check_model_width(cross_attn.W_O, width, "params.cross_attn.W_O")
    ffn = check_ffn(x, p.ffn, "params.ffn.")
    _check_model_width(ffn.W2, width, "params.ffn.W2")
    norms = [check_norm(width, getattr(p, n), f"params.{n}.") for n in ("norm1", "norm2", "norm3")]
    return DecoderParams(self_attn, cross_attn, ffn, *norms)
