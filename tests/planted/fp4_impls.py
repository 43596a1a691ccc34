"""Planted fp4 implementations: one correct, four that misread NVFP4/MXFP4 block scales.

Each is ``impl(q, k, v, **options)`` in the oracle's calling convention: it dequantises its
fp4 inputs itself (written here from the description in docs/conventions.md, not from
refattn), runs float64 attention on the values and rounds to q's dtype (float32 for fp4 q).
``FP4_BROKEN[name]`` is the diagnosis label each must receive.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import refattn
from oracle.adapters.refattn_numpy import output_dtype, round_to

__all__ = ["FP4_BROKEN", "fp4_correct"]

_BLOCK = {"float8_e4m3fn": 16, "float8_e8m0fnu": 32}


def _scales(x, scale, bug):
    """Per-value float64 scales (..., N, D) of the flat scale memory, as the bug reads it."""
    rows, feats = x.shape[-2], x.shape[-1]
    block = _BLOCK[scale.dtype.name]
    memory = scale.astype(np.float64).reshape(scale.shape[:-2] + (-1,))
    position = np.arange(rows)[:, None]
    feature = np.arange(feats)[None, :]
    if bug == "block":  # the other format's block size, stride and index alike
        block = 48 - block
        index = (position * (feats // block) + feature // block) % memory.shape[-1]
    elif bug == "axis":  # scales stored block-major (..., D / n, N) assumed
        index = (feature // block) * rows + position
    else:
        index = position * (feats // block) + feature // block
    return memory[..., index]


def _make(bug=None):
    def impl(q, k, v, **options):
        out_dtype = output_dtype(q)
        arrays = {"q": q, "k": k, "v": v}
        heads = np.shape(q)[-3]
        kv_heads = np.shape(k)[-3]
        gqa = options.get("gqa") or "interleave"
        for name, x in arrays.items():
            scale = options.pop(f"{name}_block_scale", None)
            descale = options.pop(f"{name}_descale", None)
            if x.dtype != np.dtype(ml_dtypes.float4_e2m1fn):
                continue
            values = x.astype(np.float64)
            if bug == "nibbles":
                values = values.reshape(values.shape[:-1] + (-1, 2))[..., ::-1]
                values = values.reshape(x.shape)
            values = values * _scales(x, scale, bug)
            if descale is not None and bug != "global":
                factor = descale.astype(np.float64)
                if name == "q":
                    group = heads // kv_heads
                    reads = (
                        np.arange(heads) // group
                        if gqa == "interleave"
                        else (np.arange(heads) % kv_heads)
                    )
                    factor = factor[..., reads]
                values = values * factor[..., None, None]
            arrays[name] = values
        result = refattn.attention(arrays["q"], arrays["k"], arrays["v"], **options)
        if isinstance(result, tuple):
            return tuple(round_to(r, out_dtype) for r in result)
        return round_to(result, out_dtype)

    impl.__name__ = f"fp4_{bug or 'correct'}"
    return impl


#: the correct reading (must pass every fp4 case)
fp4_correct = _make()
fp4_block_size_swapped = _make("block")
fp4_scales_wrong_axis = _make("axis")
fp4_global_scale_missing = _make("global")
fp4_nibbles_swapped = _make("nibbles")

#: planted bug -> (implementation, the words its diagnosis must contain)
FP4_BROKEN = {
    "block-size-swapped": (fp4_block_size_swapped, "block scales applied per"),
    "scales-wrong-axis": (fp4_scales_wrong_axis, "block scales along the position axis"),
    "global-scale-missing": (fp4_global_scale_missing, "global scale (descale) missing"),
    "nibbles-swapped": (fp4_nibbles_swapped, "packed nibbles swapped"),
}
