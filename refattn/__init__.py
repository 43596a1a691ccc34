"""refattn: exact reference implementation and numerics oracle for attention.

Shape letters (used in every docstring; see docs/conventions.md):
B batch, H query heads, K key/value heads, G = H/K group size, L query length, S key length,
D query/key dim, E value dim, R mixture components, N spins (sites), d spin dimension.

Every function has two paths: ``precision="float64"`` (fast NumPy, log-space) and
``precision="exact"`` (every output element the exact result rounded once to ``out_dtype``).
"""

from ._version import __version__
from .attention import AttentionGrads, attention, attention_vjp
from .logspace import log_softmax, logsumexp, softmax

__all__ = [
    "__version__",
    "attention",
    "attention_vjp",
    "AttentionGrads",
    "logsumexp",
    "softmax",
    "log_softmax",
]
