"""The attention call stated once: the canonical spec, the option layout and the allowed set.

This module is the one home of the rules every path reads (the float64 path, the
arbitrary-precision referee, the fast exact engine, the Numba CPU and CUDA kernels, the
variants' masks and the oracle): see ``docs/architecture.md``.

* **The allowed set** (docs/conventions.md, "allowed set"): row i of batch row b may read key j
  when

  .. math::

      \\mathcal{A}_{ij} = [\\text{lo}_i \\le j < \\text{hi}_i] \\wedge \\mathrm{mask}_{ij}
          \\wedge [\\mathrm{bias}_{ij} \\ne -\\infty]

  where the structural interval ``[lo_i, hi_i)`` (:func:`key_interval`) holds causal
  (``j <= i + o``), the window (``i + o - left <= j <= i + o + right``) and the row's key length
  (``j < S_b``, ``kv_lengths``), with the offset ``o = 0`` for ``align="top_left"`` and
  ``o = S_b - L`` for ``align="bottom_right"`` (:func:`offset_of`). :func:`key_interval` is plain
  Python on ints so that each backend compiles the same text: :data:`key_interval_jit` (Numba
  CPU), ``numba.cuda.jit(device=True)(key_interval)`` (CUDA); the NumPy forms
  (:func:`key_intervals`, :func:`structural_mask`, :func:`allowed_mask`,
  :meth:`AttentionSpec.allowed`) are built on it. :func:`position_allowed` is the per-position
  half (explicit mask, -inf bias). Sparse key indices (``key_indices``,
  ``key_block_indices``: :mod:`refattn.sparse_indices`) are one more factor
  ``[j \\in I_{b, g(h), i}]``: :func:`canonicalize` ANDs their set into the mask, so every
  path reads them through this rule.
* **The canonical call**: :func:`canonicalize` validates the arguments of
  :func:`refattn.attention` once and returns an :class:`AttentionSpec` whose arrays have a flat
  batch axis: q (B, H, L, D), k (B, K, S, D), v (B, K, S, E), and bias / mask / dropout_mask as
  (B, H, L, S) views (zero strides where they were broadcast, so no (B, H, L, S) copy is made
  unless a reshape forces one).
* **Folding** (:func:`fold`): an equivalent spec with fewer options for the paths that do not
  implement an option natively (see the docstring of :func:`fold`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

import numba
import numpy as np

from . import _checks, sparse_indices
from ._qv import fold_qv, split_qv_grads
from .quantized import FP8_DTYPES, dequantize_inputs

__all__ = [
    "ALIGNS",
    "AttentionSpec",
    "EMPTY_ROWS",
    "FP8_DTYPES",
    "GQA_MODES",
    "NORMALIZERS",
    "UNBOUNDED",
    "WINDOW_CAP",
    "allowed_mask",
    "canonicalize",
    "check_cotangent",
    "check_window",
    "fold",
    "key_interval",
    "key_interval_jit",
    "key_intervals",
    "needs_fold",
    "offset_of",
    "position_allowed",
    "position_allowed_jit",
    "split_qv_grads",
    "split_sink_grads",
    "structural_mask",
    "window_sides",
]

# --------------------------------------------------------------------------------------
# the allowed set: the one rule
# --------------------------------------------------------------------------------------
ALIGNS = ("top_left", "bottom_right")


def offset_of(align: str, length: int, keys: int) -> int:
    """Diagonal offset o: 0 for "top_left", S - L for "bottom_right"."""
    _checks.choice(align, "align", ALIGNS)
    return 0 if align == "top_left" else keys - length


WINDOW_CAP = 2**62  # larger than any array axis (int64 index arithmetic stays exact)


def check_window(window):
    """Validate ``window=(left, right)``: non-negative ints or None (unbounded side)."""
    if window is None:
        return None
    if not isinstance(window, tuple | list) or len(window) != 2:
        raise ValueError(f"window: expected a pair (left, right), got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, int | np.integer):
            raise TypeError(f"window: {name} size must be an int or None, got {side!r}")
        if side < 0:
            raise ValueError(f"window: {name} size must be >= 0, got {side}")
        # any size beyond every index difference is the same window; capping it keeps the
        # index arithmetic in int64 (a size of 2**70 is valid and means "unbounded")
        sides.append(min(int(side), WINDOW_CAP))
    return tuple(sides)


#: The compiled form of a window side that is None (unbounded).
UNBOUNDED = -1


def window_sides(window) -> tuple[int, int]:
    """A checked ``window`` as the compiled rule's ``(left, right)`` ints (-1: unbounded)."""
    if window is None:
        return UNBOUNDED, UNBOUNDED
    left, right = window
    return (UNBOUNDED if left is None else int(left)), (UNBOUNDED if right is None else int(right))


def key_interval(i, offset, keys, causal, left, right):
    """The structural key interval ``[lo, hi)`` of query row ``i``: the one home of the rule.

    Row i may read key j exactly when ``lo <= j < hi`` (before the explicit mask, the -inf
    bias and dropout): ``j <= i + o`` (causal), ``i + o - left <= j <= i + o + right``
    (window; a side of -1, :data:`UNBOUNDED`, is unbounded) and ``0 <= j < keys``, where
    ``keys`` is the row's key count (``S``, or ``S_b`` under ``kv_lengths``) and ``o`` its
    offset (:func:`offset_of` of that count). Always ``0 <= lo <= hi <= keys``; an empty
    interval has ``lo == hi``.

    Plain Python on ints: :data:`key_interval_jit` is its Numba CPU compilation and the CUDA
    kernels compile the same function as a device function.

    Parameters
    ----------
    i, offset, keys : int
        Query row, alignment offset o and key count.
    causal : bool
    left, right : int
        Window sides, -1 for unbounded (:func:`window_sides`).

    Returns
    -------
    (lo, hi) : tuple of int

    Examples
    --------
    >>> key_interval(1, 0, 4, True, -1, -1)
    (0, 2)
    >>> key_interval(0, 2, 4, False, 1, 0)  # bottom-right L=2, S=4, window (1, 0)
    (1, 3)
    """
    diag = i + offset
    lo = 0
    hi = keys
    if causal:
        hi = min(hi, diag + 1)
    if left >= 0:
        lo = max(lo, diag - left)
    if right >= 0:
        hi = min(hi, diag + right + 1)
    lo = min(lo, keys)
    hi = max(hi, lo)
    return lo, hi


#: :func:`key_interval` compiled for the Numba CPU paths (integer arithmetic only).
key_interval_jit = numba.njit(cache=True, fastmath=False)(key_interval)


def position_allowed(has_mask, mask_value, has_bias, bias_value):
    """The per-position half of the allowed set: the explicit mask allows it and the bias is
    not -inf (plain Python, compiled by the kernels like :func:`key_interval`).

    Examples
    --------
    >>> position_allowed(True, True, True, -float("inf"))
    False
    """
    return (not has_mask or bool(mask_value)) and (not has_bias or bias_value != -math.inf)


#: :func:`position_allowed` compiled for the Numba CPU paths.
position_allowed_jit = numba.njit(cache=True, fastmath=False)(position_allowed)


@numba.njit(cache=True, fastmath=False)
def _intervals(rows, offset, keys, causal, left, right):
    lo = np.empty(rows.shape[0], np.int64)
    hi = np.empty(rows.shape[0], np.int64)
    for n in range(rows.shape[0]):
        lo[n], hi[n] = key_interval_jit(rows[n], offset, keys, causal, left, right)
    return lo, hi


def key_intervals(length: int, offset: int, keys: int, *, causal=False, window=None):
    """:func:`key_interval` of every row ``0 <= i < length``: int64 arrays (lo, hi) of shape
    (L,).

    Examples
    --------
    >>> [x.tolist() for x in key_intervals(3, 0, 4, causal=True, window=(1, None))]
    [[0, 0, 1], [1, 2, 3]]
    """
    left, right = window_sides(check_window(window))
    rows = np.arange(length, dtype=np.int64)
    return _intervals(rows, int(offset), int(keys), bool(causal), left, right)


def _interval_mask(rows, cols, offset, keys, causal, left, right) -> np.ndarray:
    """(rows, cols) bool: ``lo_i <= j < hi_i`` with :func:`key_interval` of each row."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    cols = np.asarray(cols, dtype=np.int64).reshape(-1)
    lo, hi = _intervals(rows, int(offset), int(keys), bool(causal), left, right)
    return (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])


def structural_mask(
    rows, cols, *, causal: bool = False, window=None, offset: int = 0
) -> np.ndarray:
    """Causal/window part of the allowed set for query rows ``rows`` and key columns ``cols``.

    Parameters
    ----------
    rows, cols : array_like of int
        Query indices i (length L') and key indices j (length S').
    causal : bool
        Allow only ``j <= i + offset``.
    window : (left, right) or None
        Allow only ``i + offset - left <= j <= i + offset + right`` (None side: unbounded).
    offset : int
        The alignment offset o (see :func:`offset_of`).

    Returns
    -------
    ndarray of bool, shape (L', S')

    Examples
    --------
    >>> structural_mask(range(2), range(3), causal=True, offset=1).astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    left, right = window_sides(check_window(window))
    return _interval_mask(rows, cols, offset, WINDOW_CAP, causal, left, right)


def allowed_mask(
    length: int,
    keys: int,
    *,
    mask=None,
    bias=None,
    causal: bool = False,
    window=None,
    align: str = "top_left",
) -> np.ndarray:
    """The full allowed set, shape broadcast of mask/bias with (L, S).

    Parameters
    ----------
    length, keys : int
        L and S.
    mask : array_like of bool, optional
        True = attend; broadcastable to (..., L, S).
    bias : array_like of float, optional
        Positions with bias -inf are excluded.
    causal, window, align
        As in :func:`refattn.attention`.

    Returns
    -------
    ndarray of bool, shape (..., L, S)

    Examples
    --------
    >>> allowed_mask(2, 2, causal=True).astype(int).tolist()
    [[1, 0], [1, 1]]
    """
    offset = offset_of(align, length, keys)
    allowed = structural_mask(
        range(length), range(keys), causal=causal, window=check_window(window), offset=offset
    )
    if mask is not None:
        allowed = allowed & _checks.bool_array(mask, "mask")
    if bias is not None:
        allowed = allowed & ~np.isneginf(np.asarray(bias, dtype=np.float64))
    return allowed


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
    kv_lengths: np.ndarray | None = None  # (B,) int64: keys j >= kv_lengths[b] excluded
    sinks: np.ndarray | None = None  # (H,) float64: a logit added to every row's normaliser
    # set by refattn.spec for the exact paths only (None on canonical specs):
    alibi_offsets: np.ndarray | None = None  # (B,) int64: ALiBi's o_b, overriding row_offset
    alibi_keys: int | None = None  # ALiBi applies to keys j < alibi_keys (a folded sink: none)
    dbias_index: np.ndarray | None = None  # (B, H, L, S) int64 slot of each dS in dbias (-1: none)
    # sparse key selection (refattn.sparse_indices): the validated (B, K, L, T) int64 indices
    # (-1 for ignored entries; blocks already expanded). With index_reading="set" their set is
    # already ANDed into ``mask``; "multiset" is computed by refattn.sparse_multiset's gather.
    key_indices: np.ndarray | None = None
    index_reading: str = "set"
    normalizer: str = "softmax"  # "softmax" or "sigmoid" (NORMALIZERS)
    # qv (FlashAttention 3, MLA): q holds [q, qv] and k holds [k, v] (refattn._qv.fold_qv);
    # the last qv_features of their D features are the latent part (0: no qv)
    qv_features: int = 0

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

    def key_count(self, b: int = 0) -> int:
        """The key count of batch row b: ``S``, or ``S_b`` under ``kv_lengths``."""
        keys = self.k.shape[-2]
        return keys if self.kv_lengths is None else int(self.kv_lengths[b])

    def intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi): int64 (B, L) structural key intervals of every row (:func:`key_interval`
        with the row's offset and key count: causal, window, key length).

        Examples
        --------
        >>> spec = canonicalize(np.zeros((3, 2)), np.zeros((4, 2)), np.zeros((4, 1)),
        ...                     causal=True, window=(1, None))
        >>> [x.ravel().tolist() for x in spec.intervals()]
        [[0, 0, 1], [1, 2, 3]]
        """
        batch, _, _, length, _, _, _ = self.dims
        left, right = window_sides(self.window)
        rows = np.arange(length, dtype=np.int64)
        lo = np.empty((batch, length), np.int64)
        hi = np.empty((batch, length), np.int64)
        for b in range(batch):
            lo[b], hi[b] = _intervals(
                rows, self.row_offset(b), self.key_count(b), self.causal, left, right
            )
        return lo, hi

    def structural(self, rows=None, cols=None, b: int = 0) -> np.ndarray:
        """Causal/window (and key-length) allowed set of batch row b for the given query rows
        and key columns (:func:`key_interval`)."""
        _, _, _, length, keys, _, _ = self.dims
        rows = np.arange(length) if rows is None else rows
        cols = np.arange(keys) if cols is None else cols
        left, right = window_sides(self.window)
        return _interval_mask(
            rows, cols, self.row_offset(b), self.key_count(b), self.causal, left, right
        )

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
    key_indices=None,
    key_block_indices=None,
    key_block_size=None,
    index_reading="set",
    q_block_scale=None,
    k_block_scale=None,
    v_block_scale=None,
    normalizer="softmax",
    qv=None,
) -> AttentionSpec:
    """Validate refattn.attention's arguments and return the canonical :class:`AttentionSpec`.

    With ``qv`` the spec holds ``q' = [q, qv]`` and ``k' = [k, v]`` (D + E features, the last
    ``qv_features = E`` of them latent): ``q' . k' = q . k + qv . v`` exactly, so every path
    computes the FlashAttention 3 score unchanged, and the default scale ``1/sqrt(D')`` is
    FlashAttention 3's ``1/sqrt(D + E)``. :func:`split_qv_grads` maps the gradients back.
    """
    _check_normalizer(normalizer, sinks)
    blocks = {"q": q_block_scale, "k": k_block_scale, "v": v_block_scale}
    latent = None
    if qv is not None:  # qv is q's latent part: q's dtype, and q_descale when float8
        raw_qv, raw_q = _checks.as_array(qv, "qv"), _checks.as_array(q, "q")
        if raw_qv.dtype != raw_q.dtype:
            raise TypeError(f"qv: expected q's dtype {raw_q.dtype}, got {raw_qv.dtype}")
        latent = dequantize_inputs(
            raw_qv, k, v, q_descale, k_descale, v_descale, gqa, {**blocks, "q": None}
        )[0]
    q, k, v = dequantize_inputs(q, k, v, q_descale, k_descale, v_descale, gqa, blocks)
    if qv is not None:
        q, k = fold_qv(q, k, v, latent)
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
        normalizer=normalizer,
        qv_features=0 if qv is None else int(v.shape[-1]),
    )
    indices = sparse_indices.canonical_indices(
        key_indices,
        key_block_indices,
        key_block_size,
        index_reading,
        batch_shape=tuple(batch_shape),
        kv_heads=kv_heads,
        length=length,
        keys=keys,
        single_head=single,
    )
    if indices is not None:
        spec = _with_indices(spec, indices, index_reading)
    _check_bias_values(spec)
    return spec


def _with_indices(spec: AttentionSpec, indices: np.ndarray, reading: str) -> AttentionSpec:
    """The spec with its key indices; the set reading ANDs the listed set into the mask (one
    (B, K, L, S) plane per kv head, broadcast over the query heads when K = 1)."""
    changes = dict(key_indices=indices, index_reading=reading)
    if reading == "set":
        batch, heads, kv_heads, length, keys, _, _ = spec.dims
        listed = sparse_indices.index_mask(indices, keys)
        target = (batch, heads, length, keys)
        listed = np.broadcast_to(listed, target) if kv_heads == 1 else listed[:, spec.kv_head]
        changes["mask"] = listed if spec.mask is None else spec.mask & listed
    return dataclasses.replace(spec, **changes)


#: The score normalisers: "softmax" (weights ``exp(t - lse)``) and "sigmoid" (weights
#: ``sigmoid(t)``, no normaliser; Ramapuram et al. 2024, docs/conventions.md).
NORMALIZERS = ("softmax", "sigmoid")


def _check_normalizer(normalizer, sinks) -> None:
    """``normalizer`` is one of :data:`NORMALIZERS`; sinks need a normaliser to join."""
    _checks.choice(normalizer, "normalizer", NORMALIZERS)
    if normalizer == "sigmoid" and sinks is not None:
        raise ValueError(
            "sinks: normalizer='sigmoid' has no normaliser for a sink to join (each weight is "
            "sigmoid(t_ij) on its own); pass sinks only with normalizer='softmax'"
        )


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


# --------------------------------------------------------------------------------------
# folding: an equivalent spec with fewer options
# --------------------------------------------------------------------------------------
def needs_fold(spec: AttentionSpec) -> bool:
    """True when ``spec`` uses an option that :func:`fold` rewrites for the kernels."""
    return spec.sinks is not None or spec.kv_lengths is not None


def _planes(spec, fn) -> np.ndarray:
    batch, heads = spec.dims[:2]
    return np.stack([np.stack([fn(b, h) for h in range(heads)]) for b in range(batch)])


def fold(spec: AttentionSpec, *, alibi_into_bias: bool) -> AttentionSpec:
    """``spec`` without kv_lengths and sinks.

    Rewrite an :class:`AttentionSpec` into an equivalent one with fewer options, for the paths
    that do not implement an option natively (the Numba kernels; the exact path for sinks).

    * The allowed set (causal, window, per-row key lengths, mask, -inf bias) becomes an explicit
      boolean mask, with causal/window/kv_lengths off: the same set, whatever the alignment.
    * ALiBi: the float64 paths (``alibi_into_bias=True``) fold it into the bias
      (``bias + (-m_h |i + o_b - j|)`` in float64: one more rounding). The exact paths keep it
      native and exact: the folded spec pins each batch row's offset ``o_b``
      (:attr:`AttentionSpec.alibi_offsets`, relative to the row's own key length under
      ``align="bottom_right"``, as before the fold) and the keys it applies to
      (:attr:`AttentionSpec.alibi_keys`: not the sink's).
    * A sink becomes one more key: k = 0 and v = 0 (so its score is ``s * 0 = 0`` and softcap(0) =
      0 exactly), bias = the sink logit, always allowed and kept, no ALiBi term. Its weight is the
      sink's share of the normaliser and it adds nothing to the output, which is exactly the
      sink's definition; the bias gradient of that column, summed over batch and rows, is the
      sink's gradient. On the exact paths that sum is part of the one rounding: the folded spec's
      :attr:`AttentionSpec.dbias_index` sends the caller's bias positions to the caller's dbias
      (summed over bias's broadcast dimensions) and the sink column of head h to slot
      ``n_bias + h``, so dbias comes back flat as ``(dbias.ravel(), dsinks)``
      (:func:`split_sink_grads`).

    ``alibi_into_bias=True`` (float64 paths) adds ALiBi to the bias; ``False`` (exact paths)
    keeps it exact and native, and reduces the folded dbias to ``(dbias, dsinks)`` slots.
    """
    batch, heads, _, length, keys, _, _ = spec.dims
    allowed = _planes(spec, spec.allowed)
    bias = None if spec.bias is None else np.where(allowed, spec.bias, 0.0)
    changes = dict(
        mask=allowed,
        causal=False,
        window=None,
        kv_lengths=None,
        align="top_left",
        offset=0,
        bias=bias,
        bias_shape=None if bias is None else bias.shape,
    )
    if spec.alibi_slopes is not None:
        if alibi_into_bias:
            alibi = _planes(spec, lambda b, h: spec.alibi(h, b))
            changes.update(
                alibi_slopes=None,
                bias=alibi if bias is None else bias + alibi,
                bias_shape=(batch, heads, length, keys),
            )
        else:
            changes.update(
                alibi_offsets=np.array(
                    [spec.alibi_offset(b) for b in range(batch)], dtype=np.int64
                ),
                alibi_keys=keys if spec.alibi_keys is None else spec.alibi_keys,
            )
    if spec.sinks is not None:
        changes.update(_sink_key(spec, allowed, changes["bias"], exact=not alibi_into_bias))
    return dataclasses.replace(spec, **changes)


def split_sink_grads(spec: AttentionSpec, flat: np.ndarray):
    """(dbias in the caller's bias shape or None, dsinks (H,)) from the flat dbias of an
    exact path's folded spec (``spec`` is the caller's, unfolded)."""
    heads = spec.dims[1]
    if spec.bias is None:
        return None, flat[-heads:]
    return flat[:-heads].reshape(spec.bias_shape), flat[-heads:]


def _sink_key(spec, allowed, bias, exact) -> dict:
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims

    def extend(array, fill):
        column = np.full(array.shape[:-1] + (1,), fill, dtype=array.dtype)
        return np.concatenate([np.broadcast_to(array, array.shape), column], axis=-1)

    k = np.concatenate([spec.k, np.zeros((batch, kv_heads, 1, dim), spec.k.dtype)], axis=-2)
    v = np.concatenate([spec.v, np.zeros((batch, kv_heads, 1, vdim), spec.v.dtype)], axis=-2)
    sink_column = np.broadcast_to(spec.sinks[None, :, None, None], (1, heads, 1, 1))
    if bias is None:  # broadcast over batch and rows: the exact dbias reduction is dsinks
        bias = np.concatenate([np.zeros((1, heads, 1, keys)), sink_column], axis=-1)
        bias = np.broadcast_to(bias, (batch, heads, length, keys + 1))
        bias_shape = (1, heads, 1, keys + 1)
    else:
        bias = np.concatenate(
            [bias, np.broadcast_to(sink_column, (batch, heads, length, 1))], axis=-1
        )
        bias_shape = bias.shape
    keep = None if spec.dropout_mask is None else extend(spec.dropout_mask, True)
    changes = dict(
        k=k,
        v=v,
        mask=extend(allowed, True),
        bias=bias,
        bias_shape=bias_shape,
        dropout_mask=keep,
        sinks=None,
    )
    if exact:
        changes.update(_sink_slots(spec))
    return changes


def _sink_slots(spec) -> dict:
    """dbias_index and bias_shape of an exact path's folded spec: the caller's bias positions
    to their dbias slots, the sink column of head h to slot ``n_bias + h``."""
    batch, heads, _, length, keys, _, _ = spec.dims
    if spec.bias is None:
        user, n_bias = np.full((1, 1, 1, keys), -1, dtype=np.int64), 0
    else:
        shape = tuple(spec.bias_shape)
        n_bias = int(np.prod(shape))
        full = tuple(spec.batch_shape) + (heads, length, keys)
        user = np.broadcast_to(np.arange(n_bias, dtype=np.int64).reshape(shape), full)
        user = user.reshape((batch, heads, length, keys))
    user = np.broadcast_to(user, (batch, heads, length, keys))
    sink = np.broadcast_to(
        n_bias + np.arange(heads, dtype=np.int64)[None, :, None, None], (batch, heads, length, 1)
    )
    return dict(dbias_index=np.concatenate([user, sink], axis=-1), bias_shape=(n_bias + heads,))
