"""Merge cases a merge without the max subtraction, or in the wrong base, cannot pass
(families of :mod:`oracle.catalogue.merge_families`, suites merge-default and merge-smoke).

* ``merge-large``: lses near +1e4 (exp overflows in every dtype) and near -1e4 (exp
  underflows to 0, 0/0), with empty states among them, in the natural base and in base 2
  (FlashInfer's ``merge_state``), 2 to 64 states;
* ``merge-base2-empty``: base-2 states, a third of them empty, and a row where all are.

Each row's lses sit within a few units of each other, so the merge is well conditioned:
only the arithmetic of the merge is tested. No NaN anywhere in the inputs.
"""

from __future__ import annotations

__all__ = ["LARGE_FAMILIES", "large_lses"]

# (tag, P, recipe, options, in smoke): as merge_families._FAMILIES
LARGE_FAMILIES = (
    ("merge-large-pos-P2", 2, {"style": "large", "sign": 1}, {}, True),
    ("merge-large-neg-P4", 4, {"style": "large", "sign": -1, "empty": 1}, {}, False),
    ("merge-large-base2-P8", 8, {"style": "large", "sign": 1, "empty": 2}, {"lse_base": 2}, False),
    (
        "merge-large-neg-base2-P64",
        64,
        {"style": "large", "sign": -1, "empty": 16, "empty_rows": 1},
        {"lse_base": 2},
        False,
    ),
    (
        "merge-base2-empty-P6",
        6,
        {"style": "random", "empty": 2, "empty_rows": 1},
        {"lse_base": 2},
        True,
    ),
)


def large_lses(gaussian, sign):
    """lses within a few units of ``sign`` * 1e4 (gaussian: the stream's (P, ..., L) draw)."""
    return sign * 1.0e4 + 2.0 * gaussian
