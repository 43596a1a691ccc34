"""The attention case families of the options sinks, kv_lengths and float8 inputs."""

from __future__ import annotations

from oracle.catalogue.attention_entry import GRAD, MID, Entry
from oracle.catalogue.case import Shapes
from oracle.catalogue.names import FP8_TRUTH_DTYPES

__all__ = ["option_entries"]


def option_entries(gauss) -> list[Entry]:
    """Cases of the options sinks, kv_lengths and float8 inputs (fp8 cases: bfloat16 only)."""
    return [
        *sink_rows(gauss),
        *kv_length_rows(gauss),
        *option_gradient_rows(gauss),
        *combination_rows(gauss),
        *fp8_rows(gauss),
    ]


def sink_rows(gauss) -> list[Entry]:
    """Attention sinks: one extra logit per head in every normaliser."""
    e = Entry
    sinks = {**gauss, "sinks": "gaussian"}
    br = {"causal": True, "align": "bottom_right"}
    return [
        e(
            "sinks",
            MID,
            "attention sinks: one logit per head in every row's normaliser",
            recipe=sinks,
        ),
        e(
            "sinks-empty-rows",
            Shapes(batch=1, H=2, K=2, L=9, S=11, D=16, E=16),
            "sinks with fully masked rows (out 0, lse = the sink)",
            options={"empty_rows": "zero"},
            recipe={**sinks, "mask": "empty-rows"},
        ),
        e(
            "sinks-causal-br",
            Shapes(batch=1, H=2, K=2, L=12, S=32, D=16, E=16),
            "sinks, causal bottom_right",
            options=br,
            recipe=sinks,
        ),
        e(
            "sinks-gqa",
            Shapes(batch=1, H=8, K=2, L=12, S=20, D=16, E=16),
            "sinks with GQA (one sink per query head)",
            options={"gqa": "interleave"},
            recipe=sinks,
        ),
    ]


def kv_length_rows(gauss) -> list[Entry]:
    """Per-row key lengths (a KV cache), alone and with sinks in a decode."""
    e = Entry
    sinks = {**gauss, "sinks": "gaussian"}
    ragged = {**gauss, "kv_lengths": "ragged"}
    br = {"causal": True, "align": "bottom_right"}
    return [
        e(
            "kv-lengths",
            Shapes(batch=3, H=2, K=2, L=8, S=24, D=16, E=16),
            "per-row key lengths (a KV cache's cache_seqlens), no causal",
            recipe=ragged,
        ),
        e(
            "kv-lengths-causal-tl",
            Shapes(batch=3, H=2, K=2, L=8, S=24, D=16, E=16),
            "per-row key lengths, causal top_left",
            options={"causal": True, "align": "top_left"},
            recipe=ragged,
        ),
        e(
            "kv-lengths-causal-br",
            Shapes(batch=3, H=2, K=2, L=8, S=24, D=16, E=16),
            "per-row key lengths, causal bottom_right aligned to each row's own length",
            options=br,
            recipe=ragged,
        ),
        e(
            "kv-lengths-zero",
            Shapes(batch=3, H=2, K=2, L=6, S=16, D=16, E=16),
            "per-row key lengths with an empty cache (length 0: empty rows)",
            options={**br, "empty_rows": "zero"},
            recipe={**gauss, "kv_lengths": "ragged-zero"},
        ),
        e(
            "kv-lengths-window",
            Shapes(batch=3, H=2, K=2, L=8, S=32, D=16, E=16),
            "per-row key lengths with a (4, 0) window, bottom_right",
            options={"window": (4, 0), "align": "bottom_right"},
            recipe=ragged,
        ),
        e(
            "sinks-kv-decode",
            Shapes(batch=3, H=8, K=2, L=1, S=64, D=32, E=32),
            "gpt-oss decode: L = 1, GQA, sinks, per-row cache lengths, causal bottom_right",
            options={**br, "gqa": "interleave"},
            recipe={**sinks, "kv_lengths": "ragged"},
        ),
        e(
            "sinks-kv-decode-window",
            Shapes(batch=3, H=8, K=2, L=1, S=64, D=32, E=32),
            "gpt-oss sliding-window decode: sinks, cache lengths, window (16, 0)",
            options={"window": (16, 0), "align": "bottom_right", "gqa": "interleave"},
            recipe={**sinks, "kv_lengths": "ragged"},
        ),
        e(
            "poison-nan-kv-lengths",
            Shapes(batch=3, H=2, K=2, L=4, S=12, D=8, E=8),
            "NaN in k and v beyond each row's key length (an unwritten KV cache)",
            category="robustness",
            options=br,
            recipe={**ragged, "poison": "nan"},
        ),
    ]


def option_gradient_rows(gauss) -> list[Entry]:
    """Gradients with sinks and per-row key lengths (``dsinks``)."""
    e = Entry
    sinks = {**gauss, "sinks": "gaussian"}
    ragged = {**gauss, "kv_lengths": "ragged"}
    br = {"causal": True, "align": "bottom_right"}
    return [
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
            Shapes(batch=1, H=2, K=2, L=9, S=11, D=16, E=16),
            "dsinks with fully masked rows",
            options={"empty_rows": "zero"},
            recipe={**sinks, "mask": "empty-rows"},
            grads=True,
        ),
        e(
            "grad-kv-lengths",
            Shapes(batch=2, H=2, K=2, L=6, S=12, D=16, E=16),
            "gradients with per-row key lengths, causal bottom_right",
            options=br,
            recipe=ragged,
            grads=True,
        ),
        e(
            "grad-sinks-kv-gqa",
            Shapes(batch=2, H=4, K=2, L=4, S=12, D=16, E=16),
            "dsinks with per-row key lengths and GQA",
            options={**br, "gqa": "interleave"},
            recipe={**sinks, "kv_lengths": "ragged", "grad_lse": True},
            grads=True,
        ),
    ]


def combination_rows(gauss) -> list[Entry]:
    """Sinks and key lengths together with ALiBi and bias."""
    e = Entry
    sinks = {**gauss, "sinks": "gaussian"}
    ragged = {**gauss, "kv_lengths": "ragged"}
    br = {"causal": True, "align": "bottom_right"}
    return [
        e(
            "sinks-alibi-causal-br",
            Shapes(batch=1, H=4, K=2, L=8, S=20, D=16, E=16),
            "sinks with ALiBi (no ALiBi term on the sink), causal bottom_right, GQA",
            default=("float32",),
            options={**br, "gqa": "interleave"},
            recipe={**sinks, "alibi": True},
        ),
        e(
            "kv-lengths-alibi-decode",
            Shapes(batch=3, H=4, K=2, L=1, S=32, D=16, E=16),
            "ALiBi decode over per-row cache lengths (distances from each row's own length)",
            default=("bfloat16",),
            options={**br, "gqa": "interleave"},
            recipe={**ragged, "alibi": True},
        ),
        e(
            "grad-sinks-bias-alibi",
            Shapes(batch=2, H=2, K=2, L=4, S=10, D=16, E=16),
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
    ]


def fp8_rows(gauss) -> list[Entry]:
    """Float8 q, k, v with float32 descales (bfloat16 truth only)."""
    e = Entry
    sinks = {**gauss, "sinks": "gaussian"}
    br = {"causal": True, "align": "bottom_right"}
    fp8 = {"default": FP8_TRUTH_DTYPES, "full": FP8_TRUTH_DTYPES}
    return [
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
            Shapes(batch=2, H=8, K=2, L=12, S=32, D=32, E=32),
            "float8_e4m3fn, causal bottom_right, GQA, per-(batch, kv head) descales",
            options={**br, "gqa": "interleave"},
            recipe={**gauss, "fp8": "e4m3fn"},
            **fp8,
        ),
        e(
            "fp8-e4m3-sinks-kv-decode",
            Shapes(batch=3, H=8, K=2, L=1, S=64, D=32, E=32),
            "float8_e4m3fn decode with sinks and per-row cache lengths",
            options={**br, "gqa": "interleave"},
            recipe={**sinks, "kv_lengths": "ragged", "fp8": "e4m3fn"},
            **fp8,
        ),
    ]
