"""Broadcasting and head-layout helpers shared by the float64 path, the exact path and the bounds.

A gradient of a broadcast argument is the gradient of the broadcast array summed back over the
axes broadcasting added or stretched (:func:`reduce_to`). Grouped-query attention reads kv head
``h // G`` (``gqa="interleave"``) or ``h % K`` (``"tile"``) for query head h
(:func:`expand_kv`); its gradients sum the query heads sharing a kv head (:func:`fold_kv`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["reduce_to", "expand_kv", "fold_kv"]


def reduce_to(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum a broadcast gradient back to the argument's ``shape``.

    Works on float and on object (exact rational) arrays alike.

    >>> reduce_to(np.ones((2, 3, 4)), (1, 4)).tolist()
    [[6.0, 6.0, 6.0, 6.0]]
    """
    shape = tuple(shape)
    extra = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(extra))) if extra else grad
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=axes, keepdims=True) if axes else grad


def expand_kv(x: np.ndarray, heads: int, gqa: str) -> np.ndarray:
    """(..., K, S, .) -> (..., H, S, .): query head h reads kv head h // G or h % K.

    >>> expand_kv(np.arange(2.0).reshape(2, 1, 1), 4, "tile").ravel().tolist()
    [0.0, 1.0, 0.0, 1.0]
    """
    kv_heads = x.shape[-3]
    if heads % kv_heads:
        raise ValueError(f"H={heads} is not a multiple of K={kv_heads}")
    if gqa == "interleave":
        return np.repeat(x, heads // kv_heads, axis=-3)
    if gqa == "tile":
        return np.concatenate([x] * (heads // kv_heads), axis=-3)
    raise ValueError(f"gqa: expected 'interleave' or 'tile', got {gqa!r}")


def fold_kv(x: np.ndarray, kv_heads: int, gqa: str) -> np.ndarray:
    """Inverse of :func:`expand_kv` for gradients: sum the query heads sharing a kv head.

    >>> fold_kv(np.ones((4, 1, 1)), 2, "interleave").ravel().tolist()
    [2.0, 2.0]
    """
    heads = x.shape[-3]
    group = heads // kv_heads
    if gqa == "interleave":
        return x.reshape(*x.shape[:-3], kv_heads, group, *x.shape[-2:]).sum(axis=-3)
    return x.reshape(*x.shape[:-3], group, kv_heads, *x.shape[-2:]).sum(axis=-4)
