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
    P_GAMMA_DIM,
    P_KEEP_ERR,
    P_KEEP_HI,
    P_KEEP_LO,
    P_SCALE_ERR,
    P_SCALE_HI,
    P_SCALE_LO,
    P_SLOPE,
    P_SOFTCAP,
    P_SUM_REL,
    R_HAS_BIAS,
    R_HAS_KEEP,
    R_HAS_MASK,
    R_ROWS_HI,
    R_ROWS_LO,
)
from .allowed_set import key_state
from .doubledouble import EXP_D_REL, EXP_FAST_REL, exp_d, exp_dd_fast
from .forward_kernels import EMPTY, OK, UNDECIDED, bias_in_range, row_dots, score_dd
from .rounding_decision import decide_one

__all__ = ["sigmoid_dd", "sigmoid_d", "FAR", "TINY", "OK", "EMPTY", "UNDECIDED"]

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
def _row_sums(lo, scores, state, vp, sums):
    """N (hi, compensation) and the radius data (a_e float sums, far |v| sums) of one row;
    returns the largest relative weight bound rho (module docstring, 3)."""
    th, tl, te = scores
    ns, nc, av, far = sums
    vdim = vp.shape[1]
    rho = 0.0
    for jj in range(state.shape[0]):
        if state[jj] != 2:
            continue
        j = lo + jj
        wh, wl, rel, absolute = _weight(th[jj], tl[jj], te[jj])
        rho = max(rho, rel)
        if absolute > 0.0:
            for e in range(vdim):
                far[e] += abs(vp[j, e])
        if wh == 0.0:
            continue
        for e in range(vdim):
            x = vp[j, e]
            p = wh * x
            ep = D.fma(wh, x, -p)
            t, es = D.two_sum(ns[e], p)
            ns[e] = t
            nc[e] += ep + es + wl * x
            av[e] += abs(wh) * abs(x)
    return rho


@numba.jit(**_JIT)
def _sigmoid_row(b, h, i, inputs, rule, target, results):
    """First step of query row i of plane (b, h); returns its status (OK, EMPTY, UNDECIDED)."""
    q, kT, v, qn, kn, prm, kvh = inputs
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    has_mask, has_bias, has_keep = rule[R_HAS_MASK], rule[R_HAS_BIAS], rule[R_HAS_KEEP]
    want_w, want_enclosure, p, emin, maxf = target
    out, enclosure = results[0], results[3]
    g = kvh[h]
    lo, hi = rows_lo[b, i], rows_hi[b, i]
    n = hi - lo
    vdim = v.shape[3]
    pr = prm[b, h]
    knp = kn[b, g]
    th = np.empty(n)
    tl = np.empty(n)
    te = np.zeros(n)
    state = np.zeros(n, np.int8)
    row_dots(q[b, h, i], kT[b, g], lo, hi, th, tl)
    any_allowed = False
    for jj in range(n):
        j = lo + jj
        st, bv = 2, 0.0
        if has_mask or has_bias or has_keep:
            st, bv = key_state(rule, b, h, i, j)
        state[jj] = st
        if st == 0:
            continue
        any_allowed = True
        if has_bias and not bias_in_range(bv):
            return UNDECIDED
        th[jj], tl[jj], te[jj] = score_dd(
            i, j, th[jj], tl[jj], qn[b, h, i], knp[j], pr, bv, has_bias
        )
        if not te[jj] <= _DELTA_MAX:
            return UNDECIDED
    if not any_allowed:
        return EMPTY
    ns = np.zeros(vdim)
    nc = np.zeros(vdim)
    av = np.zeros(vdim)
    far = np.zeros(vdim)
    rho = _row_sums(lo, (th, tl, te), state, v[b, g], (ns, nc, av, far))
    grow = (1.0 + rho) * (1.0 + 1.01 * (n + 2) * D.U / (1.0 - (n + 2) * D.U)) * (1.0 + 2.0**-50)
    sum_rel = pr[P_SUM_REL]
    keep_hi, keep_lo, keep_err = pr[P_KEEP_HI], pr[P_KEEP_LO], pr[P_KEEP_ERR]
    ok = True
    for e in range(vdim):
        nr = ((sum_rel + rho) * av[e] * grow + TINY * far[e]) * D.BOUND_SAFETY
        nh, nl = D.two_sum(ns[e], nc[e])
        oh, ol = D.dd_mul(nh, nl, keep_hi, keep_lo)
        orad = nr * (abs(keep_hi) + keep_err) + (abs(nh) + nr) * keep_err + D.DD_REL * abs(oh)
        if want_enclosure:
            enclosure[b, h, i, e, 0] = oh
            enclosure[b, h, i, e, 1] = ol
            enclosure[b, h, i, e, 2] = orad * D.BOUND_SAFETY
        value, dec = decide_one(oh, ol, orad * D.BOUND_SAFETY, p, emin, maxf)
        out[b, h, i, e] = value
        ok = ok and dec
    if ok and want_w:
        ok = _row_weights((b, h, i), lo, (th, tl, te), state, target, results[1])
    return OK if ok else UNDECIDED


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def sigmoid_dd(items, inputs, rule, target, results):
    """The first step for the query rows ``items`` ((n, 3): b, h, i), in parallel over rows.

    ``inputs`` = (q (B, H, L, D), kT (B, K, D, S), v (B, K, S, E) float64, qn (B, H, L), kn
    (B, K, S) row-norm bounds, prm (B, H, 16) (:func:`refattn.exact.fast.forward.kernel_params`),
    kv_head (H,)); ``rule`` = :meth:`refattn.exact.fast.allowed_set.AllowedRule.kernel_args`;
    ``target`` = (want_weights, want_enclosure, p, emin, max_finite) of the output format;
    ``results`` = (out (B, H, L, E), weights (B, H, L, S) or a dummy, status (B, H, L) int8,
    enclosure (B, H, L, E, 3): out's (hi, lo, radius) before rounding, or a dummy)."""
    status = results[2]
    for r in prange(items.shape[0]):
        b, h, i = items[r, 0], items[r, 1], items[r, 2]
        status[b, h, i] = _sigmoid_row(b, h, i, inputs, rule, target, results)


# --------------------------------------------------------------------------------------
# the double-precision step (targets of at most 24 bits)
# --------------------------------------------------------------------------------------
@numba.jit(**_JIT)
def _row_scores_d(b, h, i, lo, inputs, rule, t, te, state):
    """Scores t (float64) and their absolute bounds te of row i's keys lo .. lo + n, and the
    key states; returns (any allowed key, every allowed score usable)."""
    q, kT, _, qn, kn, prm, kvh = inputs
    has_mask, has_bias, has_keep = rule[R_HAS_MASK], rule[R_HAS_BIAS], rule[R_HAS_KEEP]
    g = kvh[h]
    n = t.shape[0]
    pr = prm[b, h]
    scale_hi = pr[P_SCALE_HI]
    scale_tail = abs(pr[P_SCALE_LO]) + pr[P_SCALE_ERR]
    dot_err = abs(scale_hi) * pr[P_GAMMA_DIM] * qn[b, h, i] * (1.0 + 2.0**-40)
    for jj in range(n):
        t[jj] = 0.0
    qrow, kTp, knp = q[b, h, i], kT[b, g], kn[b, g]
    for d in range(qrow.shape[0]):  # fma chains sequential over D, lanes over keys
        a = qrow[d]
        row = kTp[d, lo : lo + n]
        for jj in range(n):
            t[jj] = D.fma(a, row[jj], t[jj])
    any_allowed = False
    for jj in range(n):
        j = lo + jj
        st, bv = 2, 0.0
        if has_mask or has_bias or has_keep:
            st, bv = key_state(rule, b, h, i, j)
        state[jj] = st
        if st == 0:
            continue
        any_allowed = True
        if has_bias and not bias_in_range(bv):
            return True, False
        x = t[jj] * scale_hi
        err = (dot_err * knp[j] + abs(t[jj]) * scale_tail + D.U * abs(x)) * (1.0 + 2.0**-40)
        if has_bias:
            x = x + bv
            err = err + D.U * abs(x) * (1.0 + 2.0**-40)
        t[jj] = x
        te[jj] = err
        if not err <= _DELTA_MAX:
            return True, False
    return any_allowed, True


@numba.jit(**_JIT)
def _weight_d(t, delta):
    """(w, relative bound, absolute bound) of sigma(t) in double precision (exp_d; the
    analysis of :func:`_weight` with EXP_D_REL and u for the two roundings)."""
    if t < -FAR:
        return 0.0, 0.0, TINY
    if t > FAR:
        return 1.0, 0.0, TINY
    rho_e = (EXP_D_REL + 2.0 * delta) * (1.0 + _DELTA_MAX)
    e = exp_d(-abs(t))
    w = 1.0 / (1.0 + e) if t >= 0.0 else e / (1.0 + e)
    return w, (2.0 * rho_e + 3.0 * D.U) * (1.0 + 2.0**-18), 0.0


@numba.jit(**_JIT)
def _sigmoid_row_d(b, h, i, inputs, rule, target, results):
    """Double-precision first step of row i of plane (b, h) (OK, EMPTY or UNDECIDED: the
    double-double step takes the undecided rows). ``N`` is an fma chain over the kept keys in
    increasing order: ``|N^ - sum w^ v| <= gamma_n sum |w^ v|`` (Higham 2002, eq. (3.5))."""
    v, prm = inputs[2], inputs[5]
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    _, want_enclosure, p, emin, maxf = target
    out = results[0]
    pr = prm[b, h]
    if pr[P_SOFTCAP] != 0.0 or pr[P_SLOPE] != 0.0:  # the double-double step scores those
        return UNDECIDED
    g = inputs[6][h]
    lo, hi = rows_lo[b, i], rows_hi[b, i]
    n = hi - lo
    t = np.empty(n)
    te = np.empty(n)
    state = np.zeros(n, np.int8)
    any_allowed, usable = _row_scores_d(b, h, i, lo, inputs, rule, t, te, state)
    if not usable:
        return UNDECIDED
    if not any_allowed:
        return EMPTY
    vp = v[b, g]
    vdim = vp.shape[1]
    acc = np.zeros(vdim)
    av = np.zeros(vdim)
    far = np.zeros(vdim)
    rho = 0.0
    for jj in range(n):
        if state[jj] != 2:
            continue
        w, rel, absolute = _weight_d(t[jj], te[jj])
        rho = max(rho, rel)
        vrow = vp[lo + jj]
        if absolute > 0.0:
            for e in range(vdim):
                far[e] += abs(vrow[e])
        for e in range(vdim):
            x = vrow[e]
            acc[e] = D.fma(w, x, acc[e])
            av[e] += w * abs(x)
    gam = 1.01 * (n + 2) * D.U / (1.0 - (n + 2) * D.U)
    grow = (1.0 + rho) * (1.0 + gam) * (1.0 + 2.0**-50)
    keep_hi = pr[P_KEEP_HI]
    keep_tail = abs(pr[P_KEEP_LO]) + pr[P_KEEP_ERR]
    ok = True
    for e in range(vdim):
        nr = ((gam + rho) * av[e] * grow + TINY * far[e]) * D.BOUND_SAFETY
        o = acc[e] * keep_hi
        rad = nr * abs(keep_hi) + (abs(acc[e]) + nr) * keep_tail + D.U * abs(o)
        rad = rad * (1.0 + 2.0**-40) * D.BOUND_SAFETY
        if want_enclosure:
            enclosure = results[3]
            enclosure[b, h, i, e, 0] = o
            enclosure[b, h, i, e, 1] = 0.0
            enclosure[b, h, i, e, 2] = rad
        value, dec = decide_one(o, 0.0, rad, p, emin, maxf)
        out[b, h, i, e] = value
        ok = ok and dec
    return OK if ok else UNDECIDED


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def sigmoid_d(items, inputs, rule, target, results):
    """The double-precision first step (targets of at most 24 bits, no weights) for the query
    rows ``items``, in parallel over rows; the arguments are those of :func:`sigmoid_dd`.
    Rows it leaves undecided run :func:`sigmoid_dd` next."""
    status = results[2]
    for r in prange(items.shape[0]):
        b, h, i = items[r, 0], items[r, 1], items[r, 2]
        status[b, h, i] = _sigmoid_row_d(b, h, i, inputs, rule, target, results)
