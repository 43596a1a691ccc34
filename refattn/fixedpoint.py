"""Batched fixed-point solver with a per-sample stopping rule (Picard and Anderson mixing).

Deep implicit attention (Bal 2021, "Deep Implicit Attention", section 3; source document
``002`` of the seeds) computes attention as the fixed point ``z* = f(z*)`` of a
mean-field update, found by Anderson acceleration as in deep equilibrium models. This module
is refattn's solver for such fixed points.

Pinned choices
--------------
* **Per-sample residual.** ``z0`` has shape ``(B..., *state)``; the last ``state_ndim`` axes form
  one sample's state. Each sample ``b`` has its own relative residual

  .. math:: r_b(z) = \\frac{\\lVert f(z)_b - z_b \\rVert_2}{\\lVert f(z)_b \\rVert_2},

  with ``0/0 = 0`` (an exact fixed point at the origin) and ``c/0 = +inf`` for ``c > 0``.
  A sample is *converged* when ``||f(z)_b - z_b|| <= tol * ||f(z)_b||`` or
  ``||f(z)_b - z_b|| <= atol``. A converged sample is frozen (its iterate no longer changes)
  while the others continue. The public deep-implicit-attention solver instead stops the whole
  batch on one batch-global residual ``||F - X|| / (1e-5 + ||F||)`` taken over all samples at
  once, so an easy sample can hide a hard one (or the reverse); refattn does not do that.
* **Honest failure.** ``converged`` is never True for a sample whose residual did not meet the
  criterion. What happens when some sample fails is chosen by ``on_fail``: ``"raise"``
  (default) raises :class:`NotConvergedError` carrying the full result, ``"warn"`` issues a
  :class:`NotConvergedWarning` and returns, ``"return"`` returns silently. A sample whose
  residual becomes NaN or infinite is frozen as failed (never converged).
* **Returned iterate.** ``z`` is the iterate ``z_k`` whose residual was measured (not
  ``f(z_k)``), so the reported residual describes exactly the returned value.
* **Arithmetic.** float64 throughout (inputs of lower precision are widened exactly);
  deterministic: no randomness, and every per-sample reduction is a row reduction of a fixed
  shape, so a sample's trajectory does not depend on the other samples in the batch as long as
  ``f`` itself is sample-wise (``f(z)[b]`` depends only on ``z[b]``, which the solver requires).

Anderson mixing (type II, Walker & Ni 2011, with Tikhonov regularisation): with
``g(z) = f(z) - z``, the last ``n = min(memory, k)`` differences
``dX = [x_{i+1} - x_i]``, ``dG = [g_{i+1} - g_i]`` and damping ``beta``,

.. math::

    \\gamma_k = \\arg\\min_\\gamma \\lVert g_k - \\Delta G_k \\gamma \\rVert_2^2
        + \\lambda \\lVert \\Delta G_k \\rVert_F^2 \\lVert \\gamma \\rVert_2^2, \\qquad
    x_{k+1} = x_k + \\beta g_k - (\\Delta X_k + \\beta \\Delta G_k) \\gamma_k ,

i.e. ``(dG^T dG + lam ||dG||_F^2 I) gamma = dG^T g_k``. The regulariser is *relative* (scaled by
``||dG||_F^2``) so the step is invariant under rescaling of the problem and the normal matrix
has condition number at most ``(1 + n lam) / lam``. ``memory=0`` is damped Picard iteration
``x_{k+1} = beta f(x_k) + (1 - beta) x_k``.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import _checks

__all__ = [
    "FixedPointResult",
    "NotConvergedError",
    "NotConvergedWarning",
    "solve",
    "relative_residual",
    "DEFAULT_TOL",
    "DEFAULT_MAX_ITER",
    "DEFAULT_LAM",
]

#: Default relative residual tolerance: about 2**-33, well above the float64 rounding floor
#: (a few units of 2**-53 times the map's condition) for the well-conditioned maps of interest.
DEFAULT_TOL = 1e-10

#: Default cap on the number of updates per sample.
DEFAULT_MAX_ITER = 500

#: Default relative Tikhonov weight of Anderson's least-squares step (normal-matrix condition
#: number at most about 1e10, so the small solve keeps ~6 correct digits in the worst case).
DEFAULT_LAM = 1e-10


@dataclass(frozen=True)
class FixedPointResult:
    """Outcome of :func:`solve` (all per-sample arrays have the batch shape ``B...``).

    Attributes
    ----------
    z : ndarray, float64, shape (B..., *state)
        The last iterate of every sample (the one whose residual is reported).
    iterations : ndarray of int, shape (B...)
        Number of updates applied to each sample (``f`` was evaluated ``iterations + 1``
        times on it).
    residuals : ndarray, float64, shape (B..., K + 1)
        Relative residual trace: ``residuals[b, k]`` is ``r_b(z_k)``; NaN after the sample
        stopped. ``K`` is the largest number of updates of any sample.
    residual : ndarray, float64, shape (B...)
        Final relative residual of each sample (``residuals[b, iterations[b]]``).
    converged : ndarray of bool, shape (B...)
        True only where the stopping criterion was met.
    method : str
        "anderson" or "picard".
    """

    z: np.ndarray
    iterations: np.ndarray
    residuals: np.ndarray
    residual: np.ndarray
    converged: np.ndarray
    method: str


class NotConvergedError(ArithmeticError):
    """Some samples did not reach the tolerance; ``.result`` holds the full result."""

    def __init__(self, message: str, result):
        super().__init__(message)
        self.result = result


class NotConvergedWarning(RuntimeWarning):
    """Issued by ``on_fail="warn"`` when some samples did not reach the tolerance."""


def relative_residual(fz, z, *, state_ndim: int = 1) -> np.ndarray:
    """Per-sample ``||f(z) - z||_2 / ||f(z)||_2`` over the last ``state_ndim`` axes.

    ``0/0`` is 0 (an exact fixed point at the origin); ``c/0`` with ``c > 0`` is ``+inf``.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.fixedpoint import relative_residual
    >>> relative_residual(np.array([[2.0, 0.0], [0.0, 0.0]]), np.array([[1.0, 0.0], [0.0, 0.0]]))
    array([0.5, 0. ])
    """
    fz, z = np.asarray(fz, dtype=np.float64), np.asarray(z, dtype=np.float64)
    batch = fz.shape[: fz.ndim - state_ndim]
    num, den = _norms(fz.reshape(*batch, -1) - z.reshape(*batch, -1), fz.reshape(*batch, -1))
    return _ratio(num, den)


def _norms(g, fz):
    # a diverging sample overflows to inf here and is then frozen as failed
    with np.errstate(over="ignore", invalid="ignore"):
        return np.linalg.norm(g, axis=-1), np.linalg.norm(fz, axis=-1)


def _ratio(num, den):
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = num / den
    return np.where(den == 0, np.where(num == 0, 0.0, np.inf), ratio)


def _nonneg(value, name):
    value = _checks.real_scalar(value, name)
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative number, got {value!r}")
    return value


def _count(value, name, minimum=0):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def _validate(f, z0, method, memory, damping, tol, atol, max_iter, lam, state_ndim, on_fail):
    if not callable(f):
        raise TypeError(f"f: expected a callable, got {type(f).__name__}")
    z0 = _checks.float_array(z0, "z0")
    state_ndim = _count(state_ndim, "state_ndim")
    if state_ndim > z0.ndim:
        raise ValueError(f"state_ndim: {state_ndim} exceeds z0.ndim = {z0.ndim} (shape {z0.shape})")
    _checks.choice(method, "method", ("anderson", "picard"))
    _checks.choice(on_fail, "on_fail", ("raise", "warn", "return"))
    damping = _checks.real_scalar(damping, "damping", positive=True)
    if damping > 1:
        raise ValueError(f"damping: expected a number in (0, 1], got {damping!r}")
    return (
        z0,
        _count(memory, "memory"),
        damping,
        _nonneg(tol, "tol"),
        _nonneg(atol, "atol"),
        _count(max_iter, "max_iter"),
        _nonneg(lam, "lam"),
        state_ndim,
    )


def _evaluate(f, x, shape):
    out = f(x.reshape(shape))
    arr = np.asarray(out)
    if arr.shape != shape or arr.dtype.kind != "f":
        raise ValueError(
            f"f: must return a float array of the shape of z0 {shape}, "
            f"got dtype {arr.dtype.name} with shape {arr.shape}"
        )
    return arr.astype(np.float64).reshape(x.shape)


def _anderson_step(x, g, dxs, dgs, damping, lam):
    """One type-II Anderson update for every row (rows are samples)."""
    if not dxs:
        return x + damping * g
    dX, dG = np.stack(dxs, axis=-1), np.stack(dgs, axis=-1)  # (B, P, n)
    normal = np.einsum("bpi,bpj->bij", dG, dG)
    scale = np.trace(normal, axis1=-2, axis2=-1)
    usable = np.isfinite(scale) & (scale > 0)
    eye = np.eye(normal.shape[-1])
    normal = np.where(usable[:, None, None], normal + lam * scale[:, None, None] * eye, eye)
    rhs = np.where(usable[:, None], np.einsum("bpi,bp->bi", dG, g), 0.0)
    # pinv (symmetric eigendecomposition) never raises on a singular normal matrix (lam = 0)
    gamma = np.einsum("bij,bj->bi", np.linalg.pinv(normal, hermitian=True), rhs)
    return x + damping * g - np.einsum("bpi,bi->bp", dX + damping * dG, gamma)


def solve(
    f: Callable[[np.ndarray], np.ndarray],
    z0,
    *,
    method: str = "anderson",
    memory: int = 5,
    damping: float = 1.0,
    tol: float = DEFAULT_TOL,
    atol: float = 0.0,
    max_iter: int = DEFAULT_MAX_ITER,
    lam: float = DEFAULT_LAM,
    state_ndim: int = 1,
    on_fail: str = "raise",
) -> FixedPointResult:
    """Solve ``z = f(z)`` for every sample of a batch (Picard or Anderson mixing).

    The update of deep implicit attention (Bal 2021, eq. (23), ``\\label{eq:diaupdate}``)
    and the adaptive TAP equations (eqs. (17), (20), (22)) are solved with this function.

    .. math::

        z^* = f(z^*), \\qquad
        r_b(z) = \\frac{\\lVert f(z)_b - z_b \\rVert_2}{\\lVert f(z)_b \\rVert_2}
        \\quad (0/0 = 0,\\ c/0 = \\infty)

    Parameters
    ----------
    f : callable
        Maps an array of the shape of ``z0`` to a float array of the same shape. Must be
        sample-wise: ``f(z)[b]`` may depend only on ``z[b]`` (converged samples are frozen
        while ``f`` keeps being evaluated on the whole batch).
    z0 : array_like, float, shape (B..., *state)
        Initial iterate. The last ``state_ndim`` axes are one sample's state.
    method : {"anderson", "picard"}
        Anderson mixing (module docstring) or damped Picard iteration.
    memory : int
        Anderson depth: number of past differences used (``memory=0`` is Picard).
    damping : float in (0, 1]
        Mixing weight ``beta`` of ``f`` (1 = undamped).
    tol : float
        Relative tolerance on ``||f(z) - z|| / ||f(z)||`` per sample.
    atol : float
        Absolute tolerance on ``||f(z) - z||`` (default 0: the criterion is purely relative;
        set it when a fixed point may be at the origin, where the relative residual of a
        nonzero iterate does not go to 0).
    max_iter : int
        Largest number of updates per sample.
    lam : float >= 0
        Relative Tikhonov weight ``lambda`` of Anderson's least-squares step (module
        docstring).
    state_ndim : int
        Number of trailing axes of ``z0`` forming one sample.
    on_fail : {"raise", "warn", "return"}
        What to do when some sample did not converge: raise :class:`NotConvergedError`
        (carrying the result), warn (:class:`NotConvergedWarning`), or just return.

    Returns
    -------
    FixedPointResult
        ``z``, ``iterations``, ``residuals`` (trace), ``residual``, ``converged``, ``method``.

    Raises
    ------
    NotConvergedError
        With ``on_fail="raise"``, when some sample did not converge; the message names the
        number of failures and the worst sample's index and residual.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.fixedpoint import solve
    >>> res = solve(np.cos, np.array([[1.0], [0.5]]))
    >>> bool(res.converged.all()), round(float(res.z[0, 0]), 12)
    (True, 0.739085133215)
    """
    z0, memory, damping, tol, atol, max_iter, lam, state_ndim = _validate(
        f, z0, method, memory, damping, tol, atol, max_iter, lam, state_ndim, on_fail
    )
    if method == "picard":
        memory = 0
    batch = z0.shape[: z0.ndim - state_ndim]
    x = np.array(z0, dtype=np.float64).reshape(int(np.prod(batch, dtype=int)), -1)
    fx = _evaluate(f, x, z0.shape)
    trace, iterations, converged, active = (
        [],
        np.zeros(len(x), int),
        np.zeros(len(x), bool),
        np.ones(len(x), bool),
    )
    dxs, dgs = [], []
    for k in range(max_iter + 1):
        g = fx - x
        num, den = _norms(g, fx)
        trace.append(np.where(active, _ratio(num, den), np.nan))
        met = (num <= tol * den) | (num <= atol)
        converged |= active & met
        iterations[active] = k
        active &= ~met & np.isfinite(num) & np.isfinite(den)
        if not active.any() or k == max_iter:
            break
        x_next = np.where(active[:, None], _anderson_step(x, g, dxs, dgs, damping, lam), x)
        fx_next = np.where(active[:, None], _evaluate(f, x_next, z0.shape), fx)
        if memory:
            dxs.append(x_next - x)
            dgs.append((fx_next - x_next) - g)
            del dxs[:-memory], dgs[:-memory]
        x, fx = x_next, fx_next
    residuals = np.stack(trace, axis=-1)
    result = FixedPointResult(
        z=x.reshape(z0.shape),
        iterations=iterations.reshape(batch),
        residuals=residuals.reshape(*batch, -1),
        residual=residuals[np.arange(len(x)), iterations].reshape(batch),
        converged=converged.reshape(batch),
        method=method,
    )
    _report(result, on_fail, tol, atol, max_iter, "solve")
    return result


def _report(result, on_fail, tol, atol, max_iter, what):
    """Apply the ``on_fail`` policy to a result whose ``converged`` has some False."""
    failed = ~np.asarray(result.converged)
    if not failed.any() or on_fail == "return":
        return
    final = np.where(failed, np.nan_to_num(result.residual, nan=np.inf), -np.inf)
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(final)), final.shape))
    message = (
        f"{what}: {int(failed.sum())} of {failed.size} samples did not converge within "
        f"max_iter={max_iter} (tol={tol:g}, atol={atol:g}); worst sample {list(worst)} has "
        f"relative residual {float(result.residual[worst]):.3e} after "
        f"{int(result.iterations[worst])} iterations"
    )
    if on_fail == "raise":
        raise NotConvergedError(message, result)
    warnings.warn(message, NotConvergedWarning, stacklevel=3)
