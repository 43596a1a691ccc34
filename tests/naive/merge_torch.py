"""merge_states in torch, written from docs/conventions.md ("Merging attention states"), for
``refattn-oracle validate --suite merge-default --framework torch`` (stacked convention) and
``--merge-convention pair`` (:func:`merge_state`). Computes in float64 whatever the inputs'
dtype, returns the inputs' dtype."""

from __future__ import annotations

import math

import torch

__all__ = ["merge_states", "merge_state"]


def merge_states(outs, lses, lse_base="e"):
    """(out, lse) of P states: outs (P, ..., L, E), lses (P, ..., L)."""
    dtype = outs.dtype
    outs, lses = outs.double(), lses.double()
    c = 1.0 if lse_base == "e" else math.log(2.0)
    live = ~torch.isneginf(lses)
    top = torch.where(live, lses, torch.full_like(lses, -math.inf)).amax(dim=0)
    empty = torch.isneginf(top)
    shift = torch.where(empty, torch.zeros_like(top), top)
    weights = torch.where(live, torch.exp((torch.where(live, lses, shift) - shift) * c), 0.0)
    total = weights.sum(dim=0)
    safe = torch.where(live[..., None], outs, torch.zeros_like(outs))
    out = (weights[..., None] * safe).sum(dim=0) / torch.where(empty, 1.0, total)[..., None]
    lse = torch.where(empty, -math.inf, shift + torch.log(torch.where(empty, 1.0, total)) / c)
    return out.to(dtype), lse.to(dtype)


def merge_state(out_a, lse_a, out_b, lse_b, lse_base="e"):
    """The pairwise convention (FlashInfer's ``merge_state``)."""
    return merge_states(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]), lse_base)
