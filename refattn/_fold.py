"""Folding (:func:`refattn.spec.fold`): an equivalent :class:`refattn.spec.AttentionSpec` with
fewer options, for the paths that do not implement an option natively; and
:func:`with_indices`, the spec with its sparse key indices (the set reading as a mask).

Re-exported by :mod:`refattn.spec` (its public home); the spec's own methods
(:meth:`~refattn.spec.AttentionSpec.allowed`, ``alibi``, ``alibi_offset``) state the rule
that the fold writes out, and :meth:`~refattn.spec.AttentionSpec.without` switches off the
options it writes out (their defaults in :data:`refattn.spec.OPTIONS`). This module imports
nothing from :mod:`refattn.spec` (which imports it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import sparse_indices


# --------------------------------------------------------------------------------------
# folding: an equivalent spec with fewer options
# --------------------------------------------------------------------------------------
def needs_fold(spec) -> bool:
    """True when ``spec`` uses an option that :func:`fold` rewrites for the kernels."""
    return spec.sinks is not None or spec.kv_lengths is not None


def _planes(spec, fn) -> np.ndarray:
    batch, heads = spec.dims[:2]
    return np.stack([np.stack([fn(b, h) for h in range(heads)]) for b in range(batch)])


def fold(spec, *, alibi_into_bias: bool):
    """``spec`` without kv_lengths and sinks.

    Rewrite an :class:`AttentionSpec` into an equivalent one with fewer options, for the paths
    that do not implement an option natively (the Numba kernels; the exact path for sinks).

    * The allowed set (causal, window, per-row key lengths, mask, -inf bias) becomes an explicit
      boolean mask, with causal/window/kv_lengths off: the same set, whatever the alignment.
    * ALiBi: the float64 paths (``alibi_into_bias=True``) fold it into the bias
      (``bias + (-m_h |i + o_b - j|)`` in float64: one more rounding). The exact paths keep it
      native and exact: the folded spec pins each batch row's offset ``o_b``
      (:attr:`AttentionSpec.alibi_offsets`, relative to the row's own key length under
      ``align="bottom_right"``, as before the fold) and the keys it applies to
      (:attr:`AttentionSpec.alibi_keys`: not the sink's).
    * A sink becomes one more key: k = 0 and v = 0 (so its score is ``s * 0 = 0`` and softcap(0) =
      0 exactly), bias = the sink logit, always allowed and kept, no ALiBi term. Its weight is the
      sink's share of the normaliser and it adds nothing to the output, which is exactly the
      sink's definition; the bias gradient of that column, summed over batch and rows, is the
      sink's gradient. On the exact paths that sum is part of the one rounding: the folded spec's
      :attr:`AttentionSpec.dbias_index` sends the caller's bias positions to the caller's dbias
      (summed over bias's broadcast dimensions) and the sink column of head h to slot
      ``n_bias + h``, so dbias comes back flat as ``(dbias.ravel(), dsinks)``
      (:func:`split_sink_grads`).

    ``alibi_into_bias=True`` (float64 paths) adds ALiBi to the bias; ``False`` (exact paths)
    keeps it exact and native, and reduces the folded dbias to ``(dbias, dsinks)`` slots.
    """
    batch, heads, _, length, keys, _, _ = spec.dims
    allowed = _planes(spec, spec.allowed)
    bias = None if spec.bias is None else np.where(allowed, spec.bias, 0.0)
    changes = dict(
        mask=allowed,
        offset=0,
        bias=bias,
        bias_shape=None if bias is None else bias.shape,
    )
    if spec.alibi_slopes is not None:
        if alibi_into_bias:
            alibi = _planes(spec, lambda b, h: spec.alibi(h, b))
            changes.update(
                alibi_slopes=None,
                bias=alibi if bias is None else bias + alibi,
                bias_shape=(batch, heads, length, keys),
            )
        else:
            changes.update(
                alibi_offsets=np.array(
                    [spec.alibi_offset(b) for b in range(batch)], dtype=np.int64
                ),
                alibi_keys=keys if spec.alibi_keys is None else spec.alibi_keys,
            )
    if spec.sinks is not None:
        changes.update(_sink_key(spec, allowed, changes["bias"], exact=not alibi_into_bias))
    # causal, window, align, kv_lengths off: the explicit mask holds the same set
    return spec.without("interval", **changes)


def split_sink_grads(spec, flat: np.ndarray):
    """(dbias in the caller's bias shape or None, dsinks (H,)) from the flat dbias of an
    exact path's folded spec (``spec`` is the caller's, unfolded)."""
    heads = spec.dims[1]
    if spec.bias is None:
        return None, flat[-heads:]
    return flat[:-heads].reshape(spec.bias_shape), flat[-heads:]


def _sink_key(spec, allowed, bias, exact) -> dict:
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
        bias = np.concatenate(
            [bias, np.broadcast_to(sink_column, (batch, heads, length, 1))], axis=-1
        )
        bias_shape = bias.shape
    keep = None if spec.dropout_mask is None else extend(spec.dropout_mask, True)
    changes = dict(
        k=k,
        v=v,
        mask=extend(allowed, True),
        bias=bias,
        bias_shape=bias_shape,
        dropout_mask=keep,
        sinks=None,
    )
    if exact:
        changes.update(_sink_slots(spec))
    return changes


def _sink_slots(spec) -> dict:
    """dbias_index and bias_shape of an exact path's folded spec: the caller's bias positions
    to their dbias slots, the sink column of head h to slot ``n_bias + h``."""
    batch, heads, _, length, keys, _, _ = spec.dims
    if spec.bias is None:
        user, n_bias = np.full((1, 1, 1, keys), -1, dtype=np.int64), 0
    else:
        shape = tuple(spec.bias_shape)
        n_bias = int(np.prod(shape))
        full = tuple(spec.batch_shape) + (heads, length, keys)
        user = np.broadcast_to(np.arange(n_bias, dtype=np.int64).reshape(shape), full)
        user = user.reshape((batch, heads, length, keys))
    user = np.broadcast_to(user, (batch, heads, length, keys))
    sink = np.broadcast_to(
        n_bias + np.arange(heads, dtype=np.int64)[None, :, None, None], (batch, heads, length, 1)
    )
    return dict(dbias_index=np.concatenate([user, sink], axis=-1), bias_shape=(n_bias + heads,))


def with_indices(spec, indices: np.ndarray, reading: str):
    """The spec with its key indices; the set reading ANDs the listed set into the mask (one
    (B, K, L, S) plane per kv head, broadcast over the query heads when K = 1)."""
    changes = dict(key_indices=indices, index_reading=reading)
    if reading == "set":
        batch, heads, kv_heads, length, keys, _, _ = spec.dims
        listed = sparse_indices.index_mask(indices, keys)
        target = (batch, heads, length, keys)
        listed = np.broadcast_to(listed, target) if kv_heads == 1 else listed[:, spec.kv_head]
        changes["mask"] = listed if spec.mask is None else spec.mask & listed
    return dataclasses.replace(spec, **changes)
