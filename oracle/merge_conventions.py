"""Calling conventions of a merge implementation under test.

The merge cases (:mod:`oracle.catalogue.merge_families`) call the stacked convention
``impl(outs=(P, ..., L, E), lses=(P, ..., L), **options)`` (refattn's). A pairwise
implementation ``impl(out_a, lse_a, out_b, lse_b, **options)`` (FlashInfer's ``merge_state``)
is adapted by :func:`stacked`, which folds the P states left to right; associativity of the
exact merge makes the fold's truth the same, and each step's rounding is what the tolerance's
``gamma_{4P+8}`` floor allows for.

Examples
--------
>>> import numpy as np
>>> def pair(out_a, lse_a, out_b, lse_b):
...     return (out_a + out_b) / 2, np.logaddexp(lse_a, lse_b)
>>> out, lse = stacked(pair)(outs=np.ones((3, 1, 1, 2)), lses=np.zeros((3, 1, 1)))
>>> out.tolist()
[[[1.0, 1.0]]]
"""

from __future__ import annotations

__all__ = ["CONVENTIONS", "stacked", "adapt"]

#: The merge conventions (CLI ``--merge-convention``).
CONVENTIONS = ("stacked", "pair")


def stacked(pair):
    """The stacked-convention function of a pairwise merge ``pair(out_a, lse_a, out_b,
    lse_b, **options)``."""

    def merge(outs, lses, **options):
        out, lse = outs[0], lses[0]
        for p in range(1, len(outs)):
            out, lse = pair(out, lse, outs[p], lses[p], **options)
        return out, lse

    merge.__name__ = f"stacked({getattr(pair, '__name__', 'pair')})"
    return merge


def adapt(impl, convention: str):
    """``impl`` in the stacked convention (a ValueError names an unknown convention)."""
    if convention not in CONVENTIONS:
        raise ValueError(
            f"merge convention: expected one of {list(CONVENTIONS)}, got {convention!r}"
        )
    return impl if convention == "stacked" else stacked(impl)
