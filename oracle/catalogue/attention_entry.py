"""The row type of the attention catalogue, its suites and the shapes the families share.

An :class:`Entry` is one catalogue row, expanded into one :class:`~oracle.catalogue.case.Case`
per dtype by :func:`oracle.catalogue.attention.attention_cases`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oracle.catalogue.case import Shapes
from oracle.catalogue.names import DTYPES

__all__ = ["SUITES", "KERNEL_SUITES", "Entry", "ALL", "HALF", "BASE", "SMALL", "MID", "GRAD"]

#: The attention suites: smoke within default within full; "kernel" holds every kernel-scale
#: case (:func:`kernel_entries`), the cheaper of which are also in default and full.
SUITES = ("smoke", "default", "full", "kernel")

#: The suite of every kernel-scale case (those marked ``default=True`` in
#: :func:`kernel_entries` are also in default and full, in every dtype).
KERNEL_SUITES = ("kernel",)

ALL = DTYPES
HALF = ("float16", "bfloat16")
BASE = Shapes(1, 2, 2, 24, 40, 32, 32)
SMALL = Shapes(1, 2, 2, 5, 7, 8, 8)
MID = Shapes(1, 2, 2, 12, 20, 16, 16)
GRAD = Shapes(1, 2, 2, 8, 12, 16, 16)


@dataclass(frozen=True)
class Entry:
    """A catalogue row: one case per dtype, member of the suites its dtypes say."""

    tag: str
    shapes: Shapes
    description: str
    smoke: tuple[str, ...] = ()
    default: tuple[str, ...] = ALL
    full: tuple[str, ...] = ALL
    options: Mapping[str, Any] = field(default_factory=dict)
    recipe: Mapping[str, Any] = field(default_factory=dict)
    grads: bool = False
    category: str = "conformance"
    extra: tuple[str, ...] = ()  # further suites (KERNEL_SUITES) of every dtype of the row
