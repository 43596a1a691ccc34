"""Bugs of the 2025-26 kernels, planted in refattn's own conventions (bhld ``impl(q, k, v,
**options)``; merges ``impl(outs, lses, lse_base)``): each must fail at least five cases of
its suite and be named by a diagnosis (tests/meta/test_bugs_2026.py).

* ``sentinel_clamped_to_zero``: a gather that clamps -1 to key 0 (key 0 enters once per -1
  slot);
* ``nvfp4_scales_per_32``: NVFP4 block scales applied to 32 features each (MXFP4's block);
* ``merge_without_max``: e^lse summed with no max subtracted (overflow at |lse| ~ 1e4);
* ``natural_merged_as_base2``: every lse weighed as base 2 (a base-2-only merge handed
  natural lses);
* ``sparse_indices_off_by_one``: FlashMLA-style sparse gather reading slot idx + 1 (the
  top-k list taken as 1-based);
* ``sparse_lse_in_base2``: the sparse kernel's exp2 softmax returning log2 of the normaliser
  (FlashMLA's ``flash_mla_sparse_fwd`` documents the natural log);
* ``mla_scale_of_key_width``: MLA's scale taken as 1/sqrt(576), the latent key width,
  instead of the stated 1/sqrt(192);
* ``qv_dropped``: FlashAttention 3's ``qv`` accepted (and counted in the default scale
  1/sqrt(D + E)) but its q.v term never added to the scores;
* ``nvfp4_nibbles_swapped``: packed NVFP4 bytes unpacked high nibble first.

Each bug is its correct twin (:func:`correct_twin`, the same code path with no mistake) with
one line changed; the twin passes the same cases (no false alarm).
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
    "sparse_indices_off_by_one",
    "sparse_lse_in_base2",
    "mla_scale_of_key_width",
    "qv_dropped",
    "nvfp4_nibbles_swapped",
    "correct_twin",
]


def _rounded(out, lse, dtype, return_lse):
    out, lse = np.asarray(out).astype(dtype), np.asarray(lse).astype(dtype)
    return (out, lse) if return_lse else out


def sentinel_clamped_to_zero(q, k, v, return_lse=False, **options):
    """-1 clamped to 0, then a plain gather (the multiset reading)."""
    idx = options.pop("key_indices", None)
    if idx is not None:
        idx, options["index_reading"] = np.maximum(np.asarray(idx, np.int64), 0), "multiset"
    out, lse = refattn.attention(q, k, v, key_indices=idx, return_lse=True, **options)
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


def _packed(codes):
    """float4_e2m1fn codes (..., D) as bytes (..., D / 2), element 2i in the low nibble."""
    bits = np.asarray(codes).view(np.uint8) & 0x0F
    return bits[..., 0::2] | (bits[..., 1::2] << 4)


def _unpacked(packed, like, high_first=False):
    """Bytes (..., D / 2) back to codes (..., D) of ``like``'s dtype (low nibble first)."""
    low, high = packed & 0x0F, packed >> 4
    pair = (high, low) if high_first else (low, high)
    return np.stack(pair, axis=-1).reshape(np.shape(like)).view(np.asarray(like).dtype)


def correct_twin(q, k, v, return_lse=False, mistake=None, **options):
    """A kernel of the 2025-26 features in refattn's conventions, computing in float64 and
    rounding once: sparse ``key_indices`` (-1 / past-the-end ignored), MLA's stated scale,
    FlashAttention 3's ``qv`` (default scale 1/sqrt(D + E)), NVFP4 inputs packed two codes a
    byte and unpacked. ``mistake`` names the one line a planted bug changes."""
    arrays = {"q": q, "k": k, "v": v}
    for name in ("q", "k", "v"):
        x = np.asarray(arrays[name])
        if x.dtype.name == "float4_e2m1fn":
            arrays[name] = _unpacked(_packed(x), x, high_first=mistake == "nibbles")
    D, E = np.shape(q)[-1], np.shape(v)[-1]
    if options.get("qv") is not None and options.get("scale") is None:
        options["scale"] = (D + E) ** -0.5  # FlashAttention 3's default with qv
    if mistake == "qv":
        options.pop("qv", None)
    if mistake == "key-width-scale":
        options["scale"] = D**-0.5
    if mistake == "off-by-one" and options.get("key_indices") is not None:
        idx = np.asarray(options["key_indices"], np.int64)
        S = np.shape(k)[-2]
        options["key_indices"] = np.where((idx >= 0) & (idx < S), idx + 1, -1)
    out, lse = refattn.attention(arrays["q"], arrays["k"], arrays["v"], return_lse=True, **options)
    if mistake == "base2":
        lse = np.asarray(lse) / np.log(2.0)
    dtype = np.asarray(out).dtype  # refattn rounds once to the case's output dtype
    return _rounded(out, lse, dtype, return_lse)


def sparse_indices_off_by_one(q, k, v, return_lse=False, **options):
    """Sparse gather at idx + 1 (a 1-based top-k list read by a 0-based kernel)."""
    return correct_twin(q, k, v, return_lse, mistake="off-by-one", **options)


def sparse_lse_in_base2(q, k, v, return_lse=False, **options):
    """An exp2 softmax whose lse stays in log2 units (where the natural log is expected)."""
    return correct_twin(q, k, v, return_lse, mistake="base2", **options)


def mla_scale_of_key_width(q, k, v, return_lse=False, **options):
    """The stated scale ignored: 1/sqrt(D) of the latent key width (576 for MLA)."""
    return correct_twin(q, k, v, return_lse, mistake="key-width-scale", **options)


def qv_dropped(q, k, v, return_lse=False, **options):
    """``qv`` taken (its width in the default scale) but its q.v term never added."""
    return correct_twin(q, k, v, return_lse, mistake="qv", **options)


def nvfp4_nibbles_swapped(q, k, v, return_lse=False, **options):
    """Packed fp4 bytes unpacked high nibble first: elements 2i and 2i + 1 exchanged."""
    return correct_twin(q, k, v, return_lse, mistake="nibbles", **options)
