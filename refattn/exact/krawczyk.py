"""Certified zeros of square nonlinear systems: the Krawczyk test.

A zero of a square system G(u) = 0 near a float64 approximation is certified with the
Krawczyk operator (Krawczyk 1969; Rump 1983): with C ~ G'(u0)^{-1} (float64), a box X
around the refined midpoint u and

.. math:: K(X) = u - C\\,G(u) + (I - C\\,G'(X))\\,(X - u),

K(X) inside the interior of X proves that G has exactly one zero in X, and it lies in K(X).
G'(X) is an interval enclosure of the Jacobian over the whole box. Problems supply
residual(u, ops) and jacobian(u, ops) (a sparse list of (row, column, value)) written with
+ - * / and ops.tanh only, so the same code runs on floats (the preconditioner), mpf (the
chord refinement) and intervals (the test).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mpmath import iv, mp, mpf
from mpmath.libmp import mpf_lt

from . import intervals as I

__all__ = [
    "Arithmetic",
    "FLOAT_OPS",
    "MP_OPS",
    "IV_OPS",
    "Krawczyk",
    "strictly_inside",
    "solve_linear",
]


@dataclass(frozen=True)
class Arithmetic:
    """A number system for problem code: ``num`` makes a constant, ``tanh`` the one
    transcendental function the mean-field problems need."""

    num: Callable
    tanh: Callable


FLOAT_OPS = Arithmetic(float, math.tanh)
MP_OPS = Arithmetic(mpf, mp.tanh)
IV_OPS = Arithmetic(I.point, I.tanh)


def strictly_inside(inner, outer) -> bool:
    """The interval ``inner`` lies in the interior of ``outer``."""
    (a, b), (c, d) = inner._mpi_, outer._mpi_
    return mpf_lt(c, a) and mpf_lt(b, d)


class Krawczyk:
    """Certified enclosure of the zero of ``problem`` near ``u0`` (free unknowns ``free``)."""

    def __init__(self, problem, u0, free, what):
        self.problem, self.free, self.what = problem, list(free), what
        self.rows = self.free  # equation k is paired with unknown k (a square system)
        self.u0, self.u, self.steps = [float(v) for v in u0], None, 0
        jac = np.zeros((len(self.free),) * 2)
        for row, col, value in self._entries(problem.jacobian(self.u0, FLOAT_OPS)):
            jac[row, col] += value
        if not np.isfinite(jac).all() or np.linalg.cond(jac) > 1 / np.finfo(np.float64).eps:
            raise ArithmeticError(
                f"{what}: the fixed point is not isolated (singular Jacobian "
                f"of the fixed-point equations); the exact path cannot "
                f"certify it"
            )
        self.C = np.linalg.inv(jac)

    def _entries(self, entries):
        """Restrict (row, column, value) entries to the free unknowns, renumbered."""
        index = {v: k for k, v in enumerate(self.free)}
        rows = {v: k for k, v in enumerate(self.rows)}
        return [(rows[r], index[c], v) for r, c, v in entries if r in rows and c in index]

    def refine(self, prec):
        """Chord iterations u <- u - C G(u) in mpf arithmetic until the step is below 2**-prec
        (relative), at 32 guard bits so rounding noise stays far below the threshold."""
        with mp.workprec(prec + 32):
            u = [mpf(v) for v in (self.u0 if self.u is None else self.u)]
            C = [[mpf(float(c)) for c in row] for row in self.C]
            threshold = max(1, max(abs(v) for v in u)) * mpf(2) ** (-prec)
            for self.steps in range(1, prec + 1):  # noqa: B007  (the count is reported)
                g = self.problem.residual(u, MP_OPS)
                g = [g[r] for r in self.rows]
                step = [mp.fsum(c * v for c, v in zip(row, g, strict=True)) for row in C]
                for k, var in enumerate(self.free):
                    u[var] -= step[k]
                if max(abs(v) for v in step) <= threshold:
                    break
            self.u = u

    def enclose(self, prec):
        """Krawczyk test at ``prec`` bits; returns the certified box (a list of intervals)."""
        self.refine(prec + 8)
        with I.workprec(prec):
            point = [iv.mpf(v) for v in self.u]
            C = np.array([[I.point(float(c)) for c in row] for row in self.C], dtype=object)
            g = self.problem.residual(point, IV_OPS)
            delta = C.dot(np.array([g[r] for r in self.rows], dtype=object))
            scale = max([1] + [abs(float(v)) for v in self.u])
            radius = 4 * (
                max(abs(float(d.b)) + abs(float(d.a)) for d in delta) + scale * 2.0 ** (8 - prec)
            )
            box = list(point)
            for var in self.free:
                box[var] = point[var] + iv.mpf([-radius, radius])
            contraction = self._identity_minus(C, self.problem.jacobian(box, IV_OPS))
            offsets = np.array([box[v] - point[v] for v in self.free], dtype=object)
            krawczyk = (
                np.array([point[v] for v in self.free], dtype=object)
                - delta
                + contraction.dot(offsets)
            )
            for k, var in enumerate(self.free):
                if not strictly_inside(krawczyk[k], box[var]):
                    raise ArithmeticError(
                        f"{self.what}: Krawczyk certification failed at {prec} bits (unknown "
                        f"{var}); the float64 iterate may not be near an isolated fixed point"
                    )
                box[var] = krawczyk[k]
            return box

    def _identity_minus(self, C, entries):
        """I - C G'(X) from the sparse Jacobian enclosure (O(size * nnz) operations)."""
        size = len(self.free)
        out = np.empty((size, size), dtype=object)
        out[...] = iv.mpf(0)
        for k in range(size):
            out[k, k] = iv.mpf(1)
        for row, col, value in self._entries(entries):
            out[:, col] -= C[:, row] * value
        return out


def solve_linear(A, b, prec, what):
    """Certified enclosure of the solution of ``A w = b`` for every matrix in the interval
    matrix ``A`` (n x n object array) and vector in ``b`` (n intervals), at ``prec`` bits.

    The midpoint solution is refined in mpf arithmetic (iterative refinement with the float64
    inverse ``C`` of mid(A)); the error ``e = w - w~`` then satisfies ``e = C r + (I - C A) e``
    with ``r = b - A w~`` enclosed in intervals, and the Krawczyk inclusion
    ``C r + (I - C A) X`` inside the interior of ``X`` proves that every matrix of ``A`` is
    regular and that the solution lies in ``w~ + C r + (I - C A) X`` (Rump 1983). Raises
    ArithmeticError when the inclusion fails (a singular or badly conditioned system).
    """
    n = len(b)
    mid = [[mp.make_mpf(A[i][j].mid._mpi_[0]) for j in range(n)] for i in range(n)]
    rhs = [mp.make_mpf(v.mid._mpi_[0]) for v in b]
    C = np.linalg.inv(np.array([[float(v) for v in row] for row in mid]))
    if not np.isfinite(C).all():
        raise ArithmeticError(f"{what}: singular adjoint system")
    with mp.workprec(prec + 32):
        Cm = [[mpf(float(c)) for c in row] for row in C]
        w = [mp.fsum(c * v for c, v in zip(row, rhs, strict=True)) for row in Cm]
        for _ in range(prec):
            r = [rhs[i] - mp.fsum(mid[i][j] * w[j] for j in range(n)) for i in range(n)]
            step = [mp.fsum(c * v for c, v in zip(row, r, strict=True)) for row in Cm]
            w = [v + s for v, s in zip(w, step, strict=True)]
            if max(abs(s) for s in step) <= max([1] + [abs(v) for v in w]) * mpf(2) ** -prec:
                break
    with I.workprec(prec):
        point = np.array([iv.mpf(v) for v in w], dtype=object)
        Ci = np.array([[I.point(float(c)) for c in row] for row in C], dtype=object)
        Ai = np.array(A, dtype=object).reshape(n, n)
        residual = np.array(list(b), dtype=object) - Ai.dot(point)
        z = Ci.dot(residual)
        contraction = -Ci.dot(Ai)
        for k in range(n):
            contraction[k, k] += 1
        scale = max([1] + [abs(float(v)) for v in w])
        radius = 4 * (max(abs(float(v.b)) + abs(float(v.a)) for v in z) + scale * 2.0 ** (8 - prec))
        box = np.array([iv.mpf([-radius, radius])] * n, dtype=object)
        inclusion = z + contraction.dot(box)
        for k in range(n):
            if not strictly_inside(inclusion[k], box[k]):
                raise ArithmeticError(
                    f"{what}: the adjoint linear system could not be "
                    f"certified at {prec} bits (unknown {k})"
                )
        return list(point + inclusion)
