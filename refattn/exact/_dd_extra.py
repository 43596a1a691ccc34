"""Double-double helpers of the fast exact VJP that :mod:`refattn.exact._dd` does not have.

* :func:`exp_dd_fast` -- ``exp`` on ``[EXP_MIN_ARG, 1]`` with a 1024-entry table, so that
  only four Horner steps need double-double arithmetic (the weights of the backward pass take
  one exponential per allowed (query, key) pair; this is 2-3x faster than
  :func:`refattn.exact._dd.exp_dd`);
* :func:`decide_dd_fast` -- :func:`refattn.exact.rounding.decide_dd` compiled (the same
  results, bit for bit, 10-20x faster: the rounding decision of the forward's enclosures);
* :func:`round_decision` -- the rounding of one double-double with an absolute error bound to
  a binary format, or "undecided", as a scalar Numba function (the kernel's outputs are decided
  in one compiled loop; exact zeros are decided as +0).

Both use the operations and the per-operation bound ``DD_REL`` of :mod:`refattn.exact._dd`;
no libm function is called (the table and the constants come from mpmath at 200 bits).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from mpmath import mp
from numba import njit

from ._dd import (
    DD_REL,
    EXP_MIN_ARG,
    U,
    dd_add,
    dd_add_d,
    dd_mul,
    dd_of_fraction,
    fast_two_sum,
    two_prod,
    two_sum,
)

__all__ = [
    "EXP_FAST_REL",
    "EXP_FAST_BUDGET",
    "exp_dd_fast",
    "round_decision",
    "decide_dd_compiled",
    "decide_dd_fast",
    "decide_one",
]

_JIT = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)
_STEPS = 1024  # table 2**(j/1024): |r| <= ln2/2048 < 3.4e-4
_R_MAX = 3.4e-4


def _constants():
    with mp.workprec(200):
        step = mp.log(2) / _STEPS
        pieces = []
        rest = step
        for bits in (32, 53, 53):  # k * piece exact for |k| < 2**21
            e = int(mp.floor(mp.log(abs(rest), 2)))
            quantum = mp.mpf(2) ** (e - bits + 1)
            piece = mp.nint(rest / quantum) * quantum
            pieces.append(float(piece))
            rest = rest - piece
        table = np.empty((_STEPS, 2))
        for j in range(_STEPS):
            t = mp.mpf(2) ** (mp.mpf(j) / _STEPS)
            table[j, 0] = float(t)
            table[j, 1] = float(t - table[j, 0])
        return np.array(pieces), float(abs(rest)), table


_PIECES, _PIECES_REST, _TABLE = _constants()
#: 2**e for -1022 <= e <= 2 (the final scaling: in the domain it is a normal power of two, so
#: the product is exact, and a table read is cheaper than ldexp)
_POW2_MIN = -1022
_POW2 = np.array([2.0**e for e in range(_POW2_MIN, 3)])
_INV_STEP = _STEPS / math.log(2.0)  # any approximation: it only picks the integer k
#: 1/n! for n <= 3 as double-doubles, and the float64 tail coefficients 1/n!, 4 <= n <= 8
_COEF = np.array([dd_of_fraction(Fraction(1, math.factorial(n)))[:2] for n in range(4)])
_TAIL = np.array([float(Fraction(1, math.factorial(n))) for n in range(4, 9)])


def _budget() -> float:
    """Itemised relative error of :func:`exp_dd_fast` (see its docstring)."""
    k_max = 2.0**21
    r_err = k_max * (_PIECES_REST + abs(_PIECES[2]) * U) + 3 * DD_REL * _R_MAX
    trunc = _R_MAX**9 / math.factorial(9) * 1.01
    # tau = sum_{n=4}^{8} r^(n-4)/n! in float64 (5 roundings, r's low word dropped), times
    # r^4 <= 1.4e-14: relative to exp(r) >= 0.9996
    tail = (8 * U + 2 * U) * (1 / 24) * 1.01 * _R_MAX**4
    horner = 8 * DD_REL * 1.01  # 4 products and 4 sums; partial values within 0.1% of c_n
    coef = 2.0**-105
    table = 2.0**-105
    final = DD_REL
    return (2 * r_err + trunc + tail + horner + coef + table + final) * 1.01


EXP_FAST_BUDGET = _budget()
#: Relative error bound of :func:`exp_dd_fast` on ``[EXP_MIN_ARG, 1]``.
EXP_FAST_REL = 2.0**-94
assert EXP_FAST_BUDGET < EXP_FAST_REL


@njit(**_JIT)
def exp_dd_fast(xh, xl):
    """exp(xh + xl) as a double-double, relative error <= :data:`EXP_FAST_REL` for
    ``EXP_MIN_ARG <= xh <= 1`` (outside: no claim; callers check).

    ``x = k ln2/1024 + r`` (``ln2/1024`` in three pieces from mpmath, the first of 32 bits so
    that ``k * piece`` is exact for ``|k| < 2**21``; ``|r| < 3.4e-4``), ``exp(r) = c0 + r(c1 +
    r(c2 + r(c3 + r tau)))`` with ``c_n = 1/n!`` double-doubles and ``tau = sum_{n=4}^{8}
    r^(n-4)/n!`` in float64 (``r^4 tau < 2**-46``, so its float64 error is below
    ``2**-104``), times ``2**(j/1024)`` from the table and ``2**(k >> 10)`` (exact in the
    domain: ``2**-895 <= 2**(k >> 10) <= 2``, and the low word stays normal).
    :data:`EXP_FAST_BUDGET` itemises the bound.
    """
    if not (xh >= EXP_MIN_ARG - 1.0 and xh <= 2.0):  # NaN too: never an index
        return math.nan, math.nan
    k = np.rint(xh * _INV_STEP)
    rh, rl = two_sum(xh, -k * _PIECES[0])
    rh, rl = dd_add_d(rh, rl, xl)
    ph, pl = two_prod(k, _PIECES[1])
    rh, rl = dd_add(rh, rl, -ph, -pl)
    rh, rl = dd_add_d(rh, rl, -k * _PIECES[2])
    tau = _TAIL[4]
    for n in range(3, -1, -1):
        tau = tau * rh + _TAIL[n]
    ah, al = fast_two_sum(_COEF[3, 0], _COEF[3, 1] + rh * tau)
    for n in range(2, -1, -1):
        ah, al = dd_mul(ah, al, rh, rl)
        ah, al = dd_add(ah, al, _COEF[n, 0], _COEF[n, 1])
    ki = np.int64(k)
    j = ki & (_STEPS - 1)
    ah, al = dd_mul(ah, al, _TABLE[j, 0], _TABLE[j, 1])
    # clamped: outside the domain the value is meaningless but no read leaves the table
    scale = _POW2[min(max((ki - j) // _STEPS - _POW2_MIN, 0), _POW2.shape[0] - 1)]
    return ah * scale, al * scale


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
        np.ascontiguousarray(np.broadcast_to(np.asarray(x, np.float64), shape)).reshape(-1)
        for x in (mid_hi, mid_lo, rad)
    ]
    values = np.empty(flat[0].size)
    decided = np.empty(flat[0].size, dtype=np.bool_)
    decide_dd_compiled(*flat, fmt.p, fmt.emin, float(fmt.max_finite), values, decided)
    return values.reshape(shape), decided.reshape(shape)
