"""Linear-attention loops in flash-linear-attention's calling convention (torch).

Written from FLA's documented semantics (its ``chunk_*`` / ``fused_recurrent_*`` docstrings:
[B, T, H, K] tensors, v [B, T, HV, V], natural-log gates, value head j reads key head ``j //
(HV // H)``, ``scale`` defaults to ``K ** -0.5`` and multiplies q, ``initial_state`` [N, HV, K,
V], ``cu_seqlens`` restarts the state per packed sequence, ``use_qk_l2norm_in_kernel`` is
``x / sqrt(sum x^2 + 1e-6)``; returns ``(o, final_state)``, o in v's dtype and the state in
float32), computing in float32 like FLA's kernels; not FLA's code. They serve as the
no-false-alarm check of the ``fla_*`` presets (:mod:`oracle.conventions.linear_presets`).
"""

from __future__ import annotations

import torch

__all__ = [
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "fused_recurrent_gla",
    "fused_recurrent_simple_gla",
]


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _loop(q, k, v, g, beta, scale, initial_state, cu_seqlens, l2norm):
    out_dtype = v.dtype
    work = torch.float64 if v.dtype == torch.float64 else torch.float32
    batch, length, heads, dim = q.shape
    value_heads = v.shape[2]
    group = value_heads // heads
    q, k = (x.to(work).repeat_interleave(group, dim=2) for x in (q, k))
    v = v.to(work)
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (dim**-0.5 if scale is None else scale)
    if cu_seqlens is None:
        spans = [(b, 0, length) for b in range(batch)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, a, c) for a, c in zip(cu, cu[1:], strict=False)]
    o = torch.zeros_like(v)
    finals = []
    for n, (b, start, stop) in enumerate(spans):
        state = torch.zeros(value_heads, dim, v.shape[-1], dtype=work)
        if initial_state is not None:
            state = initial_state[n].to(work).clone()
        for t in range(start, stop):
            if g is not None:
                decay = g[b, t].to(work).exp()
                state = state * (decay[..., None] if decay.ndim == 2 else decay[:, None, None])
            if beta is None:
                new = v[b, t]
            else:
                recalled = torch.einsum("hde,hd->he", state, k[b, t])
                new = beta[b, t].to(work)[:, None] * (v[b, t] - recalled)
            state = state + k[b, t][:, :, None] * new[:, None, :]
            o[b, t] = torch.einsum("hde,hd->he", state, q[b, t])
        finals.append(state)
    return o.to(out_dtype), torch.stack(finals).to(work)


def fused_recurrent_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
):
    """Gated delta rule: g [B, T, HV], beta [B, T, HV]."""
    o, state = _loop(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel)
    return o, (state if output_final_state else None)


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
):
    """Kimi Delta Attention: g [B, T, HV, K], beta [B, T, HV]."""
    o, state = _loop(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel)
    return o, (state if output_final_state else None)


def fused_recurrent_gla(
    q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None,
):  # fmt: skip
    """GLA: gk [B, T, HV, K] (a value gate gv is not part of refattn's family)."""
    if gv is not None:
        raise NotImplementedError("gv: a value-side gate")
    o, state = _loop(q, k, v, gk, None, scale, initial_state, cu_seqlens, False)
    return o, (state if output_final_state else None)


def fused_recurrent_simple_gla(
    q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None
):
    """Simple GLA: a scalar gate g [B, T, HV]."""
    o, state = _loop(q, k, v, g, None, scale, initial_state, cu_seqlens, False)
    return o, (state if output_final_state else None)
