"""The FlashMLA-style latent paged cache convention (``layout="latent-paged"``) of
:func:`oracle.conventions.layouts.wrap`.

The implementation is called as ``impl(q, cache, *, head_dim_v, block_table, cache_seqlens,
**options)`` with q (B, L, H, D) and one latent cache (P, page, 1, D) (MLA's absorbed decode:
576 = 512 latent + 64 rope features per key, a single kv head); the values are the first
``head_dim_v`` features of each cache row (FlashMLA's ``flash_mla_with_kvcache``). It returns
out (B, L, H, E) and optionally lse (B, H, L). Pages are laid out as in the ``paged`` layout
(reverse order behind one unused page, NaN in every slot no sequence owns); a case's
``kv_lengths`` become ``cache_seqlens`` (else every sequence holds S keys). Only cases whose
v is k's first E features with K = 1 fit (others are "unsupported").

A case with ``key_indices`` (DSA decode) also gets ``indices`` (B, L, T) int32: each listed
key's slot in the cache, ``block_table[b, j // page] * page + j % page`` (FlashMLA's
``indices_in_kvcache``), -1 for every entry the case's set does not take (past S_b, outside
the causal/window set, the second and later copies of a repeat); causal and window are folded
into them and not passed. :func:`fp8_latent_cache` writes the cache in FlashMLA's 656-byte
fp8 form, when its values are on that grid.

Examples
--------
>>> import numpy as np
>>> k = np.zeros((1, 576)); k[0, :128] = [1.5, -0.25] * 64; k[0, 512] = 3.0
>>> token = fp8_latent_cache(k)
>>> code, scale = float(token[0, 0].astype(float)), float(token[0, 512:516].view(np.float32)[0])
>>> token.shape, code, scale, code * scale
((1, 656), 384.0, 0.00390625, 1.5)
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from oracle.conventions.expressible import NOT_EXPRESSIBLE
from oracle.conventions.layouts_mla_sparse import valid_indices
from oracle.reading.allowed import options_allowed

__all__ = ["latent_paged_layout", "fp8_latent_cache"]

#: FlashMLA's fp8 latent token: 512 e4m3 nope features, 4 float32 scales (one per 128), then
#: the 64 rope features in bfloat16: 512 + 16 + 128 = 656 bytes
_NOPE, _TILE, _ROPE, _E4M3_MAX = 512, 128, 64, 448.0
_FOLDED = ("causal", "window", "kv_lengths", "key_indices")


def latent_paged_layout(paged):
    """The layout function of ``latent-paged``, built on the ``paged`` one (``paged(q, k, v,
    options) -> (args, kwargs, unpack)``)."""

    def layout(q, k, v, options):
        k, v = np.asarray(k), np.asarray(v)
        width = v.shape[-1]
        if k.shape[-3] != 1 or not np.array_equal(k[..., :width], v, equal_nan=True):
            raise NotImplementedError(
                "the latent-paged layout needs one kv head and v = k[..., :head_dim_v] "
                f"(k {k.shape}, v {v.shape})"
            )
        sparse = options.get("key_indices") is not None
        dropped = _FOLDED if sparse else ("kv_lengths",)
        rest = {n: x for n, x in options.items() if n not in dropped}
        (q_blhd, cache, _), kwargs, unpack = paged(q, k, k, rest)
        kwargs["head_dim_v"] = width
        if options.get("kv_lengths") is not None:
            kwargs["cache_seqlens"] = np.asarray(options["kv_lengths"], dtype=np.int32)
        if sparse:
            kwargs["indices"] = _cache_indices(q_blhd.shape, cache.shape[1], kwargs, options)
        return (q_blhd, cache), kwargs, unpack

    return layout


def _cache_indices(q_shape, page, kwargs, options):
    """(B, L, T) int32: each allowed listed key's slot in the paged cache, else -1."""
    batch, rows = q_shape[0], q_shape[1]
    table = np.asarray(kwargs["block_table"], np.int64)
    lengths = np.broadcast_to(np.asarray(kwargs["cache_seqlens"]).reshape(-1), (batch,))
    keys = table.shape[1] * page
    structural = {n: options[n] for n in ("causal", "window", "align") if n in options}
    structural["kv_lengths"] = lengths
    allowed = np.asarray(options_allowed(rows, keys, structural))
    allowed = np.broadcast_to(allowed.reshape(-1, rows, keys), (batch, rows, keys))
    indices = np.asarray(options["key_indices"])
    indices = np.broadcast_to(indices, (batch, 1, rows, indices.shape[-1]))
    kept = valid_indices(indices, allowed, lengths)[:, 0]  # (B, L, T)
    safe = np.maximum(kept, 0)
    slots = table[np.arange(batch)[:, None, None], safe // page] * page + safe % page
    return np.where(kept >= 0, slots, -1).astype(np.int32)


def fp8_latent_cache(cache) -> np.ndarray:
    """A latent cache (..., 576) as FlashMLA's fp8 cache (..., 656) of float8_e4m3fn bytes:
    512 e4m3 codes, their 4 float32 scales (the power of two ``2 ** ceil(log2(amax / 448))``
    of each 128, amax floored at 1e-4), 64 bfloat16 rope features. A token of NaN (a slot no
    sequence owns) stays NaN in every part; any other value the form cannot hold exactly is
    "not expressible" (NotImplementedError)."""
    cache = np.asarray(cache)
    if cache.shape[-1] != _NOPE + _ROPE:
        raise NotImplementedError(
            f"is_fp8_kvcache: {NOT_EXPRESSIBLE}: the 656-byte fp8 cache holds 576 features "
            f"(512 nope + 64 rope), the case's keys have {cache.shape[-1]}"
        )
    exact = np.asarray(cache, np.float64)
    unowned = np.isnan(exact).all(axis=-1)
    values = np.where(unowned[..., None], 0.0, exact)
    nope, rope = values[..., :_NOPE], values[..., _NOPE:]
    tiles = np.abs(nope).reshape(*nope.shape[:-1], -1, _TILE).max(axis=-1)
    scales = np.exp2(np.ceil(np.log2(np.maximum(tiles / _E4M3_MAX, 1e-4))))
    with np.errstate(invalid="ignore"):
        codes = (nope / np.repeat(scales, _TILE, axis=-1)).astype(ml_dtypes.float8_e4m3fn)
        half = rope.astype(ml_dtypes.bfloat16)
        back = np.repeat(scales, _TILE, axis=-1) * codes.astype(np.float64)
    if not (np.array_equal(back, nope) and np.array_equal(half.astype(np.float64), rope)):
        raise NotImplementedError(
            f"is_fp8_kvcache: {NOT_EXPRESSIBLE}: FlashMLA's sparse decode reads the 656-byte "
            "fp8 cache only (e4m3 nope features with a power-of-two scale per 128, bfloat16 "
            "rope); this cache's values are not on that grid"
        )
    scales = scales.astype(np.float32)
    nan = np.array(np.nan)
    codes = np.where(unowned[..., None], nan.astype(codes.dtype), codes)
    scales = np.where(unowned[..., None], np.float32(np.nan), scales)
    half = np.where(unowned[..., None], nan.astype(half.dtype), half)
    token = np.concatenate(
        [codes.view(np.uint8), scales.view(np.uint8), half.view(np.uint8)], axis=-1
    )
    return np.ascontiguousarray(token).view(ml_dtypes.float8_e4m3fn)
