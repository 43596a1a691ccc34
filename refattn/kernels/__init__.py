"""Fast deterministic attention kernels: Numba CPU (:mod:`.numba_cpu`) and numba.cuda
(:mod:`.cuda`, imported lazily: ``from refattn.kernels import cuda``).

:func:`attention` and :func:`attention_vjp` take an :class:`~refattn.spec.AttentionSpec`
(see :func:`refattn.spec.canonicalize`); ``refattn.attention(..., backend="numba")`` is the
user-facing entry point.
"""

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
