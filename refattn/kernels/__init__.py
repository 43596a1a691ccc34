"""Fast deterministic attention kernels: Numba CPU (:mod:`.numba_cpu`) and numba.cuda
(:mod:`.cuda`, imported lazily: ``from refattn.kernels import cuda``).

:func:`attention` and :func:`attention_vjp` take an :class:`~refattn.spec.AttentionSpec`
(see :func:`refattn.spec.canonicalize`); ``refattn.attention(..., backend="numba")`` is the
user-facing entry point.

Every name here (and every submodule) is imported on first access (module ``__getattr__``,
PEP 562): the kernels import Numba, whose start-up (0.4 s) the NumPy paths never need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

if TYPE_CHECKING:  # the same names, eagerly, for readers and type checkers
    from ._codes_forward import attention_codes
    from ._cpu_codes import codes_abs_max
    from ._cpu_range import abs_max
    from ._dispatch import (
        COMPILE_MESSAGE,
        FAMILIES,
        GATHER,
        PATHS,
        announce_compile,
        attention,
        attention_vjp,
        compute_dtype,
        gather_spec,
        gathers,
        listed_keys,
        plain_gather_attention,
        precompile,
    )

#: the module of each public name
_HOMES = {
    "attention_codes": "._codes_forward",
    "codes_abs_max": "._cpu_codes",
    "abs_max": "._cpu_range",
    **dict.fromkeys(
        (
            "COMPILE_MESSAGE",
            "FAMILIES",
            "GATHER",
            "PATHS",
            "announce_compile",
            "attention",
            "attention_vjp",
            "compute_dtype",
            "gather_spec",
            "gathers",
            "listed_keys",
            "plain_gather_attention",
            "precompile",
        ),
        "._dispatch",
    ),
}

__all__ = [
    "GATHER",
    "gather_spec",
    "gathers",
    "listed_keys",
    "attention",
    "attention_vjp",
    "plain_gather_attention",
    "attention_codes",
    "codes_abs_max",
    "abs_max",
    "compute_dtype",
    "COMPILE_MESSAGE",
    "announce_compile",
    "precompile",
    "FAMILIES",
    "PATHS",
]


__getattr__, __dir__ = _lazy.exports(__name__, _HOMES)
