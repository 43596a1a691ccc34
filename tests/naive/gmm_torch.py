"""A float64 PyTorch twin of refattn.gmm written from Movellan & Gabbur (seed 000), for autograd.

Written from the paper's equations in their textbook form (nothing here imports refattn):
the E-step weights are a softmax of ``log p(u) + log N(q; xi_u, alpha_u^-1) [+ log N(v; mu_u,
beta_u^-1)]`` (eqs. (5), (7)-(8), (14)), the M-step eq. (12)/(13), key adaptation eqs.
(23), (28)-(29) and prior adaptation eqs. (33)-(34). torch is imported by the caller
(``pytest.importorskip``); every tensor is float64 on the CPU.
"""

from __future__ import annotations

import math

__all__ = ["torch_attention", "torch_adapt_keys", "torch_adapt_priors"]


def _per_unit(torch, value, units):
    return torch.as_tensor(value, dtype=torch.float64).expand(units).clone()


def _log_gauss(torch, x, means, precision):
    """log N(x_i; mean_u, precision_u^-1 I) for every pair (i, u): (N, S)."""
    dim = x.shape[-1]
    sq = ((x[:, None, :] - means[None, :, :]) ** 2).sum(-1)
    return dim / 2 * torch.log(precision / (2 * math.pi)) - precision / 2 * sq


def torch_attention(
    torch,
    q,
    keys,
    values,
    *,
    alpha,
    beta,
    prior="uniform",
    v_init=None,
    iters=1,
    allowed=None,
    normalisers=True,
):
    """EM value inference (eqs. (13)-(14)); ``normalisers=False``: the E-step without the
    Gaussian normalisers and the plain mean as M-step. Empty rows (``allowed``) give 0."""
    units = keys.shape[0]
    alpha_u, beta_u = _per_unit(torch, alpha, units), _per_unit(torch, beta, units)
    if isinstance(prior, str) and prior == "magnitude":  # eq. (15)
        log_prior = alpha_u / 2 * (keys**2).sum(-1) + beta_u / 2 * (values**2).sum(-1)
    elif isinstance(prior, str):
        log_prior = torch.zeros(units, dtype=torch.float64)
    else:
        log_prior = torch.as_tensor(prior, dtype=torch.float64)
    dim, dim_v = q.shape[-1], values.shape[-1]
    query = _log_gauss(torch, q, keys, alpha_u)
    if not normalisers:
        query = query - dim / 2 * torch.log(alpha_u / (2 * math.pi))
    a = log_prior + query
    empty = torch.zeros(q.shape[0], dtype=torch.bool)
    if allowed is not None:
        allowed = torch.as_tensor(allowed)
        empty = ~allowed.any(-1)
        a = a.masked_fill(~allowed, -math.inf).masked_fill(empty[:, None], 0.0)
    varies = bool((beta_u != beta_u[0]).any())
    v = None if v_init is None else torch.as_tensor(v_init, dtype=torch.float64)
    for _ in range(iters):
        logits = a
        if v is not None and bool((beta_u > 0).all()):
            value = _log_gauss(torch, v, values, beta_u)
            if not normalisers:
                value = value - dim_v / 2 * torch.log(beta_u / (2 * math.pi))
            logits = a + value
        weights = torch.softmax(logits, dim=-1)
        if varies and normalisers:  # eq. (12): v = sum w beta mu / sum w beta
            weights = weights * beta_u
            weights = weights / weights.sum(-1, keepdim=True)
        v = weights @ values
    return torch.where(empty[:, None], torch.zeros_like(v), v)


def _responsibilities(torch, queries, keys, alpha_u, log_prior):
    """p(u_k | q_i), eq. (23): (L, S)."""
    return torch.softmax(log_prior + _log_gauss(torch, queries, keys, alpha_u), dim=-1)


def torch_adapt_keys(
    torch, queries, keys0, *, alpha, gamma, prior="uniform", iters=1, form="paper"
):
    """Key adaptation: eqs. (28)-(29) ("paper"), the once-counted MAP form centred on the
    initial keys ("map") or on the current keys ("map_recentred")."""
    units = keys0.shape[0]
    alpha_u = _per_unit(torch, alpha, units)
    gamma_u = _per_unit(torch, gamma, units)
    pinned = torch.isinf(gamma_u)
    gam = torch.where(pinned, torch.zeros_like(gamma_u), gamma_u)[:, None]
    a = alpha_u[:, None]
    keys = keys0
    for _ in range(iters):
        log_prior = (
            alpha_u / 2 * (keys**2).sum(-1)
            if prior == "magnitude"
            else torch.zeros(units, dtype=torch.float64)
        )
        w = _responsibilities(torch, queries, keys, alpha_u, log_prior)
        total = w.sum(0)[:, None]
        sums = w.T @ queries
        if form == "paper":
            new = (gam * keys0 + a * sums / total) / (a + gam)
        else:
            centre = keys if form == "map_recentred" else keys0
            new = (gam * centre + a * sums) / (gam + a * total)
        keys = torch.where(pinned[:, None], keys0, new)
    return keys


def torch_adapt_priors(torch, queries, keys, *, alpha, eta, pi0, iters=1, form="paper"):
    """Prior adaptation, eqs. (33)-(34) ("paper") or ``pi ∝ w̄ + eta`` ("map")."""
    units = keys.shape[0]
    alpha_u = _per_unit(torch, alpha, units)
    pi = torch.as_tensor(pi0, dtype=torch.float64)
    pi = pi / pi.sum()
    eta_u = eta * pi if isinstance(eta, float | int) else torch.as_tensor(eta, dtype=torch.float64)
    for _ in range(iters):
        w_bar = _responsibilities(torch, queries, keys, alpha_u, torch.log(pi)).sum(0)
        mass = w_bar * (1 + eta_u) if form == "paper" else w_bar + eta_u
        pi = mass / mass.sum()
    return pi
