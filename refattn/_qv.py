"""FlashAttention 3's ``qv`` in the canonical spec: the fold and the gradients' split.

``q . k + qv . v`` is the dot product of ``q' = [q, qv]`` and ``k' = [k, v]`` over D + E
features, exactly, so :func:`refattn.spec.canonicalize` stores q' and k' and every path
(float64, exact, Numba CPU, CUDA) computes the latent score unchanged; the gradients of q'
and k' are split back by :func:`split_qv_grads` (docs/conventions.md, "Latent attention").
"""

from __future__ import annotations

import numpy as np

__all__ = ["fold_qv", "split_qv_grads"]


def fold_qv(q, k, v, latent):
    """``(q', k') = ([q, qv], [k, v])`` along the features (exact: the scores' dot product
    over D + E features is ``q . k + qv . v``). qv must have q's shape but E features (v's);
    its leading dims broadcast with q's."""
    vdim = v.shape[-1] if v.ndim else 0
    if (
        latent.ndim != q.ndim
        or latent.shape[-2:] != q.shape[-2:-1] + (vdim,)
        or (q.ndim >= 3 and latent.shape[-3] != q.shape[-3])
    ):
        raise ValueError(
            f"qv: expected shape (..., H, L, E) = q's {q.shape} with E = v's {vdim} features, "
            f"got {latent.shape}"
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"qv: needs v {v.shape} with k's leading shape {k.shape[:-1]}")
    try:
        q_lead = np.broadcast_shapes(q.shape[:-1], latent.shape[:-1])
    except ValueError:
        raise ValueError(
            f"qv: leading dims {latent.shape} do not broadcast with q {q.shape}"
        ) from None
    q_dtype = np.result_type(q.dtype, latent.dtype)
    k_dtype = k.dtype if k.dtype == v.dtype else np.dtype(np.float64)  # exact either way
    q_full = np.concatenate(
        [np.broadcast_to(q, q_lead + q.shape[-1:]), np.broadcast_to(latent, q_lead + (vdim,))],
        axis=-1,
        dtype=q_dtype,
    )
    k_full = np.concatenate([k, v], axis=-1, dtype=k_dtype)
    return q_full, k_full


def split_qv_grads(spec, dq, dk, dv, *, summed=False):
    """``(dq, dk, dv, dqv)`` from the gradients of a qv spec's ``q' = [q, qv]``, ``k' = [k,
    v]``: ``dq = dq'[..., :D]``, ``dqv = dq'[..., D:]``, ``dk = dk'[..., :D]`` and
    ``dv = dv_values + dk'[..., D:]`` (v enters both the values and the scores; that sum is
    rounded once more here, unless ``summed``: the exact path passes the exactly summed dv,
    :mod:`refattn.exact.latent`)."""
    if not spec.qv_features:
        return dq, dk, dv, None
    dim = dq.shape[-1] - spec.qv_features
    total = dv if summed else dv + dk[..., dim:]
    return dq[..., :dim], dk[..., :dim], total, dq[..., dim:]
