"""Double-double ("double-word") arithmetic in Numba with rigorous error bounds.

A double-double is an unevaluated sum ``x = hi + lo`` of two float64 numbers with
``|lo| <= ulp(hi) / 2`` (normalised). The algorithms below are those of Joldes, Muller & Popescu
2017, "Tight and rigorous error bounds for basic building blocks of double-word arithmetic"
(ACM TOMS 44(2)); their proven relative error bounds (u = 2**-53, no underflow, no overflow) are
stated as module constants next to each operation:

=================  =============================  ==============================
operation          algorithm (JMP 2017)           relative error bound
=================  =============================  ==============================
dd_add_d           Alg. 4  DWPlusFP               ``DD_ADD_D_REL = 2 u^2``
dd_add             Alg. 6  AccurateDWPlusDW       ``DD_ADD_REL = 3 u^2 + 13 u^3``
dd_mul_d           Alg. 9  DWTimesFP3 (FMA)       ``DD_MUL_D_REL = 2 u^2``
dd_mul             Alg. 12 DWTimesDW3 (FMA)       ``DD_MUL_REL = 5 u^2``
dd_div_d           Alg. 15 DWDivFP3               ``DD_DIV_D_REL = 3 u^2``
dd_div             Alg. 17 DWDivDW2               ``DD_DIV_REL = 15 u^2 + 56 u^3``
=================  =============================  ==============================

(Muller & Rideau 2022, "Formalization of double-word arithmetic, and comments on 'Tight and
rigorous error bounds ...'", revised the bound of Alg. 12 from 4 u^2 to 5 u^2; the table uses
the larger values.) Every error analysis in refattn's fast exact path uses the single, generous
constant ``DD_REL = 2**-100`` (= 64 u^2, four times the largest bound above) per operation, so a
slip of a small factor in any one bound cannot break an enclosure. Underflow is kept out of the
domain by the callers (they send values below ``SAFE_MIN`` or above ``SAFE_MAX`` to the referee
engine); TwoSum and the FMA-based TwoProd are exact in that domain.

Elementary functions (no libm accuracy claim is used; libm only supplies the first guess of
``log_dd``, whose error is measured, not assumed):

* :func:`exp_dd` -- ``x = k ln2/64 + r`` with ``ln2/64`` split in three pieces (``k * piece``
  exact for ``|k| < 2**17``), ``2**(j/64)`` from a 64-entry double-double table computed at
  import with mpmath at 200 bits (relative error <= 2**-105), and the Taylor polynomial of
  degree ``EXP_DEGREE = 11`` on ``|r| <= 0.0055`` (remainder < 2**-118). Horner's rule with
  per-step error ``DD_REL`` gives ``gamma_{2N}`` times ``sum |c_n| |r|^n / |p(r)| <= 1.013``.
  Total: ``EXP_REL = 2**-94`` (:data:`EXP_BUDGET` holds the itemised sum, asserted below it).
  Domain ``[EXP_MIN_ARG, EXP_MAX_ARG]``: the result and its low word stay normal.
* :func:`log_dd` -- ``y0 = log(hi)`` from libm (a guess), ``delta = z exp(-y0) - 1`` in
  double-double, ``log z = y0 + log1p(delta)`` with ``log1p(delta) = delta - delta^2/2 +
  delta^3/3`` and remainder ``|delta|^4 / (4 (1 - |delta|))``. Returns a rigorous absolute bound
  (``inf`` when ``|delta| > 2**-30``, i.e. the guess was poor).
* :func:`exp_dd_fast` -- ``exp`` on ``[EXP_MIN_ARG, 1]`` with a 1024-entry table, so that only
  four Horner steps need double-double arithmetic (the weights of the backward pass take one
  exponential per allowed (query, key) pair; 2-3x faster than :func:`exp_dd`); relative error
  ``EXP_FAST_REL = 2**-94`` (:data:`EXP_FAST_BUDGET` itemises it).
* :func:`tanh_dd` -- ``tanh a = (1 - e^{-2a}) / (1 + e^{-2a})`` for ``a = |x|``; absolute error
  <= ``TANH_ABS`` (the quotient is <= 1 and its denominator >= 1).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numba
import numpy as np
from mpmath import mp, mpf

from ...bounds import unit
from ...kernels._simd import as_float

__all__ = [
    "U",
    "DD_REL",
    "DD_ADD_D_REL",
    "DD_ADD_REL",
    "DD_MUL_D_REL",
    "DD_MUL_REL",
    "DD_DIV_D_REL",
    "DD_DIV_REL",
    "EXP_REL",
    "EXP_MIN_ARG",
    "EXP_MAX_ARG",
    "EXP_DEGREE",
    "TANH_ABS",
    "SAFE_MIN",
    "SAFE_MAX",
    "BOUND_SAFETY",
    "fma",
    "two_sum",
    "fast_two_sum",
    "two_prod",
    "dd_add",
    "dd_add_d",
    "dd_mul",
    "dd_mul_d",
    "dd_div",
    "dd_div_d",
    "exp_dd",
    "exp_dd_fast",
    "exp_dd_fast_lanes",
    "EXP_FAST_REL",
    "EXP_FAST_BUDGET",
    "log_dd",
    "tanh_dd",
    "dd_of_fraction",
    "dd_of_exact",
    "dot_bound",
    "exp_d",
    "exp_d_core",
    "trailing_zeros",
    "EXP_D_REL",
    "EXP_D_DEGREE",
    "gamma_up",
]

U = 2.0**-53
DD_ADD_D_REL = 2 * U**2
DD_ADD_REL = 3 * U**2 + 13 * U**3
DD_MUL_D_REL = 2 * U**2
DD_MUL_REL = 5 * U**2
DD_DIV_D_REL = 3 * U**2
DD_DIV_REL = 15 * U**2 + 56 * U**3
#: The per-operation relative bound used in every analysis (covers all of the above by 4x).
DD_REL = 2.0**-100
assert DD_REL >= 4 * max(
    DD_ADD_D_REL, DD_ADD_REL, DD_MUL_D_REL, DD_MUL_REL, DD_DIV_D_REL, DD_DIV_REL
)

#: Magnitudes the fast path accepts (nonzero values outside go to the referee): far from
#: float64 underflow (2**-1022, with a 53-bit low word) and overflow (2**1024).
SAFE_MIN = 2.0**-400
SAFE_MAX = 2.0**400
#: Factor applied to error bounds computed in float64 (covers the rounding of the bound's own
#: evaluation: a sum of n < 2**25 nonnegative terms is off by at most gamma_n < 2**-27).
BOUND_SAFETY = 1.0 + 2.0**-20

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy")


# ------------------------------------------------------------------------------ FMA
def _fma_exact(a, b, c):
    """a*b + c rounded once (Python's float(Fraction) rounds correctly)."""
    if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(c)):
        return a * b + c
    return float(Fraction(a) * Fraction(b) + Fraction(c))


if numba.config.DISABLE_JIT:
    fma = _fma_exact

    def trailing_zeros(n):
        """The number of trailing zero bits of a nonzero int64."""
        n = int(n)
        return (n & -n).bit_length() - 1

else:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def trailing_zeros(typingctx, n):
        """The number of trailing zero bits of a nonzero int64 (LLVM's llvm.cttz.i64)."""
        sig = types.int64(types.int64)

        def codegen(context, builder, signature, args):
            return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

        return sig, codegen

    @intrinsic
    def fma(typingctx, a, b, c):
        """Fused multiply-add a*b + c with one rounding (LLVM's llvm.fma.f64: always fused,
        in hardware or in software, never split into two roundings)."""
        sig = types.float64(types.float64, types.float64, types.float64)

        def codegen(context, builder, signature, args):
            d = ir.DoubleType()
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(d, [d, d, d]), "llvm.fma.f64"
            )
            return builder.call(fn, args)

        return sig, codegen


# ------------------------------------------------------------------------------ error-free
@numba.jit(**_JIT)
def two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e = a + b exactly (Knuth).

    >>> two_sum(1.0, 2.0**-60)
    (1.0, 8.673617379884035e-19)
    """
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


@numba.jit(**_JIT)
def fast_two_sum(a, b):
    """(s, e) with s + e = a + b exactly, provided |a| >= |b| or a == 0 (Dekker)."""
    s = a + b
    e = b - (s - a)
    return s, e


@numba.jit(**_JIT)
def two_prod(a, b):
    """(p, e) with p = fl(a b) and p + e = a b exactly (FMA; exact without underflow).

    >>> two_prod(1.0 + 2.0**-30, 1.0 + 2.0**-30)[1] == 2.0**-60
    True
    """
    p = a * b
    return p, fma(a, b, -p)


# ------------------------------------------------------------------------------ arithmetic
@numba.jit(**_JIT)
def dd_add_d(xh, xl, y):
    """(xh + xl) + y, JMP 2017 Alg. 4 (relative error <= DD_ADD_D_REL)."""
    sh, sl = two_sum(xh, y)
    v = xl + sl
    return fast_two_sum(sh, v)


@numba.jit(**_JIT)
def dd_add(xh, xl, yh, yl):
    """(xh + xl) + (yh + yl), JMP 2017 Alg. 6 (relative error <= DD_ADD_REL)."""
    sh, sl = two_sum(xh, yh)
    th, tl = two_sum(xl, yl)
    c = sl + th
    vh, vl = fast_two_sum(sh, c)
    w = tl + vl
    return fast_two_sum(vh, w)


@numba.jit(**_JIT)
def dd_mul_d(xh, xl, y):
    """(xh + xl) * y, JMP 2017 Alg. 9 (relative error <= DD_MUL_D_REL)."""
    ch, cl1 = two_prod(xh, y)
    cl3 = fma(xl, y, cl1)
    return fast_two_sum(ch, cl3)


@numba.jit(**_JIT)
def dd_mul(xh, xl, yh, yl):
    """(xh + xl) * (yh + yl), JMP 2017 Alg. 12 (relative error <= DD_MUL_REL)."""
    ch, cl1 = two_prod(xh, yh)
    tl0 = xl * yl
    tl1 = fma(xh, yl, tl0)
    cl2 = fma(xl, yh, tl1)
    cl3 = cl1 + cl2
    return fast_two_sum(ch, cl3)


@numba.jit(**_JIT)
def dd_div_d(xh, xl, y):
    """(xh + xl) / y, JMP 2017 Alg. 15 (relative error <= DD_DIV_D_REL)."""
    th = xh / y
    ph, pl = two_prod(th, y)
    dh = xh - ph
    dt = dh - pl
    d = dt + xl
    tl = d / y
    return fast_two_sum(th, tl)


@numba.jit(**_JIT)
def dd_div(xh, xl, yh, yl):
    """(xh + xl) / (yh + yl), JMP 2017 Alg. 17 (relative error <= DD_DIV_REL)."""
    th = xh / yh
    rh, rl = dd_mul_d(yh, yl, th)
    ph = xh - rh
    dl = xl - rl
    d = ph + dl
    tl = d / yh
    return fast_two_sum(th, tl)


# ------------------------------------------------------------------------------ constants
def dd_of_fraction(x: Fraction) -> tuple[float, float, float]:
    """(hi, lo, err): the double-double nearest a rational and a bound on |hi + lo - x|.

    >>> hi, lo, err = dd_of_fraction(Fraction(1, 3))
    >>> hi, err < 2.0**-105
    (0.3333333333333333, True)
    """
    hi = float(x)
    lo = float(x - Fraction(hi))
    err = abs(x - Fraction(hi) - Fraction(lo))
    return hi, lo, _float_up(err)


def dd_of_exact(value, bits: int = 200) -> tuple[float, float, float]:
    """(hi, lo, err) for a Fraction or ("invsqrt", n) = 1/sqrt(n) (n a positive integer).

    1/sqrt(n) is enclosed with integers: ``a = isqrt(4**bits // n)`` satisfies
    ``a <= 2**bits / sqrt(n) < a + 1``.

    >>> dd_of_exact(("invsqrt", 4))[0]
    0.5
    """
    if isinstance(value, tuple):
        n = int(value[1])
        a = math.isqrt((1 << (2 * bits)) // n)
        approx = Fraction(a, 1 << bits)
        hi, lo, err = dd_of_fraction(approx)
        return hi, lo, _float_up(Fraction(err) + Fraction(1, 1 << bits))
    return dd_of_fraction(Fraction(value))


def _float_up(x) -> float:
    """A float >= the nonnegative rational x."""
    f = float(x)
    return f if Fraction(f) >= x else float(np.nextafter(f, np.inf))


def dot_bound(terms: int) -> float:
    """Relative bound of the compensated sums of refattn's fast path (Dot2-like).

    ``s, c`` accumulate ``m = terms`` products ``p_j = a_j b_j``: ``(s, es) = TwoSum(s, fl(p_j))``
    and ``c += e_j + es`` (``e_j`` the exact product error, or a term of size <= u |p_j|). The
    increments of c sum in magnitude to at most ``(m + 2) u (1 + 2u) P`` (``|es| <= u |s|``,
    ``P = sum |a_j b_j|``), their float sum errs by ``gamma_{2m}`` of that, and the low-word
    products ``a_lo b`` err by ``u^2 P``. So ``|s + c - sum a_j b_j| <= dot_bound(m) * P``.

    >>> dot_bound(64) < 2.0**-90
    True
    """
    m = int(terms) + 2
    gamma = 2 * m * U / (1 - 2 * m * U)
    return (gamma * (m + 2) * U * (1 + 2 * U) + 2 * U**2) * BOUND_SAFETY


# ------------------------------------------------------------------------------ exp
EXP_DEGREE = 11
EXP_MIN_ARG = -620.0  # exp(-620) > 2**-895: the low word (>= 2**-948) stays normal
EXP_MAX_ARG = 600.0
_R_MAX = 0.0055  # |r| <= ln2/128 + |x_lo| + rounding of k, < 0.00542


def _table_and_pieces():
    with mp.workprec(200):
        ln2_64 = mp.log(2) / 64
        pieces = []
        rest = ln2_64
        for bits in (36, 36, 53):
            # round to `bits` significant bits: k * piece is exact for |k| < 2**17
            e = int(mp.floor(mp.log(abs(rest), 2)))
            q = mp.mpf(2) ** (e - bits + 1)
            piece = mp.nint(rest / q) * q
            pieces.append(float(piece))
            assert mpf(pieces[-1]) == piece
            rest = rest - piece
        table_hi = np.empty(64)
        table_lo = np.empty(64)
        for j in range(64):
            t = mp.mpf(2) ** (mp.mpf(j) / 64)
            table_hi[j] = float(t)
            table_lo[j] = float(t - table_hi[j])
        coef_hi = np.empty(EXP_DEGREE + 1)
        coef_lo = np.empty(EXP_DEGREE + 1)
        for n in range(EXP_DEGREE + 1):
            c = Fraction(1, math.factorial(n))
            coef_hi[n], coef_lo[n], _ = dd_of_fraction(c)
        return np.array(pieces), float(abs(rest)), table_hi, table_lo, coef_hi, coef_lo


_LN2_64, _LN2_64_REST, _T_HI, _T_LO, _C_HI, _C_LO = _table_and_pieces()
_INV_LN2_64 = 64 / math.log(2)
_POW2_BIAS = 1022
#: 2**q for q in [-1022, 1023] (exact): scaling by a table entry instead of ldexp (a call)
_POW2 = np.array([math.ldexp(1.0, q) for q in range(-_POW2_BIAS, 1024)])


def _exp_budget() -> float:
    """Itemised relative error of exp_dd (see the module docstring)."""
    k_max = 2.0**17
    # reduction: tail of ln2/64 beyond the pieces, rounding of k * piece3, 3 dd additions
    r_err = k_max * (_LN2_64_REST + abs(_LN2_64[2]) * U) + 4 * DD_REL * 0.01
    r_rel = 2 * r_err  # |e^d - 1| <= 2 |d| for |d| <= 1
    horner = 2 * EXP_DEGREE * DD_REL / (1 - 2 * EXP_DEGREE * DD_REL) * math.exp(2 * _R_MAX)
    coef = 2.0**-105 * math.exp(2 * _R_MAX)
    trunc = _R_MAX ** (EXP_DEGREE + 1) / math.factorial(EXP_DEGREE + 1) * math.exp(2 * _R_MAX)
    table = 2.0**-105
    final = DD_REL
    return (r_rel + horner + coef + trunc + table + final) * 1.01


EXP_BUDGET = _exp_budget()
#: Relative error bound of :func:`exp_dd` on [EXP_MIN_ARG, EXP_MAX_ARG].
EXP_REL = 2.0**-94
assert EXP_BUDGET < EXP_REL


@numba.jit(**_JIT)
def exp_dd(xh, xl):
    """exp(xh + xl) as a double-double, relative error <= EXP_REL on [EXP_MIN_ARG,
    EXP_MAX_ARG] (outside: no claim; callers check).

    >>> exp_dd(0.0, 0.0)
    (1.0, 0.0)
    """
    if not (xh >= EXP_MIN_ARG - 1.0 and xh <= EXP_MAX_ARG + 1.0):  # NaN too: never an index
        return math.nan, math.nan
    k = np.rint(xh * _INV_LN2_64)
    # r = x - k ln2/64 in double-double; k * piece is exact for |k| < 2**17
    rh, rl = two_sum(xh, -k * _LN2_64[0])
    rh, rl = dd_add_d(rh, rl, xl)
    rh, rl = dd_add_d(rh, rl, -k * _LN2_64[1])
    rh, rl = dd_add_d(rh, rl, -k * _LN2_64[2])
    ph, pl = _C_HI[EXP_DEGREE], _C_LO[EXP_DEGREE]
    for n in range(EXP_DEGREE - 1, -1, -1):
        ph, pl = dd_mul(ph, pl, rh, rl)
        ph, pl = dd_add(ph, pl, _C_HI[n], _C_LO[n])
    ki = np.int64(k)
    j = ki & 63
    q = (ki - j) // 64
    ph, pl = dd_mul(ph, pl, _T_HI[j], _T_LO[j])
    scale = _POW2[q + _POW2_BIAS]  # |q| <= 900 on the domain: a normal power of two
    return ph * scale, pl * scale


# ------------------------------------------------------------------------------ exp (double)
EXP_D_DEGREE = 6
_EXP_D_COEF = np.array([1.0 / math.factorial(n) for n in range(EXP_D_DEGREE + 1)])
_LN2_64_D = np.array([_LN2_64[0], float(Fraction(_LN2_64[1]) + Fraction(_LN2_64[2]))])


def gamma_up(n: int) -> float:
    """gamma_n = n u / (1 - n u) (Higham 2002, Lemma 3.1), u = 2**-53, rounded up.

    >>> gamma_up(1) > 2.0**-53
    True
    """
    return unit.gamma(n) * BOUND_SAFETY


def _exp_d_budget() -> float:
    """Itemised relative error of exp_d (double precision, the same reduction as exp_dd)."""
    k_max = 2.0**17
    tail = abs(Fraction(_LN2_64[1]) + Fraction(_LN2_64[2]) - Fraction(_LN2_64_D[1]))
    r_err = k_max * (_LN2_64_REST + float(tail)) + 3 * U * (_R_MAX + k_max * _LN2_64_D[1])
    horner = gamma_up(2 * EXP_D_DEGREE) * math.exp(2 * _R_MAX)
    coef = U * math.exp(2 * _R_MAX)
    trunc = _R_MAX ** (EXP_D_DEGREE + 1) / math.factorial(EXP_D_DEGREE + 1) * 1.02
    return (2 * r_err + horner + coef + trunc + U + U) * 1.01  # + table, + final product


EXP_D_BUDGET = _exp_d_budget()
#: Relative error bound of :func:`exp_d` on [EXP_MIN_ARG, EXP_MAX_ARG].
EXP_D_REL = 2.0**-48.5
assert EXP_D_BUDGET < EXP_D_REL


@numba.jit(**_JIT)
def exp_d(x):
    """exp(x) in double precision, relative error <= EXP_D_REL on [EXP_MIN_ARG, EXP_MAX_ARG]:
    the reduction of :func:`exp_dd` (two pieces of ln2/64, each rounding of the reduction
    bounded), the degree-6 Taylor polynomial by Horner (gamma_12), the table's high words.

    >>> exp_d(0.0)
    1.0
    """
    if not (x >= EXP_MIN_ARG - 1.0 and x <= EXP_MAX_ARG + 1.0):  # NaN too: never an index
        return math.nan
    return exp_d_core(x)


_ROUND_SHIFT = 1.5 * 2.0**52  # (y + shift) - shift = rint(y) for |y| < 2**51 (ties to even)
_EXP_D_C = tuple(float(c) for c in _EXP_D_COEF)
assert len(_EXP_D_C) == 7  # the Horner steps below are written out for EXP_D_DEGREE = 6
_EXP_D_C0, _EXP_D_C1, _EXP_D_C2, _EXP_D_C3, _EXP_D_C4, _EXP_D_C5, _EXP_D_C6 = _EXP_D_C
_LN2_64_D0, _LN2_64_D1 = float(_LN2_64_D[0]), float(_LN2_64_D[1])


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def exp_d_core(x):
    """:func:`exp_d` without its domain check, branch-free (a loop over it vectorises), for x
    in [EXP_MIN_ARG - 1, EXP_MAX_ARG + 1]: the same IEEE operations, so the same bits. ``k =
    rint(x 64 / ln 2)`` by the shift trick (|x 64/ln2| < 2**17); ``2**q`` (q = floor(k / 64),
    a normal exponent on the domain) is built from its bits.

    >>> exp_d_core(-1.0) == exp_d(-1.0)
    True
    """
    k = (x * _INV_LN2_64 + _ROUND_SHIFT) - _ROUND_SHIFT
    r = (x - k * _LN2_64_D0) - k * _LN2_64_D1
    p = _EXP_D_C6 * r + _EXP_D_C5
    p = p * r + _EXP_D_C4
    p = p * r + _EXP_D_C3
    p = p * r + _EXP_D_C2
    p = p * r + _EXP_D_C1
    p = p * r + _EXP_D_C0
    ki = np.int64(k)
    return (p * _T_HI[ki & 63]) * as_float(((ki >> 6) + 1023) << 52)


# ------------------------------------------------------------------------------ log
_LOG_DELTA_MAX = 2.0**-30


@numba.jit(**_JIT)
def log_dd(zh, zl):
    """(hi, lo, err): log(zh + zl) for zh in [2**-880, 2**860], with |hi + lo - log z| <= err.

    err is ``inf`` when libm's guess ``log(zh)`` is off by more than 2**-30 (never in practice)
    or z is outside the domain.

    >>> hi, lo, err = log_dd(2.0, 0.0)
    >>> hi, err < 2.0**-90
    (0.6931471805599453, True)
    """
    if not (zh >= 2.0**-880 and zh <= 2.0**860):
        return math.nan, 0.0, math.inf
    y0 = math.log(zh)
    eh, el = exp_dd(-y0, 0.0)
    ph, pl = dd_mul(zh, zl, eh, el)  # z e^{-y0} = 1 + delta
    dh, dl = dd_add_d(ph, pl, -1.0)
    ad = abs(dh)
    if not ad <= _LOG_DELTA_MAX:
        return math.nan, 0.0, math.inf
    # |computed delta - true delta| <= (1 + |delta|)(EXP_REL + DD_REL)(1 + DD_REL) + DD_REL |delta|
    d_err = (1.0 + ad) * (EXP_REL + 3 * DD_REL) + 2 * DD_REL * ad
    sh, sl = dd_mul(dh, dl, dh, dl)  # delta^2
    ch, cl = dd_mul(sh, sl, dh, dl)  # delta^3
    ch, cl = dd_div_d(ch, cl, 3.0)
    sh, sl = sh * 0.5, sl * 0.5
    th, tl = dd_add(dh, dl, -sh, -sl)
    th, tl = dd_add(th, tl, ch, cl)
    # op errors: each of the 5 operations errs by DD_REL of a value <= 2|delta|
    ops = 10 * DD_REL * (ad + ad * ad)
    trunc = ad**4 / (4.0 * (1.0 - ad))
    # log1p is 1/(1 - |delta| - d_err)-Lipschitz near delta
    lip = 1.0 / (1.0 - 2 * _LOG_DELTA_MAX)
    rh, rl = dd_add_d(th, tl, y0)
    err = (d_err * lip + ops + trunc + DD_REL * (abs(rh) + 1.0)) * BOUND_SAFETY
    return rh, rl, err


# ------------------------------------------------------------------------------ tanh
#: Absolute error bound of :func:`tanh_dd`: numerator 1 - E and denominator 1 + E err by
#: EXP_REL E + DD_REL |.| each, the quotient (<= 1, denominator >= 1) by
#: 2 EXP_REL + 3 DD_REL + DD_DIV; rounded up generously.
TANH_ABS = 2.0**-91


@numba.jit(**_JIT)
def tanh_dd(xh, xl):
    """tanh(xh + xl) as a double-double with absolute error <= TANH_ABS.

    >>> tanh_dd(0.0, 0.0)
    (0.0, 0.0)
    """
    a_h, a_l = (xh, xl) if xh >= 0 else (-xh, -xl)
    if a_h > 300.0:  # 1 - tanh a <= 2 e^{-600} < 2**-860
        th, tl = 1.0, 0.0
    else:
        eh, el = exp_dd(-2.0 * a_h, -2.0 * a_l)
        nh, nl = dd_add(1.0, 0.0, -eh, -el)
        dh, dl = dd_add(1.0, 0.0, eh, el)
        th, tl = dd_div(nh, nl, dh, dl)
    if xh < 0:
        return -th, -tl
    return th, tl


# ------------------------------------------------------------------ exp with a 1024-entry table
#: exp_dd_fast keeps the options it was measured and verified with (no error_model: its one
#: integer division is by a nonzero constant)
_JIT_FAST_EXP = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)
_FAST_STEPS = 1024  # table 2**(j/1024): |r| <= ln2/2048 < 3.4e-4
_FAST_SHIFT = 10  # log2(_FAST_STEPS)
assert _FAST_STEPS == 1 << _FAST_SHIFT
_FAST_R_MAX = 3.4e-4


def _fast_constants():
    with mp.workprec(200):
        step = mp.log(2) / _FAST_STEPS
        pieces = []
        rest = step
        for bits in (32, 53, 53):  # k * piece exact for |k| < 2**21
            e = int(mp.floor(mp.log(abs(rest), 2)))
            quantum = mp.mpf(2) ** (e - bits + 1)
            piece = mp.nint(rest / quantum) * quantum
            pieces.append(float(piece))
            rest = rest - piece
        table = np.empty((_FAST_STEPS, 2))
        for j in range(_FAST_STEPS):
            t = mp.mpf(2) ** (mp.mpf(j) / _FAST_STEPS)
            table[j, 0] = float(t)
            table[j, 1] = float(t - table[j, 0])
        return np.array(pieces), float(abs(rest)), table


_FAST_PIECES, _FAST_PIECES_REST, _FAST_TABLE = _fast_constants()
#: 2**e for -1022 <= e <= 2 (the final scaling: in the domain it is a normal power of two, so
#: the product is exact, and a table read is cheaper than ldexp)
_FAST_POW2_MIN = -1022
_FAST_POW2 = np.array([2.0**e for e in range(_FAST_POW2_MIN, 3)])
_FAST_INV_STEP = _FAST_STEPS / math.log(2.0)  # any approximation: it only picks the integer k
#: 1/n! for n <= 3 as double-doubles, and the float64 tail coefficients 1/n!, 4 <= n <= 8
_FAST_COEF = np.array([dd_of_fraction(Fraction(1, math.factorial(n)))[:2] for n in range(4)])
_FAST_TAIL = np.array([float(Fraction(1, math.factorial(n))) for n in range(4, 9)])


def _exp_fast_budget() -> float:
    """Itemised relative error of :func:`exp_dd_fast` (see its docstring)."""
    k_max = 2.0**21
    r_err = k_max * (_FAST_PIECES_REST + abs(_FAST_PIECES[2]) * U) + 3 * DD_REL * _FAST_R_MAX
    trunc = _FAST_R_MAX**9 / math.factorial(9) * 1.01
    # tau = sum_{n=4}^{8} r^(n-4)/n! in float64 (5 roundings, r's low word dropped), times
    # r^4 <= 1.4e-14: relative to exp(r) >= 0.9996
    tail = (8 * U + 2 * U) * (1 / 24) * 1.01 * _FAST_R_MAX**4
    horner = 8 * DD_REL * 1.01  # 4 products and 4 sums; partial values within 0.1% of c_n
    coef = 2.0**-105
    table = 2.0**-105
    final = DD_REL
    return (2 * r_err + trunc + tail + horner + coef + table + final) * 1.01


EXP_FAST_BUDGET = _exp_fast_budget()
#: Relative error bound of :func:`exp_dd_fast` on ``[EXP_MIN_ARG, 1]``.
EXP_FAST_REL = 2.0**-94
assert EXP_FAST_BUDGET < EXP_FAST_REL


@numba.jit(inline="always", **_JIT_FAST_EXP)
def _exp_dd_fast_reduced(xh, xl):
    """The body of :func:`exp_dd_fast` before its power of two, for an ``xh`` in its domain:
    (hi, lo) of ``exp(r) 2**(j/1024)`` and the integers k, j (``x = k ln2/1024 + r``,
    ``j = k mod 1024``). Inlined where it is called (the lane-wise loop of
    :func:`exp_dd_fast_lanes` then vectorises it as before)."""
    k = np.rint(xh * _FAST_INV_STEP)
    rh, rl = two_sum(xh, -k * _FAST_PIECES[0])
    rh, rl = dd_add_d(rh, rl, xl)
    ph, pl = two_prod(k, _FAST_PIECES[1])
    rh, rl = dd_add(rh, rl, -ph, -pl)
    rh, rl = dd_add_d(rh, rl, -k * _FAST_PIECES[2])
    tau = _FAST_TAIL[4]
    for n in range(3, -1, -1):
        tau = tau * rh + _FAST_TAIL[n]
    ah, al = fast_two_sum(_FAST_COEF[3, 0], _FAST_COEF[3, 1] + rh * tau)
    for n in range(2, -1, -1):
        ah, al = dd_mul(ah, al, rh, rl)
        ah, al = dd_add(ah, al, _FAST_COEF[n, 0], _FAST_COEF[n, 1])
    ki = np.int64(k)
    j = ki & (_FAST_STEPS - 1)
    ah, al = dd_mul(ah, al, _FAST_TABLE[j, 0], _FAST_TABLE[j, 1])
    return ah, al, ki, j


@numba.jit(**_JIT_FAST_EXP)
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
    ah, al, ki, j = _exp_dd_fast_reduced(xh, xl)
    # clamped: outside the domain the value is meaningless but no read leaves the table
    scale = _FAST_POW2[
        min(max((ki - j) // _FAST_STEPS - _FAST_POW2_MIN, 0), _FAST_POW2.shape[0] - 1)
    ]
    return ah * scale, al * scale


@numba.jit(**_JIT_FAST_EXP)
def exp_dd_fast_lanes(xh, xl, eh, el):
    """``eh[j], el[j] = exp_dd_fast(xh[j], xl[j])`` for every j: the same operations in the
    same order (the same bits, the bound :data:`EXP_FAST_REL` on ``[EXP_MIN_ARG, 1]``), in a
    loop without branches (the domain test a select, the rounding to an integer ``rint``, the
    power of two read from the table by a shift), which the compiler runs several keys to a
    vector. Outside ``[EXP_MIN_ARG - 1, 2]`` (NaN too) the result is NaN, as there."""
    lo_arg = EXP_MIN_ARG - 1.0
    for j in range(xh.shape[0]):
        x = xh[j]
        inside = (x >= lo_arg) & (x <= 2.0)
        x = min(max(x, lo_arg), 2.0)
        ah, al, ki, t = _exp_dd_fast_reduced(x, xl[j])
        at = min(max(((ki - t) >> _FAST_SHIFT) - _FAST_POW2_MIN, 0), _FAST_POW2.shape[0] - 1)
        scale = _FAST_POW2[at]
        eh[j] = ah * scale if inside else math.nan
        el[j] = al * scale if inside else math.nan
