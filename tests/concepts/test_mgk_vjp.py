"""Gradients of refattn.mgk and refattn.hopfield, and the public-code readings as options.

Truth for the vjps: central differences of the loop-level mpmath twins (tests/naive, 60
digits) with Richardson extrapolation and an error estimate (tests.naive.mp.naive_vjp); the
exact path must round that derivative bit for bit wherever its interval decides the rounding.
The float64 paths are held to the oracle's gradient floor
(:func:`oracle.judging.variant_scales.grad_floor_terms`,
:func:`oracle.judging.tolerance.variant_floor`),
also against torch autograd of independent float64 twins (tests/planted/torch_twins.py, skipped
without torch). Each public-code reading is compared with a twin written from its description.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.catalogue import Case, Shapes
from oracle.judging.tolerance import mixture_bound, normalised_error, ratio_bound, variant_floor
from oracle.judging.variant_scales import condition, grad_floor_terms, grad_scale
from refattn import hopfield, mgk
from refattn.attention import attention_vjp
from refattn.bounds import float64_vjp_bound, gamma, mgk_vjp_bound, mlk_vjp_bound
from refattn.masks import allowed_mask
from tests.helpers import assert_rounds_derivative, assert_same_bits, assert_within
from tests.naive.hopfield import naive_retrieve
from tests.naive.mgk import naive_allowed, naive_em, naive_linear, naive_mgk
from tests.naive.mp import naive_vjp
from tests.naive.rounding import round_nested
from tests.registry import mgk_term_scale
from tests.strategies import linear_problems, mgk_problems


@pytest.fixture
def rng():
    return np.random.default_rng(20261124)


def _mgk_problem(rng, length=3, units=3, comps=2, dim=2, vdim=2):
    return (
        rng.standard_normal((length, dim)),
        rng.standard_normal((units, comps, dim)),
        rng.standard_normal((units, vdim)),
        rng.standard_normal((length, vdim)),
    )


def _floor(function, inputs, options, truth):
    """The oracle's float64 gradient floor for these inputs, times the gradient's scale."""
    q = inputs.get("q", inputs.get("xi"))
    keys = inputs.get("keys", inputs.get("X"))
    length, dim = q.shape[-2:]
    comps = keys.shape[-2] if keys.ndim == 3 else 1
    units = keys.shape[-3] if keys.ndim == 3 else keys.shape[-2]
    vdim = inputs["v"].shape[-1] if "v" in inputs else dim
    case = Case(
        "test",
        ("test",),
        "conformance",
        "float64",
        Shapes(batch=1, H=1, K=1, L=length, S=units, D=dim, E=vdim),
        options=options,
        recipe={"R": comps},
        function=function,
    )
    cond, n = grad_floor_terms(case, condition(case, inputs, {}))
    return variant_floor("float64", condition=cond, n=n, n_stored=0) * grad_scale(truth[None])[0]


def _assert_float64_grad(value, truth, floor, what):
    errors = normalised_error(value, truth, 1.0, "float64")
    assert_within(errors, np.zeros_like(errors), floor, what=what)


# --------------------------------------------------------------------------------------------
# mgk.attention_vjp
# --------------------------------------------------------------------------------------------

MGK_OPTIONS = [
    dict(sigma2=0.7),
    dict(sigma2=0.7, mode="hard"),
    dict(sigma2=np.array([[0.5, 2.0]] * 3), normalized=True),
    dict(sigma2=np.array([[0.5, 2.0]] * 3), normalized=True, mode="hard"),
    dict(log_pi=np.log(np.array([[0.25, 0.75]] * 3)), causal=True),
    dict(mask=np.array([[True, False, True], [False, False, False], [True, True, False]])),
    dict(window=(1, 0), align="bottom_right"),
    dict(sigma2=2.0, row_eps=1e-6),
]


@pytest.mark.parametrize("options", MGK_OPTIONS, ids=lambda o: ",".join(sorted(o)))
def test_mgk_vjp_matches_richardson_derivative(options, rng):
    q, keys, v, g = _mgk_problem(rng)
    exact = mgk.attention_vjp(q, keys, v, g, precision="exact", **options)
    fast = mgk.attention_vjp(q, keys, v, g, **options)
    derivative = naive_vjp(lambda a, b, c: naive_mgk(a, b, c, **options), (q, keys, v), g)
    for name, value, fast_value, deriv in zip(
        ("dq", "dkeys", "dv"), exact, fast, derivative, strict=True
    ):
        assert_rounds_derivative(value, deriv, what=f"mgk exact {name} {sorted(options)}")
        truth = np.vectorize(float)(deriv[..., 0])
        floor = _floor("mgk.attention", {"q": q, "keys": keys, "v": v}, options, truth)
        _assert_float64_grad(fast_value, truth, floor, f"mgk float64 {name}")


@settings(max_examples=25)
@given(
    problem=mgk_problems(),
    mode=st.sampled_from(["soft", "hard"]),
    normalized=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_mgk_vjp_float64_within_its_bound(problem, mode, normalized, seed):
    """float64 vjp vs the exact vjp within refattn.bounds.mgk_vjp_bound (random allowed sets,
    ties, wide and dyadic inputs from tests.strategies.mgk_problems)."""
    q, keys, v, opts = problem
    g = np.random.default_rng(seed).standard_normal((q.shape[0], v.shape[1]))
    options = dict(opts, mode=mode, normalized=normalized)
    fast = mgk.attention_vjp(q, keys, v, g, **options)
    exact = mgk.attention_vjp(q, keys, v, g, precision="exact", **options)
    bound = mgk_vjp_bound(
        q,
        keys,
        v,
        g,
        sigma2=opts.get("sigma2", 1.0),
        log_pi=opts.get("log_pi"),
        normalized=normalized,
    )
    for name, value, truth in zip(("dq", "dkeys", "dv"), fast, exact, strict=True):
        assert_within(value, truth, bound[name], what=f"mgk float64 {name} ({mode})")


def test_mgk_hard_ties_split_equally():
    """Duplicate components tie exactly: the subgradient gives each half of the lone
    component's gradient (the mean of the one-sided derivatives of the max; the lone one is
    smooth and checked against the Richardson derivative)."""
    rng = np.random.default_rng(3)
    q, keys, v, g = _mgk_problem(rng, comps=1)
    keys = np.repeat(keys, 2, axis=1)
    exact = mgk.attention_vjp(q, keys, v, g, mode="hard", precision="exact")
    assert_same_bits(exact.dkeys[:, 0], exact.dkeys[:, 1], what="tied components")
    single = mgk.attention_vjp(q, keys[:, :1], v, g, mode="hard", precision="exact")
    assert_same_bits(exact.dkeys[:, 0] * 2, single.dkeys[:, 0], what="half of the lone one")
    derivative = naive_vjp(lambda a, b, c: naive_mgk(a, b, c, mode="hard"), (q, keys[:, :1], v), g)
    assert_rounds_derivative(single.dkeys, derivative[1], what="lone component dkeys")
    fast = mgk.attention_vjp(q, keys, v, g, mode="hard")
    assert_same_bits(fast.dkeys[:, 0], fast.dkeys[:, 1], what="tied components (float64)")


def test_mgk_vjp_broadcast_batch_sums_exactly(rng):
    q = rng.standard_normal((2, 3, 2))
    keys, v = rng.standard_normal((3, 2, 2)), rng.standard_normal((3, 2))
    g = rng.standard_normal((2, 3, 2))
    exact = mgk.attention_vjp(q, keys, v, g, precision="exact", sigma2=0.5)
    assert exact.dkeys.shape == keys.shape and exact.dv.shape == v.shape
    derivative = naive_vjp(
        lambda a, b, c: [naive_mgk(a[k], b, c, sigma2=0.5) for k in range(2)], (q, keys, v), g
    )
    for value, deriv, name in zip(exact, derivative, ("dq", "dkeys", "dv"), strict=True):
        assert_rounds_derivative(value, deriv, what=f"batched {name}")


def test_mgk_vjp_lone_key_gives_exact_zero_score_gradient(rng):
    """One allowed key per row: the weights are 1, dq and dkeys are exactly 0."""
    q, keys, v, g = _mgk_problem(rng)
    grads = mgk.attention_vjp(q, keys, v, g, mask=np.eye(3, dtype=bool), precision="exact")
    assert not grads.dq.any() and not grads.dkeys.any()
    assert_same_bits(grads.dv, g, what="dv of a lone key is grad_out")


def test_mgk_vjp_rejects(rng):
    q, keys, v, g = _mgk_problem(rng)
    with pytest.raises(ValueError, match="grad_out"):
        mgk.attention_vjp(q, keys, v, g[:, :1].repeat(3, axis=1))
    bad = keys.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="keys"):
        mgk.attention_vjp(q, bad, v, g)


# --------------------------------------------------------------------------------------------
# mgk.linear_attention_vjp
# --------------------------------------------------------------------------------------------

LINEAR_OPTIONS = [
    dict(),
    dict(causal=True),
    dict(mask=np.array([[True, False, True], [False, False, False], [True, True, False]])),
    dict(mlk_form="lra"),
    dict(mlk_form="lra", causal=True),
    dict(mlk_form="lm"),
    dict(mlk_form="lm", mask=np.array([[True], [False], [True]]).T.repeat(3, axis=0)),
]


@pytest.mark.parametrize(
    "options",
    LINEAR_OPTIONS,
    ids=lambda o: (
        ",".join(f"{k}={v}" if isinstance(v, str) else k for k, v in sorted(o.items())) or "default"
    ),
)
def test_linear_vjp_matches_richardson_derivative(options, rng):
    q, keys, v, g = _mgk_problem(rng)
    pi = np.array([[0.25, 0.75], [0.5, 0.5], [0.125, 0.875]])
    exact = mgk.linear_attention_vjp(q, keys, v, g, pi=pi, precision="exact", **options)
    fast = mgk.linear_attention_vjp(q, keys, v, g, pi=pi, **options)
    derivative = naive_vjp(lambda a, b, c: naive_linear(a, b, c, pi=pi, **options), (q, keys, v), g)
    for name, value, fast_value, deriv in zip(
        ("dq", "dkeys", "dv"), exact, fast, derivative, strict=True
    ):
        assert_rounds_derivative(value, deriv, what=f"mlk exact {name} {options}")
        truth = np.vectorize(float)(deriv[..., 0])
        floor = _floor("mgk.linear_attention", {"q": q, "keys": keys, "v": v}, {}, truth)
        _assert_float64_grad(fast_value, truth, floor, f"mlk float64 {name}")


@settings(max_examples=25)
@given(problem=linear_problems(), causal=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_linear_vjp_float64_within_its_bound(problem, causal, seed):
    """float64 MLK vjp vs the exact vjp within refattn.bounds.mlk_vjp_bound."""
    q, keys, v, pi = problem
    g = np.random.default_rng(seed).standard_normal((q.shape[0], v.shape[1]))
    fast = mgk.linear_attention_vjp(q, keys, v, g, pi=pi, causal=causal)
    exact = mgk.linear_attention_vjp(q, keys, v, g, pi=pi, causal=causal, precision="exact")
    bound = mlk_vjp_bound(
        q, keys, v, g, pi=pi, allowed=allowed_mask(q.shape[0], keys.shape[0], causal=causal)
    )
    for name, value, truth in zip(("dq", "dkeys", "dv"), fast, exact, strict=True):
        assert_within(value, truth, bound[name], what=f"mlk float64 {name}")


# --------------------------------------------------------------------------------------------
# hopfield.retrieve_vjp
# --------------------------------------------------------------------------------------------


def test_retrieve_vjp_one_step_within_the_attention_bound(rng):
    """One update is attention(xi, X, X, scale=beta): its float64 vjp bound holds, dX adding
    the key and value parts (one more rounding)."""
    xi, X, g = rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((3, 4))
    fast = hopfield.retrieve_vjp(xi, X, g, beta=0.75)
    exact = hopfield.retrieve_vjp(xi, X, g, beta=0.75, precision="exact")
    dq, dk, dv, _ = float64_vjp_bound(xi, X, X, g, scale=0.75)
    parts = attention_vjp(xi, X, X, g, scale=0.75)
    assert_within(fast.dxi, exact.dxi, dq, what="retrieve dxi (1 step)")
    assert_within(
        fast.dX,
        exact.dX,
        dk + dv + gamma(1) * np.abs(parts.dk + parts.dv),
        what="retrieve dX (1 step)",
    )


def test_exact_vjp_ties_on_rounding_midpoints():
    """Tied rows give rational gradients on float64 midpoints: settled exactly (ties to
    even), with the irrational rows of the same computation left to the interval loop."""
    X = np.array([[1.0], [-1.0]])
    g = np.array([[1.0], [2.0**-53]])
    grads = hopfield.retrieve_vjp(np.zeros((2, 1)), X, g, beta=1.0, precision="exact")
    assert_same_bits(grads.dX, np.array([[0.5], [0.5]]), what="dX = 1/2 + 2**-54 -> 1/2")
    q = np.zeros((3, 1))
    keys = np.array([[[1.0]], [[-1.0]], [[5.0]]])
    mask = np.array([[True, True, False], [True, True, False], [False, True, True]])
    g = np.array([[1.0], [2.0**-53], [3.0]])
    for mode in ("soft", "hard"):
        mixed = mgk.attention_vjp(
            q, keys, np.ones((3, 1)), g, mode=mode, mask=mask, precision="exact"
        )
        assert_same_bits(
            mixed.dv[0], np.array([0.5]), what=f"dv_0 = (1 + 2**-53) / 2 -> 1/2 ({mode})"
        )


@pytest.mark.parametrize("steps", [1, 3])
def test_retrieve_vjp_matches_richardson_derivative(steps, rng):
    xi, X, g = rng.standard_normal((2, 3)), rng.standard_normal((4, 3)), rng.standard_normal((2, 3))
    exact = hopfield.retrieve_vjp(xi, X, g, beta=0.75, steps=steps, precision="exact")
    fast = hopfield.retrieve_vjp(xi, X, g, beta=0.75, steps=steps)
    derivative = naive_vjp(lambda a, b: naive_retrieve(a, b, 0.75, steps)[0], (xi, X), g)
    for name, value, fast_value, deriv in zip(("dxi", "dX"), exact, fast, derivative, strict=True):
        assert_rounds_derivative(value, deriv, what=f"retrieve exact {name} steps={steps}")
        truth = np.vectorize(float)(deriv[..., 0])
        floor = _floor(
            "hopfield.retrieve", {"xi": xi, "X": X}, {"beta": 0.75, "steps": steps}, truth
        )
        _assert_float64_grad(fast_value, truth, floor, f"retrieve float64 {name}")


def test_retrieve_vjp_with_tol_stops_rows(rng):
    """A row that stopped is constant afterwards: with the largest tol only the first update
    counts."""
    xi, X, g = rng.standard_normal((2, 3)), rng.standard_normal((4, 3)), rng.standard_normal((2, 3))
    stopped = hopfield.retrieve_vjp(xi, X, g, beta=0.5, steps=4, tol=np.finfo(float).max)
    once = hopfield.retrieve_vjp(xi, X, g, beta=0.5, steps=1)
    assert_same_bits(stopped.dxi, once.dxi, what="tol stops after one update")
    assert_same_bits(stopped.dX, once.dX, what="tol stops after one update (dX)")
    with pytest.raises(ValueError, match="tol"):
        hopfield.retrieve_vjp(xi, X, g, beta=0.5, tol=0.1, precision="exact")


# --------------------------------------------------------------------------------------------
# torch autograd of independent float64 twins
# --------------------------------------------------------------------------------------------


@pytest.mark.peers("torch")
@pytest.mark.parametrize(
    "options", MGK_OPTIONS[:2] + MGK_OPTIONS[4:], ids=lambda o: ",".join(sorted(o))
)
def test_mgk_vjp_against_torch(options, rng):
    from tests.planted.torch_twins import mgk_torch, torch_grads

    q, keys, v, g = _mgk_problem(rng)
    allowed = naive_allowed(
        3,
        3,
        mask=options.get("mask"),
        causal=options.get("causal", False),
        window=options.get("window"),
        align=options.get("align", "top_left"),
    )
    twin_options = {k: options[k] for k in ("log_pi", "sigma2", "mode", "row_eps") if k in options}
    theirs = torch_grads(mgk_torch, (q, keys, v), g, allowed=allowed, **twin_options)
    exact = mgk.attention_vjp(q, keys, v, g, precision="exact", **options)
    fast = mgk.attention_vjp(q, keys, v, g, **options)
    for name, torch_value, fast_value, truth in zip(
        ("dq", "dkeys", "dv"), theirs, fast, exact, strict=True
    ):
        floor = _floor("mgk.attention", {"q": q, "keys": keys, "v": v}, options, truth)
        _assert_float64_grad(torch_value, truth, floor, f"torch {name} vs exact")
        _assert_float64_grad(fast_value, truth, floor, f"refattn float64 {name} vs exact")


@pytest.mark.peers("torch")
@pytest.mark.parametrize("form", mgk.MLK_FORMS)
def test_linear_vjp_against_torch(form, rng):
    from tests.planted.torch_twins import mlk_torch, torch_grads

    q, keys, v, g = _mgk_problem(rng)
    pi = np.array([[0.25, 0.75], [0.5, 0.5], [0.125, 0.875]])
    allowed = naive_allowed(3, 3, causal=True)
    theirs = torch_grads(mlk_torch, (q, keys, v), g, pi=pi, allowed=allowed, mlk_form=form)
    exact = mgk.linear_attention_vjp(
        q, keys, v, g, pi=pi, causal=True, mlk_form=form, precision="exact"
    )
    fast = mgk.linear_attention_vjp(q, keys, v, g, pi=pi, causal=True, mlk_form=form)
    for name, torch_value, fast_value, truth in zip(
        ("dq", "dkeys", "dv"), theirs, fast, exact, strict=True
    ):
        floor = _floor("mgk.linear_attention", {"q": q, "keys": keys, "v": v}, {}, truth)
        _assert_float64_grad(torch_value, truth, floor, f"torch {name} vs exact ({form})")
        _assert_float64_grad(fast_value, truth, floor, f"refattn {name} vs exact ({form})")


@pytest.mark.peers("torch")
def test_retrieve_vjp_against_torch(rng):
    from tests.planted.torch_twins import retrieve_torch, torch_grads

    xi, X, g = rng.standard_normal((2, 3)), rng.standard_normal((4, 3)), rng.standard_normal((2, 3))
    theirs = torch_grads(retrieve_torch, (xi, X), g, beta=0.75, steps=2)
    exact = hopfield.retrieve_vjp(xi, X, g, beta=0.75, steps=2, precision="exact")
    fast = hopfield.retrieve_vjp(xi, X, g, beta=0.75, steps=2)
    for name, torch_value, fast_value, truth in zip(
        ("dxi", "dX"), theirs, fast, exact, strict=True
    ):
        floor = _floor("hopfield.retrieve", {"xi": xi, "X": X}, {"beta": 0.75, "steps": 2}, truth)
        _assert_float64_grad(torch_value, truth, floor, f"torch {name} vs exact")
        _assert_float64_grad(fast_value, truth, floor, f"refattn {name} vs exact")


# --------------------------------------------------------------------------------------------
# The public code's readings as options
# --------------------------------------------------------------------------------------------


def test_row_eps_is_the_public_lm_normaliser(rng):
    """row_eps=1e-6 against a twin from its description, and against the public code's direct
    form sum_r pi exp(.) / (row sum + 1e-6) (scores near 0: nothing underflows)."""
    q, keys, v, _ = _mgk_problem(rng)
    exact = mgk.attention(q, keys, v, sigma2=2.0, row_eps=1e-6, precision="exact")
    assert_same_bits(
        exact,
        round_nested(naive_mgk(q, keys, v, sigma2=2.0, row_eps=1e-6)),
        what="row_eps exact vs twin",
    )
    fast = mgk.attention(q, keys, v, sigma2=2.0, row_eps=1e-6)
    bound = mixture_bound(mgk_term_scale(q, keys, {"sigma2": 2.0}), 6, 4, np.abs(v).max())
    assert_within(fast, exact, bound, what="row_eps float64")
    dist = ((q[:, None, None, :] - keys[None]) ** 2).sum(-1)
    kernel = (0.5 * np.exp(-dist / 4)).sum(-1)
    public = (kernel / (kernel.sum(-1, keepdims=True) + 1e-6)) @ v
    assert_within(fast, public, bound, what="row_eps vs the public direct form")
    plain = mgk.attention(q, keys, v, sigma2=2.0)
    assert np.abs(plain - fast).max() > bound, "premise: row_eps moves the output"


def test_row_eps_shrinks_small_rows():
    """Row sums ~1e-5: every weight shrinks by Z / (Z + row_eps)."""
    q = np.array([[0.0]])
    keys = np.array([[[math.sqrt(2 * 11.5)]], [[-math.sqrt(2 * 11.5)]]])
    v = np.array([[1.0], [1.0]])
    out = mgk.attention(q, keys, v, row_eps=1e-6, precision="exact")
    total = 2 * np.exp(-11.5)
    assert_within(
        out,
        np.array([[total / (total + 1e-6)]]),
        mixture_bound(11.5, 2, 1, 1.0),
        what="shrink factor",
    )


def _pi_example():
    q = np.array([[0.0], [2.0]])
    keys = np.array([[[0.0], [1.0]], [[2.0], [2.0]]])
    return q, keys, np.log(np.full((2, 2), 0.5))


def test_per_key_pi_update_is_the_public_rule():
    q, keys, log_pi = _pi_example()
    per_key = mgk.em_update_pi(
        q, keys, log_pi=log_pi, sigma2=1.0, pi_update="per_key", precision="exact"
    )
    pi, resp = naive_em(q, keys, log_pi=log_pi, sigma2=1.0, pi_update="per_key")
    assert_same_bits(per_key.pi, round_nested(pi), what="per_key pi vs twin")
    assert_same_bits(per_key.responsibilities, round_nested(resp), what="per_key resp")
    fast = mgk.em_update_pi(q, keys, log_pi=log_pi, sigma2=1.0, pi_update="per_key")
    bound = mixture_bound(mgk_term_scale(q, keys, {"log_pi": log_pi}), 6, 3, 2.0)
    assert_within(fast.pi, per_key.pi, bound, what="per_key float64")
    # the public code's direct form: per-key posteriors averaged over every query
    dens = 0.5 * np.exp(-((q[:, None, None, :] - keys[None]) ** 2).sum(-1) / 2)
    public = (dens / dens.sum(-1, keepdims=True)).mean(0)
    assert_within(fast.pi, public, bound, what="per_key vs the public direct form")
    joint = mgk.em_update_pi(q, keys, log_pi=log_pi, sigma2=1.0, precision="exact")
    assert np.abs(joint.pi - per_key.pi).max() > bound, "the two rules differ here"


@pytest.mark.parametrize("masked", [False, True])
def test_per_key_pi_update_random(masked, rng):
    q, keys, _, _ = _mgk_problem(rng, length=4, units=3, comps=3)
    log_pi = np.log(rng.dirichlet(np.ones(3), 3))
    mask = rng.random((4, 3)) < 0.6 if masked else None
    exact = mgk.em_update_pi(
        q, keys, log_pi=log_pi, sigma2=0.5, mask=mask, pi_update="per_key", precision="exact"
    )
    pi, resp = naive_em(q, keys, log_pi=log_pi, sigma2=0.5, mask=mask, pi_update="per_key")
    assert_same_bits(exact.pi, round_nested(pi), what="per_key pi (random)")
    assert_same_bits(exact.responsibilities, round_nested(resp), what="per_key resp (random)")


@pytest.mark.parametrize("form", ["lra", "lm"])
@pytest.mark.parametrize("allowed", ["all", "causal", "padding"])
def test_mlk_forms_match_their_descriptions(form, allowed, rng):
    q, keys, v, _ = _mgk_problem(rng, length=3, units=4, comps=2, dim=3)
    pi = rng.uniform(0, 1, (4, 2))  # the public code clamps, it does not normalise
    options = {
        "all": {},
        "causal": {"causal": True},
        "padding": {"mask": np.array([[True, True, False, True]])},
    }[allowed]
    exact = mgk.linear_attention(q, keys, v, pi=pi, mlk_form=form, precision="exact", **options)
    naive_options = dict(options)
    if "mask" in naive_options:
        naive_options["mask"] = np.repeat(naive_options["mask"], 3, axis=0)
    assert_same_bits(
        exact,
        round_nested(naive_linear(q, keys, v, pi=pi, mlk_form=form, **naive_options)),
        what=f"mlk {form} exact vs twin ({allowed})",
    )
    fast = mgk.linear_attention(q, keys, v, pi=pi, mlk_form=form, **options)
    n = q.shape[-1] + keys.shape[1] + keys.shape[0] + 6
    if form == "lm":
        bound = ratio_bound(n, np.abs(v).max())
    else:  # sum_j kappa_ij v_j, kappa_ij >= 0 each to relative gamma_n: Higham eq. (3.4)
        magnitude = mgk.linear_attention(q, keys, np.abs(v), pi=pi, mlk_form=form, **options)
        bound = gamma(n + keys.shape[0] + 2) * magnitude
    assert_within(fast, exact, bound, what=f"mlk {form} float64 ({allowed})")


def test_mlk_lra_mixes_keys_before_the_map(rng):
    """With one component pi = 1 the lra form is the default's numerator up to (L S)^(-1/4)
    scalings; with two components it is phi of the averaged key."""
    q, keys, v, _ = _mgk_problem(rng, units=4)
    one = np.ones((4, 1))
    lra = mgk.linear_attention(q, keys[:, :1], v, pi=one, mlk_form="lra", precision="exact")
    averaged = mgk.linear_attention(
        q, keys.mean(1, keepdims=True), v, pi=one, mlk_form="lra", precision="exact"
    )
    half = mgk.linear_attention(
        q, keys, v, pi=np.full((4, 2), 0.5), mlk_form="lra", precision="exact"
    )
    assert_same_bits(half, averaged, what="lra: phi(sum_r pi k_r)")
    assert lra.shape == half.shape


def test_linear_padding_mask_removes_keys(rng):
    q, keys, v, _ = _mgk_problem(rng, units=4)
    pi = np.full((4, 2), 0.5)
    padding = np.array([[True, False, True, True]])
    for form in mgk.MLK_FORMS:
        masked = mgk.linear_attention(
            q, keys, v, pi=pi, mask=padding, mlk_form=form, precision="exact"
        )
        if form == "lra":  # its (L S)^(-1/4) counts the padded length, as the public code
            continue
        cut = mgk.linear_attention(
            q, keys[[0, 2, 3]], v[[0, 2, 3]], pi=pi[[0, 2, 3]], mlk_form=form, precision="exact"
        )
        assert_same_bits(masked, cut, what=f"padding mask vs removed key ({form})")


def test_option_rejects(rng):
    q, keys, v, _ = _mgk_problem(rng)
    with pytest.raises(ValueError, match="mlk_form"):
        mgk.linear_attention(q, keys, v, pi=np.full((3, 2), 0.5), mlk_form="performer")
    with pytest.raises(ValueError, match="pi_update"):
        mgk.em_update_pi(q, keys, log_pi=np.log(np.full((3, 2), 0.5)), sigma2=1.0, pi_update="mean")
    with pytest.raises(ValueError, match="row_eps"):
        mgk.attention(q, keys, v, row_eps=-1.0)
    with pytest.raises(ValueError, match="row_eps"):
        mgk.attention(q, keys, v, row_eps=1e-6, backend="numba")
