"""When ``precision="exact"`` reads set-read sparse key indices by gather (a light module: the
exact engine itself, :mod:`refattn.exact.fast.gather`, is imported only when it runs)."""

from __future__ import annotations

from . import config

__all__ = ["GATHER_READING", "exact_gathers"]

#: The ``index_reading`` of a spec whose set-read key indices are kept as (B, K, L, T) lists,
#: not ANDed into its mask (:data:`refattn.kernels.GATHER`, :func:`refattn.kernels.gather_spec`).
GATHER_READING = "gather"


def exact_gathers(precision, backend, index_reading, listed, normalizer, bias, lse_base) -> bool:
    """Whether ``refattn.attention`` hands the set-read key indices ``listed`` = (key_indices,
    key_block_indices, key_block_size) to the fast exact engine's gather
    (:func:`refattn.exact.fast.gather.gather_forward`) instead of a dense mask:
    ``precision="exact"`` on ``backend="numpy"`` with the fast engine (``config.EXACT_ENGINE =
    "fast"``) and ``config.EXACT_SPARSE_KEYS = "gather"``, the set reading, the softmax, no
    bias (a NaN/+inf bias is checked against the allowed set, the dense mask) and the natural
    lse base.

    Examples
    --------
    >>> import numpy as np
    >>> exact_gathers("exact", "numpy", "set", (np.zeros((1, 1)), None, None), "softmax",
    ...               None, "e")
    True
    >>> exact_gathers("float64", "numpy", "set", (np.zeros((1, 1)), None, None), "softmax",
    ...               None, "e")
    False
    """
    return (
        precision == "exact"
        and backend == "numpy"
        and config.EXACT_ENGINE == "fast"
        and config.EXACT_SPARSE_KEYS == "gather"
        and index_reading == "set"
        and (listed[0] is not None or listed[1] is not None)
        and normalizer == "softmax"
        and bias is None
        and lse_base in ("e", None)
    )
