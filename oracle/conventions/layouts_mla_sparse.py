"""The ``mla-sparse`` calling convention: FlashMLA's sparse prefill (``flash_mla_sparse_fwd``).

``layout="mla-sparse"`` (:func:`oracle.conventions.layouts.wrap`) hands an implementation what
``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)`` reads:

* q (s_q, H, D): the B * L query rows of the case, batch after batch;
* ``kv`` (s_kv, K, D): one latent tensor, the B * S keys batch after batch; the values are
  the first ``d_v`` = E features of each key (MLA's absorbed form: only cases with
  v = k[..., :E] fit);
* ``indices`` (s_q, K, T) int32: row r of batch b lists key j of its sequence as b * S + j;
  every entry the case's set does not allow is -1 (FlashMLA's invalid index): past S or S_b
  (``kv_lengths``), outside the causal/window set, and the second and later copies of a
  duplicated key (refattn reads the list as a set, FlashMLA's gather as a multiset);
* ``d_v`` = E.

It returns (out (s_q, H, E), max_logits (s_q, H), lse (s_q, H)); the lse is the natural log of
the row's normaliser without the sink, +inf on a row with no valid key (FlashMLA's
``tests/ref.py``): :func:`fix_lse` brings it to refattn's reading (-inf there; with sinks, the
sink joined). Cases without ``key_indices``, or with a mask or bias, are not expressible.

Examples
--------
>>> import numpy as np
>>> q = np.zeros((2, 4, 3, 8)); k = np.ones((2, 1, 5, 8)); v = k[..., :4]
>>> idx = np.array([0, 4, -1, 4])[None, None, None].repeat(3, axis=2).repeat(2, axis=0)
>>> args, kwargs, unpack = mla_sparse_layout(q, k, v, {"key_indices": idx})
>>> args[0].shape, args[1].shape, kwargs["indices"][3, 0].tolist(), kwargs["d_v"]
((6, 4, 8), (10, 1, 8), [5, 9, -1, -1], 4)
"""

from __future__ import annotations

import numpy as np

from oracle.conventions.expressible import NOT_EXPRESSIBLE
from oracle.reading.allowed import options_allowed

__all__ = ["mla_sparse_layout", "fix_lse", "valid_indices"]

_NOT_HERE = ("mask", "bias", "dropout_mask", "key_block_indices", "qv")


def _refuse(reason):
    raise NotImplementedError(f"flash_mla_sparse_fwd: {NOT_EXPRESSIBLE}: {reason}")


def valid_indices(indices, allowed, keys) -> np.ndarray:
    """(B, K, L, T) indices with every entry the set does not take as -1: negative, past
    ``keys`` (B,), not ``allowed`` (B, L, S) for its row, or a repeat of an earlier entry."""
    indices = np.asarray(indices, dtype=np.int64)
    batch, kv_heads, rows, top = indices.shape
    out = np.full(indices.shape, -1, dtype=np.int64)
    for b in range(batch):
        for g in range(kv_heads):
            for i in range(rows):
                seen = set()
                for t, j in enumerate(indices[b, g, i]):
                    j = int(j)
                    if 0 <= j < keys[b] and allowed[b, i, j] and j not in seen:
                        seen.add(j)
                        out[b, g, i, t] = j
    return out


def mla_sparse_layout(q, k, v, options):
    """(args, kwargs, unpack) of the mla-sparse convention for bhld NumPy inputs."""
    present = [n for n in _NOT_HERE if options.get(n) is not None]
    if present:
        _refuse(f"{', '.join(present)} (it takes only q, kv, indices and attn_sink)")
    if options.get("key_indices") is None:
        _refuse("the case lists no key_indices (FlashMLA's sparse kernel attends listed keys)")
    q, k, v = (np.asarray(a) for a in (q, k, v))
    if q.ndim != 4:
        q, k, v = (a.reshape((1,) * (4 - a.ndim) + a.shape) for a in (q, k, v))
    width = v.shape[-1]
    if v.shape[-1] > k.shape[-1] or not np.array_equal(k[..., :width], v, equal_nan=True):
        _refuse(f"kv is one latent tensor whose first d_v features are the values (k {k.shape}, "
                f"v {v.shape})")  # fmt: skip
    batch, heads, rows, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    k = np.broadcast_to(k, (batch, *k.shape[1:]))
    kwargs = {n: x for n, x in options.items() if n not in ("key_indices", "kv_lengths")}
    for name in ("causal", "window", "align"):
        kwargs.pop(name, None)  # folded into the indices
    lengths = options.get("kv_lengths")
    lengths = np.full(batch, keys) if lengths is None else np.broadcast_to(lengths, (batch,))
    folded = ("causal", "window", "align", "kv_lengths")
    structural = {n: options[n] for n in folded if n in options}
    allowed = np.asarray(options_allowed(rows, keys, structural))
    allowed = np.broadcast_to(allowed.reshape(-1, rows, keys), (batch, rows, keys))
    indices = np.asarray(options["key_indices"])
    indices = np.broadcast_to(indices, (batch, kv_heads, rows, indices.shape[-1]))
    indices = valid_indices(indices, allowed, lengths)
    offsets = (np.arange(batch) * keys)[:, None, None, None]
    flat = np.where(indices >= 0, indices + offsets, -1)  # (B, K, L, T)
    kwargs["indices"] = np.ascontiguousarray(
        flat.transpose(0, 2, 1, 3).reshape(batch * rows, kv_heads, -1)
    ).astype(np.int32)
    kwargs["d_v"] = int(width)
    q_rows = np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(batch * rows, heads, dim))
    kv = np.ascontiguousarray(k.transpose(0, 2, 1, 3).reshape(batch * keys, kv_heads, dim))

    def unpack(x, what):
        x = np.asarray(x)
        if what == "lse":  # (s_q, H)
            return np.ascontiguousarray(x.reshape(batch, rows, heads).transpose(0, 2, 1))
        return np.ascontiguousarray(x.reshape(batch, rows, heads, -1).transpose(0, 2, 1, 3))

    return (q_rows, kv), kwargs, unpack


def fix_lse(lse, options) -> np.ndarray:
    """FlashMLA's lse (bhld axes) in refattn's reading: +inf (a row with no valid key) is
    -inf; with ``sinks`` the sink logit joins the normaliser (FlashMLA's lse leaves it out,
    refattn's includes it: :func:`refattn.attention`, ``sinks``)."""
    lse = np.asarray(lse)
    fixed = np.where(np.isposinf(lse), -np.inf, lse.astype(np.float64))
    sinks = options.get("sinks")
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64).reshape(-1)[:, None]
        fixed = np.logaddexp(fixed, sink)
    return fixed.astype(lse.dtype)
