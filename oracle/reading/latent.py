"""FlashAttention 3's ``qv`` in the oracle's own arithmetic (the textbook baseline, the natural
gradient scales): the fold ``q' = [q, qv]``, ``k' = [k, v]`` (docs/conventions.md, "Latent
attention") and the split of the gradients back into (dq, dk, dv, dbias, dsinks, dqv)."""

from __future__ import annotations

import numpy as np

__all__ = ["fold_latent", "split_latent"]


def fold_latent(q, k, v, options):
    """``(q', k', options without qv)`` of dequantised q, k, v
    (:func:`oracle.reading.baseline.dequantised_inputs`); the default scale becomes
    ``1/sqrt(D + E)`` by the width of q'. (No catalogue case has a float8 qv.)"""
    rest = {n: x for n, x in options.items() if n != "qv"}
    qv = np.asarray(options["qv"])
    q, qv, k, v = (np.asarray(x) for x in (q, qv, k, v))
    q_dtype = np.result_type(q.dtype, qv.dtype)
    k_dtype = k.dtype if k.dtype == v.dtype else np.dtype(np.float64)
    q_full = np.concatenate([q, qv], axis=-1, dtype=q_dtype)
    return q_full, np.concatenate([k, v], axis=-1, dtype=k_dtype), rest


def split_latent(grads, dim: int):
    """(dq, dk, dv, dbias, dsinks) of the folded call -> (dq, dk, dv + dk'[D:], dbias,
    dsinks, dqv), ``dim`` = D (the gradients' own dtype)."""
    dq, dk, dv, dbias, dsinks = grads
    total = (np.asarray(dv, np.float64) + np.asarray(dk, np.float64)[..., dim:]).astype(dv.dtype)
    return dq[..., :dim], dk[..., :dim], total, dbias, dsinks, dq[..., dim:]
