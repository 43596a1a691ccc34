"""When ``precision="exact"`` reads set-read sparse key indices by gather (a light module: the
exact engine itself, :mod:`refattn.exact.fast.gather`, is imported only when it runs)."""

from __future__ import annotations

from . import config

__all__ = ["GATHER_READING", "exact_gathers", "exact_vjp_gathers", "exact_gather_vjp"]

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


def exact_vjp_gathers(precision, backend, index_reading, listed, bias, alibi_slopes) -> bool:
    """Whether ``refattn.attention_vjp`` keeps the set-read key indices ``listed`` =
    (key_indices, key_block_indices, key_block_size) as lists for the exact vjp by gather
    (:func:`refattn.exact.fast.vjp_gather.gather_vjp`: the exact vjp of the listed keys alone,
    bit-identical to the dense mask's) instead of ANDing them into a dense mask:
    ``precision="exact"`` on ``backend="numpy"`` with ``config.EXACT_SPARSE_KEYS = "gather"``,
    the set reading, no bias (its dbias has the S keys) and no ALiBi (a score term that
    depends on the key's position).

    Examples
    --------
    >>> import numpy as np
    >>> exact_vjp_gathers("exact", "numpy", "set", (np.zeros((1, 1)), None, None), None, None)
    True
    >>> exact_vjp_gathers("exact", "numpy", "multiset", (np.zeros((1, 1)), None, None), None,
    ...                   None)
    False
    """
    return (
        precision == "exact"
        and backend == "numpy"
        and config.EXACT_SPARSE_KEYS == "gather"
        and index_reading == "set"
        and (listed[0] is not None or listed[1] is not None)
        and bias is None
        and alibi_slopes is None
    )


def exact_gather_vjp(spec, grad_out, grad_lse, paths):
    """(dq, dk, dv, dbias, dsinks) of a gather spec on the exact path with the cotangents
    ``grad_out``, ``grad_lse``: :func:`refattn.exact.fast.vjp_gather.gather_vjp` with
    ``paths(compact)`` the exact route of a plain spec.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.exact.attention_vjp import exact_vjp
    >>> from refattn.kernels import gather_spec
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((3, 2)), np.arange(3.0)[:, None])
    >>> grads = exact_gather_vjp(
    ...     gather_spec(spec, np.array([[2, -1]])),
    ...     np.ones((1, 1, 1, 1)),
    ...     None,
    ...     lambda s: (*exact_vjp(s, np.ones((1, 1, 1, 1)), None, np.dtype("float64")), None),
    ... )
    >>> grads[2].ravel().tolist()
    [0.0, 0.0, 1.0]
    """
    from .exact.fast.vjp_gather import gather_vjp

    return gather_vjp(spec, grad_out, grad_lse, paths)
