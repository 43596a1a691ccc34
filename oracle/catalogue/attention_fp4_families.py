"""The attention case families of fp4 inputs with block scales (NVFP4, MXFP4)."""

from __future__ import annotations

from oracle.catalogue.attention_entry import Entry
from oracle.catalogue.case import Shapes
from oracle.catalogue.names import FP4_TRUTH_DTYPES

__all__ = ["fp4_entries"]


def fp4_entries(gauss) -> list[Entry]:
    """NVFP4 and MXFP4 k, v (and q) at D 64/128/256, zero and max-magnitude blocks, scale
    collapse, GQA, causal, a decode over ragged cache lengths, gradients; in every output
    dtype of an fp4 kernel (bfloat16, float16, float32)."""
    e = Entry
    dtypes = {"default": FP4_TRUTH_DTYPES, "full": FP4_TRUTH_DTYPES}
    br = {"causal": True, "align": "bottom_right"}
    rows = []
    for fmt in ("nvfp4", "mxfp4"):
        name = fmt.upper()
        recipe = {**gauss, "fp4": fmt}
        for dim in (64, 128, 256):
            rows.append(
                e(
                    f"fp4-{fmt}-d{dim}",
                    Shapes(batch=1, H=4, K=2, L=6, S=24, D=dim, E=dim),
                    f"{name} k, v with block scales, D = {dim}, GQA",
                    options={"gqa": "interleave"},
                    recipe=recipe,
                    **dtypes,
                )
            )
        rows += [
            e(
                f"fp4-{fmt}-zero-max-blocks",
                Shapes(batch=1, H=2, K=2, L=5, S=18, D=128, E=128),
                f"{name}: all-zero blocks and blocks at the largest code and scale",
                recipe={**recipe, "fp4_blocks": "zero-max"},
                **dtypes,
            ),
            e(
                f"fp4-{fmt}-scale-collapse",
                Shapes(batch=1, H=2, K=2, L=5, S=18, D=64, E=64),
                f"{name}: half the positions 2**-14 smaller (block scales collapse)",
                recipe={**recipe, "fp4_blocks": "collapse"},
                **dtypes,
            ),
            e(
                f"fp4-{fmt}-qkv-causal",
                Shapes(batch=1, H=4, K=2, L=8, S=16, D=64, E=64),
                f"{name} q, k and v, causal bottom_right, GQA tile",
                options={**br, "gqa": "tile"},
                recipe={**recipe, "fp4_q": True},
                **dtypes,
            ),
            e(
                f"fp4-{fmt}-decode-kv",
                Shapes(batch=3, H=8, K=2, L=1, S=40, D=128, E=128),
                f"{name} decode over ragged cache lengths",
                options={**br, "gqa": "interleave"},
                recipe={**recipe, "kv_lengths": "ragged"},
                **dtypes,
            ),
            e(
                f"grad-fp4-{fmt}",
                Shapes(batch=1, H=2, K=2, L=4, S=12, D=64, E=64),
                f"{name} gradients (of the dequantised values)",
                recipe={**recipe, "fp4_q": True, "grad_lse": True},
                grads=True,
                **dtypes,
            ),
        ]
    return rows
