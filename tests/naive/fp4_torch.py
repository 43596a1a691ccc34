"""A PyTorch implementation of fp4 (NVFP4 / MXFP4) attention, written from docs/conventions.md
("fp4 inputs"), for ``refattn-oracle validate --framework torch`` (nothing here imports
refattn).

With ``framework="torch"`` the oracle passes fp4 arrays as torch.uint8 e2m1 codes (one per
byte, code in the low nibble), block scales as torch.float8_e4m3fn / torch.float8_e8m0fnu and
descales as float32. Values are ``E2M1[code] * block_scale[..., d // n] * descale`` in float64
(exact), attention is the textbook softmax in float64 with the options the fp4 cases use
(scale, causal, align, gqa, kv_lengths); anything else is NotImplementedError. Results are
in q's dtype (float32 for fp4 q).

    refattn-oracle validate --impl tests.naive.fp4_torch:attention --framework torch \\
        --suite default --dtype float32 --case 'fp4-*' --case 'grad-fp4-*' --grads
"""

from __future__ import annotations

import math

__all__ = ["attention"]

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
_SUPPORTED = {"scale", "causal", "align", "gqa", "kv_lengths", "return_lse"}


def _torch():
    import torch

    return torch


def _values(torch, x, block_scale, descale, name, heads, kv_heads, gqa):
    """float64 values of an fp4 (uint8 codes) or float input."""
    if x.dtype != torch.uint8:
        return x.to(torch.float64)
    table = torch.tensor(_E2M1, dtype=torch.float64)
    values = table[x.long()]
    block = x.shape[-1] // block_scale.shape[-1]
    values = values * block_scale.to(torch.float64).repeat_interleave(block, dim=-1)
    if descale is not None:
        factor = descale.to(torch.float64)
        if name == "q":
            group = heads // kv_heads
            heads_idx = torch.arange(heads)
            reads = heads_idx // group if gqa == "interleave" else heads_idx % kv_heads
            factor = factor[..., reads]
        values = values * factor[..., None, None]
    return values


def _inputs(torch, q, k, v, options):
    unknown = (
        set(options) - _SUPPORTED - {f"{n}_{s}" for n in "qkv" for s in ("block_scale", "descale")}
    )
    unknown = {n for n in unknown if options.get(n) is not None}
    if unknown:
        raise NotImplementedError(f"fp4_torch: no support for {sorted(unknown)}")
    gqa = options.get("gqa") or "interleave"
    heads, kv_heads = q.shape[-3], k.shape[-3]
    return [
        _values(
            torch,
            x,
            options.get(f"{n}_block_scale"),
            options.get(f"{n}_descale"),
            n,
            heads,
            kv_heads,
            gqa,
        )
        for n, x in zip("qkv", (q, k, v), strict=True)
    ]


def _forward(torch, q, k, v, options):
    """(out, lse) in float64: q (B, H, L, D), k (B, K, S, D), v (B, K, S, E)."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    group = heads // kv_heads
    gqa = options.get("gqa") or "interleave"
    if gqa == "interleave":
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    else:
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    length, keys = q.shape[-2], k.shape[-2]
    scale = options.get("scale")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * (q @ k.transpose(-1, -2))
    batch = q.shape[0]
    lengths = options.get("kv_lengths")
    lengths = torch.full((batch,), keys) if lengths is None else torch.as_tensor(lengths).long()
    rows = torch.arange(length)[None, :, None]
    cols = torch.arange(keys)[None, None, :]
    allowed = cols < lengths[:, None, None]
    if options.get("causal"):
        offset = lengths[:, None, None] - length if options.get("align") == "bottom_right" else 0
        allowed = allowed & (cols <= rows + offset)
    allowed = allowed[:, None]
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.where(allowed, torch.exp(scores - lse[..., None]), 0.0)
    weights = torch.nan_to_num(weights, nan=0.0)
    return weights @ v, lse


def _out_dtype(torch, q):
    return torch.float32 if q.dtype == torch.uint8 else q.dtype


def attention(q, k, v, **options):
    """fp4 attention (see the module docstring); ``return_lse`` gives (out, lse)."""
    torch = _torch()
    values = _inputs(torch, q, k, v, options)
    out, lse = _forward(torch, *values, options)
    dtype = _out_dtype(torch, q)
    if options.get("return_lse"):
        return out.to(dtype), lse.to(dtype)
    return out.to(dtype)


def _vjp(q, k, v, grad_out, grad_lse=None, **options):
    """(dq, dk, dv) with respect to the dequantised values, by autograd."""
    torch = _torch()
    values = [x.detach().requires_grad_(True) for x in _inputs(torch, q, k, v, options)]
    out, lse = _forward(torch, *values, options)
    total = (out * grad_out.to(torch.float64)).sum()
    if grad_lse is not None:
        total = (
            total + (torch.where(torch.isfinite(lse), lse, 0.0) * grad_lse.to(torch.float64)).sum()
        )
    total.backward()
    dtype = _out_dtype(torch, q)
    return tuple(x.grad.to(dtype) for x in values)


attention.vjp = _vjp
