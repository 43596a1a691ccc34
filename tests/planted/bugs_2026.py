"""Bugs of the 2025-26 kernels, planted in refattn's own conventions (bhld ``impl(q, k, v,
**options)``; merges ``impl(outs, lses, lse_base)``): each must fail at least five cases of
its suite and be named by a diagnosis (tests/meta/test_bugs_2026.py).

* ``sentinel_clamped_to_zero``: a gather that clamps -1 to key 0 (key 0 enters once per -1
  slot);
* ``nvfp4_scales_per_32``: NVFP4 block scales applied to 32 features each (MXFP4's block);
* ``merge_without_max``: e^lse summed with no max subtracted (overflow at |lse| ~ 1e4);
* ``natural_merged_as_base2``: every lse weighed as base 2 (a base-2-only merge handed
  natural lses).
"""

from __future__ import annotations

import numpy as np

import refattn
from oracle.reading.baseline import textbook_attention
from oracle.reading.heads import dequantised

__all__ = [
    "sentinel_clamped_to_zero",
    "nvfp4_scales_per_32",
    "merge_without_max",
    "natural_merged_as_base2",
]


def _rounded(out, lse, dtype, return_lse):
    out, lse = np.asarray(out).astype(dtype), np.asarray(lse).astype(dtype)
    return (out, lse) if return_lse else out


def sentinel_clamped_to_zero(q, k, v, return_lse=False, **options):
    """-1 clamped to 0, then a plain gather (the multiset reading)."""
    idx = np.maximum(np.asarray(options.pop("key_indices"), np.int64), 0)
    out, lse = refattn.attention(
        q, k, v, key_indices=idx, index_reading="multiset", return_lse=True, **options
    )
    return _rounded(out, lse, np.asarray(q).dtype, return_lse)


def _per_32(codes, scale):
    values = np.asarray(codes).astype(np.float64)
    scale = np.asarray(scale).astype(np.float64)
    blocks = np.minimum(np.arange(values.shape[-1]) // 32, scale.shape[-1] - 1)
    return values * scale[..., blocks]


def nvfp4_scales_per_32(q, k, v, return_lse=False, **options):
    """NVFP4 codes dequantised with each e4m3 block scale over 32 features (then the global
    descale, as pinned)."""
    arrays = {"q": q, "k": k, "v": v}
    heads, gqa = np.shape(q)[-3], options.get("gqa") or "interleave"
    for name in ("q", "k", "v"):
        scale = options.pop(f"{name}_block_scale", None)
        descale = options.pop(f"{name}_descale", None)
        if scale is not None:
            arrays[name] = _per_32(arrays[name], scale)
        if descale is not None:  # the global scale, per (batch, kv head), as pinned
            arrays[name] = dequantised(arrays[name], descale, heads if name == "q" else None, gqa)
    dtype = np.asarray(v).dtype if np.asarray(v).dtype.name != "float4_e2m1fn" else None
    result = textbook_attention(arrays["q"], arrays["k"], arrays["v"], **options)
    out_dtype = dtype or result.out.dtype
    return _rounded(result.out, result.lse, out_dtype, return_lse)


def merge_without_max(outs, lses, lse_base="e"):
    """sum_p b^lse_p o_p / sum_p b^lse_p in the case dtype's float64, no max subtracted."""
    factor = np.log(2.0) if lse_base == 2 else 1.0
    lses64 = np.asarray(lses, np.float64)
    with np.errstate(all="ignore"):
        weights = np.exp(lses64 * factor)
        total = weights.sum(axis=0)
        out = (weights[..., None] * np.asarray(outs, np.float64)).sum(axis=0) / total[..., None]
        lse = np.log(total) / factor
    return out.astype(np.asarray(outs).dtype), lse.astype(np.asarray(lses).dtype)


def natural_merged_as_base2(outs, lses, lse_base="e"):
    """Every lse merged as base 2, whatever the case's base."""
    out, lse = refattn.merge_states(
        np.asarray(outs, np.float64), np.asarray(lses, np.float64), lse_base=2
    )
    if lse_base != 2:
        lse = lse * np.log(2.0)
    return out.astype(np.asarray(outs).dtype), lse.astype(np.asarray(lses).dtype)
