"""Loop twin of refattn.merge_states (mpmath; nothing here imports refattn).

Per row: the live states (finite lse), ``lse = log_b sum_p b^{lse_p}`` and ``out_e = sum_p
b^{lse_p - lse} out_pe``, written as the textbook sums. Exact rational cases are kept exact:
base 2 with integer lse differences (weights ``2^k / S``, ``lse = top + log2 S`` an integer
offset when ``S`` is a power of two), and states of equal lse in either base (weights ``1/n``).
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np

from .rounding import exact_plus_small, round_stable

__all__ = ["naive_merge", "naive_merge_rounded", "mp_merge"]


def _rational_weights(lses, base2):
    """{p: weight} as Fractions when every weight is rational, else None."""
    top = max(lses.values())
    deltas = {p: Fraction(v) - Fraction(top) for p, v in lses.items()}
    if all(d == 0 for d in deltas.values()):
        return {p: Fraction(1, len(deltas)) for p in deltas}
    if not base2 or any(d.denominator != 1 or d < -4096 for d in deltas.values()):
        return None
    powers = {p: Fraction(2) ** int(d) for p, d in deltas.items()}
    total = sum(powers.values())
    return {p: w / total for p, w in powers.items()}


def _row(lse_row, out_row, base2):
    """(lse, [out_e]) of one row as mpf / Fraction / float."""
    vdim = len(out_row[0])
    if any(math.isnan(x) for x in lse_row):
        return mpmath.nan, [mpmath.nan] * vdim
    if any(x == math.inf for x in lse_row):
        return mpmath.inf, [mpmath.nan] * vdim
    live = {p: float(x) for p, x in enumerate(lse_row) if x != -math.inf}
    if not live:
        return -mpmath.inf, [mpmath.mpf(0)] * vdim
    outs = []
    for e in range(vdim):
        column = [float(out_row[p][e]) for p in live]
        if any(math.isnan(x) for x in column) or (math.inf in column and -math.inf in column):
            outs.append(mpmath.nan)
        elif math.inf in column or -math.inf in column:
            outs.append(mpmath.inf if math.inf in column else -mpmath.inf)
        else:
            outs.append(None)
    log_b = mpmath.log(2) if base2 else mpmath.mpf(1)
    top = max(live.values())
    total = mpmath.fsum(mpmath.exp((mpmath.mpf(v) - top) * log_b) for v in live.values())
    weights = _rational_weights(live, base2)
    if weights is not None and base2:
        s = sum(Fraction(2) ** int(Fraction(v) - Fraction(top)) for v in live.values())
        if s.numerator & (s.numerator - 1) == 0 and s.denominator & (s.denominator - 1) == 0:
            lse = Fraction(top) + (s.numerator.bit_length() - s.denominator.bit_length())
        else:
            lse = exact_plus_small(mpmath.mpf(top), mpmath.log(total) / log_b)
    elif len(live) == 1:
        lse = Fraction(top)
    else:
        lse = exact_plus_small(mpmath.mpf(top), mpmath.log(total) / log_b)
    for e in range(vdim):
        if outs[e] is not None:
            continue
        if weights is not None:
            outs[e] = sum(w * Fraction(float(out_row[p][e])) for p, w in weights.items())
        else:
            outs[e] = (
                mpmath.fsum(
                    mpmath.exp((mpmath.mpf(v) - top) * log_b) * mpmath.mpf(float(out_row[p][e]))
                    for p, v in live.items()
                )
                / total
            )
    return lse, outs


def naive_merge(outs, lses, base2, dps):
    """(out (R, E), lse (R,)) nested lists over the flattened rows, at ``dps`` digits."""
    states, vdim = outs.shape[0], outs.shape[-1]
    flat_lses = np.moveaxis(np.asarray(lses, np.float64), 0, -1).reshape(-1, states)
    flat_outs = np.moveaxis(np.asarray(outs, np.float64), 0, -2).reshape(-1, states, vdim)
    out, lse = [], []
    with mpmath.workdps(dps):
        for lse_row, out_row in zip(flat_lses.tolist(), flat_outs.tolist(), strict=True):
            value, values = _row(lse_row, out_row, base2)
            lse.append(value)
            out.append(values)
    return out, lse


def naive_merge_rounded(outs, lses, base2, dtype):
    """(out (..., L, E), lse (..., L)) of :func:`naive_merge` rounded once to ``dtype``."""
    finite = np.asarray(lses, np.float64)[np.isfinite(lses)]
    spread = float(finite.max() / 2 - finite.min() / 2) * 2 if finite.size else 0.0
    out = round_stable(lambda dps: naive_merge(outs, lses, base2, dps)[0], dtype, spread)
    lse = round_stable(lambda dps: naive_merge(outs, lses, base2, dps)[1], dtype, spread)
    return out.reshape(np.shape(outs)[1:]), lse.reshape(np.shape(lses)[1:])


def mp_merge(outs, lses, base2):
    """The merge of object arrays of mpf (P, R, E) / (P, R) as a flat list [out..., lse...] at
    the caller's precision (for central differences; finite, live inputs)."""
    log_b = mpmath.log(2) if base2 else mpmath.mpf(1)
    states, rows = lses.shape
    flat_out, flat_lse = [], []
    for r in range(rows):
        total = mpmath.fsum(mpmath.exp(lses[p, r] * log_b) for p in range(states))
        flat_lse.append(mpmath.log(total) / log_b)
        for e in range(outs.shape[-1]):
            flat_out.append(
                mpmath.fsum(mpmath.exp(lses[p, r] * log_b) * outs[p, r, e] for p in range(states))
                / total
            )
    return flat_out + flat_lse


def naive_lse_base2_rounded(q, k, v, opts, dtype):
    """attention's base-2 lse (``lse / ln 2``) from the loop twin, rounded once to ``dtype``."""
    from .attention import naive_attention, score_spread

    heads, length, keys = q.shape[0], q.shape[1], k.shape[1]
    full = dict(opts)
    for name in ("mask", "bias", "dropout_mask"):
        if name in full:
            full[name] = np.broadcast_to(full[name], (heads, length, keys))

    def compute(dps):
        lse = naive_attention(q, k, v, dps=dps, **full)[1]
        with mpmath.workdps(dps):
            return [[x / mpmath.log(2) for x in row] for row in lse]

    return round_stable(compute, dtype, score_spread(q, k, **full))
