"""The dot products and plain scores of the dense double-precision step of the fast exact
forward (:func:`refattn.exact.fast.forward_kernels.forward_d`; :mod:`refattn.exact.fast.forward`
states the algorithm and its bounds).

A block of query rows against the keys of the union of their intervals, two ways:

* :func:`block_dots`: one fma chain over D per (row, key), d = 0 .. D-1 from +0, on the
  register tiles of :func:`refattn.kernels._cpu_tiles.matmul_t` -- used where
  :func:`block_exact` proves every chain of the block exact (float16/bfloat16 inputs of
  moderate range: no rounding at all, a zero error bound);
* :func:`block_dots_mag`: fma chains over blocks of :data:`MAG_BLOCK` features whose block sums
  are added in order, with the float sum ``sab`` of the magnitudes of every rounded result
  (:func:`refattn.exact.fast.gather_lanes.dot_tiles`, lane-wise). Each rounding errs by at most
  ``u`` times its result's magnitude (Higham 2002, eq. (2.5) and the running error bound of
  sec. 3.1 / eq. (4.3)'s form), so ``|s - q_i . k_j| <= u sab`` up to sab's own rounding and
  underflow (:func:`mag_error`): for random data about ``u sqrt(B) D |q_i|.|k_j| / D`` against
  the a-priori ``gamma_D ||q_i|| ||k_j||`` of Higham 2002, eq. (3.5) -- some 4 bits tighter at
  D = 64, 128.

:func:`plain_scores` turns them into scores (t, radius) when every key of the rows'
intervals is kept and there is no softcap or ALiBi. Each row's arithmetic is fixed by the
shapes alone (which rows share a block changes no bit; :func:`block_exact` only chooses
between two bounds of which the kept one is rigorous either way).
"""

from __future__ import annotations

import numba
import numpy as np

from ...kernels._cpu_tiles import matmul_t
from ...kernels._simd import lanes, vload, vmax, vtop
from . import doubledouble as D
from ._params import P_GAMMA_DIM, P_SCALE_ERR, P_SCALE_HI, P_SCALE_LO
from .gather_lanes import dot_tiles

__all__ = [
    "KEY_TILE",
    "DOT_CHUNK",
    "MAG_BLOCK",
    "block_interval",
    "rows_interval",
    "block_exact",
    "block_dots",
    "block_dots_mag",
    "block_dots_unpadded",
    "mag_error",
    "plain_scores",
    "row_max",
]

#: Keys per register tile of the double-precision step's dot products (four 64-byte vectors
#: of float64): its key count is padded to a multiple of this, and K^T carries this many zero
#: keys past S (and V zero features up to a multiple of it), so every tile load is in bounds.
KEY_TILE = 32
#: Keys per chunk of the double-precision step's dot products (a multiple of KEY_TILE).
DOT_CHUNK = 256
#: Features per fma chain of :func:`block_dots_mag` (the chains' sums are then added in order).
MAG_BLOCK = 32
#: An fma chain with ``qs_i ks_j`` below this is exact (:func:`refattn.exact.fast.forward.
#: exactness_scales`).
EXACT_SCALE = 2.0**52

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")


@numba.jit(**_JIT)
def block_interval(rows_lo, rows_hi, b, i0, nb_rows):
    """The union [lo, hi) of the key intervals of rows i0 .. i0 + nb_rows - 1 of batch row b."""
    lo = rows_lo[b, i0]
    hi = rows_hi[b, i0]
    for rr in range(1, nb_rows):
        lo = min(lo, rows_lo[b, i0 + rr])
        hi = max(hi, rows_hi[b, i0 + rr])
    return lo, hi


@numba.jit(**_JIT)
def rows_interval(rows_lo, rows_hi, b, ids):
    """The union [lo, hi) of the key intervals of the rows ``ids`` (nonempty) of batch row b."""
    lo = rows_lo[b, ids[0]]
    hi = rows_hi[b, ids[0]]
    for rr in range(1, ids.shape[0]):
        lo = min(lo, rows_lo[b, ids[rr]])
        hi = max(hi, rows_hi[b, ids[rr]])
    return lo, hi


@numba.jit(**_JIT)
def block_dots(qp, kTp, ids, nb_rows, lo, npad, s, qa):
    """s[rr, j - lo] = q_{ids[rr]} . k_j for lo <= j < lo + npad by one fma chain over D each,
    d = 0 .. D-1 in order from +0 (``qp`` the plane's (L, D) queries, ``kTp`` its (D, S + pad)
    keys, zero past S; ``npad`` a multiple of :data:`KEY_TILE`; ``qa`` (D, D_ROW_BLOCK) scratch
    for the rows' transpose): the register tiles of
    :func:`refattn.kernels._cpu_tiles.matmul_t` (lanes over keys, D sequential)."""
    dim = qp.shape[1]
    for rr in range(nb_rows):
        for d in range(dim):
            qa[d, rr] = qp[ids[rr], d]
    for c in range(0, npad, DOT_CHUNK):  # a chunk of K^T stays in cache for all the rows
        cols = min(DOT_CHUNK, npad - c)
        matmul_t(qa, kTp[:, lo + c : lo + c + cols], dim, nb_rows, cols, s[:, c:], True)


@numba.jit(**_JIT)
def block_dots_unpadded(qp, kTp, ids, nb_rows, lo, hi, s):
    """s[rr, j - lo] = q_{ids[rr]} . k_j for lo <= j < hi by one fma chain over D each, d = 0
    .. D-1 in order from +0 (``qp`` the plane's (L, D) queries, ``kTp`` its (D, S) keys, no
    padding): :func:`block_dots`'s chains, key by key."""
    n = max(hi - lo, 0)
    for d in range(qp.shape[1]):
        row = kTp[d, lo:hi]  # a slice: the loop below then vectorizes
        for rr in range(nb_rows):
            a = qp[ids[rr], d]
            srow = s[rr]
            for jj in range(n):
                srow[jj] = D.fma(a, row[jj], srow[jj])


@numba.jit(**_JIT)
def block_exact(qs_rows, ks, ids, nb_rows, lo, hi):
    """Whether ``qs_i ks_j < 2**52`` for every row i of ``ids[:nb_rows]`` and key lo <= j < hi
    (every fma chain of the block exact): the largest scales' rounded product is below it
    (rounding is monotone, so each pair's rounded product is too)."""
    qmax = 0.0
    for rr in range(nb_rows):
        qmax = max(qmax, qs_rows[ids[rr]])
    kmax = 0.0
    for j in range(lo, hi):
        kmax = max(kmax, ks[j])
    return qmax * kmax < EXACT_SCALE


@numba.jit(**_JIT)
def block_dots_mag(qp, kTp, ids, nb_rows, lo, npad, s, sab):
    """s[rr, j - lo] = q_{ids[rr]} . k_j for lo <= j < lo + npad and sab[rr, j - lo] the sum of
    the magnitudes of its rounded partial results: fma chains over blocks of MAG_BLOCK features
    (a zero q feature skipped: fma(0, k, p) = p, no rounding), the block sums added in order
    (``qp`` the plane's (L, D) queries, ``kTp`` its (D, S + pad) keys, zero past S; ``npad`` a
    multiple of :data:`KEY_TILE`)."""
    qh = np.empty((nb_rows, qp.shape[1]))  # the rows, contiguous
    for rr in range(nb_rows):
        qh[rr] = qp[ids[rr]]
    dot_tiles(qh, kTp[:, lo:], npad, MAG_BLOCK, s, sab)


@numba.jit(**_JIT)
def mag_error(sab, dim):
    """A rigorous bound of the error of a :func:`block_dots_mag` dot product from its float
    magnitude sum ``sab``: ``u sab_exact`` with ``sab_exact <= sab (1 + 4 n u)`` (a float sum of
    n <= D + 2 (D / MAG_BLOCK + 1) + 4 nonnegative terms errs by at most gamma_n, Higham 2002,
    eq. (3.5), and 1 / (1 - gamma_n) <= 1 + 4 n u), the two products' roundings covered by
    BOUND_SAFETY, plus 2**-1074 per rounding for results in the subnormal range (at most
    D + D / MAG_BLOCK + 1 roundings, and one for ``u sab``)."""
    n = dim + 2 * (dim // MAG_BLOCK + 1) + 4
    rel = 4.0 * n * D.U
    return (D.U * sab) * (1.0 + rel) * D.BOUND_SAFETY + (dim + dim // MAG_BLOCK + 4) * 2.0**-1074


@numba.jit(**_JIT)
def row_max(row, r0, r1):
    """max(row[r0:r1]) (-inf when empty; no NaN in row) by 64-byte vectors of W lanes, then
    the last entries: a maximum is exact and needs no order."""
    width = lanes(row)
    m = -np.inf
    k = r0
    if r1 - r0 >= width:
        best = vload(row, k)
        k += width
        while k + width <= r1:
            best = vmax(best, vload(row, k))
            k += width
        m = vtop(best)
    while k < r1:
        m = max(m, row[k])
        k += 1
    return m


@numba.jit(**_JIT)
def plain_scores(ids, nb_rows, lo, rows, pr, keys, work):
    """The scores of :func:`refattn.exact.fast.forward_kernels.block_scores` without mask,
    bias, dropout, softcap or ALiBi (every key of a row's interval kept): the same score and
    radius as :func:`refattn.exact.fast.forward_kernels.score_d` in one tight loop per row.
    ``rows`` = (rows_lo, rows_hi, qn, qs of the batch row / plane), ``keys`` = (kn, ks, mag,
    D): with ``mag`` the dot products' error bounds come from their magnitude sums, held in
    ``err`` on entry (:func:`block_dots_mag`, :func:`mag_error`), else from ``gamma_D ||q_i||
    ||k_j||``; zero where the chain is proven exact (``qs_i ks_j < 2**52``). The loops over
    the keys hold no reduction (they vectorise); each row's maximum follows by
    :func:`row_max`."""
    rows_lo, rows_hi, qn, qs = rows
    knp, ksp, mag, dim = keys
    s, err, state, _, top, _ = work
    scale_hi, scale_lo, scale_err, gdim = (
        pr[P_SCALE_HI],
        pr[P_SCALE_LO],
        pr[P_SCALE_ERR],
        pr[P_GAMMA_DIM],
    )
    u = 1.01 * D.U
    c1 = abs(scale_hi)
    c2 = abs(scale_lo) + scale_err
    for rr in range(nb_rows):
        i = ids[rr]
        qn_i, qs_i = qn[i], qs[i]
        srow, erow, strow = s[rr], err[rr], state[rr]
        m = top[rr]
        r0, r1 = rows_lo[i] - lo, rows_hi[i] - lo
        if mag:
            for jj in range(r0, r1):
                j = lo + jj
                exact = qs_i * ksp[j] < EXACT_SCALE
                derr = 0.0 if exact else mag_error(erow[jj], dim)
                sj = srow[jj]
                t = sj * scale_hi
                erow[jj] = c1 * derr + (abs(sj) + derr) * c2 + u * abs(t)
                srow[jj] = t
                strow[jj] = 2
        else:
            for jj in range(r0, r1):
                j = lo + jj
                # an fma chain proven exact (exactness_scales) carries no error
                gd = 0.0 if qs_i * ksp[j] < EXACT_SCALE else gdim
                sj = srow[jj]
                derr = gd * qn_i * knp[j]
                t = sj * scale_hi
                erow[jj] = c1 * derr + (abs(sj) + derr) * c2 + u * abs(t)
                srow[jj] = t
                strow[jj] = 2
        top[rr] = max(m, row_max(srow, r0, r1))
