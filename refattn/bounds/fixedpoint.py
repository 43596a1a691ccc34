"""A-priori error bound of an iterate of a fixed-point map (:mod:`refattn.fixedpoint`,
:mod:`refattn.meanfield`, the deep-equilibrium attention of
:func:`refattn.meanfield.deq_attention`).
"""

from __future__ import annotations

from .unit import gamma

__all__ = ["fixed_point_forward_bound"]


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

