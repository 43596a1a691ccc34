"""A-priori error bounds of refattn's fast paths, evaluated per element.

Every bound counts roundings with Higham's ``gamma_n = n u / (1 - n u)`` in the dtype that
computes (:mod:`.unit`: the one definition of ``u`` and ``gamma_n`` per dtype). The tests and
the oracle's judging policy take their a-priori bounds from here.

* :mod:`.unit`: ``unit_roundoff``, ``gamma``.
* :mod:`.attention`: :func:`refattn.attention` / :func:`refattn.attention_vjp` float64 path
  (running error analysis, see its module notes) and the gradients' natural scales.
* :mod:`.kernels`: the online-softmax kernels of :mod:`refattn.kernels`.
* :mod:`.sigmoid`: sigmoid attention (``normalizer="sigmoid"``), float64 path and kernels.
* :mod:`.mixtures`: log-space softmax mixtures (gmm, mgk, hopfield), EM iterations, ratios.
* :mod:`.fixedpoint`: iterates of fixed-point maps (fixedpoint, meanfield).
* :mod:`.merge`: :func:`refattn.merge_states`' float64 path.
* :mod:`.linear`: the linear-attention recurrence (:func:`refattn.linear_attention`), float64
  and the Numba kernels, forward and vjp (running error analysis in norms).
* :mod:`.transformer`: the pieces of :mod:`refattn.transformer` (first-order analysis along
  the same composition).
"""

from typing import TYPE_CHECKING

from .._lazy import exports as _exports
from .unit import ETA, UNIT_ROUNDOFF, gamma, unit_roundoff

if TYPE_CHECKING:  # imported on first access (below): the variants' bounds load their modules
    from .attention import float64_forward_bound, float64_vjp_bound, grad_scales
    from .fixedpoint import fixed_point_forward_bound, implicit_vjp_bound
    from .kernels import online_backward_bound, online_forward_bound
    from .linear import linear_forward_bound, linear_vjp_bound
    from .merge import merge_bound, merge_vjp_bound
    from .mixtures import (
        iterated_bound,
        logit_lse_bound,
        mgk_vjp_bound,
        mixture_bound,
        mlk_vjp_bound,
        ratio_bound,
    )
    from .sigmoid import sigmoid_forward_bound, sigmoid_vjp_bound
    from .transformer import (
        feed_forward_vjp_bound,
        layer_norm_vjp_bound,
        multihead_attention_vjp_bound,
        transformer_forward_bound,
    )

# each bound from its module on first access (PEP 562): the transformer's bounds import
# refattn.transformer and the exact engine, which a run judging attention never needs
__getattr__, __dir__ = _exports(
    __name__,
    {
        **dict.fromkeys(
            ("float64_forward_bound", "float64_vjp_bound", "grad_scales"), ".attention"
        ),
        **dict.fromkeys(("fixed_point_forward_bound", "implicit_vjp_bound"), ".fixedpoint"),
        **dict.fromkeys(("online_backward_bound", "online_forward_bound"), ".kernels"),
        **dict.fromkeys(("linear_forward_bound", "linear_vjp_bound"), ".linear"),
        **dict.fromkeys(("merge_bound", "merge_vjp_bound"), ".merge"),
        **dict.fromkeys(
            (
                "iterated_bound",
                "logit_lse_bound",
                "mgk_vjp_bound",
                "mixture_bound",
                "mlk_vjp_bound",
                "ratio_bound",
            ),
            ".mixtures",
        ),
        **dict.fromkeys(("sigmoid_forward_bound", "sigmoid_vjp_bound"), ".sigmoid"),
        **dict.fromkeys(
            (
                "feed_forward_vjp_bound",
                "layer_norm_vjp_bound",
                "multihead_attention_vjp_bound",
                "transformer_forward_bound",
            ),
            ".transformer",
        ),
    },
)

__all__ = [
    "sigmoid_forward_bound",
    "sigmoid_vjp_bound",
    "UNIT_ROUNDOFF",
    "ETA",
    "unit_roundoff",
    "gamma",
    "float64_forward_bound",
    "float64_vjp_bound",
    "grad_scales",
    "online_forward_bound",
    "online_backward_bound",
    "logit_lse_bound",
    "mixture_bound",
    "iterated_bound",
    "ratio_bound",
    "mgk_vjp_bound",
    "mlk_vjp_bound",
    "fixed_point_forward_bound",
    "implicit_vjp_bound",
    "transformer_forward_bound",
    "layer_norm_vjp_bound",
    "feed_forward_vjp_bound",
    "multihead_attention_vjp_bound",
    "merge_bound",
    "merge_vjp_bound",
    "linear_forward_bound",
    "linear_vjp_bound",
]
