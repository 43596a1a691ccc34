"""A-priori (first-order) error bounds of :mod:`refattn.transformer`'s float64 path.

Running forward error analysis along the same composition as the float64 path
(:func:`refattn.transformer.composition`): every operation maps the bound on its inputs' errors
through its Lipschitz constants and adds its own roundings, counted with Higham's gamma_n
(:func:`refattn.bounds.gamma`). See :func:`transformer_forward_bound`.
"""

from __future__ import annotations

import math

import numpy as np

from .. import transformer as T
from .._spec import canonicalize
from ..logspace import masked_logsumexp
from ..transformer import Float64Ops, moment_exponent, scaled_moments
from .unit import ETA, UNIT_ROUNDOFF, gamma

__all__ = ["Tracked", "TrackedOps", "transformer_forward_bound"]


class Tracked:
    """A float64 value and a first-order bound on its distance to the exact value.

    >>> t = Tracked(np.array([1.0]), np.array([0.0])) + Tracked(np.array([2.0]), np.array([0.0]))
    >>> t.val.tolist(), bool(t.err[0] == 3 * UNIT_ROUNDOFF)
    ([3.0], True)
    """

    __array_ufunc__ = None  # keep NumPy from broadcasting into an object array

    def __init__(self, val, err):
        self.val, self.err = val, err

    def __add__(self, other):
        val = self.val + other.val
        return Tracked(val, self.err + other.err + UNIT_ROUNDOFF * np.abs(val))

    def map(self, fn):
        return Tracked(fn(self.val), fn(self.err))


#: max |GELU'(x)| = max (Phi(x) + x phi(x)) <= 1 + phi(1) = 1 + 1/sqrt(2 pi e).
_GELU_LIPSCHITZ = 1 + 1 / math.sqrt(2 * math.pi * math.e)


class TrackedOps:
    """First-order forward error analysis of the float64 path (see
    :func:`transformer_forward_bound`): the operations of a
    :class:`refattn.transformer.Composition` on :class:`Tracked` values.

    Each op returns the float64 value and ``err`` = (error propagated from the inputs' errors)
    + (this op's rounding errors), with Higham's gamma_n = n u / (1 - n u) for n roundings.
    """

    @staticmethod
    def linear(x, W, b):
        width = W.shape[0] + (b is not None)  # dot product of M terms (+ the bias add)
        val = Float64Ops.linear(x.val, W, b)
        size = np.abs(x.val) @ np.abs(W) + (0.0 if b is None else np.abs(b))
        return Tracked(val, x.err @ np.abs(W) + gamma(width) * size)

    @staticmethod
    def activation(x, name):
        val = Float64Ops.activation(x.val, name)
        if name == "relu":  # exact, 1-Lipschitz
            return Tracked(val, x.err)
        # x/sqrt2 (2 roundings; erf' * |x| u <= u), erf (4 units), 1 + , *x, *0.5: gamma_8 |x|
        return Tracked(val, _GELU_LIPSCHITZ * x.err + gamma(8) * np.abs(x.val))

    @staticmethod
    def layer_norm(x, p):
        width = x.val.shape[-1]
        val = Float64Ops.layer_norm(x.val, p)
        gain = 1.0 if p.gamma is None else np.abs(p.gamma)
        # everything at the float64 path's power-of-two scale 2**-e (sigma and centred scale
        # alike; x, its error and the mean's rounding are scaled to match)
        centred, var, eps = scaled_moments(x.val, p.eps)
        shift = moment_exponent(x.val, p.eps)
        x_val, x_err = np.ldexp(x.val, -shift), np.ldexp(x.err, -shift)
        sigma = np.sqrt(var + eps)
        normed = np.abs(centred) / sigma
        # propagated: dy = g/sigma (dx - mean dx - yhat mean(yhat dx))
        mean_err = x_err.mean(axis=-1, keepdims=True)
        proj_err = (normed * x_err).mean(axis=-1, keepdims=True)
        propagated = gain / sigma * (x_err + mean_err + normed * proj_err)
        # rounding: mean gamma_{M+1} mean|x|; centring u|c|; variance gamma_{M+4} (relative);
        # sigma: half the variance's relative error + gamma_2; divide, gain, shift: 3 units
        mean_round = gamma(width + 1) * np.abs(x_val).mean(axis=-1, keepdims=True)
        sigma_rel = 0.5 * gamma(width + 4) * var / sigma**2 + gamma(2)
        rounding = gain * ((mean_round + UNIT_ROUNDOFF * np.abs(centred)) / sigma
                           + normed * (sigma_rel + gamma(2))) + UNIT_ROUNDOFF * np.abs(val) \
            + 3 * ETA  # division, gain and shift may each round a subnormal result by eta
        return Tracked(val, propagated + rounding)

    @staticmethod
    def attention(q, k, v, kwargs):
        spec = canonicalize(q.val, k.val, v.val, **kwargs)
        errs = canonicalize(q.err, k.err, v.err, **kwargs)  # same flattening of the errors
        out = Float64Ops.attention(q.val, k.val, v.val, kwargs)
        err = np.zeros(spec.batch_shape + spec.q.shape[1:3] + (spec.v.shape[-1],))
        flat = err.reshape((-1,) + err.shape[-3:])
        for b in range(spec.q.shape[0]):
            for h in range(spec.q.shape[1]):
                flat[b, h] = _attention_plane_bound(spec, errs, b, h)
        return Tracked(out, err)

    @staticmethod
    def positions(length, dim, base, layout):
        return Tracked(Float64Ops.positions(length, dim, base, layout),
                       _positions_bound(length, dim, base, layout))


def _attention_plane_bound(spec, errs, b, h):
    """Bound of one (L, E) plane: refattn.attention's own bound (its docstring), widened by
    the score terms |t| + |lse| (bias, ALiBi, softcap roundings), plus the propagated input
    errors: a score error e_ij moves the weight by w_ij (e_ij + max_k e_ik)."""
    g = spec.kv_head[h]
    q, k, v = spec.q[b, h], spec.k[b, g], spec.v[b, g]
    dq, dk, dv = errs.q[b, h], errs.k[b, g], errs.v[b, g]
    length, dim = q.shape
    keys = k.shape[0]
    allowed = spec.allowed(b, h)
    scale = abs(spec.scale_float)
    raw = scale * (q @ k.T)
    scores = raw if spec.softcap is None else spec.softcap * np.tanh(raw / spec.softcap)
    if spec.bias is not None:
        scores = scores + np.where(allowed, spec.bias[b, h], 0.0)
    if spec.alibi_slopes is not None:
        scores = scores + spec.alibi(h, b)
    with np.errstate(invalid="ignore", over="ignore"):
        lse = masked_logsumexp(scores, allowed)
    finite_lse = np.where(np.isfinite(lse), lse, 0.0)[:, None]
    weights = np.where(allowed, np.exp(np.where(allowed, scores, 0.0) - finite_lse), 0.0)
    if spec.dropout_mask is not None:
        weights = np.where(spec.dropout_mask[b, h], weights, 0.0) / (1.0 - spec.dropout_p)
    magnitude = scale * (np.abs(q) @ np.abs(k).T)
    own = 2 * gamma(dim + 6) * (magnitude + np.abs(np.where(allowed, scores, 0.0))
                                 + np.abs(finite_lse) + 1)
    propagated = scale * (dq @ np.abs(k).T + np.abs(q) @ dk.T)
    propagated = np.where(allowed, propagated, 0.0)
    relative = own + propagated + propagated.max(axis=1, keepdims=True)
    return (weights * relative) @ np.abs(v) + weights @ dv + gamma(keys + 3) * (
        weights @ np.abs(v))


def _positions_bound(length, dim, base, layout):
    """|error| <= angle (gamma_3 + (2i/d) |log b| u) + gamma_2: the exponent 2i/d rounded once
    (its error times log b moves the power), pow and the product (one unit each, pow taken
    as within one ulp), sin/cos within one ulp. Column c holds frequency i = c // 2
    ("interleave") or c mod d/2 ("concat")."""
    half = dim // 2
    columns = np.arange(dim)
    frequency = columns // 2 if layout == "interleave" else columns % half
    exponent = 2.0 * frequency / dim
    angle = np.arange(length, dtype=np.float64)[:, None] * np.power(base, -exponent)
    return angle * (gamma(3) + exponent * abs(math.log(base)) * UNIT_ROUNDOFF) + gamma(2)


def transformer_forward_bound(function, *args, **kwargs) -> np.ndarray:
    """A priori bound on the float64 path's error: ``|function(*args, **kwargs) - exact|``.

    ``function`` is one of :func:`refattn.transformer.multihead_attention`, ``layer_norm``,
    ``sinusoidal_positions``, ``feed_forward``, ``encoder_block``, ``decoder_block``, called
    with the same arguments (``precision`` must be "float64"). Returns an array of the
    output's shape.

    Notes
    -----
    Running (first-order) forward error analysis along the same composition: every stage
    maps the bound on its inputs' errors through its Lipschitz constants and adds its own
    rounding errors as ``gamma_n = n u / (1 - n u)`` (Higham, *Accuracy and Stability*,
    Lemma 3.1; u = 2**-53) times the magnitudes involved:

    * ``x @ W + b``: ``err @ |W| + gamma_{M+1} (|x| @ |W| + |b|)`` (any summation order);
    * relu: the error passes; GELU: ``(1 + 1/sqrt(2 pi e)) err + gamma_8 |x|``;
    * residual add: both errors plus ``u |sum|``;
    * layer norm: ``|g|/sigma (e_i + mean e + |yhat_i| mean(|yhat| e))`` propagated, plus the
      mean, centring, variance, square-root and scaling roundings;
    * attention: :func:`refattn.bounds.float64_forward_bound`'s bookkeeping (with the score
      magnitude widened by ``|t| + |lse|`` to cover bias, ALiBi and softcap roundings) plus
      the propagated score errors ``s (e_q |k| + |q| e_k)`` (a weight moves by
      ``w_ij (e_ij + max_k e_ik)``) and ``w @ e_v``;
    * positions: ``angle (gamma_3 + (2i/d) |log b| u) + gamma_2``.

    The composition is :func:`refattn.transformer.composition`: the same validation and the
    same operations as the float64 path, evaluated on :class:`Tracked` values.
    Second-order terms (products of two errors, O(u^2)) are dropped; NaN/Inf inputs give a
    NaN bound.

    Examples
    --------
    >>> import refattn.transformer as T
    >>> bool(transformer_forward_bound(T.layer_norm, np.array([1.0, 2.0])).max() < 1e-14)
    True
    """
    if kwargs.pop("precision", "float64") != "float64":
        raise ValueError("precision: transformer_forward_bound bounds the float64 path only")
    kwargs.pop("out_dtype", None)
    plan = T.composition(function, *args, **kwargs)
    tracked = [Tracked(a, np.zeros_like(a)) for a in plan.inputs.values()]
    return plan.finish(plan.chain(TrackedOps, *tracked, plan.params).err)
