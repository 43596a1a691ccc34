"""FlashInfer's ``single_prefill_with_kv_cache`` and xformers' ``memory_efficient_attention`` as
their users call them (their keyword names, layouts and conventions), torch math underneath:
what ``--signature flashinfer`` / ``--signature xformers`` validate with no wrapper."""

from __future__ import annotations

import torch


def _softmax_attend(q, k, v, scores):
    """(heads, L, S) float32 scores over (heads, S, E) v; rows with no finite score give 0."""
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("hls,hse->hle", weights, v.float()).to(q.dtype)


def single_prefill_with_kv_cache(
    q,
    k,
    v,
    custom_mask=None,
    packed_custom_mask=None,
    causal=False,
    kv_layout="NHD",
    pos_encoding_mode="NONE",
    use_fp16_qk_reduction=False,
    sm_scale=None,
    window_left=-1,
    logits_soft_cap=None,
    rope_scale=None,
    rope_theta=None,
    return_lse=False,
):
    """q (L, H, D), k (S, K, D), v (S, K, E) (NHD); causal bottom-right; window_left keys to
    the left of the diagonal."""
    if kv_layout != "NHD" or pos_encoding_mode != "NONE" or custom_mask is not None:
        raise NotImplementedError("this sketch: NHD, no RoPE, no custom mask")
    length, heads, dim = q.shape
    keys, kv_heads = k.shape[:2]
    scale = dim**-0.5 if sm_scale is None else sm_scale
    qh = q.transpose(0, 1).float()
    kh = k.transpose(0, 1).float().repeat_interleave(heads // kv_heads, 0)
    vh = v.transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("hld,hsd->hls", qh, kh) * scale
    if logits_soft_cap:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    diagonal = torch.arange(length)[:, None] + (keys - length)
    key = torch.arange(keys)[None, :]
    allowed = torch.ones(length, keys, dtype=torch.bool)
    if causal:
        allowed &= key <= diagonal
    if window_left >= 0:
        allowed &= key >= diagonal - window_left
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = _softmax_attend(q, k, vh, scores)
    if return_lse:  # FlashInfer's lse: base 2, (L, H)
        lse = torch.logsumexp(scores, -1) / torch.log(torch.tensor(2.0))
        return out.transpose(0, 1), lse.transpose(0, 1).float()
    return out.transpose(0, 1)


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None):
    """(B, M, H, K) tensors; ``attn_bias`` a (B, H, M, N) tensor added to the scores."""
    if p:
        raise NotImplementedError("this sketch draws no dropout")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q, k = (x.transpose(1, 2).float() for x in (query, key))
    scores = torch.einsum("bhld,bhsd->bhls", q, k) * scale
    if attn_bias is not None:
        scores = scores + attn_bias.float()
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    out = torch.einsum("bhls,bhse->bhle", weights, value.transpose(1, 2).float())
    return out.to(query.dtype).transpose(1, 2)
