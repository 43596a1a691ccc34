"""Implementations that saturate instead of overflowing (tests/meta/test_unjudged.py): what a
runtime computing in float32 returns for float64 values near overflow (OpenVINO's CPU plugin
gave 2.2e38 where the truth is 3.5e305), and an accumulator kept in the case dtype that clamps
to the largest finite value. Both must fail the worst-overflow cases in both tolerance tiers.
"""

from __future__ import annotations

import numpy as np

from oracle.reading.baseline import textbook_attention
from refattn.exact.rounding import format_of

__all__ = ["float32_saturated", "saturating_accumulator"]


def _saturate(x, dtype):
    """``x`` in ``dtype`` with values past its range clamped to its largest finite value."""
    top = (
        float(np.finfo(format_of(dtype).dtype).max)
        if dtype != "bfloat16"
        else 2.0**127 * (2 - 2.0**-7)
    )
    x = np.asarray(x, dtype=np.float64)
    return np.clip(x, -top, top).astype(format_of(dtype).dtype)


def float32_saturated(q, k, v, return_lse=False, **options):
    """Textbook attention on the inputs saturated to float32, in float32, the output returned
    in the case dtype."""
    dtype = np.asarray(q).dtype
    narrow = [_saturate(x, "float32") for x in (q, k, v)]
    result = textbook_attention(*narrow, **options)
    out = _saturate(result.out, "float32").astype(dtype)
    return (out, result.lse.astype(dtype)) if return_lse else out


def saturating_accumulator(q, k, v, return_lse=False, **options):
    """The unnormalised ``exp(s - max) @ V`` (FlashAttention's order) summed key by key in the
    case dtype, clamped at its largest finite value, then divided by the normaliser."""
    dtype = format_of(np.asarray(q).dtype).name
    result = textbook_attention(q, k, v, dtype="float64", **options)
    weights = np.asarray(result.weights, dtype=np.float64)
    top = weights.max(axis=-1, keepdims=True)
    weights = np.divide(weights, top, out=np.zeros_like(weights), where=top > 0)
    values = np.asarray(v, dtype=np.float64)
    groups = weights.shape[-3] // values.shape[-3]
    values = np.repeat(values, groups, axis=-3)
    total = np.zeros(weights.shape[:-1] + values.shape[-1:])
    for j in range(values.shape[-2]):
        term = weights[..., j, None] * values[..., j, None, :]
        total = _saturate(_saturate(total, dtype).astype(np.float64) + term, dtype)
        total = total.astype(np.float64)
    norm = weights.sum(axis=-1, keepdims=True)
    out = _saturate(np.divide(total, norm, out=np.zeros_like(total), where=norm > 0), dtype)
    return (out, result.lse.astype(out.dtype)) if return_lse else out
