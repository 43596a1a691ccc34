"""Loop twin of sigmoid attention (``refattn.attention(..., normalizer="sigmoid")``).

Plain Python loops over mpmath numbers following docs/conventions.md ("The sigmoid
normaliser") literally: ``out_i = sum_{j allowed, kept} sigmoid(t~_ij) v_j / (1 - p)`` with
``sigmoid(t) = 1 / (1 + exp(-t))`` and no normaliser. Nothing here imports refattn. Slow by
design: small shapes only. Inputs may be floats or mpf (for central differences).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np

from .rounding import round_stable

__all__ = ["naive_sigmoid_attention", "naive_sigmoid_rounded", "naive_sigmoid_loss"]


def _exact(x) -> mpmath.mpf:
    return x if isinstance(x, mpmath.mpf) else mpmath.mpf(float(x))


def _allowed(h, i, j, length, keys, opts):
    offset = 0 if opts.get("align", "top_left") == "top_left" else keys - length
    mask, bias = opts.get("mask"), opts.get("bias")
    if mask is not None and not mask[h][i][j]:
        return False
    if opts.get("causal") and j > i + offset:
        return False
    window = opts.get("window")
    if window is not None:
        left, right = window
        if left is not None and j < i + offset - left:
            return False
        if right is not None and j > i + offset + right:
            return False
    return not (bias is not None and float(bias[h][i][j]) == -math.inf)


def _score(q, k, h, g, i, j, offset, sc, opts):
    s = sc * mpmath.fsum(_exact(q[h, i, d]) * _exact(k[g, j, d]) for d in range(q.shape[2]))
    if opts.get("softcap") is not None:
        c = _exact(opts["softcap"])
        s = c * mpmath.tanh(s / c)
    if opts.get("bias") is not None:
        s += _exact(opts["bias"][h][i][j])
    if opts.get("alibi_slopes") is not None:
        s -= _exact(opts["alibi_slopes"][h]) * abs(i + offset - j)
    return s


def naive_sigmoid_attention(q, k, v, *, dps=60, **opts):
    """Single-batch sigmoid attention by loops: q (H, L, D), k (K, S, D), v (K, S, E); masks
    and bias already (H, L, S). Returns (out (H, L, E), weights (H, L, S)) as nested mpf."""
    q, k, v = (np.asarray(a, dtype=object) for a in (q, k, v))
    heads, length, dim = q.shape
    kv_heads, keys, vdim = v.shape
    group = heads // kv_heads
    drop = opts.get("dropout_mask")
    with mpmath.workdps(dps):
        sc = 1 / mpmath.sqrt(dim) if opts.get("scale") is None else _exact(opts["scale"])
        keep = 1 / (1 - _exact(opts.get("dropout_p", 0.0)))
        offset = 0 if opts.get("align", "top_left") == "top_left" else keys - length
        out, weights = [], []
        for h in range(heads):
            g = h // group if opts.get("gqa", "interleave") == "interleave" else h % kv_heads
            out_h, w_h = [], []
            for i in range(length):
                row_w = [mpmath.mpf(0)] * keys
                allowed = [j for j in range(keys) if _allowed(h, i, j, length, keys, opts)]
                for j in allowed:
                    row_w[j] = 1 / (1 + mpmath.exp(-_score(q, k, h, g, i, j, offset, sc, opts)))
                if not allowed and opts.get("empty_rows", "zero") == "nan":
                    out_h.append([mpmath.nan] * vdim)
                    w_h.append([mpmath.nan] * keys)
                    continue
                kept = [j for j in allowed if drop is None or drop[h][i][j]]
                out_h.append(
                    [
                        mpmath.fsum(row_w[j] * keep * _exact(v[g, j, e]) for j in kept)
                        for e in range(vdim)
                    ]
                )
                w_h.append(row_w)
            out.append(out_h)
            weights.append(w_h)
        return out, weights


def naive_sigmoid_rounded(q, k, v, opts, dtype):
    """(out, weights) of :func:`naive_sigmoid_attention` rounded to ``dtype``
    (:func:`naive.rounding.round_stable`); q (H, L, D), k (K, S, D), v (K, S, E)."""
    heads, length, keys = q.shape[0], q.shape[1], k.shape[1]
    full = dict(opts)
    for name in ("mask", "bias", "dropout_mask"):
        if name in full:
            full[name] = np.broadcast_to(full[name], (heads, length, keys))
    return tuple(
        round_stable(lambda dps, n=n: naive_sigmoid_attention(q, k, v, dps=dps, **full)[n], dtype)
        for n in range(2)
    )


def naive_sigmoid_loss(opts):
    """``function(q, k, v[, bias])`` -> nested out, for :func:`naive.mp.central_vjp`."""

    def function(q, k, v, bias=None):
        full = dict(opts)
        if bias is not None:
            full["bias"] = bias
        return naive_sigmoid_attention(q, k, v, dps=mpmath.mp.dps, **full)[0]

    return function
