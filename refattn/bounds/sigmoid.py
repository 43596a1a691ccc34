"""A-priori error bounds of sigmoid attention (``normalizer="sigmoid"``), per element.

One bookkeeping serves the float64 path (``dtype="float64"``) and the Numba CPU and CUDA
kernels (their compute dtype: float64, or float32 for narrower inputs), with ``u`` and
Higham's ``gamma_n`` of that dtype (:mod:`.unit`). The tiled CPU kernels
(:mod:`refattn.kernels._cpu_sigmoid_tiles`) perform the scalar kernels' operations in the same
order (one fma chain per score over D, one per output over the keys in increasing order), so
the same bound holds for them term by term.

Scores. As for softmax (:mod:`.attention`):
``delta_ij <= gamma_{D+2} |s| |q_i|.|k_j| + gamma_4 (|t~_ij| + |b_ij| + |a_ij| + c)``.

Weights. ``sigma(t) = 1 / (1 + e^{-t})`` (t >= 0) or ``e^t / (1 + e^t)``: the exponential
(within 2u: the kernels' polynomial and NumPy's both stay inside one ulp), the sum and the
division give ``gamma_8`` with margin; a score error ``d`` moves ``sigma`` by a factor in
``[e^{-|d|}, e^{|d|}]`` (``|sigma'/sigma| = sigma(-t) <= 1``), so the relative error of a weight
is at most

.. math:: \\rho_{ij} = (e^{\\delta_{ij}} - 1)(1 + \\gamma_8) + \\gamma_8

and the same for ``sigma(-t)``, hence ``2 rho + rho^2 + u`` for ``sigma' = sigma(t) sigma(-t)``.

Output. There is no normaliser: a sum of S products and the dropout scale,

.. math:: |\\widehat{\\mathrm{out}}_{ie} - \\mathrm{out}_{ie}| \\le
    \\sum_j \\kappa'_{ij} w_{ij} |v_{je}| \\big((1 + \\rho_{ij})(1 + \\gamma_{S+2}) - 1\\big)
    + \\eta\\,(4 \\kappa \\sum_j |v_{je}| + S + 2)

(eta the smallest subnormal of the dtype: gradual underflow, as in :mod:`.attention`). The
vjp carries the same terms through ``dP = dO . v`` (``gamma_E``), ``dS = sigma' dP``, the
softcap derivative ``1 - tanh^2`` (absolute error ``2 e_th + e_th^2 + gamma_2`` with
``e_th = delta^raw / c + gamma_4``) and the sums of dq (S terms), dk and dv (G L terms).
Bounds hold for finite inputs; they materialise (L, S) planes (test-sized shapes).
"""

from __future__ import annotations

import numpy as np

from ..spec import canonicalize
from .unit import gamma, unit_roundoff

__all__ = ["sigmoid_forward_bound", "sigmoid_vjp_bound"]

_SKIP = ("precision", "out_dtype", "return_lse", "return_weights", "backend")


def _eta(dtype) -> float:
    return float(
        np.finfo(np.dtype(dtype) if dtype != "bfloat16" else np.float32).smallest_subnormal
    )


def _plane(spec, b, h, dtype):
    """(w, rho, derivative, allowed, |raw| error, raw scores) of one plane, float64."""
    g = spec.kv_head[h]
    q = np.asarray(spec.q[b, h], np.float64)
    k = np.asarray(spec.k[b, g], np.float64)
    allowed = spec.allowed(b, h)
    raw = spec.scale_float * (q @ k.T)
    scores = raw if spec.softcap is None else spec.softcap * np.tanh(raw / spec.softcap)
    extra = np.zeros_like(scores)
    if spec.bias is not None:
        bias = np.where(allowed, spec.bias[b, h], 0.0)
        scores, extra = scores + bias, extra + np.abs(bias)
    alibi = spec.alibi(h, b)
    if alibi is not None:
        scores, extra = scores + alibi, extra + np.abs(alibi)
    cap = 0.0 if spec.softcap is None else spec.softcap
    raw_err = gamma(q.shape[-1] + 2, dtype) * abs(spec.scale_float) * (np.abs(q) @ np.abs(k).T)
    delta = raw_err + gamma(4, dtype) * (np.abs(scores) + extra + cap)
    delta = np.where(allowed, delta, 0.0)
    safe = np.where(allowed, scores, 0.0)
    e = np.exp(-np.abs(safe))
    w = np.where(allowed, np.where(safe >= 0, 1 / (1 + e), e / (1 + e)), 0.0)
    w_neg = np.where(allowed, np.where(safe >= 0, e / (1 + e), 1 / (1 + e)), 0.0)
    g8 = gamma(8, dtype)
    rho = np.where(allowed, np.expm1(delta) * (1 + g8) + g8, 0.0)
    return w, rho, w * w_neg, allowed, raw_err, raw


def _kept(spec, b, h, allowed):
    return allowed if spec.dropout_mask is None else allowed & spec.dropout_mask[b, h]


def sigmoid_forward_bound(q, k, v, *, dtype="float64", **options) -> np.ndarray:
    """Per-element bound (..., H, L, E) on ``|out - exact|`` of a sigmoid call computed in
    ``dtype`` (float64 path: "float64"; kernels: their compute dtype).

    Examples
    --------
    >>> import numpy as np
    >>> q, k, v = np.ones((1, 2)), np.ones((3, 2)), np.ones((3, 1))
    >>> bool(sigmoid_forward_bound(q, k, v) < 1e-14)
    True
    """
    options = {key: val for key, val in options.items() if key not in _SKIP}
    options["normalizer"] = "sigmoid"
    spec = canonicalize(q, k, v, **options)
    batch, heads, _, length, keys, _, vdim = spec.dims
    bound = np.zeros((batch, heads, length, vdim))
    keep = 1.0 / (1.0 - spec.dropout_p)
    grow = gamma(keys + 2, dtype)
    eta = _eta(dtype)
    for b in range(batch):
        for h in range(heads):
            w, rho, _, allowed, _, _ = _plane(spec, b, h, dtype)
            kept = _kept(spec, b, h, allowed)
            v_abs = np.abs(np.asarray(spec.v[b, spec.kv_head[h]], np.float64))
            wk = np.where(kept, w, 0.0) * keep
            bound[b, h] = (wk * ((1 + rho) * (1 + grow) - 1)) @ v_abs
            bound[b, h] += eta * (4 * keep * (kept.astype(float) @ v_abs) + keys + 2)
    return spec.unflatten(bound)


def sigmoid_vjp_bound(q, k, v, grad_out, *, dtype="float64", **options):
    """Per-element bounds (dq, dk, dv, dS plane (..., H, L, S)) of a sigmoid vjp computed in
    ``dtype``; dbias of a broadcast bias sums the dS plane (add ``gamma_n`` of that sum).

    Examples
    --------
    >>> import numpy as np
    >>> q, k, v = np.ones((1, 2)), np.ones((3, 2)), np.ones((3, 1))
    >>> dq, dk, dv, ds = sigmoid_vjp_bound(q, k, v, np.ones((1, 1)))
    >>> bool(dq.max() < 1e-14), ds.shape
    (True, (1, 3))
    """
    options = {key: val for key, val in options.items() if key not in _SKIP}
    options["normalizer"] = "sigmoid"
    spec = canonicalize(q, k, v, **options)
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    do_all = np.asarray(grad_out, np.float64).reshape(batch, heads, length, vdim)
    dq = np.zeros((batch, heads, length, dim))
    dk = np.zeros((batch, kv_heads, keys, dim))
    dv = np.zeros((batch, kv_heads, keys, vdim))
    ds_b = np.zeros((batch, heads, length, keys))
    keep = 1.0 / (1.0 - spec.dropout_p)
    u = unit_roundoff(dtype)
    group = heads // kv_heads
    g_q, g_kv = gamma(keys + 3, dtype), gamma(length * group + 3, dtype)
    eta = _eta(dtype)
    for b in range(batch):
        for h in range(heads):
            g = spec.kv_head[h]
            w, rho, deriv, allowed, raw_err, raw = _plane(spec, b, h, dtype)
            kept = _kept(spec, b, h, allowed)
            q_abs = np.abs(np.asarray(spec.q[b, h], np.float64))
            k_abs = np.abs(np.asarray(spec.k[b, g], np.float64))
            v = np.asarray(spec.v[b, g], np.float64)
            do = do_all[b, h]
            dp = np.where(kept, do @ v.T, 0.0) * keep
            dp_err = np.where(kept, gamma(vdim + 1, dtype) * (np.abs(do) @ np.abs(v).T), 0.0) * keep
            rho_d = 2 * rho + rho * rho + u
            ds = deriv * dp
            ds_err = deriv * (
                (np.abs(dp) + dp_err) * (1 + rho_d) * (1 + gamma(2, dtype)) - np.abs(dp)
            )
            ds_err = np.where(kept, ds_err, 0.0) + eta * 4
            ds_b[b, h] = np.where(allowed, ds_err, 0.0)
            dt, dt_err = np.abs(ds), ds_err
            if spec.softcap is not None:
                th = np.tanh(raw / spec.softcap)
                e_th = raw_err / spec.softcap + gamma(4, dtype)
                c_err = 2 * e_th + e_th * e_th + gamma(2, dtype)
                dt_err = ds_err * (1 - th * th + c_err) + np.abs(ds) * c_err
                dt = np.abs(ds) * (1 - th * th)
            dt_err = np.where(allowed, dt_err, 0.0)
            scale = abs(spec.scale_float)
            dq[b, h] = scale * ((dt + dt_err) * (1 + g_q) - dt) @ k_abs + eta * (keys + 2)
            dk[b, g] += scale * ((dt + dt_err) * (1 + g_kv) - dt).T @ q_abs
            wk = np.where(kept, w, 0.0) * keep
            dv[b, g] += (wk * ((1 + rho) * (1 + g_kv) - 1)).T @ np.abs(do)
    dk += eta * (length * group + 2)
    dv += eta * (4 * keep * length * group + 2)
    return spec.unflatten(dq), spec.unflatten(dk), spec.unflatten(dv), spec.unflatten(ds_b)
