"""Exact attention vjp on sparse keys by gather: only the keys some row lists are visited.

With ``key_indices`` or ``key_block_indices`` read as a set, query row i of plane (b, h) may
attend to ``I_{b,g,i} = {idx[b, g, i, t] : 0 <= idx[b, g, i, t] < S}`` (g = kv_head[h];
duplicates count once, -1 and out-of-range entries are ignored; :mod:`refattn.sparse_indices`)
intersected with every other restriction. The dense route ANDs that set into a (B, H, L, S)
mask and runs the exact vjp (:func:`refattn.exact.attention_vjp.exact_vjp`) over all S keys;
this one never builds an (L, S) plane:

* per kv-head plane (b, g) the keys listed by some of its rows, ``U_{b,g}`` of them ascending
  (``U <= min(S, L T)``; a decode row lists at most T), are gathered into a compacted key
  axis of ``W = max U`` positions (the rows past ``U`` are zero keys that no row allows);
* the allowed set on that axis is row i's listed positions (their columns in the compacted
  list) ANDed with everything else evaluated at the original key positions: the structural
  interval (causal, window, key length: :meth:`refattn.spec.AttentionSpec.intervals`), the
  caller's mask and the dropout keep-mask (their columns gathered); the compacted spec has
  no causal, window or key length of its own;
* the exact vjp runs on that compacted spec (the fast engine with the referee for what it
  leaves undecided, dv's latent term with ``qv``, sinks, the non-finite pattern: all of
  ``refattn.attention_vjp``'s exact route), and dk, dv are scattered back to the S key rows,
  +0 at every key no row lists.

Why the bits are those of the dense route: the exact gradient of the compacted problem is, as
a real number, the exact gradient of the original one. The softmax weight of row i (eq. (1)
of the conventions, ``w_ij = exp(t_ij - m_i) / Z_i``, Z summing over the allowed keys) is
taken over the same allowed keys with the same scores ``t_ij = s q_i . k_j`` (no score term
depends on a key's position once causal, window and key length are in the mask: ALiBi and a
bias are left to the dense route), so ``dS_ij = w_ij (dP_ij - Delta_i + g_i)``,
``dq_i = s sum_j dT_ij k_j``, ``dk_j = s sum_i dT_ij q_i`` and ``dv_j = sum_i P'_ij dO_i`` are
the same sums of the same nonzero terms (a key that no row allows adds exactly 0 to dq and has
``dk_j = dv_j = 0``). Each element is that exact value rounded once, on either route.

The route is chosen by walk length (:func:`gathers`): the dense route walks each row's
structural interval, the gather route each row's kv head's ``U`` compacted keys; a decode
step (``U <= T << S``) gathers, a causal prefill whose rows together list nearly every key
keeps the dense route (its causal intervals are half as long). Either gives the same bits.

Cost: O(B K U (D + E)) to gather, the exact vjp on ``W`` keys instead of S (memory of its
(B, H, L, W) allowed plane O(H L W), O(H T) for a decode step), and the (B, K, S, D + E)
zero-filled dk, dv the caller receives. Unlisted keys' values are never read: a NaN or Inf in
a key that no row lists does not reach the result (the dense route reads every key; both
agree whenever the keys are finite).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...sparse_indices import index_mask
from ...spec import AttentionSpec

__all__ = ["compact_spec", "dense_spec", "gather_vjp", "gathered_keys", "gathers"]


def _listed_rows(spec: AttentionSpec):
    """(lists, counts): each row's distinct listed positions ascending, (B, K, L, T) int64
    (entries past ``counts[b, g, i]`` unused), of a gather spec's set-read indices (the set
    reading of :func:`refattn.exact.fast.gather_kernels.compact_lists`, in NumPy: no thread
    pool to wake for a decode step's few lists)."""
    idx = np.asarray(spec.key_indices, dtype=np.int64)
    keys = spec.dims[4]
    ordered = np.sort(np.where((idx >= 0) & (idx < keys), idx, -1), axis=-1)
    first = ordered >= 0  # out of range: not a position; then the first of equal entries
    first[..., 1:] &= ordered[..., 1:] != ordered[..., :-1]
    moved = np.argsort(~first, axis=-1, kind="stable")  # the distinct positions first, in order
    return np.take_along_axis(ordered, moved, axis=-1), first.sum(axis=-1)


def gathered_keys(spec: AttentionSpec):
    """(keys_of, local, counts) of a gather spec (set-read indices kept as (B, K, L, T) lists):
    ``keys_of`` (B, K, W) the listed positions of each kv-head plane ascending (-1 past the
    plane's own count), ``local`` (B, K, L, T) each row's listed keys as columns of
    ``keys_of`` (ascending, entries past ``counts`` (B, K, L) unused).

    Examples
    --------
    >>> from refattn.kernels import gather_spec
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((2, 2)), np.zeros((9, 2)), np.zeros((9, 1)))
    >>> keys_of, local, counts = gathered_keys(gather_spec(spec, np.array([[7, 2, 7], [-1, 4, 9]])))
    >>> keys_of.tolist(), local[0, 0, 0, :2].tolist(), counts.tolist()
    ([[[2, 4, 7]]], [0, 2], [[[2, 1]]])
    """
    lists, counts = _listed_rows(spec)
    batch, _, kv_heads, length, _, _, _ = spec.dims
    valid = np.arange(lists.shape[-1]) < counts[..., None]
    used = [[np.unique(lists[b, g][valid[b, g]]) for g in range(kv_heads)] for b in range(batch)]
    width = max([1] + [u.size for row in used for u in row])
    keys_of = np.full((batch, kv_heads, width), -1, np.int64)
    local = np.zeros_like(lists)
    for b in range(batch):
        for g in range(kv_heads):
            u = used[b][g]
            keys_of[b, g, : u.size] = u
            local[b, g] = np.where(valid[b, g], np.searchsorted(u, lists[b, g]), 0)
    return keys_of, local, counts


def _columns(plane, cols_of_head):
    """(B, H, L, W) the columns ``cols_of_head`` (B, H, W) (-1: padding, read as column 0) of a
    (B, H, L, S) view (broadcast views are read in place: only (L, W) elements per plane)."""
    batch, heads, width = cols_of_head.shape
    out = np.empty((batch, heads, plane.shape[2], width), plane.dtype)
    for b in range(batch):
        for h in range(heads):
            out[b, h] = plane[b, h][:, np.maximum(cols_of_head[b, h], 0)]
    return out


def compact_spec(spec: AttentionSpec, gathered=None):
    """(compact, keys_of): the spec on the compacted key axis (module docstring) and the
    (B, K, W) original position of each compacted key (-1: a padding key no row allows).

    ``spec`` is a gather spec without bias or ALiBi (:func:`refattn.kernels.gather_spec`,
    ``index_reading="gather"``); ``compact`` is a plain spec (``index_reading="set"``, no key
    indices) whose mask holds the listed set and the structural interval; ``gathered``: its
    :func:`gathered_keys` when already at hand.

    Examples
    --------
    >>> from refattn.kernels import gather_spec
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((2, 2)), np.arange(18.0).reshape(9, 2), np.zeros((9, 1)),
    ...                     causal=True, align="bottom_right")
    >>> compact, keys_of = compact_spec(gather_spec(spec, np.array([[8, 2, 8], [-1, 4, 8]])))
    >>> keys_of.tolist(), compact.k[0, 0, :, 0].tolist()
    ([[[2, 4, 8]]], [4.0, 8.0, 16.0])
    >>> compact.mask[0, 0].tolist()  # row 0 lists key 8, past its causal limit 7
    [[True, False, False], [False, True, True]]
    """
    if spec.bias is not None or spec.alibi_slopes is not None or spec.dbias_index is not None:
        raise ValueError("spec: expected a gather spec without bias or ALiBi (a dense mask route)")
    batch, heads, kv_heads, length, keys, _, _ = spec.dims
    keys_of, local, counts = gathered_keys(spec) if gathered is None else gathered
    width = keys_of.shape[-1]
    listed = np.zeros((batch, kv_heads, length, width), np.bool_)
    valid = np.arange(local.shape[-1]) < counts[..., None]
    b, g, i, _ = np.nonzero(valid)
    listed[b, g, i, local[valid]] = True
    lo, hi = spec.intervals()  # (B, L): causal, window, key length at the original positions
    pos = keys_of[:, :, None, :]
    listed &= (lo[:, None, :, None] <= pos) & (pos < hi[:, None, :, None]) & (pos >= 0)
    kv_head = np.asarray(spec.kv_head, np.int64)
    cols = keys_of[:, kv_head]  # (B, H, W)
    if spec.mask is not None:
        allowed = listed[:, kv_head] & _columns(spec.mask, cols)  # (B, H, L, W)
    elif kv_heads == 1:  # one kv head (MQA, MLA): the heads share its plane, a broadcast view
        allowed = np.broadcast_to(listed, (batch, heads, length, width))
    else:
        allowed = listed[:, kv_head]
    dropout_mask = None if spec.dropout_mask is None else _columns(spec.dropout_mask, cols)
    k = np.zeros(keys_of.shape + spec.k.shape[-1:], spec.k.dtype)
    v = np.zeros(keys_of.shape + spec.v.shape[-1:], spec.v.dtype)
    for b in range(batch):
        for g in range(kv_heads):
            used = keys_of[b, g][keys_of[b, g] >= 0]
            k[b, g, : used.size] = spec.k[b, g][used]
            v[b, g, : used.size] = spec.v[b, g][used]
    compact = dataclasses.replace(
        spec,
        k=k,
        v=v,
        mask=allowed,
        dropout_mask=dropout_mask,
        causal=False,
        window=None,
        align="top_left",
        offset=0,
        kv_lengths=None,
        key_indices=None,
        index_reading="set",
    )
    return compact, keys_of


def gathers(spec: AttentionSpec, keys_of: np.ndarray) -> bool:
    """Whether the compacted keys are the shorter walk: the exact vjp visits, per query row,
    every key of its structural interval ``[lo_i, hi_i)`` on the dense route (causal halves
    a prefill's) and every compacted key of its kv head (``U_{b,g}``) on the gather route.
    A decode step (U <= T << S) gathers; a causal prefill whose rows together list nearly
    every key keeps the dense route, whose intervals are shorter. The bits are the same.

    Examples
    --------
    >>> from refattn.kernels import gather_spec
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((2, 2)), np.zeros((4, 2)), np.zeros((4, 1)), causal=True)
    >>> gathers(spec, np.array([[[0, -1]]])), gathers(spec, np.array([[[0, 1, 2, 3]]]))
    (True, False)
    """
    heads = spec.dims[1]
    length = spec.dims[3]
    lo, hi = spec.intervals()
    dense = heads * int(np.maximum(hi - lo, 0).sum())
    group = np.bincount(np.asarray(spec.kv_head, np.int64), minlength=keys_of.shape[1])
    compact = length * int(((keys_of >= 0).sum(axis=-1) * group[None, :]).sum())
    return compact <= dense


def dense_spec(spec: AttentionSpec) -> AttentionSpec:
    """The gather spec with its listed set ANDed into the mask (the dense route's spec: one
    (B, K, L, S) plane, broadcast over the query heads when K = 1)."""
    batch, heads, kv_heads, length, keys, _, _ = spec.dims
    listed = index_mask(np.asarray(spec.key_indices, np.int64), keys)
    target = (batch, heads, length, keys)
    listed = np.broadcast_to(listed, target) if kv_heads == 1 else listed[:, spec.kv_head]
    mask = listed if spec.mask is None else spec.mask & listed
    return dataclasses.replace(spec, mask=mask, key_indices=None, index_reading="set")


def _finite(*arrays) -> bool:
    """Whether every element of the arrays (None: none) is finite."""
    return all(a is None or np.isfinite(np.asarray(a, np.float64)).all() for a in arrays)


def _scatter(compact_grad, keys_of, keys):
    """(B, K, S, X) from the compacted (B, K, W, X): each listed key's row at its position,
    +0 at every other key."""
    batch, kv_heads, _, features = compact_grad.shape
    out = np.zeros((batch, kv_heads, keys, features), compact_grad.dtype)
    for b in range(batch):
        for g in range(kv_heads):
            used = keys_of[b, g] >= 0
            out[b, g, keys_of[b, g][used]] = compact_grad[b, g][used]
    return out


def gather_vjp(spec: AttentionSpec, grad_out, grad_lse, paths):
    """(dq, dk, dv, dbias, dsinks) of a gather spec (module docstring): ``paths(compact)`` is
    the exact route's (dq, dk, dv, dbias, dsinks) of a plain spec (``refattn.attention_vjp``'s,
    the cotangents ``grad_out`` (B, H, L, E) and ``grad_lse`` (B, H, L) or None bound), run on
    the compacted spec; dk, dv come back with the S keys.

    A NaN or Inf in q, the cotangents, the sinks or a listed key or value sends the call to
    the dense route (:func:`dense_spec`): the positions of non-finite gradients are those of
    the float64 path on the dense mask (``refattn.attention_vjp``), where a non-finite row
    reaches every key of dv's or dk's column, listed or not.

    Examples
    --------
    >>> from refattn.exact.attention_vjp import exact_vjp
    >>> from refattn.kernels import gather_spec
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((4, 2)), np.arange(4.0)[:, None])
    >>> spec = gather_spec(spec, np.array([[3, 1, 3, -1]]))
    >>> def paths(s):
    ...     return (*exact_vjp(s, np.ones((1, 1, 1, 1)), None, np.dtype("float64")), None)
    >>> gather_vjp(spec, np.ones((1, 1, 1, 1)), None, paths)[2].ravel().tolist()
    [0.0, 0.5, 0.0, 0.5]
    """
    gathered = gathered_keys(spec)
    if not gathers(spec, gathered[0]):
        return paths(dense_spec(spec))
    compact, keys_of = compact_spec(spec, gathered)
    if not _finite(spec.q, grad_out, grad_lse, spec.sinks, compact.k, compact.v):
        return paths(dense_spec(spec))
    dq, dk, dv, dbias, dsinks = paths(compact)
    keys = spec.dims[4]
    return dq, _scatter(dk, keys_of, keys), _scatter(dv, keys_of, keys), dbias, dsinks
