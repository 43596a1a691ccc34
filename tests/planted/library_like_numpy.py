"""FlashInfer's ``single_prefill_with_kv_cache``, xformers' ``memory_efficient_attention`` (4-D
and grouped 5-D) and FlashAttention 3's ``flash_attn_with_kvcache`` (``page_table``) with the
libraries' own signatures, NumPy underneath (no torch needed): validated with a preset whose
framework is set to "numpy" (``get(name).replace(framework="numpy")``).

Each computes in float64 (oracle.reading.baseline.textbook_attention) and rounds once to the input
dtype; FlashInfer's lse is returned in base 2, (L, H), as FlashInfer returns it.
"""

from __future__ import annotations

import numpy as np

from oracle.reading.baseline import textbook_attention

__all__ = [
    "single_prefill_with_kv_cache",
    "single_prefill_natural_lse",
    "memory_efficient_attention",
    "flash_attn_with_kvcache",
]


def _attend(q, k, v, **options):
    """bhld float64 textbook (out, lse) of (B, H, L, D) q over (B, K, S, D) k, v."""
    result = textbook_attention(q, k, v, dtype="float64", **options)
    return result.out, result.lse


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
    """q (L, H, D), k (S, K, D), v (S, K, E); causal bottom-right; lse (L, H) in base 2."""
    if kv_layout != "NHD" or custom_mask is not None or pos_encoding_mode != "NONE":
        raise NotImplementedError("this sketch: NHD, no custom mask, no RoPE")
    options = {"scale": sm_scale, "causal": causal, "align": "bottom_right"}
    if window_left >= 0:
        options["window"] = (window_left, 0 if causal else None)
    if logits_soft_cap:
        options["softcap"] = logits_soft_cap
    bhld = [np.swapaxes(a, 0, 1)[None].astype(np.float64) for a in (q, k, v)]
    out, lse = _attend(*bhld, **{n: x for n, x in options.items() if x is not None})
    out = np.swapaxes(out[0], 0, 1).astype(q.dtype)
    if not return_lse:
        return out
    return out, (lse[0].T / np.log(2.0)).astype(np.float32)


def single_prefill_natural_lse(q, k, v, **kwargs):
    """The same with a natural-log lse: FlashInfer's preset must find it wrong."""
    result = single_prefill_with_kv_cache(q, k, v, **kwargs)
    if isinstance(result, tuple):
        return result[0], (result[1] * np.log(2.0)).astype(np.float32)
    return result


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None):
    """(B, M, H, K) tensors, or grouped (B, M, G, H, K) with key/value repeated along H;
    ``attn_bias`` (B, H, M, N) or (B, G, H, M, N) added to the scores."""
    if p:
        raise NotImplementedError("this sketch draws no dropout")
    grouped = query.ndim == 5
    if not grouped and query.shape[2] != key.shape[2]:  # as xformers: GQA only in 5-D
        raise ValueError("query and key must have the same number of heads in the BMHK form")
    if grouped:  # fold (G, H) into one head axis: key/value heads are repeated along H
        b, m, g, h, _ = query.shape
        query, key, value = (
            a.reshape(*a.shape[:2], g * h, a.shape[-1]) for a in (query, key, value)
        )
        if attn_bias is not None:
            attn_bias = attn_bias.reshape(b, g * h, *attn_bias.shape[-2:])
    q, k, v = (np.swapaxes(a, 1, 2).astype(np.float64) for a in (query, key, value))
    options = {"scale": scale}
    if attn_bias is not None:
        options["bias"] = attn_bias.astype(np.float64)
    out, _ = _attend(q, k, v, **{n: x for n, x in options.items() if x is not None})
    out = np.swapaxes(out, 1, 2).astype(query.dtype)
    return out.reshape(*out.shape[:2], g, h, out.shape[-1]) if grouped else out


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):
    """FlashAttention 3's names: a paged cache read through ``page_table``; q (B, L, H, D),
    caches (pages, page, K, D); causal and window bottom-right; lse (B, H, L)."""
    if page_table is None:
        raise TypeError("this sketch reads a paged cache: page_table is required")
    batch, length = q.shape[:2]
    outs, lses = [], []
    for b in range(batch):
        keys = int(cache_seqlens[b])
        kb, vb = (c[page_table[b]].reshape(-1, *c.shape[2:])[:keys] for c in (k_cache, v_cache))
        options = {"scale": softmax_scale, "causal": causal, "align": "bottom_right"}
        left, right = window_size
        if left >= 0 or right >= 0:
            options["window"] = (None if left < 0 else left, None if right < 0 else right)
        if softcap:
            options["softcap"] = softcap
        bhld = [np.swapaxes(a, 0, 1)[None].astype(np.float64) for a in (q[b], kb, vb)]
        out, lse = _attend(*bhld, **{n: x for n, x in options.items() if x is not None})
        outs.append(np.swapaxes(out[0], 0, 1))
        lses.append(lse[0])
    out = np.stack(outs).astype(q.dtype)
    return (out, np.stack(lses).astype(np.float32)) if return_softmax_lse else out
