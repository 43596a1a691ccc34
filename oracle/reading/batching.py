"""Batch surgery on attention inputs: take and reorder batch elements, keeping broadcast
dimensions broadcast.

q, k, v, mask, bias, dropout_mask, the sparse key indices, qv, the fp4 block scales and grad_out
carry the batch on axis -4 (their trailing axes are (heads, rows, columns)); grad_lse on axis
-3; kv_lengths (B,) on its only axis; the fp8 descale factors (B, K) on axis -2. An array whose
batch axis is missing, or is of size 1 while the batch is larger, broadcasts over the batch
and is left as it is.

Examples
--------
>>> import numpy as np
>>> inputs = {"q": np.zeros((3, 2, 4, 8)), "mask": np.ones((4, 5), bool)}
>>> part = take_batch(inputs, [2, 0, 0, 2])
>>> part["q"].shape, part["mask"].shape
((4, 2, 4, 8), (4, 5))
>>> cache = {"q": np.zeros((3, 2, 4, 8)), "kv_lengths": np.array([5, 6, 7])}
>>> take_batch(cache, [2, 0])["kv_lengths"]
array([7, 5])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from refattn.spec import OPTIONS

__all__ = ["BATCH_AXIS", "batch_size", "take_batch"]

#: name -> batch axis (from the end) of the attention inputs that may carry a batch: q, k, v
#: and the cotangents, and every array option by its ``batch_axis`` in refattn.spec.OPTIONS
BATCH_AXIS = {
    "q": -4,
    "k": -4,
    "v": -4,
    **{row.name: row.batch_axis for row in OPTIONS if row.batch_axis is not None},
    "grad_out": -4,
    "grad_lse": -3,
}
#: inputs that always carry the batch (never broadcast over it): per-row key lengths and the
#: per-(batch, kv head) descale and block-scale factors follow their batch element even at
#: batch size 1
_ALWAYS = ("q", "k", "v") + tuple(
    row.name for row in OPTIONS if row.kind in ("per-batch", "descale", "block scale")
)


def batch_size(inputs: Mapping[str, np.ndarray]) -> int:
    """The batch size of q (1 when q has no batch axis)."""
    q = inputs["q"]
    return q.shape[-4] if q.ndim >= 4 else 1


def _carries_batch(name: str, array, batch: int) -> bool:
    axis = BATCH_AXIS.get(name)
    if axis is None or not isinstance(array, np.ndarray) or array.ndim < -axis:
        return False
    return array.shape[axis] == batch and (batch > 1 or name in _ALWAYS)


def take_batch(inputs: Mapping[str, np.ndarray], indices: Sequence[int]) -> dict:
    """The inputs of batch elements ``indices`` (in that order, repeats allowed); arrays that
    broadcast over the batch are returned unchanged."""
    batch = batch_size(inputs)
    indices = np.asarray(indices, dtype=np.intp)
    if indices.ndim != 1 or indices.size == 0 or indices.min() < 0 or indices.max() >= batch:
        raise ValueError(f"indices: expected batch indices in [0, {batch}), got {indices.tolist()}")
    return {
        name: np.take(array, indices, axis=BATCH_AXIS[name])
        if _carries_batch(name, array, batch)
        else array
        for name, array in inputs.items()
    }
