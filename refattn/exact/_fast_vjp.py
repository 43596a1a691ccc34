"""Fast first step of the exact VJP: double-double enclosures in a Numba kernel.

Every gradient element of :func:`refattn.attention_vjp` is computed in double-double (dd)
arithmetic (:mod:`refattn.exact._dd`) together with a rigorous bound on its absolute
error, then rounded by :func:`refattn.exact.rounding.decide_dd`; elements whose bound
straddles a rounding boundary (ties, heavy cancellation, underflow) are left to the referee
(:class:`refattn.exact.attention_vjp.ExactVJP`, the Ziv loop with exact tie handling).

Formulas (the referee's, :func:`refattn.attention_vjp`): with ``t`` the scores, ``w`` the
pre-dropout weights, ``kappa`` the keep-mask and ``kf = 1/(1-p)``,

* ``dp_ij = dO_i . v_j``, ``dP_ij = kappa_ij kf dp_ij``, ``Delta_i = sum_j w_ij dP_ij``;
* ``dS_ij = w_ij (dP_ij - Delta_i + g_i)`` on allowed positions (dbias = dS);
* ``dT = dS (1 - tanh^2(x/c))`` with softcap ``c`` (``x`` the scaled score before it);
* ``dq_i = s sum_j dT_ij k_j``, ``dk_j = s sum_{h in group, i} dT_ij q_i``,
  ``dv_j = kf sum_{h, i} kappa_ij w_ij dO_i``.

Error analysis (``u = 2**-53``; every bound below is an upper bound of the exact error):

* dot products of exact inputs (``q_i . k_j``, ``dO_i . v_j``) use the compensated scheme
  ``(p, e) = two_prod``, ``(s, e') = two_sum(s, p)``, ``c += e + e'``; over n terms the pair
  ``(s, c)`` is within ``dot_bound(n) A`` of the exact sum (:func:`refattn.exact._dd.dot_bound`,
  about ``2 n^2 u^2``), ``A = sum |a_k b_k|`` bounded by ``max_k |a_k| * sum_k |b_k|``;
* the accumulations of dq, dk, dv (dd factor ``a_h + a_l`` times a float64 ``b``) use the same
  scheme with the low word folded in by one fma, ``e = fma(a_l, b, fma(a_h, b, -p))``, and a
  *running* error bound: TwoProd and TwoSum are exact, and the three roundings of a step
  (the outer fma, ``z = e + e'``, ``c + z``) err by at most ``u (|e| + |z| + |c_new|)``. A
  sum whose terms are exact (an input times a weight ``1 = 1.0 + 0.0``, sums of a few
  float32 inputs in float64) thus carries no rounding error at all, where the a-priori
  ``dot_bound(n) A`` (``~2**-97 A`` for n = 16) would hide a result ``e^-64`` from a rounding
  midpoint;
* the errors of the factors carried into dq, dk, dv (``err(dS_ij)`` times ``|k_jd|``, and the
  like): the smaller of the max-error form ``max_j err(dS_ij) * sum_j |k_jd|`` and the term-by-
  term sum ``sum_j err(dS_ij) |k_jd|`` (nonnegative products summed in float64: within
  ``(1 + u)**(n + 1) <= 1 + 2**-20`` of the exact sum); the second is the tighter where one
  key's error dominates (the reference key's), as on Gaussian rows;
* every other dd operation errs by at most ``DD_REL = 2**-100`` of its result (four times the
  largest JMP bound, :mod:`refattn.exact._dd`);
* scores: the scale (a dd for 1/sqrt(D)), softcap via ``E = exp(-2|y|)``,
  ``tanh|y| = (1 - E)/(1 + E)`` (absolute error ``2 eE + 22 DD_REL``) and
  ``1 - tanh^2 = 4E/(1 + E)^2`` (absolute error ``4 eE + 27 DD_REL`` of itself), bias and
  ALiBi (``slope * distance`` exact by two_prod) one ``DD_REL`` each;
* weights, relative to a reference key ``r`` of each row (the largest dd score, first on
  ties): ``e_ij = exp(t_ij - t_ir)`` for ``j != r`` has relative error
  ``EXP_FAST_REL + expm1(err t_ij + err t_ir)`` (below ``EXP_MIN_ARG``: 0 with absolute error
  ``2**-894``), ``e_ir = 1`` exactly; ``sigma_i = sum_{j != r} e_ij`` is a compensated sum
  (``dot_bound(S)`` of its magnitude), ``Z_i = 1 + sigma_i``, ``w_ij = e_ij (1/Z_i)`` and
  ``w_ir = 1 - tau_i`` with ``tau_i = sigma_i (1/Z_i)`` (the exact ``1 - tau_h`` by TwoSum,
  then one rounding of at most ``u`` of the low word): no weight is ever ``e_ir / Z_i``, so
  the error of every weight is relative to the weights of the other keys (a top weight
  ``1 - e^-64`` is known to about ``2**-92 e^-64``, not to ``2**-94``);
* ``dP_ij - Delta_i`` (the softmax Jacobian in ``dS`` above) in the cancellation-free
  reference-key form: with ``x_j = kappa_ij dp_ij`` and ``y_j = x_j - x_r`` (``y_r = 0``
  exactly; error ``err x_j + err x_r + DD_REL |y_j|``), ``sum_j w_ij = 1`` gives
  ``x_j - sum_k w_ik x_k = y_j - D_i`` with ``D_i = sum_{k != r} w_ik y_k`` (a compensated
  sum: the products' first-order errors plus ``(DD_REL + dot_bound(S))`` of the sum of
  magnitudes). ``dS_ir = -w_ir D_i``, and the errors of every ``dS_ij`` are in proportion
  to the non-reference weights, where the direct ``dP_ir - Delta_i`` with ``w_ir ~ 1``
  would carry ``Delta_i``'s absolute error (``~2**-94 |dP|``, the top weight's) against a
  result ``~e^-64 |dP|``: no correct rounding could be decided from it. ``kf``
  multiplies ``y_j - D_i`` afterwards (one dd product); the further steps are dd products
  and sums whose errors are the first-order JMP bounds plus the products of the operands'
  errors;
* every bound computed in float64 is multiplied by ``1 + 2**-20`` (it is a sum/product of
  fewer than ``2**25`` non-negative terms, so its own rounding stays below ``2**-26``
  relative), and ``2**-600`` is added for underflow: the fast step is used only when every
  input is finite with magnitude below ``2**60`` (and the scale, softcap and slopes are in
  range), so an intermediate's underflow loss (``<= 2**-1070`` per operation, fewer than
  ``2**40`` operations per element) is amplified by less than ``2**420`` on its way to an
  output.

Any non-finite intermediate in a (batch, kv head) unit marks the whole unit undecided.

Work units are (batch, kv head) pairs (``prange``); inside a unit the query heads of the group
and their rows are processed in increasing order, each row holding only its own length-S
vectors, so the results depend on the shapes alone (not on the thread count).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._dd import (
    BOUND_SAFETY,
    DD_REL,
    EXP_MIN_ARG,
    dd_add,
    dd_add_d,
    dd_div,
    dd_div_d,
    dd_mul,
    dd_mul_d,
    dd_of_exact,
    dd_of_fraction,
    dot_bound,
    fma,
    two_sum,
)
from ._dd_extra import EXP_FAST_REL, exp_dd_fast, round_decision

_JIT = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)
__all__ = ["INPUT_LIMIT", "UNDERFLOW_TERM", "fast_inputs_ok", "gradient_enclosures",
           "reduce_enclosure",
           "decide"]

#: Inputs (and the scale, softcap, ALiBi terms) must be below this magnitude for the fast step.
INPUT_LIMIT = 2.0**60
#: Absolute term added to every bound for underflow (see the module docstring).
UNDERFLOW_TERM = 2.0**-600
#: Upper bound of exp(x) for x below the domain of exp_dd (exp(-620) < 2**-894.4).
_EXP_TINY = 2.0**-894
_SAFE = 1.0 + 2.0**-30  # second-order terms of relative errors below 2**-30
_U = 2.0**-53  # unit roundoff of float64


@njit(**_JIT)
def _expm1_bound(delta):
    """Upper bound of exp(delta) - 1 for 0 <= delta (inf when delta is not small)."""
    if delta <= 2.0**-20:
        return delta * (1.0 + 2.0**-19)
    return np.inf


@njit(**_JIT)
def _scores(qrow, kt, s_hi, s_lo, s_err, sh, sl, se, k_l1, cd):
    """Scaled scores of one row: dd (sh, sl) with absolute errors se (length S); the dot
    products are :func:`_dots`'s."""
    _dots(qrow, kt, sh, sl, se, k_l1, cd)
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
        big_h, big_l, big_e = _exp_with_error(-2.0 * abs(yh), -2.0 * sign * yl,
                                              _expm1_bound(2.0 * ey))
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
def _add_terms(b, h, i, sh, sl, se, bias, slopes, offset, alibi_keys, has_bias, has_alibi,
               allowed):
    for j in range(sh.shape[0]):
        if not allowed[j]:
            continue
        if has_bias:
            sh[j], sl[j] = dd_add_d(sh[j], sl[j], bias[b, h, i, j])
            se[j] += DD_REL * abs(sh[j])
        if has_alibi and j < alibi_keys:
            dist = float(abs(i + offset - j))
            ah = -slopes[h] * dist
            al = fma(-slopes[h], dist, -ah)
            sh[j], sl[j] = dd_add(sh[j], sl[j], ah, al)
            se[j] += DD_REL * abs(sh[j])


@njit(**_JIT)
def _weights(sh, sl, se, allowed, wh, wl, we, c_keys):
    """w = exp(t - t_r) / Z for one row (we: absolute errors), with ``r`` the reference key
    (the largest dd score, first on ties); returns r, or -1 for an empty row.

    ``e_r = 1`` exactly; ``sigma = sum_{k != r} e_k`` is a compensated sum (``dot_bound(S)`` of
    its magnitude), ``Z = 1 + sigma``; ``w_k = e_k (1/Z)`` for ``k != r`` and the reference
    weight ``w_r = 1 - tau`` with ``tau = sigma (1/Z)`` (never ``e_r / Z``): every weight's
    error is relative to the weights of the *other* keys, so a weight ``1 - e^-64`` is known to
    ``2**-99 e^-64`` rather than to ``2**-100``.
    """
    keys = sh.shape[0]
    r = -1
    for j in range(keys):
        if allowed[j] and (r < 0 or sh[j] > sh[r] or (sh[j] == sh[r] and sl[j] > sl[r])):
            r = j
    if r < 0:
        return -1
    rh, rl, re = sh[r], sl[r], se[r]
    zh, zc, ze, zmag = 0.0, 0.0, 0.0, 0.0  # sigma by the compensated sum (dot_bound(S))
    for j in range(keys):
        if not allowed[j] or j == r:
            wh[j], wl[j], we[j] = 0.0, 0.0, 0.0
            continue
        xh, xl = dd_add(sh[j], sl[j], -rh, -rl)
        ex = se[j] + re + DD_REL * abs(xh)
        eh, el, ee = _exp_with_error(xh, xl, _expm1_bound(ex * _SAFE))
        wh[j], wl[j], we[j] = eh, el, ee
        zh, es = two_sum(zh, eh)
        zc += el + es
        ze += ee
        zmag += eh
    sig_h, sig_l = two_sum(zh, zc)
    sig_e = (ze + c_keys * zmag) * _SAFE
    z_h, z_l = dd_add_d(sig_h, sig_l, 1.0)
    # Z >= 1: its relative error is the error of sigma over Z plus the addition's DD_REL
    rho_z = (sig_e / z_h + DD_REL) * _SAFE
    ih, il = dd_div(1.0, 0.0, z_h, z_l)
    rho_inv = (rho_z + DD_REL) * _SAFE
    for j in range(keys):
        if allowed[j] and j != r:
            h, lo = dd_mul(wh[j], wl[j], ih, il)
            we[j] = (we[j] * abs(ih) + abs(h) * (rho_inv + DD_REL)) * _SAFE
            wh[j], wl[j] = h, lo
    tau_h, tau_l = dd_mul(sig_h, sig_l, ih, il)
    tau_e = (sig_e * abs(ih) + abs(tau_h) * (rho_inv + DD_REL)) * _SAFE
    # w_r = 1 - tau: (s, e) = TwoSum(1, -tau_h) is exact, e - tau_l rounds once (<= u of it),
    # and the renormalisation is exact
    s, e = two_sum(1.0, -tau_h)
    lo = e - tau_l
    wh[r], wl[r] = two_sum(s, lo)
    we[r] = (tau_e + _U * abs(lo)) * _SAFE
    return r


@njit(**_JIT)
def _dots(arow, bt, outh, outl, oute, b_l1, cn):
    """outh/outl = rows of bt (transposed) dotted with arow, errors oute."""
    keys = outh.shape[0]
    n = arow.shape[0]
    acc_c = np.zeros(keys)
    outh[:] = 0.0
    amax = 0.0
    for d in range(n):
        a = arow[d]
        amax = max(amax, abs(a))
        for j in range(keys):
            b = bt[d, j]
            p = a * b
            ep = fma(a, b, -p)
            s, es = two_sum(outh[j], p)
            outh[j] = s
            acc_c[j] += ep + es
    for j in range(keys):
        outh[j], outl[j] = two_sum(outh[j], acc_c[j])
        oute[j] = cn * amax * b_l1[j]


@njit(**_JIT)
def _accumulate(ah, al, brow, acc_h, acc_c, acc_r):
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
def _row(b, h, g, i, q, kt, vt, do, glse, has_glse, allowed, kept, bias, slopes, opts, fopts,
         k_l1, v_l1, sh, sl, se, fh, fl, fe, wh, wl, we, dh, dl, de, dsh, dsl, dse):
    """dS (dsh, dsl, dse) and dT (in place of the scores arrays) of one row.

    Returns 0 for an empty row, 2 for a row with a single allowed key (its weight is exactly
    1 and ``dS = dP - dP + g = g`` exactly, whatever the dropout), 1 otherwise.
    """
    has_bias, has_alibi, has_softcap, alibi_keys, dropout = opts[0], opts[1], opts[2], \
        opts[3], opts[4]
    offset = opts[5 + b]  # ALiBi's offset of batch row b
    s_hi, s_lo, s_err, cap, kf_h, kf_l, kf_e = fopts[0], fopts[1], fopts[2], fopts[3], \
        fopts[4], fopts[5], fopts[6]
    keys = sh.shape[0]
    _scores(q[b, h, i], kt[b, g], s_hi, s_lo, s_err, sh, sl, se, k_l1, fopts[7])
    if has_softcap:
        _softcap(cap, sh, sl, se, fh, fl, fe)
    _add_terms(b, h, i, sh, sl, se, bias, slopes, offset, alibi_keys, has_bias, has_alibi,
               allowed)
    g_i = glse[b, h, i] if has_glse else 0.0
    count, only = 0, 0
    for j in range(keys):
        if allowed[j]:
            count += 1
            only = j
    if count == 0:
        return 0
    if count == 1:
        _single_key(only, g_i, has_softcap, sh, sl, se, fh, fl, fe, wh, wl, we, dsh, dsl, dse)
        return 2
    r = _weights(sh, sl, se, allowed, wh, wl, we, fopts[9])
    _dots(do[b, h, i], vt[b, g], dh, dl, de, v_l1, fopts[8])
    # x_j = kappa_j dp_j (kf applied after); y_j = x_j - x_r in place (y_r = 0 exactly)
    for j in range(keys):
        if not (allowed[j] and kept[j]):
            dh[j], dl[j], de[j] = 0.0, 0.0, 0.0
    xr_h, xr_l, xr_e = dh[r], dl[r], de[r]
    for j in range(keys):
        if not allowed[j] or j == r:
            dh[j], dl[j], de[j] = 0.0, 0.0, 0.0
            continue
        yh, yl = dd_add(dh[j], dl[j], -xr_h, -xr_l)
        de[j] = (de[j] + xr_e + DD_REL * abs(yh)) * _SAFE
        dh[j], dl[j] = yh, yl
    # D = sum_{k != r} w_k y_k, so that x_j - Delta' = y_j - D (sum_k w_k = 1): no
    # cancellation against the reference weight w_r (which may be 1 - e^-64)
    acc_h, acc_c, acc_e, mag = 0.0, 0.0, 0.0, 0.0  # compensated sum (dot_bound(S))
    for j in range(keys):
        if not allowed[j] or j == r:
            continue
        ph, pl = dd_mul(wh[j], wl[j], dh[j], dl[j])
        acc_h, es = two_sum(acc_h, ph)
        acc_c += pl + es
        acc_e += we[j] * abs(dh[j]) + wh[j] * de[j] + we[j] * de[j]
        mag += abs(ph)
    acc_h, acc_l = two_sum(acc_h, acc_c)
    # products: DD_REL each; the compensated sum: dot_bound(S) of the sum of magnitudes
    acc_e = (acc_e + (DD_REL + fopts[9]) * mag * _SAFE) * _SAFE
    for j in range(keys):
        if not allowed[j]:
            dsh[j], dsl[j], dse[j] = 0.0, 0.0, 0.0
            sh[j], sl[j], se[j] = 0.0, 0.0, 0.0
            continue
        if j == r:
            th, tl, te = -acc_h, -acc_l, acc_e
        else:
            th, tl = dd_add(dh[j], dl[j], -acc_h, -acc_l)
            te = de[j] + acc_e + DD_REL * abs(th)
        if dropout:
            ph, pl = dd_mul(th, tl, kf_h, kf_l)
            te = (abs(kf_h) * te + abs(th) * kf_e + DD_REL * abs(ph)) * _SAFE
            th, tl = ph, pl
        if has_glse:
            th, tl = dd_add_d(th, tl, g_i)
            te += DD_REL * abs(th)
        ds_h, ds_l = dd_mul(wh[j], wl[j], th, tl)
        ds_e = (we[j] * abs(th) + wh[j] * te + we[j] * te + DD_REL * abs(ds_h)) * _SAFE
        dsh[j], dsl[j], dse[j] = ds_h, ds_l, ds_e
        if has_softcap:
            dt_h, dt_l = dd_mul(ds_h, ds_l, fh[j], fl[j])
            dt_e = (ds_e * fh[j] + abs(ds_h) * fe[j] + ds_e * fe[j] + DD_REL * abs(dt_h)) * _SAFE
            sh[j], sl[j], se[j] = dt_h, dt_l, dt_e
        else:
            sh[j], sl[j], se[j] = ds_h, ds_l, ds_e
    return 1


@njit(**_JIT)
def _single_key(only, g_i, has_softcap, sh, sl, se, fh, fl, fe, wh, wl, we, dsh, dsl, dse):
    """A row with one allowed key: w = 1, dS = g exactly, dT = g (1 - tanh^2) with softcap."""
    for j in range(sh.shape[0]):
        wh[j], wl[j], we[j] = 0.0, 0.0, 0.0
        dsh[j], dsl[j], dse[j] = 0.0, 0.0, 0.0
        if j != only:
            sh[j], sl[j], se[j] = 0.0, 0.0, 0.0
    wh[only] = 1.0
    dsh[only] = g_i
    if has_softcap:
        th, tl = dd_mul_d(fh[only], fl[only], g_i)
        sh[only], sl[only] = th, tl
        se[only] = (abs(g_i) * fe[only] + DD_REL * abs(th)) * _SAFE
    else:
        sh[only], sl[only], se[only] = g_i, 0.0, 0.0


@njit(**_JIT)
def _unit(unit, q, k, kt, vt, do, glse, has_glse, allowed, kept, bias, slopes, group, opts,
          fopts, dq, dk, dv, dbias, bad):
    kv_heads = k.shape[1]
    b, g = unit // kv_heads, unit % kv_heads
    length, dim = q.shape[2], q.shape[3]
    keys, vdim = kt.shape[3], vt.shape[2]
    has_bias, dropout = opts[0], opts[4]
    s_hi, s_lo, s_err = fopts[0], fopts[1], fopts[2]
    kf_h, kf_l, kf_e = fopts[4], fopts[5], fopts[6]
    k_l1 = np.zeros(keys)
    k_col = np.zeros(dim)
    for j in range(keys):
        for d in range(dim):
            k_l1[j] += abs(k[b, g, j, d])
            k_col[d] += abs(k[b, g, j, d])
    v_l1 = np.zeros(keys)
    for e in range(vdim):
        for j in range(keys):
            v_l1[j] += abs(vt[b, g, e, j])
    k_l1 *= BOUND_SAFETY
    k_col *= BOUND_SAFETY
    v_l1 *= BOUND_SAFETY
    row = np.empty((15, keys))
    sh, sl, se, fh, fl, fe, wh, wl, we, dh, dl, de, dsh, dsl, dse = \
        row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8], row[9], \
        row[10], row[11], row[12], row[13], row[14]
    dq_h, dq_c, dq_r = np.zeros(dim), np.zeros(dim), np.zeros(dim)
    dk_h, dk_c, dk_r = np.zeros((keys, dim)), np.zeros((keys, dim)), np.zeros((keys, dim))
    dv_h, dv_c, dv_r = np.zeros((keys, vdim)), np.zeros((keys, vdim)), np.zeros((keys, vdim))
    dk_emax, dv_emax = np.zeros(keys), np.zeros(keys)
    # the propagated errors sum_j err(dS_ij) |k_jd| (and the like for dk, dv) term by term: a
    # sum of nonnegative products, within (1 + u)**(n + 1) <= BOUND_SAFETY of its float64 value;
    # the smaller of it and the max-error form (emax * column sum) bounds the error
    dq_p = np.zeros(dim)
    dk_p, dv_p = np.zeros((keys, dim)), np.zeros((keys, vdim))
    q_sum, do_sum = np.zeros(dim), np.zeros(vdim)
    dk_terms, dv_terms = np.zeros(keys, np.int64), np.zeros(keys, np.int64)
    check = 0.0
    for member in range(group.shape[1]):
        h = group[g, member]
        for i in range(length):
            allowed_row = allowed[b, h, i]
            for d in range(dim):
                q_sum[d] += abs(q[b, h, i, d])
            for e in range(vdim):
                do_sum[e] += abs(do[b, h, i, e])
            kind = _row(b, h, g, i, q, kt, vt, do, glse, has_glse, allowed_row, kept[b, h, i],
                        bias, slopes, opts, fopts, k_l1, v_l1, sh, sl, se, fh, fl, fe, wh, wl,
                        we, dh, dl, de, dsh, dsl, dse)
            if kind == 0:  # empty row: zero gradients, exactly
                dq[:, b, h, i, :] = 0.0
                if has_bias:
                    dbias[:, b, h, i, :] = 0.0
                continue
            # dS = dT = 0 exactly when g = 0 and either a single key is allowed (weight 1,
            # dS = dP - dP) or no allowed key is kept (dP = Delta = 0)
            no_kept = True
            for j in range(keys):
                if allowed_row[j] and kept[b, h, i, j]:
                    no_kept = False
            zero_row = (kind == 2 or no_kept) and (not has_glse or glse[b, h, i] == 0.0)
            if has_bias:
                for j in range(keys):
                    dbias[0, b, h, i, j] = dsh[j]
                    dbias[1, b, h, i, j] = dsl[j]
                    # excluded positions and single-key rows are exact
                    dbias[2, b, h, i, j] = (dse[j] * BOUND_SAFETY + UNDERFLOW_TERM
                                            if allowed_row[j] and kind == 1 and not zero_row
                                            else 0.0)
            dq_h[:] = 0.0
            dq_c[:] = 0.0
            dq_r[:] = 0.0
            dq_p[:] = 0.0
            emax = 0.0
            for j in range(keys):
                if not allowed_row[j]:
                    continue
                check += se[j] + abs(sh[j]) + we[j] + dse[j]
                if kind == 2 and kept[b, h, i, j]:  # weight exactly 1
                    _accumulate(1.0, 0.0, do[b, h, i], dv_h[j], dv_c[j], dv_r[j])
                    dv_terms[j] += 1
                if zero_row:
                    continue
                emax = max(emax, se[j])
                _accumulate(sh[j], sl[j], k[b, g, j], dq_h, dq_c, dq_r)
                _accumulate(sh[j], sl[j], q[b, h, i], dk_h[j], dk_c[j], dk_r[j])
                for d in range(dim):
                    dq_p[d] += se[j] * abs(k[b, g, j, d])
                    dk_p[j, d] += se[j] * abs(q[b, h, i, d])
                dk_terms[j] += 1
                dk_emax[j] = max(dk_emax[j], se[j])
                if kept[b, h, i, j] and kind == 1:
                    _accumulate(wh[j], wl[j], do[b, h, i], dv_h[j], dv_c[j], dv_r[j])
                    for e in range(vdim):
                        dv_p[j, e] += we[j] * abs(do[b, h, i, e])
                    dv_terms[j] += 1
                    dv_emax[j] = max(dv_emax[j], we[j])
            if zero_row:
                dq[:, b, h, i, :] = 0.0
                continue
            for d in range(dim):
                xh, xl = two_sum(dq_h[d], dq_c[d])
                err = (min(emax * k_col[d], dq_p[d] * BOUND_SAFETY) + _U * dq_r[d]) \
                    * BOUND_SAFETY
                if k_col[d] == 0.0:  # a zero column of k: every product is an exact zero
                    dq[:, b, h, i, d] = 0.0
                    continue
                _store_scaled(dq, (b, h, i, d), xh, xl, err, s_hi, s_lo, s_err)
    for j in range(keys):
        if dk_terms[j] == 0:  # no allowed position reads key j: exact zeros
            dk[:, b, g, j, :] = 0.0
        if dv_terms[j] == 0:
            dv[:, b, g, j, :] = 0.0
        for d in range(dim if dk_terms[j] else 0):
            xh, xl = two_sum(dk_h[j, d], dk_c[j, d])
            err = (min(dk_emax[j] * q_sum[d], dk_p[j, d] * BOUND_SAFETY)
                   + _U * dk_r[j, d]) * BOUND_SAFETY * BOUND_SAFETY
            if q_sum[d] == 0.0:  # q's column d is zero in every row of the group
                dk[:, b, g, j, d] = 0.0
                continue
            _store_scaled(dk, (b, g, j, d), xh, xl, err, s_hi, s_lo, s_err)
        for e in range(vdim if dv_terms[j] else 0):
            xh, xl = two_sum(dv_h[j, e], dv_c[j, e])
            err = (min(dv_emax[j] * do_sum[e], dv_p[j, e] * BOUND_SAFETY)
                   + _U * dv_r[j, e]) * BOUND_SAFETY * BOUND_SAFETY
            if do_sum[e] == 0.0:  # dO's column e is zero in every row of the group
                dv[:, b, g, j, e] = 0.0
                continue
            if dropout:
                _store_scaled(dv, (b, g, j, e), xh, xl, err, kf_h, kf_l, kf_e)
            else:
                dv[0, b, g, j, e], dv[1, b, g, j, e] = xh, xl
                dv[2, b, g, j, e] = err * BOUND_SAFETY + UNDERFLOW_TERM
    if not math.isfinite(check):
        bad[b, g] = True


@njit(**_JIT)
def _store_scaled(out, index, xh, xl, err, f_h, f_l, f_e):
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


@njit(parallel=True, **_JIT)
def _units(q, k, kt, vt, do, glse, has_glse, allowed, kept, bias, slopes, group, opts, fopts,
           dq, dk, dv, dbias, bad):
    batch, kv_heads = k.shape[0], k.shape[1]
    for unit in prange(batch * kv_heads):
        _unit(unit, q, k, kt, vt, do, glse, has_glse, allowed, kept, bias, slopes, group, opts,
              fopts, dq, dk, dv, dbias, bad)


@njit(**_JIT)
def _decide_all(enc, p, emin, max_finite, out, decided):
    flat_h, flat_l, flat_e = enc[0].ravel(), enc[1].ravel(), enc[2].ravel()
    for n in range(flat_h.shape[0]):
        out[n], decided[n] = round_decision(flat_h[n], flat_l[n], flat_e[n], p, emin,
                                            max_finite)


def decide(enc: np.ndarray, fmt):
    """(values, decided) of an enclosure array (3, ...) = (hi, lo, error bound) rounded to
    ``fmt`` (:func:`refattn.exact._dd_extra.round_decision`)."""
    shape = enc.shape[1:]
    out = np.empty(int(np.prod(shape)))
    decided = np.empty(out.shape, np.bool_)
    _decide_all(np.ascontiguousarray(enc), fmt.p, fmt.emin, float(fmt.max_finite), out,
                decided)
    return out.reshape(shape), decided.reshape(shape)


def _alibi_offsets(spec) -> np.ndarray:
    """ALiBi's offset o_b of each batch row (int64 (B,))."""
    return np.array([spec.alibi_offset(b) for b in range(spec.dims[0])], dtype=np.int64)


def fast_inputs_ok(spec, grad_out, grad_lse) -> bool:
    """Whether the fast step applies: every input finite and below :data:`INPUT_LIMIT` (ALiBi's
    largest term included)."""
    arrays = [spec.q, spec.k, spec.v, grad_out]
    if grad_lse is not None:
        arrays.append(grad_lse)
    if spec.bias is not None:
        arrays.append(np.where(np.isneginf(spec.bias), 0.0, spec.bias))
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        if a.size and not (np.abs(a) < INPUT_LIMIT).all():
            return False
    _, _, _, length, keys, _, _ = spec.dims
    reach = int(np.abs(_alibi_offsets(spec)).max(initial=0))
    if spec.alibi_slopes is not None and not (
            np.abs(spec.alibi_slopes) * (length + keys + reach + 1) < INPUT_LIMIT).all():
        return False
    scale = abs(spec.scale_float)
    if scale != 0.0 and not 2.0**-60 < scale < INPUT_LIMIT:
        return False
    if spec.softcap is not None and not 2.0**-60 < spec.softcap < INPUT_LIMIT:
        return False
    return True


def gradient_enclosures(spec, grad_out, grad_lse):
    """dd enclosures (3, ...) of dq (B, H, L, D), dk (B, K, S, D), dv (B, K, S, E) and dS
    (B, H, L, S) (None without bias), and a (B, K) array of units to hand to the referee."""
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    f64 = np.float64
    q = np.ascontiguousarray(spec.q, f64)
    k = np.ascontiguousarray(spec.k, f64)
    kt = np.ascontiguousarray(np.swapaxes(k, 2, 3))
    vt = np.ascontiguousarray(np.swapaxes(np.asarray(spec.v, f64), 2, 3))
    do = np.ascontiguousarray(grad_out, f64)
    glse = np.ascontiguousarray(grad_lse, f64) if grad_lse is not None else np.zeros((1, 1, 1))
    allowed = np.empty((batch, heads, length, keys), np.bool_)
    for b in range(batch):
        for h in range(heads):
            allowed[b, h] = spec.allowed(b, h)
    kept = allowed if spec.dropout_mask is None else allowed & spec.dropout_mask
    bias = (np.ascontiguousarray(spec.bias, f64) if spec.bias is not None
            else np.zeros((1, 1, 1, 1)))
    slopes = (np.ascontiguousarray(spec.alibi_slopes, f64) if spec.alibi_slopes is not None
              else np.zeros(1))
    group = np.array([np.flatnonzero(spec.kv_head == g) for g in range(kv_heads)], np.int64)
    # [has_bias, has_alibi, has_softcap, alibi_keys, dropout, o_0, ..., o_{B-1}]: ALiBi applies
    # to keys j < alibi_keys (a folded sink has none) with the offset o_b of batch row b
    alibi_keys = keys if spec.alibi_keys is None else spec.alibi_keys
    opts = np.concatenate([np.array([spec.bias is not None, spec.alibi_slopes is not None,
                                     spec.softcap is not None, alibi_keys,
                                     spec.dropout_p != 0], np.int64), _alibi_offsets(spec)])
    # dot-product bounds per length: D (scores), E (dp), S (dq), G L (dk, dv)
    fopts = np.array([*dd_of_exact(spec.scale_exact), spec.softcap or 1.0,
                      *dd_of_fraction(spec.keep_scale), dot_bound(dim), dot_bound(vdim),
                      dot_bound(keys), dot_bound(heads // kv_heads * length)])
    dq = np.zeros((3, batch, heads, length, dim))
    dk = np.zeros((3, batch, kv_heads, keys, dim))
    dv = np.zeros((3, batch, kv_heads, keys, vdim))
    dbias = np.zeros((3, batch, heads, length, keys)) if spec.bias is not None else \
        np.zeros((3, 1, 1, 1, 1))
    bad = np.zeros((batch, kv_heads), np.bool_)
    if batch and heads and length and keys:
        _units(q, k, kt, vt, do, glse, grad_lse is not None, allowed, kept, bias, slopes,
               group, opts, fopts, dq, dk, dv, dbias, bad)
    return dq, dk, dv, (dbias if spec.bias is not None else None), bad


@njit(**_JIT)
def _reduce(enc, index, out):
    size = out.shape[1]
    mag = np.zeros(size)
    count = np.zeros(size)
    flat_h, flat_l, flat_e = enc[0].ravel(), enc[1].ravel(), enc[2].ravel()
    for n in range(flat_h.shape[0]):
        t = index[n]
        if t < 0:
            continue
        out[0, t], out[1, t] = dd_add(out[0, t], out[1, t], flat_h[n], flat_l[n])
        out[2, t] += flat_e[n]
        mag[t] += abs(flat_h[n])
        count[t] += 1.0
    for t in range(size):
        out[2, t] = (out[2, t] + count[t] * DD_REL * mag[t] * _SAFE) * BOUND_SAFETY


def reduce_enclosure(enc, index, shape):
    """Sum a (3, B, H, L, S) enclosure into the slots ``index`` (B, H, L, S) of an array of
    ``shape`` (:meth:`refattn._spec.AttentionSpec.dbias_slots`; -1: left out), in the fixed
    C order of the (B, H, L, S) positions."""
    shape = tuple(shape)
    size = int(np.prod(shape))
    flat = np.ascontiguousarray(np.broadcast_to(index, enc.shape[1:])).ravel()
    if flat.size == size and np.array_equal(flat, np.arange(size)):  # nothing to sum
        return enc.reshape((3,) + shape)
    out = np.zeros((3, size))
    if flat.size:
        _reduce(np.ascontiguousarray(enc), flat, out)
    return out.reshape((3,) + shape)
