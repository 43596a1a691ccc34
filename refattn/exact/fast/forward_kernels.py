"""The compiled first steps of the fast exact forward (:mod:`refattn.exact.fast.forward` states
the algorithm and its error bounds): the double-double step :func:`forward_dd`, one query row
per work item, and the double-precision step :func:`forward_d` for targets of at most 24 bits,
:data:`ROW_BLOCK` rows per work item, and :func:`row_facts` (the inputs' row norms, ranges and
exactness scales).

The kernels take argument records (tuples; :func:`forward_dd` lists them) rather than one
positional argument per array, as :mod:`refattn.kernels._args` does. Each row's arithmetic is
fixed by the shapes alone, so no bit depends on the thread count.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from . import doubledouble as D
from ._params import (
    P_ALIBI_KEYS,
    P_ALIBI_OFFSET,
    P_DOT_REL,
    P_GAMMA_DIM,
    P_GAMMA_SUM,
    P_HAS_SINK,
    P_KEEP_ERR,
    P_KEEP_HI,
    P_KEEP_LO,
    P_SCALE_ERR,
    P_SCALE_HI,
    P_SCALE_LO,
    P_SINK,
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
from .doubledouble import EXP_FAST_REL, exp_dd_fast
from .rounding_decision import decide_one

__all__ = [
    "forward_dd",
    "forward_d",
    "row_facts",
    "row_fact",
    "trailing_zero_count",
    "CUT",
    "TINY",
    "WEIGHT_TINY_ARG",
    "WEIGHT_ZERO_ARG",
    "SUM_BLOCK",
    "ROW_BLOCK",
    "OK",
    "EMPTY",
    "UNDECIDED",
]


#: Exponent arguments below CUT contribute ``0 <= e < TINY`` (an absolute radius).
CUT = -400.0
TINY = 2.0**-575  # > exp(-400 + 1): covers an argument error up to 1
assert math.log(TINY) > CUT + 1
#: Weights with ``x - log Z + err < WEIGHT_TINY_ARG`` are positive and below 2**-288: they
#: round to +0 in float32, float16 and bfloat16; below WEIGHT_ZERO_ARG (< 2**-1154) they round
#: to +0 in float64 too.
WEIGHT_TINY_ARG = -200.0
WEIGHT_ZERO_ARG = -800.0
_RHO_MAX = 2.0**-20
#: Key block of the double-precision sums (blocked summation, Higham 2002, sec. 4.2).
SUM_BLOCK = 64
#: Query rows the double-precision step processes together (cache reuse only: every dot
#: product is the same fma chain over D). Chunking the keys as well measured slower.
ROW_BLOCK = 8

#: Row status of the first steps: decided, empty (no allowed key), undecided (to the referee).
OK, EMPTY, UNDECIDED = 0, 1, 2

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")


@numba.jit(**_JIT)
def _dot2_step(s, a, b):
    """One compensated multiply-add (Dot2): ``(t, err)`` with ``t = fl(s + a b)`` and ``t + err``
    the exact ``s + a b`` up to err's own rounding (TwoProd by FMA, then TwoSum)."""
    p = a * b
    ep = D.fma(a, b, -p)
    t, es = D.two_sum(s, p)
    return t, ep + es


@numba.jit(**_JIT)
def _row_dots(qrow, kT, lo, hi, s, c):
    """Compensated dot products (s_j, c_j) of q_i with the keys lo <= j < hi (lanes over keys;
    entry j - lo)."""
    dim = kT.shape[0]
    for jj in range(hi - lo):
        s[jj] = 0.0
        c[jj] = 0.0
    for d in range(dim):
        a = qrow[d]
        if a == 0.0:
            continue
        row = kT[d, lo:hi]  # a slice, not kT[d, lo + jj]: the loop then vectorizes
        for jj in range(hi - lo):
            s[jj], e = _dot2_step(s[jj], a, row[jj])
            c[jj] += e


@numba.jit(**_JIT)
def _bias_in_range(x):
    """A bias value the first steps take: zero, or a magnitude in [SAFE_MIN, SAFE_MAX]."""
    return x == 0.0 or (abs(x) >= D.SAFE_MIN and abs(x) <= D.SAFE_MAX)


@numba.jit(**_JIT)
def _score(i, j, sj, cj, qn_i, kn_j, prm, bv, has_bias):
    """(t_hi, t_lo, err) of the score of key j from its dot product (s, c)."""
    scale_hi, scale_lo, scale_err, dot_rel, cap, slope, offset, alibi_keys = (
        prm[P_SCALE_HI],
        prm[P_SCALE_LO],
        prm[P_SCALE_ERR],
        prm[P_DOT_REL],
        prm[P_SOFTCAP],
        prm[P_SLOPE],
        prm[P_ALIBI_OFFSET],
        prm[P_ALIBI_KEYS],
    )
    dh, dl = D.two_sum(sj, cj)
    derr = dot_rel * qn_i * kn_j
    th, tl = D.dd_mul(dh, dl, scale_hi, scale_lo)
    err = abs(scale_hi) * 1.0000001 * derr + (abs(dh) + derr) * scale_err + D.DD_REL * abs(th)
    if cap > 0.0:
        yh, yl = D.dd_div_d(th, tl, cap)
        err = err / cap + D.DD_REL * abs(yh)
        hh, hl = D.tanh_dd(yh, yl)
        err = err + D.TANH_ABS
        th, tl = D.dd_mul_d(hh, hl, cap)
        err = err * cap + D.DD_REL * abs(th)
    if has_bias:
        th, tl = D.dd_add_d(th, tl, bv)
        err += D.DD_REL * abs(th)
    if slope != 0.0 and j < alibi_keys:
        dist = abs(i + offset - j)
        ah, al = D.two_prod(-slope, float(dist))
        th, tl = D.dd_add(th, tl, ah, al)
        err += D.DD_REL * abs(th)
    return th, tl, err * D.BOUND_SAFETY


@numba.jit(**_JIT)
def _finish_row(index, top, z, sums, prm, target, results):
    """lse = m + log Z and out = N / Z * keep_scale with their radii (forward module
    docstring, 5), rounded to the target (6); ``z`` = (Z hi, lo, radius), ``sums`` = (N hi,
    N lo, N radius) (E,) each. Returns (decided, log Z hi, lo, radius)."""
    b, h, i = index
    zh, zl, zr = z
    ns, nc, nr = sums
    want_lse, _, p, emin, maxf = target
    out, lse = results[0], results[1]
    keep_hi, keep_lo, keep_err = prm[P_KEEP_HI], prm[P_KEEP_LO], prm[P_KEEP_ERR]
    if not zr < 0.5 * zh:
        return False, 0.0, 0.0, 0.0
    lh, ll, lerr = D.log_dd(zh, zl)
    lerr = lerr + (zr / zh) / (1.0 - zr / zh)
    ok = True
    if want_lse:
        gh, gl = D.dd_add_d(lh, ll, top)
        value, dec = decide_one(gh, gl, (lerr + D.DD_REL * abs(gh)) * D.BOUND_SAFETY, p, emin, maxf)
        lse[b, h, i] = value
        ok = ok and dec
    zlow = zh - zr
    for e in range(ns.shape[0]):
        nh, nl = D.two_sum(ns[e], nc[e])
        oh, ol = D.dd_div(nh, nl, zh, zl)
        orad = (nr[e] + abs(oh) * 1.0000001 * zr) / zlow + D.DD_REL * abs(oh)
        ph, pl = D.dd_mul(oh, ol, keep_hi, keep_lo)
        orad = orad * (abs(keep_hi) + keep_err) + abs(oh) * keep_err + D.DD_REL * abs(ph)
        value, dec = decide_one(ph, pl, orad * D.BOUND_SAFETY, p, emin, maxf)
        out[b, h, i, e] = value
        ok = ok and dec
    return ok, lh, ll, lerr * D.BOUND_SAFETY


@numba.jit(**_JIT)
def _row_weights(index, lo, state, shifted, log_z, target, w):
    """w_ij = exp(x_ij - log Z_i) rounded to the target for the keys lo <= j < lo + n (entry
    j - lo of the row arrays ``shifted`` = (x hi, x lo, x radius)); ``log_z`` = (hi, lo,
    radius); excluded keys weigh exactly +0. Weights with ``x - log Z + err <
    WEIGHT_TINY_ARG`` are in (0, 2**-288) and round to +0 below 53 bits; below
    ``WEIGHT_ZERO_ARG`` (< 2**-1154) in float64 too. Returns whether all are decided."""
    b, h, i = index
    x_h, x_l, x_r = shifted
    lz_h, lz_l, lz_r = log_z
    _, _, p, emin, maxf = target
    ok = True
    for jj in range(state.shape[0]):
        j = lo + jj
        if state[jj] == 0:
            w[b, h, i, j] = 0.0
            continue
        ah, al = D.dd_add(x_h[jj], x_l[jj], -lz_h, -lz_l)
        ae = (x_r[jj] + lz_r + D.DD_REL * abs(ah)) * D.BOUND_SAFETY
        w[b, h, i, j] = 0.0
        if ah + ae < WEIGHT_TINY_ARG:
            ok = ok and (ah + ae < WEIGHT_ZERO_ARG or p < 53)
            continue
        if ah < D.EXP_MIN_ARG + 1.0 or ae > _RHO_MAX:
            ok = False
            continue
        eh, el = exp_dd_fast(ah, al)
        value, dec = decide_one(
            eh,
            el,
            (EXP_FAST_REL + 2.0 * ae) * (1.0 + _RHO_MAX) * eh * D.BOUND_SAFETY,
            p,
            emin,
            maxf,
        )
        w[b, h, i, j] = value
        ok = ok and dec
    return ok


@numba.jit(**_JIT)
def _dd_row(b, h, i, inputs, rule, target, results):
    """Double-double first step of query row i of plane (b, h) (forward module docstring,
    1-6); returns its status. ``inputs``, ``rule``, ``target``, ``results``: the argument
    records of :func:`forward_dd`."""
    q, kT, v, qn, kn, _, _, vmax, _, prm, kvh = inputs
    rows_lo, rows_hi, has_mask, has_bias, has_drop = (
        rule[R_ROWS_LO],
        rule[R_ROWS_HI],
        rule[R_HAS_MASK],
        rule[R_HAS_BIAS],
        rule[R_HAS_KEEP],
    )
    want_w = target[1]
    g = kvh[h]
    lo, hi = rows_lo[b, i], rows_hi[b, i]
    n = hi - lo
    vdim = v.shape[3]
    pr = prm[b, h]
    sum_rel = pr[P_SUM_REL]
    vp = v[b, g]  # the plane's (S, E) values
    knp = kn[b, g]
    qn_i = qn[b, h, i]
    rule_arrays = has_mask or has_bias or has_drop
    s = np.empty(n)
    c = np.empty(n)
    err = np.empty(n)
    state = np.zeros(n, np.int8)
    _row_dots(q[b, h, i], kT[b, g], lo, hi, s, c)
    top = -np.inf
    for jj in range(n):
        j = lo + jj
        st, bv = 2, 0.0
        if rule_arrays:
            st, bv = key_state(rule, b, h, i, j)
        state[jj] = st
        if st == 0:
            continue
        if has_bias and not _bias_in_range(bv):
            return UNDECIDED
        th, tl, e = _score(i, j, s[jj], c[jj], qn_i, knp[j], pr, bv, has_bias)
        s[jj], c[jj], err[jj] = th, tl, e
        if th > top:
            top = th
    has_sink, sink = pr[P_HAS_SINK] != 0.0, pr[P_SINK]
    if has_sink and sink > top:  # the sink: one more logit in the max and in Z, no value
        top = sink
    if top == -np.inf:
        return EMPTY
    ns = np.zeros(vdim)
    nc = np.zeros(vdim)
    tiny_v = np.zeros(vdim)
    zs = 0.0
    zc = 0.0
    tiny = 0.0
    rho = 0.0
    # float sum of the valued keys' hi(e_j): with e_j <= (eh + el) / (1 - rho) and the sum's
    # gamma_n < 2**-22 (n < 2**30 keys), sum_j e_j <= zv (1 + rho) (1 + 2**-20)
    zv = 0.0
    for jj in range(n):
        if state[jj] == 0:
            continue
        j = lo + jj
        xh, xl = D.dd_add_d(s[jj], c[jj], -top)
        xe = (err[jj] + D.DD_REL * abs(xh)) * D.BOUND_SAFETY
        if want_w:
            s[jj], c[jj], err[jj] = xh, xl, xe  # the shifted scores, kept for the weights
        if xh < CUT:
            tiny += TINY
            if state[jj] == 2:
                for e in range(vdim):
                    tiny_v[e] += abs(vp[j, e])
            continue
        rho = max(rho, (EXP_FAST_REL + 2.0 * xe) * (1.0 + _RHO_MAX))
        eh, el = exp_dd_fast(xh, xl)
        zs, es = D.two_sum(zs, eh)
        zc += es + el
        if state[jj] == 2:
            for e in range(vdim):
                b_ = vp[j, e]
                ns[e], er = _dot2_step(ns[e], eh, b_)
                nc[e] += er + el * b_
            zv += eh
    if has_sink:  # sink - top is exact (TwoSum); the term enters Z after the keys
        xh, xl = D.two_sum(sink, -top)
        if xh < CUT:
            tiny += TINY
        else:
            rho = max(
                rho, (EXP_FAST_REL + 2.0 * D.DD_REL * abs(xh) * D.BOUND_SAFETY) * (1.0 + _RHO_MAX)
            )
            eh, el = exp_dd_fast(xh, xl)
            zs, es = D.two_sum(zs, eh)
            zc += es + el
    if not rho <= _RHO_MAX:
        return UNDECIDED
    zh, zl = D.two_sum(zs, zc)
    zr = ((sum_rel + rho) * zh + tiny) * D.BOUND_SAFETY
    # sum_j e_j |v_je| <= vmax_e (Z + zr): the Dot2 and exponential errors of N (exactly 0
    # when no kept key above CUT carries a value: N is then 0 exactly, as with a sink alone)
    nr = TINY * tiny_v
    if zv > 0.0:  # the valued keys' mass (e > 0 above CUT): Z, or less when a sink holds most
        mass = min(zh + zr, zv * (1.0 + rho) * (1.0 + 2.0**-20))
        nr = nr + ((sum_rel + rho) * vmax[b, g] * mass) * D.BOUND_SAFETY
    ok, lz_h, lz_l, lz_r = _finish_row(
        (b, h, i), top, (zh, zl, zr), (ns, nc, nr), pr, target, results
    )
    if ok and want_w:
        ok = _row_weights((b, h, i), lo, state, (s, c, err), (lz_h, lz_l, lz_r), target, results[2])
    return OK if ok else UNDECIDED


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def forward_dd(items, inputs, rule, target, results):
    """Double-double first step for the query rows ``items`` ((n, 3): b, h, i), in parallel
    over rows of every plane.

    ``inputs`` = (q (B, H, L, D), kT (B, K, D, S), v (B, K, S, E), qn, kn (row norms), qs, ks
    (:func:`refattn.exact.fast.forward.exactness_scales`), vmax (B, K, E), vnorm (B, K, E),
    prm (B, H, 16) (:func:`refattn.exact.fast.forward.kernel_params`), kv_head (H,));
    ``rule`` = :meth:`refattn.exact.fast.allowed_set.AllowedRule.kernel_args`; ``target`` =
    (want_lse, want_weights, p, emin, max_finite) of the output format; ``results`` = (out,
    lse, weights, status), written row by row."""
    status = results[3]
    for r in prange(items.shape[0]):
        b, h, i = items[r, 0], items[r, 1], items[r, 2]
        status[b, h, i] = _dd_row(b, h, i, inputs, rule, target, results)


@numba.jit(**_JIT)
def _score_d(i, j, sj, qn_i, kn_j, prm, bv, has_bias, gdim):
    """(t, err): the score of key j in double precision from its dot product s (fma chain,
    error <= gamma_D |q_i|.|k_j|), each rounding bounded by 1.01 u |result|."""
    scale_hi, scale_lo, scale_err, cap, slope, offset, alibi_keys = (
        prm[P_SCALE_HI],
        prm[P_SCALE_LO],
        prm[P_SCALE_ERR],
        prm[P_SOFTCAP],
        prm[P_SLOPE],
        prm[P_ALIBI_OFFSET],
        prm[P_ALIBI_KEYS],
    )
    u = 1.01 * D.U
    derr = gdim * qn_i * kn_j
    t = sj * scale_hi
    err = abs(scale_hi) * derr + (abs(sj) + derr) * (abs(scale_lo) + scale_err) + u * abs(t)
    if cap > 0.0:
        yh, yl = D.dd_div_d(t, 0.0, cap)
        err = err / cap + D.DD_REL * abs(yh)
        hh, hl = D.tanh_dd(yh, yl)
        err = err + D.TANH_ABS
        th, tl = D.dd_mul_d(hh, hl, cap)
        err = err * cap + D.DD_REL * abs(th) + abs(tl)
        t = th
    if has_bias:
        t = t + bv
        err += u * abs(t)
    if slope != 0.0 and j < alibi_keys:
        a = -slope * float(abs(i + offset - j))
        t = t + a
        err += u * (abs(a) + abs(t))
    return t, err


@numba.jit(**_JIT)
def _block_interval(rows_lo, rows_hi, b, i0, nb_rows):
    """The union [lo, hi) of the key intervals of rows i0 .. i0 + nb_rows - 1 of batch row b."""
    lo = rows_lo[b, i0]
    hi = rows_hi[b, i0]
    for rr in range(1, nb_rows):
        lo = min(lo, rows_lo[b, i0 + rr])
        hi = max(hi, rows_hi[b, i0 + rr])
    return lo, hi


@numba.jit(**_JIT)
def _block_dots(qp, kTp, i0, nb_rows, lo, hi, s):
    """s[rr, j - lo] = q_{i0 + rr} . k_j for lo <= j < hi by one fma chain over D each (``qp``
    the plane's (L, D) queries, ``kTp`` its (D, S) keys)."""
    n = max(hi - lo, 0)
    for d in range(qp.shape[1]):
        row = kTp[d, lo:hi]  # a slice: the loop below then vectorizes
        for rr in range(nb_rows):
            a = qp[i0 + rr, d]
            if a == 0.0:
                continue
            srow = s[rr]
            for jj in range(n):
                srow[jj] = D.fma(a, row[jj], srow[jj])


@numba.jit(**_JIT)
def _block_scores(b, h, i0, nb_rows, lo, hi, inputs, rule, work):
    """The scores (t, err) of rows i0 .. i0 + nb_rows - 1 of plane (b, h) over the keys
    [lo, hi) in place of their dot products, with each key's state (0 excluded, 1 dropped,
    2 kept), each row's maximum score and whether a bias value is out of the first steps'
    range: ``work`` = (s, err, state, bad, top) (:func:`_d_block`)."""
    q, kT, _, qn, kn, qs, ks, _, _, prm, kvh = inputs
    rows_lo, rows_hi, has_mask, has_bias, has_drop = (
        rule[R_ROWS_LO],
        rule[R_ROWS_HI],
        rule[R_HAS_MASK],
        rule[R_HAS_BIAS],
        rule[R_HAS_KEEP],
    )
    s, err, state, bad, top = work
    g = kvh[h]
    pr = prm[b, h]
    gdim = pr[P_GAMMA_DIM]
    knp = kn[b, g]
    ksp = ks[b, g]
    rule_arrays = has_mask or has_bias or has_drop
    _block_dots(q[b, h], kT[b, g], i0, nb_rows, lo, hi, s)
    for rr in range(nb_rows):
        i = i0 + rr
        for jj in range(rows_lo[b, i] - lo, rows_hi[b, i] - lo):
            j = lo + jj
            st, bv = 2, 0.0
            if rule_arrays:
                st, bv = key_state(rule, b, h, i, j)
            state[rr, jj] = st
            if st == 0:
                continue
            if has_bias and not _bias_in_range(bv):
                bad[rr] = True
            # an fma chain proven exact (exactness_scales) carries no error
            gd = 0.0 if qs[b, h, i] * ksp[j] < 2.0**52 else gdim
            t, e = _score_d(i, j, s[rr, jj], qn[b, h, i], knp[j], pr, bv, has_bias, gd)
            s[rr, jj], err[rr, jj] = t, e
            if t > top[rr]:
                top[rr] = t


@numba.jit(**_JIT)
def _d_block(b, h, i0, nb_rows, inputs, rule, target, results):
    """Double-precision first step of rows i0 .. i0 + nb_rows - 1 of plane (b, h), which share
    each load of K^T and V (each row's arithmetic is the same sequence as alone: no bit depends
    on the blocking). The keys run over the union of the rows' intervals; the blocked sums
    restart at multiples of SUM_BLOCK of the key index j itself. The argument records are
    those of :func:`forward_dd`."""
    _, _, v, _, _, _, _, vmax, vnorm, prm, kvh = inputs
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    want_w = target[1]
    status = results[3]
    g = kvh[h]
    pr = prm[b, h]
    gsum = pr[P_GAMMA_SUM]
    u = 1.01 * D.U
    vdim = v.shape[3]
    vp = v[b, g]  # the plane's (S, E) values
    lo, hi = _block_interval(rows_lo, rows_hi, b, i0, nb_rows)
    n = max(hi - lo, 0)
    s = np.zeros((ROW_BLOCK, n))
    err = np.zeros((ROW_BLOCK, n))
    state = np.zeros((ROW_BLOCK, n), np.int8)
    bad = np.zeros(ROW_BLOCK, np.bool_)
    top = np.full(ROW_BLOCK, -np.inf)
    _block_scores(b, h, i0, nb_rows, lo, hi, inputs, rule, (s, err, state, bad, top))
    has_sink, sink = pr[P_HAS_SINK] != 0.0, pr[P_SINK]
    if has_sink:  # the sink: one more logit in the max and in Z, no value
        for rr in range(nb_rows):
            top[rr] = max(top[rr], sink)
    nsum = np.zeros((ROW_BLOCK, vdim))
    nb = np.zeros((ROW_BLOCK, vdim))
    e2 = np.zeros(ROW_BLOCK)
    tiny_v = np.zeros((ROW_BLOCK, vdim))
    z = np.zeros(ROW_BLOCK)
    zb = np.zeros(ROW_BLOCK)
    tiny = np.zeros(ROW_BLOCK)
    rho = np.zeros(ROW_BLOCK)
    ex = np.zeros(ROW_BLOCK)
    use = np.zeros(ROW_BLOCK, dtype=np.bool_)
    for jj in range(n):
        j = lo + jj
        if (j % SUM_BLOCK) == 0:  # blocked sums: gamma_{B + S/B} instead of gamma_S
            for rr in range(nb_rows):
                z[rr] += zb[rr]
                zb[rr] = 0.0
                for e in range(vdim):
                    nsum[rr, e] += nb[rr, e]
                    nb[rr, e] = 0.0
        for rr in range(nb_rows):
            use[rr] = False
            if state[rr, jj] == 0:
                continue
            x = s[rr, jj] - top[rr]
            xe = (err[rr, jj] + u * abs(x)) * D.BOUND_SAFETY
            if want_w:
                s[rr, jj], err[rr, jj] = x, xe  # the shifted scores, kept for the weights
            if x < CUT:
                tiny[rr] += TINY
                if state[rr, jj] == 2:
                    for e in range(vdim):
                        tiny_v[rr, e] += abs(vp[j, e])
                continue
            rho[rr] = max(rho[rr], (D.EXP_D_REL + 2.0 * xe) * (1.0 + _RHO_MAX))
            ex[rr] = D.exp_d(x)
            zb[rr] += ex[rr]
            e2[rr] += ex[rr] * ex[rr]
            use[rr] = state[rr, jj] == 2
        for rr in range(nb_rows):
            if use[rr]:
                wgt = ex[rr]
                for e in range(vdim):
                    nb[rr, e] = D.fma(wgt, vp[j, e], nb[rr, e])
    zeros = np.zeros(vdim)
    for rr in range(nb_rows):
        i = i0 + rr
        if bad[rr]:
            status[b, h, i] = UNDECIDED
            continue
        if top[rr] == -np.inf:
            status[b, h, i] = EMPTY
            continue
        zr_ = z[rr] + zb[rr]
        if has_sink:  # the sink's term enters Z after the keys' blocks (gsum counts it)
            x = sink - top[rr]
            if x < CUT:
                tiny[rr] += TINY
            else:
                rho[rr] = max(
                    rho[rr], (D.EXP_D_REL + 2.0 * u * abs(x) * D.BOUND_SAFETY) * (1.0 + _RHO_MAX)
                )
                zr_ += D.exp_d(x)
        for e in range(vdim):
            nsum[rr, e] += nb[rr, e]
        if not rho[rr] <= _RHO_MAX:
            status[b, h, i] = UNDECIDED
            continue
        gg = gsum + rho[rr]
        zrad = (gg * zr_ * (1.0 + gsum) + tiny[rr]) * D.BOUND_SAFETY
        # sum_j e_j |v_je| <= min(vmax_e sum_j e_j, sqrt(sum_j e_j^2) ||v_e||) (the second
        # by Cauchy-Schwarz; the float sums are within gamma_S < 2**-27 of their values)
        acc = np.minimum(vmax[b, g] * (zr_ + zrad), math.sqrt(e2[rr]) * vnorm[b, g])
        nr = (gg * acc * (1.0 + gsum) * (1.0 + rho[rr])) * D.BOUND_SAFETY + TINY * tiny_v[rr]
        ok, lz_h, lz_l, lz_r = _finish_row(
            (b, h, i), top[rr], (zr_, 0.0, zrad), (nsum[rr], zeros, nr), pr, target, results
        )
        if ok and want_w:
            r0 = rows_lo[b, i] - lo
            r1 = rows_hi[b, i] - lo
            shifted = (s[rr, r0:r1], np.zeros(r1 - r0), err[rr, r0:r1])
            ok = _row_weights(
                (b, h, i),
                lo + r0,
                state[rr, r0:r1],
                shifted,
                (lz_h, lz_l, lz_r),
                target,
                results[2],
            )
        status[b, h, i] = OK if ok else UNDECIDED


if numba.config.DISABLE_JIT:  # pragma: no cover  (the intrinsic only compiles)

    def trailing_zero_count(n):
        """The number of trailing zero bits of the integer ``n`` != 0."""
        n = int(n)
        return (n & -n).bit_length() - 1

else:
    from numba.cpython.unsafe.numbers import trailing_zeros as trailing_zero_count


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def row_facts(x, bits, norms, scales, ok):
    """Per row of x (N, D) (``bits``: the same array viewed as int64), in a fixed order:
    ``ok`` (all finite, nonzero magnitudes in [SAFE_MIN, SAFE_MAX]), ``norms`` (an upper bound
    of the 2-norm: the float sum of squares errs by at most gamma_D < 2**-30 relative for
    D < 2**22, covered by the factor 1 + 2**-30; 2**-1000 covers underflow) and ``scales``
    (:func:`exactness_scales`: the exponent of the lowest set bit from the bit pattern)."""
    for n in prange(x.shape[0]):
        ok[n], norms[n], scales[n] = row_fact(x[n], bits[n])


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy")
def row_fact(a, bits):
    """``(ok, norm, scale)`` of one row ``a`` (D,) (``bits``: viewed as int64), as
    :func:`row_facts` states them."""
    frac_mask = (1 << 52) - 1
    good = True
    acc = 0.0
    low = 1 << 40
    for d in range(a.shape[0]):
        x = a[d]
        m = abs(x)
        if not (m == 0.0 or (m >= D.SAFE_MIN and m <= D.SAFE_MAX)):
            good = False
        acc += x * x
        if m != 0.0:
            w = bits[d]
            biased = (w >> 52) & 0x7FF
            mant = w & frac_mask
            if biased != 0:
                mant |= 1 << 52
            else:
                biased = 1  # subnormal: the same scale as the smallest normal
            tz = np.int64(trailing_zero_count(mant))  # the lowest set bit (mant != 0)
            low = min(low, biased - 1075 + tz)
    norm = math.sqrt(acc) * (1.0 + 2.0**-30) + 2.0**-1000
    g = 0 if low == 1 << 40 else low  # a zero row: its products are all 0
    return good, norm, np.ldexp(norm, -g)


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def forward_d(blocks, inputs, rule, target, results):
    """Double-precision first step (for targets of <= 24 bits) over ``blocks`` ((n, 4): b, h,
    first row, row count <= ROW_BLOCK), in parallel over the blocks of every plane: fma chains
    with gamma_n bounds (Higham 2002, eq. (3.5)) and
    :func:`refattn.exact.fast.doubledouble.exp_d`; the argument records are those of
    :func:`forward_dd`."""
    for r in prange(blocks.shape[0]):
        _d_block(
            blocks[r, 0], blocks[r, 1], blocks[r, 2], blocks[r, 3], inputs, rule, target, results
        )


# The per-key and per-row steps above, shared with the gathered-keys kernels
# (:mod:`refattn.exact.fast.gather_kernels`), which walk each row's listed keys instead of an
# interval: the same arithmetic and the same bounds.
RHO_MAX = _RHO_MAX
dot2_step = _dot2_step
row_dots = _row_dots
bias_in_range = _bias_in_range
score_dd = _score
score_d = _score_d
finish_row = _finish_row
row_weights = _row_weights
# the sigmoid first steps (:mod:`refattn.exact.fast.sigmoid_kernels`) score keys the same way
block_interval = _block_interval
block_scores = _block_scores
