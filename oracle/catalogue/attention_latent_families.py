"""The attention case families of latent attention: FlashAttention 3's ``qv`` and MLA's
absorbed decode (docs/conventions.md, "Latent attention").

Recipe keys (read by :func:`latent_inputs`, called from
:func:`oracle.catalogue.attention_inputs.make_inputs`): ``qv`` ("gaussian": qv (batch, H, L, E)
i.i.d. Gaussian in the case dtype) and ``latent_v`` (True: v is the first E features of k, the
MLA latent cache read as values, FlashMLA's ``head_dim_v``; with fp8 inputs v is k's float8
slice and takes ``k_descale``) and ``fp8_latent`` (True: k on the grid of FlashMLA's 656-byte
fp8 cache, :func:`on_fp8_latent_grid`, so the cache can be handed to its sparse decode as it
is stored, with no rounding).

MLA decode cases carry DeepSeek-V3's model scale ``1/sqrt(128 + 64)`` as an explicit
``scale`` (the key is 576 wide: an implementation that scales by ``1/sqrt(576)`` fails them).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from oracle.catalogue import seeding
from oracle.catalogue.attention_entry import Entry
from oracle.catalogue.case import Shapes
from oracle.catalogue.names import FP8_TRUTH_DTYPES

__all__ = ["latent_entries", "latent_inputs", "on_fp8_latent_grid", "MLA_SCALE"]

#: DeepSeek-V3's softmax scale: the model's head dim, 128 nope + 64 rope features.
MLA_SCALE = 1.0 / math.sqrt(128 + 64)


#: FlashMLA's fp8 latent token: 512 nope features in float8_e4m3fn, one power-of-two float32
#: scale per 128 of them, then 64 rope features in bfloat16 (656 bytes)
FP8_NOPE, FP8_TILE, E4M3_MAX = 512, 128, 448.0


def tile_scales(nope) -> np.ndarray:
    """(..., 512 / 128) power-of-two scales of the nope features (..., 512): 2 ** ceil(log2(
    amax / 448)) of each tile of 128 (amax floored at 1e-4), the rule of FlashMLA's tests."""
    tiles = np.abs(np.asarray(nope, np.float64)).reshape(*np.shape(nope)[:-1], -1, FP8_TILE)
    return np.exp2(np.ceil(np.log2(np.maximum(tiles.max(axis=-1) / E4M3_MAX, 1e-4))))


def on_fp8_latent_grid(k) -> np.ndarray:
    """k (..., 576) in float64 moved onto the 656-byte fp8 cache's grid: each tile of 128 nope
    features e4m3 codes times its :func:`tile_scales` scale (round to nearest even), the 64
    rope features rounded to bfloat16. Every value is then exact in float32 and bfloat16."""
    k = np.asarray(k, np.float64)
    nope, rope = k[..., :FP8_NOPE], k[..., FP8_NOPE:]
    scale = np.repeat(tile_scales(nope), FP8_TILE, axis=-1)
    codes = (nope / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    rope = seeding.to_dtype(rope, "bfloat16").astype(np.float64)
    return np.concatenate([codes * scale, rope], axis=-1)


def latent_inputs(stream, n: Shapes, case, inputs: dict) -> dict:
    """The recipe's latent arrays (``qv``; v as a slice of k), in place of / beside
    ``inputs``; returns the arrays to add or replace."""
    recipe, extra = case.recipe, {}
    if recipe.get("qv"):
        qv = stream.gaussian("qv", (n.batch, n.H, n.L, n.E))
        extra["qv"] = seeding.to_dtype(qv, case.dtype)
    if recipe.get("fp8_latent"):
        extra["k"] = seeding.to_dtype(on_fp8_latent_grid(inputs["k"]), case.dtype)
    if recipe.get("latent_v"):
        k = extra.get("k", inputs["k"])
        extra["v"] = np.ascontiguousarray(k[..., : n.E])
        if "k_descale" in inputs:
            extra["v_descale"] = inputs["k_descale"].copy()
    return extra


def latent_entries(gauss) -> list[Entry]:
    """MLA absorbed decode (D 576 / E 512, K 1, the model scale), qv at L > 1, gradients."""
    e = Entry
    mla = {**gauss, "latent_v": True}
    qv = {**gauss, "qv": "gaussian"}
    br = {"causal": True, "align": "bottom_right"}
    model = {"scale": MLA_SCALE}
    return [
        e(
            "mla-decode",
            Shapes(batch=1, H=8, K=1, L=1, S=128, D=576, E=512),
            "MLA absorbed decode: 8 heads read one 576-wide latent key, v = k[..., :512], "
            "scale 1/sqrt(192)",
            options=model,
            recipe=mla,
        ),
        e(
            "mla-decode-h128",
            Shapes(batch=1, H=128, K=1, L=1, S=128, D=576, E=512),
            "MLA absorbed decode with DeepSeek-V3's 128 heads: K 1, S 128, scale 1/sqrt(192)",
            default=("bfloat16",),
            options=model,
            recipe=mla,
        ),
        e(
            "mla-decode-h128-long",
            Shapes(batch=1, H=128, K=1, L=1, S=2048, D=576, E=512),
            "MLA absorbed decode at DeepSeek-V3 size: H 128, K 1, S 2048 (full suite)",
            default=(),
            full=("bfloat16",),
            options=model,
            recipe=mla,
        ),
        e(
            "mla-decode-kv-lengths",
            Shapes(batch=2, H=8, K=1, L=2, S=96, D=576, E=512),
            "MLA decode, 2 query rows (speculative), per-row cache lengths, causal bottom_right",
            options={**model, **br},
            recipe={**mla, "kv_lengths": "ragged"},
        ),
        e(
            "mla-decode-fp8",
            Shapes(batch=1, H=8, K=1, L=1, S=128, D=576, E=512),
            "MLA decode with a float8_e4m3fn latent cache (v = k's slice, k's descale)",
            options=model,
            recipe={**mla, "fp8": "e4m3fn"},
            default=FP8_TRUTH_DTYPES,
            full=FP8_TRUTH_DTYPES,
        ),
        e(
            "qv",
            Shapes(batch=1, H=4, K=1, L=12, S=20, D=16, E=32),
            "FlashAttention 3's qv: s (q.k + qv.v), default scale 1/sqrt(D + E)",
            recipe=qv,
        ),
        e(
            "qv-causal-gqa",
            Shapes(batch=2, H=8, K=2, L=12, S=24, D=16, E=32),
            "qv with causal bottom_right and GQA",
            options={**br, "gqa": "interleave"},
            recipe=qv,
        ),
        e(
            "qv-mla-form",
            Shapes(batch=1, H=8, K=1, L=6, S=64, D=64, E=512),
            "FlashAttention 3's MLA form: q, k the 64 rope features, qv/v the 512 latent ones, "
            "scale 1/sqrt(192)",
            options={**model, **br},
            recipe=qv,
        ),
        e(
            "grad-qv",
            Shapes(batch=1, H=4, K=2, L=8, S=12, D=16, E=16),
            "dq, dk, dv (both of v's terms) and dqv, causal top_left",
            options={"causal": True},
            recipe={**qv, "grad_lse": True},
            grads=True,
        ),
        e(
            "grad-mla",
            Shapes(batch=1, H=4, K=1, L=4, S=16, D=72, E=64),
            "gradients of a small absorbed MLA call (v = k[..., :E]) with the model scale",
            options=model,
            recipe=mla,
            grads=True,
        ),
    ]
