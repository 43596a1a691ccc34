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
    "STRICT_ONLY",
    "ATTENTION_OPTIONS",
    "OPTION_NAMES",
    "ARRAY_OPTIONS",
    "FP8_DTYPES",
    "FP8_TRUTH_DTYPES",
    "FP8_OPTIONS",
    "FP4_FORMATS",
    "FP4_TRUTH_DTYPES",
    "FP4_OPTIONS",
]

#: The case dtypes, widest first (every case is built in each of them).
DTYPES = ("float64", "float32", "float16", "bfloat16")
#: The dtype part of a case name.
DTYPE_TAGS = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
#: "conformance": the pinned semantics; "robustness": poison at excluded positions;
#: "refusal": malformed inputs a kernel must refuse (no truth, see attention_refusal_families).
CATEGORIES = ("conformance", "robustness", "refusal")
#: The categories whose failures fail a validation only under strict (--strict).
STRICT_ONLY = ("robustness", "refusal")
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
    "key_indices",
    "key_block_indices",
    "key_block_size",
    "q_block_scale",
    "k_block_scale",
    "v_block_scale",
    "normalizer",
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
    "key_indices",
    "key_block_indices",
    "q_block_scale",
    "k_block_scale",
    "v_block_scale",
    "qv",
)
#: Input formats of the fp8 cases (ml_dtypes names), by recipe value ``fp8``.
FP8_DTYPES = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}
#: Case dtypes (the truth's) of the fp8 cases: FlashAttention 3 returns bfloat16 for float8
#: inputs, so an fp8 case is a bfloat16 case whose q, k, v are stored as float8.
FP8_TRUTH_DTYPES = ("bfloat16",)
#: The options only fp8 cases carry (so only the dtypes of FP8_TRUTH_DTYPES exercise them).
FP8_OPTIONS = ("q_descale", "k_descale", "v_descale")
#: fp4 formats by recipe value ``fp4``: (block scale dtype, values per scale).
FP4_FORMATS = {"nvfp4": ("float8_e4m3fn", 16), "mxfp4": ("float8_e8m0fnu", 32)}
#: Case dtypes (the truth's) of the fp4 cases: k, v (and q) fp4, the rest in the case dtype.
FP4_TRUTH_DTYPES = ("bfloat16", "float16", "float32")
#: The options only fp4 cases carry.
FP4_OPTIONS = ("q_block_scale", "k_block_scale", "v_block_scale")
