"""Exact paths of :mod:`refattn.logspace`: log-sum-exp, softmax and log-softmax of the exact
binary inputs, enclosed in intervals per row and rounded once by the Ziv loop.

A compiled double-double first step (:mod:`refattn.exact.fast_logspace`) decides almost every
row; only the rows it leaves undecided run through the interval engine (the referee).

NaN and infinite entries are handled exactly (an included NaN gives NaN, an included +inf gives
+inf for lse and NaN weights, -inf entries weigh 0); a row with no included entry has lse -inf.
"""

from __future__ import annotations

import numpy as np

from .. import config
from . import intervals as I
from .fast_logspace import fast_logsumexp, fast_softmax
from .rounding import correctly_round, format_of

__all__ = ["logsumexp", "softmax", "lse_interval"]


def _exact_rows(x, allowed, fn, out_dtype, what):
    """Run ``fn(row_intervals, row_allowed) -> intervals`` per row under the Ziv loop."""
    rows = x.reshape(int(np.prod(x.shape[:-1])), x.shape[-1])  # -1 is ambiguous for size 0
    masks = allowed.reshape(rows.shape)

    def evaluate(prec):
        with I.workprec(prec):
            results = [fn(I.to_intervals(r), m, r) for r, m in zip(rows, masks, strict=True)]
        return I.endpoints(np.array(results, dtype=object).reshape(rows.shape[0], -1))

    return correctly_round(evaluate, out_dtype, what=what)


def lse_interval(row, allowed, raw):
    """Enclosure of lse over the allowed entries of one row (NaN / +-inf handled exactly)."""
    if not allowed.any():
        return -np.inf
    vals = raw[allowed]
    if np.isnan(vals).any():
        return np.nan
    if np.isposinf(vals).any():
        return np.inf
    finite = allowed & np.isfinite(raw)
    if not finite.any():
        return -np.inf
    top = row[np.flatnonzero(finite)[np.argmax(raw[finite])]]
    total = sum(I.exp(row[j] - top) for j in np.flatnonzero(finite))
    return top + I.log(total)


def _softmax_intervals(row, allowed, raw, log: bool):
    lse = lse_interval(row, allowed, raw)
    empty = -np.inf if log else 0.0
    out = []
    for j in range(len(row)):
        if not allowed[j]:
            out.append(empty)
        elif not isinstance(lse, I.iv.mpf):  # lse is NaN, +inf or -inf
            out.append(np.nan if np.isnan(lse) or np.isposinf(lse) else empty)
        elif np.isneginf(raw[j]):
            out.append(empty)
        else:
            out.append(row[j] - lse if log else I.exp(row[j] - lse))
    return out


def logsumexp(x: np.ndarray, allowed: np.ndarray, dtype) -> np.ndarray:
    """Correctly rounded lse over the last axis of float64 ``x`` restricted to ``allowed``.

    >>> logsumexp(np.array([[0.0, 0.0]]), np.array([[True, True]]), np.float64).tolist()
    [0.6931471805599453]
    """
    def referee(xr, ar):
        return _exact_rows(xr, ar, lambda r, m, raw: [lse_interval(r, m, raw)], dtype,
                           "lse")[:, 0]

    return _fast_then_referee(x, allowed, dtype, fast_logsumexp, referee).reshape(x.shape[:-1])


def softmax(x: np.ndarray, allowed: np.ndarray, dtype, *, log: bool = False) -> np.ndarray:
    """Correctly rounded softmax (``log=True``: log-softmax) over the last axis.

    >>> softmax(np.array([[0.0, 0.0]]), np.array([[True, False]]), np.float64).tolist()
    [[1.0, 0.0]]
    """
    def referee(xr, ar):
        return _exact_rows(xr, ar, lambda r, m, raw: _softmax_intervals(r, m, raw, log), dtype,
                           "log_softmax" if log else "softmax")

    def fast(xr, ar, dt):
        return fast_softmax(xr, ar, dt, log=log)

    return _fast_then_referee(x, allowed, dtype, fast, referee).reshape(x.shape)


def _fast_then_referee(x, allowed, dtype, fast, referee):
    """The fast first step on every row (config.EXACT_ENGINE == "fast"), the referee engine on
    the rows it leaves undecided; results (R, ...) in ``dtype``."""
    rows = x.reshape(int(np.prod(x.shape[:-1])), x.shape[-1])
    masks = np.broadcast_to(allowed, x.shape).reshape(rows.shape)
    if config.EXACT_ENGINE != "fast":
        return referee(rows, masks)
    values, decided = fast(rows, masks, dtype)
    values = values.astype(format_of(dtype).dtype)
    todo = np.flatnonzero(~decided)
    if todo.size:
        values[todo] = referee(rows[todo], masks[todo])
    return values
