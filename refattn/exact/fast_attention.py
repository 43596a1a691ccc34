"""Fast exact attention forward: a compiled double-double first step, the referee for the rest.

``precision="exact"`` means every element of out, lse and weights is the exact real result
rounded once to ``out_dtype``. This module decides almost every element with a Numba kernel in
double-double arithmetic (:mod:`refattn.exact._dd`) that carries a rigorous error bound, and
sends the rows it cannot decide to the arbitrary-precision engine
(:class:`refattn.exact.attention.ExactForward`, "the referee") -- Ziv's strategy with a compiled
first step. The results are bit-identical to the referee's.

Per query row i of a (batch, head) plane (working memory O(L*E + S*D) plus the plane's (L, S)
boolean allowed set, taken from :meth:`AttentionSpec.allowed` so that the one rule of
:mod:`refattn.masks` decides it; the weights, when asked for, are an (L, S) output anyway):

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
   ``|error| <= delta_ij + DD_REL |x_ij|``.
3. Exponentials. ``e_ij = exp_dd_fast(x_ij)`` (``x <= 0``: a 1024-entry table) with relative error
   ``rho_ij <= (EXP_FAST_REL + 2 err(x_ij)) (1 + 2**-20)`` (``|e^d - 1| <= 2|d|`` for |d| <= 1;
   rows with an error above 2**-20 are left to the referee). Keys with ``x < CUT`` (-400)
   have ``0 <= e < TINY`` (2**-575) and enter as that absolute radius only.
4. Sums. ``Z = sum_j e_ij`` and ``N_e = sum_j kappa_ij e_ij v_je`` with TwoProd/TwoSum and a
   compensation word: ``|N - N^| <= (dot_bound(2S) + rho_i) A_e + TINY sum |v_je|`` with
   ``A_e = sum_j e_ij |v_je| <= max_j |v_je| (Z + rZ)`` (``rho_i = max_j rho_ij``; the same
   for Z with A = Z).
5. Results. ``out = N / Z * keep_scale`` (double-double division; the quotient of enclosures
   ``(rN + |N/Z| rZ) / (Z - rZ)``), ``lse = m + log_dd(Z)`` (``-log(1 - rZ/Z)`` for Z's
   radius), ``w_ij = exp_dd_fast(x_ij - log Z)``.
6. Rounding decision. :func:`refattn.exact.rounding.decide_dd` (compiled: ``decide_dd_fast``) rounds
   both ends of each enclosure exactly; where they differ (a rounding boundary within the radius:
   ties at the max, weights exactly 1/n on a midpoint, exact zeros, overflow) the whole row goes to
   the referee, restricted to those rows (:func:`row_spec`: a spec of the row run, with the offset
   shifted so causal/window/ALiBi use the original row indices).

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

Planes with NaN/Inf in q, k or v, magnitudes outside [SAFE_MIN, SAFE_MAX], a softcap or ALiBi
slope outside it, and empty rows go to the referee whole; their semantics are not re-derived.
"""

from __future__ import annotations

import dataclasses
import math

import numba
import numpy as np
from numba import prange

from .._spec import AttentionSpec
from . import _dd as D
from ._dd_extra import EXP_FAST_REL, decide_dd_fast, exp_dd_fast
from .attention import exact_forward
from .rounding import format_of

__all__ = ["fast_exact_forward", "fallback_stats", "row_spec", "rounds_to_zero",
           "exactness_scales", "CUT", "TINY", "WEIGHT_TINY_ARG", "WEIGHT_ZERO_ARG"]

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
def _row_dots(q, kT, i, s, c):
    """Compensated dot products (s_j, c_j) of q_i with every key (lanes over keys)."""
    dim, keys = kT.shape
    for j in range(keys):
        s[j] = 0.0
        c[j] = 0.0
    for d in range(dim):
        a = q[i, d]
        if a == 0.0:
            continue
        for j in range(keys):
            b = kT[d, j]
            p = a * b
            ep = D.fma(a, b, -p)
            sj = s[j]
            t = sj + p
            bb = t - sj
            es = (sj - (t - bb)) + (p - bb)
            s[j] = t
            c[j] += ep + es


@numba.jit(**_JIT)
def _score(i, j, sj, cj, qn_i, kn_j, prm, bias, has_bias):
    """(t_hi, t_lo, err) of the score of key j from its dot product (s, c)."""
    scale_hi, scale_lo, scale_err, dot_rel, cap, slope, offset, alibi_keys = (
        prm[0], prm[1], prm[2], prm[3], prm[4], prm[5], prm[6], prm[13])
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
        th, tl = D.dd_add_d(th, tl, bias[i, j])
        err += D.DD_REL * abs(th)
    if slope != 0.0 and j < alibi_keys:
        dist = abs(i + offset - j)
        ah, al = D.two_prod(-slope, float(dist))
        th, tl = D.dd_add(th, tl, ah, al)
        err += D.DD_REL * abs(th)
    return th, tl, err * D.BOUND_SAFETY


@numba.jit(**_JIT)
def _finish_row(i, top, zh, zl, zr, ns, nc, nr, prm, out_h, out_l, out_r, lse_h, lse_l, lse_r,
                lz_h, lz_l, lz_r, status):
    """lse = m + log Z and out = N / Z * keep_scale with their radii (module docstring, 5)."""
    keep_hi, keep_lo, keep_err = prm[8], prm[9], prm[10]
    if not zr < 0.5 * zh:
        status[i] = _UNDECIDED
        return
    lh, ll, lerr = D.log_dd(zh, zl)
    lerr = lerr + (zr / zh) / (1.0 - zr / zh)
    lz_h[i], lz_l[i], lz_r[i] = lh, ll, lerr * D.BOUND_SAFETY
    gh, gl = D.dd_add_d(lh, ll, top)
    lse_h[i], lse_l[i] = gh, gl
    lse_r[i] = (lerr + D.DD_REL * abs(gh)) * D.BOUND_SAFETY
    zlow = zh - zr
    for e in range(ns.shape[0]):
        nh, nl = D.two_sum(ns[e], nc[e])
        oh, ol = D.dd_div(nh, nl, zh, zl)
        orad = (nr[e] + abs(oh) * 1.0000001 * zr) / zlow + D.DD_REL * abs(oh)
        ph, pl = D.dd_mul(oh, ol, keep_hi, keep_lo)
        orad = orad * (abs(keep_hi) + keep_err) + abs(oh) * keep_err + D.DD_REL * abs(ph)
        out_h[i, e], out_l[i, e], out_r[i, e] = ph, pl, orad * D.BOUND_SAFETY
    status[i] = _OK


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def _forward_dd(rows, q, kT, v, allowed, kept, bias, has_bias, qn, kn, qs, ks, vmax, vnorm,
                prm,
                want_x,
                out_h, out_l, out_r, lse_h, lse_l, lse_r, lz_h, lz_l, lz_r,
                x_h, x_l, x_r, status):
    """Double-double first step for the query rows ``rows`` (module docstring, 1-5)."""
    keys = kT.shape[1]
    vdim = v.shape[1]
    sum_rel = prm[7]
    for r in prange(rows.shape[0]):
        i = rows[r]
        s = np.empty(keys)
        c = np.empty(keys)
        err = np.empty(keys)
        _row_dots(q, kT, i, s, c)
        top = -np.inf
        for j in range(keys):
            if allowed[i, j]:
                th, tl, e = _score(i, j, s[j], c[j], qn[i], kn[j], prm, bias, has_bias)
                s[j], c[j], err[j] = th, tl, e
                if th > top:
                    top = th
        if top == -np.inf:
            status[i] = _EMPTY
            continue
        ns = np.zeros(vdim)
        nc = np.zeros(vdim)
        tiny_v = np.zeros(vdim)
        zs = 0.0
        zc = 0.0
        tiny = 0.0
        rho = 0.0
        for j in range(keys):
            if not allowed[i, j]:
                continue
            xh, xl = D.dd_add_d(s[j], c[j], -top)
            xe = (err[j] + D.DD_REL * abs(xh)) * D.BOUND_SAFETY
            if want_x:
                x_h[i, j], x_l[i, j], x_r[i, j] = xh, xl, xe
            if xh < CUT:
                tiny += TINY
                if kept[i, j]:
                    for e in range(vdim):
                        tiny_v[e] += abs(v[j, e])
                continue
            rho = max(rho, (EXP_FAST_REL + 2.0 * xe) * (1.0 + _RHO_MAX))
            eh, el = exp_dd_fast(xh, xl)
            t = zs + eh
            bb = t - zs
            zc += ((zs - (t - bb)) + (eh - bb)) + el
            zs = t
            if kept[i, j]:
                for e in range(vdim):
                    b = v[j, e]
                    p = eh * b
                    ep = D.fma(eh, b, -p)
                    nse = ns[e]
                    t2 = nse + p
                    b2 = t2 - nse
                    es = (nse - (t2 - b2)) + (p - b2)
                    ns[e] = t2
                    nc[e] += (ep + es) + el * b
        if not rho <= _RHO_MAX:
            status[i] = _UNDECIDED
            continue
        zh, zl = D.two_sum(zs, zc)
        zr = ((sum_rel + rho) * zh + tiny) * D.BOUND_SAFETY
        # sum_j e_j |v_je| <= vmax_e (Z + zr): the Dot2 and exponential errors of N
        nr = ((sum_rel + rho) * vmax * (zh + zr)) * D.BOUND_SAFETY + TINY * tiny_v
        _finish_row(i, top, zh, zl, zr, ns, nc, nr, prm, out_h, out_l, out_r,
                    lse_h, lse_l, lse_r, lz_h, lz_l, lz_r, status)


@numba.jit(**_JIT)
def _score_d(i, j, sj, qn_i, kn_j, prm, bias, has_bias, gdim):
    """(t, err): the score of key j in double precision from its dot product s (fma chain,
    error <= gamma_D |q_i|.|k_j|), each rounding bounded by 1.01 u |result|."""
    scale_hi, scale_lo, scale_err, cap, slope, offset, alibi_keys = (
        prm[0], prm[1], prm[2], prm[4], prm[5], prm[6], prm[13])
    u = 1.01 * D.U
    derr = gdim * qn_i * kn_j
    t = sj * scale_hi
    err = (abs(scale_hi) * derr + (abs(sj) + derr) * (abs(scale_lo) + scale_err)
           + u * abs(t))
    if cap > 0.0:
        yh, yl = D.dd_div_d(t, 0.0, cap)
        err = err / cap + D.DD_REL * abs(yh)
        hh, hl = D.tanh_dd(yh, yl)
        err = err + D.TANH_ABS
        th, tl = D.dd_mul_d(hh, hl, cap)
        err = err * cap + D.DD_REL * abs(th) + abs(tl)
        t = th
    if has_bias:
        t = t + bias[i, j]
        err += u * abs(t)
    if slope != 0.0 and j < alibi_keys:
        a = -slope * float(abs(i + offset - j))
        t = t + a
        err += u * (abs(a) + abs(t))
    return t, err


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def _forward_d(rows, q, kT, v, allowed, kept, bias, has_bias, qn, kn, qs, ks, vmax, vnorm,
               prm,
               want_x,
               out_h, out_l, out_r, lse_h, lse_l, lse_r, lz_h, lz_l, lz_r,
               x_h, x_l, x_r, status):
    """Double-precision first step (for targets of <= 24 bits): fma chains with gamma_n
    bounds (Higham 2002, eq. (3.5)) and :func:`refattn.exact._dd.exp_d`.

    Rows are taken ROW_BLOCK at a time so that each row of K^T and of V is loaded once per
    block (each row's arithmetic is the same sequence as alone: no bit depends on blocking).
    """
    dim, keys = kT.shape
    vdim = v.shape[1]
    gdim = prm[11]
    gsum = prm[12]
    u = 1.01 * D.U
    nrows = rows.shape[0]
    for blk in prange((nrows + ROW_BLOCK - 1) // ROW_BLOCK):
        r0 = blk * ROW_BLOCK
        nb_rows = min(ROW_BLOCK, nrows - r0)
        s = np.zeros((ROW_BLOCK, keys))
        err = np.zeros((ROW_BLOCK, keys))
        for d in range(dim):
            for rr in range(nb_rows):
                a = q[rows[r0 + rr], d]
                if a == 0.0:
                    continue
                for j in range(keys):
                    s[rr, j] = D.fma(a, kT[d, j], s[rr, j])
        top = np.full(ROW_BLOCK, -np.inf)
        for rr in range(nb_rows):
            i = rows[r0 + rr]
            for j in range(keys):
                if allowed[i, j]:
                    # an fma chain proven exact (exactness_scales) carries no error
                    g = 0.0 if qs[i] * ks[j] < 2.0**52 else gdim
                    t, e = _score_d(i, j, s[rr, j], qn[i], kn[j], prm, bias, has_bias, g)
                    s[rr, j], err[rr, j] = t, e
                    if t > top[rr]:
                        top[rr] = t
        n = np.zeros((ROW_BLOCK, vdim))
        nb = np.zeros((ROW_BLOCK, vdim))
        e2 = np.zeros(ROW_BLOCK)
        tiny_v = np.zeros((ROW_BLOCK, vdim))
        z = np.zeros(ROW_BLOCK)
        zb = np.zeros(ROW_BLOCK)
        tiny = np.zeros(ROW_BLOCK)
        rho = np.zeros(ROW_BLOCK)
        ex = np.zeros(ROW_BLOCK)
        use = np.zeros(ROW_BLOCK, dtype=np.bool_)
        for j in range(keys):
            if (j % SUM_BLOCK) == 0:  # blocked sums: gamma_{B + S/B} instead of gamma_S
                for rr in range(nb_rows):
                    z[rr] += zb[rr]
                    zb[rr] = 0.0
                    for e in range(vdim):
                        n[rr, e] += nb[rr, e]
                        nb[rr, e] = 0.0
            for rr in range(nb_rows):
                i = rows[r0 + rr]
                use[rr] = False
                if not allowed[i, j]:
                    continue
                x = s[rr, j] - top[rr]
                xe = (err[rr, j] + u * abs(x)) * D.BOUND_SAFETY
                if want_x:
                    x_h[i, j], x_l[i, j], x_r[i, j] = x, 0.0, xe
                if x < CUT:
                    tiny[rr] += TINY
                    if kept[i, j]:
                        for e in range(vdim):
                            tiny_v[rr, e] += abs(v[j, e])
                    continue
                rho[rr] = max(rho[rr], (D.EXP_D_REL + 2.0 * xe) * (1.0 + _RHO_MAX))
                ex[rr] = D.exp_d(x)
                zb[rr] += ex[rr]
                e2[rr] += ex[rr] * ex[rr]
                use[rr] = kept[i, j]
            for rr in range(nb_rows):
                if use[rr]:
                    w = ex[rr]
                    for e in range(vdim):
                        nb[rr, e] = D.fma(w, v[j, e], nb[rr, e])
        for rr in range(nb_rows):
            i = rows[r0 + rr]
            if top[rr] == -np.inf:
                status[i] = _EMPTY
                continue
            zr_ = z[rr] + zb[rr]
            for e in range(vdim):
                n[rr, e] += nb[rr, e]
            if not rho[rr] <= _RHO_MAX:
                status[i] = _UNDECIDED
                continue
            g = gsum + rho[rr]
            zrad = (g * zr_ * (1.0 + gsum) + tiny[rr]) * D.BOUND_SAFETY
            # sum_j e_j |v_je| <= min(vmax_e sum_j e_j, sqrt(sum_j e_j^2) ||v_e||) (the second
            # by Cauchy-Schwarz; the float sums are within gamma_S < 2**-27 of their values)
            acc = np.minimum(vmax * (zr_ + zrad), math.sqrt(e2[rr]) * vnorm)
            nr = (g * acc * (1.0 + gsum) * (1.0 + rho[rr])) * D.BOUND_SAFETY \
                + TINY * tiny_v[rr]
            _finish_row(i, top[rr], zr_, 0.0, zrad, n[rr], np.zeros(vdim), nr, prm,
                        out_h, out_l, out_r, lse_h, lse_l, lse_r, lz_h, lz_l, lz_r, status)


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def _weights_plane(rows, allowed, x_h, x_l, x_r, lz_h, lz_l, lz_r, status, w_h, w_l, w_r,
                   w_tiny):
    """w_ij = exp(x_ij - log Z_i) with a radius; w_tiny marks 0 < w < 2**-288 (1) and
    0 < w < 2**-1154 (2) (mid 0)."""
    keys = allowed.shape[1]
    for r in prange(rows.shape[0]):
        i = rows[r]
        if status[i] != _OK:
            continue
        for j in range(keys):
            if not allowed[i, j]:
                w_h[i, j], w_l[i, j], w_r[i, j] = 0.0, 0.0, 0.0
                continue
            ah, al = D.dd_add(x_h[i, j], x_l[i, j], -lz_h[i], -lz_l[i])
            ae = (x_r[i, j] + lz_r[i] + D.DD_REL * abs(ah)) * D.BOUND_SAFETY
            if ah + ae < WEIGHT_TINY_ARG:
                w_tiny[i, j] = 2 if ah + ae < WEIGHT_ZERO_ARG else 1
                continue
            if ah < D.EXP_MIN_ARG + 1.0 or ae > _RHO_MAX:
                w_r[i, j] = np.inf
                continue
            eh, el = exp_dd_fast(ah, al)
            w_h[i, j], w_l[i, j] = eh, el
            w_r[i, j] = (EXP_FAST_REL + 2.0 * ae) * (1.0 + _RHO_MAX) * eh * D.BOUND_SAFETY


# ------------------------------------------------------------------------------ wrapper
def rounds_to_zero(tiny: np.ndarray, fmt) -> np.ndarray:
    """Where a weight flagged by the kernels (1: 0 < w < 2**-288, 2: 0 < w < 2**-1154)
    rounds to +0 in ``fmt``.

    >>> from refattn.exact.rounding import FORMATS
    >>> rounds_to_zero(np.array([0, 1, 2]), FORMATS["float64"]).tolist()
    [False, False, True]
    """
    return (tiny == 2) | ((tiny == 1) & (fmt.p < 53))


def _in_range(x: np.ndarray) -> bool:
    """All finite, nonzero magnitudes in [SAFE_MIN, SAFE_MAX]."""
    if not np.isfinite(x).all():
        return False
    a = np.abs(x)
    return bool(((a == 0) | ((a >= D.SAFE_MIN) & (a <= D.SAFE_MAX))).all())


def _plane_inputs(spec: AttentionSpec, b: int, h: int):
    """Float64 inputs of one plane, or None when the plane goes to the referee whole."""
    g = int(spec.kv_head[h])
    q = np.ascontiguousarray(spec.q[b, h], dtype=np.float64)
    k = np.asarray(spec.k[b, g], dtype=np.float64)
    v = np.ascontiguousarray(spec.v[b, g], dtype=np.float64)
    if not (_in_range(q) and _in_range(k) and _in_range(v)):
        return None
    allowed = spec.allowed(b, h)
    kept = allowed if spec.dropout_mask is None else allowed & spec.dropout_mask[b, h]
    bias = np.zeros((1, 1))
    if spec.bias is not None:
        bias = np.asarray(spec.bias[b, h], dtype=np.float64)
        if not _in_range(np.where(allowed, bias, 0.0)):
            return None
    return q, np.ascontiguousarray(k.T), v, allowed, np.ascontiguousarray(kept), bias


def _params(spec: AttentionSpec, b: int, h: int, dim: int, keys: int):
    """The scalar parameters of the plane kernel, or None (referee) when out of range."""
    scale_hi, scale_lo, scale_err = D.dd_of_exact(spec.scale_exact)
    cap = 0.0 if spec.softcap is None else float(spec.softcap)
    slope = 0.0 if spec.alibi_slopes is None else float(spec.alibi_slopes[h])
    for value in (scale_hi, cap, slope):
        if value != 0 and not D.SAFE_MIN <= abs(value) <= D.SAFE_MAX:
            return None
    keep_hi, keep_lo, keep_err = D.dd_of_fraction(spec.keep_scale)
    alibi_keys = keys if spec.alibi_keys is None else spec.alibi_keys
    return np.array([scale_hi, scale_lo, scale_err, D.dot_bound(dim), cap, slope,
                     float(spec.alibi_offset(b)), D.dot_bound(2 * keys), keep_hi, keep_lo,
                     keep_err, D.gamma_up(dim), D.gamma_up(SUM_BLOCK + keys // SUM_BLOCK + 2),
                     float(alibi_keys)])


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


def _norms(x: np.ndarray) -> np.ndarray:
    """Upper bounds of the row 2-norms (float rounding covered by a factor 1 + 2**-30)."""
    return np.sqrt(np.einsum("ij,ij->i", x, x)) * (1.0 + 2.0**-30) + 2.0**-1000


def row_spec(spec: AttentionSpec, b: int, h: int, start: int, stop: int) -> AttentionSpec:
    """The spec of query rows ``start:stop`` of plane (b, h) alone: one batch, one head, the
    kv head it reads, and the offset shifted by ``start`` so causal, window and ALiBi see the
    original row indices (``i' + o' = i + o``).

    Examples
    --------
    >>> from refattn._spec import canonicalize
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
        mask = np.broadcast_to(own, (1, 1, stop - start, own.size)) if mask is None \
            else mask & own
    return dataclasses.replace(
        spec, q=spec.q[b : b + 1, h : h + 1, start:stop], k=spec.k[b : b + 1, g : g + 1],
        v=spec.v[b : b + 1, g : g + 1], batch_shape=(1,), single_head=False,
        bias=rows(spec.bias), mask=mask, dropout_mask=rows(spec.dropout_mask),
        alibi_slopes=None if spec.alibi_slopes is None else spec.alibi_slopes[h : h + 1],
        kv_head=np.zeros(1, dtype=np.int64), offset=spec.row_offset(b) + start,
        kv_lengths=None, dbias_index=None,
        alibi_offsets=None if spec.alibi_offsets is None else np.array(
            [spec.alibi_offsets[b] + start], dtype=np.int64))


def _runs(rows: np.ndarray):
    """Maximal runs (start, stop) of consecutive sorted row indices."""
    if rows.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [rows.size]])
    return [(int(rows[a]), int(rows[z - 1]) + 1) for a, z in zip(starts, stops, strict=True)]


class _Plane:
    """Decided results of one plane and the rows left to the referee.

    For targets of at most 24 bits the double-precision first step runs first and the rows it
    leaves undecided run again in double-double; for float64 the double-double step runs alone.
    """

    def __init__(self, spec, b, h, fmt, want_lse, want_w):
        _, _, _, length, keys, dim, vdim = spec.dims
        self.out = np.zeros((length, vdim))
        self.lse = np.zeros(length)
        self.w = np.zeros((length, keys)) if want_w else None
        self.undecided = np.ones(length, dtype=bool)
        self.steps = {}
        inputs = _plane_inputs(spec, b, h)
        prm = _params(spec, b, h, dim, keys)
        if inputs is None or prm is None or length == 0 or keys == 0:
            return
        q, kT, v, allowed, kept, bias = inputs
        vmax = np.max(np.abs(v), axis=0)
        qn, kn = _norms(q), _norms(kT.T)
        common = (q, kT, v, allowed, kept, bias, spec.bias is not None, qn, kn,
                  exactness_scales(q, qn), exactness_scales(kT.T, kn), vmax, _norms(v.T), prm,
                  want_w)
        bufs = ([np.zeros((length, vdim)) for _ in range(3)]
                + [np.zeros(length) for _ in range(6)]
                + [np.zeros((length, keys) if want_w else (1, 1)) for _ in range(3)])
        status = np.full(length, _UNDECIDED, dtype=np.int8)
        rows = np.arange(length)
        steps = [("double", _forward_d), ("double-double", _forward_dd)]
        for name, step in steps if fmt.p <= 24 else steps[1:]:
            step(rows, *common, *bufs, status)
            self.steps[name] = rows.size
            decided = self._decide(rows, allowed, bufs, status, fmt, want_lse, want_w)
            rows = rows[~decided]
            if rows.size == 0:
                break
        self.undecided[:] = False
        self.undecided[rows] = True

    def _decide(self, rows, allowed, bufs, status, fmt, want_lse, want_w):
        """Round the enclosures of ``rows``; store the values; return which rows are decided."""
        out_h, out_l, out_r, lse_h, lse_l, lse_r, lz_h, lz_l, lz_r, x_h, x_l, x_r = bufs
        value, decided = decide_dd_fast(out_h[rows], out_l[rows], out_r[rows], fmt)
        self.out[rows] = value
        ok = (status[rows] == _OK) & decided.all(axis=1)
        if want_lse:
            value, decided = decide_dd_fast(lse_h[rows], lse_l[rows], lse_r[rows], fmt)
            self.lse[rows] = value
            ok &= decided
        if want_w:
            keys = allowed.shape[1]
            w = [np.zeros((allowed.shape[0], keys)) for _ in range(3)]
            tiny = np.zeros(allowed.shape, dtype=np.int8)
            _weights_plane(rows, allowed, x_h, x_l, x_r, lz_h, lz_l, lz_r, status, *w, tiny)
            value, decided = decide_dd_fast(w[0][rows], w[1][rows], w[2][rows], fmt)
            here = allowed[rows]
            decided |= ~here  # excluded keys weigh exactly +0
            value = np.where(here, value, 0.0)
            zero = rounds_to_zero(tiny[rows], fmt)
            decided |= zero
            value = np.where(zero, 0.0, value)
            self.w[rows] = value
            ok &= decided.all(axis=1)
        return ok


def fast_exact_forward(spec: AttentionSpec, out_dtype, *, return_lse=False,
                       return_weights=False):
    """Correctly rounded (out, lse, weights) in the flat (B, H, ...) layout, bit-identical to
    :func:`refattn.exact.attention.exact_forward` (see the module docstring).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn._spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((2, 2)), np.array([[1.0], [2.0]]))
    >>> out, _, _ = fast_exact_forward(spec, np.float64)
    >>> out.tolist()
    [[[[1.5]]]]
    """
    fmt = format_of(out_dtype)
    batch, heads, _, length, keys, _, vdim = spec.dims
    out = np.zeros((batch, heads, length, vdim))
    lse = np.zeros((batch, heads, length)) if return_lse else None
    weights = np.zeros((batch, heads, length, keys)) if return_weights else None
    referee_rows = 0
    undecided_elements = 0
    step_rows = {"double": 0, "double-double": 0}
    for b in range(batch):
        for h in range(heads):
            plane = _Plane(spec, b, h, fmt, return_lse, return_weights)
            out[b, h] = plane.out
            if return_lse:
                lse[b, h] = plane.lse
            if return_weights:
                weights[b, h] = plane.w
            for name, count in plane.steps.items():
                step_rows[name] += count
            rows = np.flatnonzero(plane.undecided)
            referee_rows += rows.size
            undecided_elements += rows.size * (vdim + return_lse + keys * return_weights)
            for start, stop in _runs(rows):
                sub = row_spec(spec, b, h, start, stop)
                o, g, w = exact_forward(sub, out_dtype, return_lse=return_lse,
                                        return_weights=return_weights)
                out[b, h, start:stop] = o[0, 0]
                if return_lse:
                    lse[b, h, start:stop] = g[0, 0]
                if return_weights:
                    weights[b, h, start:stop] = w[0, 0]
    total_rows = batch * heads * length
    _LAST_STATS.clear()
    _LAST_STATS.update(rows=total_rows, referee_rows=referee_rows,
                       elements=total_rows * (vdim + return_lse + keys * return_weights),
                       referee_elements=undecided_elements,
                       double_rows=step_rows["double"],
                       double_double_rows=step_rows["double-double"])
    dtype = fmt.dtype
    return (out.astype(dtype), None if lse is None else lse.astype(dtype),
            None if weights is None else weights.astype(dtype))


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
