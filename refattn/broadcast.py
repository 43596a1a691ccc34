"""Broadcasting and head-layout helpers shared by the float64 path, the exact path, the bounds and
the oracle.

A gradient of a broadcast argument is the gradient of the broadcast array summed back over the
axes broadcasting added or stretched (:func:`reduce_to`). Grouped-query attention reads kv head
``h // G`` (``gqa="interleave"``) or ``h % K`` (``"tile"``) for query head h
(:func:`expand_kv`); its gradients sum the query heads sharing a kv head (:func:`fold_kv`).

Shape letters as in :mod:`refattn`: H query heads, K key/value heads, G = H / K, S key length.
"""

from __future__ import annotations

import numpy as np

__all__ = ["reduce_to", "expand_kv", "fold_kv"]


def reduce_to(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum a broadcast gradient back to the argument's ``shape``.

    If ``x`` of shape ``shape`` was broadcast to ``grad.shape`` in the forward pass, the gradient
    of ``x`` is

    .. math:: \\frac{\\partial f}{\\partial x} = \\sum_{\\text{broadcast axes}}
              \\frac{\\partial f}{\\partial \\operatorname{broadcast}(x)}

    summed over the leading axes broadcasting added and the axes it stretched from 1.

    Parameters
    ----------
    grad : ndarray
        Gradient of the broadcast array. Float or object (exact rational) dtype.
    shape : tuple of int
        Shape of the argument before broadcasting; must broadcast to ``grad.shape``.

    Returns
    -------
    ndarray
        ``grad`` summed to ``shape`` (same dtype; exact for object arrays).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.broadcast import reduce_to
    >>> reduce_to(np.ones((2, 3, 4)), (1, 4)).tolist()
    [[6.0, 6.0, 6.0, 6.0]]
    """
    shape = tuple(shape)
    extra = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(extra))) if extra else grad
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=axes, keepdims=True) if axes else grad


def expand_kv(x: np.ndarray, heads: int, gqa: str) -> np.ndarray:
    """Give every query head its key/value head: (..., K, S, .) -> (..., H, S, .).

    .. math:: \\operatorname{kv}(h) = \\lfloor h / G \\rfloor \\;(\\text{interleave}),
              \\qquad h \\bmod K \\;(\\text{tile})

    Parameters
    ----------
    x : ndarray, shape (..., K, S, D) or (..., K, S, E)
        Keys or values, heads on axis -3.
    heads : int
        Number of query heads H, a multiple of K.
    gqa : {"interleave", "tile"}
        Head grouping: query heads ``[g*G, (g+1)*G)`` share kv head g (interleave), or query head
        h reads kv head ``h % K`` (tile).

    Returns
    -------
    ndarray, shape (..., H, S, .)
        A new array (``x`` repeated along axis -3).

    Raises
    ------
    ValueError
        If H is not a multiple of K or ``gqa`` is not one of the two layouts.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.broadcast import expand_kv
    >>> expand_kv(np.arange(2.0).reshape(2, 1, 1), 4, "tile").ravel().tolist()
    [0.0, 1.0, 0.0, 1.0]
    >>> expand_kv(np.arange(2.0).reshape(2, 1, 1), 4, "interleave").ravel().tolist()
    [0.0, 0.0, 1.0, 1.0]
    """
    kv_heads = x.shape[-3]
    if heads % kv_heads:
        raise ValueError(f"H={heads} is not a multiple of K={kv_heads}")
    if gqa == "interleave":
        return np.repeat(x, heads // kv_heads, axis=-3)
    if gqa == "tile":
        return np.concatenate([x] * (heads // kv_heads), axis=-3)
    raise ValueError(f"gqa: expected 'interleave' or 'tile', got {gqa!r}")


def fold_kv(x: np.ndarray, kv_heads: int, gqa: str) -> np.ndarray:
    """Sum the gradients of the query heads sharing a kv head: (..., H, S, .) -> (..., K, S, .).

    The adjoint of :func:`expand_kv`:

    .. math:: \\bar{k}_g = \\sum_{h : \\operatorname{kv}(h) = g} \\bar{k}_h

    Parameters
    ----------
    x : ndarray, shape (..., H, S, .)
        Per-query-head gradient of the expanded keys or values.
    kv_heads : int
        Number of key/value heads K (H must be a multiple of it).
    gqa : {"interleave", "tile"}
        The layout :func:`expand_kv` used.

    Returns
    -------
    ndarray, shape (..., K, S, .)

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.broadcast import fold_kv
    >>> fold_kv(np.ones((4, 1, 1)), 2, "interleave").ravel().tolist()
    [2.0, 2.0]
    >>> fold_kv(np.arange(4.0).reshape(4, 1, 1), 2, "tile").ravel().tolist()
    [2.0, 4.0]
    """
    heads = x.shape[-3]
    group = heads // kv_heads
    if gqa == "interleave":
        return x.reshape(*x.shape[:-3], kv_heads, group, *x.shape[-2:]).sum(axis=-3)
    return x.reshape(*x.shape[:-3], group, kv_heads, *x.shape[-2:]).sum(axis=-4)
