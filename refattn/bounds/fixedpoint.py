"""A-priori error bound of an iterate of a fixed-point map (:mod:`refattn.fixedpoint`,
:mod:`refattn.meanfield`, the deep-equilibrium attention of
:func:`refattn.meanfield.deq_attention`).
"""

from __future__ import annotations

from .unit import gamma

__all__ = ["fixed_point_forward_bound", "implicit_vjp_bound"]


def fixed_point_forward_bound(residual_norm, inverse_norm, rounding_scale, n, dtype="float64"):
    """Bound on ``||z - z*||`` for an iterate ``z`` of a map ``f`` with fixed point ``z*``.

    For an affine map ``f(z) = A z + b`` the identity ``z - z* = (I - A)^{-1} (z - f(z))`` gives
    ``||z - z*|| <= ||(I - A)^{-1}|| ||f(z) - z||``; for a contraction with Lipschitz constant
    ``q`` the same holds with ``1 / (1 - q)`` in place of ``||(I - A)^{-1}||``. The residual
    is measured with a *computed* ``f``, whose rounding error is at most
    ``gamma_n * rounding_scale`` (``rounding_scale`` the norm of the sum of the absolute values
    of the terms of ``f``, ``n`` the number of roundings per entry), so

    .. math:: \\lVert z - z^* \\rVert \\le \\kappa \\big(\\lVert \\tilde f(z) - z \\rVert
              + \\gamma_n\\, s\\big).

    >>> bool(fixed_point_forward_bound(0.0, 2.0, 1.0, 3) == 2 * gamma(3))
    True
    """
    return float(inverse_norm) * (float(residual_norm) + gamma(n, dtype) * float(rounding_scale))


def implicit_vjp_bound(
    adjoint_residual,
    inverse_norm,
    adjoint_scale,
    n,
    *,
    state_error=0.0,
    sensitivity=0.0,
    dtype="float64",
):
    """Bound on ``||u - u*||`` for the adjoint ``u*`` of an implicit vector-Jacobian product.

    The adjoint solves ``A(z*)^T u* = g`` (``A = I - f'`` for a fixed point ``z* = f(z*)``, or
    the Jacobian of the fixed-point equations; :func:`refattn.meanfield.ising_tap_vjp`,
    :func:`refattn.meanfield.deq_attention_vjp`), and is computed as ``u`` at an approximate
    state ``z`` with ``||z - z*|| <= state_error``. With ``sensitivity`` a bound on the norm
    of ``z -> A(z)^T u`` near ``z*``,

    .. math:: \\lVert u - u^* \\rVert \\le \\lVert A^{-T} \\rVert \\big(\\lVert A(z)^T u - g
              \\rVert + \\gamma_n s + \\text{sensitivity}\\cdot\\text{state\\_error}\\big),

    the first two terms as :func:`fixed_point_forward_bound` (residual measured with a computed
    ``A``, ``s = || |A^T| |u| + |g| ||``); the last is first order in the state error (exact
    when ``A`` does not depend on ``z``, ``sensitivity = 0``).

    >>> bool(implicit_vjp_bound(0.0, 2.0, 1.0, 3) == fixed_point_forward_bound(0.0, 2.0, 1.0, 3))
    True
    """
    return fixed_point_forward_bound(
        adjoint_residual, inverse_norm, adjoint_scale, n, dtype
    ) + float(inverse_norm) * float(sensitivity) * float(state_error)
