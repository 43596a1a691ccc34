"""The dense double-precision first step of the exact sigmoid-attention forward
(``normalizer="sigmoid"``, targets of at most 24 bits, no weights): blocks of
:data:`~refattn.exact.fast.forward_kernels.D_ROW_BLOCK` query rows on the register tiles of the
softmax engine's dense step, rows it cannot decide left to the double-double step
(:func:`refattn.exact.fast.sigmoid_kernels.sigmoid_dd`).

Per query row i of plane (b, h), over the keys ``lo_i <= j < hi_i`` of its interval:

1. Scores ``t^_ij`` with an absolute bound ``delta_ij`` exactly as the softmax engine's dense
   step computes them (:func:`refattn.exact.fast.forward_kernels._block_scores_d` with padded
   K^T: one fma chain over D per (row, key) on the tiles of
   :func:`refattn.kernels._cpu_tiles.matmul_t`, the a-priori ``gamma_D ||q_i|| ||k_j||``
   bound of Higham 2002, eq. (3.5), zero where the chain is proven exact). A row with some
   ``delta > 2**-20`` or a bias out of range is left undecided.
2. Weights (Ramapuram et al. 2024, eq. (2): ``w = sigma(t) = 1 / (1 + e^{-t})``). With
   ``e^ = exp_d_core(-|t^|)`` (the project's own exponential,
   :func:`refattn.exact.fast.doubledouble.exp_d_core`, relative error at most ``EXP_D_REL``
   against ``e^{-|t^|}``, proven in :mod:`refattn.exact.fast.doubledouble`, no libm claim)
   and ``||t^| - |t|| <= delta``: ``e^ = e^{-|t|} (1 + eps_1)``,
   ``|eps_1| <= rho_e = (EXP_D_REL + 2 delta)(1 + 2**-20)`` (``|e^d - 1| <= 2|d|`` for
   ``|d| <= 1``, the product of the two factors' deviations inside the ``2**-20``).
   ``d^ = fl(1 + e^)`` errs relatively by at most ``rho_e e / (1 + e) + u <= rho_e + u``;
   ``w^ = fl(1 / d^)`` (``t^ >= 0``) or ``fl(e^ / d^)`` (``t^ < 0``) then gives
   ``|w^ - w| <= rho w`` with ``rho = (2 rho_e + 3 u)(1 + 2**-18)`` (both forms equal
   sigma(t) for either sign of t, so a sign flip of t within delta changes nothing). For
   ``|t^| > 400`` no exponential counts: ``w^ = 0`` (``t^ < 0``) or 1, within ``TINY >
   e^{-399}`` of w, an absolute radius. The exponentials of a row run in one branch-free loop
   (arguments clamped to [-400, 0], in exp_d's domain).
3. Sums. ``N_e = sum_j w^_j v_je`` blocked: one fma chain per SUM_BLOCK keys (j in increasing
   order, blocks cut at multiples of SUM_BLOCK of j) added in order
   (:func:`refattn.exact.fast.forward_kernels.d_values`), so ``|N^ - sum w^ v| <= gamma_m
   A^_e`` with ``m = SUM_BLOCK + n / SUM_BLOCK + 4`` and ``A^_e = sum_j w^_j |v_je|``, which
   the same blocked sums give from |V| as ``a_e`` with ``A^_e <= a_e (1 + 1.01 gamma_m)``
   (nonnegative terms). With the weights' error:
   ``|N^ - N_e| <= (gamma_m + rho) a_e (1 + rho)(1 + 1.01 gamma_m)(1 + 2**-50) + TINY
   sum_far |v_je|``.
4. ``out = N^ keep_scale`` (keep_scale ``keep_hi + keep_lo +- keep_err``) with radius
   ``r_N |keep_hi| + (|N^| + r_N)(|keep_lo| + keep_err) + u |out|``, then the rounding
   decision (:func:`refattn.exact.fast.rounding_decision.decide_one`).

Each row's arithmetic is fixed by the shapes alone (which rows share a block changes no bit),
so no bit depends on the thread count; the results are rounded once from a rigorous
enclosure, so they are the exact values rounded, as the other steps give.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from . import doubledouble as D
from ._params import P_KEEP_ERR, P_KEEP_HI, P_KEEP_LO, R_ROWS_HI, R_ROWS_LO
from .dense_dots import rows_interval
from .forward_exps import SUM_BLOCK
from .forward_kernels import (
    D_ROW_BLOCK,
    EMPTY,
    OK,
    UNDECIDED,
    block_rows,
    block_scores_d,
    d_values,
)
from .rounding_decision import decide_one

__all__ = ["sigmoid_dense", "FAR", "TINY"]

#: Scores with ``|t^| > FAR`` take no exponential: their weight is within TINY of 0 or 1.
FAR = 400.0
TINY = 2.0**-575  # > exp(-FAR + 1): covers a score error up to 1
_DELTA_MAX = 2.0**-20
_U = 1.01 * D.U
_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")


@numba.jit(**_JIT)
def _rel(delta):
    """The relative bound rho of a weight whose score errs by at most ``delta`` (module
    docstring, 2); increasing in delta."""
    rho_e = (D.EXP_D_REL + 2.0 * delta) * (1.0 + _DELTA_MAX)
    return (2.0 * rho_e + 3.0 * D.U) * (1.0 + 2.0**-18)


@numba.jit(**_JIT)
def _weights_row(rr, r0, r1, work, scratch):
    """Weights of row rr's keys r0 <= jj < r1 in place of its scores (module docstring, 2):
    0 where the key is not kept (state != 2), state 3 for a far kept key. Returns (the largest
    score bound of the kept keys, the number of far kept keys)."""
    s, err, state = work
    xs, ex = scratch
    srow, erow, strow = s[rr], err[rr], state[rr]
    dmax = 0.0
    nfar = 0
    for jj in range(r0, r1):
        if strow[jj] == 2:
            dmax = max(dmax, erow[jj])
            if abs(srow[jj]) > FAR:
                strow[jj] = 3
                nfar += 1
    for jj in range(r0, r1):
        xs[jj] = max(-abs(srow[jj]), -FAR)
    for jj in range(r0, r1):  # branch-free: the loop vectorises
        ex[jj] = D.exp_d_core(xs[jj])
    for jj in range(r0, r1):
        t = srow[jj]
        e = ex[jj]
        w = (1.0 if t >= 0.0 else e) / (1.0 + e)  # one division: 1 / d or e / d
        w = 1.0 if t > FAR else w
        w = 0.0 if t < -FAR else w
        srow[jj] = w if strow[jj] >= 2 else 0.0
    return dmax, nfar


@numba.jit(**_JIT)
def _finish_row(index, n, facts, sums, pr, target, out):
    """out = N keep_scale with its radius (module docstring, 3-4), rounded to the target;
    ``facts`` = (rho, enclosure array or a dummy); ``sums`` = (N, a, far |v| sums) of the row.
    Returns whether every element is decided."""
    b, h, i = index
    rho, enclosure = facts
    nsum, asum, far = sums
    _, want_enclosure, p, emin, maxf = target
    terms = SUM_BLOCK + n // SUM_BLOCK + 4
    gam = 1.01 * terms * D.U / (1.0 - terms * D.U)
    grow = (1.0 + rho) * (1.0 + gam) * (1.0 + 2.0**-50)
    keep_hi = pr[P_KEEP_HI]
    keep_tail = abs(pr[P_KEEP_LO]) + pr[P_KEEP_ERR]
    ok = True
    for e in range(out.shape[3]):
        nr = ((gam + rho) * asum[e] * grow + TINY * far[e]) * D.BOUND_SAFETY
        o = nsum[e] * keep_hi
        rad = nr * abs(keep_hi) + (abs(nsum[e]) + nr) * keep_tail + D.U * abs(o)
        rad = rad * (1.0 + 2.0**-40) * D.BOUND_SAFETY
        if want_enclosure:
            enclosure[b, h, i, e, 0] = o
            enclosure[b, h, i, e, 1] = 0.0
            enclosure[b, h, i, e, 2] = rad
        value, dec = decide_one(o, 0.0, rad, p, emin, maxf)
        out[b, h, i, e] = value
        ok = ok and dec
    return ok


@numba.jit(**_JIT)
def _dense_block(b, h, ids, inputs, vabs, rule, target, results, scratch, redo):
    """The dense step (module docstring) of the rows ``ids`` (ascending) of plane (b, h), which
    share each load of K^T and V; sets each row's status (OK, EMPTY, or UNDECIDED).
    ``inputs``, ``vabs``, ``redo``: those of :func:`sigmoid_dense`."""
    v, prm, kvh = inputs[2], inputs[9], inputs[10]
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    out, status = results[0], results[2]
    s, err, state, xs, ex, qa, nsum, asum, nb = scratch
    nb_rows = ids.shape[0]
    g = kvh[h]
    lo, hi = rows_interval(rows_lo, rows_hi, b, ids)
    hi = max(hi, lo)
    bad = np.zeros(D_ROW_BLOCK, np.bool_)
    top = np.full(D_ROW_BLOCK, -np.inf)
    work = (s, err, state, bad, top, qa)
    mag, _, bias, _ = redo
    block_scores_d(b, h, ids, nb_rows, (lo, hi), inputs, rule, work, mag)
    if bias != 0.0:  # the constant bias the rule leaves out: t = fl(t + b), err + u |t|
        for rr in range(nb_rows):
            i = ids[rr]
            srow, erow = s[rr], err[rr]
            for jj in range(rows_lo[b, i] - lo, rows_hi[b, i] - lo):
                t = srow[jj] + bias
                srow[jj] = t
                erow[jj] += _U * abs(t)
    vdim = out.shape[3]
    far = np.zeros((D_ROW_BLOCK, vdim))
    rho = np.zeros(D_ROW_BLOCK)
    usable = np.ones(D_ROW_BLOCK, np.bool_)
    for rr in range(nb_rows):
        i = ids[rr]
        r0, r1 = rows_lo[b, i] - lo, rows_hi[b, i] - lo
        s[rr, :r0] = 0.0
        s[rr, r1 : hi - lo] = 0.0
        dmax, nfar = _weights_row(rr, r0, r1, (s, err, state), (xs, ex))
        usable[rr] = dmax <= _DELTA_MAX
        rho[rr] = _rel(dmax)
        if nfar > 0:
            for jj in range(r0, r1):
                if state[rr, jj] == 3:
                    for e in range(vdim):
                        far[rr, e] += abs(v[b, g, lo + jj, e])
    d_values(lo, hi, nb_rows, s, v[b, g], (nsum, nb))
    d_values(lo, hi, nb_rows, s, vabs[b, g], (asum, nb))
    for rr in range(nb_rows):
        i = ids[rr]
        if bad[rr] or not usable[rr]:
            status[b, h, i] = UNDECIDED
            continue
        if top[rr] == -np.inf:
            status[b, h, i] = EMPTY
            continue
        facts = (rho[rr], results[3])
        sums = (nsum[rr], asum[rr], far[rr])
        ok = _finish_row((b, h, i), hi - lo, facts, sums, prm[b, h], target, out)
        status[b, h, i] = OK if ok else UNDECIDED


@numba.jit(**_JIT)
def _scratch(inputs):
    """Scratch of :func:`_dense_block` for any block of the call: (s, err, state) (D_ROW_BLOCK,
    S + KEY_TILE), (xs, ex) (S + KEY_TILE,), qa (D, D_ROW_BLOCK), (nsum, asum, nb)
    (D_ROW_BLOCK, E padded)."""
    q, kT, v = inputs[0], inputs[1], inputs[2]
    keys = kT.shape[3]
    epad = v.shape[3]
    return (
        np.zeros((D_ROW_BLOCK, keys)),
        np.zeros((D_ROW_BLOCK, keys)),
        np.zeros((D_ROW_BLOCK, keys), np.int8),
        np.zeros(keys),
        np.zeros(keys),
        np.zeros((q.shape[3], D_ROW_BLOCK)),
        np.zeros((D_ROW_BLOCK, epad)),
        np.zeros((D_ROW_BLOCK, epad)),
        np.zeros((D_ROW_BLOCK, epad)),
    )


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def sigmoid_dense(blocks, inputs, vabs, rule, target, results, redo):
    """The dense double-precision first step (targets of at most 24 bits, no weights) over
    ``blocks`` ((n, 4): b, h, first row, rows <= D_ROW_BLOCK), in parallel over blocks (worker
    w takes blocks w, w + workers, ...; one scratch each). ``inputs`` = the softmax dense
    step's record (:func:`refattn.exact.fast.forward_kernels.forward_d`: q, K^T with KEY_TILE
    zero keys past S, V with zero features up to a multiple of KEY_TILE, qn, kn, qs, ks, vmax,
    vnorm, prm, kv_head); ``vabs`` = |V| (B, K, S, E padded); ``rule``, ``target`` and
    ``results`` are those of
    :func:`refattn.exact.fast.sigmoid_kernels.sigmoid_dd` (out holds E features). ``redo`` =
    (mag, row list, bias, workers): the first pass (mag False, an empty list) takes
    consecutive rows and the a-priori dot-product bounds; the second (mag True) takes the rows
    the first left undecided, a block's third column the offset of its rows in the (int64)
    list (ascending rows of its plane), with the dot products' bounds from their magnitude
    sums (:func:`refattn.exact.fast.dense_dots.block_dots_mag`, some 4 bits tighter).
    ``bias``: 0, or a constant finite bias in the first steps' range that ``rule`` then leaves
    out (``has_bias`` False: the all-kept tight loops of the scores), added to every score of
    the row intervals with its rounding bounded as the rule's bias is (``u |t|``).
    ``workers``: how many scratch sets (one per worker, 3 D_ROW_BLOCK (S + KEY_TILE) floats
    each: a few per thread, as fresh large allocations fault their pages in anew on every
    call); no bit depends on it. Rows left
    undecided run the double-double step next."""
    count = blocks.shape[0]
    workers = max(min(count, redo[3]), 1)
    for w in prange(workers):
        scratch = _scratch(inputs)
        for r in range(w, count, workers):
            b, h, ids, _ = block_rows(blocks, r, redo[1])
            _dense_block(b, h, ids, inputs, vabs, rule, target, results, scratch, redo)
