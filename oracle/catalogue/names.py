"""The names every part of the oracle shares: dtypes, their tags, categories, option keywords.

Examples
--------
>>> DTYPE_TAGS["bfloat16"], ARRAY_OPTIONS
('bf16', ('mask', 'bias', 'dropout_mask', 'alibi_slopes'))
"""

from __future__ import annotations

__all__ = ["DTYPES", "DTYPE_TAGS", "CATEGORIES", "ATTENTION_OPTIONS", "OPTION_NAMES",
           "ARRAY_OPTIONS"]

#: The case dtypes, widest first (every case is built in each of them).
DTYPES = ("float64", "float32", "float16", "bfloat16")
#: The dtype part of a case name.
DTYPE_TAGS = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
#: "conformance": the pinned semantics; "robustness": poison at excluded positions.
CATEGORIES = ("conformance", "robustness")
#: Keywords of refattn.attention an implementation under test receives (besides q, k, v).
ATTENTION_OPTIONS = (
    "scale", "bias", "mask", "causal", "window", "align", "softcap", "alibi_slopes", "gqa",
    "dropout_mask", "dropout_p", "empty_rows",
)
#: Keywords of refattn.attention / attention_vjp the catalogue must exercise.
OPTION_NAMES = ATTENTION_OPTIONS + ("grad_out", "grad_lse")
#: The array-valued options: built by the catalogue, stored among a fixture's inputs.
ARRAY_OPTIONS = ("mask", "bias", "dropout_mask", "alibi_slopes")
