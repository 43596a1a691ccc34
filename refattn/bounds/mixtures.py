"""A-priori error bounds of the probabilistic variants' float64 paths: softmax mixtures in
log-space (:mod:`refattn.gmm`, :mod:`refattn.mgk`, :mod:`refattn.hopfield` and their kernels in
:mod:`refattn.kernels.variants`), iterated EM steps and normalised ratios.

Counts follow Higham (*Accuracy and Stability of Numerical Algorithms*, 2nd ed.): a sum of n
rounded terms errs by at most gamma_n times the sum of their absolute values (eq. (3.4)), and
the max-shifted log1p log-sum-exp is backward stable (Blanchard, Higham & Higham 2021).
"""

from __future__ import annotations

import math

import numpy as np

from .unit import gamma, unit_roundoff

__all__ = [
    "logit_lse_bound",
    "mixture_bound",
    "iterated_bound",
    "ratio_bound",
    "mgk_vjp_bound",
    "mlk_vjp_bound",
]


def logit_lse_bound(term_scale, n, dim, lse_magnitude=0.0, dtype="float64"):
    """First-order bound on the absolute float error of ``lse_j(s_j)`` computed in log-space.

    Each logit ``s_j`` is a sum of at most ``dim + 2`` rounded terms whose absolute values sum
    to at most ``term_scale`` (error <= gamma_{dim+2} term_scale, Higham eq. (3.4)); the
    max-shifted log1p lse of ``n`` logits adds gamma_{n+4} (1 + |lse|) (Blanchard, Higham &
    Higham 2021, Theorem 2.2).

    >>> bool(logit_lse_bound(0.0, 1, 0) == gamma(5))
    True
    """
    return gamma(dim + 2, dtype) * float(term_scale) + gamma(n + 4, dtype) * (
        1.0 + abs(float(lse_magnitude))
    )


def mixture_bound(term_scale, n, dim, value_scale, dtype="float64"):
    """First-order bound on the absolute float error of ``sum_j softmax(s)_j v_j``.

    Every weight ``exp(s_j - lse)`` carries the logit error and the lse error (so twice
    :func:`logit_lse_bound`'s logit part, doubled again for safety against the second-order
    terms), the exponential and the subtraction each one rounding at most ``u (1 + |s_j -
    lse|) w_j <= u`` absolute, and the weighted sum of ``n`` values gamma_n; all scaled by
    ``value_scale = max |v_j|``.

    >>> bool(mixture_bound(0.0, 1, 0, 1.0) == gamma(13))
    True
    """
    return float(value_scale) * (
        4 * gamma(dim + 2, dtype) * float(term_scale) + gamma(3 * n + 10, dtype)
    )


def iterated_bound(step_bound, lipschitz, iters):
    """Error after ``iters`` steps of a map with Lipschitz constant ``lipschitz`` when every step
    adds at most ``step_bound``: ``step_bound * sum_{t < iters} lipschitz**t``.

    >>> iterated_bound(1.0, 0.5, 3)
    1.75
    """
    return float(step_bound) * sum(float(lipschitz) ** t for t in range(int(iters)))


def ratio_bound(n_terms, value_scale, dtype="float64"):
    """Bound on the float error of ``sum_j c_j v_j / sum_j c_j`` with all ``c_j >= 0`` each
    known to relative error gamma_{n_terms}: the quotient is a convex combination, so the error
    is at most ``value_scale * 2 gamma_{2 n_terms + 2}``.

    >>> bool(ratio_bound(1, 1.0) == 2 * gamma(4))
    True
    """
    return float(value_scale) * 2 * gamma(2 * int(n_terms) + 2, dtype)


def _mgk_term_scale(q, keys, sigma2, log_pi, normalized):
    """A bound on the sum of |terms| of any MGK component term (and so on |score|)."""
    dim = q.shape[-1]
    s2 = np.asarray(sigma2, dtype=np.float64)
    reach = (np.abs(q).max(initial=0.0) + np.abs(keys).max(initial=0.0)) ** 2 * dim
    scale = reach / (2 * float(s2.min()))
    if normalized:
        scale += dim * max(
            abs(math.log(2 * math.pi * float(s2.min()))),
            abs(math.log(2 * math.pi * float(s2.max()))),
        )
    if log_pi is not None:
        finite = np.asarray(log_pi, dtype=np.float64)
        scale += float(np.abs(finite[np.isfinite(finite)]).max(initial=0.0))
    return scale + math.log(keys.shape[-2])


def mgk_vjp_bound(
    q, keys, v, grad_out, *, sigma2=1.0, log_pi=None, normalized=False, dtype="float64"
):
    """First-order bound on the float64 error of :func:`refattn.mgk.attention_vjp`, per element.

    With ``T`` the term scale of the component terms (every term and score is at most ``T``
    in magnitude, computed to ``gamma_{D+2} T``), each score (an lse over R components) errs
    by ``e_s = gamma_{D+2} T + gamma_{R+4} (1 + T)`` (:func:`logit_lse_bound`); a softmax
    weight by the relative ``e_w = 2 e_s + gamma_{S+3} + 4 u T`` (``|s_j - max| <= 2T``,
    :func:`refattn.logspace.softmax`), a component share likewise with R; both doubled for
    the second-order terms as in :func:`mixture_bound`. With ``P <= 1``, ``rho <= 1`` and
    ``M_i = max_j |g_i| . |v_j|`` (so ``|dS_ij| <= P_ij (|dP_ij| + sum_k P_ik |dP_ik|)``,
    summing to at most ``2 M_i`` over j):

    .. math::

        |\\Delta dq_{id}| \\le \\epsilon\\, 2 M_i \\max_{j,r}
            \\frac{|q_{id} - k_{jrd}|}{\\sigma^2_{jr}},\\quad
        |\\Delta dk_{jrd}| \\le \\epsilon \\sum_i 2 M_i
            \\frac{|q_{id} - k_{jrd}|}{\\sigma^2_{jr}},\\quad
        |\\Delta dv_{je}| \\le (2 e_w + \\gamma_{L+1}) \\sum_i |g_{ie}|,

    ``epsilon = 2 e_w + 2 e_rho + gamma_E + gamma_{S+2} + gamma_{S R + L + D + 4} + 3u``. The
    same bound covers every allowed set (fewer keys only drop terms) and mode="hard" (the share
    is exact); it is stated for ``row_eps = 0``. q (L, D) or (..., L, D) etc. as
    :func:`refattn.mgk.attention_vjp`, without broadcasting of the batch dimensions.

    >>> b = mgk_vjp_bound(np.zeros((1, 1)), np.zeros((1, 1, 1)), np.ones((1, 1)),
    ...                   np.ones((1, 1)))
    >>> sorted(b), float(b["dq"][0, 0])
    (['dkeys', 'dq', 'dv'], 0.0)
    """
    q, keys, v, g = (np.asarray(a, dtype=np.float64) for a in (q, keys, v, grad_out))
    length, dim = q.shape[-2:]
    units, comps = keys.shape[-3:-1]
    u = unit_roundoff(dtype)
    term = _mgk_term_scale(q, keys, sigma2, log_pi, normalized)
    e_s = gamma(dim + 2, dtype) * term + gamma(comps + 4, dtype) * (1 + term)
    e_w = 2 * (2 * e_s + gamma(units + 3, dtype) + 4 * u * term)
    e_rho = 2 * (2 * e_s + gamma(comps + 3, dtype) + 4 * u * term)
    eps = (
        2 * e_w
        + 2 * e_rho
        + gamma(v.shape[-1], dtype)
        + gamma(units + 2, dtype)
        + gamma(units * comps + length + dim + 4, dtype)
        + 3 * u
    )
    s2 = np.broadcast_to(np.asarray(sigma2, dtype=np.float64), keys.shape[:-1])
    top = (np.abs(g) @ np.swapaxes(np.abs(v), -1, -2)).max(axis=-1)  # M_i (..., L)
    reach = np.abs(q[..., :, None, None, :] - keys[..., None, :, :, :]) / s2[..., None, :, :, None]
    dq = eps * 2 * top[..., None] * reach.max(axis=(-3, -2))
    dkeys = eps * 2 * np.einsum("...l,...lsrd->...srd", top, reach)
    dv = (2 * e_w + gamma(length + 1, dtype)) * np.broadcast_to(
        np.abs(g).sum(axis=-2)[..., None, :], v.shape[:-2] + (units, v.shape[-1])
    )
    return {"dq": dq, "dkeys": dkeys, "dv": np.array(dv)}


def mlk_vjp_bound(q, keys, v, grad_out, *, pi, allowed=None, dtype="float64"):
    """First-order bound on the float64 error of :func:`refattn.mgk.linear_attention_vjp`
    (``mlk_form="mixture"``), per element.

    The features ``a = phi(q)`` and ``m_j = sum_r pi_jr phi(k_jr)`` are positive with relative
    errors ``gamma_2`` and ``gamma_{R+2}``, the kernels ``kappa_ij = a_i . m_j`` with
    ``e_k = gamma_{D+R+4}``, the denominators ``Dn_i`` with ``e_d = gamma_{S+D+R+4}`` and the
    output (a convex combination of the v_j) to ``2 gamma_{2n+2} V`` absolutely
    (:func:`ratio_bound`, ``V = max |v|``). With ``A_ij = (|g_i| . |v_j| + ||g_i||_1 V) /
    Dn_i`` (so ``|dkappa_ij| <= A_ij``) the errors are, doubled for the second-order terms:

    .. math::

        |\\Delta dq_{id}| \\le \\epsilon\\, \\phi'(q_{id}) \\sum_j A_{ij} m_{jd},\\quad
        |\\Delta dk_{jrd}| \\le \\epsilon\\, \\pi_{jr} \\phi'(k_{jrd}) \\sum_i A_{ij} a_{id},
        \\quad |\\Delta dv_{je}| \\le \\epsilon \\sum_i \\frac{\\kappa_{ij}}{Dn_i} |g_{ie}|,

    ``epsilon = 2 (gamma_{E+1} + e_d + e_k + 2 gamma_{2n+2} + gamma_{L+S} + gamma_{R+2} + 4u)``,
    ``n = D + R + S + 4``; sums over the allowed (i, j) only (``allowed`` (..., L, S), default
    all). The features are evaluated in float64 (a first-order bound).

    >>> b = mlk_vjp_bound(np.zeros((1, 1)), np.zeros((1, 1, 1)), np.ones((1, 1)),
    ...                   np.ones((1, 1)), pi=np.ones((1, 1)))
    >>> sorted(b)
    ['dkeys', 'dq', 'dv']
    """
    q, keys, v, g, pi = (np.asarray(a, dtype=np.float64) for a in (q, keys, v, grad_out, pi))
    length, dim = q.shape[-2:]
    units, comps = keys.shape[-3:-1]
    u = unit_roundoff(dtype)
    n = dim + comps + units + 4
    e_k, e_d = gamma(dim + comps + 4, dtype), gamma(units + dim + comps + 4, dtype)
    eps = 2 * (
        gamma(v.shape[-1] + 1, dtype)
        + e_d
        + e_k
        + 2 * gamma(2 * n + 2, dtype)
        + gamma(length + units, dtype)
        + gamma(comps + 2, dtype)
        + 4 * u
    )

    def feature(x):
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))

    def slope(x):
        return np.where(x > 0, 1.0, np.exp(np.minimum(x, 0.0)))

    a = feature(q)
    m = np.einsum("...sr,...srd->...sd", pi, feature(keys))
    keep = np.ones((length, units), dtype=bool) if allowed is None else np.asarray(allowed)
    kappa = np.where(keep, a @ np.swapaxes(m, -1, -2), 0.0)
    den = kappa.sum(axis=-1, keepdims=True)
    den = np.where(den > 0, den, np.inf)  # rows with no allowed key: every gradient is 0
    big_v = np.abs(v).max(initial=0.0)
    reach = (
        np.abs(g) @ np.swapaxes(np.abs(v), -1, -2) + np.abs(g).sum(axis=-1, keepdims=True) * big_v
    ) / den
    reach = np.where(keep, reach, 0.0)  # A_ij
    dq = eps * slope(q) * (reach @ m)
    dkeys = eps * pi[..., None] * slope(keys) * (np.swapaxes(reach, -1, -2) @ a)[..., None, :]
    dv = eps * np.swapaxes(kappa / den, -1, -2) @ np.abs(g)
    return {"dq": dq, "dkeys": dkeys, "dv": dv}
