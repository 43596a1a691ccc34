"""Interval arithmetic for the exact path (mpmath ``iv`` context, gmpy2 backend).

Exact-path evaluators compute rigorous enclosures at a working precision and hand them to
:func:`refattn.exact.rounding.correctly_round`. This module is the shared toolkit:

* :func:`to_intervals` takes a float array of any dtype (float16, bfloat16, float32, float64)
  at its exact binary value as an object array of point intervals;
* elementwise enclosures of the elementary functions the mechanisms need (``exp``, ``log``,
  ``log1p``, ``sqrt``, ``tanh``, ``erf``, ``expm1``), each evaluated with directed rounding
  and widened outward by two units in the last place, so an enclosure stays rigorous even if
  a library function misses its last bit;
* :func:`endpoints`, the (lo, hi) exact endpoint arrays the Ziv loop rounds.

Working precision is always set with :func:`workprec` (a context manager); the global
precision of mpmath is never left changed.

Object arrays of ``iv.mpf`` support ``+ - * /`` and ``@`` through NumPy's object dtype.
"""

from __future__ import annotations

import contextlib
from fractions import Fraction

import numpy as np
from mpmath import iv, mp, mpf
from mpmath.libmp import (
    from_man_exp,
    mpf_add,
    mpf_erf,
    mpf_exp,
    mpf_log,
    mpf_sqrt,
    mpf_sub,
    mpf_tanh,
    round_ceiling,
    round_floor,
)

from .. import config

__all__ = [
    "workprec",
    "to_intervals",
    "interval",
    "endpoints",
    "exp",
    "expm1",
    "log",
    "log1p",
    "sqrt",
    "tanh",
    "erf",
    "point",
]


@contextlib.contextmanager
def workprec(prec: int):
    """Context manager: interval arithmetic at ``prec`` bits (the old precision is restored)."""
    saved = iv.prec
    iv.prec = prec
    try:
        yield
    finally:
        iv.prec = saved


def point(x) -> iv.mpf:
    """A point interval holding the exact value of a float / int / Fraction / mpf."""
    if isinstance(x, Fraction):
        return iv.mpf(x.numerator) / iv.mpf(x.denominator)
    if isinstance(x, float | np.floating):
        with mp.workprec(64):
            return iv.mpf(mpf(float(x)))  # every supported dtype embeds exactly in float64
    return iv.mpf(x)


def to_intervals(array) -> np.ndarray:
    """Object array of point intervals at the exact binary values of a float array."""
    array = np.asarray(array)
    if array.dtype.kind in "biu":
        flat = [iv.mpf(int(x)) for x in array.ravel()]
    else:
        flat = [point(float(x)) for x in array.astype(np.float64).ravel()]
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(array.shape)


def interval(lo, hi) -> iv.mpf:
    """The interval [lo, hi] from two exact values."""
    return iv.make_mpf((point(lo)._mpi_[0], point(hi)._mpi_[1]))


def endpoints(array) -> tuple[np.ndarray, np.ndarray]:
    """Exact endpoint arrays (lo, hi) of an object array of intervals (NaN for non-intervals)."""
    array = np.asarray(array, dtype=object)
    lo = np.empty(array.shape, dtype=object)
    hi = np.empty(array.shape, dtype=object)
    for index, x in np.ndenumerate(array):
        if isinstance(x, iv.mpf):
            lo[index], hi[index] = x._mpi_
        else:
            lo[index] = hi[index] = x
    return lo, hi


def _widened(raw, prec: int, down: bool):
    """Move a raw mpf two units in the last place (at ``prec`` bits) outward."""
    _, man, exp, bc = raw
    if man == 0:
        return raw
    ulp2 = from_man_exp(1, exp + bc - prec + 1)
    return (mpf_sub if down else mpf_add)(raw, ulp2, prec, round_floor if down else round_ceiling)


def _monotone(fn, x, increasing: bool = True) -> iv.mpf:
    """Enclosure of a monotone function over an interval from its endpoints."""
    x = x if isinstance(x, iv.mpf) else point(x)
    prec = iv.prec + config.ELEMENTARY_GUARD_BITS
    a, b = x._mpi_
    lo_arg, hi_arg = (a, b) if increasing else (b, a)
    lo = _widened(fn(lo_arg, prec, round_floor), prec, down=True)
    hi = _widened(fn(hi_arg, prec, round_ceiling), prec, down=False)
    return iv.make_mpf((lo, hi))


def _monotone_mp(fn, x) -> iv.mpf:
    """Like :func:`_monotone` for an increasing mpmath function without a directed-rounding
    primitive: evaluated at 8 extra bits, widened by two ulp of 4 bits fewer."""
    prec = iv.prec + config.ELEMENTARY_GUARD_BITS
    a, b = x._mpi_
    with mp.workprec(prec):
        lo, hi = fn(mpf(a))._mpf_, fn(mpf(b))._mpf_
    return iv.make_mpf((_widened(lo, prec - 4, True), _widened(hi, prec - 4, False)))


def _elementwise(scalar_fn):
    def apply(x):
        if isinstance(x, np.ndarray):
            out = np.empty(x.shape, dtype=object)
            for index, value in np.ndenumerate(x):
                out[index] = scalar_fn(value)
            return out
        return scalar_fn(x)

    apply.__doc__ = scalar_fn.__doc__
    apply.__name__ = scalar_fn.__name__
    return apply


@_elementwise
def exp(x):
    """Enclosure of exp over an interval (elementwise on object arrays)."""
    return _monotone(mpf_exp, x)


@_elementwise
def expm1(x):
    """Enclosure of exp(x) - 1, accurate near 0 (elementwise)."""
    x = x if isinstance(x, iv.mpf) else point(x)
    return _monotone_mp(mp.expm1, x)


@_elementwise
def log(x):
    """Enclosure of the natural log over a positive interval (elementwise)."""
    return _monotone(mpf_log, x)


@_elementwise
def log1p(x):
    """Enclosure of log(1 + x), accurate near 0 (elementwise)."""
    x = x if isinstance(x, iv.mpf) else point(x)
    return _monotone_mp(mp.log1p, x)


@_elementwise
def sqrt(x):
    """Enclosure of the square root over a non-negative interval (elementwise)."""
    return _monotone(mpf_sqrt, x)


@_elementwise
def tanh(x):
    """Enclosure of tanh over an interval (elementwise)."""
    return _monotone(mpf_tanh, x)


@_elementwise
def erf(x):
    """Enclosure of the error function over an interval (elementwise)."""
    return _monotone(mpf_erf, x)
