"""Implementations under test written as kernel authors write them: torch tensors in their own
layout, FlashAttention-style signatures (validated through oracle.conventions.layouts, no
wrapper)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sdpa(q, k, v, scale, causal, mask=None):
    """(B, H, L, D) torch SDPA with GQA; refattn's options that these kernels take."""
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[-3] != k.shape[-3],
    )


def _refuse(options):
    if options:
        raise NotImplementedError(f"not supported: {sorted(options)}")


def attention_bhld(q, k, v, *, scale=None, causal=False, mask=None, **options):
    _refuse(options)
    return _sdpa(q, k, v, scale, causal, mask)


def flash_attn_func(q, k, v, *, scale=None, causal=False, **options):
    """(B, L, H, D) like FlashAttention's flash_attn_func."""
    _refuse(options)
    out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, causal)
    return out.transpose(1, 2)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    scale=None,
    causal=False,
    **options,
):
    """Packed tokens (total, H, D) with cumulative sequence lengths."""
    _refuse(options)
    outs = []
    for b in range(len(cu_seqlens_q) - 1):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        keys = slice(int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1]))
        out = _sdpa(
            q[rows].transpose(0, 1)[None],
            k[keys].transpose(0, 1)[None],
            v[keys].transpose(0, 1)[None],
            scale,
            causal,
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def flash_attn_with_kvcache(
    q, k_cache, v_cache, block_table, cache_seqlens, *, scale=None, causal=False, **options
):
    """q (B, L, H, D) over a paged KV cache (pages, page, K, D) and a block table."""
    _refuse(options)
    outs = []
    for b in range(q.shape[0]):
        length = int(cache_seqlens[b])
        k = k_cache[block_table[b].long()].flatten(0, 1)[:length]
        v = v_cache[block_table[b].long()].flatten(0, 1)[:length]
        out = _sdpa(
            q[b : b + 1].transpose(1, 2),
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            scale,
            causal,
        )
        outs.append(out.transpose(1, 2))
    return torch.cat(outs)


def paged_ignoring_table(q, k_cache, v_cache, block_table, cache_seqlens, **options):
    """Broken: reads the pages in storage order, ignoring the block table."""
    first = k_cache.shape[0] - block_table.numel()
    table = torch.arange(first, k_cache.shape[0], dtype=torch.int32).reshape(block_table.shape)
    return flash_attn_with_kvcache(q, k_cache, v_cache, table, cache_seqlens, **options)


def jax_dot_product_attention(q, k, v, *, scale=None, causal=False, **options):
    """jax.nn.dot_product_attention as it is: (B, L, H, D) jax arrays."""
    import jax

    _refuse(options)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)
