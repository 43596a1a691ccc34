"""The multiset reading of sparse key indices: a gather into duplicated keys.

A plain gather kernel reads, for query row i of kv head g, the keys ``k[idx[b, g, i, t]]``
for every valid slot t without removing duplicates, so a position listed n times enters the
softmax n times:

.. math::

    \\mathrm{lse}_i = \\log \\sum_{t \\in V_i} e^{\\tilde t_{i, idx_t}}, \\quad
    \\mathrm{out}_i = \\sum_{t \\in V_i} e^{\\tilde t_{i, idx_t} - \\mathrm{lse}_i}\\,
        v_{idx_t}

with ``V_i`` the valid slots (0 <= idx < S and allowed by every other restriction). refattn
states it literally: :func:`gather_spec` makes one batch row per (b, i) whose T keys are the
gathered ones (one query row, the allowed set gathered with them), every path computes that
ordinary attention, and :func:`scatter_forward` / :func:`scatter_vjp` bring the results back
(dk, dv, dbias and the weights of a position sum over its copies). Memory O(B L T (D + E)).
On the exact path out and lse are exact (they are the gathered call's outputs); the weights
and the gradients of keys listed several times would be sums of rounded values, so the exact
path refuses them (and ALiBi, whose exact form the gather would lose).
"""

from __future__ import annotations

import numpy as np

from .spec import AttentionSpec

__all__ = ["check_exact", "gather_spec", "scatter_forward", "scatter_vjp"]


def check_exact(spec: AttentionSpec, *, weights: bool = False, vjp: bool = False) -> None:
    """Refuse what the exact path cannot round once under the multiset reading."""
    if spec.alibi_slopes is not None:
        raise NotImplementedError(
            "index_reading='multiset': precision='exact' does not take alibi_slopes "
            "(use index_reading='set' or precision='float64')"
        )
    if weights or vjp:
        what = "return_weights" if weights else "attention_vjp"
        raise NotImplementedError(
            f"index_reading='multiset': precision='exact' does not give {what} (a key listed "
            "twice would sum two rounded values); use precision='float64' or "
            "index_reading='set'"
        )


def _slots(spec):
    batch, heads, kv_heads, length, keys, _, _ = spec.dims
    indices = spec.key_indices
    valid = indices >= 0
    safe = np.where(valid, indices, 0)
    return valid, safe


def gather_spec(spec: AttentionSpec, *, alibi_into_bias: bool = True) -> AttentionSpec:
    """The ordinary attention whose batch row ``b L + i`` is query row i of batch row b over
    its T gathered keys (duplicates kept): q (B L, H, 1, D), k (B L, K, T, D), v likewise,
    mask (B L, H, 1, T) = valid slot and allowed there; bias, ALiBi (folded into the bias,
    one float64 rounding) and the dropout mask gathered alike; sinks unchanged."""
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    valid, safe = _slots(spec)
    count = safe.shape[-1]
    rows = batch * length
    bidx = np.arange(batch)[:, None, None, None]
    gidx = np.arange(kv_heads)[None, :, None, None]

    def gather_keys(x):  # (B, K, S, F) -> (B L, K, T, F)
        taken = x[bidx, gidx, safe]  # (B, K, L, T, F)
        return taken.transpose(0, 2, 1, 3, 4).reshape(rows, kv_heads, count, x.shape[-1])

    planes = np.stack([np.stack([spec.allowed(b, h) for h in range(heads)]) for b in range(batch)])
    per_head = (safe[:, spec.kv_head], valid[:, spec.kv_head])  # (B, H, L, T)

    def gather_plane(plane):  # (B, H, L, S) -> (B L, H, 1, T)
        taken = np.take_along_axis(
            np.broadcast_to(plane, (batch, heads, length, keys)), per_head[0], axis=-1
        )
        return taken.transpose(0, 2, 1, 3).reshape(rows, heads, 1, count)

    allowed = gather_plane(planes) & per_head[1].transpose(0, 2, 1, 3).reshape(
        rows, heads, 1, count
    )
    bias = None
    if spec.bias is not None:
        bias = np.where(allowed, gather_plane(spec.bias), 0.0)
    if spec.alibi_slopes is not None and alibi_into_bias:
        distance = np.stack([spec.alibi_distance(b) for b in range(batch)])[:, None]
        alibi = gather_plane(-spec.alibi_slopes[None, :, None, None] * distance)
        bias = alibi if bias is None else bias + alibi
    keep = None if spec.dropout_mask is None else gather_plane(spec.dropout_mask)
    # the gathered rows hold their keys and allowed set explicitly: causal, window, align,
    # kv_lengths and the indices are off
    return spec.without(
        "interval",
        "indices",
        q=spec.q.transpose(0, 2, 1, 3).reshape(rows, heads, 1, dim),
        k=gather_keys(spec.k),
        v=gather_keys(spec.v),
        batch_shape=(rows,),
        single_head=False,
        bias=bias,
        bias_shape=None if bias is None else bias.shape,
        mask=allowed,
        offset=0,
        alibi_slopes=None if alibi_into_bias else spec.alibi_slopes,
        dropout_mask=keep,
    )


def _rows_back(x, batch, length):
    """(B L, H, 1, F) -> (B, H, L, F); (B L, H, 1) -> (B, H, L)."""
    heads = x.shape[1]
    x = x.reshape((batch, length, heads) + x.shape[3:])
    return np.moveaxis(x, 1, 2)


def _scatter_keys(spec, gathered, width):
    """(B L, K, T, F) per-copy values summed into (B, K, S, F) at the valid slots."""
    batch, _, kv_heads, length, keys, _, _ = spec.dims
    valid, safe = _slots(spec)
    count = safe.shape[-1]
    per = gathered.reshape(batch, length, kv_heads, count, width).transpose(0, 2, 1, 3, 4)
    out = np.zeros((batch, kv_heads, keys, width), dtype=np.float64)
    b, g, i, t = np.nonzero(valid)
    np.add.at(out, (b, g, safe[b, g, i, t]), per[b, g, i, t])
    return out


def _scatter_plane(spec, gathered):
    """(B L, H, 1, T) -> (B, H, L, S), summing the copies of a position."""
    batch, heads, _, length, keys, _, _ = spec.dims
    valid, safe = _slots(spec)
    per = _rows_back(gathered, batch, length)  # (B, H, L, T)
    head_safe, head_valid = safe[:, spec.kv_head], valid[:, spec.kv_head]
    out = np.zeros((batch, heads, length, keys), dtype=np.float64)
    b, h, i, t = np.nonzero(head_valid)
    np.add.at(out, (b, h, i, head_safe[b, h, i, t]), np.asarray(per, np.float64)[b, h, i, t])
    return out


def scatter_forward(spec, out, lse, weights):
    """The gathered call's flat (out, lse, weights) as the caller's (B, H, L, ...)."""
    batch, length = spec.dims[0], spec.dims[3]
    out = _rows_back(out, batch, length)
    lse = None if lse is None else _rows_back(lse[..., None], batch, length)[..., 0]
    weights = None if weights is None else _scatter_plane(spec, weights)
    return out, lse, weights


def scatter_vjp(spec, dq, dk, dv, dbias):
    """The gathered call's flat gradients as the caller's: dq (B, H, L, D), dk, dv summed
    over the copies of a key (B, K, S, .), dbias summed into (B, H, L, S) (or None)."""
    batch, length = spec.dims[0], spec.dims[3]
    dq = _rows_back(dq, batch, length)
    dk = _scatter_keys(spec, dk, dk.shape[-1])
    dv = _scatter_keys(spec, dv, dv.shape[-1])
    if dbias is not None:
        dbias = _scatter_plane(spec, dbias.reshape(dbias.shape[0], dbias.shape[1], 1, -1))
    return dq, dk, dv, dbias
