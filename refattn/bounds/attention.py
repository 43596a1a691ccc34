"""A-priori error bounds of :func:`refattn.attention`'s float64 path (running-error style, evaluated
per element), and the natural scales of its gradients.

With ``u = 2**-53`` and Higham's ``gamma_n = n u / (1 - n u)`` (Higham, *Accuracy and Stability
of Numerical Algorithms*, 2nd ed., Lemma 3.1 and eq. (3.5) for inner products):

Scores. ``fl(q . k)`` errs by at most ``gamma_D |q|.|k|``; the scale, softcap (tanh is
1-Lipschitz; its evaluation and the two scalings add a few u of ``c``), bias and ALiBi
additions add a few roundings of the running value:

.. math::

    \\delta_{ij} \\le \\gamma_{D+2} |s| (|q_i| \\cdot |k_j|)
        + \\gamma_4 (|\\tilde t_{ij}| + |b_{ij}| + |a_{ij}| + c).

lse. The max-shifted log1p form is backward stable (Blanchard, Higham & Higham 2021,
Theorem 4.2): perturbing every score by at most ``delta_i = max_j delta_ij`` moves lse by at most
``delta_i``, and the evaluation adds ``gamma_{S+3}`` (sum of S exponentials, log1p) plus one
rounding of the result:

.. math:: |\\widehat{\\mathrm{lse}}_i - \\mathrm{lse}_i| \\le \\Delta_i
    = \\delta_i + \\gamma_{S+3} + u |\\mathrm{lse}_i| .

Weights. ``w_ij = e^{t_ij - m_i} / (1 + s_i)`` (m_i the row max, s_i the rest of the sum)
has relative error at most

.. math:: \\rho_{ij} = \\epsilon_{ij} + \\sum_k w_{ik} \\epsilon_{ik} + \\gamma_{S+2}, \\qquad
    \\epsilon_{ij} = \\delta_{ij} + \\gamma_2 (1 + |t_{ij} - m_i|)

(numerator, then the normaliser as a weighted mean of its terms' errors; to first order, the
bounds below multiply by ``1 + max rho`` to cover the second-order term).

Outputs. The weighted sum of S terms (and the dropout scale) adds ``gamma_{S+2}``:

.. math:: |\\widehat{\\mathrm{out}}_{ie} - \\mathrm{out}_{ie}| \\le
    \\sum_j \\kappa'_{ij} w_{ij} |v_{je}| (\\rho_{ij} + \\gamma_{S+2}).

The same bookkeeping is carried through the vjp (see :func:`float64_vjp_bound`).

Underflow. The relative model above fails for subnormal results; with Higham's
``fl(x op y) = (x op y)(1 + d) + e``, ``|e| <= eta / 2`` (eta = 2**-1074, Higham Section 2.1),
each output also gets ``eta (4 (1/(1-p)) sum_j kappa_ij |v_je| + S + 2)`` (a weight that
underflows is off by at most 4 eta; each product and the sum by eta / 2 more), so a result of
5e-324 against an exact 0 or the reverse stays inside the bound.

Scores beyond the float64 range (finite inputs): the first-order terms are not finite; the
float64 path still returns a convex combination, so those rows get
``(2 + gamma_{S+2}) (1/(1-p)) max_j kappa_ij |v_je|`` (plus the underflow term) and an lse
bound of +inf.
"""

from __future__ import annotations

import math

import numpy as np

from ..broadcast import expand_kv, fold_kv, reduce_to
from ..spec import canonicalize
from .unit import ETA, UNIT_ROUNDOFF, gamma

__all__ = ["float64_forward_bound", "float64_vjp_bound", "grad_scales"]


def _score_terms(spec, b, h):
    """(scores, allowed, delta) for one plane, in float64 (exact-path-free)."""
    g = spec.kv_head[h]
    q = np.asarray(spec.q[b, h], np.float64)
    k = np.asarray(spec.k[b, g], np.float64)
    dim = q.shape[-1]
    allowed = spec.allowed(b, h)
    raw = spec.scale_float * (q @ k.T)
    scores = raw if spec.softcap is None else spec.softcap * np.tanh(raw / spec.softcap)
    extra = np.zeros_like(scores)
    if spec.bias is not None:
        bias = np.where(allowed, spec.bias[b, h], 0.0)
        scores = scores + bias
        extra += np.abs(bias)
    alibi = spec.alibi(h, b)
    if alibi is not None:
        scores = scores + alibi
        extra += np.abs(alibi)
    cap = 0.0 if spec.softcap is None else spec.softcap
    delta = gamma(dim + 2) * abs(spec.scale_float) * (np.abs(q) @ np.abs(k).T) + gamma(4) * (
        np.abs(scores) + extra + cap
    )
    delta = np.where(allowed, delta, 0.0)
    if spec.sinks is not None:  # the sink: an exact, always-allowed logit with no value
        column = np.full((scores.shape[0], 1), spec.sinks[h])
        scores, raw = np.hstack([scores, column]), np.hstack([raw, np.zeros_like(column)])
        allowed = np.hstack([allowed, np.ones_like(column, dtype=bool)])
        delta = np.hstack([delta, np.zeros_like(column)])
    return scores, allowed, delta, raw


def _keys_only(keys, *arrays):
    """The key columns of per-plane arrays (a sink's column removed after normalising)."""
    return tuple(a[:, :keys] for a in arrays)


def _weights(scores, allowed, delta):
    """(weights, rho, lse error) of one plane; see the module notes."""
    keys = scores.shape[-1]
    masked = np.where(allowed, scores, -np.inf)
    top = masked.max(axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    terms = np.where(allowed, np.exp(np.where(allowed, scores, 0.0) - top), 0.0)
    total = terms.sum(axis=1, keepdims=True)
    w = np.where(total > 0, terms / np.where(total > 0, total, 1.0), 0.0)
    with np.errstate(divide="ignore"):  # empty rows: lse = -inf, no weights
        lse = top[:, 0] + np.log(total[:, 0])
    finite = np.isfinite(lse)
    lse_err = np.where(
        finite,
        delta.max(axis=1) + gamma(keys + 3) + UNIT_ROUNDOFF * np.abs(np.where(finite, lse, 0.0)),
        0.0,
    )
    # w = e^{t - m} / (1 + s): the numerator errs by delta + gamma_2 (1 + |t - m|), the
    # denominator by the p-weighted mean of the same plus gamma_{S+2} (sum and division)
    own = np.where(allowed, delta + gamma(2) * (1 + np.abs(scores - top)), 0.0)
    rho = own + (w * own).sum(axis=1, keepdims=True) + gamma(keys + 2)
    rho = np.where(allowed, rho, 0.0)
    second_order = 1 + rho.max(initial=0.0)
    return w, rho * second_order, lse_err * second_order


def _underflow_term(kept, v_abs, keep):
    """Absolute errors of gradual underflow (Higham's ``fl(x op y) = (x op y)(1 + d) + e``,
    ``|e| <= eta/2``, eta = 2**-1074): a weight that underflows (exp, division, dropout scale)
    is off by at most 4 eta, and each of the S products ``w v`` and the sum by eta/2 more."""
    with np.errstate(over="ignore"):
        v_sum = np.where(kept[:, :, None], v_abs[None], 0.0).sum(axis=1)
    return ETA * (4 * keep * v_sum + kept.shape[1] + 2)


def _beyond_range_rows(spec, b, h, kept, v_abs, keep, out_b, lse_b):
    """Rows with finite inputs whose scores exceed the float64 range: the first-order bound
    is not finite there; the weights are still a convex combination (the path rescales), so
    ``|out - exact| <= (2 + gamma_{S+2}) max_j kappa'_ij |v_je|``; lse has no finite bound."""
    rows = ~np.isfinite(out_b[b, h]).all(axis=1) | ~np.isfinite(lse_b[b, h])
    if not rows.any():
        return
    q = np.asarray(spec.q[b, h], np.float64)
    k = np.asarray(spec.k[b, spec.kv_head[h]], np.float64)
    finite_keys = np.isfinite(k).all(axis=1) & np.isfinite(v_abs).all(axis=1)
    rows &= np.isfinite(q).all(axis=1) & (finite_keys[None, :] | ~kept).all(axis=1)
    if not rows.any():
        return
    top = np.where(kept[rows][:, :, None], v_abs[None], 0.0).max(axis=1, initial=0.0)
    out_b[b, h][rows] = (2 + gamma(kept.shape[1] + 2)) * keep * top + _underflow_term(
        kept[rows], v_abs, keep
    )
    lse_b[b, h][rows] = np.inf


def float64_forward_bound(q, k, v, **options):
    """Per-element bounds (out_bound (..., H, L, E), lse_bound (..., H, L)) of the float64 path.

    Parameters
    ----------
    q, k, v, **options
        As :func:`refattn.attention` (precision / return flags are ignored).

    Returns
    -------
    out_bound, lse_bound : ndarrays
        ``|float64 - exact| <= bound`` elementwise for finite inputs (see the module notes).
    """
    options = {
        k_: v_
        for k_, v_ in options.items()
        if k_ not in ("precision", "out_dtype", "return_lse", "return_weights", "backend")
    }
    spec = canonicalize(q, k, v, **options)
    batch, heads, _, length, keys, _, vdim = spec.dims
    out_b = np.zeros((batch, heads, length, vdim))
    lse_b = np.zeros((batch, heads, length))
    keep = 1.0 / (1.0 - spec.dropout_p)
    for b in range(batch):
        for h in range(heads):
            with np.errstate(invalid="ignore", over="ignore"):  # scores beyond the range
                scores, allowed, delta, _ = _score_terms(spec, b, h)
                w, rho, lse_err = _weights(scores, allowed, delta)
                w, rho, allowed = _keys_only(keys, w, rho, allowed)
            kept = allowed if spec.dropout_mask is None else allowed & spec.dropout_mask[b, h]
            wk = np.where(kept, w, 0.0) * keep
            v_abs = np.abs(np.asarray(spec.v[b, spec.kv_head[h]], np.float64))
            with np.errstate(invalid="ignore", over="ignore"):
                out_b[b, h] = (wk * (rho + gamma(keys + 2))) @ v_abs
            out_b[b, h] += _underflow_term(kept, v_abs, keep)
            lse_b[b, h] = lse_err
            _beyond_range_rows(spec, b, h, kept, v_abs, keep, out_b, lse_b)
    return spec.unflatten(out_b), spec.unflatten(lse_b)


def float64_vjp_bound(q, k, v, grad_out, *, grad_lse=None, **options):
    """Per-element bounds (dq, dk, dv, dbias-plane) of :func:`refattn.attention_vjp`'s float64
    path, from the same bookkeeping as :func:`float64_forward_bound`:

    ``|dP err| <= gamma_{E} |dO|.|v|``, ``|Delta err| <= sum_j w (rho + gamma_{S+E+2})|dO||v|``,
    ``|dS err| <= w rho (|dP| + |Delta| + |g|) + w (|dP err| + |Delta err| + gamma_3 (|dP| +
    |Delta| + |g|))``, softcap factor ``|1 - tanh^2| err <= 2 delta_raw / c + gamma_4``, and the
    final products ``s dT K`` / ``s dT^T Q`` / ``P'^T dO`` add ``gamma_{S+2}`` / ``gamma_{L+2}``
    (``gamma_{G L + 2}`` summed over a kv group). dbias is returned per (..., H, L, S) plane.

    With ``sinks`` a fifth bound (H,) is returned, of ``dsinks = sum_{b,i} w_sink (g_i -
    Delta_i)``: ``w_sink = exp(sigma - lse)`` errs relatively by ``r = err(lse) + gamma_2
    (1 + |sigma - lse|)`` (the lse bound, the subtraction and exp), each term by
    ``w_sink (r |g - Delta| + |Delta err| + gamma_2 |g - Delta|)`` (the difference and the
    product) and the sums over rows and batch by ``gamma_{L+B}`` of the terms' magnitudes
    ``w_sink (|g| + |Delta|)``.

    With ``qv`` the bounds are those of ``q' = [q, qv]``, ``k' = [k, v]`` split back: dq, dk
    (D features), dv adds the last E features of dk' (``s dT^T qv``) and the rounding of that sum,
    and the bound of dqv (``dq'[..., D:]``) comes last.
    """
    options = {
        k_: v_ for k_, v_ in options.items() if k_ not in ("precision", "out_dtype", "backend")
    }
    spec = canonicalize(q, k, v, **options)
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    do_all = np.asarray(grad_out, np.float64).reshape(batch, heads, length, vdim)
    g_all = (
        None if grad_lse is None else np.asarray(grad_lse, np.float64).reshape(batch, heads, length)
    )
    group = heads // kv_heads
    bounds = [
        np.zeros((batch, heads, length, dim)),
        np.zeros((batch, kv_heads, keys, dim)),
        np.zeros((batch, kv_heads, keys, vdim)),
        np.zeros((batch, heads, length, keys)),
    ]
    keep = 1.0 / (1.0 - spec.dropout_p)
    sink_err, sink_abs = np.zeros(heads), np.zeros(heads)
    magnitudes = [np.zeros_like(bounds[2]), np.zeros_like(bounds[1])]  # |P'|^T|dO|, s|dT|^T|q|
    for b in range(batch):
        for h in range(heads):
            g = spec.kv_head[h]
            scores, allowed, delta, raw = _score_terms(spec, b, h)
            w, rho, lse_err = _weights(scores, allowed, delta)
            w_sink = None if spec.sinks is None else w[:, keys]
            w, rho, allowed, scores, delta, raw = _keys_only(
                keys, w, rho, allowed, scores, delta, raw
            )
            kept = allowed if spec.dropout_mask is None else allowed & spec.dropout_mask[b, h]
            q_ = np.abs(np.asarray(spec.q[b, h], np.float64))
            k_ = np.abs(np.asarray(spec.k[b, g], np.float64))
            v_ = np.abs(np.asarray(spec.v[b, g], np.float64))
            do = np.abs(do_all[b, h])
            wk = np.where(kept, w, 0.0) * keep
            bounds[2][b, g] += (wk * (rho + gamma(group * length + 2))).T @ do
            dp_abs = np.where(kept, do @ v_.T, 0.0) * keep
            dp_err = gamma(vdim + 2) * dp_abs
            delta_abs = (w * dp_abs).sum(axis=1, keepdims=True)
            delta_err = (w * (rho + gamma(keys + vdim + 2)) * dp_abs).sum(axis=1, keepdims=True)
            g_abs = 0.0 if g_all is None else np.abs(g_all[b, h])[:, None]
            inner = dp_abs + delta_abs + g_abs
            ds_abs = w * inner
            ds_err = np.where(
                allowed, w * rho * inner + w * (dp_err + delta_err + gamma(3) * inner), 0.0
            )
            # gradual underflow (absolute, eta = 2**-1074 per rounding; see _underflow_term):
            # products in dP and Delta, the weights themselves (4 eta each), the final sums
            bounds[2][b, g] += ETA * (4 * keep * (kept.T.astype(float) @ do) + length + 2)
            ds_eta = np.where(
                allowed,
                w * (2 * (vdim + 2) * keep + keys + 2) * ETA + 4 * ETA * inner + 3 * ETA,
                0.0,
            )
            ds_err = ds_err + ds_eta
            bounds[3][b, h] = ds_err
            if w_sink is not None:
                size = (delta_abs + g_abs)[:, 0]  # |g| + |Delta|
                with np.errstate(divide="ignore"):
                    gap = np.where(w_sink > 0, -np.log(np.where(w_sink > 0, w_sink, 1.0)), 0.0)
                rel = lse_err + gamma(2) * (1 + gap)
                term = w_sink * (rel * size + delta_err[:, 0] + gamma(2) * size) * (1 + rel)
                sink_err[h] += term.sum() + ETA * (4 * size.sum() + 3 * length)
                sink_abs[h] += (w_sink * size).sum() * (1 + rel.max(initial=0.0))
            if spec.softcap is not None:
                delta_raw = gamma(dim + 2) * abs(spec.scale_float) * (q_ @ k_.T)
                factor_err = 2 * delta_raw / spec.softcap + gamma(4)
                ds_err = ds_err + ds_abs * factor_err + ETA
            s = abs(spec.scale_float)
            bounds[0][b, h] = s * (ds_err @ k_ + gamma(keys + 2) * ds_abs @ k_) + (keys + 2) * ETA
            bounds[1][b, g] += (
                s * (ds_err.T @ q_ + gamma(group * length + 2) * ds_abs.T @ q_) + (length + 2) * ETA
            )
            magnitudes[0][b, g] += wk.T @ do
            magnitudes[1][b, g] += s * ds_abs.T @ q_
    dqv = None
    if spec.qv_features:  # dv = P'^T dO + dk'[D:]: both bounds, and the sum's rounding
        cut = dim - spec.qv_features
        tail, tail_mag = bounds[1][..., cut:], magnitudes[1][..., cut:]
        bounds[2] = bounds[2] + tail + gamma(2) * (magnitudes[0] + tail_mag + bounds[2] + tail)
        bounds[2] += ETA
        dqv = bounds[0][..., cut:]
        bounds[0], bounds[1] = bounds[0][..., :cut], bounds[1][..., :cut]
    result = tuple(spec.unflatten(x) for x in bounds)
    if spec.sinks is not None:
        result += (sink_err + gamma(length + batch) * sink_abs,)
    if dqv is not None:
        result += (spec.unflatten(dqv),)
    return result


def _finite_abs(x):
    x = np.asarray(x, dtype=np.float64)
    return np.where(np.isfinite(x), np.abs(x), 0.0)


def _heads(x, name):
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"{name}: expected at least 2 dimensions, got shape {x.shape}")
    return x if x.ndim > 2 else x[None]


def grad_scales(
    q,
    k,
    v,
    grad_out,
    weights,
    dropped,
    *,
    grad_lse=None,
    scale=None,
    bias=None,
    gqa="interleave",
    sink_weights=None,
    normalizer="softmax",
    qv=None,
    **_ignored,
) -> dict:
    """Natural scales of dq, dk, dv, dbias, shaped like them: the gradients' sums taken over
    absolute values (non-finite inputs count as 0),

    .. math::

        g_{ij} = p_{ij} (|dP_{ij}| + \\Delta_i + |\\bar\\ell_i|), \\quad
        \\widehat{dq} = |s|\\, g |K|, \\quad \\widehat{dk} = |s|\\, g^T |Q|, \\quad
        \\widehat{dv} = |P'|^T |dO|, \\quad \\widehat{d\\mathrm{bias}} = g,

    with ``|dP| = |dO| |V|^T`` (times the dropout rescaling) and ``Delta_i = sum_j p_ij |dP_ij|``;
    with ``sink_weights`` (the sinks' weights ``w_sink`` (..., H, L)) also
    ``\\widehat{d\\sigma}_h = \\sum_{b,i} w_{sink} (\\Delta_i + |\\bar\\ell_i|)`` (H,), the
    magnitude of ``dsinks = sum_{b,i} w_sink (grad_lse_i - Delta_i)``. With
    ``normalizer="sigmoid"`` (``dS = sigma' dP``, ``sigma' <= sigma = p``) Delta_i is 0. With
    ``qv`` the scales of ``q' = [q, qv]``, ``k' = [k, v]`` split back (dv adds the last E of
    dk', dqv those of dq').
    The rounding errors of a gradient computed in a given order are proportional to these
    (used by the kernels' backward bound and by the oracle's judging policy).

    ``weights`` are the float64 pre-dropout weights (..., H, L, S), ``dropped`` the
    post-dropout ones (the same array without dropout); q, k, v, grad_out as
    :func:`refattn.attention_vjp`.

    >>> w = np.full((1, 1, 2), 0.5)
    >>> s = grad_scales(np.ones((1, 1, 1)), np.ones((1, 2, 1)), np.ones((1, 2, 1)),
    ...                 np.ones((1, 1, 1)), w, w, scale=1.0)
    >>> s["dq"].tolist(), s["dv"].tolist()
    ([[[2.0]]], [[[0.5], [0.5]]])
    """
    gqa = gqa or "interleave"
    if qv is not None:
        extra = {"scale": scale, "bias": bias, "gqa": gqa, "sink_weights": sink_weights}
        extra["normalizer"] = normalizer
        return _latent_scales(q, k, v, qv, grad_out, weights, dropped, grad_lse=grad_lse, **extra)
    q3, k3, v3 = _heads(q, "q"), _heads(k, "k"), _heads(v, "v")
    heads, dim = q3.shape[-3], q3.shape[-1]
    kv_heads = k3.shape[-3]
    p = _finite_abs(weights)
    d_out = _finite_abs(_heads(grad_out, "grad_out"))
    rescale = np.divide(_finite_abs(dropped), p, out=np.ones_like(p), where=p > 0)
    d_p = np.matmul(d_out, np.swapaxes(expand_kv(_finite_abs(v3), heads, gqa), -1, -2)) * rescale
    delta = (p * d_p).sum(axis=-1, keepdims=True)
    if normalizer == "sigmoid":  # dS = sigma' dP with sigma' <= sigma = p: no Delta term
        delta = np.zeros_like(delta)
    g_lse = 0.0 if grad_lse is None else _finite_abs(grad_lse)[..., None]
    g = p * (d_p + delta + g_lse)
    s = abs(1.0 / math.sqrt(dim) if scale is None else float(scale))
    dq = s * np.matmul(g, expand_kv(_finite_abs(k3), heads, gqa))
    dk = fold_kv(s * np.matmul(np.swapaxes(g, -1, -2), _finite_abs(q3)), kv_heads, gqa)
    dv = fold_kv(np.matmul(np.swapaxes(_finite_abs(dropped), -1, -2), d_out), kv_heads, gqa)
    scales = {
        "dq": reduce_to(dq, np.shape(q)),
        "dk": reduce_to(dk, np.shape(k)),
        "dv": reduce_to(dv, np.shape(v)),
    }
    if bias is not None:
        scales["dbias"] = reduce_to(g, np.shape(bias))
    if sink_weights is not None:
        per_row = _heads(_finite_abs(sink_weights) * (delta + g_lse)[..., 0], "sink_weights")
        scales["dsinks"] = per_row.reshape((-1,) + per_row.shape[-2:]).sum(axis=(0, 2))
    return scales


def _latent_scales(q, k, v, qv, grad_out, weights, dropped, **options) -> dict:
    """:func:`grad_scales` of a call with ``qv``: those of ``[q, qv]``, ``[k, v]`` split."""
    wide = [np.asarray(x, np.float64) for x in (q, qv, k, v)]
    q_full = np.concatenate(wide[:2], axis=-1)
    k_full = np.concatenate(wide[2:], axis=-1)
    scales = grad_scales(q_full, k_full, v, grad_out, weights, dropped, **options)
    dim = np.shape(q)[-1]
    dq, dk = scales["dq"], scales["dk"]
    scales.update(dq=dq[..., :dim], dqv=dq[..., dim:], dk=dk[..., :dim])
    scales["dv"] = scales["dv"] + dk[..., dim:]
    return scales
