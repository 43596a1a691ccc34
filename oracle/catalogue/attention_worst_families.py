"""Worst-case attention families every suite should hold: each targets one bug class that
random inputs rarely reach (see each builder's docstring).

=====================  ========================================================================
``worst-peaky-x5/x20`` logits scaled up 5x / 20x (peaky softmax): a missing max shift, scores
                       rounded to a narrow type before the exponential, a bad ``exp``
``worst-midpoint``     true outputs a hair from a rounding midpoint of the case dtype: any
                       error above half an ulp rounds the wrong way (tight tier)
``worst-lse-neg120``   single-query rows whose lse is about -120, forward and backward: an
                       lse computed without the max shift underflows (-inf), a normaliser
                       kept in the input type flushes to zero
``worst-one-value``    one non-zero value slot: out = weight of that key * v, a P@V that
                       drops or duplicates a key shows exactly
``worst-equal-keys``   all keys equal: uniform weights 1/S, out = mean of v (exact ties
                       everywhere; a max-tie or tile-count bug shows)
``worst-near-zero``    outputs near 2**-10 of the usual scale: a kernel returning zeros would
                       pass a loose absolute test (refattn judges relative to the truth)
``worst-overflow``     values near the dtype's overflow after the softmax sum: an accumulator
                       kept in the input type, or P@V before normalisation, overflows
=====================  ========================================================================

Shapes a kernel should refuse (GQA with H not a multiple of K, q and k of different head dims,
...) are the refusal family: :mod:`oracle.catalogue.attention_refusal_families`.
"""

from __future__ import annotations

import numpy as np

from oracle.catalogue import attention_inputs, seeding
from oracle.catalogue.attention_entry import ALL, Entry
from oracle.catalogue.attention_long_inputs import grid
from oracle.catalogue.case import Shapes
from refattn.exact.rounding import format_of

__all__ = ["worst_entries"]

_ROWS = Shapes(batch=1, H=2, K=2, L=12, S=80, D=16, E=16)


def _qkv_midpoint(stream, n, dtype, options, sigma, recipe):
    """Values alternating ``1`` and ``1 + ulp(1)`` with nearly uniform weights (q tiny):
    every output is about ``1 + ulp(1) / 2``, the midpoint between two neighbours of the
    dtype's grid, offset by a tiny amount that only a correctly rounded result gets right."""
    p = format_of(dtype).p
    q = 2.0**-8 * stream.gaussian("q", (n.batch, n.H, n.L, n.D))
    k = stream.gaussian("k", (n.batch, n.K, n.S, n.D))
    v = np.ones((n.batch, n.K, n.S, n.E))
    v[:, :, 1::2, :] += 2.0 ** (1 - p)
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_lse(stream, n, dtype, options, sigma, recipe):
    """q0 = 16, k_j0 about -(120 + log S) / (16 scale): every score about -120 - log S, so
    lse is about -120 (other channels: small noise)."""
    scale = float(options.get("scale") or 1 / np.sqrt(n.D))
    q = 2.0**-4 * stream.gaussian("q", (n.batch, n.H, n.L, n.D))
    k = 2.0**-4 * stream.gaussian("k", (n.batch, n.K, n.S, n.D))
    v = stream.gaussian("v", (n.batch, n.K, n.S, n.E))
    q[..., 0] = 16.0
    k[..., 0] = -(120.0 + np.log(n.S)) / (16.0 * scale) + 0.25 * k[..., 0]
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_one_value(stream, n, dtype, options, sigma, recipe):
    """Gaussian q, k; v zero except at one key (chosen per kv head)."""
    q, k, v = (stream.gaussian(name, shape) for name, shape in _shapes(n))
    where = (stream.uniform("slot", (n.batch, n.K)) * n.S).astype(np.int64)
    keep = np.arange(n.S)[None, None, :] == where[..., None]
    v = np.where(keep[..., None], v, 0.0)
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_equal_keys(stream, n, dtype, options, sigma, recipe):
    """Every key the same vector: every score of a row equal, weights exactly 1/S."""
    q, k, v = (stream.gaussian(name, shape) for name, shape in _shapes(n))
    k = np.broadcast_to(k[:, :, :1, :], k.shape).copy()
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_near_zero(stream, n, dtype, options, sigma, recipe):
    """Values of size 2**-10 (outputs about 1e-4): zeros pass ``atol = 1e-3``."""
    q, k, v = (stream.gaussian(name, shape) for name, shape in _shapes(n))
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, 2.0**-10 * v))


#: exponent of the values of worst-overflow: near the top of the dtype, yet S = 80 of them
#: summed in the accumulation type (float32 for the half types) stay finite
_OVERFLOW_EXP = {"float16": 14, "bfloat16": 119, "float32": 119, "float64": 1015}


def _qkv_overflow(stream, n, dtype, options, sigma, recipe):
    """Values of magnitude 2**e .. 2**(e + 1) with e near the dtype's largest exponent."""
    q, k, _ = (stream.gaussian(name, shape) for name, shape in _shapes(n))
    magnitude = 1.0 + np.abs(grid(stream.seed, "v", (n.batch, n.K, n.S, n.E))) / 2
    sign = np.where(stream.uniform("sign", magnitude.shape) < 0.5, -1.0, 1.0)
    v = np.ldexp(sign * magnitude, _OVERFLOW_EXP[format_of(dtype).name])
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _shapes(n):
    return (
        ("q", (n.batch, n.H, n.L, n.D)),
        ("k", (n.batch, n.K, n.S, n.D)),
        ("v", (n.batch, n.K, n.S, n.E)),
    )


_BUILDERS = {
    "midpoint": _qkv_midpoint,
    "lse-neg120": _qkv_lse,
    "one-value": _qkv_one_value,
    "equal-keys": _qkv_equal_keys,
    "near-zero": _qkv_near_zero,
    "overflow": _qkv_overflow,
}
attention_inputs._RECIPE_QKV.update(_BUILDERS)


def worst_entries() -> list[Entry]:
    """The worst-case rows (every dtype, default and full; see the module docstring)."""

    def e(tag, shapes, description, options=None, qkv="gaussian", grads=False):
        return Entry(
            tag,
            shapes,
            description,
            default=ALL,
            full=ALL,
            options=dict(options or {}),
            recipe={"qkv": qkv, "sigma": 1.0},
            grads=grads,
        )

    return [
        e("worst-peaky-x5", _ROWS, "logits x5 (scale 5/sqrt(D)): peaky rows", {"scale": 1.25}),
        e(
            "worst-peaky-x20",
            _ROWS,
            "logits x20 (scale 20/sqrt(D)): near one-hot rows",
            {"scale": 5.0},
        ),
        e("worst-midpoint", _ROWS, "outputs a hair from a rounding midpoint", qkv="midpoint"),
        e(
            "worst-lse-neg120",
            Shapes(batch=1, H=2, K=2, L=1, S=40, D=16, E=16),
            "single-query rows with lse about -120, forward and backward",
            qkv="lse-neg120",
            grads=True,
        ),
        e("worst-one-value", _ROWS, "one non-zero value slot per kv head", qkv="one-value"),
        e("worst-equal-keys", _ROWS, "all keys equal: weights exactly 1/S", qkv="equal-keys"),
        e("worst-near-zero", _ROWS, "outputs near 1e-4: zeros pass a loose atol", qkv="near-zero"),
        e("worst-overflow", _ROWS, "values near the dtype's overflow", qkv="overflow"),
    ]
