"""Exact row evaluation: one flat Ziv loop over the rows of a variant's computation.

A row evaluator ``evaluate_row(ops, row) -> list`` runs in the number system ``ops``
(:mod:`refattn.exact.numbers`): on intervals at every working precision of the Ziv loop, and on
exact rationals for the entries the loop cannot decide (a value exactly on a rounding boundary).
"""

from __future__ import annotations

import numpy as np

from .. import _checks
from ..broadcast import reduce_to
from . import intervals as I
from .autodiff import AutodiffOps, vjp
from .numbers import INTERVAL, RATIONAL, NotRational
from .rounding import correctly_round

__all__ = ["exact_rows", "batch_rows", "exact_grads", "exact_vjp_rows", "UNKNOWN"]


def exact_rows(rows, evaluate_row, dtype, what):
    """Correctly round ``evaluate_row(ops, row) -> list`` for every row (one flat Ziv loop).

    Entries of the returned list are numbers of ``ops`` (intervals or Fractions), Python
    ints/floats (exact, NaN allowed) or None (rational mode only: "not rational").
    """

    def evaluate(prec):
        with I.workprec(prec):
            values = [evaluate_row(INTERVAL, row) for row in rows]
        table = np.empty((len(rows), len(values[0]) if values else 0), dtype=object)
        for r, row_values in enumerate(values):
            for c, value in enumerate(row_values):
                table[r, c] = value
        return I.endpoints(table)

    cache = {}

    def fallback(index):
        r, c = index
        if r not in cache:
            try:
                cache[r] = evaluate_row(RATIONAL, rows[r])
            except NotRational:
                cache[r] = None
        row_values = cache[r]
        return None if row_values is None else row_values[c]

    if not rows:
        return np.empty((0, 0), dtype=_checks.out_dtype(dtype))
    return correctly_round(evaluate, dtype, fallback=fallback, what=what)


def batch_rows(batch: tuple, length: int) -> list:
    """The (batch index, row) pairs of a (..., L, .) computation, in C order."""
    return [(b, i) for b in np.ndindex(*batch) for i in range(length)]


class _Unknown:
    """Rational mode: a value known not to be computable as a rational (absorbs + - * /)."""

    def _absorb(self, *_):
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _absorb
    __truediv__ = __rtruediv__ = __neg__ = _absorb

    def __repr__(self):
        return "UNKNOWN"


#: Rational mode: the contribution of a part of the computation that is not rational; a
#: gradient element it reaches is left to the interval loop (:func:`exact_grads`).
UNKNOWN = _Unknown()


def exact_grads(batch, batch_grads, inner_shapes, shapes, dtype, what):
    """Correctly round gradients computed per batch element, in one Ziv loop.

    ``batch_grads(ops, b) -> nested lists``, one per argument of inner shape
    ``inner_shapes[k]`` (the argument's shape without the batch dimensions ``batch``); the
    per-batch gradients are summed exactly to the arguments' ``shapes`` (broadcast batch
    dimensions, :func:`refattn.broadcast.reduce_to`) before the single rounding. Returns one
    array per argument. In rational mode (the loop's fallback for elements on a rounding
    boundary) a batch element that raises :class:`NotRational` contributes :data:`UNKNOWN`
    to all its gradients, and ``batch_grads`` may add :data:`UNKNOWN` to the elements a
    non-rational part reaches; only those elements are left undecided.

    Examples
    --------
    >>> from fractions import Fraction
    >>> def grads(ops, b):  # d(x . y)/dx = y per batch element, x shared over the batch
    ...     return ([Fraction(1, 3), Fraction(2, 3)],)
    >>> exact_grads((2,), grads, [(2,)], [(2,)], "float64", "demo")[0].tolist()
    [0.6666666666666666, 1.3333333333333333]
    """

    def evaluate(ops, _row):
        per_arg = [np.empty(tuple(batch) + tuple(shape), dtype=object) for shape in inner_shapes]
        for b in np.ndindex(*batch):
            try:
                grads_b = batch_grads(ops, b)
            except NotRational:
                if not ops.rational:
                    raise
                grads_b = [np.full(shape, UNKNOWN, dtype=object) for shape in inner_shapes]
            for target, grads in zip(per_arg, grads_b, strict=True):
                inner = target.shape[len(batch) :]
                for index in np.ndindex(*inner):
                    value = grads
                    for k in index:
                        value = value[k]
                    target[b + index] = value
        reduced = [reduce_to(g, shape) for g, shape in zip(per_arg, shapes, strict=True)]
        return [None if x is UNKNOWN else x for g in reduced for x in g.ravel()]

    table = exact_rows([0], evaluate, dtype, what)[0]
    out, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape, dtype=np.int64))
        out.append(table[start : start + size].reshape(shape))
        start += size
    return tuple(out)


def exact_vjp_rows(batch, inputs, run, grad, dtype, what):
    """Correctly rounded gradients of ``sum(grad * outputs)`` by reverse accumulation
    (:mod:`refattn.exact.autodiff`) through a row evaluator.

    Parameters
    ----------
    batch : tuple
        The broadcast batch shape.
    inputs : sequence of (name, array, rank)
        The arguments to differentiate, as passed (before batch broadcasting), and the rank of
        their core (non-batch) part.
    run : callable
        ``run(ops, leaves, b) -> list``: the outputs of batch element ``b`` in the number
        system ``ops`` (an :class:`~refattn.exact.autodiff.AutodiffOps`), where ``leaves``
        maps each name to an object array (core shape) of differentiable inputs.
    grad : array, batch + output core shape
        The cotangents, in the order of ``run``'s outputs.

    Returns
    -------
    tuple of arrays shaped as the ``inputs``: each element the exact gradient rounded once.
    When an input is broadcast along the batch its gradient sums over batch elements, and
    that sum is part of the exact value: all batch elements are then one row of the Ziv loop.
    """
    per_element = all(arr.shape[: arr.ndim - rank] == batch for _, arr, rank in inputs)
    rows = [[b] for b in np.ndindex(*batch)] if per_element else [list(np.ndindex(*batch))]

    def row_grads(ops, group):
        ad = AutodiffOps(ops)
        leaves = [
            ad.variables(ops.array(arr[group[0]] if per_element else arr)) for _, arr, _ in inputs
        ]
        outputs, cotangents = [], []
        for b in group:
            fields = {}
            for (name, arr, rank), leaf in zip(inputs, leaves, strict=True):
                core = arr.shape[arr.ndim - rank :]
                fields[name] = leaf if per_element else np.broadcast_to(leaf, batch + core)[b]
            outputs.extend(run(ad, fields, b))
            cotangents.extend(ops.scalar(g) for g in np.ravel(grad[b]))
        return vjp(outputs, cotangents, [v for leaf in leaves for v in leaf.ravel()])

    table = exact_rows(rows, row_grads, dtype, what)
    out, start = [], 0
    for _, arr, rank in inputs:
        core = arr.shape[arr.ndim - rank :]
        size = int(np.prod(core)) if per_element else arr.size
        part = table[:, start : start + size]
        out.append(part.reshape(batch + core) if per_element else part.reshape(arr.shape))
        start += size
    return tuple(out)
