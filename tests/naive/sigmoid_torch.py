"""Sigmoid attention in PyTorch, written from its description (nothing here imports refattn).

Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid Self-Attention",
eq. (2): ``out_i = sum_j sigmoid(s q_i.k_j + b_ij) v_j`` over the keys row i may attend, with
no normaliser; the scores follow the usual order (scale, softcap ``c tanh(x / c)``, then the
bias, then ALiBi ``-m_h |i + o - j|``); causal/window/mask/-inf bias exclude keys, dropout keeps
a position and rescales by ``1/(1 - p)``, GQA "interleave" reads kv head ``h // G`` ("tile":
``h % K``), a row with no key gives 0 (or NaN with ``empty_rows="nan"``). The paper's bias
``b = -log(S)`` arrives through ``bias``. Computes in float32 for float16/bfloat16 inputs
(float32 accumulation) and in the input's dtype otherwise; the vjp is torch autograd.

``sigmoid_attention(q, k, v, **options)`` takes and returns torch tensors (the oracle's
``--framework torch``); with ``normalizer`` other than "sigmoid" it raises NotImplementedError
("unsupported": it implements sigmoid attention only).
"""

from __future__ import annotations

import math

__all__ = ["sigmoid_attention"]


def _allowed(torch, L, S, device, causal, window, align, mask, bias):
    offset = 0 if align == "top_left" else S - L
    i = torch.arange(L, device=device)[:, None] + offset
    j = torch.arange(S, device=device)[None, :]
    allowed = torch.ones(L, S, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        left, right = window
        if left is not None:
            allowed = allowed & (j >= i - left)
        if right is not None:
            allowed = allowed & (j <= i + right)
    if mask is not None:
        allowed = allowed & mask.to(torch.bool)
    if bias is not None:
        allowed = allowed & (bias != -math.inf)
    return allowed, (i - j).abs()


def _forward(q, k, v, bias, opts):
    import torch

    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    H, L, D = q.shape[-3:]
    K, S = k.shape[-3], k.shape[-2]
    index = torch.arange(H, device=q.device)
    kv = index // (H // K) if opts.get("gqa", "interleave") == "interleave" else index % K
    k, v = k[..., kv, :, :], v[..., kv, :, :]
    scale = opts.get("scale")
    scale = 1 / math.sqrt(D) if scale is None else float(scale)
    scores = scale * (q @ k.transpose(-1, -2))
    if opts.get("softcap") is not None:
        cap = float(opts["softcap"])
        scores = cap * torch.tanh(scores / cap)
    bias_w = None if bias is None else bias.to(work)
    allowed, distance = _allowed(
        torch, L, S, q.device, opts.get("causal", False), opts.get("window"),
        opts.get("align", "top_left"), opts.get("mask"), bias_w,
    )  # fmt: skip
    if bias_w is not None:
        scores = scores + torch.where(allowed, bias_w, torch.zeros((), dtype=work))
    if opts.get("alibi_slopes") is not None:
        slopes = opts["alibi_slopes"].to(work)[:, None, None]
        scores = scores - slopes * distance.to(work)
    allowed = allowed.expand(scores.shape)
    weights = torch.where(allowed, torch.sigmoid(scores), torch.zeros((), dtype=work))
    if opts.get("dropout_mask") is not None:
        keep = opts["dropout_mask"].to(torch.bool)
        weights = torch.where(keep, weights, torch.zeros((), dtype=work))
        weights = weights / (1 - float(opts.get("dropout_p", 0.0)))
    out = weights @ v
    if opts.get("empty_rows", "zero") == "nan":
        empty = ~allowed.any(dim=-1, keepdim=True)
        out = torch.where(empty, torch.full((), math.nan, dtype=work), out)
    return out


def sigmoid_attention(q, k, v, *, bias=None, normalizer="softmax", return_lse=False, **opts):
    """Sigmoid attention of torch tensors q (..., H, L, D), k (..., K, S, D), v (..., K, S, E)."""
    if normalizer != "sigmoid":
        raise NotImplementedError("normalizer: this implementation computes sigmoid attention")
    if return_lse:
        raise NotImplementedError("return_lse: sigmoid attention has no log-sum-exp")
    return _forward(q, k, v, bias, opts).to(q.dtype)


def _vjp(q, k, v, grad_out, *, bias=None, normalizer="softmax", **opts):
    import torch

    if normalizer != "sigmoid":
        raise NotImplementedError("normalizer: this implementation computes sigmoid attention")
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    bias_leaf = None if bias is None else bias.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = _forward(*leaves, bias_leaf, opts)
        out.backward(grad_out.to(out.dtype))
    grads = [x.grad.to(x.dtype) for x in leaves]
    return (*grads, None if bias_leaf is None else bias_leaf.grad.to(bias.dtype))


sigmoid_attention.vjp = _vjp
