"""The attention case families of MLA-shaped sparse attention: DeepSeek Sparse Attention's
top-2048 selection over a 576-wide latent cache (FlashMLA's ``flash_mla_sparse_fwd``:
D 576 = 512 latent + 64 rope features, E 512 = the latent part read as values, one kv head,
H 64 or 128 query heads, the model scale ``1/sqrt(192)``).

An implementation that scales by the key width (``1/sqrt(576)``), reads a -1 slot as key 0
(a clamped gather), shifts the indices by one or drops the sentinel check fails them. Few and
in bfloat16 only in ``default`` (each holds an 8192-key latent cache, ~9.4 MB); the 65536-key
row is in ``full`` only.
"""

from __future__ import annotations

from oracle.catalogue.attention_entry import Entry
from oracle.catalogue.attention_latent_families import MLA_SCALE
from oracle.catalogue.case import Shapes

__all__ = ["mla_sparse_entries"]


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
