"""Deep implicit attention (Bal 2021, section 3.4): the fixed point of the fast update eq. (23)
with an optional amortised Onsager correction ``f`` supplied by the caller.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import _checks
from .. import fixedpoint as fp
from ..exact import meanfield as exact
from ._model import (
    MeanFieldResult,
    check_solver_options,
    checked_image,
    deq_problem,
    exact_result,
    spins,
)


def deq_attention(
    x,
    J,
    correction: Callable[[np.ndarray], np.ndarray] | None = None,
    *,
    z0=None,
    diagonal="error",
    tol=fp.DEFAULT_TOL,
    max_iter=fp.DEFAULT_MAX_ITER,
    precision="float64",
    out_dtype=None,
    lipschitz=None,
    **solver_options,
) -> MeanFieldResult:
    """Deep implicit attention: the fixed point of the fast update eq. (23).

    .. math::

        z_i = \\sum_j J_{ij} z_j - f(z)_i + x_i \\qquad \\text{eq. (23), \\texttt{eq:diaupdate}}

    ``f`` is the amortised Onsager self-correction (the source's ``f_theta``, section 3.4; a
    feed-forward layer in the transformer reading of section 4.3). ``f = 0`` gives the naive
    mean-field fixed point ``z = (I - J)^{-1} x``.

    Parameters
    ----------
    x : array_like, float, (B..., N, d)
    J : array_like, float, (B..., N, N, d, d)
    correction : callable or None
        ``f``: maps z of shape (B..., N, d) to an array of the same shape. Should act per
        sample (the solver freezes converged samples). None means ``f = 0``. A result of
        another shape, of non-real dtype, or with NaN/Inf at a finite z raises a
        ValueError/TypeError naming ``correction`` (never broadcast).
    z0 : array_like, optional
        Initial iterate (default zeros), broadcastable to (B..., N, d).
    diagonal : {"error", "zero", "keep"}
        Self-coupling policy. "keep" allows softmax couplings (eq. (24)), where a token
        couples to itself.
    tol, max_iter, **solver_options
        As :func:`adaptive_tap` (the residual is over z).
    precision : {"float64", "exact"}
        "exact" with ``correction=None``: ``(I - J)^{-1} x`` in exact rational arithmetic,
        rounded once (ValueError if ``I - J`` is singular). With a correction: a certified
        enclosure by the contraction-mapping bound, which needs ``lipschitz`` and a
        ``correction`` that also accepts object arrays of ``mpmath.iv.mpf`` intervals and
        returns enclosures; see Notes.
    out_dtype : dtype, optional
    lipschitz : float, optional
        Exact path with a correction: a bound ``L`` on the Lipschitz constant of ``f`` in the
        max-norm over one sample's N d entries (asserted by the caller, not checked).

    Returns
    -------
    MeanFieldResult
        ``means`` = z (B..., N, d); ``cavity_var`` and ``chi_diag`` are None.

    Notes
    -----
    Exact path with a correction: with ``q = ||J||_inf + L < 1`` (``||J||_inf`` the exact
    max-row-sum norm of the (N d, N d) coupling matrix) the map ``T(z) = J z - f(z) + x`` is a
    max-norm contraction, so for any ``z_k``,
    ``||z* - T(z_k)||_inf <= q / (1 - q) ||T(z_k) - z_k||_inf``. ``z_k`` is refined by
    iterating ``T`` at the working precision and ``T(z_k)`` is enclosed in interval
    arithmetic. Certified under two assumptions stated by the caller: ``L`` bounds the
    Lipschitz constant and the interval evaluation of ``f`` encloses ``f``. The refinement
    starts from the float64 fixed point (so that solve must succeed first); an exact zero in
    the result is not decidable by this bound unless ``T(z_k) = z_k`` exactly, and raises
    :class:`refattn.exact.rounding.UndecidedRoundingError` at 4096 bits.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import deq_attention
    >>> J = np.zeros((2, 2, 1, 1)); J[0, 1] = 0.5
    >>> deq_attention(np.array([[1.0], [2.0]]), J).means.ravel().round(12).tolist()
    [2.0, 2.0]
    """
    precision = _checks.precision(precision)
    x, J, batch = deq_problem(x, J, diagonal, correction)
    n, d = x.shape[-2:]
    options = check_solver_options(solver_options)
    if precision == "exact" and correction is None:
        return exact_result(
            batch, exact.deq_linear(x, J, batch, _checks.out_dtype(out_dtype)), None, None
        )
    xb = np.broadcast_to(x, (*batch, n, d))
    Jb = np.broadcast_to(J, (*batch, n, n, d, d))
    start = (
        np.zeros((*batch, n, d))
        if z0 is None
        else np.array(
            _checks.broadcast(spins(z0, "z0"), (*batch, n, d), "z0", "x"), dtype=np.float64
        )
    )

    def update(z):
        coupled = np.einsum("...ijxy,...jy->...ix", Jb, z) + xb
        if correction is None:
            return coupled
        return coupled - checked_image(correction(z), z, "correction")

    res = fp.solve(update, start, tol=tol, max_iter=max_iter, state_ndim=2, **options)
    if precision == "exact":
        lipschitz = _checks.real_scalar(lipschitz, "lipschitz", allow_none=True)
        if lipschitz is None or lipschitz < 0:
            raise ValueError(
                "lipschitz: the exact path with a correction needs a non-negative "
                f"Lipschitz bound of the correction, got {lipschitz!r}"
            )
        z, iterations = exact.deq_contraction(
            res.z, xb, Jb, correction, lipschitz, _checks.out_dtype(out_dtype)
        )
        return exact_result(batch, z, None, None, iterations=np.full(batch, iterations))
    return MeanFieldResult(
        means=res.z,
        cavity_var=None,
        chi_diag=None,
        iterations=res.iterations,
        residuals=res.residuals,
        converged=res.converged,
        precision="float64",
    )
