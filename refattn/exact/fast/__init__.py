"""The compiled first step of the exact path: double-double enclosures decided in Numba kernels,
the undecided elements left to the arbitrary-precision referee (Ziv's strategy).

Modules, each with one job:

``doubledouble``       double-double arithmetic and elementary functions with stated bounds
``rounding_decision``  rounding a double-double enclosure to a format, or "undecided"
``allowed_set``        the allowed set read without (L, S) arrays (the rule of
                       :mod:`refattn.spec`: intervals and the per-position test)
``forward_kernels``    the forward's compiled first steps (double-double, double)
``forward``            the forward's host side: inputs, parameters, referee fallback
``logspace``           the first step of the exact log-sum-exp and (log-)softmax
``vjp_rows``           the vjp's per-row pieces (scores, weights, dS, dT, accumulations)
``vjp_passes``         the vjp's parallel passes (dq, dk/dv, dbias) and slot sums
``vjp``                the vjp's host side: enclosures, decisions, dbias reduction
``vjp_gather``         the exact vjp on set-read sparse keys: the listed keys compacted
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ... import _lazy

if TYPE_CHECKING:  # the same names, eagerly, for readers and type checkers
    from .forward import fallback_stats, fast_exact_forward, row_spec
    from .logspace import fast_logsumexp, fast_softmax
    from .vjp import INPUT_LIMIT, decide, fast_inputs_ok, gradient_enclosures, reduce_enclosure

#: the module of each public name: imported on first access (module ``__getattr__``, PEP 562),
#: since every module here imports Numba, whose start-up (0.4 s) ``import refattn`` leaves out
_HOMES = {
    **dict.fromkeys(("fallback_stats", "fast_exact_forward", "row_spec"), ".forward"),
    **dict.fromkeys(("fast_logsumexp", "fast_softmax"), ".logspace"),
    **dict.fromkeys(
        ("INPUT_LIMIT", "decide", "fast_inputs_ok", "gradient_enclosures", "reduce_enclosure"),
        ".vjp",
    ),
}

__all__ = [
    "fast_exact_forward",
    "fallback_stats",
    "row_spec",
    "fast_logsumexp",
    "fast_softmax",
    "INPUT_LIMIT",
    "decide",
    "fast_inputs_ok",
    "gradient_enclosures",
    "reduce_enclosure",
]

__getattr__, __dir__ = _lazy.exports(__name__, _HOMES)
