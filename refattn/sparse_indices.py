"""Sparse key selection: token-level top-k key indices and block-sparse key blocks.

The index half of the allowed set (docs/conventions.md, "Sparse key indices"):

* ``key_indices`` (B, K, L, T) integer, refattn's bhld order, one list per batch row, kv head
  and query row (DeepSeek Sparse Attention's top-k indexer output, FlashMLA's sparse
  ``indices``): row i of every query head reading kv head g may attend to the *set*
  ``I_{b,g,i} = {idx[b, g, i, t] : 0 <= idx[b, g, i, t] < S}``; entries < 0 (the -1 sentinel)
  or >= S are ignored and a position listed twice counts once. The set is intersected with
  every other restriction (mask, causal, window, kv_lengths, -inf bias); sinks are unchanged.
* ``key_block_indices`` (B, K, L, T) with ``key_block_size`` s (NSA's selected blocks, MoBA's
  gated blocks): the union of the blocks ``[c s, (c + 1) s)`` (clipped to S) of the listed
  block numbers c, i.e. exactly the token indices ``c s + r`` for ``0 <= r < s``
  (:func:`expand_blocks`); block numbers < 0 or with ``c s >= S`` are ignored.
* ``index_reading="multiset"``: what a plain gather kernel computes when it reads the listed
  keys without removing duplicates: a position listed n times enters the softmax n times
  (weight ``n e^{t_ij} / sum``); see :mod:`refattn.sparse_multiset`.

This module validates the indices and states the set as a boolean (B, K, L, S) mask (the
canonical spec ANDs it into its mask, so every path reads it through the one allowed-set rule).
"""

from __future__ import annotations

import numpy as np

from . import _checks

__all__ = ["INDEX_READINGS", "canonical_indices", "expand_blocks", "index_mask"]

INDEX_READINGS = ("set", "multiset")


def _integer_array(x, name: str) -> np.ndarray:
    arr = _checks.as_array(x, name)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{name}: expected an integer array of key positions, got dtype {arr.dtype.name} "
            f"with shape {arr.shape}"
        )
    if arr.ndim == 0:
        raise ValueError(f"{name}: expected an array (..., K, L, T), got a scalar")
    return arr


def _as_int64(arr: np.ndarray, limit: int) -> np.ndarray:
    """``arr`` as int64 with every entry outside [0, limit) replaced by -1 (uint64 values
    beyond int64 and negative values alike are 'not a position')."""
    if arr.dtype.kind == "u":
        arr = np.minimum(arr, np.uint64(limit)).astype(np.int64)
    else:
        arr = arr.astype(np.int64)
    return np.where((arr >= 0) & (arr < limit), arr, -1)


def expand_blocks(blocks, block_size: int, keys: int) -> np.ndarray:
    """Token indices (..., T * s) of the key blocks (..., T) of size s over S keys: block c
    lists ``c s + r`` for ``0 <= r < s`` (positions >= S and invalid blocks become -1).

    Examples
    --------
    >>> expand_blocks(np.array([[1, -1]]), 2, 3).tolist()
    [[2, -1, -1, -1]]
    """
    nblocks = -(-keys // block_size)
    blocks = _as_int64(np.asarray(blocks), nblocks)
    tokens = blocks[..., None] * block_size + np.arange(block_size, dtype=np.int64)
    tokens = np.where((blocks[..., None] >= 0) & (tokens < keys), tokens, -1)
    return tokens.reshape(blocks.shape[:-1] + (blocks.shape[-1] * block_size,))


def _block_size(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"key_block_size: expected a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"key_block_size: expected a positive int, got {value}")
    return int(value)


def canonical_indices(
    key_indices,
    key_block_indices,
    key_block_size,
    index_reading,
    *,
    batch_shape: tuple,
    kv_heads: int,
    length: int,
    keys: int,
    single_head: bool,
):
    """The validated indices as int64 (B, K, L, T) (flat batch, -1 for every ignored entry),
    or None when neither ``key_indices`` nor ``key_block_indices`` is given."""
    _checks.choice(index_reading, "index_reading", INDEX_READINGS)
    if key_block_size is not None and key_block_indices is None:
        raise ValueError("key_block_size: given without key_block_indices")
    if key_indices is None and key_block_indices is None:
        return None
    if key_indices is not None and key_block_indices is not None:
        raise ValueError(
            "key_indices, key_block_indices: give one of them (expand the blocks to token "
            "indices to combine both)"
        )
    name = "key_indices" if key_indices is not None else "key_block_indices"
    arr = _integer_array(key_indices if key_indices is not None else key_block_indices, name)
    lead = () if single_head else tuple(batch_shape) + (kv_heads,)
    target = lead + (length, arr.shape[-1])
    letters = "(L, T)" if single_head else "(..., K, L, T)"
    arr = _checks.broadcast(arr, target, name, letters)
    if key_block_indices is not None:
        if key_block_size is None:
            raise ValueError("key_block_indices: needs key_block_size (the keys per block)")
        arr = expand_blocks(arr, _block_size(key_block_size), keys)
    else:
        arr = _as_int64(arr, keys)
    flat = int(np.prod(batch_shape)) if batch_shape else 1
    return arr.reshape((flat, kv_heads, length, arr.shape[-1]))


def index_mask(indices: np.ndarray, keys: int) -> np.ndarray:
    """The set reading of canonical indices (B, K, L, T): bool (B, K, L, S), True where the
    position is listed at least once.

    Examples
    --------
    >>> index_mask(np.array([[[[2, -1, 2]]]]), 4).astype(int).tolist()
    [[[[0, 0, 1, 0]]]]
    """
    batch, kv_heads, length, count = indices.shape
    # one spare column receives every ignored entry (-1), then is dropped
    listed = np.zeros((batch, kv_heads, length, keys + 1), dtype=bool)
    slots = np.where(indices >= 0, indices, keys)
    np.put_along_axis(listed, slots, True, axis=-1)
    return listed[..., :keys]
