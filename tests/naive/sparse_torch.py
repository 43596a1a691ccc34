"""A PyTorch implementation of sparse key selection written from docs/conventions.md
("Sparse key indices"), for ``refattn-oracle validate --framework torch`` (nothing here
imports refattn or the oracle).

``torch_sparse_attention(q, k, v, **options)`` takes torch tensors in the bhld layout: q
(B, H, L, D), k (B, K, S, D), v (B, K, S, E), ``key_indices`` (B, K, L, T) int, or
``key_block_indices`` with ``key_block_size``, and the options mask, bias, scale, causal,
window, align, gqa, kv_lengths, sinks, empty_rows and the float8 descales. It computes in
float64 for float64 inputs, float32 otherwise (a gather-free dense form: the listed set is a
boolean (B, H, L, S) mask, entries < 0 or >= S dropped, duplicates counted once).
``torch_sparse_attention.vjp`` is torch autograd of the same function. ``dsa_sparse_attention``
is the same in the DSA calling convention (blhd tensors, ``indices`` (B, L, K, T)).
"""

from __future__ import annotations

import math

__all__ = ["dsa_sparse_attention", "torch_sparse_attention"]


def _torch():
    import torch

    return torch


def _compute_dtype(torch, q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _dequantised(torch, x, descale, heads_of, work):
    x = x.to(work) if not str(x.dtype).startswith("torch.float8") else x.to(torch.float32).to(work)
    if descale is None:
        return x
    factor = descale.to(work)
    if heads_of is not None:
        factor = factor[:, heads_of]
    return x * factor[:, :, None, None]


def _listed(torch, indices, keys, heads_of):
    """(B, H, L, S) bool: the set of valid listed positions, per query head."""
    idx = indices.to(torch.int64)
    valid = (idx >= 0) & (idx < keys)
    slots = torch.where(valid, idx, torch.full_like(idx, keys))
    listed = torch.zeros(idx.shape[:-1] + (keys + 1,), dtype=torch.bool, device=idx.device)
    listed.scatter_(-1, slots, True)
    return listed[..., :keys][:, heads_of]


def _block_tokens(torch, blocks, size, keys):
    blocks = blocks.to(torch.int64)
    count = -(-keys // size)
    ok = (blocks >= 0) & (blocks < count)
    tokens = blocks[..., None] * size + torch.arange(size, device=blocks.device)
    tokens = torch.where(ok[..., None] & (tokens < keys), tokens, torch.full_like(tokens, -1))
    return tokens.reshape(blocks.shape[:-1] + (blocks.shape[-1] * size,))


def _allowed(torch, shape, options, heads_of, device):
    batch, heads, length, keys = shape
    rows = torch.arange(length, device=device)[:, None]
    cols = torch.arange(keys, device=device)[None, :]
    lengths = options.get("kv_lengths")
    own = (
        torch.full((batch,), keys, device=device)
        if lengths is None
        else lengths.to(torch.int64).reshape(batch)
    )
    offset = (own - length) if options.get("align") == "bottom_right" else own * 0
    diag = rows[None] + offset[:, None, None]  # (B, L, 1)
    allowed = (cols[None] < own[:, None, None]).expand(batch, length, keys).clone()
    if options.get("causal"):
        allowed &= cols[None] <= diag
    window = options.get("window")
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= cols[None] >= diag - left
        if right is not None:
            allowed &= cols[None] <= diag + right
    allowed = allowed[:, None].expand(batch, heads, length, keys)
    if options.get("mask") is not None:
        allowed = allowed & options["mask"].to(torch.bool)
    if options.get("bias") is not None:
        allowed = allowed & ~torch.isneginf(options["bias"])
    indices = options.get("key_indices")
    if options.get("key_block_indices") is not None:
        indices = _block_tokens(
            torch, options["key_block_indices"], options["key_block_size"], keys
        )
    if indices is not None:
        allowed = allowed & _listed(torch, indices.expand(batch, -1, length, -1), keys, heads_of)
    return allowed


def torch_sparse_attention(q, k, v, *, return_lse=False, **options):
    """Forward (out, and lse when ``return_lse``) of attention over the listed keys."""
    out, lse = _forward(q, k, v, options)
    return (out, lse) if return_lse else out


def _forward(q, k, v, options):
    torch = _torch()
    work = _compute_dtype(torch, q)
    heads, kv_heads = q.shape[-3], k.shape[-3]
    group = heads // kv_heads
    interleave = (options.get("gqa") or "interleave") == "interleave"
    heads_of = (
        torch.arange(heads, device=q.device) // group
        if interleave
        else torch.arange(heads, device=q.device) % kv_heads
    )
    q = _dequantised(torch, q, options.get("q_descale"), heads_of, work)
    k = _dequantised(torch, k, options.get("k_descale"), None, work)[:, heads_of]
    v = _dequantised(torch, v, options.get("v_descale"), None, work)[:, heads_of]
    batch = max(q.shape[0], k.shape[0])
    q, k, v = (x.expand(batch, *x.shape[1:]) for x in (q, k, v))
    scale = options.get("scale")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = scale * (q @ k.transpose(-1, -2))
    shape = scores.shape
    allowed = _allowed(torch, shape, options, heads_of, q.device)
    if options.get("bias") is not None:
        scores = scores + torch.where(allowed, options["bias"].to(work), 0.0)
    logits = torch.where(allowed, scores, torch.tensor(-math.inf, dtype=work))
    sinks = options.get("sinks")
    if sinks is not None:
        column = sinks.to(work)[None, :, None, None].expand(*shape[:-1], 1)
        logits = torch.cat([logits, column], dim=-1)
    top = logits.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    expo = torch.exp(logits - top)
    total = expo.sum(dim=-1, keepdim=True)
    lse = (torch.log(total) + top)[..., 0]
    weights = expo / torch.where(total > 0, total, torch.ones_like(total))
    if sinks is not None:
        weights = weights[..., :-1]
    out = weights @ v
    empty = ~allowed.any(dim=-1)
    if sinks is None and (options.get("empty_rows") or "zero") == "nan":
        out = torch.where(empty[..., None], torch.nan, out)
        lse = torch.where(empty, torch.nan, lse)
    return out, lse


def _vjp(q, k, v, grad_out, *, grad_lse=None, **options):
    torch = _torch()
    work = _compute_dtype(torch, q)
    leaves = [x.detach().to(work).requires_grad_(True) for x in (q, k, v)]
    out, lse = _forward(*leaves, options)
    loss = (out * grad_out.to(work)).sum()
    if grad_lse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse * grad_lse.to(work), 0.0).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return tuple(
        torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves, strict=True)
    ) + (None,)


torch_sparse_attention.vjp = _vjp


def dsa_sparse_attention(q, k, v, *, indices=None, return_lse=False, **options):
    """The same in the DSA calling convention: q (B, L, H, D), k (B, S, K, D), v (B, S, K, E),
    ``indices`` (B, L, K, T); returns out (B, L, H, E) and lse (B, H, L)."""
    swap = [x.transpose(1, 2) for x in (q, k, v)]
    if indices is not None:
        options["key_indices"] = indices.transpose(1, 2)
    block = options.pop("block_indices", None)
    if block is not None:
        options["key_block_indices"] = block.transpose(1, 2)
        options["key_block_size"] = options.pop("block_size")
    out, lse = _forward(*swap, options)
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
