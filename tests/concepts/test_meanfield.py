"""Tests of refattn.meanfield (Bal 2021): naive step, vector adaptive TAP, binary-spin TAP, DEQ
attention; float64 against closed forms and the exact path, exact path against independent
mpmath computations (the twins of tests/naive/meanfield.py, written without refattn)."""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given

from oracle.judging.tolerance import fixed_point_forward_bound, gamma, ulp, unit_roundoff
from refattn.attention import attention
from refattn.exact import intervals as I
from refattn.fixedpoint import NotConvergedError
from refattn.meanfield import adaptive_tap, deq_attention, ising_tap, naive_step
from tests.helpers import assert_norm_within, assert_same_bits, assert_within
from tests.naive.meanfield import DPS, exact_naive_step, mp_inverse, mp_ising, mp_solve
from tests.strategies import weak_vector_couplings

# ----------------------------------------------------------------------------- helpers


def _big(J):
    n, _, d, _ = J.shape[-4:]
    return np.swapaxes(J, -3, -2).reshape(*J.shape[:-4], n * d, n * d)


def _nearest_float64(truth_mp):
    """The float64 nearest to each element of an mpf array (given at DPS digits)."""
    with mpmath.workdps(DPS):
        return np.vectorize(lambda t: float(mpmath.mpf(t)), otypes=[float])(truth_mp)


@pytest.fixture
def rng():
    return np.random.default_rng(2021_05)


def _couplings(rng, n, d, strength, symmetric=True):
    J = rng.standard_normal((n, n, d, d))
    if symmetric:
        J = (J + J.transpose(1, 0, 3, 2)) / 2
    J[np.arange(n), np.arange(n)] = 0.0
    return J * (strength / np.linalg.norm(_big(J), 2))


# ----------------------------------------------------------------------------- naive step


@given(case=weak_vector_couplings())
def test_naive_step_exact_is_correctly_rounded_and_float64_within_gamma(case):
    x, J = case
    m = np.tanh(x[::-1] * 3.0)
    exact = naive_step(m, J, x, precision="exact")
    truth = exact_naive_step(m, J, x)
    expected = np.array([[float(v) for v in row] for row in truth])  # Fraction -> float: RN
    assert np.array_equal(exact, expected), "naive_step exact is not the rounded exact sum"
    n, d = x.shape
    bound = gamma(n * d + 1) * (np.einsum("ijab,jb->ia", np.abs(J), np.abs(m)) + np.abs(x))
    assert_within(naive_step(m, J, x), expected, bound, what="naive_step float64")


def test_naive_step_exact_float32_half_ulp(rng):
    x = rng.standard_normal((3, 2))
    J = rng.standard_normal((3, 3, 2, 2))
    m = rng.standard_normal((3, 2))
    out = naive_step(
        m.astype(np.float32),
        J.astype(np.float32),
        x.astype(np.float32),
        precision="exact",
        out_dtype=np.float32,
    )
    assert out.dtype == np.float32
    truth = exact_naive_step(m.astype(np.float32), J.astype(np.float32), x.astype(np.float32))
    for (i, a), value in np.ndenumerate(out):
        error = abs(Fraction(float(value)) - truth[i][a])
        half = Fraction(float(ulp(float(truth[i][a]), "float32"))) / 2
        assert error <= half, f"float32 [{i},{a}]: {value} vs {float(truth[i][a])}"


def test_naive_step_batches_like_a_loop(rng):
    J = rng.standard_normal((2, 1, 3, 3, 2, 2))
    m = rng.standard_normal((4, 3, 2))
    x = rng.standard_normal((3, 2))
    out = naive_step(m, J, x)
    assert out.shape == (2, 4, 3, 2)
    for b in range(2):
        for s in range(4):
            assert np.array_equal(out[b, s], naive_step(m[s], J[b, 0], x)), (b, s)
    exact = naive_step(m[:2], J[0, 0], x, precision="exact")
    assert exact.shape == (2, 3, 2)


def _softmax_couplings(X, WQ, WK, WV):
    """Eq. (24): J_ij = softmax(X W_Q W_K^T X^T / sqrt(d))_ij W_V^T, plus its score bound."""
    import refattn

    d = X.shape[-1]
    q, k = X @ WQ, X @ WK
    weights = refattn.softmax(q @ k.T / np.sqrt(d), axis=-1)
    J = np.einsum("ij,ba->ijab", weights, WV)
    score_size = np.abs(q) @ np.abs(k).T / np.sqrt(d)
    return weights, J, score_size


def test_softmax_attention_plus_residual_is_one_naive_step(rng):
    # Bal 2021 section 4.2: X'_i = sum_j softmax(...)_ij [X W_V]_j + X_i
    N, d = 5, 4
    X = rng.standard_normal((N, d))
    WQ, WK, WV = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(3))
    weights, J, score_size = _softmax_couplings(X, WQ, WK, WV)
    out = attention(X @ WQ, X @ WK, X @ WV) + X
    step = naive_step(X, J, X)
    # both sides: softmax weights with relative error gamma_{d+4} (2 |scores| + 2) (refattn
    # .attention's documented bound, the same computation for refattn.softmax), then the sums
    # over j and beta (N d + d + 2 roundings: X W_V, the weighted sum, the residual add)
    value_size = np.abs(X) @ np.abs(WV)
    nat = weights @ value_size
    weight_error = gamma(d + 4) * 2 * (score_size.max(axis=-1, keepdims=True) + 1)
    bound = 2 * (weight_error * nat + gamma(N * d + d + 2) * (nat + np.abs(X)))
    assert_within(step, out, bound, what="attention + X vs naive_step")
    # exact path: attention's exact output + X differs from the exact naive step on the
    # exactly rounded weights by the weight rounding, u |w| |X W_V|, and three roundings
    exact_weights = refattn_softmax_exact(X @ WQ, X @ WK)
    J_exact = np.einsum("ij,ba->ijab", exact_weights, WV)
    exact_step = naive_step(X, J_exact, X, precision="exact")
    exact_attn = attention(X @ WQ, X @ WK, X @ WV, precision="exact")
    bound = gamma(1) * exact_weights @ value_size + gamma(3) * (nat + np.abs(X)) + gamma(d) * nat
    assert_within(exact_step, exact_attn + X, bound, what="exact attention + X vs exact naive_step")


def refattn_softmax_exact(q, k):
    import refattn

    # the scores q k^T / sqrt(d) are rounded once before the exact softmax; their error is
    # below gamma(d + 2) |q||k| / sqrt(d), which the caller's bound absorbs through gamma(d)
    return refattn.softmax(q @ k.T / np.sqrt(q.shape[-1]), axis=-1, precision="exact")


@pytest.mark.parametrize(
    "m_shape, J_shape, x_shape, match",
    [
        ((3, 2), (3, 3, 2, 1), (3, 2), r"J: expected shape \(\.\.\., N, N, d, d\)"),
        ((3, 2), (3, 3, 2, 2), (3, 1), r"x: expected shape"),
        ((2, 3, 2), (3, 3, 2, 2), (4, 3, 2), "do not broadcast"),
        ((3,), (3, 3, 2, 2), (3, 2), "m: expected at least 2 dimensions"),
    ],
)
def test_naive_step_bad_shapes(m_shape, J_shape, x_shape, match):
    with pytest.raises(ValueError, match=match):
        naive_step(np.zeros(m_shape), np.zeros(J_shape), np.zeros(x_shape))


def test_naive_step_bad_dtype_and_nonfinite_exact():
    with pytest.raises(TypeError, match="J: expected a float array"):
        naive_step(np.zeros((2, 1)), np.zeros((2, 2, 1, 1), dtype=int), np.zeros((2, 1)))
    with pytest.raises(ValueError, match="finite"):
        naive_step(
            np.full((2, 1), np.inf), np.zeros((2, 2, 1, 1)), np.zeros((2, 1)), precision="exact"
        )


# ----------------------------------------------------------------------------- adaptive TAP


def _tap_means_bound(res, x, J, P):
    """fixed_point_forward_bound for the means: the m-update is affine at fixed V with
    (I - A)^{-1} = (P - J)^{-1} (P - V) (module docstring), residual measured in float64."""
    n, d = x.shape[-2:]
    m, V = res.means, res.cavity_var
    cavity = np.einsum("ijab,jb->ia", J, m) - np.einsum("iab,ib->ia", V, m)
    image = np.linalg.solve(P - V, (cavity + x)[..., None])[..., 0]
    Pbig = np.zeros((n * d, n * d))
    for i in range(n):
        Pbig[i * d : (i + 1) * d, i * d : (i + 1) * d] = P[i]
    Vbig = np.zeros_like(Pbig)
    for i in range(n):
        Vbig[i * d : (i + 1) * d, i * d : (i + 1) * d] = V[i]
    amplification = np.linalg.norm(np.linalg.solve(Pbig - _big(J), Pbig - Vbig), 2)
    terms = (
        np.einsum("ijab,jb->ia", np.abs(J), np.abs(m))
        + np.einsum("iab,ib->ia", np.abs(V), np.abs(m))
        + np.abs(x)
    )
    site = max(
        np.linalg.norm(np.linalg.inv(P[i] - V[i]), 2) * np.linalg.cond(P[i] - V[i])
        for i in range(n)
    )
    scale = site * np.linalg.norm(terms)
    return fixed_point_forward_bound(
        np.linalg.norm(image - m), amplification, scale, n * d + 2 * d + 2
    )


@pytest.mark.parametrize("response", ["site", "prior"])
# undamped Picard is not used: its mean update can have an eigenvalue -1 already for
# J = [[0, 1/2], [1/2, 0]] (see test_undamped_picard_on_tap_can_diverge_where_damping_converges)
@pytest.mark.parametrize("method, damping", [("anderson", 1.0), ("picard", 0.5)])
@given(case=weak_vector_couplings())
def test_gaussian_prior_means_are_linear_solve(response, method, damping, case):
    x, J = case
    n, d = x.shape
    res = adaptive_tap(x, J, response=response, method=method, damping=damping)
    truth = np.linalg.solve(np.eye(n * d) - _big(J), x.ravel()).reshape(n, d)
    solve_error = np.linalg.cond(np.eye(n * d) - _big(J)) * gamma(n * d) * np.linalg.norm(truth)
    P = np.broadcast_to(np.eye(d), (n, d, d))
    assert_norm_within(
        res.means,
        truth,
        _tap_means_bound(res, x, J, P) + solve_error,
        what=f"{response}/{method} means vs (I - J)^-1 x",
    )


@pytest.mark.parametrize(
    "prior", [2.0, np.array([1.5, 3.0]), np.array([[2.0, 0.5], [0.5, 1.0]]), "per-site"]
)
def test_prior_precision_forms(rng, prior):
    n, d = 3, 2
    J = _couplings(rng, n, d, 0.5)
    x = rng.standard_normal((n, d))
    if isinstance(prior, str):
        A = rng.standard_normal((n, d, d))
        prior = np.einsum("iab,icb->iac", A, A) + np.eye(d)
    P = np.broadcast_to(
        np.diag(prior)
        if np.ndim(prior) == 1
        else (prior * np.eye(d) if np.ndim(prior) == 0 else prior),
        (n, d, d),
    )
    res = adaptive_tap(x, J, prior_precision=prior)
    Pbig = np.zeros((n * d, n * d))
    for i in range(n):
        Pbig[i * d : (i + 1) * d, i * d : (i + 1) * d] = P[i]
    truth = np.linalg.solve(Pbig - _big(J), x.ravel()).reshape(n, d)
    solve_error = np.linalg.cond(Pbig - _big(J)) * gamma(n * d) * np.linalg.norm(truth)
    assert_norm_within(
        res.means, truth, _tap_means_bound(res, x, J, P) + solve_error, what="means vs (P - J)^-1 x"
    )


def test_site_reading_gives_exact_gaussian_marginals(rng):
    n, d = 4, 2
    J = _couplings(rng, n, d, 0.6)
    x = rng.standard_normal((n, d))
    res = adaptive_tap(x, J, tol=1e-14)
    chi = np.linalg.inv(np.eye(n * d) - _big(J))
    cond = np.linalg.cond(np.eye(n * d) - _big(J))
    for i in range(n):
        block = chi[i * d : (i + 1) * d, i * d : (i + 1) * d]
        bound = cond**2 * gamma(4 * n * d) * np.abs(block).max()
        assert_within(res.chi_diag[i], block, bound, what=f"chi_ii site {i}")
        site_variance = np.linalg.inv(np.eye(d) - res.cavity_var[i])
        assert_within(site_variance, block, bound, what=f"(Sigma^-1 - V_i)^-1 site {i}")


def test_prior_reading_pins_chi_ii_to_the_prior_covariance(rng):
    n, d = 3, 2
    J = _couplings(rng, n, d, 0.5)
    x = rng.standard_normal((n, d))
    P = np.array([[2.0, 0.5], [0.5, 1.0]])
    res = adaptive_tap(x, J, prior_precision=P, response="prior", tol=1e-14)
    cond = np.linalg.cond(np.eye(n * d) - _big(J))
    for i in range(n):
        assert_within(
            res.chi_diag[i],
            np.linalg.inv(P),
            cond**2 * gamma(4 * n * d) * np.abs(np.linalg.inv(P)).max(),
            what=f"chi_ii site {i} vs Sigma",
        )


def test_adaptive_tap_exact_against_mpmath(rng):
    n, d = 3, 2
    J = _couplings(rng, n, d, 0.6, symmetric=False)
    x = rng.standard_normal((2, n, d))
    P = np.array([[2.0, 0.5], [0.5, 1.0]])
    res = adaptive_tap(x, J, prior_precision=P, precision="exact")
    Pbig = np.kron(np.eye(n), P)
    chi = mp_inverse(Pbig, _big(J))
    with mpmath.workdps(DPS):
        means = np.array(
            [
                chi.dot(np.array([mpmath.mpf(float(v)) for v in xb.ravel()], dtype=object))
                for xb in x
            ],
            dtype=object,
        )
        blocks = [chi[i * d : (i + 1) * d, i * d : (i + 1) * d] for i in range(n)]
        cavity = [
            np.array(
                (mpmath.matrix(P.tolist()) - mpmath.matrix(b.tolist()) ** -1).tolist(), dtype=object
            )
            for b in blocks
        ]
    assert_same_bits(res.means, _nearest_float64(means.reshape(2, n, d)), what="exact means")
    for i in range(n):
        assert_same_bits(res.chi_diag[1, i], _nearest_float64(blocks[i]), what=f"exact chi_ii {i}")
        assert_same_bits(res.cavity_var[0, i], _nearest_float64(cavity[i]), what=f"exact V_{i}")
    assert res.converged.all() and res.precision == "exact" and res.residuals.shape == (2, 0)
    float_res = adaptive_tap(x, J, prior_precision=P)
    bound = max(
        _tap_means_bound(
            type("R", (), {"means": float_res.means[b], "cavity_var": float_res.cavity_var[b]}),
            x[b],
            J,
            np.broadcast_to(P, (n, d, d)),
        )
        for b in range(2)
    )
    assert_norm_within(
        float_res.means,
        res.means,
        bound * np.sqrt(2) + gamma(1) * np.linalg.norm(res.means),
        what="float64 vs exact means",
    )


def test_adaptive_tap_prior_reading_exact_against_mpmath(rng):
    n, d = 2, 2
    J = _couplings(rng, n, d, 0.6, symmetric=False)
    x = rng.standard_normal((2, n, d))
    P = np.array([[2.0, 0.5], [0.5, 1.0]])
    res = adaptive_tap(x, J, prior_precision=P, response="prior", precision="exact")
    with mpmath.workdps(DPS):
        Pm, Jm = mpmath.matrix(np.kron(np.eye(n), P).tolist()), mpmath.matrix(_big(J).tolist())
        sigma = mpmath.matrix(P.tolist()) ** -1

        def equations(*v):
            V = mpmath.zeros(n * d, n * d)
            for i in range(n):
                for a in range(d):
                    for b in range(d):
                        V[i * d + a, i * d + b] = v[i * d * d + a * d + b]
            chi = (Pm + V - Jm) ** -1
            return [
                chi[i * d + a, i * d + b] - sigma[a, b]
                for i in range(n)
                for a in range(d)
                for b in range(d)
            ]

        root = mpmath.findroot(
            equations,
            [mpmath.mpf(float(v)) for v in res.cavity_var[0].ravel()],
            tol=mpmath.mpf(10) ** (-2 * DPS + 10),
        )
        V = np.array([root[k] for k in range(n * d * d)], dtype=object).reshape(n, d, d)
        sigma = np.array(sigma.tolist(), dtype=object)
    means = mp_solve(np.kron(np.eye(n), P), _big(J), x[1].ravel()).reshape(n, d)
    for b in range(2):
        assert_same_bits(
            res.cavity_var[b], _nearest_float64(V), what=f"prior-reading V, sample {b}"
        )
        for i in range(n):
            assert_same_bits(
                res.chi_diag[b, i],
                _nearest_float64(sigma),
                what=f"prior-reading chi_ii = Sigma, site {i}",
            )
    assert_same_bits(res.means[1], _nearest_float64(means), what="prior-reading means")
    with pytest.raises(ValueError, match="N d <= 12"):
        adaptive_tap(np.zeros((7, 2)), np.zeros((7, 7, 2, 2)), response="prior", precision="exact")


def test_adaptive_tap_exact_out_dtype_float32(rng):
    n, d = 3, 2
    J = _couplings(rng, n, d, 0.5)
    x = rng.standard_normal((n, d))
    res = adaptive_tap(x, J, precision="exact", out_dtype=np.float32)
    wide = adaptive_tap(x, J, precision="exact")
    assert res.means.dtype == np.float32 and res.cavity_var.dtype == np.float32
    # rounding the float64 result again may differ from one rounding only within half an ulp
    assert_within(
        res.means,
        wide.means,
        ulp(wide.means, "float32") / 2 + ulp(wide.means, "float64"),
        what="float32 exact means",
    )


def test_adaptive_tap_batch_samples_are_independent(rng):
    n, d = 3, 2
    J = np.stack([_couplings(rng, n, d, 0.1), _couplings(rng, n, d, 0.6)])
    x = rng.standard_normal((2, n, d))
    res = adaptive_tap(x, J)
    assert res.iterations[0] < res.iterations[1]
    for b in range(2):
        alone = adaptive_tap(x[b], J[b])
        assert np.array_equal(alone.means, res.means[b]), f"sample {b}"
        assert alone.iterations == res.iterations[b]


def test_undamped_picard_on_tap_can_diverge_where_damping_converges(rng):
    # the mean update m -> (P - V)^{-1} (J - V) m + ... has spectral radius 1.48 here although
    # rho(J) = 0.6: the Onsager term amplifies; Anderson (default) or damping is needed
    n, d = 3, 2
    _couplings(rng, n, d, 0.1)
    J = _couplings(rng, n, d, 0.6)
    x = rng.standard_normal((2, n, d))[1]
    with pytest.raises(NotConvergedError, match="relative residual"):
        adaptive_tap(x, J, method="picard")
    damped = adaptive_tap(x, J, method="picard", damping=0.5)
    anderson = adaptive_tap(x, J)
    truth = np.linalg.solve(np.eye(n * d) - _big(J), x.ravel()).reshape(n, d)
    solve_error = np.linalg.cond(np.eye(n * d) - _big(J)) * gamma(n * d) * np.linalg.norm(truth)
    P = np.broadcast_to(np.eye(d), (n, d, d))
    for name, res in (("damped picard", damped), ("anderson", anderson)):
        assert_norm_within(
            res.means, truth, _tap_means_bound(res, x, J, P) + solve_error, what=name
        )


def test_adaptive_tap_nonconvergence_reports_residual(rng):
    n, d = 3, 1
    J = _couplings(rng, n, d, 3.0)  # |eigenvalues| up to 3: Picard diverges
    with pytest.raises(NotConvergedError, match="relative residual"):
        adaptive_tap(rng.standard_normal((n, d)), J, method="picard", max_iter=30)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"prior_precision": -1.0}, ValueError, "prior_precision: expected a positive"),
        ({"prior_precision": np.array([1.0, 0.0])}, ValueError, "positive definite"),
        ({"prior_precision": np.array([[1.0, 2.0], [0.0, 1.0]])}, ValueError, "symmetric"),
        ({"prior_precision": np.ones((3,))}, ValueError, "prior_precision: expected a scalar"),
        ({"response": "cavity"}, ValueError, "response"),
        ({"diagonal": "keep"}, ValueError, "diagonal"),
        ({"solver": "x"}, TypeError, "unexpected keyword"),
    ],
)
def test_adaptive_tap_bad_input(rng, kwargs, error, match):
    J = _couplings(rng, 3, 2, 0.5)
    with pytest.raises(error, match=match):
        adaptive_tap(rng.standard_normal((3, 2)), J, **kwargs)


def test_nonzero_diagonal_blocks(rng):
    J = _couplings(rng, 3, 2, 0.5)
    x = rng.standard_normal((3, 2))
    selfish = J.copy()
    selfish[1, 1] = 0.25
    with pytest.raises(ValueError, match=r"self-coupling .* index \[1"):
        adaptive_tap(x, selfish)
    zeroed = adaptive_tap(x, selfish, diagonal="zero")
    assert np.array_equal(zeroed.means, adaptive_tap(x, J).means)
    with pytest.raises(ValueError, match="self-coupling"):
        deq_attention(x, selfish)
    with pytest.raises(ValueError, match="self-coupling"):
        ising_tap(np.ones(2), np.eye(2))


# ----------------------------------------------------------------------------- binary spins


@pytest.fixture
def ising_case(rng):
    n = 4
    J = rng.standard_normal((n, n)) / np.sqrt(n) * 0.5
    J = (J + J.T) / 2
    np.fill_diagonal(J, 0.0)
    return rng.standard_normal((2, n)), J


def test_ising_exact_against_mpmath(ising_case):
    x, J = ising_case
    res = ising_tap(x, J, precision="exact")
    for b in range(2):
        m, V, chi = mp_ising(x[b], J, res.means[b], res.cavity_var[b])
        assert_same_bits(res.means[b], _nearest_float64(m), what=f"ising means {b}")
        assert_same_bits(res.cavity_var[b], _nearest_float64(V), what=f"ising V {b}")
        assert_same_bits(res.chi_diag[b], _nearest_float64(chi), what=f"ising chi_ii {b}")


def _ising_map(state, J, x):
    """The printed update (eqs. (14), (10), (8), (11)) on the joint state (m, V)."""
    n = len(x)
    m, V = state[:n], state[n:]
    h = J @ m - V * m + x
    lam = V + np.cosh(h) ** 2
    return np.concatenate([np.tanh(h), lam - 1 / np.diag(np.linalg.inv(np.diag(lam) - J))])


def test_ising_float64_close_to_exact(ising_case):
    x, J = ising_case
    exact = ising_tap(x, J, precision="exact")
    approx = ising_tap(x, J)
    eps = np.sqrt(unit_roundoff("float64"))  # central-difference step: error O(eps^2) = O(u)
    for b in range(2):
        z = np.concatenate([approx.means[b], approx.cavity_var[b]])
        truth = np.concatenate([exact.means[b], exact.cavity_var[b]])
        eye = np.eye(len(z))
        jacobian = np.stack(
            [
                (_ising_map(z + eps * e, J, x[b]) - _ising_map(z - eps * e, J, x[b])) / (2 * eps)
                for e in eye
            ],
            axis=1,
        )
        # z - z* = (I - Phi')^{-1} (z - Phi(z)) to first order; the factor 2 covers the
        # second-order remainder at residuals of 1e-10
        amplification = 2 * np.linalg.norm(np.linalg.inv(eye - jacobian), 2)
        image = _ising_map(z, J, x[b])
        n = len(x[b])
        lam = z[n:] + np.cosh(J @ z[:n] - z[n:] * z[:n] + x[b]) ** 2
        scale = np.linalg.norm(image) * np.linalg.cond(np.diag(lam) - J)
        bound = fixed_point_forward_bound(np.linalg.norm(image - z), amplification, scale, 4 * n**2)
        assert_norm_within(
            z,
            truth,
            bound + gamma(1) * np.linalg.norm(truth),
            what=f"ising float64 (m, V) sample {b}",
        )


def test_ising_uncoupled_is_tanh(rng):
    x = rng.standard_normal((3,))
    J = np.zeros((3, 3))
    res = ising_tap(x, J, precision="exact")
    with mpmath.workdps(DPS):
        tanh = np.array([mpmath.tanh(mpmath.mpf(float(v))) for v in x], dtype=object)
        assert_same_bits(res.means, _nearest_float64(tanh), what="uncoupled means")
        assert_same_bits(
            res.chi_diag,
            _nearest_float64(np.array([1 - t**2 for t in tanh], dtype=object)),
            what="uncoupled chi",
        )
    assert np.array_equal(res.cavity_var, np.zeros(3))  # isolated sites: V_i = 0 exactly
    approx = ising_tap(x, J)
    assert_within(approx.means, np.tanh(x), gamma(4) * np.abs(np.tanh(x)), what="uncoupled float64")


def test_ising_zero_field_gives_exact_zero_means():
    J = np.array([[0.0, 0.3, 0.0], [0.3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    res = ising_tap(np.zeros(3), J, precision="exact")
    assert np.array_equal(res.means, np.zeros(3)) and not np.signbit(res.means).any()
    assert res.cavity_var[2] == 0.0 and res.cavity_var[0] > 0
    _, V, _ = mp_ising(np.zeros(3), J, np.zeros(3), res.cavity_var)
    assert_same_bits(res.cavity_var, _nearest_float64(V), what="zero-field V")


def test_ising_bad_input():
    with pytest.raises(ValueError, match=r"J: expected shape \(\.\.\., N, N\)"):
        ising_tap(np.zeros(3), np.zeros((3, 2)))
    with pytest.raises(TypeError, match="x: expected a float array"):
        ising_tap(np.zeros(3, dtype=int), np.zeros((3, 3)))


# ----------------------------------------------------------------------------- DEQ attention


def test_deq_without_correction_is_linear_solve(rng):
    n, d = 4, 2
    J = _couplings(rng, n, d, 0.7, symmetric=False)
    x = rng.standard_normal((3, n, d))
    res = deq_attention(x, J)
    exact = deq_attention(x, J, precision="exact")
    for b in range(3):
        truth = mp_solve(np.eye(n * d), _big(J), x[b].ravel())
        assert_same_bits(
            exact.means[b], _nearest_float64(truth.reshape(n, d)), what=f"deq exact sample {b}"
        )
        A = _big(J)
        residual = np.linalg.norm(A @ res.means[b].ravel() + x[b].ravel() - res.means[b].ravel())
        scale = np.linalg.norm(np.abs(A) @ np.abs(res.means[b].ravel()) + np.abs(x[b].ravel()))
        bound = fixed_point_forward_bound(
            residual, np.linalg.norm(np.linalg.inv(np.eye(n * d) - A), 2), scale, n * d + 1
        )
        assert_norm_within(
            res.means[b],
            exact.means[b],
            bound + gamma(1) * np.linalg.norm(exact.means[b]),
            what=f"deq float64 sample {b}",
        )


@given(case=weak_vector_couplings(strength=0.9))
def test_deq_fixed_point_property(case):
    # z = J z - f(z) + x with f = z / 4: the fixed point solves (5/4 I - J) z = x
    x, J = case
    n, d = x.shape
    res = deq_attention(x, J, lambda z: z * 0.25)
    A = _big(J) - 0.25 * np.eye(n * d)
    z = res.means.ravel()
    residual = np.linalg.norm(A @ z + x.ravel() - z)
    scale = np.linalg.norm(np.abs(_big(J)) @ np.abs(z) + 0.25 * np.abs(z) + np.abs(x.ravel()))
    truth = np.linalg.solve(np.eye(n * d) - A, x.ravel())
    solve_error = np.linalg.cond(np.eye(n * d) - A) * gamma(n * d) * np.linalg.norm(truth)
    bound = fixed_point_forward_bound(
        residual, np.linalg.norm(np.linalg.inv(np.eye(n * d) - A), 2), scale, n * d + 2
    )
    assert_norm_within(z, truth, bound + solve_error, what="deq linear correction")


def _half_tanh(z):
    if z.dtype == object:  # the exact path passes interval arrays
        return I.tanh(z) * 0.5
    return 0.5 * np.tanh(z)


def test_deq_with_corrections_exact_against_mpmath(rng):
    n, d = 3, 2
    J = rng.standard_normal((n, n, d, d))
    J[np.arange(n), np.arange(n)] = 0.0
    J *= 0.4 / np.abs(J).sum(axis=(1, 3)).max()  # ||J||_inf = 0.4
    x = rng.standard_normal((n, d))
    linear = deq_attention(x, J, lambda z: z * 0.25, precision="exact", lipschitz=0.25)
    truth = mp_solve(1.25 * np.eye(n * d), _big(J), x.ravel())
    assert_same_bits(
        linear.means, _nearest_float64(truth.reshape(n, d)), what="deq linear correction"
    )
    res = deq_attention(x, J, _half_tanh, precision="exact", lipschitz=0.5)
    with mpmath.workdps(DPS):
        A = mpmath.matrix(_big(J).tolist())
        xs = [mpmath.mpf(float(v)) for v in x.ravel()]

        def equations(*z):
            return [
                mpmath.fsum(A[i, j] * z[j] for j in range(n * d))
                - mpmath.tanh(z[i]) / 2
                + xs[i]
                - z[i]
                for i in range(n * d)
            ]

        root = mpmath.findroot(
            equations,
            [mpmath.mpf(float(v)) for v in res.means.ravel()],
            tol=mpmath.mpf(10) ** (-2 * DPS + 10),
        )
        truth = np.array([root[i] for i in range(n * d)], dtype=object).reshape(n, d)
    assert_same_bits(res.means, _nearest_float64(truth), what="deq tanh correction")
    approx = deq_attention(x, J, _half_tanh)
    image = np.einsum("ijab,jb->ia", J, approx.means) - _half_tanh(approx.means) + x
    scale = np.linalg.norm(
        np.einsum("ijab,jb->ia", np.abs(J), np.abs(approx.means))
        + np.abs(_half_tanh(approx.means))
        + np.abs(x)
    )
    bound = fixed_point_forward_bound(
        np.linalg.norm(image - approx.means), 1 / (1 - 0.9), scale * np.sqrt(n * d), n * d + 3
    )
    assert_norm_within(
        approx.means,
        res.means,
        bound + gamma(1) * np.linalg.norm(res.means),
        what="deq tanh float64",
    )


def test_deq_softmax_couplings_keep_the_diagonal(rng):
    N, d = 4, 3
    X = rng.standard_normal((N, d))
    WQ, WK, WV = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(3))
    _, J, _ = _softmax_couplings(X, WQ, WK, WV)
    J *= 0.5 / np.linalg.norm(_big(J), 2)
    with pytest.raises(ValueError, match="self-coupling"):
        deq_attention(X, J)
    res = deq_attention(X, J, diagonal="keep")
    exact = deq_attention(X, J, diagonal="keep", precision="exact")
    truth = mp_solve(np.eye(N * d), _big(J), X.ravel())
    assert_same_bits(
        exact.means, _nearest_float64(truth.reshape(N, d)), what="deq softmax couplings"
    )
    amplification = np.linalg.norm(np.linalg.inv(np.eye(N * d) - _big(J)), 2)
    image = np.einsum("ijab,jb->ia", J, res.means) + X
    scale = np.linalg.norm(np.einsum("ijab,jb->ia", np.abs(J), np.abs(res.means)) + np.abs(X))
    assert_norm_within(
        res.means,
        exact.means,
        fixed_point_forward_bound(
            np.linalg.norm(image - res.means), amplification, scale, N * d + 1
        )
        + gamma(1) * np.linalg.norm(exact.means),
        what="deq softmax float64",
    )


def test_deq_per_sample_iterations_and_z0(rng):
    n, d = 3, 2
    J = np.stack([_couplings(rng, n, d, 0.05), _couplings(rng, n, d, 0.95)])
    x = rng.standard_normal((2, n, d))
    res = deq_attention(x, J, method="picard", max_iter=2000)
    assert res.converged.all() and res.iterations[0] < res.iterations[1]
    warm = deq_attention(x, J, z0=res.means, method="picard")
    assert (warm.iterations <= 1).all()


def test_deq_exact_needs_a_contraction_certificate(rng):
    n, d = 3, 1
    J = _couplings(rng, n, d, 0.5)
    x = rng.standard_normal((n, d))
    with pytest.raises(ValueError, match="lipschitz"):
        deq_attention(x, J, _half_tanh, precision="exact")
    with pytest.raises(ValueError, match=">= 1"):
        deq_attention(x, J, _half_tanh, precision="exact", lipschitz=1.0)
    with pytest.raises(TypeError, match="correction"):
        deq_attention(x, J, correction=3.0)


# ----------------------------------------------------------------------------- larger sizes


@pytest.mark.slow
def test_exact_paths_at_the_documented_sizes(rng):
    # N = 8, d = 4: closed forms (adaptive TAP "site", DEQ without correction) and the
    # certified binary-spin TAP at N = 8; each against its float64 result
    n, d = 8, 4
    J = _couplings(rng, n, d, 0.5)
    x = rng.standard_normal((n, d))
    exact = adaptive_tap(x, J, precision="exact")
    approx = adaptive_tap(x, J)
    P = np.broadcast_to(np.eye(d), (n, d, d))
    assert_norm_within(
        approx.means,
        exact.means,
        _tap_means_bound(approx, x, J, P) + gamma(1) * np.linalg.norm(exact.means),
        what="N=8 d=4 adaptive TAP",
    )
    deq = deq_attention(x, J, precision="exact")
    assert np.array_equal(deq.means, exact.means)  # both are (I - J)^{-1} x rounded once
    spins = rng.standard_normal((n, n)) / np.sqrt(n) * 0.5
    spins = (spins + spins.T) / 2
    np.fill_diagonal(spins, 0.0)
    fields = rng.standard_normal(n)
    res = ising_tap(fields, spins, precision="exact")
    m, V, chi = mp_ising(fields, spins, res.means, res.cavity_var)
    assert_same_bits(res.means, _nearest_float64(m), what="N=8 ising means")
    assert_same_bits(res.cavity_var, _nearest_float64(V), what="N=8 ising V")
