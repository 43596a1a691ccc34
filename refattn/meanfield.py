"""Mean-field attention of Bal (2021), "Deep Implicit Attention: A Mean-Field Theory Perspective
on Attention Mechanisms" (source document ``002``).

Equation numbers
----------------
The source numbers no equation in its text; refattn numbers its displayed equations in order of
appearance, (1)-(25), one number per line of an ``align`` and none for the ``\\nonumber`` display
of section 4.2 (the numbering MathJax gives the post). The LaTeX label is quoted where the source
has one. The ones used here:

====  ============================  ==================================================
(4)   ``eq:cavitymean``             a_i = sum_j J_ij m_j - V_i m_i (binary spins)
(8)   ``eq:chiijlinresp``           chi = (Lambda - J)^-1
(9)   (unlabelled)                  Lambda = diag(Lambda_1, ..., Lambda_N)
(10)  (unlabelled)                  Lambda_i = V_i + (d<S_i>/dx_i)^-1
(11)  ``eq:viselfcons``             1 / (Lambda_i - V_i) = [(Lambda - J)^-1]_ii
(14)  (unlabelled)                  <S_i> = tanh(sum_j J_ij <S_j> - V_i <S_i> + x_i)
(17)  ``eq:veccavmeans``            a_i = sum_j J_ij <S_j> - V_i <S_i> (vector spins)
(20)  (unlabelled)                  <S_i> = (Sigma^-1 - V_i)^-1 (a_i + X_i)
(21)  (unlabelled)                  <S_i^2> - <S_i>^2 = (Sigma^-1 - V_i)^-1
(22)  (unlabelled)                  (1 - Sigma_i J_ik + Sigma_i V_i delta_ik) chi_kj = Sigma_i
(23)  ``eq:diaupdate``              <S_i> = sum_j J_ij <S_j> - f(<S_i>) + X_i
(24)  ``eq:softmaxcouplings``       J_ij = softmax(X W_Q W_K^T X^T / sqrt(d))_ij
====  ============================  ==================================================

Shapes (docs/conventions.md): N spins (sites), d spin dimension, B... batch. Vector spins
``m`` (B..., N, d); couplings ``J`` (B..., N, N, d, d) with ``J[i, j]`` the d x d block
``J_ij^{alpha beta}`` acting on the column vector ``m_j``; fields ``x`` (B..., N, d).

Pinned readings (each also stated where it is used)
---------------------------------------------------
* ``prior_precision`` is ``Sigma^{-1}``, the precision of the zero-mean Gaussian spin prior
  ``N(0, Sigma)`` of section 3.3 (the source picks ``Sigma = 1_d``, the default here).
* ``Lambda_i`` (eq. (10)) uses the *site* susceptibility ``d<S_i>/dX_i = (Sigma^{-1} - V_i)^{-1}``
  of eq. (21), which gives ``Lambda_i = Sigma^{-1}`` (``response="site"``, default). Section 3.3
  also prints ``Lambda_i = V_i + Sigma^{-1}`` (equivalently eq. (22)), which takes the prior
  covariance ``Sigma`` as the susceptibility; ``response="prior"`` implements that reading.
* The cavity variances are updated by eq. (11) solved for ``V_i`` with ``Lambda`` evaluated at
  the current ``V``: ``V_i <- Lambda_i - [chi_ii]^{-1}``; means and variances are updated
  together (Jacobi order) and the pair ``(m, V)`` is one fixed-point state.
* The cavity derivation assumes no self-coupling (section 3.1: "enforcing the couplings'
  block-diagonal to be zero"): ``adaptive_tap``, ``ising_tap`` and ``deq_attention`` reject
  nonzero diagonal blocks unless ``diagonal="zero"`` (zero them) or, for ``deq_attention``,
  ``diagonal="keep"``. ``naive_step`` keeps them: softmax couplings (eq. (24)) let a token
  attend to itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import _checks
from . import fixedpoint as fp
from ._blocks import big, block_diag, diag_blocks
from .broadcast import reduce_to
from .exact import meanfield as exact

__all__ = [
    "MeanFieldResult",
    "naive_step",
    "adaptive_tap",
    "ising_tap",
    "deq_attention",
    "MeanFieldGrads",
    "adaptive_tap_vjp",
    "ising_tap_vjp",
    "deq_attention_vjp",
    "softmax_couplings",
    "SoftmaxCouplingsGrads",
    "softmax_couplings_vjp",
]


@dataclass(frozen=True)
class MeanFieldResult:
    """Fixed point of a mean-field iteration.

    Attributes
    ----------
    means : ndarray, (B..., N, d) or (B..., N) for binary spins
        Spin means ``<S_i>`` (the attention output).
    cavity_var : ndarray or None, (B..., N, d, d) or (B..., N)
        Cavity variances ``V_i`` (None for :func:`deq_attention`).
    chi_diag : ndarray or None, (B..., N, d, d) or (B..., N)
        Diagonal blocks ``chi_ii`` of the linear-response susceptibility ``(Lambda - J)^{-1}``
        at the returned ``V`` (eq. (8)); None for :func:`deq_attention`.
    iterations : ndarray of int, (B...)
        float64: updates applied per sample. exact: iterations of the high-precision solve
        that was certified (0 where the fixed point is computed in closed form).
    residuals : ndarray, (B..., K + 1)
        float64: relative residual trace (see :func:`refattn.fixedpoint.solve`). exact: an
        empty trace of shape (B..., 0).
    converged : ndarray of bool, (B...)
        float64: the stopping criterion was met. exact: always True (a certification failure
        raises instead).
    precision : str
        "float64" or "exact".
    """

    means: np.ndarray
    cavity_var: np.ndarray | None
    chi_diag: np.ndarray | None
    iterations: np.ndarray
    residuals: np.ndarray
    converged: np.ndarray
    precision: str


# ----------------------------------------------------------------------------- validation


def _spins(m, name):
    return _checks.as_float64(_checks.float_array(m, name, ndim_min=2))


def _couplings(J, n, d, name="J"):
    J = _checks.as_float64(_checks.float_array(J, name, ndim_min=4))
    if J.shape[-4:] != (n, n, d, d):
        raise ValueError(
            f"{name}: expected shape (..., N, N, d, d) = (..., {n}, {n}, {d}, {d}) to match the "
            f"spins (N={n}, d={d}), got shape {J.shape}"
        )
    return J


def _batch(*pairs):
    """Broadcast batch shape of (array, core_ndim) pairs, or a ValueError naming the shapes."""
    try:
        return np.broadcast_shapes(*(a.shape[: a.ndim - k] for a, k in pairs))
    except ValueError:
        shapes = ", ".join(str(a.shape) for a, _ in pairs)
        raise ValueError(
            f"batch dimensions of the inputs do not broadcast: shapes {shapes}"
        ) from None


def _diagonal(J, policy, allowed, scalar=False):
    """Apply the self-coupling policy: ``error`` on nonzero diagonal blocks, or ``zero`` them."""
    _checks.choice(policy, "diagonal", allowed)
    if policy == "keep":
        return J
    diag = np.einsum("...ii->...i", J) if scalar else np.einsum("...iixy->...ixy", J)
    if policy == "zero":
        J = J.copy()
        if scalar:
            sites = np.arange(J.shape[-1])
            J[..., sites, sites] = 0.0
        else:
            sites = np.arange(J.shape[-3])
            J[..., sites, sites, :, :] = 0.0  # the whole d x d block J_ii
        return J
    nonzero = diag != 0
    if nonzero.any():
        where = np.argwhere(nonzero)[0]
        raise ValueError(
            f"J: nonzero self-coupling (diagonal block) at index {where.tolist()} of the "
            f"diagonal, value {float(diag[tuple(where)])!r} (J has shape {J.shape}); the cavity "
            f"derivation needs J_ii = 0 (Bal 2021, section 3.1): pass diagonal='zero' to zero "
            f"the diagonal blocks"
        )
    return J


def _prior_blocks(prior_precision, n, d):
    """``Sigma^{-1}`` as (N, d, d) float64 blocks, checked symmetric positive definite."""
    if prior_precision is None:
        return np.broadcast_to(np.eye(d), (n, d, d))
    if np.ndim(prior_precision) == 0:
        value = _checks.real_scalar(prior_precision, "prior_precision", positive=True)
        return np.broadcast_to(value * np.eye(d), (n, d, d))
    p = _checks.as_float64(_checks.float_array(prior_precision, "prior_precision"))
    if p.shape == (d,):
        p = np.einsum("x,xy->xy", p, np.eye(d))
    if p.shape not in ((d, d), (n, d, d)):
        raise ValueError(
            f"prior_precision: expected a scalar, shape (d,) = ({d},), (d, d) = ({d}, {d}) or "
            f"(N, d, d) = ({n}, {d}, {d}), got shape {p.shape}"
        )
    p = np.broadcast_to(p, (n, d, d))
    if not np.isfinite(p).all() or not (p == np.swapaxes(p, -1, -2)).all():
        raise ValueError("prior_precision: expected finite symmetric matrices")
    smallest = np.linalg.eigvalsh(p).min()
    if smallest <= 0:
        raise ValueError(
            f"prior_precision: expected positive definite precisions (Sigma^-1), smallest "
            f"eigenvalue is {smallest!r}"
        )
    return p


def _solver_options(options):
    allowed = {"method", "memory", "damping", "lam", "atol", "on_fail"}
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(
            f"unexpected keyword arguments {sorted(unknown)}; solver options are {sorted(allowed)}"
        )
    return options


def _exact_result(batch, means, cavity_var, chi_diag, iterations=None):
    return MeanFieldResult(
        means=means,
        cavity_var=cavity_var,
        chi_diag=chi_diag,
        iterations=np.zeros(batch, int) if iterations is None else iterations,
        residuals=np.zeros((*batch, 0)),
        converged=np.ones(batch, bool),
        precision="exact",
    )


# ----------------------------------------------------------------------------- naive step


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
    m = _spins(m, "m")
    n, d = m.shape[-2:]
    J = _couplings(J, n, d)
    x = _spins(x, "x")
    if x.shape[-2:] != (n, d):
        raise ValueError(f"x: expected shape (..., N, d) = (..., {n}, {d}) like m, got {x.shape}")
    batch = _batch((m, 2), (J, 4), (x, 2))
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
    _checks.choice(response, "response", ("site", "prior"))
    x = _spins(x, "x")
    n, d = x.shape[-2:]
    J = _diagonal(_couplings(J, n, d), diagonal, ("error", "zero"))
    P = _prior_blocks(prior_precision, n, d)
    batch = _batch((x, 2), (J, 4))
    options = _solver_options(solver_options)
    if precision == "exact" and response == "site":
        return _exact_result(
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
        return _exact_result(batch, *outputs, iterations=iterations)
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
    x = _checks.as_float64(_checks.float_array(x, "x", ndim_min=1))
    n = x.shape[-1]
    J = _checks.as_float64(_checks.float_array(J, "J", ndim_min=2))
    if J.shape[-2:] != (n, n):
        raise ValueError(
            f"J: expected shape (..., N, N) = (..., {n}, {n}) to match x of shape "
            f"{x.shape}, got {J.shape}"
        )
    J = _diagonal(J, diagonal, ("error", "zero"), scalar=True)
    batch = _batch((x, 1), (J, 2))
    options = _solver_options(solver_options)
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
        return _exact_result(batch, *outputs, iterations=iterations)
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


# ----------------------------------------------------------------------------- DEQ attention


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
        sample (the solver freezes converged samples). None means ``f = 0``.
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
    x = _spins(x, "x")
    n, d = x.shape[-2:]
    J = _diagonal(_couplings(J, n, d), diagonal, ("error", "zero", "keep"))
    if correction is not None and not callable(correction):
        raise TypeError(f"correction: expected a callable or None, got {type(correction).__name__}")
    batch = _batch((x, 2), (J, 4))
    options = _solver_options(solver_options)
    if precision == "exact" and correction is None:
        return _exact_result(
            batch, exact.deq_linear(x, J, batch, _checks.out_dtype(out_dtype)), None, None
        )
    xb = np.broadcast_to(x, (*batch, n, d))
    Jb = np.broadcast_to(J, (*batch, n, n, d, d))
    start = (
        np.zeros((*batch, n, d))
        if z0 is None
        else np.array(
            _checks.broadcast(_spins(z0, "z0"), (*batch, n, d), "z0", "x"), dtype=np.float64
        )
    )

    def update(z):
        coupled = np.einsum("...ijxy,...jy->...ix", Jb, z) + xb
        return coupled if correction is None else coupled - np.asarray(correction(z))

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
        return _exact_result(batch, z, None, None, iterations=np.full(batch, iterations))
    return MeanFieldResult(
        means=res.z,
        cavity_var=None,
        chi_diag=None,
        iterations=res.iterations,
        residuals=res.residuals,
        converged=res.converged,
        precision="float64",
    )


# ----------------------------------------------------------------------------- gradients


class MeanFieldGrads(NamedTuple):
    """Vector-Jacobian product of a mean-field fixed point's means: ``dx`` (x's shape) and
    ``dJ`` (J's shape; the diagonal blocks are zero unless ``diagonal="keep"``)."""

    dx: np.ndarray
    dJ: np.ndarray


def _cotangent(grad_out, shape):
    g = _checks.as_float64(_checks.float_array(grad_out, "grad_out"))
    if g.shape != tuple(shape):
        raise ValueError(
            f"grad_out: expected the shape of the means {tuple(shape)}, got shape {g.shape}"
        )
    return g


def _flat_batch(batch, *pairs):
    """Each (array, core_shape) broadcast to (prod(batch), *core_shape)."""
    size = int(np.prod(batch, dtype=int))
    return [np.broadcast_to(a, (*batch, *core)).reshape(size, *core) for a, core in pairs]


def _zero_self_couplings(dJ, scalar=False):
    n = dJ.shape[-1] if scalar else dJ.shape[-3]
    sites = np.arange(n)
    if scalar:
        dJ[..., sites, sites] = 0
    else:
        dJ[..., sites, sites, :, :] = 0
    return dJ


def _linear_fixed_point_vjp(x, J, P, g, batch, keep_diagonal):
    """float64 (dx, dJ) of ``m = (P - J)^{-1} x``: ``u = (P - J)^{-T} g``, ``dx = u``,
    ``dJ_ij = u_i m_j^T`` (summed over broadcast batch dimensions)."""
    n, d = x.shape[-2:]
    xb, Jb, gb = _flat_batch(batch, (x, (n, d)), (J, (n, n, d, d)), (g, (n, d)))
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
        _zero_self_couplings(dJ)
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
    _checks.choice(response, "response", ("site", "prior"))
    x = _spins(x, "x")
    n, d = x.shape[-2:]
    J = _diagonal(_couplings(J, n, d), diagonal, ("error", "zero"))
    P = _prior_blocks(prior_precision, n, d)
    batch = _batch((x, 2), (J, 4))
    _solver_options(solver_options)
    g = _cotangent(grad_out, (*batch, n, d))
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
    return w1c, _zero_self_couplings(dJ, scalar=True)


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
    x = _checks.as_float64(_checks.float_array(x, "x", ndim_min=1))
    n = x.shape[-1]
    J = _checks.as_float64(_checks.float_array(J, "J", ndim_min=2))
    if J.shape[-2:] != (n, n):
        raise ValueError(
            f"J: expected shape (..., N, N) = (..., {n}, {n}) to match x of shape "
            f"{x.shape}, got {J.shape}"
        )
    J = _diagonal(J, diagonal, ("error", "zero"), scalar=True)
    batch = _batch((x, 1), (J, 2))
    g = _cotangent(grad_out, (*batch, n))
    res = ising_tap(x, J, tol=tol, max_iter=max_iter, **_solver_options(solver_options))
    m, V = (a.reshape(-1, n) for a in (res.means, res.cavity_var))
    xb, Jb, gb = _flat_batch(batch, (x, (n,)), (J, (n, n)), (g, (n,)))
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
        ``correction_vjp(z, v) -> v^T f'(z)`` (arrays of the shape of z, per sample). On the
        exact path it must also accept object arrays of ``mpmath.iv.mpf`` intervals (z a box)
        and return enclosures.
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
    x = _spins(x, "x")
    n, d = x.shape[-2:]
    J = _diagonal(_couplings(J, n, d), diagonal, ("error", "zero", "keep"))
    keep = diagonal == "keep"
    if correction is not None and not callable(correction_vjp):
        raise TypeError(
            "correction_vjp: a correction needs its vector-Jacobian product "
            f"correction_vjp(z, v) -> v^T f'(z), got {type(correction_vjp).__name__}"
        )
    batch = _batch((x, 2), (J, 4))
    g = _cotangent(grad_out, (*batch, n, d))
    options = _solver_options(solver_options)
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
        return np.einsum("...ijab,...ia->...jb", Jb, u) + g - np.asarray(correction_vjp(z, u))

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
        _zero_self_couplings(dJ)
    return MeanFieldGrads(reduce_to(u, x.shape), reduce_to(dJ, J.shape))


# ----------------------------------------------------------------------------- couplings


def softmax_couplings(
    x,
    W_Q,
    W_K,
    W_V=None,
    *,
    scale=None,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    precision="float64",
    out_dtype=None,
):
    """Softmax couplings of eq. (24) (``\\label{eq:softmaxcouplings}``), with an allowed set.

    .. math::

        J_{ij} = \\Big[\\mathrm{softmax}_{j \\in \\mathcal{A}_i}\\big(s\\, (x W_Q)_i \\cdot
            (x W_K)_j\\big)\\Big]\\, W_V^T \\quad (j \\in \\mathcal{A}_i), \\qquad
        J_{ij} = 0 \\quad (j \\notin \\mathcal{A}_i)

    (section 4.1; with ``W_V`` the blocks ``A_ij W_V^T`` make one naive update
    :func:`naive_step` equal softmax attention plus the residual, section 4.2). The allowed
    set ``A`` is :func:`refattn.masks.allowed_mask` of ``mask``, ``causal`` and ``window``:
    an excluded pair couples with exactly zero weight (it is removed from the softmax, never
    given -1e9); a site with no allowed partner has all-zero couplings. The couplings keep
    their diagonal (a token attends to itself): pass ``diagonal="keep"`` to
    :func:`deq_attention` / :func:`deq_attention_vjp`.

    Parameters
    ----------
    x : array_like, float, (B..., N, d)
        Spins / tokens.
    W_Q, W_K : array_like, float, (d, D)
    W_V : array_like, float, (d, d), optional
        None: ``J_ij = A_ij I_d`` (the scalar couplings of eq. (24)).
    scale : float, optional
        ``s``; default ``1/sqrt(D)`` (the source's ``1/sqrt(d)`` for square ``W_Q``).
    mask : array_like of bool, broadcastable to (B..., N, N), optional
        True = couple.
    causal, window, align
        As :func:`refattn.attention`. The couplings are square (N x N), so both alignments
        give the same set; ``align`` is accepted for symmetry.
    precision : {"float64", "exact"}
        "float64": log-sum-exp weights (:func:`refattn.logspace.masked_softmax`) times
        ``W_V^T``. "exact": every block entry ``A_ij W_V[b, a]`` enclosed in interval
        arithmetic and rounded once to ``out_dtype``.
    out_dtype : dtype, optional

    Returns
    -------
    ndarray, (B..., N, N, d, d)

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import softmax_couplings
    >>> J = softmax_couplings(np.ones((3, 1)), np.ones((1, 1)), np.ones((1, 1)), causal=True)
    >>> np.round(J[..., 0, 0], 6).tolist()
    [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.333333, 0.333333, 0.333333]]
    """
    precision = _checks.precision(precision)
    x, W_Q, W_K, values, scale, allowed = _coupling_inputs(
        x, W_Q, W_K, W_V, scale, mask, causal, window, align
    )
    if precision == "exact":
        return exact.softmax_couplings(
            x, W_Q, W_K, values, allowed, scale, _checks.out_dtype(out_dtype)
        )
    weights, _, _, _ = _coupling_weights(x, W_Q, W_K, scale, allowed)
    return np.einsum("...ij,ba->...ijab", weights, values)


def _coupling_inputs(x, W_Q, W_K, W_V, scale, mask, causal, window, align):
    """Validated (x, W_Q, W_K, W_V or I, scale, allowed (B..., N, N)) of eq. (24)."""
    from . import masks

    x = _spins(x, "x")
    n, d = x.shape[-2:]
    W_Q = _checks.as_float64(_checks.float_array(W_Q, "W_Q"))
    W_K = _checks.as_float64(_checks.float_array(W_K, "W_K"))
    if W_Q.ndim != 2 or W_Q.shape[0] != d or W_K.shape != W_Q.shape:
        raise ValueError(
            f"W_Q, W_K: expected two (d, D) matrices with d = {d}, got shapes "
            f"{W_Q.shape} and {W_K.shape}"
        )
    values = np.eye(d) if W_V is None else _checks.as_float64(_checks.float_array(W_V, "W_V"))
    if values.shape != (d, d):
        raise ValueError(f"W_V: expected shape (d, d) = ({d}, {d}), got {values.shape}")
    scale = _checks.real_scalar(scale, "scale", allow_none=True)
    allowed = masks.allowed_mask(n, n, mask=mask, causal=causal, window=window, align=align)
    allowed = np.broadcast_to(allowed, np.broadcast_shapes(allowed.shape, x.shape[:-2] + (n, n)))
    return x, W_Q, W_K, values, scale, allowed


def _coupling_weights(x, W_Q, W_K, scale, allowed):
    """float64 (A, q, k, s): the masked log-sum-exp softmax weights of eq. (24)."""
    from .logspace import masked_softmax

    s = 1.0 / np.sqrt(W_Q.shape[1]) if scale is None else scale
    q, k = x @ W_Q, x @ W_K
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * s
    _, weights = masked_softmax(np.broadcast_to(scores, allowed.shape), allowed)
    return weights, q, k, s


class SoftmaxCouplingsGrads(NamedTuple):
    """Gradients of :func:`softmax_couplings`: dx (x's shape), dW_Q, dW_K, dW_V (None when
    W_V is None)."""

    dx: np.ndarray
    dW_Q: np.ndarray
    dW_K: np.ndarray
    dW_V: np.ndarray | None


def softmax_couplings_vjp(
    x,
    W_Q,
    W_K,
    W_V,
    grad_out,
    *,
    scale=None,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    precision="float64",
    out_dtype=None,
) -> SoftmaxCouplingsGrads:
    """Vector-Jacobian product of :func:`softmax_couplings` (eq. (24)).

    With ``G = grad_out`` (the cotangent of J, e.g. ``dJ`` of :func:`deq_attention_vjp`),
    ``q = x W_Q``, ``k = x W_K`` and the weights ``A``:

    .. math::

        dA_{ij} = \\sum_{ab} G_{ij}^{ab} W_V[b, a], \\quad dW_V = \\Big(\\sum_{ij} A_{ij}
        G_{ij}\\Big)^T, \\quad dS = A \\odot (dA - \\mathrm{rowsum}(A \\odot dA)), \\\\
        dq = s\\, dS\\, k, \\quad dk = s\\, dS^T q, \\quad dx = dq W_Q^T + dk W_K^T, \\quad
        dW_Q = x^T dq, \\quad dW_K = x^T dk

    Excluded pairs have ``A_ij = 0`` exactly, so their cotangent reaches nothing.

    Parameters
    ----------
    x, W_Q, W_K, W_V, scale, mask, causal, window, align
        As :func:`softmax_couplings`.
    grad_out : array_like, float, (B..., N, N, d, d)
    precision : {"float64", "exact"}
        "exact": forward and backward enclosed in interval arithmetic, the weight gradients
        summed over the batch, every element rounded once.
    out_dtype : dtype, optional

    Returns
    -------
    SoftmaxCouplingsGrads

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import softmax_couplings_vjp
    >>> G = np.zeros((2, 2, 1, 1)); G[1, 0] = 1.0
    >>> grads = softmax_couplings_vjp(np.ones((2, 1)), np.ones((1, 1)), np.ones((1, 1)), None,
    ...                               G, causal=True)
    >>> grads.dW_V, grads.dx.ravel().tolist()  # equal scores: A_10 = A_11 = 1/2
    (None, [0.25, -0.25])
    """
    precision = _checks.precision(precision)
    x, W_Q, W_K, values, scale, allowed = _coupling_inputs(
        x, W_Q, W_K, W_V, scale, mask, causal, window, align
    )
    n, d = x.shape[-2:]
    G = _checks.as_float64(_checks.float_array(grad_out, "grad_out"))
    if G.shape != allowed.shape[:-2] + (n, n, d, d):
        raise ValueError(
            f"grad_out: expected the shape of the couplings "
            f"{allowed.shape[:-2] + (n, n, d, d)}, got {G.shape}"
        )
    if precision == "exact":
        grads = exact.softmax_couplings_vjp(
            x, W_Q, W_K, values, allowed, scale, G, x.shape, _checks.out_dtype(out_dtype)
        )
    else:
        weights, q, k, s = _coupling_weights(x, W_Q, W_K, scale, allowed)
        xb, qb, kb = (
            np.broadcast_to(a, allowed.shape[:-1] + a.shape[-1:]).reshape(-1, n, a.shape[-1])
            for a in (x, q, k)
        )
        parts = [
            exact.softmax_couplings_backward(*sample, s)
            for sample in zip(
                xb,
                [W_Q] * len(xb),
                [W_K] * len(xb),
                [values] * len(xb),
                weights.reshape(-1, n, n),
                qb,
                kb,
                G.reshape(-1, n, n, d, d),
                strict=True,
            )
        ]
        dx = reduce_to(
            np.stack([p[0] for p in parts]).reshape(allowed.shape[:-2] + (n, d)), x.shape
        )
        grads = [dx] + [sum(p[m] for p in parts) for m in (1, 2, 3)]
    return SoftmaxCouplingsGrads(grads[0], grads[1], grads[2], None if W_V is None else grads[3])
