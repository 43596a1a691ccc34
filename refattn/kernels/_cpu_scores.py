"""A tile's final scores on the Numba CPU kernels (:mod:`.numba_cpu`): the allowed set and the
optional terms.

A raw ``q . k`` tile becomes the final scores of the documented order (scale -> softcap ->
+ bias -> + ALiBi -> allowed set), -inf marking the excluded positions. The structural part of
the allowed set (causal, window, key count) is :func:`refattn.spec.key_interval`, the one home
of the rule, compiled for the CPU (:data:`refattn.spec.key_interval_jit`); the explicit mask
and the -inf bias are the per-position part.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..spec import WINDOW_CAP, key_interval_jit
from ._args import (
    DIM_KEYS,
    FOPT_NEG_INF,
    FOPT_SCALE,
    FOPT_SOFTCAP,
    OPT_CAUSAL,
    OPT_HAS_ALIBI,
    OPT_HAS_BIAS,
    OPT_HAS_MASK,
    OPT_HAS_SOFTCAP,
    OPT_LEFT,
    OPT_OFFSET,
    OPT_RIGHT,
)
from ._simd import KERNEL_OPTIONS, lanes, vload, vmuls, vstore

__all__ = [
    "row_interval",
    "first_key_block",
    "raw_scores_suffice",
    "finish_scores",
    "dropout_weights",
]

_OPTS = KERNEL_OPTIONS


@njit(**_OPTS)
def row_interval(i, dims, opts):
    """The half-open key interval [lo, hi) of query row ``i`` (:func:`refattn.spec.key_interval`
    with the kernels' option vectors: offset, causal, window sides; S keys)."""
    return key_interval_jit(
        i, opts[OPT_OFFSET], dims[DIM_KEYS], opts[OPT_CAUSAL] != 0, opts[OPT_LEFT], opts[OPT_RIGHT]
    )


@njit(**_OPTS)
def first_key_block(r0, dims, opts, block):
    """The start of the key block holding the first key that row ``r0`` may read: its lo over
    unbounded keys (``WINDOW_CAP``, as :func:`refattn.spec.structural_mask` takes it), so a lo
    past S is not clamped to S and a block of rows that reads no key starts past the last key
    block, as it always did (running that block would only turn -0 partials into +0)."""
    lo, _ = key_interval_jit(
        r0, opts[OPT_OFFSET], WINDOW_CAP, opts[OPT_CAUSAL] != 0, opts[OPT_LEFT], opts[OPT_RIGHT]
    )
    return lo // block * block


@njit(**_OPTS)
def raw_scores_suffice(nr, nc, r0, c0, dims, opts, fopts, width):
    """Whether a q.k tile needs nothing but the scale (no option, every position allowed,
    a finite positive scale): its users then multiply each loaded score by the scale
    themselves (the same product, so the same bits) instead of a separate pass."""
    if (
        opts[OPT_HAS_SOFTCAP] != 0
        or opts[OPT_HAS_BIAS] != 0
        or opts[OPT_HAS_MASK] != 0
        or opts[OPT_HAS_ALIBI] != 0
        or nc != width
    ):
        return False
    scale = fopts[FOPT_SCALE]
    if not (scale > 0 and scale < np.inf):  # scaling keeps -inf (overflowed q.k) as -inf
        return False
    _, hi_first = row_interval(r0, dims, opts)
    lo_last, _ = row_interval(r0 + nr - 1, dims, opts)
    return lo_last <= c0 and hi_first >= c0 + nc


@njit(**_OPTS)
def finish_scores(s, nr, nc, r0, c0, b, h, dims, opts, fopts, terms, deriv):
    """Turn raw q.k tile into final scores in place; -inf marks excluded positions.

    ``terms`` is :func:`~refattn.kernels._args.kernel_arguments`' tuple of the optional
    per-position terms. Returns True when the tile has no excluded position (the fast paths
    may then skip per-element checks). ``deriv`` receives d(softcap)/d(raw) when softcap is
    active.
    """
    bias, bstr, mask, mstr, _, _, slopes = terms
    offset = opts[OPT_OFFSET]
    has_softcap, has_bias, has_mask = (
        opts[OPT_HAS_SOFTCAP] != 0,
        opts[OPT_HAS_BIAS] != 0,
        opts[OPT_HAS_MASK] != 0,
    )
    has_alibi = opts[OPT_HAS_ALIBI] != 0
    scale, cap = fopts[FOPT_SCALE], fopts[FOPT_SOFTCAP]
    neg_inf = fopts[FOPT_NEG_INF]
    _, hi_first = row_interval(r0, dims, opts)
    lo_last, _ = row_interval(r0 + nr - 1, dims, opts)
    full = lo_last <= c0 and hi_first >= c0 + nc
    general = has_softcap or has_bias or has_mask or has_alibi
    width = s.shape[1]
    if not general and full and nc == width:
        lane_count = lanes(s)
        for r in range(nr):
            row = s[r]
            for c in range(0, width, lane_count):
                vstore(row, c, vmuls(vload(row, c), scale))
        return full
    if not general:
        for r in range(nr):
            row = s[r]
            lo, hi = row_interval(r0 + r, dims, opts)
            jl = lo - c0
            jh = hi - c0
            for c in range(width):
                scaled = row[c] * scale
                row[c] = scaled if (c >= jl and c < jh and c < nc) else neg_inf
        return full
    slope = slopes[h] if has_alibi else 0.0
    clean = True
    for r in range(nr):
        i = r0 + r
        row = s[r]
        lo, hi = row_interval(i, dims, opts)
        for c in range(width):
            j = c0 + c
            allowed = c < nc and j >= lo and j < hi
            if allowed and has_mask:
                allowed = mask[mstr[0] * b + mstr[1] * h + mstr[2] * i + mstr[3] * j] != 0
            t = -np.inf
            if allowed:
                t = row[c] * scale
                if has_softcap:
                    th = math.tanh(t / cap)
                    t = cap * th
                    deriv[r, c] = 1.0 - th * th
                if has_bias:
                    bv = bias[bstr[0] * b + bstr[1] * h + bstr[2] * i + bstr[3] * j]
                    if bv == -np.inf:
                        allowed = False
                        t = -np.inf
                    else:
                        t = t + bv
                if allowed and has_alibi:
                    t = t - slope * abs(i + offset - j)
            clean &= allowed or c >= nc
            row[c] = t
    return clean


@njit(**_OPTS)
def dropout_weights(p, pd, nr, nc, r0, c0, b, h, drop, dstr):
    """pd[:nr, :nc] = p where the dropout mask keeps the position, else 0."""
    for r in range(nr):
        i = r0 + r
        for c in range(nc):
            keep = drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * (c0 + c)] != 0
            pd[r, c] = p[r, c] if keep else 0
