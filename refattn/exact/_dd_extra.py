"""Double-double (dd) building blocks with proven error bounds, for the fast exact VJP.

A dd number is an unevaluated pair ``hi + lo`` of float64. The operations below are the
double-word algorithms of Joldes, Muller & Popescu, "Tight and rigorous error bounds for basic
building blocks of double-word arithmetic" (ACM TOMS 44(2), 2017; "JMP" below); each returns a
pair whose relative error is bounded by the constant next to it, where ``u = 2**-53`` (the
published bounds, rounded up to a whole multiple of ``u**2`` as a margin):

=================  ==========================  ===============  ============
function           JMP algorithm               published bound  used here
=================  ==========================  ===============  ============
:func:`dd_add_d`   4 (DWPlusFP)                2 u^2            :data:`ADD_D`
:func:`dd_add`     6 (AccurateDWPlusDW)        3 u^2 + 13 u^3   :data:`ADD`
:func:`dd_mul_d`   9 (DWTimesFP3)              2 u^2            :data:`MUL_D`
:func:`dd_mul`     12 (DWTimesDW3)             4 u^2            :data:`MUL`
:func:`dd_div_d`   15 (DWDivFP3)               3 u^2            :data:`DIV_D`
:func:`dd_div`     17 (DWDivDW2)               15 u^2 + 56 u^3  :data:`DIV`
=================  ==========================  ===============  ============

The bounds hold when no intermediate underflows or overflows; the callers add an absolute
term for underflow and treat any non-finite value as "undecided".

:func:`exp_dd` encloses ``exp`` without any libm call: the table ``2**(j/64)`` and the
constants ``ln2/64``, ``1/n!`` are computed once with mpmath (arbitrary precision) and stored
as dd pairs; see its docstring for the error budget.

:func:`round_decision` rounds a dd value with an absolute error bound to a binary format, or
reports that the bound straddles a rounding boundary.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numba
import numpy as np
from numba import njit

__all__ = [
    "U2", "ADD_D", "ADD", "MUL_D", "MUL", "DIV_D", "DIV", "EXP_REL", "JIT_OPTIONS",
    "fma", "two_sum", "fast_two_sum", "two_prod", "dd_add_d", "dd_add", "dd_mul_d", "dd_mul",
    "dd_div_d", "dd_div", "exp_dd", "round_decision",
]

#: u**2 with u = 2**-53, the unit of every dd error bound.
U2 = 2.0**-106
ADD_D = 3.0 * U2
ADD = 4.0 * U2
MUL_D = 3.0 * U2
MUL = 5.0 * U2
DIV_D = 4.0 * U2
DIV = 16.0 * U2
#: Relative error bound of :func:`exp_dd` for an exact argument (see its docstring).
EXP_REL = 2.0**-96

#: fastmath off (no re-association, no contraction into fma), on-disk cache.
JIT_OPTIONS = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)

if not numba.config.DISABLE_JIT:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    @intrinsic
    def fma(typingctx, a, b, c):
        """a * b + c with one rounding (``llvm.fma.f64``)."""
        if not (a == b == c == types.float64):
            return None

        def codegen(context, builder, sig, args):
            lt = ir.DoubleType()
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(lt, [lt] * 3), "llvm.fma.f64")
            return builder.call(fn, args)

        return types.float64(a, b, c), codegen

else:  # pragma: no cover - the NUMBA_DISABLE_JIT=1 tier

    def fma(a, b, c):
        """a * b + c with one rounding (exact rational arithmetic, then one rounding)."""
        if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(c)):
            return a * b + c
        return float(Fraction(a) * Fraction(b) + Fraction(c))


@njit(**JIT_OPTIONS)
def two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e = a + b exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@njit(**JIT_OPTIONS)
def fast_two_sum(a, b):
    """(s, e) with s + e = a + b exactly, when a = 0 or |a| >= |b| (Dekker)."""
    s = a + b
    return s, b - (s - a)


@njit(**JIT_OPTIONS)
def two_prod(a, b):
    """(p, e) with p = fl(a b) and p + e = a b exactly (no underflow)."""
    p = a * b
    return p, fma(a, b, -p)


@njit(**JIT_OPTIONS)
def dd_add_d(xh, xl, y):
    """dd + float64 (JMP Alg. 4)."""
    sh, sl = two_sum(xh, y)
    return fast_two_sum(sh, xl + sl)


@njit(**JIT_OPTIONS)
def dd_add(xh, xl, yh, yl):
    """dd + dd (JMP Alg. 6)."""
    sh, sl = two_sum(xh, yh)
    th, tl = two_sum(xl, yl)
    vh, vl = fast_two_sum(sh, sl + th)
    return fast_two_sum(vh, tl + vl)


@njit(**JIT_OPTIONS)
def dd_mul_d(xh, xl, y):
    """dd * float64 (JMP Alg. 9)."""
    ch, cl1 = two_prod(xh, y)
    return fast_two_sum(ch, fma(xl, y, cl1))


@njit(**JIT_OPTIONS)
def dd_mul(xh, xl, yh, yl):
    """dd * dd (JMP Alg. 12)."""
    ch, cl1 = two_prod(xh, yh)
    tl1 = fma(xh, yl, xl * yl)
    cl2 = fma(xl, yh, tl1)
    return fast_two_sum(ch, cl1 + cl2)


@njit(**JIT_OPTIONS)
def dd_div_d(xh, xl, y):
    """dd / float64 (JMP Alg. 15)."""
    th = xh / y
    ph, pl = two_prod(th, y)
    dh = xh - ph
    d = (dh - pl) + xl
    return fast_two_sum(th, d / y)


@njit(**JIT_OPTIONS)
def dd_div(xh, xl, yh, yl):
    """dd / dd (JMP Alg. 17)."""
    th = xh / yh
    rh, rl = dd_mul_d(yh, yl, th)
    d = (xh - rh) + (xl - rl)
    return fast_two_sum(th, d / yh)


# -- exp ---------------------------------------------------------------------------------
def _split(value: mpmath.mpf, parts: int, first_bits: int = 53):
    """value as a sum of ``parts`` float64 (the first rounded to ``first_bits`` bits)."""
    out = []
    rest = value
    for n in range(parts):
        bits = first_bits if n == 0 else 53
        with mpmath.workprec(bits):
            piece = +rest
        out.append(float(piece))
        rest = rest - mpmath.mpf(out[-1])
    return out


def _constants():
    with mpmath.workprec(400):
        c1, c2, c3 = _split(mpmath.ln(2) / 64, 3, first_bits=32)
        table = np.array([_split(mpmath.mpf(2) ** (mpmath.mpf(j) / 64), 2) for j in range(64)])
        inv_fact = np.array([_split(1 / mpmath.factorial(n), 2) for n in range(12)])
    return c1, c2, c3, table, inv_fact


_C1, _C2, _C3, _TABLE, _INV_FACT = _constants()
_INV_C = 64.0 / math.log(2.0)  # any approximation works: it only picks the reduction integer


@njit(**JIT_OPTIONS)
def exp_dd(xh, xl):
    """exp(xh + xl) as a dd with relative error <= :data:`EXP_REL`, for xh <= 1.

    ``x = k ln2/64 + r`` with ``k = rint(64 xh / ln2)`` and ``|r| <= 0.0055``:

    * ``ln2/64 = C1 + C2 + C3 + eps`` (mpmath, 400 bits; C1 has 32 bits so ``k C1`` is exact for
      ``|k| < 2**21``; ``|eps| < 2**-145``); ``xh - k C1`` is exact (Sterbenz), the rest is one
      exact two-sum, one dd addition and one dd + float64 addition:
      ``|r - r~| <= 8 u^2 |r| + 2**-120``;
    * ``exp(r) = c0 + r(c1 + r(c2 + ... r(c5 + r tau)))`` with ``c_n = 1/n!`` (dd) and
      ``tau = sum_{n=6}^{11} r^(n-6)/n!`` in float64 (truncation ``< 2**-118``; the float64
      error of ``tau`` moves the result by ``< 2**-104``); the six dd steps (a product,
      ``5 u^2``, and an addition, ``4 u^2``, each) act on partial values within 1% of
      ``c_n``, and an error in step ``n + 1`` reaches the result damped by ``|r| / (n + 1)``:
      ``<= 10 u^2`` in all;
    * ``2**(j/64)`` from the table (``<= 2**-105`` relative), one dd product (``5 u^2``), and
      ``2**(k >> 6)`` exact (``ldexp``; a subnormal result loses at most ``2**-1074``
      absolute, which the callers' absolute term covers).

    The sum of these is below ``2**-101``; :data:`EXP_REL` = ``2**-96`` keeps a margin. For
    ``xh < -746`` the result is 0 (``exp(x) < 2**-1076``, an absolute error only).
    """
    if xh < -746.0:
        return 0.0, 0.0
    kf = np.rint(xh * _INV_C)
    r1 = xh - kf * _C1
    ph, pl = two_prod(kf, _C2)
    rh, rl = two_sum(r1, xl)  # a normalised pair for the JMP additions
    rh, rl = dd_add(rh, rl, -ph, -pl)
    rh, rl = dd_add_d(rh, rl, -(kf * _C3))
    tau = _INV_FACT[11, 0]
    for n in range(10, 5, -1):
        tau = tau * rh + _INV_FACT[n, 0]
    ah, al = tau, 0.0
    for n in range(5, -1, -1):
        ah, al = dd_mul(ah, al, rh, rl)
        ah, al = dd_add(ah, al, _INV_FACT[n, 0], _INV_FACT[n, 1])
    k = int(kf)
    j = k & 63
    ah, al = dd_mul(ah, al, _TABLE[j, 0], _TABLE[j, 1])
    e = (k - j) >> 6
    return math.ldexp(ah, e), math.ldexp(al, e)


# -- rounding decision -------------------------------------------------------------------
@njit(**JIT_OPTIONS)
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
    d = (s - y) + e  # s - y is exact (both on the float64 grid, |s - y| <= quantum / 2)
    slack = 1.0 + 2.0**-50  # covers the roundings of d and of |d| + err
    if y == 0.0:
        half = 0.5 * quantum
        if (abs(d) + err) * slack < half and abs(d) > err * slack:
            return math.copysign(0.0, s), True
        return 0.0, False
    if abs(y) > max_finite:
        return 0.0, False
    frac, ex = math.frexp(abs(y))
    gap = math.ldexp(1.0, max(ex - 1, emin) - (p - 1))
    if frac == 0.5 and ex - 1 > emin:
        gap = 0.5 * gap  # below a power of two the spacing halves
    return y, (abs(d) + err) * slack < 0.5 * gap
