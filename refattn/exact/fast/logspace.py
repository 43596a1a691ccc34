"""Fast first step of the exact log-sum-exp, softmax and log-softmax (rows of float64 values).

Per row with allowed entries ``x_j`` (the same double-double machinery as
:mod:`refattn.exact.fast.forward`, Blanchard, Higham & Higham 2021, eq. (4.1)):

* ``m = max_j x_j``; ``x_j - m`` is exact as a double-double (TwoSum), so the only errors are
  those of ``e_j = exp_dd_fast(x_j - m)`` (relative ``EXP_FAST_REL``; arguments below ``CUT``
  enter as ``0 <= e < TINY``), of the compensated sum ``Z = sum_j e_j`` (``dot_bound(2n) Z``) and of
  ``log_dd(Z)`` (its returned bound, plus ``-log(1 - rZ/Z)`` for Z's radius rZ);
* ``lse = m + log Z``; ``log_softmax_j = (x_j - m) - log Z``; ``softmax_j =
  exp_dd_fast((x_j - m) - log Z)`` with relative radius ``EXP_FAST_REL + 2 err(argument)``.

The enclosures are rounded by :func:`refattn.exact.rounding.decide_dd` (compiled); rows with an
element it cannot decide, with non-finite allowed entries, entries beyond ``2**1000`` in magnitude,
or no allowed entry are returned as undecided for the referee (:mod:`refattn.exact.logspace`).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..rounding import format_of
from . import doubledouble as D
from ._params import frozen
from .doubledouble import EXP_FAST_REL, exp_dd_fast
from .forward import rounds_to_zero
from .forward_kernels import CUT, TINY, WEIGHT_TINY_ARG, WEIGHT_ZERO_ARG
from .rounding_decision import decide_dd_fast

__all__ = ["fast_logsumexp", "fast_softmax"]

_BIG = 2.0**1000
_RHO_MAX = 2.0**-20


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def _lse_rows(x, allowed, sum_rel, top_out, lz, lse, ok):
    """Row shift m, log Z and lse (each as hi, lo, radius in lz[:, k], lse[:, k])."""
    rows, n = x.shape
    for r in prange(rows):
        top = -np.inf
        good = True
        for j in range(n):
            if allowed[r, j]:
                value = x[r, j]
                if not abs(value) <= _BIG:  # NaN, inf or huge: the referee
                    good = False
                top = max(top, value)
        if not good or top == -np.inf:
            continue
        zs = 0.0
        zc = 0.0
        tiny = 0.0
        for j in range(n):
            if allowed[r, j]:
                xh, xl = D.two_sum(x[r, j], -top)
                if xh < CUT:
                    tiny += TINY
                    continue
                eh, el = exp_dd_fast(xh, xl)
                t = zs + eh
                bb = t - zs
                zc += ((zs - (t - bb)) + (eh - bb)) + el
                zs = t
        zh, zl = D.two_sum(zs, zc)
        zr = ((sum_rel + EXP_FAST_REL) * zh + tiny) * D.BOUND_SAFETY
        if not zr < 0.5 * zh:
            continue
        lh, ll, lerr = D.log_dd(zh, zl)
        lerr = (lerr + (zr / zh) / (1.0 - zr / zh)) * D.BOUND_SAFETY
        gh, gl = D.dd_add_d(lh, ll, top)
        top_out[r] = top
        lz[r, 0], lz[r, 1], lz[r, 2] = lh, ll, lerr
        lse[r, 0], lse[r, 1], lse[r, 2] = gh, gl, (lerr + D.DD_REL * abs(gh)) * D.BOUND_SAFETY
        ok[r] = True


@numba.jit(nopython=True, cache=True, fastmath=False, error_model="numpy", parallel=True)
def _softmax_rows(x, allowed, top, lz, ok, log, w_h, w_l, w_r, tiny):
    """softmax (or log-softmax) enclosures of the rows marked ok."""
    rows, n = x.shape
    for r in prange(rows):
        if not ok[r]:
            continue
        for j in range(n):
            if not allowed[r, j]:
                continue
            xh, xl = D.two_sum(x[r, j], -top[r])
            ah, al = D.dd_add(xh, xl, -lz[r, 0], -lz[r, 1])
            ae = (lz[r, 2] + D.DD_REL * abs(ah)) * D.BOUND_SAFETY
            if log:
                w_h[r, j], w_l[r, j], w_r[r, j] = ah, al, ae
            elif ah + ae < WEIGHT_TINY_ARG:
                tiny[r, j] = 2 if ah + ae < WEIGHT_ZERO_ARG else 1
            elif ah < D.EXP_MIN_ARG + 1.0 or ae > _RHO_MAX:
                w_r[r, j] = np.inf
            else:
                eh, el = exp_dd_fast(ah, al)
                w_h[r, j], w_l[r, j] = eh, el
                w_r[r, j] = (EXP_FAST_REL + 2.0 * ae) * (1.0 + _RHO_MAX) * eh * D.BOUND_SAFETY


def _first_step(x, allowed):
    rows, n = x.shape
    top = np.zeros(rows)
    lz = np.zeros((rows, 3))
    lse = np.zeros((rows, 3))
    ok = np.zeros(rows, dtype=bool)
    if rows and n:
        _lse_rows(x, allowed, D.dot_bound(2 * n), top, lz, lse, ok)
    return top, lz, lse, ok


def fast_logsumexp(x: np.ndarray, allowed: np.ndarray, dtype):
    """(values, decided) for the rows (R, n) of float64 ``x``: the correctly rounded lse where
    ``decided`` (R,) is True.

    Examples
    --------
    >>> values, decided = fast_logsumexp(np.zeros((1, 2)), np.ones((1, 2), bool), np.float64)
    >>> values.tolist(), decided.tolist()
    ([0.6931471805599453], [True])
    """
    fmt = format_of(dtype)
    x = frozen(x, np.float64)
    allowed = frozen(allowed, bool)
    _, _, lse, ok = _first_step(x, allowed)
    values, decided = decide_dd_fast(lse[:, 0], lse[:, 1], lse[:, 2], fmt)
    return values, decided & ok


def fast_softmax(x: np.ndarray, allowed: np.ndarray, dtype, *, log: bool = False):
    """(values (R, n), decided (R,)) for softmax (``log=True``: log-softmax) of the rows of
    float64 ``x``; excluded entries are 0 (log: -inf).

    Examples
    --------
    >>> values, decided = fast_softmax(np.zeros((1, 2)), np.ones((1, 2), bool), np.float64)
    >>> values.tolist(), decided.tolist()
    ([[0.5, 0.5]], [True])
    """
    fmt = format_of(dtype)
    x = frozen(x, np.float64)
    allowed = frozen(allowed, bool)
    top, lz, _, ok = _first_step(x, allowed)
    w = [np.zeros(x.shape) for _ in range(3)]
    tiny = np.zeros(x.shape, dtype=np.int8)
    if x.size:
        _softmax_rows(x, allowed, top, lz, ok, log, *w, tiny)
    values, decided = decide_dd_fast(*w, fmt)
    zero = rounds_to_zero(tiny, fmt)
    decided |= zero
    values = np.where(zero, 0.0, values)
    decided |= ~allowed
    values = np.where(allowed, values, -np.inf if log else 0.0)
    return values, decided.all(axis=1) & ok
