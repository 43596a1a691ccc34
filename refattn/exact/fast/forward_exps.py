"""The exponentials and their sums of the dense double-precision step of the fast exact forward
(:func:`refattn.exact.fast.forward_kernels.forward_d`; :mod:`refattn.exact.fast.forward` states
the algorithm and its bounds), for rows whose every key is kept (no mask, bias or dropout):

* :func:`plain_exps` -- from the scores (t, radius) of a row held in the block's scratch;
* :func:`plain_row` -- from the row's dot products alone, when neither softcap nor ALiBi
  applies and the weights are not asked for: the score ``t = s scale_hi``, its radius and the
  shifted score are recomputed key by key from ``s`` and the keys' norms and exactness scales
  (one read of the row, no score or radius array written), the same values as
  :func:`refattn.exact.fast.dense_dots.plain_scores` followed by :func:`plain_exps`, so the
  same bits;
* :func:`exp_sums` -- their reductions by 64-byte vectors (rho's maximum, Z blocked, sum e^2).

The order of every sum is fixed by the row's key interval and its block's: by the shapes
alone, never by the thread count.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ...kernels._simd import as_float, lanes, vadd, vfmav, vload, vmax, vmuls, vsum, vtop, vzero
from . import doubledouble as D
from ._params import P_GAMMA_DIM, P_SCALE_ERR, P_SCALE_HI, P_SCALE_LO
from .dense_dots import EXACT_SCALE, mag_error
from .rounding_decision import float_bits

__all__ = [
    "CUT",
    "TINY",
    "SUM_BLOCK",
    "RHO_MAX",
    "plain_exps",
    "plain_row",
    "exp_sums",
    "cut_values",
]

#: Exponent arguments below CUT contribute ``0 <= e < TINY`` (an absolute radius).
CUT = -400.0
TINY = 2.0**-575  # > exp(-400 + 1): covers an argument error up to 1
assert math.log(TINY) > CUT + 1
#: Largest relative error of an exponential the first steps accept (rows above it go on).
RHO_MAX = 2.0**-20
#: Key block of the double-precision sums (blocked summation, Higham 2002, sec. 4.2).
SUM_BLOCK = 64

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")


@numba.jit(**_JIT)
def plain_exps(rr, r0, r1, lo, row, work, sums):
    """The exponentials of :func:`refattn.exact.fast.forward_kernels.forward_d` for row rr
    when all of its keys r0 <= jj < r1 are kept. One element-wise loop (it vectorises: its
    only reductions are on integers): the shifted scores x = t - top and their radii xe (kept
    in s and err), ``p = exp_d_core(x)`` (a key below CUT gets the argument CUT - 1, then
    e = 0, and is counted: TINY each, an exact sum of powers of two) and the largest xe of the
    keys above CUT, as the maximum of their bit patterns (nonnegative floats order as their
    bits; the start 0 is +0.0, so the result is at least 0: only an upper bound is used, and
    rho is monotone in it). Then one pass of 64-byte vectors (:func:`exp_sums`) for Z blocked
    and ``sum e^2``. ``row`` = (top, want_w) (the shifted scores are written either way),
    ``work`` = (s, err, p), ``sums`` = (z, e2, tiny, rho)."""
    top = row[0]
    s, err, p = work
    u = 1.01 * D.U
    srow, erow, prow = s[rr], err[rr], p[rr]
    cut = 0
    worst = np.int64(0)  # the bits of the largest xe above CUT (0: +0.0)
    for jj in range(r0, r1):
        x = srow[jj] - top
        xe = (erow[jj] + u * abs(x)) * D.BOUND_SAFETY
        srow[jj], erow[jj] = x, xe  # the shifted scores, kept for the weights
        above = x >= CUT
        e = D.exp_d_core(x if above else CUT - 1.0)  # CUT - 1 <= x <= 0: exp_d's domain
        prow[jj] = e if above else 0.0
        worst = max(worst, float_bits(xe) if above else np.int64(0))  # xe >= 0: its bits order it
        cut += 0 if above else 1
    close_row(rr, (r0, r1, lo), prow, cut, worst, sums)


@numba.jit(**_JIT)
def close_row(rr, span, prow, cut, worst, sums):
    """The end of row rr of :func:`plain_exps` and :func:`plain_row`: ``cut`` keys below CUT
    add TINY each, Z and ``sum e^2`` of the row's exponentials ``prow`` (``span`` = (r0, r1,
    lo)) by :func:`exp_sums`, and rho from ``worst``, the bits of the largest radius."""
    r0, r1, lo = span
    z, e2, tiny, rho = sums
    tiny[rr] += cut * TINY
    zr, sq = exp_sums(r0, r1, lo, prow, z[rr])
    rho[rr] = max(rho[rr], (D.EXP_D_REL + 2.0 * as_float(worst)) * (1.0 + RHO_MAX))
    z[rr] = zr
    e2[rr] += sq


@numba.jit(**_JIT)
def exp_sums(r0, r1, lo, prow, z0):
    """(z0 + the blocked sum of prow, sum of prow^2) over the entries r0 <= jj < r1 (key j =
    lo + jj) by 64-byte vectors of W lanes (:mod:`refattn.kernels._simd`): each SUM_BLOCK
    block of the key index j is summed from +0 -- its keys before the first j = 0 mod W in
    order, then the lanes (lane l: the keys j = l mod W) over the whole vectors, the lanes
    added in order (``vsum``) and added on, then the block's last keys in order -- and added
    to Z: each term meets at most SUM_BLOCK additions inside its block, so the bound
    ``gamma_{B + S/B}`` of the blocked sums holds (Higham 2002, sec. 4.2: eq. (4.4) holds for
    every order of summation); ``sum e^2`` lane-wise by fma, then the lanes and the leftover
    keys: its bound ``gamma_S`` holds for every order as well. The order is fixed by the
    row's key interval alone (each key's lane is j mod W): neither by the rows it is blocked
    with nor by the thread count."""
    width = lanes(prow)
    sqv = vzero(prow)
    sq = 0.0
    zr = z0
    jj = r0
    while jj < r1:
        stop = min(r1, ((lo + jj) // SUM_BLOCK + 1) * SUM_BLOCK - lo)
        acc = vzero(prow)
        k = jj
        zb = 0.0
        while k < stop and (lo + k) % width != 0:  # up to the first key j = 0 mod W
            e = prow[k]
            zb += e
            sq = D.fma(e, e, sq)
            k += 1
        while k + width <= stop:
            e = vload(prow, k)
            acc = vadd(acc, e)
            sqv = vfmav(e, e, sqv)
            k += width
        zb += vsum(acc)
        while k < stop:
            e = prow[k]
            zb += e
            sq = D.fma(e, e, sq)
            k += 1
        zr += zb  # the block's sum added to Z (+0 + zb exact at the first block when z0 = 0)
        jj = stop
    return zr, sq + vsum(sqv)


@numba.jit(**_JIT)
def cut_values(rr, r0, r1, lo, s, vp, tiny_v):
    """tiny_v[rr, e] += |v_je| for row rr's keys below CUT (all kept; s holds x itself)."""
    for jj in range(r0, r1):
        if s[rr, jj] < CUT:
            for e in range(tiny_v.shape[1]):
                tiny_v[rr, e] += abs(vp[lo + jj, e])


@numba.jit(**_JIT)
def plain_row(rr, r0, r1, lo, row, keys, pr, work, sums):
    """:func:`plain_exps` of row rr straight from its dot products ``s[rr, r0:r1]`` (left in
    place; the entries of the keys lo + r0 .. lo + r1 - 1), every key kept, no softcap or
    ALiBi, the weights not asked for. ``row`` = (qn_i, qs_i, sink or -inf), ``keys`` = (kn,
    ks of the plane, mag, D, whether every chain of the block is exact: then one loop without
    the keys' facts, the same values), ``work`` = (s, sab, p) (``sab`` the magnitude sums when
    ``mag``, else unread), ``sums`` = (z, e2, tiny, rho). Per key, the score and its radius of
    :func:`refattn.exact.fast.dense_dots.plain_scores` (``t = s scale_hi``; the dot product's
    bound zero where the chain is exact, else ``u sab`` by :func:`mag_error` or ``gamma_D
    ||q_i|| ||k_j||``), the maximum ``top`` of the t (and the sink) by 64-byte vectors, then
    x = t - top, its radius, the exponential and the sums exactly as :func:`plain_exps`:
    the same operations on the same values, so the same bits. Returns top (-inf for an empty
    row without a sink)."""
    qn_i, qs_i, sink = row
    knp, ksp, mag, dim, exact = keys
    s, sab, p = work
    scale_hi = pr[P_SCALE_HI]
    c1, c2 = abs(scale_hi), abs(pr[P_SCALE_LO]) + pr[P_SCALE_ERR]
    gdim = pr[P_GAMMA_DIM]
    u = 1.01 * D.U
    srow, arow, prow = s[rr], sab[rr], p[rr]
    width = lanes(srow)
    top = -np.inf
    k = r0
    if r1 - r0 >= width:  # the maximum of the t = fl(s scale_hi): exact, in any order
        best = vmuls(vload(srow, k), scale_hi)
        k += width
        while k + width <= r1:
            best = vmax(best, vmuls(vload(srow, k), scale_hi))
            k += width
        top = vtop(best)
    while k < r1:
        top = max(top, srow[k] * scale_hi)
        k += 1
    top = max(top, sink)
    if top == -np.inf:
        return top
    cut = 0
    worst = np.int64(0)  # the bits of the largest xe above CUT (0: +0.0)
    if exact:  # every chain of the block exact (block_exact): derr = 0, no key facts read
        for jj in range(r0, r1):
            sj = srow[jj]
            t = sj * scale_hi
            x = t - top
            xe = ((c1 * 0.0 + (abs(sj) + 0.0) * c2 + u * abs(t)) + u * abs(x)) * D.BOUND_SAFETY
            above = x >= CUT
            e = D.exp_d_core(x if above else CUT - 1.0)  # CUT - 1 <= x <= 0: exp_d's domain
            prow[jj] = e if above else 0.0
            worst = max(
                worst, float_bits(xe) if above else np.int64(0)
            )  # xe >= 0: its bits order it
            cut += 0 if above else 1
    for jj in range(r0, r1 if not exact else r0):
        j = lo + jj
        sj = srow[jj]
        derr = 0.0  # an fma chain proven exact (exactness_scales) carries no error
        if not qs_i * ksp[j] < EXACT_SCALE:
            derr = mag_error(arow[jj], dim) if mag else gdim * qn_i * knp[j]
        t = sj * scale_hi
        x = t - top
        xe = ((c1 * derr + (abs(sj) + derr) * c2 + u * abs(t)) + u * abs(x)) * D.BOUND_SAFETY
        above = x >= CUT
        e = D.exp_d_core(x if above else CUT - 1.0)  # CUT - 1 <= x <= 0: exp_d's domain
        prow[jj] = e if above else 0.0
        worst = max(worst, float_bits(xe) if above else np.int64(0))  # xe >= 0: its bits order it
        cut += 0 if above else 1
    close_row(rr, (r0, r1, lo), prow, cut, worst, sums)
    return top
