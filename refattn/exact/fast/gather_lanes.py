"""Lane-wise inner loops of the fast exact gather's double-precision step and of its key and
value setup (:mod:`refattn.exact.fast.gather_kernels` states the algorithm and the bounds).

Each loop here does, in every lane, the very IEEE operations of the scalar loop it replaces,
in the same order: a lane holds one (query, key) dot product or one (query, value feature)
sum, and the lanes never meet. The accumulators stay in registers over a whole block of
features or keys (64-byte vectors, :mod:`refattn.kernels._simd`), so the bits are those of
the scalar loops and depend on the shapes alone.

* :func:`dot_tiles`: the blocked fma dot products and their magnitude sums (Higham 2002,
  eq. (4.3): each rounding errs by at most u times its result's magnitude).
* :func:`weighted_block`: one key block's ``sum_j e_j v_je`` and ``sum_j e_j |v_je|``;
  :func:`sums_rows` the first alone (its bits) and :func:`magnitude_sum` the second for one
  feature (its bits), for the features whose outputs a looser bound leaves undecided.
* :func:`key_facts`, :func:`value_rows`: the listed keys gathered into the transposed float64
  table with their norms, exactness scales and range check in one pass; the listed values
  with their maxima and range check.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ...kernels._simd import JIT, vadd, vload, vmul, vstore, vzero
from . import doubledouble as D

__all__ = [
    "W",
    "vabs",
    "dot_tiles",
    "weighted_block",
    "weighted_rows",
    "sums_rows",
    "magnitude_sum",
    "key_facts",
    "value_rows",
    "source_dots",
    "source_span",
    "source_panel",
]

#: Lanes of a 64-byte float64 vector.
W = 8

#: Keys per block of :func:`key_facts` (four lane vectors: whole cache lines of each row of the
#: transposed table are written at once).
KEY_BLOCK = 4 * W

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")

if JIT:
    from llvmlite import ir
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    @intrinsic
    def vabs(typingctx, x):
        """|x| lane-wise (llvm.fabs: exact, the sign bit cleared)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[0])
            bits = 64 if isinstance(lt.element, ir.DoubleType) else 32
            fnty = ir.FunctionType(lt, [lt])
            fn = cgutils.get_or_insert_function(
                builder.module, fnty, f"llvm.fabs.v{lt.count}f{bits}"
            )
            return builder.call(fn, args)

        return x(x), codegen

    from ...kernels._simd import vfma

    def _shuffle(builder, a, b, mask):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), mask))

    @intrinsic
    def transpose8(typingctx, src, d0, dst):
        """``dst[d0 + x, r] = src[r, d0 + x]`` for r, x < 8 (``src`` (8, >= d0 + 8), ``dst``
        (>= d0 + 8, 8) float64, C-contiguous): eight loads, 24 shuffles in three stages
        (pairs of rows, then pairs of pairs, then halves) and eight stores; data moved, not
        computed."""

        def codegen(context, builder, sig, args):
            srcty, _, dstty = sig.args
            sa = context.make_array(srcty)(context, builder, args[0])
            da = context.make_array(dstty)(context, builder, args[2])
            i64 = ir.IntType(64)
            vt = ir.VectorType(ir.DoubleType(), 8)
            m = []
            for r in range(8):
                at = [ir.Constant(i64, r), args[1]]
                ptr = cgutils.get_item_pointer(context, builder, srcty, sa, at)
                m.append(builder.load(builder.bitcast(ptr, vt.as_pointer()), align=1))
            u = [None] * 8
            for r in (0, 2, 4, 6):
                u[r] = _shuffle(builder, m[r], m[r + 1], [0, 8, 2, 10, 4, 12, 6, 14])
                u[r + 1] = _shuffle(builder, m[r], m[r + 1], [1, 9, 3, 11, 5, 13, 7, 15])
            v = [None] * 8
            for r in (0, 1, 4, 5):
                v[r] = _shuffle(builder, u[r], u[r + 2], [0, 1, 8, 9, 4, 5, 12, 13])
                v[r + 2] = _shuffle(builder, u[r], u[r + 2], [2, 3, 10, 11, 6, 7, 14, 15])
            out = [None] * 8
            for c in (0, 1, 2, 3):
                out[c] = _shuffle(builder, v[c], v[c + 4], [0, 1, 2, 3, 8, 9, 10, 11])
                out[c + 4] = _shuffle(builder, v[c], v[c + 4], [4, 5, 6, 7, 12, 13, 14, 15])
            for x in range(8):
                at = [builder.add(args[1], ir.Constant(i64, x)), ir.Constant(i64, 0)]
                ptr = cgutils.get_item_pointer(context, builder, dstty, da, at)
                builder.store(out[x], builder.bitcast(ptr, vt.as_pointer()), align=1)
            return context.get_dummy_value()

        return numba.types.none(src, d0, dst), codegen

    @intrinsic
    def _trailing_zeros(typingctx, n):
        """The count of trailing zero bits of an int64 (llvm.cttz; 64 for 0)."""

        def codegen(context, builder, sig, args):
            it = ir.IntType(64)
            fnty = ir.FunctionType(it, [it, ir.IntType(1)])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.cttz.i64")
            return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])

        return numba.types.int64(n), codegen

else:  # pragma: no cover - exercised by the NUMBA_DISABLE_JIT=1 test tier
    from ...kernels._simd import vfma

    def vabs(x):
        return np.abs(x)

    def _trailing_zeros(n):
        n = int(n)
        return 64 if n == 0 else (n & -n).bit_length() - 1

    def transpose8(src, d0, dst):
        dst[d0 : d0 + 8, :8] = src[:8, d0 : d0 + 8].T


@numba.jit(**_JIT)
def _dots4(q4, kcols, c, dim, block, s4, sab4):
    """Four query rows (``q4`` (4, D)) against the W keys ``kcols[:, c:c + W]``: per lane,
    fma chains over each block of ``block`` features (a zero feature skipped), the block sums
    added in order and every rounded result's magnitude summed (the scalar loop of
    :func:`refattn.exact.fast.gather_kernels._blocked_dots`, lane by lane); written to
    ``s4[r, c:c + W]``, ``sab4[r, c:c + W]``."""
    s0 = s1 = s2 = s3 = b0 = b1 = b2 = b3 = vzero(kcols[0])
    for d0 in range(0, dim, block):
        p0 = p1 = p2 = p3 = a0 = a1 = a2 = a3 = vzero(kcols[0])
        for d in range(d0, min(d0 + block, dim)):
            k = vload(kcols[d], c)
            x = q4[0, d]
            if x != 0.0:
                p0 = vfma(x, k, p0)
                a0 = vadd(a0, vabs(p0))
            x = q4[1, d]
            if x != 0.0:
                p1 = vfma(x, k, p1)
                a1 = vadd(a1, vabs(p1))
            x = q4[2, d]
            if x != 0.0:
                p2 = vfma(x, k, p2)
                a2 = vadd(a2, vabs(p2))
            x = q4[3, d]
            if x != 0.0:
                p3 = vfma(x, k, p3)
                a3 = vadd(a3, vabs(p3))
        s0 = vadd(s0, p0)
        b0 = vadd(b0, vadd(a0, vabs(s0)))
        s1 = vadd(s1, p1)
        b1 = vadd(b1, vadd(a1, vabs(s1)))
        s2 = vadd(s2, p2)
        b2 = vadd(b2, vadd(a2, vabs(s2)))
        s3 = vadd(s3, p3)
        b3 = vadd(b3, vadd(a3, vabs(s3)))
    vstore(s4[0], c, s0)
    vstore(s4[1], c, s1)
    vstore(s4[2], c, s2)
    vstore(s4[3], c, s3)
    vstore(sab4[0], c, b0)
    vstore(sab4[1], c, b1)
    vstore(sab4[2], c, b2)
    vstore(sab4[3], c, b3)


@numba.jit(**_JIT)
def _dots4_full(q4, kcols, c, dim, block, s4, sab4):
    """:func:`_dots4` for four query rows without a zero feature (no feature is skipped: the
    same operations, without the tests)."""
    s0 = s1 = s2 = s3 = b0 = b1 = b2 = b3 = vzero(kcols[0])
    for d0 in range(0, dim, block):
        p0 = p1 = p2 = p3 = a0 = a1 = a2 = a3 = vzero(kcols[0])
        for d in range(d0, min(d0 + block, dim)):
            k = vload(kcols[d], c)
            p0 = vfma(q4[0, d], k, p0)
            p1 = vfma(q4[1, d], k, p1)
            p2 = vfma(q4[2, d], k, p2)
            p3 = vfma(q4[3, d], k, p3)
            a0 = vadd(a0, vabs(p0))
            a1 = vadd(a1, vabs(p1))
            a2 = vadd(a2, vabs(p2))
            a3 = vadd(a3, vabs(p3))
        s0 = vadd(s0, p0)
        b0 = vadd(b0, vadd(a0, vabs(s0)))
        s1 = vadd(s1, p1)
        b1 = vadd(b1, vadd(a1, vabs(s1)))
        s2 = vadd(s2, p2)
        b2 = vadd(b2, vadd(a2, vabs(s2)))
        s3 = vadd(s3, p3)
        b3 = vadd(b3, vadd(a3, vabs(s3)))
    vstore(s4[0], c, s0)
    vstore(s4[1], c, s1)
    vstore(s4[2], c, s2)
    vstore(s4[3], c, s3)
    vstore(sab4[0], c, b0)
    vstore(sab4[1], c, b1)
    vstore(sab4[2], c, b2)
    vstore(sab4[3], c, b3)


@numba.jit(**_JIT)
def _dots1(qrow, kcols, c, dim, block, srow, sabrow):
    """:func:`_dots4` for one query row."""
    s0 = b0 = vzero(kcols[0])
    for d0 in range(0, dim, block):
        p0 = a0 = vzero(kcols[0])
        for d in range(d0, min(d0 + block, dim)):
            x = qrow[d]
            if x != 0.0:
                p0 = vfma(x, vload(kcols[d], c), p0)
                a0 = vadd(a0, vabs(p0))
        s0 = vadd(s0, p0)
        b0 = vadd(b0, vadd(a0, vabs(s0)))
    vstore(srow, c, s0)
    vstore(sabrow, c, b0)


@numba.jit(**_JIT)
def dot_tiles(qh, kcols, n, block, s, sab):
    """``s[r, c] = qh[r] . kcols[:, c]`` and the magnitude sums ``sab[r, c]`` for the rows of
    ``qh`` (R, D) and the first ``n - n % W`` columns of ``kcols`` (D, >= n), W keys per lane
    vector, four query rows at a time (their chains interleaved); the caller does the rest of
    the columns. ``s`` and ``sab`` (>= R, >= n) are overwritten there. Each tile of W keys is
    first copied into a contiguous (D, W) panel that every row then reads (one strided pass
    over ``kcols`` per tile, however many rows: the copy changes no bit)."""
    rows = qh.shape[0]
    dim = qh.shape[1]
    panel = np.empty((dim, W))
    tile = np.zeros((4, W))
    tile_ab = np.zeros((4, W))
    for c in range(0, n - n % W, W):
        for d in range(dim):
            vstore(panel[d], 0, vload(kcols[d], c))
        r = 0
        while r + 4 <= rows:
            _dots4(qh[r : r + 4], panel, 0, dim, block, tile, tile_ab)
            for rr in range(4):
                vstore(s[r + rr], c, vload(tile[rr], 0))
                vstore(sab[r + rr], c, vload(tile_ab[rr], 0))
            r += 4
        while r < rows:
            _dots1(qh[r], panel, 0, dim, block, tile[0], tile_ab[0])
            vstore(s[r], c, vload(tile[0], 0))
            vstore(sab[r], c, vload(tile_ab[0], 0))
            r += 1


@numba.jit(**_JIT)
def weighted_block(vp, cols, j0, j1, wrow, use, nrow, arow):
    """``nrow[e] += sum_j wrow[j] vp[cols[j], e]`` and ``arow[e] += sum_j wrow[j]
    |vp[cols[j], e]|`` over the keys j0 <= j < j1 with ``use[j]``, each block sum an fma
    chain over j in order from +0, then added to the total (the scalar loop's block sums and
    flush, lane by lane); ``vp`` the plane's gathered (U, E) values."""
    vdim = vp.shape[1]
    whole = vdim - vdim % (4 * W)
    for e in range(0, whole, 4 * W):
        n0 = n1 = n2 = n3 = a0 = a1 = a2 = a3 = vzero(nrow)
        for j in range(j0, j1):
            if not use[j]:
                continue
            w = wrow[j]
            vrow = vp[cols[j]]
            v0, v1 = vload(vrow, e), vload(vrow, e + W)
            v2, v3 = vload(vrow, e + 2 * W), vload(vrow, e + 3 * W)
            n0, n1 = vfma(w, v0, n0), vfma(w, v1, n1)
            n2, n3 = vfma(w, v2, n2), vfma(w, v3, n3)
            a0, a1 = vfma(w, vabs(v0), a0), vfma(w, vabs(v1), a1)
            a2, a3 = vfma(w, vabs(v2), a2), vfma(w, vabs(v3), a3)
        vstore(nrow, e, vadd(vload(nrow, e), n0))
        vstore(nrow, e + W, vadd(vload(nrow, e + W), n1))
        vstore(nrow, e + 2 * W, vadd(vload(nrow, e + 2 * W), n2))
        vstore(nrow, e + 3 * W, vadd(vload(nrow, e + 3 * W), n3))
        vstore(arow, e, vadd(vload(arow, e), a0))
        vstore(arow, e + W, vadd(vload(arow, e + W), a1))
        vstore(arow, e + 2 * W, vadd(vload(arow, e + 2 * W), a2))
        vstore(arow, e + 3 * W, vadd(vload(arow, e + 3 * W), a3))
    if whole < vdim:
        _weighted_tail(vp, cols[j0:j1], j1 - j0, wrow[j0:j1], use[j0:j1], whole, nrow, arow)


@numba.jit(**_JIT)
def _weighted4(vp, cols, nb, wts, use, e, acc):
    """:func:`weighted_block` of four query rows (``wts``, ``use`` (4, >= nb)) on the W value
    features e <= x < e + W: each value vector loaded once for the four rows; ``acc`` =
    (nsum, asum) (4, E) totals."""
    nsum, asum = acc
    n0 = n1 = n2 = n3 = a0 = a1 = a2 = a3 = vzero(nsum[0])
    for j in range(nb):
        v = vload(vp[cols[j]], e)
        av = vabs(v)
        if use[0, j]:
            n0, a0 = vfma(wts[0, j], v, n0), vfma(wts[0, j], av, a0)
        if use[1, j]:
            n1, a1 = vfma(wts[1, j], v, n1), vfma(wts[1, j], av, a1)
        if use[2, j]:
            n2, a2 = vfma(wts[2, j], v, n2), vfma(wts[2, j], av, a2)
        if use[3, j]:
            n3, a3 = vfma(wts[3, j], v, n3), vfma(wts[3, j], av, a3)
    vstore(nsum[0], e, vadd(vload(nsum[0], e), n0))
    vstore(nsum[1], e, vadd(vload(nsum[1], e), n1))
    vstore(nsum[2], e, vadd(vload(nsum[2], e), n2))
    vstore(nsum[3], e, vadd(vload(nsum[3], e), n3))
    vstore(asum[0], e, vadd(vload(asum[0], e), a0))
    vstore(asum[1], e, vadd(vload(asum[1], e), a1))
    vstore(asum[2], e, vadd(vload(asum[2], e), a2))
    vstore(asum[3], e, vadd(vload(asum[3], e), a3))


@numba.jit(**_JIT)
def _weighted8(vp, cols, nb, wts, use, e, acc):
    """:func:`_weighted4` for eight query rows (16 accumulators: each value vector and its
    magnitude loaded once for the eight)."""
    nsum, asum = acc
    n0 = n1 = n2 = n3 = n4 = n5 = n6 = n7 = vzero(nsum[0])
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero(nsum[0])
    for j in range(nb):
        v = vload(vp[cols[j]], e)
        av = vabs(v)
        if use[0, j]:
            n0, a0 = vfma(wts[0, j], v, n0), vfma(wts[0, j], av, a0)
        if use[1, j]:
            n1, a1 = vfma(wts[1, j], v, n1), vfma(wts[1, j], av, a1)
        if use[2, j]:
            n2, a2 = vfma(wts[2, j], v, n2), vfma(wts[2, j], av, a2)
        if use[3, j]:
            n3, a3 = vfma(wts[3, j], v, n3), vfma(wts[3, j], av, a3)
        if use[4, j]:
            n4, a4 = vfma(wts[4, j], v, n4), vfma(wts[4, j], av, a4)
        if use[5, j]:
            n5, a5 = vfma(wts[5, j], v, n5), vfma(wts[5, j], av, a5)
        if use[6, j]:
            n6, a6 = vfma(wts[6, j], v, n6), vfma(wts[6, j], av, a6)
        if use[7, j]:
            n7, a7 = vfma(wts[7, j], v, n7), vfma(wts[7, j], av, a7)
    _add_lanes(nsum, e, (n0, n1, n2, n3, n4, n5, n6, n7))
    _add_lanes(asum, e, (a0, a1, a2, a3, a4, a5, a6, a7))


@numba.jit(**_JIT)
def _add_lanes(total, e, parts):
    """``total[r, e:e + W] += parts[r]`` for the eight rows."""
    for r in numba.literal_unroll(range(8)):
        vstore(total[r], e, vadd(vload(total[r], e), parts[r]))


@numba.jit(**_JIT)
def weighted_rows(vp, cols, nb, nh, wts, use, nsum, asum):
    """:func:`weighted_block` (over the keys 0 <= j < nb of ``cols``) for the rows
    0 <= r < nh of ``wts``, ``use``, ``nsum``, ``asum``: eight, then four rows at a time
    sharing each value vector on the whole W-feature vectors, the rest row by row (the same
    bits)."""
    vdim = vp.shape[1]
    whole = vdim - vdim % W
    r = 0
    while r + 8 <= nh:
        acc = (nsum[r : r + 8], asum[r : r + 8])
        for e in range(0, whole, W):
            _weighted8(vp, cols, nb, wts[r : r + 8], use[r : r + 8], e, acc)
        if whole < vdim:
            for rr in range(r, r + 8):
                _weighted_tail(vp, cols, nb, wts[rr], use[rr], whole, nsum[rr], asum[rr])
        r += 8
    while r + 4 <= nh:
        acc = (nsum[r : r + 4], asum[r : r + 4])
        for e in range(0, whole, W):
            _weighted4(vp, cols, nb, wts[r : r + 4], use[r : r + 4], e, acc)
        if whole < vdim:
            for rr in range(r, r + 4):
                _weighted_tail(vp, cols, nb, wts[rr], use[rr], whole, nsum[rr], asum[rr])
        r += 4
    while r < nh:
        weighted_block(vp, cols, 0, nb, wts[r], use[r], nsum[r], asum[r])
        r += 1


@numba.jit(**_JIT)
def _sums1(vp, cols, j0, j1, wrow, use, e, nrow):
    """The N sums of :func:`sums_rows` for one row (``wrow``, ``use`` (>= j1,)) on the W
    features from e."""
    n0 = vzero(nrow)
    for j in range(j0, j1):
        if use[j]:
            n0 = vfma(wrow[j], vload(vp[cols[j]], e), n0)
    vstore(nrow, e, vadd(vload(nrow, e), n0))


@numba.jit(**_JIT)
def _msums16(vp, cols, wm, e, nsum):
    """``nsum[r, e:e + 2 W] +=`` the fma chains from +0 over the keys j < n of ``wm[r, j]
    vp[cols[j], e:e + 2 W]`` for the eight rows of ``wm`` (8, n) (each value vector loaded
    once for the eight rows, each weight once for the two vectors)."""
    n0 = n1 = n2 = n3 = n4 = n5 = n6 = n7 = vzero(nsum[0])
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = vzero(nsum[0])
    for j in range(cols.shape[0]):
        vrow = vp[cols[j]]
        v, u = vload(vrow, e), vload(vrow, e + W)
        w = wm[0, j]
        n0, m0 = vfma(w, v, n0), vfma(w, u, m0)
        w = wm[1, j]
        n1, m1 = vfma(w, v, n1), vfma(w, u, m1)
        w = wm[2, j]
        n2, m2 = vfma(w, v, n2), vfma(w, u, m2)
        w = wm[3, j]
        n3, m3 = vfma(w, v, n3), vfma(w, u, m3)
        w = wm[4, j]
        n4, m4 = vfma(w, v, n4), vfma(w, u, m4)
        w = wm[5, j]
        n5, m5 = vfma(w, v, n5), vfma(w, u, m5)
        w = wm[6, j]
        n6, m6 = vfma(w, v, n6), vfma(w, u, m6)
        w = wm[7, j]
        n7, m7 = vfma(w, v, n7), vfma(w, u, m7)
    _add_lanes(nsum, e, (n0, n1, n2, n3, n4, n5, n6, n7))
    _add_lanes(nsum, e + W, (m0, m1, m2, m3, m4, m5, m6, m7))


@numba.jit(**_JIT)
def _msums8(vp, cols, wm, e, nsum):
    """:func:`_msums16` on the W features from e alone."""
    n0 = n1 = n2 = n3 = n4 = n5 = n6 = n7 = vzero(nsum[0])
    for j in range(cols.shape[0]):
        v = vload(vp[cols[j]], e)
        n0, n1 = vfma(wm[0, j], v, n0), vfma(wm[1, j], v, n1)
        n2, n3 = vfma(wm[2, j], v, n2), vfma(wm[3, j], v, n3)
        n4, n5 = vfma(wm[4, j], v, n4), vfma(wm[5, j], v, n5)
        n6, n7 = vfma(wm[6, j], v, n6), vfma(wm[7, j], v, n7)
    _add_lanes(nsum, e, (n0, n1, n2, n3, n4, n5, n6, n7))


@numba.jit(**_JIT)
def sums_rows(vp, cols, j0, j1, nh, wts, use, nsum):
    """``nsum[r, e] += sum_j wts[r, j] vp[cols[j], e]`` over the keys j0 <= j < j1 with
    ``use[r, j]`` for the rows r < nh: the N sums of :func:`weighted_rows` without the
    magnitude sums (the same bits: each block sum an fma chain over j in order from +0, then
    added to the total), eight rows sharing each value vector.

    Eight rows at a time run branch-free on their weights with the unused ones set to +0,
    the same bits: for finite v (the values' range check) ``fma(+0, v, n) = n + (+-0)``
    equals n when n is nonzero, so a chain differs from the one that skips the key at most
    in the sign of a zero while it is zero (an fma with a nonzero product then gives the
    same value from either zero); the chain enters the total by one addition, and the total
    (from +0) is never -0 in round to nearest (x + y is -0 only when both are), so
    ``total + (+-0)`` is the same for either sign."""
    vdim = vp.shape[1]
    whole = vdim - vdim % W
    pairs = vdim - vdim % (2 * W)
    block = cols[j0:j1]
    wm = np.empty((8, j1 - j0))
    r = 0
    while r + 8 <= nh:
        for rr in range(8):
            for j in range(j0, j1):
                wm[rr, j - j0] = wts[r + rr, j] if use[r + rr, j] else 0.0
        for e in range(0, pairs, 2 * W):
            _msums16(vp, block, wm, e, nsum[r : r + 8])
        for e in range(pairs, whole, W):
            _msums8(vp, block, wm, e, nsum[r : r + 8])
        r += 8
    while r < nh:
        for e in range(0, whole, W):
            _sums1(vp, cols, j0, j1, wts[r], use[r], e, nsum[r])
        r += 1
    for rr in range(nh):
        for e in range(whole, vdim):
            n = 0.0
            for j in range(j0, j1):
                if use[rr, j]:
                    n = D.fma(wts[rr, j], vp[cols[j], e], n)
            nsum[rr, e] += n


@numba.jit(**_JIT)
def magnitude_sum(vp, cols, n, block, wrow, use, e):
    """``sum_j wrow[j] |vp[cols[j], e]|`` over the keys j < n with ``use[j]`` in the blocked
    sums of :func:`weighted_block` (``block`` keys per block, each an fma chain from +0, the
    block sums added in order from +0): the magnitude sum of one feature, its bits."""
    total = 0.0
    for j0 in range(0, n, block):
        a = 0.0
        for j in range(j0, min(j0 + block, n)):
            if use[j]:
                a = D.fma(wrow[j], abs(vp[cols[j], e]), a)
        total += a
    return total


@numba.jit(**_JIT)
def _weighted_tail(vp, cols, nb, wrow, use, e0, nrow, arow):
    """The scalar features e0 <= e < E of :func:`weighted_block` (keys 0 <= j < nb)."""
    for e in range(e0, vp.shape[1]):
        n = 0.0
        a = 0.0
        for j in range(nb):
            if use[j]:
                ve = vp[cols[j], e]
                n = D.fma(wrow[j], ve, n)
                a = D.fma(wrow[j], abs(ve), a)
        nrow[e] += n
        arow[e] += a


@numba.jit(**_JIT)
def _row_scale(row, bits):
    """(ok, g) of one widened row (``bits`` its int64 view): ok as in :func:`key_facts`, g the
    least exponent of the lowest set bit of a nonzero element (1 << 40 for a zero row), in a
    branch-free loop (a minimum and a conjunction: their order cannot change them)."""
    frac_mask = (1 << 52) - 1
    bad = 0
    low = 1 << 40
    for d in range(row.shape[0]):
        m = abs(row[d])
        bad |= not ((m == 0.0) | ((m >= D.SAFE_MIN) & (m <= D.SAFE_MAX)))
        w = bits[d]
        biased = (w >> 52) & 0x7FF
        mant = (w & frac_mask) | (np.int64(biased != 0) << 52)
        biased = max(biased, 1)  # subnormal: the same scale as the smallest normal
        e = biased - 1075 + _trailing_zeros(mant)
        low = min(low, e if m != 0.0 else 1 << 40)
    return bad == 0, low


@numba.jit(**_JIT)
def _key_block(src, used, c0, c1, kT, facts):
    """:func:`key_facts` for the listed keys c0 <= c < c1 (at most KEY_BLOCK): each widened
    into a row buffer (its range check and scale), the buffer transposed into ``kT[:,
    c0:c1]``, whose rows then carry the sums of squares side by side in the lanes of four
    vectors (each its own chain over d in order: the bits of the scalar loop, which a part
    block runs)."""
    norms, scales, ok = facts
    dim = src.shape[1]
    nk = c1 - c0
    rows = np.empty((KEY_BLOCK, dim))
    bits = rows.view(np.int64)
    low = np.empty(KEY_BLOCK, np.int64)
    for cc in range(nk):
        row = src[used[c0 + cc]]
        buf = rows[cc]
        for d in range(dim):
            buf[d] = row[d]
        ok[c0 + cc], low[cc] = _row_scale(buf, bits[cc])
    for d in range(dim):
        kd = kT[d]
        for cc in range(nk):
            kd[c0 + cc] = rows[cc, d]
    sums = np.zeros(KEY_BLOCK)
    if nk == KEY_BLOCK:
        a0 = a1 = a2 = a3 = vzero(sums)
        for d in range(dim):
            kd = kT[d]
            t0, t1 = vload(kd, c0), vload(kd, c0 + W)
            t2, t3 = vload(kd, c0 + 2 * W), vload(kd, c0 + 3 * W)
            a0, a1 = vadd(a0, vmul(t0, t0)), vadd(a1, vmul(t1, t1))
            a2, a3 = vadd(a2, vmul(t2, t2)), vadd(a3, vmul(t3, t3))
        vstore(sums, 0, a0)
        vstore(sums, W, a1)
        vstore(sums, 2 * W, a2)
        vstore(sums, 3 * W, a3)
    else:
        for cc in range(nk):
            for d in range(dim):
                a = rows[cc, d]
                sums[cc] += a * a
    for cc in range(nk):
        c = c0 + cc
        norms[c] = math.sqrt(sums[cc]) * (1.0 + 2.0**-30) + 2.0**-1000
        g = 0 if low[cc] == 1 << 40 else low[cc]  # a zero row: its products are all 0
        scales[c] = np.ldexp(norms[c], -g)


@numba.jit(**_JIT, parallel=True)
def key_facts(src, used, kT, norms, scales, ok):
    """The keys ``src[used[c]]`` (``src`` (S, D) float32 or float64, widened exactly) into
    the transposed table ``kT[:, c]`` with, per key, in the order of
    :func:`refattn.exact.fast.facts.row_facts` (the same bits): ``ok[c]`` (all
    finite, nonzero magnitudes in [SAFE_MIN, SAFE_MAX]), ``norms[c]`` (an upper bound of the
    2-norm) and ``scales[c]`` (the norm over 2 to the exponent of the lowest set bit of the
    row). In parallel over blocks of KEY_BLOCK keys (each key's arithmetic is its own)."""
    count = used.shape[0]
    for blk in prange((count + KEY_BLOCK - 1) // KEY_BLOCK):
        c0 = blk * KEY_BLOCK
        _key_block(src, used, c0, min(count, c0 + KEY_BLOCK), kT, (norms, scales, ok))


@numba.jit(**_JIT)
def value_rows(src, used, out, vmax):
    """``out[c] = src[used[c]]`` widened exactly to float64 (``src`` (S, E) float32 or
    float64), ``vmax[e] = max_c |out[c, e]|``; returns whether every value is zero or of a
    magnitude in [SAFE_MIN, SAFE_MAX] (NaN and Inf are not), in one pass."""
    good = True
    for e in range(vmax.shape[0]):
        vmax[e] = 0.0
    for c in range(used.shape[0]):
        row = src[used[c]]
        dst = out[c]
        bad = 0
        for e in range(row.shape[0]):  # branch-free: the loop vectorizes
            x = np.float64(row[e])
            dst[e] = x
            m = abs(x)
            bad |= not ((m == 0.0) | ((m >= D.SAFE_MIN) & (m <= D.SAFE_MAX)))
            vmax[e] = m if m > vmax[e] else vmax[e]
        if bad:
            good = False
    return good


@numba.jit(**_JIT)
def _source_panel(src, rows, cols, at, m, buf, panel, facts):
    """The m <= W keys ``src[rows[cols[c + l]]]`` (l < m; ``at`` = (c, o)) widened exactly to
    float64 into the lanes of the (D, W) ``panel`` (the other lanes +0); with ``facts`` =
    (ok, scales) not empty, each key's range check and exactness scale into ``ok[o + l]``,
    ``scales[o + l]``
    (the bits of :func:`key_facts`: the widened row's
    :func:`_row_scale`, its sum of squares a lane chain over d in order, then the norm and the
    scale as :func:`_key_block` forms them). ``buf`` (W, D) float64 holds the widened rows,
    transposed into the panel eight features at a time (:func:`transpose8`)."""
    c, o = at
    dim = panel.shape[0]
    want = facts[0].shape[0] > 0
    bits = buf.view(np.int64)
    low = np.empty(W, np.int64)
    good = np.ones(W, np.bool_)
    for cc in range(W):
        dst = buf[cc]
        if cc < m:
            row = src[rows[cols[c + cc]]]
            for d in range(dim):
                dst[d] = row[d]
            if want:
                good[cc], low[cc] = _row_scale(dst, bits[cc])
        else:
            for d in range(dim):
                dst[d] = 0.0
    whole = dim - dim % W
    for d0 in range(0, whole, W):
        transpose8(buf, d0, panel)
    for d in range(whole, dim):
        for cc in range(W):
            panel[d, cc] = buf[cc, d]
    if not want:
        return
    ok, scales = facts
    acc = vzero(panel[0])
    for d in range(dim):
        t = vload(panel[d], 0)
        acc = vadd(acc, vmul(t, t))
    sums = np.empty(W)
    vstore(sums, 0, acc)
    for cc in range(m):
        norm = math.sqrt(sums[cc]) * (1.0 + 2.0**-30) + 2.0**-1000
        g = 0 if low[cc] == 1 << 40 else low[cc]  # a zero row: its products are all 0
        ok[o + cc] = good[cc]
        scales[o + cc] = np.ldexp(norm, -g)


@numba.jit(**_JIT)
def source_dots(qh, src, rows, cols, block, s, sab, facts):
    """:func:`source_span` of all the listed keys ``cols`` (from column 0 of ``s``, ``sab``
    and ``facts``)."""
    source_span(qh, src, rows, cols, 0, block, s, sab, facts)


@numba.jit(**_JIT)
def source_span(qh, src, rows, cols, at, block, s, sab, facts):
    """:func:`dot_tiles` (the same bits) for every listed key: ``s[r, jj] = qh[r] .
    src[rows[cols[jj]]]`` and the magnitude sums ``sab[r, jj]`` for jj < n (``s``, ``sab``
    (>= R, n)), read from the kv-head plane's own rows ``src`` (S', D) (float32 or float64,
    widened exactly) W keys at a time into a (D, W) panel that every query row then reads:
    no float64 copy or transposed table of the gathered keys is formed. The last panel's
    missing keys are +0 lanes whose results are dropped (each lane's arithmetic is its own).
    With ``facts`` = (ok, scales) (empty: not asked) each key's range check and exactness
    scale are formed from the widened row in the same pass (:func:`_source_panel`). Key jj
    of ``cols`` goes to column ``at + jj`` of ``s``, ``sab``, ``ok`` and ``scales`` (a span
    of a plane's keys: each key's lane arithmetic is its own, so the spans' bits are those of
    one call over all the keys)."""
    nq = qh.shape[0]
    dim = qh.shape[1]
    n = cols.shape[0]
    full = np.ones(nq // 4, np.bool_)  # four rows without a zero feature: no test per feature
    for r in range(nq - nq % 4):
        for d in range(dim):
            if qh[r, d] == 0.0:
                full[r // 4] = False
    buf = np.empty((W, dim))
    panel = np.empty((dim, W))
    tile = np.zeros((4, W))
    tile_ab = np.zeros((4, W))
    for c in range(0, n, W):
        m = min(W, n - c)
        _source_panel(src, rows, cols, (c, at + c), m, buf, panel, facts)
        r = 0
        while r < nq:
            k = 4 if r + 4 <= nq else 1
            if k == 4 and full[r // 4]:
                _dots4_full(qh[r : r + 4], panel, 0, dim, block, tile, tile_ab)
            elif k == 4:
                _dots4(qh[r : r + 4], panel, 0, dim, block, tile, tile_ab)
            else:
                _dots1(qh[r], panel, 0, dim, block, tile[0], tile_ab[0])
            for rr in range(k):
                if m == W:
                    vstore(s[r + rr], at + c, vload(tile[rr], 0))
                    vstore(sab[r + rr], at + c, vload(tile_ab[rr], 0))
                else:
                    for cc in range(m):
                        s[r + rr, at + c + cc] = tile[rr, cc]
                        sab[r + rr, at + c + cc] = tile_ab[rr, cc]
            r += k


#: The public name of :func:`_source_panel` (the double-double step,
#: :mod:`refattn.exact.fast.gather_dd`, builds its panels with it).
source_panel = _source_panel
