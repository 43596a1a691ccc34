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

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from mpmath import mp, mpf
from mpmath.libmp import mpf_lt

from . import _checks
from . import fixedpoint as fp
from .exact import intervals as I
from .exact.intervals import iv
from .exact.rounding import correctly_round

__all__ = [
    "MeanFieldResult",
    "naive_step",
    "adaptive_tap",
    "ising_tap",
    "deq_attention",
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
        raise ValueError(f"batch dimensions of the inputs do not broadcast: shapes {shapes}") \
            from None


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
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}; solver options are "
                        f"{sorted(allowed)}")
    return options


def _big(blocks):
    """(B, N, N, d, d) couplings -> (B, N d, N d) with row (i, alpha) and column (j, beta)."""
    b, n, _, d, _ = blocks.shape
    return blocks.transpose(0, 1, 3, 2, 4).reshape(b, n * d, n * d)


def _block_diag(blocks):
    """(B, N, d, d) site blocks -> (B, N d, N d) block-diagonal matrix (float or exact)."""
    b, n, d, _ = blocks.shape
    out = np.zeros((b, n, d, n, d), dtype=blocks.dtype)
    if blocks.dtype == object:
        out[...] = Fraction(0)
    for i in range(n):
        out[:, i, :, i, :] = blocks[:, i]
    return out.reshape(b, n * d, n * d)


def _diag_blocks(matrix, n, d):
    """Diagonal d x d blocks of (B, N d, N d) matrices -> (B, N, d, d)."""
    blocks = matrix.reshape(matrix.shape[0], n, d, n, d)
    return np.stack([blocks[:, i, :, i, :] for i in range(n)], axis=1)


# ----------------------------------------------------------------------------- exact helpers


def _fractions(array, name):
    """Exact rational values of a finite float array (object array of Fraction)."""
    array = np.asarray(array, dtype=np.float64)
    if not np.isfinite(array).all():
        raise ValueError(f"{name}: the exact path needs finite inputs (shape {array.shape})")
    flat = np.empty(array.size, dtype=object)
    flat[:] = [Fraction(v) for v in array.ravel().tolist()]
    return flat.reshape(array.shape)


def _round(values, dtype, what):
    """Round exact rationals once to ``dtype`` (they are their own enclosure)."""
    values = np.asarray(values, dtype=object)
    return correctly_round(lambda prec: (values, values), dtype, what=what)


def _exact_inverse(matrix, what):
    """Inverse of a square object matrix of Fractions by Gauss-Jordan elimination."""
    n = matrix.shape[0]
    rows = [list(matrix[i]) + [Fraction(int(i == j)) for j in range(n)] for i in range(n)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if rows[r][col] != 0), None)
        if pivot is None:
            raise ValueError(f"{what} is singular; the fixed point does not exist")
        rows[col], rows[pivot] = rows[pivot], rows[col]
        inverse_pivot = 1 / rows[col][col]
        rows[col] = [v * inverse_pivot for v in rows[col]]
        for r in range(n):
            factor = rows[r][col]
            if r != col and factor != 0:
                rows[r] = [v - factor * w for v, w in zip(rows[r], rows[col], strict=True)]
    out = np.empty((n, n), dtype=object)
    for i in range(n):
        out[i, :] = rows[i][n:]
    return out


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
    dtype = _checks.out_dtype(out_dtype)
    mb = np.broadcast_to(_fractions(m, "m"), (*batch, n, d)).reshape(-1, n * d, 1)
    Jb = _big(np.broadcast_to(_fractions(J, "J"), (*batch, n, n, d, d)).reshape(-1, n, n, d, d))
    xb = np.broadcast_to(_fractions(x, "x"), (*batch, n, d)).reshape(-1, n * d, 1)
    exact = np.matmul(Jb, mb) + xb
    return _round(exact, dtype, "naive_step").reshape(*batch, n, d)


# ----------------------------------------------------------------------------- adaptive TAP


def _tap_update(m, V, J, x, P, response):
    """One Jacobi sweep of eqs. (17), (20), (10), (8), (11) (vector spins, Gaussian prior)."""
    n, d = m.shape[-2:]
    cavity = np.einsum("bijxy,bjy->bix", J, m) - np.einsum("bixy,biy->bix", V, m)
    means = np.linalg.solve(P - V, (cavity + x)[..., None])[..., 0]
    lam = P + V if response == "prior" else np.broadcast_to(P, V.shape)
    chi = np.linalg.inv(_block_diag(lam) - _big(J))
    chi_diag = _diag_blocks(chi, n, d)
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
        return _adaptive_tap_exact(x, J, P, batch, _checks.out_dtype(out_dtype))
    if precision == "exact" and n * d > _PRIOR_EXACT_MAX_SIZE:
        raise ValueError(f"adaptive_tap: the exact path with response='prior' certifies "
                         f"N d <= {_PRIOR_EXACT_MAX_SIZE} unknown blocks, got N d = {n * d}")
    result = _adaptive_tap_float(x, J, P, batch, response, tol, max_iter, options)
    if precision == "exact":
        return _adaptive_tap_prior_exact(result.cavity_var, x, J, P, batch,
                                         _checks.out_dtype(out_dtype))
    return result


def _adaptive_tap_float(x, J, P, batch, response, tol, max_iter, options):
    n, d = x.shape[-2:]
    size = int(np.prod(batch, dtype=int))
    xb = np.broadcast_to(x, (*batch, n, d)).reshape(size, n, d)
    Jb = np.broadcast_to(J, (*batch, n, n, d, d)).reshape(size, n, n, d, d)

    def split(state):
        return state[:, : n * d].reshape(-1, n, d), state[:, n * d:].reshape(-1, n, d, d)

    def update(state):
        m, V = split(state)
        means, V_new, _ = _tap_update(m, V, Jb, xb, P, response)
        return np.concatenate([means.reshape(size, -1), V_new.reshape(size, -1)], axis=1)

    try:
        res = fp.solve(update, np.zeros((size, n * d * (1 + d))), tol=tol, max_iter=max_iter,
                       **options)
        m, V = split(res.z)
        _, _, chi_diag = _tap_update(m, V, Jb, xb, P, response)
    except np.linalg.LinAlgError as exc:
        raise ValueError(f"adaptive_tap: singular matrix during the iteration ({exc}); "
                         f"Sigma^-1 - J or Sigma^-1 - V_i is not invertible") from None
    return MeanFieldResult(
        means=m.reshape(*batch, n, d),
        cavity_var=V.reshape(*batch, n, d, d),
        chi_diag=chi_diag.reshape(*batch, n, d, d),
        iterations=res.iterations.reshape(batch),
        residuals=res.residuals.reshape(*batch, -1),
        converged=res.converged.reshape(batch),
        precision="float64",
    )


def _site_closed_form(x, J, P, batch):
    """Exact (means, V, chi_ii) of the response="site" fixed point per sample (Fractions):
    m = (P - J)^{-1} x, chi_ii = [(P - J)^{-1}]_ii, V_i = P_i - chi_ii^{-1}."""
    n, d = x.shape[-2:]
    xs = np.broadcast_to(_fractions(x, "x"), (*batch, n, d)).reshape(-1, n * d)
    Js = np.broadcast_to(_fractions(J, "J"), (*batch, n, n, d, d)).reshape(-1, n, n, d, d)
    Pf = _fractions(P, "prior_precision")
    Pbig = _block_diag(Pf[None])[0]
    system = None
    means, cavity, chis = [], [], []
    for xb, Jb in zip(xs, Js, strict=True):
        if system is None or J.ndim > 4:  # a shared (unbatched) J is solved once
            chi = _exact_inverse(Pbig - _big(Jb[None])[0], "Sigma^-1 - J")
            chi_diag = _diag_blocks(chi[None], n, d)[0]
            inverses = [_exact_inverse(block, f"chi_ii (site {i})")
                        for i, block in enumerate(chi_diag)]
            system = chi, chi_diag, Pf - np.stack(inverses)
        chi, chi_diag, V = system
        means.append(chi.dot(xb).reshape(n, d))
        cavity.append(V)
        chis.append(chi_diag)
    return np.array(means, dtype=object), np.array(cavity, dtype=object), \
        np.array(chis, dtype=object)


def _adaptive_tap_exact(x, J, P, batch, dtype):
    """Closed-form fixed point (response="site") in exact rational arithmetic."""
    n, d = x.shape[-2:]
    means, cavity, chis = _site_closed_form(x, J, P, batch)
    return _exact_result(
        batch,
        _round(means, dtype, "means").reshape(*batch, n, d),
        _round(cavity, dtype, "cavity_var").reshape(*batch, n, d, d),
        _round(chis, dtype, "chi_diag").reshape(*batch, n, d, d),
    )


# Exact path of adaptive_tap with response="prior": the means are the closed form
# (P - J)^{-1} x and chi_ii = Sigma_i = P_i^{-1} exactly (the fixed point of eq. (11) with
# Lambda_i = V_i + P_i); the cavity variances solve the nonlinear system, with
# D = N d, unknowns V_i (N d^2, index i d^2 + a d + b) and Y = (P + V - J)^{-1} (D^2, index
# N d^2 + r D + s):
#   E2 = (P + V - J) Y - I      (D^2 equations, eqs. (8), (22))
#   E3 = P_i Y_ii - I           (N d^2 equations, eq. (11): chi_ii = (Lambda_i - V_i)^{-1})

#: Largest N d of the certified exact path of adaptive_tap(response="prior"): the Krawczyk
#: test is dense in (N d)^2 + N d^2 unknowns.
_PRIOR_EXACT_MAX_SIZE = 12


class _TapPriorProblem:
    def __init__(self, J, P):
        n, d = P.shape[:2]
        self.n, self.d, self.size = n, d, n * d
        self.J = _big(J[None])[0].tolist()
        self.P = P.tolist()
        self.offset = n * d * d
        # structural nonzeros of P + V - J in each row: the diagonal block and J's nonzeros
        self.support = [[t for t in range(n * d) if t // d == r // d or self.J[r][t] != 0]
                        for r in range(n * d)]

    def _blocks(self, u, ops):
        d, D = self.d, self.size
        J = [[ops.num(v) for v in row] for row in self.J]
        P = [[[ops.num(v) for v in row] for row in site] for site in self.P]
        V = lambda i, a, b: u[i * d * d + a * d + b]  # noqa: E731
        Y = lambda r, s: u[self.offset + r * D + s]  # noqa: E731

        def A(r, t):
            i, a, b = r // d, r % d, t % d
            diagonal = P[i][a][b] + V(i, a, b) if t // d == i else 0
            return diagonal - J[r][t]

        return P, Y, A

    def residual(self, u, ops):
        n, d, D = self.n, self.d, self.size
        P, Y, A = self._blocks(u, ops)
        out = [sum(A(r, t) * Y(t, s) for t in self.support[r]) - (1 if r == s else 0)
               for r in range(D) for s in range(D)]
        out.extend(sum(P[i][a][b] * Y(i * d + b, i * d + c) for b in range(d))
                   - (1 if a == c else 0)
                   for i in range(n) for a in range(d) for c in range(d))
        return out

    def jacobian(self, u, ops):
        n, d, D = self.n, self.d, self.size
        P, Y, A = self._blocks(u, ops)
        entries = []
        for r in range(D):
            i, a = divmod(r, d)
            for s in range(D):
                row = r * D + s
                entries.extend((row, self.offset + t * D + s, A(r, t)) for t in self.support[r])
                entries.extend((row, i * d * d + a * d + b, Y(i * d + b, s)) for b in range(d))
        for i in range(n):
            for a in range(d):
                for c in range(d):
                    row = D * D + i * d * d + a * d + c
                    entries.extend((row, self.offset + (i * d + b) * D + i * d + c, P[i][a][b])
                                   for b in range(d))
        return entries


def _adaptive_tap_prior_exact(V, x, J, P, batch, dtype):
    """Means and chi_ii in closed form; V certified by the Krawczyk test."""
    n, d = x.shape[-2:]
    size = int(np.prod(batch, dtype=int))
    means, _, _ = _site_closed_form(x, J, P, batch)  # the means do not depend on V
    sigma = np.stack([_exact_inverse(block, f"prior_precision (site {i})")
                      for i, block in enumerate(_fractions(P, "prior_precision"))])
    Js = np.broadcast_to(J, (*batch, n, n, d, d)).reshape(size, n, n, d, d)
    Vs = V.reshape(size, n, d, d)
    certifiers = []
    for b in range(size):
        if b == 0 or J.ndim > 4:  # V depends on J only: a shared J is certified once
            Pbig, Vbig = _block_diag(P[None])[0], _block_diag(Vs[b:b + 1])[0]
            Y = np.linalg.inv(Pbig + Vbig - _big(Js[b:b + 1])[0])
            u0 = np.concatenate([Vs[b].ravel(), Y.ravel()])
            certifiers.append(_Krawczyk(_TapPriorProblem(Js[b], P), u0, range(len(u0)),
                                        "adaptive_tap"))
    isolated = _isolated_sites(Js, scalar=False)
    means_flat, block = means.reshape(size, -1), n * d * d

    def evaluate(prec):
        boxes = [c.enclose(prec)[:block] for c in certifiers]
        rows = [list(means_flat[b]) + boxes[min(b, len(boxes) - 1)] + list(sigma.ravel())
                for b in range(size)]
        return I.endpoints(np.array(rows, dtype=object))

    def exact_zero(index):
        b, k = index
        k -= n * d
        if 0 <= k < block and isolated[b, k // (d * d)]:
            return 0  # an isolated site has chi_ii = (P_i + V_i)^{-1} = P_i^{-1}: V_i = 0
        return None

    out = correctly_round(evaluate, dtype, max_prec=_CERTIFIED_MAX_PREC, fallback=exact_zero,
                          what="adaptive_tap")
    iterations = np.array([certifiers[min(b, len(certifiers) - 1)].steps for b in range(size)])
    return _exact_result(
        batch,
        out[:, : n * d].reshape(*batch, n, d),
        out[:, n * d: n * d + block].reshape(*batch, n, d, d),
        out[:, n * d + block:].reshape(*batch, n, d, d),
        iterations=iterations.reshape(batch),
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
        raise ValueError(f"J: expected shape (..., N, N) = (..., {n}, {n}) to match x of shape "
                         f"{x.shape}, got {J.shape}")
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
        dtype = _checks.out_dtype(out_dtype)
        return _ising_exact(m, V, Jb, xb, batch, dtype)
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


# ----------------------------------------------------------------------------- certification
# A zero of a square system G(u) = 0 near a float64 approximation is certified with the
# Krawczyk operator (Krawczyk 1969; Rump 1983): with C ~ G'(u0)^{-1} (float64), a box X
# around the refined midpoint u and
#     K(X) = u - C G(u) + (I - C G'(X)) (X - u),
# K(X) inside the interior of X proves that G has exactly one zero in X, and it lies in K(X).
# G'(X) is an interval enclosure of the Jacobian over the whole box. Problems supply
# residual(u, ops) and jacobian(u, ops) (a sparse list of (row, column, value)) written with
# + - * / and ops.tanh only, so the same code runs on floats (the preconditioner), mpf (the
# chord refinement) and intervals (the test).


@dataclass(frozen=True)
class _Ops:
    num: Callable
    tanh: Callable


_FLOAT_OPS = _Ops(float, math.tanh)
_MP_OPS = _Ops(mpf, mp.tanh)
_IV_OPS = _Ops(I.point, I.tanh)


def _strictly_inside(inner, outer):
    (a, b), (c, d) = inner._mpi_, outer._mpi_
    return mpf_lt(c, a) and mpf_lt(b, d)


class _Krawczyk:
    """Certified enclosure of the zero of ``problem`` near ``u0`` (free unknowns ``free``)."""

    def __init__(self, problem, u0, free, what):
        self.problem, self.free, self.what = problem, list(free), what
        self.rows = self.free  # equation k is paired with unknown k (a square system)
        self.u0, self.u, self.steps = [float(v) for v in u0], None, 0
        jac = np.zeros((len(self.free),) * 2)
        for row, col, value in self._entries(problem.jacobian(self.u0, _FLOAT_OPS)):
            jac[row, col] += value
        if not np.isfinite(jac).all() or np.linalg.cond(jac) > 1 / np.finfo(np.float64).eps:
            raise ArithmeticError(f"{what}: the fixed point is not isolated (singular Jacobian "
                                  f"of the fixed-point equations); the exact path cannot "
                                  f"certify it")
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
                g = self.problem.residual(u, _MP_OPS)
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
            g = self.problem.residual(point, _IV_OPS)
            delta = C.dot(np.array([g[r] for r in self.rows], dtype=object))
            scale = max([1] + [abs(float(v)) for v in self.u])
            radius = 4 * (max(abs(float(d.b)) + abs(float(d.a)) for d in delta)
                          + scale * 2.0 ** (8 - prec))
            box = list(point)
            for var in self.free:
                box[var] = point[var] + iv.mpf([-radius, radius])
            contraction = self._identity_minus(C, self.problem.jacobian(box, _IV_OPS))
            offsets = np.array([box[v] - point[v] for v in self.free], dtype=object)
            krawczyk = np.array([point[v] for v in self.free], dtype=object) - delta \
                + contraction.dot(offsets)
            for k, var in enumerate(self.free):
                if not _strictly_inside(krawczyk[k], box[var]):
                    raise ArithmeticError(
                        f"{self.what}: Krawczyk certification failed at {prec} bits (unknown "
                        f"{var}); the float64 iterate may not be near an isolated fixed point")
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


def _isolated_sites(J, scalar):
    """Sites with no coupling in or out (their cavity variance is exactly 0)."""
    axes = (-1,) if scalar else (-3, -2, -1)
    rows = (J != 0).any(axis=axes)
    cols = (np.swapaxes(J, -1, -2) != 0).any(axis=(-1,)) if scalar else \
        (np.swapaxes(J, -3, -4) != 0).any(axis=axes)
    return ~(rows | cols)


# Exact path of ising_tap: unknowns u = (m_i, Lambda_i, Y_pl) with Y = (Lambda - J)^{-1}, laid
# out as m -> [0, N), Lambda -> [N, 2N), Y_pl -> 2N + p N + l; equations E1 (N), E2 (N^2),
# E3 (N) in the same order:
#   E1_i = m_i - tanh(sum_j J_ij m_j - (Lambda_i - 1/(1 - m_i^2)) m_i + x_i)   (eqs. (14), (10))
#   E2   = (Lambda - J) Y - I                                                  (eq. (8))
#   E3_i = Y_ii - (1 - m_i^2)                                                  (eq. (11))

#: Largest working precision of the exact Ziv loops of the nonlinear fixed points (an exact
#: zero that no structural rule proves would otherwise double the precision up to
#: config.ZIV_MAX_PREC).
_CERTIFIED_MAX_PREC = 4096


class _IsingProblem:
    def __init__(self, J, x):
        self.n, self.J, self.x = len(x), J.tolist(), x.tolist()
        self.nonzero = (J != 0).tolist()

    def residual(self, u, ops):
        n, J, x = self.n, [[ops.num(v) for v in row] for row in self.J], \
            [ops.num(v) for v in self.x]
        m, lam, Y = u[:n], u[n:2 * n], u[2 * n:]
        out = []
        for i in range(n):
            s = sum(J[i][j] * m[j] for j in range(n)) - lam[i] * m[i] + m[i] / (1 - m[i] * m[i])
            out.append(m[i] - ops.tanh(s + x[i]))
        for k in range(n):
            for l in range(n):
                coupled = sum(J[k][p] * Y[p * n + l] for p in range(n))
                out.append(lam[k] * Y[k * n + l] - coupled - (1 if k == l else 0))
        out.extend(Y[i * n + i] - (1 - m[i] * m[i]) for i in range(n))
        return out

    def jacobian(self, u, ops):
        n, J, x, nonzero = self.n, [[ops.num(v) for v in row] for row in self.J], \
            [ops.num(v) for v in self.x], self.nonzero
        m, lam, Y = u[:n], u[n:2 * n], u[2 * n:]
        entries = []
        for i in range(n):
            c = 1 - m[i] * m[i]
            t = ops.tanh(sum(J[i][j] * m[j] for j in range(n)) - lam[i] * m[i] + m[i] / c + x[i])
            slope = 1 - t * t
            entries.extend((i, j, -slope * J[i][j]) for j in range(n) if nonzero[i][j])
            entries.append((i, i, 1 - slope * ((1 + m[i] * m[i]) / (c * c) - lam[i])))
            entries.append((i, n + i, slope * m[i]))
        for k in range(n):
            for l in range(n):
                row = n + k * n + l
                entries.append((row, n + k, Y[k * n + l]))
                entries.extend((row, 2 * n + p * n + l, (lam[k] if p == k else 0) - J[k][p])
                               for p in range(n) if p == k or nonzero[k][p])
        for i in range(n):
            entries.append((n + n * n + i, i, 2 * m[i]))
            entries.append((n + n * n + i, 2 * n + i * n + i, 1))
        return entries


def _ising_certifier(m, V, J, x):
    n = len(x)
    free_m = bool((x != 0).any())  # x = 0: m = 0 is an exact solution; certify (Lambda, Y)
    m = m if free_m else np.zeros(n)
    lam = V + 1 / (1 - m * m)
    u0 = np.concatenate([m, lam, np.linalg.inv(np.diag(lam) - J).ravel()])
    return _Krawczyk(_IsingProblem(J, x), u0, range(0 if free_m else n, 2 * n + n * n),
                     "ising_tap")


def _ising_outputs(box, n):
    m, lam, Y = box[:n], box[n:2 * n], box[2 * n:]
    return m + [lam[i] - 1 / (1 - m[i] * m[i]) for i in range(n)] + \
        [Y[i * n + i] for i in range(n)]


def _ising_exact(m, V, J, x, batch, dtype):
    """Correctly rounded (means, cavity_var, chi_diag) of the certified fixed points."""
    n = x.shape[-1]
    certifiers = [_ising_certifier(mb, Vb, Jb, xb) for mb, Vb, Jb, xb in
                  zip(m, V, J, x, strict=True)]
    isolated = _isolated_sites(J, scalar=True)

    def evaluate(prec):
        boxes = [c.enclose(prec) for c in certifiers]
        with I.workprec(prec):  # V_i = Lambda_i - 1/(1 - m_i^2) on the certified box
            outputs = [_ising_outputs(box, n) for box in boxes]
        return I.endpoints(np.array(outputs, dtype=object))

    def exact_zero(index):
        # an isolated site has V_i = 0 (chi_ii = 1 / Lambda_i) and, if x_i = 0, m_i = 0
        b, k = index
        kind, site = divmod(k, n)
        if isolated[b, site] and (kind == 1 or (kind == 0 and x[b, site] == 0)):
            return 0
        return None

    out = correctly_round(evaluate, dtype, max_prec=_CERTIFIED_MAX_PREC, fallback=exact_zero,
                          what="ising_tap").reshape(len(certifiers), 3, n)
    iterations = np.array([c.steps for c in certifiers], dtype=int)
    return _exact_result(batch, *(out[:, k].reshape(*batch, n) for k in range(3)),
                         iterations=iterations.reshape(batch))


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
        return _deq_linear_exact(x, J, batch, _checks.out_dtype(out_dtype))
    xb = np.broadcast_to(x, (*batch, n, d))
    Jb = np.broadcast_to(J, (*batch, n, n, d, d))
    start = np.zeros((*batch, n, d)) if z0 is None else np.array(
        _checks.broadcast(_spins(z0, "z0"), (*batch, n, d), "z0", "x"), dtype=np.float64)

    def update(z):
        coupled = np.einsum("...ijxy,...jy->...ix", Jb, z) + xb
        return coupled if correction is None else coupled - np.asarray(correction(z))

    res = fp.solve(update, start, tol=tol, max_iter=max_iter, state_ndim=2, **options)
    if precision == "exact":
        lipschitz = _checks.real_scalar(lipschitz, "lipschitz", allow_none=True)
        if lipschitz is None or lipschitz < 0:
            raise ValueError("lipschitz: the exact path with a correction needs a non-negative "
                             f"Lipschitz bound of the correction, got {lipschitz!r}")
        return _deq_contraction_exact(res, xb, Jb, correction, lipschitz,
                                      _checks.out_dtype(out_dtype))
    return MeanFieldResult(
        means=res.z,
        cavity_var=None,
        chi_diag=None,
        iterations=res.iterations,
        residuals=res.residuals,
        converged=res.converged,
        precision="float64",
    )


def _deq_linear_exact(x, J, batch, dtype):
    n, d = x.shape[-2:]
    xs = np.broadcast_to(_fractions(x, "x"), (*batch, n, d)).reshape(-1, n * d)
    Js = np.broadcast_to(_fractions(J, "J"), (*batch, n, n, d, d)).reshape(-1, n, n, d, d)
    eye = np.identity(n * d, dtype=object) * Fraction(1)
    shared = _exact_inverse(eye - _big(Js[:1])[0], "I - J") if J.ndim == 4 else None
    out = []
    for xb, Jb in zip(xs, Js, strict=True):
        inverse = shared if shared is not None else _exact_inverse(eye - _big(Jb[None])[0],
                                                                   "I - J")
        out.append(inverse.dot(xb))
    z = _round(np.array(out, dtype=object), dtype, "means").reshape(*batch, n, d)
    return _exact_result(batch, z, None, None)


def _upper(value):
    """Exact upper bound of |value| for an interval (or exact number) as an mpf."""
    value = value if isinstance(value, iv.mpf) else I.point(value)
    return mp.make_mpf(abs(value)._mpi_[1])


def _deq_contraction_exact(res, x, J, correction, lipschitz, dtype):
    """Certified enclosure of z* = T(z*), T(z) = J z - f(z) + x, by the contraction bound."""
    batch, (n, d) = res.z.shape[:-2], res.z.shape[-2:]
    size = int(np.prod(batch, dtype=int))
    row_sums = np.sum(np.abs(_fractions(J, "J")), axis=(-3, -1)).reshape(size, -1)
    q = [max(row) + Fraction(lipschitz) for row in row_sums]
    if max(q) >= 1:
        raise ValueError(
            f"deq_attention: the exact path needs a max-norm contraction, but ||J||_inf + "
            f"lipschitz = {float(max(q))!r} >= 1")
    state = {"z": res.z, "iterations": 0}

    def T(z, Jbig, xi):
        coupled = np.matmul(Jbig, z.reshape(size, n * d, 1)).reshape(*batch, n, d) + xi
        return coupled - np.asarray(correction(z), dtype=object).reshape(*batch, n, d)

    def evaluate(prec):
        with I.workprec(prec):
            Jbig = _big(I.to_intervals(J).reshape(size, n, n, d, d))
            xi = I.to_intervals(x)
            z = I.to_intervals(state["z"])
            scale = max([1] + [_upper(v) for v in z.ravel()]) * mpf(2) ** (8 - prec)
            for step in range(64 * prec):
                image = T(z, Jbig, xi)
                gap = [max(_upper(v) for v in row) for row in (image - z).reshape(size, -1)]
                if max(gap) <= scale or step == 64 * prec - 1:
                    break
                z = np.vectorize(lambda v: v.mid, otypes=[object])(image)
            if max(gap) > scale:
                raise ArithmeticError(f"deq_attention: no contraction to 2**{8 - prec} within "
                                      f"{64 * prec} iterations at {prec} bits")
            state["z"], state["iterations"] = np.vectorize(float)(z), step
            radius = [(I.point(qb) / (1 - I.point(qb)) * iv.mpf(g)).b for qb, g in
                      zip(q, gap, strict=True)]
            flat = image.reshape(size, -1)
            enclosure = np.array([[v + iv.mpf([-radius[b], radius[b]]) for v in flat[b]]
                                  for b in range(size)], dtype=object)
        return I.endpoints(enclosure)

    z = correctly_round(evaluate, dtype, max_prec=_CERTIFIED_MAX_PREC, what="deq_attention")
    return _exact_result(batch, z.reshape(*batch, n, d), None, None,
                         iterations=np.full(batch, state["iterations"]))

