"""Vector-Jacobian products of refattn.meanfield (Bal 2021): adaptive TAP, binary-spin TAP and
deep implicit attention, by implicit differentiation.

References: mpmath central differences with a Richardson step on the fixed points as printed
(tests/naive/meanfield.py, no refattn code), and torch autograd of an independent float64
implementation of the printed updates (implicit differentiation with torch's Jacobians at the
converged fixed point). Thresholds come from refattn.bounds.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest

from refattn.bounds import fixed_point_forward_bound, gamma, implicit_vjp_bound
from refattn.exact import intervals as I
from refattn.meanfield import (
    adaptive_tap,
    adaptive_tap_vjp,
    deq_attention,
    deq_attention_vjp,
    ising_tap,
    ising_tap_vjp,
    softmax_couplings,
    softmax_couplings_vjp,
)
from tests.helpers import assert_norm_within, assert_same_bits, assert_within
from tests.naive.meanfield import (
    DPS,
    deq_loss,
    ising_loss,
    linear_means_loss,
    mp_softmax_couplings,
    richardson_gradient,
)

# ----------------------------------------------------------------------------- helpers


def _big(J):
    n, _, d, _ = J.shape[-4:]
    return np.swapaxes(J, -3, -2).reshape(*J.shape[:-4], n * d, n * d)


def _couplings(rng, n, d, strength):
    J = rng.standard_normal((n, n, d, d))
    J[np.arange(n), np.arange(n)] = 0.0
    return J * (strength / np.abs(_big(J)).sum(axis=1).max())  # ||J||_inf = strength


def _off_diagonal(shape):
    n = shape[0]
    free = np.ones(shape, dtype=bool)
    free[np.arange(n), np.arange(n)] = False
    return free


def assert_rounds_to(value, grad, error, *, what):
    """``value`` is the float64 rounding of the true gradient, known to lie in
    ``grad +- error`` (mpf arrays): bit-identical where the whole interval rounds to one
    float64, else one of the two roundings of its ends."""
    __tracebackhide__ = True
    with mpmath.workdps(DPS):
        lo = np.vectorize(lambda g, e: float(g - e), otypes=[float])(grad, error)
        hi = np.vectorize(lambda g, e: float(g + e), otypes=[float])(grad, error)
    decided = lo == hi
    assert_same_bits(np.where(decided, value, lo), lo, what=what + " (decided elements)")
    assert ((value >= lo) & (value <= hi)).all(), f"{what}: outside the Richardson interval"


def _richardson(loss, x, J, free_J):
    theta = np.concatenate([x.ravel(), J.ravel()])
    free = np.concatenate([np.ones(x.size, bool), free_J.ravel()])
    grad, error = richardson_gradient(loss, theta, free, DPS)
    return (
        grad[: x.size].reshape(x.shape),
        error[: x.size].reshape(x.shape),
        grad[x.size :].reshape(J.shape),
        error[x.size :].reshape(J.shape),
    )


@pytest.fixture
def rng():
    return np.random.default_rng(2021_13)


# ----------------------------------------------------------------------------- linear


@pytest.mark.parametrize("response", ["site", "prior"])
def test_adaptive_tap_vjp_exact_against_richardson(rng, response):
    n, d = 3, 2
    x = rng.standard_normal((n, d))
    J = _couplings(rng, n, d, 0.6)
    g = rng.standard_normal((n, d))
    P = np.diag([1.5, 0.75]).astype(float)
    grads = adaptive_tap_vjp(x, J, g, prior_precision=P, response=response, precision="exact")
    Pbig = np.kron(np.eye(n), P).tolist()
    dx, ex, dJ, eJ = _richardson(
        linear_means_loss((n, d), J.shape, Pbig, g), x, J, _off_diagonal(J.shape)
    )
    assert_rounds_to(grads.dx, dx, ex, what="adaptive_tap_vjp dx")
    assert_rounds_to(grads.dJ, dJ, eJ, what="adaptive_tap_vjp dJ")


def _linear_vjp_bounds(x, J, P, g, dx_exact, dJ_exact):
    """(bound on ||dx - dx*||, bound on ||dJ - dJ*||_F) of the float64 closed form: the two
    solves by fixed_point_forward_bound, the outer product by first-order propagation."""
    A = np.kron(np.eye(x.shape[0]), P) - _big(J)
    inverse_norm = np.linalg.norm(np.linalg.inv(A), 2)
    m = np.linalg.solve(A, x.ravel())
    u = dx_exact.ravel()
    size = A.shape[0]
    m_error = fixed_point_forward_bound(
        np.linalg.norm(A @ m - x.ravel()),
        inverse_norm,
        np.linalg.norm(np.abs(A) @ np.abs(m) + np.abs(x.ravel())),
        size + 1,
    )
    u_error = implicit_vjp_bound(
        np.linalg.norm(A.T @ u - g.ravel()),
        inverse_norm,
        np.linalg.norm(np.abs(A.T) @ np.abs(u) + np.abs(g.ravel())),
        size + 1,
    )
    dJ_error = (
        u_error * (np.linalg.norm(m) + m_error)
        + np.linalg.norm(u) * m_error
        + gamma(1) * np.linalg.norm(dJ_exact)
    )
    return u_error + gamma(1) * np.linalg.norm(u), dJ_error


def test_adaptive_tap_vjp_float64_within_bound(rng):
    n, d = 4, 3
    x = rng.standard_normal((n, d))
    J = _couplings(rng, n, d, 0.8)
    g = rng.standard_normal((n, d))
    exact = adaptive_tap_vjp(x, J, g, precision="exact")
    approx = adaptive_tap_vjp(x, J, g)
    dx_bound, dJ_bound = _linear_vjp_bounds(x, J, np.eye(d), g, exact.dx, exact.dJ)
    assert_norm_within(approx.dx, exact.dx, dx_bound, what="adaptive_tap_vjp float64 dx")
    assert_norm_within(approx.dJ, exact.dJ, dJ_bound, what="adaptive_tap_vjp float64 dJ")


def test_adaptive_tap_vjp_batched_sums_shared_couplings(rng):
    n, d = 3, 2
    x = rng.standard_normal((2, n, d))
    J = _couplings(rng, n, d, 0.5)
    g = rng.standard_normal((2, n, d))
    grads = adaptive_tap_vjp(x, J, g, precision="exact")
    assert grads.dx.shape == x.shape and grads.dJ.shape == J.shape

    def loss(flat):  # sum over the batch of the per-sample losses, J shared
        xs, Js = flat[: x.size], flat[x.size :]
        return sum(
            linear_means_loss((n, d), J.shape, np.eye(n * d).tolist(), g[b])(
                list(xs[b * n * d : (b + 1) * n * d]) + list(Js)
            )
            for b in range(2)
        )

    dx, ex, dJ, eJ = _richardson(loss, x, J, _off_diagonal(J.shape))
    assert_rounds_to(grads.dx, dx, ex, what="batched dx")
    assert_rounds_to(grads.dJ, dJ, eJ, what="batched dJ (summed over the batch)")


@pytest.mark.parametrize("diagonal", ["error", "keep"])
def test_deq_vjp_linear_exact_against_richardson(rng, diagonal):
    n, d = 3, 2
    x = rng.standard_normal((n, d))
    J = _couplings(rng, n, d, 0.7)
    if diagonal == "keep":  # softmax couplings (eq. (24)) couple a token to itself
        J[np.arange(n), np.arange(n)] = 0.1 * rng.standard_normal((n, d, d))
    g = rng.standard_normal((n, d))
    grads = deq_attention_vjp(x, J, g, diagonal=diagonal, precision="exact")
    free = np.ones(J.shape, bool) if diagonal == "keep" else _off_diagonal(J.shape)
    dx, ex, dJ, eJ = _richardson(
        linear_means_loss((n, d), J.shape, np.eye(n * d).tolist(), g), x, J, free
    )
    assert_rounds_to(grads.dx, dx, ex, what="deq_attention_vjp dx")
    assert_rounds_to(grads.dJ, dJ, eJ, what="deq_attention_vjp dJ")
    approx = deq_attention_vjp(x, J, g, diagonal=diagonal)
    dx_bound, dJ_bound = _linear_vjp_bounds(x, J, np.eye(d), g, grads.dx, grads.dJ)
    assert_norm_within(approx.dx, grads.dx, dx_bound, what="deq_attention_vjp float64 dx")
    assert_norm_within(approx.dJ, grads.dJ, dJ_bound, what="deq_attention_vjp float64 dJ")


# ----------------------------------------------------------------------------- nonlinear


def _half_tanh(z):
    return I.tanh(z) * 0.5 if z.dtype == object else 0.5 * np.tanh(z)


def _half_tanh_vjp(z, v):
    if z.dtype == object:
        t = I.tanh(z)
        return v * (1 - t * t) * 0.5
    return v * 0.5 / np.cosh(z) ** 2


def test_deq_vjp_with_correction_exact_against_richardson(rng):
    n, d = 3, 2
    x = rng.standard_normal((n, d))
    J = _couplings(rng, n, d, 0.4)
    g = rng.standard_normal((n, d))
    grads = deq_attention_vjp(
        x,
        J,
        g,
        correction=_half_tanh,
        correction_vjp=_half_tanh_vjp,
        lipschitz=0.5,
        precision="exact",
    )
    z0 = deq_attention(x, J, _half_tanh).means
    loss = deq_loss((n, d), J.shape, g, lambda v: mpmath.tanh(v) / 2, z0)
    dx, ex, dJ, eJ = _richardson(loss, x, J, _off_diagonal(J.shape))
    assert_rounds_to(grads.dx, dx, ex, what="deq_attention_vjp (correction) dx")
    assert_rounds_to(grads.dJ, dJ, eJ, what="deq_attention_vjp (correction) dJ")


@pytest.fixture
def ising_case(rng):
    n = 3
    J = rng.standard_normal((n, n)) * 0.3
    J = (J + J.T) / 2
    np.fill_diagonal(J, 0.0)
    return rng.standard_normal(n), J, rng.standard_normal(n)


def test_ising_vjp_exact_against_richardson(ising_case):
    x, J, g = ising_case
    grads = ising_tap_vjp(x, J, g, precision="exact")
    res = ising_tap(x, J)
    dx, ex, dJ, eJ = _richardson(
        ising_loss(len(x), g, res.means, res.cavity_var), x, J, _off_diagonal(J.shape)
    )
    assert_rounds_to(grads.dx, dx, ex, what="ising_tap_vjp dx")
    assert_rounds_to(grads.dJ, dJ, eJ, what="ising_tap_vjp dJ")


def test_ising_vjp_zero_field_has_exactly_zero_coupling_gradient(ising_case):
    _, J, g = ising_case
    grads = ising_tap_vjp(np.zeros(len(g)), J, g, precision="exact")
    assert np.array_equal(grads.dJ, np.zeros_like(J)) and not np.signbit(grads.dJ).any()
    # m = 0: dm/dx solves (I - J + diag(Lambda - 1)) dm = dx at the fixed point's Lambda
    res = ising_tap(np.zeros(len(g)), J, precision="exact")
    lam = res.cavity_var + 1.0
    u = np.linalg.solve((np.eye(len(g)) - J + np.diag(lam - 1)).T, g)
    A = (np.eye(len(g)) - J + np.diag(lam - 1)).T
    bound = implicit_vjp_bound(
        np.linalg.norm(A @ u - g),
        np.linalg.norm(np.linalg.inv(A), 2),
        np.linalg.norm(np.abs(A) @ np.abs(u) + np.abs(g)),
        len(g) + 2,
    )
    assert_norm_within(
        u,
        grads.dx,
        bound + gamma(1) * np.linalg.norm(u),
        what="zero-field dx against the linearised solve",
    )


def test_vjp_shapes_and_bad_input(rng):
    J = _couplings(rng, 3, 2, 0.5)
    with pytest.raises(ValueError, match=r"grad_out: expected the shape of the means"):
        adaptive_tap_vjp(np.ones((3, 2)), J, np.ones((3, 1)))
    with pytest.raises(TypeError, match="correction_vjp"):
        deq_attention_vjp(np.ones((3, 2)), J, np.ones((3, 2)), correction=_half_tanh)
    with pytest.raises(ValueError, match="self-coupling"):
        ising_tap_vjp(np.ones(2), np.eye(2), np.ones(2))
    zeroed = ising_tap_vjp(np.ones(2), np.eye(2), np.ones(2), diagonal="zero")
    assert zeroed.dJ[0, 0] == 0 and zeroed.dJ[1, 1] == 0


def test_deq_vjp_reports_nonconvergence_like_the_forward(rng):
    from refattn.fixedpoint import NotConvergedError

    n, d = 3, 2
    x, J, g = rng.standard_normal((n, d)), _couplings(rng, n, d, 0.4), rng.standard_normal((n, d))
    with pytest.raises(NotConvergedError):
        deq_attention_vjp(x, J, g, correction=_half_tanh, correction_vjp=_half_tanh_vjp, max_iter=1)
    grads = deq_attention_vjp(
        x, J, g, correction=_half_tanh, correction_vjp=_half_tanh_vjp, max_iter=1, on_fail="return"
    )
    assert grads.dx.shape == x.shape


def test_ising_vjp_batched_shared_couplings_sum_the_samples(ising_case):
    x, J, g = ising_case
    xs, gs = np.stack([x, -0.5 * x]), np.stack([g, g[::-1]])
    exact = ising_tap_vjp(xs, J, gs, precision="exact")
    parts = [ising_tap_vjp(xs[b], J, gs[b], precision="exact") for b in range(2)]
    assert exact.dx.shape == xs.shape and exact.dJ.shape == J.shape
    assert_same_bits(exact.dx, np.stack([p.dx for p in parts]), what="batched ising dx")
    # the rounded total is within one rounding of the sum of the two rounded halves each
    halves = parts[0].dJ + parts[1].dJ
    assert_within(
        exact.dJ,
        halves,
        gamma(3) * (np.abs(parts[0].dJ) + np.abs(parts[1].dJ)),
        what="batched ising dJ",
    )


# ----------------------------------------------------------------------------- masks


@pytest.fixture
def coupling_case(rng):
    n, d = 4, 3
    x = rng.standard_normal((n, d))
    W_Q, W_K, W_V = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(3))
    mask = np.array([[1, 0, 1, 1], [1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=bool)
    return x, W_Q, W_K, W_V, mask


def test_softmax_couplings_mask_exact_and_float64(coupling_case):
    x, W_Q, W_K, W_V, mask = coupling_case
    allowed = mask & np.tril(np.ones((4, 4), bool))
    exact = softmax_couplings(x, W_Q, W_K, W_V, mask=mask, causal=True, precision="exact")
    with mpmath.workdps(DPS):
        truth = np.vectorize(float, otypes=[float])(mp_softmax_couplings(x, W_Q, W_K, W_V, allowed))
    assert_same_bits(exact, truth, what="softmax_couplings exact")
    assert (exact[~allowed] == 0).all() and not np.signbit(exact[~allowed]).any()
    assert (exact[2] == 0).all(), "a site with no allowed partner has no couplings"
    approx = softmax_couplings(x, W_Q, W_K, W_V, mask=mask, causal=True)
    assert (approx[~allowed] == 0).all(), "excluded pairs are exact zeros on float64 too"
    # float64: scores with relative error gamma(d + 2) of |q||k| s, then the log1p-form weights
    # (refattn.softmax's documented bound) and one product with W_V
    q, k = x @ W_Q, x @ W_K
    score_size = np.abs(q) @ np.abs(k).T / np.sqrt(3)
    weights = np.abs(exact).sum(axis=(-1, -2)) / np.abs(W_V).sum()
    weight_error = gamma(3 + 4) * 2 * (score_size.max(axis=-1, keepdims=True) + 1) * weights
    bound = np.einsum("ij,ba->ijab", weight_error, np.abs(W_V)) + gamma(1) * np.abs(exact)
    assert_within(approx, exact, bound, what="softmax_couplings float64")


def test_masked_softmax_couplings_deq_vjp(coupling_case):
    # Bal 2021 section 4: deep implicit attention with masked softmax couplings (self-coupling
    # kept); the gradient with respect to an excluded pair is that of a zero coupling
    x, W_Q, W_K, W_V, mask = coupling_case
    J = 0.5 * softmax_couplings(x, W_Q, W_K, W_V, mask=mask, precision="exact")
    g = np.ones_like(x)
    grads = deq_attention_vjp(x, J, g, diagonal="keep", precision="exact")
    row = np.zeros(J.shape, bool)
    row[0] = True  # the couplings of site 0 (pair (0, 1) is excluded): keeps the test fast
    dx, ex, dJ, eJ = _richardson(
        linear_means_loss(x.shape, J.shape, np.eye(x.size).tolist(), g), x, J, row
    )
    assert_rounds_to(grads.dx, dx, ex, what="masked deq dx")
    assert_rounds_to(grads.dJ[0], dJ[0], eJ[0], what="masked deq dJ (site 0)")
    assert J[0, 1].max() == 0 and grads.dJ[0, 1].any(), "an excluded pair still has a gradient"


def test_softmax_couplings_vjp_exact_against_richardson(rng):
    n, d = 3, 2
    x = rng.standard_normal((n, d))
    W_Q, W_K, W_V = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(3))
    mask = np.array([[1, 1, 0], [1, 0, 1], [1, 1, 1]], dtype=bool)
    G = rng.standard_normal((n, n, d, d))
    grads = softmax_couplings_vjp(x, W_Q, W_K, W_V, G, mask=mask, precision="exact")
    arrays = (x, W_Q, W_K, W_V)
    sizes = np.cumsum([0] + [a.size for a in arrays])

    def loss(flat):
        parts = [
            np.array(flat[sizes[m] : sizes[m + 1]], dtype=object).reshape(a.shape)
            for m, a in enumerate(arrays)
        ]
        J = mp_softmax_couplings(*parts, mask)
        return mpmath.fsum(float(gk) * jk for gk, jk in zip(G.ravel(), J.ravel(), strict=True))

    grad, error = richardson_gradient(loss, np.concatenate([a.ravel() for a in arrays]), True, DPS)
    for m, (name, value) in enumerate(zip(grads._fields, grads, strict=True)):
        part = slice(sizes[m], sizes[m + 1])
        assert_rounds_to(
            value,
            grad[part].reshape(value.shape),
            error[part].reshape(value.shape),
            what=f"softmax_couplings_vjp {name}",
        )
    approx = softmax_couplings_vjp(x, W_Q, W_K, W_V, G, mask=mask)
    # no a-priori bound yet: the first-order estimate gamma(n) max|gradient|, n the number of
    # differentiated scalars (as the transformer pieces without a bound)
    scale = max(np.abs(v).max() for v in grads)
    for name, value, truth in zip(grads._fields, approx, grads, strict=True):
        assert_within(value, truth, gamma(int(sizes[-1])) * scale, what=f"float64 {name}")


# ----------------------------------------------------------------------------- torch


def _torch():
    return pytest.importorskip("torch")


def _torch_fixed_point(update, state):
    """Damped Picard on the printed update until the step stops shrinking at the float64
    rounding level (the state error is measured against the exact path afterwards)."""
    torch = _torch()
    floor = torch.finfo(torch.float64).eps
    with torch.no_grad():
        for _ in range(20000):
            new = 0.5 * state + 0.5 * update(state)
            step = float(torch.linalg.norm(new - state))
            state = new
            if step <= 4 * floor * float(torch.linalg.norm(state)):
                break
    return state


def _torch_reference(update, state, params, g_state, truth_state):
    """Implicit VJP with torch Jacobians at the converged state: ``u = (I - F_z)^{-T} g``,
    ``d params = u^T F_params``; returns the flat gradient, its first-order error bound against
    the exact gradient and the gradient's sensitivity to the state (for other float64 paths).

    Bound: ``||F_params|| * implicit_vjp_bound(u)`` (the adjoint solve) plus
    ``||d grad / d state|| * ||state - state*||`` (the gradient as a function of the state,
    differentiated by torch) plus the rounding of the final products.
    """
    torch = _torch()
    size = state.numel()
    leaves = [p.detach().requires_grad_(True) for p in params]

    def gradient(s):
        jac = torch.autograd.functional.jacobian(lambda z: update(z), s, create_graph=True)
        A = torch.eye(size, dtype=torch.float64) - jac.reshape(size, size)
        u = torch.linalg.solve(A.T, g_state.reshape(-1))
        out = update(s, *leaves)
        grads = torch.autograd.grad(out, leaves, u.reshape(out.shape), create_graph=True)
        return torch.cat([gr.reshape(-1) for gr in grads]), A, u

    flat, A, u = (t.detach() for t in gradient(state.detach()))
    gvec = g_state.reshape(-1)
    u_bound = implicit_vjp_bound(
        float(torch.linalg.norm(A.T @ u - gvec)),
        float(torch.linalg.matrix_norm(torch.linalg.inv(A.detach()), 2)),
        float(torch.linalg.norm(A.abs().T @ u.abs() + gvec.abs())),
        size + 1,
    )
    jac_params = torch.autograd.functional.jacobian(
        lambda *ps: update(state.detach(), *ps), tuple(p.detach() for p in params)
    )
    params_norm = float(
        torch.linalg.matrix_norm(torch.cat([j.reshape(size, -1) for j in jac_params], dim=1), 2)
    )
    sensitivity = float(
        torch.linalg.matrix_norm(
            torch.autograd.functional.jacobian(lambda s: gradient(s)[0], state.detach()).reshape(
                flat.numel(), size
            ),
            2,
        )
    )
    state_error = float(
        np.linalg.norm(state.detach().numpy().ravel() - truth_state.ravel())
    ) + gamma(1) * np.linalg.norm(truth_state)
    value = flat.detach().numpy()
    bound = params_norm * u_bound + sensitivity * state_error + gamma(size) * np.linalg.norm(value)
    return value, bound, sensitivity, params_norm


def _flat(grads):
    dx, dJ = (np.array(a, dtype=float, copy=True) for a in grads)
    n = dJ.shape[0]
    dJ[np.arange(n), np.arange(n)] = 0.0  # J_ii are not free parameters
    return np.concatenate([dx.ravel(), dJ.ravel()])


def _float64_bound(sensitivity, solve_term, state, truth_state, value):
    """First-order bound of a float64 path with its own state and adjoint error
    ``solve_term``: torch's sensitivity of the gradient to the state."""
    state_error = np.linalg.norm(np.ravel(state) - np.ravel(truth_state)) + gamma(
        1
    ) * np.linalg.norm(truth_state)
    return solve_term + sensitivity * state_error + gamma(len(value)) * np.linalg.norm(value)


@pytest.mark.peers("torch")
def test_deq_vjp_matches_torch_autograd(rng):
    torch = _torch()
    n, d = 3, 2
    x, J, g = rng.standard_normal((n, d)), _couplings(rng, n, d, 0.4), rng.standard_normal((n, d))
    xt, Jt = torch.tensor(x), torch.tensor(J)

    def update(z, x_=xt, J_=Jt):  # eq. (23) with f = tanh / 2
        return torch.einsum("ijab,jb->ia", J_, z) - 0.5 * torch.tanh(z) + x_

    z = _torch_fixed_point(update, torch.zeros(n, d, dtype=torch.float64))
    truth_z = deq_attention(x, J, _half_tanh, lipschitz=0.5, precision="exact").means
    value, bound, sensitivity, params_norm = _torch_reference(
        update, z, [xt, Jt], torch.tensor(g), truth_z
    )
    exact = _flat(
        deq_attention_vjp(
            x,
            J,
            g,
            correction=_half_tanh,
            correction_vjp=_half_tanh_vjp,
            lipschitz=0.5,
            precision="exact",
        )
    )
    assert_norm_within(
        _flat((value[: n * d].reshape(n, d), value[n * d :].reshape(J.shape))),
        exact,
        bound,
        what="torch deq (dx, dJ)",
    )
    approx = _flat(deq_attention_vjp(x, J, g, correction=_half_tanh, correction_vjp=_half_tanh_vjp))
    approx_z = deq_attention(x, J, _half_tanh).means
    # refattn's adjoint is iterated to the solver's tolerance: bound its own residual in the
    # adjoint system (I - J + diag f'(z))^T u = g
    A = np.eye(n * d) - _big(J) + np.diag(0.5 / np.cosh(approx_z.ravel()) ** 2)
    u = approx[: n * d]
    solve_term = params_norm * implicit_vjp_bound(
        np.linalg.norm(A.T @ u - g.ravel()),
        np.linalg.norm(np.linalg.inv(A), 2),
        np.linalg.norm(np.abs(A.T) @ np.abs(u) + np.abs(g.ravel())),
        n * d + 1,
    )
    assert_norm_within(
        approx,
        exact,
        _float64_bound(sensitivity, solve_term, approx_z, truth_z, exact),
        what="refattn float64 deq",
    )


@pytest.mark.peers("torch")
def test_adaptive_tap_vjp_matches_torch_autograd(rng):
    torch = _torch()
    n, d = 3, 2
    x, J, g = rng.standard_normal((n, d)), _couplings(rng, n, d, 0.5), rng.standard_normal((n, d))
    xt, Jt = torch.tensor(x), torch.tensor(J)
    eye_d = torch.eye(d, dtype=torch.float64)

    def update(state, x_=xt, J_=Jt):
        """Eqs. (17), (20), (10) site reading (Lambda_i = 1), (8), (11); Sigma = 1_d."""
        m, V = state[:, :d], state[:, d:].reshape(n, d, d)
        cavity = torch.einsum("ijab,jb->ia", J_, m) - torch.einsum("iab,ib->ia", V, m)
        means = torch.linalg.solve(eye_d - V, (cavity + x_)[..., None])[..., 0]
        big = J_.permute(0, 2, 1, 3).reshape(n * d, n * d)
        chi = torch.linalg.inv(torch.eye(n * d, dtype=torch.float64) - big)
        chi_ii = torch.stack([chi[i * d : (i + 1) * d, i * d : (i + 1) * d] for i in range(n)])
        V_new = eye_d - torch.linalg.inv(chi_ii)
        return torch.cat([means, V_new.reshape(n, d * d)], dim=1)

    state = _torch_fixed_point(update, torch.zeros(n, d + d * d, dtype=torch.float64))
    truth = adaptive_tap(x, J, precision="exact")
    truth_state = np.concatenate([truth.means, truth.cavity_var.reshape(n, -1)], axis=1)
    g_state = torch.cat([torch.tensor(g), torch.zeros(n, d * d, dtype=torch.float64)], dim=1)
    value, bound, _, _ = _torch_reference(update, state, [xt, Jt], g_state, truth_state)
    exact = _flat(adaptive_tap_vjp(x, J, g, precision="exact"))
    assert_norm_within(
        _flat((value[: n * d].reshape(n, d), value[n * d :].reshape(J.shape))),
        exact,
        bound,
        what="torch adaptive TAP (dx, dJ)",
    )


@pytest.mark.peers("torch")
def test_ising_vjp_matches_torch_autograd(ising_case):
    torch = _torch()
    x, J, g = ising_case
    n = len(x)
    xt, Jt = torch.tensor(x), torch.tensor(J)

    def update(state, x_=xt, J_=Jt):
        """Eqs. (14), (10) with d<S>/dx = 1/cosh^2, (8), (11), Jacobi order."""
        m, V = state[:n], state[n:]
        h = J_ @ m - V * m + x_
        lam = V + torch.cosh(h) ** 2
        chi = torch.linalg.inv(torch.diag(lam) - J_)
        return torch.cat([torch.tanh(h), lam - 1 / torch.diagonal(chi)])

    state = _torch_fixed_point(update, torch.zeros(2 * n, dtype=torch.float64))
    truth = ising_tap(x, J, precision="exact")
    truth_state = np.concatenate([truth.means, truth.cavity_var])
    g_state = torch.cat([torch.tensor(g), torch.zeros(n, dtype=torch.float64)])
    value, bound, sensitivity, params_norm = _torch_reference(
        update, state, [xt, Jt], g_state, truth_state
    )
    exact = _flat(ising_tap_vjp(x, J, g, precision="exact"))
    assert_norm_within(
        _flat((value[:n], value[n:].reshape(n, n))), exact, bound, what="torch ising (dx, dJ)"
    )
    approx = ising_tap(x, J)
    # refattn solves the reduced equations' adjoint directly (LAPACK): its error is bounded
    # like torch's solve of the same fixed point's adjoint (the two systems share the
    # fixed point's conditioning), plus the effect of refattn's own state
    solve_term = bound - sensitivity * (
        np.linalg.norm(state.numpy() - truth_state) + gamma(1) * np.linalg.norm(truth_state)
    )
    assert_norm_within(
        _flat(ising_tap_vjp(x, J, g)),
        exact,
        _float64_bound(
            sensitivity,
            solve_term,
            np.concatenate([approx.means, approx.cavity_var]),
            truth_state,
            exact,
        ),
        what="refattn float64 ising",
    )
