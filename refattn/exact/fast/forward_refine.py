"""The third compiled step of the fast exact forward: a tighter double-double row for the rows
the double-double step left undecided, before the referee.

The double-double step (:func:`refattn.exact.fast.forward_kernels.forward_dd`) bounds its sums
over keys by the a-priori Dot2 bound ``dot_bound(2S) ~ 8 S**2 u**2`` of ``sum_j e_j |v_je|``
(:func:`refattn.exact.fast.doubledouble.dot_bound`: the compensation word of S terms is itself
summed recursively), and its scores by ``dot_bound(D) ||q_i|| ||k_j||``. At S = 32768 that is
2**-73 relative, 2**33 times the double-double unit, and a row whose result lies within about
2**-66 of a float64 rounding midpoint (a few rows in a hundred at that length: nothing is an
exact tie, every such result is irrational) went to the arbitrary-precision referee at several
seconds per row. This step evaluates the row again with the same arithmetic and bounds that
are linear in S (rows are few, so it may cost more per row than the first steps):

1. Scores. The same Dot2 dot products and score arithmetic, with ``|error| = 0`` for the dot
   product where :func:`refattn.exact.fast.forward.exactness_scales` proves the fma chain
   exact (``qs_i ks_j < 2**52``: every product and partial sum is then representable, so
   TwoProd and TwoSum have zero errors and ``s`` is the dot product, ``c = 0``), as for
   quantised inputs (float8, NVFP4, MXFP4) and float16 / bfloat16.
2. Sums in blocks of :data:`REFINE_BLOCK` keys. Within block b a Dot2 sum as in the
   double-double step, ``|s_b + c_b - sum_{j in b} e^_j v_je| <= dot_bound(2 B) P_b`` with
   ``P_b = sum_{j in b} hi(e_j) |v_je|`` (Ogita, Rump and Oishi 2005, Dot2; the bound of
   ``dot_bound``); the block sums enter a double-double accumulator by ``dd_add``, each
   addition erring by at most ``DD_REL |acc|`` of its own computed result (added up as it
   runs: an a-posteriori bound). So
   ``|N^_e - sum_j e^_j v_je| <= dot_bound(2 B) P_e + DD_REL sum_b |acc_b|``, about
   ``2**-90 P_e`` instead of ``2**-73``. The same for Z (v = 1).
3. Exponentials. ``|e_j - e^_j| <= rho e_j`` as in the double-double step, so the
   exponentials add ``rho A_e`` to N and ``rho Z / (1 - rho)`` to Z, with
   ``P_e <= A_e = sum_j e_j |v_je| <= max_j |v_je| zv (1 + 2**-18)``, ``zv`` the float sum of
   the valued keys' ``hi(e_j)`` (nonnegative terms: ``gamma_n < 2**-22`` for ``n < 2**30``;
   ``e <= e^ / (1 - rho)``, ``e^ <= hi(e) (1 + u)``, ``rho <= 2**-20``); keys below ``CUT``
   add ``TINY |v_je|`` (``TINY`` to Z).
4. Inputs. Rows of at least :data:`REFINE_KEYS` keys skip the double-double step (its bound
   leaves many of them undecided; this step costs about as much per row). With k and v as
   quantised codes (:class:`refattn.quantized.QuantisedRows`) and a float64 target, the step
   reads the codes (:func:`code_planes`): each tile of keys and each value row is
   dequantised as it is read, exactly (``table[code] * factor``), and no float64 K^T or V is
   formed; the terms and their order are those of the float64 inputs.

The results (out = N / Z * keep_scale, lse = m + log Z, the weights) and their rounding
decisions are those of the double-double step, from the tighter radii; a row still undecided
goes to the referee, which remains the arbiter (the results are bit-identical to its: both are
the exact result rounded once). Each row's arithmetic depends on the shapes alone.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from . import doubledouble as D
from ._params import (
    P_HAS_SINK,
    P_SINK,
    R_HAS_BIAS,
    R_HAS_KEEP,
    R_HAS_MASK,
    R_ROWS_HI,
    R_ROWS_LO,
    frozen,
)
from .allowed_set import key_state
from .doubledouble import EXP_FAST_REL, exp_dd_fast
from .forward_kernels import (
    CUT,
    EMPTY,
    OK,
    TINY,
    UNDECIDED,
    bias_in_range,
    finish_row,
    row_dots,
    row_weights,
)
from .forward_kernels import score_dd as score

__all__ = ["forward_refine", "code_planes", "REFINE_BLOCK", "REFINE_KEYS", "refine_bounds"]

#: Keys per block of the refined sums (a Dot2 sum within a block, double-double across).
REFINE_BLOCK = 64
#: Rows of at least this many keys skip the double-double step: its sum bound
#: (``dot_bound(2 S)``, above 2**-79 here) leaves a sizeable share of them undecided, and the
#: refined step costs about as much per row.
REFINE_KEYS = 4096
#: The largest relative exponential error the step takes (as the double-double step).
_RHO_MAX = 2.0**-20
#: Exactness threshold of the dot products: ``qs_i ks_j < 2**52`` (exactness_scales).
_EXACT_DOT = 2.0**52

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")


def refine_bounds() -> float:
    """``dot_bound(2 * REFINE_BLOCK)``: the relative bound of one block's Dot2 sum.

    >>> refine_bounds() < 2.0**-90
    True
    """
    return D.dot_bound(2 * REFINE_BLOCK)


#: dot_bound(2 B) of a block's sums (Z's, with v = 1, and N's).
_BLOCK_REL = refine_bounds()


@numba.jit(**_JIT)
def _fold_block(acc, blk, err):
    """Add the block sums ``blk`` = (s, c) into the accumulators ``acc`` = (hi, lo) (both
    arrays of one length), adding ``DD_REL |hi|`` of each new accumulator to ``err``; resets
    the block sums."""
    ah, al = acc
    bs, bc = blk
    for e in range(ah.shape[0]):
        bh, bl = D.two_sum(bs[e], bc[e])
        ah[e], al[e] = D.dd_add(ah[e], al[e], bh, bl)
        err[e] += D.DD_REL * abs(ah[e])
        bs[e] = 0.0
        bc[e] = 0.0


@numba.jit(**_JIT)
def _exact_dots(qrow, kT, lo, s, c):
    """``q_i . k_j`` of the keys ``lo <= j < lo + n`` (entry j - lo of ``s``; ``c`` zeroed) by
    plain multiply-adds, for a row where every key has ``qs_i ks_j < 2**52``: each product
    and partial sum is then a multiple of ``2**(g_i + g_j)`` below ``2**53`` times it
    (:func:`refattn.exact.fast.forward.exactness_scales`), so no operation rounds."""
    n = s.shape[0]
    for jj in range(n):
        s[jj] = 0.0
        c[jj] = 0.0
    for d in range(kT.shape[0]):
        a = qrow[d]
        if a == 0.0:
            continue
        row = kT[d, lo : lo + n]
        for jj in range(n):
            s[jj] += a * row[jj]


@numba.jit(**_JIT)
def _code_dots(qrow, k_codes, lo, s, c, exact):
    """``q_i . k_j`` of the keys ``lo <= j < lo + n`` read from their codes ``k_codes`` =
    (codes (S, D), factors (S, D / n), table): tiles of :data:`REFINE_BLOCK` keys' values
    ``table[code] * factor`` (exact) stored transposed, then the products in increasing d,
    skipping ``q_id = 0`` -- the terms and order of
    :func:`~refattn.exact.fast.forward_kernels.row_dots` (which it calls on the tile) or,
    where ``exact``, of :func:`_exact_dots` (no operation rounds)."""
    codes, factors, table = k_codes
    dim = codes.shape[1]
    size = dim // factors.shape[1]
    n = s.shape[0]
    tile = np.empty((dim, REFINE_BLOCK))
    for t0 in range(0, n, REFINE_BLOCK):
        m = min(REFINE_BLOCK, n - t0)
        for cc in range(m):
            crow, frow = codes[lo + t0 + cc], factors[lo + t0 + cc]
            for blk in range(factors.shape[1]):
                f = frow[blk]
                for d in range(blk * size, (blk + 1) * size):
                    tile[d, cc] = table[crow[d]] * f
        if exact:
            _exact_dots(qrow, tile, 0, s[t0 : t0 + m], c[t0 : t0 + m])
        else:
            row_dots(qrow, tile, 0, m, s[t0 : t0 + m], c[t0 : t0 + m])


@numba.jit(**_JIT)
def _value_row(v_codes, j, row):
    """Value row j from its codes ``v_codes`` = (codes (S, E), factors (S, E / n), table) into
    ``row`` (exact products)."""
    codes, factors, table = v_codes
    size = codes.shape[1] // factors.shape[1]
    for blk in range(factors.shape[1]):
        f = factors[j, blk]
        for x in range(blk * size, (blk + 1) * size):
            row[x] = table[codes[j, x]] * f


@numba.jit(**_JIT)
def _scores(b, h, i, inputs, rule, sce, state, codes):
    """Scores of row i of plane (b, h) into ``sce`` = (hi, lo, err) over its key interval, the
    keys' states into ``state``; returns (top, ok): the row maximum of the scores' high words
    (-inf: no allowed key), ok False where a bias is out of range. ``codes``: see
    :func:`forward_refine`."""
    q, kT, _, qn, kn, qs, ks, _, _, prm, kvh = inputs
    rows_lo, has_mask, has_bias, has_drop = (
        rule[R_ROWS_LO],
        rule[R_HAS_MASK],
        rule[R_HAS_BIAS],
        rule[R_HAS_KEEP],
    )
    s, c, err = sce
    g = kvh[h]
    lo = rows_lo[b, i]
    n = s.shape[0]
    pr = prm[b, h]
    knp, ksp = kn[b, g], ks[b, g]
    qn_i, qs_i = qn[b, h, i], qs[b, h, i]
    rule_arrays = has_mask or has_bias or has_drop
    exact = True
    for jj in range(n):
        exact = exact and qs_i * ksp[lo + jj] < _EXACT_DOT
    if codes[0]:
        _code_dots(q[b, h, i], (codes[1][b, g], codes[2][b, g], codes[5]), lo, s, c, exact)
    elif exact:  # every product and partial sum representable: a plain chain is the dot
        _exact_dots(q[b, h, i], kT[b, g], lo, s, c)
    else:
        row_dots(q[b, h, i], kT[b, g], lo, lo + n, s, c)
    top = -np.inf
    for jj in range(n):
        j = lo + jj
        st, bv = 2, 0.0
        if rule_arrays:
            st, bv = key_state(rule, b, h, i, j)
        state[jj] = st
        if st == 0:
            continue
        if has_bias and not bias_in_range(bv):
            return top, False
        # an exact dot product (s = q.k, c = 0) has no error: a zero norm makes it so
        qn_eff = 0.0 if qs_i * ksp[j] < _EXACT_DOT else qn_i
        th, tl, e = score(i, j, s[jj], c[jj], qn_eff, knp[j], pr, bv, has_bias)
        s[jj], c[jj], err[jj] = th, tl, e
        if th > top:
            top = th
    return top, True


@numba.jit(**_JIT)
def _add_key(blk, eh, el, row):
    """One valued key's terms ``e^_j v_je`` (``e^_j = eh + el``) into the block's Dot2 sums
    ``blk`` = (s, c) (entries 0..E-1)."""
    blk_s, blk_c = blk
    for e in range(row.shape[0]):
        b_ = row[e]
        p = eh * b_
        ep = D.fma(eh, b_, -p)
        t, et = D.two_sum(blk_s[e], p)
        blk_s[e] = t
        blk_c[e] += (ep + et) + el * b_


@numba.jit(**_JIT)
def _add_abs(acc, row):
    """``acc += |row|`` (the values of a key below CUT)."""
    for e in range(acc.shape[0]):
        acc[e] += abs(row[e])


@numba.jit(**_JIT)
def _refine_row(b, h, i, inputs, rule, target, results, codes):
    """The refined row i of plane (b, h) (module docstring, 1-3); returns its status."""
    _, _, v, _, _, _, _, vmax, _, prm, kvh = inputs
    want_w = target[1]
    lo, hi = rule[R_ROWS_LO][b, i], rule[R_ROWS_HI][b, i]
    n = hi - lo
    vdim = results[0].shape[3]
    pr = prm[b, h]
    g = kvh[h]
    vp = v[b, g]
    s, c, err = np.empty(n), np.empty(n), np.empty(n)
    state = np.zeros(n, np.int8)
    top, ok = _scores(b, h, i, inputs, rule, (s, c, err), state, codes)
    v_codes = (codes[3][b, g], codes[4][b, g], codes[6])
    vrow = np.empty(vdim)
    if not ok:
        return UNDECIDED
    has_sink, sink = pr[P_HAS_SINK] != 0.0, pr[P_SINK]
    if has_sink and sink > top:
        top = sink
    if top == -np.inf:
        return EMPTY
    # accumulators: entries 0..vdim-1 for N, entry vdim for Z
    acc_h, acc_l, acc_err = np.zeros(vdim + 1), np.zeros(vdim + 1), np.zeros(vdim + 1)
    blk_s, blk_c = np.zeros(vdim + 1), np.zeros(vdim + 1)
    mass = np.zeros(2)  # float sums of hi(e_j): all keys (Z), the valued keys
    tiny_v = np.zeros(vdim)
    tiny = 0.0
    rho = 0.0
    in_block = 0
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
            if state[jj] == 2 and codes[0]:
                _value_row(v_codes, j, vrow)
                _add_abs(tiny_v, vrow)
            elif state[jj] == 2:
                _add_abs(tiny_v, vp[j, :vdim])
            continue
        rho = max(rho, (EXP_FAST_REL + 2.0 * xe) * (1.0 + _RHO_MAX))
        eh, el = exp_dd_fast(xh, xl)
        blk_s[vdim], es = D.two_sum(blk_s[vdim], eh)
        blk_c[vdim] += es + el
        mass[0] += eh
        if state[jj] == 2:
            mass[1] += eh
            if codes[0]:
                _value_row(v_codes, j, vrow)
                _add_key((blk_s, blk_c), eh, el, vrow)
            else:
                _add_key((blk_s, blk_c), eh, el, vp[j, :vdim])
        in_block += 1
        if in_block == REFINE_BLOCK:
            _fold_block((acc_h, acc_l), (blk_s, blk_c), acc_err)
            in_block = 0
    _fold_block((acc_h, acc_l), (blk_s, blk_c), acc_err)
    if has_sink:  # one more term of Z, after the keys (exact shift: TwoSum)
        xh, xl = D.two_sum(sink, -top)
        if xh < CUT:
            tiny += TINY
        else:
            rho = max(
                rho, (EXP_FAST_REL + 2.0 * D.DD_REL * abs(xh) * D.BOUND_SAFETY) * (1.0 + _RHO_MAX)
            )
            eh, el = exp_dd_fast(xh, xl)
            acc_h[vdim], acc_l[vdim] = D.dd_add(acc_h[vdim], acc_l[vdim], eh, el)
            acc_err[vdim] += D.DD_REL * abs(acc_h[vdim])
            mass[0] += eh
    if not rho <= _RHO_MAX:
        return UNDECIDED
    ok, lz_h, lz_l, lz_r = _finish(
        (b, h, i),
        top,
        (acc_h, acc_l, acc_err, mass),
        (tiny, tiny_v, rho),
        (pr, vmax[b, g]),
        target,
        results,
    )
    if ok and want_w:
        ok = row_weights((b, h, i), lo, state, (s, c, err), (lz_h, lz_l, lz_r), target, results[2])
    return OK if ok else UNDECIDED


@numba.jit(**_JIT)
def _finish(index, top, sums, small, plane, target, results):
    """The radii of Z and N (module docstring, 2-3) and the results by the double-double
    step's :func:`~refattn.exact.fast.forward_kernels.finish_row` (``plane`` = (the plane's
    parameters, max |v_e| over its keys)); returns (decided, log Z hi, lo, radius)."""
    pr, vmax_p = plane
    acc_h, acc_l, acc_err, mass = sums
    tiny, tiny_v, rho = small
    vdim = tiny_v.shape[0]
    zh, zl = D.two_sum(acc_h[vdim], acc_l[vdim])
    z_sum = _BLOCK_REL * mass[0] * (1.0 + 2.0**-18) + acc_err[vdim]
    z_top = zh + z_sum + tiny  # >= the exact sum of the exponentials' enclosures
    zr = (z_sum + rho * z_top / (1.0 - rho) + tiny) * D.BOUND_SAFETY
    nr = np.empty(vdim)
    for e in range(vdim):
        a_e = vmax_p[e] * mass[1] * (1.0 + 2.0**-18)  # >= sum_j e_j |v_je| (and >= P_e)
        nr[e] = (_BLOCK_REL * a_e + acc_err[e] + rho * a_e + TINY * tiny_v[e]) * D.BOUND_SAFETY
    return finish_row(
        index, top, (zh, zl, zr), (acc_h[:vdim], acc_l[:vdim], nr), pr, target, results
    )


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def forward_refine(items, inputs, rule, target, results, codes):
    """The refined step for the query rows ``items`` ((n, 3): b, h, i), in parallel over the
    rows; the argument records are those of
    :func:`refattn.exact.fast.forward_kernels.forward_dd`, whose status it overwrites for
    these rows (OK: decided, written; UNDECIDED: to the referee). ``codes`` =
    :func:`code_planes`: when its flag is set, k and v are read from their codes (K^T and V
    in ``inputs`` may then be empty), else from ``inputs``."""
    status = results[3]
    for r in prange(items.shape[0]):
        b, h, i = items[r, 0], items[r, 1], items[r, 2]
        status[b, h, i] = _refine_row(b, h, i, inputs, rule, target, results, codes)


def code_planes(kv, batch):
    """The ``codes`` record of :func:`forward_refine`: ``(True, k codes (B, K, S, D), k factors
    (B, K, S, D / n), v codes (B, K, S, E), v factors, k table, v table)`` of the streamed
    rows ``kv`` (:class:`refattn.quantized.QuantisedRows`, flat batch ``batch``), or, for
    ``kv`` None, the flag False with empty placeholders."""
    if not kv:
        codes = frozen(np.zeros((1, 1, 1, 1), np.uint8))
        factors, table = frozen(np.ones((1, 1, 1, 1))), frozen(np.zeros(256))
        return (False, codes, factors, codes, factors, table, table)
    out = [True]
    for rows in kv:
        out += [
            frozen(rows.codes.reshape((batch,) + rows.codes.shape[-3:])),
            frozen(rows.factors.reshape((batch,) + rows.factors.shape[-3:])),
        ]
    return tuple(out) + (frozen(kv[0].table), frozen(kv[1].table))
