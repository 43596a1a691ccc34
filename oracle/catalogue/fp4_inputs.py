"""Inputs of the fp4 cases: NVFP4 / MXFP4 quantisation as callers of fp4 KV caches do it.

Recipe keys: ``fp4`` ("nvfp4" | "mxfp4"), ``fp4_q`` (quantise q too), ``fp4_global``
("head": NVFP4's global scale per (batch, kv head), the default; "tensor": one per tensor,
as FlashInfer's and TensorRT-LLM's NVFP4 caches carry it), ``fp4_blocks``
("zero-max": every third position's blocks all zero, every third + 1 all at the tensor's
amax, so its codes are +-6 and, for NVFP4, its scale the largest; "collapse": every other
position scaled by 2**-14 (NVFP4: its e4m3 block scales fall to subnormals or 0, so blocks
collapse to zero; MXFP4: small power-of-two scales)).

Quantisation (bit-identical everywhere: float64 divisions of exactly representable numbers,
IEEE float32 casts and ml_dtypes' rounding):

* NVFP4: global scale g = amax / (6 * 448) per (batch, kv head) in float32 (q: over the kv
  head's query group), the ``*_descale``; block scale = e4m3(block amax / (6 g)) (clipped to
  448); code = e2m1(x / (scale * g)) clipped to +-6 (0 where the scale is 0).
* MXFP4: scale = 2**ceil(log2(block amax / 6)) in e8m0 (2**-127 for an all-zero block), code
  = e2m1(x / scale); no global scale (MXFP4 has none).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from oracle.catalogue.names import FP4_FORMATS

__all__ = ["quantised_fp4"]

_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)


def quantised_fp4(inputs, n, recipe) -> dict[str, np.ndarray]:
    """fp4 k, v (and q with ``fp4_q``) with their block scales (and NVFP4's descales) for
    the float64 ``inputs``; the names q, k, v replace the float64 arrays."""
    fmt = recipe["fp4"]
    scale_name, block = FP4_FORMATS[fmt]
    out = {}
    names = ("q", "k", "v") if recipe.get("fp4_q") else ("k", "v")
    for name in names:
        x = _shaped(inputs[name], recipe.get("fp4_blocks"))
        if fmt == "nvfp4":
            descale = _global_scale(x, n, name, recipe.get("fp4_global", "head"))
            per_head = descale.astype(np.float64)[..., None, None]
            if name == "q":
                per_head = np.repeat(per_head, n.H // n.K, axis=1)
            codes, scales = _nvfp4(x / per_head, block)
            out[f"{name}_descale"] = descale
        else:
            codes, scales = _mxfp4(x, block)
        out[name] = codes
        out[f"{name}_block_scale"] = scales.astype(np.dtype(getattr(ml_dtypes, scale_name)))
    return out


def _shaped(x, style):
    """x with the recipe's special blocks (positions on axis -2)."""
    x = np.array(x, dtype=np.float64)
    if style == "zero-max":
        amax = np.abs(x).max()
        x[..., 0::3, :] = 0.0
        x[..., 1::3, :] = np.where(x[..., 1::3, :] < 0, -amax, amax)
    elif style == "collapse":
        x[..., 1::2, :] *= 2.0**-14
    return x


def _global_scale(x, n, name, scope="head"):
    """NVFP4's global scale (float32 (batch, K)): per (batch, kv head), or with ``scope``
    "tensor" one for the whole tensor (FlashInfer's and TensorRT-LLM's caches), repeated."""
    group = x.reshape(n.batch, n.K, -1)  # q (batch, H, L, D): its kv head's query group
    amax = np.abs(group).max(axis=-1)
    if scope == "tensor":
        amax = np.full(amax.shape, np.abs(group).max())
    return np.maximum(amax / (6.0 * 448.0), np.finfo(np.float32).tiny).astype(np.float32)


def _blocks(x, block):
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _nvfp4(x, block):
    blocks = _blocks(x, block)
    amax = np.abs(blocks).max(axis=-1)
    scale = np.minimum(amax / 6.0, 448.0).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    factor = scale.astype(np.float64)[..., None]
    safe = np.where(factor > 0, factor, 1.0)
    codes = np.where(factor > 0, np.clip(blocks / safe, -6.0, 6.0), 0.0)
    return codes.astype(np.float32).astype(_E2M1).reshape(x.shape), scale


def _mxfp4(x, block):
    blocks = _blocks(x, block)
    amax = np.abs(blocks).max(axis=-1)
    # ceil(log2(amax / 6)) from frexp (exact; no libm): m = f 2**e, f in [0.5, 1)
    fraction, power = np.frexp(np.where(amax > 0, amax, 1.0) / 6.0)
    exponent = np.where(amax > 0, np.where(fraction > 0.5, power, power - 1), -127)
    exponent = np.clip(exponent, -127, 127)
    scale = np.ldexp(1.0, exponent.astype(np.int64))
    codes = np.clip(blocks / scale[..., None], -6.0, 6.0)
    return codes.astype(np.float32).astype(_E2M1).reshape(x.shape), scale.astype(np.float32)
