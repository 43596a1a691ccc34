"""Twins of refattn.meanfield (Bal 2021): the naive update in exact Fractions, the fixed
points by mpmath linear algebra and root finding on the equations as printed.

Nothing here imports refattn.
"""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np

from .mp import richardson_gradient

__all__ = [
    "DPS",
    "exact_naive_step",
    "mp_matrix",
    "mp_solve",
    "mp_inverse",
    "mp_ising",
    "richardson_gradient",
    "linear_means_loss",
    "deq_loss",
    "ising_loss",
    "mp_softmax_couplings",
]

#: Decimal digits of the mpmath evaluations.
DPS = 50


def exact_naive_step(m, J, x):
    """``m_i <- sum_j J_ij m_j + x_i`` for one sample, in exact Fractions (nested lists)."""
    n, d = m.shape
    return [
        [
            sum(
                (
                    Fraction(float(J[i, j, a, b])) * Fraction(float(m[j, b]))
                    for j in range(n)
                    for b in range(d)
                ),
                Fraction(float(x[i, a])),
            )
            for a in range(d)
        ]
        for i in range(n)
    ]


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
        return np.array(
            [[inv[i, j] for j in range(inv.cols)] for i in range(inv.rows)], dtype=object
        )


def mp_ising(x, J, m0, V0):
    """TAP fixed point (m, V, chi_ii) by mpmath findroot on the equations as printed."""
    n = len(x)
    with mpmath.workdps(DPS):
        Jm = mpmath.matrix(J.tolist())
        xs = [mpmath.mpf(v) for v in x]  # floats exactly, or mpf (perturbed inputs)

        def equations(*u):
            m, V = u[:n], u[n:]
            lam = mpmath.diag([V[i] + 1 / (1 - m[i] ** 2) for i in range(n)])
            chi = (lam - Jm) ** -1
            return [
                m[i]
                - mpmath.tanh(mpmath.fsum(Jm[i, j] * m[j] for j in range(n)) - V[i] * m[i] + xs[i])
                for i in range(n)
            ] + [chi[i, i] - (1 - m[i] ** 2) for i in range(n)]

        root = mpmath.findroot(
            equations,
            [mpmath.mpf(float(v)) for v in (*m0, *V0)],
            tol=mpmath.mpf(10) ** (-2 * DPS + 10),
        )
        m, V = [root[i] for i in range(n)], [root[n + i] for i in range(n)]
        return (
            np.array(m, dtype=object),
            np.array(V, dtype=object),
            np.array([1 - v**2 for v in m], dtype=object),
        )


# ----------------------------------------------------------------------------- gradients


def _blocks_matrix(J, n, d):
    """(N, N, d, d) nested values -> mpmath (N d, N d) matrix with row (i, a), column (j, b)."""
    return mpmath.matrix(
        [[J[i][j][a][b] for j in range(n) for b in range(d)] for i in range(n) for a in range(d)]
    )


def _split(flat, x_shape, J_shape):
    size = int(np.prod(x_shape))
    x = np.array(flat[:size], dtype=object).reshape(x_shape)
    J = np.array(flat[size:], dtype=object).reshape(J_shape)
    return x, J


def linear_means_loss(x_shape, J_shape, P, g):
    """``theta = (x, J) -> sum g . m`` with ``m = (P - J)^{-1} x`` (one sample; the means of
    the Gaussian adaptive TAP fixed point, Bal 2021 section 3.3, and of deep implicit
    attention with ``f = 0``, eq. (23), for ``P = I``)."""
    n, d = x_shape

    def loss(flat):
        x, J = _split(flat, x_shape, J_shape)
        A = mpmath.matrix(
            [
                [P[i * d + a][j * d + b] for j in range(n) for b in range(d)]
                for i in range(n)
                for a in range(d)
            ]
        ) - _blocks_matrix(J, n, d)
        m = mpmath.lu_solve(A, mpmath.matrix(list(x.ravel())))
        return mpmath.fsum(float(gk) * m[k] for k, gk in enumerate(np.ravel(g)))

    return loss


def deq_loss(x_shape, J_shape, g, correction, z0):
    """``theta = (x, J) -> sum g . z`` with ``z = J z - f(z) + x`` (eq. (23)) solved by
    mpmath findroot from ``z0``; ``correction`` maps one mpf to one mpf (element-wise f)."""
    n, d = x_shape

    def loss(flat):
        x, J = _split(flat, x_shape, J_shape)
        Jm = _blocks_matrix(J, n, d)
        xs = list(x.ravel())

        def equations(*z):
            return [
                z[r] - mpmath.fsum(Jm[r, c] * z[c] for c in range(n * d)) + correction(z[r]) - xs[r]
                for r in range(n * d)
            ]

        z = mpmath.findroot(
            equations,
            [mpmath.mpf(float(v)) for v in np.ravel(z0)],
            tol=mpmath.mpf(10) ** (-2 * DPS + 10),
        )
        return mpmath.fsum(float(gk) * z[k] for k, gk in enumerate(np.ravel(g)))

    return loss


def ising_loss(n, g, m0, V0):
    """``theta = (x, J) -> sum g . m`` for the binary-spin TAP fixed point (:func:`mp_ising`
    from the float start ``(m0, V0)``)."""

    def loss(flat):
        x, J = _split(flat, (n,), (n, n))
        m, _, _ = mp_ising(x, J, m0, V0)
        return mpmath.fsum(float(gk) * mk for gk, mk in zip(g, m, strict=True))

    return loss


def mp_softmax_couplings(x, W_Q, W_K, W_V, allowed):
    """Eq. (24) with an allowed set, one sample: ``J_ij^{ab} = A_ij W_V[b, a]`` over the
    allowed j (0 elsewhere), scale ``1/sqrt(D)``, at DPS digits (object array of mpf)."""
    n, d = x.shape
    with mpmath.workdps(DPS):
        X = mpmath.matrix(x.tolist())
        q, k = X * mpmath.matrix(W_Q.tolist()), X * mpmath.matrix(W_K.tolist())
        scale = 1 / mpmath.sqrt(W_Q.shape[1])
        out = np.empty((n, n, d, d), dtype=object)
        out[...] = mpmath.mpf(0)
        for i in range(n):
            keys = [j for j in range(n) if allowed[i, j]]
            scores = {
                j: scale * mpmath.fsum(q[i, c] * k[j, c] for c in range(q.cols)) for j in keys
            }
            total = mpmath.fsum(mpmath.exp(s) for s in scores.values())
            for j in keys:
                weight = mpmath.exp(scores[j]) / total
                for a in range(d):
                    for b in range(d):
                        out[i, j, a, b] = weight * mpmath.mpf(W_V[b, a])
        return out
