"""Torch functions with the REAL signatures and return values of the 2025-26 attention
kernels, written from their public interfaces (argument names, shapes, dtypes, return tuples),
computing in float64 and rounding once to the output dtype: FlashAttention 3's hopper
``flash_attn_func`` / ``flash_attn_with_kvcache``, FlashMLA's ``flash_mla_sparse_fwd`` /
``flash_mla_with_kvcache``, FlashInfer's ``trtllm_batch_decode_with_kv_cache`` (NVFP4 cache) and
``merge_state`` / ``merge_states``. Each must pass its suite through ``--signature NAME`` with
no wrapper (tests/meta/test_presets_2026.py). Nothing here imports refattn or the oracle.

:func:`mistake` plants one named mistake in these functions for the duration of a call (the
one-line bugs of tests/planted/library_bugs_2026.py); with none planted they are correct.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

__all__ = [
    "flash_attn_func",
    "flash_attn_with_kvcache",
    "flash_mla_sparse_fwd",
    "flash_mla_with_kvcache",
    "trtllm_batch_decode_with_kv_cache",
    "merge_state",
    "merge_states",
]

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

#: the mistake planted for the current call (None: the correct functions)
_MISTAKE = contextvars.ContextVar("library_2026_mistake", default=None)
MISTAKES = ("off-by-one", "base2", "key-width-scale", "qv", "nibbles")


@contextlib.contextmanager
def mistake(name):
    """Within the block, the functions make mistake ``name`` (one of :data:`MISTAKES`)."""
    if name not in MISTAKES:
        raise ValueError(f"mistake: {name!r} is not one of {MISTAKES}")
    token = _MISTAKE.set(name)
    try:
        yield
    finally:
        _MISTAKE.reset(token)


def _planted(name) -> bool:
    return _MISTAKE.get() == name


def _torch():
    import torch

    return torch


def _f64(x, descale=None, heads=None):
    """x as float64 (float8 dequantised with its (B, K) descale, per head of ``heads``)."""
    x = x.double()
    if descale is None:
        return x
    per = descale.double()  # (B, K)
    if heads is not None and heads != per.shape[1]:
        per = per.repeat_interleave(heads // per.shape[1], dim=1)
    return x * per[:, None, :, None]  # x (B, L, heads, D)


def _softmax_rows(scores, allowed, values):
    """scores (..., H, L, S) with ``allowed`` -> out (..., H, L, E), lse (..., H, L) (natural;
    empty rows: out 0, lse -inf)."""
    torch = _torch()
    scores = torch.where(allowed, scores, torch.tensor(-math.inf, dtype=torch.float64))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weights = torch.where(allowed, torch.exp(scores - safe[..., None]), 0.0)
    return weights @ values, lse


def _attend(q, k, v, allowed, scale, softcap=0.0, qv=None):
    """q (B, L, H, D), k (B, S, K, D), v (B, S, K, E) float64; allowed (B, L, S) ->
    out (B, L, H, E), lse (B, H, L); query head h reads kv head h // G."""
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    kh = k.repeat_interleave(group, dim=2).permute(0, 2, 3, 1)  # (B, H, D, S)
    vh = v.repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # (B, H, S, E)
    scores = q.permute(0, 2, 1, 3) @ kh
    if qv is not None and not _planted("qv"):
        scores = scores + qv.permute(0, 2, 1, 3) @ vh.transpose(-1, -2)
    scores = scores * scale
    if softcap:
        scores = softcap * (scores / softcap).tanh()
    out, lse = _softmax_rows(scores, allowed[:, None], vh)
    return out.permute(0, 2, 1, 3), lse


def _flash_allowed(rows, lengths, keys, causal, window_size):
    """(B, L, S): FlashAttention's bottom-right causal/window per sequence length S_b."""
    torch = _torch()
    i = torch.arange(rows)[None, :, None]
    j = torch.arange(keys)[None, None, :]
    top = lengths[:, None, None]
    diag = i + top - rows
    allowed = j < top
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        allowed = allowed & (j >= diag - left)
    if right >= 0:
        allowed = allowed & (j <= diag + right)
    return allowed


def _check_shapes(q, k, v, names=("k", "v")):
    """FlashAttention 3's shape checks (its C++ ``CHECK_SHAPE`` / ``TORCH_CHECK``, raised as
    RuntimeError): k (.., S, K, D) with q's D, v (.., S, K, E) with k's leading axes, H a
    multiple of K."""
    if k.shape[-1] != q.shape[-1]:
        raise RuntimeError(f"{names[0]} must have head dim {q.shape[-1]}, got {tuple(k.shape)}")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise RuntimeError(f"{names[1]} must have shape {tuple(k.shape[:-1])} + (headdim_v,)")
    if q.shape[-2] % k.shape[-2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def _out_dtype(q):
    torch = _torch()
    return torch.bfloat16 if q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else q.dtype


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """FlashAttention 3: q (B, L, H, D), k (B, S, K, D), v (B, S, K, E), qv (B, L, H, E) ->
    out (B, L, H, E) [, lse (B, H, L) float32]."""
    torch = _torch()
    _check_shapes(q, k, v)
    heads = q.shape[2]
    if softmax_scale is None:
        softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0)) ** -0.5
    qf = _f64(q, q_descale, heads)
    kf, vf = _f64(k, k_descale), _f64(v, v_descale)
    qvf = None if qv is None else _f64(qv, q_descale, heads)
    lengths = torch.full((q.shape[0],), k.shape[1])
    allowed = _flash_allowed(q.shape[1], lengths, k.shape[1], causal, window_size)
    out, lse = _attend(qf, kf, vf, allowed, softmax_scale, softcap, qvf)
    out = out.to(_out_dtype(q))
    return (out, lse.float()) if return_attn_probs else out


def _gather(cache, table, lengths):
    """(B, S, K, X) of a paged cache (P, page, K, X) along the table, S = max S_b; slots past
    S_b read as 0 (a kernel never loads them)."""
    torch = _torch()
    keys = int(lengths.max())
    pages = cache[table.long()]  # (B, per_seq, page, K, X)
    seq = pages.reshape(table.shape[0], -1, *cache.shape[2:])[:, :keys]
    owned = torch.arange(keys)[None, :] < lengths.long()[:, None]
    bits = seq.view(torch.uint8) if seq.element_size() == 1 else seq  # float8: by its bits
    kept = torch.where(owned[:, :, None, None], bits, torch.zeros((), dtype=bits.dtype))
    return kept.view(seq.dtype)


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
    """FlashAttention 3's decode: q (B, L, H, D), caches (P, page, K, D | E), page_table
    (B, pages), cache_seqlens (B,) -> out (B, L, H, E) [, lse (B, H, L) float32]."""
    _check_shapes(q, k_cache, v_cache, ("k_cache", "v_cache"))
    heads = q.shape[2]
    if softmax_scale is None:
        softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0)) ** -0.5
    keys = int(cache_seqlens.max())
    kf = _f64(_gather(k_cache, page_table, cache_seqlens), k_descale)
    vf = _f64(_gather(v_cache, page_table, cache_seqlens), v_descale)
    lengths = cache_seqlens.long()
    allowed = _flash_allowed(q.shape[1], lengths, keys, causal, window_size)
    qvf = None if qv is None else _f64(qv, q_descale, heads)
    out, lse = _attend(_f64(q, q_descale, heads), kf, vf, allowed, softmax_scale, softcap, qvf)
    out = out.to(_out_dtype(q))
    return (out, lse.float()) if return_softmax_lse else out


def _sparse_rows(q, gathered, invalid, scale, d_v, attn_sink):
    """q (N, H, D), gathered (N, K, T, D), invalid (N, K, T) -> out (N, H, d_v) float64,
    max_logits (N, H), lse (N, H) (FlashMLA's: no sink, +inf on rows with no valid key)."""
    torch = _torch()
    heads, kv_heads = q.shape[1], gathered.shape[1]
    group = heads // kv_heads
    kh = gathered.repeat_interleave(group, dim=1)  # (N, H, T, D)
    scores = (q[:, :, None, :] @ kh.transpose(-1, -2))[:, :, 0] * scale  # (N, H, T)
    bad = invalid.repeat_interleave(group, dim=1)
    scores = torch.where(bad, torch.tensor(-math.inf, dtype=torch.float64), scores)
    lse = torch.logsumexp(scores, dim=-1)
    max_logits = scores.max(dim=-1).values
    norm = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.double()[None])
    norm = torch.where(torch.isneginf(norm), torch.tensor(math.inf, dtype=torch.float64), norm)
    weights = torch.exp(scores - norm[..., None])
    out = (weights[:, :, None, :] @ kh[..., :d_v])[:, :, 0]
    lse = torch.where(torch.isneginf(lse), torch.tensor(math.inf, dtype=torch.float64), lse)
    return out, max_logits, lse


def _read_indices(indices):
    """The indices as int64, -1 (and every negative) kept."""
    idx = indices.long()
    if _planted("off-by-one"):  # a 1-based top-k list read by a 0-based gather
        idx = _torch().where(idx >= 0, idx + 1, idx)
    return idx


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """FlashMLA's sparse prefill: q (s_q, H, D), kv (s_kv, K, D), indices (s_q, K, T) int32
    (-1 or >= s_kv invalid) -> (out (s_q, H, d_v), max_logits (s_q, H), lse (s_q, H))."""
    torch = _torch()
    idx = _read_indices(indices)
    invalid = (idx < 0) | (idx >= kv.shape[0])
    if topk_length is not None:
        top = torch.arange(idx.shape[-1])[None, None, :]
        invalid = invalid | (top >= topk_length.long()[:, None, None])
    safe = torch.where(invalid, torch.zeros_like(idx), idx)
    heads_kv = torch.arange(kv.shape[1])[None, :, None]
    gathered = kv.double()[safe, heads_kv]  # (s_q, K, T, D)
    out, max_logits, lse = _sparse_rows(q.double(), gathered, invalid, sm_scale, d_v, attn_sink)
    if _planted("base2"):
        lse = lse / math.log(2.0)
    return out.to(q.dtype), max_logits.float(), lse.float()


def flash_mla_with_kvcache(
    q,
    k_cache,
    block_table,
    cache_seqlens,
    head_dim_v,
    tile_scheduler_metadata,
    num_splits=None,
    softmax_scale=None,
    causal=False,
    is_fp8_kvcache=False,
    indices=None,
    attn_sink=None,
    extra_k_cache=None,
    extra_indices_in_kvcache=None,
    topk_length=None,
    extra_topk_length=None,
):
    """FlashMLA's decode: q (B, s_q, H, D), k_cache (P, page, 1, D), block_table (B, pages),
    cache_seqlens (B,) -> (out (B, s_q, H, head_dim_v), lse (B, H, s_q) float32, +inf on rows
    with no key). With ``indices`` (B, s_q, topk) int32 (each key's slot ``page * page_size +
    offset`` in the cache, -1 invalid) the sparse decode: ``is_fp8_kvcache`` then, each token
    656 bytes (512 e4m3 nope values, 4 float32 scales, one per 128, 64 bfloat16 rope values),
    not causal; block_table and cache_seqlens unused."""
    torch = _torch()
    if extra_k_cache is not None or extra_indices_in_kvcache is not None:
        raise NotImplementedError("this twin computes no extra_k_cache")
    if softmax_scale is None or _planted("key-width-scale"):
        softmax_scale = q.shape[-1] ** -0.5
    if indices is not None:
        assert not causal, "causal must be False when sparse attention is enabled"
        assert is_fp8_kvcache, "is_fp8_kvcache must be True when sparse attention is enabled"
        return _sparse_decode(
            q, k_cache, indices, head_dim_v, softmax_scale, attn_sink, topk_length
        )
    if is_fp8_kvcache or topk_length is not None:
        raise NotImplementedError("this twin computes the dense path on a bf16 cache only")
    keys = int(cache_seqlens.max())
    kf = _gather(k_cache, block_table, cache_seqlens).double()  # (B, S, 1, D)
    allowed = _flash_allowed(q.shape[1], cache_seqlens.long(), keys, causal, (-1, -1))
    out, lse = _attend(q.double(), kf, kf[..., :head_dim_v], allowed, softmax_scale)
    if attn_sink is not None:
        sink = attn_sink.double()[None, :, None]
        out = out * torch.exp(lse - torch.logaddexp(lse, sink)).permute(0, 2, 1)[..., None]
    lse = torch.where(torch.isneginf(lse), torch.tensor(math.inf, dtype=torch.float64), lse)
    return out.to(q.dtype), lse.float()


def _fp8_latent(k_cache):
    """The 656-byte fp8 tokens (P, page, 1, 656) as float64 (P, page, 1, 576)."""
    torch = _torch()
    raw = k_cache.view(torch.uint8)
    nope = raw[..., :512].contiguous().view(torch.float8_e4m3fn).double()
    scales = raw[..., 512:528].contiguous().view(torch.float32).double()
    rope = raw[..., 528:656].contiguous().view(torch.bfloat16).double()
    return torch.cat([nope * scales.repeat_interleave(128, dim=-1), rope], dim=-1)


def _sparse_decode(q, k_cache, indices, head_dim_v, scale, attn_sink, topk_length):
    """FlashMLA's sparse decode over the cache's slots (see flash_mla_with_kvcache)."""
    torch = _torch()
    batch, rows, heads, _ = q.shape
    flat = _fp8_latent(k_cache).reshape(-1, 576)
    idx = _read_indices(indices).reshape(batch * rows, 1, -1)  # (N, 1, topk)
    invalid = (idx < 0) | (idx >= flat.shape[0])
    if topk_length is not None:
        top = torch.arange(idx.shape[-1])[None, None, :]
        lengths = topk_length.long().repeat_interleave(rows)[:, None, None]
        invalid = invalid | (top >= lengths)
    gathered = flat[torch.where(invalid, torch.zeros_like(idx), idx)]  # (N, 1, topk, 576)
    gathered = torch.where(invalid[..., None], torch.zeros((), dtype=torch.float64), gathered)
    q_rows = q.double().reshape(batch * rows, heads, -1)
    out, _, lse = _sparse_rows(q_rows, gathered, invalid, scale, head_dim_v, attn_sink)
    out = out.reshape(batch, rows, heads, head_dim_v)
    return out.to(q.dtype), lse.reshape(batch, rows, heads).transpose(1, 2).float()


def _fp4_values(packed, scales, block):
    """(..., X/2) uint8, two e2m1 codes per byte (low nibble first), and block scales
    (..., X/block) -> float64 (..., X)."""
    torch = _torch()
    table = torch.tensor(_E2M1 + tuple(-x for x in _E2M1), dtype=torch.float64)
    low, high = (packed & 0x0F).long(), (packed >> 4).long()
    if _planted("nibbles"):
        low, high = high, low
    codes = torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1)
    values = table[codes]
    scale = scales.double().repeat_interleave(block, dim=-1)
    return values * scale


def trtllm_batch_decode_with_kv_cache(
    query,
    kv_cache,
    workspace_buffer,
    block_tables,
    seq_lens,
    max_seq_len,
    bmm1_scale=1.0,
    bmm2_scale=1.0,
    window_left=-1,
    out=None,
    out_dtype=None,
    o_sf_scale=None,
    o_sf_vec_size=None,
    sinks=None,
    kv_layout="HND",
    enable_pdl=None,
    backend="auto",
    q_len_per_req=1,
    o_scale=1.0,
    mask=None,
    max_q_len=None,
    cum_seq_lens_q=None,
    kv_cache_sf=None,
):
    """FlashInfer's TensorRT-LLM decode, NVFP4 cache: query (B * q_len, H, D), kv_cache
    (k, v) each (P, K, page, D/2) uint8 (HND), kv_cache_sf their e4m3 scales (P, K, page,
    D/16) -> out (B * q_len, H, E) in query's dtype."""
    k_cache, v_cache = kv_cache
    k_sf, v_sf = kv_cache_sf
    if kv_layout == "HND":  # to (P, page, K, X)
        k_cache, v_cache, k_sf, v_sf = (x.transpose(1, 2) for x in (k_cache, v_cache, k_sf, v_sf))
    block = 2 * k_cache.shape[-1] // k_sf.shape[-1]
    keys = int(seq_lens.max())
    pages = [_gather(x, block_tables, seq_lens) for x in (k_cache, k_sf, v_cache, v_sf)]
    kf, vf = _fp4_values(pages[0], pages[1], block), _fp4_values(pages[2], pages[3], block)
    batch = block_tables.shape[0]
    q = query.double().reshape(batch, q_len_per_req, *query.shape[1:])
    allowed = _flash_allowed(q_len_per_req, seq_lens.long(), keys, True, (window_left, 0))
    result, _ = _attend(q, kf, vf * bmm2_scale, allowed, bmm1_scale)
    return result.reshape(query.shape[0], query.shape[1], -1).to(out_dtype or query.dtype)


def merge_state(v_a, s_a, v_b, s_b):
    """FlashInfer's merge of two states: v (seq, heads, dim), s (seq, heads) float32 base-2
    lse -> (V, S)."""
    return merge_states(
        _torch().stack([v_a, v_b], dim=1), _torch().stack([s_a, s_b], dim=1)
    )  # fmt: skip


def merge_states(v, s):
    """FlashInfer's merge of many states: v (seq, num_states, heads, dim), s (seq,
    num_states, heads) float32 base-2 lse -> (V (seq, heads, dim), S (seq, heads))."""
    torch = _torch()
    lse = s.double() * math.log(2.0)
    top = lse.max(dim=1, keepdim=True).values
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)  # (seq, P, heads)
    total = weights.sum(dim=1)
    merged = (weights[..., None] * v.double()).sum(dim=1)
    merged = torch.where(total[..., None] > 0, merged / total[..., None], 0.0)
    merged_lse = (torch.log(total) + top[:, 0]) / math.log(2.0)
    return merged.to(v.dtype), merged_lse.float()
