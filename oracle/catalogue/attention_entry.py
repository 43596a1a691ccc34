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
BASE = Shapes(batch=1, H=2, K=2, L=24, S=40, D=32, E=32)
SMALL = Shapes(batch=1, H=2, K=2, L=5, S=7, D=8, E=8)
MID = Shapes(batch=1, H=2, K=2, L=12, S=20, D=16, E=16)
GRAD = Shapes(batch=1, H=2, K=2, L=8, S=12, D=16, E=16)


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
