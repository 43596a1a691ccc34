"""Inputs of the sparse key selection cases (recipe keys ``key_indices`` and ``key_blocks``).

``key_indices`` (int32 (batch, K, L, T), T = recipe ``topk``): each row's T positions are the
first T of a random permutation of [0, S) (distinct, from :mod:`oracle.catalogue.seeding`'s
uniform stream: bit-identical on every machine), then, by kind --

* ``"topk"``: as drawn;
* ``"sentinels"``: every fourth slot (from the second) is -1 (an unused slot);
* ``"duplicates"``: every odd slot repeats the slot before it (a position listed twice);
* ``"past-end"``: every fourth slot (from the third) is S, S + 7 or 2**30 (ignored);
* ``"empty-rows"``: sentinels, and query rows 0 and 3 (mod 4) of every kv head list only -1
  and S (rows with no valid index);
* kinds join with "+" ("duplicates+empty-rows").

``key_blocks`` (int32 (batch, K, L, T) block numbers, T = recipe ``topk``): the first T of a
random permutation of the ceil(S / s) blocks (s the case's ``key_block_size``), every fourth
slot (from the second) -1.
"""

from __future__ import annotations

import numpy as np

from oracle.catalogue.case import Shapes

__all__ = ["sparse_inputs"]


def _first_of_permutations(stream, name, rows: tuple, count: int, take: int) -> np.ndarray:
    keys = stream.uniform(name, rows + (count,))
    return np.argsort(keys, axis=-1, kind="stable")[..., :take].astype(np.int64)


def _token_indices(stream, n: Shapes, kind: str, take: int) -> np.ndarray:
    idx = _first_of_permutations(stream, "key_indices", (n.batch, n.K, n.L), n.S, take)
    slots = np.arange(take)
    parts = kind.split("+")
    if set(parts) - {"topk", "sentinels", "duplicates", "past-end", "empty-rows"}:
        raise ValueError(f"key_indices recipe: unknown kind {kind!r}")
    if "sentinels" in parts or "empty-rows" in parts:
        idx[..., slots % 4 == 1] = -1
    if "duplicates" in parts:
        idx[..., 1::2] = idx[..., 0:-1:2][..., : idx[..., 1::2].shape[-1]]
    if "past-end" in parts:
        beyond = np.array([n.S, n.S + 7, 2**30])
        chosen = slots[slots % 4 == 2]
        idx[..., chosen] = beyond[np.arange(chosen.size) % 3]
    if "empty-rows" in parts:
        empty = (np.arange(n.L) % 4) % 3 == 0  # rows 0 and 3 (mod 4)
        idx[:, :, empty] = np.where(slots % 2 == 0, -1, n.S)
    return idx


def sparse_inputs(stream, n: Shapes, recipe, options) -> dict[str, np.ndarray]:
    """The sparse inputs the recipe asks for (none without its keys)."""
    inputs = {}
    take = int(recipe.get("topk", 1))
    if recipe.get("key_indices"):
        inputs["key_indices"] = _token_indices(stream, n, recipe["key_indices"], take).astype(
            np.int32
        )
    if recipe.get("key_blocks"):
        size = int(options["key_block_size"])
        nblocks = -(-n.S // size)
        blocks = _first_of_permutations(stream, "key_blocks", (n.batch, n.K, n.L), nblocks, take)
        blocks[..., np.arange(take) % 4 == 1] = -1
        inputs["key_block_indices"] = blocks.astype(np.int32)
    return inputs
