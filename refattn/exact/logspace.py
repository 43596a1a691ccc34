"""Exact paths of :mod:`refattn.logspace`: log-sum-exp, softmax and log-softmax of the exact
binary inputs, enclosed per row and rounded once by the Ziv loop.

With the row maximum ``m`` (an input, exact) and the exact differences ``d_j = x_j - m``,
``X = sum_{j != r} exp(d_j)`` over the included entries other than one maximal entry ``r``:

* ``lse = m + log1p(X)``, ``softmax_j = exp(d_j) / (1 + X)``, ``log_softmax_j = d_j -
  log1p(X)`` (Blanchard, Higham & Higham 2021, eqs. (2.3)-(2.4): the shifted, log1p form);
* every quantity is enclosed in *relative* precision (directed rounding on raw mpfs), so a gap
  of 1e9 or scores near the float maximum cost no more than ordinary ones;
* a result a hair from a rounding boundary (``lse = midpoint + exp(-1e9)``) is settled by the
  sign of ``result - boundary`` (:meth:`_Rows.side`), never by raising the precision.

A compiled double-double first step (:mod:`refattn.exact.fast.logspace`) decides almost every
row; only the rows it leaves undecided run through the engine above (the referee).

NaN and infinite entries are handled exactly (an included NaN gives NaN, an included +inf gives
+inf for lse and NaN weights, -inf entries weigh 0); a row with no included entry has lse -inf.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from mpmath.libmp import (
    from_float,
    from_man_exp,
    fzero,
    mpf_add,
    mpf_div,
    mpf_mul,
    mpf_sub,
    round_ceiling,
    round_floor,
)

from .. import config
from . import _fixed as F
from . import fast as _fast
from .rounding import correctly_round, format_of

__all__ = ["logsumexp", "softmax"]

_NAN = float("nan")


class _Rows:
    """Exact data of the rows of one call: the finite included entries, their maximum and the
    exact differences to it (None for a row whose result is NaN / +-inf / empty)."""

    def __init__(self, x: np.ndarray, allowed: np.ndarray):
        self.raw = x.reshape(int(np.prod(x.shape[:-1])), x.shape[-1])  # -1 fails for size 0
        self.allowed = allowed.reshape(self.raw.shape)
        self.rows = [self._row(r, m) for r, m in zip(self.raw, self.allowed, strict=True)]

    @staticmethod
    def _row(raw, allowed):
        """("nan" | "inf" | "empty" | (top, ref, {j: d_j})) for one row."""
        vals = raw[allowed]
        if np.isnan(vals).any():
            return "nan"
        if np.isposinf(vals).any():
            return "inf"
        finite = np.flatnonzero(allowed & np.isfinite(raw))
        if not finite.size:
            return "empty"
        ref = int(finite[np.argmax(raw[finite])])
        top = from_float(float(raw[ref]))
        return top, ref, {int(j): mpf_sub(from_float(float(raw[j])), top) for j in finite}

    @staticmethod
    def tail(row, work: int):
        """Bounds of ``X = sum_{j != ref} exp(d_j)`` at ``work`` bits (relative)."""
        _, ref, diffs = row
        x_lo = x_hi = fzero
        for j, d in diffs.items():
            if j != ref:
                e_lo, e_hi = F.exp_bounds(d, d, work)
                x_lo = mpf_add(x_lo, e_lo, work, round_floor)
                x_hi = mpf_add(x_hi, e_hi, work, round_ceiling)
        return x_lo, x_hi

    def enclose(self, kind: str, prec: int):
        """(lo, hi) object arrays (rows, n) for kind in lse / softmax / log_softmax."""
        work = prec + config.ELEMENTARY_GUARD_BITS
        n = 1 if kind == "lse" else self.raw.shape[1]
        lo = np.empty((len(self.rows), n), dtype=object)
        hi = np.empty_like(lo)
        for r, row in enumerate(self.rows):
            lo[r], hi[r] = self._enclose_row(kind, r, row, work)
        return lo, hi

    def _enclose_row(self, kind, r, row, work):
        allowed, raw = self.allowed[r], self.raw[r]
        empty = 0.0 if kind == "softmax" else -np.inf
        if isinstance(row, str):
            if kind == "lse":
                value = {"nan": _NAN, "inf": np.inf, "empty": -np.inf}[row]
                return [value], [value]
            value = empty if row == "empty" else _NAN
            values = [value if a else empty for a in allowed]
            return values, values
        top, _, diffs = row
        l_lo, l_hi = F.log1p_bounds(*self.tail(row, work), work)
        if kind == "lse":
            return [mpf_add(top, l_lo, work, round_floor)], [
                mpf_add(top, l_hi, work, round_ceiling)
            ]
        one = from_man_exp(1, 0)
        x_lo, x_hi = self.tail(row, work)
        z_lo = mpf_add(one, x_lo, work, round_floor)
        z_hi = mpf_add(one, x_hi, work, round_ceiling)
        lo, hi = [empty] * len(raw), [empty] * len(raw)
        for j, d in diffs.items():
            if kind == "log_softmax":
                lo[j] = mpf_sub(d, l_hi, work, round_floor)
                hi[j] = mpf_sub(d, l_lo, work, round_ceiling)
            else:
                e_lo, e_hi = F.exp_bounds(d, d, work)
                lo[j] = mpf_div(e_lo, z_hi, work, round_floor)
                hi[j] = mpf_div(e_hi, z_lo, work, round_ceiling)
        return lo, hi

    def side(self, kind: str, index: tuple, boundary: Fraction):
        """The sign of ``result - boundary`` (or None), in relative precision:
        ``(m - M) + log1p(X)``, ``(d_j - M) - log1p(X)`` or ``exp(d_j) - M (1 + X)``."""
        r, j = index
        row = self.rows[r]
        if isinstance(row, str) or (kind != "lse" and j not in row[2]):
            return None
        top, _, diffs = row
        m = from_man_exp(boundary.numerator, -(boundary.denominator.bit_length() - 1))
        for work in (64, 256, 1024, 4096):
            x_lo, x_hi = self.tail(row, work)
            if kind == "softmax":
                e_lo, e_hi = F.exp_bounds(diffs[j], diffs[j], work)
                one = from_man_exp(1, 0)
                z_lo = mpf_mul(m, mpf_add(one, x_lo, work, round_floor), work, round_floor)
                z_hi = mpf_mul(m, mpf_add(one, x_hi, work, round_ceiling), work, round_ceiling)
                found = F.sign_of(
                    mpf_sub(e_lo, z_hi, work, round_floor), mpf_sub(e_hi, z_lo, work, round_ceiling)
                )
            else:
                l_lo, l_hi = F.log1p_bounds(x_lo, x_hi, work)
                if kind == "lse":
                    base = mpf_sub(top, m)
                    found = F.sign_of(
                        mpf_add(base, l_lo, work, round_floor),
                        mpf_add(base, l_hi, work, round_ceiling),
                    )
                else:
                    base = mpf_sub(diffs[j], m)
                    found = F.sign_of(
                        mpf_sub(base, l_hi, work, round_floor),
                        mpf_sub(base, l_lo, work, round_ceiling),
                    )
            if found is not None:
                return found
        return None


def _round_rows(x, allowed, kind, dtype):
    """The referee: correctly rounded (rows, n) results of every row of (rows, n) inputs."""
    rows = _Rows(np.asarray(x, dtype=np.float64), np.asarray(allowed, dtype=bool))
    return correctly_round(
        lambda prec: rows.enclose(kind, prec),
        dtype,
        decide=lambda ix, m: rows.side(kind, ix, m),
        what=kind,
    )


def _fast_then_referee(x, allowed, dtype, fast, kind):
    """The fast first step on every row (config.EXACT_ENGINE == "fast"), the referee on the
    rows it leaves undecided; results (R, n) in ``dtype``."""
    rows = x.reshape(int(np.prod(x.shape[:-1])), x.shape[-1])  # -1 fails for size 0
    masks = np.broadcast_to(allowed, x.shape).reshape(rows.shape)
    if config.EXACT_ENGINE != "fast":
        return _round_rows(rows, masks, kind, dtype)
    values, decided = fast(rows, masks, dtype)
    values = values.astype(format_of(dtype).dtype)
    values = values.reshape(len(rows), values.size // max(len(rows), 1))
    todo = np.flatnonzero(~decided)
    if todo.size:
        values[todo] = _round_rows(rows[todo], masks[todo], kind, dtype)
    return values


def logsumexp(x: np.ndarray, allowed: np.ndarray, dtype) -> np.ndarray:
    """Correctly rounded lse over the last axis of float64 ``x`` restricted to ``allowed``.

    >>> logsumexp(np.array([[0.0, 0.0]]), np.array([[True, True]]), np.float64).tolist()
    [0.6931471805599453]
    >>> logsumexp(np.array([[1e10, 0.0]]), np.array([[True, True]]), np.float64).tolist()
    [10000000000.0]
    """
    return _fast_then_referee(x, allowed, dtype, _fast.fast_logsumexp, "lse").reshape(x.shape[:-1])


def softmax(x: np.ndarray, allowed: np.ndarray, dtype, *, log: bool = False) -> np.ndarray:
    """Correctly rounded softmax (``log=True``: log-softmax) over the last axis.

    >>> softmax(np.array([[0.0, 0.0]]), np.array([[True, False]]), np.float64).tolist()
    [[1.0, 0.0]]
    >>> softmax(np.array([[1e10, 0.0]]), np.array([[True, True]]), np.float64, log=True).tolist()
    [[-0.0, -10000000000.0]]
    """
    kind = "log_softmax" if log else "softmax"

    def fast(rows, masks, dt):
        return _fast.fast_softmax(rows, masks, dt, log=log)

    return _fast_then_referee(x, allowed, dtype, fast, kind).reshape(x.shape)
