"""FlashAttention's three entry points as a kernel author ships them: FlashAttention's own
signatures and conventions (blhd tensors, ``softmax_scale``, bottom-right ``causal``,
``window_size=(-1, -1)`` with -1 unbounded, ``softcap=0.0`` for none, ``alibi_slopes``, lse
(B, H, L) float32 with ``return_attn_probs``), torch SDPA underneath. Validated with
``--signature flash_attn|flash_attn_varlen|flash_attn_with_kvcache`` and no wrapper.

Scores with softcap or ALiBi are computed in float32 torch (SDPA takes neither); the lse is
float32 logsumexp of the allowed scores. Rows with no allowed key give 0 (and lse -inf).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _allowed(length, keys, causal, window_size, device):
    """(L, S) bool: FlashAttention's set, bottom-right aligned (row i's diagonal at i + S - L)."""
    rows = torch.arange(length, device=device)[:, None] + (keys - length)
    cols = torch.arange(keys, device=device)[None, :]
    left, right = window_size
    if causal:
        right = 0
    allowed = torch.ones(length, keys, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= cols >= rows - left
    if right >= 0:
        allowed &= cols <= rows + right
    return allowed


def _scores(q, k, scale, softcap, alibi_slopes, allowed):
    """float32 (B, H, L, S) scores with -inf outside the allowed set."""
    scores = torch.einsum("bhld,bhsd->bhls", q.float(), k.float()) * scale
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        length, keys = scores.shape[-2:]
        rows = torch.arange(length)[:, None] + (keys - length)
        distance = (rows - torch.arange(keys)[None, :]).abs().float()
        scores = scores - alibi_slopes.float().reshape(-1, 1, 1) * distance
    return scores.masked_fill(~allowed, float("-inf"))


def _attend(q, k, v, scale, causal, window_size, softcap, alibi_slopes, want_lse):
    """(B, L, H, D) q over (B, S, K, D) k and (B, S, K, E) v: out (B, L, H, E), lse (B, H, L)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, heads, len, dim)
    heads, kv_heads = q.shape[1], k.shape[1]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    allowed = _allowed(q.shape[2], k.shape[2], causal, tuple(window_size), q.device)
    simple = softcap == 0.0 and alibi_slopes is None
    k_full, v_full = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    if simple:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=heads != kv_heads
        )
    else:
        weights = torch.softmax(_scores(q, k_full, scale, softcap, alibi_slopes, allowed), -1)
        out = torch.einsum("bhls,bhse->bhle", weights, v_full.float()).to(q.dtype)
    out = torch.where(allowed.any(-1)[:, None], out, torch.zeros_like(out))
    lse = None
    if want_lse:
        lse = torch.logsumexp(_scores(q, k_full, scale, softcap, alibi_slopes, allowed), -1)
    return out.transpose(1, 2), lse


def _no_dropout(dropout_p):
    if dropout_p:
        raise NotImplementedError("this build draws no dropout")


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (B, L, H, D), k (B, S, K, D), v (B, S, K, E) -> out (B, L, H, E)[, lse, None]."""
    _no_dropout(dropout_p)
    out, lse = _attend(
        q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs
    )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Packed q (total_q, H, D), k (total_k, K, D), v (total_k, K, E) -> out (total_q, H, E)
    [, lse (H, total_q), None]; sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]."""
    _no_dropout(dropout_p)
    if block_table is not None:
        raise NotImplementedError("this build takes no paged cache in varlen")
    outs, lses = [], []
    for b in range(len(cu_seqlens_q) - 1):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        keys = slice(int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1]))
        out, lse = _attend(
            q[None, rows],
            k[None, keys],
            v[None, keys],
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            return_attn_probs,
        )
        outs.append(out[0])
        lses.append(None if lse is None else lse[0])
    out = torch.cat(outs)
    return (out, torch.cat(lses, dim=-1), None) if return_attn_probs else out


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """q (B, L, H, D) over a KV cache: (B, S_max, K, D) or, with block_table (B, pages),
    pages (P, page, K, D); row b reads its first cache_seqlens[b] keys."""
    if k is not None or v is not None or rotary_cos is not None or cache_batch_idx is not None:
        raise NotImplementedError("this build does not append to the cache")
    outs, lses = [], []
    for b in range(q.shape[0]):
        if block_table is None:
            keys, values = k_cache[b], v_cache[b]
        else:
            pages = block_table[b].long()
            keys, values = k_cache[pages].flatten(0, 1), v_cache[pages].flatten(0, 1)
        if cache_seqlens is not None:
            length = int(cache_seqlens[b])
            keys, values = keys[:length], values[:length]
        out, lse = _attend(
            q[b : b + 1],
            keys[None],
            values[None],
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            return_softmax_lse,
        )
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_softmax_lse else out
