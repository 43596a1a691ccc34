"""The mean-field model's results and the validation of its arguments (:mod:`refattn.meanfield`).

:class:`MeanFieldResult` and :class:`MeanFieldGrads`, and the checks every public function of
:mod:`refattn.meanfield` runs first: spins and couplings of matching shapes, broadcast batch
dimensions, the self-coupling policy, the prior precision, the solver options, cotangents. Each
error names the argument, its shape and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import _checks


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


def spins(m, name):
    return _checks.as_float64(_checks.float_array(m, name, ndim_min=2))


def couplings(J, n, d, name="J"):
    J = _checks.as_float64(_checks.float_array(J, name, ndim_min=4))
    if J.shape[-4:] != (n, n, d, d):
        raise ValueError(
            f"{name}: expected shape (..., N, N, d, d) = (..., {n}, {n}, {d}, {d}) to match the "
            f"spins (N={n}, d={d}), got shape {J.shape}"
        )
    return J


def batch_shape(**named):
    """Broadcast batch shape of ``name=(array, core_ndim)`` arguments, or a ValueError naming
    the arguments and their shapes."""
    try:
        return np.broadcast_shapes(*(a.shape[: a.ndim - k] for a, k in named.values()))
    except ValueError:
        shapes = ", ".join(f"{name} {a.shape}" for name, (a, _) in named.items())
        raise ValueError(
            f"{', '.join(named)}: the batch dimensions (B...) do not broadcast: shapes {shapes}"
        ) from None


def apply_diagonal(J, policy, allowed, scalar=False):
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


def prior_blocks(prior_precision, n, d):
    """``Sigma^{-1}`` as (N, d, d) float64 blocks, checked symmetric positive definite."""
    if prior_precision is None:
        return np.broadcast_to(np.eye(d), (n, d, d))
    # as_array: np.ndim of a ragged list would raise NumPy's own error, naming nothing
    if np.ndim(_checks.as_array(prior_precision, "prior_precision")) == 0:
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


def tap_problem(x, J, prior_precision, response, diagonal):
    """The checked ``(x, J, P, batch)`` of adaptive TAP (:func:`adaptive_tap` and its vjp):
    spins x (B..., N, d), couplings J (B..., N, N, d, d) under the ``diagonal`` policy, the
    prior precision as (N, d, d) blocks P and the broadcast batch shape."""
    _checks.choice(response, "response", ("site", "prior"))
    x = spins(x, "x")
    n, d = x.shape[-2:]
    J = apply_diagonal(couplings(J, n, d), diagonal, ("error", "zero"))
    P = prior_blocks(prior_precision, n, d)
    return x, J, P, batch_shape(x=(x, 2), J=(J, 4))


def ising_problem(x, J, diagonal):
    """The checked ``(x, J, batch)`` of binary-spin TAP (:func:`ising_tap` and its vjp):
    fields x (B..., N), couplings J (B..., N, N) under the ``diagonal`` policy."""
    x = _checks.as_float64(_checks.float_array(x, "x", ndim_min=1))
    n = x.shape[-1]
    J = _checks.as_float64(_checks.float_array(J, "J", ndim_min=2))
    if J.shape[-2:] != (n, n):
        raise ValueError(
            f"J: expected shape (..., N, N) = (..., {n}, {n}) to match x of shape "
            f"{x.shape}, got {J.shape}"
        )
    J = apply_diagonal(J, diagonal, ("error", "zero"), scalar=True)
    return x, J, batch_shape(x=(x, 1), J=(J, 2))


def deq_problem(x, J, diagonal, correction):
    """The checked ``(x, J, batch)`` of the DEQ (:func:`deq_attention` and its vjp): spins x
    (B..., N, d), couplings J (B..., N, N, d, d) under the ``diagonal`` policy (``"keep"``
    allowed), and a callable or None ``correction``."""
    x = spins(x, "x")
    n, d = x.shape[-2:]
    J = apply_diagonal(couplings(J, n, d), diagonal, ("error", "zero", "keep"))
    if correction is not None and not callable(correction):
        raise TypeError(f"correction: expected a callable or None, got {type(correction).__name__}")
    return x, J, batch_shape(x=(x, 2), J=(J, 4))


def check_solver_options(options):
    allowed = {"method", "memory", "damping", "lam", "atol", "on_fail"}
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(
            f"unexpected keyword arguments {sorted(unknown)}; solver options are {sorted(allowed)}"
        )
    return options


def exact_result(batch, means, cavity_var, chi_diag, iterations=None):
    return MeanFieldResult(
        means=means,
        cavity_var=cavity_var,
        chi_diag=chi_diag,
        iterations=np.zeros(batch, int) if iterations is None else iterations,
        residuals=np.zeros((*batch, 0)),
        converged=np.ones(batch, bool),
        precision="exact",
    )


class MeanFieldGrads(NamedTuple):
    """Vector-Jacobian product of a mean-field fixed point's means: ``dx`` (x's shape) and
    ``dJ`` (J's shape; the diagonal blocks are zero unless ``diagonal="keep"``)."""

    dx: np.ndarray
    dJ: np.ndarray


def cotangent(grad_out, shape):
    g = _checks.as_float64(_checks.float_array(grad_out, "grad_out"))
    if g.shape != tuple(shape):
        raise ValueError(
            f"grad_out: expected the shape of the means {tuple(shape)}, got shape {g.shape}"
        )
    return g


def flat_batch(batch, *pairs):
    """Each (array, core_shape) broadcast to (prod(batch), *core_shape)."""
    size = int(np.prod(batch, dtype=int))
    return [np.broadcast_to(a, (*batch, *core)).reshape(size, *core) for a, core in pairs]


def zero_self_couplings(dJ, scalar=False):
    n = dJ.shape[-1] if scalar else dJ.shape[-3]
    sites = np.arange(n)
    if scalar:
        dJ[..., sites, sites] = 0
    else:
        dJ[..., sites, sites, :, :] = 0
    return dJ


def checked_image(value, like, name, like_name="z"):
    """``value``, the caller's ``name`` evaluated at ``like`` (the iterate), as an array of
    ``like``'s shape holding real numbers, finite wherever ``like`` is finite; otherwise an
    error naming ``name``, the shapes and what was expected (not NumPy's broadcast error from
    inside the solver)."""
    try:
        image = np.asarray(value)
    except ValueError:  # a ragged sequence
        raise ValueError(
            f"{name}: expected an array of the shape of {like_name} {like.shape}, got a ragged "
            f"{type(value).__name__}"
        ) from None
    if image.shape != like.shape:
        raise ValueError(
            f"{name}: expected an array of the shape of {like_name} {like.shape} (B..., N, d), "
            f"got shape {image.shape} ({type(value).__name__}, dtype {image.dtype})"
        )
    if image.dtype.kind not in "biuf":
        raise TypeError(
            f"{name}: expected real numbers, got dtype {image.dtype} with shape {image.shape}"
        )
    if not np.isfinite(image).all() and np.isfinite(like).all():
        raise ValueError(
            f"{name}: returned NaN or Inf (shape {image.shape}) at a finite {like_name}; "
            "expected finite values"
        )
    return image
