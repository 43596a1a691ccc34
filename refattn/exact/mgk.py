"""Exact paths of :mod:`refattn.mgk` (Transformer-MGK and -MLK of Nguyen et al. 2022): every
output element the exact value of the stated computation, rounded once.

Rows are evaluated in the number systems of :mod:`refattn.exact.numbers`; a soft score (a
log-sum-exp over a key's components) is compared, not computed, in the rational fallback
(:class:`_Symbolic`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from mpmath import iv, mp

from .. import _checks
from .numbers import NotRational, dot, is_zero, sqdist
from .rows import batch_rows, exact_rows

__all__ = ["attention", "em_update_pi", "linear_attention"]


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


def _component_terms_exact(ops, qrow, kj, log_pi_j, sig_j, sig_log_j, mode, normalized,
                           sigma_varies):
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


def attention(q, clean_keys, v, log_pi, sigma2, sigma_varies, mode, normalized, allowed,
              poisoned, dtype):
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
            terms = _component_terms_exact(ops, x.q[i], x.keys[j], x.log_pi[j], x.sigma2[j],
                                           None if x.sigma_log is None else x.sigma_log[j],
                                           mode, normalized, sigma_varies)
            scores.append(_key_score(ops, terms, mode) if terms else None)
        weights = ops.softmax(scores)
        values = ops.array(np.where(allowed[b][i][:, None], v[b], 0.0))
        return [sum((w * values[j, e] for j, w in enumerate(weights) if not is_zero(w)), 0)
                for e in range(v.shape[-1])]

    rows = batch_rows(batch, length)
    table = exact_rows(rows, row_out, dtype, "mgk.attention")
    return table.reshape(batch + (length, v.shape[-1]))


def em_update_pi(q, keys, log_pi, sigma2, sigma_varies, allowed, dtype):
    """(pi (..., S, R), responsibilities (..., L, S, R)) of one EM step, rounded once."""
    batch = allowed.shape[:-2]
    length, units, comps = q.shape[-2], keys.shape[-3], keys.shape[-2]
    comp_shape = batch + keys.shape[-3:-1]

    def batch_out(ops, b):
        x = _exact_inputs(ops, q, keys, log_pi, sigma2, sigma_varies, True, b)
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
                    if sigma_varies:  # the Gaussian normaliser cancels when sigma2 is shared
                        term = term - x.sigma_log[j][r] * q.shape[-1] / 2
                    flat.append(term)
            resp.append(ops.softmax(flat))
        pi = []
        for j in range(units):
            den = sum((resp[i][j * comps + r] for i in range(length) for r in range(comps)), 0)
            for r in range(comps):
                if is_zero(den):
                    pi.append(ops.exp(ops.scalar(log_pi[b][j][r]))
                              if not np.isneginf(log_pi[b][j][r]) else 0)
                    continue
                pi.append(sum((resp[i][j * comps + r] for i in range(length)), 0) / den)
        return pi + [w for row in resp for w in row]

    rows = list(np.ndindex(*batch))
    table = exact_rows(rows, batch_out, dtype, "mgk.em_update_pi")
    n_pi = units * comps
    return (table[:, :n_pi].reshape(comp_shape),
            table[:, n_pi:].reshape(batch + (length, units, comps)))


def _elu1_exact(ops, x_float, x):
    """phi(x) = elu(x) + 1: x + 1 for x > 0, exp(x) otherwise (branch on the exact input)."""
    return x + 1 if x_float > 0 else ops.exp(x)


def linear_attention(q, keys, v, pi, causal, dtype):
    """Transformer-MLK output (..., L, E) rounded once."""
    batch = pi.shape[:-2]
    length, units = q.shape[-2], keys.shape[-3]

    def row_out(ops, row):
        b, i = row
        qf = _checks.as_float64(q[b][i])
        phi_q = [_elu1_exact(ops, f, x) for f, x in zip(qf, ops.array(qf), strict=False)]
        keys_f = _checks.as_float64(keys[b])
        keys_x, pi_x, v_x = ops.array(keys_f), ops.array(pi[b]), ops.array(v[b])
        stop = min(i, units - 1) + 1 if causal else units
        num = [0] * v.shape[-1]
        den = 0
        for j in range(stop):
            mixed = [sum((pi_x[j][r] * _elu1_exact(ops, keys_f[j, r, d], keys_x[j, r, d])
                          for r in range(keys.shape[-2])), 0) for d in range(q.shape[-1])]
            kernel = dot(phi_q, mixed)
            den = den + kernel
            num = [n + kernel * v_x[j][e] for e, n in enumerate(num)]
        return [n / den for n in num]

    rows = batch_rows(batch, length)
    table = exact_rows(rows, row_out, dtype, "mgk.linear_attention")
    return table.reshape(batch + (length, v.shape[-1]))
