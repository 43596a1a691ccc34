"""The compiled first step of the exact linear-attention forward: the recurrence per (sequence,
value head) in midpoint-radius double-double arithmetic.

Every number is a double-double midpoint ``m = hi + lo`` (an exact real) with a float64 radius
``r`` such that the exact real value lies in ``[m - r, m + r]``. The recurrence and its notation
are those of :mod:`refattn.linear` (docs/conventions.md, "Linear attention"): per step t,
``S' = diag(a_t) S``, then the delta rule ``S = S' + k_t (beta_t (v_t - S'^T k_t))^T`` or the
plain update ``S = S' + k_t v_t^T``, and ``o_t = S^T (scale q_t)``.

Error model (the bound each step uses)
--------------------------------------
* One double-double operation (:mod:`refattn.exact.fast.doubledouble`: dd_add, dd_add_d,
  dd_mul, dd_mul_d, Joldes-Muller-Popescu 2017 Alg. 6, 4, 12, 9) returns ``z~`` with
  ``|z~ - z| <= OP_REL |hi(z~)| + ETA``: ``OP_REL = 2 max(DD_ADD_REL, DD_ADD_D_REL,
  DD_MUL_REL, DD_MUL_D_REL) = 10 u^2`` is twice the largest proven relative bound, which is
  measured against the exact result (the factor 2 covers the passage to the computed
  ``|hi(z~)|``), and ``ETA = 2**-1040`` is an absolute allowance for
  underflow (gates down to -20 per step drive old state into the subnormals, where TwoProd is
  no longer exact: each of the dozen float operations of a double-double operation then errs
  by at most 2**-1075 more; ETA is 2**34 times that grain).
* Radii are computed in float64 and each formula is multiplied by ``GROW = 1 + 2**-30``: a
  formula of n <= 2**20 float operations on nonnegative terms errs by at most ``gamma_n``
  relative (Higham 2002, Lemma 3.1), well below 2**-30; sums of squares add ``n 2**-1074``.
* Wrapping. Elementwise radii would blow up under the delta rule: the exact step applies
  ``I - beta k k^T`` (a contraction for ``0 <= beta ||k||^2 <= 2``) but an elementwise bound
  uses ``|I| + beta |k| |k|^T``, whose norm grows like ``1 + beta ||k||_1^2`` (about 1.6 per
  step at D = 128). The state therefore carries, per column e, a bound ``R_e`` on the 2-norm
  of the error vector ``S_exact[:, e] - S_mid[:, e]``; each element's radius is ``R_e``.
* Decay. ``a = exp(g)`` (base e, ``g`` exact) or ``exp(g ln2)`` (base 2: ``ln2`` a
  double-double with its error, the product a double-double with ``|g| err(ln2) + OP_REL``),
  by :func:`exp_dd` with ``EXP_REL``: ``|a - a~| <= |a~| (EXP_REL + 2 dx) GROW``
  (``|e^d - 1| <= 2|d|``). ``g = 0`` gives 1 and a base-2 integer gate ``2**g`` exactly;
  gates below the domain (``e^g`` or ``2**g`` under ``2**-893``) give ``a in [0, 2**-893]``
  (midpoint 0); gates above ``MAX_GATE`` leave the row to the referee.
  ``||diag(a) S - diag(a~) S~|| <= max(|a~| + r_a) R + max(r_a) ||S~||``.
* Delta rule. With ``S'`` the computed decayed state (its error bound ``R'``), k the key's
  midpoint (``Dk = k_exact - k``, ``||Dk|| <= rho_k``, ``||k_exact|| <= kx``):
  ``S_new,exact - S_ideal = (I - beta k_x k_x^T) DS' + beta Dk (v - k^T S') - beta k_x
  (Dk^T S')``, so ``R_new <= c R' + |beta| rho_k |v - k^T S'| + |beta| kx rho_k ||S'|| +
  ||k|| d_step + (operation errors)``, ``c = ||I - beta k_x k_x^T||_2 = max(1, |1 - beta
  ||k_x||^2|)`` (1 when ``0 <= beta kx^2 <= 2``, else ``1 + |beta| kx^2``) and ``d_step`` the
  error of the computed ``beta (v - k^T S')``.
* Plain update. ``R_new <= R' + rho_k |v_e| + (operation errors)``.
* Dot products (``k^T S'`` and the output) sum double-double products with double-double
  additions: error ``<= OP_REL (sum |products| + sum |partial sums|) + 2 D ETA``. The
  elementwise errors of the decay and of the update (``OP_REL |x_d| + ETA`` per element) enter a
  column's bound by their 2-norm, ``<= OP_REL ||x|| + sqrt(D) ETA`` (Minkowski).
* Output. ``|o_exact - o~| <= (||qs|| + rho_q) R_new + rho_q ||S_new|| + (dot errors)``, with
  ``qs = scale q`` (the default scale the real ``1/sqrt(D)`` from ``dd_of_exact``).
* Normalisation. ``s = eps + sum x_d^2`` in double-double (``ds`` from the dot rule),
  ``y~ ~ 1/sqrt(s~)`` by one Newton step from ``1/sqrt(hi(s~))``, then the residual
  ``eps~ = 1 - s~ y~^2`` evaluated with its bound: ``|1/sqrt(s~) - y~| <= y~ |eps~|``
  (``|1/sqrt(1-e) - 1| <= |e|`` for ``|e| <= 1/2``) and ``|1/sqrt(s) - 1/sqrt(s~)| <=
  y~ (1 + |eps~|) ds / s~`` (mean value theorem, ``ds <= s~/4``).
* Range. Inputs above ``INPUT_MAX`` in magnitude, or a state whose column norm or radius
  exceeds ``STATE_MAX`` (or is not finite), leave the row to the referee: below those limits
  no operation overflows, so no infinity can hide behind a later operation.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from .doubledouble import (
    DD_ADD_D_REL,
    DD_ADD_REL,
    DD_MUL_D_REL,
    DD_MUL_REL,
    EXP_REL,
    dd_add,
    dd_add_d,
    dd_mul,
    dd_mul_d,
    exp_dd,
    two_prod,
)

__all__ = [
    "linear_rows",
    "LINEAR_PRM",
    "OP_REL",
    "ETA",
    "GROW",
    "INPUT_MAX",
    "STATE_MAX",
    "MAX_GATE",
]

#: Relative error of one double-double operation against the computed ``|hi(z~)|``: twice the
#: largest proven bound of the operations used (dd_add, dd_add_d, dd_mul, dd_mul_d).
OP_REL = 2 * max(DD_ADD_REL, DD_ADD_D_REL, DD_MUL_REL, DD_MUL_D_REL)
ETA = 2.0**-1040
GROW = 1.0 + 2.0**-30
INPUT_MAX = 2.0**200
STATE_MAX = 2.0**500
MAX_GATE = 60.0
#: A bound of every decay below the exp domain: e^g < 2**-893 for g < -619, 2**g for g < -893.
TINY_DECAY = 2.0**-893
_SUB = 2.0**-1074

#: Slots of ``prm``: whether there are gates, the delta rule, the normalisation, base 2; the
#: scale as a double-double with its error; the normalisation's eps; ln 2 as a double-double
#: with its error.
LINEAR_PRM = (
    "gated",
    "delta",
    "l2norm",
    "base2",
    "scale_hi",
    "scale_lo",
    "scale_err",
    "eps",
    "ln2_hi",
    "ln2_lo",
    "ln2_err",
)
_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")


@numba.jit(**_JIT)
def _norm_up(sumsq, count):
    """An upper bound of sqrt(the exact sum of squares) from its float sum of ``count`` terms."""
    return math.sqrt(sumsq * GROW + count * _SUB) * GROW


@numba.jit(**_JIT)
def _rsqrt_dd(sh, sl, ds):
    """(yh, yl, ry): 1/sqrt(s) for s = sh + sl +- ds (sh > 0), ry < 0 when no bound holds."""
    y0 = 1.0 / math.sqrt(sh)
    th, tl = dd_mul_d(sh, sl, y0)
    th, tl = dd_mul_d(th, tl, y0)
    rh, rl = dd_add_d(-th, -tl, 1.0)
    ch, cl = dd_mul_d(rh, rl, 0.5 * y0)
    yh, yl = dd_add_d(ch, cl, y0)
    # the residual 1 - s~ y~^2 with its own bound
    th, tl = dd_mul(sh, sl, yh, yl)
    uh, ul = dd_mul(th, tl, yh, yl)
    eh, el = dd_add_d(-uh, -ul, 1.0)
    ay = abs(yh) + abs(yl)
    e1 = OP_REL * abs(th) + ETA
    e2 = ay * e1 + OP_REL * abs(uh) + ETA
    bound = (abs(eh) + abs(el) + e2 + OP_REL * abs(eh) + ETA) * GROW
    if not (bound <= 0.25 and ds <= 0.25 * sh):
        return yh, yl, -1.0
    return yh, yl, (ay * (bound + (1.0 + bound) * ds / sh)) * GROW + ETA


@numba.jit(**_JIT)
def _features(x, l2norm, eps, sc, out):
    """Rows (hi, lo, radius) of ``out`` = the (normalised) vector ``x`` times the scale
    ``sc = (hi, lo, err)``; False when the normalisation has no bound."""
    dim = x.shape[0]
    yh, yl, ry = 1.0, 0.0, 0.0
    if l2norm:
        sh, sl, acc = eps, 0.0, 0.0
        for d in range(dim):
            ph, pl = two_prod(x[d], x[d])
            sh, sl = dd_add(sh, sl, ph, pl)
            acc += abs(ph) + abs(sh)
        yh, yl, ry = _rsqrt_dd(sh, sl, OP_REL * acc * GROW + 2 * dim * ETA)
        if ry < 0.0:
            return False
    for d in range(dim):
        xh, xl = dd_mul_d(yh, yl, x[d])
        xr = 0.0
        if l2norm:
            xr = (abs(x[d]) * ry + OP_REL * abs(xh)) * GROW + ETA
        ph, pl = dd_mul(xh, xl, sc[0], sc[1])
        ax, asc = abs(xh) + abs(xl), abs(sc[0]) + abs(sc[1])
        out[0, d], out[1, d] = ph, pl
        out[2, d] = (ax * sc[2] + asc * xr + xr * sc[2] + OP_REL * abs(ph)) * GROW + ETA
    return True


@numba.jit(**_JIT)
def _decay(gv, base2, ln2):
    """(ah, al, ra, ok): the decay base**gv as a double-double with a radius."""
    if gv == 0.0:
        return 1.0, 0.0, 0.0, True
    if gv > MAX_GATE or not gv == gv:
        return 0.0, 0.0, 0.0, False
    if (base2 and gv < -893.0) or (not base2 and gv < -619.0):
        return 0.0, 0.0, TINY_DECAY, True
    if base2 and gv == math.floor(gv):
        return math.ldexp(1.0, int(gv)), 0.0, 0.0, True  # exact: 2**gv is a normal number
    xh, xl, dx = gv, 0.0, 0.0
    if base2:
        xh, xl = dd_mul_d(ln2[0], ln2[1], gv)
        dx = (abs(gv) * ln2[2] + OP_REL * abs(xh)) * GROW + ETA
    ah, al = exp_dd(xh, xl)
    return ah, al, (abs(ah) * (EXP_REL + 2.0 * dx)) * GROW + ETA, True


@numba.jit(**_JIT)
def _decays(g_t, base2, ln2, vec):
    """Rows 6..8 of ``vec`` (decay hi, lo, radius per key row) from the gate(s) ``g_t`` (one
    scalar gate or one per key row); (max |a| + r_a, max r_a, ok)."""
    amax, rmax = 0.0, 0.0
    ah, al, ra, ok = _decay(g_t[0], base2, ln2)
    for d in range(vec.shape[1]):
        if g_t.shape[0] > 1:
            ah, al, ra, ok = _decay(g_t[d], base2, ln2)
        if not ok:
            return 0.0, 0.0, False
        vec[6, d], vec[7, d], vec[8, d] = ah, al, ra
        amax = max(amax, abs(ah) + abs(al) + ra)
        rmax = max(rmax, ra)
    return amax * GROW, rmax, True


@numba.jit(**_JIT)
def _decay_column(s2, e, vec, gated, delta):
    """Pass 1 over column e: the decay in place and the prediction k^T S'. Returns
    (pred hi, pred lo, its operation error, ||S|| before, ||S'||, decay operation error)."""
    dim = s2.shape[2]
    ph_sum, pl_sum, pacc = 0.0, 0.0, 0.0
    n_old, n_mid = 0.0, 0.0
    for d in range(dim):
        sh, sl = s2[0, e, d], s2[1, e, d]
        if gated:
            a = abs(sh) + abs(sl)
            n_old += a * a
            sh, sl = dd_mul(sh, sl, vec[6, d], vec[7, d])
            s2[0, e, d], s2[1, e, d] = sh, sl
        a = abs(sh) + abs(sl)
        n_mid += a * a
        if delta:
            xh, xl = dd_mul(sh, sl, vec[3, d], vec[4, d])
            ph_sum, pl_sum = dd_add(ph_sum, pl_sum, xh, xl)
            pacc += abs(xh) + abs(ph_sum)
    perr = OP_REL * pacc * GROW + 2 * dim * ETA
    return ph_sum, pl_sum, perr, _norm_up(n_old, dim), _norm_up(n_mid, dim)


@numba.jit(**_JIT)
def _update_column(s2, e, vec, th, tl, o_row):
    """Pass 2 over column e: S += k (th + tl) and the output dot product (written to
    ``o_row[0:2]``). Returns (the 2-norm of the update's elementwise operation errors,
    ||S_new||, the output's operation error)."""
    dim = s2.shape[2]
    oh, ol, oacc, n_prod, n_new = 0.0, 0.0, 0.0, 0.0, 0.0
    for d in range(dim):
        xh, xl = dd_mul(vec[3, d], vec[4, d], th, tl)
        sh, sl = dd_add(s2[0, e, d], s2[1, e, d], xh, xl)
        a = abs(xh) + abs(xl)
        n_prod += a * a
        s2[0, e, d], s2[1, e, d] = sh, sl
        a = abs(sh) + abs(sl)
        n_new += a * a
        xh, xl = dd_mul(sh, sl, vec[0, d], vec[1, d])
        oh, ol = dd_add(oh, ol, xh, xl)
        oacc += abs(xh) + abs(oh)
    o_row[0], o_row[1] = oh, ol
    n_new = _norm_up(n_new, dim)
    uerr = OP_REL * (_norm_up(n_prod, dim) + n_new) * GROW + 2 * dim * ETA
    return uerr, n_new, OP_REL * oacc * GROW


@numba.jit(**_JIT)
def _step(s2, rad, vec, sc, v_t, b, o_t):
    """One step of the recurrence on every column; ``sc`` = (||qs||, rho_q, ||k||, rho_k,
    max(|a| + r_a), max r_a, gated, delta). Writes o_t (3, E); False when out of range."""
    dim = s2.shape[2]
    qn, rq, kn, rk, amax, rmax = sc[0], sc[1], sc[2], sc[3], sc[4], sc[5]
    gated, delta = sc[6] != 0.0, sc[7] != 0.0
    kx = kn + rk
    c = 1.0
    if delta and not (b >= 0.0 and b * kx * kx * GROW <= 2.0):
        c = (1.0 + abs(b) * kx * kx) * GROW
    for e in range(s2.shape[1]):
        ph, pl, perr, n_old, n_mid = _decay_column(s2, e, vec, gated, delta)
        r = rad[e]
        if gated:  # the decay's elementwise errors OP_REL |S'_d| + ETA: 2-norm <= OP_REL ||S'||
            r = (amax * r + rmax * n_old + OP_REL * n_mid) * GROW + dim * ETA
        if delta:
            dh, dl = dd_add_d(-ph, -pl, v_t[e])
            derr = perr + OP_REL * abs(dh) + ETA
            th, tl = dd_mul_d(dh, dl, b)
            serr = abs(b) * derr + OP_REL * abs(th) + ETA
            prop = abs(b) * rk * (abs(dh) + abs(dl) + derr) + abs(b) * kx * rk * n_mid
            prop += kn * serr
            r = c * r + prop
        else:
            th, tl = v_t[e], 0.0
            r = r + rk * abs(v_t[e])
        uerr, n_new, oerr = _update_column(s2, e, vec, th, tl, o_t[:, e])
        r = (r + uerr) * GROW
        rad[e] = r
        o_t[2, e] = ((qn + rq) * r + rq * n_new + oerr) * GROW + 2 * dim * ETA
        if not (r <= STATE_MAX and n_new <= STATE_MAX):
            return False
    return True


@numba.jit(**_JIT)
def _vector_facts(vec, row):
    """(norm upper bound of the midpoints, sum of the radii) of rows row..row+2 of ``vec``."""
    sumsq, rsum = 0.0, 0.0
    for d in range(vec.shape[1]):
        a = abs(vec[row, d]) + abs(vec[row + 1, d])
        sumsq += a * a
        rsum += vec[row + 2, d]
    return _norm_up(sumsq, vec.shape[1]), rsum * GROW


@numba.jit(**_JIT)
def _in_range(x):
    for value in x.flat:
        if not abs(value) <= INPUT_MAX:
            return False
    return True


@numba.jit(**_JIT)
def _row(q, k, v, g, beta, h0, prm, o3, s3):
    """One (sequence, value head): q, k (T_n, D), v (T_n, E), g (T_n, 1 or D), beta (T_n),
    h0 (D, E) -> o3 (3, T_n, E) and s3 (3, D, E) as (hi, lo, radius); False when the row is
    left to the referee."""
    steps, dim, edim = q.shape[0], q.shape[1], v.shape[1]
    inputs_ok = _in_range(q) and _in_range(k) and _in_range(v) and _in_range(g)
    if not (inputs_ok and _in_range(beta) and _in_range(h0)):
        return False
    gated, l2norm, base2 = prm[0] != 0.0, prm[2] != 0.0, prm[3] != 0.0
    scale = prm[4:7]
    one = np.array([1.0, 0.0, 0.0])
    ln2 = prm[8:11]
    s2 = np.zeros((2, edim, dim))
    for d in range(dim):
        for e in range(edim):
            s2[0, e, d] = h0[d, e]
    rad = np.zeros(edim)
    vec = np.zeros((9, dim))
    sc = np.zeros(8)
    sc[6], sc[7] = prm[0], prm[1]
    for t in range(steps):
        if not _features(q[t], l2norm, prm[7], scale, vec[0:3]):
            return False
        if not _features(k[t], l2norm, prm[7], one, vec[3:6]):
            return False
        sc[0], sc[1] = _vector_facts(vec, 0)
        sc[2], sc[3] = _vector_facts(vec, 3)
        if gated:
            sc[4], sc[5], ok = _decays(g[t], base2, ln2, vec)
            if not ok:
                return False
        if not _step(s2, rad, vec, sc, v[t], beta[t], o3[:, t]):
            return False
    for d in range(dim):
        for e in range(edim):
            s3[0, d, e], s3[1, d, e], s3[2, d, e] = s2[0, e, d], s2[1, e, d], rad[e]
    return True


@numba.jit(**_JIT, parallel=True)
def linear_rows(q, k, v, g, beta, h0, seg, prm, out, state, ok):
    """Every (sequence n, value head j) row in parallel (each row's arithmetic fixed by the
    shapes): q, k (B, HV, T, D), v (B, HV, T, E), g (B, HV, T, 1 or D), beta (B, HV, T), h0
    (N, HV, D, E), seg (N, 3) = (batch row, start, stop) -> out (3, B, HV, T, E), state
    (3, N, HV, D, E) (hi, lo, radius) and ok (N, HV)."""
    heads = v.shape[1]
    for index in prange(seg.shape[0] * heads):
        n, j = index // heads, index % heads
        b, start, stop = seg[n, 0], seg[n, 1], seg[n, 2]
        ok[n, j] = _row(
            q[b, j, start:stop],
            k[b, j, start:stop],
            v[b, j, start:stop],
            g[b, j, start:stop],
            beta[b, j, start:stop],
            h0[n, j],
            prm,
            out[:, b, j, start:stop],
            state[:, n, j],
        )
