"""The attention case families of MLA-shaped sparse attention: DeepSeek Sparse Attention's
top-2048 selection over a 576-wide latent cache (FlashMLA's ``flash_mla_sparse_fwd``:
D 576 = 512 latent + 64 rope features, E 512 = the latent part read as values, one kv head,
H 64 or 128 query heads, the model scale ``1/sqrt(192)``).

An implementation that scales by the key width (``1/sqrt(576)``), reads a -1 slot as key 0
(a clamped gather), shifts the indices by one or drops the sentinel check fails them. Few and
in bfloat16 only in ``default`` (each holds an 8192-key latent cache, ~9.4 MB); the 65536-key
row is in ``full`` only.

The ``mla-dsa-decode-*`` rows are DSA decode on FlashMLA's paged latent cache
(``flash_mla_with_kvcache(..., indices=)``: ``--signature flashmla_kvcache``): small (top-64 or
128 of at most 320 keys), in float32 and bfloat16, their k on the grid of FlashMLA's 656-byte fp8
cache (recipe ``fp8_latent``: e4m3 nope features with a power-of-two scale per 128, bfloat16
rope), so the cache its sparse decode reads holds the case's values exactly.
"""

from __future__ import annotations

from oracle.catalogue.attention_entry import Entry
from oracle.catalogue.attention_latent_families import MLA_SCALE
from oracle.catalogue.case import Shapes

__all__ = ["mla_sparse_entries", "mla_dsa_decode_entries"]


def mla_sparse_entries(gauss) -> list[Entry]:
    """Top-2048 of 8192 (H 64, two query rows, -1 sentinels), of 8192 with H 128 and causal
    bottom-right (decode rows), and of 65536 (full only)."""
    e = Entry
    bf16 = ("bfloat16",)
    model = {"scale": MLA_SCALE}
    # compact: k (and v, its first 512 columns) regenerated on load, as the long rows are
    recipe = {**gauss, "latent_v": True, "key_indices": "sentinels", "topk": 2048, "compact": True}
    return [
        e(
            "mla-sparse-prefill",
            Shapes(batch=1, H=64, K=1, L=2, S=8192, D=576, E=512),
            "DSA prefill rows: top-2048 of 8192 latent keys (-1 in every fourth slot), H 64, "
            "D 576 / E 512, scale 1/sqrt(192)",
            default=bf16,
            full=bf16,
            options=model,
            recipe=recipe,
        ),
        e(
            "mla-sparse-decode-h128",
            Shapes(batch=1, H=128, K=1, L=1, S=8192, D=576, E=512),
            "DSA decode: top-2048 of 8192 latent keys, H 128, causal bottom_right, "
            "scale 1/sqrt(192)",
            default=bf16,
            full=bf16,
            options={**model, "causal": True, "align": "bottom_right"},
            recipe=recipe,
        ),
        e(
            "mla-sparse-64k",
            Shapes(batch=1, H=64, K=1, L=1, S=65536, D=576, E=512),
            "DSA decode over 65536 latent keys: top-2048, H 64 (full only)",
            default=(),
            full=bf16,
            options=model,
            recipe={**recipe, "key_indices": "topk"},
        ),
    ]


def mla_dsa_decode_entries(gauss) -> list[Entry]:
    """DSA decode rows over a paged 576-wide latent cache on the fp8 cache's grid: top-64 with
    -1 sentinels (H 64) and top-128 of 256 (H 128), FlashMLA's sparse decode head counts; then
    H 16: rows listing no valid key with attention sinks; two sequences of ragged lengths with
    causal bottom-right, duplicates and past-the-end entries."""
    e = Entry
    dtypes = ("float32", "bfloat16")
    model = {"scale": MLA_SCALE}
    recipe = {**gauss, "latent_v": True, "fp8_latent": True, "topk": 64}
    return [
        e(
            "mla-dsa-decode",
            Shapes(batch=1, H=64, K=1, L=2, S=320, D=576, E=512),
            "DSA decode on a paged latent cache: top-64 of 320 keys (-1 in every fourth slot), "
            "H 64, D 576 / E 512, scale 1/sqrt(192)",
            default=dtypes,
            full=dtypes,
            options=model,
            recipe={**recipe, "key_indices": "sentinels"},
        ),
        e(
            "mla-dsa-decode-h128",
            Shapes(batch=1, H=128, K=1, L=1, S=256, D=576, E=512),
            "DSA decode with DeepSeek-V3.2's 128 heads: one row, top-128 of 256 latent keys",
            default=dtypes,
            full=dtypes,
            options=model,
            recipe={**recipe, "key_indices": "topk", "topk": 128},
        ),
        e(
            "mla-dsa-decode-sinks",
            Shapes(batch=1, H=16, K=1, L=4, S=192, D=576, E=512),
            "DSA decode with attention sinks; rows 0 and 3 list no valid key (out 0)",
            default=dtypes,
            full=dtypes,
            options={**model, "empty_rows": "zero"},
            recipe={**recipe, "key_indices": "empty-rows", "sinks": True},
        ),
        e(
            "mla-dsa-decode-ragged",
            Shapes(batch=2, H=16, K=1, L=2, S=256, D=576, E=512),
            "DSA decode of two sequences of ragged cache lengths, causal bottom-right, "
            "duplicated and past-the-end indices",
            default=dtypes,
            full=dtypes,
            options={**model, "causal": True, "align": "bottom_right"},
            recipe={**recipe, "key_indices": "duplicates+past-end", "kv_lengths": "ragged"},
        ),
    ]
