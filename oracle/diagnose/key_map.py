"""The (query, key) error map of a failing output: which keys a row's error points at.

A kernel that drops or adds key ``j`` moves row ``i`` along ``v_j - o_i`` exactly, so the
cosine between each row's error and each key's direction lights up the columns of a
key-position bug (a dropped partial tile, a causal frontier). The judge attaches the map to
a failing result (:attr:`oracle.judging.results.CaseResult.key_map`); the HTML report
(:mod:`oracle.report.formats`) draws it.

Examples
--------
>>> import numpy as np
>>> max_pool(np.arange(16.0).reshape(4, 4), 2).tolist()
[[5.0, 7.0], [13.0, 15.0]]
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["key_alignment", "key_map", "max_pool", "KEY_MAP_CAP"]


def key_alignment(out, truth, v, *, gqa="interleave", max_size=128):
    """|cos| between each row's error ``out_i - truth_i`` and ``v_j - truth_i`` for every key
    j, on the (batch, head) with the worst error: (L, S), max-pooled to at most ``max_size``
    per side. A kernel that drops or adds key j moves row i along ``v_j - o_i`` exactly, so a
    key-position bug lights up its column (a dropped partial tile, a causal frontier).
    Returns None when the shapes do not allow it."""
    out, truth = np.asarray(out, np.float64), np.asarray(truth, np.float64)
    v = np.asarray(v, np.float64)
    if out.shape != truth.shape or out.ndim < 2 or v.ndim < 2:
        return None
    error = np.where(np.isfinite(out - truth), out - truth, 0.0)
    out4 = error.reshape((-1,) + error.shape[-3:]) if error.ndim >= 3 else error[None, None]
    truth4 = truth.reshape(out4.shape)
    v4 = v.reshape((-1,) + v.shape[-3:]) if v.ndim >= 3 else v[None, None]
    if v4.shape[0] not in (1, out4.shape[0]):
        return None
    norms = np.linalg.norm(out4, axis=-1).max(axis=-1)  # (B, H)
    b, h = np.unravel_index(int(np.argmax(norms)), norms.shape)
    K, H = v4.shape[1], out4.shape[1]
    kv = h // max(H // K, 1) if gqa != "tile" else h % K
    vb = v4[min(b, v4.shape[0] - 1), kv]  # (S, E)
    e, t = out4[b, h], np.where(np.isfinite(truth4[b, h]), truth4[b, h], 0.0)  # (L, E)
    direction = vb[None, :, :] - t[:, None, :]  # (L, S, E)
    with np.errstate(all="ignore"):
        cos = np.abs(np.einsum("le,lse->ls", e, direction)) / (
            np.linalg.norm(e, axis=-1)[:, None] * np.linalg.norm(direction, axis=-1)
        )
    cos = np.where(np.isfinite(cos), cos, 0.0)
    return max_pool(cos, max_size)


def max_pool(grid, size):
    """Max-pool a 2-d grid to at most ``size`` per side."""
    for axis in (0, 1):
        n = grid.shape[axis]
        if n > size:
            step = math.ceil(n / size)
            pad = (-n) % step
            widths = [(0, 0), (0, 0)]
            widths[axis] = (0, pad)
            padded = np.pad(grid, widths)
            shape = list(padded.shape)
            shape[axis : axis + 1] = [shape[axis] // step, step]
            grid = padded.reshape(shape).max(axis=axis + 1)
    return grid


#: Largest L * S * E for which :func:`key_map` is computed (the HTML's (query, key) map).
KEY_MAP_CAP = 2**24


def key_map(out, truth, v, gqa=None):
    """:func:`key_alignment` of a failing output, or None (no output, NaN-only errors, too
    large: L S E over :data:`KEY_MAP_CAP`, or a single key)."""
    if out is None or truth is None or np.shape(out) != np.shape(truth) or np.ndim(v) < 2:
        return None
    L, S, E = np.shape(out)[-2], np.shape(v)[-2], np.shape(v)[-1]
    if S < 2 or L * S * E > KEY_MAP_CAP:
        return None
    return key_alignment(out, truth, v, gqa=gqa or "interleave").astype(np.float32)
