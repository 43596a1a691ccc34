"""The double-double step of the fast exact forward on gathered keys: the query rows the
double-precision step of :mod:`refattn.exact.fast.gather_kernels` left undecided (or every row,
for a target of more than 24 bits), grouped by list (the query heads of one kv head at one
query row read the same listed keys), in up to three compiled passes (:func:`dd_step`).

1. :func:`grid_dots`, in parallel over spans of :data:`SPAN` listed keys of each group: the
   keys are read from the kv-head plane's own rows W at a time into a (D, W) panel
   (:func:`~refattn.exact.fast.gather_lanes.source_panel`: no transposed float64 table of
   the gathered keys is formed) that every row of the group then reads; each (row, key)
   dot product is accumulated on a fixed grid in the lanes of a vector
   (:func:`grid_dot_bound` states the algorithm and its bound: two fma and two additions
   per term, against ten operations for Dot2, with an error of the same order,
   ``2 D^2 u^2 sigma``).
2. :func:`dd_rows`, over the rows: each row's scores in double-double
   (:func:`refattn.exact.fast.forward_kernels.score_dd` on the grid sums and their bound),
   the exponentials lane-wise (:func:`refattn.exact.fast.doubledouble.exp_dd_fast_lanes`,
   the bits of ``exp_dd_fast``) and the compensated sum of Z, as
   :func:`refattn.exact.fast.forward_kernels.forward_dd` forms them; then, for any target
   but the one below, every feature by Dot2 (Ogita, Rump and Oishi 2005, Algorithm 5.3;
   :func:`refattn.exact.fast.doubledouble.dot_bound`) and the row finished as there.
3. :func:`dd_values`, for a float32 target of the outputs alone (no lse, no weights, keep
   scale 1), in parallel over spans of :data:`FEATURES` output features of each group: the
   sums ``N_e`` in blocked fma chains on the exponentials' high words, each value row's span
   read once for all the group's rows, the outputs decided from one-word quotients
   (:func:`refattn.exact.fast.gather_kernels.float32_outputs`); only the features that
   leaves undecided (heavy cancellation: one or two of 512 per row on a DeepSeek Sparse
   Attention decode step) are summed by Dot2 and decided from double-double quotients.

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
from .doubledouble import EXP_FAST_REL
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
from .gather_kernels import exp_rel, float32_out, float32_outputs, row_columns, scatter_weights
from .gather_lanes import W, source_panel
from .rounding_decision import decide_quick

__all__ = [
    "FEATURES",
    "PENDING",
    "SPAN",
    "dd_rows",
    "dd_step",
    "dd_values",
    "grid_dot_bound",
    "grid_dots",
]

#: Listed keys per task of :func:`grid_dots` (whole panels of W keys).
SPAN = 8 * W

#: Output features per task of :func:`dd_values` (eight lane vectors).
FEATURES = 8 * W

#: The status :func:`dd_rows` gives a row whose outputs :func:`dd_values` decides.
PENDING = -1

#: Least grid of :func:`grid_dots` (its unit 2**-953 stays a normal float64).
GRID_MIN = 2.0**-900

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")

if JIT:
    from numba.core.extending import intrinsic

    @intrinsic
    def vsub(typingctx, x, y):
        """x - y lane-wise, rounded once."""

        def codegen(context, builder, sig, args):
            return builder.fsub(args[0], args[1])

        return x(x, y), codegen

else:  # pragma: no cover - exercised by the NUMBA_DISABLE_JIT=1 test tier

    def vsub(x, y):
        return x - y

    def vfma(a, x, y):
        # fused, lane by lane (the grid sums of grid_dot_bound need one rounding per fma)
        return np.array([D.fma(float(a), float(p), float(q)) for p, q in zip(x, y, strict=True)])


def grid_dot_bound(dim: int, sigma: float) -> float:
    """The bound of :func:`grid_dots`' error on a D-term dot product with grid ``sigma``.

    For each (row, key) the products ``p_d = q_d k_d`` (``P = sum_d |p_d| <= ||q|| ||k||``)
    are added on a grid: with ``sigma = 2**k >= 8 ||q|| ||k||`` (a power of two, at least
    :data:`GRID_MIN`), ``T_0 = sigma`` and for d = 1..D

        t = fl(T + q_d k_d)  (one fma),  r_d = fl(q_d k_d + (T - t))  (one fma),
        lo = fl(lo + r_d),  T = t,

    (``c_d = t - T``, formed negated).

    By induction ``T_d = sigma + sum_{d' <= d} c_d'`` with ``|T_d - sigma| <= P + D u sigma <
    sigma / 4``, so every T and t lies in [3 sigma / 4, 5 sigma / 4]: ``c_d = t - T`` is exact
    (Sterbenz's lemma, Higham 2002, Theorem 2.5), ``q_d k_d - c_d = (T + p_d) - t`` is the
    rounding error of t, of magnitude at most ``ulp(t) / 2 <= u sigma`` (u = 2**-53), and so
    is ``hi = T_D - sigma`` exact. Then ``q . k = hi + sum_d (q_d k_d - c_d)``; each r_d errs by
    at most ``u |r_d|`` (the standard model, Higham 2002, eq. (2.4); no rounding at all for
    float32 q and k, whose products fit in 48 bits) and the recursive sum of the D terms r_d
    by at most ``gamma_{D-1} sum_d |r_d|`` (each term through at most D - 1 roundings,
    Higham 2002, Lemma 3.1), so with Lemma 3.3 (``u + (1 + u) gamma_{D-1} <= gamma_D``)

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
        l0 = vadd(l0, vfma(a, k, vsub(t0, x)))
        t0 = x
        a = q4[1, d]
        x = vfma(a, k, t1)
        l1 = vadd(l1, vfma(a, k, vsub(t1, x)))
        t1 = x
        a = q4[2, d]
        x = vfma(a, k, t2)
        l2 = vadd(l2, vfma(a, k, vsub(t2, x)))
        t2 = x
        a = q4[3, d]
        x = vfma(a, k, t3)
        l3 = vadd(l3, vfma(a, k, vsub(t3, x)))
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
        l0 = vadd(l0, vfma(a, k, vsub(t0, x)))
        t0 = x
    vstore(hi, 0, vsub(t0, vload(sig, 0)))
    vstore(lo, 0, l0)


@numba.jit(**_JIT)
def _panel_norms(panel, m, kn):
    """Upper bounds of the 2-norms of the panel's first m keys (the bound of
    :func:`refattn.exact.fast.gather_lanes.key_facts`: the sum of squares a lane chain, its
    relative error below gamma_2D < 2**-30 in any order, Higham 2002, eq. (3.5): here two
    chains, even and odd features, then added; then the square root)."""
    acc = vzero(panel[0])
    odd = vzero(panel[0])
    dim = panel.shape[0]
    for d in range(0, dim - 1, 2):
        t = vload(panel[d], 0)
        acc = vadd(acc, vmul(t, t))
        t = vload(panel[d + 1], 0)
        odd = vadd(odd, vmul(t, t))
    if dim % 2:
        t = vload(panel[dim - 1], 0)
        acc = vadd(acc, vmul(t, t))
    sums = np.empty(W)
    vstore(sums, 0, vadd(acc, odd))
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
    cols = row_columns(b, g, i, lists, keys_of, rule)
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
    nofacts = (np.zeros(0, np.bool_), np.zeros(0))  # the keys' range checks: not asked
    sig = np.empty((4, W))
    th = np.empty((4, W))
    tl = np.empty((4, W))
    for c in range(c0, c1, W):
        m = min(W, c1 - c)
        source_panel(src[b, g], rows[b, g], cols, (c, 0), m, buf, panel, nofacts)
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
    """The exponentials (hi, lo into ``exps`` = (eh, el, use); ``use``: the key enters N)
    of the shifted scores, by :func:`refattn.exact.fast.doubledouble.exp_dd_fast_lanes`
    (the bits of ``exp_dd_fast``), and the compensated sum of Z over the keys in order;
    returns (zs, zc, tiny, rho, zv, tiny_v (E,))."""
    s, c, err, state = work
    eh_, el_, use = exps
    n = cols.shape[0]
    xh, xl = np.zeros(n), np.zeros(n)
    tiny_v = np.zeros(vp.shape[1])
    tiny = rho = 0.0
    for jj in range(n):
        use[jj] = False
        if state[jj] == 0:
            continue
        h, lo = D.dd_add_d(s[jj], c[jj], -top)
        xe = (err[jj] + D.DD_REL * abs(h)) * D.BOUND_SAFETY
        if want_w:
            s[jj], c[jj], err[jj] = h, lo, xe  # the shifted scores, kept for the weights
        if h < CUT:
            tiny += TINY
            if state[jj] == 2:
                vrow = vp[cols[jj]]
                for e in range(vrow.shape[0]):
                    tiny_v[e] += abs(vrow[e])
            continue
        rho = max(rho, exp_rel(EXP_FAST_REL, xe))
        xh[jj], xl[jj] = h, lo
        use[jj] = True
    D.exp_dd_fast_lanes(xh, xl, eh_, el_)
    zs = zc = zv = 0.0
    for jj in range(n):
        if not use[jj]:
            eh_[jj] = el_[jj] = 0.0
            continue
        zs, es = D.two_sum(zs, eh_[jj])
        zc += es + el_[jj]
        use[jj] = state[jj] == 2  # a dropped key's term is in Z, not in N
        if use[jj]:
            zv += eh_[jj]
    return zs, zc, tiny, rho, zv, tiny_v


@numba.jit(**_JIT)
def _full_row(index, top, cols, vp, exps, sums, pr, vmax, target, results):
    """Every output feature by Dot2 (Ogita, Rump and Oishi 2005, Algorithm 5.3; the bound
    ``dot_bound(2 (S + sink))`` of :func:`refattn.exact.fast.doubledouble.dot_bound`) and the
    row finished by :func:`refattn.exact.fast.forward_kernels.finish_row` (the value sums and
    bounds of :func:`refattn.exact.fast.forward_kernels.forward_dd`); returns (decided,
    log Z hi, lo, radius)."""
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
def _dd_row(r, row, dots, inputs, lists, rule, target, results, kept):
    """Double-double step of row ``row`` = (b, h, i) (row r of :func:`grid_dots`' sums) up to
    its value sums; returns its status, or PENDING when its outputs are left to
    :func:`dd_values` (a float32 target of the outputs alone, keep scale 1), its
    exponentials and Z kept in ``kept`` = (eh, el, use (n, >= listed), z (n, 5): zh, zl, zr,
    rho, zv, tiny_v (n, E))."""
    _, _, vu, _, _, _, _, vmaxu, keys_of, prm, kvh = inputs
    b, h, i = row[0], row[1], row[2]
    g = kvh[h]
    want_w = target[1]
    cols = row_columns(b, g, i, lists, keys_of, rule)
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
    exps = (kept[0][r, :n], kept[1][r, :n], kept[2][r, :n])
    zs, zc, tiny, rho, zv, tiny_v = _exps(cols, vp, top, want_w, work, exps)
    if has_sink:  # sink - top is exact (TwoSum); the term enters Z after the keys
        xh, xl = D.two_sum(sink, -top)
        if xh < CUT:
            tiny += TINY
        else:
            rho = max(rho, exp_rel(EXP_FAST_REL, D.DD_REL * abs(xh) * D.BOUND_SAFETY))
            eh, el = D.exp_dd_fast(xh, xl)
            zs, es = D.two_sum(zs, eh)
            zc += es + el
    if not rho <= RHO_MAX:
        return UNDECIDED
    zh, zl = D.two_sum(zs, zc)
    zr = ((pr[P_SUM_REL] + rho) * zh + tiny) * D.BOUND_SAFETY
    keep_one = pr[P_KEEP_HI] == 1.0 and pr[P_KEEP_LO] == 0.0 and pr[P_KEEP_ERR] == 0.0
    if float32_out(target) and keep_one:
        z = kept[3][r]
        z[0], z[1], z[2], z[3], z[4] = zh, zl, zr, rho, zv
        kept[4][r] = tiny_v
        return PENDING
    sums = (zh, zl, zr, rho, tiny_v, zv)
    ok, lz_h, lz_l, lz_r = _full_row(
        (b, h, i), top, cols, vp, exps, sums, pr, vmaxu[b, g], target, results
    )
    if ok and want_w:
        ok = scatter_weights(
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
def dd_rows(sorted_rows, dots, inputs, lists, rule, target, results, kept, pending):
    """Double-double step of the rows ``sorted_rows`` ((n, 3): b, h, i) from their grid sums
    ``dots`` (:func:`grid_dots`), in parallel over the rows: their statuses, or
    ``pending[r]`` set for the rows whose outputs :func:`dd_values` decides (``kept``: see
    :func:`_dd_row`); the records are those of
    :func:`refattn.exact.fast.gather_kernels.gather_d`."""
    status = results[3]
    for r in prange(sorted_rows.shape[0]):
        row = sorted_rows[r]
        got = _dd_row(r, row, dots, inputs, lists, rule, target, results, kept)
        pending[r] = got == PENDING
        if got != PENDING:
            status[row[0], row[1], row[2]] = got


#: :func:`dd_rows` compiled without threads (the same loop body and bits), for a step of a
#: few rows (each row's keys: a fraction of the other passes' work): on a loaded machine a
#: parallel region may wait a scheduler slice for the second core.
dd_rows_serial = numba.jit(**_JIT)(dd_rows.py_func)

#: Rows x listed keys below which :func:`dd_step` runs :func:`dd_rows_serial`.
SERIAL_ROWS = 1 << 16


@numba.jit(**_JIT)
def _span_block(vp, cols, j0, j1, e0, wts, use, brow):
    """``brow[e] += sum_{j0 <= jj < j1, use[jj]} wts[jj] v_{cols[jj], e0 + e}`` for the
    FEATURES features of a span: one block's fma chain from +0 in eight lane vectors (in
    registers), then added to ``brow``."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero(brow)
    for jj in range(j0, j1):
        if not use[jj]:
            continue
        w = wts[jj]
        vrow = vp[cols[jj]]
        a0 = vfma(w, vload(vrow, e0), a0)
        a1 = vfma(w, vload(vrow, e0 + W), a1)
        a2 = vfma(w, vload(vrow, e0 + 2 * W), a2)
        a3 = vfma(w, vload(vrow, e0 + 3 * W), a3)
        a4 = vfma(w, vload(vrow, e0 + 4 * W), a4)
        a5 = vfma(w, vload(vrow, e0 + 5 * W), a5)
        a6 = vfma(w, vload(vrow, e0 + 6 * W), a6)
        a7 = vfma(w, vload(vrow, e0 + 7 * W), a7)
    vstore(brow, 0, vadd(vload(brow, 0), a0))
    vstore(brow, W, vadd(vload(brow, W), a1))
    vstore(brow, 2 * W, vadd(vload(brow, 2 * W), a2))
    vstore(brow, 3 * W, vadd(vload(brow, 3 * W), a3))
    vstore(brow, 4 * W, vadd(vload(brow, 4 * W), a4))
    vstore(brow, 5 * W, vadd(vload(brow, 5 * W), a5))
    vstore(brow, 6 * W, vadd(vload(brow, 6 * W), a6))
    vstore(brow, 7 * W, vadd(vload(brow, 7 * W), a7))


@numba.jit(**_JIT)
def _chunk_sums(vp, cols, e0, rows, kept, pending, total):
    """``total[rr, e] = sum_j eh_j v_{j, e0 + e}`` for the pending rows ``rows`` = (first,
    count) over the keys each uses, in blocked fma chains (SUM_BLOCK keys per block from +0,
    each block then added to the total), lane-wise over FEATURES features: every term goes
    through at most ``SUM_BLOCK + n / SUM_BLOCK + 1`` roundings, so the error is at most
    gamma of that count (``P_GAMMA_SUM``) times ``sum_j eh_j |v_je|`` (Higham 2002, Lemma
    3.1). A block's value spans (SUM_BLOCK x FEATURES) stay in cache for all the rows."""
    m0, nh = rows
    eh, use = kept[0], kept[2]
    ne = min(FEATURES, vp.shape[1] - e0)
    block = np.zeros(FEATURES)
    n = cols.shape[0]
    for j0 in range(0, n, SUM_BLOCK):
        j1 = min(j0 + SUM_BLOCK, n)
        for rr in range(nh):
            r = m0 + rr
            if not pending[r]:
                continue
            if ne == FEATURES:
                _span_block(vp, cols, j0, j1, e0, eh[r], use[r], total[rr])
                continue
            block[:ne] = 0.0
            for jj in range(j0, j1):
                if use[r, jj]:
                    w = eh[r, jj]
                    vrow = vp[cols[jj]]
                    for e in range(ne):
                        block[e] = D.fma(w, vrow[e0 + e], block[e])
            for e in range(ne):
                total[rr, e] += block[e]


@numba.jit(**_JIT)
def _dot2_features(vp, cols, e0, m0, pairs, kept, sums):
    """``sums`` = (s, c) of ``sum_j e_j v_je`` by Dot2 (:func:`_full_row`'s sum, feature by
    feature) for the (row ``m0 + pairs[f, 0]``, feature ``e0 + pairs[f, 1]``) pairs, over
    each row's used keys in order: one sweep of the keys' value rows for all the pairs."""
    eh, el, use = kept[0], kept[1], kept[2]
    s, c = sums
    for f in range(pairs.shape[0]):
        s[f] = c[f] = 0.0
    for jj in range(cols.shape[0]):
        vrow = vp[cols[jj]]
        for f in range(pairs.shape[0]):
            r = m0 + pairs[f, 0]
            if use[r, jj]:
                x = vrow[e0 + pairs[f, 1]]
                s[f], er = dot2_step(s[f], eh[r, jj], x)
                c[f] += er + el[r, jj] * x


@numba.jit(**_JIT)
def _decide_feature(index, e, n, z, nr, target, out):
    """Output e of a float32 target from its Dot2 sum ``n`` = (s, c) and Z = (zh, zl, zr),
    decided from the double-double quotient as
    :func:`refattn.exact.fast.forward_kernels.finish_row` decides it (keep scale 1);
    returns whether it is decided."""
    b, h, i = index
    zh, zl, zr = z
    _, _, p, emin, maxf = target
    nh, nl = D.two_sum(n[0], n[1])
    oh, ol = D.dd_div(nh, nl, zh, zl)
    orad = (nr + abs(oh) * 1.0000001 * zr) / (zh - zr) + 2.0 * D.DD_REL * abs(oh)
    value, dec = decide_quick(oh, ol, orad * D.BOUND_SAFETY, p, emin, maxf)
    out[b, h, i, e] = value
    return dec


@numba.jit(**_JIT)
def _row_radii(r, h, e0, ne, vmax, kept, prm_b):
    """(loose, dd) radii (ne,) of row r's sums over features e0:e0 + ne: of the one-word
    sums, ``(gamma + rho + 2u)(1 + 2 rho) vmax_e Zv``, and of the Dot2 sums, ``(dot_bound +
    rho) vmax_e Zv`` (:func:`_values_task`), each with the tiny terms' ``TINY sum |v_je|``."""
    zh, zl, zr, rho, zv = kept[3][r]
    tiny_v = kept[4][r, e0 : e0 + ne]
    mass = min(zh + abs(zl) + zr, zv * (1.0 + rho) * (1.0 + 2.0**-20))
    loose = (prm_b[h, P_GAMMA_SUM] + rho + 2.0 * D.U) * (1.0 + 2.0 * rho) * mass
    nr = loose * D.BOUND_SAFETY * vmax * D.BOUND_SAFETY + TINY * tiny_v
    dd = ((prm_b[h, P_SUM_REL] + rho) * vmax * mass) * D.BOUND_SAFETY + TINY * tiny_v
    return nr, dd


@numba.jit(**_JIT)
def _values_task(task, sorted_rows, kept, inputs, lists, rule, target, results):
    """:func:`dd_values` of one task: output features ``task[2]:task[2] + FEATURES`` of the
    pending rows ``task[0]:task[1]`` of one group. The outputs are decided from one-word
    sums first (:func:`_chunk_sums`), whose error against ``N_e = sum_j e_j v_je`` is at most
    ``(gamma + rho + 2u)(1 + 2 rho) X_e`` (gamma: the blocked sums; rho: the exponentials'
    relative error; 2u: the low words dropped, ``|el| <= u eh``), ``X_e = sum_j e_j |v_je|
    <= vmax_e Zv`` (Zv the valued keys' mass), by
    :func:`refattn.exact.fast.gather_kernels.float32_outputs`; the features that leaves
    undecided (heavy cancellation) by Dot2 (:func:`_dot2_features`, error ``(dot_bound(2
    (S + sink)) + rho) X_e``), decided from double-double quotients."""
    _, _, vu, _, _, _, _, vmaxu, keys_of, prm, kvh = inputs
    m0, m1, e0 = task[0], task[1], task[2]
    pending, done = kept[5], kept[6]
    b, i = sorted_rows[m0, 0], sorted_rows[m0, 2]
    g = kvh[sorted_rows[m0, 1]]
    cols = row_columns(b, g, i, lists, keys_of, rule)
    vp = vu[b, g]
    ne = min(FEATURES, vp.shape[1] - e0)
    total = np.zeros((m1 - m0, FEATURES))
    _chunk_sums(vp, cols, e0, (m0, m1 - m0), kept, pending, total)
    out = results[0][:, :, :, e0 : e0 + ne]
    vmax = vmaxu[b, g, e0 : e0 + ne]
    pairs = np.empty(((m1 - m0) * ne, 2), np.int64)
    radii = np.empty((m1 - m0, ne))
    count = 0
    span = e0 // FEATURES
    for rr in range(m1 - m0):
        r = m0 + rr
        if not pending[r]:
            continue
        h = sorted_rows[r, 1]
        nr, radii[rr] = _row_radii(r, h, e0, ne, vmax, kept, prm[b])
        zh, zl, zr = kept[3][r, 0], kept[3][r, 1], kept[3][r, 2]
        flags = np.zeros(ne, np.bool_)
        z = (zh, (abs(zl) + zr) * D.BOUND_SAFETY)
        left = float32_outputs((b, h, i), z, (total[rr, :ne], nr), out, flags)
        done[r, span] = left >= 0  # -1: Z's radius too wide, every output undecided
        for e in range(ne if left > 0 else 0):
            if flags[e]:
                pairs[count, 0], pairs[count, 1] = rr, e
                count += 1
    if count == 0:
        return
    sums = (np.empty(count), np.empty(count))
    _dot2_features(vp, cols, e0, m0, pairs[:count], kept, sums)
    for f in range(count):
        r = m0 + pairs[f, 0]
        z = (kept[3][r, 0], kept[3][r, 1], kept[3][r, 2])
        index = (b, sorted_rows[r, 1], i)
        n = (sums[0][f], sums[1][f])
        dec = _decide_feature(
            index, e0 + pairs[f, 1], n, z, radii[pairs[f, 0], pairs[f, 1]], target, results[0]
        )
        done[r, span] = done[r, span] and dec


@numba.jit(**_JIT, parallel=True)
def dd_values(tasks, sorted_rows, kept, inputs, lists, rule, target, results):
    """The outputs of the rows :func:`dd_rows` left pending, in parallel over ``tasks`` ((m,
    3): first and end row of a group, first feature of a span of FEATURES): per task, every
    listed value row's span read once for all the group's rows (:func:`_values_task`);
    ``done[r, span]`` (``kept[6]``) records whether all of the span's outputs of row r are
    decided. Each output's sums run over its row's keys in order: no bit depends on the
    split or the thread count."""
    for t in prange(tasks.shape[0]):
        _values_task(tasks[t], sorted_rows, kept, inputs, lists, rule, target, results)


#: Rows x (listed keys + E) of one call of the passes (per row and listed key: the dot
#: products' (hi, lo, bound) and the kept exponentials, 48 bytes; per row and feature: the
#: tiny terms' value sums); more rows are taken in several calls.
CHUNK = 1 << 20


def dd_step(rows, inputs, lists, rule, target, results, source) -> None:
    """The double-double step of the query rows ``rows`` ((n, 3): b, h, i), their statuses and
    results into ``results`` (the records of
    :func:`refattn.exact.fast.gather_kernels.gather_d`): the rows grouped by (b, kv head, i)
    (one list each), the grid dot products by spans of listed keys (:func:`grid_dots`), the
    rows (:func:`dd_rows`), the outputs left pending by spans of features
    (:func:`dd_values`), CHUNK elements at a time.

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
    vdim = inputs[2].shape[3]
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
        size += (m1 - m0) * (max(n, 1) + vdim)
        if size >= CHUNK:
            _chunk(chunk, rows, inputs, lists, rule, target, results, source)
            chunk, size = [], 0
    if chunk:
        _chunk(chunk, rows, inputs, lists, rule, target, results, source)


def _chunk(groups, rows, inputs, lists, rule, target, results, source) -> None:
    """:func:`dd_step` of the rows of ``groups`` ((first, end row, b, g, listed count))."""
    first, last = groups[0][0], groups[-1][1]
    part = rows[first:last]
    count = part.shape[0]
    width = max(1, max(n for *_, n in groups))
    tasks = np.array(
        [
            (b, g, m0 - first, m1 - first, c0)
            for m0, m1, b, g, n in groups
            for c0 in range(0, n, SPAN)
        ],
        np.int64,
    ).reshape(-1, 5)
    dots = tuple(np.zeros((count, width)) for _ in range(3))
    if tasks.shape[0]:
        grid_dots(tasks, part, inputs, lists, rule, source, dots)
    vdim = inputs[2].shape[3]
    spans = -(-vdim // FEATURES)
    pending = np.zeros(count, np.bool_)
    done = np.zeros((count, spans), np.bool_)
    kept = (
        np.zeros((count, width)),
        np.zeros((count, width)),
        np.zeros((count, width), np.bool_),
        np.zeros((count, 5)),
        np.zeros((count, vdim)),
        pending,
        done,
    )
    step = dd_rows_serial if count * width < SERIAL_ROWS else dd_rows
    step(part, dots, inputs, lists, rule, target, results, kept, pending)
    if not pending.any():
        return
    tasks = np.array(
        [(m0 - first, m1 - first, e0) for m0, m1, *_ in groups for e0 in range(0, vdim, FEATURES)],
        np.int64,
    ).reshape(-1, 3)
    dd_values(tasks, part, kept, inputs, lists, rule, target, results)
    status = results[3]
    at = pending.nonzero()[0]
    decided = done[at].all(axis=1)
    status[part[at, 0], part[at, 1], part[at, 2]] = np.where(decided, OK, UNDECIDED)
