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

__all__ = [
    "AttentionSpec",
    "canonicalize",
    "check_cotangent",
    "GQA_MODES",
    "EMPTY_ROWS",
    "FP8_DTYPES",
]

GQA_MODES = ("interleave", "tile")
EMPTY_ROWS = ("zero", "nan")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


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
    kv_lengths: np.ndarray | None = None  # (B,) int64: keys j >= kv_lengths[b] excluded
    sinks: np.ndarray | None = None  # (H,) float64: a logit added to every row's normaliser
    # set by refattn._fold for the exact paths only (None on canonical specs):
    alibi_offsets: np.ndarray | None = None  # (B,) int64: ALiBi's o_b, overriding row_offset
    alibi_keys: int | None = None  # ALiBi applies to keys j < alibi_keys (a folded sink: none)
    dbias_index: np.ndarray | None = None  # (B, H, L, S) int64 slot of each dS in dbias (-1: none)

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

    def row_offset(self, b: int = 0) -> int:
        """The alignment offset o of batch row b: with ``kv_lengths``, ``align="bottom_right"``
        aligns to the row's own key length (o = S_b - L), else o is :attr:`offset`."""
        if self.kv_lengths is None:
            return self.offset
        length = self.q.shape[-2]
        return offset_of(self.align, length, int(self.kv_lengths[b]))

    def structural(self, rows=None, cols=None, b: int = 0) -> np.ndarray:
        """Causal/window (and key-length) allowed set of batch row b for the given query rows
        and key columns."""
        _, _, _, length, keys, _, _ = self.dims
        rows = range(length) if rows is None else rows
        cols = range(keys) if cols is None else cols
        allowed = structural_mask(
            rows, cols, causal=self.causal, window=self.window, offset=self.row_offset(b)
        )
        if self.kv_lengths is not None:
            allowed &= np.asarray(cols)[None, :] < self.kv_lengths[b]
        return allowed

    def allowed(self, b: int, h: int) -> np.ndarray:
        """Allowed set (L, S) of batch b, query head h (mask, causal, window, key length,
        finite bias)."""
        allowed = self.structural(b=b)
        if self.mask is not None:
            allowed = allowed & self.mask[b, h]
        if self.bias is not None:
            allowed = allowed & ~np.isneginf(self.bias[b, h])
        return allowed

    def alibi_offset(self, b: int = 0) -> int:
        """ALiBi's offset o_b of batch row b: :meth:`row_offset`, unless a folded spec pins it
        (:attr:`alibi_offsets`, the rows' offsets before their key lengths became a mask)."""
        return self.row_offset(b) if self.alibi_offsets is None else int(self.alibi_offsets[b])

    def alibi_distance(self, b: int = 0) -> np.ndarray:
        """|i + o_b - j| as int64 (L, S): the ALiBi distance of batch row b (0 for the keys
        j >= :attr:`alibi_keys` of a folded spec: a sink has no position)."""
        _, _, _, length, keys, _, _ = self.dims
        dist = np.abs(np.arange(length)[:, None] + self.alibi_offset(b) - np.arange(keys)[None, :])
        if self.alibi_keys is not None:
            dist[:, self.alibi_keys :] = 0
        return dist

    def dbias_slots(self) -> tuple[np.ndarray, tuple]:
        """(index, shape): the slot of dbias (flat, C order of ``shape``) that each dS_ij of
        the (B, H, L, S) plane adds to, -1 where none, and dbias's shape. By default
        ``shape`` is :attr:`bias_shape` and the slots sum over bias's broadcast dimensions; a
        folded spec (:attr:`dbias_index`) sends a sink's column to its own slots (dsinks)."""
        batch, heads, _, length, keys, _, _ = self.dims
        if self.dbias_index is not None:
            return (
                np.broadcast_to(self.dbias_index, (batch, heads, length, keys)),
                self.bias_shape,
            )
        shape = tuple(self.bias_shape)
        full = tuple(self.batch_shape) + (heads, length, keys)
        index = np.broadcast_to(np.arange(int(np.prod(shape))).reshape(shape), full)
        return index.reshape((batch, heads, length, keys)), shape

    def alibi(self, h: int, b: int = 0) -> np.ndarray | None:
        """ALiBi term -slope_h * |i + o_b - j| as float64 (L, S), or None."""
        if self.alibi_slopes is None:
            return None
        return -self.alibi_slopes[h] * self.alibi_distance(b)

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
    arr = (
        _checks.bool_array(value, name)
        if kind == "bool"
        else _checks.as_float64(_checks.float_array(value, name))
    )
    target = batch_shape + plane
    return _flat(
        _checks.broadcast(arr, target, name, "(..., H, L, S)"), batch_shape, plane
    ), arr.shape


def canonicalize(
    q,
    k,
    v,
    *,
    scale=None,
    bias=None,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    softcap=None,
    alibi_slopes=None,
    gqa="interleave",
    dropout_mask=None,
    dropout_p=0.0,
    empty_rows="zero",
    sinks=None,
    kv_lengths=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
) -> AttentionSpec:
    """Validate refattn.attention's arguments and return the canonical :class:`AttentionSpec`."""
    q, k, v = _dequantize(q, k, v, q_descale, k_descale, v_descale, gqa)
    q, k, v, single = _heads(q, k, v)
    heads, kv_heads, length, keys = _check_core_shapes(q, k, v)
    try:
        batch_shape = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except ValueError:
        raise ValueError(
            f"q, k, v: leading (batch) dims do not broadcast: q {q.shape}, k {k.shape}, v {v.shape}"
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
    sink_values = None
    if sinks is not None:
        sink_values = _checks.as_float64(_checks.float_array(sinks, "sinks"))
        if sink_values.shape != (heads,):
            raise ValueError(
                f"sinks: expected shape ({heads},) (one logit per query head), "
                f"got {sink_values.shape}"
            )
        if not np.isfinite(sink_values).all():
            raise ValueError("sinks: expected finite logits")
    lengths = _kv_lengths(kv_lengths, batch_shape, keys)
    spec = AttentionSpec(
        q=_flat(q, batch_shape, q.shape[-3:]),
        k=_flat(k, batch_shape, k.shape[-3:]),
        v=_flat(v, batch_shape, v.shape[-3:]),
        batch_shape=tuple(batch_shape),
        single_head=single,
        scale=scale,
        bias=bias_flat,
        bias_shape=bias_shape,
        mask=mask_flat,
        causal=bool(causal),
        window=check_window(window),
        align=align,
        offset=offset_of(align, length, keys),
        softcap=softcap,
        alibi_slopes=slopes,
        gqa=gqa,
        kv_head=kv_head,
        dropout_mask=drop_flat,
        dropout_p=float(dropout_p),
        empty_rows=empty_rows,
        kv_lengths=lengths,
        sinks=sink_values,
    )
    _check_bias_values(spec)
    return spec


def _kv_lengths(kv_lengths, batch_shape, keys):
    """``kv_lengths`` as an int64 (B,) array with 0 <= S_b <= S, or None."""
    if kv_lengths is None:
        return None
    lengths = _checks.as_array(kv_lengths, "kv_lengths")
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"kv_lengths: expected integers, got dtype {lengths.dtype.name}")
    if lengths.shape != tuple(batch_shape):
        raise ValueError(
            f"kv_lengths: expected shape {tuple(batch_shape)} (one length per "
            f"batch row), got {lengths.shape}"
        )
    if lengths.size and (lengths.min() < 0 or lengths.max() > keys):
        raise ValueError(
            f"kv_lengths: expected lengths in [0, S = {keys}], got values in "
            f"[{lengths.min()}, {lengths.max()}]"
        )
    return (
        lengths.astype(np.int64).reshape(-1) if batch_shape else lengths.astype(np.int64).reshape(1)
    )


def _dequantize(q, k, v, q_descale, k_descale, v_descale, gqa):
    """q, k, v as float arrays; fp8 inputs (ml_dtypes float8_e4m3fn / float8_e5m2) times their
    float32 descale factors, exactly (a float8 significand has at most 4 bits and a float32
    one 24: the product needs at most 28 of float64's 53 and stays in its range), as
    float64."""
    arrays = {}
    for name, x, descale in (("q", q, q_descale), ("k", k, k_descale), ("v", v, v_descale)):
        raw = _checks.as_array(x, name) if x is not None else None
        if raw is not None and raw.dtype.name in FP8_DTYPES:
            arrays[name] = (raw, descale)
        else:
            if descale is not None:
                raise ValueError(
                    f"{name}_descale: only float8 inputs take a descale factor "
                    f"({name} has dtype {getattr(raw, 'dtype', None)})"
                )
            arrays[name] = (_checks.float_array(x, name), None)
    if all(d is None and a.dtype.name not in FP8_DTYPES for a, d in arrays.values()):
        return arrays["q"][0], arrays["k"][0], arrays["v"][0]
    kv_heads = arrays["k"][0].shape[-3] if arrays["k"][0].ndim >= 3 else 1
    heads = arrays["q"][0].shape[-3] if arrays["q"][0].ndim >= 3 else 1
    out = []
    for name in ("q", "k", "v"):
        raw, descale = arrays[name]
        if raw.dtype.name not in FP8_DTYPES:
            out.append(raw)
            continue
        values = raw.astype(np.float64)  # exact: every float8 value is a float64
        if descale is not None:
            kind = _checks.float_array(descale, f"{name}_descale").dtype.name
            if kind != "float32":  # float64 factors could make the product round
                raise TypeError(
                    f"{name}_descale: expected float32 factors (FlashAttention 3's "
                    f"descale type), got {kind}"
                )
            factor = _checks.as_float64(np.asarray(descale))
            if not np.isfinite(factor).all() or (factor <= 0).any():
                raise ValueError(f"{name}_descale: expected finite positive factors")
            per_head = factor[..., None, None] if factor.ndim else factor
            if factor.ndim:
                if factor.shape[-1] != kv_heads:
                    raise ValueError(
                        f"{name}_descale: expected shape (..., K = {kv_heads}) "
                        f"(one factor per batch row and kv head), got "
                        f"{factor.shape}"
                    )
                if name == "q":  # query head h uses the factor of the kv head it reads
                    group = heads // kv_heads
                    reads = (
                        np.arange(heads) // group
                        if gqa == "interleave"
                        else np.arange(heads) % kv_heads
                    )
                    per_head = np.take(per_head, reads, axis=-3)
            values = values * per_head  # exact, see above
        out.append(values)
    return tuple(out)


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
