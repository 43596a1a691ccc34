"""torch attention on a CUDA device with one backend forced, in the oracle's torch convention.

Implementations under test for ``tools/gpu_check.py`` (``--framework torch --device cuda``):
each takes torch tensors ``q (B, H, L, D)``, ``k (B, K, S, D)``, ``v (B, K, S, E)`` and the
keywords of :func:`refattn.attention` that differ from their defaults, and raises
``NotImplementedError`` for a keyword the backend cannot express, so the oracle reports the case
"unsupported" rather than failing it.

``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``
    ``torch.nn.functional.scaled_dot_product_attention`` inside
    ``torch.nn.attention.sdpa_kernel(<backend>)``: torch refuses the call (RuntimeError "No
    available kernel") when the forced backend cannot take the inputs, which the oracle reports
    as an error with torch's message; that is a finding about the backend, not about refattn.
``flex_compiled``
    ``torch.compile(flex_attention)`` with a ``mask_mod`` for the allowed set and a
    ``score_mod`` for bias and softcap.

Each has a ``.vjp`` (autograd through the same call) returning ``(dq, dk, dv, dbias)``.

Conventions pinned (torch >= 2.5): causal top-left is ``is_causal=True``; bottom-right, masks
and biases become one ``attn_mask`` (bool: True = attend; float: added, -inf excludes); a bias
that does not convert exactly to q's dtype is unsupported (torch would add the rounded bias).

Examples
--------
>>> from tools import gpu_impls  # doctest: +SKIP
>>> out = gpu_impls.sdpa_math(q, k, v, causal=True)  # doctest: +SKIP
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_compiled", "IMPLS"]

_SDPA_KEYWORDS = {"scale", "causal", "align", "mask", "bias", "gqa", "softcap", "window"}


def _reject(options, allowed):
    other = sorted(set(options) - allowed)
    if other:
        raise NotImplementedError(f"{', '.join(other)}: not expressible with this torch call")
    if options.get("gqa", "interleave") != "interleave":
        raise NotImplementedError("gqa='tile': torch maps query head h to kv head h // G only")


def _exact_bias(bias, dtype):
    """The bias in q's dtype, or NotImplementedError when it would round."""
    if bias is None:
        return None
    cast = bias.to(dtype)
    same = (cast.to(bias.dtype) == bias) | (torch.isinf(bias) & torch.isinf(cast.to(bias.dtype)))
    if not bool(same.all()):
        raise NotImplementedError(f"bias: does not convert exactly to {dtype}")
    return cast


def _causal_set(length, keys, align, device):
    """(L, S) bool: key j allowed for row i when j <= i + o (o = 0 top-left, S - L bottom-right)."""
    offset = keys - length if align == "bottom_right" else 0
    rows = torch.arange(length, device=device)[:, None]
    cols = torch.arange(keys, device=device)[None, :]
    return cols <= rows + offset


def _attn_mask(q, k, options):
    """(attn_mask or None, is_causal) for SDPA."""
    length, keys = q.shape[-2], k.shape[-2]
    mask, bias = options.get("mask"), _exact_bias(options.get("bias"), q.dtype)
    causal, align = options.get("causal", False), options.get("align", "top_left")
    if causal and mask is None and bias is None and align == "top_left":
        return None, True
    if causal:
        structural = _causal_set(length, keys, align, q.device)
        mask = structural if mask is None else mask & structural
    if bias is not None and mask is not None:
        return torch.where(
            mask, bias, torch.tensor(-torch.inf, dtype=q.dtype, device=q.device)
        ), False
    return (bias if bias is not None else mask), False


def _sdpa(backend, q, k, v, **options):
    _reject(options, {"scale", "causal", "align", "mask", "bias", "gqa"})
    attn_mask, is_causal = _attn_mask(q, k, options)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=options.get("scale"),
            enable_gqa=q.shape[1] != k.shape[1],
        )


def _vjp_of(forward):
    def vjp(q, k, v, grad_out, grad_lse=None, **options):
        if grad_lse is not None:
            raise NotImplementedError("grad_lse: the function returns no log-sum-exp")
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        bias = options.get("bias")
        if bias is not None:
            bias = _exact_bias(bias, q.dtype).detach().clone().requires_grad_(True)
            options = {**options, "bias": bias}
        out = forward(*leaves, **options)
        out.backward(grad_out)
        grads = [t.grad for t in leaves]
        return (*grads, None if bias is None else bias.grad)

    return vjp


def _forced(backend):
    def impl(q, k, v, **options):
        return _sdpa(backend, q, k, v, **options)

    impl.vjp = _vjp_of(impl)
    return impl


sdpa_flash = _forced(SDPBackend.FLASH_ATTENTION)
sdpa_efficient = _forced(SDPBackend.EFFICIENT_ATTENTION)
sdpa_cudnn = _forced(SDPBackend.CUDNN_ATTENTION)
sdpa_math = _forced(SDPBackend.MATH)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # one compile per shape and option set: room for every case, so none falls back to eager
    torch._dynamo.config.cache_size_limit = 512
    return torch.compile(flex_attention)


def flex_compiled(q, k, v, **options):
    """torch.compile(flex_attention) with the allowed set as a block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    _reject(options, {"scale", "causal", "align", "mask", "bias", "gqa", "softcap"})
    batch, heads, length, _ = q.shape
    keys = k.shape[-2]
    mask, bias = options.get("mask"), _exact_bias(options.get("bias"), q.dtype)
    causal, align = options.get("causal", False), options.get("align", "top_left")
    offset = keys - length if align == "bottom_right" else 0
    softcap = options.get("softcap")
    if mask is not None:
        mask = mask.expand(batch, heads, length, keys)
    if bias is not None:
        bias = bias.expand(batch, heads, length, keys)

    def mask_mod(b, h, i, j):
        ok = (j <= i + offset) if causal else (j >= 0)
        if mask is not None:
            ok = ok & mask[b, h, i, j]
        if bias is not None:
            ok = ok & (bias[b, h, i, j] > -torch.inf)
        return ok

    def score_mod(score, b, h, i, j):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            score = score + bias[b, h, i, j]
        return score

    block_mask = create_block_mask(mask_mod, batch, heads, length, keys, device=q.device)
    return _compiled_flex()(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=options.get("scale"),
        enable_gqa=heads != k.shape[1],
    )


flex_compiled.vjp = _vjp_of(flex_compiled)

#: name -> "module:function" as the oracle's --impl takes it
IMPLS = {
    name: f"tools.gpu_impls:{name}"
    for name in ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_compiled")
}
