"""The names every part of the oracle shares: dtypes, their tags, categories, option keywords.

Examples
--------
>>> DTYPE_TAGS["bfloat16"], ARRAY_OPTIONS[:4]
('bf16', ('bias', 'mask', 'alibi_slopes', 'dropout_mask'))
"""

from __future__ import annotations

from refattn.spec import OPTIONS, option_names

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
#: Keywords of refattn.attention an implementation under test receives (besides q, k, v): the
#: options of refattn.spec.OPTIONS but ``index_reading`` (the sparse cases pin the set reading,
#: oracle.reading.sparse).
ATTENTION_OPTIONS = tuple(name for name in option_names() if name != "index_reading")
#: Keywords of refattn.attention / attention_vjp the catalogue must exercise.
OPTION_NAMES = ATTENTION_OPTIONS + ("grad_out", "grad_lse")
#: The array-valued options: built by the catalogue, stored among a fixture's inputs.
ARRAY_OPTIONS = tuple(row.name for row in OPTIONS if row.is_array)
#: Input formats of the fp8 cases (ml_dtypes names), by recipe value ``fp8``.
FP8_DTYPES = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}
#: Case dtypes (the truth's) of the fp8 cases: FlashAttention 3 returns bfloat16 for float8
#: inputs, so an fp8 case is a bfloat16 case whose q, k, v are stored as float8.
FP8_TRUTH_DTYPES = ("bfloat16",)
#: The options only fp8 cases carry (so only the dtypes of FP8_TRUTH_DTYPES exercise them).
FP8_OPTIONS = tuple(row.name for row in OPTIONS if row.kind == "descale")
#: fp4 formats by recipe value ``fp4``: (block scale dtype, values per scale).
FP4_FORMATS = {"nvfp4": ("float8_e4m3fn", 16), "mxfp4": ("float8_e8m0fnu", 32)}
#: Case dtypes (the truth's) of the fp4 cases: k, v (and q) fp4, the rest in the case dtype.
FP4_TRUTH_DTYPES = ("bfloat16", "float16", "float32")
#: The options only fp4 cases carry.
FP4_OPTIONS = tuple(row.name for row in OPTIONS if row.kind == "block scale")
