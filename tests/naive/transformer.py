"""Loop twins of refattn.transformer: linear maps, layer norm, multi-head attention,
feed-forward, encoder and decoder blocks, sinusoidal positions.

Plain loops over mpf following the lecture notes' formulas literally (call inside
``mpmath.workdps``); parameters are any objects with the fields of refattn.transformer's
parameter classes. Nothing here imports refattn.
"""

from __future__ import annotations

import mpmath
import numpy as np

__all__ = [
    "mp_array",
    "naive_linear",
    "naive_layer_norm",
    "naive_attention_rows",
    "naive_mha",
    "naive_feed_forward",
    "naive_encoder",
    "naive_decoder",
    "naive_positions",
]


def mp_array(a) -> np.ndarray:
    """Float array -> object array of mpf holding the exact values (mpf arrays, e.g.
    perturbed parameters of a central difference, are returned as they are)."""
    if isinstance(a, np.ndarray) and a.dtype == object:
        return a
    a = np.asarray(a, dtype=np.float64)
    out = np.empty(a.shape, dtype=object)
    for index, v in np.ndenumerate(a):
        out[index] = mpmath.mpf(float(v))
    return out


def naive_linear(x, W, b):
    """``x W + b`` with W, b taken exactly."""
    out = np.matmul(x, mp_array(W))
    return out if b is None else out + mp_array(b)


def naive_layer_norm(x, norm):
    """Layer norm of the last axis; ``norm`` has ``eps``, ``gamma``, ``beta`` (NormParams)."""
    out = np.empty(x.shape, dtype=object)
    width = x.shape[-1]
    for index in np.ndindex(*x.shape[:-1]):
        row = list(x[index])
        mean = mpmath.fsum(row) / width
        var = mpmath.fsum((v - mean) ** 2 for v in row) / width
        if var + mpmath.mpf(float(norm.eps)) == 0:
            out[index] = [mpmath.nan] * width
            continue
        sigma = mpmath.sqrt(var + mpmath.mpf(float(norm.eps)))
        for j, v in enumerate(row):
            y = (v - mean) / sigma
            if norm.gamma is not None:
                y *= mpmath.mpf(norm.gamma[j])
            if norm.beta is not None:
                y += mpmath.mpf(norm.beta[j])
            out[index + (j,)] = y
    return out


def naive_attention_rows(q, k, v, allowed):
    """q (L, D), k (S, D), v (S, E) mpf arrays, allowed (L, S): scale 1/sqrt(D)."""
    scale = 1 / mpmath.sqrt(q.shape[1])
    out = np.empty((q.shape[0], v.shape[1]), dtype=object)
    for i in range(q.shape[0]):
        keys = [j for j in range(k.shape[0]) if allowed[i, j]]
        if not keys:
            out[i] = [mpmath.mpf(0)] * v.shape[1]
            continue
        scores = {j: scale * mpmath.fsum(q[i] * k[j]) for j in keys}
        total = mpmath.fsum(mpmath.exp(s) for s in scores.values())
        for e in range(v.shape[1]):
            out[i, e] = mpmath.fsum(mpmath.exp(scores[j]) * v[j, e] for j in keys) / total
    return out


def naive_mha(x_q, x_kv, p, allowed):
    """2-D x_q (L, M), x_kv (S, N); allowed (L, S) for every head; GQA interleave; ``p`` has
    the fields of refattn.transformer.AttentionParams."""
    heads, kv_heads = p.num_heads, p.num_kv_heads or p.num_heads
    q = naive_linear(x_q, p.W_Q, p.b_Q)
    k = naive_linear(x_kv, p.W_K, p.b_K)
    v = naive_linear(x_kv, p.W_V, p.b_V)
    dim, vdim = q.shape[1] // heads, v.shape[1] // kv_heads
    blocks = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        blocks.append(
            naive_attention_rows(
                q[:, h * dim : (h + 1) * dim],
                k[:, g * dim : (g + 1) * dim],
                v[:, g * vdim : (g + 1) * vdim],
                allowed,
            )
        )
    return naive_linear(np.concatenate(blocks, axis=1), p.W_O, p.b_O)


def naive_feed_forward(x, p):
    """Position-wise feed-forward; ``p`` has W1, b1, W2, b2, activation."""
    hidden = naive_linear(x, p.W1, p.b1)
    if p.activation == "relu":
        act = np.vectorize(lambda t: max(t, 0), otypes=[object])(hidden)
    else:
        act = np.vectorize(lambda t: t / 2 * (1 + mpmath.erf(t / mpmath.sqrt(2))), otypes=[object])(
            hidden
        )
    return naive_linear(act, p.W2, p.b2)


def naive_encoder(x, p, norm):
    """One encoder block, post- or pre-LN; ``p`` has attn, ffn, norm1, norm2."""
    full = np.ones((x.shape[0], x.shape[0]), dtype=bool)
    if norm == "post":
        h = naive_layer_norm(x + naive_mha(x, x, p.attn, full), p.norm1)
        return naive_layer_norm(h + naive_feed_forward(h, p.ffn), p.norm2)
    n1 = naive_layer_norm(x, p.norm1)
    h = x + naive_mha(n1, n1, p.attn, full)
    return h + naive_feed_forward(naive_layer_norm(h, p.norm2), p.ffn)


def naive_decoder(x, memory, p, norm="post"):
    """One decoder block; ``p`` has self_attn, cross_attn, ffn, norm1..norm3."""
    causal = np.tril(np.ones((x.shape[0], x.shape[0]), dtype=bool))
    full = np.ones((x.shape[0], memory.shape[0]), dtype=bool)
    if norm == "pre":
        n1 = naive_layer_norm(x, p.norm1)
        h = x + naive_mha(n1, n1, p.self_attn, causal)
        h = h + naive_mha(naive_layer_norm(h, p.norm2), memory, p.cross_attn, full)
        return h + naive_feed_forward(naive_layer_norm(h, p.norm3), p.ffn)
    h = naive_layer_norm(x + naive_mha(x, x, p.self_attn, causal), p.norm1)
    h = naive_layer_norm(h + naive_mha(h, memory, p.cross_attn, full), p.norm2)
    return naive_layer_norm(h + naive_feed_forward(h, p.ffn), p.norm3)


def naive_positions(length, dim, base, layout):
    """Sinusoidal position table (L, dim), "interleave" or "split" layout."""
    table = np.empty((length, dim), dtype=object)
    half = dim // 2
    for pos in range(length):
        for i in range(half):
            angle = pos / mpmath.power(mpmath.mpf(float(base)), mpmath.mpf(2 * i) / dim)
            s, c = (2 * i, 2 * i + 1) if layout == "interleave" else (i, half + i)
            table[pos, s], table[pos, c] = mpmath.sin(angle), mpmath.cos(angle)
    return table
