"""Tests of refattn.fixedpoint.solve: accuracy on maps with known fixed points, per-sample
stopping, honest failure reporting, input validation, determinism."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given

from oracle.judging.tolerance import fixed_point_forward_bound, unit_roundoff
from refattn.fixedpoint import (
    NotConvergedError,
    NotConvergedWarning,
    relative_residual,
    solve,
)
from tests.helpers import assert_norm_within
from tests.strategies import contractive_affine_maps

METHODS = ["anderson", "picard"]


def _affine(A, b):
    return lambda z: np.einsum("bij,bj->bi", A, z) + b


def _affine_bounds(A, b, z):
    """fixed_point_forward_bound per sample for the affine map z -> A z + b."""
    eye = np.eye(A.shape[-1])
    residual = np.linalg.norm(_affine(A, b)(z) - z, axis=-1)
    inverse_norm = np.linalg.norm(np.linalg.inv(eye - A), 2, axis=(-2, -1))
    scale = np.linalg.norm(np.einsum("bij,bj->bi", np.abs(A), np.abs(z)) + np.abs(b), axis=-1)
    n = A.shape[-1] + 1
    return [
        fixed_point_forward_bound(r, k, s, n)
        for r, k, s in zip(residual, inverse_norm, scale, strict=True)
    ]


@pytest.mark.parametrize("method", METHODS)
@given(maps=contractive_affine_maps())
def test_affine_map_known_solution(method, maps):
    A, b = maps
    res = solve(_affine(A, b), np.zeros_like(b), method=method)
    truth = np.linalg.solve(np.eye(A.shape[-1]) - A, b[..., None])[..., 0]
    assert res.converged.all(), f"{method}: not converged, residuals {res.residual}"
    # the truth itself carries the error of the dense solve: kappa(I - A) * u * ||truth||
    cond = np.linalg.cond(np.eye(A.shape[-1]) - A)
    solve_error = cond * unit_roundoff("float64") * np.linalg.norm(truth, axis=-1) * A.shape[-1]
    bounds = np.array(_affine_bounds(A, b, res.z)) + solve_error
    assert_norm_within(res.z, truth, bounds, what=f"{method} affine", per_sample=True)


@pytest.mark.parametrize("method", METHODS)
@given(maps=contractive_affine_maps())
def test_converged_means_residual_below_tol(method, maps):
    A, b = maps
    tol = 1e-6
    res = solve(
        _affine(A, b), np.zeros_like(b), method=method, tol=tol, max_iter=3, on_fail="return"
    )
    measured = relative_residual(_affine(A, b)(res.z), res.z)
    assert np.array_equal(measured, res.residual), "reported residual is not f's residual at z"
    claimed = res.converged
    assert (measured[claimed] <= tol).all(), (
        f"{method}: samples {np.flatnonzero(claimed & (measured > tol))} claimed converged with "
        f"residual {measured[claimed & (measured > tol)]} > tol {tol}"
    )
    assert not claimed[measured > tol].any()


def _contraction(z):
    # |d/dz (0.5 cos z + 0.3 z)| <= 0.8 < 1: a contraction whose fixed point is not in closed form
    return 0.5 * np.cos(z) + 0.3 * z + 1.0


def test_anderson_and_picard_agree_on_a_contraction():
    z0 = np.linspace(-3.0, 3.0, 12).reshape(3, 4)
    anderson = solve(_contraction, z0, method="anderson", tol=1e-13)
    picard = solve(_contraction, z0, method="picard", tol=1e-13)
    q = 0.8  # the Lipschitz bound of _contraction (comment above)
    bounds = []
    for res in (anderson, picard):
        residual = np.linalg.norm(_contraction(res.z) - res.z, axis=-1)
        scale = np.linalg.norm(np.abs(0.5 * np.cos(res.z)) + np.abs(0.3 * res.z) + 1.0, axis=-1)
        bounds.append(
            [
                fixed_point_forward_bound(r, 1 / (1 - q), s, 4)
                for r, s in zip(residual, scale, strict=True)
            ]
        )
    assert_norm_within(
        anderson.z,
        picard.z,
        np.array(bounds[0]) + np.array(bounds[1]),
        what="anderson vs picard",
        per_sample=True,
    )
    assert (anderson.iterations < picard.iterations).all(), (
        f"Anderson should need fewer updates: {anderson.iterations} vs {picard.iterations}"
    )


def test_anderson_beats_picard_on_slow_linear_map(rng_slow_map):
    A, b = rng_slow_map
    anderson = solve(_affine(A, b), np.zeros_like(b), method="anderson")
    picard = solve(_affine(A, b), np.zeros_like(b), method="picard", max_iter=5000)
    assert (anderson.iterations * 4 < picard.iterations).all(), (
        f"anderson {anderson.iterations} vs picard {picard.iterations}"
    )


@pytest.fixture
def rng_slow_map():
    rng = np.random.default_rng(20211)
    A = rng.standard_normal((2, 10, 10))
    A = (A + A.transpose(0, 2, 1)) / 2  # symmetric: real spectrum, Picard rate = radius
    A *= 0.97 / np.abs(np.linalg.eigvalsh(A)).max(axis=-1)[:, None, None]
    return A, rng.standard_normal((2, 10))


@pytest.mark.parametrize("method", METHODS)
def test_per_sample_convergence_is_independent_of_the_batch(method):
    # sample 0 contracts fast (radius 0.1), sample 1 slowly (radius 0.95)
    rng = np.random.default_rng(7)
    A = rng.standard_normal((2, 6, 6))
    A = (A + A.transpose(0, 2, 1)) / 2
    A *= (np.array([0.1, 0.95]) / np.abs(np.linalg.eigvalsh(A)).max(axis=-1))[:, None, None]
    b = rng.standard_normal((2, 6))
    batch = solve(_affine(A, b), np.zeros_like(b), method=method, max_iter=2000)
    assert batch.iterations[0] < batch.iterations[1]
    for s in range(2):
        alone = solve(
            _affine(A[s : s + 1], b[s : s + 1]), np.zeros((1, 6)), method=method, max_iter=2000
        )
        assert alone.iterations[0] == batch.iterations[s], f"{method} sample {s}"
        assert np.array_equal(alone.z[0], batch.z[s]), f"{method} sample {s}: z differs"
    # the trace of the easy sample stops (NaN) once it converged
    assert np.isnan(batch.residuals[0, batch.iterations[0] + 1 :]).all()


def test_batch_global_residual_would_hide_a_hard_sample():
    # An easy sample of scale 1e6 and a hard one of scale 1: the batch-global rule of the
    # deep-implicit-attention solver, ||F - X|| / ||F|| over the whole batch, is met while the
    # hard sample's own residual is far above tol. refattn reports that sample as unconverged.
    A = np.array([[[0.0]], [[0.9]]])
    b = np.array([[1e6], [1.0]])
    tol = 1e-5
    for steps in range(1, 200):
        res = solve(
            _affine(A, b),
            np.zeros_like(b),
            method="picard",
            tol=tol,
            max_iter=steps,
            on_fail="return",
        )
        fz = _affine(A, b)(res.z)
        if np.linalg.norm(fz - res.z) / np.linalg.norm(fz) < tol:
            break
    assert res.converged[0] and not res.converged[1], (
        f"batch-global residual met after {steps} steps; per-sample converged={res.converged}, "
        f"residuals={res.residual}"
    )
    assert res.residual[1] > tol


def test_on_fail_policies():
    diverging = lambda z: 2.0 * z + 1.0  # noqa: E731  (fixed point -1 is repelling)
    with pytest.raises(NotConvergedError, match="relative residual") as info:
        solve(diverging, np.zeros((2, 1)), method="picard", max_iter=10)
    result = info.value.result
    assert not result.converged.any() and (result.iterations == 10).all()
    with pytest.warns(NotConvergedWarning, match="2 of 2 samples"):
        solve(diverging, np.zeros((2, 1)), method="picard", max_iter=10, on_fail="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = solve(diverging, np.zeros((2, 1)), method="picard", max_iter=10, on_fail="return")
    assert not res.converged.any()


def test_nan_sample_fails_and_is_frozen():
    def f(z):
        out = 0.5 * z + 1.0
        out[1] = np.nan
        return out

    res = solve(f, np.zeros((2, 3)), on_fail="return")
    assert res.converged.tolist() == [True, False]
    assert res.iterations[1] == 0 and np.isnan(res.residual[1])


def test_zero_denominator():
    zero = np.zeros_like
    res = solve(zero, np.zeros((1, 2)))
    assert res.iterations[0] == 0 and res.residual[0] == 0.0 and res.converged[0]
    res = solve(zero, np.ones((1, 2)), method="picard")
    assert np.isinf(res.residuals[0, 0]) and res.residuals[0, 1] == 0.0 and res.converged[0]
    assert relative_residual(np.zeros((1, 2)), np.ones((1, 2)))[0] == np.inf


def test_damping_makes_an_oscillating_map_converge():
    flip = lambda z: 2.0 - z  # noqa: E731  (Picard oscillates 0, 2, 0, ...; fixed point 1)
    with pytest.raises(NotConvergedError):
        solve(flip, np.zeros((1, 1)), method="picard", max_iter=20)
    res = solve(flip, np.zeros((1, 1)), method="picard", damping=0.5)
    assert res.z[0, 0] == 1.0 and res.iterations[0] == 1


def test_memory_zero_is_picard_and_solver_is_deterministic(rng_slow_map):
    A, b = rng_slow_map
    f = _affine(A, b)
    picard = solve(f, np.zeros_like(b), method="picard", max_iter=5000)
    zero_memory = solve(f, np.zeros_like(b), method="anderson", memory=0, max_iter=5000)
    assert np.array_equal(picard.z, zero_memory.z)
    first, second = solve(f, np.zeros_like(b)), solve(f, np.zeros_like(b))
    assert np.array_equal(first.z, second.z)
    assert np.array_equal(first.residuals, second.residuals, equal_nan=True)


def test_state_ndim_and_batch_shapes():
    z0 = np.zeros((2, 3, 4, 5))
    res = solve(lambda z: 0.5 * z + 1.0, z0, state_ndim=2)
    assert res.z.shape == z0.shape and res.iterations.shape == (2, 3)
    assert res.residuals.shape[:2] == (2, 3) and res.converged.shape == (2, 3)
    residual = np.linalg.norm((0.5 * res.z + 1.0 - res.z).reshape(6, -1), axis=-1)
    scale = np.linalg.norm((0.5 * np.abs(res.z) + 1.0).reshape(6, -1), axis=-1)
    bounds = [fixed_point_forward_bound(r, 2.0, s, 2) for r, s in zip(residual, scale, strict=True)]
    assert_norm_within(
        res.z.reshape(6, 4, 5),
        np.full((6, 4, 5), 2.0),
        bounds,
        what="state_ndim=2",
        per_sample=True,
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"f": 3}, TypeError, "f: expected a callable"),
        ({"z0": np.zeros((2, 2), dtype=int)}, TypeError, "z0: expected a float array"),
        ({"method": "broyden"}, ValueError, "method"),
        ({"damping": 0.0}, ValueError, "damping"),
        ({"damping": 1.5}, ValueError, "damping"),
        ({"memory": -1}, ValueError, "memory"),
        ({"tol": -1.0}, ValueError, "tol"),
        ({"lam": -1.0}, ValueError, "lam"),
        ({"max_iter": 2.5}, ValueError, "max_iter"),
        ({"state_ndim": 3}, ValueError, "state_ndim"),
        ({"on_fail": "ignore"}, ValueError, "on_fail"),
        ({"f": lambda z: z[:, :1]}, ValueError, r"f: must return .* shape of z0"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = {"f": np.cos, "z0": np.zeros((2, 2))} | kwargs
    f, z0 = args.pop("f"), args.pop("z0")
    with pytest.raises(error, match=match):
        solve(f, z0, **args)
