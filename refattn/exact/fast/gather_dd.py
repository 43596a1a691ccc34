"""The double-double step of the fast exact forward on gathered keys: the query rows the
double-precision step of :mod:`refattn.exact.fast.gather_kernels` left undecided (or every row,
for a target of more than 24 bits), in two compiled passes.

1. :func:`grid_dots`, in parallel over spans of :data:`SPAN` listed keys of each group of rows
   that read one list (the query heads of one kv head at one query row): each key's row is
   read from the kv-head plane's own rows W at a time into a (D, W) panel
   (:func:`refattn.exact.fast.gather_lanes._source_panel`: no transposed float64 table of the
   gathered keys is formed) that every row of the group then reads; each (row, key) dot
   product is accumulated on a fixed grid in the lanes of a vector (:func:`grid_dot_bound`
   states the algorithm and its bound: two fma and two additions per term, against ten
   operations for Dot2, with an error of the same order, ``2 D^2 u^2 sigma``).
2. :func:`dd_rows`, in parallel over the rows: each row's scores in double-double
   (:func:`refattn.exact.fast.forward_kernels.score_dd` on the grid sums and their bound),
   the exponentials (``exp_dd_fast``) and the compensated sum of Z as in
   :func:`refattn.exact.fast.forward_kernels.forward_dd`; then

   * a float32 target of the outputs alone (no lse, no weights, keep scale 1): the sums
     ``N_e`` in blocked fma chains on the high words of the exponentials, lane-wise over the
     features (:func:`value_sums`), the outputs decided from one-word quotients
     (:func:`refattn.exact.fast.gather_kernels.float32_outputs`); only the features that
     leaves undecided (heavy cancellation) are summed by Dot2 and decided from double-double
     quotients (:func:`_dd_features`);
   * any other target: every feature by Dot2 (Ogita, Rump and Oishi 2005, Algorithm 5.3;
     :func:`refattn.exact.fast.doubledouble.dot_bound`), the row finished as
     :func:`refattn.exact.fast.forward_kernels.forward_dd` finishes it.

Every key's dot product is its own lane's arithmetic and every row's sums run over its list
in order: no bit depends on the split into spans, on the thread count or on which rows share
a group. Every decided element is the exact result rounded once (the bounds below enclose it);
the others stay undecided (the referee takes them).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ...kernels._simd import JIT, vadd, vfma, vload, vmul, vstore, vzero
from . import doubledouble as D
from ._params import (
    P_DOT_REL,
    P_GAMMA_SUM,
    P_HAS_SINK,
    P_KEEP_ERR,
    P_KEEP_HI,
    P_KEEP_LO,
    P_SINK,
    P_SUM_REL,
    R_HAS_BIAS,
    R_HAS_KEEP,
    R_HAS_MASK,
)
from .allowed_set import key_state
from .doubledouble import EXP_FAST_REL, exp_dd_fast
from .forward_kernels import (
    CUT,
    EMPTY,
    OK,
    RHO_MAX,
    SUM_BLOCK,
    TINY,
    UNDECIDED,
    bias_in_range,
    dot2_step,
    finish_row,
    score_dd,
)
from .gather_kernels import (
    _float32_out,
    _row_columns,
    _scatter_weights,
    exp_rel,
    float32_outputs,
)
from .gather_lanes import W, _source_panel
from .rounding_decision import decide_quick

__all__ = ["SPAN", "dd_step", "dd_rows", "grid_dots", "grid_dot_bound", "value_sums"]

#: Listed keys per task of :func:`grid_dots` (whole panels of W keys).
SPAN = 8 * W

#: Least grid of :func:`grid_dots` (its unit 2**-953 stays a normal float64).
GRID_MIN = 2.0**-900

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")

if JIT:
    from llvmlite import ir
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    @intrinsic
    def vsub(typingctx, x, y):
        """x - y lane-wise, rounded once."""

        def codegen(context, builder, sig, args):
            return builder.fsub(args[0], args[1])

        return x(x, y), codegen

    @intrinsic
    def vfms(typingctx, a, x, y):
        """a * x - y lane-wise, rounded once (a is a scalar, broadcast; -y exact)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[1])
            bits = 64 if isinstance(lt.element, ir.DoubleType) else 32
            fnty = ir.FunctionType(lt, [lt] * 3)
            fn = cgutils.get_or_insert_function(
                builder.module, fnty, f"llvm.fma.v{lt.count}f{bits}"
            )
            undef = ir.Constant(lt, ir.Undefined)
            one = builder.insert_element(undef, args[0], ir.Constant(ir.IntType(32), 0))
            zeros = ir.Constant(ir.VectorType(ir.IntType(32), lt.count), [0] * lt.count)
            splat = builder.shuffle_vector(one, undef, zeros)
            neg = builder.fsub(ir.Constant(lt, [ir.Constant(lt.element, -0.0)] * lt.count), args[2])
            return builder.call(fn, [splat, args[1], neg])

        return x(a, x, y), codegen

else:  # pragma: no cover - exercised by the NUMBA_DISABLE_JIT=1 test tier

    def vsub(x, y):
        return x - y

    def vfms(a, x, y):
        return (a * x - y).astype(x.dtype)


def grid_dot_bound(dim: int, sigma: float) -> float:
    """The bound of :func:`grid_dots`' error on a D-term dot product with grid ``sigma``.

    For each (row, key) the products ``p_d = q_d k_d`` (``P = sum_d |p_d| <= ||q|| ||k||``)
    are added on a grid: with ``sigma = 2**k >= 8 ||q|| ||k||`` (a power of two, at least
    :data:`GRID_MIN`), ``T_0 = sigma`` and for d = 1..D

        t = fl(T + q_d k_d)  (one fma),  c_d = t - T,  r_d = fl(q_d k_d - c_d)  (one fma),
        lo = fl(lo + r_d),  T = t.

    By induction ``T_d = sigma + sum_{d' <= d} c_d'`` with ``|T_d - sigma| <= P + D u sigma <
    sigma / 4``, so every T and t lies in [3 sigma / 4, 5 sigma / 4]: ``c_d = t - T`` is exact
    (Sterbenz's lemma, Higham 2002, Theorem 2.5), ``q_d k_d - c_d = (T + p_d) - t`` is the
    rounding error of t, of magnitude at most ``ulp(t) / 2 <= u sigma`` (u = 2**-53), and so
    is ``hi = T_D - sigma`` exact. Then ``q . k = hi + sum_d (q_d k_d - c_d)``; each r_d errs by
    at most ``u |r_d|`` (Higham 2002, eq. (2.4); no rounding at all for float32 q and k, whose
    products fit in 48 bits) and the recursive sum of the D terms r_d by at most
    ``gamma_{D-1} sum_d |r_d|`` (Higham 2002, eq. (4.4)), so with Lemma 3.3 there

        |hi + lo - q . k| <= D u sigma (u + (1 + u) gamma_{D-1}) <= D gamma_D u sigma
                          <= 2 D^2 u^2 sigma     (D u <= 1/2),

    the same order as Dot2's ``dot_bound(D) ||q|| ||k||`` (Ogita, Rump and Oishi 2005): this
    is the returned value, widened by BOUND_SAFETY for its own evaluation. No term underflows:
    inputs are zero or of a magnitude in [SAFE_MIN, SAFE_MAX] (the first steps' range), the
    products' bits and the grid unit ``2**(k - 53) >= 2**-953`` are normal. (The grid
    accumulation is that of Rump, Ogita and Oishi 2008 and of Demmel and Nguyen's
    reproducible sums, with one fma forming each product's rounding error.)

    >>> grid_dot_bound(576, 2.0**10) < 2.0**-76
    True
    """
    return _grid_bound(dim, sigma)


@numba.jit(**_JIT)
def _grid_bound(dim, sigma):
    return 2.0 * dim * (dim + 1.0) * D.U * D.U * sigma * D.BOUND_SAFETY


@numba.jit(**_JIT)
def _grid(qn, kn):
    """The grid of a (row, key) dot product (:func:`grid_dot_bound`): a power of two at least
    ``8 qn kn`` (16 qn kn rounded twice is above 8 qn kn), at least GRID_MIN."""
    _, e = math.frexp(16.0 * qn * kn)
    return max(math.ldexp(1.0, e), GRID_MIN)


@numba.jit(**_JIT)
def _grid4(q4, panel, dim, sig, hi, lo):
    """Four rows (``q4`` (4, D)) against the W keys of ``panel`` (D, W): the grid sums of
    :func:`grid_dot_bound` in the lanes of four vectors (grids ``sig`` (4, W)), ``hi``
    (4, W) the exact ``T_D - sigma``, ``lo`` the sums of the rounding errors."""
    t0, t1, t2, t3 = vload(sig[0], 0), vload(sig[1], 0), vload(sig[2], 0), vload(sig[3], 0)
    l0 = l1 = l2 = l3 = vzero(panel[0])
    for d in range(dim):
        k = vload(panel[d], 0)
        a = q4[0, d]
        x = vfma(a, k, t0)
        l0 = vadd(l0, vfms(a, k, vsub(x, t0)))
        t0 = x
        a = q4[1, d]
        x = vfma(a, k, t1)
        l1 = vadd(l1, vfms(a, k, vsub(x, t1)))
        t1 = x
        a = q4[2, d]
        x = vfma(a, k, t2)
        l2 = vadd(l2, vfms(a, k, vsub(x, t2)))
        t2 = x
        a = q4[3, d]
        x = vfma(a, k, t3)
        l3 = vadd(l3, vfms(a, k, vsub(x, t3)))
        t3 = x
    vstore(hi[0], 0, vsub(t0, vload(sig[0], 0)))
    vstore(hi[1], 0, vsub(t1, vload(sig[1], 0)))
    vstore(hi[2], 0, vsub(t2, vload(sig[2], 0)))
    vstore(hi[3], 0, vsub(t3, vload(sig[3], 0)))
    vstore(lo[0], 0, l0)
    vstore(lo[1], 0, l1)
    vstore(lo[2], 0, l2)
    vstore(lo[3], 0, l3)


@numba.jit(**_JIT)
def _grid1(qrow, panel, dim, sig, hi, lo):
    """:func:`_grid4` for one row (``sig``, ``hi``, ``lo`` (W,))."""
    t0 = vload(sig, 0)
    l0 = vzero(panel[0])
    for d in range(dim):
        k = vload(panel[d], 0)
        a = qrow[d]
        x = vfma(a, k, t0)
        l0 = vadd(l0, vfms(a, k, vsub(x, t0)))
        t0 = x
    vstore(hi, 0, vsub(t0, vload(sig, 0)))
    vstore(lo, 0, l0)


@numba.jit(**_JIT)
def _panel_norms(panel, m, kn):
    """Upper bounds of the 2-norms of the panel's first m keys (the bound of
    :func:`refattn.exact.fast.gather_lanes.key_facts`: the sum of squares a lane chain, its
    relative error below gamma_2D < 2**-30, then the square root)."""
    acc = vzero(panel[0])
    for d in range(panel.shape[0]):
        t = vload(panel[d], 0)
        acc = vadd(acc, vmul(t, t))
    sums = np.empty(W)
    vstore(sums, 0, acc)
    for cc in range(W):
        kn[cc] = math.sqrt(sums[cc]) * (1.0 + 2.0**-30) + 2.0**-1000 if cc < m else 0.0


@numba.jit(**_JIT)
def _dots_task(task, sorted_rows, inputs, lists, rule, source, dots):
    """:func:`grid_dots` of one task: listed keys ``task[4]:task[4] + SPAN`` of the rows
    ``task[2]:task[3]`` of ``sorted_rows`` (one group: one kv head, one query row)."""
    q, _, _, qn, _, _, _, _, keys_of, _, kvh = inputs
    src, rows = source[0], source[1]
    hi, lo, err = dots
    m0, m1, c0 = task[2], task[3], task[4]
    b, i = sorted_rows[m0, 0], sorted_rows[m0, 2]
    g = kvh[sorted_rows[m0, 1]]
    cols = _row_columns(b, g, i, lists, keys_of, rule)
    c1 = min(cols.shape[0], c0 + SPAN)
    dim = q.shape[3]
    nh = m1 - m0
    qh = np.empty((nh, dim))
    qnh = np.empty(nh)
    for rr in range(nh):
        h = sorted_rows[m0 + rr, 1]
        qh[rr] = q[b, h, i]
        qnh[rr] = qn[b, h, i]
    buf = np.empty((W, dim))
    panel = np.empty((dim, W))
    kn = np.empty(W)
    sig = np.empty((4, W))
    th = np.empty((4, W))
    tl = np.empty((4, W))
    none = (np.empty(0, np.bool_), np.empty(0))
    for c in range(c0, c1, W):
        m = min(W, c1 - c)
        _source_panel(src[b, g], rows[b, g], cols, (c, c), m, buf, panel, none)
        _panel_norms(panel, m, kn)
        r = 0
        while r < nh:
            k = 4 if r + 4 <= nh else 1
            for rr in range(k):
                for cc in range(W):
                    sig[rr, cc] = _grid(qnh[r + rr], kn[cc]) if cc < m else GRID_MIN
            if k == 4:
                _grid4(qh[r : r + 4], panel, dim, sig, th, tl)
            else:
                _grid1(qh[r], panel, dim, sig[0], th[0], tl[0])
            for rr in range(k):
                for cc in range(m):
                    hi[m0 + r + rr, c + cc] = th[rr, cc]
                    lo[m0 + r + rr, c + cc] = tl[rr, cc]
                    err[m0 + r + rr, c + cc] = _grid_bound(dim, sig[rr, cc])
            r += k


@numba.jit(**_JIT, parallel=True)
def grid_dots(tasks, sorted_rows, inputs, lists, rule, source, dots):
    """The dot products of the rows ``sorted_rows`` ((n, 3): b, h, i, each group of one kv head
    and query row contiguous) with their listed keys, in parallel over ``tasks`` ((m, 5): b,
    g, first and end row of a group, first listed key of a span) into ``dots`` = (hi, lo,
    bound) (n, >= listed count), column jj for the row's jj-th listed key in its interval
    (:func:`grid_dot_bound`). ``inputs``, ``lists``, ``rule`` and ``source`` (the keys' own
    rows and each gathered column's row) are the records of
    :func:`refattn.exact.fast.gather_kernels.gather_d`."""
    for t in prange(tasks.shape[0]):
        _dots_task(tasks[t], sorted_rows, inputs, lists, rule, source, dots)


@numba.jit(**_JIT)
def value_sums(vp, cols, wts, use, nsum):
    """``nsum[e] = sum_j wts[j] vp[cols[j], e]`` over the keys with ``use[j]``, in blocked fma
    chains (SUM_BLOCK keys per block from +0, each block then added to the total: every term
    goes through at most ``SUM_BLOCK + n / SUM_BLOCK + 1`` roundings, so the error is at most
    ``gamma`` of that count times ``sum_j wts[j] |v_je|``, Higham 2002, Lemma 3.1), lane-wise
    over the features (the tail feature by feature, the same operations)."""
    vdim = vp.shape[1]
    whole = vdim - vdim % W
    block = np.zeros(vdim)
    for e in range(vdim):
        nsum[e] = 0.0
    n = cols.shape[0]
    for j0 in range(0, n, SUM_BLOCK):
        for e in range(vdim):
            block[e] = 0.0
        for jj in range(j0, min(j0 + SUM_BLOCK, n)):
            if not use[jj]:
                continue
            w = wts[jj]
            vrow = vp[cols[jj]]
            for e in range(0, whole, W):
                vstore(block, e, vfma(w, vload(vrow, e), vload(block, e)))
            for e in range(whole, vdim):
                block[e] = D.fma(w, vrow[e], block[e])
        for e in range(0, whole, W):
            vstore(nsum, e, vadd(vload(nsum, e), vload(block, e)))
        for e in range(whole, vdim):
            nsum[e] += block[e]


@numba.jit(**_JIT)
def _row_scores(r, row, cols, dots, inputs, rule, work):
    """Double-double scores of row ``row`` = (b, h, i) over its listed keys ``cols`` from
    the grid sums ``dots[:][r]``: ``work`` = (s, c, err, state); returns (max score, bias out
    of range)."""
    _, _, _, _, _, _, _, _, keys_of, prm, kvh = inputs
    has_mask, has_bias, has_keep = rule[R_HAS_MASK], rule[R_HAS_BIAS], rule[R_HAS_KEEP]
    s, c, err, state = work
    b, h, i = row[0], row[1], row[2]
    korig = keys_of[b, kvh[h]]
    pr = prm[b, h].copy()
    pr[P_DOT_REL] = 1.0  # the dot product's bound is given whole (qn = bound, kn = 1)
    top = -np.inf
    for jj in range(cols.shape[0]):
        j = korig[cols[jj]]
        st, bv = 2, 0.0
        if has_mask or has_bias or has_keep:
            st, bv = key_state(rule, b, h, i, j)
        state[jj] = st
        if st == 0:
            continue
        if has_bias and not bias_in_range(bv):
            return top, True
        d0, d1, de = dots[0][r, jj], dots[1][r, jj], dots[2][r, jj]
        th, tl, e = score_dd(i, j, d0, d1, de, 1.0, pr, bv, has_bias)
        s[jj], c[jj], err[jj] = th, tl, e
        if th > top:
            top = th
    return top, False


@numba.jit(**_JIT)
def _exps(cols, vp, top, want_w, work, exps):
    """The exponentials of the shifted scores (hi, lo into ``exps`` = (eh, el, use)) and the
    compensated sum of Z; returns (zs, zc, tiny, rho, zv, tiny_v (E,))."""
    s, c, err, state = work
    eh_, el_, use = exps
    vdim = vp.shape[1]
    tiny_v = np.zeros(vdim)
    zs = zc = tiny = rho = zv = 0.0
    for jj in range(cols.shape[0]):
        use[jj] = False
        eh_[jj] = el_[jj] = 0.0
        if state[jj] == 0:
            continue
        xh, xl = D.dd_add_d(s[jj], c[jj], -top)
        xe = (err[jj] + D.DD_REL * abs(xh)) * D.BOUND_SAFETY
        if want_w:
            s[jj], c[jj], err[jj] = xh, xl, xe  # the shifted scores, kept for the weights
        if xh < CUT:
            tiny += TINY
            if state[jj] == 2:
                vrow = vp[cols[jj]]
                for e in range(vdim):
                    tiny_v[e] += abs(vrow[e])
            continue
        rho = max(rho, exp_rel(EXP_FAST_REL, xe))
        eh, el = exp_dd_fast(xh, xl)
        eh_[jj], el_[jj] = eh, el
        zs, es = D.two_sum(zs, eh)
        zc += es + el
        if state[jj] == 2:
            use[jj] = True
            zv += eh
    return zs, zc, tiny, rho, zv, tiny_v


@numba.jit(**_JIT)
def _dot2_feature(vp, cols, exps, e):
    """(s, c) of ``sum_j e_j v_je`` over the used keys by Dot2 (the operations of
    :func:`refattn.exact.fast.forward_kernels.forward_dd`'s value sums, for one feature)."""
    eh_, el_, use = exps
    ns = nc = 0.0
    for jj in range(cols.shape[0]):
        if use[jj]:
            x = vp[cols[jj], e]
            ns, er = dot2_step(ns, eh_[jj], x)
            nc += er + el_[jj] * x
    return ns, nc


@numba.jit(**_JIT)
def _dd_features(index, cols, vp, exps, z, nr, target, out, flags):
    """The flagged features of a float32 target by Dot2 (:func:`_dot2_feature`), each decided
    from its double-double quotient as
    :func:`refattn.exact.fast.forward_kernels.finish_row` decides it (keep scale 1); returns
    whether all are decided."""
    b, h, i = index
    zh, zl, zr = z
    _, _, p, emin, maxf = target
    zlow = zh - zr
    ok = True
    for e in range(flags.shape[0]):
        if not flags[e]:
            continue
        ns, nc = _dot2_feature(vp, cols, exps, e)
        nh, nl = D.two_sum(ns, nc)
        oh, ol = D.dd_div(nh, nl, zh, zl)
        orad = (nr[e] + abs(oh) * 1.0000001 * zr) / zlow + D.DD_REL * abs(oh)
        value, dec = decide_quick(
            oh, ol, (orad + D.DD_REL * abs(oh)) * D.BOUND_SAFETY, p, emin, maxf
        )
        out[b, h, i, e] = value
        ok = ok and dec
    return ok


@numba.jit(**_JIT)
def _float32_row(index, cols, vp, exps, sums, pr, vmax, target, results):
    """The outputs of a float32 target (no lse, no weights, keep scale 1) from Z = (zh, zl,
    zr) and the row's ``rho``, ``tiny_v``, ``zv`` (``sums``): first from one-word sums
    (:func:`value_sums`), whose error against ``N_e = sum_j e_j v_je`` is at most
    ``(gamma + rho + 2u)(1 + 2 rho) X_e`` (gamma: the blocked sums, ``P_GAMMA_SUM``; rho: the
    exponentials' relative error, 2u: the low words dropped, ``|el| <= u eh``) with ``X_e =
    sum_j e_j |v_je| <= vmax_e Zv``, Zv the valued keys' mass; the features left undecided
    by Dot2 (:func:`_dd_features`). Returns whether every output is decided."""
    zh, zl, zr, rho, tiny_v, zv = sums
    eh_, _, use = exps
    mass = min(zh + abs(zl) + zr, zv * (1.0 + rho) * (1.0 + 2.0**-20))
    gam = pr[P_GAMMA_SUM]
    loose = (gam + rho + 2.0 * D.U) * (1.0 + 2.0 * rho) * mass * D.BOUND_SAFETY
    nsum = np.empty(vp.shape[1])
    value_sums(vp, cols, eh_, use, nsum)
    nr = loose * vmax * D.BOUND_SAFETY + TINY * tiny_v
    flags = np.zeros(vp.shape[1], np.bool_)
    count = float32_outputs(
        index, (zh, (abs(zl) + zr) * D.BOUND_SAFETY), (nsum, nr), results[0], flags
    )
    if count == 0:
        return True
    if count < 0:
        return False
    nr = ((pr[P_SUM_REL] + rho) * vmax * mass) * D.BOUND_SAFETY + TINY * tiny_v
    return _dd_features(index, cols, vp, exps, (zh, zl, zr), nr, target, results[0], flags)


@numba.jit(**_JIT)
def _full_row(index, top, cols, vp, exps, sums, pr, vmax, target, results):
    """Every output feature by Dot2 and the row finished by
    :func:`refattn.exact.fast.forward_kernels.finish_row` (the value sums and bounds of
    :func:`refattn.exact.fast.forward_kernels.forward_dd`); returns (decided, log Z hi, lo,
    radius)."""
    zh, zl, zr, rho, tiny_v, zv = sums
    eh_, el_, use = exps
    vdim = vp.shape[1]
    ns, nc = np.zeros(vdim), np.zeros(vdim)
    for jj in range(cols.shape[0]):
        if not use[jj]:
            continue
        vrow = vp[cols[jj]]
        eh, el = eh_[jj], el_[jj]
        for e in range(vdim):
            ns[e], er = dot2_step(ns[e], eh, vrow[e])
            nc[e] += er + el * vrow[e]
    nr = TINY * tiny_v
    if zv > 0.0:  # the valued keys' mass: Z, or less when a sink holds most of it
        mass = min(zh + zr, zv * (1.0 + rho) * (1.0 + 2.0**-20))
        nr = nr + ((pr[P_SUM_REL] + rho) * vmax * mass) * D.BOUND_SAFETY
    return finish_row(index, top, (zh, zl, zr), (ns, nc, nr), pr, target, results)


@numba.jit(**_JIT)
def _dd_row(r, row, dots, inputs, lists, rule, target, results):
    """Double-double step of row ``row`` = (b, h, i) (row r of :func:`grid_dots`' sums);
    returns its status."""
    _, _, vu, _, _, _, _, vmaxu, keys_of, prm, kvh = inputs
    b, h, i = row[0], row[1], row[2]
    g = kvh[h]
    want_w = target[1]
    cols = _row_columns(b, g, i, lists, keys_of, rule)
    n = cols.shape[0]
    pr = prm[b, h]
    vp = vu[b, g]
    work = (np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n, np.int8))
    top, bad = _row_scores(r, row, cols, dots, inputs, rule, work)
    if bad:
        return UNDECIDED
    has_sink, sink = pr[P_HAS_SINK] != 0.0, pr[P_SINK]
    if has_sink and sink > top:  # the sink: one more logit in the max and in Z, no value
        top = sink
    if top == -np.inf:
        return EMPTY
    exps = (np.zeros(n), np.zeros(n), np.zeros(n, np.bool_))
    zs, zc, tiny, rho, zv, tiny_v = _exps(cols, vp, top, want_w, work, exps)
    if has_sink:  # sink - top is exact (TwoSum); the term enters Z after the keys
        xh, xl = D.two_sum(sink, -top)
        if xh < CUT:
            tiny += TINY
        else:
            rho = max(rho, exp_rel(EXP_FAST_REL, D.DD_REL * abs(xh) * D.BOUND_SAFETY))
            eh, el = exp_dd_fast(xh, xl)
            zs, es = D.two_sum(zs, eh)
            zc += es + el
    if not rho <= RHO_MAX:
        return UNDECIDED
    zh, zl = D.two_sum(zs, zc)
    zr = ((pr[P_SUM_REL] + rho) * zh + tiny) * D.BOUND_SAFETY
    sums = (zh, zl, zr, rho, tiny_v, zv)
    keep_one = pr[P_KEEP_HI] == 1.0 and pr[P_KEEP_LO] == 0.0 and pr[P_KEEP_ERR] == 0.0
    if _float32_out(target) and keep_one:
        ok = _float32_row((b, h, i), cols, vp, exps, sums, pr, vmaxu[b, g], target, results)
        return OK if ok else UNDECIDED
    ok, lz_h, lz_l, lz_r = _full_row(
        (b, h, i), top, cols, vp, exps, sums, pr, vmaxu[b, g], target, results
    )
    if ok and want_w:
        ok = _scatter_weights(
            (b, h, i),
            cols,
            keys_of[b, g],
            work[3],
            work[:3],
            (lz_h, lz_l, lz_r),
            target,
            results[2],
        )
    return OK if ok else UNDECIDED


@numba.jit(**_JIT, parallel=True)
def dd_rows(sorted_rows, dots, inputs, lists, rule, target, results):
    """Double-double step of the rows ``sorted_rows`` ((n, 3): b, h, i) from their grid sums
    ``dots`` (:func:`grid_dots`), in parallel over the rows; the records are those of
    :func:`refattn.exact.fast.gather_kernels.gather_d`."""
    status = results[3]
    for r in prange(sorted_rows.shape[0]):
        row = sorted_rows[r]
        status[row[0], row[1], row[2]] = _dd_row(r, row, dots, inputs, lists, rule, target, results)


#: Rows x listed keys of one call of the two passes (their (hi, lo, bound) arrays: 24 bytes
#: each); more rows are taken in several calls.
CHUNK = 1 << 21


def dd_step(rows, inputs, lists, rule, target, results, source) -> None:
    """The double-double step of the query rows ``rows`` ((n, 3): b, h, i), their statuses and
    results into ``results`` (the records of
    :func:`refattn.exact.fast.gather_kernels.gather_d`): the rows grouped by (b, kv head, i)
    (one list each), the grid dot products by spans of listed keys (:func:`grid_dots`), then
    the rows (:func:`dd_rows`), CHUNK elements at a time.

    Examples
    --------
    >>> from refattn.kernels import gather_spec
    >>> from refattn.spec import canonicalize
    >>> from refattn.exact.fast.gather import gather_forward
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((3, 2)), np.array([[1.0], [2.0], [4.0]]))
    >>> gather_forward(gather_spec(spec, np.array([[2, 0]])), np.float64)[0].tolist()
    [[[[2.5]]]]
    """
    kvh = inputs[10]
    counts = lists[1]
    order = np.lexsort((rows[:, 1], rows[:, 2], kvh[rows[:, 1]], rows[:, 0]))
    rows = np.ascontiguousarray(rows[order])
    key = np.stack([rows[:, 0], kvh[rows[:, 1]], rows[:, 2]], axis=1)
    starts = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]).any(axis=1)])
    ends = np.r_[starts[1:], rows.shape[0]]
    chunk = []
    size = 0
    for m0, m1 in zip(starts.tolist(), ends.tolist(), strict=True):
        b, g, i = key[m0].tolist()
        n = int(counts[b, g, i])
        chunk.append((m0, m1, b, g, n))
        size += (m1 - m0) * max(n, 1)
        if size >= CHUNK:
            _chunk(chunk, rows, inputs, lists, rule, target, results, source)
            chunk, size = [], 0
    if chunk:
        _chunk(chunk, rows, inputs, lists, rule, target, results, source)


def _chunk(groups, rows, inputs, lists, rule, target, results, source) -> None:
    """:func:`dd_step` of the rows of ``groups`` ((first, end row, b, g, listed count))."""
    first, last = groups[0][0], groups[-1][1]
    part = rows[first:last]
    width = max(1, max(n for *_, n in groups))
    tasks = np.array(
        [
            (b, g, m0 - first, m1 - first, c0)
            for m0, m1, b, g, n in groups
            for c0 in range(0, n, SPAN)
        ],
        np.int64,
    ).reshape(-1, 5)
    dots = tuple(np.zeros((part.shape[0], width)) for _ in range(3))
    if tasks.shape[0]:
        grid_dots(tasks, part, inputs, lists, rule, source, dots)
    dd_rows(part, dots, inputs, lists, rule, target, results)
