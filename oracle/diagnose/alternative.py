"""The named alternative semantics of a diagnosis (:mod:`oracle.diagnose.diagnosis` and the modules
that
add alternatives to it: :mod:`oracle.diagnose.peers`, :mod:`oracle.diagnose.tiles`).

Examples
--------
>>> a = Alternative("no scale", frozenset({"scale"}), lambda o, e: ({**o, "scale": 1.0}, e))
>>> a.apply({"scale": 0.5}, {})
({'scale': 1.0}, {})
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Alternative"]


@dataclass(frozen=True)
class Alternative:
    """A named alternative semantics: ``apply(options, extras) -> (options, extras)``.

    ``extras`` holds textbook-only switches: ``softcap_order`` and ``out_factor`` (a factor
    applied to the output, e.g. ``1 - p`` for dropout without rescaling).
    """

    label: str
    keys: frozenset
    apply: Callable
