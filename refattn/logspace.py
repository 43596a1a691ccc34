"""Log-space primitives: logsumexp, softmax, log_softmax (float64 and exact paths).

All three take the max term out of the sum and add it back with ``log1p`` (Blanchard, Higham &
Higham 2021, "Accurately computing the log-sum-exp and softmax functions", eq. (4.1)):

.. math::

    \\operatorname{lse}(x) = m + \\operatorname{log1p}\\Big(\\sum_{j \\ne k} e^{x_j - m}\\Big),
    \\qquad m = x_k = \\max_j x_j .

Excluded entries (``where=False``) are removed from every sum. A slice with no included entry
has lse = -inf, softmax 0 and log_softmax -inf.
"""

from __future__ import annotations

import numpy as np

from . import _checks, _lazy

exact = _lazy.module("refattn.exact.logspace")  # the exact path's (mpmath) on first use

__all__ = [
    "logsumexp",
    "softmax",
    "log_softmax",
    "masked_logsumexp",
    "masked_softmax",
    "LSE_BASES",
    "base_factor",
]

#: The accepted ``lse_base`` values: "e" (natural log, refattn's default) or 2 (FlashInfer's
#: base-2 lse), of :func:`refattn.attention` and :func:`refattn.merge_states`.
LSE_BASES = ("e", 2)
LN2 = float(np.log(2.0))


def base_factor(value) -> float:
    """The factor c with ``natural lse = c * lse`` of an ``lse_base`` argument (1 or ln 2).

    >>> base_factor("e"), round(base_factor(2), 6)
    (1.0, 0.693147)
    """
    if isinstance(value, bool) or value not in LSE_BASES:
        raise ValueError(f"lse_base: expected 'e' (natural log) or 2 (base-2 lse), got {value!r}")
    return 1.0 if value == "e" else LN2


def _prepare(x, axis, where):
    """(x with the reduction axis last, allowed mask); axis=None flattens x (and where)."""
    if axis is None:
        x = _checks.float_array(x, "x")
        if where is not None:
            where = _checks.broadcast(_checks.bool_array(where, "where"), x.shape, "where", "x")
            where = np.reshape(where, -1)
        x, axis = np.reshape(x, -1), 0
    axis = _checks.axis(axis)
    x = _checks.as_float64(_checks.float_array(x, "x", ndim_min=1))
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis: {axis} is out of range for x of shape {x.shape}")
    x = np.moveaxis(x, axis, -1)
    if where is None:
        allowed = np.ones(x.shape, dtype=bool)
    else:
        allowed = np.moveaxis(
            _checks.broadcast(
                _checks.bool_array(where, "where"), np.moveaxis(x, -1, axis).shape, "where", "x"
            ),
            axis,
            -1,
        )
    return x, np.asarray(allowed)


def masked_softmax(x: np.ndarray, allowed: np.ndarray, exponent=None):
    """Row-wise (lse, weights) over the last axis in float64: the float64 path of
    :func:`softmax` and :func:`logsumexp` on a float64 ``x`` and a bool ``allowed`` of its
    shape (no validation).

    ``exponent`` (optional, per row, the shape of ``x[..., :1]``): the row's entries are
    ``x * 2**exponent`` (scores beyond the float64 range kept in a scaled form); the
    differences to the max are unscaled before exponentiation (they overflow to -inf only
    where the weight is 0) and lse is ``2**exponent * max + log1p(rest)`` (+-inf when its
    magnitude exceeds the float64 range).

    With m the row max (over allowed entries) and s = sum_{j != argmax} e^{x_j - m}:
    lse = m + log1p(s) (Blanchard, Higham & Higham 2021, Algorithm 4.1) and the weights are
    e^{x_j - m} / (1 + s) (their Algorithm 5.2 shifts by lse instead; dividing keeps the
    weights' error proportional to |x_j - m| rather than to |lse|). Excluded entries weigh 0;
    rows with a NaN entry give NaN; empty rows give lse -inf and weights 0.

    Examples
    --------
    >>> lse, w = masked_softmax(np.array([[0.0, 0.0, 7.0]]), np.array([[True, True, False]]))
    >>> float(lse[0]), w.tolist()
    (0.6931471805599453, [[0.5, 0.5, 0.0]])
    """
    if x.shape[-1] == 0:  # no entries at all: every row is empty
        return np.full(x.shape[:-1], -np.inf), np.zeros(x.shape)
    masked = np.where(allowed, x, -np.inf)
    top_index = np.argmax(masked, axis=-1)[..., None]
    top = np.take_along_axis(masked, top_index, axis=-1)
    finite_top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = masked - finite_top
        if exponent is not None:
            shifted = np.ldexp(shifted, exponent)
        terms = np.where(allowed, np.exp(shifted), 0.0)
    np.put_along_axis(terms, top_index, 0.0, axis=-1)  # the max term is the "1" of log1p
    rest = terms.sum(axis=-1)
    with np.errstate(over="ignore"):
        top_value = top[..., 0] if exponent is None else np.ldexp(top[..., 0], exponent[..., 0])
    lse = top_value + np.log1p(rest)
    np.put_along_axis(terms, top_index, np.where(np.isfinite(top), 1.0, 0.0), axis=-1)
    with np.errstate(invalid="ignore"):
        weights = terms / (1.0 + rest)[..., None]
    has_nan = (np.isnan(x) & allowed).any(axis=-1) | np.isnan(lse)
    lse = np.where(has_nan, np.nan, lse)
    weights = np.where(has_nan[..., None] & allowed, np.nan, weights)
    posinf = np.isposinf(top[..., 0])
    weights = np.where(posinf[..., None] & allowed, np.nan, weights)
    return lse, weights


def masked_logsumexp(x: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Row-wise lse over the last axis (float64, Blanchard-Higham log1p form), as
    :func:`masked_softmax`.

    >>> masked_logsumexp(np.array([[1.0, 5.0]]), np.array([[True, False]])).tolist()
    [1.0]
    """
    return masked_softmax(x, allowed)[0]


def logsumexp(x, axis=-1, where=None, *, precision="float64", out_dtype=None):
    """Log-sum-exp along ``axis``, restricted to ``where``.

    .. math:: \\operatorname{lse}(x) = \\log \\sum_{j:\\,\\mathrm{where}_j} e^{x_j}

    Parameters
    ----------
    x : array_like, float (float16, bfloat16, float32, float64)
    axis : int or None
        Reduction axis; None reduces over all elements (as NumPy does).
    where : array_like of bool, optional
        Entries to include (broadcastable to x). Excluded entries are removed from the sum.
    precision : {"float64", "exact"}
        "float64": max-shifted log1p form in float64 (relative error a few units of 2**-53
        times the condition number ``sum|x_j| e^{x_j} / (e^{lse} |lse|)``). "exact": the exact
        value rounded once to ``out_dtype``.
    out_dtype : dtype, optional
        Exact path only: float64 (default), float32, float16 or bfloat16.

    Returns
    -------
    ndarray with ``axis`` removed (a 0-d array for ``axis=None``). -inf for slices with no
    included entry (an empty axis included); +inf when an
    included entry is +inf; NaN when an included entry is NaN.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> float(refattn.logsumexp(np.array([0.0, 0.0])))  # log 2
    0.6931471805599453
    >>> float(refattn.logsumexp(np.array([1.0, 5.0]), where=np.array([True, False])))
    1.0
    """
    precision = _checks.precision(precision)
    x2, allowed = _prepare(x, axis, where)
    if precision == "float64":
        _checks.out_dtype(out_dtype)  # validated (the float64 path returns float64)
        return masked_logsumexp(x2, allowed)
    dtype = _checks.out_dtype(out_dtype)
    if x2.size == 0:  # no rows, or empty rows: the empty sum's log is -inf
        return np.full(x2.shape[:-1], -np.inf, dtype=dtype)
    return exact.logsumexp(x2, allowed, dtype)


def _softmax(x, axis, where, precision, out_dtype, log: bool):
    precision = _checks.precision(precision)
    x = _checks.float_array(x, "x")
    shape = x.shape
    x2, allowed = _prepare(x, axis, where)
    axis = -1 if axis is None else axis
    if x2.size == 0:  # softmax of nothing is nothing
        dtype = np.float64 if precision == "float64" else _checks.out_dtype(out_dtype)
        return np.moveaxis(np.zeros(x2.shape, dtype=dtype), -1, axis).reshape(shape)
    if precision == "float64":
        _checks.out_dtype(out_dtype)
        lse, weights = masked_softmax(x2, allowed)
        if log:
            finite = np.where(np.isfinite(lse), lse, 0.0)[..., None]
            with np.errstate(invalid="ignore"):
                result = np.where(allowed, x2 - finite, -np.inf)
                result = np.where((np.isnan(lse) | np.isposinf(lse))[..., None], np.nan, result)
        else:
            result = weights
    else:
        result = exact.softmax(x2, allowed, _checks.out_dtype(out_dtype), log=log)
    return np.moveaxis(result, -1, axis).reshape(shape)


def softmax(x, axis=-1, where=None, *, precision="float64", out_dtype=None):
    """Softmax along ``axis`` over the entries in ``where``: ``exp(x_j - lse(x))``.

    Parameters and paths as :func:`logsumexp`. Excluded entries and slices with no included
    entry give 0. The float64 path computes ``e^{x_j - m} / (1 + s)`` with m the max and
    ``s = sum_{k != argmax} e^{x_k - m}`` (the denominator of the log1p-form lse, Blanchard,
    Higham & Higham 2021); the relative error per entry is at most
    ``gamma_{n+3} + u (|x_j - m| + sum_k p_k |x_k - m|)`` to first order (u = 2**-53,
    n entries), free of the ``u |lse|`` that shifting by lse would add.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> refattn.softmax(np.array([0.0, 0.0, 1000.0])).tolist()
    [0.0, 0.0, 1.0]
    """
    return _softmax(x, axis, where, precision, out_dtype, log=False)


def log_softmax(x, axis=-1, where=None, *, precision="float64", out_dtype=None):
    """Log-softmax along ``axis``: ``x_j - lse(x)``; excluded entries give -inf.

    Parameters and paths as :func:`logsumexp`.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> refattn.log_softmax(np.array([0.0, 0.0])).tolist()
    [-0.6931471805599453, -0.6931471805599453]
    """
    return _softmax(x, axis, where, precision, out_dtype, log=True)
