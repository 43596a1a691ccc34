"""Exact integer representations of float arrays, and directed-rounding scalar helpers.

A finite float array is held as ``ints * 2**exp``: an object array of Python ints sharing one
exponent, so sums and products of inputs are exact integer arithmetic (fast: NumPy's object
matmul runs at ~50 ns per multiply-add). Transcendental steps use mpmath's ``libmp`` raw
functions with directed rounding (floor for lower bounds, ceiling for upper bounds), widened
outward by two units in the last place.
"""

from __future__ import annotations

import numpy as np
from mpmath.libmp import (
    from_man_exp,
    fzero,
    mpf_add,
    mpf_cmp,
    mpf_div,
    mpf_exp,
    mpf_log,
    mpf_sqrt,
    mpf_sub,
    mpf_tanh,
    round_ceiling,
    round_floor,
)

from .. import config

__all__ = ["FixedArray", "to_fixed"]


class FixedArray:
    """An exact array ``ints * 2**exp`` (object ints) with a mask of non-finite entries."""

    __slots__ = ("ints", "exp", "nonfinite")

    def __init__(self, ints: np.ndarray, exp: int, nonfinite: np.ndarray):
        self.ints = ints
        self.exp = exp
        self.nonfinite = nonfinite


def to_fixed(array) -> FixedArray:
    """Exact (ints, exp) form of a float array; non-finite entries are 0 and flagged."""
    array = np.asarray(array, dtype=np.float64)
    nonfinite = ~np.isfinite(array)
    finite = np.where(nonfinite, 0.0, array)
    frac, exps = np.frexp(finite)
    mant = (frac * 2.0**53).astype(np.int64)
    exps = exps.astype(np.int64) - 53
    nonzero = mant != 0
    if not nonzero.any():
        return FixedArray(np.zeros(array.shape, dtype=object), 0, nonfinite)
    low_bit = mant & -mant  # strip trailing zero bits so narrow dtypes give small ints
    tz = np.where(nonzero, np.log2(np.where(nonzero, np.abs(low_bit), 1)).astype(np.int64), 0)
    mant = mant >> tz
    exps = exps + tz
    base = int(exps[nonzero].min())
    shift = np.where(nonzero, exps - base, 0)
    ints = np.left_shift(mant.astype(object), shift.astype(object))
    return FixedArray(ints, base, nonfinite)


def raw(man: int, exp: int):
    """The raw mpf man * 2**exp (exact)."""
    return from_man_exp(man, exp)


def widen(x, prec: int, down: bool):
    """Move a raw mpf outward by two ulp at ``prec`` bits."""
    if x == fzero:
        return x
    _, man, exp, bc = x
    step = from_man_exp(2, exp + bc - prec)
    return (mpf_sub if down else mpf_add)(x, step, prec, round_floor if down else round_ceiling)


def exp_bounds(lo, hi, prec: int):
    """Enclosure [exp(lo), exp(hi)] of exp over [lo, hi]."""
    work = prec + config.ELEMENTARY_GUARD_BITS
    return (
        widen(mpf_exp(lo, work, round_floor), work, True),
        widen(mpf_exp(hi, work, round_ceiling), work, False),
    )


def log_bounds(lo, hi, prec: int):
    """Enclosure of log over the positive interval [lo, hi]."""
    work = prec + config.ELEMENTARY_GUARD_BITS
    return (
        widen(mpf_log(lo, work, round_floor), work, True),
        widen(mpf_log(hi, work, round_ceiling), work, False),
    )


def log1p_bounds(lo, hi, prec: int):
    """Enclosure of ``log(1 + x)`` over ``0 <= lo <= hi``, relatively tight for tiny x.

    Below ``2**-prec`` the bounds ``x / (1 + x) <= log1p(x) <= x`` already are (no
    ``exp(-1e9)``-sized precision is ever needed); above it ``1 + x`` is formed at
    ``prec + |log2 x|`` bits (at most ``2 prec``) before the logarithm.
    """
    if not hi[1]:
        return fzero, fzero
    one = from_man_exp(1, 0)
    if hi[2] + hi[3] < -prec:
        return mpf_div(lo, mpf_add(one, lo, prec, round_ceiling), prec, round_floor), hi
    extra = prec + max(0, -(lo[2] + lo[3])) if lo[1] else 2 * prec
    return log_bounds(
        mpf_add(one, lo, extra, round_floor), mpf_add(one, hi, extra, round_ceiling), extra
    )


def tanh_bounds(lo, hi, prec: int):
    """Enclosure of tanh over [lo, hi]."""
    work = prec + config.ELEMENTARY_GUARD_BITS
    return (
        widen(mpf_tanh(lo, work, round_floor), work, True),
        widen(mpf_tanh(hi, work, round_ceiling), work, False),
    )


def invsqrt_bounds(n: int, prec: int):
    """Enclosure of 1/sqrt(n) for a positive integer n."""
    work = prec + config.ELEMENTARY_GUARD_BITS
    root_lo = mpf_sqrt(from_man_exp(n, 0), work, round_floor)
    root_hi = mpf_sqrt(from_man_exp(n, 0), work, round_ceiling)
    one = from_man_exp(1, 0)
    return mpf_div(one, root_hi, work, round_floor), mpf_div(one, root_lo, work, round_ceiling)


def sign_of(lo, hi):
    """+1 / -1 when the enclosure [lo, hi] excludes 0 on that side, else None."""
    if mpf_cmp(lo, fzero) > 0:
        return 1
    if mpf_cmp(hi, fzero) < 0:
        return -1
    return None


def floor_scaled(x, bits: int) -> int:
    """floor(x * 2**bits) for a raw mpf x."""
    if x == fzero:
        return 0
    sign, man, exp, _ = x
    man = -man if sign else man
    shift = exp + bits
    return man << shift if shift >= 0 else man >> -shift


def ceil_scaled(x, bits: int) -> int:
    """ceil(x * 2**bits) for a raw mpf x."""
    return -floor_scaled(_neg(x), bits)


def _neg(x):
    if x == fzero:
        return x
    sign, man, exp, bc = x
    return (1 - sign, man, exp, bc)


def add_floor(a, b, prec: int):
    return mpf_add(a, b, prec, round_floor)


def add_ceil(a, b, prec: int):
    return mpf_add(a, b, prec, round_ceiling)
