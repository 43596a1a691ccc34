"""Tests of refattn.meanfield (Bal 2021): naive step, vector adaptive TAP, binary-spin TAP, DEQ
attention; float64 against closed forms and the exact path, exact path against independent
mpmath computations (tests/naive.py style: written here without refattn)."""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given

from oracle.tolerance import fixed_point_forward_bound, gamma, ulp, unit_roundoff
from refattn.exact import intervals as I
from refattn.fixedpoint import NotConvergedError
from refattn.meanfield import adaptive_tap, deq_attention, ising_tap, naive_step
from tests.strategies import weak_vector_couplings

try:
    from refattn.attention import attention
except ImportError:  # pragma: no cover - the lead's module lands separately
    attention = None

DPS = 50


# ----------------------------------------------------------------------------- helpers


def _big(J):
    n, _, d, _ = J.shape[-4:]
    return np.swapaxes(J, -3, -2).reshape(*J.shape[:-4], n * d, n * d)


def _assert_bound(case, value, truth, bound):
    """Elementwise |value - truth| <= bound; names the worst element."""
    __tracebackhide__ = True
    value, truth = np.asarray(value, dtype=np.float64), np.asarray(truth, dtype=np.float64)
    excess = np.abs(value - truth) - np.broadcast_to(bound, value.shape)
    worst = np.unravel_index(int(np.argmax(excess)), value.shape)
    if excess[worst] > 0:
        raise AssertionError(
            f"{case}: element {list(worst)} value {value[worst]!r} truth {truth[worst]!r} "
            f"error {abs(value[worst] - truth[worst]):.3e} > bound "
            f"{np.broadcast_to(bound, value.shape)[worst]:.3e}")


def _assert_norm_bound(case, value, truth, bound):
    __tracebackhide__ = True
    error = float(np.linalg.norm(np.asarray(value) - np.asarray(truth)))
    if error > bound:
        worst = np.unravel_index(int(np.argmax(np.abs(value - truth))), np.shape(value))
        raise AssertionError(f"{case}: 2-norm error {error:.3e} > bound {bound:.3e}; worst "
                             f"element {list(worst)} value {value[worst]!r} truth {truth[worst]!r}")


def _assert_rounded(case, value, truth_mp):
    """value is truth (an mpf array at DPS digits) rounded to nearest float64."""
    __tracebackhide__ = True
    with mpmath.workdps(DPS):
        expected = np.vectorize(lambda t: float(mpmath.mpf(t)), otypes=[float])(truth_mp)
    mismatch = ~((value == expected) & (np.signbit(value) == np.signbit(expected)))
    if mismatch.any():
        worst = tuple(np.argwhere(mismatch)[0])
        raise AssertionError(f"{case}: element {list(worst)} is {value[worst]!r}, the correctly "
                             f"rounded truth is {expected[worst]!r} ({truth_mp[worst]})")


def _mp_matrix(P, J):
    """P - J at DPS digits, both float matrices taken exactly (no float subtraction)."""
    return mpmath.matrix(P.tolist()) - mpmath.matrix(J.tolist())


def _mp_solve(P, J, rhs):
    """Solve (P - J) y = rhs (float arrays taken exactly) at DPS digits."""
    with mpmath.workdps(DPS):
        y = mpmath.lu_solve(_mp_matrix(P, J), mpmath.matrix([float(v) for v in rhs]))
        return np.array([y[i] for i in range(len(rhs))], dtype=object)


def _mp_inverse(P, J):
    with mpmath.workdps(DPS):
        inv = _mp_matrix(P, J) ** -1
        return np.array([[inv[i, j] for j in range(inv.cols)] for i in range(inv.rows)],
                        dtype=object)


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


def _fraction_naive_step(m, J, x):
    n, d = m.shape
    return [[sum((Fraction(float(J[i, j, a, b])) * Fraction(float(m[j, b]))
                  for j in range(n) for b in range(d)), Fraction(float(x[i, a])))
             for a in range(d)] for i in range(n)]


@given(case=weak_vector_couplings())
def test_naive_step_exact_is_correctly_rounded_and_float64_within_gamma(case):
    x, J = case
    m = np.tanh(x[::-1] * 3.0)
    exact = naive_step(m, J, x, precision="exact")
    truth = _fraction_naive_step(m, J, x)
    expected = np.array([[float(v) for v in row] for row in truth])  # Fraction -> float: RN
    assert np.array_equal(exact, expected), "naive_step exact is not the rounded exact sum"
    n, d = x.shape
    bound = gamma(n * d + 1) * (np.einsum("ijab,jb->ia", np.abs(J), np.abs(m)) + np.abs(x))
    _assert_bound("naive_step float64", naive_step(m, J, x), expected, bound)


def test_naive_step_exact_float32_half_ulp(rng):
    x = rng.standard_normal((3, 2))
    J = rng.standard_normal((3, 3, 2, 2))
    m = rng.standard_normal((3, 2))
    out = naive_step(m.astype(np.float32), J.astype(np.float32), x.astype(np.float32),
                     precision="exact", out_dtype=np.float32)
    assert out.dtype == np.float32
    truth = _fraction_naive_step(m.astype(np.float32), J.astype(np.float32),
                                 x.astype(np.float32))
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


@pytest.mark.skipif(attention is None, reason="refattn.attention not available")
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
    _assert_bound("attention + X vs naive_step", step, out, bound)
    # exact path: attention's exact output + X differs from the exact naive step on the
    # exactly rounded weights by the weight rounding, u |w| |X W_V|, and three roundings
    exact_weights = refattn_softmax_exact(X @ WQ, X @ WK)
    J_exact = np.einsum("ij,ba->ijab", exact_weights, WV)
    exact_step = naive_step(X, J_exact, X, precision="exact")
    exact_attn = attention(X @ WQ, X @ WK, X @ WV, precision="exact")
    bound = gamma(1) * exact_weights @ value_size + gamma(3) * (nat + np.abs(X)) \
        + gamma(d) * nat
    _assert_bound("exact attention + X vs exact naive_step", exact_step, exact_attn + X, bound)


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
        naive_step(np.full((2, 1), np.inf), np.zeros((2, 2, 1, 1)), np.zeros((2, 1)),
                   precision="exact")


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
        Pbig[i * d:(i + 1) * d, i * d:(i + 1) * d] = P[i]
    Vbig = np.zeros_like(Pbig)
    for i in range(n):
        Vbig[i * d:(i + 1) * d, i * d:(i + 1) * d] = V[i]
    amplification = np.linalg.norm(np.linalg.solve(Pbig - _big(J), Pbig - Vbig), 2)
    terms = np.einsum("ijab,jb->ia", np.abs(J), np.abs(m)) + np.einsum(
        "iab,ib->ia", np.abs(V), np.abs(m)) + np.abs(x)
    site = max(np.linalg.norm(np.linalg.inv(P[i] - V[i]), 2) * np.linalg.cond(P[i] - V[i])
               for i in range(n))
    scale = site * np.linalg.norm(terms)
    return fixed_point_forward_bound(np.linalg.norm(image - m), amplification, scale,
                                     n * d + 2 * d + 2)


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
    _assert_norm_bound(f"{response}/{method} means vs (I - J)^-1 x", res.means, truth,
                       _tap_means_bound(res, x, J, P) + solve_error)


@pytest.mark.parametrize(
    "prior", [2.0, np.array([1.5, 3.0]), np.array([[2.0, 0.5], [0.5, 1.0]]), "per-site"])
def test_prior_precision_forms(rng, prior):
    n, d = 3, 2
    J = _couplings(rng, n, d, 0.5)
    x = rng.standard_normal((n, d))
    if isinstance(prior, str):
        A = rng.standard_normal((n, d, d))
        prior = np.einsum("iab,icb->iac", A, A) + np.eye(d)
    P = np.broadcast_to(np.diag(prior) if np.ndim(prior) == 1 else
                        (prior * np.eye(d) if np.ndim(prior) == 0 else prior), (n, d, d))
    res = adaptive_tap(x, J, prior_precision=prior)
    Pbig = np.zeros((n * d, n * d))
    for i in range(n):
        Pbig[i * d:(i + 1) * d, i * d:(i + 1) * d] = P[i]
    truth = np.linalg.solve(Pbig - _big(J), x.ravel()).reshape(n, d)
    solve_error = np.linalg.cond(Pbig - _big(J)) * gamma(n * d) * np.linalg.norm(truth)
    _assert_norm_bound("means vs (P - J)^-1 x", res.means, truth,
                       _tap_means_bound(res, x, J, P) + solve_error)


def test_site_reading_gives_exact_gaussian_marginals(rng):
    n, d = 4, 2
    J = _couplings(rng, n, d, 0.6)
    x = rng.standard_normal((n, d))
    res = adaptive_tap(x, J, tol=1e-14)
    chi = np.linalg.inv(np.eye(n * d) - _big(J))
    cond = np.linalg.cond(np.eye(n * d) - _big(J))
    for i in range(n):
        block = chi[i * d:(i + 1) * d, i * d:(i + 1) * d]
        bound = cond ** 2 * gamma(4 * n * d) * np.abs(block).max()
        _assert_bound(f"chi_ii site {i}", res.chi_diag[i], block, bound)
        site_variance = np.linalg.inv(np.eye(d) - res.cavity_var[i])
        _assert_bound(f"(Sigma^-1 - V_i)^-1 site {i}", site_variance, block, bound)


def test_prior_reading_pins_chi_ii_to_the_prior_covariance(rng):
    n, d = 3, 2
    J = _couplings(rng, n, d, 0.5)
    x = rng.standard_normal((n, d))
    P = np.array([[2.0, 0.5], [0.5, 1.0]])
    res = adaptive_tap(x, J, prior_precision=P, response="prior", tol=1e-14)
    cond = np.linalg.cond(np.eye(n * d) - _big(J))
    for i in range(n):
        _assert_bound(f"chi_ii site {i} vs Sigma", res.chi_diag[i], np.linalg.inv(P),
                      cond ** 2 * gamma(4 * n * d) * np.abs(np.linalg.inv(P)).max())


def test_adaptive_tap_exact_against_mpmath(rng):
    n, d = 3, 2
    J = _couplings(rng, n, d, 0.6, symmetric=False)
    x = rng.standard_normal((2, n, d))
    P = np.array([[2.0, 0.5], [0.5, 1.0]])
    res = adaptive_tap(x, J, prior_precision=P, precision="exact")
    Pbig = np.kron(np.eye(n), P)
    chi = _mp_inverse(Pbig, _big(J))
    with mpmath.workdps(DPS):
        means = np.array([chi.dot(np.array([mpmath.mpf(float(v)) for v in xb.ravel()],
                                           dtype=object)) for xb in x], dtype=object)
        blocks = [chi[i * d:(i + 1) * d, i * d:(i + 1) * d] for i in range(n)]
        cavity = [np.array((mpmath.matrix(P.tolist()) - mpmath.matrix(b.tolist()) ** -1)
                           .tolist(), dtype=object) for b in blocks]
    _assert_rounded("exact means", res.means, means.reshape(2, n, d))
    for i in range(n):
        _assert_rounded(f"exact chi_ii {i}", res.chi_diag[1, i], blocks[i])
        _assert_rounded(f"exact V_{i}", res.cavity_var[0, i], cavity[i])
    assert res.converged.all() and res.precision == "exact" and res.residuals.shape == (2, 0)
    float_res = adaptive_tap(x, J, prior_precision=P)
    bound = max(_tap_means_bound(
        type("R", (), {"means": float_res.means[b], "cavity_var": float_res.cavity_var[b]}),
        x[b], J, np.broadcast_to(P, (n, d, d))) for b in range(2))
    _assert_norm_bound("float64 vs exact means", float_res.means, res.means,
                       bound * np.sqrt(2) + gamma(1) * np.linalg.norm(res.means))


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
            return [chi[i * d + a, i * d + b] - sigma[a, b]
                    for i in range(n) for a in range(d) for b in range(d)]

        root = mpmath.findroot(equations, [mpmath.mpf(float(v)) for v in
                                           res.cavity_var[0].ravel()],
                               tol=mpmath.mpf(10) ** (-2 * DPS + 10))
        V = np.array([root[k] for k in range(n * d * d)], dtype=object).reshape(n, d, d)
        sigma = np.array(sigma.tolist(), dtype=object)
    means = _mp_solve(np.kron(np.eye(n), P), _big(J), x[1].ravel()).reshape(n, d)
    for b in range(2):
        _assert_rounded(f"prior-reading V, sample {b}", res.cavity_var[b], V)
        for i in range(n):
            _assert_rounded(f"prior-reading chi_ii = Sigma, site {i}", res.chi_diag[b, i], sigma)
    _assert_rounded("prior-reading means", res.means[1], means)
    with pytest.raises(ValueError, match="N d <= 12"):
        adaptive_tap(np.zeros((7, 2)), np.zeros((7, 7, 2, 2)), response="prior",
                     precision="exact")


def test_adaptive_tap_exact_out_dtype_float32(rng):
    n, d = 3, 2
    J = _couplings(rng, n, d, 0.5)
    x = rng.standard_normal((n, d))
    res = adaptive_tap(x, J, precision="exact", out_dtype=np.float32)
    wide = adaptive_tap(x, J, precision="exact")
    assert res.means.dtype == np.float32 and res.cavity_var.dtype == np.float32
    # rounding the float64 result again may differ from one rounding only within half an ulp
    _assert_bound("float32 exact means", res.means, wide.means,
                  ulp(wide.means, "float32") / 2 + ulp(wide.means, "float64"))


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
        _assert_norm_bound(name, res.means, truth, _tap_means_bound(res, x, J, P) + solve_error)


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


def _mp_ising(x, J, m0, V0):
    """TAP fixed point (m, V, chi_ii) by mpmath findroot on the equations as printed."""
    n = len(x)
    with mpmath.workdps(DPS):
        Jm = mpmath.matrix(J.tolist())
        xs = [mpmath.mpf(float(v)) for v in x]

        def equations(*u):
            m, V = u[:n], u[n:]
            lam = mpmath.diag([V[i] + 1 / (1 - m[i] ** 2) for i in range(n)])
            chi = (lam - Jm) ** -1
            return ([m[i] - mpmath.tanh(mpmath.fsum(Jm[i, j] * m[j] for j in range(n))
                                        - V[i] * m[i] + xs[i]) for i in range(n)]
                    + [chi[i, i] - (1 - m[i] ** 2) for i in range(n)])

        root = mpmath.findroot(equations, [mpmath.mpf(float(v)) for v in (*m0, *V0)],
                               tol=mpmath.mpf(10) ** (-2 * DPS + 10))
        m, V = [root[i] for i in range(n)], [root[n + i] for i in range(n)]
        return (np.array(m, dtype=object), np.array(V, dtype=object),
                np.array([1 - v ** 2 for v in m], dtype=object))


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
        m, V, chi = _mp_ising(x[b], J, res.means[b], res.cavity_var[b])
        _assert_rounded(f"ising means {b}", res.means[b], m)
        _assert_rounded(f"ising V {b}", res.cavity_var[b], V)
        _assert_rounded(f"ising chi_ii {b}", res.chi_diag[b], chi)


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
        jacobian = np.stack([(_ising_map(z + eps * e, J, x[b]) - _ising_map(z - eps * e, J,
                             x[b])) / (2 * eps) for e in eye], axis=1)
        # z - z* = (I - Phi')^{-1} (z - Phi(z)) to first order; the factor 2 covers the
        # second-order remainder at residuals of 1e-10
        amplification = 2 * np.linalg.norm(np.linalg.inv(eye - jacobian), 2)
        image = _ising_map(z, J, x[b])
        n = len(x[b])
        lam = z[n:] + np.cosh(J @ z[:n] - z[n:] * z[:n] + x[b]) ** 2
        scale = np.linalg.norm(image) * np.linalg.cond(np.diag(lam) - J)
        bound = fixed_point_forward_bound(np.linalg.norm(image - z), amplification, scale,
                                          4 * n ** 2)
        _assert_norm_bound(f"ising float64 (m, V) sample {b}", z, truth,
                           bound + gamma(1) * np.linalg.norm(truth))


def test_ising_uncoupled_is_tanh(rng):
    x = rng.standard_normal((3,))
    J = np.zeros((3, 3))
    res = ising_tap(x, J, precision="exact")
    with mpmath.workdps(DPS):
        tanh = np.array([mpmath.tanh(mpmath.mpf(float(v))) for v in x], dtype=object)
        _assert_rounded("uncoupled means", res.means, tanh)
        _assert_rounded("uncoupled chi", res.chi_diag,
                        np.array([1 - t ** 2 for t in tanh], dtype=object))
    assert np.array_equal(res.cavity_var, np.zeros(3))  # isolated sites: V_i = 0 exactly
    approx = ising_tap(x, J)
    _assert_bound("uncoupled float64", approx.means, np.tanh(x), gamma(4) * np.abs(np.tanh(x)))


def test_ising_zero_field_gives_exact_zero_means():
    J = np.array([[0.0, 0.3, 0.0], [0.3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    res = ising_tap(np.zeros(3), J, precision="exact")
    assert np.array_equal(res.means, np.zeros(3)) and not np.signbit(res.means).any()
    assert res.cavity_var[2] == 0.0 and res.cavity_var[0] > 0
    _, V, _ = _mp_ising(np.zeros(3), J, np.zeros(3), res.cavity_var)
    _assert_rounded("zero-field V", res.cavity_var, V)


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
        truth = _mp_solve(np.eye(n * d), _big(J), x[b].ravel())
        _assert_rounded(f"deq exact sample {b}", exact.means[b], truth.reshape(n, d))
        A = _big(J)
        residual = np.linalg.norm(A @ res.means[b].ravel() + x[b].ravel()
                                  - res.means[b].ravel())
        scale = np.linalg.norm(np.abs(A) @ np.abs(res.means[b].ravel()) + np.abs(x[b].ravel()))
        bound = fixed_point_forward_bound(residual, np.linalg.norm(np.linalg.inv(
            np.eye(n * d) - A), 2), scale, n * d + 1)
        _assert_norm_bound(f"deq float64 sample {b}", res.means[b], exact.means[b],
                           bound + gamma(1) * np.linalg.norm(exact.means[b]))


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
    bound = fixed_point_forward_bound(residual, np.linalg.norm(np.linalg.inv(np.eye(n * d) - A),
                                                               2), scale, n * d + 2)
    _assert_norm_bound("deq linear correction", z, truth, bound + solve_error)


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
    truth = _mp_solve(1.25 * np.eye(n * d), _big(J), x.ravel())
    _assert_rounded("deq linear correction", linear.means, truth.reshape(n, d))
    res = deq_attention(x, J, _half_tanh, precision="exact", lipschitz=0.5)
    with mpmath.workdps(DPS):
        A = mpmath.matrix(_big(J).tolist())
        xs = [mpmath.mpf(float(v)) for v in x.ravel()]

        def equations(*z):
            return [mpmath.fsum(A[i, j] * z[j] for j in range(n * d)) - mpmath.tanh(z[i]) / 2
                    + xs[i] - z[i] for i in range(n * d)]

        root = mpmath.findroot(equations, [mpmath.mpf(float(v)) for v in res.means.ravel()],
                               tol=mpmath.mpf(10) ** (-2 * DPS + 10))
        truth = np.array([root[i] for i in range(n * d)], dtype=object).reshape(n, d)
    _assert_rounded("deq tanh correction", res.means, truth)
    approx = deq_attention(x, J, _half_tanh)
    image = np.einsum("ijab,jb->ia", J, approx.means) - _half_tanh(approx.means) + x
    scale = np.linalg.norm(np.einsum("ijab,jb->ia", np.abs(J), np.abs(approx.means))
                           + np.abs(_half_tanh(approx.means)) + np.abs(x))
    bound = fixed_point_forward_bound(np.linalg.norm(image - approx.means), 1 / (1 - 0.9),
                                      scale * np.sqrt(n * d), n * d + 3)
    _assert_norm_bound("deq tanh float64", approx.means, res.means,
                       bound + gamma(1) * np.linalg.norm(res.means))


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
    truth = _mp_solve(np.eye(N * d), _big(J), X.ravel())
    _assert_rounded("deq softmax couplings", exact.means, truth.reshape(N, d))
    amplification = np.linalg.norm(np.linalg.inv(np.eye(N * d) - _big(J)), 2)
    image = np.einsum("ijab,jb->ia", J, res.means) + X
    scale = np.linalg.norm(np.einsum("ijab,jb->ia", np.abs(J), np.abs(res.means)) + np.abs(X))
    _assert_norm_bound("deq softmax float64", res.means, exact.means,
                       fixed_point_forward_bound(np.linalg.norm(image - res.means),
                                                 amplification, scale, N * d + 1)
                       + gamma(1) * np.linalg.norm(exact.means))


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
    _assert_norm_bound("N=8 d=4 adaptive TAP", approx.means, exact.means,
                       _tap_means_bound(approx, x, J, P) + gamma(1) * np.linalg.norm(exact.means))
    deq = deq_attention(x, J, precision="exact")
    assert np.array_equal(deq.means, exact.means)  # both are (I - J)^{-1} x rounded once
    spins = rng.standard_normal((n, n)) / np.sqrt(n) * 0.5
    spins = (spins + spins.T) / 2
    np.fill_diagonal(spins, 0.0)
    fields = rng.standard_normal(n)
    res = ising_tap(fields, spins, precision="exact")
    m, V, chi = _mp_ising(fields, spins, res.means, res.cavity_var)
    _assert_rounded("N=8 ising means", res.means, m)
    _assert_rounded("N=8 ising V", res.cavity_var, V)
