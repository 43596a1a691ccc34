"""The attention case families of sparse key selection: token-level top-k ``key_indices``
(DeepSeek Sparse Attention, FlashMLA's sparse kernels) and block-sparse
``key_block_indices`` (NSA, MoBA), in refattn's set reading (docs/conventions.md, "Sparse key
indices"); inputs from :mod:`oracle.catalogue.attention_sparse_inputs`."""

from __future__ import annotations

from oracle.catalogue.attention_entry import Entry
from oracle.catalogue.case import Shapes
from oracle.catalogue.names import FP8_TRUTH_DTYPES

__all__ = ["sparse_entries"]


def sparse_entries(gauss) -> list[Entry]:
    """Top-k with T in {1, 64, 2048} over S up to 8192 (few query rows for the long ones),
    sentinels, duplicates, past-the-end entries, empty rows, indices with causal and
    kv_lengths, 64-key blocks, gradients, fp8 decode."""
    e = Entry
    br = {"causal": True, "align": "bottom_right"}

    def topk(kind, t):
        return {**gauss, "key_indices": kind, "topk": t}

    blocks = {**gauss, "key_blocks": True, "topk": 4}
    return [
        e(
            "sparse-topk1",
            Shapes(batch=1, H=4, K=1, L=4, S=256, D=32, E=32),
            "top-1 key per row",
            recipe=topk("topk", 1),
        ),
        e(
            "sparse-topk64",
            Shapes(batch=2, H=4, K=2, L=8, S=512, D=32, E=32),
            "top-64 keys per (batch, kv head, row), GQA",
            recipe=topk("topk", 64),
        ),
        e(
            "sparse-topk2048-decode",
            Shapes(batch=1, H=8, K=1, L=2, S=8192, D=32, E=32),
            "DSA-style decode: 2048 of 8192 keys, one kv head shared by 8 query heads",
            recipe=topk("topk", 2048),
        ),
        e(
            "sparse-sentinels",
            Shapes(batch=1, H=4, K=2, L=8, S=64, D=16, E=16),
            "top-16 with -1 sentinels in every fourth slot (ignored)",
            recipe=topk("sentinels", 16),
        ),
        e(
            "sparse-duplicates",
            Shapes(batch=1, H=4, K=2, L=8, S=64, D=16, E=16),
            "top-16 with every position listed twice (a set: counted once)",
            recipe=topk("duplicates", 16),
        ),
        e(
            "sparse-past-end",
            Shapes(batch=1, H=4, K=2, L=8, S=64, D=16, E=16),
            "top-16 with entries S, S + 7, 2**30 (ignored)",
            recipe=topk("past-end", 16),
        ),
        e(
            "sparse-empty-rows",
            Shapes(batch=1, H=4, K=2, L=8, S=64, D=16, E=16),
            "rows listing only -1 and S (no valid index: out 0, lse -inf)",
            options={"empty_rows": "zero"},
            recipe=topk("empty-rows", 8),
        ),
        e(
            "sparse-causal-br",
            Shapes(batch=1, H=4, K=2, L=16, S=128, D=16, E=16),
            "top-32 drawn over all keys, intersected with causal bottom_right",
            options=br,
            recipe=topk("sentinels", 32),
        ),
        e(
            "sparse-kv-lengths",
            Shapes(batch=3, H=4, K=1, L=2, S=256, D=32, E=32),
            "decode over per-row cache lengths with top-64 (indices past S_b ignored)",
            options=br,
            recipe={**topk("topk", 64), "kv_lengths": "ragged"},
        ),
        e(
            "sparse-blocks64",
            Shapes(batch=1, H=4, K=2, L=8, S=1000, D=32, E=32),
            "4 of 16 key blocks of 64 (the last one partial), -1 in every fourth slot",
            options={"key_block_size": 64},
            recipe=blocks,
        ),
        e(
            "sparse-blocks64-causal",
            Shapes(batch=1, H=4, K=1, L=16, S=512, D=16, E=16),
            "64-key blocks intersected with causal bottom_right",
            options={**br, "key_block_size": 64},
            recipe=blocks,
        ),
        e(
            "grad-sparse-topk",
            Shapes(batch=1, H=4, K=2, L=6, S=48, D=16, E=16),
            "gradients with top-8 indices, sentinels, causal bottom_right",
            options=br,
            recipe={**topk("sentinels", 8), "grad_lse": True},
            grads=True,
        ),
        e(
            "grad-sparse-duplicates",
            Shapes(batch=1, H=2, K=1, L=6, S=32, D=16, E=16),
            "gradients with duplicated indices (counted once) and an empty row",
            options={"empty_rows": "zero"},
            recipe={**topk("duplicates+empty-rows", 6), "grad_lse": True},
            grads=True,
        ),
        e(
            "grad-sparse-blocks64",
            Shapes(batch=1, H=2, K=1, L=4, S=256, D=16, E=16),
            "gradients with 64-key blocks",
            options={"key_block_size": 64},
            recipe=blocks,
            grads=True,
        ),
        e(
            "fp8-e4m3-sparse-decode",
            Shapes(batch=1, H=8, K=1, L=2, S=512, D=64, E=64),
            "float8_e4m3fn decode with top-64 indices (FlashMLA's fp8 KV cache)",
            recipe={**topk("sentinels", 64), "fp8": "e4m3fn"},
            default=FP8_TRUTH_DTYPES,
            full=FP8_TRUTH_DTYPES,
        ),
    ]
