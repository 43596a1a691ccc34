"""A PyTorch implementation of latent attention written from its description
(docs/conventions.md, "Latent attention"; FlashAttention 3's ``qv``; DeepSeek-V2's absorbed
MLA decode), for the oracle's ``framework="torch"`` convention. Nothing here imports refattn.

``attention(q, k, v, *, qv=None, scale=None, causal=False, align="top_left", gqa="interleave",
kv_lengths=None, q_descale=None, k_descale=None, v_descale=None, return_lse=False)``: torch
tensors (..., H, L, D) / (..., K, S, D) / (..., K, S, E) / qv (..., H, L, E); scores
``s (q . k + qv . v)`` with ``s = 1/sqrt(D + E)`` by default (1/sqrt(D) without qv), computed in
float32 for half inputs (float64 for float64), keys j >= kv_lengths[b] and (causal) j > i + o
excluded, ``o = 0`` or ``S_b - L``; empty rows give out 0 and lse -inf. float8 inputs are
dequantised with their per-(batch, kv head) descales (qv with q's). Any other option raises
NotImplementedError (the oracle reports "unsupported").
"""

from __future__ import annotations

import math

__all__ = ["attention"]

_TAKES = {"qv", "scale", "causal", "align", "gqa", "kv_lengths", "q_descale", "k_descale"}
_TAKES |= {"v_descale", "return_lse", "empty_rows"}


def _float(torch, x, acc, descale=None, heads=None):
    if str(x.dtype).startswith("torch.float8"):
        x = x.to(torch.float64)
        if descale is not None:
            factor = descale.to(torch.float64)
            if heads is not None:  # query heads use their kv head's factor
                factor = factor.repeat_interleave(heads // factor.shape[-1], dim=-1)
            x = x * factor[..., None, None]
    return x.to(acc)


def attention(q, k, v, **options):
    import torch

    unknown = {n for n, x in options.items() if x is not None and x is not False} - _TAKES
    if unknown or (options.get("empty_rows") or "zero") != "zero":
        raise NotImplementedError(f"latent torch twin: no {sorted(unknown) or 'empty_rows'}")
    out_dtype = q.dtype if not str(q.dtype).startswith("torch.float8") else torch.bfloat16
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads, kv_heads = q.shape[-3], k.shape[-3]
    qf = _float(torch, q, acc, options.get("q_descale"), heads)
    kf = _float(torch, k, acc, options.get("k_descale"))
    vf = _float(torch, v, acc, options.get("v_descale"))
    group = heads // kv_heads
    if (options.get("gqa") or "interleave") == "interleave":
        kh, vh = kf.repeat_interleave(group, dim=-3), vf.repeat_interleave(group, dim=-3)
    else:
        kh, vh = (
            kf.repeat(*([1] * (kf.dim() - 3)), group, 1, 1),
            vf.repeat(*([1] * (vf.dim() - 3)), group, 1, 1),
        )
    scores = qf @ kh.transpose(-1, -2)
    width = q.shape[-1]
    qv = options.get("qv")
    if qv is not None:
        qvf = _float(torch, qv, acc, options.get("q_descale"), heads)
        scores = scores + qvf @ vh.transpose(-1, -2)
        width += v.shape[-1]
    scale = options.get("scale")
    scores = scores * (1 / math.sqrt(width) if scale is None else scale)
    length, keys = q.shape[-2], k.shape[-2]
    lengths = options.get("kv_lengths")
    own = (
        torch.full((1,) * (q.dim() - 3), keys, dtype=torch.int64, device=q.device)
        if lengths is None
        else lengths.to(torch.int64).reshape(q.shape[:-3] if q.dim() > 3 else (1,))
    )
    own = own[..., None, None, None]
    rows = torch.arange(length, device=q.device)[:, None]
    cols = torch.arange(keys, device=q.device)[None, :]
    allowed = cols < own
    if options.get("causal"):
        offset = 0 if (options.get("align") or "top_left") == "top_left" else own - length
        allowed = allowed & (cols <= rows + offset)
    allowed = allowed.expand(scores.shape)
    masked = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(masked, dim=-1)
    weights = torch.where(allowed, torch.exp(masked - lse[..., None]), 0.0)
    weights = torch.nan_to_num(weights, nan=0.0)
    out = (weights @ vh).to(out_dtype)
    return (out, lse.to(out_dtype)) if options.get("return_lse") else out
