"""Named alternatives of sparse key selection (docs/conventions.md, "Sparse key indices").

Each is the set refattn pins, read the way a real kernel gets it wrong, evaluated by the
oracle's textbook like every alternative of :mod:`oracle.diagnose.diagnosis`:

* a sentinel clamped to key 0 by a gather (key 0 then enters once per -1 slot: the clamp and
  the multiset reading together);
* a sentinel read as a key (-1 wrapping to key S - 1 as a Python/gather index does, or
  clamped to key 0); past-the-end entries clamped to key S - 1;
* duplicates counted twice (a plain gather: a position listed n times has weight
  ``n e^t / sum``, modelled exactly as a bias ``+ log n`` on the listed set);
* an index off by one (1-based positions, or 0-based read as 1-based);
* block numbers read as token indices;
* for lse (:func:`sparse_lse_models`): lse = +inf on rows with no valid key (FlashMLA's sparse
  decode convention) instead of -inf.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["sparse_alternatives", "sparse_lse_models"]


def _with_indices(change):
    def apply(options, extras):
        idx = np.asarray(options["key_indices"]).astype(np.int64)
        return {**options, "key_indices": change(idx)}, extras

    return apply


def _then(first, second):
    """One alternative's change after another's."""

    def apply(options, extras):
        return second(*first(options, extras))

    return apply


def _blocks_as_tokens(options, extras):
    rest = {n: x for n, x in options.items() if n not in ("key_block_indices", "key_block_size")}
    return {**rest, "key_indices": np.asarray(options["key_block_indices"])}, extras


def _counted_twice(H, L, S):
    """The multiset reading as the set plus a bias ``log n_ij`` (n_ij the times listed)."""

    def apply(options, extras):
        idx = np.asarray(options["key_indices"]).astype(np.int64)
        lead = idx.shape[:-3] if idx.ndim >= 4 else ()
        K = idx.shape[-3] if idx.ndim >= 3 else 1
        flat = idx.reshape((-1, K, idx.shape[-2], idx.shape[-1]))
        counts = np.zeros(flat.shape[:2] + (flat.shape[2], S + 1))
        slots = np.where((flat >= 0) & (flat < S), flat, S)
        for index in np.ndindex(*flat.shape[:3]):
            np.add.at(counts[index], slots[index], 1.0)
        counts = counts[..., :S]
        gqa = options.get("gqa") or "interleave"
        reads = np.arange(H) // (H // K) if gqa == "interleave" else np.arange(H) % K
        counts = counts[:, reads]
        extra = np.where(counts > 1, np.log(np.maximum(counts, 1)), 0.0)
        extra = extra.reshape(lead + (H, counts.shape[2], S)) if idx.ndim >= 4 else extra[0, 0]
        bias = options.get("bias")
        merged = extra if bias is None else np.asarray(bias, np.float64) + extra
        return {**options, "bias": merged}, extras

    return apply


def sparse_alternatives(options, *, H, L, S, alternative) -> list:
    """The sparse alternatives that apply to a case with these options (``alternative`` is
    :class:`oracle.diagnose.diagnosis.Alternative`)."""
    found = []
    if options.get("key_indices") is not None:
        idx = np.asarray(options["key_indices"])
        keys = frozenset({"key_indices"})
        if (idx < 0).any():
            found.append(
                alternative(
                    "sentinel read as a key (-1 wraps to key S - 1)",
                    keys,
                    _with_indices(lambda i: np.where(i < 0, i % S, i)),
                )
            )
            found.append(
                alternative(
                    "sentinel read as a key (clamped to key 0)",
                    keys,
                    _with_indices(lambda i: np.maximum(i, 0)),
                )
            )
            found.append(
                alternative(
                    "sentinel clamped to key 0 by a gather (key 0 counted once per -1 slot)",
                    frozenset({"key_indices", "bias"}),
                    _then(_with_indices(lambda i: np.maximum(i, 0)), _counted_twice(H, L, S)),
                )
            )
        if (idx >= S).any():
            found.append(
                alternative(
                    "past-the-end indices clamped to key S - 1",
                    keys,
                    _with_indices(lambda i: np.where(i >= S, S - 1, i)),
                )
            )
        found.append(
            alternative(
                "duplicates counted twice (a plain gather, the multiset reading)",
                frozenset({"key_indices", "bias"}),
                _counted_twice(H, L, S),
            )
        )
        for shift, label in ((-1, "1-based indices (key idx - 1)"), (1, "key idx + 1")):
            found.append(
                alternative(
                    f"index off by one ({label})",
                    keys,
                    _with_indices(lambda i, s=shift: np.where((i >= 0) & (i < S), i + s, -1)),
                )
            )
    if options.get("key_block_indices") is not None:
        found.append(
            alternative(
                "block indices read as token indices",
                frozenset({"key_indices", "key_block_indices"}),
                _blocks_as_tokens,
            )
        )
    return found


def sparse_lse_models(truth: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(label, model lse) of the lse conventions of rows with no valid key."""
    if not np.isneginf(truth).any():
        return []
    label = (
        "lse = +inf on rows with no valid key (FlashMLA's sparse convention; refattn and "
        "merge kernels use -inf)"
    )
    return [(label, np.where(np.isneginf(truth), math.inf, truth))]
