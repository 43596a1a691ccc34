"""Canonical form of an attention call, shared by every path (float64, exact, kernels).

:func:`canonicalize` validates the arguments of :func:`refattn.attention` once and returns an
:class:`AttentionSpec` whose arrays have a flat batch axis: q (B, H, L, D), k (B, K, S, D),
v (B, K, S, E), and bias / mask / dropout_mask as (B, H, L, S) views (zero strides where they
were broadcast, so no (B, H, L, S) copy is made unless a reshape forces one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from . import _checks
from .masks import check_window, offset_of, structural_mask

__all__ = ["AttentionSpec", "canonicalize", "check_cotangent", "GQA_MODES", "EMPTY_ROWS"]

GQA_MODES = ("interleave", "tile")
EMPTY_ROWS = ("zero", "nan")


@dataclass(frozen=True)
class AttentionSpec:
    q: np.ndarray  # (B, H, L, D), input dtype
    k: np.ndarray  # (B, K, S, D)
    v: np.ndarray  # (B, K, S, E)
    batch_shape: tuple
    single_head: bool  # inputs were 2-D: outputs drop the batch and head axes
    scale: float | None  # None: 1/sqrt(D)
    bias: np.ndarray | None  # (B, H, L, S) float64 view
    bias_shape: tuple | None  # the caller's bias shape (dbias has it)
    mask: np.ndarray | None  # (B, H, L, S) bool view
    causal: bool
    window: tuple | None
    align: str
    offset: int
    softcap: float | None
    alibi_slopes: np.ndarray | None  # (H,) float64
    gqa: str
    kv_head: np.ndarray  # (H,) int: kv head read by each query head
    dropout_mask: np.ndarray | None  # (B, H, L, S) bool view
    dropout_p: float
    empty_rows: str

    @property
    def dims(self):
        """(B, H, K, L, S, D, E)."""
        batch, heads, length, dim = self.q.shape
        _, kv_heads, keys, vdim = self.v.shape
        return batch, heads, kv_heads, length, keys, dim, vdim

    @property
    def scale_float(self) -> float:
        """The scale as a float64 (1/sqrt(D) rounded once when defaulted)."""
        return 1.0 / math.sqrt(self.q.shape[-1]) if self.scale is None else self.scale

    @property
    def scale_exact(self):
        """The exact scale: a Fraction, or ("invsqrt", D) when 1/sqrt(D) is irrational."""
        if self.scale is not None:
            return Fraction(self.scale)
        dim = self.q.shape[-1]
        root = math.isqrt(dim)
        return Fraction(1, root) if root * root == dim else ("invsqrt", dim)

    @property
    def keep_scale(self) -> Fraction:
        """1 / (1 - p), exactly."""
        return 1 / (1 - Fraction(self.dropout_p))

    def structural(self, rows=None, cols=None) -> np.ndarray:
        """Causal/window allowed set for the given query rows and key columns."""
        _, _, _, length, keys, _, _ = self.dims
        rows = range(length) if rows is None else rows
        cols = range(keys) if cols is None else cols
        return structural_mask(
            rows, cols, causal=self.causal, window=self.window, offset=self.offset
        )

    def allowed(self, b: int, h: int) -> np.ndarray:
        """Allowed set (L, S) of batch b, query head h (mask, causal, window, finite bias)."""
        allowed = self.structural()
        if self.mask is not None:
            allowed = allowed & self.mask[b, h]
        if self.bias is not None:
            allowed = allowed & ~np.isneginf(self.bias[b, h])
        return allowed

    def alibi(self, h: int) -> np.ndarray | None:
        """ALiBi term -slope_h * |i + o - j| as float64 (L, S), or None."""
        if self.alibi_slopes is None:
            return None
        _, _, _, length, keys, _, _ = self.dims
        dist = np.abs(np.arange(length)[:, None] + self.offset - np.arange(keys)[None, :])
        return -self.alibi_slopes[h] * dist

    def unflatten(self, array: np.ndarray) -> np.ndarray:
        """(B, H, ...) -> batch_shape + (H, ...); for 2-D inputs the head axis is dropped."""
        array = array.reshape(self.batch_shape + array.shape[1:])
        return array[0] if self.single_head else array


def _heads(q, k, v):
    if q.ndim == 2 and k.ndim == 2 and v.ndim == 2:
        return q[None], k[None], v[None], True
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.ndim < 3:
            raise ValueError(
                f"{name}: expected shape (..., heads, length, features) (or 2-D q, k, v for a "
                f"single head), got shape {arr.shape} with q {q.shape}, k {k.shape}, v {v.shape}"
            )
    return q, k, v, False


def _check_core_shapes(q, k, v):
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
    return heads, kv_heads, length, keys


def _flat(arr: np.ndarray, batch_shape: tuple, tail: tuple) -> np.ndarray:
    full = np.broadcast_to(arr, batch_shape + tail)
    # an explicit batch size: reshape(-1, ...) is ambiguous when a trailing size is 0
    return full.reshape((int(np.prod(batch_shape)),) + tail) if batch_shape else full[None]


def _plane_array(value, name, batch_shape, plane, kind):
    if value is None:
        return None, None
    arr = _checks.bool_array(value, name) if kind == "bool" else _checks.as_float64(
        _checks.float_array(value, name))
    target = batch_shape + plane
    return _flat(_checks.broadcast(arr, target, name, "(..., H, L, S)"), batch_shape, plane), \
        arr.shape


def canonicalize(
    q, k, v, *, scale=None, bias=None, mask=None, causal=False, window=None,
    align="top_left", softcap=None, alibi_slopes=None, gqa="interleave",
    dropout_mask=None, dropout_p=0.0, empty_rows="zero",
) -> AttentionSpec:
    """Validate refattn.attention's arguments and return the canonical :class:`AttentionSpec`."""
    q = _checks.float_array(q, "q")
    k = _checks.float_array(k, "k")
    v = _checks.float_array(v, "v")
    q, k, v, single = _heads(q, k, v)
    heads, kv_heads, length, keys = _check_core_shapes(q, k, v)
    try:
        batch_shape = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except ValueError:
        raise ValueError(
            f"q, k, v: leading (batch) dims do not broadcast: q {q.shape}, k {k.shape}, "
            f"v {v.shape}"
        ) from None
    plane = (heads, length, keys)
    bias_flat, bias_shape = _plane_array(bias, "bias", batch_shape, plane, "float")
    mask_flat, _ = _plane_array(mask, "mask", batch_shape, plane, "bool")
    drop_flat, _ = _plane_array(dropout_mask, "dropout_mask", batch_shape, plane, "bool")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, int | float | np.floating):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:  # compared exactly (a huge int does not overflow)
        raise ValueError(f"dropout_p: expected a value in [0, 1), got {dropout_p!r}")
    if dropout_p > 0 and dropout_mask is None:
        raise ValueError(
            "dropout_mask: dropout is deterministic in refattn; dropout_p > 0 needs a boolean "
            "keep-mask broadcastable to (..., H, L, S)"
        )
    if softcap is not None:
        softcap = _checks.real_scalar(softcap, "softcap", positive=True)
    if scale is not None:
        scale = _checks.real_scalar(scale, "scale")
    slopes = None
    if alibi_slopes is not None:
        slopes = _checks.as_float64(_checks.float_array(alibi_slopes, "alibi_slopes"))
        if slopes.shape != (heads,):
            raise ValueError(
                f"alibi_slopes: expected shape ({heads},) (one slope per query head), "
                f"got {slopes.shape}"
            )
        if not np.isfinite(slopes).all():
            raise ValueError("alibi_slopes: slopes must be finite")
    _checks.choice(gqa, "gqa", GQA_MODES)
    _checks.choice(empty_rows, "empty_rows", EMPTY_ROWS)
    if not isinstance(causal, bool | np.bool_):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    group = heads // kv_heads
    kv_head = np.arange(heads) // group if gqa == "interleave" else np.arange(heads) % kv_heads
    spec = AttentionSpec(
        q=_flat(q, batch_shape, q.shape[-3:]),
        k=_flat(k, batch_shape, k.shape[-3:]),
        v=_flat(v, batch_shape, v.shape[-3:]),
        batch_shape=tuple(batch_shape), single_head=single, scale=scale,
        bias=bias_flat, bias_shape=bias_shape, mask=mask_flat, causal=bool(causal),
        window=check_window(window), align=align, offset=offset_of(align, length, keys),
        softcap=softcap, alibi_slopes=slopes, gqa=gqa, kv_head=kv_head,
        dropout_mask=drop_flat, dropout_p=float(dropout_p), empty_rows=empty_rows,
    )
    _check_bias_values(spec)
    return spec


def _check_bias_values(spec: AttentionSpec) -> None:
    """NaN or +inf bias at an allowed position is an error (it has no meaningful weight)."""
    if spec.bias is None:
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


def check_cotangent(spec: AttentionSpec, grad, name: str, tail_shape: tuple) -> np.ndarray:
    """A cotangent (``grad_out`` or ``grad_lse``) checked against the output's shape and
    flattened like the spec: (B, *tail_shape), float64."""
    grad = _checks.as_float64(_checks.float_array(grad, name))
    expected = spec.batch_shape + tail_shape if not spec.single_head else tail_shape[1:]
    if grad.shape != expected:
        raise ValueError(f"{name}: expected shape {expected} (the output's), got {grad.shape}")
    return grad.reshape((spec.q.shape[0],) + tail_shape)
