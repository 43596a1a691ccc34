"""A-priori error bounds of the streaming (online-softmax) kernels of :mod:`refattn.kernels`.

The Numba CPU and CUDA kernels compute in a compute dtype (float64, or float32 for the narrower
inputs) with key blocks and an online softmax (Milakov & Gimelshein 2018, Algorithm 3); these
bounds count their roundings with Higham's gamma_n in that dtype (:func:`refattn.bounds.gamma`).
They materialise (L, S) planes: meant for the small shapes of the tests.

Each bound is a relative part (Higham's gamma_n, valid while no intermediate leaves the normal
range) plus an absolute gradual-underflow part in multiples of eta, the smallest subnormal of
the compute dtype (Higham's model ``fl(x op y) = (x op y)(1 + d) + e``, ``|e| <= eta/2``): a
weight that underflows is off by at most 4 eta, every further product or sum that lands in
the subnormal range by eta/2. Without it a result that rounds to zero (or to a subnormal)
would lie outside a purely relative bound.
"""

from __future__ import annotations

import numpy as np

from .attention import grad_scales
from .unit import gamma

__all__ = ["online_forward_bound", "online_backward_bound"]


def _planes(spec, weights):
    """Score magnitudes A_i (B, H, L), allowed planes and post-dropout |weights|."""
    batch, heads, _, length, keys, _, _ = spec.dims
    mags = np.zeros((batch, heads, length))
    dropped = np.abs(np.nan_to_num(weights, nan=0.0))
    for b in range(batch):
        for h in range(heads):
            g = spec.kv_head[h]
            q = np.abs(np.nan_to_num(np.asarray(spec.q[b, h], np.float64), posinf=0, neginf=0))
            k = np.abs(np.nan_to_num(np.asarray(spec.k[b, g], np.float64), posinf=0, neginf=0))
            mag = abs(spec.scale_float) * (q @ k.T)
            if spec.bias is not None:
                bias = np.asarray(spec.bias[b, h], np.float64)
                mag = mag + np.where(np.isfinite(bias), np.abs(bias), 0.0)
            alibi = spec.alibi(h, b)
            if alibi is not None:
                mag = mag + np.abs(alibi)
            allowed = spec.allowed(b, h)
            mags[b, h] = np.where(allowed, mag, 0.0).max(axis=1, initial=0.0)
            if spec.dropout_mask is not None:
                dropped[b, h] = dropped[b, h] * spec.dropout_mask[b, h] / (1 - spec.dropout_p)
    return mags, dropped


def _eta(dtype) -> float:
    """Smallest subnormal of the compute dtype (the absolute error floor of one rounding)."""
    return float(np.finfo(dtype).smallest_subnormal)


def _finite_abs(x):
    return np.abs(np.nan_to_num(np.asarray(x, np.float64), nan=0.0, posinf=0.0, neginf=0.0))


def _kept(spec, b, h):
    """Allowed positions (L, S) of (b, h) that dropout keeps."""
    kept = spec.allowed(b, h)
    if spec.dropout_mask is not None:
        kept = kept & spec.dropout_mask[b, h]
    return kept


def _forward_underflow(spec, dtype, rescalings):
    """eta (4 k sum_{kept j} |v_je| + S + n_b + 8) (B, H, L, E): underflowing weights (4 eta
    each, times the dropout rescaling k), the S products and sums, the n_b rescalings and the
    final scaling (eta/2 each); the normaliser is >= 1, so nothing is amplified."""
    batch, heads, _, length, keys, _, vdim = spec.dims
    keep = 1.0 / (1.0 - spec.dropout_p)
    out = np.zeros((batch, heads, length, vdim))
    for b in range(batch):
        for h in range(heads):
            v = _finite_abs(spec.v[b, spec.kv_head[h]])
            out[b, h] = 4 * keep * (_kept(spec, b, h) @ v) + keys + rescalings + 8
    return _eta(dtype) * out


def online_forward_bound(spec, weights, dtype, rescalings):
    """Bound on |out - exact| (B, H, L, E) and |lse - exact| (B, H, L) of an online-softmax
    forward kernel computing in ``dtype`` with ``rescalings`` (n_b) running-max rescalings:

    .. math::

        |\\Delta o_{ie}| \\le \\bigl(2\\gamma_{D+4}(A_i + 1) + \\gamma_{S + n_b + 8}\\bigr)
            \\sum_j \\tilde w_{ij} |v_{je}|, \\qquad
        |\\Delta \\mathrm{lse}_i| \\le \\gamma_{D+4}(2A_i + 1) + \\gamma_{S + n_b + 8}
            + \\gamma_2 |\\mathrm{lse}_i|

    with A_i = max over allowed j of ``|scale| |q_i|.|k_j| + |bias_ij| + |alibi_ij|`` (each
    score has absolute error <= gamma_{D+4} A_i: D fused multiply-adds, the scale, softcap,
    bias and ALiBi roundings; the softmax weights then have relative error <= 2 gamma_{D+4}
    (A_i + 1) through exp), n_b the number of key blocks (one rescaling each), the 8 covering
    exp (about one ulp), the normalisation and dropout scaling; ``w~`` the post-dropout
    weights. ``out`` also carries the absolute underflow term (module notes)
    ``eta (4 k sum_{kept j} |v_je| + S + n_b + 8)`` with ``k = 1/(1-p)``.

    ``spec`` is an :class:`~refattn.spec.AttentionSpec`, ``weights`` the float64 pre-dropout
    weights (B, H, L, S) of the NumPy path.

    >>> import refattn.spec as S
    >>> spec = S.canonicalize(np.ones((1, 1)), np.ones((2, 1)), np.ones((2, 1)))
    >>> out, lse = online_forward_bound(spec, np.full((1, 1, 1, 2), 0.5), np.float64, 1)
    >>> bool(0 < out.max() < 1e-14), out.shape
    (True, (1, 1, 1, 1))
    """
    mags, dropped = _planes(spec, weights)
    _, _, _, _, keys, dim, _ = spec.dims
    g_score, g_sum = gamma(dim + 4, dtype), gamma(keys + rescalings + 8, dtype)
    v = np.abs(np.nan_to_num(np.asarray(spec.v, np.float64), nan=0.0, posinf=0, neginf=0))
    nat = np.matmul(dropped, v[:, spec.kv_head])
    out = (2 * g_score * (mags + 1) + g_sum)[..., None] * nat
    out = out + _forward_underflow(spec, dtype, rescalings)
    lse_mag = np.abs(np.nan_to_num(np.log(np.maximum(mags, 1.0)), nan=0.0))
    lse = g_score * (2 * mags + 1) + g_sum + gamma(2, dtype) * (lse_mag + mags + 1)
    return out, lse


def online_backward_bound(spec, weights, grad_out, grad_lse, dtype, chunks):
    """Bound on |dq|, |dk|, |dv|, |dbias| errors of a backward kernel computing in ``dtype``
    whose dk, dv are summed over ``chunks`` query chunks (shapes of the grads).

    Each gradient is a sum of products of the weights (relative error <= 2 gamma_{D+4}(A+1)),
    dP = dO . v (gamma_E), delta = dO . out (gamma_E plus the forward error), q or k (exact)
    and the scale; summed over S keys (dq), L*G query rows and chunks (dk, dv). Hence

    .. math::

        |\\Delta g| \\le \\bigl(4\\gamma_{D+4}(A+1) + 2\\gamma_E + \\gamma_D + 2\\gamma_S
            + 2\\gamma_{L G + c} + \\gamma_{16}\\bigr)\\, \\hat g

    with A = max_i A_i and ``g_hat`` the natural scale of the gradient (the same sums over
    absolute values, :func:`refattn.bounds.grad_scales`), plus the absolute underflow terms
    of :func:`_backward_underflow` (module notes).

    >>> import refattn.spec as S
    >>> spec = S.canonicalize(np.ones((1, 1)), np.ones((2, 1)), np.ones((2, 1)))
    >>> dq, dk, dv, dbias = online_backward_bound(
    ...     spec, np.full((1, 1, 1, 2), 0.5), np.ones((1, 1, 1, 1)), None, np.float64, 1)
    >>> bool(0 < dv.max() < 1e-14), dbias is None
    (True, True)
    """
    mags, dropped = _planes(spec, weights)
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    group = heads // kv_heads
    big = float(mags.max(initial=0.0))
    theta = (
        4 * gamma(dim + 4, dtype) * (big + 1)
        + 2 * gamma(max(vdim, 1), dtype)
        + gamma(dim, dtype)
        + 2 * gamma(keys + 8, dtype)
        + 2 * gamma(length * group + chunks + 8, dtype)
        + gamma(16, dtype)
    )
    pre = np.abs(np.nan_to_num(weights, nan=0.0))
    if spec.bias is not None:
        bias = np.asarray(spec.bias, np.float64)
    else:
        bias = None
    scales = grad_scales(
        np.asarray(spec.q, np.float64),
        np.asarray(spec.k, np.float64),
        np.asarray(spec.v, np.float64),
        grad_out,
        pre,
        dropped,
        grad_lse=grad_lse,
        scale=spec.scale_float,
        bias=bias,
        gqa=spec.gqa,
    )
    bounds = {name: theta * value for name, value in scales.items()}
    under = _backward_underflow(spec, weights, grad_out, grad_lse, dtype, chunks)
    bounds = {name: value + under[name] for name, value in bounds.items()}
    return bounds["dq"], bounds["dk"], bounds["dv"], bounds.get("dbias")


def _backward_underflow(spec, weights, grad_out, grad_lse, dtype, chunks):
    """Absolute underflow terms of the gradients (module notes), shaped like them:

    ``e_ij = eta (4 (k |dP_ij| + Delta_i + |g_i|) + p_ij (2E + 4) k + 4)`` on allowed
    positions (an underflowing weight times the factor it multiplies; dP and delta's E
    products each; the products by the factor, the scale and the softcap derivative),
    ``dq_i: s sum_j e_ij |k_j| + eta (S + 8)``, ``dk_j: s sum_i e_ij |q_i| + eta (L + c + 8)``
    per query head, ``dv_j: 4 eta k sum_{kept i} |dO_i| + eta (L + c + 8)`` per query head
    and ``dbias = e``; |dP| = |dO| |v|^T and Delta_i = sum_j p_ij k |dP_ij|.
    """
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    eta, keep, scale = _eta(dtype), 1.0 / (1.0 - spec.dropout_p), abs(spec.scale_float)
    grad_out = np.reshape(grad_out, (batch, heads, length, vdim))
    glse = (
        np.zeros((batch, heads, length))
        if grad_lse is None
        else _finite_abs(np.reshape(grad_lse, (batch, heads, length)))
    )
    under = {
        "dq": np.zeros((batch, heads, length, dim)),
        "dk": np.zeros((batch, kv_heads, keys, dim)),
        "dv": np.zeros((batch, kv_heads, keys, vdim)),
    }
    if spec.bias is not None:
        under["dbias"] = np.zeros((batch, heads, length, keys))
    for b in range(batch):
        for h in range(heads):
            g = spec.kv_head[h]
            allowed, kept = spec.allowed(b, h), _kept(spec, b, h)
            d_out = _finite_abs(grad_out[b, h])
            d_p = keep * d_out @ _finite_abs(spec.v[b, g]).T
            w = _finite_abs(weights[b, h])
            delta = (w * d_p).sum(axis=1, keepdims=True) + glse[b, h][:, None]
            ds = np.where(allowed, eta * (4 * (d_p + delta) + w * (2 * vdim + 4) * keep + 4), 0.0)
            under["dq"][b, h] = scale * ds @ _finite_abs(spec.k[b, g]) + eta * (keys + 8)
            under["dk"][b, g] += scale * ds.T @ _finite_abs(spec.q[b, h]) + eta * (
                length + chunks + 8
            )
            under["dv"][b, g] += 4 * eta * keep * kept.T @ d_out + eta * (length + chunks + 8)
            if "dbias" in under:
                under["dbias"][b, h] = ds
    return under
