"""The per-row pieces of the fast exact vjp's kernels (:mod:`refattn.exact.fast.vjp` states the
formulas and the error analysis; :mod:`refattn.exact.fast.vjp_passes` runs them over rows and
key blocks): the scores with softcap, bias and ALiBi terms, the weights relative to a
reference key, the dot products with running error bounds, dS and dT of one row
(:func:`row_gradients`, pass A) or of a block of its keys recomputed from the row statistics
(:func:`block_ds`, passes B and C), and the compensated accumulation of dq, dk, dv.

Every value is a double-double with an absolute error bound, held as a triple (hi, lo,
error); the functions take such triples and the row's arrays as tuples (argument records, as
in :mod:`refattn.kernels._args`), never one positional argument per array.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._params import (
    R_BIAS,
    R_BIAS_STRIDES,
    VF_DOT_D,
    VF_DOT_E,
    VF_DOT_S,
    VF_KEEP_ERR,
    VF_KEEP_HI,
    VF_KEEP_LO,
    VF_SCALE_ERR,
    VF_SCALE_HI,
    VF_SCALE_LO,
    VF_SOFTCAP,
    VO_ALIBI_KEYS,
    VO_DROPOUT,
    VO_HAS_ALIBI,
    VO_HAS_BIAS,
    VO_HAS_SOFTCAP,
    VO_OFFSETS,
)
from .doubledouble import (
    BOUND_SAFETY,
    DD_REL,
    EXP_FAST_REL,
    EXP_MIN_ARG,
    dd_add,
    dd_add_d,
    dd_div,
    dd_div_d,
    dd_mul,
    dd_mul_d,
    exp_dd_fast,
    fma,
    two_sum,
)
from .doubledouble import U as _U

__all__ = [
    "UNDERFLOW_TERM",
    "SECOND_ORDER",
    "row_gradients",
    "block_ds",
    "accumulate",
    "dt_of",
    "single_dt",
    "store_scaled",
]

_JIT = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)

#: Absolute term added to every bound for underflow (see :mod:`refattn.exact.fast.vjp`).
UNDERFLOW_TERM = 2.0**-600
#: Upper bound of exp(x) for x below the domain of exp_dd (exp(-620) < 2**-894.4).
_EXP_TINY = 2.0**-894
#: Second-order terms of relative errors below 2**-30.
SECOND_ORDER = 1.0 + 2.0**-30
_SAFE = SECOND_ORDER


@njit(**_JIT)
def _expm1_bound(delta):
    """Upper bound of exp(delta) - 1 for 0 <= delta (inf when delta is not small)."""
    if delta <= 2.0**-20:
        return delta * (1.0 + 2.0**-19)
    return np.inf


@njit(**_JIT)
def _scores(qrow, kt, j0, s_hi, s_lo, s_err, sh, sl, se, k_l1, cd):
    """Scaled scores of one row: dd (sh, sl) with absolute errors se (length S); the dot
    products are :func:`_dots`'s."""
    _dots(qrow, kt, j0, sh, sl, se, k_l1, cd)
    exact_scale = s_lo == 0.0 and s_err == 0.0
    for j in range(sh.shape[0]):
        h, lo, err = sh[j], sl[j], se[j]
        if exact_scale:
            h2, l2 = dd_mul_d(h, lo, s_hi)
            se[j] = abs(s_hi) * err + DD_REL * abs(h2)
        else:
            h2, l2 = dd_mul(h, lo, s_hi, s_lo)
            se[j] = abs(s_hi) * err * _SAFE + abs(h) * s_err * _SAFE + DD_REL * abs(h2)
        sh[j], sl[j] = h2, l2


@njit(**_JIT)
def _exp_with_error(xh, xl, rel):
    """exp(x) as (hi, lo, absolute error): ``rel`` is the relative effect of x's own error;
    below exp_dd's domain the result is 0 with error ``_EXP_TINY``."""
    if xh < EXP_MIN_ARG:
        return 0.0, 0.0, _EXP_TINY
    eh, el = exp_dd_fast(xh, xl)
    return eh, el, eh * (EXP_FAST_REL + rel) * _SAFE


@njit(**_JIT)
def _softcap(cap, sh, sl, se, fh, fl, fe):
    """Scores -> cap * tanh(score / cap) in place; the derivative 1 - tanh^2 into (fh, fl, fe).

    With ``E = exp(-2|y|)`` (absolute error ``eE``): ``tanh|y| = (1 - E)/(1 + E)`` moves by at
    most ``2 eE`` (its derivative in E is ``-2/(1 + E)^2``) plus its own three operations
    (numerator and denominator ``DD_REL (1 + E)`` each, the quotient ``<= 1`` one ``DD_REL``):
    ``2 eE + 22 DD_REL``; ``1 - tanh^2 = 4E/(1 + E)^2`` moves by at most ``4 eE`` plus
    ``27 DD_REL`` of itself (denominator twice, square, quotient).
    """
    for j in range(sh.shape[0]):
        yh, yl = dd_div_d(sh[j], sl[j], cap)
        ey = se[j] / cap * _SAFE + DD_REL * abs(yh)
        sign = 1.0 if yh >= 0.0 else -1.0
        big_h, big_l, big_e = _exp_with_error(
            -2.0 * abs(yh), -2.0 * sign * yl, _expm1_bound(2.0 * ey)
        )
        den_h, den_l = dd_add_d(big_h, big_l, 1.0)
        num_h, num_l = dd_add_d(-big_h, -big_l, 1.0)
        th_h, th_l = dd_div(num_h, num_l, den_h, den_l)
        eth = 2.0 * big_e * _SAFE + 22.0 * DD_REL
        sh[j], sl[j] = dd_mul_d(sign * th_h, sign * th_l, cap)
        se[j] = (cap * eth + DD_REL * abs(sh[j])) * _SAFE
        d2h, d2l = dd_mul(den_h, den_l, den_h, den_l)
        fh[j], fl[j] = dd_div(4.0 * big_h, 4.0 * big_l, d2h, d2l)
        fe[j] = (4.0 * big_e + fh[j] * 27.0 * DD_REL) * _SAFE


@njit(**_JIT)
def _add_terms(index, j0, scores, allowed, rule, slopes, opts):
    """Bias and ALiBi terms of keys ``j0 + t`` (t indexes the scratch row) in place in
    ``scores`` = (hi, lo, error); the bias is the rule's (:mod:`.allowed_set`)."""
    b, h, i = index
    sh, sl, se = scores
    bias, bias_st = rule[R_BIAS], rule[R_BIAS_STRIDES]
    offset, alibi_keys, has_bias, has_alibi = (
        opts[VO_OFFSETS + b],
        opts[VO_ALIBI_KEYS],
        opts[VO_HAS_BIAS],
        opts[VO_HAS_ALIBI],
    )
    base = b * bias_st[0] + h * bias_st[1] + i * bias_st[2]
    for t in range(sh.shape[0]):
        if not allowed[t]:
            continue
        j = j0 + t
        if has_bias:
            sh[t], sl[t] = dd_add_d(sh[t], sl[t], bias[base + j * bias_st[3]])
            se[t] += DD_REL * abs(sh[t])
        if has_alibi and j < alibi_keys:
            dist = float(abs(i + offset - j))
            ah = -slopes[h] * dist
            al = fma(-slopes[h], dist, -ah)
            sh[t], sl[t] = dd_add(sh[t], sl[t], ah, al)
            se[t] += DD_REL * abs(sh[t])


@njit(**_JIT)
def _exp_rel(xh_s, xl_s, xe_s, rh, rl, re):
    """``e_j = exp(t_j - t_r)`` of a non-reference key with its absolute error."""
    xh, xl = dd_add(xh_s, xl_s, -rh, -rl)
    ex = xe_s + re + DD_REL * abs(xh)
    return _exp_with_error(xh, xl, _expm1_bound(ex * _SAFE))


@njit(**_JIT)
def _scaled_weight(eh, el, ee, ih, il, rho_inv):
    """``w_j = e_j (1/Z)`` of a non-reference key with its absolute error."""
    h, lo = dd_mul(eh, el, ih, il)
    return h, lo, (ee * abs(ih) + abs(h) * (rho_inv + DD_REL)) * _SAFE


@njit(**_JIT)
def _weights(sh, sl, se, allowed, wh, wl, we, c_keys):
    """w = exp(t - t_r) / Z for one row (we: absolute errors), with ``r`` the reference key
    (the largest dd score, first on ties); returns (r, 1/Z as a dd, the relative error
    bound of 1/Z), r = -1 for an empty row.

    ``e_r = 1`` exactly; ``sigma = sum_{k != r} e_k`` is a compensated sum (the smaller of
    ``dot_bound(S)`` of its magnitude and the running bound), ``Z = 1 + sigma``;
    ``w_k = e_k (1/Z)`` for ``k != r`` and the reference weight ``w_r = 1 - tau`` with
    ``tau = sigma (1/Z)`` (never ``e_r / Z``): every weight's error is relative to the
    weights of the *other* keys, so a weight ``1 - e^-64`` is known to
    ``2**-99 e^-64`` rather than to ``2**-100``.
    """
    keys = sh.shape[0]
    r = -1
    for j in range(keys):
        if allowed[j] and (r < 0 or sh[j] > sh[r] or (sh[j] == sh[r] and sl[j] > sl[r])):
            r = j
    if r < 0:
        return -1, 0.0, 0.0, 0.0
    rh, rl, re = sh[r], sl[r], se[r]
    # sigma by the compensated sum: its error is within dot_bound(S) of the magnitudes and
    # within the running bound u sum_k (|t_k| + |c_k|) of the two roundings of each update
    # ``c += t``, ``t = el + es`` (TwoSum is exact); the smaller of the two is taken
    zh, zc, ze, zmag, zrun = 0.0, 0.0, 0.0, 0.0, 0.0
    for j in range(keys):
        if not allowed[j] or j == r:
            wh[j], wl[j], we[j] = 0.0, 0.0, 0.0
            continue
        eh, el, ee = _exp_rel(sh[j], sl[j], se[j], rh, rl, re)
        wh[j], wl[j], we[j] = eh, el, ee
        zh, es = two_sum(zh, eh)
        t = el + es
        zc += t
        zrun += abs(t) + abs(zc)
        ze += ee
        zmag += eh
    sig_h, sig_l = two_sum(zh, zc)
    sig_e = (ze + min(c_keys * zmag, _U * zrun * BOUND_SAFETY)) * _SAFE
    z_h, z_l = dd_add_d(sig_h, sig_l, 1.0)
    # Z >= 1: its relative error is the error of sigma over Z plus the addition's DD_REL
    rho_z = (sig_e / z_h + DD_REL) * _SAFE
    ih, il = dd_div(1.0, 0.0, z_h, z_l)
    rho_inv = (rho_z + DD_REL) * _SAFE
    for j in range(keys):
        if allowed[j] and j != r:
            wh[j], wl[j], we[j] = _scaled_weight(wh[j], wl[j], we[j], ih, il, rho_inv)
    tau_h, tau_l = dd_mul(sig_h, sig_l, ih, il)
    tau_e = (sig_e * abs(ih) + abs(tau_h) * (rho_inv + DD_REL)) * _SAFE
    # w_r = 1 - tau: (s, e) = TwoSum(1, -tau_h) is exact, e - tau_l rounds once (<= u of it),
    # and the renormalisation is exact
    s, e = two_sum(1.0, -tau_h)
    lo = e - tau_l
    wh[r], wl[r] = two_sum(s, lo)
    we[r] = (tau_e + _U * abs(lo)) * _SAFE
    return r, ih, il, rho_inv


@njit(**_JIT)
def _dots(arow, bt, j0, outh, outl, oute, b_l1, cn):
    """outh/outl = columns ``j0 .. j0 + n`` of bt (the rows of its transpose) dotted with
    arow, errors oute (n = len(outh); b_l1 indexed like bt's columns); each column's result
    depends on that column alone."""
    keys = outh.shape[0]
    n = arow.shape[0]
    outh[:] = 0.0
    outl[:] = 0.0  # the compensation terms until the final renormalisation
    oute[:] = 0.0  # the running bound's sum until the end
    amax = 0.0
    for d in range(n):
        a = arow[d]
        amax = max(amax, abs(a))
        row = bt[d, j0 : j0 + keys]  # a slice, not bt[d, j0 + j]: the loop then vectorizes
        for j in range(keys):
            b = row[j]
            p = a * b
            ep = fma(a, b, -p)
            s, es = two_sum(outh[j], p)
            outh[j] = s
            t = ep + es
            c = outl[j] + t
            outl[j] = c
            oute[j] += abs(t) + abs(c)
    for j in range(keys):
        outh[j], outl[j] = two_sum(outh[j], outl[j])
        # the smaller of the a-priori bound and the running one (the two roundings of each
        # compensation update, TwoProd and TwoSum being exact)
        oute[j] = min(cn * amax * b_l1[j0 + j], _U * oute[j] * BOUND_SAFETY)


@njit(**_JIT)
def accumulate(ah, al, brow, acc_h, acc_c, acc_r):
    """acc += (ah + al) * brow, compensated (one term of a dd x float64 dot product).

    ``acc_r`` is the running error bound in units of ``u = 2**-53``: the product's high part
    is exact (TwoProd), its low part ``fma(al, b, e)``, the sum ``ep + es`` and ``c + z`` round
    once each, by at most ``u`` of their results; TwoSum is exact.
    """
    for d in range(brow.shape[0]):
        b = brow[d]
        p = ah * b
        ep = fma(al, b, fma(ah, b, -p))
        s, es = two_sum(acc_h[d], p)
        acc_h[d] = s
        z = ep + es
        c = acc_c[d] + z
        acc_c[d] = c
        acc_r[d] += abs(ep) + abs(z) + abs(c)


@njit(**_JIT)
def _y_of(xh, xl, xe, xr_h, xr_l, xr_e):
    """``y_j = x_j - x_r`` of a non-reference key with its absolute error."""
    yh, yl = dd_add(xh, xl, -xr_h, -xr_l)
    return yh, yl, (xe + xr_e + DD_REL * abs(yh)) * _SAFE


@njit(**_JIT)
def _ds_of(is_ref, y, acc, keep, glse, weight):
    """``dS_j = w_j (kf (y_j - D) + g)`` (``-D`` for the reference key) with its error;
    ``y``, ``acc`` (D) and ``weight`` (w_j) as (hi, lo, error), ``keep`` = (dropout, kf hi,
    lo, error), ``glse`` = (has grad_lse, g)."""
    yh, yl, ye = y
    acc_h, acc_l, acc_e = acc
    dropout, kf_h, kf_l, kf_e = keep
    has_glse, g_i = glse
    w_h, w_l, w_e = weight
    if is_ref:
        th, tl, te = -acc_h, -acc_l, acc_e
    else:
        th, tl = dd_add(yh, yl, -acc_h, -acc_l)
        te = ye + acc_e + DD_REL * abs(th)
    if dropout:
        ph, pl = dd_mul(th, tl, kf_h, kf_l)
        te = (abs(kf_h) * te + abs(th) * kf_e + DD_REL * abs(ph)) * _SAFE
        th, tl = ph, pl
    if has_glse:
        th, tl = dd_add_d(th, tl, g_i)
        te += DD_REL * abs(th)
    ds_h, ds_l = dd_mul(w_h, w_l, th, tl)
    ds_e = (w_e * abs(th) + w_h * te + w_e * te + DD_REL * abs(ds_h)) * _SAFE
    return ds_h, ds_l, ds_e


@njit(**_JIT)
def dt_of(ds_h, ds_l, ds_e, f_h, f_l, f_e):
    """``dT_j = dS_j (1 - tanh^2)`` (softcap) with its error."""
    dt_h, dt_l = dd_mul(ds_h, ds_l, f_h, f_l)
    dt_e = (ds_e * f_h + abs(ds_h) * f_e + ds_e * f_e + DD_REL * abs(dt_h)) * _SAFE
    return dt_h, dt_l, dt_e


@njit(**_JIT)
def single_dt(g_i, has_softcap, f_h, f_l, f_e):
    """dT of the one allowed key of a single-key row: ``g`` (times ``1 - tanh^2``)."""
    if has_softcap:
        th, tl = dd_mul_d(f_h, f_l, g_i)
        return th, tl, (abs(g_i) * f_e + DD_REL * abs(th)) * _SAFE
    return g_i, 0.0, 0.0


@njit(**_JIT)
def _block_scores(index, a, row_inputs, allowed, rule, terms, scores, deriv):
    """Scores ``scores`` = (hi, lo, error) and the softcap derivative ``deriv`` of the keys
    ``a .. a + n`` of row i (scratch rows of length n): each element is computed by itself,
    so any key range gives the same bits as the whole row. ``row_inputs`` = (q_i, k^T, v^T,
    dO_i, |k_j|, |v_j|) of the row's plane, ``terms`` = (slopes, opts, fopts)."""
    qrow, kt_bg, k_l1 = row_inputs[0], row_inputs[1], row_inputs[4]
    slopes, opts, fopts = terms
    sh, sl, se = scores
    fh, fl, fe = deriv
    _scores(
        qrow,
        kt_bg,
        a,
        fopts[VF_SCALE_HI],
        fopts[VF_SCALE_LO],
        fopts[VF_SCALE_ERR],
        sh,
        sl,
        se,
        k_l1,
        fopts[VF_DOT_D],
    )
    if opts[VO_HAS_SOFTCAP]:
        _softcap(fopts[VF_SOFTCAP], sh, sl, se, fh, fl, fe)
    _add_terms(index, a, scores, allowed, rule, slopes, opts)


@njit(**_JIT)
def block_ds(index, a, row_stats, glse, row_inputs, sets, rule, terms, scratch):
    """Recompute, for the keys ``a .. a + n`` of row i (scratch rows of length n), the scores
    and softcap derivative (sh .. fe) and, for a kind-1 row (:func:`row_gradients`), the weights
    (wh, wl, we) and dS (dh, dl, de) of its allowed keys from pass A's row statistics ``st``
    (r the reference key, absolute index): every step is elementwise in the key and is the
    same compiled operation on the same operands as in pass A, so the values and bounds are
    bit-identical to pass A's. Used by pass B (dk, dv) and pass C (dbias).

    ``row_stats`` = (kind, r, st), ``glse`` = (has grad_lse, g_i), ``sets`` = (allowed,
    kept), ``scratch`` = (scores, deriv, dS, weights) triples (hi, lo, error); the other
    records as in :func:`_block_scores`."""
    kind, r, st = row_stats
    allowed, kept = sets
    dorow, vt_bg, v_l1 = row_inputs[3], row_inputs[2], row_inputs[5]
    opts, fopts = terms[1], terms[2]
    scores, deriv, ds, weights = scratch
    sh, sl, se = scores
    dh, dl, de = ds
    wh, wl, we = weights
    keep = (opts[VO_DROPOUT], fopts[VF_KEEP_HI], fopts[VF_KEEP_LO], fopts[VF_KEEP_ERR])
    _block_scores(index, a, row_inputs, allowed, rule, terms, scores, deriv)
    if kind != 1:
        return
    _dots(dorow, vt_bg, a, dh, dl, de, v_l1, fopts[VF_DOT_E])
    for t in range(allowed.shape[0]):
        if not allowed[t]:
            continue
        j = a + t
        if j == r:
            w_h, w_l, w_e = st[6], st[7], st[8]
            yh, yl, ye = 0.0, 0.0, 0.0
        else:
            eh, el, ee = _exp_rel(sh[t], sl[t], se[t], st[0], st[1], st[2])
            w_h, w_l, w_e = _scaled_weight(eh, el, ee, st[3], st[4], st[5])
            if kept[t]:
                yh, yl, ye = _y_of(dh[t], dl[t], de[t], st[9], st[10], st[11])
            else:
                yh, yl, ye = _y_of(0.0, 0.0, 0.0, st[9], st[10], st[11])
        dh[t], dl[t], de[t] = _ds_of(
            j == r, (yh, yl, ye), (st[12], st[13], st[14]), keep, glse, (w_h, w_l, w_e)
        )
        wh[t], wl[t], we[t] = w_h, w_l, w_e


@njit(**_JIT)
def row_gradients(index, lo, row_inputs, glse, sets, rule, terms, scratch, stat, sink):
    """dS (dsh, dsl, dse) and dT (in place of the scores arrays) of the keys ``lo .. lo + n``
    of one row (every allowed key of the row lies there); the row statistics that pass B
    needs into ``stat`` (see :func:`refattn.exact.fast.vjp_passes.dq_pass`).

    With a sink (``has_sink``) the scratch rows have length n + 1 and entry n is the sink: an
    always allowed and kept "key" of score exactly ``sigma`` (no scale, softcap, bias or
    ALiBi; softcap derivative 1), key 0 and value 0 (``dp = 0`` exactly); ``allowed[n]`` and
    ``kept[n]`` are set here. The weights, ``D``, dS and dT then run over the n + 1 entries
    as over any key (the sink may be the reference key); dS at entry n is the sink's.

    Returns (kind, r): kind 0 for an empty row, 2 for a row with a single allowed key (its
    weight is exactly 1 and ``dS = dP - dP + g = g`` exactly, whatever the dropout; with a
    sink: the sink alone), 1 otherwise; r the reference key (scratch index; the single key
    for kind 2; n for the sink).

    Records: ``index`` = (b, h, i), ``row_inputs`` = (q_i, k^T, v^T, dO_i, |k_j|, |v_j|),
    ``glse`` = (has grad_lse, g_i), ``sets`` = (allowed, kept), ``terms`` = (slopes, opts,
    fopts), ``scratch`` = (scores, deriv, weights, dp, dS) triples (hi, lo, error) of
    length n (+ 1), ``sink`` = (has sink, sigma).
    """
    has_glse, g_i = glse
    allowed, kept = sets
    dorow, vt_bg, v_l1 = row_inputs[3], row_inputs[2], row_inputs[5]
    opts, fopts = terms[1], terms[2]
    (sh, sl, se), (fh, fl, fe), (wh, wl, we), (dh, dl, de), (dsh, dsl, dse) = scratch
    has_sink, sigma = sink
    has_softcap = opts[VO_HAS_SOFTCAP]
    keep = (opts[VO_DROPOUT], fopts[VF_KEEP_HI], fopts[VF_KEEP_LO], fopts[VF_KEEP_ERR])
    keys = sh.shape[0]
    real = keys - 1 if has_sink else keys
    if real > 0:
        _block_scores(
            index,
            lo,
            row_inputs,
            allowed[:real],
            rule,
            terms,
            (sh[:real], sl[:real], se[:real]),
            (fh[:real], fl[:real], fe[:real]),
        )
    if has_sink:
        allowed[real], kept[real] = True, True
        sh[real], sl[real], se[real] = sigma, 0.0, 0.0
        fh[real], fl[real], fe[real] = 1.0, 0.0, 0.0
    count, only = 0, 0
    for j in range(keys):
        if allowed[j]:
            count += 1
            only = j
    if count == 0:
        return 0, -1
    if count == 1:
        for j in range(keys):
            wh[j], wl[j], we[j] = 0.0, 0.0, 0.0
            dsh[j], dsl[j], dse[j] = 0.0, 0.0, 0.0
            if j != only:
                sh[j], sl[j], se[j] = 0.0, 0.0, 0.0
        wh[only] = 1.0
        dsh[only] = g_i
        sh[only], sl[only], se[only] = single_dt(g_i, has_softcap, fh[only], fl[only], fe[only])
        return 2, only
    r, ih, il, rho_inv = _weights(sh, sl, se, allowed, wh, wl, we, fopts[VF_DOT_S])
    stat[0], stat[1], stat[2] = sh[r], sl[r], se[r]
    if real > 0:
        _dots(dorow, vt_bg, lo, dh[:real], dl[:real], de[:real], v_l1, fopts[VF_DOT_E])
    if has_sink:  # dp of the sink: dO . 0 = 0 exactly
        dh[real], dl[real], de[real] = 0.0, 0.0, 0.0
    # x_j = kappa_j dp_j (kf applied after); y_j = x_j - x_r in place (y_r = 0 exactly)
    for j in range(keys):
        if not (allowed[j] and kept[j]):
            dh[j], dl[j], de[j] = 0.0, 0.0, 0.0
    xr_h, xr_l, xr_e = dh[r], dl[r], de[r]
    for j in range(keys):
        if not allowed[j] or j == r:
            dh[j], dl[j], de[j] = 0.0, 0.0, 0.0
            continue
        dh[j], dl[j], de[j] = _y_of(dh[j], dl[j], de[j], xr_h, xr_l, xr_e)
    # D = sum_{k != r} w_k y_k, so that x_j - Delta' = y_j - D (sum_k w_k = 1): no
    # cancellation against the reference weight w_r (which may be 1 - e^-64)
    # compensated sum: dot_bound(S) of the magnitudes, or the running bound (as for sigma)
    acc_h, acc_c, acc_e, mag, arun = 0.0, 0.0, 0.0, 0.0, 0.0
    for j in range(keys):
        if not allowed[j] or j == r:
            continue
        ph, pl = dd_mul(wh[j], wl[j], dh[j], dl[j])
        acc_h, es = two_sum(acc_h, ph)
        t = pl + es
        acc_c += t
        arun += abs(t) + abs(acc_c)
        acc_e += we[j] * abs(dh[j]) + wh[j] * de[j] + we[j] * de[j]
        mag += abs(ph)
    acc_h, acc_l = two_sum(acc_h, acc_c)
    # products: DD_REL each; the compensated sum: the smaller of its two bounds
    acc_e = (
        acc_e + (DD_REL * mag + min(fopts[VF_DOT_S] * mag, _U * arun * BOUND_SAFETY)) * _SAFE
    ) * _SAFE
    for j in range(keys):
        if not allowed[j]:
            dsh[j], dsl[j], dse[j] = 0.0, 0.0, 0.0
            sh[j], sl[j], se[j] = 0.0, 0.0, 0.0
            continue
        ds_h, ds_l, ds_e = _ds_of(
            j == r, (dh[j], dl[j], de[j]), (acc_h, acc_l, acc_e), keep, glse, (wh[j], wl[j], we[j])
        )
        dsh[j], dsl[j], dse[j] = ds_h, ds_l, ds_e
        if has_softcap:
            sh[j], sl[j], se[j] = dt_of(ds_h, ds_l, ds_e, fh[j], fl[j], fe[j])
        else:
            sh[j], sl[j], se[j] = ds_h, ds_l, ds_e
    stat[3], stat[4], stat[5] = ih, il, rho_inv
    stat[6], stat[7], stat[8] = wh[r], wl[r], we[r]
    stat[9], stat[10], stat[11] = xr_h, xr_l, xr_e
    stat[12], stat[13], stat[14] = acc_h, acc_l, acc_e
    return 1, r


@njit(**_JIT)
def store_scaled(out, index, xh, xl, err, f_h, f_l, f_e):
    """out[:, index] = (x * f, its error bound), f a dd with absolute error f_e."""
    b, h, i, d = index
    if f_l == 0.0 and f_e == 0.0:
        yh, yl = dd_mul_d(xh, xl, f_h)
        e = abs(f_h) * err + DD_REL * abs(yh)
    else:
        yh, yl = dd_mul(xh, xl, f_h, f_l)
        e = (abs(f_h) * err + abs(xh) * f_e) * _SAFE + DD_REL * abs(yh)
    out[0, b, h, i, d], out[1, b, h, i, d] = yh, yl
    out[2, b, h, i, d] = e * BOUND_SAFETY + UNDERFLOW_TERM
