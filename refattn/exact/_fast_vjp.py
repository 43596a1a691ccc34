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
  (error: the smaller of ``dot_bound(S)`` of its magnitude and the running bound
  ``u sum_k (|t_k| + |c_k|)`` of the two roundings of each compensation update
  ``c_k = c_{k-1} + t_k``, ``t_k = lo_k + e'_k``, TwoSum being exact: about ``S u^2`` of
  the magnitude where the a-priori bound is ``2 S^2 u^2``), ``Z_i = 1 + sigma_i``,
  ``w_ij = e_ij (1/Z_i)`` and
  ``w_ir = 1 - tau_i`` with ``tau_i = sigma_i (1/Z_i)`` (the exact ``1 - tau_h`` by TwoSum,
  then one rounding of at most ``u`` of the low word): no weight is ever ``e_ir / Z_i``, so
  the error of every weight is relative to the weights of the other keys (a top weight
  ``1 - e^-64`` is known to about ``2**-92 e^-64``, not to ``2**-94``);
* ``dP_ij - Delta_i`` (the softmax Jacobian in ``dS`` above) in the cancellation-free
  reference-key form: with ``x_j = kappa_ij dp_ij`` and ``y_j = x_j - x_r`` (``y_r = 0``
  exactly; error ``err x_j + err x_r + DD_REL |y_j|``), ``sum_j w_ij = 1`` gives
  ``x_j - sum_k w_ik x_k = y_j - D_i`` with ``D_i = sum_{k != r} w_ik y_k`` (a compensated
  sum: the products' first-order errors plus ``DD_REL`` of the sum of magnitudes plus the
  summation's error, bounded as sigma's). ``dS_ir = -w_ir D_i``, and the errors of every
  ``dS_ij`` are in proportion to the non-reference weights, where the direct
  ``dP_ir - Delta_i`` with ``w_ir ~ 1`` would carry ``Delta_i``'s absolute error
  (``~2**-94 |dP|``, the top weight's) against a result ``~e^-64 |dP|``: no correct rounding
  could be decided from it. ``kf``
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

Sinks (``spec.sinks`` (H,), finite, below :data:`INPUT_LIMIT`) are native, with the semantics
of :func:`refattn.spec.fold` (one more key with key 0, value 0 and score exactly the logit
``sigma_h``: no scale, softcap, bias or ALiBi) but no (B, H, L, S + 1) array: pass A's scratch
row of the keys ``lo .. hi`` (length n) gets the sink as entry n (always allowed and kept,
score ``(sigma_h, 0)`` with error 0, softcap derivative 1, ``dp = 0`` exactly), and the
weights, ``D_i``, dS and dT run over the n + 1 entries unchanged (:func:`_row`), so the error
analysis above holds with the sink as one more key (``sigma_i`` and ``D_i`` still sum at most
S terms: the reference entry is left out). The sink may be the reference key: pass A then
stores :data:`SINK_REF` (outside [0, S)) as its index and passes B and C, which visit real
keys only, read its score ``(sigma_h, 0, 0)`` and ``x_r = 0`` from the row statistics. A row
with no allowed key has the sink alone (kind 2: weight 1, ``dS = g_i`` exactly, dq = 0,
nothing reaches dk, dv). The sink adds exactly nothing to dq (its key is 0) and its dk is
discarded; its dS enclosure per row (3, B, H, L) is summed over (b, i) into dsinks (3, H) by
:func:`reduce_enclosure` in the C order of (b, h, i).

Streaming (no (L, S) array; memory O(L D + S D) per head plane, plus a (B, H, L, S) dS
enclosure only where dbias has that size or for a folded spec's slots: see pass C): each
row's allowed and kept sets are computed on the fly into a length-S scratch row from its
structural key interval ``[lo, hi)`` (causal, window, key length) and, only where present, the
explicit mask, the -inf positions of the bias and the dropout keep-mask, read through their
un-broadcast arrays and strides (:mod:`refattn.exact._stream`); every key loop runs over
``[lo, hi)`` only (causal halves the work), in increasing key order, so the values are those of
the full loops. Two passes, in the manner of FlashAttention-2's backward:

* pass A (:func:`_pass_a`), parallel over (batch, query head, block of :data:`ROW_BLOCK`
  rows): each row's scores, weights, ``D_i``, dS and dT and its dq (and dbias); it stores per
  row only O(1) statistics (the reference key ``r`` and its score enclosure, ``1/Z_i`` and its
  relative error bound, the reference weight ``w_ir``, ``x_ir`` and ``D_i`` with their
  bounds, the row kind);
* pass B (:func:`_pass_b`), parallel over (batch, kv head, block of :data:`KEY_BLOCK` keys):
  the group's query heads and their rows in increasing order; for each row it recomputes the
  scores and ``dp`` of the block's keys, then ``e_ij``, ``w_ij = e_ij (1/Z_i)``, ``y_j``, dS and
  dT from the stored statistics, and accumulates dk, dv of its keys. Error analysis of the
  recomputation: every one of these steps is elementwise in the key (the dot products of one
  key, the exponential of one score difference, the product with the stored ``1/Z_i``) and is
  executed by the same compiled functions on the same operands (the stored statistics are the
  very floats pass A used), so each recomputed value and error bound is bit-identical to pass
  A's, whose bounds are those above: pass B adds no error term, and dk, dv accumulate the
  same terms in the same order (heads of the group, rows, increasing) as a single pass would.
* pass C (:func:`_pass_c`, a bias broadcast over batch, heads or rows with its key axis of
  size S), parallel over blocks of :data:`KEY_BLOCK` keys: the dS enclosure of every (b, h,
  i) at the block's keys, recomputed as in pass B (:func:`_block_ds`), summed into its dbias
  slot in the C order of (b, h, i); each slot holds one key's positions, so a block owns its
  slots, and the sums and bounds are those of :func:`reduce_enclosure` on pass A's
  (3, B, H, L, S) enclosure, bit for bit (the path kept for a full bias, where the sum is the
  identity, and for a folded spec's slots). A bias broadcast along the keys (dbias without a
  key axis of size S) has one slot per row at most: pass A sums each row's dS over its keys
  (in increasing order, with the bound of :func:`_reduce`: the terms' errors plus ``DD_REL``
  of the magnitudes per addition) into a (3, B, H, L) array, which :func:`reduce_enclosure`
  then sums into the slots; the enclosures differ in their last bits from the
  dS-then-reduce path's, the decided roundings do not.

Every output element is written by exactly one work item, whose operations are in a fixed
order: the results depend on the shapes alone (not on the thread count).
"""

from __future__ import annotations

import math
from fractions import Fraction

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
from ._fixed import to_fixed
from ._stream import compact_view, key_intervals
from .rounding import round_exact

_JIT = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)
__all__ = [
    "INPUT_LIMIT",
    "UNDERFLOW_TERM",
    "fast_inputs_ok",
    "gradient_enclosures",
    "reduce_enclosure",
    "decide",
]

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
def _add_terms(
    b, h, i, j0, sh, sl, se, bias, bias_st, slopes, offset, alibi_keys, has_bias, has_alibi, allowed
):
    """Bias and ALiBi terms of keys ``j0 + t`` (t indexes the scratch row) in place."""
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
def _y_of(xh, xl, xe, xr_h, xr_l, xr_e):
    """``y_j = x_j - x_r`` of a non-reference key with its absolute error."""
    yh, yl = dd_add(xh, xl, -xr_h, -xr_l)
    return yh, yl, (xe + xr_e + DD_REL * abs(yh)) * _SAFE


@njit(**_JIT)
def _ds_of(
    is_ref, yh, yl, ye, acc_h, acc_l, acc_e, dropout, kf_h, kf_l, kf_e, has_glse, g_i, w_h, w_l, w_e
):
    """``dS_j = w_j (kf (y_j - D) + g)`` (``-D`` for the reference key) with its error."""
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
def _dt_of(ds_h, ds_l, ds_e, f_h, f_l, f_e):
    """``dT_j = dS_j (1 - tanh^2)`` (softcap) with its error."""
    dt_h, dt_l = dd_mul(ds_h, ds_l, f_h, f_l)
    dt_e = (ds_e * f_h + abs(ds_h) * f_e + ds_e * f_e + DD_REL * abs(dt_h)) * _SAFE
    return dt_h, dt_l, dt_e


@njit(**_JIT)
def _single_dt(g_i, has_softcap, f_h, f_l, f_e):
    """dT of the one allowed key of a single-key row: ``g`` (times ``1 - tanh^2``)."""
    if has_softcap:
        th, tl = dd_mul_d(f_h, f_l, g_i)
        return th, tl, (abs(g_i) * f_e + DD_REL * abs(th)) * _SAFE
    return g_i, 0.0, 0.0


@njit(**_JIT)
def _block_scores(
    b,
    h,
    i,
    a,
    qrow,
    kt_bg,
    allowed,
    bias,
    bias_st,
    slopes,
    opts,
    fopts,
    k_l1,
    sh,
    sl,
    se,
    fh,
    fl,
    fe,
):
    """Scores (and the softcap derivative) of the keys ``a .. a + n`` of row i (scratch
    rows of length n): each element is computed by itself, so any key range gives the same
    bits as the whole row."""
    _scores(qrow, kt_bg, a, fopts[0], fopts[1], fopts[2], sh, sl, se, k_l1, fopts[7])
    if opts[2]:
        _softcap(fopts[3], sh, sl, se, fh, fl, fe)
    _add_terms(
        b,
        h,
        i,
        a,
        sh,
        sl,
        se,
        bias,
        bias_st,
        slopes,
        opts[7 + b],
        opts[3],
        opts[0],
        opts[1],
        allowed,
    )


@njit(**_JIT)
def _block_ds(
    b,
    h,
    i,
    a,
    kind,
    r,
    st,
    g_i,
    has_glse,
    qrow,
    kt_bg,
    vt_bg,
    dorow,
    allowed,
    kept,
    bias,
    bias_st,
    slopes,
    opts,
    fopts,
    k_l1,
    v_l1,
    sh,
    sl,
    se,
    fh,
    fl,
    fe,
    dh,
    dl,
    de,
    wh,
    wl,
    we,
):
    """Recompute, for the keys ``a .. a + n`` of row i (scratch rows of length n), the scores
    and softcap derivative (sh .. fe) and, for a kind-1 row (:func:`_row`), the weights
    (wh, wl, we) and dS (dh, dl, de) of its allowed keys from pass A's row statistics ``st``
    (r the reference key, absolute index): every step is elementwise in the key and is the
    same compiled operation on the same operands as in pass A, so the values and bounds are
    bit-identical to pass A's. Used by pass B (dk, dv) and pass C (dbias)."""
    dropout = opts[4]
    kf_h, kf_l, kf_e = fopts[4], fopts[5], fopts[6]
    _block_scores(
        b,
        h,
        i,
        a,
        qrow,
        kt_bg,
        allowed,
        bias,
        bias_st,
        slopes,
        opts,
        fopts,
        k_l1,
        sh,
        sl,
        se,
        fh,
        fl,
        fe,
    )
    if kind != 1:
        return
    _dots(dorow, vt_bg, a, dh, dl, de, v_l1, fopts[8])
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
            j == r,
            yh,
            yl,
            ye,
            st[12],
            st[13],
            st[14],
            dropout,
            kf_h,
            kf_l,
            kf_e,
            has_glse,
            g_i,
            w_h,
            w_l,
            w_e,
        )
        wh[t], wl[t], we[t] = w_h, w_l, w_e


@njit(**_JIT)
def _row(
    b,
    h,
    i,
    lo,
    qrow,
    kt_bg,
    vt_bg,
    dorow,
    g_i,
    has_glse,
    allowed,
    kept,
    bias,
    bias_st,
    slopes,
    opts,
    fopts,
    k_l1,
    v_l1,
    sh,
    sl,
    se,
    fh,
    fl,
    fe,
    wh,
    wl,
    we,
    dh,
    dl,
    de,
    dsh,
    dsl,
    dse,
    stat,
    has_sink,
    sigma,
):
    """dS (dsh, dsl, dse) and dT (in place of the scores arrays) of the keys ``lo .. lo + n``
    of one row (every allowed key of the row lies there); the row statistics that pass B
    needs into ``stat`` (see :func:`_pass_a`).

    With a sink (``has_sink``) the scratch rows have length n + 1 and entry n is the sink: an
    always allowed and kept "key" of score exactly ``sigma`` (no scale, softcap, bias or
    ALiBi; softcap derivative 1), key 0 and value 0 (``dp = 0`` exactly); ``allowed[n]`` and
    ``kept[n]`` are set here. The weights, ``D``, dS and dT then run over the n + 1 entries
    as over any key (the sink may be the reference key); dS at entry n is the sink's.

    Returns (kind, r): kind 0 for an empty row, 2 for a row with a single allowed key (its
    weight is exactly 1 and ``dS = dP - dP + g = g`` exactly, whatever the dropout; with a
    sink: the sink alone), 1 otherwise; r the reference key (scratch index; the single key
    for kind 2; n for the sink).
    """
    dropout, has_softcap = opts[4], opts[2]
    kf_h, kf_l, kf_e = fopts[4], fopts[5], fopts[6]
    keys = sh.shape[0]
    real = keys - 1 if has_sink else keys
    if real > 0:
        _block_scores(
            b,
            h,
            i,
            lo,
            qrow,
            kt_bg,
            allowed[:real],
            bias,
            bias_st,
            slopes,
            opts,
            fopts,
            k_l1,
            sh[:real],
            sl[:real],
            se[:real],
            fh[:real],
            fl[:real],
            fe[:real],
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
        sh[only], sl[only], se[only] = _single_dt(g_i, has_softcap, fh[only], fl[only], fe[only])
        return 2, only
    r, ih, il, rho_inv = _weights(sh, sl, se, allowed, wh, wl, we, fopts[9])
    stat[0], stat[1], stat[2] = sh[r], sl[r], se[r]
    if real > 0:
        _dots(dorow, vt_bg, lo, dh[:real], dl[:real], de[:real], v_l1, fopts[8])
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
    acc_e = (acc_e + (DD_REL * mag + min(fopts[9] * mag, _U * arun * BOUND_SAFETY)) * _SAFE) * _SAFE
    for j in range(keys):
        if not allowed[j]:
            dsh[j], dsl[j], dse[j] = 0.0, 0.0, 0.0
            sh[j], sl[j], se[j] = 0.0, 0.0, 0.0
            continue
        ds_h, ds_l, ds_e = _ds_of(
            j == r,
            dh[j],
            dl[j],
            de[j],
            acc_h,
            acc_l,
            acc_e,
            dropout,
            kf_h,
            kf_l,
            kf_e,
            has_glse,
            g_i,
            wh[j],
            wl[j],
            we[j],
        )
        dsh[j], dsl[j], dse[j] = ds_h, ds_l, ds_e
        if has_softcap:
            sh[j], sl[j], se[j] = _dt_of(ds_h, ds_l, ds_e, fh[j], fl[j], fe[j])
        else:
            sh[j], sl[j], se[j] = ds_h, ds_l, ds_e
    stat[3], stat[4], stat[5] = ih, il, rho_inv
    stat[6], stat[7], stat[8] = wh[r], wl[r], we[r]
    stat[9], stat[10], stat[11] = xr_h, xr_l, xr_e
    stat[12], stat[13], stat[14] = acc_h, acc_l, acc_e
    return 1, r


@njit(**_JIT)
def _allowed_row(b, h, i, lo, hi, masks, mask_st, bias, bias_st, opts, allowed, kept):
    """Keys ``lo .. hi`` of row i of plane (b, h) of the allowed set
    (:meth:`AttentionSpec.allowed`) and of the kept set (allowed and the dropout keep-mask)
    into ``allowed[:hi - lo]``, ``kept[:hi - lo]``.

    ``[lo, hi)`` lies inside the row's structural key interval (causal, window, key length:
    :func:`refattn.exact._stream.key_intervals`); ``masks`` holds the explicit mask (0) and
    the keep-mask (1) as
    flat un-broadcast arrays read through the element strides ``mask_st`` (2, 4) (zero along
    broadcast axes), the bias the same way (``bias_st``): a position is excluded where the
    bias is -inf.
    """
    has_bias, has_mask, has_drop = opts[0], opts[5], opts[6]
    m0 = b * mask_st[0, 0] + h * mask_st[0, 1] + i * mask_st[0, 2]
    d0 = b * mask_st[1, 0] + h * mask_st[1, 1] + i * mask_st[1, 2]
    b0 = b * bias_st[0] + h * bias_st[1] + i * bias_st[2]
    for j in range(lo, hi):
        ok = True
        if has_mask:
            ok = masks[0][m0 + j * mask_st[0, 3]]
        if ok and has_bias:
            ok = bias[b0 + j * bias_st[3]] != -np.inf
        allowed[j - lo] = ok
        kept[j - lo] = ok and (not has_drop or masks[1][d0 + j * mask_st[1, 3]])


#: Query rows per work item of pass A and keys per work item of pass B.
ROW_BLOCK = 64
KEY_BLOCK = 64
#: Row statistics kept by pass A for pass B (float64 per row): the reference key's score
#: (3: hi, lo, error), 1/Z (hi, lo) and its relative error bound, the reference weight
#: w_r = 1 - tau (3), x_r (3) and D (3).
N_STAT = 15
#: The reference key of a row in pass A's statistics when it is the sink: outside [0, S), so
#: passes B and C (which visit the real keys only) never take a real key for it.
SINK_REF = -2


@njit(parallel=True, **_JIT)
def _pass_a(
    q,
    k,
    kt,
    vt,
    do,
    glse,
    has_glse,
    rows_lo,
    rows_hi,
    masks,
    mask_st,
    bias,
    bias_st,
    slopes,
    kv_head,
    opts,
    fopts,
    k_l1,
    v_l1,
    k_col,
    dq,
    write_ds,
    dbias,
    istat,
    fstat,
    bad,
    has_sink,
    sinks,
    dsink,
    row_sums,
):
    """Pass A, parallel over (batch, query head, block of ROW_BLOCK rows): each row's dS, dT
    and dq (and the dS enclosure ``dbias`` (3, B, H, L, S) when ``write_ds``; with
    ``row_sums`` instead, for a bias broadcast along the keys, each row's sum over its keys
    ``dbias[:, b, h, i, 0]``, summed as :func:`_reduce` sums a slot), the row
    statistics for passes B and C (``istat`` (B, H, L, 3): kind, reference key (absolute;
    :data:`SINK_REF` for the sink), zero row; ``fstat`` (B, H, L, N_STAT)) and the
    non-finite flag of the block (``bad`` (B, H, blocks)). With a sink (``has_sink``,
    ``sinks`` (H,)) every row has it as one more entry (:func:`_row`; a row with no allowed
    key is the sink alone) and its dS enclosure goes to ``dsink`` (3, B, H, L)."""
    batch, heads, length, dim = q.shape
    keys = kt.shape[3]
    s_hi, s_lo, s_err = fopts[0], fopts[1], fopts[2]
    blocks = (length + ROW_BLOCK - 1) // ROW_BLOCK
    extra = 1 if has_sink else 0
    for item in prange(batch * heads * blocks):
        b = item // (heads * blocks)
        h = (item // blocks) % heads
        blk = item % blocks
        g = kv_head[h]
        sigma = sinks[h] if has_sink else 0.0
        row = np.empty((15, keys + extra))
        sh, sl, se, fh, fl, fe, wh, wl, we, dh, dl, de, dsh, dsl, dse = (
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            row[6],
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
            row[12],
            row[13],
            row[14],
        )
        allowed = np.empty(keys + extra, np.bool_)
        kept = np.empty(keys + extra, np.bool_)
        dq_h, dq_c, dq_r, dq_p = np.zeros(dim), np.zeros(dim), np.zeros(dim), np.zeros(dim)
        check = 0.0
        for i in range(blk * ROW_BLOCK, min(length, (blk + 1) * ROW_BLOCK)):
            lo, hi = rows_lo[b, i], rows_hi[b, i]
            istat[b, h, i, 0] = 0
            if lo >= hi and not has_sink:  # empty row: zero gradients, exactly
                continue
            n = max(hi - lo, 0)
            m = n + extra
            if n > 0:
                _allowed_row(b, h, i, lo, hi, masks, mask_st, bias, bias_st, opts, allowed, kept)
            g_i = glse[b, h, i] if has_glse else 0.0
            kind, r = _row(
                b,
                h,
                i,
                lo,
                q[b, h, i],
                kt[b, g],
                vt[b, g],
                do[b, h, i],
                g_i,
                has_glse,
                allowed[:m],
                kept[:m],
                bias,
                bias_st,
                slopes,
                opts,
                fopts,
                k_l1[b, g],
                v_l1[b, g],
                sh[:m],
                sl[:m],
                se[:m],
                fh[:m],
                fl[:m],
                fe[:m],
                wh[:m],
                wl[:m],
                we[:m],
                dh[:m],
                dl[:m],
                de[:m],
                dsh[:m],
                dsl[:m],
                dse[:m],
                fstat[b, h, i],
                has_sink,
                sigma,
            )
            if kind == 0:  # empty row: zero gradients, exactly
                continue
            # dS = dT = 0 exactly when g = 0 and either a single key is allowed (weight 1,
            # dS = dP - dP) or no allowed key is kept (dP = Delta = 0; the sink's dp is 0)
            no_kept = True
            for t in range(n):
                if allowed[t] and kept[t]:
                    no_kept = False
            zero_row = (kind == 2 or no_kept) and (not has_glse or g_i == 0.0)
            ref = SINK_REF if r == n else lo + r
            istat[b, h, i, 0], istat[b, h, i, 1], istat[b, h, i, 2] = kind, ref, zero_row
            if has_sink:
                check += se[n] + abs(sh[n]) + we[n] + dse[n]
                if zero_row:
                    dsink[0, b, h, i], dsink[1, b, h, i], dsink[2, b, h, i] = 0.0, 0.0, 0.0
                else:
                    dsink[0, b, h, i], dsink[1, b, h, i] = dsh[n], dsl[n]
                    # a sink-only row (kind 2) is exact: dS = g
                    dsink[2, b, h, i] = dse[n] * BOUND_SAFETY + UNDERFLOW_TERM if kind == 1 else 0.0
            if row_sums:  # sum_j dS_ij as _reduce sums a slot (terms in increasing j)
                rs_h, rs_l, rs_e, rs_mag, rs_count = 0.0, 0.0, 0.0, 0.0, 0.0
                for t in range(n):
                    rs_h, rs_l = dd_add(rs_h, rs_l, dsh[t], dsl[t])
                    if allowed[t] and kind == 1 and not zero_row:
                        rs_e += dse[t] * BOUND_SAFETY + UNDERFLOW_TERM
                    rs_mag += abs(dsh[t])
                    rs_count += 1.0
                dbias[0, b, h, i, 0], dbias[1, b, h, i, 0] = rs_h, rs_l
                dbias[2, b, h, i, 0] = (rs_e + rs_count * DD_REL * rs_mag * _SAFE) * BOUND_SAFETY
            if write_ds:
                for t in range(n):
                    j = lo + t
                    dbias[0, b, h, i, j] = dsh[t]
                    dbias[1, b, h, i, j] = dsl[t]
                    # excluded positions and single-key rows are exact
                    dbias[2, b, h, i, j] = (
                        dse[t] * BOUND_SAFETY + UNDERFLOW_TERM
                        if allowed[t] and kind == 1 and not zero_row
                        else 0.0
                    )
            dq_h[:] = 0.0
            dq_c[:] = 0.0
            dq_r[:] = 0.0
            dq_p[:] = 0.0
            emax = 0.0
            # the real keys only: the sink's key is 0, it adds exactly nothing to dq
            for t in range(n):
                if not allowed[t]:
                    continue
                check += se[t] + abs(sh[t]) + we[t] + dse[t]
                if zero_row:
                    continue
                j = lo + t
                emax = max(emax, se[t])
                _accumulate(sh[t], sl[t], k[b, g, j], dq_h, dq_c, dq_r)
                for d in range(dim):
                    dq_p[d] += se[t] * abs(k[b, g, j, d])
            if zero_row or (kind == 2 and r == n):  # dq = 0 exactly (the sink's key is 0)
                continue
            for d in range(dim):
                xh, xl = two_sum(dq_h[d], dq_c[d])
                err = (
                    min(emax * k_col[b, g, d], dq_p[d] * BOUND_SAFETY) + _U * dq_r[d]
                ) * BOUND_SAFETY
                if k_col[b, g, d] == 0.0:  # a zero column of k: every product is an exact 0
                    continue
                _store_scaled(dq, (b, h, i, d), xh, xl, err, s_hi, s_lo, s_err)
        if not math.isfinite(check):
            bad[b, h, blk] = True


@njit(parallel=True, **_JIT)
def _pass_b(
    q,
    kt,
    vt,
    do,
    glse,
    has_glse,
    rows_lo,
    rows_hi,
    masks,
    mask_st,
    bias,
    bias_st,
    slopes,
    group,
    opts,
    fopts,
    k_l1,
    v_l1,
    q_sum,
    do_sum,
    istat,
    fstat,
    dk,
    dv,
):
    """Pass B, parallel over (batch, kv head, block of KEY_BLOCK keys): dk and dv of the
    block's keys, summed over the group's query heads and their rows in increasing order.
    Each row's weights, dS and dT at these keys are recomputed from the inputs and pass A's
    row statistics by the same floating-point operations as in pass A (every one elementwise
    in the key), so they and their error bounds are bit-identical to pass A's."""
    batch, kv_heads, dim, keys = kt.shape
    length, vdim = q.shape[2], vt.shape[2]
    dropout, has_softcap = opts[4], opts[2]
    s_hi, s_lo, s_err = fopts[0], fopts[1], fopts[2]
    kf_h, kf_l, kf_e = fopts[4], fopts[5], fopts[6]
    blocks = (keys + KEY_BLOCK - 1) // KEY_BLOCK
    for item in prange(batch * kv_heads * blocks):
        b = item // (kv_heads * blocks)
        g = (item // blocks) % kv_heads
        blk = item % blocks
        j0 = blk * KEY_BLOCK
        nb = min(keys, j0 + KEY_BLOCK) - j0
        row = np.empty((12, nb))
        sh, sl, se, fh, fl, fe, dh, dl, de, wh, wl, we = (
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            row[6],
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
        )
        allowed, kept = np.empty(nb, np.bool_), np.empty(nb, np.bool_)
        dk_h, dk_c, dk_r = np.zeros((nb, dim)), np.zeros((nb, dim)), np.zeros((nb, dim))
        dv_h, dv_c, dv_r = np.zeros((nb, vdim)), np.zeros((nb, vdim)), np.zeros((nb, vdim))
        dk_emax, dv_emax = np.zeros(nb), np.zeros(nb)
        # the propagated errors sum_i err(dT_ij) |q_id| (and the like for dv) term by term: a
        # sum of nonnegative products, within (1 + u)**(n + 1) <= BOUND_SAFETY of its float64
        # value; the smaller of it and the max-error form (emax * column sum) bounds the error
        dk_p, dv_p = np.zeros((nb, dim)), np.zeros((nb, vdim))
        dk_terms, dv_terms = np.zeros(nb, np.int64), np.zeros(nb, np.int64)
        for member in range(group.shape[1]):
            h = group[g, member]
            for i in range(length):
                kind, r, zero_row = istat[b, h, i, 0], istat[b, h, i, 1], istat[b, h, i, 2]
                # nothing reaches dk, dv (a sink-only row: the sink's key and value are 0)
                if kind == 0 or (zero_row and kind == 1) or (kind == 2 and r == SINK_REF):
                    continue
                a = max(j0, rows_lo[b, i])
                c = min(j0 + nb, rows_hi[b, i])
                if a >= c:
                    continue
                n = c - a
                _allowed_row(b, h, i, a, c, masks, mask_st, bias, bias_st, opts, allowed, kept)
                st = fstat[b, h, i]
                g_i = glse[b, h, i] if has_glse else 0.0
                _block_ds(
                    b,
                    h,
                    i,
                    a,
                    kind,
                    r,
                    st,
                    g_i,
                    has_glse,
                    q[b, h, i],
                    kt[b, g],
                    vt[b, g],
                    do[b, h, i],
                    allowed[:n],
                    kept[:n],
                    bias,
                    bias_st,
                    slopes,
                    opts,
                    fopts,
                    k_l1[b, g],
                    v_l1[b, g],
                    sh[:n],
                    sl[:n],
                    se[:n],
                    fh[:n],
                    fl[:n],
                    fe[:n],
                    dh[:n],
                    dl[:n],
                    de[:n],
                    wh[:n],
                    wl[:n],
                    we[:n],
                )
                for t in range(n):
                    if not allowed[t]:
                        continue
                    j = a + t
                    x = j - j0
                    w_h, w_l, w_e = 0.0, 0.0, 0.0
                    if kind == 2:  # the single allowed key: weight exactly 1, dT = g (f)
                        if kept[t]:
                            _accumulate(1.0, 0.0, do[b, h, i], dv_h[x], dv_c[x], dv_r[x])
                            dv_terms[x] += 1
                        if zero_row:
                            continue
                        th, tl, te = _single_dt(g_i, has_softcap, fh[t], fl[t], fe[t])
                    else:
                        w_h, w_l, w_e = wh[t], wl[t], we[t]
                        th, tl, te = dh[t], dl[t], de[t]
                        if has_softcap:
                            th, tl, te = _dt_of(th, tl, te, fh[t], fl[t], fe[t])
                    _accumulate(th, tl, q[b, h, i], dk_h[x], dk_c[x], dk_r[x])
                    for d in range(dim):
                        dk_p[x, d] += te * abs(q[b, h, i, d])
                    dk_terms[x] += 1
                    dk_emax[x] = max(dk_emax[x], te)
                    if kept[t] and kind == 1:
                        _accumulate(w_h, w_l, do[b, h, i], dv_h[x], dv_c[x], dv_r[x])
                        for e in range(vdim):
                            dv_p[x, e] += w_e * abs(do[b, h, i, e])
                        dv_terms[x] += 1
                        dv_emax[x] = max(dv_emax[x], w_e)
        for x in range(nb):
            j = j0 + x
            for d in range(dim if dk_terms[x] else 0):
                xh, xl = two_sum(dk_h[x, d], dk_c[x, d])
                err = (
                    (min(dk_emax[x] * q_sum[b, g, d], dk_p[x, d] * BOUND_SAFETY) + _U * dk_r[x, d])
                    * BOUND_SAFETY
                    * BOUND_SAFETY
                )
                if q_sum[b, g, d] == 0.0:  # q's column d is zero in every row of the group
                    continue
                _store_scaled(dk, (b, g, j, d), xh, xl, err, s_hi, s_lo, s_err)
            for e in range(vdim if dv_terms[x] else 0):
                xh, xl = two_sum(dv_h[x, e], dv_c[x, e])
                err = (
                    (min(dv_emax[x] * do_sum[b, g, e], dv_p[x, e] * BOUND_SAFETY) + _U * dv_r[x, e])
                    * BOUND_SAFETY
                    * BOUND_SAFETY
                )
                if do_sum[b, g, e] == 0.0:  # dO's column e is zero in every row of the group
                    continue
                if dropout:
                    _store_scaled(dv, (b, g, j, e), xh, xl, err, kf_h, kf_l, kf_e)
                else:
                    dv[0, b, g, j, e], dv[1, b, g, j, e] = xh, xl
                    dv[2, b, g, j, e] = err * BOUND_SAFETY + UNDERFLOW_TERM


@njit(parallel=True, **_JIT)
def _pass_c(
    q,
    kt,
    vt,
    do,
    glse,
    has_glse,
    rows_lo,
    rows_hi,
    masks,
    mask_st,
    bias,
    bias_st,
    slopes,
    kv_head,
    opts,
    fopts,
    k_l1,
    v_l1,
    istat,
    fstat,
    slot_b,
    slot_st,
    out,
    mag,
    count,
):
    """Pass C (a broadcast bias), parallel over blocks of KEY_BLOCK keys: the dS enclosure of
    every position (b, h, i, j) of the block's keys, recomputed from pass A's row statistics
    as pass B does (:func:`_block_ds`; bit-identical to pass A's dS and to the enclosure pass
    A writes: zeros outside a row's allowed keys, ``g`` at a single-key row's key, an error
    term for the allowed keys of kind-1 rows that are not zero rows), summed into its dbias
    slot ``slot_b[b] + h slot_st[0] + i slot_st[1] + j slot_st[2]`` as :func:`_reduce` does
    (``out`` (3, N) with its ``mag``, ``count`` (N,); :func:`_finish` completes it). A slot's
    positions share its key j (dbias's key axis has size S), so each block owns its slots,
    and they are visited in the C order of (b, h, i): the sums are those of
    :func:`reduce_enclosure` on the (3, B, H, L, S) enclosure, bit for bit."""
    batch, heads, length = q.shape[0], q.shape[1], q.shape[2]
    keys = kt.shape[3]
    blocks = (keys + KEY_BLOCK - 1) // KEY_BLOCK
    for blk in prange(blocks):
        j0 = blk * KEY_BLOCK
        nb = min(keys, j0 + KEY_BLOCK) - j0
        row = np.empty((15, nb))
        sh, sl, se, fh, fl, fe, dh, dl, de, wh, wl, we, vh, vl, ve = (
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            row[6],
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
            row[12],
            row[13],
            row[14],
        )
        allowed, kept = np.empty(nb, np.bool_), np.empty(nb, np.bool_)
        for b in range(batch):
            for h in range(heads):
                g = kv_head[h]
                for i in range(length):
                    vh[:] = 0.0
                    vl[:] = 0.0
                    ve[:] = 0.0
                    kind, r, zero_row = istat[b, h, i, 0], istat[b, h, i, 1], istat[b, h, i, 2]
                    g_i = glse[b, h, i] if has_glse else 0.0
                    if kind == 2:  # the single allowed key: dS = g exactly
                        if j0 <= r < j0 + nb:
                            vh[r - j0] = g_i
                    elif kind == 1:
                        a = max(j0, rows_lo[b, i])
                        c = min(j0 + nb, rows_hi[b, i])
                        if a < c:
                            n = c - a
                            _allowed_row(
                                b, h, i, a, c, masks, mask_st, bias, bias_st, opts, allowed, kept
                            )
                            _block_ds(
                                b,
                                h,
                                i,
                                a,
                                kind,
                                r,
                                fstat[b, h, i],
                                g_i,
                                has_glse,
                                q[b, h, i],
                                kt[b, g],
                                vt[b, g],
                                do[b, h, i],
                                allowed[:n],
                                kept[:n],
                                bias,
                                bias_st,
                                slopes,
                                opts,
                                fopts,
                                k_l1[b, g],
                                v_l1[b, g],
                                sh[:n],
                                sl[:n],
                                se[:n],
                                fh[:n],
                                fl[:n],
                                fe[:n],
                                dh[:n],
                                dl[:n],
                                de[:n],
                                wh[:n],
                                wl[:n],
                                we[:n],
                            )
                            for t in range(n):
                                if not allowed[t]:
                                    continue
                                x = a + t - j0
                                vh[x], vl[x] = dh[t], dl[t]
                                if not zero_row:
                                    ve[x] = de[t] * BOUND_SAFETY + UNDERFLOW_TERM
                    base = slot_b[b] + h * slot_st[0] + i * slot_st[1] + j0 * slot_st[2]
                    for x in range(nb):
                        t = base + x * slot_st[2]
                        out[0, t], out[1, t] = dd_add(out[0, t], out[1, t], vh[x], vl[x])
                        out[2, t] += ve[x]
                        mag[t] += abs(vh[x])
                        count[t] += 1.0


@njit(parallel=True, **_JIT)
def _norms(q, k, vt, do, group, k_l1, v_l1, k_col, q_sum, do_sum):
    """Per (batch, kv head): the row sums |k_j|, |v_j| (k_l1, v_l1 (B, K, S)), the column sums
    of |k| (k_col (B, K, D)) and of |q|, |dO| over the group's rows (q_sum, do_sum), each in
    a fixed order, times BOUND_SAFETY for the first three."""
    batch, kv_heads, keys, dim = k.shape
    length, vdim = q.shape[2], vt.shape[2]
    for unit in prange(batch * kv_heads):
        b, g = unit // kv_heads, unit % kv_heads
        for j in range(keys):
            for d in range(dim):
                k_l1[b, g, j] += abs(k[b, g, j, d])
                k_col[b, g, d] += abs(k[b, g, j, d])
        for e in range(vdim):
            for j in range(keys):
                v_l1[b, g, j] += abs(vt[b, g, e, j])
        for j in range(keys):
            k_l1[b, g, j] *= BOUND_SAFETY
            v_l1[b, g, j] *= BOUND_SAFETY
        for d in range(dim):
            k_col[b, g, d] *= BOUND_SAFETY
        for member in range(group.shape[1]):
            h = group[g, member]
            for i in range(length):
                for d in range(dim):
                    q_sum[b, g, d] += abs(q[b, h, i, d])
                for e in range(vdim):
                    do_sum[b, g, e] += abs(do[b, h, i, e])


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


@njit(**_JIT)
def _decide_all(enc, p, emin, max_finite, out, decided):
    flat_h, flat_l, flat_e = enc[0].ravel(), enc[1].ravel(), enc[2].ravel()
    for n in range(flat_h.shape[0]):
        out[n], decided[n] = round_decision(flat_h[n], flat_l[n], flat_e[n], p, emin, max_finite)


def decide(enc: np.ndarray, fmt):
    """(values, decided) of an enclosure array (3, ...) = (hi, lo, error bound) rounded to
    ``fmt`` (:func:`refattn.exact._dd_extra.round_decision`); an enclosure of radius 0 is the
    exact value ``hi + lo``, rounded exactly (:func:`refattn.exact.rounding.round_exact`)
    where it lies on a rounding boundary (a tie)."""
    shape = enc.shape[1:]
    out = np.empty(int(np.prod(shape)))
    decided = np.empty(out.shape, np.bool_)
    flat = np.ascontiguousarray(enc).reshape(3, out.size)  # (3, N): a 0-d dbias too
    _decide_all(flat, fmt.p, fmt.emin, float(fmt.max_finite), out, decided)
    exact = (flat[2] == 0.0) & np.isfinite(flat[0]) & np.isfinite(flat[1])
    for n in np.flatnonzero(~decided & exact):  # an exact value: rounded exactly (ties too)
        out[n] = round_exact(Fraction(flat[0, n]) + Fraction(flat[1, n]), fmt)
        decided[n] = True
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
    if spec.sinks is not None:
        arrays.append(spec.sinks)
    if spec.bias is not None:  # the un-broadcast elements only (never a (B, H, L, S) copy)
        core, _ = compact_view(spec.bias, np.float64)
        arrays.append(np.where(np.isneginf(core), 0.0, core))
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        if a.size and not (np.abs(a) < INPUT_LIMIT).all():
            return False
    _, _, _, length, keys, _, _ = spec.dims
    reach = int(np.abs(_alibi_offsets(spec)).max(initial=0))
    if (
        spec.alibi_slopes is not None
        and not (np.abs(spec.alibi_slopes) * (length + keys + reach + 1) < INPUT_LIMIT).all()
    ):
        return False
    scale = abs(spec.scale_float)
    if scale != 0.0 and not 2.0**-60 < scale < INPUT_LIMIT:
        return False
    if spec.softcap is not None and not 2.0**-60 < spec.softcap < INPUT_LIMIT:
        return False
    return True


@njit(**_JIT)
def _allowed_plane(b, h, rows_lo, rows_hi, masks, mask_st, bias, bias_st, opts, allowed, kept):
    for i in range(allowed.shape[0]):
        lo, hi = rows_lo[b, i], rows_hi[b, i]
        _allowed_row(
            b, h, i, lo, hi, masks, mask_st, bias, bias_st, opts, allowed[i, lo:], kept[i, lo:]
        )


def allowed_plane(spec, b, h):
    """(allowed, kept) bool (L, S) of plane (b, h) as the kernels compute them row by row
    (:func:`refattn.exact._stream.key_intervals` and the un-broadcast mask, bias and
    keep-mask): for tests, which
    compare them with :meth:`refattn.spec.AttentionSpec.allowed`."""
    _, _, _, length, keys, _, _ = spec.dims
    rows_lo, rows_hi = key_intervals(spec)
    mask_f, mask_st = compact_view(spec.mask, np.bool_)
    drop_f, drop_st = compact_view(spec.dropout_mask, np.bool_)
    bias, bias_st = compact_view(spec.bias, np.float64)
    opts = np.array(
        [spec.bias is not None, 0, 0, 0, 0, spec.mask is not None, spec.dropout_mask is not None],
        np.int64,
    )
    allowed = np.zeros((length, keys), np.bool_)
    kept = np.zeros((length, keys), np.bool_)
    _allowed_plane(
        b,
        h,
        rows_lo,
        rows_hi,
        (mask_f, drop_f),
        np.stack([mask_st, drop_st]),
        bias,
        bias_st,
        opts,
        allowed,
        kept,
    )
    return allowed, kept


def _dbias_stream_slots(spec):
    """(slot_b (B,), strides (3,)) with ``slot_b[b] + h st[0] + i st[1] + j st[2]`` the dbias
    slot of position (b, h, i, j) (:meth:`AttentionSpec.dbias_slots`), or None where pass C
    does not apply: no bias, a full (B, H, L, S) bias (the reduction is the identity), a
    bias broadcast along the keys (a slot would span key blocks), a folded spec's
    ``dbias_index`` or an empty problem."""
    if spec.bias is None or spec.dbias_index is not None:
        return None
    batch, heads, _, length, keys, _, _ = spec.dims
    shape = tuple(spec.bias_shape)
    size = int(np.prod(shape))
    if not shape or shape[-1] != keys or size == 0 or size == batch * heads * length * keys:
        return None
    full = tuple(spec.batch_shape) + (heads, length, keys)
    index = np.broadcast_to(np.arange(size, dtype=np.int64).reshape(shape), full)
    strides = np.array([st // index.itemsize for st in index.strides[-3:]], np.int64)
    slot_b = np.ascontiguousarray(index[..., 0, 0, 0], np.int64).reshape(-1)
    if slot_b.shape != (batch,):
        return None
    return slot_b, strides


def _exact_row_sums(glse, nonempty, index, shape):
    """dbias of a bias broadcast along the keys without sinks, exactly: a row's dS sums to
    ``sum_j w_ij (dP_ij - Delta_i + g_i) = g_i`` (``sum_j w_ij = 1``, ``Delta_i = sum_j w_ij
    dP_ij``: whatever the dropout and softcap) when it has an allowed key, to 0 when it has
    none, so each slot is the exact sum of its rows' ``g_i`` (0 without grad_lse), in integers.
    Returned as an enclosure (3,) + shape: the nearest double-double and a radius of 0 where
    it is exact (:func:`decide` then rounds ties exactly too)."""
    size = int(np.prod(shape))
    out = np.zeros((3, size))
    if glse is not None:
        fixed = to_fixed(np.where(nonempty, glse, 0.0))  # exact: ints * 2**exp
        totals = np.zeros(size, dtype=object)
        np.add.at(totals, np.broadcast_to(index, nonempty.shape).ravel(), fixed.ints.ravel())
        for t, total in enumerate(totals):
            value = Fraction(int(total)) * Fraction(2) ** fixed.exp
            hi = float(value)
            rest = value - Fraction(hi)
            lo = float(rest)
            out[0, t], out[1, t] = hi, lo
            out[2, t] = 0.0 if Fraction(lo) == rest else math.ulp(lo)
    return out.reshape((3,) + tuple(shape))


def _along_keys(spec) -> bool:
    """Whether dbias has no key axis of its own (a bias broadcast along the keys, S > 1): every
    key of a row then adds to one slot, and pass A sums each row (``row_sums``)."""
    if spec.bias is None or spec.dbias_index is not None:
        return False
    keys = spec.dims[4]
    shape = tuple(spec.bias_shape)
    return keys > 1 and (not shape or shape[-1] == 1)


def gradient_enclosures(spec, grad_out, grad_lse, *, stream_dbias=True):
    """dd enclosures (3, ...) of dq (B, H, L, D), dk (B, K, S, D), dv (B, K, S, E), dbias
    (3,) + :meth:`AttentionSpec.dbias_slots`'s shape (None without bias) and dsinks (3, H)
    (None without sinks), and a (B, K) array of units to hand to the referee.

    Sinks (``spec.sinks``) are native: each row has its head's sink as one more entry
    (:func:`_row`), its dS enclosure per row (3, B, H, L) is summed over batch and rows by
    :func:`reduce_enclosure` into dsinks; dbias is the caller's bias's alone (no sink slots).

    Streaming (module docstring): besides the inputs and the outputs, the memory is O(L + S +
    D + E) per head plane (row statistics, row intervals, norms; with sinks the (B, H, L)
    sink dS) and a scratch row of length S (S + 1 with a sink) per worker; no (L, S) array
    is formed unless the caller's mask, keep-mask or bias is one (they are read
    un-broadcast). dbias: a bias broadcast over batch, heads or rows (its key axis of size S)
    is summed by pass C (:func:`_pass_c`) with no (B, H, L, S) array; a full
    bias's dbias is the dS enclosure itself, written by pass A; a bias broadcast along the
    keys is summed per row by pass A (``row_sums``, (3, B, H, L)) and then into its slots;
    otherwise (a folded spec's slots, or ``stream_dbias=False``) pass A writes the
    (3, B, H, L, S) dS enclosure and :func:`reduce_enclosure` sums it, with the same bits as
    pass C.
    """
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    f64 = np.float64
    q = np.ascontiguousarray(spec.q, f64)
    k = np.ascontiguousarray(spec.k, f64)
    kt = np.ascontiguousarray(np.swapaxes(k, 2, 3))
    vt = np.ascontiguousarray(np.swapaxes(np.asarray(spec.v, f64), 2, 3))
    do = np.ascontiguousarray(grad_out, f64)
    glse = np.ascontiguousarray(grad_lse, f64) if grad_lse is not None else np.zeros((1, 1, 1))
    rows_lo, rows_hi = key_intervals(spec)
    mask_f, mask_st = compact_view(spec.mask, np.bool_)
    drop_f, drop_st = compact_view(spec.dropout_mask, np.bool_)
    masks = (mask_f, drop_f)
    mask_st = np.stack([mask_st, drop_st])
    bias, bias_st = compact_view(spec.bias, f64)
    slopes = (
        np.ascontiguousarray(spec.alibi_slopes, f64)
        if spec.alibi_slopes is not None
        else np.zeros(1)
    )
    group = np.array([np.flatnonzero(spec.kv_head == g) for g in range(kv_heads)], np.int64)
    # [has_bias, has_alibi, has_softcap, alibi_keys, dropout, has_mask, has_dropout_mask, o_0,
    # ..., o_{B-1}]: ALiBi applies to keys j < alibi_keys (a folded sink has none) with the
    # offset o_b of batch row b
    alibi_keys = keys if spec.alibi_keys is None else spec.alibi_keys
    opts = np.concatenate(
        [
            np.array(
                [
                    spec.bias is not None,
                    spec.alibi_slopes is not None,
                    spec.softcap is not None,
                    alibi_keys,
                    spec.dropout_p != 0,
                    spec.mask is not None,
                    spec.dropout_mask is not None,
                ],
                np.int64,
            ),
            _alibi_offsets(spec),
        ]
    )
    # dot-product bounds per length: D (scores), E (dp), S (dq), G L (dk, dv)
    fopts = np.array(
        [
            *dd_of_exact(spec.scale_exact),
            spec.softcap or 1.0,
            *dd_of_fraction(spec.keep_scale),
            dot_bound(dim),
            dot_bound(vdim),
            dot_bound(keys),
            dot_bound(heads // kv_heads * length),
        ]
    )
    dq = np.zeros((3, batch, heads, length, dim))
    dk = np.zeros((3, batch, kv_heads, keys, dim))
    dv = np.zeros((3, batch, kv_heads, keys, vdim))
    slots = _dbias_stream_slots(spec) if stream_dbias else None
    along = stream_dbias and slots is None and _along_keys(spec)
    exact_rows = along and spec.sinks is None  # sum_j dS_ij = g_i exactly (_exact_row_sums)
    row_sums = along and not exact_rows
    write_ds = spec.bias is not None and slots is None and not along
    dbias = np.zeros((3, batch, heads, length, keys)) if write_ds else np.zeros((3, 1, 1, 1, 1))
    if row_sums:
        dbias = np.zeros((3, batch, heads, length, 1))
    if slots is not None:
        dbias_shape = tuple(spec.bias_shape)
        reduced = np.zeros((3, int(np.prod(dbias_shape))))
    has_sink = spec.sinks is not None
    sinks = np.ascontiguousarray(spec.sinks, f64) if has_sink else np.zeros(1)
    dsink = np.zeros((3, batch, heads, length)) if has_sink else np.zeros((3, 1, 1, 1))
    bad = np.zeros((batch, kv_heads), np.bool_)
    if batch and heads and length and (keys or has_sink):
        k_l1, v_l1 = np.zeros((batch, kv_heads, keys)), np.zeros((batch, kv_heads, keys))
        k_col = np.zeros((batch, kv_heads, dim))
        q_sum, do_sum = np.zeros((batch, kv_heads, dim)), np.zeros((batch, kv_heads, vdim))
        _norms(q, k, vt, do, group, k_l1, v_l1, k_col, q_sum, do_sum)
        kv_head = np.ascontiguousarray(spec.kv_head, np.int64)
        istat = np.zeros((batch, heads, length, 3), np.int64)
        fstat = np.zeros((batch, heads, length, N_STAT))
        bad_rows = np.zeros((batch, heads, -(-length // ROW_BLOCK)), np.bool_)
        _pass_a(
            q,
            k,
            kt,
            vt,
            do,
            glse,
            grad_lse is not None,
            rows_lo,
            rows_hi,
            masks,
            mask_st,
            bias,
            bias_st,
            slopes,
            kv_head,
            opts,
            fopts,
            k_l1,
            v_l1,
            k_col,
            dq,
            write_ds,
            dbias,
            istat,
            fstat,
            bad_rows,
            has_sink,
            sinks,
            dsink,
            row_sums,
        )
        _pass_b(
            q,
            kt,
            vt,
            do,
            glse,
            grad_lse is not None,
            rows_lo,
            rows_hi,
            masks,
            mask_st,
            bias,
            bias_st,
            slopes,
            group,
            opts,
            fopts,
            k_l1,
            v_l1,
            q_sum,
            do_sum,
            istat,
            fstat,
            dk,
            dv,
        )
        if slots is not None:
            mag, count = np.zeros(reduced.shape[1]), np.zeros(reduced.shape[1])
            _pass_c(
                q,
                kt,
                vt,
                do,
                glse,
                grad_lse is not None,
                rows_lo,
                rows_hi,
                masks,
                mask_st,
                bias,
                bias_st,
                slopes,
                kv_head,
                opts,
                fopts,
                k_l1,
                v_l1,
                istat,
                fstat,
                slots[0],
                slots[1],
                reduced,
                mag,
                count,
            )
            _finish(reduced, mag, count)
        for h in range(heads):
            bad[:, kv_head[h]] |= bad_rows[:, h].any(axis=1)
    dsinks = None
    if has_sink:  # the sink's dS of every (b, h, i) into slot h, in their C order
        index = np.broadcast_to(
            np.arange(heads, dtype=np.int64)[None, :, None], (batch, heads, length)
        )
        dsinks = reduce_enclosure(dsink, index, (heads,))
    if spec.bias is None:
        return dq, dk, dv, None, dsinks, bad
    if slots is not None:
        return dq, dk, dv, reduced.reshape((3,) + dbias_shape), dsinks, bad
    index, shape = spec.dbias_slots()
    if exact_rows:
        nonempty = (
            istat[..., 0] != 0
            if batch and heads and length and keys
            else np.zeros((batch, heads, length), np.bool_)
        )
        return (
            dq,
            dk,
            dv,
            _exact_row_sums(glse if grad_lse is not None else None, nonempty, index[..., 0], shape),
            dsinks,
            bad,
        )
    if row_sums:  # every key of a row shares the row's slot: the row sums into their slots
        return dq, dk, dv, reduce_enclosure(dbias[..., 0], index[..., 0], shape), dsinks, bad
    return dq, dk, dv, reduce_enclosure(dbias, index, shape), dsinks, bad


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
    _finish(out, mag, count)


@njit(**_JIT)
def _finish(out, mag, count):
    """The error bound of summed slots: the terms' errors plus ``DD_REL`` of the magnitudes
    per addition (``count`` additions into the slot)."""
    for t in range(out.shape[1]):
        out[2, t] = (out[2, t] + count[t] * DD_REL * mag[t] * _SAFE) * BOUND_SAFETY


def reduce_enclosure(enc, index, shape):
    """Sum a (3, B, H, L, S) enclosure into the slots ``index`` (B, H, L, S) of an array of
    ``shape`` (:meth:`refattn.spec.AttentionSpec.dbias_slots`; -1: left out), in the fixed
    C order of the (B, H, L, S) positions (any other (3,) + shape with its index: the sinks'
    (3, B, H, L) into (H,))."""
    shape = tuple(shape)
    size = int(np.prod(shape))
    flat = np.ascontiguousarray(np.broadcast_to(index, enc.shape[1:])).ravel()
    if flat.size == size and np.array_equal(flat, np.arange(size)):  # nothing to sum
        return enc.reshape((3,) + shape)
    out = np.zeros((3, size))
    if flat.size:
        _reduce(np.ascontiguousarray(enc), flat, out)
    return out.reshape((3,) + shape)
