"""Exact base-2 lse of attention (``return_lse=True, lse_base=2``): ``lse_i / ln 2`` rounded
once to the output dtype.

First step: the correctly rounded float64 natural lse ``x`` (from the exact engine in use)
encloses the exact lse in ``[x - ulp_below/2, x + ulp_above/2]``; divided by an enclosure of
ln 2, the ends usually round to the same value of a narrower format. Rows it leaves undecided
(every row for float64 output) go to the referee (:class:`refattn.exact.attention.ExactForward`
on that row alone), whose lse enclosure divided by ln 2 runs through the Ziv loop.

``lse / ln 2`` is rational only when lse is 0 (Lindemann-Weierstrass: otherwise ``2^(lse/ln 2)
= e^lse`` is a sum of exponentials of distinct algebraic scores, transcendental unless all
scores are 0, where lse = log n and lse / ln 2 = log2 n, a representable integer when n is a
power of two and irrational otherwise), so only 0 needs an exact decision.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from mpmath.libmp import from_man_exp, mpf_div, mpf_ln2, round_ceiling, round_floor

from .. import config
from ..spec import AttentionSpec, fold
from . import fast as _fast
from .attention import ExactForward
from .rounding import correctly_round, format_of, round_exact

__all__ = ["exact_lse_base2"]

_FIRST_BITS = 128


def _as_mpf(x: Fraction, prec: int, rounding):
    return mpf_div(from_man_exp(x.numerator, 0), from_man_exp(x.denominator, 0), prec, rounding)


def _divide(lo, hi, work):
    """Enclosure of [lo, hi] / ln 2 (raw mpfs or +-inf/NaN floats)."""
    if isinstance(lo, float):
        return lo, hi
    l_lo, l_hi = mpf_ln2(work, round_floor), mpf_ln2(work, round_ceiling)
    lower = mpf_div(lo, l_hi if lo[0] == 0 else l_lo, work, round_floor)
    upper = mpf_div(hi, l_lo if hi[0] == 0 else l_hi, work, round_ceiling)
    return lower, upper


def _first_step(x: float, fmt):
    """The rounding of lse / ln 2 when the float64 lse ``x`` settles it, else None."""
    if not math.isfinite(x):
        return x  # NaN, -inf (empty row) and +inf (beyond float64) keep their value
    below, above = np.nextafter(x, -np.inf), np.nextafter(x, np.inf)
    value = Fraction(x)
    lo = (value + Fraction(float(below))) / 2
    high_neighbour = (
        Fraction(float(above)) if math.isfinite(above) else value + (value - Fraction(float(below)))
    )
    hi = (value + high_neighbour) / 2
    lo2, hi2 = _divide(
        _as_mpf(lo, _FIRST_BITS, round_floor), _as_mpf(hi, _FIRST_BITS, round_ceiling), _FIRST_BITS
    )
    a, b = round_exact(lo2, fmt), round_exact(hi2, fmt)
    return a if a == b and math.copysign(1, a) == math.copysign(1, b) else None


def _referee(spec: AttentionSpec, b: int, h: int, i: int, fmt) -> float:
    sub = _fast.row_spec(spec, b, h, i, i + 1)
    engine = ExactForward(fold(sub, alibi_into_bias=False) if sub.sinks is not None else sub)

    def evaluate(prec):
        work = prec + config.ELEMENTARY_GUARD_BITS
        lo, hi = engine.at(prec)["lse"]
        out_lo, out_hi = np.empty_like(lo), np.empty_like(hi)
        for ix in np.ndindex(*lo.shape):
            out_lo[ix], out_hi[ix] = _divide(lo[ix], hi[ix], work)
        return out_lo, out_hi

    def fallback(ix):
        return Fraction(0) if engine.exact_value("lse", ix) == 0 else None

    def decide(ix, boundary):
        return engine.side("lse", ix, boundary) if boundary == 0 else None

    result = correctly_round(evaluate, fmt, fallback=fallback, decide=decide, what="lse (base 2)")
    return float(result[0, 0, 0])


def exact_lse_base2(spec: AttentionSpec, lse64: np.ndarray, out_dtype) -> np.ndarray:
    """Correctly rounded ``lse / ln 2`` (B, H, L) in ``out_dtype`` from the correctly rounded
    float64 natural lse ``lse64`` of the same spec."""
    fmt = format_of(out_dtype)
    result = np.empty(lse64.shape, dtype=np.float64)
    for index in np.ndindex(*lse64.shape):
        value = _first_step(float(lse64[index]), fmt)
        result[index] = value if value is not None else _referee(spec, *index, fmt)
    return result.astype(fmt.dtype)
