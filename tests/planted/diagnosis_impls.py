"""Planted implementations for the diagnoses of issue 25 (item 4).

Each is an ``impl(q, k, v, **options)`` in :func:`oracle.run.validate`'s calling convention that
reproduces one bug or one real peer's convention the oracle must *name*:

======================================  =================================================
``partial_tile_minus_one``              a tiled kernel whose last, partial key tile (of 64)
                                        stops one key short: key ``S - 1`` is never read
                                        when ``S mod 64 != 0``
``squared_scale``                       the scale applied twice (``scale**2``)
``missing_scale``                       no scale at all
``empty_rows_weighted``                 masking by ``finfo(dtype).min`` added to the scores
                                        in the case dtype (keras / HF eager): a row with no
                                        allowed key holds a *weighted* average of v
``unidirectional_last_row``             onnxruntime MultiHeadAttention ``unidirectional=1``
                                        with L != S: row i sees keys 0..i (top-left), the
                                        last row every key
======================================  =================================================
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from oracle.judging.tolerance import allowed_positions
from oracle.reading.baseline import textbook_attention
from oracle.reading.heads import resolve_scale

__all__ = ["PLANTED", "TILE"]

TILE = 64


def _forward(q, k, v, return_lse=False, **options):
    result = textbook_attention(q, k, v, **options)
    return (result.out, result.lse) if return_lse else result.out


def _with_mask(options, extra):
    mask = options.get("mask")
    mask = extra if mask is None else np.asarray(mask, dtype=bool) & extra
    return {**options, "mask": mask}


def partial_tile_minus_one(q, k, v, **options):
    """The remainder loop of a tiled kernel stops one key short (key S - 1 is skipped when
    S is not a multiple of the 64-key tile)."""
    S = np.shape(k)[-2]
    if S % TILE and S > 1:
        options = _with_mask(options, np.arange(S) != S - 1)
    return _forward(q, k, v, **options)


def squared_scale(q, k, v, **options):
    """The scale is applied twice."""
    scale = resolve_scale(options.get("scale"), np.shape(q)[-1])
    return _forward(q, k, v, **{**options, "scale": scale * scale})


def missing_scale(q, k, v, **options):
    """Scores are q . k, never scaled."""
    return _forward(q, k, v, **{**options, "scale": 1.0})


def empty_rows_weighted(q, k, v, *, mask=None, return_lse=False, **options):
    """keras / HF eager: the boolean mask becomes ``finfo(float16).min`` added to the scores,
    softmax in float32; rows with no allowed key are not removed, and the shift cancels there
    (they hold the softmax of every key, a weighted average of v)."""
    dtype = np.asarray(q).dtype
    qf, kf, vf = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    scale = resolve_scale(options.get("scale"), qf.shape[-1])
    scores = (np.einsum("...ld,...sd->...ls", qf, kf) * scale).astype(dtype)
    if mask is not None:
        big = np.float32(np.finfo(np.float16).min)  # keras' large negative for float16
        scores = scores.astype(np.float32) + np.where(np.asarray(mask, dtype=bool), 0, big)
    s = scores.astype(np.float32)
    s = s - s.max(axis=-1, keepdims=True)
    w = np.exp(s)
    w = w / w.sum(axis=-1, keepdims=True)
    out = np.einsum("...ls,...se->...le", w, vf).astype(dtype)
    return (out, None) if return_lse else out


def unidirectional_last_row(q, k, v, **options):
    """onnxruntime MultiHeadAttention unidirectional=1 with L != S: top-left causal, except
    that the last row sees every key."""
    L, S = np.shape(q)[-2], np.shape(k)[-2]
    if not options.get("causal") or L == S:
        return _forward(q, k, v, **options)
    allowed = allowed_positions(L, S, causal=True, align="top_left")
    allowed = np.array(np.broadcast_to(allowed, (L, S)))
    allowed[-1, :] = True
    options = {**options, "causal": False, "align": None}
    return _forward(q, k, v, **_with_mask(options, allowed))


#: name -> (implementation, case patterns it must fail, the diagnosis text it must receive)
PLANTED = {
    "partial_tile_minus_one": (
        partial_tile_minus_one,
        ("l-lt-s-*-f32", "k-tile-H2K2-L65S65-*-f32", "k-tile-H2K2-L129S129-*-f32"),
        "last key of the partial key tile",
    ),
    "squared_scale": (squared_scale, ("basic-H2K2-L24S40-*-f32", "scale-*-f32"), "squared"),
    "missing_scale": (missing_scale, ("basic-H2K2-L24S40-*-f32", "d-ne-e-*-f32"), "no scale"),
    "empty_rows_weighted": (
        empty_rows_weighted,
        ("mask-empty-rows-H2K2-*-f16", "mask-empty-rows-H2K2-*-bf16"),
        "weighted average",
    ),
    "unidirectional_last_row": (
        unidirectional_last_row,
        ("causal-tl-H2K2-L12S32-*",),
        "last row",
    ),
}


def _bf16_sums(q, k, v, return_lse, options, values):
    """q.k summed feature by feature in bfloat16 (every partial sum rounded to 8 bits), the
    softmax in float32, then P@V summed key by key in bfloat16 (``values``) or in float32."""
    bf = ml_dtypes.bfloat16
    qb, kb, vb = (np.asarray(x).astype(bf) for x in (q, k, v))
    group = qb.shape[-3] // kb.shape[-3]
    kb, vb = (np.repeat(x, group, axis=-3) for x in (kb, vb))
    scores = np.zeros(qb.shape[:-1] + (kb.shape[-2],), bf)
    for d in range(qb.shape[-1]):
        scores = (scores + qb[..., :, None, d] * kb[..., None, :, d]).astype(bf)
    s = scores.astype(np.float32) * np.float32(resolve_scale(options.get("scale"), qb.shape[-1]))
    top = s.max(axis=-1, keepdims=True)
    w = np.exp(s - top)
    total = w.sum(axis=-1, keepdims=True)
    p = w / total
    if values:
        p, out = p.astype(bf), np.zeros(qb.shape[:-1] + (vb.shape[-1],), bf)
        for j in range(vb.shape[-2]):
            out = (out + p[..., :, j, None] * vb[..., None, j, :]).astype(bf)
    else:
        out = np.einsum("...ls,...se->...le", p, vb.astype(np.float32))
    dtype = np.asarray(q).dtype
    lse = (np.log(total) + top)[..., 0].astype(dtype)
    out = np.asarray(out).astype(dtype)
    return (out, lse) if return_lse else out


def bf16_score_sums(q, k, v, return_lse=False, **options):
    """A kernel summing q.k in bfloat16 (a precision loss, not a convention); unmasked cases
    with no options only."""
    return _bf16_sums(q, k, v, return_lse, options, values=False)


def bf16_accumulation(q, k, v, return_lse=False, **options):
    """A kernel summing q.k and P@V in bfloat16; unmasked cases with no options only."""
    return _bf16_sums(q, k, v, return_lse, options, values=True)
