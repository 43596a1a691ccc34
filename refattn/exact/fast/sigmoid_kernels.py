"""The compiled first step of the exact sigmoid-attention forward (``normalizer="sigmoid"``):
double-double enclosures of every output element (and weight) with a rigorous radius,
rounded to the target where the radius allows (:mod:`refattn.exact.fast.sigmoid` is the host
side; the rows it leaves go to the referee, :mod:`refattn.exact.attention_sigmoid`).

Per query row i of plane (b, h), over the keys ``lo_i <= j < hi_i`` of its structural interval
(the allowed set read on the fly, :func:`~refattn.exact.fast.allowed_set.key_state`):

1. Scores. ``t_ij`` as a double-double ``t^`` with an absolute bound ``delta_ij``, exactly as
   the softmax first step computes them (:func:`~refattn.exact.fast.forward_kernels.score_dd`:
   Dot2 products, scale, softcap, bias, ALiBi); rows with ``delta > 2**-20`` go to the
   referee.
2. Weights (Ramapuram et al. 2024, eq. (2): ``w = sigma(t) = 1 / (1 + e^{-t})``). With
   ``a = -|t^|`` and ``e^ = exp_dd_fast(a)`` (relative error ``EXP_FAST_REL``,
   :mod:`~refattn.exact.fast.doubledouble`), ``e^ = e^{-|t|} (1 + eps_1)`` with
   ``|eps_1| <= rho_e = (EXP_FAST_REL + 2 delta)(1 + 2**-20)`` (``|e^d - 1| <= 2|d|`` for
   ``|d| <= 1``). ``d^ = 1 + e^`` (``dd_add_d``) has relative error at most
   ``rho_e + DD_REL`` (the relative error of ``e^`` shrinks by ``e / (1 + e) < 1``), and
   ``w^ = 1 / d^`` (``t^ >= 0``) or ``e^ / d^`` (``t^ < 0``; ``dd_div``) gives
   ``|w^ - w| <= rho_w w`` with ``rho_w = (2 rho_e + 3 DD_REL)(1 + 2**-18)``.
   For ``|t^| > 400`` no exponential is evaluated: ``w in [0, TINY)`` (``t < 0``) or
   ``(1 - TINY, 1]`` (``t > 0``), ``TINY = 2**-575 > e^{-399}``, an absolute radius.
3. Sums. ``N_e = sum_j kappa_ij w_ij v_je`` by Dot2 over the 2 S products
   ``hi(w) v``, ``lo(w) v`` (the pattern of the softmax step's ``N``):
   ``|N^ - N| <= (dot_bound(2 S) + rho) A_e + TINY sum_{far} |v_je|`` with ``rho = max_j
   rho_w`` and ``A_e = sum_j w_j |v_je| <= (1 + rho)(1 + gamma_{S+2})(1 + 2**-50) a_e``,
   ``a_e`` the float sum of ``|hi(w_j)| |v_je|``.
4. ``out = N^ keep_scale`` (``dd_mul`` with the double-double ``1 / (1 - p)`` and its bound),
   then the rounding decision (:func:`~refattn.exact.fast.rounding_decision.decide_one`).
   Weights (when asked for) are decided one by one from step 2.

A row is undecided (sent to the referee whole) when an element's enclosure straddles a
rounding boundary, when an allowed bias is outside [SAFE_MIN, SAFE_MAX], when a score bound
exceeds 2**-20, or when a float64 weight lies below ``e^{-400}``; a row with no allowed key
is left to the referee too (its 0 or NaN fill is the referee's). Each row's arithmetic is fixed
by the shapes alone, so no bit depends on the thread count.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from . import doubledouble as D
from ._params import (
    P_KEEP_ERR,
    P_KEEP_HI,
    P_KEEP_LO,
    P_SUM_REL,
    R_HAS_BIAS,
    R_HAS_KEEP,
    R_HAS_MASK,
    R_ROWS_HI,
    R_ROWS_LO,
)
from .allowed_set import key_state
from .doubledouble import EXP_FAST_REL, exp_dd_fast
from .forward_kernels import (
    EMPTY,
    OK,
    ROW_BLOCK,
    UNDECIDED,
    bias_in_range,
    score_dd,
)
from .rounding_decision import decide_one

__all__ = ["sigmoid_dd", "FAR", "TINY", "OK", "EMPTY", "UNDECIDED"]

#: Scores with ``|t^| > FAR`` take no exponential: their weight is within TINY of 0 or 1.
FAR = 400.0
TINY = 2.0**-575  # > exp(-FAR + 1): covers a score error up to 1
_DELTA_MAX = 2.0**-20
_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")


@numba.jit(**_JIT)
def _weight(th, tl, delta):
    """(w hi, w lo, relative bound, absolute bound) of sigma(t) for the score enclosure
    ``th + tl +- delta`` (module docstring, 2)."""
    if th < -FAR:
        return 0.0, 0.0, 0.0, TINY
    if th > FAR:
        return 1.0, 0.0, 0.0, TINY
    rho_e = (EXP_FAST_REL + 2.0 * delta) * (1.0 + _DELTA_MAX)
    if th >= 0.0:
        eh, el = exp_dd_fast(-th, -tl)
        dh, dl = D.dd_add_d(eh, el, 1.0)
        wh, wl = D.dd_div(1.0, 0.0, dh, dl)
    else:
        eh, el = exp_dd_fast(th, tl)
        dh, dl = D.dd_add_d(eh, el, 1.0)
        wh, wl = D.dd_div(eh, el, dh, dl)
    return wh, wl, (2.0 * rho_e + 3.0 * D.DD_REL) * (1.0 + 2.0**-18), 0.0


@numba.jit(**_JIT)
def _row_weights(index, lo, scores, state, target, w):
    """Decide the weights of row i (keys lo .. lo + n; ``scores`` = (t hi, t lo, delta));
    excluded keys weigh +0. Returns whether all are decided."""
    b, h, i = index
    th, tl, te = scores
    _, _, p, emin, maxf = target
    ok = True
    for jj in range(state.shape[0]):
        j = lo + jj
        w[b, h, i, j] = 0.0
        if state[jj] == 0:
            continue
        wh, wl, rel, absolute = _weight(th[jj], tl[jj], te[jj])
        if absolute > 0.0:  # below TINY (p < 53 rounds it to +0) or within TINY of 1
            w[b, h, i, j] = wh
            ok = ok and (wh == 1.0 or p < 53)
            continue
        value, dec = decide_one(wh, wl, rel * abs(wh) * D.BOUND_SAFETY, p, emin, maxf)
        w[b, h, i, j] = value
        ok = ok and dec
    return ok


@numba.jit(**_JIT)
def _block_dots2(qp, kTp, rows, nb_rows, lo, hi, s, c):
    """Compensated dot products (s, c) of the queries ``rows[:nb_rows]`` of the plane with the
    keys lo <= j < hi (entry [rr, j - lo]); each (s, c) is the Dot2 chain over D of a row
    alone, so the blocking changes no bit."""
    n = max(hi - lo, 0)
    for d in range(qp.shape[1]):
        row = kTp[d, lo:hi]  # a slice: the loop below then vectorizes
        for rr in range(nb_rows):
            a = qp[rows[rr], d]
            if a == 0.0:
                continue
            srow = s[rr]
            crow = c[rr]
            for jj in range(n):
                p = a * row[jj]
                ep = D.fma(a, row[jj], -p)
                t, es = D.two_sum(srow[jj], p)
                srow[jj] = t
                crow[jj] += ep + es


@numba.jit(**_JIT)
def _block_scores_dd(b, h, rows, nb_rows, lo, inputs, rule, work, row_status):
    """Scores (module docstring, 1) of the block's rows in place of their dot products, the
    key states, and each row's status so far (EMPTY: no allowed key; UNDECIDED: a bias out
    of range or a score bound above 2**-20)."""
    qn, kn, prm, kvh = inputs[3], inputs[4], inputs[9], inputs[10]
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    has_mask, has_bias, has_keep = rule[R_HAS_MASK], rule[R_HAS_BIAS], rule[R_HAS_KEEP]
    th, tl, te, state = work
    pr = prm[b, h]
    knp = kn[b, kvh[h]]
    for rr in range(nb_rows):
        i = rows[rr]
        row_status[rr] = EMPTY
        for jj in range(rows_lo[b, i] - lo, rows_hi[b, i] - lo):
            j = lo + jj
            st, bv = 2, 0.0
            if has_mask or has_bias or has_keep:
                st, bv = key_state(rule, b, h, i, j)
            state[rr, jj] = st
            if st == 0:
                continue
            if row_status[rr] == EMPTY:
                row_status[rr] = OK
            if has_bias and not bias_in_range(bv):
                row_status[rr] = UNDECIDED
                break
            th[rr, jj], tl[rr, jj], te[rr, jj] = score_dd(
                i, j, th[rr, jj], tl[rr, jj], qn[b, h, i], knp[j], pr, bv, has_bias
            )
            if not te[rr, jj] <= _DELTA_MAX:
                row_status[rr] = UNDECIDED
                break


@numba.jit(**_JIT)
def _block_weights_dd(nb_rows, work, row_status, rho):
    """Weights (module docstring, 2) of the kept keys of the block's rows in one pass, apart
    from the sums (independent exponentials back to back, which the processor overlaps):
    (hi, lo) in place of the score, the relative bound in place of the score bound, state 3
    for a far key (absolute bound TINY); per row the largest relative bound."""
    th, tl, te, state = work
    for rr in range(nb_rows):
        if row_status[rr] != OK:
            continue
        for jj in range(th.shape[1]):
            if state[rr, jj] != 2:
                continue
            wh, wl, rel, absolute = _weight(th[rr, jj], tl[rr, jj], te[rr, jj])
            th[rr, jj], tl[rr, jj], te[rr, jj] = wh, wl, rel
            rho[rr] = max(rho[rr], rel)
            if absolute > 0.0:
                state[rr, jj] = 3


@numba.jit(**_JIT)
def _block_sums_dd(vp, lo, nb_rows, work, row_status, sums):
    """N (Dot2 over the 2 S products hi(w) v, lo(w) v), a_e and the far keys' |v| sums of the
    block's rows (module docstring, 3) from :func:`_block_weights_dd`'s weights; each V row
    is loaded once for the block."""
    wh_all, wl_all, _, state = work
    ns, nc, av, far = sums
    vdim = vp.shape[1]
    for jj in range(wh_all.shape[1]):
        vrow = vp[lo + jj]
        for rr in range(nb_rows):
            st = state[rr, jj]
            if st < 2 or row_status[rr] != OK:
                continue
            if st == 3:
                for e in range(vdim):
                    far[rr, e] += abs(vrow[e])
            wh, wl = wh_all[rr, jj], wl_all[rr, jj]
            if wh == 0.0:
                continue
            srow, crow, arow = ns[rr], nc[rr], av[rr]
            for e in range(vdim):
                x = vrow[e]
                p = wh * x
                ep = D.fma(wh, x, -p)
                t, es = D.two_sum(srow[e], p)
                srow[e] = t
                crow[e] += ep + es + wl * x
                arow[e] += abs(wh) * abs(x)


@numba.jit(**_JIT)
def _finish_dd(index, n, rho, sums, pr, target, results):
    """out = N keep_scale with its radius, rounded to the target (module docstring, 3-4);
    returns whether every element is decided."""
    b, h, i = index
    ns, nc, av, far = sums
    _, want_enclosure, p, emin, maxf = target
    out, enclosure = results[0], results[3]
    grow = (1.0 + rho) * (1.0 + 1.01 * (n + 2) * D.U / (1.0 - (n + 2) * D.U)) * (1.0 + 2.0**-50)
    sum_rel = pr[P_SUM_REL]
    keep_hi, keep_lo, keep_err = pr[P_KEEP_HI], pr[P_KEEP_LO], pr[P_KEEP_ERR]
    ok = True
    for e in range(ns.shape[0]):
        nr = ((sum_rel + rho) * av[e] * grow + TINY * far[e]) * D.BOUND_SAFETY
        nh, nl = D.two_sum(ns[e], nc[e])
        oh, ol = D.dd_mul(nh, nl, keep_hi, keep_lo)
        orad = nr * (abs(keep_hi) + keep_err) + (abs(nh) + nr) * keep_err + D.DD_REL * abs(oh)
        orad = orad * D.BOUND_SAFETY
        if want_enclosure:
            enclosure[b, h, i, e, 0] = oh
            enclosure[b, h, i, e, 1] = ol
            enclosure[b, h, i, e, 2] = orad
        value, dec = decide_one(oh, ol, orad, p, emin, maxf)
        out[b, h, i, e] = value
        ok = ok and dec
    return ok


@numba.jit(**_JIT)
def _sigmoid_block(b, h, rows, inputs, rule, target, results):
    """The double-double first step of the query rows ``rows`` (at most ROW_BLOCK) of plane
    (b, h), which share each load of K^T and V; sets each row's status."""
    q, kT, v, prm, kvh = inputs[0], inputs[1], inputs[2], inputs[9], inputs[10]
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    status = results[2]
    nb_rows = rows.shape[0]
    g = kvh[h]
    lo, hi = rows_lo[b, rows[0]], rows_hi[b, rows[0]]
    for rr in range(1, nb_rows):
        lo, hi = min(lo, rows_lo[b, rows[rr]]), max(hi, rows_hi[b, rows[rr]])
    n = max(hi - lo, 0)
    work = (
        np.zeros((ROW_BLOCK, n)),
        np.zeros((ROW_BLOCK, n)),
        np.zeros((ROW_BLOCK, n)),
        np.zeros((ROW_BLOCK, n), np.int8),
    )
    _block_dots2(q[b, h], kT[b, g], rows, nb_rows, lo, hi, work[0], work[1])
    row_status = np.zeros(ROW_BLOCK, np.int8)
    _block_scores_dd(b, h, rows, nb_rows, lo, inputs, rule, work, row_status)
    vdim = v.shape[3]
    sums = (
        np.zeros((ROW_BLOCK, vdim)),
        np.zeros((ROW_BLOCK, vdim)),
        np.zeros((ROW_BLOCK, vdim)),
        np.zeros((ROW_BLOCK, vdim)),
    )
    rho = np.zeros(ROW_BLOCK)
    empty = np.empty((0, 0))
    scores = (empty, empty, empty)  # the scores, kept for the weights when asked for
    if target[0]:
        scores = (work[0].copy(), work[1].copy(), work[2].copy())
    _block_weights_dd(nb_rows, work, row_status, rho)
    _block_sums_dd(v[b, g], lo, nb_rows, work, row_status, sums)
    for rr in range(nb_rows):
        i = rows[rr]
        if row_status[rr] != OK:
            status[b, h, i] = row_status[rr]
            continue
        row_sums = (sums[0][rr], sums[1][rr], sums[2][rr], sums[3][rr])
        ok = _finish_dd((b, h, i), n, rho[rr], row_sums, prm[b, h], target, results)
        if ok and target[0]:
            row_scores = (scores[0][rr], scores[1][rr], scores[2][rr])
            ok = _row_weights((b, h, i), lo, row_scores, work[3][rr], target, results[1])
        status[b, h, i] = OK if ok else UNDECIDED


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def sigmoid_dd(blocks, inputs, rule, target, results):
    """The double-double first step over ``blocks`` ((n, 3 + ROW_BLOCK): b, h, row count, then
    that many query rows of plane (b, h)), in parallel over blocks.

    ``inputs`` = the softmax first steps' record
    (:func:`refattn.exact.fast.forward_kernels.forward_dd`: q, kT, v, qn, kn, qs, ks, vmax,
    vnorm, prm, kv_head); ``rule`` = :meth:`refattn.exact.fast.allowed_set.AllowedRule.
    kernel_args`; ``target`` = (want_weights, want_enclosure, p, emin, max_finite) of the output
    format; ``results`` = (out (B, H, L, E), weights (B, H, L, S) or a dummy, status (B, H, L)
    int8, enclosure (B, H, L, E, 3): out's (hi, lo, radius) before rounding, or a dummy)."""
    for r in prange(blocks.shape[0]):
        b, h, count = blocks[r, 0], blocks[r, 1], blocks[r, 2]
        _sigmoid_block(b, h, blocks[r, 3 : 3 + count], inputs, rule, target, results)
