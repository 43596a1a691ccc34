"""The attention case families: semantics, every option, adversarial inputs and gradients.

:func:`entries` lists the rows in catalogue order (the rows of the options sinks, kv_lengths and
float8 inputs, :mod:`oracle.catalogue.attention_option_families`, sit in their place among
them); the kernel-scale rows follow them (:mod:`oracle.catalogue.attention_kernel_families`).
"""

from __future__ import annotations

from oracle.catalogue.attention_entry import ALL, BASE, GRAD, MID, SMALL, Entry
from oracle.catalogue.attention_fp4_families import fp4_entries
from oracle.catalogue.attention_fp4_tensor_families import fp4_tensor_entries
from oracle.catalogue.attention_latent_families import latent_entries
from oracle.catalogue.attention_mla_sparse_families import (
    mla_dsa_decode_entries,
    mla_sparse_entries,
)
from oracle.catalogue.attention_option_families import option_entries
from oracle.catalogue.attention_sigmoid_families import sigmoid_entries
from oracle.catalogue.attention_sparse_families import sparse_entries
from oracle.catalogue.case import Shapes

__all__ = ["entries"]


def entries() -> list[Entry]:
    """Every row of this module and of the option families, in catalogue order."""
    gauss = {"qkv": "gaussian", "sigma": 1.0}
    return [
        *smoke_rows(gauss),
        *shape_rows(gauss),
        *gqa_rows(gauss),
        *causal_window_rows(gauss),
        *softcap_bias_rows(gauss),
        *mask_rows(gauss),
        *dropout_rows(gauss),
        *distribution_rows(gauss),
        *adversarial_rows(gauss),
        *poison_rows(gauss),
        *gradient_rows(gauss),
        # --- sinks, per-row key lengths (KV cache), fp8 inputs ------------------------------
        *option_entries(gauss),
        *sparse_entries(gauss),
        *fp4_entries(gauss),  # NVFP4 / MXFP4 block-scaled inputs
        *fp4_tensor_entries(gauss),  # NVFP4 with one global scale per tensor
        *sigmoid_entries(gauss),
        *latent_entries(gauss),
        *mla_sparse_entries(gauss),  # DSA top-2048 over a 576-wide latent cache
        *mla_dsa_decode_entries(gauss),  # DSA decode on a paged latent cache
        *large_rows(gauss),
    ]


def smoke_rows(gauss: dict) -> list[Entry]:
    """Smoke: one tiny case per headline feature."""
    e = Entry
    return [
        e("basic", SMALL, "Gaussian q, k, v; no options", smoke=ALL, recipe=gauss),
        e(
            "causal-br",
            Shapes(batch=1, H=2, K=2, L=4, S=7, D=8, E=8),
            "causal, bottom_right alignment, L < S",
            smoke=("float32",),
            options={"causal": True, "align": "bottom_right"},
            recipe=gauss,
        ),
        e(
            "gqa-interleave",
            Shapes(batch=1, H=4, K=2, L=5, S=6, D=8, E=8),
            "GQA, query head h reads kv head h//G",
            smoke=("float32",),
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "mask-empty-rows",
            Shapes(batch=1, H=2, K=2, L=6, S=7, D=8, E=8),
            "random mask with fully masked rows, empty_rows='zero'",
            smoke=("float32",),
            options={"empty_rows": "zero"},
            recipe={**gauss, "mask": "empty-rows"},
        ),
        e(
            "grad-bias",
            Shapes(batch=1, H=2, K=2, L=4, S=5, D=8, E=8),
            "gradients incl. dbias",
            smoke=("float64",),
            options={},
            recipe={**gauss, "bias": "gaussian"},
            grads=True,
        ),
    ]


def shape_rows(gauss: dict) -> list[Entry]:
    """Shapes: L versus S, D versus E, decode, long, batch, explicit scale."""
    e = Entry
    return [
        e("basic", BASE, "Gaussian q, k, v; no options", recipe=gauss),
        e(
            "l-gt-s",
            Shapes(batch=1, H=2, K=2, L=40, S=12, D=32, E=32),
            "more queries than keys",
            recipe=gauss,
        ),
        e(
            "l-lt-s",
            Shapes(batch=1, H=2, K=2, L=5, S=97, D=32, E=32),
            "fewer queries than keys",
            recipe=gauss,
        ),
        e(
            "d-ne-e",
            Shapes(batch=1, H=2, K=2, L=12, S=24, D=32, E=16),
            "value dim smaller than key dim",
            recipe=gauss,
        ),
        e(
            "d-ne-e",
            Shapes(batch=1, H=2, K=2, L=12, S=24, D=16, E=48),
            "value dim larger than key dim",
            recipe=gauss,
        ),
        e(
            "decode",
            Shapes(batch=1, H=8, K=2, L=1, S=512, D=64, E=64),
            "single-token GQA decode (L = 1)",
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "long",
            Shapes(batch=1, H=2, K=1, L=4, S=4096, D=32, E=32),
            "4 queries over S = 4096 keys, MQA",
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "long-causal-br",
            Shapes(batch=1, H=4, K=1, L=16, S=4096, D=64, E=64),
            "MQA, 16 queries over S = 4096, causal bottom_right",
            default=(),
            options={"causal": True, "align": "bottom_right", "gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "batch",
            Shapes(batch=3, H=2, K=2, L=8, S=12, D=16, E=16),
            "three batch entries",
            recipe=gauss,
        ),
        e("scale", BASE, "explicit dyadic scale 1/8", options={"scale": 0.125}, recipe=gauss),
        e(
            "scale",
            Shapes(batch=1, H=2, K=2, L=12, S=20, D=16, E=8),
            "explicit non-dyadic scale 0.3",
            options={"scale": 0.3},
            recipe=gauss,
        ),
    ]


def gqa_rows(gauss: dict) -> list[Entry]:
    """GQA and MQA in both head layouts (interleave, tile)."""
    e = Entry
    return [
        e(
            "gqa-interleave",
            Shapes(batch=1, H=8, K=2, L=12, S=20, D=16, E=16),
            "GQA H=8, K=2, interleave",
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "gqa-tile",
            Shapes(batch=1, H=8, K=2, L=12, S=20, D=16, E=16),
            "GQA H=8, K=2, tile (h % K)",
            options={"gqa": "tile"},
            recipe=gauss,
        ),
        e(
            "mqa-interleave",
            Shapes(batch=1, H=4, K=1, L=12, S=20, D=16, E=16),
            "MQA (K = 1), interleave",
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "mqa-tile",
            Shapes(batch=1, H=4, K=1, L=12, S=20, D=16, E=16),
            "MQA (K = 1), tile",
            options={"gqa": "tile"},
            recipe=gauss,
        ),
    ]


def causal_window_rows(gauss: dict) -> list[Entry]:
    """Causal masks in both alignments, empty rows, sliding windows."""
    e = Entry
    return [
        e(
            "causal-tl",
            Shapes(batch=1, H=2, K=2, L=24, S=24, D=32, E=32),
            "causal, top_left, L = S",
            options={"causal": True, "align": "top_left"},
            recipe=gauss,
        ),
        e(
            "causal-tl",
            Shapes(batch=1, H=2, K=2, L=12, S=32, D=16, E=16),
            "causal, top_left, L < S",
            options={"causal": True, "align": "top_left"},
            recipe=gauss,
        ),
        e(
            "causal-br",
            Shapes(batch=1, H=2, K=2, L=12, S=32, D=16, E=16),
            "causal, bottom_right, L < S",
            options={"causal": True, "align": "bottom_right"},
            recipe=gauss,
        ),
        e(
            "causal-tl",
            Shapes(batch=1, H=2, K=2, L=24, S=10, D=16, E=16),
            "causal, top_left, L > S",
            options={"causal": True, "align": "top_left"},
            recipe=gauss,
        ),
        e(
            "causal-br-empty",
            Shapes(batch=1, H=2, K=2, L=12, S=5, D=8, E=8),
            "causal bottom_right with L > S: the first L - S rows are empty (zero)",
            options={"causal": True, "align": "bottom_right", "empty_rows": "zero"},
            recipe=gauss,
        ),
        e(
            "causal-br-empty-nan",
            Shapes(batch=1, H=2, K=2, L=12, S=5, D=8, E=8),
            "causal bottom_right with L > S, empty_rows='nan'",
            options={"causal": True, "align": "bottom_right", "empty_rows": "nan"},
            recipe=gauss,
        ),
        e(
            "window-both",
            Shapes(batch=1, H=2, K=2, L=20, S=20, D=16, E=16),
            "window (3, 2), top_left",
            options={"window": (3, 2), "align": "top_left"},
            recipe=gauss,
        ),
        e(
            "window-both-br",
            Shapes(batch=1, H=2, K=2, L=10, S=28, D=16, E=16),
            "window (2, 2), bottom_right, L < S",
            options={"window": (2, 2), "align": "bottom_right"},
            recipe=gauss,
        ),
        e(
            "window-left",
            Shapes(batch=1, H=2, K=2, L=12, S=24, D=16, E=16),
            "window (4, None), bottom_right",
            options={"window": (4, None), "align": "bottom_right"},
            recipe=gauss,
        ),
        e(
            "window-right",
            Shapes(batch=1, H=2, K=2, L=16, S=16, D=16, E=16),
            "window (None, 1), top_left",
            options={"window": (None, 1), "align": "top_left"},
            recipe=gauss,
        ),
        e(
            "window-causal",
            Shapes(batch=1, H=2, K=2, L=18, S=18, D=16, E=16),
            "causal with a left window of 3",
            options={"causal": True, "window": (3, None), "align": "top_left"},
            recipe=gauss,
        ),
    ]


def softcap_bias_rows(gauss: dict) -> list[Entry]:
    """Softcap, ALiBi and additive bias."""
    e = Entry
    return [
        e(
            "softcap",
            MID,
            "softcap 5 on logits of scale ~8",
            options={"softcap": 5.0},
            recipe={"qkv": "gaussian", "sigma": 2.0},
        ),
        e(
            "softcap-bias",
            MID,
            "softcap 4 then bias (order matters: softcap before bias)",
            options={"softcap": 4.0},
            recipe={"qkv": "gaussian", "sigma": 2.0, "bias": "gaussian"},
        ),
        e(
            "softcap-mask",
            MID,
            "softcap with a random mask",
            options={"softcap": 3.0},
            recipe={"qkv": "gaussian", "sigma": 2.0, "mask": "random"},
        ),
        e(
            "alibi",
            Shapes(batch=1, H=4, K=4, L=12, S=24, D=16, E=16),
            "ALiBi slopes, causal, bottom_right",
            options={"causal": True, "align": "bottom_right"},
            recipe={**gauss, "alibi": True},
        ),
        e(
            "alibi-tl",
            Shapes(batch=1, H=4, K=2, L=12, S=24, D=16, E=16),
            "ALiBi without causal, top_left, GQA",
            options={"align": "top_left", "gqa": "interleave"},
            recipe={**gauss, "alibi": True},
        ),
        e(
            "bias",
            BASE,
            "Gaussian additive bias (batch, H, L, S)",
            recipe={**gauss, "bias": "gaussian"},
        ),
        e(
            "bias-bcast",
            Shapes(batch=2, H=2, K=2, L=12, S=20, D=16, E=16),
            "bias broadcast from (1, 1, L, S)",
            recipe={**gauss, "bias": "gaussian", "bias_shape": "broadcast"},
        ),
        e(
            "bias-neginf",
            MID,
            "bias with -inf entries and one all -inf row per head (empty rows)",
            options={"empty_rows": "zero"},
            recipe={**gauss, "bias": "neginf"},
        ),
    ]


def mask_rows(gauss: dict) -> list[Entry]:
    """Boolean masks and empty rows."""
    e = Entry
    return [
        e(
            "mask-padding",
            Shapes(batch=2, H=2, K=2, L=12, S=24, D=16, E=16),
            "padding mask (batch, 1, 1, S)",
            recipe={**gauss, "mask": "padding"},
        ),
        e("mask-random", MID, "random mask, P(attend) = 3/4", recipe={**gauss, "mask": "random"}),
        e(
            "mask-empty-rows-nan",
            Shapes(batch=1, H=2, K=2, L=6, S=7, D=8, E=8),
            "random mask with fully masked rows, empty_rows='nan'",
            options={"empty_rows": "nan"},
            recipe={**gauss, "mask": "empty-rows"},
        ),
    ]


def dropout_rows(gauss: dict) -> list[Entry]:
    """Dropout keep-masks."""
    e = Entry
    return [
        e(
            "dropout",
            BASE,
            "dropout keep-mask, p = 1/4",
            options={"dropout_p": 0.25},
            recipe={**gauss, "dropout": True},
        ),
        e(
            "dropout-causal",
            Shapes(batch=1, H=2, K=2, L=16, S=16, D=16, E=16),
            "dropout p = 0.1 with causal",
            options={"dropout_p": 0.1, "causal": True, "align": "top_left"},
            recipe={**gauss, "dropout": True},
        ),
    ]


def distribution_rows(gauss: dict) -> list[Entry]:
    """Input distributions: small and large logits."""
    e = Entry
    return [
        e(
            "gauss-s0.25",
            BASE,
            "small logits (sigma 1/4)",
            recipe={"qkv": "gaussian", "sigma": 0.25},
        ),
        e("gauss-s4", BASE, "large logits (sigma 4)", recipe={"qkv": "gaussian", "sigma": 4.0}),
        e(
            "gauss-s8",
            Shapes(batch=1, H=2, K=2, L=16, S=32, D=64, E=32),
            "very large logits (sigma 8, D = 32)",
            default=(),
            recipe={"qkv": "gaussian", "sigma": 8.0},
        ),
    ]


def adversarial_rows(gauss: dict) -> list[Entry]:
    """Adversarial inputs: logit gaps, ties, monotone scores, cancellation."""
    e = Entry
    return [
        e("gap", BASE, "logit gaps > 40 (overflow without max shift)", recipe={"qkv": "gap"}),
        e("ties", BASE, "three-way exact ties at the row maximum", recipe={"qkv": "ties"}),
        e("ascending", BASE, "scores ascending along keys", recipe={"qkv": "ascending"}),
        e("descending", BASE, "scores descending along keys", recipe={"qkv": "descending"}),
        e(
            "cancel",
            BASE,
            "near-cancelling outputs (paired keys, opposite values)",
            recipe={"qkv": "cancel"},
        ),
        e(
            "gap-causal",
            Shapes(batch=1, H=2, K=2, L=16, S=16, D=16, E=16),
            "logit gaps with causal top_left",
            options={"causal": True, "align": "top_left"},
            recipe={"qkv": "gap"},
        ),
    ]


def poison_rows(gauss: dict) -> list[Entry]:
    """Robustness: NaN/Inf poison at excluded positions."""
    e = Entry
    return [
        e(
            "poison-nan-padding",
            Shapes(batch=2, H=2, K=2, L=5, S=10, D=8, E=8),
            "NaN in k, v and bias at padded (masked) keys",
            smoke=("float32",),
            category="robustness",
            recipe={**gauss, "mask": "padding", "bias": "gaussian", "poison": "nan"},
        ),
        e(
            "poison-inf-padding",
            Shapes(batch=2, H=2, K=2, L=10, S=20, D=16, E=16),
            "+-Inf in k, v and bias at padded (masked) keys",
            category="robustness",
            recipe={**gauss, "mask": "padding", "bias": "gaussian", "poison": "inf"},
        ),
        e(
            "poison-nan-causal",
            Shapes(batch=1, H=2, K=2, L=16, S=16, D=16, E=16),
            "NaN in the bias above the causal diagonal",
            category="robustness",
            options={"causal": True, "align": "top_left"},
            recipe={**gauss, "bias": "gaussian", "poison": "nan"},
        ),
        e(
            "poison-inf-window",
            Shapes(batch=1, H=2, K=2, L=16, S=20, D=16, E=16),
            "+-Inf in the bias outside a (2, 1) window",
            category="robustness",
            options={"window": (2, 1), "align": "bottom_right"},
            recipe={**gauss, "bias": "gaussian", "poison": "inf"},
        ),
    ]


def gradient_rows(gauss: dict) -> list[Entry]:
    """Gradients (``grads=True``) of every option."""
    e = Entry
    return [
        e("grad-basic", GRAD, "gradients dq, dk, dv", recipe=gauss, grads=True),
        e(
            "grad-bias-bcast",
            GRAD,
            "dbias summed over broadcast dimensions",
            recipe={**gauss, "bias": "gaussian", "bias_shape": "broadcast"},
            grads=True,
        ),
        e(
            "grad-gqa",
            Shapes(batch=1, H=4, K=2, L=6, S=10, D=16, E=16),
            "dk, dv summed over the query heads of a group",
            options={"gqa": "interleave"},
            recipe=gauss,
            grads=True,
        ),
        e(
            "grad-gqa-tile",
            Shapes(batch=1, H=4, K=2, L=6, S=10, D=16, E=16),
            "gradients under gqa='tile'",
            options={"gqa": "tile"},
            recipe=gauss,
            grads=True,
        ),
        e(
            "grad-causal-br",
            Shapes(batch=1, H=2, K=2, L=6, S=12, D=16, E=16),
            "gradients, causal bottom_right",
            options={"causal": True, "align": "bottom_right"},
            recipe=gauss,
            grads=True,
        ),
        e(
            "grad-window",
            GRAD,
            "gradients, window (2, 1)",
            options={"window": (2, 1), "align": "top_left"},
            recipe=gauss,
            grads=True,
        ),
        e(
            "grad-softcap",
            GRAD,
            "softcap derivative",
            options={"softcap": 4.0},
            recipe={"qkv": "gaussian", "sigma": 2.0},
            grads=True,
        ),
        e(
            "grad-alibi",
            Shapes(batch=1, H=4, K=4, L=6, S=10, D=16, E=16),
            "gradients with ALiBi",
            options={"causal": True, "align": "top_left"},
            recipe={**gauss, "alibi": True},
            grads=True,
        ),
        e(
            "grad-dropout",
            GRAD,
            "dropout derivative (keep-mask, p = 1/4)",
            options={"dropout_p": 0.25},
            recipe={**gauss, "dropout": True},
            grads=True,
        ),
        e(
            "grad-lse",
            GRAD,
            "cotangent of lse too (grad_lse)",
            recipe={**gauss, "grad_lse": True},
            grads=True,
        ),
        e(
            "grad-empty-rows",
            Shapes(batch=1, H=2, K=2, L=9, S=11, D=16, E=16),
            "zero gradients of empty rows",
            options={"empty_rows": "zero"},
            recipe={**gauss, "mask": "empty-rows"},
            grads=True,
        ),
        e("grad-gap", GRAD, "gradients with logit gaps > 40", recipe={"qkv": "gap"}, grads=True),
        e(
            "grad-cancel",
            GRAD,
            "gradients of near-cancelling outputs",
            recipe={"qkv": "cancel"},
            grads=True,
        ),
    ]


def large_rows(gauss: dict) -> list[Entry]:
    """Full only (mostly): larger shapes."""
    e = Entry
    return [
        e(
            "basic",
            Shapes(batch=2, H=8, K=2, L=64, S=96, D=64, E=64),
            "larger GQA problem",
            default=(),
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "causal-br",
            Shapes(batch=1, H=4, K=4, L=48, S=128, D=64, E=64),
            "larger causal bottom_right",
            default=(),
            options={"causal": True, "align": "bottom_right"},
            recipe=gauss,
        ),
        e(
            "head-dim-128",
            Shapes(batch=1, H=2, K=2, L=16, S=32, D=128, E=128),
            "head dimension 128",
            recipe=gauss,
        ),
        e(
            "all-options",
            Shapes(batch=1, H=4, K=2, L=10, S=24, D=16, E=16),
            "causal bottom_right + window + softcap + bias + ALiBi + dropout + GQA tile",
            grads=True,
            options={
                "causal": True,
                "align": "bottom_right",
                "window": (6, None),
                "softcap": 6.0,
                "gqa": "tile",
                "dropout_p": 0.125,
            },
            recipe={
                "qkv": "gaussian",
                "sigma": 1.5,
                "bias": "gaussian",
                "alibi": True,
                "dropout": True,
                "grad_lse": True,
            },
        ),
        e(
            "gap",
            Shapes(batch=1, H=4, K=4, L=32, S=512, D=64, E=64),
            "logit gaps > 40 over 512 keys",
            default=(),
            recipe={"qkv": "gap"},
        ),
        e(
            "cancel",
            Shapes(batch=1, H=4, K=4, L=32, S=512, D=64, E=64),
            "near-cancelling outputs over 512 keys",
            default=(),
            recipe={"qkv": "cancel"},
        ),
        e(
            "mask-padding",
            Shapes(batch=4, H=8, K=2, L=16, S=256, D=64, E=64),
            "padded batch of 4, GQA",
            default=(),
            options={"gqa": "interleave"},
            recipe={**gauss, "mask": "padding"},
        ),
        e(
            "window-causal",
            Shapes(batch=1, H=4, K=2, L=64, S=1024, D=64, E=64),
            "sliding window (256, 0) with causal bottom_right over 1024 keys",
            default=(),
            options={
                "causal": True,
                "align": "bottom_right",
                "window": (256, 0),
                "gqa": "interleave",
            },
            recipe=gauss,
        ),
        e(
            "softcap",
            Shapes(batch=1, H=4, K=4, L=32, S=128, D=64, E=64),
            "softcap 30 (Gemma 2) on larger logits",
            default=(),
            options={"softcap": 30.0},
            recipe={"qkv": "gaussian", "sigma": 3.0},
        ),
        e(
            "grad-basic",
            Shapes(batch=1, H=4, K=2, L=16, S=32, D=64, E=64),
            "larger gradient case",
            default=(),
            options={"gqa": "interleave"},
            recipe={**gauss, "bias": "gaussian"},
            grads=True,
        ),
    ]
