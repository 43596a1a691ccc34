"""The ``trtllm-fp4`` calling convention: FlashInfer's TensorRT-LLM decode on an NVFP4 KV cache
(``flashinfer.decode.trtllm_batch_decode_with_kv_cache``).

``layout="trtllm-fp4"`` (:func:`oracle.conventions.layouts.wrap`) hands an implementation:

* ``query`` (B * L, H, D) in the case dtype (q is not quantised: a decode query);
* ``kv_cache``: the tuple (k_cache, v_cache), each (P, K, page, D/2) uint8 (``kv_layout="HND"``),
  two e2m1 codes per byte, element 2i in the low nibble;
* ``kv_cache_sf``: the tuple of their e4m3 block scales (P, K, page, D/16), one per 16
  features, paged with the codes (a plain row-major layout, not a swizzled one);
* ``workspace_buffer`` (zeros, uint8), ``block_tables`` (B, pages per sequence) int32,
  ``seq_lens`` (B,) int32: each sequence's real key count (the case's ``kv_lengths``, else S),
  ``max_seq_len`` = S, ``q_len_per_req`` = L;
* ``bmm1_scale`` = q_scale * k_scale * sm_scale and ``bmm2_scale`` = v_scale (floats): the
  tensor's one global scale folded into the two products.

Pages hold 16 positions, stored in reverse order behind one unused page; every slot no
sequence owns holds code 0 with a NaN scale (0x7F). It returns out (B * L, H, E) and no lse.
NVFP4 with one global scale per tensor only: a case whose ``k_descale`` or ``v_descale``
differ between (batch, kv head) is not expressible (FlashInfer's and TensorRT-LLM's caches
carry one per tensor), nor MXFP4 nor an fp4 q.

Examples
--------
>>> import numpy as np
>>> hnd = to_hnd(np.zeros((5, 16, 2, 8)))
>>> hnd.shape
(5, 2, 16, 8)
"""

from __future__ import annotations

import numpy as np

from oracle.conventions.expressible import NOT_EXPRESSIBLE
from oracle.conventions.layouts_fp4 import FP4_PAGE, pack_low_first

__all__ = ["trtllm_fp4_layout", "to_hnd", "WORKSPACE_BYTES"]

#: The workspace handed to the kernel (FlashInfer's tests allocate 128 MiB, zeroed).
WORKSPACE_BYTES = 128 * 1024 * 1024
_NAN_E4M3 = 0x7F


def _refuse(reason):
    raise NotImplementedError(f"trtllm_batch_decode_with_kv_cache: {NOT_EXPRESSIBLE}: {reason}")


def to_hnd(cache) -> np.ndarray:
    """(P, page, K, X) -> (P, K, page, X): FlashInfer's HND page layout."""
    return np.ascontiguousarray(np.swapaxes(cache, 1, 2))


def _one_scale(options, name):
    descale = options.get(name)
    if descale is None:
        _refuse(f"{name} missing (an NVFP4 cache has one global scale per tensor)")
    values = np.unique(np.asarray(descale, dtype=np.float64))
    if values.size != 1:
        _refuse(
            f"{name} differs between (batch, kv head) ({values.size} values): FlashInfer's and "
            f"TensorRT-LLM's NVFP4 caches carry one global scale per tensor"
        )
    return float(values[0])


def _paged(array, table, pages, lengths, fill):
    batch = array.shape[0]
    cache = np.full((pages, FP4_PAGE, array.shape[1], array.shape[-1]), fill, array.dtype)
    seq = np.swapaxes(array, 1, 2)  # (B, S, K, X)
    for b in range(batch):
        for p in range(table.shape[1]):
            chunk = seq[b, p * FP4_PAGE : min((p + 1) * FP4_PAGE, lengths[b])]
            cache[table[b, p], : len(chunk)] = chunk
    return to_hnd(cache)


def _check(q, k, v, options):
    for name in ("mask", "bias", "dropout_mask", "qv", "key_indices", "key_block_indices"):
        if options.get(name) is not None:
            _refuse(f"{name} (the decode takes no per-position arrays)")
    names = [np.asarray(x).dtype.name for x in (q, k, v)]
    if names[1:] != ["float4_e2m1fn"] * 2 or names[0] == "float4_e2m1fn":
        _refuse(f"an NVFP4 k, v cache and an unquantised q (q, k, v are {names})")
    scale = np.asarray(options["k_block_scale"])
    if scale.dtype.name != "float8_e4m3fn" or k.shape[-1] != 16 * scale.shape[-1]:
        _refuse("NVFP4 only (e4m3 scales over 16 features); MXFP4 caches are not taken")
    if np.ndim(q) != 4:
        _refuse("batched (B, H, L, D) inputs")


def trtllm_fp4_layout(q, k, v, options):
    """(args, kwargs, unpack) of the trtllm-fp4 convention for bhld NumPy inputs."""
    _check(q, k, v, options)
    batch, heads, rows, dim = q.shape
    keys = k.shape[-2]
    k_scale, v_scale = _one_scale(options, "k_descale"), _one_scale(options, "v_descale")
    lengths = options.get("kv_lengths")
    lengths = np.full(batch, keys) if lengths is None else np.broadcast_to(lengths, (batch,))
    lengths = np.asarray(lengths, dtype=np.int32).copy()
    per_seq = -(-keys // FP4_PAGE)
    pages = batch * per_seq + 1  # page 0 is never used
    table = pages - 1 - (np.arange(batch)[:, None] * per_seq + np.arange(per_seq)[None, :])
    caches, scales = [], []
    for name, x in (("k", k), ("v", v)):
        scale = np.asarray(options[f"{name}_block_scale"])
        nan = np.array(_NAN_E4M3, np.uint8).view(scale.dtype)
        caches.append(_paged(pack_low_first(x), table, pages, lengths, 0))
        scales.append(_paged(scale, table, pages, lengths, nan))
    sm_scale = options.get("scale")
    sm_scale = dim**-0.5 if sm_scale is None else float(sm_scale)
    skip = ("k_descale", "v_descale", "k_block_scale", "v_block_scale", "kv_lengths", "scale")
    kwargs = {n: x for n, x in options.items() if n not in skip}
    kwargs.update(
        kv_cache=tuple(caches),
        kv_cache_sf=tuple(scales),
        workspace_buffer=np.zeros(WORKSPACE_BYTES, np.uint8),
        block_tables=table.astype(np.int32),
        seq_lens=lengths,
        max_seq_len=int(keys),
        bmm1_scale=1.0 * k_scale * sm_scale,  # q_scale = 1: the query is not quantised
        bmm2_scale=v_scale,
        q_len_per_req=int(rows),
    )
    query = np.ascontiguousarray(np.swapaxes(q, 1, 2).reshape(batch * rows, heads, dim))

    def unpack(x, what):
        x = np.asarray(x)
        if what == "lse":
            return x
        return np.ascontiguousarray(x.reshape(batch, rows, heads, -1).transpose(0, 2, 1, 3))

    return (query,), kwargs, unpack
