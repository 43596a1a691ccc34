"""Exact row evaluation: one flat Ziv loop over the rows of a variant's computation.

A row evaluator ``evaluate_row(ops, row) -> list`` runs in the number system ``ops``
(:mod:`refattn.exact.numbers`): on intervals at every working precision of the Ziv loop, and on
exact rationals for the entries the loop cannot decide (a value exactly on a rounding boundary).
"""

from __future__ import annotations

import numpy as np

from .. import _checks
from . import intervals as I
from .autodiff import AutodiffOps, vjp
from .numbers import INTERVAL, RATIONAL, NotRational
from .rounding import correctly_round

__all__ = ["exact_rows", "batch_rows", "exact_vjp_rows"]


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
    per_element = all(arr.shape[:arr.ndim - rank] == batch for _, arr, rank in inputs)
    rows = [[b] for b in np.ndindex(*batch)] if per_element else [list(np.ndindex(*batch))]

    def row_grads(ops, group):
        ad = AutodiffOps(ops)
        leaves = [ad.variables(ops.array(arr[group[0]] if per_element else arr))
                  for _, arr, _ in inputs]
        outputs, cotangents = [], []
        for b in group:
            fields = {}
            for (name, arr, rank), leaf in zip(inputs, leaves, strict=True):
                core = arr.shape[arr.ndim - rank:]
                fields[name] = leaf if per_element else np.broadcast_to(leaf, batch + core)[b]
            outputs.extend(run(ad, fields, b))
            cotangents.extend(ops.scalar(g) for g in np.ravel(grad[b]))
        return vjp(outputs, cotangents, [v for leaf in leaves for v in leaf.ravel()])

    table = exact_rows(rows, row_grads, dtype, what)
    out, start = [], 0
    for _, arr, rank in inputs:
        core = arr.shape[arr.ndim - rank:]
        size = int(np.prod(core)) if per_element else arr.size
        part = table[:, start:start + size]
        out.append(part.reshape(batch + core) if per_element else part.reshape(arr.shape))
        start += size
    return tuple(out)
