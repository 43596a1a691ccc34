"""Register tiles of the sparse-key gather forward (:mod:`._cpu_gather`) that read the listed
key and value rows where they lie (no gathered copy, no transposition).

Scores: ``s[r, c] = sum_x q[r, x] k[j_c, x]`` as a dot product of two contiguous rows. On a
2-query x 4-key register tile the 8 products run lane-parallel over the features (lane l
sums the features x = l (mod W), x sequential over the whole vectors of the row; W the
lanes of a 64-byte vector), the lanes are then added by a fixed pairwise tree (:func:`vpairs`:
lanes (0, 1), (2, 3), ... then pairs of those, ...), and the last ``D mod W`` features are
added one by one with fused multiply-adds. A single dot product (:func:`dot_row`) runs the
same operations, so every score has the same bits in any tile. Error: each score is a sum of
D products with at most ``D / W + log2 W + D mod W <= D`` roundings in its chain, within the
``gamma_{D+4}`` of :func:`refattn.bounds.kernels.online_forward_bound`.

Values: ``acc[r, e] = sum_c p[r, c] v[j_c, e]``, c sequential (increasing key index), one
fused multiply-add per term starting from zero, on 4-row x 4-vector tiles, single vectors and
single columns: the same operation sequence per element in every tile, so the tiling (the head
blocks, the value width) changes no bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._simd import (
    JIT,
    KERNEL_OPTIONS,
    fma,
    lanes,
    vbest,
    vfma,
    vlane,
    vload,
    vmax,
    vmuls,
    vstore,
    vzero,
)

__all__ = [
    "lanes_const",
    "vfmav",
    "vpairs",
    "dot_row",
    "raw_scores",
    "row_top",
    "rows_top4",
    "score_span",
    "weighted_rows",
    "weighted_span",
    "weighted_tail",
]

_OPTS = KERNEL_OPTIONS

if JIT:
    from llvmlite import ir
    from numba.core import cgutils
    from numba.core.extending import intrinsic, overload

    def _vector_name(vtype):
        bits = 64 if isinstance(vtype.element, ir.DoubleType) else 32
        return f"v{vtype.count}f{bits}"

    @intrinsic
    def vfmav(typingctx, x, y, z):
        """x * y + z lane-wise, rounded once (``llvm.fma`` on vectors)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[0])
            fnty = ir.FunctionType(lt, [lt] * 3)
            fn = cgutils.get_or_insert_function(
                builder.module, fnty, f"llvm.fma.{_vector_name(lt)}"
            )
            return builder.call(fn, list(args))

        return x(x, y, z), codegen

    @intrinsic
    def vpairs(typingctx, x, y):
        """[x0 + x1, x2 + x3, ..., y0 + y1, y2 + y3, ...]: adjacent lanes added, x's pairs in
        the low half and y's in the high half (two shuffles and one add)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[0])
            i32 = ir.IntType(32)
            count = lt.count

            def lanes_of(first):
                items = [ir.Constant(i32, 2 * t + first) for t in range(count)]
                return ir.Constant(ir.VectorType(i32, count), items)

            even = builder.shuffle_vector(args[0], args[1], lanes_of(0))
            odd = builder.shuffle_vector(args[0], args[1], lanes_of(1))
            return builder.fadd(even, odd)

        return x(x, y), codegen

    def lanes_const(arr):  # the lanes of arr's dtype, a literal in the caller's IR (below)
        raise NotImplementedError

    @overload(lanes_const, inline="always")
    def _lanes_const_overload(arr):
        # inlined as a literal, so that a loop stepping by it has a constant step: with
        # ``_simd.lanes`` (a call LLVM did not fold) the score loop ran at 0.65x the rate
        count = 512 // arr.dtype.bitwidth
        return lambda arr: count

else:  # pragma: no cover - the NUMBA_DISABLE_JIT=1 tier runs the bodies as Python

    def lanes_const(arr):
        return 64 // arr.itemsize

    def vfmav(x, y, z):
        return (x * y + z).astype(x.dtype)

    def vpairs(x, y):
        both = np.concatenate([x, y])
        return (both[0::2] + both[1::2]).astype(x.dtype)


@njit(**_OPTS)
def _tail(qrow, krow, start, dim, total):
    """total + q[x] k[x] for x in [start, dim), one fused multiply-add each, x increasing."""
    for x in range(start, dim):
        total = fma(qrow[x], krow[x], total)
    return total


@njit(**_OPTS)
def dot_row(qrow, krow, dim):
    """q . k of two rows of ``dim`` features in the order of :func:`_dots2x4` (lane-parallel
    over whole vectors, the pairwise lane tree, then the tail features)."""
    width = lanes_const(qrow)
    whole = dim - dim % width
    acc = vzero(qrow)
    for x in range(0, whole, width):
        acc = vfmav(vload(qrow, x), vload(krow, x), acc)
    step = width
    while step > 1:
        acc = vpairs(acc, acc)
        step //= 2
    return _tail(qrow, krow, whole, dim, vlane(acc, 0))


@njit(**_OPTS)
def _dots2x4(q0, q1, k0, k1, k2, k3, dim):
    """A vector whose lane 4a + c is (q0, q1)[a] . (k0, k1, k2, k3)[c] before the tail
    features: 8
    lane-parallel accumulators reduced by the pairwise lane tree (:func:`vpairs`). Two query
    rows by four keys (not 4 x 4): the 16-accumulator tile made LLVM spill registers once it
    unrolled the loop, and ran at about 0.65x this one's rate."""
    width = lanes_const(q0)
    whole = dim - dim % width
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = vzero(q0)
    for x in range(0, whole, width):
        y0, y1, y2, y3 = vload(k0, x), vload(k1, x), vload(k2, x), vload(k3, x)
        z = vload(q0, x)
        a00, a01 = vfmav(z, y0, a00), vfmav(z, y1, a01)
        a02, a03 = vfmav(z, y2, a02), vfmav(z, y3, a03)
        z = vload(q1, x)
        a10, a11 = vfmav(z, y0, a10), vfmav(z, y1, a11)
        a12, a13 = vfmav(z, y2, a12), vfmav(z, y3, a13)
    # three levels of the lane tree: float64 (8 lanes) holds the 8 sums, float32 (16 lanes)
    # their two halves, added by a fourth level
    low = vpairs(vpairs(a00, a01), vpairs(a02, a03))
    tree = vpairs(low, vpairs(vpairs(a10, a11), vpairs(a12, a13)))
    if width == 16:
        tree = vpairs(tree, tree)
    return tree


@njit(**_OPTS)
def _dots3x4(q0, q1, q2, k0, k1, k2, k3, dim):
    """:func:`_dots2x4` for three query rows: (the 2 x 4 tree of rows 0 and 1, a vector whose
    lane c is row 2's dot with key c), each sum by the same lane tree. 12 accumulators and 7
    loads per 12 fused multiply-adds (the 2 x 4 tile: 6 per 8), for a group of many heads
    whose queries stream past the same key rows."""
    width = lanes_const(q0)
    whole = dim - dim % width
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = vzero(q0)
    for x in range(0, whole, width):
        y0, y1, y2, y3 = vload(k0, x), vload(k1, x), vload(k2, x), vload(k3, x)
        z = vload(q0, x)
        a00, a01 = vfmav(z, y0, a00), vfmav(z, y1, a01)
        a02, a03 = vfmav(z, y2, a02), vfmav(z, y3, a03)
        z = vload(q1, x)
        a10, a11 = vfmav(z, y0, a10), vfmav(z, y1, a11)
        a12, a13 = vfmav(z, y2, a12), vfmav(z, y3, a13)
        z = vload(q2, x)
        a20, a21 = vfmav(z, y0, a20), vfmav(z, y1, a21)
        a22, a23 = vfmav(z, y2, a22), vfmav(z, y3, a23)
    low = vpairs(vpairs(a00, a01), vpairs(a02, a03))
    tree = vpairs(low, vpairs(vpairs(a10, a11), vpairs(a12, a13)))
    third = vpairs(vpairs(a20, a21), vpairs(a22, a23))
    third = vpairs(third, third)
    if width == 16:
        tree = vpairs(tree, tree)
        third = vpairs(third, third)
    return tree, third


@njit(**_OPTS)
def _score_tile3(qt, row, k0, k1, k2, k3, c, s):
    """s[row:row+3, c:c+4] by :func:`_dots3x4` plus the tail features."""
    dim = qt.shape[1]
    whole = dim - dim % lanes(qt)
    tree, third = _dots3x4(qt[row], qt[row + 1], qt[row + 2], k0, k1, k2, k3, dim)
    s0, s1, s2 = s[row], s[row + 1], s[row + 2]
    s0[c], s0[c + 1], s0[c + 2], s0[c + 3] = (
        vlane(tree, 0),
        vlane(tree, 1),
        vlane(tree, 2),
        vlane(tree, 3),
    )
    s1[c], s1[c + 1], s1[c + 2], s1[c + 3] = (
        vlane(tree, 4),
        vlane(tree, 5),
        vlane(tree, 6),
        vlane(tree, 7),
    )
    s2[c], s2[c + 1], s2[c + 2], s2[c + 3] = (
        vlane(third, 0),
        vlane(third, 1),
        vlane(third, 2),
        vlane(third, 3),
    )
    if whole < dim:
        krows = (k0, k1, k2, k3)
        for a in range(3):
            for t in range(4):
                s[row + a, c + t] = _tail(qt[row + a], krows[t], whole, dim, s[row + a, c + t])


#: Listed keys per chunk of :func:`raw_scores`: 64 key rows (147 KiB at D 576 float32) stay
#: in L2 while each 4-row block of queries (in L1) passes over them.
KEY_CHUNK = 64


@njit(**_OPTS)
def raw_scores(qt, kp, cols, count, rows, s, minus_one):
    """s[r, c] = qt[r] . kp[cols[c]] for r < rows, c < count: chunks of :data:`KEY_CHUNK`
    keys, each by :func:`score_span`; returns max |x| over the key rows read."""
    top = 0.0
    for c0 in range(0, count, KEY_CHUNK):
        top = score_span(qt, kp, cols, c0, min(count, c0 + KEY_CHUNK), rows, s, minus_one, top)
    return top


@njit(**_OPTS)
def _score_tile(qt, row, k0, k1, k2, k3, c, s):
    """s[row:row+2, c:c+4] = the 2 x 4 tile of :func:`_dots2x4` plus the tail features."""
    dim = qt.shape[1]
    whole = dim - dim % lanes(qt)
    tree = _dots2x4(qt[row], qt[row + 1], k0, k1, k2, k3, dim)
    s0, s1 = s[row], s[row + 1]
    # constant lane indices: the sums leave the register without a trip through memory
    s0[c], s0[c + 1], s0[c + 2], s0[c + 3] = (
        vlane(tree, 0),
        vlane(tree, 1),
        vlane(tree, 2),
        vlane(tree, 3),
    )
    s1[c], s1[c + 1], s1[c + 2], s1[c + 3] = (
        vlane(tree, 4),
        vlane(tree, 5),
        vlane(tree, 6),
        vlane(tree, 7),
    )
    if whole < dim:
        krows = (k0, k1, k2, k3)
        for a in range(2):
            for t in range(4):
                s[row + a, c + t] = _tail(qt[row + a], krows[t], whole, dim, s[row + a, c + t])


@njit(**_OPTS)
def score_span(qt, kp, cols, c0, c1, rows, s, minus_one, top):
    """s[r, c] = qt[r] . kp[cols[c]] for r < rows and c in [c0, c1), each score the bits of
    :func:`raw_scores`: every group of 4 keys is loaded once and dotted with all the rows by
    3 x 4 tiles (the key rows stay in L1 while the query rows stream past: many heads
    sharing one key list), a 2 x 4 tile and a single row for the leftover rows, the leftover
    keys one at a time. Returns max(top, max |x| over the key rows read) (:func:`row_top`,
    while they are in L1; ``minus_one`` -1 in their dtype): what the range check of the
    scores reads of k."""
    triples = rows - rows % 3
    full_rows = triples + (rows - triples) // 2 * 2
    full_end = c1 - (c1 - c0) % 4
    dim = qt.shape[1]
    for c in range(c0, full_end, 4):
        k0, k1, k2, k3 = kp[cols[c]], kp[cols[c + 1]], kp[cols[c + 2]], kp[cols[c + 3]]
        top = rows_top4(k0, k1, k2, k3, minus_one, top)
        for row in range(0, triples, 3):
            _score_tile3(qt, row, k0, k1, k2, k3, c, s)
        for row in range(triples, full_rows, 2):
            _score_tile(qt, row, k0, k1, k2, k3, c, s)
        for row in range(full_rows, rows):
            for t in range(4):
                s[row, c + t] = dot_row(qt[row], kp[cols[c + t]], dim)
    for c in range(full_end, c1):
        krow = kp[cols[c]]
        top = row_top(krow, minus_one, top)
        for row in range(rows):
            s[row, c] = dot_row(qt[row], krow, dim)
    return top


@njit(**_OPTS)
def _weighted4(p, row, vp, cols, count, e0, acc):
    """acc[row:row+4, e0:e0+4W] = sum_c p[row:row+4, c] vp[cols[c], e0:e0+4W], c increasing."""
    _weighted4_span(p, row, vp, cols, 0, count, e0, acc)


@njit(**_OPTS)
def _weighted4_span(p, row, vp, cols, c0, c1, e0, acc):
    """The terms c in [c0, c1) of :func:`_weighted4`'s sums, continuing from the partial sums
    in acc (from zero when c0 == 0): a float stored and reloaded keeps its bits, so a sum run
    over consecutive spans is the same fused multiply-add sequence as one run over all."""
    width = lanes(acc)
    e1, e2, e3 = e0 + width, e0 + 2 * width, e0 + 3 * width
    p0, p1, p2, p3 = p[row], p[row + 1], p[row + 2], p[row + 3]
    c00 = c01 = c02 = c03 = c10 = c11 = c12 = c13 = vzero(acc)
    c20 = c21 = c22 = c23 = c30 = c31 = c32 = c33 = vzero(acc)
    if c0 > 0:
        c00, c01, c02, c03 = _load4(acc[row], e0, width)
        c10, c11, c12, c13 = _load4(acc[row + 1], e0, width)
        c20, c21, c22, c23 = _load4(acc[row + 2], e0, width)
        c30, c31, c32, c33 = _load4(acc[row + 3], e0, width)
    for c in range(c0, c1):
        vrow = vp[cols[c]]
        b0, b1, b2, b3 = vload(vrow, e0), vload(vrow, e1), vload(vrow, e2), vload(vrow, e3)
        w = p0[c]
        c00, c01, c02, c03 = vfma(w, b0, c00), vfma(w, b1, c01), vfma(w, b2, c02), vfma(w, b3, c03)
        w = p1[c]
        c10, c11, c12, c13 = vfma(w, b0, c10), vfma(w, b1, c11), vfma(w, b2, c12), vfma(w, b3, c13)
        w = p2[c]
        c20, c21, c22, c23 = vfma(w, b0, c20), vfma(w, b1, c21), vfma(w, b2, c22), vfma(w, b3, c23)
        w = p3[c]
        c30, c31, c32, c33 = vfma(w, b0, c30), vfma(w, b1, c31), vfma(w, b2, c32), vfma(w, b3, c33)
    _store4(acc[row], e0, width, c00, c01, c02, c03)
    _store4(acc[row + 1], e0, width, c10, c11, c12, c13)
    _store4(acc[row + 2], e0, width, c20, c21, c22, c23)
    _store4(acc[row + 3], e0, width, c30, c31, c32, c33)


@njit(**_OPTS)
def _load4(orow, e0, width):
    return (
        vload(orow, e0),
        vload(orow, e0 + width),
        vload(orow, e0 + 2 * width),
        vload(orow, e0 + 3 * width),
    )


@njit(**_OPTS)
def _store4(orow, e0, width, x0, x1, x2, x3):
    vstore(orow, e0, x0)
    vstore(orow, e0 + width, x1)
    vstore(orow, e0 + 2 * width, x2)
    vstore(orow, e0 + 3 * width, x3)


@njit(**_OPTS)
def _weighted1(prow, vp, cols, count, e0, orow):
    """orow[e0:e0+W] = sum_c prow[c] vp[cols[c], e0:e0+W] (the operations of
    :func:`_weighted4` for one row and one vector)."""
    total = vzero(orow)
    for c in range(count):
        total = vfma(prow[c], vload(vp[cols[c]], e0), total)
    vstore(orow, e0, total)


@njit(**_OPTS)
def weighted_rows(p, vp, cols, count, rows, vdim, acc):
    """acc[:rows, :vdim] = p[:rows, :count] @ vp[cols[:count], :vdim] (``vp`` rows may be
    wider than ``vdim``: a value that is the leading features of the key rows is read in
    place); 4-row x 4-vector tiles, then single vectors, then single columns."""
    tile = 4 * lanes(acc)
    tiled = vdim - vdim % tile
    full_rows = rows - rows % 4
    for e0 in range(0, tiled, tile):
        for row in range(0, full_rows, 4):
            _weighted4(p, row, vp, cols, count, e0, acc)
        _weighted_single(p, vp, cols, count, full_rows, rows, e0, e0 + tile, acc)
    weighted_tail(p, vp, cols, count, rows, vdim, acc)


#: Listed keys per span of :func:`weighted_span`: 64 value slices of 4 vectors (16 KiB in
#: float32) stay in L1 while every 4-row tile of the heads passes over them.
VALUE_CHUNK = 64


@njit(**_OPTS)
def weighted_span(p, vp, cols, count, rows, e0, acc):
    """acc[:rows, e0:e0+4W] of :func:`weighted_rows` (the same bits): the keys in spans of
    :data:`VALUE_CHUNK`, each span's value slices read once for all the 4-row tiles."""
    full_rows = rows - rows % 4
    for c0 in range(0, max(count, 1), VALUE_CHUNK):
        c1 = min(count, c0 + VALUE_CHUNK)
        for row in range(0, full_rows, 4):
            _weighted4_span(p, row, vp, cols, c0, c1, e0, acc)
    _weighted_single(p, vp, cols, count, full_rows, rows, e0, e0 + 4 * lanes(acc), acc)


@njit(**_OPTS)
def _weighted_single(p, vp, cols, count, r0, r1, e0, e1, acc):
    """Rows [r0, r1) of acc[:, e0:e1] (whole vectors) by single vectors."""
    width = lanes(acc)
    for row in range(r0, r1):
        for e in range(e0, e1, width):
            _weighted1(p[row], vp, cols, count, e, acc[row])


@njit(**_OPTS)
def weighted_tail(p, vp, cols, count, rows, vdim, acc):
    """The columns of :func:`weighted_rows` past its 4-vector tiles: single vectors, then
    single columns."""
    width = lanes(acc)
    tiled = vdim - vdim % (4 * width)
    whole = vdim - vdim % width
    _weighted_single(p, vp, cols, count, 0, rows, tiled, whole, acc)
    for e in range(whole, vdim):
        for row in range(rows):
            prow = p[row]
            total = vlane(vzero(acc), 0)
            for c in range(count):
                total = fma(prow[c], vp[cols[c], e], total)
            acc[row, e] = total


@njit(**_OPTS)
def row_top(row, minus_one, best):
    """max(best, |x|) over the entries x of a contiguous row (NaN skipped; Inf kept);
    ``minus_one`` is -1 in the row's dtype."""
    width = lanes_const(row)
    whole = row.shape[0] - row.shape[0] % width
    acc = vzero(row)
    for x in range(0, whole, width):
        value = vload(row, x)
        acc = vmax(acc, vmax(value, vmuls(value, minus_one)))
    best = max(best, vbest(acc))
    for x in range(whole, row.shape[0]):
        if abs(row[x]) > best:
            best = abs(row[x])
    return best


@njit(**_OPTS)
def rows_top4(r0, r1, r2, r3, minus_one, best):
    """:func:`row_top` of four rows read side by side (the maximum is order-free)."""
    width = lanes_const(r0)
    whole = r0.shape[0] - r0.shape[0] % width
    a0 = a1 = vzero(r0)
    for x in range(0, whole, width):
        v0, v1, v2, v3 = vload(r0, x), vload(r1, x), vload(r2, x), vload(r3, x)
        a0 = vmax(a0, vmax(vmax(v0, vmuls(v0, minus_one)), vmax(v1, vmuls(v1, minus_one))))
        a1 = vmax(a1, vmax(vmax(v2, vmuls(v2, minus_one)), vmax(v3, vmuls(v3, minus_one))))
    best = max(best, vbest(vmax(a0, a1)))
    for row in (r0, r1, r2, r3):
        for x in range(whole, row.shape[0]):
            if abs(row[x]) > best:
                best = abs(row[x])
    return best
