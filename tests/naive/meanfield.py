"""Twins of refattn.meanfield (Bal 2021): the naive update in exact Fractions, the fixed
points by mpmath linear algebra and root finding on the equations as printed.

Nothing here imports refattn.
"""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np

__all__ = ["DPS", "exact_naive_step", "mp_matrix", "mp_solve", "mp_inverse", "mp_ising"]

#: Decimal digits of the mpmath evaluations.
DPS = 50


def exact_naive_step(m, J, x):
    """``m_i <- sum_j J_ij m_j + x_i`` for one sample, in exact Fractions (nested lists)."""
    n, d = m.shape
    return [[sum((Fraction(float(J[i, j, a, b])) * Fraction(float(m[j, b]))
                  for j in range(n) for b in range(d)), Fraction(float(x[i, a])))
             for a in range(d)] for i in range(n)]


def mp_matrix(P, J):
    """P - J at DPS digits, both float matrices taken exactly (no float subtraction)."""
    return mpmath.matrix(P.tolist()) - mpmath.matrix(J.tolist())


def mp_solve(P, J, rhs):
    """Solve (P - J) y = rhs (float arrays taken exactly) at DPS digits."""
    with mpmath.workdps(DPS):
        y = mpmath.lu_solve(mp_matrix(P, J), mpmath.matrix([float(v) for v in rhs]))
        return np.array([y[i] for i in range(len(rhs))], dtype=object)


def mp_inverse(P, J):
    with mpmath.workdps(DPS):
        inv = mp_matrix(P, J) ** -1
        return np.array([[inv[i, j] for j in range(inv.cols)] for i in range(inv.rows)],
                        dtype=object)


def mp_ising(x, J, m0, V0):
    """TAP fixed point (m, V, chi_ii) by mpmath findroot on the equations as printed."""
    n = len(x)
    with mpmath.workdps(DPS):
        Jm = mpmath.matrix(J.tolist())
        xs = [mpmath.mpf(float(v)) for v in x]

        def equations(*u):
            m, V = u[:n], u[n:]
            lam = mpmath.diag([V[i] + 1 / (1 - m[i] ** 2) for i in range(n)])
            chi = (lam - Jm) ** -1
            return ([m[i] - mpmath.tanh(mpmath.fsum(Jm[i, j] * m[j] for j in range(n))
                                        - V[i] * m[i] + xs[i]) for i in range(n)]
                    + [chi[i, i] - (1 - m[i] ** 2) for i in range(n)])

        root = mpmath.findroot(equations, [mpmath.mpf(float(v)) for v in (*m0, *V0)],
                               tol=mpmath.mpf(10) ** (-2 * DPS + 10))
        m, V = [root[i] for i in range(n)], [root[n + i] for i in range(n)]
        return (np.array(m, dtype=object), np.array(V, dtype=object),
                np.array([1 - v ** 2 for v in m], dtype=object))
