"""Quantised k and v streamed as codes into the Numba forward (:func:`refattn.attention` with
``backend="numba"``): which calls do, and the spec they run on.

A float8 or float4 k or v is otherwise dequantised whole into float64 before any path runs
(:func:`refattn.quantized.dequantize_inputs`): for an NVFP4 decode step that copy, 8 bytes
per element, costs more than the kernel. On the Numba softmax forward the kernels instead read
the codes and one factor per block (:class:`refattn.quantized.QuantisedRows`) and dequantise
each key block as they load it (:mod:`refattn.kernels`), to the same values: the results are
bit-identical. The spec is canonicalised with a zero-stride placeholder of the right shape in
place of each streamed input (every check of the call still runs; the rows' own checks are
:func:`~refattn.quantized.quantised_rows`'s, the messages of the whole-tensor path).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from . import config
from .blockscale import is_fp4
from .quantized import FP8_DTYPES, quantised_rows
from .spec import canonicalize

__all__ = [
    "streamed_codes",
    "streamed_spec",
    "k_extremes",
    "kernel_forward",
    "with_codes",
    "with_values",
]


def _quantised(x) -> bool:
    name = getattr(getattr(x, "dtype", None), "name", None)
    return is_fp4(x) or name in FP8_DTYPES


def streamed_codes(q, k, v, options: dict, backend, precision, other_path):
    """``(k, v, options, codes)`` for :func:`refattn.spec.canonicalize`: ``codes`` is None (the
    call dequantises as usual; k, v, options unchanged) or ``(k_rows, v_rows)``, the
    :class:`~refattn.quantized.QuantisedRows` of the streamed inputs (None for one that is not
    quantised), whose k, v are then float64 placeholders (zero strides) and whose options
    lack their descale and block scale.

    Streamed: the softmax on ``backend="numba"`` (precision "float64"), or on the fast exact
    engine (``precision="exact"``, both k and v quantised:
    :mod:`refattn.exact.fast.codes_inputs`); no qv, sinks, kv_lengths or listed key indices
    (they rewrite k or read it by index), and q, k, v with the same batch dimensions (three or
    more axes). ``other_path``: the call reads k otherwise (the gather kernels; an lse in base
    2, whose exact path re-runs the engine's referee on the spec).

    Examples
    --------
    >>> import ml_dtypes
    >>> k = np.ones((1, 1, 2, 32), ml_dtypes.float8_e4m3fn); q = np.ones((1, 1, 1, 32))
    >>> opts = dict(normalizer="softmax", qv=None, sinks=None, kv_lengths=None,
    ...             key_indices=None, key_block_indices=None, k_descale=None,
    ...             v_descale=None, k_block_scale=None, v_block_scale=None)
    >>> k2, v2, _, codes = streamed_codes(q, k, k, opts, "numba", "float64", False)
    >>> k2.strides, codes[0].codes.dtype.name
    ((0, 0, 0, 0), 'uint8')
    """
    skip = any(
        options[name] is not None
        for name in ("qv", "sinks", "kv_lengths", "key_indices", "key_block_indices")
    )
    exact = precision == "exact"
    fast_exact = exact and backend == "numpy" and config.EXACT_ENGINE == "fast"
    if (
        not (fast_exact or (backend == "numba" and not exact))
        or other_path
        or skip
        or options["normalizer"] != "softmax"
        or not (_quantised(k) or _quantised(v))
    ):
        return k, v, options, None
    arrays = [np.asarray(x) if not hasattr(x, "shape") else x for x in (q, k, v)]
    if min(a.ndim for a in arrays) < 3 or len({a.shape[:-3] for a in arrays}) != 1:
        return k, v, options, None
    rows = [
        quantised_rows(x, options[f"{n}_descale"], options[f"{n}_block_scale"], n)
        if _quantised(x)
        else None
        for n, x in (("k", k), ("v", v))
    ]
    if all(r is None for r in rows) or (exact and any(r is None for r in rows)):
        return k, v, options, None
    options = dict(options)
    placed = []
    for n, x, r in (("k", k, rows[0]), ("v", v, rows[1])):
        if r is not None:
            options.update({f"{n}_descale": None, f"{n}_block_scale": None})
            x = np.broadcast_to(np.zeros((), np.float64), r.shape)
        placed.append(x)
    return placed[0], placed[1], options, tuple(rows)


def streamed_spec(q, k, v, options: dict, backend, precision, other_path):
    """``(spec, codes)``: :func:`refattn.spec.canonicalize` of the call after
    :func:`streamed_codes` (the same arguments)."""
    k, v, options, codes = streamed_codes(q, k, v, options, backend, precision, other_path)
    return canonicalize(q, k, v, **options), codes


def k_extremes(kv):
    """None, or for streamed k rows a (1, 1) float64 array holding max |k| over its finite
    values (:func:`refattn.kernels.codes_abs_max`): what the Numba range check reads of k."""
    if not kv or kv[0] is None:
        return None
    from .kernels import codes_abs_max

    return np.array([[codes_abs_max(kv[0])]])


def kernel_forward(spec, kv):
    """(out, lse) of the Numba forward: :func:`refattn.kernels.attention_codes` with the
    streamed rows ``kv`` of :func:`streamed_codes`, or :func:`refattn.kernels.attention`."""
    from . import kernels

    return kernels.attention_codes(spec, *kv) if kv else kernels.attention(spec, return_lse=True)


def with_codes(engine, kv):
    """The exact engine (:func:`refattn.exact.fast.fast_exact_forward`) given the streamed
    rows ``kv``, or ``engine`` itself when there are none."""
    return functools.partial(engine, kv=kv) if kv else engine


def with_values(spec, kv):
    """``spec`` with the values of the streamed k and v in place of their placeholders.

    Examples
    --------
    >>> import ml_dtypes
    >>> from refattn.spec import canonicalize
    >>> k = np.full((1, 1, 2, 2), 1.5, ml_dtypes.float8_e4m3fn)
    >>> rows = quantised_rows(k, None, None, "k")
    >>> spec = canonicalize(np.ones((1, 1, 1, 2)), np.zeros(k.shape), np.ones((1, 1, 2, 1)))
    >>> with_values(spec, (rows, None)).k[0, 0].tolist()
    [[1.5, 1.5], [1.5, 1.5]]
    """
    changes = {
        name: rows.dequantised().reshape(getattr(spec, name).shape)
        for name, rows in zip("kv", kv, strict=True)
        if rows is not None
    }
    return dataclasses.replace(spec, **changes)
