"""The attention cases of the catalogue (suites smoke, default, full) and their inputs.

A :class:`~oracle.catalogue.case.Case` is a complete, JSON-serialisable description of one
attention problem: its shapes (in the shape letters of docs/conventions.md), the dtype of its
inputs, the scalar keywords of :func:`refattn.attention`, a *recipe* for the inputs, and a
seed. The catalogue is a pure function of this module's source: names are stable (they never
depend on catalogue order) and each case's seed is derived from its name.

Suites
------
``"smoke"`` (a handful of tiny cases, < 30 s to generate), ``"default"`` (every option of
``refattn.attention`` and ``refattn.attention_vjp`` and every adversarial input, each in all
four dtypes, because an implementation is validated one dtype at a time, plus 24 kernel-scale
rows per dtype: lengths around the 64/128 tiles, several query and key tiles, L > S
bottom_right, real head dims, GQA, ragged batches and the kernel input distributions over 300
keys, and five more in float16 and bfloat16 for 16-bit accumulators; about 3 minutes on 2
cores) and ``"full"`` (default plus larger shapes: S = 4096 with
D = 64, sliding windows over 1024 keys, D = 128, batches of padded sequences). smoke is a
subset of default, which is a subset of full. ``"kernel"`` holds every kernel-scale case
(:func:`_kernel_entries`), the costly ones (S up to 65536, a 32k-key decode) included.

Categories
----------
``"conformance"``: the pinned semantics; a peer that disagrees is wrong or uses another
convention. ``"robustness"``: NaN/Inf poison at *excluded* key, value or bias positions;
refattn guarantees the poison never reaches the output, peers legitimately differ (many
compute ``0 * NaN``), so these cases fail a validation only under ``--strict``.

Inputs (:func:`make_inputs`)
----------------------------
q (batch, H, L, D), k (batch, K, S, D), v (batch, K, S, E) in the case dtype, plus, as the
recipe asks: ``mask`` (bool; (batch, 1, 1, S) for padding, (batch, H, L, S) otherwise),
``bias`` (case dtype; (batch, H, L, S), or (1, 1, L, S) when ``bias_shape="broadcast"``),
``dropout_mask`` (bool keep-mask, (batch, H, L, S)), ``alibi_slopes`` (case dtype, (H,)),
``grad_out`` (batch, H, L, E) and ``grad_lse`` (batch, H, L) for gradient cases, ``sinks``
(case dtype, (H,)), ``kv_lengths`` (int32, (batch,)) and the float32 descales (batch, K) of
fp8 cases.

Random numbers come from :mod:`oracle.catalogue.seeding` (SplitMix64 in counter mode keyed by
sha256(seed, array name); Irwin-Hall Gaussians from integer sums; no ``numpy.random``
Generator, no libm): the float64 values are bit-identical on every machine and NumPy
version, and are rounded once to the case dtype.

Recipe keys (``Case.recipe``)
-----------------------------
``qkv``: how q, k, v are built --

* ``"gaussian"``: i.i.d. Gaussian with standard deviation ``sigma`` (q, k) and 1 (v);
* ``"gap"``: logit gaps > 40: q_i0 = +-A, one key per sign has k_j0 = +-A, every other key
  k_j0 = 0 and small Gaussian noise elsewhere, so each row's top score exceeds the rest by
  about scale * A**2 >= 48 (overflows ``exp`` without the max shift in half precision);
* ``"ties"``: three identical keys k_j = B e_0 and q_i0 = A > 0 make a three-way exact tie
  at each row's maximum (other keys: |k_j0| <= B/2, small noise);
* ``"ascending"`` / ``"descending"``: k_j = t_j e_0 on a dyadic ramp, q_i0 in [1, 2): every
  row's scores are monotone in j (non-strictly once rounded to a narrow dtype);
* ``"cancel"``: keys in identical pairs, values in opposite pairs v_{2m+1} = -v_{2m}(1 + eps)
  with eps ~ 2**-(p/2) of the dtype: outputs nearly cancel (sum_j w_j |v_j| >> |out|).

``sigma`` (q/k scale), ``mask`` ("padding" | "random" | "empty-rows"), ``bias`` ("gaussian" |
"neginf", the latter with -inf entries and one all -inf row per head), ``bias_shape``
("full" | "broadcast"), ``alibi`` (power-of-two slopes 2**-(1 + 8h // H)), ``dropout``
(keep-mask drawn with P(keep) = 1 - dropout_p), ``poison`` ("nan" | "inf": written into every
key/value position that no query may attend and into every excluded bias position),
``grad_lse`` (a cotangent for lse too), ``sinks`` ("gaussian": one logit per query head,
``2 + 2 N(0, 1)`` in the case dtype), ``kv_lengths`` ("ragged": int32 lengths in [1, S] per
batch row, the last S; "ragged-zero": the first 0, an empty cache), ``fp8`` ("e4m3fn" |
"e5m2": q, k, v quantised per (batch, kv head) as FlashAttention 3's callers do, descale =
amax / largest float8 in float32, stored as float8 with ``q_descale``, ``k_descale``,
``v_descale`` (batch, K); the case dtype, bfloat16, is the truth's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np

from refattn.exact.rounding import format_of
from refattn.masks import allowed_mask

from . import seeding
from .case import Case, Shapes, seed_of
from .names import DTYPE_TAGS, DTYPES, FP8_DTYPES, FP8_TRUTH_DTYPES
from .seeding import Streams

__all__ = ["SUITES", "attention_cases", "make_inputs", "allowed_positions"]

#: The attention suites: smoke within default within full; "kernel" holds every kernel-scale
#: case (:func:`_kernel_entries`), the cheaper of which are also in default and full.
SUITES = ("smoke", "default", "full", "kernel")

#: The suite of every kernel-scale case (those marked ``default=True`` in
#: :func:`_kernel_entries` are also in default and full, in every dtype).
KERNEL_SUITES = ("kernel",)


# ---------------------------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------------------------

_ALL = DTYPES
_HALF = ("float16", "bfloat16")
_BASE = Shapes(1, 2, 2, 24, 40, 32, 32)
_SMALL = Shapes(1, 2, 2, 5, 7, 8, 8)
_MID = Shapes(1, 2, 2, 12, 20, 16, 16)
_GRAD = Shapes(1, 2, 2, 8, 12, 16, 16)


@dataclass(frozen=True)
class _Entry:
    """A catalogue row: one case per dtype, member of the suites its dtypes say."""

    tag: str
    shapes: Shapes
    description: str
    smoke: tuple[str, ...] = ()
    default: tuple[str, ...] = _ALL
    full: tuple[str, ...] = _ALL
    options: Mapping[str, Any] = field(default_factory=dict)
    recipe: Mapping[str, Any] = field(default_factory=dict)
    grads: bool = False
    category: str = "conformance"
    extra: tuple[str, ...] = ()  # further suites (KERNEL_SUITES) of every dtype of the row


def _entries() -> list[_Entry]:
    e = _Entry
    gauss = {"qkv": "gaussian", "sigma": 1.0}
    rows = [
        # --- smoke: one tiny case per headline feature --------------------------------------
        e("basic", _SMALL, "Gaussian q, k, v; no options", smoke=_ALL, recipe=gauss),
        e(
            "causal-br",
            Shapes(1, 2, 2, 4, 7, 8, 8),
            "causal, bottom_right alignment, L < S",
            smoke=("float32",),
            options={"causal": True, "align": "bottom_right"},
            recipe=gauss,
        ),
        e(
            "gqa-interleave",
            Shapes(1, 4, 2, 5, 6, 8, 8),
            "GQA, query head h reads kv head h//G",
            smoke=("float32",),
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "mask-empty-rows",
            Shapes(1, 2, 2, 6, 7, 8, 8),
            "random mask with fully masked rows, empty_rows='zero'",
            smoke=("float32",),
            options={"empty_rows": "zero"},
            recipe={**gauss, "mask": "empty-rows"},
        ),
        e(
            "grad-bias",
            Shapes(1, 2, 2, 4, 5, 8, 8),
            "gradients incl. dbias",
            smoke=("float64",),
            options={},
            recipe={**gauss, "bias": "gaussian"},
            grads=True,
        ),
        # --- shapes ---------------------------------------------------------------------------
        e("basic", _BASE, "Gaussian q, k, v; no options", recipe=gauss),
        e("l-gt-s", Shapes(1, 2, 2, 40, 12, 32, 32), "more queries than keys", recipe=gauss),
        e("l-lt-s", Shapes(1, 2, 2, 5, 97, 32, 32), "fewer queries than keys", recipe=gauss),
        e(
            "d-ne-e",
            Shapes(1, 2, 2, 12, 24, 32, 16),
            "value dim smaller than key dim",
            recipe=gauss,
        ),
        e("d-ne-e", Shapes(1, 2, 2, 12, 24, 16, 48), "value dim larger than key dim", recipe=gauss),
        e(
            "decode",
            Shapes(1, 8, 2, 1, 512, 64, 64),
            "single-token GQA decode (L = 1)",
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "long",
            Shapes(1, 2, 1, 4, 4096, 32, 32),
            "4 queries over S = 4096 keys, MQA",
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "long-causal-br",
            Shapes(1, 4, 1, 16, 4096, 64, 64),
            "MQA, 16 queries over S = 4096, causal bottom_right",
            default=(),
            options={"causal": True, "align": "bottom_right", "gqa": "interleave"},
            recipe=gauss,
        ),
        e("batch", Shapes(3, 2, 2, 8, 12, 16, 16), "three batch entries", recipe=gauss),
        e("scale", _BASE, "explicit dyadic scale 1/8", options={"scale": 0.125}, recipe=gauss),
        e(
            "scale",
            Shapes(1, 2, 2, 12, 20, 16, 8),
            "explicit non-dyadic scale 0.3",
            options={"scale": 0.3},
            recipe=gauss,
        ),
        # --- GQA / MQA ------------------------------------------------------------------------
        e(
            "gqa-interleave",
            Shapes(1, 8, 2, 12, 20, 16, 16),
            "GQA H=8, K=2, interleave",
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "gqa-tile",
            Shapes(1, 8, 2, 12, 20, 16, 16),
            "GQA H=8, K=2, tile (h % K)",
            options={"gqa": "tile"},
            recipe=gauss,
        ),
        e(
            "mqa-interleave",
            Shapes(1, 4, 1, 12, 20, 16, 16),
            "MQA (K = 1), interleave",
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "mqa-tile",
            Shapes(1, 4, 1, 12, 20, 16, 16),
            "MQA (K = 1), tile",
            options={"gqa": "tile"},
            recipe=gauss,
        ),
        # --- causal and windows ---------------------------------------------------------------
        e(
            "causal-tl",
            Shapes(1, 2, 2, 24, 24, 32, 32),
            "causal, top_left, L = S",
            options={"causal": True, "align": "top_left"},
            recipe=gauss,
        ),
        e(
            "causal-tl",
            Shapes(1, 2, 2, 12, 32, 16, 16),
            "causal, top_left, L < S",
            options={"causal": True, "align": "top_left"},
            recipe=gauss,
        ),
        e(
            "causal-br",
            Shapes(1, 2, 2, 12, 32, 16, 16),
            "causal, bottom_right, L < S",
            options={"causal": True, "align": "bottom_right"},
            recipe=gauss,
        ),
        e(
            "causal-tl",
            Shapes(1, 2, 2, 24, 10, 16, 16),
            "causal, top_left, L > S",
            options={"causal": True, "align": "top_left"},
            recipe=gauss,
        ),
        e(
            "causal-br-empty",
            Shapes(1, 2, 2, 12, 5, 8, 8),
            "causal bottom_right with L > S: the first L - S rows are empty (zero)",
            options={"causal": True, "align": "bottom_right", "empty_rows": "zero"},
            recipe=gauss,
        ),
        e(
            "causal-br-empty-nan",
            Shapes(1, 2, 2, 12, 5, 8, 8),
            "causal bottom_right with L > S, empty_rows='nan'",
            options={"causal": True, "align": "bottom_right", "empty_rows": "nan"},
            recipe=gauss,
        ),
        e(
            "window-both",
            Shapes(1, 2, 2, 20, 20, 16, 16),
            "window (3, 2), top_left",
            options={"window": (3, 2), "align": "top_left"},
            recipe=gauss,
        ),
        e(
            "window-both-br",
            Shapes(1, 2, 2, 10, 28, 16, 16),
            "window (2, 2), bottom_right, L < S",
            options={"window": (2, 2), "align": "bottom_right"},
            recipe=gauss,
        ),
        e(
            "window-left",
            Shapes(1, 2, 2, 12, 24, 16, 16),
            "window (4, None), bottom_right",
            options={"window": (4, None), "align": "bottom_right"},
            recipe=gauss,
        ),
        e(
            "window-right",
            Shapes(1, 2, 2, 16, 16, 16, 16),
            "window (None, 1), top_left",
            options={"window": (None, 1), "align": "top_left"},
            recipe=gauss,
        ),
        e(
            "window-causal",
            Shapes(1, 2, 2, 18, 18, 16, 16),
            "causal with a left window of 3",
            options={"causal": True, "window": (3, None), "align": "top_left"},
            recipe=gauss,
        ),
        # --- softcap, ALiBi, bias -------------------------------------------------------------
        e(
            "softcap",
            _MID,
            "softcap 5 on logits of scale ~8",
            options={"softcap": 5.0},
            recipe={"qkv": "gaussian", "sigma": 2.0},
        ),
        e(
            "softcap-bias",
            _MID,
            "softcap 4 then bias (order matters: softcap before bias)",
            options={"softcap": 4.0},
            recipe={"qkv": "gaussian", "sigma": 2.0, "bias": "gaussian"},
        ),
        e(
            "softcap-mask",
            _MID,
            "softcap with a random mask",
            options={"softcap": 3.0},
            recipe={"qkv": "gaussian", "sigma": 2.0, "mask": "random"},
        ),
        e(
            "alibi",
            Shapes(1, 4, 4, 12, 24, 16, 16),
            "ALiBi slopes, causal, bottom_right",
            options={"causal": True, "align": "bottom_right"},
            recipe={**gauss, "alibi": True},
        ),
        e(
            "alibi-tl",
            Shapes(1, 4, 2, 12, 24, 16, 16),
            "ALiBi without causal, top_left, GQA",
            options={"align": "top_left", "gqa": "interleave"},
            recipe={**gauss, "alibi": True},
        ),
        e(
            "bias",
            _BASE,
            "Gaussian additive bias (batch, H, L, S)",
            recipe={**gauss, "bias": "gaussian"},
        ),
        e(
            "bias-bcast",
            Shapes(2, 2, 2, 12, 20, 16, 16),
            "bias broadcast from (1, 1, L, S)",
            recipe={**gauss, "bias": "gaussian", "bias_shape": "broadcast"},
        ),
        e(
            "bias-neginf",
            _MID,
            "bias with -inf entries and one all -inf row per head (empty rows)",
            options={"empty_rows": "zero"},
            recipe={**gauss, "bias": "neginf"},
        ),
        # --- masks, empty rows ----------------------------------------------------------------
        e(
            "mask-padding",
            Shapes(2, 2, 2, 12, 24, 16, 16),
            "padding mask (batch, 1, 1, S)",
            recipe={**gauss, "mask": "padding"},
        ),
        e("mask-random", _MID, "random mask, P(attend) = 3/4", recipe={**gauss, "mask": "random"}),
        e(
            "mask-empty-rows-nan",
            Shapes(1, 2, 2, 6, 7, 8, 8),
            "random mask with fully masked rows, empty_rows='nan'",
            options={"empty_rows": "nan"},
            recipe={**gauss, "mask": "empty-rows"},
        ),
        # --- dropout --------------------------------------------------------------------------
        e(
            "dropout",
            _BASE,
            "dropout keep-mask, p = 1/4",
            options={"dropout_p": 0.25},
            recipe={**gauss, "dropout": True},
        ),
        e(
            "dropout-causal",
            Shapes(1, 2, 2, 16, 16, 16, 16),
            "dropout p = 0.1 with causal",
            options={"dropout_p": 0.1, "causal": True, "align": "top_left"},
            recipe={**gauss, "dropout": True},
        ),
        # --- input distributions --------------------------------------------------------------
        e(
            "gauss-s0.25",
            _BASE,
            "small logits (sigma 1/4)",
            recipe={"qkv": "gaussian", "sigma": 0.25},
        ),
        e("gauss-s4", _BASE, "large logits (sigma 4)", recipe={"qkv": "gaussian", "sigma": 4.0}),
        e(
            "gauss-s8",
            Shapes(1, 2, 2, 16, 32, 64, 32),
            "very large logits (sigma 8, D = 32)",
            default=(),
            recipe={"qkv": "gaussian", "sigma": 8.0},
        ),
        # --- adversarial ----------------------------------------------------------------------
        e("gap", _BASE, "logit gaps > 40 (overflow without max shift)", recipe={"qkv": "gap"}),
        e("ties", _BASE, "three-way exact ties at the row maximum", recipe={"qkv": "ties"}),
        e("ascending", _BASE, "scores ascending along keys", recipe={"qkv": "ascending"}),
        e("descending", _BASE, "scores descending along keys", recipe={"qkv": "descending"}),
        e(
            "cancel",
            _BASE,
            "near-cancelling outputs (paired keys, opposite values)",
            recipe={"qkv": "cancel"},
        ),
        e(
            "gap-causal",
            Shapes(1, 2, 2, 16, 16, 16, 16),
            "logit gaps with causal top_left",
            options={"causal": True, "align": "top_left"},
            recipe={"qkv": "gap"},
        ),
        # --- robustness: poison at excluded positions -----------------------------------------
        e(
            "poison-nan-padding",
            Shapes(2, 2, 2, 5, 10, 8, 8),
            "NaN in k, v and bias at padded (masked) keys",
            smoke=("float32",),
            category="robustness",
            recipe={**gauss, "mask": "padding", "bias": "gaussian", "poison": "nan"},
        ),
        e(
            "poison-inf-padding",
            Shapes(2, 2, 2, 10, 20, 16, 16),
            "+-Inf in k, v and bias at padded (masked) keys",
            category="robustness",
            recipe={**gauss, "mask": "padding", "bias": "gaussian", "poison": "inf"},
        ),
        e(
            "poison-nan-causal",
            Shapes(1, 2, 2, 16, 16, 16, 16),
            "NaN in the bias above the causal diagonal",
            category="robustness",
            options={"causal": True, "align": "top_left"},
            recipe={**gauss, "bias": "gaussian", "poison": "nan"},
        ),
        e(
            "poison-inf-window",
            Shapes(1, 2, 2, 16, 20, 16, 16),
            "+-Inf in the bias outside a (2, 1) window",
            category="robustness",
            options={"window": (2, 1), "align": "bottom_right"},
            recipe={**gauss, "bias": "gaussian", "poison": "inf"},
        ),
        # --- gradients ------------------------------------------------------------------------
        e("grad-basic", _GRAD, "gradients dq, dk, dv", recipe=gauss, grads=True),
        e(
            "grad-bias-bcast",
            _GRAD,
            "dbias summed over broadcast dimensions",
            recipe={**gauss, "bias": "gaussian", "bias_shape": "broadcast"},
            grads=True,
        ),
        e(
            "grad-gqa",
            Shapes(1, 4, 2, 6, 10, 16, 16),
            "dk, dv summed over the query heads of a group",
            options={"gqa": "interleave"},
            recipe=gauss,
            grads=True,
        ),
        e(
            "grad-gqa-tile",
            Shapes(1, 4, 2, 6, 10, 16, 16),
            "gradients under gqa='tile'",
            options={"gqa": "tile"},
            recipe=gauss,
            grads=True,
        ),
        e(
            "grad-causal-br",
            Shapes(1, 2, 2, 6, 12, 16, 16),
            "gradients, causal bottom_right",
            options={"causal": True, "align": "bottom_right"},
            recipe=gauss,
            grads=True,
        ),
        e(
            "grad-window",
            _GRAD,
            "gradients, window (2, 1)",
            options={"window": (2, 1), "align": "top_left"},
            recipe=gauss,
            grads=True,
        ),
        e(
            "grad-softcap",
            _GRAD,
            "softcap derivative",
            options={"softcap": 4.0},
            recipe={"qkv": "gaussian", "sigma": 2.0},
            grads=True,
        ),
        e(
            "grad-alibi",
            Shapes(1, 4, 4, 6, 10, 16, 16),
            "gradients with ALiBi",
            options={"causal": True, "align": "top_left"},
            recipe={**gauss, "alibi": True},
            grads=True,
        ),
        e(
            "grad-dropout",
            _GRAD,
            "dropout derivative (keep-mask, p = 1/4)",
            options={"dropout_p": 0.25},
            recipe={**gauss, "dropout": True},
            grads=True,
        ),
        e(
            "grad-lse",
            _GRAD,
            "cotangent of lse too (grad_lse)",
            recipe={**gauss, "grad_lse": True},
            grads=True,
        ),
        e(
            "grad-empty-rows",
            Shapes(1, 2, 2, 9, 11, 16, 16),
            "zero gradients of empty rows",
            options={"empty_rows": "zero"},
            recipe={**gauss, "mask": "empty-rows"},
            grads=True,
        ),
        e("grad-gap", _GRAD, "gradients with logit gaps > 40", recipe={"qkv": "gap"}, grads=True),
        e(
            "grad-cancel",
            _GRAD,
            "gradients of near-cancelling outputs",
            recipe={"qkv": "cancel"},
            grads=True,
        ),
        # --- sinks, per-row key lengths (KV cache), fp8 inputs ------------------------------
        *_new_option_entries(gauss),
        # --- full only: larger shapes ---------------------------------------------------------
        e(
            "basic",
            Shapes(2, 8, 2, 64, 96, 64, 64),
            "larger GQA problem",
            default=(),
            options={"gqa": "interleave"},
            recipe=gauss,
        ),
        e(
            "causal-br",
            Shapes(1, 4, 4, 48, 128, 64, 64),
            "larger causal bottom_right",
            default=(),
            options={"causal": True, "align": "bottom_right"},
            recipe=gauss,
        ),
        e("head-dim-128", Shapes(1, 2, 2, 16, 32, 128, 128), "head dimension 128", recipe=gauss),
        e(
            "all-options",
            Shapes(1, 4, 2, 10, 24, 16, 16),
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
            Shapes(1, 4, 4, 32, 512, 64, 64),
            "logit gaps > 40 over 512 keys",
            default=(),
            recipe={"qkv": "gap"},
        ),
        e(
            "cancel",
            Shapes(1, 4, 4, 32, 512, 64, 64),
            "near-cancelling outputs over 512 keys",
            default=(),
            recipe={"qkv": "cancel"},
        ),
        e(
            "mask-padding",
            Shapes(4, 8, 2, 16, 256, 64, 64),
            "padded batch of 4, GQA",
            default=(),
            options={"gqa": "interleave"},
            recipe={**gauss, "mask": "padding"},
        ),
        e(
            "window-causal",
            Shapes(1, 4, 2, 64, 1024, 64, 64),
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
            Shapes(1, 4, 4, 32, 128, 64, 64),
            "softcap 30 (Gemma 2) on larger logits",
            default=(),
            options={"softcap": 30.0},
            recipe={"qkv": "gaussian", "sigma": 3.0},
        ),
        e(
            "grad-basic",
            Shapes(1, 4, 2, 16, 32, 64, 64),
            "larger gradient case",
            default=(),
            options={"gqa": "interleave"},
            recipe={**gauss, "bias": "gaussian"},
            grads=True,
        ),
    ]
    return rows + _kernel_entries()


#: Lengths around the 64/128 tile sizes of real kernels.
TILE_LENGTHS = (1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 2049)
#: Those of them whose ``k-tile`` case is also in default (a single key, an exact tile, a tile
#: and one key, two tiles and one key, four tiles and one key: one key past a split-KV chunk).
DEFAULT_TILE_LENGTHS = (1, 64, 65, 129, 257)


def _kernel_entries() -> list[_Entry]:
    """Kernel-scale cases: lengths around tile sizes, long rows, real head dims, GQA groups,
    ragged batches and input distributions that stress a tiled online softmax."""

    def e(tag, shapes, description, options=None, recipe=None, default=False):
        if default == "half":  # rows for accumulators as narrow as the 16-bit input type
            return _Entry(
                tag,
                shapes,
                description,
                default=_HALF,
                full=_HALF,
                extra=KERNEL_SUITES,
                options=dict(options or {}),
                recipe=dict(recipe or gauss),
            )
        # default=True: also in default and full, every dtype (a bug class needs >= 5 cases
        # of each dtype to fail); the rest (the costly truths: S >= 16384, the 32k decode,
        # L = 257 over S = 1000/2049) only in the kernel suite
        chosen = _ALL if default else ()
        return _Entry(
            tag,
            shapes,
            description,
            default=chosen,
            full=chosen,
            extra=KERNEL_SUITES,
            options=dict(options or {}),
            recipe=dict(recipe or gauss),
        )

    gauss = {"qkv": "gaussian", "sigma": 1.0}
    br_empty = {"causal": True, "align": "bottom_right", "empty_rows": "zero"}
    rows = []
    for n in TILE_LENGTHS:
        rows.append(
            e(
                "k-tile",
                Shapes(1, 2, 2, min(n, 257), n, 64, 64),
                f"L, S around the 64/128 tiles (S = {n}): tile boundaries, partial "
                f"tiles, masked tails",
                default=n in DEFAULT_TILE_LENGTHS,
            )
        )
    for n in (63, 65, 129, 257):
        rows.append(
            e(
                "k-tile-causal",
                Shapes(1, 2, 2, n, n, 64, 64),
                f"causal, L = S = {n}: diagonal tiles cut by a tile boundary",
                {"causal": True, "align": "top_left"},
                default=n in (65, 129),
            )
        )
    rows += [
        e(
            "k-tiles",
            Shapes(1, 2, 2, 200, 300, 64, 64),
            "several query x key tiles (4 x 5), both partial; S > 256: two split-KV chunks",
            default=True,
        ),
        e(
            "k-tiles-br",
            Shapes(1, 2, 2, 130, 390, 128, 128),
            "causal bottom_right over several tiles, L < S",
            {"causal": True, "align": "bottom_right"},
        ),
        e(
            "k-causal-l-gt-s",
            Shapes(1, 2, 2, 200, 70, 64, 64),
            "causal bottom_right with L > S: a negative diagonal offset (first rows empty)",
            br_empty,
            default=True,
        ),
        # L > S bottom_right: a kernel that clamps the diagonal offset S - L at 0 lets the
        # first rows attend; small and cheap, so every dtype has five of them
        e(
            "k-causal-l-gt-s",
            Shapes(1, 2, 2, 130, 70, 64, 64),
            "causal bottom_right, L = 130 > S = 70 (offset -60) over partial query and key tiles",
            br_empty,
            default=True,
        ),
        e(
            "k-causal-l-gt-s",
            Shapes(1, 2, 2, 200, 129, 64, 64),
            "causal bottom_right, L = 200 > S = 129 (offset -71): several tiles of each",
            br_empty,
            default=True,
        ),
        e(
            "k-causal-l-gt-s",
            Shapes(1, 4, 2, 100, 40, 32, 32),
            "causal bottom_right with L > S and GQA (offset -60)",
            {**br_empty, "gqa": "interleave"},
            default=True,
        ),
        e(
            "k-causal-l-gt-s",
            Shapes(2, 2, 2, 70, 64, 32, 32),
            "causal bottom_right, L = 70 > S = 64, a batch of two (offset -6: few empty rows)",
            br_empty,
            default=True,
        ),
        e(
            "k-window-l-gt-s",
            Shapes(1, 2, 2, 150, 100, 32, 32),
            "window (32, 0) bottom_right with L > S: the window follows the negative offset",
            {"window": (32, 0), "align": "bottom_right", "empty_rows": "zero"},
            default=True,
        ),
        e(
            "k-long",
            Shapes(1, 1, 1, 4, 16384, 64, 64),
            "4 queries over 16384 keys: many key tiles, late max moves, split-KV",
        ),
        e("k-long", Shapes(1, 1, 1, 2, 65536, 64, 64), "2 queries over 65536 keys"),
        e(
            "k-decode",
            Shapes(1, 8, 2, 1, 32768, 128, 128),
            "GQA decode L = 1 over 32768 keys (split-KV combine)",
            {"gqa": "interleave"},
        ),
    ]
    for D in (64, 96, 128, 256, 59, 111):
        rows.append(
            e(
                "k-headdim",
                Shapes(1, 2, 2, 65, 129, D, D),
                f"head dim {D} over a partial tile: vector widths, odd dims",
                default=D in (128, 59),
            )
        )
    rows.append(
        e(
            "k-d-ne-e",
            Shapes(1, 2, 2, 65, 129, 192, 128),
            "D = 192, E = 128 (scale 1/sqrt(D), not E)",
        )
    )
    for K in (8, 2, 1):
        rows.append(
            e(
                "k-gqa",
                Shapes(1, 8, K, 65, 200, 64, 64),
                f"GQA group size {8 // K} (H = 8, K = {K})",
                {"gqa": "interleave"},
                default=K == 2,
            )
        )
    rows.append(
        e(
            "k-ragged",
            Shapes(4, 2, 2, 65, 300, 64, 64),
            "a batch whose rows have different key lengths (padding mask): per-row "
            "tails inside tiles",
            recipe={**gauss, "mask": "padding"},
        )
    )
    rows.append(
        e(
            "k-ragged",
            Shapes(3, 2, 2, 65, 130, 64, 64),
            "three rows of different key lengths (padding mask) over three key tiles",
            recipe={**gauss, "mask": "padding"},
            default=True,
        )
    )
    distributions = [
        (
            "k-outlier",
            {"qkv": "outlier", "factor": 32.0, "channels": 3},
            "outlier channels: 3 dims of q and k 32x larger (LLM activations)",
        ),
        ("k-sink", {"qkv": "sink"}, "a sink key (key 0) taking most of every row's weight"),
        (
            "k-peaky-late",
            {"qkv": "late-max"},
            "peaky rows whose max moves in every tile up to the last (online rescale)",
        ),
        (
            "k-uniform",
            {"qkv": "gaussian", "sigma": 0.0625},
            "near-uniform rows (tiny logits): long sums of nearly equal terms",
        ),
        (
            "k-offset",
            {"qkv": "offset", "offset": 64.0},
            "values with a large common offset (64 + N(0,1)): cancellation in P@V",
        ),
        (
            "k-overflow16",
            {"qkv": "gaussian", "sigma": 24.0},
            "q.k beyond the float16 range unless the scale is applied first",
        ),
    ]
    for tag, recipe, description in distributions:
        rows.append(e(tag, Shapes(1, 2, 2, 65, 1000, 64, 64), description, recipe=recipe))
    # a float16/bfloat16 accumulator for inputs of that type is caught (tight tier) where the
    # terms are all positive: a common value offset, a dominant sink key, small logits
    half_rows = [
        (
            "k-offset",
            Shapes(1, 2, 2, 65, 129, 64, 64),
            {"qkv": "offset", "offset": 64.0},
            "values 64 + N(0,1) over a partial key tile: a 16-bit P@V accumulator drifts",
        ),
        (
            "k-offset",
            Shapes(1, 2, 2, 65, 129, 128, 128),
            {"qkv": "offset", "offset": 64.0},
            "values 64 + N(0,1), D = E = 128: a 16-bit P@V accumulator drifts",
        ),
        (
            "k-sink",
            Shapes(1, 2, 2, 65, 129, 64, 64),
            {"qkv": "sink"},
            "a sink key over a partial key tile: a 16-bit normaliser and P@V accumulator",
        ),
        (
            "k-small-logits",
            Shapes(1, 2, 2, 65, 129, 64, 64),
            {"qkv": "gaussian", "sigma": 0.25},
            "small logits (sigma 1/4) over a partial key tile: nearly equal positive weights",
        ),
        (
            "k-small-logits",
            Shapes(1, 2, 2, 65, 300, 64, 64),
            {"qkv": "gaussian", "sigma": 0.25},
            "small logits (sigma 1/4) over 300 keys: nearly equal positive weights",
        ),
    ]
    for tag, shapes, recipe, description in half_rows:
        rows.append(e(tag, shapes, description, recipe=recipe, default="half"))
    for tag, recipe, description in distributions:
        # the same inputs over 300 keys (five key tiles, the last partial; two split-KV
        # chunks) and a partial query tile: default's share of each distribution
        rows.append(
            e(
                tag,
                Shapes(1, 2, 2, 65, 300, 64, 64),
                description + " (S = 300)",
                recipe=recipe,
                default=True,
            )
        )
    return rows


def _new_option_entries(gauss) -> list[_Entry]:
    """Cases of the options sinks, kv_lengths and float8 inputs (fp8 cases: bfloat16 only)."""
    e = _Entry
    sinks = {**gauss, "sinks": "gaussian"}
    ragged = {**gauss, "kv_lengths": "ragged"}
    br = {"causal": True, "align": "bottom_right"}
    fp8 = {"default": FP8_TRUTH_DTYPES, "full": FP8_TRUTH_DTYPES}
    return [
        e(
            "sinks",
            _MID,
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
            _GRAD,
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
            _MID,
            "float8_e4m3fn q, k, v with float32 descales, bfloat16 truth",
            recipe={**gauss, "fp8": "e4m3fn"},
            **fp8,
        ),
        e(
            "fp8-e5m2",
            _MID,
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


def _expand(entry: _Entry) -> list[Case]:
    cases = []
    for dtype in DTYPES:
        in_smoke = dtype in entry.smoke
        in_default = in_smoke or dtype in entry.default
        in_full = in_default or dtype in entry.full
        membership = zip(SUITES[:3], (in_smoke, in_default, in_full), strict=True)
        suites = tuple(s for s, member in membership if member)
        suites += tuple(s for s in entry.extra if s not in suites)
        if not suites:
            continue
        name = f"{entry.tag}-{entry.shapes.tag()}-{DTYPE_TAGS[dtype]}"
        cases.append(
            Case(
                name=name,
                suites=suites,
                category=entry.category,
                dtype=dtype,
                shapes=entry.shapes,
                options=dict(entry.options),
                recipe=dict(entry.recipe),
                seed=seed_of(name),
                grads=entry.grads,
                description=entry.description,
            )
        )
    return cases


_CATALOGUE: dict[str, Case] | None = None


def attention_cases() -> dict[str, Case]:
    """Every attention case (all three suites) by name, in catalogue order."""
    global _CATALOGUE
    if _CATALOGUE is None:
        catalogue: dict[str, Case] = {}
        for entry in _entries():
            for case in _expand(entry):
                if case.name in catalogue:
                    raise RuntimeError(f"oracle.catalogue: duplicate case name {case.name!r}")
                catalogue[case.name] = case
        _CATALOGUE = catalogue
    return _CATALOGUE


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """Inputs of ``case``, bit-identical on every machine and NumPy version.

    Returns q, k, v in the case dtype and, as the recipe asks, mask, bias, dropout_mask,
    alibi_slopes, grad_out, grad_lse (see the module docstring for shapes and construction).

    Examples
    --------
    >>> from oracle import catalogue
    >>> inputs = make_inputs(catalogue.get("basic-H2K2-L5S7-D8E8-f32"))
    >>> sorted(inputs), inputs["q"].shape, inputs["q"].dtype.name
    (['k', 'q', 'v'], (1, 2, 5, 8), 'float32')
    """
    recipe = case.recipe
    n = case.shapes
    stream = Streams(case.seed)
    fp8 = recipe.get("fp8")
    kind = recipe.get("qkv", "gaussian")
    qkv_dtype = "float64" if fp8 else case.dtype
    if kind in _RECIPE_QKV:
        q, k, v = _RECIPE_QKV[kind](
            stream, n, qkv_dtype, case.options, float(recipe.get("sigma", 1.0)), recipe
        )
    else:
        q, k, v = _QKV[kind](stream, n, qkv_dtype, case.options, float(recipe.get("sigma", 1.0)))
    inputs = {"q": q, "k": k, "v": v}
    if fp8:
        inputs.update(_quantised(inputs, n, FP8_DTYPES[fp8]))
    if recipe.get("sinks"):
        sinks = 2.0 + 2.0 * stream.gaussian("sinks", (n.H,))
        inputs["sinks"] = seeding.to_dtype(sinks, case.dtype)
    if recipe.get("kv_lengths"):
        inputs["kv_lengths"] = _kv_lengths(stream, n, recipe["kv_lengths"])
    if recipe.get("mask"):
        inputs["mask"] = _MASKS[recipe["mask"]](stream, n)
    if recipe.get("bias"):
        inputs["bias"] = _bias(stream, n, case.dtype, recipe)
    if recipe.get("alibi"):
        slopes = np.ldexp(1.0, -(1 + (8 * np.arange(n.H)) // n.H))
        inputs["alibi_slopes"] = seeding.to_dtype(slopes, case.dtype)
    if recipe.get("dropout"):
        keep = 1 - Fraction(case.options.get("dropout_p", 0.0))
        inputs["dropout_mask"] = stream.bernoulli("dropout_mask", (n.batch, n.H, n.L, n.S), keep)
    if recipe.get("poison"):
        _poison(inputs, case, recipe["poison"])
    if case.grads:
        inputs["grad_out"] = seeding.to_dtype(
            stream.gaussian("grad_out", (n.batch, n.H, n.L, n.E)), case.dtype
        )
        if recipe.get("grad_lse"):
            inputs["grad_lse"] = seeding.to_dtype(
                stream.gaussian("grad_lse", (n.batch, n.H, n.L)), case.dtype
            )
    return inputs


def _quantised(inputs, n: Shapes, fp8: str) -> dict[str, np.ndarray]:
    """q, k, v quantised to ``fp8`` as FlashAttention 3's callers do: per (batch, kv head)
    descale = amax / (largest finite fp8) in float32 (q: amax over the kv head's query group),
    x / descale clipped to the fp8 range and rounded to it (through float32: IEEE casts and
    ml_dtypes' integer rounding, identical on every machine)."""
    dtype = np.dtype(getattr(ml_dtypes, fp8))
    top = float(ml_dtypes.finfo(dtype).max)
    group = n.H // n.K
    quantised = {}
    for name in ("q", "k", "v"):
        x = inputs[name]
        grouped = (
            x.reshape(n.batch, n.K, -1)
            if name != "q"
            else x.reshape(n.batch, n.K, group * n.L * n.D)
        )
        amax = np.abs(grouped).max(axis=-1)
        descale = np.maximum(amax / top, np.finfo(np.float32).tiny).astype(np.float32)
        per_head = descale.astype(np.float64)[..., None, None]
        if name == "q":
            per_head = np.repeat(per_head, group, axis=1)  # query head h reads kv head h // G
        scaled = np.clip(x / per_head, -top, top)
        quantised[name] = scaled.astype(np.float32).astype(dtype)
        quantised[f"{name}_descale"] = descale
    return quantised


def _kv_lengths(stream, n: Shapes, kind: str) -> np.ndarray:
    """int32 (batch,) key lengths in [1, S] (the last row S); "ragged-zero": the first is 0."""
    lengths = 1 + (stream.uniform("kv_lengths", (n.batch,)) * n.S).astype(np.int64)
    lengths[-1] = n.S
    lengths[0] = 0 if kind == "ragged-zero" else min(lengths[0], max(1, n.S // 2))
    return lengths.astype(np.int32)


def _scale(n: Shapes, options) -> float:
    return float(options.get("scale") or 1 / np.sqrt(n.D))


def _qkv_gaussian(stream, n, dtype, options, sigma):
    q = sigma * stream.gaussian("q", (n.batch, n.H, n.L, n.D))
    k = sigma * stream.gaussian("k", (n.batch, n.K, n.S, n.D))
    v = stream.gaussian("v", (n.batch, n.K, n.S, n.E))
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_gap(stream, n, dtype, options, sigma):
    # the smallest power of two A with A**2 * scale >= 48: the top key wins by >= 48 - noise
    amplitude = 1.0
    while amplitude * amplitude * _scale(n, options) < 48:
        amplitude *= 2
    q = 0.25 * stream.gaussian("q", (n.batch, n.H, n.L, n.D))
    k = 0.25 * stream.gaussian("k", (n.batch, n.K, n.S, n.D))
    v = stream.gaussian("v", (n.batch, n.K, n.S, n.E))
    sign = np.where(stream.uniform("sign", (n.batch, n.H, n.L)) < 0.5, -1.0, 1.0)
    q[..., 0] = amplitude * sign
    k[..., 0] = 0.0
    plus, minus = _two_positions(stream, n)
    for b in range(n.batch):
        for g in range(n.K):
            k[b, g, plus[b, g], 0] = amplitude
            k[b, g, minus[b, g], 0] = -amplitude
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _two_positions(stream, n):
    draws = (stream.uniform("positions", (n.batch, n.K, 2)) * n.S).astype(np.int64)
    plus = draws[..., 0]
    minus = np.where(draws[..., 1] == plus, (plus + 1) % n.S, draws[..., 1])
    return plus, minus


def _qkv_ties(stream, n, dtype, options, sigma):
    q = 0.25 * stream.gaussian("q", (n.batch, n.H, n.L, n.D))
    k = 0.25 * stream.gaussian("k", (n.batch, n.K, n.S, n.D))
    v = stream.gaussian("v", (n.batch, n.K, n.S, n.E))
    q[..., 0] = 4.0
    k[..., 0] = 4.0 * (stream.uniform("k0", (n.batch, n.K, n.S)) - 0.5)
    order = np.argsort(stream.uniform("tie_positions", (n.batch, n.K, n.S)), axis=-1, kind="stable")
    for b in range(n.batch):
        for g in range(n.K):
            for j in order[b, g, :3]:
                k[b, g, j, :] = 0.0
                k[b, g, j, 0] = 8.0
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_ramp(descending):
    def build(stream, n, dtype, options, sigma):
        q = stream.gaussian("q", (n.batch, n.H, n.L, n.D))
        q[..., 0] = 1.0 + stream.uniform("q0", (n.batch, n.H, n.L))
        v = stream.gaussian("v", (n.batch, n.K, n.S, n.E))
        # scores span 16 to 32 across the keys: step = 2**floor(log2(16 / (scale * S)))
        step = math.ldexp(1.0, math.frexp(16 / (_scale(n, options) * n.S))[1] - 1)
        ramp = (np.arange(n.S) - n.S // 2) * step
        k = np.zeros((n.batch, n.K, n.S, n.D))
        k[..., 0] = -ramp if descending else ramp
        return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))

    return build


def _qkv_cancel(stream, n, dtype, options, sigma):
    q, k, v = _qkv_gaussian(stream, n, "float64", options, sigma)
    pairs = n.S // 2
    k[:, :, 1 : 2 * pairs : 2] = k[:, :, 0 : 2 * pairs : 2]
    eps = 2.0 ** -(format_of(dtype).p // 2)
    wiggle = 1 + eps * (2 * stream.uniform("wiggle", (n.batch, n.K, pairs, n.E)) - 1)
    v = seeding.to_dtype(v, dtype).astype(np.float64)
    v[:, :, 1 : 2 * pairs : 2] = -v[:, :, 0 : 2 * pairs : 2] * wiggle
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_outlier(stream, n, dtype, options, sigma, recipe):
    q, k, v = _qkv_gaussian(stream, n, "float64", options, sigma)
    channels = int(recipe.get("channels", 3))
    factor = float(recipe.get("factor", 32.0))
    q[..., :channels] *= factor
    k[..., :channels] *= factor
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_sink(stream, n, dtype, options, sigma, recipe):
    # key 0 aligned with every query: a score about 12 above the rest
    q, k, v = _qkv_gaussian(stream, n, "float64", options, 0.5)
    q[..., 0] = 2.0
    k[..., 0, :] = 0.0
    k[..., 0, 0] = 6.0 / _scale(n, options)  # scale * q0 * k00 = 12
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_late_max(stream, n, dtype, options, sigma, recipe):
    # scores rise along the keys (with noise): the running max moves in every tile
    q, k, v = _qkv_gaussian(stream, n, "float64", options, 0.5)
    q[..., 0] = 1.0 + stream.uniform("q0", (n.batch, n.H, n.L))
    k[..., 0] = np.arange(n.S) * (16.0 / (_scale(n, options) * max(n.S, 1)))
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


def _qkv_offset(stream, n, dtype, options, sigma, recipe):
    q, k, v = _qkv_gaussian(stream, n, "float64", options, sigma)
    v = v + float(recipe.get("offset", 64.0))
    return tuple(seeding.to_dtype(x, dtype) for x in (q, k, v))


_RECIPE_QKV = {
    "outlier": _qkv_outlier,
    "sink": _qkv_sink,
    "late-max": _qkv_late_max,
    "offset": _qkv_offset,
}

_QKV = {
    "gaussian": _qkv_gaussian,
    "gap": _qkv_gap,
    "ties": _qkv_ties,
    "ascending": _qkv_ramp(False),
    "descending": _qkv_ramp(True),
    "cancel": _qkv_cancel,
}


def _mask_padding(stream, n):
    # valid lengths in [1, S], the last batch entry unpadded
    lengths = 1 + (stream.uniform("lengths", (n.batch,)) * n.S).astype(np.int64)
    lengths[-1] = n.S
    lengths[0] = min(lengths[0], max(1, n.S - 3))  # at least three padded keys somewhere
    return (np.arange(n.S) < lengths[:, None]).reshape(n.batch, 1, 1, n.S)


def _mask_random(stream, n):
    return stream.bernoulli("mask", (n.batch, n.H, n.L, n.S), Fraction(3, 4))


def _mask_empty_rows(stream, n):
    mask = _mask_random(stream, n)
    mask[:, :, 1::3, :] = False  # every third row of every head has no allowed key
    return mask


_MASKS = {"padding": _mask_padding, "random": _mask_random, "empty-rows": _mask_empty_rows}


def _bias(stream, n, dtype, recipe):
    shape = (
        (1, 1, n.L, n.S) if recipe.get("bias_shape") == "broadcast" else (n.batch, n.H, n.L, n.S)
    )
    bias = stream.gaussian("bias", shape)
    if recipe["bias"] == "neginf":
        bias[stream.bernoulli("bias_neginf", shape, Fraction(1, 4))] = -np.inf
        bias[..., min(2, n.L - 1), :] = -np.inf
    return seeding.to_dtype(bias, dtype)


def allowed_positions(case: Case, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """Boolean (batch, H, L, S): positions a query may attend (:mod:`refattn.masks`' rule).

    mask AND causal AND window AND finite bias, computed from the case's own options; used
    to place poison and by tests.
    """
    n = case.shapes
    opts = case.options
    rule = allowed_mask(
        n.L,
        n.S,
        mask=inputs.get("mask"),
        bias=inputs.get("bias"),
        causal=bool(opts.get("causal")),
        window=opts.get("window"),
        align=opts.get("align", "top_left"),
    )
    allowed = np.ones((n.batch, n.H, n.L, n.S), dtype=bool) & rule
    if "kv_lengths" in inputs:  # each row aligned to its own length (refattn's reading)
        for b, length in enumerate(np.asarray(inputs["kv_lengths"]).tolist()):
            own = allowed_mask(
                n.L,
                int(length),
                causal=bool(opts.get("causal")),
                window=opts.get("window"),
                align=opts.get("align", "top_left"),
            )
            row = np.zeros((n.L, n.S), dtype=bool)
            row[:, :length] = own
            allowed[b] &= row
    return allowed


def _poison(inputs, case, kind):
    n = case.shapes
    allowed = allowed_positions(case, inputs)
    if "bias" in inputs:
        # NaN or +Inf (legal only where excluded); -Inf would merely re-exclude the position
        bias = np.broadcast_to(inputs["bias"], allowed.shape).copy()
        bias[~allowed] = np.nan if kind == "nan" else np.inf
        inputs["bias"] = bias
    heads = np.arange(n.H)
    group = n.H // n.K
    tile = case.options.get("gqa", "interleave") == "tile"
    kv_of = heads % n.K if tile else heads // group
    # a key/value position is poisonable when no query of any head reading it may attend
    used = np.zeros((n.batch, n.K, n.S), dtype=bool)
    for h in heads:
        used[:, kv_of[h]] |= allowed[:, h].any(axis=1)
    for name in ("k", "v"):
        array = inputs[name].copy()
        array[~used] = np.nan if kind == "nan" else np.inf
        if kind == "inf":
            array[~used, ::2] = -np.inf
        inputs[name] = array
