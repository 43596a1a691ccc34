"""refattn's own paths as adapters: the float64 NumPy path and the exact path.

``refattn-float64`` runs :func:`refattn.attention` with ``precision="float64"`` (every
option supported) and rounds its float64 results once to the case dtype (nearest, ties to
even, with refattn's integer rounding so that bfloat16 is not rounded twice through float32).
Its error is the float64 path's documented bound plus that one rounding: it is the oracle's
"same-dtype" control and must pass every case.

``refattn-exact`` runs ``precision="exact"`` with ``out_dtype`` = the case dtype: its output
*is* the truth, so its error must be exactly zero (a meta-test of the oracle's machinery).
It is slow (mpmath); use it on small cases.

Both expose ``.vjp(q, k, v, grad_out, grad_lse=None, **options) -> (dq, dk, dv, dbias,
dsinks)``. Every option passes through (sinks, kv_lengths, float8 inputs with their
descales: results of float8 inputs are rounded to bfloat16, :func:`output_dtype`).

Examples
--------
>>> import numpy as np
>>> from oracle.adapters import get
>>> q = np.array([[1.0, 0.0]], np.float32); k = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
>>> v = np.array([[1.0], [3.0]], np.float32)
>>> out = get("refattn-float64")(q, k, v, causal=True)
>>> out.dtype.name, out.tolist()
('float32', [[1.0]])
"""

from __future__ import annotations

import numpy as np

from oracle.adapters import OPTION_NAMES, Adapter
from refattn.attention import attention, attention_vjp
from refattn.exact.rounding import format_of, round_array

__all__ = ["RefattnFloat64", "RefattnExact", "round_to", "output_dtype"]


def output_dtype(q) -> np.dtype:
    """The dtype results are rounded to: q's, or bfloat16 for float8 q (FlashAttention 3's
    output type for float8 inputs; the oracle's fp8 cases are bfloat16 cases), float32 for
    float4 q (the fp4 cases' widest truth dtype)."""
    dtype = np.asarray(q).dtype
    if dtype.name.startswith("float4"):  # fp4 q: the widest fp4 kernel output
        return np.dtype(np.float32)
    return np.dtype(format_of("bfloat16").dtype) if dtype.name.startswith("float8") else dtype


def round_to(values, dtype) -> np.ndarray:
    """float64 values rounded once (nearest, ties to even) to ``dtype``; None stays None."""
    if values is None:
        return None
    values = np.asarray(values, dtype=np.float64)
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return values
    if dtype in (np.float32, np.float16):
        return values.astype(dtype)  # IEEE conversions in NumPy round once, to nearest even
    rounded = round_array(values.astype(object), format_of(dtype))
    return np.where(np.signbit(values) & (rounded == 0), -0.0, rounded).astype(dtype)


class _RefattnAdapter(Adapter):
    precision = "float64"

    def _check_names(self, options):
        unknown = sorted(set(options) - set(OPTION_NAMES) - {"grad_lse"})
        if unknown:
            raise TypeError(f"{self.name}: unknown option(s) {unknown}")

    def _keywords(self, dtype):
        if self.precision == "exact":
            return {"precision": "exact", "out_dtype": dtype.name}
        return {"precision": "float64"}

    def __call__(self, q, k, v, **options):
        self._check_names(options)
        dtype = output_dtype(q)
        result = attention(q, k, v, **options, **self._keywords(dtype))
        if isinstance(result, tuple):
            return tuple(round_to(r, dtype) for r in result)
        return round_to(result, dtype)

    def vjp(self, q, k, v, grad_out, **options):
        """(dq, dk, dv, dbias, dsinks) of :func:`refattn.attention_vjp`, in the input dtype."""
        self._check_names(options)
        options.pop("return_lse", None)
        dtype = output_dtype(q)
        grads = attention_vjp(q, k, v, grad_out, **options, **self._keywords(dtype))
        return tuple(round_to(g, dtype) for g in grads)


class RefattnFloat64(_RefattnAdapter):
    """refattn.attention(precision="float64"), rounded once to the case dtype."""

    name = "refattn-float64"
    peer = "refattn float64 path"
    fully_masked_rows = "as empty_rows asks"
    precision = "float64"


class RefattnExact(_RefattnAdapter):
    """refattn.attention(precision="exact", out_dtype=case dtype): the truth itself."""

    name = "refattn-exact"
    peer = "refattn exact path"
    fully_masked_rows = "as empty_rows asks"
    precision = "exact"
