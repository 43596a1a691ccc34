"""Vector-Jacobian products of the mean-field fixed points (:mod:`refattn.meanfield`):
implicit differentiation at the fixed point (closed form for adaptive TAP and the linear DEQ,
one adjoint solve for binary spins, the adjoint fixed point for a DEQ with a correction).
"""

from __future__ import annotations

import numpy as np

from .. import _checks
from .. import fixedpoint as fp
from .._blocks import big, block_diag
from ..broadcast import reduce_to
from ..exact import meanfield as exact
from ._deq import deq_attention
from ._model import (
    MeanFieldGrads,
    check_solver_options,
    checked_image,
    cotangent,
    deq_problem,
    flat_batch,
    ising_problem,
    tap_problem,
    zero_self_couplings,
)
from ._tap import ising_tap


def _linear_fixed_point_vjp(x, J, P, g, batch, keep_diagonal):
    """float64 (dx, dJ) of ``m = (P - J)^{-1} x``: ``u = (P - J)^{-T} g``, ``dx = u``,
    ``dJ_ij = u_i m_j^T`` (summed over broadcast batch dimensions)."""
    n, d = x.shape[-2:]
    xb, Jb, gb = flat_batch(batch, (x, (n, d)), (J, (n, n, d, d)), (g, (n, d)))
    A = block_diag(np.broadcast_to(P, (len(xb), n, d, d))) - big(Jb)
    try:
        m = np.linalg.solve(A, xb.reshape(-1, n * d, 1)).reshape(-1, n, d)
        u = np.linalg.solve(np.swapaxes(A, -1, -2), gb.reshape(-1, n * d, 1)).reshape(-1, n, d)
    except np.linalg.LinAlgError:
        raise ValueError(
            "the coupling matrix P - J (Sigma^-1 - J, or I - J) is singular: the "
            "fixed point and its gradient do not exist"
        ) from None
    dJ = np.einsum("bia,bjc->bijac", u, m)
    if not keep_diagonal:
        zero_self_couplings(dJ)
    return MeanFieldGrads(
        reduce_to(u.reshape(*batch, n, d), x.shape),
        reduce_to(dJ.reshape(*batch, n, n, d, d), J.shape),
    )


def adaptive_tap_vjp(
    x,
    J,
    grad_out,
    *,
    prior_precision=None,
    response="site",
    diagonal="error",
    tol=fp.DEFAULT_TOL,
    max_iter=fp.DEFAULT_MAX_ITER,
    precision="float64",
    out_dtype=None,
    **solver_options,
) -> MeanFieldGrads:
    """Vector-Jacobian product of :func:`adaptive_tap`'s means (implicit, closed form).

    At the fixed point of eqs. (17), (20), (10), (8), (11) the means solve
    ``(Sigma^-1 - J) m = x`` for both readings of eq. (10) (see :func:`adaptive_tap`), so
    implicit differentiation of the fixed point has the closed form

    .. math::

        u = (\\Sigma^{-1} - J)^{-T} g, \\qquad dx = u, \\qquad dJ_{ij} = u_i\\, m_j^T

    (``g = grad_out``, the cotangent of the means; ``dJ_ij`` is the d x d block
    ``dJ_ij^{alpha beta} = u_i^alpha m_j^beta``).

    Parameters
    ----------
    x, J, prior_precision, response, diagonal
        As :func:`adaptive_tap`.
    grad_out : array_like, float, (B..., N, d)
        Cotangent of the means (the cavity variances and ``chi_diag`` get none).
    tol, max_iter, **solver_options
        Accepted for symmetry with :func:`adaptive_tap` and validated; the closed form needs
        no iteration.
    precision : {"float64", "exact"}
        "float64": two LAPACK solves per sample. "exact": ``u``, ``m`` and the products in
        exact rational arithmetic, summed over broadcast dimensions, rounded once.
    out_dtype : dtype, optional
        Exact path only.

    Returns
    -------
    MeanFieldGrads
        ``dx`` of x's shape, ``dJ`` of J's shape (gradients of broadcast arguments summed).
        The diagonal blocks of ``dJ`` are zero: ``J_ii`` are not free parameters (they must be
        zero, or are zeroed by ``diagonal="zero"``).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import adaptive_tap_vjp
    >>> J = np.zeros((2, 2, 1, 1)); J[0, 1] = J[1, 0] = 0.5
    >>> grads = adaptive_tap_vjp(np.ones((2, 1)), J, np.array([[1.0], [0.0]]))
    >>> np.round(grads.dx.ravel(), 12).tolist(), np.round(grads.dJ[0, 1].ravel(), 12).tolist()
    ([1.333333333333, 0.666666666667], [2.666666666667])
    """
    precision = _checks.precision(precision)
    x, J, P, batch = tap_problem(x, J, prior_precision, response, diagonal)
    n, d = x.shape[-2:]
    check_solver_options(solver_options)
    g = cotangent(grad_out, (*batch, n, d))
    if precision == "exact":
        return MeanFieldGrads(
            *exact.linear_fixed_point_vjp(x, J, P, g, batch, False, _checks.out_dtype(out_dtype))
        )
    return _linear_fixed_point_vjp(x, J, P, g, batch, keep_diagonal=False)


def _ising_adjoint_float(m, V, J, g):
    """float64 (dx, dJ) per flattened sample from the fixed point (m, V): one dense solve of
    the transposed Jacobian of the reduced equations (see :func:`ising_tap_vjp`)."""
    size, n = m.shape
    eye = np.eye(n)
    c = 1 - m * m
    lam = V + 1 / c
    Y = np.linalg.inv(np.einsum("ij,bi->bij", eye, lam) - J)
    H = np.zeros((size, 2 * n, 2 * n))
    H[:, :n, :n] = eye - c[..., None] * (
        J + np.einsum("ij,bi->bij", eye, (1 + m * m) / (c * c) - lam)
    )
    H[:, :n, n:] = np.einsum("ij,bi->bij", eye, c * m)
    H[:, n:, :n] = np.einsum("ij,bi->bij", eye, 2 * m)
    H[:, n:, n:] = -(Y * np.swapaxes(Y, -1, -2))
    rhs = np.concatenate([g, np.zeros_like(g)], axis=-1)[..., None]
    w = np.linalg.solve(np.swapaxes(H, -1, -2), rhs)[..., 0]
    w1c, w2 = w[:, :n] * c, w[:, n:]
    dJ = np.einsum("bp,bq->bpq", w1c, m) - np.einsum("bip,bi,bqi->bpq", Y, w2, Y)
    return w1c, zero_self_couplings(dJ, scalar=True)


def ising_tap_vjp(
    x,
    J,
    grad_out,
    *,
    diagonal="error",
    tol=fp.DEFAULT_TOL,
    max_iter=fp.DEFAULT_MAX_ITER,
    precision="float64",
    out_dtype=None,
    **solver_options,
) -> MeanFieldGrads:
    """Vector-Jacobian product of :func:`ising_tap`'s means by implicit differentiation.

    The fixed point ``(m, V)`` of eqs. (14), (10), (8), (11) is the zero of the reduced
    equations in ``(m, Lambda)`` (``Lambda_i = V_i + 1/(1 - m_i^2)``, ``Y = (Lambda - J)^{-1}``)

    .. math::

        H_1 = m_i - \\tanh\\big(\\textstyle\\sum_j J_{ij} m_j - V_i m_i + x_i\\big), \\qquad
        H_2 = Y_{ii} - (1 - m_i^2),

    so ``dL/dtheta = -w^T dH/dtheta`` with ``(dH/d(m, Lambda))^T w = (g, 0)``: one adjoint
    linear system of size 2N per sample, never an unrolled iteration. With ``c_i = 1 - m_i^2``
    (the tanh slope at the fixed point),

    .. math::

        dx_i = c_i w_{1,i}, \\qquad
        dJ_{pq} = c_p w_{1,p} m_q - \\textstyle\\sum_i w_{2,i} Y_{ip} Y_{qi} \\quad (p \\ne q).

    Parameters
    ----------
    x, J, diagonal, tol, max_iter, **solver_options
        As :func:`ising_tap` (the forward fixed point is solved first, with its ``on_fail``).
    grad_out : array_like, float, (B..., N)
        Cotangent of the means.
    precision : {"float64", "exact"}
        "float64": the float64 fixed point, then a dense LAPACK solve of the adjoint system.
        "exact": the fixed point enclosed by the Krawczyk test of :func:`ising_tap`'s exact
        path, the adjoint system solved in interval arithmetic over that box
        (:func:`refattn.exact.krawczyk.solve_linear`, which also proves it regular), the
        gradients enclosed and rounded once. A zero field ``x = 0`` gives ``dJ = 0`` exactly;
        other exact zeros of a gradient are not decidable and raise
        :class:`refattn.exact.rounding.UndecidedRoundingError`.
    out_dtype : dtype, optional

    Returns
    -------
    MeanFieldGrads
        ``dx`` (x's shape), ``dJ`` (J's shape, zero diagonal), summed over broadcast
        dimensions.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import ising_tap_vjp
    >>> grads = ising_tap_vjp(np.array([0.5, -0.25]), np.zeros((2, 2)), np.ones(2))
    >>> np.round(grads.dx, 9).tolist()  # uncoupled spins: m = tanh(x), dm/dx = 1 - m^2
    [0.786447733, 0.940014849]
    """
    precision = _checks.precision(precision)
    x, J, batch = ising_problem(x, J, diagonal)
    n = x.shape[-1]
    g = cotangent(grad_out, (*batch, n))
    res = ising_tap(x, J, tol=tol, max_iter=max_iter, **check_solver_options(solver_options))
    m, V = (a.reshape(-1, n) for a in (res.means, res.cavity_var))
    xb, Jb, gb = flat_batch(batch, (x, (n,)), (J, (n, n)), (g, (n,)))
    if precision == "exact":
        return MeanFieldGrads(
            *exact.ising_tap_vjp(
                m, V, Jb, xb, gb, batch, x.shape, J.shape, _checks.out_dtype(out_dtype)
            )
        )
    dx, dJ = _ising_adjoint_float(m, V, Jb, gb)
    return MeanFieldGrads(
        reduce_to(dx.reshape(*batch, n), x.shape), reduce_to(dJ.reshape(*batch, n, n), J.shape)
    )


def deq_attention_vjp(
    x,
    J,
    grad_out,
    *,
    correction=None,
    correction_vjp=None,
    z0=None,
    diagonal="error",
    tol=fp.DEFAULT_TOL,
    max_iter=fp.DEFAULT_MAX_ITER,
    precision="float64",
    out_dtype=None,
    lipschitz=None,
    **solver_options,
) -> MeanFieldGrads:
    """Vector-Jacobian product of :func:`deq_attention` (the implicit backward of eq. (23)).

    At the fixed point ``z* = J z* - f(z*) + x`` implicit differentiation gives the adjoint
    fixed point and the parameter gradients

    .. math::

        u = J^T u - f'(z^*)^T u + g, \\qquad dx = u, \\qquad dJ_{ij} = u_i\\, (z^*_j)^T

    (``g = grad_out``; ``dJ_ij^{alpha beta} = u_i^alpha z_j^beta``), the backward pass of a
    deep equilibrium model: the solver is run a second time on the adjoint, nothing is
    unrolled.

    Parameters
    ----------
    x, J, z0, diagonal, tol, max_iter, lipschitz, **solver_options
        As :func:`deq_attention`; the forward fixed point is solved first (with its
        ``on_fail``), the adjoint with the same solver options.
    grad_out : array_like, float, (B..., N, d)
        Cotangent of the means ``z*``.
    correction : callable or None
        ``f`` of :func:`deq_attention` (keyword here).
    correction_vjp : callable, required with a correction
        ``correction_vjp(z, v) -> v^T f'(z)`` (arrays of the shape of z, per sample; checked
        as ``correction`` is, against the shape of v). On the exact path it must also accept
        object arrays of ``mpmath.iv.mpf`` intervals (z a box) and return enclosures.
    precision : {"float64", "exact"}
        "float64": without a correction, ``u = (I - J)^{-T} g`` by a LAPACK solve; with one,
        :func:`refattn.fixedpoint.solve` on the adjoint map. "exact": without a correction,
        exact rational arithmetic; with one, ``z*`` and ``u`` enclosed by the contraction
        bound of :func:`deq_attention` (``q = ||J||_inf + L < 1`` makes the adjoint map a
        1-norm contraction with the same ``q``), rounded once; certified under the caller's
        two assertions (``L`` bounds the Lipschitz constant of ``f``; the interval
        evaluations of ``f`` and ``correction_vjp`` enclose them).
    out_dtype : dtype, optional

    Returns
    -------
    MeanFieldGrads
        ``dx`` (x's shape), ``dJ`` (J's shape; zero diagonal blocks unless
        ``diagonal="keep"``), summed over broadcast dimensions.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import deq_attention_vjp
    >>> J = np.zeros((2, 2, 1, 1)); J[0, 1] = 0.5
    >>> grads = deq_attention_vjp(np.array([[1.0], [2.0]]), J, np.array([[1.0], [0.0]]))
    >>> grads.dx.ravel().tolist(), grads.dJ[0, 1].ravel().tolist()
    ([1.0, 0.5], [2.0])
    """
    precision = _checks.precision(precision)
    x, J, batch = deq_problem(x, J, diagonal, correction)
    n, d = x.shape[-2:]
    keep = diagonal == "keep"
    if correction is not None and not callable(correction_vjp):
        raise TypeError(
            "correction_vjp: a correction needs its vector-Jacobian product "
            f"correction_vjp(z, v) -> v^T f'(z), got {type(correction_vjp).__name__}"
        )
    g = cotangent(grad_out, (*batch, n, d))
    options = check_solver_options(solver_options)
    if correction is None:
        if precision == "exact":
            return MeanFieldGrads(
                *exact.linear_fixed_point_vjp(
                    x, J, np.eye(d), g, batch, keep, _checks.out_dtype(out_dtype)
                )
            )
        return _linear_fixed_point_vjp(x, J, np.eye(d), g, batch, keep_diagonal=keep)
    z = deq_attention(
        x, J, correction, z0=z0, diagonal="keep", tol=tol, max_iter=max_iter, **options
    ).means
    Jb = np.broadcast_to(J, (*batch, n, n, d, d))

    def adjoint(u):
        image = checked_image(correction_vjp(z, u), u, "correction_vjp", "v")
        return np.einsum("...ijab,...ia->...jb", Jb, u) + g - image

    u = fp.solve(
        adjoint, np.zeros((*batch, n, d)), tol=tol, max_iter=max_iter, state_ndim=2, **options
    ).z
    if precision == "exact":
        lipschitz = _checks.real_scalar(lipschitz, "lipschitz", allow_none=True)
        if lipschitz is None or lipschitz < 0:
            raise ValueError(
                "lipschitz: the exact path with a correction needs a non-negative "
                f"Lipschitz bound of the correction, got {lipschitz!r}"
            )
        return MeanFieldGrads(
            *exact.deq_contraction_vjp(
                z,
                u,
                np.broadcast_to(x, (*batch, n, d)),
                Jb,
                g,
                correction,
                correction_vjp,
                lipschitz,
                keep,
                (x.shape, J.shape),
                _checks.out_dtype(out_dtype),
            )
        )
    dJ = np.einsum("...ia,...jb->...ijab", u, z)
    if not keep:
        zero_self_couplings(dJ)
    return MeanFieldGrads(reduce_to(u, x.shape), reduce_to(dJ, J.shape))
