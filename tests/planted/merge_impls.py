"""Implementations of merge_states under test: a correct one written from the description in
docs/conventions.md, and planted broken ones, each one bug reported in the wild (named in
:data:`BROKEN_MERGES`). Stacked convention ``impl(outs, lses, lse_base="e")``; ``pairwise``
ones follow ``impl(out_a, lse_a, out_b, lse_b, lse_base="e")``."""

from __future__ import annotations

import numpy as np

__all__ = ["merge_ok", "merge_pair_ok", "BROKEN_MERGES"]


def _compute(outs, lses, lse_base="e", *, natural=False, guard=True, empty_lse=None):
    outs = np.asarray(outs, dtype=np.float64)
    lses = np.asarray(lses, dtype=np.float64)
    if empty_lse is not None:
        lses = np.where(np.isneginf(lses), empty_lse, lses)
    c = 1.0 if (lse_base == "e" or natural) else np.log(2.0)
    top = lses.max(axis=0)
    shift = np.where(np.isneginf(top), 0.0, top) if guard else top
    with np.errstate(invalid="ignore", divide="ignore"):
        e = np.exp((lses - shift) * c)
        total = e.sum(axis=0)
        out = np.einsum("p...,p...e->...e", e, np.where(e[..., None] > 0, outs, 0.0))
        out = out / (np.where(total > 0, total, 1.0) if guard else total)[..., None]
        lse = shift + np.log(total) / c
    return out, lse


def merge_ok(outs, lses, lse_base="e"):
    """Correct: max-shifted, empty states weigh 0, all-empty rows give (0, -inf)."""
    return _compute(outs, lses, lse_base)


def merge_pair_ok(out_a, lse_a, out_b, lse_b, lse_base="e"):
    """Correct, pairwise convention."""
    return _compute(np.stack([out_a, out_b]), np.stack([lse_a, lse_b]), lse_base)


def merge_base2_as_natural(outs, lses, lse_base="e"):
    """Bug: base-2 lses merged with the natural-log formula."""
    return _compute(outs, lses, lse_base, natural=True)


def merge_empty_nan(outs, lses, lse_base="e"):
    """Bug: an all-empty row shifts by -inf (exp(-inf - -inf) = NaN) instead of giving the
    identity (0, -inf)."""
    return _compute(outs, lses, lse_base, guard=False)


def merge_empty_finite_lse(outs, lses, lse_base="e"):
    """Bug: an empty chunk reported with a finite lse (0) instead of -inf."""
    return _compute(outs, lses, lse_base, empty_lse=0.0)


BROKEN_MERGES = {
    "base-2 lse merged as natural": merge_base2_as_natural,
    "empty-state merge gives NaN": merge_empty_nan,
    "empty chunk with a finite lse": merge_empty_finite_lse,
}
