"""Rounding decisions of the compiled first steps: a double-double enclosure to a binary format.

* :func:`round_decision` -- the rounding of one double-double with an absolute error bound to
  a binary format, or "undecided", as a scalar Numba function (the vjp's outputs are decided
  in one compiled loop; exact zeros are decided as +0);
* :func:`decide_one` -- one element of :func:`refattn.exact.rounding.decide_dd` (both ends of
  the widened enclosure rounded, decided where they agree): what the forward kernels call per
  element; :func:`decide_dd_compiled` / :func:`decide_dd_fast` -- the same over arrays (the
  same results as ``decide_dd``, bit for bit, 10-20x faster);
* :func:`decide_quick` -- :func:`decide_one` with a cheap first test (Veltkamp's splitting
  rounds to the target's precision; the enclosure inside the half-spacing around that value
  decides it), falling back to :func:`decide_one` where the test does not decide: the same
  decided values (each the one rounding of every point of the enclosure).

They use the operations of :mod:`refattn.exact.fast.doubledouble`; no libm function is called.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ...kernels._simd import as_bits, as_float
from ._params import frozen
from .doubledouble import two_sum

__all__ = [
    "round_decision",
    "decide_dd_compiled",
    "decide_dd_fast",
    "decide_one",
    "decide_quick",
    "float_bits",
    "half_gap",
]

_JIT = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)

#: The bits of a float64 as an int64 (a bitcast; the inverse of
#: :func:`refattn.kernels._simd.as_float`).
float_bits = as_bits


_EXPONENT_BITS = 0x7FF0000000000000


@njit(**_JIT)
def half_gap(y, low, high):
    """Half the smaller distance from a ``p``-bit float ``y`` (nonzero, normal in its format
    and in float64) to its two neighbours, given ``low = 2**-p`` and ``high = 2**-(p + 1)``.
    With ``2**e <= |y| < 2**(e + 1)`` (``2**e`` read from y's exponent bits, exact) the
    spacing of p-bit floats is ``2**(e - p + 1)`` on both sides of y, except toward zero when
    ``|y| = 2**e``, where it is ``2**(e - p)`` (Higham 2002, sec. 2.1, the spacing of a binary
    format); half of the smaller one is ``2**e low``, or ``2**e high`` at a power of two (both
    products exact). Branch-free (a loop over it vectorises).

    >>> half_gap(1.5, 2.0**-24, 2.0**-25) == 2.0**-24, half_gap(-1.0, 2.0**-24, 2.0**-25)
    (True, 2.9802322387695312e-08)
    """
    pow2 = as_float(float_bits(y) & _EXPONENT_BITS)
    return pow2 * (low if abs(y) != pow2 else high)


@njit(**_JIT)
def round_decision(xh, xl, err, p, emin, max_finite):
    """(y, decided): ``y`` the value of ``xh + xl`` rounded to the format (``p`` significand
    bits, minimum normal exponent ``emin``) with ties to even, decided when every real number
    within ``err`` of ``xh + xl`` rounds to the same ``y`` (sign of zero included).

    Undecided when ``err`` or the value is not finite, when the interval reaches a rounding
    midpoint (ties are left to the referee) or zero, or when ``|y| > max_finite``.
    """
    s, e = two_sum(xh, xl)
    if not (err >= 0.0 and err < np.inf) or not (abs(s) < np.inf):
        return 0.0, False
    if s == 0.0:
        return 0.0, err == 0.0  # e == 0 too: the value is exactly zero, rounded to +0
    frac, ex = math.frexp(abs(s))
    quantum = math.ldexp(1.0, max(ex - 1, emin) - (p - 1))
    y = np.rint(s / quantum) * quantum
    if abs(s - y) == 0.5 * quantum and e != 0.0 and (e > 0.0) == (s > y):
        y = y + 2.0 * (s - y)  # s is a midpoint and x = s + e lies beyond it: the far neighbour
    d = (s - y) + e  # s - y is exact (both on the float64 grid, |s - y| <= quantum / 2)
    # the relative slack covers the roundings of d and of |d| + err; 2**-1074 a rounding of d
    # in the subnormal range
    slack = 1.0 + 2.0**-50
    err = err + 2.0**-1074
    if y == 0.0:
        half = 0.5 * quantum
        if (abs(d) + err) * slack < half and abs(d) > err * slack:
            return math.copysign(0.0, s), True
        return 0.0, False
    if abs(y) > max_finite:
        return 0.0, False
    frac, ex = math.frexp(abs(y))
    gap = math.ldexp(1.0, max(ex - 1, emin) - (p - 1))  # the spacing above |y|
    below = gap  # the spacing below |y|: half as much below a power of two
    if frac == 0.5 and ex - 1 > emin:
        below = 0.5 * gap
    if (abs(d) + err) * slack < 0.5 * below:
        return y, True
    # |x| beyond a power of two |y|: the wider spacing above it applies on that side
    beyond = d if y > 0.0 else -d  # |x| - |y| up to d's rounding
    if beyond > 0.0 and (beyond + err) * slack < 0.5 * gap and err * slack < 0.5 * below:
        return y, True
    # x = y + a + e a hair inside a midpoint (|a| ~ half, e beyond d's precision): the margin
    # half - |a + e| = (half - |a|) - sign(a) e, the first difference exact (Sterbenz, as
    # half/2 <= |a| <= 2 half), the second rounded once (<= u of its result)
    a = s - y
    half = 0.5 * (gap if (a > 0.0) == (y > 0.0) else below)
    if abs(a) >= 0.5 * half and abs(e) < 0.25 * abs(a):
        margin = (half - abs(a)) - math.copysign(1.0, a) * e
        return y, margin * (1.0 - 2.0**-50) > err
    return y, False


@njit(**_JIT)
def _round_dd_scalar(hi, lo, p, emin, max_finite):
    """One element of :func:`refattn.exact.rounding.round_dd` (finite ``hi``, ``lo``)."""
    hi, lo = two_sum(hi, lo)
    if p == 53:
        out = hi
    else:
        e = math.frexp(hi)[1]
        quantum = max(e - 1, emin) - (p - 1)
        a = math.ldexp(hi, -quantum)  # exact (a scaling up, |a| < 2**p)
        low = math.floor(a)
        if a - low == 0.5 and lo > 0.0:
            n = low + 1.0
        elif a - low == 0.5 and lo < 0.0:
            n = low
        else:
            n = np.rint(a)
        out = math.ldexp(n, quantum)
    if abs(out) > max_finite:
        return math.copysign(np.inf, out)
    return out


@njit(**_JIT)
def decide_one(mh, ml, r, p, emin, max_finite):
    """One element of :func:`decide_dd_compiled`: ``(value, decided)`` of the enclosure
    ``mh + ml +- r`` (the form the compiled kernels call per element)."""
    wide = r * (1.0 + 2.0**-50) + 2.0**-99 * (abs(mh) + r) + 2.0**-1060
    s, e = two_sum(mh, -wide)
    v = ml + e
    lh = s + v
    ll = v - (lh - s)
    s, e = two_sum(mh, wide)
    v = ml + e
    hh = s + v
    hl = v - (hh - s)
    ok = (
        abs(lh) < np.inf
        and abs(hh) < np.inf
        and abs(ll) < np.inf
        and abs(hl) < np.inf
        and lh != 0.0
        and hh != 0.0
        and abs(wide) < np.inf
    )
    if not ok:
        return 0.0, False
    low = _round_dd_scalar(lh, ll, p, emin, max_finite)
    high = _round_dd_scalar(hh, hl, p, emin, max_finite)
    return low, (
        low == high and math.copysign(1.0, low) == math.copysign(1.0, high) and abs(low) < np.inf
    )


@njit(**_JIT)
def decide_dd_compiled(mid_hi, mid_lo, rad, p, emin, max_finite, values, decided):
    """:func:`refattn.exact.rounding.decide_dd` compiled, elementwise over 1-d arrays: the same
    widening of ``rad``, the same double-double ends and the same rule (both ends finite,
    nonzero and rounding to the same bits); writes ``values`` (the low end's rounding, 0 where
    an end is not finite or zero) and ``decided``. ``tests/exact/test_dd.py`` checks it against
    ``decide_dd`` bit for bit."""
    for i in range(mid_hi.shape[0]):
        values[i], decided[i] = decide_one(mid_hi[i], mid_lo[i], rad[i], p, emin, max_finite)


def decide_dd_fast(mid_hi, mid_lo, rad, fmt):
    """:func:`refattn.exact.rounding.decide_dd` (same results, bit for bit) by
    :func:`decide_dd_compiled`: ``(values, decided)`` of the shape of ``mid_hi``; ``fmt`` a
    :class:`refattn.exact.rounding.Format`."""
    mid_hi = np.asarray(mid_hi, np.float64)
    shape = mid_hi.shape
    flat = [
        frozen(np.broadcast_to(np.asarray(x, np.float64), shape)).reshape(-1)
        for x in (mid_hi, mid_lo, rad)
    ]
    values = np.empty(flat[0].size)
    decided = np.empty(flat[0].size, dtype=np.bool_)
    decide_dd_compiled(*flat, fmt.p, fmt.emin, float(fmt.max_finite), values, decided)
    return values.reshape(shape), decided.reshape(shape)


@njit(**_JIT)
def decide_quick(mh, ml, r, p, emin, max_finite):
    """``(value, decided)`` of the enclosure ``mh + ml +- r`` as :func:`decide_one`, first by a
    cheap test. With ``s + e = mh + ml`` (TwoSum, exact) and ``y = s`` rounded to nearest on
    ``p`` bits by Veltkamp's splitting (``t = (2**(53 - p) + 1) s``, ``y = t - (t - s)``:
    Dekker 1971; Boldo 2006 proves y a nearest p-bit float of s, ties either way), the
    distance ``d = (s - y) + e`` (``s - y`` exact by Sterbenz's lemma) and the half-spacing
    ``g`` of the format around a normal ``y`` (:func:`half_gap`, the smaller side): every point
    within ``|d| + r < g`` of ``y`` rounds to ``y`` (ties excluded, strictly inside), the slack
    ``2**-50`` covering the roundings of ``d`` and of the sum. (``g >= |y| 2**-(p + 1)``,
    up to twice it: the exact half-spacing rather than that lower bound leaves about half as
    many elements to ``decide_one``.) Used where
    ``2**(emin + 1) <= |s| <= max_finite / 2`` (y normal and finite in the format) and
    ``p <= 51`` (Boldo's condition: a split of at least 2 bits); elsewhere, and where the
    test fails, :func:`decide_one` decides.

    >>> decide_quick(1.0 + 2.0**-30, 0.0, 2.0**-40, 24, -126, 3.4e38)
    (1.0, True)
    """
    s, e = two_sum(mh, ml)
    a = abs(s)
    if p <= 51 and a >= math.ldexp(1.0, emin + 1) and a <= 0.5 * max_finite and 0.0 <= r < a:
        c = float(1 << (53 - p)) + 1.0
        t = c * s
        y = t - (t - s)
        d = (s - y) + e
        gap = half_gap(y, math.ldexp(1.0, -p), math.ldexp(1.0, -p - 1))
        if (abs(d) + r) * (1.0 + 2.0**-50) < gap:
            return y, True
    return decide_one(mh, ml, r, p, emin, max_finite)
