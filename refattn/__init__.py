"""refattn: exact reference implementation and numerics oracle for attention.

Shape letters (used in every docstring; see docs/conventions.md):
B batch, H query heads, K key/value heads, G = H/K group size, L query length, S key length,
D query/key dim, E value dim, R mixture components, N spins (sites), d spin dimension;
transformer pieces add M model width, N memory width, P output width, F feed-forward width.

Every function has two paths: ``precision="float64"`` (fast NumPy, log-space) and
``precision="exact"`` (every output element the exact result rounded once to ``out_dtype``).
"""

from . import (
    _numba_cache,  # noqa: F401 (first: importing it removes stale Numba caches)
    bounds,
    fixedpoint,
    gmm,
    hopfield,
    linear,
    masks,
    meanfield,
    mgk,
    mla,
    spec,
    transformer,
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
from .exact.rounding import UndecidedRoundingError
from .linear import LinearAttentionGrads, linear_attention, linear_attention_vjp
from .logspace import log_softmax, logsumexp, softmax
from .masks import allowed_mask
from .merge import MergeGrads, merge_states, merge_states_vjp
from .transformer import (
    decoder_block,
    encoder_block,
    feed_forward,
    layer_norm,
    multihead_attention,
    sinusoidal_positions,
)

# the submodules not imported above (refattn.kernels, refattn.exact, ...) on first access: the
# Numba kernels are imported by the first call that runs one, not by ``import refattn``
__getattr__, __dir__ = _exports(__name__, {})

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
