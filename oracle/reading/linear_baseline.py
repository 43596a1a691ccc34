"""The oracle's own reading of a linear-attention case: the textbook recurrence in a dtype.

:func:`recurrence` runs the one recurrence of docs/conventions.md ("Linear attention") step by
step, per sequence with the value heads vectorised, on the inputs' exact values in a compute
dtype, its state kept in that dtype: the *same-dtype textbook implementation* of the tolerance
rule (:mod:`oracle.judging.linear`; float32 compute for float16 and bfloat16 inputs, the dtype
itself otherwise, outputs rounded once to the case dtype). With ``magnitudes=True`` (float64) it
also returns, per sequence, value head and value column e, the largest column norm
``||S_t[:, e]||_2`` of the states S_0 .. S_T plus the largest ``|v_te|``: the natural scale of
the states (:func:`oracle.judging.linear.natural_scales`).

Examples
--------
>>> import numpy as np, refattn
>>> rng = np.random.default_rng(0)
>>> q, k = rng.standard_normal((2, 1, 1, 5, 4)); v = rng.standard_normal((1, 1, 5, 3))
>>> g = -rng.uniform(0, 1, (1, 1, 5)); beta = rng.uniform(0, 1, (1, 1, 5))
>>> o, s, _ = recurrence(dict(q=q, k=k, v=v, g=g, beta=beta), {"qk_l2norm": True}, "float64")
>>> ref = refattn.linear_attention(q, k, v, g, beta, qk_l2norm=True, output_final_state=True)
>>> bool(np.allclose(o, ref[0], rtol=0, atol=1e-12) and np.allclose(s, ref[1], atol=1e-12))
True
"""

from __future__ import annotations

import math

import numpy as np

from oracle.catalogue import seeding

__all__ = ["recurrence", "segments_of", "L2NORM_EPS"]

#: The eps inside the root of the q/k normalisation (docs/conventions.md).
L2NORM_EPS = 1e-6


def segments_of(arrays) -> list[tuple[int, int, int]]:
    """(batch row, start, stop) of every sequence (``cu_seqlens`` or one per batch row)."""
    batch, _, length, _ = np.shape(arrays["q"])
    cu = arrays.get("cu_seqlens")
    if cu is None:
        return [(b, 0, length) for b in range(batch)]
    cu = [int(x) for x in np.asarray(cu)]
    return [(0, a, b) for a, b in zip(cu, cu[1:], strict=False)]


def _prepared(arrays, options, compute):
    heads = np.shape(arrays["v"])[1]
    group = heads // np.shape(arrays["q"])[1]

    def cast(name):
        x = arrays.get(name)
        return None if x is None else np.asarray(x, dtype=np.float64).astype(compute)

    q, k = (np.repeat(cast(n), group, axis=1) for n in ("q", "k"))
    if options.get("qk_l2norm"):
        eps = compute.type(L2NORM_EPS)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
    scale = options.get("scale")
    scale = compute.type(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return q * scale, k, cast("v"), cast("g"), cast("beta"), cast("initial_state")


def _decay(g_t, base, compute):
    return np.exp2(g_t) if base == "2" else np.exp(g_t)


def recurrence(arrays, options, dtype, *, magnitudes=False):
    """(o (B, HV, T, E), final states (N, HV, D, E), magnitudes or None) of the recurrence
    computed in the accumulation dtype of ``dtype`` and rounded once to ``dtype``.

    ``arrays``: q, k, v and optionally g, beta, initial_state, cu_seqlens (refattn's names and
    layout); ``options``: qk_l2norm, gate_base, scale. ``magnitudes`` (N, HV, E): see the
    module docstring (float64 runs only).
    """
    compute = np.dtype(np.float32) if np.dtype(_plain(dtype)).itemsize < 4 else np.dtype(dtype)
    q, k, v, g, beta, h0 = _prepared(arrays, options, compute)
    base = str(options.get("gate_base", "e"))
    heads, dim, edim = v.shape[1], q.shape[-1], v.shape[-1]
    out = np.zeros(v.shape, dtype=compute)
    segments = segments_of(arrays)
    final = np.zeros((len(segments), heads, dim, edim), dtype=compute)
    sizes = np.zeros((len(segments), heads, edim)) if magnitudes else None
    for n, (b, start, stop) in enumerate(segments):
        state = np.zeros((heads, dim, edim), dtype=compute) if h0 is None else h0[n].copy()
        largest = np.sqrt((state.astype(np.float64) ** 2).sum(1)) if magnitudes else None
        for t in range(start, stop):
            if g is not None:
                decay = _decay(g[b, :, t], base, compute)
                state = state * (decay[:, :, None] if decay.ndim == 2 else decay[:, None, None])
            if beta is None:
                new = v[b, :, t]
            else:
                recalled = np.einsum("hde,hd->he", state, k[b, :, t])
                new = beta[b, :, t, None] * (v[b, :, t] - recalled)
            state = state + k[b, :, t, :, None] * new[:, None, :]
            out[b, :, t] = np.einsum("hde,hd->he", state, q[b, :, t])
            if magnitudes:
                largest = np.maximum(largest, np.sqrt((state * state).sum(1)))
        final[n] = state
        if magnitudes:
            values = np.abs(v[b, :, start:stop]).max(axis=1) if stop > start else 0.0
            sizes[n] = largest + values
    return _round(out, dtype), _round(final, dtype), sizes


def _plain(dtype):
    return np.float16 if str(dtype) == "bfloat16" else dtype


def _round(x, dtype):
    if np.dtype(_plain(dtype)).itemsize >= 4:
        return np.asarray(x, dtype=dtype)
    return seeding.to_dtype(np.asarray(x, dtype=np.float64), str(dtype))
