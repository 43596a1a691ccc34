"""The allowed set as the oracle reads a case: :mod:`refattn.spec`'s one rule on plain arrays.

The rule itself (causal, window, alignment offset, key lengths, explicit mask, -inf bias) lives
in :mod:`refattn.spec` (:func:`refattn.spec.key_interval` and the NumPy forms built on it); this
module only applies it to the oracle's arrays, whose batch axes need not be flat. The baseline,
the tolerance policy, the diagnosis and the case catalogue all take their allowed set from
:func:`allowed_positions`.
"""

from __future__ import annotations

import numpy as np

from refattn.spec import offset_of, structural_mask

__all__ = ["allowed_positions", "options_allowed"]


def _structural(L, S, causal, window, align, keys=None):
    """Causal/window set (L, S) aligned to ``keys`` (the row's key count, S by default), keys
    j >= ``keys`` excluded (refattn.spec's reading of ``kv_lengths``)."""
    keys = S if keys is None else int(keys)
    allowed = structural_mask(
        range(L), range(S), causal=causal, window=window, offset=offset_of(align, L, keys)
    )
    if keys < S:
        allowed[:, keys:] = False
    return allowed


def allowed_positions(
    L,
    S,
    *,
    mask=None,
    bias=None,
    causal=False,
    window=None,
    align="top_left",
    kv_lengths=None,
) -> np.ndarray:
    """The allowed set of docs/conventions.md: mask AND causal AND window AND key length AND
    bias > -inf, from :func:`refattn.spec.structural_mask` and :func:`refattn.spec.offset_of`.

    .. math:: \\mathcal{A}_{ij} = [\\text{lo}_i \\le j < \\text{hi}_i] \\wedge
              \\mathrm{mask}_{ij} \\wedge [\\mathrm{bias}_{ij} \\ne -\\infty]

    Parameters
    ----------
    L, S : int
        Query and key lengths.
    mask : array_like of bool, optional
        True = attend; broadcastable to (..., L, S).
    bias : array_like of float, optional
        Positions with bias -inf are excluded.
    causal, window, align
        As in :func:`refattn.attention` (the window checked by
        :func:`refattn.spec.check_window` inside :func:`refattn.spec.structural_mask`).
    kv_lengths : array_like of int, optional
        Key length S_b of each batch row (batch shape): each row's causal/window set is aligned
        to its own length (``align="bottom_right"``: o = S_b - L) and keys j >= S_b are
        excluded.

    Returns
    -------
    ndarray of bool
        Shape (L, S), or (*kv_lengths.shape, 1, L, S) with ``kv_lengths``, broadcast with the
        mask's and the bias's shapes.

    Examples
    --------
    >>> allowed_positions(2, 3, causal=True, align="bottom_right").astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
    >>> rows = allowed_positions(1, 3, causal=True, align="bottom_right", kv_lengths=[1, 2])
    >>> rows[:, 0].astype(int).tolist()
    [[[1, 0, 0]], [[1, 1, 0]]]
    """
    if kv_lengths is None:
        allowed = _structural(L, S, causal, window, align)
    else:
        lengths = np.asarray(kv_lengths)
        allowed = np.zeros(lengths.shape + (1, L, S), dtype=bool)
        for index in np.ndindex(lengths.shape):
            allowed[index][0] = _structural(L, S, causal, window, align, lengths[index])
    if mask is not None:
        allowed = allowed & np.asarray(mask, dtype=bool)
    if bias is not None:
        allowed = allowed & ~(np.asarray(bias, dtype=np.float64) == -np.inf)
    return allowed


def options_allowed(L, S, options, *, bias=True) -> np.ndarray:
    """:func:`allowed_positions` of an options dict in refattn's names (mask, bias, causal,
    window, align, kv_lengths; ``bias=False`` leaves a -inf bias out of the set).

    Examples
    --------
    >>> options_allowed(2, 3, {"causal": True}).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0]]
    """
    return allowed_positions(
        L,
        S,
        mask=options.get("mask"),
        bias=options.get("bias") if bias else None,
        causal=bool(options.get("causal")),
        window=options.get("window"),
        align=options.get("align") or "top_left",
        kv_lengths=options.get("kv_lengths"),
    )
