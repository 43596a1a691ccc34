"""Loop twins of refattn.mgk (Nguyen et al. 2022): MGK attention, its EM update, linear MLK.

Loop-level mpmath evaluations at :data:`~naive.gmm.DPS` digits, one batch element at a time;
nothing here imports refattn.
"""

from __future__ import annotations

import mpmath
import numpy as np

from .gmm import DPS
from .mp import exact_div, exact_mul, exact_sum, lse, mp, softmax_weights

__all__ = [
    "naive_allowed",
    "naive_mgk",
    "naive_em",
    "naive_linear",
    "naive_lm_soft2keys_pi",
    "naive_lm_rbf2keys",
    "lm_two_key_variances",
    "LM_EPS",
    "MGK_GUARD",
]

#: The constant of the public language-modelling MLK denominator (mlk_form="lm").
LM_EPS = 1e-5


def naive_allowed(length, keys, *, mask=None, causal=False, window=None, align="top_left"):
    offset = 0 if align == "top_left" else keys - length
    out = np.zeros((length, keys), dtype=bool)
    for i in range(length):
        for j in range(keys):
            ok = mask is None or bool(mask[i][j])
            if causal and j > i + offset:
                ok = False
            if window is not None:
                left, right = window
                if left is not None and j < i + offset - left:
                    ok = False
                if right is not None and j > i + offset + right:
                    ok = False
            out[i, j] = ok
    return out


def _component(q_row, k, s2, log_p, mode, normalized):
    dim = len(q_row)
    term = -mpmath.fsum((mp(a) - mp(b)) ** 2 for a, b in zip(q_row, k, strict=True)) / (2 * s2)
    if normalized:
        term -= dim / mpmath.mpf(2) * mpmath.log(2 * mpmath.pi * s2)
    if mode == "soft":
        term += log_p
    return term


def naive_mgk(
    q,
    keys,
    v,
    *,
    log_pi=None,
    sigma2=1.0,
    mode="soft",
    normalized=False,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    row_eps=0.0,
):
    """Rows h_i = sum_j P_ij v_j; with ``row_eps`` the weights are e^{s_ij} / (sum_j e^{s_ij}
    + row_eps) (the public language-modelling code's extra 1e-6 in the row normaliser)."""
    length, (units, comps) = len(q), keys.shape[:2]
    allowed = naive_allowed(length, units, mask=mask, causal=causal, window=window, align=align)
    s2 = np.broadcast_to(np.asarray(sigma2, dtype=np.float64), (units, comps))
    with mpmath.workdps(DPS):
        out = []
        for i in range(length):
            scores = {}
            for j in range(units):
                if not allowed[i, j]:
                    continue
                terms = []
                for r in range(comps):
                    log_p = (
                        -mpmath.log(comps)
                        if log_pi is None
                        else (-mpmath.inf if np.isneginf(log_pi[j][r]) else mp(log_pi[j][r]))
                    )
                    if mode == "soft" and log_p == -mpmath.inf:
                        continue
                    terms.append(
                        _component(q[i], keys[j][r], mp(s2[j][r]), log_p, mode, normalized)
                    )
                scores[j] = lse(terms) if mode == "soft" else max(terms)
            if not scores:
                out.append([mpmath.mpf(0)] * v.shape[1])
                continue
            if row_eps:
                total = mpmath.fsum(mpmath.exp(s) for s in scores.values()) + mp(row_eps)
                weights = {j: mpmath.exp(s) / total for j, s in scores.items()}
            else:
                weights = dict(zip(scores, softmax_weights(list(scores.values())), strict=True))
            out.append(
                [
                    exact_sum(exact_mul(w, v[j][e]) for j, w in weights.items())
                    for e in range(v.shape[1])
                ]
            )
        return out


def naive_em(q, keys, *, log_pi, sigma2, mask=None, pi_update="joint"):
    length, (units, comps) = len(q), keys.shape[:2]
    allowed = naive_allowed(length, units, mask=mask)
    s2 = np.broadcast_to(np.asarray(sigma2, dtype=np.float64), (units, comps))
    if pi_update == "per_key":
        return _naive_em_per_key(q, keys, log_pi, s2, allowed)
    with mpmath.workdps(DPS):
        resp = [[[mpmath.mpf(0)] * comps for _ in range(units)] for _ in range(length)]
        for i in range(length):
            terms = {
                (j, r): _component(q[i], keys[j][r], mp(s2[j][r]), mp(log_pi[j][r]), "soft", True)
                for j in range(units)
                for r in range(comps)
                if allowed[i, j]
            }
            if not terms:
                continue
            for (j, r), w in zip(terms, softmax_weights(list(terms.values())), strict=True):
                resp[i][j][r] = w
        pi = []
        for j in range(units):
            den = exact_sum(resp[i][j][r] for i in range(length) for r in range(comps))
            pi.append(
                [
                    exact_div(exact_sum(resp[i][j][r] for i in range(length)), den)
                    if den
                    else mpmath.exp(mp(log_pi[j][r]))
                    for r in range(comps)
                ]
            )
        return pi, resp


def _naive_em_per_key(q, keys, log_pi, s2, allowed):
    """pi_jr = average over the allowed queries of p(z_r | t_j, q_i) (per-key posteriors)."""
    length, (units, comps) = len(q), keys.shape[:2]
    with mpmath.workdps(DPS):
        resp = [[[mpmath.mpf(0)] * comps for _ in range(units)] for _ in range(length)]
        for i in range(length):
            for j in range(units):
                if not allowed[i, j]:
                    continue
                dens = [
                    mpmath.exp(
                        _component(q[i], keys[j][r], mp(s2[j][r]), mp(log_pi[j][r]), "soft", True)
                    )
                    for r in range(comps)
                ]
                total = mpmath.fsum(dens)
                resp[i][j] = [d / total for d in dens]
        pi = []
        for j in range(units):
            rows = [i for i in range(length) if allowed[i, j]]
            pi.append(
                [
                    mpmath.fsum(resp[i][j][r] for i in rows) / len(rows)
                    if rows
                    else mpmath.exp(mp(log_pi[j][r]))
                    for r in range(comps)
                ]
            )
        return pi, resp


def _phi(x):
    x = mp(x)
    return x + 1 if x > 0 else mpmath.exp(x)


def naive_linear(
    q, keys, v, *, pi, causal=False, mask=None, window=None, align="top_left", mlk_form="mixture"
):
    """MLK rows from the three readings' descriptions.

    "mixture": ratio of sum_j phi(q).(sum_r pi phi(k_jr)) v_j over the same sum without v_j;
    "lra": (L S)^(-1/4) sum_j phi(q).phi(sum_r pi k_jr) v_j, no denominator; "lm": each
    feature vector divided by its sum over d, D^(-1/2) times the ratio with 1e-5 added to the
    denominator. A row with no allowed key is 0.
    """
    length, (units, comps, dim) = len(q), keys.shape
    allowed = naive_allowed(length, units, mask=mask, causal=causal, window=window, align=align)
    with mpmath.workdps(DPS):

        def unit(vec):
            total = mpmath.fsum(vec)
            return [x / total for x in vec]

        if mlk_form == "lra":
            root = mpmath.root(mpmath.mpf(length) * units, 4)
            mixed = [
                [
                    _phi(mpmath.fsum(mp(pi[j][r]) * mp(keys[j][r][d]) for r in range(comps)))
                    for d in range(dim)
                ]
                for j in range(units)
            ]
        else:
            feats = [
                [
                    (unit if mlk_form == "lm" else list)([_phi(x) for x in keys[j][r]])
                    for r in range(comps)
                ]
                for j in range(units)
            ]
            mixed = [
                [
                    mpmath.fsum(mp(pi[j][r]) * feats[j][r][d] for r in range(comps))
                    for d in range(dim)
                ]
                for j in range(units)
            ]
        out = []
        for i in range(length):
            phi_q = [_phi(x) for x in q[i]]
            if mlk_form == "lm":
                phi_q = unit(phi_q)
            cols = [j for j in range(units) if allowed[i, j]]
            kernels = {
                j: mpmath.fsum(a * b for a, b in zip(phi_q, mixed[j], strict=True)) for j in cols
            }
            num = [mpmath.fsum(kernels[j] * mp(v[j][e]) for j in cols) for e in range(v.shape[1])]
            if mlk_form == "lra":
                out.append([n / root for n in num])
            elif mlk_form == "lm":
                den = mpmath.fsum(kernels.values()) + mp(LM_EPS)
                out.append([n / (mpmath.sqrt(dim) * den) for n in num])
            elif not cols:
                out.append([mpmath.mpf(0)] * v.shape[1])
            else:
                den = mpmath.fsum(kernels.values())
                out.append([n / den for n in num])
        return out


# --------------------------------------------------------------------------------------------
# The public transformer-mgk code (minhtannguyen/transformer-mgk), written from its
# description: language-modeling/lmtool-fwms/src/mem_transformer.py, class MGKAttn, with two
# keys per position (update modes "soft2keys" and "rbf2keys").
# --------------------------------------------------------------------------------------------

#: The guard MGKAttn adds to the per-key mixture (soft2keys pi update) and to the row sum.
MGK_GUARD = 1e-6


def lm_two_key_variances(dim):
    """sigma^2 of the two keys: QK_distance0 = -(1/sqrt(D))/2 |q - k0|^2 and QK_distance1 =
    -1.5/sqrt(D) |q - k1|^2, i.e. sigma^2_0 = sqrt(D), sigma^2_1 = sqrt(D) / 3."""
    root = mpmath.sqrt(dim)
    return root, root / 3


def _two_key_kernels(q_row, k0_row, k1_row, dim):
    """exp(QK_distance0), exp(QK_distance1): unnormalised Gaussian kernels (no (2 pi s2)^(-D/2))."""
    s0, s1 = lm_two_key_variances(dim)
    d0 = mpmath.fsum((mp(a) - mp(b)) ** 2 for a, b in zip(q_row, k0_row, strict=True))
    d1 = mpmath.fsum((mp(a) - mp(b)) ** 2 for a, b in zip(q_row, k1_row, strict=True))
    return mpmath.exp(-d0 / (2 * s0)), mpmath.exp(-d1 / (2 * s1))


def naive_lm_soft2keys_pi(q, k0, k1, pi):
    """The soft2keys training-time pi update: with e_r the kernels of the two keys,
    ``resp0 = pi_j e0 / (pi_j e0 + (1 - pi_j) e1 + 1e-6)`` and ``pi_j <- sum_{b, i} resp0 /
    (B L)``, pooled over the batch and every query (the attention mask is applied later).
    q (B, L, D), k0 and k1 (B, S, D), pi (S,) the weight of key 0. Returns pi_new (S,) mpf."""
    batch, length, dim = q.shape
    units = k0.shape[1]
    with mpmath.workdps(DPS):
        out = []
        for j in range(units):
            p = mp(pi[j])
            total = mpmath.mpf(0)
            for b in range(batch):
                for i in range(length):
                    e0, e1 = _two_key_kernels(q[b, i], k0[b, j], k1[b, j], dim)
                    total += p * e0 / (p * e0 + (1 - p) * e1 + mp(MGK_GUARD))
            out.append(total / (batch * length))
        return out


def naive_lm_rbf2keys(q, k0, k1, v, pi0, pi1, *, causal=True):
    """The rbf2keys attention of one batch element: ``attn = clamp(pi0_j, 0, 1) e0 +
    clamp(pi1_j, 0, 1) e1`` (pi0, pi1 learnt independently, not normalised), masked
    positions set to 0, each row divided by (its sum + 1e-6), times v. q (L, D), k0 and k1
    (S, D), v (S, E), pi0 and pi1 (S,). Returns (L, E) mpf lists."""
    length, dim = q.shape
    units = k0.shape[0]
    offset = units - length  # the memory (mems) precedes the current segment
    with mpmath.workdps(DPS):
        out = []
        for i in range(length):
            row = []
            for j in range(units):
                if causal and j > i + offset:
                    row.append(mpmath.mpf(0))
                    continue
                e0, e1 = _two_key_kernels(q[i], k0[j], k1[j], dim)
                c0, c1 = (min(max(mp(p), 0), 1) for p in (pi0[j], pi1[j]))
                row.append(c0 * e0 + c1 * e1)
            total = mpmath.fsum(row) + mp(MGK_GUARD)
            out.append(
                [
                    mpmath.fsum(w / total * mp(v[j][e]) for j, w in enumerate(row))
                    for e in range(v.shape[1])
                ]
            )
        return out
