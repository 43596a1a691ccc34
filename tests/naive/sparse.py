"""Loop twin of sparse key selection (``key_indices``, ``key_block_indices``), from
docs/conventions.md ("Sparse key indices") alone; nothing here imports refattn.

* set reading: row i of kv head g may attend to the listed positions 0 <= j < S (each once),
  intersected with the other restrictions: the twin builds that mask by loops and hands it to
  :func:`tests.naive.attention.naive_attention`.
* multiset reading: a plain gather; every valid slot is a key of its own (duplicates twice).
  The twin gathers the keys of each query row and decides each slot's admission with its own
  loops over the structural rule (causal, window, key length), the mask and the -inf bias.
"""

from __future__ import annotations

import math

import numpy as np

from .attention import naive_attention, naive_attention_rounded

__all__ = [
    "block_tokens",
    "gathered_row_problem",
    "naive_sparse_attention",
    "naive_sparse_rounded",
    "set_mask",
]


def block_tokens(blocks, block_size, keys):
    """Token lists of block lists, by loops: block c lists c s .. c s + s - 1 below S."""
    blocks = np.asarray(blocks)
    out = np.full(blocks.shape[:-1] + (blocks.shape[-1] * block_size,), -1, dtype=np.int64)
    for index in np.ndindex(*blocks.shape[:-1]):
        slot = 0
        for c in blocks[index]:
            for r in range(block_size):
                j = int(c) * block_size + r
                if int(c) >= 0 and j < keys:
                    out[index + (slot,)] = j
                slot += 1
    return out


def set_mask(indices, heads, keys, gqa="interleave"):
    """(H, L, S) bool of one batch row's indices (K, L, T): listed and in range."""
    indices = np.asarray(indices)
    kv_heads, length, _ = indices.shape
    group = heads // kv_heads
    mask = np.zeros((heads, length, keys), dtype=bool)
    for h in range(heads):
        g = h // group if gqa == "interleave" else h % kv_heads
        for i in range(length):
            for j in indices[g, i]:
                if 0 <= int(j) < keys:
                    mask[h, i, int(j)] = True
    return mask


def _structural(i, j, length, keys, opts):
    own = keys if opts.get("kv_length") is None else int(opts["kv_length"])
    if j >= own:
        return False
    offset = 0 if opts.get("align", "top_left") == "top_left" else own - length
    if opts.get("causal") and j > i + offset:
        return False
    window = opts.get("window")
    if window is not None:
        left, right = window
        if left is not None and j < i + offset - left:
            return False
        if right is not None and j > i + offset + right:
            return False
    return True


def gathered_row_problem(q, k, v, indices, i, opts):
    """Query row i of one batch row as its own attention call over the gathered slots:
    (q (H, 1, D), k (K, T, D), v (K, T, E), options with the gathered mask/bias/keep-mask)."""
    heads, length, _ = q.shape
    kv_heads, keys, _ = k.shape
    indices = np.asarray(indices)
    count = indices.shape[-1]
    group = heads // kv_heads
    gqa = opts.get("gqa", "interleave")
    slots = np.zeros((kv_heads, count), dtype=np.int64)
    valid = np.zeros((kv_heads, count), dtype=bool)
    for g in range(kv_heads):
        for t in range(count):
            j = int(indices[g, i, t])
            if 0 <= j < keys:
                slots[g, t], valid[g, t] = j, True
    k_row = np.stack([k[g, slots[g]] for g in range(kv_heads)])
    v_row = np.stack([v[g, slots[g]] for g in range(kv_heads)])
    mask = np.zeros((heads, 1, count), dtype=bool)
    row = {n: x for n, x in opts.items() if n not in ("causal", "window", "align", "kv_length")}
    bias = None if opts.get("bias") is None else np.zeros((heads, 1, count))
    keep = None if opts.get("dropout_mask") is None else np.zeros((heads, 1, count), dtype=bool)
    for h in range(heads):
        g = h // group if gqa == "interleave" else h % kv_heads
        for t in range(count):
            j = int(slots[g, t])
            ok = valid[g, t] and _structural(i, j, length, keys, opts)
            if opts.get("mask") is not None:
                ok = ok and bool(opts["mask"][h][i][j])
            if bias is not None:
                ok = ok and opts["bias"][h][i][j] != -math.inf
                bias[h, 0, t] = opts["bias"][h][i][j] if ok else 0.0
            if keep is not None:
                keep[h, 0, t] = opts["dropout_mask"][h][i][j]
            mask[h, 0, t] = ok
    row.update(mask=mask)
    if bias is not None:
        row["bias"] = bias
    if keep is not None:
        row["dropout_mask"] = keep
    return q[:, i : i + 1], k_row, v_row, row


def naive_sparse_attention(q, k, v, indices, *, reading="set", dps=60, **opts):
    """One batch row: q (H, L, D), k (K, S, D), v (K, S, E), indices (K, L, T) (token
    positions; expand blocks with :func:`block_tokens`). Options as
    :func:`naive_attention`'s (planes (H, L, S)). Returns (out, lse, weights) nested lists of
    mpf; multiset weights sum the copies of a position."""
    heads, length, _ = q.shape
    keys = k.shape[1]
    if reading == "set":
        listed = set_mask(indices, heads, keys, opts.get("gqa", "interleave"))
        mask = listed if opts.get("mask") is None else listed & np.asarray(opts["mask"])
        return naive_attention(q, k, v, dps=dps, **{**opts, "mask": mask})
    assert opts.get("alibi_slopes") is None, "the multiset twin takes no ALiBi"
    out = [[None] * length for _ in range(heads)]
    lse = [[None] * length for _ in range(heads)]
    weights = [[None] * length for _ in range(heads)]
    kv_heads = k.shape[0]
    group = heads // kv_heads
    for i in range(length):
        qi, ki, vi, row = gathered_row_problem(q, k, v, indices, i, opts)
        o, lo, w = naive_attention(qi, ki, vi, dps=dps, **row)
        for h in range(heads):
            g = h // group if opts.get("gqa", "interleave") == "interleave" else h % kv_heads
            out[h][i], lse[h][i] = o[h][0], lo[h][0]
            summed = [0] * keys
            for t, j in enumerate(np.asarray(indices)[g, i]):
                if 0 <= int(j) < keys:
                    summed[int(j)] = summed[int(j)] + w[h][0][t]
            weights[h][i] = summed
    return out, lse, weights


def naive_sparse_rounded(q, k, v, indices, opts, dtype, reading="set"):
    """(out, lse) of one batch row rounded once to ``dtype`` (set reading: weights too)."""
    heads, length, _ = q.shape
    keys = k.shape[1]
    full = dict(opts)
    for name in ("mask", "bias", "dropout_mask"):
        if full.get(name) is not None:
            full[name] = np.broadcast_to(full[name], (heads, length, keys))
    if reading == "set":
        listed = set_mask(indices, heads, keys, full.get("gqa", "interleave"))
        full["mask"] = listed if full.get("mask") is None else listed & full["mask"]
        return naive_attention_rounded(q, k, v, full, dtype)
    outs, lses = [], []
    for i in range(length):
        qi, ki, vi, row = gathered_row_problem(q, k, v, indices, i, full)
        o, lo, _ = naive_attention_rounded(qi, ki, vi, row, dtype)
        outs.append(np.asarray(o)[:, 0])
        lses.append(np.asarray(lo)[:, 0])
    return np.stack(outs, axis=1), np.stack(lses, axis=1)
