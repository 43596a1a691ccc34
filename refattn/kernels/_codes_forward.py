"""The Numba CPU forward of quantised k and v (:class:`refattn.quantized.QuantisedRows`):
the short-query key splits dequantise each key block as they load it
(:mod:`._cpu_codes`); the query-block path packs its key blocks once per (batch, kv head)
anyway, so it takes the rows dequantised into the compute dtype (in parallel, no float64 copy
for float32 compute). Either way the results are bit-identical to the kernels' on the
dequantised inputs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ._args import kernel_arguments, read_only
from ._cpu_codes import dequantised_rows
from ._cpu_decode import forward_splits, split_keys
from ._cpu_forward import forward_blocks
from ._dispatch import announce_compile, compute_dtype

__all__ = ["attention_codes", "forward_codes"]


def attention_codes(spec, k_rows, v_rows, *, dtype=None):
    """(out, lse) of :func:`refattn.kernels.attention` (``return_lse=True``) for a softmax
    ``spec`` whose k and/or v come as :class:`refattn.quantized.QuantisedRows`
    (:func:`forward_codes`); the compute dtype is :func:`compute_dtype` of q's by default.

    Examples
    --------
    >>> import ml_dtypes
    >>> from refattn.quantized import quantised_rows
    >>> from refattn.spec import canonicalize
    >>> k = np.ones((1, 1, 2, 4), ml_dtypes.float8_e5m2)
    >>> rows = quantised_rows(k, np.array(0.5, np.float32), None, "k")
    >>> spec = canonicalize(np.ones((1, 1, 1, 4)), np.zeros((1, 1, 2, 4)), np.ones((1, 1, 2, 1)))
    >>> out, lse = attention_codes(spec, rows, None)
    >>> out.ravel().tolist(), float(lse[0, 0, 0]) == float(np.log(2) + 1)
    ([1.0], True)
    """
    from . import _cpu_decode, _cpu_forward

    if spec.normalizer != "softmax":
        raise ValueError(f"normalizer: quantised rows run the softmax, got {spec.normalizer!r}")
    announce_compile((_cpu_forward, _cpu_decode), names="forward")
    dtype = compute_dtype(spec.q.dtype) if dtype is None else np.dtype(dtype)
    return forward_codes(spec, k_rows, v_rows, dtype)


def forward_codes(spec, k_rows, v_rows, dtype):
    """out (B, H, L, E) and lse (B, H, L) in ``dtype`` of ``spec`` whose k (v) is given by
    ``k_rows`` (``v_rows``), :class:`refattn.quantized.QuantisedRows` of shape (B, K, S, D)
    ((B, K, S, E)), or None when ``spec.k`` (``spec.v``) holds the values; a spec's k or v
    given as rows is a placeholder of the right shape and is never read.

    Examples
    --------
    >>> import ml_dtypes
    >>> from refattn.quantized import quantised_rows
    >>> from refattn.spec import canonicalize
    >>> q = np.zeros((1, 1, 1, 4)); k = np.zeros((1, 1, 2, 4)); v = np.array([[[[1.0], [3.0]]]])
    >>> rows = quantised_rows(v.astype(ml_dtypes.float8_e4m3fn), None, None, "v")
    >>> out, lse = forward_codes(canonicalize(q, k, v), None, rows, np.float64)
    >>> out.ravel().tolist()
    [2.0]
    """
    light = dataclasses.replace(
        spec,
        k=spec.k if k_rows is None else spec.k[:, :, :0],
        v=spec.v if v_rows is None else spec.v[:, :, :0],
    )
    q, k, v, kv_head, dims, opts, fopts, terms = kernel_arguments(light, dtype)
    dims[:] = spec.dims
    batch, heads, kv_heads, length, keys, _, vdim = spec.dims
    out = np.empty((batch, heads, length, vdim), dtype)
    lse = np.empty((batch, heads, length), dtype)
    if not lse.size:
        return out, lse
    nsplit = split_keys(heads, kv_heads, length, keys)
    if nsplit:
        k, v = _kernel_form(k_rows, k, batch), _kernel_form(v_rows, v, batch)
        forward_splits(nsplit, q, k, v, kv_head, dims, opts, fopts, terms, out, lse)
    else:
        k, v = _packed_form(k_rows, k, batch, dtype), _packed_form(v_rows, v, batch, dtype)
        forward_blocks(q, k, v, kv_head, dims, opts, fopts, terms, out, lse)
    return out, lse


def _kernel_form(rows, array, batch):
    """The kernels' k or v argument: the array, or the rows as (codes, factors, table)."""
    if rows is None:
        return array
    codes = rows.codes.reshape((batch,) + rows.codes.shape[-3:])
    factors = rows.factors.reshape((batch,) + rows.factors.shape[-3:])
    return read_only(codes), read_only(factors), read_only(rows.table)


def _packed_form(rows, array, batch, dtype):
    """The array, or the rows' values in ``dtype`` (B, K, S, D)."""
    if rows is None:
        return array
    values = dequantised_rows(rows, dtype)
    return read_only(values.reshape((batch,) + values.shape[-3:]))
