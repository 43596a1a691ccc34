"""Rewrite an :class:`AttentionSpec` into an equivalent one with fewer options, for the paths
that do not implement an option natively (the Numba kernels; the exact path for sinks).

* The allowed set (causal, window, per-row key lengths, mask, -inf bias) becomes an explicit
  boolean mask, with causal/window/kv_lengths off: the same set, whatever the alignment.
* ALiBi becomes part of the bias (``bias + (-m_h |i + o_b - j|)`` in float64: one more
  rounding, for float64 paths only).
* A sink becomes one more key: k = 0 and v = 0 (so its score is ``s * 0 = 0`` and softcap(0) =
  0 exactly), bias = the sink logit, always allowed and kept. Its weight is the sink's share of
  the normaliser and it adds nothing to the output, which is exactly the sink's definition; the
  bias gradient of that column, summed over batch and rows, is the sink's gradient.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ._spec import AttentionSpec

__all__ = ["fold", "needs_fold"]


def needs_fold(spec: AttentionSpec) -> bool:
    """True when ``spec`` uses an option that :func:`fold` rewrites for the kernels."""
    return spec.sinks is not None or spec.kv_lengths is not None


def _planes(spec, fn) -> np.ndarray:
    batch, heads = spec.dims[:2]
    return np.stack([np.stack([fn(b, h) for h in range(heads)]) for b in range(batch)])


def fold(spec: AttentionSpec, *, alibi_into_bias: bool) -> AttentionSpec:
    """``spec`` without kv_lengths and sinks (see the module docstring).

    ``alibi_into_bias=False`` (exact paths) refuses ALiBi together with a sink or per-row key
    lengths: the folded ALiBi term would be rounded.
    """
    batch, heads, _, length, keys, _, _ = spec.dims
    if spec.alibi_slopes is not None and not alibi_into_bias:
        raise NotImplementedError("alibi_slopes together with sinks or kv_lengths: the exact "
                                  "path does not fold ALiBi into the bias (it would round); "
                                  "use precision='float64'")
    allowed = _planes(spec, spec.allowed)
    bias = None if spec.bias is None else np.where(allowed, spec.bias, 0.0)
    if spec.alibi_slopes is not None:
        alibi = _planes(spec, lambda b, h: spec.alibi(h, b))
        bias = alibi if bias is None else bias + alibi
    changes = dict(mask=allowed, causal=False, window=None, kv_lengths=None, alibi_slopes=None,
                   align="top_left", offset=0, bias=bias,
                   bias_shape=None if bias is None else bias.shape)
    if spec.sinks is not None:
        changes.update(_sink_key(spec, allowed, bias))
    return dataclasses.replace(spec, **changes)


def _sink_key(spec, allowed, bias) -> dict:
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims

    def extend(array, fill):
        column = np.full(array.shape[:-1] + (1,), fill, dtype=array.dtype)
        return np.concatenate([np.broadcast_to(array, array.shape), column], axis=-1)

    k = np.concatenate([spec.k, np.zeros((batch, kv_heads, 1, dim), spec.k.dtype)], axis=-2)
    v = np.concatenate([spec.v, np.zeros((batch, kv_heads, 1, vdim), spec.v.dtype)], axis=-2)
    sink_column = np.broadcast_to(spec.sinks[None, :, None, None], (1, heads, 1, 1))
    if bias is None:  # broadcast over batch and rows: the exact dbias reduction is dsinks
        bias = np.concatenate([np.zeros((1, heads, 1, keys)), sink_column], axis=-1)
        bias = np.broadcast_to(bias, (batch, heads, length, keys + 1))
        bias_shape = (1, heads, 1, keys + 1)
    else:
        bias = np.concatenate([bias, np.broadcast_to(sink_column, (batch, heads, length, 1))],
                              axis=-1)
        bias_shape = bias.shape
    keep = None if spec.dropout_mask is None else extend(spec.dropout_mask, True)
    return dict(k=k, v=v, mask=extend(allowed, True), bias=bias, bias_shape=bias_shape,
                dropout_mask=keep, sinks=None)
