"""Block layout of vector-spin couplings (:mod:`refattn.meanfield`), for float and exact
(object) arrays alike: the (B, N, N, d, d) coupling blocks ``J[i, j]`` as one (B, N d, N d)
matrix with row (i, alpha) and column (j, beta).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

__all__ = ["big", "block_diag", "diag_blocks"]


def big(blocks):
    """(B, N, N, d, d) couplings -> (B, N d, N d) with row (i, alpha) and column (j, beta)."""
    b, n, _, d, _ = blocks.shape
    return blocks.transpose(0, 1, 3, 2, 4).reshape(b, n * d, n * d)


def block_diag(blocks):
    """(B, N, d, d) site blocks -> (B, N d, N d) block-diagonal matrix (float or exact)."""
    b, n, d, _ = blocks.shape
    out = np.zeros((b, n, d, n, d), dtype=blocks.dtype)
    if blocks.dtype == object:
        out[...] = Fraction(0)
    for i in range(n):
        out[:, i, :, i, :] = blocks[:, i]
    return out.reshape(b, n * d, n * d)


def diag_blocks(matrix, n, d):
    """Diagonal d x d blocks of (B, N d, N d) matrices -> (B, N, d, d)."""
    blocks = matrix.reshape(matrix.shape[0], n, d, n, d)
    return np.stack([blocks[:, i, :, i, :] for i in range(n)], axis=1)
