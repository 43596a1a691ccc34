"""Implementations with their own fixed reading of rows with no allowed key
(tests/meta/test_empty_rows.py): NaN rows (a ``-inf`` fill, ``0/0``) and averaged rows (a large
finite fill: uniform weights, the mean of v over all keys). Neither takes ``empty_rows``; each
is correct under its declared reading (``validate(..., empty_rows=...)``)."""

from __future__ import annotations

import numpy as np

from oracle.reading.baseline import textbook_attention
from refattn.broadcast import expand_kv

__all__ = ["nan_on_empty_rows", "average_on_empty_rows"]


def _result(q, k, v, options, reading):
    options = {n: x for n, x in options.items() if n != "empty_rows"}  # it has no such option
    return textbook_attention(q, k, v, empty_rows=reading, **options)


def nan_on_empty_rows(q, k, v, return_lse=False, **options):
    """Textbook attention whose empty rows come out NaN (out and lse)."""
    sigmoid = options.get("normalizer") == "sigmoid"  # no 0/0 without a normaliser
    result = _result(q, k, v, options, "zero" if sigmoid else "nan")
    return (result.out, result.lse) if return_lse else result.out


def average_on_empty_rows(q, k, v, return_lse=False, **options):
    """Textbook attention whose empty rows average v over all keys (a finite fill), with the
    lse such a fill gives (``fill + log S``)."""
    result = _result(q, k, v, options, "zero")
    empty = ~np.asarray(result.allowed).any(axis=-1)
    if options.get("sinks") is not None or options.get("normalizer") == "sigmoid":
        empty = np.zeros_like(empty)  # a sink takes the weight; sigmoid(fill) is 0
    dtype = np.asarray(q).dtype
    v64 = np.asarray(v).astype(np.float64)
    if v64.ndim > 2:
        v64 = expand_kv(v64, np.shape(q)[-3], options.get("gqa") or "interleave")
    mean = v64.mean(axis=-2, keepdims=True).astype(dtype)
    empty = np.broadcast_to(empty, result.out.shape[:-1])
    out = np.where(empty[..., None], mean, result.out).astype(dtype)
    fill = np.finfo(np.float32).min / 2 + np.log(np.shape(k)[-2])
    lse = np.where(empty, fill, np.asarray(result.lse, dtype=np.float64)).astype(result.lse.dtype)
    return (out, lse) if return_lse else out
