"""Natural scales (T1) and condition factors (V1) of the variant functions.

The variant fixtures (:mod:`oracle.catalogue.variants`) are judged like attention (rules (T1)
and (T2) of :mod:`oracle.judging.tolerance`): each output element's error is normalised by the
natural
scale of its function (:func:`natural_scale`) -- the largest ``|v_je|`` of its column for the
mixtures (a convex combination of the values), the largest of the averaged quantities for the
key adaptation, 1 for priors (a distribution), the sum of the magnitudes of the energy's terms,
``sum |J m| + |x|`` for the naive step and the largest ``|truth|`` of the sample for the fixed
points -- and the floor :func:`oracle.judging.tolerance.variant_floor` (V1) is scaled by the case's
condition factor (:func:`condition`).

Examples
--------
>>> import numpy as np
>>> from oracle import catalogue
>>> case = catalogue.get("mlk-basic-H2-L4S6-D4E4-f64")
>>> inputs = catalogue.make_inputs(case)
>>> condition(case, inputs, {})
2.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from oracle.catalogue import merge_families
from oracle.catalogue.case import Case
from oracle.catalogue.variants import FUNCTIONS

__all__ = ["natural_scale", "condition", "grad_scale", "grad_floor_terms"]


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _per_unit(value, shape):
    return np.broadcast_to(_f64(value), shape)


def natural_scale(
    case: Case, inputs: Mapping[str, np.ndarray], name: str, truth64: np.ndarray
) -> np.ndarray:
    """The denominator of (T1) for output ``name`` of ``case`` (see the module docstring)."""
    fn = case.function
    if fn == "merge_states":
        return merge_families.natural_scale(inputs, name, truth64)
    x = {k: _f64(v) for k, v in inputs.items()}
    if fn in ("gmm.attention", "mgk.attention", "mgk.linear_attention"):
        values = x["values"] if fn == "gmm.attention" else x["v"]
        return np.broadcast_to(np.abs(values).max(axis=-2, keepdims=True), truth64.shape)
    if fn == "hopfield.retrieve":
        return np.broadcast_to(np.abs(x["X"]).max(axis=-2, keepdims=True), truth64.shape)
    if fn == "gmm.adapt_keys":
        reach = np.maximum(
            np.abs(x["queries"]).max(axis=-2, keepdims=True),
            np.abs(x["keys0"]).max(axis=-2, keepdims=True),
        )
        return np.broadcast_to(reach, truth64.shape)
    if fn == "gmm.adapt_priors":
        return np.ones_like(truth64)
    if fn == "hopfield.energy":
        xi, X, beta = x["xi"], x["X"], float(case.options["beta"])
        dots = np.abs(xi[..., :, None, :] * X[..., None, :, :]).sum(-1).max(-1)
        scale = 0.5 * (xi * xi).sum(-1) + dots + math.log(X.shape[-2]) / beta
        if case.options.get("constant"):
            scale = scale + 0.5 * (X * X).sum(-1).max(-1, keepdims=True)
        return np.broadcast_to(scale, truth64.shape)
    if fn == "meanfield.naive_step":
        terms = np.abs(np.einsum("ijab,...jb->...ijab", x["J"], x["m"])).sum(axis=(-3, -1))
        return terms + np.abs(x["x"])
    # fixed points: the largest magnitude of the output in each sample (cavity variances
    # are a difference Lambda - 1/chi: their scale includes the prior precision's)
    axes = tuple(range(1, truth64.ndim))
    scale = np.abs(truth64).max(axis=axes, keepdims=True) if axes else np.abs(truth64)
    if name == "cavity_var":
        prior = x.get("prior_precision")
        scale = scale + (1.0 if prior is None else float(np.abs(prior).max()))
    if fn == "meanfield.ising_tap" and name in ("means", "chi_diag"):
        scale = np.maximum(scale, 1.0)  # |m| <= 1, chi_ii = 1 - m^2 <= 1
    return np.broadcast_to(scale, truth64.shape)


def grad_scale(truth64: np.ndarray) -> np.ndarray:
    """The denominator of (T1) for a gradient ``d<name>`` of a variant case: the largest
    ``|truth|`` of the gradient in each sample (axis 0), as for the fixed points.

    A gradient is a signed sum of products through the whole computation; no per-element sum
    of absolute terms is derived for the variants (unlike attention's
    :func:`refattn.bounds.grad_scales`), so the per-sample magnitude is the scale.
    """
    truth64 = np.asarray(truth64, dtype=np.float64)
    axes = tuple(range(1, truth64.ndim))
    finite = np.where(np.isfinite(truth64), np.abs(truth64), 0.0)
    scale = finite.max(axis=axes, keepdims=True) if axes else finite
    return np.broadcast_to(scale, truth64.shape)


def grad_floor_terms(case: Case, forward_condition: float) -> tuple[float, int]:
    """``(c, n)`` of the floor (V1) for a variant's gradients.

    The reverse pass re-runs the forward's chain (the weights) and then as many operations
    again through the transposed chain, each cotangent passing the softmax (or ratio) once
    more: ``c = 2 c_forward`` and ``n = 2 n_forward + D + E`` (the cotangent's dot products
    with the values and the distance vectors). A policy, not an a-priori bound: no bound is
    derived for the variants' vjps.
    """
    spec = FUNCTIONS[case.function]
    return 2.0 * float(forward_condition), 2 * spec.n_roundings(
        case
    ) + case.shapes.D + case.shapes.E


def _sq_terms(a, b, weight):
    """weight/2 * sum_d (a_d - b_d)^2 for every (row of a, row of b)."""
    diff = a[..., :, None, :] - b[..., None, :, :]
    return 0.5 * weight * (diff * diff).sum(-1)


def _big(J):
    n, _, d, _ = J.shape
    return np.swapaxes(J, 1, 2).reshape(n * d, n * d)


def _kappa(A):
    return float(np.linalg.norm(A, np.inf) * np.linalg.norm(np.linalg.inv(A), np.inf))


def condition(
    case: Case, inputs: Mapping[str, np.ndarray], truth64: Mapping[str, np.ndarray]
) -> float:
    """Relative condition factor ``c`` of (V1): how much the case amplifies rounding errors.

    Mixtures: ``1 + 2A`` per step, with ``A`` the largest magnitude of a logit's terms (a
    logit perturbed by a relative ``delta`` moves a softmax weight by ``2 delta A``
    relative, as in (T5)), summed over the iterations; iterates are bounded through the convex
    hull they lie in (of the values, keys/queries or patterns), and Hopfield steps multiply
    by the update's Lipschitz bound ``beta diam(X)^2 / 4`` (when above 1); linear attention:
    2 (a ratio of positive sums); linear systems: the infinity-norm condition number of
    ``P - J`` (of ``Lambda - J`` for the binary spins); the naive step and the energy: 1
    (their scales already sum the terms' magnitudes).
    """
    fn, opts = case.function, case.options
    if fn == "merge_states":
        return merge_families.condition(case)
    x = {k: _f64(v) for k, v in inputs.items()}
    if fn == "gmm.attention":
        q, keys, values = x["q"], x["keys"], x["values"]
        alpha = _per_unit(x.get("alpha", opts.get("alpha", 1.0)), keys.shape[:-1])
        beta = _per_unit(x.get("beta", opts.get("beta", 0.0)), keys.shape[:-1])
        A = _sq_terms(q, keys, alpha[..., None, :])
        if opts.get("prior") == "magnitude":
            A = (
                A
                + 0.5
                * (alpha * (keys * keys).sum(-1) + beta * (values * values).sum(-1))[..., None, :]
            )
        if "prior" in x:
            A = A + np.abs(x["prior"])[..., None, :]
        # every iterate v_t lies in the convex hull of the values (and v_init), where the
        # convex ||v - mu_u||^2 is largest at a vertex
        hull = values if "v_init" not in x else np.concatenate([values, x["v_init"]], -2)
        value_term = float((beta[..., None, :] * _sq_terms(hull, values, 1.0)).max())
        first = float(A.max()) + (value_term if "v_init" in x else 0.0)
        later = float(A.max()) + value_term
        iters = int(opts.get("iters", 1))
        return (1 + 2 * first) + (iters - 1) * (1 + 2 * later)
    if fn == "gmm.adapt_keys":
        q, keys = x["queries"], x["keys0"]
        # the keys stay in the convex hull of keys0 and the queries
        hull = np.concatenate([keys, q], -2)
        A = float(_sq_terms(q, hull, float(opts["alpha"])).max())
        if opts.get("prior") == "magnitude":
            A += 0.5 * float(opts["alpha"]) * float((hull * hull).sum(-1).max())
        factor = q.shape[-2] + 1 if opts.get("form") == "map" else 1
        return int(opts.get("iters", 1)) * factor * (1 + 2 * A)
    if fn == "gmm.adapt_priors":
        q, keys, pi0 = x["queries"], x["keys"], x["pi0"]
        A = float(_sq_terms(q, keys, float(opts["alpha"])).max())
        A += float(np.abs(np.log(pi0)).max())
        return int(opts.get("iters", 1)) * (1 + 2 * A)
    if fn == "mgk.attention":
        q, keys = x["q"], x["keys"]
        s2 = _per_unit(x.get("sigma2", opts.get("sigma2", 1.0)), keys.shape[:-1])
        diff = q[..., :, None, None, :] - keys[..., None, :, :, :]
        A = (diff * diff).sum(-1) / (2 * s2[..., None, :, :])
        if opts.get("normalized"):
            A = A + 0.5 * q.shape[-1] * np.abs(np.log(2 * np.pi * s2))[..., None, :, :]
        if "log_pi" in x:
            A = A + np.abs(x["log_pi"])[..., None, :, :]
        return 1 + 2 * float(A.max()) + math.log(keys.shape[-2])
    if fn == "mgk.linear_attention":
        return 2.0
    if fn == "hopfield.retrieve":
        xi, X, beta = x["xi"], x["X"], float(opts["beta"])
        # iterates after the first lie in the convex hull of the patterns, where the convex
        # sum_d |x_jd y_d| is largest at a vertex
        hull = np.concatenate([xi, X], -2)
        A = beta * float(np.abs(X[..., :, None, :] * hull[..., None, :, :]).sum(-1).max())
        # Lipschitz constant of xi -> X^T softmax(beta X xi): beta times the largest
        # covariance of a distribution on the patterns, at most diam^2 / 4
        lipschitz = beta * float(_sq_terms(X, X, 1.0).max()) / 2
        steps = int(opts.get("steps", 1))
        return (1 + 2 * A) * sum(max(lipschitz, 1.0) ** t for t in range(steps))
    if fn in ("hopfield.energy", "meanfield.naive_step"):
        return 1.0
    if fn in ("meanfield.adaptive_tap", "meanfield.deq_attention"):
        J = x["J"]
        N, d = J.shape[0], J.shape[2]
        if fn == "meanfield.deq_attention" or "prior_precision" not in x:
            P = np.eye(N * d)
        else:
            P = np.kron(np.eye(N), x["prior_precision"])
        return _kappa(P - _big(J))
    if fn == "meanfield.ising_tap":
        m, V = truth64["means"], truth64["cavity_var"]
        lam = V + 1 / (1 - m * m)
        return max(_kappa(np.diag(row) - x["J"]) for row in lam.reshape(-1, lam.shape[-1]))
    raise ValueError(f"condition: unknown variant function {fn!r}")
