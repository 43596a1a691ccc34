"""Exact paths of :mod:`refattn.mgk` (Transformer-MGK and -MLK of Nguyen et al. 2022): every
output element the exact value of the stated computation, rounded once.

Rows are evaluated in the number systems of :mod:`refattn.exact.numbers`; a soft score (a
log-sum-exp over a key's components) is compared, not computed, in the rational fallback
(:class:`_Symbolic`).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np
from mpmath import iv, mp

from .. import _checks
from . import intervals as I
from .numbers import NotRational, dot, is_zero, sqdist
from .rows import UNKNOWN, batch_rows, exact_grads, exact_rows

__all__ = [
    "attention",
    "attention_vjp",
    "em_update_pi",
    "linear_attention",
    "linear_attention_vjp",
    "LM_EPS",
]

#: The constant of the public language-modelling MLK denominator (see refattn.mgk).
LM_EPS = 1e-5


class _Symbolic:
    """Rational mode: lse_r of rational terms, compared (not computed) as a multiset.

    Two soft scores are exactly equal when their component terms agree as multisets, which is
    all the rational fallback needs to certify a tie of the softmax over keys.
    """

    def __init__(self, terms):
        self.terms = tuple(sorted(terms))

    def __eq__(self, other):
        return isinstance(other, _Symbolic) and self.terms == other.terms

    def __ne__(self, other):
        return not self == other

    __hash__ = None


def _iv_max(values):
    """Enclosure of max_r x_r from enclosures of the x_r."""
    lo = max(mp.make_mpf(x._mpi_[0]) for x in values)
    hi = max(mp.make_mpf(x._mpi_[1]) for x in values)
    return iv.mpf([lo, hi])


def _component_terms_exact(
    ops, qrow, kj, log_pi_j, sig_j, sig_log_j, mode, normalized, sigma_varies
):
    terms = []
    for r in range(len(kj)):
        if mode == "soft" and log_pi_j[r] is None:
            continue
        term = -sqdist(qrow, kj[r]) / (2 * sig_j[r])
        if mode == "soft":
            term = term + log_pi_j[r]
        if normalized and sigma_varies:
            term = term - sig_log_j[r] * len(qrow) / 2
        terms.append(term)
    return terms


def _key_score(ops, terms, mode):
    if mode == "hard":
        return max(terms) if ops.rational else _iv_max(terms)
    if ops.rational:
        return terms[0] if len(terms) == 1 else _Symbolic(terms)
    return ops.lse(terms)


class _ExactInputs(NamedTuple):
    q: np.ndarray
    keys: np.ndarray
    log_pi: list
    sigma2: np.ndarray
    sigma_log: np.ndarray | None


def _exact_inputs(ops, q, keys, log_pi, sigma2, sigma_varies, normalized, b):
    sig = ops.array(sigma2[b])
    sig_log = None
    if normalized and sigma_varies:
        if ops.rational:
            raise NotRational  # log(2 pi sigma2) is transcendental
        sig_log = np.array([[ops.log(2 * iv.pi * s) for s in row] for row in sig], dtype=object)
    lp = [[None if np.isneginf(x) else ops.scalar(x) for x in row] for row in log_pi[b]]
    return _ExactInputs(ops.array(q[b]), ops.array(keys[b]), lp, sig, sig_log)


def attention(
    q,
    clean_keys,
    v,
    log_pi,
    sigma2,
    sigma_varies,
    mode,
    normalized,
    allowed,
    poisoned,
    row_eps,
    dtype,
):
    """MGK attention (..., L, E) rounded once: rows in ``poisoned`` are NaN, keys with non-finite
    entries enter as ``clean_keys`` (their rows are poisoned or excluded by ``allowed``)."""
    batch, length, units = allowed.shape[:-2], q.shape[-2], clean_keys.shape[-3]

    def row_out(ops, row):
        b, i = row
        if poisoned[b][i]:
            return [math.nan] * v.shape[-1]
        x = _exact_inputs(ops, q, clean_keys, log_pi, sigma2, sigma_varies, normalized, b)
        scores = []
        for j in range(units):
            if not allowed[b][i][j]:
                scores.append(None)
                continue
            terms = _component_terms_exact(
                ops,
                x.q[i],
                x.keys[j],
                x.log_pi[j],
                x.sigma2[j],
                None if x.sigma_log is None else x.sigma_log[j],
                mode,
                normalized,
                sigma_varies,
            )
            scores.append(_key_score(ops, terms, mode) if terms else None)
        weights = _weights_and_rest(ops, scores, row_eps)[0]
        values = ops.array(np.where(allowed[b][i][:, None], v[b], 0.0))
        return [
            sum((w * values[j, e] for j, w in enumerate(weights) if not is_zero(w)), 0)
            for e in range(v.shape[-1])
        ]

    rows = batch_rows(batch, length)
    table = exact_rows(rows, row_out, dtype, "mgk.attention")
    return table.reshape(batch + (length, v.shape[-1]))


def _hard_tops(q, keys, sigma2, with_log):
    """{(b, i, j): components attaining max_r of the exact hard terms}, decided exactly.

    The terms ``-||q_i - k_jr||^2 / (2 sigma2_jr)`` are rationals; with the Gaussian constant
    (``with_log``) two terms with different sigma2 differ by ``(D/2) log(sigma2 ratio)`` plus a
    rational, never 0 (log of a rational other than 1 is irrational), so distinct (term,
    sigma2) pairs are separated by enclosures at a rising precision.
    """
    qf, kf, sf = (_checks.as_float64(a) for a in (q, keys, sigma2))
    dim = qf.shape[-1]
    tops = {}
    for b in np.ndindex(*qf.shape[:-2]):
        for i in range(qf.shape[-2]):
            qi = [Fraction(x) for x in qf[b][i]]
            for j in range(kf.shape[-3]):
                terms = [
                    (
                        -sum(
                            ((a - Fraction(c)) ** 2 for a, c in zip(qi, kf[b][j][r], strict=True)),
                            Fraction(0),
                        )
                        / (2 * Fraction(sf[b][j][r])),
                        Fraction(sf[b][j][r]) if with_log else 0,
                    )
                    for r in range(kf.shape[-2])
                ]
                tops[b, i, j] = _argmax(terms, dim)
    return tops


def _argmax(terms, dim):
    """Indices r maximising ``F_r - (D/2) log s_r`` over ``terms = [(F_r, s_r or 0)]``."""
    groups = sorted(set(terms))
    if len(groups) == 1 or all(s == 0 for _, s in groups):
        best = max(terms)
        return [r for r, t in enumerate(terms) if t == best]
    prec = 64
    while True:
        with I.workprec(prec):
            bounds = {}
            for t in groups:
                f, s = t
                value = I.point(f)
                if s != 0:
                    value = value - dim * I.log(I.point(s)) / 2
                bounds[t] = (mp.make_mpf(value._mpi_[0]), mp.make_mpf(value._mpi_[1]))
        top = max(groups, key=lambda t: bounds[t][0])
        if all(bounds[t][1] < bounds[top][0] for t in groups if t != top):
            return [r for r, t in enumerate(terms) if t == top]
        prec *= 2


def attention_vjp(
    q,
    keys,
    v,
    go,
    log_pi,
    sigma2,
    sigma_varies,
    mode,
    normalized,
    allowed,
    row_eps,
    dtype,
    shapes=None,
):
    """(dq, dkeys, dv) of MGK attention, summed to ``shapes`` (default: the broadcast shapes)
    and rounded once (one Ziv loop over every element)."""
    batch = allowed.shape[:-2]
    length, units, comps, dim = q.shape[-2], keys.shape[-3], keys.shape[-2], q.shape[-1]
    evalue = v.shape[-1]
    with_log = normalized and sigma_varies
    tops = _hard_tops(q, keys, sigma2, with_log) if mode == "hard" else None
    if shapes is None:
        shapes = (q.shape, keys.shape, v.shape)

    def batch_grads(ops, b):
        x = _exact_inputs(ops, q, keys, log_pi, sigma2, sigma_varies, normalized, b)
        v_x, g_x = ops.array(v[b]), ops.array(go[b])
        dq = [[0] * dim for _ in range(length)]
        dk = [[[0] * dim for _ in range(comps)] for _ in range(units)]
        dv = [[0] * evalue for _ in range(units)]
        for i in range(length):
            try:
                row_vjp(ops, x, b, i, v_x, g_x, dq, dk, dv)
            except NotRational:
                if not ops.rational:
                    raise
                _row_unknown(dq, dk, dv, i, allowed[b][i])
        return dq, dk, dv

    def row_vjp(ops, x, b, i, v_x, g_x, dq, dk, dv):
        scores, shares = _row_scores(ops, x, b, i, allowed, mode, normalized, sigma_varies, tops)
        weights, rest = _weights_and_rest(ops, scores, row_eps)
        cols = [j for j, w in enumerate(weights) if not is_zero(w)]
        dots = {j: dot(g_x[i], v_x[j]) for j in cols}
        for j in cols:
            for e in range(evalue):
                dv[j][e] = dv[j][e] + weights[j] * g_x[i][e]
            # dS_j = P_j (rest dP_j + sum_{k != j} P_k (dP_j - dP_k)): exactly 0 for a
            # lone key (sum_k P_k = 1 - rest)
            inner = sum((weights[k] * (dots[j] - dots[k]) for k in cols if k != j), 0)
            if not is_zero(rest):
                inner = inner + rest * dots[j]
            if is_zero(inner):
                continue
            dscore = weights[j] * inner
            for r, share in shares[j]:
                coef = dscore * share / x.sigma2[j][r]
                for d in range(dim):
                    diff = x.q[i][d] - x.keys[j][r][d]
                    dq[i][d] = dq[i][d] - coef * diff
                    dk[j][r][d] = dk[j][r][d] + coef * diff

    return exact_grads(
        batch,
        batch_grads,
        [(length, dim), (units, comps, dim), (units, evalue)],
        shapes,
        dtype,
        "mgk.attention_vjp",
    )


def _row_unknown(dq, dk, dv, i, allowed_row):
    """Rational mode: row i is not rational; mark every gradient element it reaches."""
    dq[i] = [UNKNOWN] * len(dq[i])
    for j, ok in enumerate(allowed_row):
        if ok:
            dk[j] = [[UNKNOWN] * len(row) for row in dk[j]]
            dv[j] = [UNKNOWN] * len(dv[j])


def _row_scores(ops, x, b, i, allowed, mode, normalized, sigma_varies, tops):
    """Scores s_ij (None = excluded) and, per key, [(r, d s_ij / d t_ijr)] of row i."""
    scores, shares = [], []
    for j in range(len(x.keys)):
        present = []
        if allowed[b][i][j]:
            for r in range(len(x.keys[j])):
                if mode == "soft" and x.log_pi[j][r] is None:
                    continue
                term = -sqdist(x.q[i], x.keys[j][r]) / (2 * x.sigma2[j][r])
                if mode == "soft":
                    term = term + x.log_pi[j][r]
                if normalized and sigma_varies:
                    term = term - x.sigma_log[j][r] * len(x.q[i]) / 2
                present.append((r, term))
        if not present:
            scores.append(None)
            shares.append([])
            continue
        terms = [t for _, t in present]
        score = _key_score(ops, terms, mode)
        scores.append(score)
        if mode == "hard":
            top = tops[b, i, j]
            share = 1 if len(top) == 1 else Fraction(1, len(top))
            shares.append(
                [(r, share if ops.rational or len(top) == 1 else I.point(share)) for r in top]
            )
        elif len(present) == 1:
            shares.append([(present[0][0], 1)])
        else:
            if ops.rational:
                raise NotRational  # a component's share exp(t - s) is transcendental
            shares.append([(r, ops.exp(t - score)) for r, t in present])
    return scores, shares


def _weights_and_rest(ops, scores, row_eps):
    """(weights, 1 - sum of weights = row_eps / (Z + row_eps))."""
    if not row_eps or all(s is None for s in scores):
        return ops.softmax(scores), 0
    log_eps = ops.log(ops.scalar(row_eps))
    log_den = ops.lse(list(scores) + [log_eps])
    return [0 if s is None else ops.exp(s - log_den) for s in scores], ops.exp(log_eps - log_den)


def em_update_pi(
    q, keys, log_pi, sigma2, sigma_varies, allowed, pi_update, normalized, component_eps, dtype
):
    """(pi (..., S, R), responsibilities (..., L, S, R)) of one EM step, rounded once."""
    batch = allowed.shape[:-2]
    length, units, comps = q.shape[-2], keys.shape[-3], keys.shape[-2]
    comp_shape = batch + keys.shape[-3:-1]

    def batch_out(ops, b):
        x = _exact_inputs(ops, q, keys, log_pi, sigma2, sigma_varies, normalized, b)
        resp = []
        for i in range(length):
            flat = []
            for j in range(units):
                for r in range(comps):
                    if not allowed[b][i][j] or x.log_pi[j][r] is None:
                        flat.append(None)
                        continue
                    term = -sqdist(x.q[i], x.keys[j][r]) / (2 * x.sigma2[j][r])
                    term = term + x.log_pi[j][r]
                    if normalized and sigma_varies:  # cancels when sigma2 is shared
                        term = term - x.sigma_log[j][r] * q.shape[-1] / 2
                    flat.append(term)
            if pi_update == "per_key":  # softmax over r within each allowed key
                flat = [
                    w
                    for j in range(units)
                    for w in (
                        _weights_and_rest(ops, flat[j * comps : (j + 1) * comps], component_eps)[0]
                        if allowed[b][i][j]
                        else [0] * comps
                    )
                ]
            else:
                flat = ops.softmax(flat)
            resp.append(flat)
        if pi_update == "per_key":
            return _per_key_pi(ops, resp, log_pi[b], allowed[b], units, comps) + [
                w for row in resp for w in row
            ]
        pi = []
        for j in range(units):
            den = sum((resp[i][j * comps + r] for i in range(length) for r in range(comps)), 0)
            for r in range(comps):
                if is_zero(den):
                    pi.append(
                        ops.exp(ops.scalar(log_pi[b][j][r]))
                        if not np.isneginf(log_pi[b][j][r])
                        else 0
                    )
                    continue
                pi.append(sum((resp[i][j * comps + r] for i in range(length)), 0) / den)
        return pi + [w for row in resp for w in row]

    rows = list(np.ndindex(*batch))
    table = exact_rows(rows, batch_out, dtype, "mgk.em_update_pi")
    n_pi = units * comps
    return (
        table[:, :n_pi].reshape(comp_shape),
        table[:, n_pi:].reshape(batch + (length, units, comps)),
    )


def _per_key_pi(ops, resp, log_pi, allowed, units, comps):
    """pi_jr = mean over the allowed queries i of p(z_r | t_j, q_i) (keys never allowed keep
    their pi)."""
    pi = []
    for j in range(units):
        rows = [i for i in range(len(resp)) if allowed[i][j]]
        for r in range(comps):
            if not rows:
                pi.append(ops.exp(ops.scalar(log_pi[j][r])) if not np.isneginf(log_pi[j][r]) else 0)
                continue
            pi.append(sum((resp[i][j * comps + r] for i in rows), 0) / len(rows))
    return pi


def _phi(ops, x_float, x):
    """phi(x) = elu(x) + 1: x + 1 for x > 0, exp(x) otherwise (branch on the exact input)."""
    return x + 1 if x_float > 0 else ops.exp(x)


def _dphi(ops, x_float, x):
    """phi'(x): 1 for x > 0, exp(x) otherwise (both sides give 1 at 0)."""
    return 1 if x_float > 0 else ops.exp(x)


def _inv_root(ops, n, k):
    """n^(-1/k) for an integer n >= 1 (exact when n is a k-th power)."""
    if ops.rational:
        root = round(n ** (1.0 / k))
        if root**k != n:
            raise NotRational
        return Fraction(1, root)
    value = I.point(float(n))
    for _ in range(k // 2):
        value = I.sqrt(value)
    return 1 / value


class _Features(NamedTuple):
    """The query features a_i (L x D), key features m_j (S x D) of one batch element and the
    maps taking their cotangents back to q and keys."""

    a: list
    m: list
    back_q: object
    back_k: object


def _normalised(ops, phis):
    total = sum(phis, 0)
    return [p / total for p in phis], total


def _features(ops, qf, kf, pif, form):
    """Features of one batch element: qf (L, D), kf (S, R, D), pif (S, R) float64."""
    (length, dim), (units, comps) = qf.shape, pif.shape
    qx, kx, pix = ops.array(qf), ops.array(kf), ops.array(pif)
    phi_q = [[_phi(ops, qf[i, d], qx[i, d]) for d in range(dim)] for i in range(length)]
    dphi_q = [[_dphi(ops, qf[i, d], qx[i, d]) for d in range(dim)] for i in range(length)]
    if form == "lra":
        cq, ck = _inv_root(ops, length, 4), _inv_root(ops, units, 4)
        exact_u = [
            [
                sum(
                    (Fraction(pif[j, r]) * Fraction(kf[j, r, d]) for r in range(comps)), Fraction(0)
                )
                for d in range(dim)
            ]
            for j in range(units)
        ]
        ux = [
            [sum((pix[j, r] * kx[j, r, d] for r in range(comps)), 0) for d in range(dim)]
            for j in range(units)
        ]
        a = [[p * cq for p in row] for row in phi_q]
        m = [[_phi(ops, exact_u[j][d], ux[j][d]) * ck for d in range(dim)] for j in range(units)]

        def back_q(da):
            return [[da[i][d] * cq * dphi_q[i][d] for d in range(dim)] for i in range(length)]

        def back_k(dm):
            du = [
                [dm[j][d] * ck * _dphi(ops, exact_u[j][d], ux[j][d]) for d in range(dim)]
                for j in range(units)
            ]
            return [
                [[pix[j, r] * du[j][d] for d in range(dim)] for r in range(comps)]
                for j in range(units)
            ]

        return _Features(a, m, back_q, back_k)
    phi_k = [
        [[_phi(ops, kf[j, r, d], kx[j, r, d]) for d in range(dim)] for r in range(comps)]
        for j in range(units)
    ]
    dphi_k = [
        [[_dphi(ops, kf[j, r, d], kx[j, r, d]) for d in range(dim)] for r in range(comps)]
        for j in range(units)
    ]
    if form == "mixture":
        a, qsum, hat_k, ksum = phi_q, None, phi_k, None
    else:  # "lm": every feature vector normalised to sum 1 over d
        a, qsum = zip(*(_normalised(ops, row) for row in phi_q), strict=True)
        pairs = [[_normalised(ops, phi_k[j][r]) for r in range(comps)] for j in range(units)]
        hat_k = [[pair[0] for pair in row] for row in pairs]
        ksum = [[pair[1] for pair in row] for row in pairs]
    m = [
        [sum((pix[j, r] * hat_k[j][r][d] for r in range(comps)), 0) for d in range(dim)]
        for j in range(units)
    ]

    def through_norm(dhat, hat, total):
        if total is None:
            return dhat
        inner = sum((g * h for g, h in zip(dhat, hat, strict=True)), 0)
        return [(g - inner) / total for g in dhat]

    def back_q(da):
        return [
            [
                g * dp
                for g, dp in zip(
                    through_norm(da[i], a[i], None if qsum is None else qsum[i]),
                    dphi_q[i],
                    strict=True,
                )
            ]
            for i in range(length)
        ]

    def back_k(dm):
        out = []
        for j in range(units):
            rows = []
            for r in range(comps):
                dhat = [pix[j, r] * g for g in dm[j]]
                dphi = through_norm(dhat, hat_k[j][r], None if ksum is None else ksum[j][r])
                rows.append([g * dp for g, dp in zip(dphi, dphi_k[j][r], strict=True)])
            out.append(rows)
        return out

    return _Features(list(a), m, back_q, back_k)


def _lm_constants(ops, dim, form):
    """(c, e) of ``h = c N / (Dn + e)``: (1, 0) for "mixture", (D^-1/2, LM_EPS) for "lm"."""
    if form == "lm":
        return _inv_root(ops, dim, 2), ops.scalar(LM_EPS)
    return 1, 0


def linear_attention(q, keys, v, pi, allowed, form, dtype):
    """Transformer-MLK output (..., L, E) in reading ``form``, rounded once."""
    batch = allowed.shape[:-2]
    length, units, dim, evalue = q.shape[-2], keys.shape[-3], q.shape[-1], v.shape[-1]
    qf, kf, pif = (_checks.as_float64(a) for a in (q, keys, pi))

    def batch_out(ops, b):
        feats = _features(ops, qf[b], kf[b], pif[b], form)
        scale, eps = _lm_constants(ops, dim, form)
        v_x = ops.array(v[b])
        out = []
        for i in range(length):
            cols = [j for j in range(units) if allowed[b][i][j]]
            kernels = {j: dot(feats.a[i], feats.m[j]) for j in cols}
            num = [sum((kernels[j] * v_x[j][e] for j in cols), 0) for e in range(evalue)]
            if form == "lra":
                out.extend(num)
            elif form == "mixture" and not cols:
                out.extend([0] * evalue)
            elif form == "mixture" and len(cols) == 1:  # kappa v / kappa: exactly v
                out.extend(v_x[cols[0]][e] for e in range(evalue))
            else:
                den = sum(kernels.values(), 0) + eps
                out.extend(scale * n / den for n in num)
        return out

    rows = list(np.ndindex(*batch))
    table = exact_rows(rows, batch_out, dtype, "mgk.linear_attention")
    return table.reshape(batch + (length, evalue))


def linear_attention_vjp(q, keys, v, go, pi, allowed, form, shapes, dtype):
    """(dq, dkeys, dv) of Transformer-MLK in reading ``form``, summed to ``shapes`` and rounded
    once."""
    batch = allowed.shape[:-2]
    length, units, dim, evalue = q.shape[-2], keys.shape[-3], q.shape[-1], v.shape[-1]
    comps = keys.shape[-2]
    qf, kf, pif = (_checks.as_float64(a) for a in (q, keys, pi))

    def batch_grads(ops, b):
        feats = _features(ops, qf[b], kf[b], pif[b], form)
        scale, eps = _lm_constants(ops, dim, form)
        v_x, g_x = ops.array(v[b]), ops.array(go[b])
        da = [[0] * dim for _ in range(length)]
        dm = [[0] * dim for _ in range(units)]
        dv = [[0] * evalue for _ in range(units)]
        for i in range(length):
            cols = [j for j in range(units) if allowed[b][i][j]]
            if not cols:
                continue
            kernels = {j: dot(feats.a[i], feats.m[j]) for j in cols}
            dots = {j: dot(g_x[i], v_x[j]) for j in cols}
            if form == "lra":
                dkernel, weight = dots, 1
            else:  # dkappa_j = c (e dP_j + sum_k kappa_k (dP_j - dP_k)) / (Dn + e)^2
                den = sum(kernels.values(), 0) + eps
                factor = scale / (den * den)
                dkernel = {
                    j: factor
                    * (
                        eps * dots[j]
                        + sum((kernels[k] * (dots[j] - dots[k]) for k in cols if k != j), 0)
                    )
                    for j in cols
                }
                weight = scale / den
            for j in cols:
                # the row's weight of v_j: exactly 1 for a lone key of the "mixture" form
                share = 1 if form == "mixture" and len(cols) == 1 else kernels[j] * weight
                for e in range(evalue):
                    dv[j][e] = dv[j][e] + share * g_x[i][e]
                if is_zero(dkernel[j]):
                    continue
                for d in range(dim):
                    da[i][d] = da[i][d] + dkernel[j] * feats.m[j][d]
                    dm[j][d] = dm[j][d] + dkernel[j] * feats.a[i][d]
        return feats.back_q(da), feats.back_k(dm), dv

    return exact_grads(
        batch,
        batch_grads,
        [(length, dim), (units, comps, dim), (units, evalue)],
        shapes,
        dtype,
        "mgk.linear_attention_vjp",
    )
