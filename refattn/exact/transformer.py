"""Interval twins of the transformer pieces (the exact path of :mod:`refattn.transformer`).

Everything here works on object arrays of ``mpmath.iv.mpf`` at the working precision set by
:func:`refattn.exact.intervals.workprec`, and returns rigorous enclosures of the exact real
results. :mod:`refattn.transformer` composes them and rounds *once* at the end with the Ziv
loop (:func:`refattn.exact.rounding.correctly_round`): the exact path of a whole encoder block
is the exact real value of the block, not a chain of correctly rounded pieces.

Why an own interval attention here rather than ``refattn.attention(precision="exact")``: that
function returns correctly rounded *outputs*; composing rounded outputs would round more than
once. :func:`attention` below encloses the same pinned semantics (docs/conventions.md) on
interval inputs, so projections, attention and the output projection stay one exact chain.
It is written for the small shapes of the exact path (Python loops over rows).

Shape letters as in :mod:`refattn`; M is the model width (the last axis of ``x``).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import numpy as np
from mpmath import iv, mpf
from mpmath.libmp import (
    from_man_exp,
    fzero,
    mpf_add,
    mpf_sign,
    mpf_sub,
    round_ceiling,
    round_floor,
)

from .. import config
from .._tape import Tape, backward_pass
from ..broadcast import reduce_to
from ..spec import canonicalize
from . import intervals as I
from .rounding import correctly_round

__all__ = [
    "linear",
    "relu",
    "gelu",
    "layer_norm",
    "rational_layer_norm",
    "sin",
    "cos",
    "positions",
    "attention",
    "EnclosureOps",
    "round_composition",
    "round_layer_norm",
    "round_positions",
    "attention_vjp",
    "activation_slope",
    "layer_norm_vjp",
    "EnclosureVJPOps",
    "round_vjp",
]

_ZERO = iv.mpf(0)


def _object(shape, values) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out.reshape(shape)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """Enclosure of ``x @ W + b`` (x (..., L, M), W (M, P), b (P,)), all object arrays."""
    out = np.matmul(x, weight)
    return out if bias is None else out + bias


def _relu_scalar(x):
    lo, hi = x._mpi_
    if mpf_sign(lo) >= 0:
        return x
    if mpf_sign(hi) <= 0:
        return _ZERO
    return iv.make_mpf((fzero, hi))


def relu(x: np.ndarray) -> np.ndarray:
    """Enclosure of ``max(x, 0)`` (exact: no rounding is involved)."""
    return _object(x.shape, [_relu_scalar(v) for v in x.ravel()])


def gelu(x: np.ndarray) -> np.ndarray:
    """Enclosure of the exact-erf GELU ``x/2 (1 + erf(x / sqrt 2))`` (Hendrycks & Gimpel)."""
    root2 = I.sqrt(I.point(2))
    return x * (1 + I.erf(x / root2)) / 2


def _nonnegative(x):
    """Clip an interval known to enclose a non-negative number at 0 from below."""
    lo, hi = x._mpi_
    return x if mpf_sign(lo) >= 0 else iv.make_mpf((fzero, hi))


def layer_norm(x: np.ndarray, gamma, beta, eps) -> np.ndarray:
    """Enclosure of layer normalisation over the last axis of an interval array.

    ``gamma``/``beta`` are object arrays of shape (M,) or None; ``eps`` an exact value.
    The variance is the biased one (divide by M), as in the notes (lecture 17, "Other layers").
    """
    width = x.shape[-1]
    mean = x.sum(axis=-1, keepdims=True) / width
    centred = x - mean
    var = (centred**2).sum(axis=-1, keepdims=True) / width
    var = _object(var.shape, [_nonnegative(v) for v in var.ravel()])
    out = centred / I.sqrt(var + I.point(eps))
    if gamma is not None:
        out = out * gamma
    if beta is not None:
        out = out + beta
    return out


def rational_layer_norm(row: np.ndarray, gamma, beta, eps) -> list:
    """Enclosure of layer norm of one row of exact float values (a 1-D float64 array).

    Mean, centred values and the biased variance are computed exactly as rationals, so only
    the square root and the final division and product are interval operations: an exactly
    zero centred value gives an exact zero (no Ziv loop stalls on constant rows).
    Non-finite entries give a NaN row (as ``0/0`` or ``inf - inf`` would in IEEE arithmetic);
    a constant row with ``eps == 0`` is ``0/0``, also NaN.
    """
    if not np.isfinite(row).all():
        return [np.nan] * len(row)
    exact = [Fraction(float(v)) for v in row]
    mean = sum(exact) / len(exact)
    centred = [v - mean for v in exact]
    var = sum(c * c for c in centred) / len(exact) + Fraction(float(eps))
    if var == 0:
        return [np.nan] * len(row)
    inv_sigma = 1 / I.sqrt(I.point(var))
    out = []
    for j, c in enumerate(centred):
        y = I.point(c) * inv_sigma
        if gamma is not None:
            y = y * gamma[j]
        if beta is not None:
            y = y + beta[j]
        out.append(y)
    return out


def _widen(raw, prec: int, down: bool):
    _, man, exp, bc = raw
    if man == 0:
        return raw
    ulp2 = from_man_exp(1, exp + bc - prec + 1)
    return (mpf_sub if down else mpf_add)(raw, ulp2, prec, round_floor if down else round_ceiling)


def _trig(fn, x):
    """``iv.sin``/``iv.cos`` at extra precision, widened outward by two ulp of the working
    precision (the same guard :mod:`refattn.exact.intervals` applies to its functions)."""
    prec = iv.prec
    with I.workprec(prec + config.ELEMENTARY_GUARD_BITS):
        y = fn(x)
    lo, hi = y._mpi_
    return iv.make_mpf((_widen(lo, prec, True), _widen(hi, prec, False)))


def sin(x):
    """Enclosure of sin over an interval (scalar)."""
    return _trig(iv.sin, x)


def cos(x):
    """Enclosure of cos over an interval (scalar)."""
    return _trig(iv.cos, x)


def positions(length: int, dim: int, base, layout: str) -> np.ndarray:
    """Enclosure of the sinusoidal table, shape (length, dim).

    The angle ``pos / base^(2i/dim)`` is evaluated as ``pos * exp(-(2i/dim) log(base))`` with
    the exponent ``2i/dim`` an exact rational; ``base`` is taken at its exact binary value.
    """
    half = dim // 2
    log_base = I.log(I.point(base))
    inv_freq = [
        I.exp(-(I.point(Fraction(2 * i, dim))) * log_base) if i else iv.mpf(1) for i in range(half)
    ]
    table = np.empty((length, dim), dtype=object)
    for pos in range(length):
        for i, freq in enumerate(inv_freq):
            angle = freq * pos
            sin_col, cos_col = (2 * i, 2 * i + 1) if layout == "interleave" else (i, half + i)
            table[pos, sin_col] = sin(angle)
            table[pos, cos_col] = cos(angle)
    return table


def _scale_interval(spec):
    exact = spec.scale_exact
    if isinstance(exact, tuple):  # ("invsqrt", D): 1/sqrt(D) is irrational
        return 1 / I.sqrt(I.point(exact[1]))
    return I.point(exact)


def _flat(arr: np.ndarray, batch_shape: tuple) -> np.ndarray:
    tail = arr.shape[-3:]
    return np.broadcast_to(arr, batch_shape + tail).reshape((-1,) + tail)


def _row_logits(spec, scores, b, h, i, row, cap, slope):
    """Logits of the allowed keys ``row`` of query row i: softcap, bias, ALiBi (exact)."""
    logits = []
    for j in row:
        t = scores[i, j]
        if cap is not None:
            t = cap * I.tanh(t / cap)
        if spec.bias is not None:
            t = t + I.point(spec.bias[b, h, i, j])
        if slope is not None:  # exact, not spec.alibi's rounded float64 product
            t = t - slope * abs(i + spec.offset - int(j))
        logits.append(t)
    return logits


def attention(q, k, v, spec) -> np.ndarray:
    """Enclosure of scaled dot-product attention (docs/conventions.md, steps 1-7).

    Parameters
    ----------
    q, k, v : object arrays (..., H, L, D), (..., K, S, D), (..., K, S, E) of intervals
    spec : refattn.spec.AttentionSpec
        The validated keywords, from :func:`refattn.spec.canonicalize` called on arrays of
        the same shapes (allowed set, bias, ALiBi, GQA head map, dropout, empty rows).

    Returns
    -------
    object array ``spec.batch_shape + (H, L, E)``

    Notes
    -----
    Row i of head h: ``out_i = sum_j e_j keep_j v_j / ((1 - p) sum_j e_j)`` over the allowed j,
    with ``e_j = exp(t_j - t_top)`` (the shift by the largest logit only keeps the intervals
    small; it cancels exactly in the real quotient).
    """
    batch_shape = spec.batch_shape
    q, k, v = (_flat(a, batch_shape) for a in (q, k, v))
    batch, heads, length, _ = q.shape
    vdim = v.shape[-1]
    out = np.empty((batch, heads, length, vdim), dtype=object)
    scale = _scale_interval(spec)
    cap = None if spec.softcap is None else I.point(spec.softcap)
    keep_scale = None if spec.dropout_mask is None else I.point(spec.keep_scale)
    for b in range(batch):
        for h in range(heads):
            g = int(spec.kv_head[h])
            scores = np.matmul(q[b, h], k[b, g].T) * scale
            allowed = spec.allowed(b, h)
            slope = None if spec.alibi_slopes is None else I.point(spec.alibi_slopes[h])
            for i in range(length):
                row = np.flatnonzero(allowed[i])
                if row.size == 0:
                    fill = _ZERO if spec.empty_rows == "zero" else np.nan
                    out[b, h, i] = [fill] * vdim
                    continue
                logits = _row_logits(spec, scores, b, h, i, row, cap, slope)
                top = max(range(len(logits)), key=lambda n: mpf(logits[n]._mpi_[1]))
                weights = [
                    iv.mpf(1) if n == top else I.exp(t - logits[top]) for n, t in enumerate(logits)
                ]
                total = sum(weights)
                if keep_scale is not None:
                    keep = spec.dropout_mask[b, h, i]
                    weights = [
                        w * keep_scale if keep[j] else _ZERO
                        for w, j in zip(weights, row, strict=True)
                    ]
                acc = sum(v[b, g, j] * w for w, j in zip(weights, row, strict=True))
                out[b, h, i] = list(acc / total)
    return out.reshape(batch_shape + out.shape[1:])


# ----------------------------------------------------------------------------- rounded once


class EnclosureOps:
    """The operations of the exact path: enclosures at the working precision (the operations
    of a :class:`refattn.transformer.Composition`)."""

    @staticmethod
    def linear(x, W, b):
        return linear(x, W, b)

    @staticmethod
    def activation(x, name):
        return relu(x) if name == "relu" else gelu(x)

    @staticmethod
    def layer_norm(x, p):
        return layer_norm(x, p.gamma, p.beta, p.eps)

    @staticmethod
    def positions(length, dim, base, layout):
        return positions(length, dim, base, layout)

    def __init__(self):
        self.nan_rows = []

    def attention(self, q, k, v, kwargs):
        shapes = [np.broadcast_to(np.float64(0.0), a.shape) for a in (q, k, v)]
        spec = canonicalize(*shapes, **kwargs)  # same validation as refattn.attention
        if spec.empty_rows == "nan":
            # NaN cannot live in an interval ([-inf, inf] would never round): compute empty
            # rows as zeros and poison them at the end. Within one block a NaN query row only
            # reaches its own output row (W_O, residual, norm and FFN act row by row).
            spec = replace(spec, empty_rows="zero")
            empty = np.zeros(spec.q.shape[:3], dtype=bool)
            for b in range(empty.shape[0]):
                for h in range(empty.shape[1]):
                    empty[b, h] = ~spec.allowed(b, h).any(axis=1)
            self.nan_rows.append(empty.any(axis=1).reshape(spec.batch_shape + (-1,)))
        return attention(q, k, v, spec)

    def poison(self, out):
        for rows in self.nan_rows:
            out[np.broadcast_to(rows, out.shape[:-1])] = np.nan
        return out


def round_composition(chain, inputs, params, dtype, what, *, map_params):
    """``chain(ops, *inputs, params)`` (a :class:`refattn.transformer.Composition`) enclosed
    over :class:`EnclosureOps` at each working precision and rounded once to ``dtype``.

    ``inputs`` are finite float arrays, ``params`` a (nested) parameter dataclass converted
    by ``map_params(params, fn)``.
    """
    args = [I.to_intervals(a) for a in inputs]
    params_iv = map_params(params, I.to_intervals)

    def evaluate(prec):
        ops = EnclosureOps()
        with I.workprec(prec):
            out = chain(ops, *args, params_iv)
        return I.endpoints(ops.poison(out))

    return correctly_round(evaluate, dtype, what=what)


def round_layer_norm(rows: np.ndarray, gamma, beta, eps, dtype) -> np.ndarray:
    """Layer norm of the (R, M) float64 ``rows`` (exact rational mean and variance, see
    :func:`rational_layer_norm`), rounded once to ``dtype``."""
    gamma_iv = None if gamma is None else np.broadcast_to(I.to_intervals(gamma), rows.shape[1:])
    beta_iv = None if beta is None else np.broadcast_to(I.to_intervals(beta), rows.shape[1:])

    def evaluate(prec):
        with I.workprec(prec):
            out = [rational_layer_norm(r, gamma_iv, beta_iv, eps) for r in rows]
        return I.endpoints(np.array(out, dtype=object).reshape(rows.shape))

    return correctly_round(evaluate, dtype, what="layer_norm")


def round_positions(length: int, dim: int, base, layout: str, dtype) -> np.ndarray:
    """The sinusoidal position table (:func:`positions`) rounded once to ``dtype``."""

    def evaluate(prec):
        with I.workprec(prec):
            return I.endpoints(positions(length, dim, base, layout))

    return correctly_round(evaluate, dtype, what="sinusoidal_positions")


# ----------------------------------------------------------------------------- derivatives


def _zeros(shape) -> np.ndarray:
    return _object(shape, [_ZERO] * int(np.prod(shape, dtype=int)))


def attention_vjp(q, k, v, grad_out, spec):
    """Enclosures (dq, dk, dv) of the vector-Jacobian product of :func:`attention`.

    Row i of head h, allowed keys j, weights ``P_j`` (pre-dropout), ``kappa_j`` the kept
    factor (``keep_j / (1 - p)``, or 1 without dropout), cotangent ``dO_i``:

    .. math::

        dP_j = \\kappa_j\\, dO_i \\cdot v_j, \\quad \\Delta = \\sum_j P_j dP_j, \\quad
        dT_j = P_j (dP_j - \\Delta)\\,(1 - \\tanh^2(s_j / c)), \\\\
        dq_i \\mathrel{+}= \\sigma \\sum_j dT_j k_j, \\quad dk_j \\mathrel{+}= \\sigma\\, dT_j q_i,
        \\quad dv_j \\mathrel{+}= \\kappa_j P_j\\, dO_i

    (``s_j`` the scaled score, ``c`` the softcap, ``sigma`` the scale). Excluded keys and
    empty rows contribute nothing (exact zeros). dk and dv sum the query heads of a kv group;
    every gradient is summed back to its argument's own (broadcast) shape.
    """
    batch_shape = spec.batch_shape
    shapes = (q.shape, k.shape, v.shape)
    q, k, v, do = (_flat(a, batch_shape) for a in (q, k, v, grad_out))
    batch, heads, length, _ = q.shape
    dq, dk, dv = _zeros(q.shape), _zeros(k.shape), _zeros(v.shape)
    scale = _scale_interval(spec)
    cap = None if spec.softcap is None else I.point(spec.softcap)
    keep_scale = None if spec.dropout_mask is None else I.point(spec.keep_scale)
    for b in range(batch):
        for h in range(heads):
            g = int(spec.kv_head[h])
            scores = np.matmul(q[b, h], k[b, g].T) * scale
            allowed = spec.allowed(b, h)
            slope = None if spec.alibi_slopes is None else I.point(spec.alibi_slopes[h])
            for i in range(length):
                row = np.flatnonzero(allowed[i])
                if row.size == 0:
                    continue
                logits = _row_logits(spec, scores, b, h, i, row, cap, slope)
                top = max(range(len(logits)), key=lambda n: mpf(logits[n]._mpi_[1]))
                weights = [
                    iv.mpf(1) if n == top else I.exp(t - logits[top]) for n, t in enumerate(logits)
                ]
                total = sum(weights)
                probs = [w / total for w in weights]
                kept = [
                    iv.mpf(1)
                    if keep_scale is None
                    else (keep_scale if spec.dropout_mask[b, h, i, j] else _ZERO)
                    for j in row
                ]
                dprobs = [
                    kappa * np.dot(do[b, h, i], v[b, g, j])
                    for kappa, j in zip(kept, row, strict=True)
                ]
                delta = sum(p * dp for p, dp in zip(probs, dprobs, strict=True))
                for n, j in enumerate(row):
                    dt = probs[n] * (dprobs[n] - delta)
                    if cap is not None:
                        dt = dt * (1 - I.tanh(scores[i, j] / cap) ** 2)
                    dt = dt * scale
                    dq[b, h, i] = dq[b, h, i] + k[b, g, j] * dt
                    dk[b, g, j] = dk[b, g, j] + q[b, h, i] * dt
                    dv[b, g, j] = dv[b, g, j] + do[b, h, i] * (kept[n] * probs[n])
    grads = (dq, dk, dv)
    return tuple(
        reduce_to(a.reshape(batch_shape + a.shape[1:]), shape)
        for a, shape in zip(grads, shapes, strict=True)
    )


def _relu_slope(x):
    lo, hi = x._mpi_
    if mpf_sign(lo) > 0:
        return iv.mpf(1)
    if mpf_sign(hi) <= 0:  # includes an exact zero: the slope at 0 is 0 (torch's choice)
        return _ZERO
    return iv.make_mpf((fzero, iv.mpf(1)._mpi_[1]))


def activation_slope(x: np.ndarray, name: str) -> np.ndarray:
    """Enclosure of the derivative of ReLU (0 at 0) or of the exact-erf GELU,
    ``Phi(x) + x phi(x) = (1 + erf(x / sqrt 2)) / 2 + x exp(-x^2 / 2) / sqrt(2 pi)``."""
    if name == "relu":
        return _object(x.shape, [_relu_slope(v) for v in x.ravel()])
    root2 = I.sqrt(I.point(2))
    density = I.exp(-(x * x) / 2) / I.sqrt(2 * iv.pi)
    return (1 + I.erf(x / root2)) / 2 + x * density


def layer_norm_vjp(x, gamma, eps, grad_out):
    """Enclosures (dx, dgamma, dbeta) of layer norm over the last axis (biased variance):
    with ``s = sqrt(var + eps)``, ``xhat = (x - mu) / s`` and ``dxhat = g gamma``,
    ``dx = (dxhat - mean(dxhat) - xhat mean(dxhat xhat)) / s``, ``dgamma = sum g xhat``,
    ``dbeta = sum g`` (sums over every axis but the last)."""
    width = x.shape[-1]
    centred = x - x.sum(axis=-1, keepdims=True) / width
    var = (centred**2).sum(axis=-1, keepdims=True) / width
    var = _object(var.shape, [_nonnegative(v) for v in var.ravel()])
    sigma = I.sqrt(var + I.point(eps))
    xhat = centred / sigma
    dxhat = grad_out if gamma is None else grad_out * gamma
    dx = (
        dxhat
        - dxhat.sum(axis=-1, keepdims=True) / width
        - xhat * (dxhat * xhat).sum(axis=-1, keepdims=True) / width
    ) / sigma
    rows = (-1, width)
    return dx, (grad_out * xhat).reshape(rows).sum(axis=0), grad_out.reshape(rows).sum(axis=0)


class EnclosureVJPOps(EnclosureOps):
    """:class:`EnclosureOps` with the vector-Jacobian product of every operation (the exact
    path of the ``*_vjp`` functions of :mod:`refattn.transformer`)."""

    @staticmethod
    def zeros(shape):
        return _zeros(shape)

    @staticmethod
    def linear_vjp(x, W, has_bias, g):
        rows_x, rows_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        return (
            np.matmul(g, W.T),
            np.matmul(rows_x.T, rows_g),
            rows_g.sum(axis=0) if has_bias else None,
        )

    @staticmethod
    def activation_vjp(x, name, g):
        return g * activation_slope(x, name)

    @staticmethod
    def layer_norm_vjp(x, p, g):
        return layer_norm_vjp(x, p.gamma, p.eps, g)

    def attention_vjp(self, q, k, v, kwargs, g):
        shapes = [np.broadcast_to(np.float64(0.0), a.shape) for a in (q, k, v)]
        spec = canonicalize(*shapes, **kwargs)
        return attention_vjp(q, k, v, g, replace(spec, empty_rows="zero"))


def round_vjp(chain, inputs, params, grad_out, dtype, what, *, map_params, zero_arrays=()) -> list:
    """Gradients of ``sum(grad_out * chain(ops, *inputs, params))`` with respect to the inputs
    and every parameter array (:func:`refattn._tape.backward_pass` order), as the exact
    derivative of the whole composition: forward and backward pass enclosed over
    :class:`EnclosureVJPOps` at each working precision, every gradient rounded once.

    ``zero_arrays``: positions (in that order) of gradients the caller has proved to be exactly
    zero (an enclosure can only straddle 0; they are settled by the Ziv loop's exact
    fallback instead of running it to its precision cap)."""
    args = [np.asarray(a, dtype=np.float64) for a in inputs]
    sizes = []

    def evaluate(prec):
        ops = EnclosureVJPOps()
        with I.workprec(prec):
            grads = backward_pass(
                Tape(ops), chain, args, params, grad_out, I.to_intervals, map_params
            )
        if any(np.any(rows) for rows in ops.nan_rows):
            raise ValueError(
                f"{what}: the exact vector-Jacobian product does not support "
                "empty rows with empty_rows='nan' (NaN outputs)"
            )
        sizes[:] = [(g.shape, g.size) for g in grads]
        return I.endpoints(np.concatenate([g.ravel() for g in grads]))

    def exact_zero(index):
        start = 0
        for position, (_, size) in enumerate(sizes):
            if start <= index[0] < start + size:
                return 0 if position in zero_arrays else None
            start += size
        return None

    flat = correctly_round(evaluate, dtype, what=what, fallback=exact_zero)
    out, start = [], 0
    for shape, size in sizes:
        out.append(flat[start : start + size].reshape(shape))
        start += size
    return out
