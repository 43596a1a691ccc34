"""Register tiles, row loads and row reductions of the Numba CPU kernels (:mod:`.numba_cpu`).

The micro-kernels compute ``C[r, c:c+4W] += sum_x A(x, r) * B[x, c:c+4W]`` on a 4-row x
4-vector register tile (W lanes of a 64-byte vector), x sequential: the fixed reduction order
of every product in the kernels; lanes run over independent outputs only. The row helpers load
(and transpose) blocks of rows into zero-padded tiles and reduce one tile row (sum in the
documented lane order, NaN-ignoring max).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ._simd import (
    JIT,
    KERNEL_OPTIONS,
    exp_float32,
    exp_float64,
    lanes,
    vadd,
    vbest,
    vfma,
    vload,
    vmax,
    vmuls,
    vstore,
    vsum,
    vzero,
)

__all__ = [
    "BLOCK_Q",
    "BLOCK_K",
    "exp_compute",
    "matmul_t",
    "matmul_n",
    "matmul_t_rows4",
    "matmul_n_rows4",
    "row_sum",
    "row_max",
    "row_max_scaled",
    "load_rows_t",
    "load_rows",
    "pad",
    "padded",
]

#: Query rows per work unit / tile (a multiple of the 4-row register tile).
BLOCK_Q = 64
#: Keys per streamed block (a multiple of four 64-byte vectors of either dtype).
BLOCK_K = 64
#: Vectors per row of the register tile of the micro-kernels (4 rows x 4 vectors); value
#: and feature columns are padded to a multiple of this many vectors.
_TILE_VECTORS = 4

_OPTS = KERNEL_OPTIONS


if JIT:
    from numba import types
    from numba.core.extending import overload

    def exp_compute(x):  # exp_float64 or exp_float32, dispatched on the compute dtype below
        raise NotImplementedError

    @overload(exp_compute)
    def _exp_overload(x):
        if x == types.float64:
            return lambda x: exp_float64(x)
        if x == types.float32:
            return lambda x: exp_float32(x)
        return None

else:  # pragma: no cover

    def exp_compute(x):
        with np.errstate(all="ignore"):
            return exp_float64(x) if isinstance(x, np.float64 | float) else exp_float32(x)


# --------------------------------------------------------------------------------------
# micro-kernels: C[r, c:c+4W] += sum_x A(x, r) * Bm[x, c:c+4W], a 4 x 4W register tile,
# x sequential (the fixed reduction order), lanes = independent outputs.
# --------------------------------------------------------------------------------------
@njit(**_OPTS)
def _tile4x4_t(a, bm, count, row, col, out, fresh):
    """out[row:row+4, col:col+4W] += a[:count, row:row+4].T @ bm[:count, col:col+4W]."""
    width = lanes(bm)
    col1 = col + 1 * width
    col2 = col + 2 * width
    col3 = col + 3 * width
    o0 = out[row + 0]
    o1 = out[row + 1]
    o2 = out[row + 2]
    o3 = out[row + 3]
    c00 = vzero(o0) if fresh else vload(o0, col)
    c01 = vzero(o0) if fresh else vload(o0, col1)
    c02 = vzero(o0) if fresh else vload(o0, col2)
    c03 = vzero(o0) if fresh else vload(o0, col3)
    c10 = vzero(o1) if fresh else vload(o1, col)
    c11 = vzero(o1) if fresh else vload(o1, col1)
    c12 = vzero(o1) if fresh else vload(o1, col2)
    c13 = vzero(o1) if fresh else vload(o1, col3)
    c20 = vzero(o2) if fresh else vload(o2, col)
    c21 = vzero(o2) if fresh else vload(o2, col1)
    c22 = vzero(o2) if fresh else vload(o2, col2)
    c23 = vzero(o2) if fresh else vload(o2, col3)
    c30 = vzero(o3) if fresh else vload(o3, col)
    c31 = vzero(o3) if fresh else vload(o3, col1)
    c32 = vzero(o3) if fresh else vload(o3, col2)
    c33 = vzero(o3) if fresh else vload(o3, col3)
    for x in range(count):
        brow = bm[x]
        b0, b1, b2, b3 = vload(brow, col), vload(brow, col1), vload(brow, col2), vload(brow, col3)
        arow = a[x]
        a0 = arow[row + 0]
        c00 = vfma(a0, b0, c00)
        c01 = vfma(a0, b1, c01)
        c02 = vfma(a0, b2, c02)
        c03 = vfma(a0, b3, c03)
        a1 = arow[row + 1]
        c10 = vfma(a1, b0, c10)
        c11 = vfma(a1, b1, c11)
        c12 = vfma(a1, b2, c12)
        c13 = vfma(a1, b3, c13)
        a2 = arow[row + 2]
        c20 = vfma(a2, b0, c20)
        c21 = vfma(a2, b1, c21)
        c22 = vfma(a2, b2, c22)
        c23 = vfma(a2, b3, c23)
        a3 = arow[row + 3]
        c30 = vfma(a3, b0, c30)
        c31 = vfma(a3, b1, c31)
        c32 = vfma(a3, b2, c32)
        c33 = vfma(a3, b3, c33)
    vstore(o0, col, c00)
    vstore(o0, col1, c01)
    vstore(o0, col2, c02)
    vstore(o0, col3, c03)
    vstore(o1, col, c10)
    vstore(o1, col1, c11)
    vstore(o1, col2, c12)
    vstore(o1, col3, c13)
    vstore(o2, col, c20)
    vstore(o2, col1, c21)
    vstore(o2, col2, c22)
    vstore(o2, col3, c23)
    vstore(o3, col, c30)
    vstore(o3, col1, c31)
    vstore(o3, col2, c32)
    vstore(o3, col3, c33)


@njit(**_OPTS)
def _tile4x4_n(a, bm, count, row, col, out):
    """out[row:row+4, col:col+4W] += a[row:row+4, :count] @ bm[:count, col:col+4W]."""
    width = lanes(bm)
    col1 = col + 1 * width
    col2 = col + 2 * width
    col3 = col + 3 * width
    o0 = out[row + 0]
    r0 = a[row + 0]
    o1 = out[row + 1]
    r1 = a[row + 1]
    o2 = out[row + 2]
    r2 = a[row + 2]
    o3 = out[row + 3]
    r3 = a[row + 3]
    c00, c01, c02, c03 = vload(o0, col), vload(o0, col1), vload(o0, col2), vload(o0, col3)
    c10, c11, c12, c13 = vload(o1, col), vload(o1, col1), vload(o1, col2), vload(o1, col3)
    c20, c21, c22, c23 = vload(o2, col), vload(o2, col1), vload(o2, col2), vload(o2, col3)
    c30, c31, c32, c33 = vload(o3, col), vload(o3, col1), vload(o3, col2), vload(o3, col3)
    for x in range(count):
        brow = bm[x]
        b0, b1, b2, b3 = vload(brow, col), vload(brow, col1), vload(brow, col2), vload(brow, col3)
        a0 = r0[x]
        c00 = vfma(a0, b0, c00)
        c01 = vfma(a0, b1, c01)
        c02 = vfma(a0, b2, c02)
        c03 = vfma(a0, b3, c03)
        a1 = r1[x]
        c10 = vfma(a1, b0, c10)
        c11 = vfma(a1, b1, c11)
        c12 = vfma(a1, b2, c12)
        c13 = vfma(a1, b3, c13)
        a2 = r2[x]
        c20 = vfma(a2, b0, c20)
        c21 = vfma(a2, b1, c21)
        c22 = vfma(a2, b2, c22)
        c23 = vfma(a2, b3, c23)
        a3 = r3[x]
        c30 = vfma(a3, b0, c30)
        c31 = vfma(a3, b1, c31)
        c32 = vfma(a3, b2, c32)
        c33 = vfma(a3, b3, c33)
    vstore(o0, col, c00)
    vstore(o0, col1, c01)
    vstore(o0, col2, c02)
    vstore(o0, col3, c03)
    vstore(o1, col, c10)
    vstore(o1, col1, c11)
    vstore(o1, col2, c12)
    vstore(o1, col3, c13)
    vstore(o2, col, c20)
    vstore(o2, col1, c21)
    vstore(o2, col2, c22)
    vstore(o2, col3, c23)
    vstore(o3, col, c30)
    vstore(o3, col1, c31)
    vstore(o3, col2, c32)
    vstore(o3, col3, c33)


@njit(**_OPTS)
def _row_t(a, bm, count, row, col, out, fresh):
    """One row of :func:`_tile4x4_t` over 2W columns (the same operations, so the same bits
    per element)."""
    width = lanes(bm)
    col2 = col + width
    orow = out[row]
    c0 = vzero(orow) if fresh else vload(orow, col)
    c1 = vzero(orow) if fresh else vload(orow, col2)
    for x in range(count):
        brow = bm[x]
        ax = a[x, row]
        c0, c1 = vfma(ax, vload(brow, col), c0), vfma(ax, vload(brow, col2), c1)
    vstore(orow, col, c0)
    vstore(orow, col2, c1)


@njit(**_OPTS)
def _row_n(a, bm, count, row, col, out):
    """One row of :func:`_tile4x4_n` over 2W columns (the same operations, so the same bits
    per element)."""
    width = lanes(bm)
    col2 = col + width
    orow, arow = out[row], a[row]
    c0, c1 = vload(orow, col), vload(orow, col2)
    for x in range(count):
        brow = bm[x]
        ax = arow[x]
        c0, c1 = vfma(ax, vload(brow, col), c0), vfma(ax, vload(brow, col2), c1)
    vstore(orow, col, c0)
    vstore(orow, col2, c1)


@njit(**_OPTS)
def matmul_t(a, bm, count, rows, cols, out, fresh=False):
    """out[:rows, :cols] += a[:count, :rows].T @ bm[:count, :cols] (``=`` with ``fresh``:
    the tiles start from zero registers); 4 x 4-vector tiles, then rows one at a time (a
    decode step has one query row). ``cols`` is a multiple of four vectors."""
    step = 2 * lanes(bm)
    full = rows - rows % 4
    for row in range(0, full, 4):
        for col in range(0, cols, 2 * step):
            _tile4x4_t(a, bm, count, row, col, out, fresh)
    for row in range(full, rows):
        for col in range(0, cols, step):
            _row_t(a, bm, count, row, col, out, fresh)


@njit(**_OPTS)
def matmul_n(a, bm, count, rows, cols, out):
    """out[:rows, :cols] += a[:rows, :count] @ bm[:count, :cols]; 4 x 4-vector tiles, then
    rows one at a time. ``cols`` is a multiple of four vectors."""
    step = 2 * lanes(bm)
    full = rows - rows % 4
    for row in range(0, full, 4):
        for col in range(0, cols, 2 * step):
            _tile4x4_n(a, bm, count, row, col, out)
    for row in range(full, rows):
        for col in range(0, cols, step):
            _row_n(a, bm, count, row, col, out)


@njit(**_OPTS)
def _tile4x2_t(a, bm, count, row, col, out):
    """:func:`_tile4x4_t` (``fresh``) over 2W columns: the same operations per element, so
    the same bits."""
    width = lanes(bm)
    col1 = col + width
    o0, o1, o2, o3 = out[row], out[row + 1], out[row + 2], out[row + 3]
    c00, c01, c10, c11 = vzero(o0), vzero(o0), vzero(o0), vzero(o0)
    c20, c21, c30, c31 = vzero(o0), vzero(o0), vzero(o0), vzero(o0)
    for x in range(count):
        brow = bm[x]
        b0, b1 = vload(brow, col), vload(brow, col1)
        arow = a[x]
        a0, a1, a2, a3 = arow[row], arow[row + 1], arow[row + 2], arow[row + 3]
        c00, c01 = vfma(a0, b0, c00), vfma(a0, b1, c01)
        c10, c11 = vfma(a1, b0, c10), vfma(a1, b1, c11)
        c20, c21 = vfma(a2, b0, c20), vfma(a2, b1, c21)
        c30, c31 = vfma(a3, b0, c30), vfma(a3, b1, c31)
    vstore(o0, col, c00)
    vstore(o0, col1, c01)
    vstore(o1, col, c10)
    vstore(o1, col1, c11)
    vstore(o2, col, c20)
    vstore(o2, col1, c21)
    vstore(o3, col, c30)
    vstore(o3, col1, c31)


@njit(**_OPTS)
def matmul_t_rows4(a, bm, count, row, need, out):
    """out[row:row+4, :n] = a[:count, row:row+4].T @ bm[:count, :n] for the columns ``n``
    (``need`` rounded up to two vectors) of the :func:`matmul_t` (``fresh``) tiles that hold
    the first ``need`` columns; the other columns are left as they are. Each element is the
    same fma chain as in :func:`matmul_t`, so the same bits."""
    step = 2 * lanes(bm)
    for col in range(0, need, 2 * step):
        if col + step >= need:
            _tile4x2_t(a, bm, count, row, col, out)
        else:
            _tile4x4_t(a, bm, count, row, col, out, True)


@njit(**_OPTS)
def matmul_n_rows4(a, bm, count, row, cols, out):
    """out[row:row+4, :cols] += a[row:row+4, :count] @ bm[:count, :cols]: the four-row tiles
    of :func:`matmul_n` (the same fma chains, over the first ``count`` terms)."""
    step = 2 * lanes(bm)
    for col in range(0, cols, 2 * step):
        _tile4x4_n(a, bm, count, row, col, out)


@njit(**_OPTS)
def row_sum(row, count):
    """sum(row[:count]) in the documented lane order (row padded with zeros to a vector)."""
    width = lanes(row)
    acc = vzero(row)
    for c in range(0, count, width):
        acc = vadd(acc, vload(row, c))
    return vsum(acc)


@njit(**_OPTS)
def row_max(row, count):
    """max(row[:count]) ignoring NaN (-inf when all are -inf or NaN); order-free."""
    width = lanes(row)
    acc = vload(row, 0)
    for c in range(width, count, width):
        acc = vmax(acc, vload(row, c))
    return vbest(acc)


@njit(**_OPTS)
def load_rows_t(src, start, count, out):
    """out[:, :count] = src[start:start+count].T; the remaining columns are zeroed. Eight
    source rows at a time (contiguous reads, eight adjacent stores per output row): a pure
    copy, about three times faster than one strided column at a time."""
    width = out.shape[0]
    pad = out.shape[1]
    full = count - count % 8
    for c in range(0, full, 8):
        r = start + c
        s0, s1, s2, s3 = src[r], src[r + 1], src[r + 2], src[r + 3]
        s4, s5, s6, s7 = src[r + 4], src[r + 5], src[r + 6], src[r + 7]
        for x in range(width):
            orow = out[x]
            orow[c] = s0[x]
            orow[c + 1] = s1[x]
            orow[c + 2] = s2[x]
            orow[c + 3] = s3[x]
            orow[c + 4] = s4[x]
            orow[c + 5] = s5[x]
            orow[c + 6] = s6[x]
            orow[c + 7] = s7[x]
    for x in range(width):
        orow = out[x]
        for c in range(full, count):
            orow[c] = src[start + c, x]
        for c in range(count, pad):
            orow[c] = 0


@njit(**_OPTS)
def load_rows(src, start, count, out, zero_nonfinite=False):
    """out[:count, :F] = src[start:start+count]; padding rows/columns are zeroed; returns
    whether every loaded value is finite (with ``zero_nonfinite`` non-finite values are
    stored as 0)."""
    feats = src.shape[1]
    finite = True
    for c in range(count):
        orow = out[c]
        srow = src[start + c]
        for x in range(feats):
            value = srow[x]
            ok = math.isfinite(value)
            orow[x] = value if ok or not zero_nonfinite else 0
            finite &= ok
        for x in range(feats, out.shape[1]):
            orow[x] = 0
    for c in range(count, out.shape[0]):
        out[c, :] = 0
    return finite


@njit(**_OPTS)
def row_max_scaled(row, count, factor):
    """max(row[:count] * factor) ignoring NaN, as :func:`row_max` of the scaled row."""
    width = lanes(row)
    acc = vmuls(vload(row, 0), factor)
    for c in range(width, count, width):
        acc = vmax(acc, vmuls(vload(row, c), factor))
    return vbest(acc)


@njit(**_OPTS)
def pad(features, width):
    """Features padded to a multiple of four vectors of ``width`` lanes (the register tile's
    width; at least one tile)."""
    tile = _TILE_VECTORS * width
    return max(tile, -(-features // tile) * tile)


def padded(features, dtype):
    """:func:`pad` for a dtype's 64-byte vectors."""
    width = 64 // np.dtype(dtype).itemsize
    return max(
        _TILE_VECTORS * width, -(-features // (_TILE_VECTORS * width)) * _TILE_VECTORS * width
    )
