"""A planted attention that never checks its inputs (the refusal cases must catch it).

``unchecked_attention`` is what a kernel without shape checks does to malformed inputs: it
truncates q and k to the shorter head dim and k and v to the shorter key count, maps query
heads to kv heads by ``h * K // H`` whatever H and K are, repeats k and v along the batch,
fills a mask or bias of any shape into (B, H, L, S) with ``np.resize`` (repeating its
elements), clips kv_lengths into [0, S] and truncates a fractional window side -- and returns
numbers. On well-formed inputs it is the textbook softmax attention in float64.
"""

from __future__ import annotations

import numpy as np

__all__ = ["unchecked_attention"]


def unchecked_attention(
    q, k, v, *, scale=None, mask=None, bias=None, kv_lengths=None, window=None, causal=False, **_
):
    """Textbook attention that accepts anything it can index (see the module docstring)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, heads, length, dim = q.shape
    k = np.resize(k, (batch, *k.shape[1:]))
    v = np.resize(v, (batch, *v.shape[1:]))
    keys = min(k.shape[2], v.shape[2])
    d = min(dim, k.shape[3])
    k = k[:, (np.arange(heads) * k.shape[1]) // heads, :keys, :d]
    v = v[:, (np.arange(heads) * v.shape[1]) // heads, :keys]
    scale = 1.0 / np.sqrt(dim) if scale is None else scale
    scores = np.einsum("bhld,bhsd->bhls", q[..., :d], k) * scale
    plane = scores.shape
    if bias is not None:
        scores = scores + np.resize(np.asarray(bias, dtype=np.float64), plane)
    allowed = np.ones(plane, dtype=bool)
    if mask is not None:
        allowed &= np.resize(np.asarray(mask, dtype=bool), plane)
    rows, cols = np.arange(length)[:, None], np.arange(keys)[None, :]
    if causal:
        allowed &= cols <= rows
    if window is not None:
        left, right = (keys if side is None else int(side) for side in window)
        allowed &= (cols >= rows - left) & (cols <= rows + right)
    if kv_lengths is not None:
        lengths = np.clip(np.resize(np.asarray(kv_lengths), batch), 0, keys)
        allowed &= cols[None, None] < lengths[:, None, None, None]
    scores = np.where(allowed, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    weights = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    weights = weights / np.where(total > 0, total, 1.0)
    return np.einsum("bhls,bhse->bhle", weights, v)
