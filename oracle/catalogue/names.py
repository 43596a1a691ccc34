"""The names every part of the oracle shares: dtypes, their tags, categories, option keywords.

Examples
--------
>>> DTYPE_TAGS["bfloat16"], ARRAY_OPTIONS[:4]
('bf16', ('mask', 'bias', 'dropout_mask', 'alibi_slopes'))
"""

from __future__ import annotations

__all__ = [
    "DTYPES",
    "DTYPE_TAGS",
    "CATEGORIES",
    "ATTENTION_OPTIONS",
    "OPTION_NAMES",
    "ARRAY_OPTIONS",
    "FP8_DTYPES",
    "FP8_TRUTH_DTYPES",
    "FP8_OPTIONS",
]

#: The case dtypes, widest first (every case is built in each of them).
DTYPES = ("float64", "float32", "float16", "bfloat16")
#: The dtype part of a case name.
DTYPE_TAGS = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
#: "conformance": the pinned semantics; "robustness": poison at excluded positions.
CATEGORIES = ("conformance", "robustness")
#: Keywords of refattn.attention an implementation under test receives (besides q, k, v).
ATTENTION_OPTIONS = (
    "scale",
    "bias",
    "mask",
    "causal",
    "window",
    "align",
    "softcap",
    "alibi_slopes",
    "gqa",
    "dropout_mask",
    "dropout_p",
    "empty_rows",
    "sinks",
    "kv_lengths",
    "q_descale",
    "k_descale",
    "v_descale",
    "qv",
)
#: Keywords of refattn.attention / attention_vjp the catalogue must exercise.
OPTION_NAMES = ATTENTION_OPTIONS + ("grad_out", "grad_lse")
#: The array-valued options: built by the catalogue, stored among a fixture's inputs.
ARRAY_OPTIONS = (
    "mask",
    "bias",
    "dropout_mask",
    "alibi_slopes",
    "sinks",
    "kv_lengths",
    "q_descale",
    "k_descale",
    "v_descale",
    "qv",
)
#: Input formats of the fp8 cases (ml_dtypes names), by recipe value ``fp8``.
FP8_DTYPES = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}
#: Case dtypes (the truth's) of the fp8 cases: FlashAttention 3 returns bfloat16 for float8
#: inputs, so an fp8 case is a bfloat16 case whose q, k, v are stored as float8.
FP8_TRUTH_DTYPES = ("bfloat16",)
#: The options only fp8 cases carry (so only the dtypes of FP8_TRUTH_DTYPES exercise them).
FP8_OPTIONS = ("q_descale", "k_descale", "v_descale")
