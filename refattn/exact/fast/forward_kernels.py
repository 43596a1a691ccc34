"""The compiled first steps of the fast exact forward (:mod:`refattn.exact.fast.forward` states
the algorithm and its error bounds): the double-double step :func:`forward_dd`, one query row
per work item, and the double-precision step :func:`forward_d` for targets of at most 24 bits,
:data:`D_ROW_BLOCK` rows per work item (the inputs' row norms, ranges and exactness scales:
:mod:`refattn.exact.fast.facts`).

The kernels take argument records (tuples; :func:`forward_dd` lists them) rather than one
positional argument per array, as :mod:`refattn.kernels._args` does. Each row's arithmetic is
fixed by the shapes alone, so no bit depends on the thread count.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ...kernels._cpu_tiles import matmul_n
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
from .dense_dots import (
    EXACT_SCALE,
    KEY_TILE,
    block_dots,
    block_dots_mag,
    block_dots_unpadded,
    block_exact,
    block_interval,
    mag_error,
    plain_scores,
    rows_interval,
)
from .doubledouble import EXP_FAST_REL, exp_dd_fast
from .forward_exps import CUT, RHO_MAX, SUM_BLOCK, TINY, cut_values, plain_exps, plain_row
from .rounding_decision import decide_one, decide_quick, half_gap

__all__ = [
    "block_interval",
    "forward_dd",
    "forward_d",
    "CUT",
    "TINY",
    "WEIGHT_TINY_ARG",
    "WEIGHT_ZERO_ARG",
    "SUM_BLOCK",
    "ROW_BLOCK",
    "D_ROW_BLOCK",
    "KEY_TILE",
    "OK",
    "EMPTY",
    "UNDECIDED",
]


#: Weights with ``x - log Z + err < WEIGHT_TINY_ARG`` are positive and below 2**-288: they
#: round to +0 in float32, float16 and bfloat16; below WEIGHT_ZERO_ARG (< 2**-1154) they round
#: to +0 in float64 too.
WEIGHT_TINY_ARG = -200.0
WEIGHT_ZERO_ARG = -800.0
#: Query rows (query heads in the gathered-keys kernels) one work item processes together.
ROW_BLOCK = 8
#: Query rows the dense double-precision step processes together (cache reuse only: every dot
#: product is the same fma chain over D): each K^T chunk and V block is read once per 32 rows.
D_ROW_BLOCK = 32
#: Work lanes of the double-precision step: lane w takes blocks w, w + WORKERS, ... with one
#: scratch (which rows a lane takes changes no bit: each row's arithmetic is its own).
WORKERS = 64

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
    want_lse, want_w, p, emin, maxf = target
    out, lse = results[0], results[1]
    keep_hi, keep_lo, keep_err = prm[P_KEEP_HI], prm[P_KEEP_LO], prm[P_KEEP_ERR]
    if not zr < 0.5 * zh:
        return False, 0.0, 0.0, 0.0
    lh, ll, lerr = 0.0, 0.0, 0.0
    if want_lse or want_w:  # log Z serves lse and the weights alone
        lh, ll, lerr = D.log_dd(zh, zl)
        lerr = lerr + (zr / zh) / (1.0 - zr / zh)
    ok = True
    if want_lse:
        gh, gl = D.dd_add_d(lh, ll, top)
        value, dec = decide_quick(
            gh, gl, (lerr + D.DD_REL * abs(gh)) * D.BOUND_SAFETY, p, emin, maxf
        )
        lse[b, h, i] = value
        ok = ok and dec
    zlow = zh - zr
    for e in range(ns.shape[0]):
        nh, nl = D.two_sum(ns[e], nc[e])
        oh, ol = D.dd_div(nh, nl, zh, zl)
        orad = (nr[e] + abs(oh) * 1.0000001 * zr) / zlow + D.DD_REL * abs(oh)
        ph, pl = D.dd_mul(oh, ol, keep_hi, keep_lo)
        orad = orad * (abs(keep_hi) + keep_err) + abs(oh) * keep_err + D.DD_REL * abs(ph)
        value, dec = decide_quick(ph, pl, orad * D.BOUND_SAFETY, p, emin, maxf)
        out[b, h, i, e] = value
        ok = ok and dec
    return ok, lh, ll, lerr * D.BOUND_SAFETY


@numba.jit(**_JIT)
def _finish_out_d(index, z, sums, prm, target, out):
    """out = N / Z * keep_scale of the double-precision step from double N and Z: the quotient
    and the product by keep_hi each rounded once (``u`` times the result's magnitude added to
    the radius: Higham 2002, eq. (2.5)), ``|N/Z - n/z| <= (nr + |n/z| zr) / (z - zr)`` and
    ``|keep - keep_hi| <= |keep_lo| + keep_err``; decided first by decide_quick's test in a
    branch-free loop, then element by element by decide_one where that test fails. ``z`` = (Z,
    radius), ``sums`` = (N, N radius, and (E,) scratch for the products, their radii and the
    test's flags). Returns whether every element is decided. (When the quick test cannot apply,
    ``a`` below ``low`` -- y zero or subnormal -- :func:`half_gap` reads a meaningless value
    whose test result is discarded.)"""
    b, h, i = index
    zh, zr = z
    ns, nr, xs, rads, flags = sums
    _, _, p, emin, maxf = target
    keep_hi, keep_lo, keep_err = prm[P_KEEP_HI], prm[P_KEEP_LO], prm[P_KEEP_ERR]
    kabs = abs(keep_hi) + abs(keep_lo) + keep_err
    klo = abs(keep_lo) + keep_err
    zlow = zh - zr
    split = float(1 << (53 - p)) + 1.0  # Veltkamp's constant (decide_quick)
    low_gap, high_gap = math.ldexp(1.0, -p), math.ldexp(1.0, -p - 1)  # half_gap's factors
    low, high, quick = math.ldexp(1.0, emin + 1), 0.5 * maxf, p <= 51
    failed = 0
    orow = out[b, h, i]
    for e in range(ns.shape[0]):  # branch-free (& of the tests, not ``and``): it vectorises
        oh = ns[e] / zh
        orad = (nr[e] + abs(oh) * 1.0000001 * zr) / zlow + D.U * abs(oh)
        x = oh * keep_hi
        r = (orad * kabs + abs(oh) * klo + D.U * abs(x)) * D.BOUND_SAFETY
        t = split * x
        y = t - (t - x)
        a = abs(x)
        test = (abs(x - y) + r) * (1.0 + 2.0**-50) < half_gap(y, low_gap, high_gap)
        good = quick & (a >= low) & (a <= high) & test
        orow[e] = y
        xs[e], rads[e] = x, r
        flag = np.int8(1) if good else np.int8(0)
        flags[e] = flag
        failed += 1 - np.int64(flag)
    ok = True
    if failed:
        for e in range(ns.shape[0]):
            if flags[e] == 0:
                value, dec = decide_one(xs[e], 0.0, rads[e], p, emin, maxf)
                out[b, h, i, e] = value
                ok = ok and dec
    return ok


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
        if ah < D.EXP_MIN_ARG + 1.0 or ae > RHO_MAX:
            ok = False
            continue
        eh, el = exp_dd_fast(ah, al)
        value, dec = decide_quick(
            eh,
            el,
            (EXP_FAST_REL + 2.0 * ae) * (1.0 + RHO_MAX) * eh * D.BOUND_SAFETY,
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
    vdim = results[0].shape[3]
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
        rho = max(rho, (EXP_FAST_REL + 2.0 * xe) * (1.0 + RHO_MAX))
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
                rho, (EXP_FAST_REL + 2.0 * D.DD_REL * abs(xh) * D.BOUND_SAFETY) * (1.0 + RHO_MAX)
            )
            eh, el = exp_dd_fast(xh, xl)
            zs, es = D.two_sum(zs, eh)
            zc += es + el
    if not rho <= RHO_MAX:
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
def _block_scores(b, h, i0, nb_rows, lo, hi, inputs, rule, work):
    """:func:`_block_scores_d` of the rows i0 .. i0 + nb_rows - 1 with the a-priori
    dot-product bounds (``mag`` False)."""
    ids = np.arange(i0, i0 + nb_rows)
    _block_scores_d(b, h, ids, nb_rows, (lo, hi), inputs, rule, work, False)


@numba.jit(**_JIT)
def _block_scores_d(b, h, ids, nb_rows, keys, inputs, rule, work, mag):
    """The scores (t, err) of the rows ``ids[:nb_rows]`` of plane (b, h) over the keys
    [lo, hi) in place of their dot products, with each key's state (0 excluded, 1 dropped,
    2 kept), each row's maximum score and whether a bias value is out of the first steps'
    range: ``work`` = (s, err, state, bad, top, qa) (:func:`_d_block`), ``keys`` = (lo, hi).
    With ``mag`` the dot products' error bounds come from their magnitude sums
    (:func:`refattn.exact.fast.dense_dots.block_dots_mag`) unless every chain of the block is
    proven exact; else from ``gamma_D ||q_i|| ||k_j||``. With ``qa`` of zero
    columns (a caller whose K^T has no KEY_TILE padding and whose ``s`` has hi - lo columns:
    the sigmoid step) the dot products are single fma chains key by key with the bound
    ``gamma_D ||q_i|| ||k_j||``, and every kept key's state is written (no all-kept shortcut)."""
    q, kT, _, qn, kn, qs, ks, _, _, prm, kvh = inputs
    rows_lo, rows_hi, has_mask, has_bias, has_drop = (
        rule[R_ROWS_LO],
        rule[R_ROWS_HI],
        rule[R_HAS_MASK],
        rule[R_HAS_BIAS],
        rule[R_HAS_KEEP],
    )
    s, err, state, bad, top, qa = work
    g = kvh[h]
    pr = prm[b, h]
    gdim = pr[P_GAMMA_DIM]
    knp = kn[b, g]
    ksp = ks[b, g]
    dim = q.shape[3]
    lo, hi = keys
    rule_arrays = has_mask or has_bias or has_drop
    if qa.shape[1] == 0:  # K^T without KEY_TILE padding (the sigmoid step): the keys one by one
        block_dots_unpadded(q[b, h], kT[b, g], ids, nb_rows, lo, hi, s)
    else:
        npad = max(KEY_TILE, -(-(hi - lo) // KEY_TILE) * KEY_TILE)
        mag = mag and not block_exact(qs[b, h], ksp, ids, nb_rows, lo, hi)
        if mag:  # err holds the magnitude sums until the scores replace them
            block_dots_mag(q[b, h], kT[b, g], ids, nb_rows, lo, npad, s, err)
        else:
            block_dots(q[b, h], kT[b, g], ids, nb_rows, lo, npad, s, qa)
        if not rule_arrays and pr[P_SOFTCAP] == 0.0 and pr[P_SLOPE] == 0.0:
            rows = (rows_lo[b], rows_hi[b], qn[b, h], qs[b, h])
            plain_scores(ids, nb_rows, lo, rows, pr, (knp, ksp, mag, dim), work)
            return
    for rr in range(nb_rows):
        i = ids[rr]
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
            derr = 0.0
            if not qs[b, h, i] * ksp[j] < EXACT_SCALE:
                derr = mag_error(err[rr, jj], dim) if mag else gdim * qn[b, h, i] * knp[j]
            t, e = _score_d(i, j, s[rr, jj], derr, 1.0, pr, bv, has_bias, 1.0)
            s[rr, jj], err[rr, jj] = t, e
            if t > top[rr]:
                top[rr] = t


@numba.jit(**_JIT)
def _d_exps(ids, nb_rows, lo, hi, top, block_rows, work, sums):
    """Exponentials of the block's rows into ``p`` (0 for keys that carry no value) and each row's
    Z (blocked: a partial sum per SUM_BLOCK keys, restarting at multiples of SUM_BLOCK of the
    key index j), sum of e^2, tiny count and |v| sum, and rho. ``block_rows`` = (rows_lo,
    rows_hi of the batch row, want_w, plane values (S, E), whether every key of the rows'
    intervals is kept: then :func:`~refattn.exact.fast.forward_exps.plain_exps`); ``work`` = (s,
    err, state, p, and the scratch rows xs, ex, use); p is zero outside each row's interval up
    to hi - lo; ``sums`` = (z, e2, tiny, tiny_v, rho). Per row: the shifted scores and their
    radii (keys below CUT or excluded get a dummy argument 0 and use 0), then the exponentials
    in one branch-free loop (:func:`refattn.exact.fast.doubledouble.exp_d_core`), then the sums
    in key order, where an unused key adds an exact 0."""
    rows_lo, rows_hi, want_w, vp, all_kept = block_rows
    s, err, state, p, xs, ex, use = work
    z, e2, tiny, tiny_v, rho = sums
    u = 1.01 * D.U
    vdim = tiny_v.shape[1]
    for rr in range(nb_rows):
        i = ids[rr]
        r0, r1 = rows_lo[i] - lo, rows_hi[i] - lo
        if all_kept:
            p[rr, :r0] = 0.0
            p[rr, r1 : hi - lo] = 0.0
            plain_exps(rr, r0, r1, lo, (top[rr], want_w), (s, err, p), (z, e2, tiny, rho))
            if tiny[rr] > 0.0:
                cut_values(rr, r0, r1, lo, s, vp, tiny_v)
            continue
        for jj in range(r0, r1):
            use[jj] = 0
            xs[jj] = 0.0
            st = state[rr, jj]
            if st == 0:
                continue
            x = s[rr, jj] - top[rr]
            xe = (err[rr, jj] + u * abs(x)) * D.BOUND_SAFETY
            if want_w:
                s[rr, jj], err[rr, jj] = x, xe  # the shifted scores, kept for the weights
            if x < CUT:
                tiny[rr] += TINY
                if st == 2:
                    for e in range(vdim):
                        tiny_v[rr, e] += abs(vp[lo + jj, e])
                continue
            rho[rr] = max(rho[rr], (D.EXP_D_REL + 2.0 * xe) * (1.0 + RHO_MAX))
            xs[jj] = x
            use[jj] = st
        for jj in range(r0, r1):
            ex[jj] = D.exp_d_core(xs[jj])  # CUT <= x <= 0 (0 a dummy): in exp_d's domain
        zb = 0.0
        zr = z[rr]
        sq = e2[rr]
        prow = p[rr]
        prow[:r0] = 0.0
        prow[r1 : hi - lo] = 0.0
        for jj in range(r0, r1):
            if ((lo + jj) % SUM_BLOCK) == 0:  # blocked sums: gamma_{B + S/B}, not gamma_S
                zr += zb
                zb = 0.0
            uj = use[jj]
            e = ex[jj] if uj != 0 else 0.0
            zb += e
            sq += e * e
            prow[jj] = e if uj == 2 else 0.0
        z[rr] = zr + zb
        e2[rr] = sq


@numba.jit(**_JIT)
def _d_values(lo, hi, nb_rows, p, vp, sums):
    """nsum[rr, :] = sum over the keys [lo, hi) of p[rr, j - lo] v_j, blocked: each SUM_BLOCK
    block of the key index j is one fma chain from +0 in key order (the register tiles of
    :func:`refattn.kernels._cpu_tiles.matmul_n`, lanes over features), added to nsum at the
    block's end; a zero weight adds exactly nothing. ``sums`` = (nsum, nb scratch), both
    (D_ROW_BLOCK, E padded), of which the rows < nb_rows are written."""
    nsum, nb = sums
    epad = nsum.shape[1]
    nsum[:nb_rows] = 0.0  # matmul_n reads and writes the rows < nb_rows alone
    c0 = lo
    while c0 < hi:
        c1 = min(hi, (c0 // SUM_BLOCK + 1) * SUM_BLOCK)
        nb[:nb_rows] = 0.0
        matmul_n(p[:, c0 - lo :], vp[c0:c1], c1 - c0, nb_rows, epad, nb)
        for rr in range(nb_rows):
            for e in range(epad):
                nsum[rr, e] += nb[rr, e]
        c0 = c1


@numba.jit(**_JIT)
def _d_scratch(inputs):
    """Scratch of :func:`_d_block` for any block of the call: (s, err, state, p) (D_ROW_BLOCK,
    S + KEY_TILE), (xs, ex, use) (S + KEY_TILE,), qa (D, D_ROW_BLOCK), (nsum, nb) (D_ROW_BLOCK, E
    padded)."""
    q, kT, v = inputs[0], inputs[1], inputs[2]
    keys = kT.shape[3]
    epad = v.shape[3]
    return (
        np.empty((D_ROW_BLOCK, keys)),
        np.empty((D_ROW_BLOCK, keys)),
        np.zeros((D_ROW_BLOCK, keys), np.int8),
        np.zeros((D_ROW_BLOCK, keys)),
        np.zeros(keys),
        np.empty(keys),
        np.zeros(keys, np.int8),
        np.zeros((q.shape[3], D_ROW_BLOCK)),
        np.zeros((D_ROW_BLOCK, epad)),
        np.zeros((D_ROW_BLOCK, epad)),
    )


@numba.jit(**_JIT)
def _fused(rule, pr, want_w, qa):
    """Whether a block takes :func:`_fused_rows`: every key of the rows' intervals kept, no
    softcap or ALiBi, the weights not asked for, K^T padded (``qa`` has columns)."""
    arrays = rule[R_HAS_MASK] or rule[R_HAS_BIAS] or rule[R_HAS_KEEP]
    plain = pr[P_SOFTCAP] == 0.0 and pr[P_SLOPE] == 0.0
    return not arrays and plain and not want_w and qa.shape[1] > 0


@numba.jit(**_JIT)
def _fused_rows(b, h, ids, nb_rows, keys, inputs, rule, work, sums, mag):
    """The dot products of the block (:func:`refattn.exact.fast.dense_dots.block_dots`, or
    with ``mag`` and some chain not proven exact :func:`~refattn.exact.fast.dense_dots.
    block_dots_mag`), then each row's scores, maximum, exponentials and sums by
    :func:`~refattn.exact.fast.forward_exps.plain_row` while the row is in cache (the same
    bits as :func:`_block_scores_d` followed by :func:`_d_exps`), and |v| of the keys below
    CUT. ``work`` = (s, err, p, qa, top): ``top`` gets each row's maximum score, the sink
    included; ``sums`` = (z, e2, tiny, tiny_v, rho)."""
    q, kT, v, qn, kn, qs, ks, _, _, prm, kvh = inputs
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    s, err, p, qa, top = work
    z, e2, tiny, tiny_v, rho = sums
    g = kvh[h]
    pr = prm[b, h]
    lo, hi = keys
    npad = max(KEY_TILE, -(-(hi - lo) // KEY_TILE) * KEY_TILE)
    exact = block_exact(qs[b, h], ks[b, g], ids, nb_rows, lo, hi)
    mag = mag and not exact
    if mag:  # err holds the magnitude sums
        block_dots_mag(q[b, h], kT[b, g], ids, nb_rows, lo, npad, s, err)
    else:
        block_dots(q[b, h], kT[b, g], ids, nb_rows, lo, npad, s, qa)
    sink = pr[P_SINK] if pr[P_HAS_SINK] != 0.0 else -np.inf
    key_facts = (kn[b, g], ks[b, g], mag, q.shape[3], exact)
    for rr in range(nb_rows):
        i = ids[rr]
        r0, r1 = rows_lo[b, i] - lo, rows_hi[b, i] - lo
        p[rr, :r0] = 0.0
        p[rr, r1 : hi - lo] = 0.0
        row = (qn[b, h, i], qs[b, h, i], sink)
        m = plain_row(rr, r0, r1, lo, row, key_facts, pr, (s, err, p), (z, e2, tiny, rho))
        top[rr] = m
        if tiny[rr] > 0.0:  # |v| of the keys below CUT (x = t - m, recomputed)
            for jj in range(r0, r1):
                if s[rr, jj] * pr[P_SCALE_HI] - m < CUT:
                    for e in range(tiny_v.shape[1]):
                        tiny_v[rr, e] += abs(v[b, g, lo + jj, e])


@numba.jit(**_JIT)
def _d_block(b, h, ids, nb_rows, inputs, rule, target, results, scratch, redo):
    """Double-precision first step of the rows ``ids`` (nb_rows, ascending) of plane (b, h),
    which share each load of K^T and V (each row's arithmetic is the same sequence as alone:
    no bit depends on the blocking). The keys run over the union of the rows' intervals; the
    blocked sums restart at multiples of SUM_BLOCK of the key index j itself. The argument
    records are those of :func:`forward_dd` (``v`` padded with zero features to a multiple of
    :data:`KEY_TILE`, ``kT`` with KEY_TILE zero keys past S); ``scratch``: :func:`_d_scratch`,
    reused from block to block (read only where written for this block); ``redo``: the
    arguments of :func:`forward_d`'s second pass."""
    _, _, v, _, _, _, _, vmax, vnorm, prm, kvh = inputs
    mag, vabs, _ = redo
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    want_w = target[1]
    status = results[3]
    vdim = results[0].shape[3]
    g = kvh[h]
    pr = prm[b, h]
    gsum = pr[P_GAMMA_SUM]
    u = 1.01 * D.U
    vp = v[b, g]  # the plane's (S, E padded) values
    lo, hi = rows_interval(rows_lo, rows_hi, b, ids)
    hi = max(hi, lo)
    s, err, state, p, xs, ex, use, qa, nsum, nb = scratch
    bad = np.zeros(D_ROW_BLOCK, np.bool_)
    top = np.full(D_ROW_BLOCK, -np.inf)
    has_sink, sink = pr[P_HAS_SINK] != 0.0, pr[P_SINK]
    z = np.zeros(D_ROW_BLOCK)
    e2 = np.zeros(D_ROW_BLOCK)
    tiny = np.zeros(D_ROW_BLOCK)
    tiny_v = np.zeros((D_ROW_BLOCK, vdim))
    rho = np.zeros(D_ROW_BLOCK)
    sums = (z, e2, tiny, tiny_v, rho)
    if _fused(rule, pr, want_w, qa):  # scores and exponentials row by row from the dots
        work = (s, err, p, qa, top)
        _fused_rows(b, h, ids, nb_rows, (lo, hi), inputs, rule, work, sums, mag)
    else:
        work = (s, err, state, bad, top, qa)
        _block_scores_d(b, h, ids, nb_rows, (lo, hi), inputs, rule, work, mag)
        all_kept = not (rule[R_HAS_MASK] or rule[R_HAS_BIAS] or rule[R_HAS_KEEP])
        if has_sink:  # the sink: one more logit in the max and in Z, no value
            for rr in range(nb_rows):
                top[rr] = max(top[rr], sink)
        _d_exps(
            ids,
            nb_rows,
            lo,
            hi,
            top,
            (rows_lo[b], rows_hi[b], want_w, vp, all_kept),
            (s, err, state, p, xs, ex, use),
            sums,
        )
    _d_values(lo, hi, nb_rows, p, vp, (nsum, nb))
    asum = np.empty((0, 0))
    if mag:  # A_e = sum_j e_j |v_je| by the same blocked sums, in its own scratch
        asum = np.zeros_like(nsum)
        _d_values(lo, hi, nb_rows, p, vabs[b, g], (asum, np.zeros_like(nb)))
    nr, xs_, rads, flags = np.empty(vdim), np.empty(vdim), np.empty(vdim), np.empty(vdim, np.int8)
    for rr in range(nb_rows):
        i = ids[rr]
        if bad[rr]:
            status[b, h, i] = UNDECIDED
            continue
        if top[rr] == -np.inf:
            status[b, h, i] = EMPTY
            continue
        zr_ = z[rr]
        if has_sink:  # the sink's term enters Z after the keys' blocks (gsum counts it)
            x = sink - top[rr]
            if x < CUT:
                tiny[rr] += TINY
            else:
                rho[rr] = max(
                    rho[rr], (D.EXP_D_REL + 2.0 * u * abs(x) * D.BOUND_SAFETY) * (1.0 + RHO_MAX)
                )
                zr_ += D.exp_d(x)
        if not rho[rr] <= RHO_MAX:
            status[b, h, i] = UNDECIDED
            continue
        gg = gsum + rho[rr]
        zrad = (gg * zr_ * (1.0 + gsum) + tiny[rr]) * D.BOUND_SAFETY
        # sum_j e_j |v_je| <= min(vmax_e sum_j e_j, sqrt(sum_j e_j^2) ||v_e||) (the second
        # by Cauchy-Schwarz; the float sums are within gamma_S < 2**-27 of their values)
        zsum, root, grow = zr_ + zrad, math.sqrt(e2[rr]), (1.0 + gsum) * (1.0 + rho[rr])
        for e in range(vdim):
            acc = min(vmax[b, g, e] * zsum, root * vnorm[b, g, e])
            if mag:  # its blocked float sum of nonnegative terms is within gamma of A_e:
                # the value is at most the sum / (1 - gsum) <= the sum (1 + 4 gsum)
                acc = min(acc, asum[rr, e] * (1.0 + 4.0 * gsum))
            nr[e] = (gg * acc * grow) * D.BOUND_SAFETY + TINY * tiny_v[rr, e]
        # lse (and log Z for the weights) by _finish_row, given no features; then out
        ok, lz_h, lz_l, lz_r = _finish_row(
            (b, h, i), top[rr], (zr_, 0.0, zrad), (nr[:0], nr[:0], nr[:0]), pr, target, results
        )
        if ok:
            sums = (nsum[rr, :vdim], nr, xs_, rads, flags)
            ok = _finish_out_d((b, h, i), (zr_, zrad), sums, pr, target, results[0])
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


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def forward_d(blocks, inputs, rule, target, results, redo):
    """Double-precision first step (for targets of <= 24 bits) over ``blocks`` ((n, 4): b, h,
    first row, row count <= D_ROW_BLOCK), in parallel over the blocks of every plane: fma chains
    with gamma_n bounds (Higham 2002, eq. (3.5)) and
    :func:`refattn.exact.fast.doubledouble.exp_d`; the argument records are those of
    :func:`forward_dd`. ``redo`` = (mag, |V|, row list): with ``mag`` (the second pass, over
    the rows the first left undecided) the dot products' bounds come from their magnitude sums
    (:mod:`refattn.exact.fast.dense_dots`) and ``A_e = sum_j e_j |v_je|`` is summed from |V|
    ((B, K, S, E padded), else unread) by the same blocked sums as N; with a nonempty row list
    (int64) a block's third column is the offset of its rows in that list (ascending rows of
    its plane, not necessarily consecutive), else its first row."""
    count = blocks.shape[0]
    workers = min(count, WORKERS)
    for w in prange(workers):  # worker w takes blocks w, w + workers, ...: one scratch each
        scratch = _d_scratch(inputs)
        for r in range(w, count, workers):
            b, h, ids, nb_rows = block_rows(blocks, r, redo[2])
            _d_block(b, h, ids, nb_rows, inputs, rule, target, results, scratch, redo)


@numba.jit(**_JIT)
def block_rows(blocks, r, row_list):
    """(b, h, rows, row count) of block ``r`` of ``blocks`` ((n, 4): b, h, first, count):
    its rows are consecutive from the first, or with a nonempty ``row_list`` (int64) entries
    first .. first + count - 1 of that list."""
    b, h, i0, nb_rows = blocks[r, 0], blocks[r, 1], blocks[r, 2], blocks[r, 3]
    if row_list.shape[0] > 0:
        return b, h, row_list[i0 : i0 + nb_rows], nb_rows
    return b, h, np.arange(i0, i0 + nb_rows), nb_rows


# The per-key and per-row steps above, shared with the gathered-keys kernels
# (:mod:`refattn.exact.fast.gather_kernels`), which walk each row's listed keys instead of an
# interval: the same arithmetic and the same bounds.

dot2_step = _dot2_step
row_dots = _row_dots
bias_in_range = _bias_in_range
score_dd = _score
score_d = _score_d
finish_row = _finish_row
row_weights = _row_weights
# the sigmoid first steps (:mod:`refattn.exact.fast.sigmoid_kernels`) score keys the same way
# and the refined step (:mod:`refattn.exact.fast.forward_refine`) runs the per-row pieces
block_scores = _block_scores
# and the dense sigmoid step (:mod:`refattn.exact.fast.sigmoid_dense`) the dense pieces
block_scores_d = _block_scores_d
d_values = _d_values
