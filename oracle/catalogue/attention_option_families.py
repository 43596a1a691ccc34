"""The attention case families of the options sinks, kv_lengths and float8 inputs."""

from __future__ import annotations

from oracle.catalogue.attention_entry import GRAD, MID, Entry
from oracle.catalogue.case import Shapes
from oracle.catalogue.names import FP8_TRUTH_DTYPES

__all__ = ["option_entries"]


def option_entries(gauss) -> list[Entry]:
    """Cases of the options sinks, kv_lengths and float8 inputs (fp8 cases: bfloat16 only)."""
    e = Entry
    sinks = {**gauss, "sinks": "gaussian"}
    ragged = {**gauss, "kv_lengths": "ragged"}
    br = {"causal": True, "align": "bottom_right"}
    fp8 = {"default": FP8_TRUTH_DTYPES, "full": FP8_TRUTH_DTYPES}
    return [
        e(
            "sinks",
            MID,
            "attention sinks: one logit per head in every row's normaliser",
            recipe=sinks,
        ),
        e(
            "sinks-empty-rows",
            Shapes(1, 2, 2, 9, 11, 16, 16),
            "sinks with fully masked rows (out 0, lse = the sink)",
            options={"empty_rows": "zero"},
            recipe={**sinks, "mask": "empty-rows"},
        ),
        e(
            "sinks-causal-br",
            Shapes(1, 2, 2, 12, 32, 16, 16),
            "sinks, causal bottom_right",
            options=br,
            recipe=sinks,
        ),
        e(
            "sinks-gqa",
            Shapes(1, 8, 2, 12, 20, 16, 16),
            "sinks with GQA (one sink per query head)",
            options={"gqa": "interleave"},
            recipe=sinks,
        ),
        e(
            "kv-lengths",
            Shapes(3, 2, 2, 8, 24, 16, 16),
            "per-row key lengths (a KV cache's cache_seqlens), no causal",
            recipe=ragged,
        ),
        e(
            "kv-lengths-causal-tl",
            Shapes(3, 2, 2, 8, 24, 16, 16),
            "per-row key lengths, causal top_left",
            options={"causal": True, "align": "top_left"},
            recipe=ragged,
        ),
        e(
            "kv-lengths-causal-br",
            Shapes(3, 2, 2, 8, 24, 16, 16),
            "per-row key lengths, causal bottom_right aligned to each row's own length",
            options=br,
            recipe=ragged,
        ),
        e(
            "kv-lengths-zero",
            Shapes(3, 2, 2, 6, 16, 16, 16),
            "per-row key lengths with an empty cache (length 0: empty rows)",
            options={**br, "empty_rows": "zero"},
            recipe={**gauss, "kv_lengths": "ragged-zero"},
        ),
        e(
            "kv-lengths-window",
            Shapes(3, 2, 2, 8, 32, 16, 16),
            "per-row key lengths with a (4, 0) window, bottom_right",
            options={"window": (4, 0), "align": "bottom_right"},
            recipe=ragged,
        ),
        e(
            "sinks-kv-decode",
            Shapes(3, 8, 2, 1, 64, 32, 32),
            "gpt-oss decode: L = 1, GQA, sinks, per-row cache lengths, causal bottom_right",
            options={**br, "gqa": "interleave"},
            recipe={**sinks, "kv_lengths": "ragged"},
        ),
        e(
            "sinks-kv-decode-window",
            Shapes(3, 8, 2, 1, 64, 32, 32),
            "gpt-oss sliding-window decode: sinks, cache lengths, window (16, 0)",
            options={"window": (16, 0), "align": "bottom_right", "gqa": "interleave"},
            recipe={**sinks, "kv_lengths": "ragged"},
        ),
        e(
            "poison-nan-kv-lengths",
            Shapes(3, 2, 2, 4, 12, 8, 8),
            "NaN in k and v beyond each row's key length (an unwritten KV cache)",
            category="robustness",
            options=br,
            recipe={**ragged, "poison": "nan"},
        ),
        e(
            "grad-sinks",
            GRAD,
            "dsinks (and dq, dk, dv) with causal top_left",
            options={"causal": True, "align": "top_left"},
            recipe={**sinks, "grad_lse": True},
            grads=True,
        ),
        e(
            "grad-sinks-empty-rows",
            Shapes(1, 2, 2, 9, 11, 16, 16),
            "dsinks with fully masked rows",
            options={"empty_rows": "zero"},
            recipe={**sinks, "mask": "empty-rows"},
            grads=True,
        ),
        e(
            "grad-kv-lengths",
            Shapes(2, 2, 2, 6, 12, 16, 16),
            "gradients with per-row key lengths, causal bottom_right",
            options=br,
            recipe=ragged,
            grads=True,
        ),
        e(
            "grad-sinks-kv-gqa",
            Shapes(2, 4, 2, 4, 12, 16, 16),
            "dsinks with per-row key lengths and GQA",
            options={**br, "gqa": "interleave"},
            recipe={**sinks, "kv_lengths": "ragged", "grad_lse": True},
            grads=True,
        ),
        e(
            "sinks-alibi-causal-br",
            Shapes(1, 4, 2, 8, 20, 16, 16),
            "sinks with ALiBi (no ALiBi term on the sink), causal bottom_right, GQA",
            default=("float32",),
            options={**br, "gqa": "interleave"},
            recipe={**sinks, "alibi": True},
        ),
        e(
            "kv-lengths-alibi-decode",
            Shapes(3, 4, 2, 1, 32, 16, 16),
            "ALiBi decode over per-row cache lengths (distances from each row's own length)",
            default=("bfloat16",),
            options={**br, "gqa": "interleave"},
            recipe={**ragged, "alibi": True},
        ),
        e(
            "grad-sinks-bias-alibi",
            Shapes(2, 2, 2, 4, 10, 16, 16),
            "dsinks and dbias together, with ALiBi and per-row key lengths, causal bottom_right",
            default=("float64",),
            options=br,
            recipe={
                **sinks,
                "bias": "gaussian",
                "alibi": True,
                "kv_lengths": "ragged",
                "grad_lse": True,
            },
            grads=True,
        ),
        e(
            "fp8-e4m3",
            MID,
            "float8_e4m3fn q, k, v with float32 descales, bfloat16 truth",
            recipe={**gauss, "fp8": "e4m3fn"},
            **fp8,
        ),
        e(
            "fp8-e5m2",
            MID,
            "float8_e5m2 q, k, v with float32 descales, bfloat16 truth",
            recipe={**gauss, "fp8": "e5m2"},
            **fp8,
        ),
        e(
            "fp8-e4m3-causal-gqa",
            Shapes(2, 8, 2, 12, 32, 32, 32),
            "float8_e4m3fn, causal bottom_right, GQA, per-(batch, kv head) descales",
            options={**br, "gqa": "interleave"},
            recipe={**gauss, "fp8": "e4m3fn"},
            **fp8,
        ),
        e(
            "fp8-e4m3-sinks-kv-decode",
            Shapes(3, 8, 2, 1, 64, 32, 32),
            "float8_e4m3fn decode with sinks and per-row cache lengths",
            options={**br, "gqa": "interleave"},
            recipe={**sinks, "kv_lengths": "ragged", "fp8": "e4m3fn"},
            **fp8,
        ),
    ]
