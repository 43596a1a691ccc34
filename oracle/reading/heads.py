"""Head layout of attention arrays, shared by the textbook baseline and the tolerance policy.

q is (..., H, L, D), k (..., K, S, D), v (..., K, S, E); a 2-D array is one head. The GQA
head mapping and the broadcast-gradient reduction are refattn's own
(:mod:`refattn.broadcast`: ``expand_kv``, ``fold_kv``, ``reduce_to``).

Examples
--------
>>> import numpy as np
>>> with_heads(np.zeros((3, 4)), "q").shape, resolve_scale(None, 16)
((1, 3, 4), 0.25)
>>> alibi_bias([0.5], 2, 3, "bottom_right").tolist()
[[[-0.5, -0.0, -0.5], [-1.0, -0.5, -0.0]]]
"""

from __future__ import annotations

import math

import numpy as np

from refattn.broadcast import expand_kv
from refattn.spec import offset_of

__all__ = ["with_heads", "alibi_bias", "resolve_scale", "dequantised"]


def with_heads(x, name):
    """``x`` with a head axis: a 2-D array becomes (1, rows, cols); others are unchanged."""
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"{name}: expected at least 2 dimensions, got shape {x.shape}")
    return x if x.ndim > 2 else x[None]


def alibi_bias(slopes, L, S, align, length=None):
    """ALiBi's additive bias ``-slope_h |i + o - j|``, (..., H, L, S), in float64.

    ``length``: the row's own key length S_b (``kv_lengths``), to which bottom_right aligns
    (o = S_b - L); S by default."""
    offset = offset_of(align, L, S if length is None else int(length))
    dist = np.abs(np.arange(L)[:, None] + offset - np.arange(S)[None, :]).astype(np.float64)
    slopes = np.asarray(slopes, dtype=np.float64)
    return -slopes[..., None, None] * dist


def resolve_scale(scale, D):
    """The score scale: ``1 / sqrt(D)`` when ``scale`` is None."""
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


def dequantised(x, descale, heads=None, gqa="interleave"):
    """float8 ``x`` (..., X, N, M) times its float32 ``descale`` (..., K) as float64 (exact:
    4 significant bits times 24 fit in float64's 53). ``heads`` = H for q, whose head h uses
    the factor of the kv head it reads; other arrays (and ``descale=None``) pass through
    unless float8 (then taken as float64 values). fp4 values already multiplied by their block
    scales (float64) take their descale the same way."""
    x = np.asarray(x)
    if not x.dtype.name.startswith("float8") and descale is None:
        return x
    values = x.astype(np.float64)
    if descale is None:
        return values
    factor = np.asarray(descale, dtype=np.float64)[..., :, None, None]
    if heads is not None and factor.shape[-3] != heads:
        factor = expand_kv(factor, heads, gqa or "interleave")
    return values * factor
