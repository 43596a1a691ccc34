"""Head layout of attention arrays, shared by the textbook baseline and the tolerance policy.

q is (..., H, L, D), k (..., K, S, D), v (..., K, S, E) with ``G = H / K`` query heads per
kv head; a 2-D array is one head. The kv heads are read by the query heads in one of two
layouts (``gqa``): ``"interleave"`` (query head h reads kv head ``h // G``) or ``"tile"``
(``h % K``), as in :func:`refattn.attention`.

Examples
--------
>>> import numpy as np
>>> k = np.arange(2.0).reshape(2, 1, 1)          # K = 2 kv heads
>>> expand_kv(k, 4, "interleave")[:, 0, 0].tolist(), expand_kv(k, 4, "tile")[:, 0, 0].tolist()
([0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0])
>>> fold_kv(np.ones((4, 1, 1)), 2, "interleave")[:, 0, 0].tolist()
[2.0, 2.0]
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["with_heads", "expand_kv", "fold_kv", "sum_to_shape", "alibi_bias", "resolve_scale"]


def with_heads(x, name):
    """``x`` with a head axis: a 2-D array becomes (1, rows, cols); others are unchanged."""
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"{name}: expected at least 2 dimensions, got shape {x.shape}")
    return x if x.ndim > 2 else x[None]


def expand_kv(x, H, gqa):
    """(..., K, S, .) -> (..., H, S, .): query head h reads kv head h // G or h % K."""
    K = x.shape[-3]
    if H % K:
        raise ValueError(f"H={H} is not a multiple of K={K}")
    if gqa == "interleave":
        return np.repeat(x, H // K, axis=-3)
    if gqa == "tile":
        return np.concatenate([x] * (H // K), axis=-3)
    raise ValueError(f"gqa: expected 'interleave' or 'tile', got {gqa!r}")


def fold_kv(x, K, gqa):
    """Inverse of :func:`expand_kv` for gradients: sum the heads sharing a kv head."""
    H = x.shape[-3]
    G = H // K
    if gqa == "interleave":
        return x.reshape(*x.shape[:-3], K, G, *x.shape[-2:]).sum(axis=-3)
    return x.reshape(*x.shape[:-3], G, K, *x.shape[-2:]).sum(axis=-4)


def sum_to_shape(x, shape):
    """Sum ``x`` over the dimensions that broadcasting added or stretched to reach its shape."""
    # TODO(arch-lib): use refattn's public broadcast-gradient reduction once it is exported
    shape = tuple(shape)
    extra = x.ndim - len(shape)
    if extra > 0:
        x = x.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True))
                 if b == 1 and a != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape)


def alibi_bias(slopes, L, S, align):
    """ALiBi's additive bias ``-slope_h |i + o - j|``, (..., H, L, S), in float64."""
    offset = 0 if align == "top_left" else S - L
    dist = np.abs(np.arange(L)[:, None] + offset - np.arange(S)[None, :]).astype(np.float64)
    slopes = np.asarray(slopes, dtype=np.float64)
    return -slopes[..., None, None] * dist


def resolve_scale(scale, D):
    """The score scale: ``1 / sqrt(D)`` when ``scale`` is None."""
    return 1.0 / math.sqrt(D) if scale is None else float(scale)
