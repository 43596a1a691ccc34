"""Exact rational linear algebra: finite float inputs as Fractions, Gauss-Jordan inverses, and
rationals rounded once (an exact rational is its own enclosure).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from .rounding import correctly_round

__all__ = ["fractions", "invert", "round_rationals"]


def fractions(array, name):
    """Exact rational values of a finite float array (object array of Fraction)."""
    array = np.asarray(array, dtype=np.float64)
    if not np.isfinite(array).all():
        raise ValueError(f"{name}: the exact path needs finite inputs (shape {array.shape})")
    flat = np.empty(array.size, dtype=object)
    flat[:] = [Fraction(v) for v in array.ravel().tolist()]
    return flat.reshape(array.shape)


def round_rationals(values, dtype, what):
    """Round exact rationals once to ``dtype`` (they are their own enclosure)."""
    values = np.asarray(values, dtype=object)
    return correctly_round(lambda prec: (values, values), dtype, what=what)


def invert(matrix, what):
    """Inverse of a square object matrix of Fractions by Gauss-Jordan elimination."""
    n = matrix.shape[0]
    rows = [list(matrix[i]) + [Fraction(int(i == j)) for j in range(n)] for i in range(n)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if rows[r][col] != 0), None)
        if pivot is None:
            raise ValueError(f"{what} is singular; the fixed point does not exist")
        rows[col], rows[pivot] = rows[pivot], rows[col]
        inverse_pivot = 1 / rows[col][col]
        rows[col] = [v * inverse_pivot for v in rows[col]]
        for r in range(n):
            factor = rows[r][col]
            if r != col and factor != 0:
                rows[r] = [v - factor * w for v, w in zip(rows[r], rows[col], strict=True)]
    out = np.empty((n, n), dtype=object)
    for i in range(n):
        out[i, :] = rows[i][n:]
    return out
