"""The linear-attention family: one gated (delta-rule) recurrence over a (D, E) state.

Gated DeltaNet, Kimi Delta Attention, DeltaNet, GLA, simple GLA, RetNet, Lightning Attention
and plain linear attention are argument patterns of :func:`linear_attention` (see its table);
:func:`linear_attention_vjp` is its reverse mode. The float64 path is ``_float64`` (NumPy),
the exact path :mod:`refattn.exact.linear`, the Numba CPU kernel
:mod:`refattn.kernels.linear_cpu`, the a-priori bounds :mod:`refattn.bounds.linear`
(:func:`forward_error_bound`, :func:`vjp_error_bound` evaluate them with the run-time state
norms). Conventions: docs/conventions.md, "Linear attention"; guide: docs/linear.md.
"""

from ._api import (
    LinearAttentionGrads,
    forward_error_bound,
    linear_attention,
    linear_attention_vjp,
    vjp_error_bound,
)

__all__ = [
    "linear_attention",
    "linear_attention_vjp",
    "LinearAttentionGrads",
    "forward_error_bound",
    "vjp_error_bound",
]
