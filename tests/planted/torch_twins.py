"""Independent float64 PyTorch implementations of the MGK/MLK and Hopfield forwards, written
from the seeds (Nguyen et al. 2022 notes (N6)-(N9); Ramsauer et al. (U)), whose gradients come
from torch autograd. Nothing here imports refattn; the caller skips when torch is missing.

Conventions are the ones refattn pins (minus sign of the Gaussian exponent, mixture after
the feature map, excluded keys removed, empty rows 0); ``torch.amax`` splits its gradient
equally over tied maxima, the hard-mode subgradient refattn documents.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["torch_grads", "mgk_torch", "mlk_torch", "retrieve_torch"]


def _torch():
    import torch

    return torch


def torch_grads(forward, arrays, grad_out, **options):
    """Gradients of ``sum(grad_out * forward(*arrays, **options))`` w.r.t. every array."""
    torch = _torch()
    leaves = [torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True) for a in arrays]
    out = forward(*leaves, **options)
    (out * torch.tensor(np.asarray(grad_out, dtype=np.float64))).sum().backward()
    return [leaf.grad.numpy() for leaf in leaves]


def mgk_torch(q, keys, v, *, allowed, log_pi=None, sigma2=1.0, mode="soft", row_eps=0.0):
    """MGK attention: s_ij = lse_r(log pi_jr - ||q_i - k_jr||^2 / (2 sigma2_jr)) (soft) or
    max_r of the distance term (hard); h_i = sum_j P_ij v_j over the allowed keys."""
    torch = _torch()
    comps = keys.shape[-2]
    sigma2 = torch.tensor(np.array(np.broadcast_to(sigma2, keys.shape[:-1]), dtype=np.float64))
    dist = ((q[:, None, None, :] - keys[None]) ** 2).sum(-1) / (2 * sigma2[None])
    if mode == "soft":
        prior = (
            torch.full(keys.shape[:-1], -math.log(comps), dtype=torch.float64)
            if log_pi is None
            else torch.tensor(np.array(log_pi, dtype=np.float64))
        )
        scores = torch.logsumexp(prior[None] - dist, dim=-1)
    else:
        scores = torch.amax(-dist, dim=-1)
    mask = torch.tensor(np.array(allowed, dtype=bool))
    scores = torch.where(mask, scores, torch.tensor(-math.inf, dtype=torch.float64))
    top = torch.amax(
        torch.where(mask, scores, torch.tensor(-1e300, dtype=torch.float64)), -1, keepdim=True
    ).detach()
    expo = torch.where(mask, torch.exp(scores - top), torch.zeros((), dtype=torch.float64))
    total = expo.sum(-1, keepdim=True)
    if row_eps:
        total = total + row_eps * torch.exp(-top)
    weights = torch.where(total > 0, expo / torch.where(total > 0, total, 1.0), 0.0)
    return weights @ v


def _phi(x):
    torch = _torch()
    return torch.nn.functional.elu(x) + 1


def mlk_torch(q, keys, v, *, pi, allowed, mlk_form="mixture"):
    """MLK in the three readings (see refattn.mgk.linear_attention's description)."""
    torch = _torch()
    pi = torch.tensor(np.array(pi, dtype=np.float64))
    mask = torch.tensor(np.array(allowed, dtype=np.float64))
    length, units, dim = q.shape[0], keys.shape[0], q.shape[-1]
    if mlk_form == "lra":
        a = _phi(q) / (length * units) ** 0.25
        m = _phi((pi[..., None] * keys).sum(-2))
        return ((a @ m.T) * mask) @ v
    fq, fk = _phi(q), _phi(keys)
    if mlk_form == "lm":
        fq, fk = fq / fq.sum(-1, keepdim=True), fk / fk.sum(-1, keepdim=True)
    m = (pi[..., None] * fk).sum(-2)
    kernels = (fq @ m.T) * mask
    den = kernels.sum(-1, keepdim=True)
    if mlk_form == "lm":
        return (kernels @ v) / (math.sqrt(dim) * (den + 1e-5))
    return torch.where(den > 0, (kernels @ v) / torch.where(den > 0, den, 1.0), 0.0)


def retrieve_torch(xi, X, *, beta, steps=1):
    """``steps`` updates xi <- X^T softmax(beta X xi) of every row."""
    torch = _torch()
    for _ in range(steps):
        xi = torch.softmax(beta * xi @ X.T, dim=-1) @ X
    return xi
