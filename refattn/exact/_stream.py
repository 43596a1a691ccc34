"""The allowed set of attention without (L, S) arrays: what the streaming exact kernels read.

Row i of batch row b may read key j when ``lo_i <= j < hi_i`` (:func:`key_intervals`: causal,
window, key length) and, only where the caller passed them, the mask allows it and the bias is
not -inf; the dropout keep-mask then selects the kept keys. The mask, bias and keep-mask are
read from their un-broadcast elements (:func:`compact_view`). Together this is the one rule of
:meth:`refattn.spec.AttentionSpec.allowed`; the forward (:mod:`refattn.exact.fast_attention`)
and the vjp (:mod:`refattn.exact._fast_vjp`) share it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["key_intervals", "compact_view"]


def key_intervals(spec):
    """The structural key interval ``[lo, hi)`` of every query row: int64 (B, L) arrays.

    Row i of batch row b may read key j exactly when ``lo <= j < hi`` (before the explicit
    mask, -inf bias and dropout): ``j <= i + o`` (causal), ``i + o - left <= j <= i + o +
    right`` (window, a None side unbounded) and ``j < S_b`` (``kv_lengths``), with ``o`` the
    row offset :meth:`refattn.spec.AttentionSpec.row_offset` (the semantics of
    :func:`refattn.masks.structural_mask`). An empty interval has ``lo == hi``.

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((3, 2)), np.zeros((4, 2)), np.zeros((4, 1)), causal=True,
    ...                     window=(1, None))
    >>> [x.ravel().tolist() for x in key_intervals(spec)]
    [[0, 0, 1], [1, 2, 3]]
    """
    batch, _, _, length, keys, _, _ = spec.dims
    rows = np.arange(length, dtype=np.int64)
    lo = np.zeros((batch, length), np.int64)
    hi = np.full((batch, length), keys, np.int64)
    for b in range(batch):
        diag = rows + spec.row_offset(b)
        if spec.causal:
            hi[b] = np.minimum(hi[b], diag + 1)
        if spec.window is not None:
            left, right = spec.window
            if left is not None:
                lo[b] = np.maximum(lo[b], diag - left)
            if right is not None:
                hi[b] = np.minimum(hi[b], diag + right + 1)
        if spec.kv_lengths is not None:
            hi[b] = np.minimum(hi[b], int(spec.kv_lengths[b]))
    lo = np.clip(lo, 0, keys)
    return lo, np.clip(hi, lo, keys)


def compact_view(view, dtype):
    """A (B, H, L, S) view (zero strides where broadcast) as (flat C array of its distinct
    elements, int64 (4,) element strides, 0 along broadcast axes); (one zero, zeros) for None.
    Only the un-broadcast elements are copied: never a (B, H, L, S) array for a broadcast
    view."""
    if view is None:
        return np.zeros(1, dtype), np.zeros(4, np.int64)
    view = np.asarray(view)
    core = view[
        tuple(
            slice(0, 1) if st == 0 or n == 1 else slice(None)
            for st, n in zip(view.strides, view.shape, strict=True)
        )
    ]
    core = np.require(core, dtype, ["C", "W"])  # writable: the kernels see one array type
    strides = np.array(
        [
            0 if n == 1 else st // core.itemsize
            for st, n in zip(core.strides, core.shape, strict=True)
        ],
        np.int64,
    )
    return core.ravel(), strides
