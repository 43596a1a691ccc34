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


def _unpack(packed, high_first=False):
    """e2m1 codes (..., 2 W) of packed bytes (..., W)."""
    packed = np.asarray(packed, dtype=np.uint8)
    low, high = packed & 0x0F, packed >> 4
    first, second = (high, low) if high_first else (low, high)
    return np.stack([first, second], axis=-1).reshape(packed.shape[:-1] + (-1,))


def _gather(cache, table, keys):
    """(B, K, S, X) of a paged cache (P, page, K, X) along the block table."""
    pages = cache[table]  # (B, per_seq, page, K, X)
    seq = pages.reshape(table.shape[0], -1, *cache.shape[2:])[:, :keys]
    return np.swapaxes(seq, 1, 2)


def _make_paged(high_first=False):
    def impl(q, k_cache, v_cache, *, block_table, cache_seqlens, **options):
        keys = int(np.max(cache_seqlens))
        f4 = np.dtype(ml_dtypes.float4_e2m1fn)
        args = {}
        for name, cache in (("k", k_cache), ("v", v_cache)):
            codes = _unpack(_gather(cache, block_table, keys), high_first)
            args[name] = codes.view(f4)
            args[f"{name}_block_scale"] = _gather(
                options.pop(f"{name}_block_scale"), block_table, keys
            )
        if np.any(np.asarray(cache_seqlens) != keys):  # per-row lengths: past S_b excluded
            options["kv_lengths"] = np.asarray(cache_seqlens)
        if q.dtype == np.uint8:
            q = _unpack(q, high_first).view(f4)
            options["q_block_scale"] = np.swapaxes(options["q_block_scale"], 1, 2)
        q = np.swapaxes(q, 1, 2)
        result = _make()(q, args["k"], args["v"], **_scales_of(args), **options)
        if isinstance(result, tuple):
            return np.swapaxes(result[0], 1, 2), result[1]
        return np.swapaxes(result, 1, 2)

    impl.__name__ = "fp4_paged_high_first" if high_first else "fp4_paged"
    return impl


def _scales_of(args):
    return {n: x for n, x in args.items() if n.endswith("_block_scale")}


#: the fp4-paged convention read correctly / with the nibbles of each byte swapped
fp4_paged = _make_paged()
fp4_paged_high_first = _make_paged(high_first=True)
