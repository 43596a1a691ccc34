"""Modern (continuous) Hopfield networks: energy and retrieval.

Ramsauer et al., "Hopfield Networks is All You Need" (arXiv:2008.02217, 2020; reference [3] of
seed 000): the energy ("E") and update rule ("U") of its introduction. The seeds hold no copy
of that paper, so refattn labels the two displays (E) and (U) instead of citing equation
numbers it cannot check. refattn stores patterns as the **rows** of X
(S, D) (the paper's X is D x N, columns), and a batch of L states as the rows of xi (L, D):

.. math::

    E(\\xi) = \\tfrac12 \\xi^\\top\\xi - \\beta^{-1}\\log\\sum_{j=1}^{S} e^{\\beta x_j^\\top \\xi}
              \\;\\big[+\\ \\beta^{-1}\\log S + \\tfrac12 M^2\\big] \\quad (E), \\qquad
    \\xi^{new} = X^\\top \\operatorname{softmax}(\\beta X \\xi) \\quad (U),

with M = max_j ||x_j||. The bracketed constant is the paper's; it makes 0 <= E <= 2 M^2 and is
added only with ``constant=True``. One update (U) is ``refattn.attention(xi, X, X,
scale=beta)``; the update never increases E (the paper's Theorem 1, a concave-convex procedure).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _checks
from .broadcast import reduce_to
from .exact import hopfield as exact
from .logspace import logsumexp

__all__ = ["energy", "retrieve", "retrieve_vjp", "RetrieveResult", "RetrieveGrads"]


class RetrieveResult(NamedTuple):
    """Result of :func:`retrieve` with ``return_trace=True``.

    states : (..., L, D) the retrieved states.
    energy : (..., L, steps + 1) E(xi^t) for t = 0..steps (NaN after a row stopped on tol).
    steps : (..., L) int, updates performed per row.
    """

    states: np.ndarray
    energy: np.ndarray
    steps: np.ndarray


class RetrieveGrads(NamedTuple):
    """Result of :func:`retrieve_vjp`: dxi (..., L, D) and dX (..., S, D), each in its
    argument's shape."""

    dxi: np.ndarray
    dX: np.ndarray


def _inputs(xi, patterns, beta):
    xi = _checks.finite_array(xi, "xi", 2)
    patterns = _checks.finite_array(patterns, "X", 2)
    if xi.shape[-1] != patterns.shape[-1]:
        raise ValueError(
            f"X: expected patterns of size D = {xi.shape[-1]} (as xi {xi.shape}), "
            f"got shape {patterns.shape}"
        )
    if patterns.shape[-2] == 0:
        raise ValueError("X: expected at least one stored pattern (S >= 1)")
    beta = _checks.real_scalar(beta, "beta", positive=True)
    try:
        batch = np.broadcast_shapes(xi.shape[:-2], patterns.shape[:-2])
    except ValueError:
        raise ValueError(
            f"leading (batch) dimensions do not broadcast: xi {xi.shape}, X {patterns.shape}"
        ) from None
    return (
        np.broadcast_to(xi, batch + xi.shape[-2:]),
        np.broadcast_to(patterns, batch + patterns.shape[-2:]),
        beta,
        batch,
    )


def _energy64(xi, patterns, beta, constant):
    scores = beta * (xi @ np.swapaxes(patterns, -1, -2))
    # lse / beta beyond the float64 range (beta near 0) is +-inf, as the exact path rounds it
    with np.errstate(over="ignore"):
        value = 0.5 * np.einsum("...ld,...ld->...l", xi, xi) - logsumexp(scores, axis=-1) / beta
        if constant:
            norms = np.einsum("...sd,...sd->...s", patterns, patterns).max(axis=-1)
            value = value + (np.log(patterns.shape[-2]) / beta + 0.5 * norms)[..., None]
    return value


def energy(xi, X, *, beta, constant=False, precision="float64", out_dtype=None):
    """Energy of the continuous modern Hopfield network, Ramsauer et al. (E).

    .. math::

        E(\\xi) = \\tfrac12\\,\\xi\\cdot\\xi
                  - \\beta^{-1}\\operatorname{lse}_j(\\beta\\, x_j\\cdot\\xi)
                  \\;[+\\ \\beta^{-1}\\log S + \\tfrac12 \\max_j \\|x_j\\|^2]

    Parameters
    ----------
    xi : array (..., L, D)
        States, one per row.
    X : array (..., S, D)
        Stored patterns, one per row.
    beta : float > 0
        Inverse temperature.
    constant : bool
        Add the paper's constant ``log(S)/beta + M^2/2`` (default: the stated constant is 0).
    precision : {"float64", "exact"}
    out_dtype : dtype, optional (exact path)

    Returns
    -------
    array (..., L)

    Notes
    -----
    float64 error: ``|dE| <= gamma_{D+2} ||xi||^2 / 2 + dlse / beta`` with ``dlse`` the lse bound
    of :func:`refattn.bounds.logit_lse_bound` for logits ``beta x_j . xi`` (term scale
    ``beta D max|x| max|xi|``).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import hopfield
    >>> float(hopfield.energy(np.array([[1.0, 0.0]]), np.array([[1.0, 0.0]]), beta=1.0)[0])
    -0.5
    """
    precision = _checks.precision(precision)
    xi, patterns, beta, batch = _inputs(xi, X, beta)
    if precision == "float64":
        return _energy64(_checks.as_float64(xi), _checks.as_float64(patterns), beta, constant)

    return exact.energy(xi, patterns, beta, constant, _checks.out_dtype(out_dtype))


def retrieve(
    xi, X, *, beta, steps=1, tol=None, return_trace=False, precision="float64", out_dtype=None
):
    """Retrieve stored patterns by the update rule of Ramsauer et al. (U).

    .. math:: \\xi^{t+1} = X^\\top \\operatorname{softmax}(\\beta X \\xi^t)

    applied ``steps`` times to every state (row of xi) independently. One step is
    ``refattn.attention(xi, X, X, scale=beta)`` (bit for bit on the exact path).

    Parameters
    ----------
    xi : array (..., L, D)
        Initial states, one per row.
    X : array (..., S, D)
        Stored patterns, one per row.
    beta : float > 0
    steps : int >= 1
        Updates (the maximum when ``tol`` is given).
    tol : float, optional
        float64 path only: a row stops once ``max_d |xi^{t+1} - xi^t| <= tol`` (per row).
    return_trace : bool
        Also return the energies E(xi^t), t = 0..steps, of the iterates (exact path: of the
        exact iterates, each rounded once), as a :class:`RetrieveResult`.
    precision : {"float64", "exact"}
        The exact path returns the exact value of ``steps`` updates (not of the fixed point).
    out_dtype : dtype, optional (exact path)

    Returns
    -------
    states (..., L, D), or RetrieveResult(states, energy, steps).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import hopfield
    >>> X = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> hopfield.retrieve(np.array([[3.0, 0.0]]), X, beta=8.0, steps=2).round(3).tolist()
    [[1.0, 0.0]]
    """
    precision = _checks.precision(precision)
    xi, patterns, beta, batch = _inputs(xi, X, beta)
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    tol = _checks.iteration_tol(tol, precision, "`steps` updates")
    if precision == "float64":
        return _retrieve64(
            _checks.as_float64(xi), _checks.as_float64(patterns), beta, steps, tol, return_trace
        )
    states, energies = exact.retrieve(
        xi, patterns, beta, steps, return_trace, _checks.out_dtype(out_dtype)
    )
    if not return_trace:
        return states
    return RetrieveResult(states, energies, np.full(states.shape[:-1], steps, dtype=np.int64))


def _retrieve64(xi, patterns, beta, steps, tol, want_trace):
    from .attention import attention

    shape = xi.shape[:-1]
    active = np.ones(shape, dtype=bool)
    done = np.zeros(shape, dtype=np.int64)
    trace = np.full(shape + (steps + 1,), np.nan) if want_trace else None
    if want_trace:
        trace[..., 0] = _energy64(xi, patterns, beta, False)
    state = xi
    for t in range(steps):
        new = attention(state, patterns, patterns, scale=beta)
        new = np.where(active[..., None], new, state)
        done += active
        if want_trace:
            trace[..., t + 1] = np.where(active, _energy64(new, patterns, beta, False), np.nan)
        if tol is not None:
            settled = np.max(np.abs(new - state), axis=-1) <= tol
        else:
            settled = np.zeros(shape, dtype=bool)
        state = new
        active &= ~settled
        if not active.any():
            break
    return RetrieveResult(state, trace, done) if want_trace else state


def retrieve_vjp(xi, X, grad_out, *, beta, steps=1, tol=None, precision="float64", out_dtype=None):
    """Vector-Jacobian product of :func:`retrieve` (the states) with respect to xi and X.

    Reverse mode through the ``steps`` updates (U) ``xi^{t+1} = X^T softmax(beta X xi^t)``;
    X enters every update twice (keys and values). For one update with weights P and
    cotangent ``g`` of ``xi^{t+1}``:

    .. math::

        dP_j = g \\cdot x_j,\\quad dS_j = P_j\\big(dP_j - \\textstyle\\sum_k P_k dP_k\\big),
        \\quad \\bar\\xi^t = \\beta \\sum_j dS_j x_j,\\quad
        \\bar x_j \\mathrel{+}= P_j g + \\beta\\, dS_j\\, \\xi^t .

    Parameters
    ----------
    xi, X, beta, steps
        As :func:`retrieve`.
    grad_out : array (..., L, D)
        The cotangent of the retrieved states.
    tol : float, optional
        float64 path only, as :func:`retrieve`: a row that stopped is constant afterwards (the
        stopping decision itself has no derivative).
    precision : {"float64", "exact"}
        "exact": the exact derivative of the ``steps`` exact updates, every element rounded
        once (enclosures and the Ziv loop, :mod:`refattn.exact.hopfield`).
    out_dtype : dtype, optional (exact path)

    Returns
    -------
    RetrieveGrads(dxi (..., L, D), dX (..., S, D)), each summed back to its argument's shape.

    Notes
    -----
    float64 path: every update's backward is :func:`refattn.attention_vjp` (q = xi^t,
    k = v = X, scale = beta), whose bound (:func:`refattn.bounds.float64_vjp_bound`) holds per
    step; no bound is derived for the composition of several steps.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import hopfield
    >>> X = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> g = hopfield.retrieve_vjp(np.zeros((1, 2)), X, np.ones((1, 2)), beta=1.0)
    >>> g.dX.tolist()  # weights 1/2 each; dP_j equal, so dS = 0
    [[0.5, 0.5], [0.5, 0.5]]
    """
    precision = _checks.precision(precision)
    shapes = (np.shape(xi), np.shape(X))
    xi, patterns, beta, batch = _inputs(xi, X, beta)
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    tol = _checks.iteration_tol(tol, precision, "`steps` updates")
    go = _checks.finite_array(grad_out, "grad_out", 2)
    go = _checks.broadcast(go, xi.shape, "grad_out", "(..., L, D) of xi")
    if precision == "exact":
        return RetrieveGrads(
            *exact.retrieve_vjp(
                xi, patterns, go, beta, int(steps), shapes, _checks.out_dtype(out_dtype)
            )
        )
    return _retrieve_vjp64(
        _checks.as_float64(xi),
        _checks.as_float64(patterns),
        _checks.as_float64(go),
        beta,
        int(steps),
        tol,
        shapes,
    )


def _retrieve_vjp64(xi, patterns, grad, beta, steps, tol, shapes):
    from .attention import attention, attention_vjp

    states, actives = [xi], []
    active = np.ones(xi.shape[:-1], dtype=bool)
    for _ in range(steps):
        if not active.any():
            break
        new = np.where(
            active[..., None], attention(states[-1], patterns, patterns, scale=beta), states[-1]
        )
        actives.append(active.copy())
        if tol is not None:
            active &= ~(np.max(np.abs(new - states[-1]), axis=-1) <= tol)
        states.append(new)
    dpatterns = np.zeros(patterns.shape)
    for state, active in zip(reversed(states[:-1]), reversed(actives), strict=True):
        step = attention_vjp(
            state, patterns, patterns, np.where(active[..., None], grad, 0.0), scale=beta
        )
        dpatterns = dpatterns + step.dk + step.dv
        grad = np.where(active[..., None], step.dq, grad)
    return RetrieveGrads(reduce_to(grad, shapes[0]), reduce_to(dpatterns, shapes[1]))
