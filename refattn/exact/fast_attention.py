"""Fast exact attention forward: a compiled double-double first step, the referee for the rest.

``precision="exact"`` means every element of out, lse and weights is the exact real result
rounded once to ``out_dtype``. This module decides almost every element with a Numba kernel in
double-double arithmetic (:mod:`refattn.exact._dd`) that carries a rigorous error bound, and
sends the rows it cannot decide to the arbitrary-precision engine
(:class:`refattn.exact.attention.ExactForward`, "the referee") -- Ziv's strategy with a compiled
first step. The results are bit-identical to the referee's.

Per query row i of a (batch, head) plane, streaming: no (L, S) array is ever built (only the
weights, when asked for, are an (L, S) output). Working memory is the float64 inputs, their
row norms, O(L) per plane of status and results, and O(S) per row in flight. The allowed set
is read on the fly (:func:`allowed_rule`, :mod:`refattn.exact._stream`): a key interval
``lo_i <= j < hi_i`` per row from causal, window and key length, and, only where the caller
passed them, the mask, ``bias == -inf`` and the dropout keep-mask read from their
un-broadcast arrays; it equals :meth:`AttentionSpec.allowed`, the one rule of
:mod:`refattn.masks`. The keys outside the interval are never visited, so causal rows cost
about half. The first steps run in parallel over the rows (blocks of :data:`ROW_BLOCK` rows)
of every plane at once -- a decode call (L = 1, many heads) is as parallel as a prefill -- and
each row's arithmetic is fixed by the shapes alone, so no bit depends on the thread count.

1. Scores. ``q_i . k_j`` is summed as ``(s, c)`` with TwoProd and TwoSum (Dot2-like):
   ``|s + c - q_i . k_j| <= dot_bound(D) |q_i|.|k_j| <= dot_bound(D) ||q_i|| ||k_j||``
   (Cauchy-Schwarz; the norms are float upper bounds). Inputs of every dtype are taken at their
   exact binary values; TwoProd is exact because nonzero magnitudes are kept in
   [SAFE_MIN, SAFE_MAX] (other planes go to the referee). Then ``t = s_dd * scale_dd``
   (``scale_dd`` a double-double with a bound from exact integers), softcap
   ``c tanh(t / c)`` (tanh is 1-Lipschitz, ``TANH_ABS`` absolute), ``+ bias``, ``+ ALiBi``
   (``-slope |i + o_b - j|`` by TwoProd, exact; none on a folded sink's key). Each
   double-double operation adds ``DD_REL |result|`` to an absolute error bound ``delta_ij``
   of the score.
2. Shift. ``m_i = max_j hi(t_ij)`` over the allowed keys (any number works: it cancels in
   ``out = N / Z`` and ``lse = m + log Z`` adds it back), ``x_ij = t_ij - m_i`` with
   ``|error| <= delta_ij + DD_REL |x_ij|``. A sink ``sigma_h`` (``spec.sinks``) is one more
   logit, exact, in the max and in Z (added after the keys, and counted in the sums' bounds)
   with no value: a row with no allowed key holds it alone (out 0, lse = sigma_h), and the
   weights stay those of the keys. Nothing is folded: the referee alone folds the sink into
   one more key (:func:`refattn.spec.fold`), for the rows it is given.
3. Exponentials. ``e_ij = exp_dd_fast(x_ij)`` (``x <= 0``: a 1024-entry table) with relative error
   ``rho_ij <= (EXP_FAST_REL + 2 err(x_ij)) (1 + 2**-20)`` (``|e^d - 1| <= 2|d|`` for |d| <= 1;
   rows with an error above 2**-20 are left to the referee). Keys with ``x < CUT`` (-400)
   have ``0 <= e < TINY`` (2**-575) and enter as that absolute radius only.
4. Sums. ``Z = sum_j e_ij`` and ``N_e = sum_j kappa_ij e_ij v_je`` with TwoProd/TwoSum and a
   compensation word: ``|N - N^| <= (dot_bound(2S) + rho_i) A_e + TINY sum |v_je|`` with
   ``A_e = sum_j e_ij |v_je| <= max_j |v_je| min(Z + rZ, (1 + rho_i)(1 + 2**-20) zv)``
   (``rho_i = max_j rho_ij``; ``zv`` the float sum of the valued keys' ``hi(e_ij)``, which
   is what bounds N when a sink holds most of Z; the same for Z with A = Z).
5. Results. ``out = N / Z * keep_scale`` (double-double division; the quotient of enclosures
   ``(rN + |N/Z| rZ) / (Z - rZ)``), ``lse = m + log_dd(Z)`` (``-log(1 - rZ/Z)`` for Z's
   radius), ``w_ij = exp_dd_fast(x_ij - log Z)``.
6. Rounding decision. :func:`refattn.exact.rounding.decide_dd` (compiled, per element in the
   kernels: ``decide_one``) rounds both ends of each enclosure exactly; where they differ (a
   rounding boundary within the radius: ties at the max, weights exactly 1/n on a midpoint,
   exact zeros, overflow) the whole row goes to the referee, restricted to those rows
   (:func:`row_spec`: a spec of the row run, with the offset shifted so causal/window/ALiBi
   use the original row indices).

For targets of at most 24 bits (float32, float16, bfloat16) a cheaper double-precision first
step runs before the double-double one (:func:`_forward_d`): the dot products are fma chains
(``|error| <= gamma_D |q_i|.|k_j|``, Higham 2002, eq. (3.5); zero where
:func:`exactness_scales` proves every partial sum representable, as for float16/bfloat16
inputs), each later rounding is bounded by ``1.01 u |result|``, ``e = exp_d(x)`` has relative
error ``EXP_D_REL`` (2**-48.5), and the sums over keys are blocked (:data:`SUM_BLOCK` keys per
block, ``gamma_{B + S/B}``, Higham 2002, sec. 4.2) with ``|N - N^| <= (gamma + rho) A_e``,
``A_e <= min(max_j |v_je| Z, (sum_j e_j^2)^(1/2) ||v_e||)`` (Cauchy-Schwarz; no second pass
over V). Its radii are about 2**-40 relative to ``sum_j w_j |v_je|``, ample for 24-bit
targets; the rows it leaves undecided (a few percent for float32 at S = 4096) run again in
double-double, and only then go to the referee. Float64 targets use the double-double step
alone.

Planes with NaN/Inf in q, k or v, magnitudes outside [SAFE_MIN, SAFE_MAX], or a softcap or ALiBi
slope outside it go to the referee whole; rows with an allowed bias outside that range, and
empty rows, go to the referee row by row; their semantics are not re-derived.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numba
import numpy as np
from numba import prange

from ..spec import AttentionSpec
from . import _dd as D
from ._dd_extra import EXP_FAST_REL, decide_one, exp_dd_fast
from ._stream import compact_view, key_intervals
from .attention import exact_forward
from .rounding import format_of

__all__ = [
    "fast_exact_forward",
    "fallback_stats",
    "row_spec",
    "rounds_to_zero",
    "exactness_scales",
    "allowed_rule",
    "rule_allowed",
    "CUT",
    "TINY",
    "WEIGHT_TINY_ARG",
    "WEIGHT_ZERO_ARG",
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

_OK, _EMPTY, _UNDECIDED = 0, 1, 2
_LAST_STATS: dict = {}

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")


# ------------------------------------------------------------------------------ kernels
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
def _key_state(b, h, i, j, mk, mstr, bs, bstr, dr, dstr, has_mask, has_bias, has_drop):
    """(state, bias) of key j inside row i's structural interval: state 0 excluded (mask, or
    bias -inf), 1 allowed, 2 allowed and kept (dropout); the bias value (0 without bias).
    The one rule of :meth:`refattn.spec.AttentionSpec.allowed`, read from the compact
    (un-broadcast)
    arrays of :func:`refattn.exact._stream.compact_view`."""
    if has_mask and not mk[b * mstr[0] + h * mstr[1] + i * mstr[2] + j * mstr[3]]:
        return 0, 0.0
    bv = 0.0
    if has_bias:
        bv = bs[b * bstr[0] + h * bstr[1] + i * bstr[2] + j * bstr[3]]
        if bv == -np.inf:
            return 0, 0.0
    if has_drop and not dr[b * dstr[0] + h * dstr[1] + i * dstr[2] + j * dstr[3]]:
        return 1, bv
    return 2, bv


@numba.jit(**_JIT)
def _bias_in_range(x):
    """A bias value the first steps take: zero, or a magnitude in [SAFE_MIN, SAFE_MAX]."""
    return x == 0.0 or (abs(x) >= D.SAFE_MIN and abs(x) <= D.SAFE_MAX)


@numba.jit(**_JIT)
def _score(i, j, sj, cj, qn_i, kn_j, prm, bv, has_bias):
    """(t_hi, t_lo, err) of the score of key j from its dot product (s, c)."""
    scale_hi, scale_lo, scale_err, dot_rel, cap, slope, offset, alibi_keys = (
        prm[0],
        prm[1],
        prm[2],
        prm[3],
        prm[4],
        prm[5],
        prm[6],
        prm[13],
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
def _finish_row(b, h, i, top, zh, zl, zr, ns, nc, nr, prm, want_lse, p, emin, maxf, out, lse):
    """lse = m + log Z and out = N / Z * keep_scale with their radii (module docstring, 5),
    rounded to the target (6). Returns (decided, log Z hi, lo, radius)."""
    keep_hi, keep_lo, keep_err = prm[8], prm[9], prm[10]
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
def _row_weights(b, h, i, lo, state, x_h, x_l, x_r, lz_h, lz_l, lz_r, p, emin, maxf, w):
    """w_ij = exp(x_ij - log Z_i) rounded to the target for the keys lo <= j < lo + n (entry
    j - lo of the row arrays); excluded keys weigh exactly +0. Weights with
    ``x - log Z + err < WEIGHT_TINY_ARG`` are in (0, 2**-288) and round to +0 below 53 bits;
    below ``WEIGHT_ZERO_ARG`` (< 2**-1154) in float64 too. Returns whether all are decided."""
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
def _dd_row(
    b,
    h,
    i,
    q,
    kT,
    v,
    qn,
    kn,
    vmax,
    prm,
    kvh,
    lohi,
    mk,
    mstr,
    bs,
    bstr,
    dr,
    dstr,
    has_mask,
    has_bias,
    has_drop,
    want_lse,
    want_w,
    p,
    emin,
    maxf,
    out,
    lse,
    w,
):
    """Double-double first step of query row i of plane (b, h) (module docstring, 1-6);
    returns its status."""
    g = kvh[h]
    lo, hi = lohi[b, i, 0], lohi[b, i, 1]
    n = hi - lo
    vdim = v.shape[3]
    pr = prm[b, h]
    sum_rel = pr[7]
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
            st, bv = _key_state(
                b, h, i, j, mk, mstr, bs, bstr, dr, dstr, has_mask, has_bias, has_drop
            )
        state[jj] = st
        if st == 0:
            continue
        if has_bias and not _bias_in_range(bv):
            return _UNDECIDED
        th, tl, e = _score(i, j, s[jj], c[jj], qn_i, knp[j], pr, bv, has_bias)
        s[jj], c[jj], err[jj] = th, tl, e
        if th > top:
            top = th
    has_sink, sink = pr[14] != 0.0, pr[15]
    if has_sink and sink > top:  # the sink: one more logit in the max and in Z, no value
        top = sink
    if top == -np.inf:
        return _EMPTY
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
        return _UNDECIDED
    zh, zl = D.two_sum(zs, zc)
    zr = ((sum_rel + rho) * zh + tiny) * D.BOUND_SAFETY
    # sum_j e_j |v_je| <= vmax_e (Z + zr): the Dot2 and exponential errors of N (exactly 0
    # when no kept key above CUT carries a value: N is then 0 exactly, as with a sink alone)
    nr = TINY * tiny_v
    if zv > 0.0:  # the valued keys' mass (e > 0 above CUT): Z, or less when a sink holds most
        mass = min(zh + zr, zv * (1.0 + rho) * (1.0 + 2.0**-20))
        nr = nr + ((sum_rel + rho) * vmax[b, g] * mass) * D.BOUND_SAFETY
    ok, lz_h, lz_l, lz_r = _finish_row(
        b, h, i, top, zh, zl, zr, ns, nc, nr, pr, want_lse, p, emin, maxf, out, lse
    )
    if ok and want_w:
        ok = _row_weights(b, h, i, lo, state, s, c, err, lz_h, lz_l, lz_r, p, emin, maxf, w)
    return _OK if ok else _UNDECIDED


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def _forward_dd(
    items,
    q,
    kT,
    v,
    qn,
    kn,
    vmax,
    prm,
    kvh,
    lohi,
    mk,
    mstr,
    bs,
    bstr,
    dr,
    dstr,
    has_mask,
    has_bias,
    has_drop,
    want_lse,
    want_w,
    p,
    emin,
    maxf,
    out,
    lse,
    w,
    status,
):
    """Double-double first step for the query rows ``items`` ((n, 3): b, h, i), in parallel
    over rows of every plane."""
    for r in prange(items.shape[0]):
        b, h, i = items[r, 0], items[r, 1], items[r, 2]
        status[b, h, i] = _dd_row(
            b,
            h,
            i,
            q,
            kT,
            v,
            qn,
            kn,
            vmax,
            prm,
            kvh,
            lohi,
            mk,
            mstr,
            bs,
            bstr,
            dr,
            dstr,
            has_mask,
            has_bias,
            has_drop,
            want_lse,
            want_w,
            p,
            emin,
            maxf,
            out,
            lse,
            w,
        )


@numba.jit(**_JIT)
def _score_d(i, j, sj, qn_i, kn_j, prm, bv, has_bias, gdim):
    """(t, err): the score of key j in double precision from its dot product s (fma chain,
    error <= gamma_D |q_i|.|k_j|), each rounding bounded by 1.01 u |result|."""
    scale_hi, scale_lo, scale_err, cap, slope, offset, alibi_keys = (
        prm[0],
        prm[1],
        prm[2],
        prm[4],
        prm[5],
        prm[6],
        prm[13],
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
def _d_block(
    b,
    h,
    i0,
    nb_rows,
    q,
    kT,
    v,
    qn,
    kn,
    qs,
    ks,
    vmax,
    vnorm,
    prm,
    kvh,
    lohi,
    mk,
    mstr,
    bs,
    bstr,
    dr,
    dstr,
    has_mask,
    has_bias,
    has_drop,
    want_lse,
    want_w,
    p,
    emin,
    maxf,
    out,
    lse,
    w,
    status,
):
    """Double-precision first step of rows i0 .. i0 + nb_rows - 1 of plane (b, h), which share
    each load of K^T and V (each row's arithmetic is the same sequence as alone: no bit depends
    on the blocking). The keys run over the union of the rows' intervals; the blocked sums
    restart at multiples of SUM_BLOCK of the key index j itself."""
    g = kvh[h]
    pr = prm[b, h]
    gdim = pr[11]
    gsum = pr[12]
    u = 1.01 * D.U
    vdim = v.shape[3]
    vp = v[b, g]  # the plane's (S, E) values
    knp = kn[b, g]
    ksp = ks[b, g]
    rule_arrays = has_mask or has_bias or has_drop
    lo = lohi[b, i0, 0]
    hi = lohi[b, i0, 1]
    for rr in range(1, nb_rows):
        lo = min(lo, lohi[b, i0 + rr, 0])
        hi = max(hi, lohi[b, i0 + rr, 1])
    n = max(hi - lo, 0)
    s = np.zeros((ROW_BLOCK, n))
    err = np.zeros((ROW_BLOCK, n))
    state = np.zeros((ROW_BLOCK, n), np.int8)
    bad = np.zeros(ROW_BLOCK, np.bool_)
    for d in range(q.shape[3]):
        row = kT[b, g, d, lo:hi]  # a slice: the loop below then vectorizes
        for rr in range(nb_rows):
            a = q[b, h, i0 + rr, d]
            if a == 0.0:
                continue
            srow = s[rr]
            for jj in range(n):
                srow[jj] = D.fma(a, row[jj], srow[jj])
    top = np.full(ROW_BLOCK, -np.inf)
    for rr in range(nb_rows):
        i = i0 + rr
        for jj in range(lohi[b, i, 0] - lo, lohi[b, i, 1] - lo):
            j = lo + jj
            st, bv = 2, 0.0
            if rule_arrays:
                st, bv = _key_state(
                    b, h, i, j, mk, mstr, bs, bstr, dr, dstr, has_mask, has_bias, has_drop
                )
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
    has_sink, sink = pr[14] != 0.0, pr[15]
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
            status[b, h, i] = _UNDECIDED
            continue
        if top[rr] == -np.inf:
            status[b, h, i] = _EMPTY
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
            status[b, h, i] = _UNDECIDED
            continue
        gg = gsum + rho[rr]
        zrad = (gg * zr_ * (1.0 + gsum) + tiny[rr]) * D.BOUND_SAFETY
        # sum_j e_j |v_je| <= min(vmax_e sum_j e_j, sqrt(sum_j e_j^2) ||v_e||) (the second
        # by Cauchy-Schwarz; the float sums are within gamma_S < 2**-27 of their values)
        acc = np.minimum(vmax[b, g] * (zr_ + zrad), math.sqrt(e2[rr]) * vnorm[b, g])
        nr = (gg * acc * (1.0 + gsum) * (1.0 + rho[rr])) * D.BOUND_SAFETY + TINY * tiny_v[rr]
        ok, lz_h, lz_l, lz_r = _finish_row(
            b,
            h,
            i,
            top[rr],
            zr_,
            0.0,
            zrad,
            nsum[rr],
            zeros,
            nr,
            pr,
            want_lse,
            p,
            emin,
            maxf,
            out,
            lse,
        )
        if ok and want_w:
            r0 = lohi[b, i, 0] - lo
            r1 = lohi[b, i, 1] - lo
            ok = _row_weights(
                b,
                h,
                i,
                lo + r0,
                state[rr, r0:r1],
                s[rr, r0:r1],
                np.zeros(r1 - r0),
                err[rr, r0:r1],
                lz_h,
                lz_l,
                lz_r,
                p,
                emin,
                maxf,
                w,
            )
        status[b, h, i] = _OK if ok else _UNDECIDED


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def _row_facts(x, bits, norms, scales, ok):
    """Per row of x (N, D) (``bits``: the same array viewed as int64), in a fixed order:
    ``ok`` (all finite, nonzero magnitudes in [SAFE_MIN, SAFE_MAX]), ``norms`` (an upper bound
    of the 2-norm: the float sum of squares errs by at most gamma_D < 2**-30 relative for
    D < 2**22, covered by the factor 1 + 2**-30; 2**-1000 covers underflow) and ``scales``
    (:func:`exactness_scales`: the exponent of the lowest set bit from the bit pattern)."""
    frac_mask = (1 << 52) - 1
    for n in prange(x.shape[0]):
        good = True
        acc = 0.0
        low = 1 << 40
        for d in range(x.shape[1]):
            a = x[n, d]
            m = abs(a)
            if not (m == 0.0 or (m >= D.SAFE_MIN and m <= D.SAFE_MAX)):
                good = False
            acc += a * a
            if m != 0.0:
                w = bits[n, d]
                biased = (w >> 52) & 0x7FF
                mant = w & frac_mask
                if biased != 0:
                    mant |= 1 << 52
                else:
                    biased = 1  # subnormal: the same scale as the smallest normal
                lowbit = mant & -mant  # a power of two below 2**53: exact as a float
                tz = np.int64(math.frexp(float(lowbit))[1] - 1)
                low = min(low, biased - 1075 + tz)
        ok[n] = good
        norms[n] = math.sqrt(acc) * (1.0 + 2.0**-30) + 2.0**-1000
        g = 0 if low == 1 << 40 else low  # a zero row: its products are all 0
        scales[n] = np.ldexp(norms[n], -g)


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def _forward_d(
    blocks,
    q,
    kT,
    v,
    qn,
    kn,
    qs,
    ks,
    vmax,
    vnorm,
    prm,
    kvh,
    lohi,
    mk,
    mstr,
    bs,
    bstr,
    dr,
    dstr,
    has_mask,
    has_bias,
    has_drop,
    want_lse,
    want_w,
    p,
    emin,
    maxf,
    out,
    lse,
    w,
    status,
):
    """Double-precision first step (for targets of <= 24 bits) over ``blocks`` ((n, 4): b, h,
    first row, row count <= ROW_BLOCK), in parallel over the blocks of every plane: fma chains
    with gamma_n bounds (Higham 2002, eq. (3.5)) and :func:`refattn.exact._dd.exp_d`."""
    for r in prange(blocks.shape[0]):
        _d_block(
            blocks[r, 0],
            blocks[r, 1],
            blocks[r, 2],
            blocks[r, 3],
            q,
            kT,
            v,
            qn,
            kn,
            qs,
            ks,
            vmax,
            vnorm,
            prm,
            kvh,
            lohi,
            mk,
            mstr,
            bs,
            bstr,
            dr,
            dstr,
            has_mask,
            has_bias,
            has_drop,
            want_lse,
            want_w,
            p,
            emin,
            maxf,
            out,
            lse,
            w,
            status,
        )


# ------------------------------------------------------------------------------ wrapper
def rounds_to_zero(tiny: np.ndarray, fmt) -> np.ndarray:
    """Where a weight flagged by the kernels (1: 0 < w < 2**-288, 2: 0 < w < 2**-1154)
    rounds to +0 in ``fmt``.

    >>> from refattn.exact.rounding import FORMATS
    >>> rounds_to_zero(np.array([0, 1, 2]), FORMATS["float64"]).tolist()
    [False, False, True]
    """
    return (tiny == 2) | ((tiny == 1) & (fmt.p < 53))


def exactness_scales(x: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Per row of x, ``norms / 2**g`` with g the exponent of the row's lowest set bit.

    The fma chain of ``q_i . k_j`` is exact when ``sq_i * sk_j < 2**52`` (sq, sk the scales of
    q's and k's rows): every product and partial sum is then a multiple of ``2**(g_i + g_j)``
    of magnitude ``<= ||q_i|| ||k_j|| < 2**53 * 2**(g_i + g_j)`` (the factor 2 covers the
    rounding of the scales' product). True for float16/bfloat16 inputs of moderate range.

    >>> exactness_scales(np.array([[0.5, 1.5], [0.0, 0.0]]), np.array([2.0, 0.0])).tolist()
    [4.0, 0.0]
    """
    frac, exps = np.frexp(x)
    mant = (np.abs(frac) * 2.0**53).astype(np.int64)
    nonzero = mant != 0
    trailing = np.log2(np.where(nonzero, mant & -mant, 1)).astype(np.int64)  # exact
    low = np.where(nonzero, exps.astype(np.int64) - 53 + trailing, np.iinfo(np.int64).max)
    g = low.min(axis=1, initial=np.iinfo(np.int64).max)
    g = np.where(g == np.iinfo(np.int64).max, 0, g)  # a zero row: its products are all 0
    with np.errstate(over="ignore"):
        return np.ldexp(norms, -g)


def row_spec(spec: AttentionSpec, b: int, h: int, start: int, stop: int) -> AttentionSpec:
    """The spec of query rows ``start:stop`` of plane (b, h) alone: one batch, one head, the
    kv head it reads, and the offset shifted by ``start`` so causal, window and ALiBi see the
    original row indices (``i' + o' = i + o``). Its bias shape is its own rows' (1, 1, n, S)
    and it keeps head h's sink.

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((4, 2)), np.zeros((4, 2)), np.zeros((4, 1)), causal=True)
    >>> sub = row_spec(spec, 0, 0, 2, 4)
    >>> sub.q.shape, sub.offset
    ((1, 1, 2, 2), 2)
    """
    g = int(spec.kv_head[h])

    def rows(a):
        return None if a is None else a[b : b + 1, h : h + 1, start:stop]

    mask = rows(spec.mask)
    if spec.kv_lengths is not None:  # the row's own key length becomes part of the mask
        own = np.arange(spec.k.shape[-2]) < spec.kv_lengths[b]
        mask = np.broadcast_to(own, (1, 1, stop - start, own.size)) if mask is None else mask & own
    return dataclasses.replace(
        spec,
        q=spec.q[b : b + 1, h : h + 1, start:stop],
        k=spec.k[b : b + 1, g : g + 1],
        v=spec.v[b : b + 1, g : g + 1],
        batch_shape=(1,),
        single_head=False,
        bias=rows(spec.bias),
        mask=mask,
        dropout_mask=rows(spec.dropout_mask),
        bias_shape=None if spec.bias is None else (1, 1, stop - start, spec.bias.shape[-1]),
        alibi_slopes=None if spec.alibi_slopes is None else spec.alibi_slopes[h : h + 1],
        sinks=None if spec.sinks is None else spec.sinks[h : h + 1],
        kv_head=np.zeros(1, dtype=np.int64),
        offset=spec.row_offset(b) + start,
        kv_lengths=None,
        dbias_index=None,
        alibi_offsets=None
        if spec.alibi_offsets is None
        else np.array([spec.alibi_offsets[b] + start], dtype=np.int64),
    )


def _runs(rows: np.ndarray):
    """Maximal runs (start, stop) of consecutive sorted row indices."""
    if rows.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [rows.size]])
    return [(int(rows[a]), int(rows[z - 1]) + 1) for a, z in zip(starts, stops, strict=True)]


class _Rule(NamedTuple):
    """The allowed set of every plane without an (L, S) array: the key intervals and the
    compact mask, bias and dropout mask (:func:`refattn.exact._stream.compact_view`; a
    1-element dummy when absent)."""

    lohi: np.ndarray
    mask: tuple
    bias: tuple
    drop: tuple
    has_mask: bool
    has_bias: bool
    has_drop: bool


def allowed_rule(spec: AttentionSpec) -> _Rule:
    """The rule the kernels read the allowed set and the dropout keep-mask from; equal to
    :meth:`AttentionSpec.allowed` (``tests/exact/test_fast_exact.py`` checks it)."""
    return _Rule(
        np.stack(key_intervals(spec), axis=-1),
        compact_view(spec.mask, np.bool_),
        compact_view(spec.bias, np.float64),
        compact_view(spec.dropout_mask, np.bool_),
        spec.mask is not None,
        spec.bias is not None,
        spec.dropout_mask is not None,
    )


def rule_allowed(rule: _Rule, b: int, h: int, keys: int) -> tuple[np.ndarray, np.ndarray]:
    """(allowed, kept) (L, S) of plane (b, h) as the kernels read them from ``rule`` (the
    key intervals and :func:`_key_state`), for tests."""
    lohi = rule.lohi[b]
    allowed = np.zeros((lohi.shape[0], keys), dtype=bool)
    kept = np.zeros_like(allowed)
    for i, (lo, hi) in enumerate(lohi):
        for j in range(lo, hi):
            state, _ = _key_state(
                b,
                h,
                i,
                j,
                *rule.mask,
                *rule.bias,
                *rule.drop,
                rule.has_mask,
                rule.has_bias,
                rule.has_drop,
            )
            allowed[i, j], kept[i, j] = state > 0, state == 2
    return allowed, kept


def _params(spec: AttentionSpec):
    """(B, H, 14) scalar parameters of every plane's kernel and the (B, H) planes whose
    parameters are in range (the others go to the referee)."""
    batch, heads, _, _, keys, dim, _ = spec.dims
    scale_hi, scale_lo, scale_err = D.dd_of_exact(spec.scale_exact)
    cap = 0.0 if spec.softcap is None else float(spec.softcap)
    slopes = (
        np.zeros(heads)
        if spec.alibi_slopes is None
        else np.asarray(spec.alibi_slopes, dtype=np.float64)
    )
    keep_hi, keep_lo, keep_err = D.dd_of_fraction(spec.keep_scale)
    alibi_keys = keys if spec.alibi_keys is None else spec.alibi_keys

    def in_range(x):
        return (x == 0) | ((np.abs(x) >= D.SAFE_MIN) & (np.abs(x) <= D.SAFE_MAX))

    ok = np.broadcast_to(
        in_range(slopes) & bool(in_range(scale_hi) and in_range(cap)), (batch, heads)
    )
    sink = spec.sinks is not None  # one more term in Z: the sums' bounds count it
    sinks = np.zeros(heads) if not sink else np.asarray(spec.sinks, dtype=np.float64)
    ok = ok & in_range(sinks)[None, :]
    prm = np.empty((batch, heads, 16))
    prm[...] = [
        scale_hi,
        scale_lo,
        scale_err,
        D.dot_bound(dim),
        cap,
        0.0,
        0.0,
        D.dot_bound(2 * (keys + sink)),
        keep_hi,
        keep_lo,
        keep_err,
        D.gamma_up(dim),
        D.gamma_up(SUM_BLOCK + keys // SUM_BLOCK + 2 + sink),
        float(alibi_keys),
        float(sink),
        0.0,
    ]
    prm[:, :, 15] = sinks[None, :]
    prm[:, :, 5] = slopes[None, :]
    prm[:, :, 6] = np.array([spec.alibi_offset(b) for b in range(batch)], dtype=np.float64)[:, None]
    return prm, ok


class _Inputs:
    """Float64 inputs of every plane, their norms and scales, and the planes the first steps
    take (the others go to the referee whole)."""

    def __init__(self, spec: AttentionSpec):
        batch, heads, _, length, keys, _, _ = spec.dims
        f64 = np.float64
        self.q = np.ascontiguousarray(spec.q, dtype=f64)
        k = np.ascontiguousarray(spec.k, dtype=f64)
        self.kT = np.ascontiguousarray(np.swapaxes(k, 2, 3))
        self.v = np.ascontiguousarray(spec.v, dtype=f64)
        self.kvh = np.ascontiguousarray(spec.kv_head, dtype=np.int64)
        self.prm, ok = _params(spec)

        def facts(a):  # (ok, norms, scales) of the rows of a's last axis
            flat = a.reshape(int(np.prod(a.shape[:3])), a.shape[3])
            out = [np.empty(flat.shape[0], dtype) for dtype in (np.bool_, np.float64, np.float64)]
            if flat.shape[0]:
                _row_facts(flat, flat.view(np.int64), out[1], out[2], out[0])
            return [o.reshape(a.shape[:3]) for o in out]

        q_ok, self.qn, self.qs = facts(self.q)
        k_ok, self.kn, self.ks = facts(k)
        vT = np.ascontiguousarray(np.swapaxes(self.v, 2, 3))
        v_ok, self.vnorm, _ = facts(vT)
        kv_ok = k_ok.all(axis=2) & v_ok.all(axis=2)
        self.ok = ok & q_ok.all(axis=2) & kv_ok[:, self.kvh] & (length > 0) & (keys > 0)
        self.vmax = np.max(np.abs(self.v), axis=2, initial=0.0)
        self.rule = allowed_rule(spec)


def fast_exact_forward(spec: AttentionSpec, out_dtype, *, return_lse=False, return_weights=False):
    """Correctly rounded (out, lse, weights) in the flat (B, H, ...) layout, bit-identical to
    :func:`refattn.exact.attention.exact_forward` (see the module docstring).

    The first steps run in parallel over the query rows (blocks of ROW_BLOCK rows) of every
    plane at once; each row's arithmetic depends on the shapes alone, so the bits do not
    depend on the thread count.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((2, 2)), np.array([[1.0], [2.0]]))
    >>> out, _, _ = fast_exact_forward(spec, np.float64)
    >>> out.tolist()
    [[[[1.5]]]]
    """
    fmt = format_of(out_dtype)
    batch, heads, _, length, keys, _, vdim = spec.dims
    out = np.zeros((batch, heads, length, vdim))
    lse = np.zeros((batch, heads, length))
    weights = np.zeros((batch, heads, length, keys) if return_weights else (1, 1, 1, 1))
    status = np.full((batch, heads, length), _UNDECIDED, dtype=np.int8)
    step_rows = {"double": 0, "double-double": 0}
    if out.size or lse.size:
        x = _Inputs(spec)
        rule = x.rule
        common = (
            x.prm,
            x.kvh,
            rule.lohi,
            *rule.mask,
            *rule.bias,
            *rule.drop,
            rule.has_mask,
            rule.has_bias,
            rule.has_drop,
            return_lse,
            return_weights,
            fmt.p,
            fmt.emin,
            float(fmt.max_finite),
            out,
            lse,
            weights,
            status,
        )
        planes = np.argwhere(x.ok)
        if fmt.p <= 24 and planes.size:
            starts = np.arange(0, length, ROW_BLOCK)
            blocks = np.empty((planes.shape[0] * starts.size, 4), dtype=np.int64)
            blocks[:, :2] = np.repeat(planes, starts.size, axis=0)
            blocks[:, 2] = np.tile(starts, planes.shape[0])
            blocks[:, 3] = np.minimum(ROW_BLOCK, length - blocks[:, 2])
            _forward_d(blocks, x.q, x.kT, x.v, x.qn, x.kn, x.qs, x.ks, x.vmax, x.vnorm, *common)
            step_rows["double"] = planes.shape[0] * length
            redo = x.ok[:, :, None] & (status == _UNDECIDED)
        else:
            redo = np.broadcast_to(x.ok[:, :, None], status.shape)
        items = np.argwhere(redo)
        if items.size:
            _forward_dd(items, x.q, x.kT, x.v, x.qn, x.kn, x.vmax, *common)
        step_rows["double-double"] = items.shape[0]
    referee_rows = 0
    for b, h in np.argwhere((status != _OK).any(axis=2)):
        rows = np.flatnonzero(status[b, h] != _OK)
        referee_rows += rows.size
        for start, stop in _runs(rows):
            sub = row_spec(spec, int(b), int(h), start, stop)
            o, g, w = exact_forward(
                sub, out_dtype, return_lse=return_lse, return_weights=return_weights
            )
            out[b, h, start:stop] = o[0, 0]
            if return_lse:
                lse[b, h, start:stop] = g[0, 0]
            if return_weights:
                weights[b, h, start:stop] = w[0, 0]
    total_rows = batch * heads * length
    per_row = vdim + return_lse + keys * return_weights
    _LAST_STATS.clear()
    _LAST_STATS.update(
        rows=total_rows,
        referee_rows=referee_rows,
        elements=total_rows * per_row,
        referee_elements=referee_rows * per_row,
        double_rows=step_rows["double"],
        double_double_rows=step_rows["double-double"],
    )
    dtype = fmt.dtype
    return (
        out.astype(dtype),
        lse.astype(dtype) if return_lse else None,
        weights.astype(dtype) if return_weights else None,
    )


def fallback_stats() -> dict:
    """Statistics of the last :func:`fast_exact_forward` call: ``rows`` and ``elements`` in
    total, ``double_rows`` and ``double_double_rows`` (rows evaluated by each first step),
    ``referee_rows`` and ``referee_elements`` (those of the rows recomputed by the referee
    engine).

    Examples
    --------
    >>> set(fallback_stats()) <= {'rows', 'elements', 'referee_rows', 'referee_elements',
    ...                           'double_rows', 'double_double_rows'}
    True
    """
    return dict(_LAST_STATS)
