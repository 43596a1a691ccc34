"""refattn: exact reference implementation and numerics oracle for attention.

Shape letters (used in every docstring; see docs/conventions.md):
B batch, H query heads, K key/value heads, G = H/K group size, L query length, S key length,
D query/key dim, E value dim, R mixture components, N spins (sites), d spin dimension;
transformer pieces add M model width, N memory width, P output width, F feed-forward width.

Every function has two paths: ``precision="float64"`` (fast NumPy, log-space) and
``precision="exact"`` (every output element the exact result rounded once to ``out_dtype``).
"""

from . import (  # noqa: F401 - masks and spec: light, the conventions every path reads
    _numba_cache,  # first: importing it removes stale Numba caches
    masks,
    spec,
)
from ._lazy import exports as _exports
from ._version import __version__
from .attention import (
    AttentionGrads,
    AttentionLatentGrads,
    AttentionSinkGrads,
    attention,
    attention_vjp,
)
from .masks import allowed_mask

# the rest on first access (PEP 562): the submodules (refattn.gmm, refattn.bounds,
# refattn.kernels, refattn.exact, ...) and the names below, so that ``import refattn`` and a
# run of the float64 attention path load neither the variants, the exact engine (mpmath) nor
# Numba
__getattr__, __dir__ = _exports(
    __name__,
    {
        "UndecidedRoundingError": ".exact.rounding",
        "LinearAttentionGrads": ".linear",
        "linear_attention": ".linear",
        "linear_attention_vjp": ".linear",
        "log_softmax": ".logspace",
        "logsumexp": ".logspace",
        "softmax": ".logspace",
        "MergeGrads": ".merge",
        "merge_states": ".merge",
        "merge_states_vjp": ".merge",
        "decoder_block": ".transformer",
        "encoder_block": ".transformer",
        "feed_forward": ".transformer",
        "layer_norm": ".transformer",
        "multihead_attention": ".transformer",
        "sinusoidal_positions": ".transformer",
    },
)

__all__ = [
    "__version__",
    "attention",
    "attention_vjp",
    "AttentionGrads",
    "AttentionLatentGrads",
    "AttentionSinkGrads",
    "logsumexp",
    "softmax",
    "log_softmax",
    "allowed_mask",
    "multihead_attention",
    "layer_norm",
    "sinusoidal_positions",
    "feed_forward",
    "encoder_block",
    "decoder_block",
    "UndecidedRoundingError",
    "merge_states",
    "merge_states_vjp",
    "MergeGrads",
    "linear_attention",
    "linear_attention_vjp",
    "LinearAttentionGrads",
    # submodules: the probabilistic variants and the error bounds
    "gmm",
    "mla",
    "mgk",
    "hopfield",
    "fixedpoint",
    "meanfield",
    "linear",
    "transformer",
    "masks",
    "spec",
    "bounds",
]
