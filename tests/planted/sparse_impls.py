"""Sparse key selection implemented the ways kernels get it wrong (the oracle must catch and
name each), and the correct counterpart that must pass every sparse case.

Each is a plain ``impl(q, k, v, **options)`` computing with the oracle's textbook algorithm in
the case dtype (float32 accumulation for the half types) on the indices as the bug reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import refattn
from oracle.reading.baseline import textbook_attention

__all__ = ["SPARSE_BROKEN", "SparseBroken", "sparse_textbook"]


def _forward(q, k, v, return_lse=False, **options):
    result = textbook_attention(q, k, v, **options)
    return (result.out, result.lse) if return_lse else result.out


def sparse_textbook(q, k, v, **options):
    """Correct: the listed set, intersected with the other restrictions (must pass)."""
    return _forward(q, k, v, **options)


def _shifted(options, change):
    return {**options, "key_indices": change(np.asarray(options["key_indices"], np.int64))}


def sentinel_as_key(q, k, v, **options):
    """-1 used as a gather index: it wraps to key S - 1."""
    keys = np.shape(k)[-2]
    return _forward(q, k, v, **_shifted(options, lambda i: np.where(i < 0, i % keys, i)))


def duplicates_twice(q, k, v, return_lse=False, **options):
    """A plain gather: a key listed twice enters the softmax twice (refattn's multiset
    reading, float64, rounded to the case dtype)."""
    dtype = np.asarray(q).dtype if not np.asarray(q).dtype.name.startswith("float8") else None
    out, lse = refattn.attention(q, k, v, **options, index_reading="multiset", return_lse=True)
    if dtype is not None:
        out, lse = out.astype(dtype), lse.astype(dtype)
    return (out, lse) if return_lse else out


def one_based(q, k, v, **options):
    """Indices read as 1-based positions: key idx - 1."""
    return _forward(q, k, v, **_shifted(options, lambda i: np.where(i >= 0, i - 1, i)))


def blocks_as_tokens(q, k, v, **options):
    """key_block_indices read as token positions (the block size ignored)."""
    rest = {n: x for n, x in options.items() if n not in ("key_block_indices", "key_block_size")}
    return _forward(q, k, v, **rest, key_indices=options["key_block_indices"])


def lse_plus_inf(q, k, v, return_lse=False, **options):
    """Correct out, but lse = +inf on rows with no valid key (FlashMLA's sparse decode)."""
    result = textbook_attention(q, k, v, **options)
    lse = np.where(np.isneginf(result.lse), np.inf, result.lse).astype(result.lse.dtype)
    return (result.out, lse) if return_lse else result.out


@dataclass(frozen=True)
class SparseBroken:
    impl: object
    cases: tuple  # fnmatch patterns over case names
    diagnosis: str


SPARSE_BROKEN = {
    "sentinel_as_key": SparseBroken(
        sentinel_as_key,
        (
            "sparse-sentinels-*-f32",
            "sparse-sentinels-*-f64",
            "sparse-causal-br-*-f32",
            "sparse-empty-rows-*-f32",
            "sparse-empty-rows-*-f64",
        ),
        "sentinel read as a key",
    ),
    "duplicates_twice": SparseBroken(
        duplicates_twice,
        (
            "sparse-duplicates-*-f32",
            "sparse-duplicates-*-f64",
            "grad-sparse-duplicates-*-f32",
            "grad-sparse-duplicates-*-f64",
            "sparse-duplicates-*-f16",
        ),
        "duplicates counted twice",
    ),
    "one_based": SparseBroken(
        one_based,
        (
            "sparse-topk1-*-f32",
            "sparse-topk64-*-f32",
            "sparse-sentinels-*-f32",
            "sparse-sentinels-*-f64",
            "sparse-duplicates-*-f32",
        ),
        "index off by one",
    ),
    "blocks_as_tokens": SparseBroken(
        blocks_as_tokens,
        ("sparse-blocks64-*-f32", "sparse-blocks64-*-f64", "sparse-blocks64-causal-*-f16"),
        "block indices read as token indices",
    ),
    "lse_plus_inf": SparseBroken(
        lse_plus_inf,
        ("sparse-empty-rows-*", "grad-sparse-duplicates-*-f32"),
        "lse = +inf on rows with no valid key",
    ),
}
