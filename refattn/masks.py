"""The allowed set: causal / window / alignment / padding mask -> one boolean, True = attend.

Every path (float64, exact, Numba, CUDA) derives the allowed set from the same rule
(docs/conventions.md):

.. math::

    \\mathcal{A}_{ij} = \\mathrm{mask}_{ij} \\wedge [\\text{causal} \\Rightarrow j \\le i + o]
        \\wedge [i + o - \\ell \\le j \\le i + o + r] \\wedge [\\mathrm{bias}_{ij} \\ne -\\infty]

with offset ``o = 0`` for ``align="top_left"`` and ``o = S - L`` for ``align="bottom_right"``.
"""

from __future__ import annotations

import numpy as np

from . import _checks

__all__ = ["ALIGNS", "offset_of", "structural_mask", "allowed_mask"]

ALIGNS = ("top_left", "bottom_right")


def offset_of(align: str, length: int, keys: int) -> int:
    """Diagonal offset o: 0 for "top_left", S - L for "bottom_right"."""
    _checks.choice(align, "align", ALIGNS)
    return 0 if align == "top_left" else keys - length


WINDOW_CAP = 2**62  # larger than any array axis (int64 index arithmetic stays exact)


def check_window(window):
    """Validate ``window=(left, right)``: non-negative ints or None (unbounded side)."""
    if window is None:
        return None
    if not isinstance(window, tuple | list) or len(window) != 2:
        raise ValueError(f"window: expected a pair (left, right), got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, int | np.integer):
            raise TypeError(f"window: {name} size must be an int or None, got {side!r}")
        if side < 0:
            raise ValueError(f"window: {name} size must be >= 0, got {side}")
        # any size beyond every index difference is the same window; capping it keeps the
        # index arithmetic in int64 (a size of 2**70 is valid and means "unbounded")
        sides.append(min(int(side), WINDOW_CAP))
    return tuple(sides)


def structural_mask(
    rows, cols, *, causal: bool = False, window=None, offset: int = 0
) -> np.ndarray:
    """Causal/window part of the allowed set for query rows ``rows`` and key columns ``cols``.

    Parameters
    ----------
    rows, cols : array_like of int
        Query indices i (length L') and key indices j (length S').
    causal : bool
        Allow only ``j <= i + offset``.
    window : (left, right) or None
        Allow only ``i + offset - left <= j <= i + offset + right`` (None side: unbounded).
    offset : int
        The alignment offset o (see :func:`offset_of`).

    Returns
    -------
    ndarray of bool, shape (L', S')

    Examples
    --------
    >>> structural_mask(range(2), range(3), causal=True, offset=1).astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    diag = np.asarray(rows)[:, None] + offset
    j = np.asarray(cols)[None, :]
    allowed = np.ones((diag.shape[0], j.shape[1]), dtype=bool)
    if causal:
        allowed &= j <= diag
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= j >= diag - left
        if right is not None:
            allowed &= j <= diag + right
    return allowed


def allowed_mask(
    length: int,
    keys: int,
    *,
    mask=None,
    bias=None,
    causal: bool = False,
    window=None,
    align: str = "top_left",
) -> np.ndarray:
    """The full allowed set, shape broadcast of mask/bias with (L, S).

    Parameters
    ----------
    length, keys : int
        L and S.
    mask : array_like of bool, optional
        True = attend; broadcastable to (..., L, S).
    bias : array_like of float, optional
        Positions with bias -inf are excluded.
    causal, window, align
        As in :func:`refattn.attention`.

    Returns
    -------
    ndarray of bool, shape (..., L, S)

    Examples
    --------
    >>> allowed_mask(2, 2, causal=True).astype(int).tolist()
    [[1, 0], [1, 1]]
    """
    offset = offset_of(align, length, keys)
    allowed = structural_mask(
        range(length), range(keys), causal=causal, window=check_window(window), offset=offset
    )
    if mask is not None:
        allowed = allowed & _checks.bool_array(mask, "mask")
    if bias is not None:
        allowed = allowed & ~np.isneginf(np.asarray(bias, dtype=np.float64))
    return allowed
