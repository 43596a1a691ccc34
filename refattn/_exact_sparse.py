"""When ``precision="exact"`` reads set-read sparse key indices by gather (a light module: the
exact engine itself, :mod:`refattn.exact.fast.gather`, is imported only when it runs)."""

from __future__ import annotations

import sys

from . import _checks, config
from ._numba_path import PLAIN_DEFAULTS, is_default, plain_arrays, plain_scale
from .spec import canonicalize

__all__ = [
    "GATHER_READING",
    "exact_gathers",
    "exact_vjp_gathers",
    "exact_gather_vjp",
    "plain_exact_gather",
]

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


def plain_exact_gather(call: dict):
    """refattn.attention's result for a plain exact sparse-key call, or None for any other
    call. ``call``: the keywords by name (refattn.attention's ``locals()``).

    Plain: ``precision="exact"`` on ``backend="numpy"``, q, k, v and ``key_indices`` as
    :func:`refattn._numba_path.plain_arrays` reads them (float32 or float64, one dtype,
    (B, H, L, D), (B, K, S, D), (B, K, S, E), integer (B, K, L, T)), a float scale (or None),
    any ``out_dtype`` and a bool ``return_lse``, every other keyword at its default, and
    :func:`exact_gathers` true. Such a call needs none of the general path's option handling:
    the spec is ``canonicalize(q, k, v, scale=scale)`` with its key indices
    (:func:`refattn.kernels.gather_spec`), the engine
    :func:`refattn.exact.fast.gather.gather_forward`; the same spec, bits and errors as the
    general path (a decode step spent about a tenth of its time in the general path's
    Python).

    Examples
    --------
    >>> import numpy as np
    >>> q = np.ones((1, 1, 1, 2)); k = np.ones((1, 1, 3, 2)); v = np.arange(3.0).reshape(1, 1, 3, 1)
    >>> call = dict(q=q, k=k, v=v, key_indices=np.array([[[[0, 2]]]]), scale=None,
    ...             precision="exact", backend="numpy", out_dtype=None, return_lse=False,
    ...             lse_base="e")
    >>> from refattn._numba_path import PLAIN_DEFAULTS
    >>> call.update({n: d for n, d in PLAIN_DEFAULTS.items() if n not in call})
    >>> plain_exact_gather(call).ravel().tolist()
    [1.0]
    """
    q, k, v, indices, scale = (call[n] for n in ("q", "k", "v", "key_indices", "scale"))
    return_lse = call["return_lse"]
    if not (
        type(return_lse) is bool
        and plain_arrays(q, k, v, indices)
        and plain_scale(scale)
        and is_default(call["backend"], "numpy")
        and is_default(call["lse_base"], "e")
        and all(
            is_default(call[name], value)
            for name, value in PLAIN_DEFAULTS.items()
            if name not in ("precision", "out_dtype")
        )
        and exact_gathers("exact", "numpy", "set", (indices, None, None), "softmax", None, "e")
    ):
        return None
    engine, kernels = _gather_modules()
    out_dtype = _checks.out_dtype(call["out_dtype"])  # the general path's check and error
    spec = kernels.gather_spec(canonicalize(q, k, v, scale=scale), indices)
    out, lse, _ = engine.gather_forward(spec, out_dtype, return_lse=return_lse)
    out = spec.unflatten(out)
    return (out, spec.unflatten(lse)) if return_lse else out


def _gather_modules():
    """(:mod:`refattn.exact.fast.gather`, :mod:`refattn.kernels`), imported on first use: a
    function-level import statement costs a decode step more than this lookup (the import
    system's lookup of each name, its ``__path__`` probe of :mod:`refattn.spec` included)."""
    engine = sys.modules.get("refattn.exact.fast.gather")
    kernels = sys.modules.get("refattn.kernels")
    if engine is None or kernels is None:
        from . import kernels
        from .exact.fast import gather as engine
    return engine, kernels


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
