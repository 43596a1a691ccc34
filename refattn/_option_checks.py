"""The checks :func:`refattn.spec.canonicalize` runs: the core shapes of q, k, v and one check
per option *kind* of :data:`refattn.spec.OPTIONS` (a new option of an existing kind needs no
code here).

Every check takes ``(value, name, shape)``, ``shape`` the :class:`CallShape` of the call, and
returns the spec fields it sets (``{name: checked value}``; a bias also sets ``bias_shape``).
The cross-option rule of ``normalizer`` and ``sinks``, and the cotangents of the vjp
(:func:`check_cotangent`, re-exported by :mod:`refattn.spec`) are checked here too.
Shapes in the letters of :mod:`refattn`: B batch, H query heads, K kv heads, L query length,
S key length, D and E the feature sizes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import ml_dtypes
import numpy as np

from . import _checks
from ._qv import fold_qv
from .quantized import dequantize_inputs

#: the supported float dtypes (:data:`refattn._checks.FLOAT_DTYPES`) as dtype objects
_PLAIN_DTYPES = frozenset(np.dtype(getattr(ml_dtypes, n, n)) for n in _checks.FLOAT_DTYPES)
#: the options that dequantise or fold an input (:func:`dequantised`)
_QUANTISED_OPTIONS = (
    "qv",
    "q_descale",
    "k_descale",
    "v_descale",
    "q_block_scale",
    "k_block_scale",
    "v_block_scale",
)


class CallShape(NamedTuple):
    """The sizes an option is checked against: the broadcast batch shape, H, L and S."""

    batch_shape: tuple
    heads: int
    length: int
    keys: int

    @property
    def plane(self) -> tuple:
        """(H, L, S): the trailing shape of a plane option."""
        return (self.heads, self.length, self.keys)


# ------------------------------------------------------------------------- q, k, v themselves
def split_heads(q, k, v):
    """(q, k, v, single): 2-D inputs gain a head axis (``single`` True), others need >= 3-D."""
    if q.ndim == 2 and k.ndim == 2 and v.ndim == 2:
        return q[None], k[None], v[None], True
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.ndim < 3:
            raise ValueError(
                f"{name}: expected shape (..., heads, length, features) (or 2-D q, k, v for a "
                f"single head), got shape {arr.shape} with q {q.shape}, k {k.shape}, v {v.shape}"
            )
    return q, k, v, False


def core_shape(q, k, v) -> CallShape:
    """The :class:`CallShape` of (..., H, L, D), (..., K, S, D), (..., K, S, E) inputs."""
    heads, length, dim = q.shape[-3:]
    kv_heads, keys, kdim = k.shape[-3:]
    if kdim != dim:
        raise ValueError(f"k: feature size {kdim} != q's {dim} (q {q.shape}, k {k.shape})")
    if v.shape[-3:-1] != (kv_heads, keys):
        raise ValueError(
            f"v: expected (..., {kv_heads}, {keys}, E) to match k {k.shape}, got {v.shape}"
        )
    if kv_heads == 0:
        raise ValueError(f"k: expected at least one kv head (K >= 1), got k {k.shape}")
    if heads % kv_heads:
        raise ValueError(
            f"q: {heads} query heads is not a multiple of k's {kv_heads} kv heads "
            f"(q {q.shape}, k {k.shape})"
        )
    if dim == 0:
        raise ValueError(f"q: feature size D must be >= 1, got q {q.shape}")
    try:
        batch_shape = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except ValueError:
        raise ValueError(
            f"q, k, v: leading (batch) dims do not broadcast: q {q.shape}, k {k.shape}, v {v.shape}"
        ) from None
    return CallShape(tuple(batch_shape), heads, length, keys)


def flat(arr: np.ndarray, batch_shape: tuple, tail: tuple) -> np.ndarray:
    """``arr`` broadcast to ``batch_shape + tail`` with one flat batch axis (a read-only view,
    as :func:`numpy.broadcast_to` gives; an array already of that shape is only reshaped, the
    common case, at a fifth of broadcast_to's cost on a decode step)."""
    if arr.shape == batch_shape + tail:
        full = arr.view()
        full.flags.writeable = False
    else:
        full = np.broadcast_to(arr, batch_shape + tail)
    # an explicit batch size: reshape(-1, ...) is ambiguous when a trailing size is 0
    return full.reshape((math.prod(batch_shape),) + tail) if batch_shape else full[None]


def dequantised(q, k, v, values):
    """q, k, v dequantised (the "descale" and "block scale" options: exact, any float8 or
    float4 input becomes its real values) with ``qv`` folded in (:func:`refattn._qv.fold_qv`)."""
    if all(values[name] is None for name in _QUANTISED_OPTIONS) and all(
        type(x) is np.ndarray and x.dtype in _PLAIN_DTYPES for x in (q, k, v)
    ):
        return q, k, v  # plain float arrays and no factor: what dequantize_inputs returns
    descales = (values["q_descale"], values["k_descale"], values["v_descale"])
    blocks = {
        "q": values["q_block_scale"],
        "k": values["k_block_scale"],
        "v": values["v_block_scale"],
    }
    qv, gqa = values["qv"], values["gqa"]
    latent = None
    if qv is not None:  # qv is q's latent part: q's dtype, and q_descale when float8
        raw_qv, raw_q = _checks.as_array(qv, "qv"), _checks.as_array(q, "q")
        if raw_qv.dtype != raw_q.dtype:
            raise TypeError(f"qv: expected q's dtype {raw_q.dtype}, got {raw_qv.dtype}")
        latent = dequantize_inputs(raw_qv, k, v, *descales, gqa, {**blocks, "q": None})[0]
    q, k, v = dequantize_inputs(q, k, v, *descales, gqa, blocks)
    if qv is not None:
        q, k = fold_qv(q, k, v, latent)
    return q, k, v


def kv_heads(gqa: str, heads: int, kv_heads: int) -> np.ndarray:
    """(H,) int: the kv head each query head reads (``gqa``: h // G or h % K)."""
    group = heads // kv_heads
    return np.arange(heads) // group if gqa == "interleave" else np.arange(heads) % kv_heads


# ------------------------------------------------------------------------- one check per kind
def real(value, name, shape) -> dict:
    """kind "float": a real scalar or None."""
    return {name: None if value is None else _checks.real_scalar(value, name)}


def positive(value, name, shape) -> dict:
    """kind "positive float": a real scalar > 0 or None."""
    return {name: None if value is None else _checks.real_scalar(value, name, positive=True)}


def probability(value, name, shape) -> dict:
    """kind "probability": a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
        raise TypeError(f"{name}: expected a float in [0, 1), got {value!r}")
    if not 0.0 <= value < 1.0:  # compared exactly (a huge int does not overflow)
        raise ValueError(f"{name}: expected a value in [0, 1), got {value!r}")
    return {name: float(value)}


def flag(value, name, shape) -> dict:
    """kind "bool": a Python or NumPy bool."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return {name: bool(value)}


def float_plane(value, name, shape) -> dict:
    """kind "float plane": float64 (B, H, L, S) view of an array broadcastable to
    (..., H, L, S), and the caller's shape (``<name>_shape``: its gradient has it)."""
    if value is None:
        return {name: None, f"{name}_shape": None}
    arr = _checks.as_float64(_checks.float_array(value, name))
    return {name: _plane(arr, name, shape), f"{name}_shape": arr.shape}


def bool_plane(value, name, shape) -> dict:
    """kind "bool plane": bool (B, H, L, S) view of an array broadcastable to (..., H, L, S)."""
    if value is None:
        return {name: None}
    return {name: _plane(_checks.bool_array(value, name), name, shape)}


def _plane(arr, name, shape):
    target = shape.batch_shape + shape.plane
    broadcast = _checks.broadcast(arr, target, name, "(..., H, L, S)")
    return flat(broadcast, shape.batch_shape, shape.plane)


def per_head(unit: str):
    """kind "per-head": the check of a finite float64 (H,) array, one ``unit`` per query head."""

    def check(value, name, shape) -> dict:
        if value is None:
            return {name: None}
        values = _checks.as_float64(_checks.float_array(value, name))
        if values.shape != (shape.heads,):
            raise ValueError(
                f"{name}: expected shape ({shape.heads},) (one {unit} per query head), "
                f"got {values.shape}"
            )
        if not np.isfinite(values).all():
            raise ValueError(f"{name}: expected finite {unit}s")
        return {name: values}

    return check


def per_batch_length(value, name, shape) -> dict:
    """kind "per-batch": int64 (B,) key lengths with 0 <= S_b <= S, or None."""
    if value is None:
        return {name: None}
    lengths = _checks.as_array(value, name)
    batch_shape, keys = shape.batch_shape, shape.keys
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {lengths.dtype.name}")
    if lengths.shape != batch_shape:
        raise ValueError(
            f"{name}: expected shape {batch_shape} (one length per batch row), got {lengths.shape}"
        )
    if lengths.size and (lengths.min() < 0 or lengths.max() > keys):
        raise ValueError(
            f"{name}: expected lengths in [0, S = {keys}], got values in "
            f"[{lengths.min()}, {lengths.max()}]"
        )
    wide = lengths.astype(np.int64)
    return {name: wide.reshape(-1) if batch_shape else wide.reshape(1)}


def choice(choices):
    """kind "choice": the check of one of ``choices``."""

    def check(value, name, shape) -> dict:
        return {name: _checks.choice(value, name, choices)}

    return check


def bad_bias_values(spec) -> None:
    """NaN or +inf bias at an allowed position is an error (it has no meaningful weight)."""
    if spec.bias is None:
        return
    # the distinct elements first (a broadcast bias, e.g. a scalar, has zero strides): most
    # calls have no NaN/+inf bias at all, and only those that do look plane by plane
    distinct = spec.bias[
        tuple(slice(0, 1) if step == 0 else slice(None) for step in spec.bias.strides)
    ]
    if not (np.isnan(distinct) | (distinct == np.inf)).any():
        return
    batch, heads = spec.bias.shape[:2]
    for b in range(batch):
        for h in range(heads):
            plane = spec.bias[b, h]
            bad = np.isnan(plane) | np.isposinf(plane)
            if bad.any():
                bad &= spec.allowed(b, h)
                if bad.any():
                    i, j = np.argwhere(bad)[0]
                    raise ValueError(
                        f"bias: {plane[i, j]} at an allowed position (batch {b}, head {h}, "
                        f"row {i}, key {j}); NaN/+inf bias is only allowed where masked"
                    )


def normalizer(value, sinks, choices) -> None:
    """``normalizer`` is one of ``choices``; sinks need a normaliser to join."""
    _checks.choice(value, "normalizer", choices)
    if value == "sigmoid" and sinks is not None:
        raise ValueError(
            "sinks: normalizer='sigmoid' has no normaliser for a sink to join (each weight is "
            "sigmoid(t_ij) on its own); pass sinks only with normalizer='softmax'"
        )


def check_cotangent(spec, grad, name: str, tail_shape: tuple) -> np.ndarray:
    """A cotangent (``grad_out`` or ``grad_lse``) checked against the output's shape and
    flattened like the spec: (B, *tail_shape), float64."""
    grad = _checks.as_float64(_checks.float_array(grad, name))
    expected = spec.batch_shape + tail_shape if not spec.single_head else tail_shape[1:]
    if grad.shape != expected:
        raise ValueError(f"{name}: expected shape {expected} (the output's), got {grad.shape}")
    return grad.reshape((spec.q.shape[0],) + tail_shape)
