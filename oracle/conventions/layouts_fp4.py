"""The ``fp4-paged`` calling convention: a paged fp4 KV cache packed two codes per byte.

``layout="fp4-paged"`` (:func:`oracle.conventions.layouts.wrap`) hands an implementation what an fp4
KV-cache kernel reads:

* q (B, L, H, D) in its dtype, or, for fp4 q, packed (B, L, H, D/2) uint8 with
  ``q_block_scale`` (B, L, H, D/n);
* ``k``, ``v``: the caches (P, page, K, D/2) and (P, page, K, E/2) uint8, two e2m1 codes per
  byte along the feature axis, element 2i in the low nibble and 2i + 1 in the high one
  (CUDA's ``__nv_fp4x2_e2m1`` order; docs/conventions.md, "fp4 inputs");
* ``k_block_scale``, ``v_block_scale``: the scale caches (P, page, K, D/n) and (P, page, K, E/n)
  (float8_e4m3fn for NVFP4, n = 16; float8_e8m0fnu for MXFP4, n = 32), paged with the codes;
* ``block_table`` (int32 (B, pages per sequence)), ``cache_seqlens`` (int32 (B,): each
  sequence's real key count, the case's ``kv_lengths``, which are not passed themselves; else
  S); the global ``*_descale`` (float32 (B, K)) and every other keyword as in refattn.

Pages hold 16 positions; they are stored in reverse order behind one unused page, and every
slot no sequence owns (past S_b too) holds code 0 with a NaN scale (0x7F / 0xFF), so a kernel
that ignores the block table or the lengths fails. Returns out (B, L, H, E), optionally lse
(B, H, L). Cases without fp4 k and v are "unsupported" in this convention.

Examples
--------
>>> import ml_dtypes, numpy as np
>>> codes = np.array([[[[1, 2, 3, 4]]]], np.uint8)  # (B, S, K, 4) e2m1 codes
>>> pack_low_first(codes).tolist()
[[[[33, 67]]]]
"""

from __future__ import annotations

import numpy as np

__all__ = ["fp4_paged", "pack_low_first", "FP4_PAGE"]

#: positions per page of the fp4 paged cache (vLLM's default KV block size)
FP4_PAGE = 16
_NAN_SCALE = {"float8_e4m3fn": 0x7F, "float8_e8m0fnu": 0xFF}


def pack_low_first(codes) -> np.ndarray:
    """uint8 (..., D/2) from e2m1 codes (..., D): element 2i low nibble, 2i + 1 high."""
    codes = np.asarray(codes).view(np.uint8) & 0x0F
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _is_fp4(x):
    return np.asarray(x).dtype.name == "float4_e2m1fn"


def _blhd(a):
    return np.ascontiguousarray(np.swapaxes(a, -3, -2))


def _paged(array, table, pages, fill, lengths):
    """(B, K, S, X) -> (pages, FP4_PAGE, K, X) along the block table: sequence b's first
    ``lengths[b]`` positions, ``fill`` in every other slot."""
    batch, kv_heads, keys, width = array.shape
    cache = np.full((pages, FP4_PAGE, kv_heads, width), fill, dtype=array.dtype)
    seq = np.swapaxes(array, 1, 2)
    for b in range(batch):
        for p in range(table.shape[1]):
            chunk = seq[b, p * FP4_PAGE : min((p + 1) * FP4_PAGE, lengths[b])]
            cache[table[b, p], : len(chunk)] = chunk
    return cache


def _lengths(kwargs, batch, keys):
    """Each sequence's key count (int32 (B,)): the case's ``kv_lengths``, consumed (they are
    ``cache_seqlens``), else S for every sequence."""
    lengths = kwargs.pop("kv_lengths", None)
    if lengths is None:
        return np.full(batch, keys, np.int32)
    return np.broadcast_to(np.asarray(lengths, np.int32).reshape(-1), (batch,)).copy()


def fp4_paged(q, k, v, options):
    """(args, kwargs, unpack) of the fp4-paged convention for bhld NumPy inputs."""
    present = [n for n in ("mask", "bias", "dropout_mask") if options.get(n) is not None]
    if present:
        raise NotImplementedError(f"the fp4-paged layout carries no per-position arrays {present}")
    if not (_is_fp4(k) and _is_fp4(v)):
        raise NotImplementedError("the fp4-paged layout is a cache of fp4 k and v")
    if np.ndim(q) != 4:
        raise NotImplementedError("the fp4-paged layout needs batched (B, H, L, D) inputs")
    batch, keys = q.shape[0], k.shape[-2]
    per_seq = -(-keys // FP4_PAGE)
    pages = batch * per_seq + 1  # page 0 is never used
    table = pages - 1 - (np.arange(batch)[:, None] * per_seq + np.arange(per_seq)[None, :])
    kwargs = dict(options)
    lengths = _lengths(kwargs, batch, keys)
    caches = {}
    for name, x in (("k", k), ("v", v)):
        scale = np.asarray(options[f"{name}_block_scale"])
        nan = np.array(_NAN_SCALE[scale.dtype.name], np.uint8).view(scale.dtype)
        caches[name] = _paged(pack_low_first(x), table, pages, 0, lengths)
        kwargs[f"{name}_block_scale"] = _paged(scale, table, pages, nan, lengths)
    if _is_fp4(q):
        q = pack_low_first(q)
        kwargs["q_block_scale"] = _blhd(np.asarray(options["q_block_scale"]))
    kwargs.update(block_table=table.astype(np.int32), cache_seqlens=lengths)

    def unpack(x, what):
        return np.asarray(x) if what == "lse" else _blhd(np.asarray(x))

    return (_blhd(q), caches["k"], caches["v"]), kwargs, unpack
