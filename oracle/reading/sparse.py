"""Sparse key selection as the oracle reads a case: the listed set as a mask.

refattn's set reading of ``key_indices`` / ``key_block_indices`` (docs/conventions.md, "Sparse
key indices") is the allowed set intersected with the listed positions; the oracle's textbook
baseline, tolerance and diagnosis take it as one more boolean mask (:func:`indices_as_mask`),
built with refattn's public :mod:`refattn.sparse_indices`.
"""

from __future__ import annotations

import numpy as np

from refattn.sparse_indices import canonical_indices, index_mask

__all__ = ["SPARSE_OPTIONS", "indices_as_mask"]

#: The keywords of sparse key selection an implementation under test receives.
SPARSE_OPTIONS = ("key_indices", "key_block_indices", "key_block_size")


def _with_heads(x):
    x = np.asarray(x)
    return x[None] if x.ndim == 2 else x


def indices_as_mask(q, k, options):
    """``options`` with the sparse keywords replaced by their set as (part of) ``mask``
    (..., H, L, S); unchanged when the case has none. The multiset reading is refattn's
    alternative, never a case's: it is refused here."""
    if all(options.get(name) is None for name in SPARSE_OPTIONS):
        return options
    if (options.get("index_reading") or "set") != "set":
        raise NotImplementedError("the oracle judges the set reading of key indices only")
    q3, k3 = _with_heads(q), _with_heads(k)
    heads, length = q3.shape[-3], q3.shape[-2]
    kv_heads, keys = k3.shape[-3], k3.shape[-2]
    batch_shape = np.broadcast_shapes(q3.shape[:-3], k3.shape[:-3])
    single = np.ndim(q) == 2
    indices = canonical_indices(
        options.get("key_indices"),
        options.get("key_block_indices"),
        options.get("key_block_size"),
        "set",
        batch_shape=batch_shape,
        kv_heads=kv_heads,
        length=length,
        keys=keys,
        single_head=single,
    )
    listed = index_mask(indices, keys)  # (B, K, L, S), flat batch
    gqa = options.get("gqa") or "interleave"
    group = heads // kv_heads
    reads = np.arange(heads) // group if gqa == "interleave" else np.arange(heads) % kv_heads
    listed = listed[:, reads].reshape(tuple(batch_shape) + (heads, length, keys))
    if single:
        listed = listed.reshape(length, keys)
    rest = {n: x for n, x in options.items() if n not in SPARSE_OPTIONS + ("index_reading",)}
    mask = options.get("mask")
    rest["mask"] = listed if mask is None else np.asarray(mask, dtype=bool) & listed
    return rest
