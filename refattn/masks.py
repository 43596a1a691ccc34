"""The allowed set as boolean arrays, True = attend (public re-exports of :mod:`refattn.spec`,
the rule's one home).

.. math::

    \\mathcal{A}_{ij} = \\mathrm{mask}_{ij} \\wedge [\\text{causal} \\Rightarrow j \\le i + o]
        \\wedge [i + o - \\ell \\le j \\le i + o + r] \\wedge [\\mathrm{bias}_{ij} \\ne -\\infty]

with offset ``o = 0`` for ``align="top_left"`` and ``o = S - L`` for ``align="bottom_right"``
(docs/conventions.md).
"""

from __future__ import annotations

from .spec import (
    ALIGNS,
    WINDOW_CAP,
    allowed_mask,
    check_window,
    key_interval,
    offset_of,
    structural_mask,
)

__all__ = [
    "ALIGNS",
    "WINDOW_CAP",
    "allowed_mask",
    "check_window",
    "key_interval",
    "offset_of",
    "structural_mask",
]
