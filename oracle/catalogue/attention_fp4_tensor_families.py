"""The attention case families of NVFP4 inputs with ONE global scale per tensor (beside the
per-(batch, kv head) ones of :mod:`oracle.catalogue.attention_fp4_families`): what
FlashInfer's and TensorRT-LLM's NVFP4 KV caches express (``bmm1_scale`` = q_scale * k_scale *
sm_scale, ``bmm2_scale`` = v_scale), so a decode kernel on such a cache can be validated as
shipped (``--signature flashinfer_trtllm_decode``). The ``*_descale`` arrays keep their
(batch, K) shape, every entry the tensor's one scale.

An implementation that reads the scales per 32 features instead of 16, or swaps the two
nibbles of each byte, fails them.
"""

from __future__ import annotations

from oracle.catalogue.attention_entry import Entry
from oracle.catalogue.case import Shapes
from oracle.catalogue.names import FP4_TRUTH_DTYPES

__all__ = ["fp4_tensor_entries"]


def fp4_tensor_entries(gauss) -> list[Entry]:
    """NVFP4 decode rows over ragged cache lengths (GQA 4, D 128 and 64), a wider GQA decode,
    and a scale-collapse decode, each with one global scale per tensor."""
    e = Entry
    dtypes = {"default": FP4_TRUTH_DTYPES, "full": FP4_TRUTH_DTYPES}
    decode = {"causal": True, "align": "bottom_right", "gqa": "interleave"}
    recipe = {**gauss, "fp4": "nvfp4", "fp4_global": "tensor"}
    return [
        e(
            "fp4-nvfp4-tensor-decode-kv",
            Shapes(batch=3, H=8, K=2, L=1, S=40, D=128, E=128),
            "NVFP4 k, v with one global scale per tensor: decode over ragged cache lengths",
            options=decode,
            recipe={**recipe, "kv_lengths": "ragged"},
            **dtypes,
        ),
        e(
            "fp4-nvfp4-tensor-decode-d64",
            Shapes(batch=2, H=8, K=1, L=1, S=48, D=64, E=64),
            "NVFP4 one-scale-per-tensor decode, D 64, MQA",
            options=decode,
            recipe=recipe,
            **dtypes,
        ),
        e(
            "fp4-nvfp4-tensor-decode-collapse",
            Shapes(batch=2, H=4, K=2, L=1, S=36, D=128, E=128),
            "NVFP4 one-scale-per-tensor decode, half the positions 2**-14 smaller",
            options=decode,
            recipe={**recipe, "fp4_blocks": "collapse", "kv_lengths": "ragged"},
            **dtypes,
        ),
    ]
