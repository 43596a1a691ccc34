"""Forward fixed points of the mean-field model (Bal 2021): the naive update, vector-spin
adaptive TAP with a Gaussian prior (section 3.3) and binary-spin adaptive TAP (section 2.2).
Equation numbers as in :mod:`refattn.meanfield`.
"""

from __future__ import annotations

import numpy as np

from .. import _checks
from .. import fixedpoint as fp
from .._blocks import big, block_diag, diag_blocks
from ..exact import meanfield as exact
from ._model import (
    MeanFieldResult,
    batch_shape,
    check_solver_options,
    couplings,
    exact_result,
    ising_problem,
    spins,
    tap_problem,
)


def naive_step(m, J, x, *, precision="float64", out_dtype=None):
    """One naive mean-field update of vector spins: ``sum_j J_ij m_j + x_i``.

    The coupling and source terms of eq. (23) (``\\label{eq:diaupdate}``) without the Onsager
    correction. With spins ``m = X``, fields ``x = X`` and couplings ``J_ij = A_ij W_V^T``
    (``A`` the softmax matrix of eq. (24)) it is softmax attention plus the residual connection
    (section 4.2, the unnumbered display ``eq:vanilla-attention``).

    .. math::

        m'^{\\alpha}_i = \\sum_j \\sum_\\beta J_{ij}^{\\alpha\\beta} m_j^{\\beta} + x_i^{\\alpha}

    Parameters
    ----------
    m : array_like, float, (B..., N, d)
        Spin means.
    J : array_like, float, (B..., N, N, d, d)
        Coupling blocks; diagonal blocks (self-couplings) are kept.
    x : array_like, float, (B..., N, d)
        External fields (sources).
    precision : {"float64", "exact"}
        "float64": NumPy contraction in float64. "exact": the exact sum rounded once to
        ``out_dtype`` (finite inputs only).
    out_dtype : dtype, optional
        Exact path only: float64 (default), float32, float16 or bfloat16.

    Returns
    -------
    ndarray, (B..., N, d)

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import naive_step
    >>> J = np.zeros((2, 2, 1, 1)); J[0, 1] = 0.5
    >>> naive_step(np.array([[1.0], [2.0]]), J, np.array([[0.0], [1.0]])).ravel().tolist()
    [1.0, 1.0]
    """
    precision = _checks.precision(precision)
    m = spins(m, "m")
    n, d = m.shape[-2:]
    J = couplings(J, n, d)
    x = spins(x, "x")
    if x.shape[-2:] != (n, d):
        raise ValueError(f"x: expected shape (..., N, d) = (..., {n}, {d}) like m, got {x.shape}")
    batch = batch_shape(m=(m, 2), J=(J, 4), x=(x, 2))
    if precision == "float64":
        return np.einsum("...ijxy,...jy->...ix", J, m) + x
    return exact.naive_step(m, J, x, batch, _checks.out_dtype(out_dtype))


# ----------------------------------------------------------------------------- adaptive TAP


def _tap_update(m, V, J, x, P, response):
    """One Jacobi sweep of eqs. (17), (20), (10), (8), (11) (vector spins, Gaussian prior)."""
    n, d = m.shape[-2:]
    cavity = np.einsum("bijxy,bjy->bix", J, m) - np.einsum("bixy,biy->bix", V, m)
    means = np.linalg.solve(P - V, (cavity + x)[..., None])[..., 0]
    lam = P + V if response == "prior" else np.broadcast_to(P, V.shape)
    chi = np.linalg.inv(block_diag(lam) - big(J))
    chi_diag = diag_blocks(chi, n, d)
    return means, lam - np.linalg.inv(chi_diag), chi_diag


def adaptive_tap(
    x,
    J,
    *,
    prior_precision=None,
    response="site",
    diagonal="error",
    tol=fp.DEFAULT_TOL,
    max_iter=fp.DEFAULT_MAX_ITER,
    precision="float64",
    out_dtype=None,
    **solver_options,
) -> MeanFieldResult:
    """Vector-spin adaptive TAP mean field with a Gaussian spin prior (Bal 2021, section 3.3).

    Fixed point of the joint update of spin means ``m_i`` and cavity variances ``V_i``:

    .. math::

        a_i &= \\textstyle\\sum_j J_{ij} m_j - V_i m_i                     && \\text{eq. (17)}\\\\
        m_i &= (\\Sigma^{-1} - V_i)^{-1} (a_i + x_i)                       && \\text{eq. (20)}\\\\
        \\Lambda_i &= V_i + \\big(\\partial m_i / \\partial x_i\\big)^{-1} && \\text{eq. (10)}\\\\
        \\chi &= (\\Lambda - J)^{-1}                                        && \\text{eq. (8)}\\\\
        V_i &\\leftarrow \\Lambda_i - \\chi_{ii}^{-1}                      && \\text{eq. (11)}

    With ``response="site"`` the susceptibility in eq. (10) is the site variance of eq. (21),
    ``(Sigma^-1 - V_i)^-1``, so ``Lambda_i = Sigma^-1``; with ``response="prior"`` it is the
    prior covariance ``Sigma`` (``Lambda_i = V_i + Sigma^-1`` as printed in section 3.3, eq.
    (22)). For both readings the means at the fixed point solve ``(Sigma^-1 - J) m = x``
    (the ``V`` terms of eqs. (17) and (20) cancel), i.e. ``m = (I - J)^{-1} x`` for the
    source's ``Sigma = 1_d``. With ``response="site"``, ``V_i = Sigma^-1 - [chi_ii]^{-1}`` with
    ``chi = (Sigma^-1 - J)^{-1}``: the site variance equals ``chi_ii`` (exact Gaussian marginals
    for symmetric J).

    Parameters
    ----------
    x : array_like, float, (B..., N, d)
        External fields (the input tokens).
    J : array_like, float, (B..., N, N, d, d)
        Couplings; diagonal blocks must be zero (or ``diagonal="zero"``).
    prior_precision : None, float, (d,), (d, d) or (N, d, d)
        ``Sigma^{-1}`` of the Gaussian prior ``N(0, Sigma)`` (None: identity, the source's
        choice); symmetric positive definite, else ValueError.
    response : {"site", "prior"}
        Reading of eq. (10) (see above).
    diagonal : {"error", "zero"}
        Nonzero diagonal coupling blocks raise, or are set to zero.
    tol, max_iter : float, int
        Stopping rule of :func:`refattn.fixedpoint.solve` on the joint state ``(m, V)`` (the
        relative residual is taken over the concatenated ``m`` and ``V`` of each sample).
    precision : {"float64", "exact"}
        "float64": iterate from ``m = 0, V = 0``. "exact", ``response="site"``: the fixed
        point in closed form, ``m = (P - J)^{-1} x``, ``chi_ii = [(P - J)^{-1}]_ii``,
        ``V_i = P_i - chi_ii^{-1}`` (``P = Sigma^{-1}``), computed in exact rational arithmetic
        and rounded once to ``out_dtype``; this is the unique solution of the fixed-point
        equations whenever ``P - J`` and every ``chi_ii`` are invertible (ValueError otherwise),
        whether or not the float64 iteration reaches it. "exact", ``response="prior"``: the
        means are the same closed form and ``chi_ii = Sigma_i`` exactly; the cavity variances
        solve ``P_i [(P + V - J)^{-1}]_ii = I``, a nonlinear system whose zero near the float64
        result is certified by a Krawczyk test in interval arithmetic (unique in a box around
        it; other solutions elsewhere are not excluded), inside the Ziv loop. Limited to
        ``N d <= 12`` (dense test in ``(N d)^2 + N d^2`` unknowns: about 10 s at the limit).
    out_dtype : dtype, optional
        Exact path only.
    **solver_options
        ``method``, ``memory``, ``damping``, ``lam``, ``atol``, ``on_fail`` of
        :func:`refattn.fixedpoint.solve` (default Anderson, ``on_fail="raise"``).

    Returns
    -------
    MeanFieldResult
        ``means`` (B..., N, d), ``cavity_var`` and ``chi_diag`` (B..., N, d, d) (one copy per
        sample; identical across samples when J is shared), ``iterations``, ``residuals``,
        ``converged``.

    Raises
    ------
    refattn.fixedpoint.NotConvergedError
        float64 path, when some sample does not converge (message carries the residual).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import adaptive_tap
    >>> J = np.zeros((2, 2, 1, 1)); J[0, 1] = J[1, 0] = 0.5
    >>> res = adaptive_tap(np.array([[1.0], [1.0]]), J)
    >>> np.round(res.means.ravel(), 8).tolist(), np.round(res.chi_diag.ravel(), 8).tolist()
    ([2.0, 2.0], [1.33333333, 1.33333333])
    """
    precision = _checks.precision(precision)
    x, J, P, batch = tap_problem(x, J, prior_precision, response, diagonal)
    n, d = x.shape[-2:]
    options = check_solver_options(solver_options)
    if precision == "exact" and response == "site":
        return exact_result(
            batch, *exact.adaptive_tap_site(x, J, P, batch, _checks.out_dtype(out_dtype))
        )
    if precision == "exact" and n * d > exact.PRIOR_EXACT_MAX_SIZE:
        raise ValueError(
            f"adaptive_tap: the exact path with response='prior' certifies "
            f"N d <= {exact.PRIOR_EXACT_MAX_SIZE} unknown blocks, got N d = "
            f"{n * d}"
        )
    result = _adaptive_tap_float(x, J, P, batch, response, tol, max_iter, options)
    if precision == "exact":
        *outputs, iterations = exact.adaptive_tap_prior(
            result.cavity_var, x, J, P, batch, _checks.out_dtype(out_dtype)
        )
        return exact_result(batch, *outputs, iterations=iterations)
    return result


def _adaptive_tap_float(x, J, P, batch, response, tol, max_iter, options):
    n, d = x.shape[-2:]
    size = int(np.prod(batch, dtype=int))
    xb = np.broadcast_to(x, (*batch, n, d)).reshape(size, n, d)
    Jb = np.broadcast_to(J, (*batch, n, n, d, d)).reshape(size, n, n, d, d)

    def split(state):
        return state[:, : n * d].reshape(-1, n, d), state[:, n * d :].reshape(-1, n, d, d)

    def update(state):
        m, V = split(state)
        means, V_new, _ = _tap_update(m, V, Jb, xb, P, response)
        return np.concatenate([means.reshape(size, -1), V_new.reshape(size, -1)], axis=1)

    try:
        res = fp.solve(
            update, np.zeros((size, n * d * (1 + d))), tol=tol, max_iter=max_iter, **options
        )
        m, V = split(res.z)
        _, _, chi_diag = _tap_update(m, V, Jb, xb, P, response)
    except np.linalg.LinAlgError as exc:
        raise ValueError(
            f"adaptive_tap: singular matrix during the iteration ({exc}); "
            f"Sigma^-1 - J or Sigma^-1 - V_i is not invertible"
        ) from None
    return MeanFieldResult(
        means=m.reshape(*batch, n, d),
        cavity_var=V.reshape(*batch, n, d, d),
        chi_diag=chi_diag.reshape(*batch, n, d, d),
        iterations=res.iterations.reshape(batch),
        residuals=res.residuals.reshape(*batch, -1),
        converged=res.converged.reshape(batch),
        precision="float64",
    )


# ----------------------------------------------------------------------------- binary spins


def _ising_update(m, V, J, x):
    """One Jacobi sweep of eqs. (14), (10), (8), (11) for binary spins."""
    h = np.einsum("bij,bj->bi", J, m) - V * m + x
    with np.errstate(over="ignore", invalid="ignore"):
        lam = V + np.cosh(h) ** 2  # d<S_i>/dx_i = 1 - tanh(h)^2 = 1 / cosh(h)^2
        chi = np.linalg.inv(np.einsum("ij,bi->bij", np.eye(len(h[0])), lam) - J)
        chi_diag = np.einsum("bii->bi", chi)
        return np.tanh(h), lam - 1 / chi_diag, chi_diag


def ising_tap(
    x,
    J,
    *,
    diagonal="error",
    tol=fp.DEFAULT_TOL,
    max_iter=fp.DEFAULT_MAX_ITER,
    precision="float64",
    out_dtype=None,
    **solver_options,
) -> MeanFieldResult:
    """Adaptive TAP for binary spins ``S = +-1`` (Bal 2021, section 2.2).

    .. math::

        m_i &= \\tanh\\Big(\\textstyle\\sum_j J_{ij} m_j - V_i m_i + x_i\\Big)
            && \\text{eqs. (4), (14)}\\\\
        \\Lambda_i &= V_i + (1 - m_i^2)^{-1} && \\text{eq. (10)}\\\\
        V_i &\\leftarrow \\Lambda_i - [(\\Lambda - J)^{-1}]_{ii} {}^{-1} && \\text{eqs. (8), (11)}

    The site susceptibility ``d m_i / d x_i = 1 - m_i^2`` is evaluated at the new field
    ``h_i`` as ``1 / cosh(h_i)^2`` (no cancellation in ``1 - tanh^2``); means and ``V`` are
    updated together from ``m = 0, V = 0``. At the fixed point ``chi_ii = 1 - m_i^2``.
    Saturated fields (``|h_i|`` above about 355, where ``cosh^2`` overflows) make the sample
    fail (NaN residual, reported as not converged).

    Parameters
    ----------
    x : array_like, float, (B..., N)
    J : array_like, float, (B..., N, N)
        Zero diagonal required (or ``diagonal="zero"``).
    tol, max_iter, **solver_options
        As :func:`adaptive_tap`.
    precision : {"float64", "exact"}
        "exact": a certified enclosure of the exact fixed point (Krawczyk test in interval
        arithmetic around a high-precision chord-Newton refinement of the float64 result,
        inside the Ziv loop), rounded once to ``out_dtype``; see Notes. Sized for small N
        (N = 8 takes about a second).
    out_dtype : dtype, optional

    Returns
    -------
    MeanFieldResult
        ``means``, ``cavity_var``, ``chi_diag`` of shape (B..., N).

    Notes
    -----
    Exact path: the fixed point is the zero of ``G(m, Lambda, Y) = 0`` with ``Y = (Lambda -
    J)^{-1}`` carried as unknowns: ``m_i - tanh(sum_j J_ij m_j - (Lambda_i - 1/(1 - m_i^2)) m_i
    + x_i)``, ``(Lambda - J) Y - I`` and ``Y_ii - (1 - m_i^2)`` (``V_i = Lambda_i - 1/(1 -
    m_i^2)``). The Krawczyk operator proves a unique zero in a box around the float64 solution
    refined by chord-Newton steps in mpmath; the enclosure is certified (no assumption beyond
    correct interval arithmetic). Only the zero inside the box is certified: the TAP equations
    may have other solutions, and the exact path returns the one the float64 iteration reached.
    Exact zeros are proved structurally: ``x = 0`` gives ``m = 0`` exactly (the reduced system
    in ``(Lambda, Y)`` is certified), and a site without couplings has ``V_i = 0`` (and
    ``m_i = 0`` when ``x_i = 0``). Any other exact zero or rounding tie cannot be decided and
    raises :class:`refattn.exact.rounding.UndecidedRoundingError` at 4096 bits.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import ising_tap
    >>> res = ising_tap(np.array([0.5, -0.25]), np.array([[0.0, 0.2], [0.2, 0.0]]))
    >>> bool(res.converged.all()), bool(np.allclose(res.chi_diag, 1 - res.means**2))
    (True, True)
    """
    precision = _checks.precision(precision)
    x, J, batch = ising_problem(x, J, diagonal)
    n = x.shape[-1]
    options = check_solver_options(solver_options)
    size = int(np.prod(batch, dtype=int))
    xb = np.broadcast_to(x, (*batch, n)).reshape(size, n)
    Jb = np.broadcast_to(J, (*batch, n, n)).reshape(size, n, n)

    def update(state):
        means, V_new, _ = _ising_update(state[:, :n], state[:, n:], Jb, xb)
        return np.concatenate([means, V_new], axis=1)

    res = fp.solve(update, np.zeros((size, 2 * n)), tol=tol, max_iter=max_iter, **options)
    m, V = res.z[:, :n], res.z[:, n:]
    if precision == "exact":
        *outputs, iterations = exact.ising_tap(m, V, Jb, xb, batch, _checks.out_dtype(out_dtype))
        return exact_result(batch, *outputs, iterations=iterations)
    _, _, chi_diag = _ising_update(m, V, Jb, xb)
    return MeanFieldResult(
        means=m.reshape(*batch, n),
        cavity_var=V.reshape(*batch, n),
        chi_diag=chi_diag.reshape(*batch, n),
        iterations=res.iterations.reshape(batch),
        residuals=res.residuals.reshape(*batch, -1),
        converged=res.converged.reshape(batch),
        precision="float64",
    )
