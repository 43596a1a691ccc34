"""Inputs of the attention cases: one builder per recipe key, bit-identical on every machine.

Inputs (:func:`make_inputs`)
----------------------------
q (batch, H, L, D), k (batch, K, S, D), v (batch, K, S, E) in the case dtype, plus, as the
recipe asks: ``mask`` (bool; (batch, 1, 1, S) for padding, (batch, H, L, S) otherwise),
``bias`` (case dtype; (batch, H, L, S), or (1, 1, L, S) when ``bias_shape="broadcast"``),
``dropout_mask`` (bool keep-mask, (batch, H, L, S)), ``alibi_slopes`` (case dtype, (H,)),
``grad_out`` (batch, H, L, E) and ``grad_lse`` (batch, H, L) for gradient cases, ``sinks``
(case dtype, (H,)), ``kv_lengths`` (int32, (batch,)) and the float32 descales (batch, K) of
fp8 cases.

Random numbers come from :mod:`oracle.catalogue.seeding` (SplitMix64 in counter mode keyed by
sha256(seed, array name); Irwin-Hall Gaussians from integer sums; no ``numpy.random``
Generator, no libm): the float64 values are bit-identical on every machine and NumPy
version, and are rounded once to the case dtype.

Recipe keys (``Case.recipe``)
-----------------------------
``qkv``: how q, k, v are built --

* ``"gaussian"``: i.i.d. Gaussian with standard deviation ``sigma`` (q, k) and 1 (v);
* ``"gap"``: logit gaps > 40: q_i0 = +-A, one key per sign has k_j0 = +-A, every other key
  k_j0 = 0 and small Gaussian noise elsewhere, so each row's top score exceeds the rest by
  about scale * A**2 >= 48 (overflows ``exp`` without the max shift in half precision);
* ``"ties"``: three identical keys k_j = B e_0 and q_i0 = A > 0 make a three-way exact tie
  at each row's maximum (other keys: |k_j0| <= B/2, small noise);
* ``"ascending"`` / ``"descending"``: k_j = t_j e_0 on a dyadic ramp, q_i0 in [1, 2): every
  row's scores are monotone in j (non-strictly once rounded to a narrow dtype);
* ``"cancel"``: keys in identical pairs, values in opposite pairs v_{2m+1} = -v_{2m}(1 + eps)
  with eps ~ 2**-(p/2) of the dtype: outputs nearly cancel (sum_j w_j |v_j| >> |out|).

``sigma`` (q/k scale), ``mask`` ("padding" | "random" | "empty-rows"), ``bias`` ("gaussian" |
"minus-log-s": a (1, 1, 1, 1) bias of -log(S), sigmoid attention's b | "neginf", the latter
with -inf entries and one all -inf row per head), ``bias_shape``
("full" | "broadcast"), ``alibi`` (power-of-two slopes 2**-(1 + 8h // H)), ``dropout``
(keep-mask drawn with P(keep) = 1 - dropout_p), ``poison`` ("nan" | "inf": written into every
key/value position that no query may attend and into every excluded bias position),
``grad_lse`` (a cotangent for lse too), ``sinks`` ("gaussian": one logit per query head,
``2 + 2 N(0, 1)`` in the case dtype), ``kv_lengths`` ("ragged": int32 lengths in [1, S] per
batch row, the last S; "ragged-zero": the first 0, an empty cache), ``fp8`` ("e4m3fn" |
"e5m2": q, k, v quantised per (batch, kv head) as FlashAttention 3's callers do, descale =
amax / largest float8 in float32, stored as float8 with ``q_descale``, ``k_descale``,
``v_descale`` (batch, K); the case dtype, bfloat16, is the truth's), ``key_indices`` /
``key_blocks`` (sparse key selection: :mod:`oracle.catalogue.attention_sparse_inputs`).
``v_descale`` (batch, K); the case dtype, bfloat16, is the truth's), ``fp4`` ("nvfp4" |
"mxfp4", with ``fp4_q`` and ``fp4_blocks``: k, v (and q) as float4_e2m1fn with
``*_block_scale`` and, for NVFP4, ``*_descale``; see :mod:`oracle.catalogue.fp4_inputs`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

import ml_dtypes
import numpy as np

from oracle.catalogue import seeding
from oracle.catalogue.attention_latent_families import latent_inputs
from oracle.catalogue.attention_sparse_inputs import sparse_inputs
from oracle.catalogue.case import Case, Shapes
from oracle.catalogue.fp4_inputs import quantised_fp4
from oracle.catalogue.names import FP8_DTYPES
from oracle.catalogue.seeding import Streams
from oracle.reading.allowed import allowed_positions
from refattn.exact.rounding import format_of

__all__ = ["make_inputs", "case_allowed", "RECIPE_INPUTS"]

#: recipe "qkv" value -> builder(stream, case) of every input of the case (families register)
RECIPE_INPUTS: dict = {}


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """Inputs of ``case``, bit-identical on every machine and NumPy version.

    Returns q, k, v in the case dtype and, as the recipe asks, mask, bias, dropout_mask,
    alibi_slopes, grad_out, grad_lse (see the module docstring for shapes and construction).

    Examples
    --------
    >>> from oracle import catalogue
    >>> inputs = make_inputs(catalogue.get("basic-H2K2-L5S7-D8E8-f32"))
    >>> sorted(inputs), inputs["q"].shape, inputs["q"].dtype.name
    (['k', 'q', 'v'], (1, 2, 5, 8), 'float32')
    """
    recipe = case.recipe
    n = case.shapes
    stream = Streams(case.seed)
    fp8 = recipe.get("fp8")
    kind = recipe.get("qkv", "gaussian")
    if kind in RECIPE_INPUTS:  # whole input sets (the refusal cases' malformed inputs)
        return RECIPE_INPUTS[kind](stream, case)
    qkv_dtype = "float64" if fp8 or recipe.get("fp4") else case.dtype
    if kind in _RECIPE_QKV:
        q, k, v = _RECIPE_QKV[kind](
            stream, n, qkv_dtype, case.options, float(recipe.get("sigma", 1.0)), recipe
        )
    else:
        q, k, v = _QKV[kind](stream, n, qkv_dtype, case.options, float(recipe.get("sigma", 1.0)))
    inputs = {"q": q, "k": k, "v": v}
    if fp8:
        inputs.update(_quantised(inputs, n, FP8_DTYPES[fp8]))
    if recipe.get("fp4"):  # fp4 k, v (and q); the rest rounded to the case dtype
        inputs.update(quantised_fp4(inputs, n, recipe))
        inputs.update(
            {
                x: seeding.to_dtype(inputs[x], case.dtype)
                for x in "qkv"
                if inputs[x].dtype == np.float64
            }
        )
    inputs.update(latent_inputs(stream, n, case, inputs))  # qv, v = k[..., :E] (MLA)
    if recipe.get("sinks"):
        sinks = 2.0 + 2.0 * stream.gaussian("sinks", (n.H,))
        inputs["sinks"] = seeding.to_dtype(sinks, case.dtype)
    if recipe.get("kv_lengths"):
        inputs["kv_lengths"] = _kv_lengths(stream, n, recipe["kv_lengths"])
    inputs.update(sparse_inputs(stream, n, recipe, case.options))  # key_indices, key_blocks
    if recipe.get("mask"):
        inputs["mask"] = _MASKS[recipe["mask"]](stream, n)
    if recipe.get("bias"):
        inputs["bias"] = _bias(stream, n, case.dtype, recipe)
    if recipe.get("alibi"):
        slopes = np.ldexp(1.0, -(1 + (8 * np.arange(n.H)) // n.H))
        inputs["alibi_slopes"] = seeding.to_dtype(slopes, case.dtype)
    if recipe.get("dropout"):
        keep = 1 - Fraction(case.options.get("dropout_p", 0.0))
        inputs["dropout_mask"] = stream.bernoulli("dropout_mask", (n.batch, n.H, n.L, n.S), keep)
    if recipe.get("poison"):
        _poison(inputs, case, recipe["poison"])
    if case.grads:
        inputs["grad_out"] = seeding.to_dtype(
            stream.gaussian("grad_out", (n.batch, n.H, n.L, n.E)), case.dtype
        )
        if recipe.get("grad_lse"):
            inputs["grad_lse"] = seeding.to_dtype(
                stream.gaussian("grad_lse", (n.batch, n.H, n.L)), case.dtype
            )
    return inputs


def _quantised(inputs, n: Shapes, fp8: str) -> dict[str, np.ndarray]:
    """q, k, v quantised to ``fp8`` as FlashAttention 3's callers do: per (batch, kv head)
    descale = amax / (largest finite fp8) in float32 (q: amax over the kv head's query group),
    x / descale clipped to the fp8 range and rounded to it (through float32: IEEE casts and
    ml_dtypes' integer rounding, identical on every machine)."""
    dtype = np.dtype(getattr(ml_dtypes, fp8))
    top = float(ml_dtypes.finfo(dtype).max)
    group = n.H // n.K
    quantised = {}
    for name in ("q", "k", "v"):
        x = inputs[name]
        grouped = (
            x.reshape(n.batch, n.K, -1)
            if name != "q"
            else x.reshape(n.batch, n.K, group * n.L * n.D)
        )
        amax = np.abs(grouped).max(axis=-1)
        descale = np.maximum(amax / top, np.finfo(np.float32).tiny).astype(np.float32)
        per_head = descale.astype(np.float64)[..., None, None]
        if name == "q":
            per_head = np.repeat(per_head, group, axis=1)  # query head h reads kv head h // G
        scaled = np.clip(x / per_head, -top, top)
        quantised[name] = scaled.astype(np.float32).astype(dtype)
        quantised[f"{name}_descale"] = descale
    return quantised


def _kv_lengths(stream, n: Shapes, kind: str) -> np.ndarray:
    """int32 (batch,) key lengths in [1, S] (the last row S); "ragged-zero": the first is 0;
    "near-end": S - 96 .. S - 1 (the last row S)."""
    lengths = 1 + (stream.uniform("kv_lengths", (n.batch,)) * n.S).astype(np.int64)
    if kind == "near-end":  # long caches a few keys short of S: tails inside the last tiles
        lengths = n.S - 1 - (stream.uniform("kv_lengths", (n.batch,)) * 96).astype(np.int64)
        lengths[-1] = n.S
        return lengths.astype(np.int32)
    lengths[-1] = n.S
    lengths[0] = 0 if kind == "ragged-zero" else min(lengths[0], max(1, n.S // 2))
    return lengths.astype(np.int32)


def _scale(n: Shapes, options) -> float:
    return float(options.get("scale") or 1 / np.sqrt(n.D))


def _qkv_gaussian(stream, n, dtype, options, sigma):
    q = sigma * stream.gaussian("q", (n.batch, n.H, n.L, n.D))
    k = sigma * stream.gaussian("k", (n.batch, n.K, n.S, n.D))
    v = stream.gaussian("v", (n.batch, n.K, n.S, n.E))
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_gap(stream, n, dtype, options, sigma):
    # the smallest power of two A with A**2 * scale >= 48: the top key wins by >= 48 - noise
    amplitude = 1.0
    while amplitude * amplitude * _scale(n, options) < 48:
        amplitude *= 2
    q = 0.25 * stream.gaussian("q", (n.batch, n.H, n.L, n.D))
    k = 0.25 * stream.gaussian("k", (n.batch, n.K, n.S, n.D))
    v = stream.gaussian("v", (n.batch, n.K, n.S, n.E))
    sign = np.where(stream.uniform("sign", (n.batch, n.H, n.L)) < 0.5, -1.0, 1.0)
    q[..., 0] = amplitude * sign
    k[..., 0] = 0.0
    plus, minus = _two_positions(stream, n)
    for b in range(n.batch):
        for g in range(n.K):
            k[b, g, plus[b, g], 0] = amplitude
            k[b, g, minus[b, g], 0] = -amplitude
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _two_positions(stream, n):
    draws = (stream.uniform("positions", (n.batch, n.K, 2)) * n.S).astype(np.int64)
    plus = draws[..., 0]
    minus = np.where(draws[..., 1] == plus, (plus + 1) % n.S, draws[..., 1])
    return plus, minus


def _qkv_ties(stream, n, dtype, options, sigma):
    q = 0.25 * stream.gaussian("q", (n.batch, n.H, n.L, n.D))
    k = 0.25 * stream.gaussian("k", (n.batch, n.K, n.S, n.D))
    v = stream.gaussian("v", (n.batch, n.K, n.S, n.E))
    q[..., 0] = 4.0
    k[..., 0] = 4.0 * (stream.uniform("k0", (n.batch, n.K, n.S)) - 0.5)
    order = np.argsort(stream.uniform("tie_positions", (n.batch, n.K, n.S)), axis=-1, kind="stable")
    for b in range(n.batch):
        for g in range(n.K):
            for j in order[b, g, :3]:
                k[b, g, j, :] = 0.0
                k[b, g, j, 0] = 8.0
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_ramp(descending):
    def build(stream, n, dtype, options, sigma):
        q = stream.gaussian("q", (n.batch, n.H, n.L, n.D))
        q[..., 0] = 1.0 + stream.uniform("q0", (n.batch, n.H, n.L))
        v = stream.gaussian("v", (n.batch, n.K, n.S, n.E))
        # scores span 16 to 32 across the keys: step = 2**floor(log2(16 / (scale * S)))
        step = math.ldexp(1.0, math.frexp(16 / (_scale(n, options) * n.S))[1] - 1)
        ramp = (np.arange(n.S) - n.S // 2) * step
        k = np.zeros((n.batch, n.K, n.S, n.D))
        k[..., 0] = -ramp if descending else ramp
        return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))

    return build


def _qkv_cancel(stream, n, dtype, options, sigma):
    q, k, v = _qkv_gaussian(stream, n, "float64", options, sigma)
    pairs = n.S // 2
    k[:, :, 1 : 2 * pairs : 2] = k[:, :, 0 : 2 * pairs : 2]
    eps = 2.0 ** -(format_of(dtype).p // 2)
    wiggle = 1 + eps * (2 * stream.uniform("wiggle", (n.batch, n.K, pairs, n.E)) - 1)
    v = seeding.to_dtype(v, dtype).astype(np.float64)
    v[:, :, 1 : 2 * pairs : 2] = -v[:, :, 0 : 2 * pairs : 2] * wiggle
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_outlier(stream, n, dtype, options, sigma, recipe):
    q, k, v = _qkv_gaussian(stream, n, "float64", options, sigma)
    channels = int(recipe.get("channels", 3))
    factor = float(recipe.get("factor", 32.0))
    q[..., :channels] *= factor
    k[..., :channels] *= factor
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_sink(stream, n, dtype, options, sigma, recipe):
    # key 0 aligned with every query: a score about 12 above the rest
    q, k, v = _qkv_gaussian(stream, n, "float64", options, 0.5)
    q[..., 0] = 2.0
    k[..., 0, :] = 0.0
    k[..., 0, 0] = 6.0 / _scale(n, options)  # scale * q0 * k00 = 12
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_late_max(stream, n, dtype, options, sigma, recipe):
    # scores rise along the keys (with noise): the running max moves in every tile
    q, k, v = _qkv_gaussian(stream, n, "float64", options, 0.5)
    q[..., 0] = 1.0 + stream.uniform("q0", (n.batch, n.H, n.L))
    k[..., 0] = np.arange(n.S) * (16.0 / (_scale(n, options) * max(n.S, 1)))
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_offset(stream, n, dtype, options, sigma, recipe):
    q, k, v = _qkv_gaussian(stream, n, "float64", options, sigma)
    v = v + float(recipe.get("offset", 64.0))
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


_RECIPE_QKV = {
    "outlier": _qkv_outlier,
    "sink": _qkv_sink,
    "late-max": _qkv_late_max,
    "offset": _qkv_offset,
}

_QKV = {
    "gaussian": _qkv_gaussian,
    "gap": _qkv_gap,
    "ties": _qkv_ties,
    "ascending": _qkv_ramp(False),
    "descending": _qkv_ramp(True),
    "cancel": _qkv_cancel,
}


def _mask_padding(stream, n):
    # valid lengths in [1, S], the last batch entry unpadded
    lengths = 1 + (stream.uniform("lengths", (n.batch,)) * n.S).astype(np.int64)
    lengths[-1] = n.S
    lengths[0] = min(lengths[0], max(1, n.S - 3))  # at least three padded keys somewhere
    return (np.arange(n.S) < lengths[:, None]).reshape(n.batch, 1, 1, n.S)


def _mask_random(stream, n):
    return stream.bernoulli("mask", (n.batch, n.H, n.L, n.S), Fraction(3, 4))


def _mask_empty_rows(stream, n):
    mask = _mask_random(stream, n)
    mask[:, :, 1::3, :] = False  # every third row of every head has no allowed key
    return mask


_MASKS = {"padding": _mask_padding, "random": _mask_random, "empty-rows": _mask_empty_rows}


def _bias(stream, n, dtype, recipe):
    if recipe["bias"] == "minus-log-s":  # sigmoid attention's b = -log(S) (Ramapuram et al.)
        return seeding.to_dtype(np.full((1, 1, 1, 1), -math.log(n.S)), dtype)
    shape = (
        (1, 1, n.L, n.S) if recipe.get("bias_shape") == "broadcast" else (n.batch, n.H, n.L, n.S)
    )
    bias = stream.gaussian("bias", shape)
    if recipe["bias"] == "neginf":
        bias[stream.bernoulli("bias_neginf", shape, Fraction(1, 4))] = -np.inf
        bias[..., min(2, n.L - 1), :] = -np.inf
    return seeding.to_dtype(bias, dtype)


def case_allowed(case: Case, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """Boolean (batch, H, L, S): positions a query of ``case`` may attend.

    The allowed set of :func:`oracle.reading.allowed.allowed_positions` (refattn.spec's rule: mask,
    causal, window, key length, finite bias) from the case's own options and inputs; used to
    place poison and by tests.
    """
    n = case.shapes
    opts = case.options
    rule = allowed_positions(
        n.L,
        n.S,
        mask=inputs.get("mask"),
        bias=inputs.get("bias"),
        causal=bool(opts.get("causal")),
        window=opts.get("window"),
        align=opts.get("align", "top_left"),
        kv_lengths=inputs.get("kv_lengths"),
    )
    return np.ones((n.batch, n.H, n.L, n.S), dtype=bool) & rule


def _poison(inputs, case, kind):
    n = case.shapes
    allowed = case_allowed(case, inputs)
    if "bias" in inputs:
        # NaN or +Inf (legal only where excluded); -Inf would merely re-exclude the position
        bias = np.broadcast_to(inputs["bias"], allowed.shape).copy()
        bias[~allowed] = np.nan if kind == "nan" else np.inf
        inputs["bias"] = bias
    heads = np.arange(n.H)
    group = n.H // n.K
    tile = case.options.get("gqa", "interleave") == "tile"
    kv_of = heads % n.K if tile else heads // group
    # a key/value position is poisonable when no query of any head reading it may attend
    used = np.zeros((n.batch, n.K, n.S), dtype=bool)
    for h in heads:
        used[:, kv_of[h]] |= allowed[:, h].any(axis=1)
    for name in ("k", "v"):
        array = inputs[name].copy()
        array[~used] = np.nan if kind == "nan" else np.inf
        if kind == "inf":
            array[~used, ::2] = -np.inf
        inputs[name] = array
