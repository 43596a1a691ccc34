"""Tests of the gmm vector-Jacobian products and of the public-code readings (forms).

Truth for the gradients: central differences with one Richardson step of the mpmath loop twins
(tests/naive/gmm.py, 60 digits, nothing from refattn) -- the exact path must equal them rounded
once wherever the error estimate decides the rounding; and torch autograd of an independent
float64 twin (tests/naive/gmm_torch.py). The float64 reverse pass claims no proven bound: it is
checked against the exact path within the first-order estimate ``gmm_vjp_bound``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refattn import gmm
from refattn.bounds import gamma
from tests.helpers import assert_same_bits, assert_within
from tests.naive.gmm import DPS, naive_adapt_keys, naive_adapt_priors, naive_gmm
from tests.naive.mp import central_vjp
from tests.naive.rounding import round_nested
from tests.registry import gmm_term_scale, gmm_vjp_bound
from tests.strategies import gmm_cases, mixture_problems

L, S, D, E = 3, 3, 2, 2


def _assert_rounds_to(value, estimate, error, what):
    """``value`` is the estimate rounded once wherever [estimate -+ error] rounds to one float;
    elsewhere (a gradient that may be exactly 0) it lies in the rounded range."""
    __tracebackhide__ = True
    lo, hi = round_nested(estimate - error), round_nested(estimate + error)
    decided = lo == hi
    assert_same_bits(np.asarray(value)[decided], lo[decided], what=what)
    straddles = (lo <= 0) & (hi >= 0)
    assert (decided | straddles).all(), f"{what}: an error estimate too wide away from 0"
    inside = (value >= lo) & (value <= hi)
    assert inside[~decided].all(), f"{what}: outside the estimate where undecided"


def _problem(seed, per_unit=False):
    rng = np.random.default_rng(seed)
    q, keys, values = (rng.standard_normal(shape) for shape in ((L, D), (S, D), (S, E)))
    alpha = rng.uniform(0.5, 2.0, S) if per_unit else 0.8
    beta = rng.uniform(0.5, 2.0, S) if per_unit else 0.4
    return rng, q, keys, values, alpha, beta


ATTENTION_CASES = {
    "uniform iters 3": dict(iters=3),
    "per-unit iters 2": dict(iters=2, per_unit=True),
    "magnitude": dict(iters=2, prior="magnitude"),
    "magnitude per-unit v_init": dict(iters=2, prior="magnitude", per_unit=True, v_init=True),
    "array prior": dict(iters=2, prior="array"),
    "causal bottom_right": dict(iters=2, causal=True, align="bottom_right"),
    "mask with empty row": dict(iters=1, mask="empty"),
    "unnormalised per-unit": dict(iters=2, per_unit=True, form="unnormalised"),
}


def _attention_case(name, seed=7):
    spec = dict(ATTENTION_CASES[name])
    rng, q, keys, values, alpha, beta = _problem(seed, spec.pop("per_unit", False))
    kwargs = dict(alpha=alpha, beta=beta, iters=spec.pop("iters"))
    naive_extra = {}
    prior = spec.pop("prior", "uniform")
    kwargs["prior"] = rng.standard_normal(S) if prior == "array" else prior
    if spec.pop("v_init", False):
        kwargs["v_init"] = rng.standard_normal((L, E))
    if spec.pop("causal", False):
        kwargs.update(causal=True, align=spec.pop("align"))
        offset = S - L if kwargs["align"] == "bottom_right" else 0
        naive_extra["allowed"] = np.arange(S)[None, :] <= np.arange(L)[:, None] + offset
    if spec.pop("mask", None):
        allowed = rng.random((L, S)) < 0.7
        allowed[0] = False
        allowed[1, 0] = True
        kwargs["mask"] = allowed
        naive_extra["allowed"] = allowed
    if "form" in spec:
        kwargs["form"] = spec.pop("form")
        naive_extra["normalisers"] = False
    grad = rng.standard_normal((L, E))
    return (q, keys, values), kwargs, naive_extra, grad


def _naive_attention(kwargs, extra):
    keys = ("alpha", "beta", "prior", "v_init", "iters")

    def function(q, keys_, values):
        out, _ = naive_gmm(
            q, keys_, values, **{k: kwargs.get(k) for k in keys if k in kwargs}, **extra
        )
        return out

    return function


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_vjp_exact_is_rounded_central_difference(name):
    arrays, kwargs, extra, grad = _attention_case(name)
    got = gmm.attention_vjp(*arrays, grad, **kwargs, precision="exact")
    truth = central_vjp(_naive_attention(kwargs, extra), arrays, grad, dps=DPS)
    for field, value, (estimate, error) in zip(got._fields, got, truth, strict=True):
        _assert_rounds_to(value, estimate, error, f"gmm.attention_vjp exact {field} ({name})")


def _float64_bound(arrays, kwargs, grads, grad):
    q, keys, values = arrays
    beta = kwargs.get("beta", 0.0)
    prior = kwargs.get("prior", "uniform")
    scale = gmm_term_scale(q, keys, values, kwargs["alpha"], beta, prior)
    diameter = np.ptp(values, axis=-2).max() ** 2 * values.shape[-1]
    return gmm_vjp_bound(
        scale,
        L + S,
        D + E,
        grads,
        grad,
        np.abs(values).max(),
        kwargs["iters"],
        1 + float(np.max(beta)) * diameter,
    )


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_vjp_float64_near_exact(name):
    arrays, kwargs, _, grad = _attention_case(name)
    exact = gmm.attention_vjp(*arrays, grad, **kwargs, precision="exact")
    fast = gmm.attention_vjp(*arrays, grad, **kwargs)
    bound = _float64_bound(arrays, kwargs, exact, grad)
    for field, value, truth in zip(fast._fields, fast, exact, strict=True):
        assert_within(value, truth, bound, what=f"gmm.attention_vjp float64 {field} ({name})")


def _torch_grads(function, arrays, grad):
    torch = pytest.importorskip("torch")
    leaves = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]
    out = function(torch, *leaves)
    (out * torch.tensor(grad, dtype=torch.float64)).sum().backward()
    return [leaf.grad.numpy() for leaf in leaves]


@pytest.mark.peers("torch")
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_vjp_matches_torch_autograd(name):
    from tests.naive.gmm_torch import torch_attention

    arrays, kwargs, extra, grad = _attention_case(name)
    options = {k: kwargs[k] for k in ("alpha", "beta", "prior", "v_init", "iters") if k in kwargs}
    autograd = _torch_grads(
        lambda torch, *a: torch_attention(torch, *a, **options, **extra), arrays, grad
    )
    exact = gmm.attention_vjp(*arrays, grad, **kwargs, precision="exact")
    bound = _float64_bound(arrays, kwargs, exact, grad)
    for field, value, truth in zip(exact._fields, autograd, exact, strict=True):
        assert_within(value, truth, bound, what=f"torch autograd twin {field} ({name})")


KEY_CASES = [
    ("paper", dict(alpha=0.7, gamma=1.3, iters=3)),
    ("map", dict(alpha=0.7, gamma=1.3, iters=3)),
    ("map_recentred", dict(alpha=0.7, gamma=1.3, iters=3)),
    ("paper", dict(alpha=np.array([0.6, 1.1, 1.7]), gamma=np.array([0.0, 1.0, np.inf]), iters=2)),
    ("map", dict(alpha=np.array([0.6, 1.1, 1.7]), gamma=np.array([0.0, 0.5, np.inf]), iters=2)),
    ("map_recentred", dict(alpha=0.9, gamma=0.4, iters=2, prior="magnitude")),
]


def _keys_case(index):
    form, kwargs = KEY_CASES[index]
    rng = np.random.default_rng(11 + index)
    queries, keys0 = rng.standard_normal((L, D)), rng.standard_normal((S, D))
    return form, dict(kwargs), (queries, keys0), rng.standard_normal((S, D))


@pytest.mark.parametrize("index", range(len(KEY_CASES)))
def test_adapt_keys_vjp(index):
    form, kwargs, arrays, grad = _keys_case(index)
    exact = gmm.adapt_keys_vjp(*arrays, grad, **kwargs, form=form, precision="exact")
    prior = kwargs.pop("prior", "uniform")

    def naive(queries, keys0):
        return naive_adapt_keys(queries, keys0, prior=prior, form=form, **kwargs)

    truth = central_vjp(naive, arrays, grad, dps=DPS)
    what = f"gmm.adapt_keys_vjp {form} case {index}"
    for field, value, (estimate, error) in zip(exact._fields, exact, truth, strict=True):
        _assert_rounds_to(value, estimate, error, f"{what} exact {field}")
    fast = gmm.adapt_keys_vjp(*arrays, grad, **kwargs, prior=prior, form=form)
    q, keys0 = arrays
    scale = gmm_term_scale(q, keys0, np.zeros((S, 1)), kwargs["alpha"], 0.0, prior)
    bound = gmm_vjp_bound(
        scale, L + S, D, exact, grad, np.abs(q).max() + np.abs(keys0).max(), kwargs["iters"]
    )
    for field, value, want in zip(fast._fields, fast, exact, strict=True):
        assert_within(value, want, bound, what=f"{what} float64 {field}")


@pytest.mark.peers("torch")
@pytest.mark.parametrize("index", range(len(KEY_CASES)))
def test_adapt_keys_vjp_matches_torch_autograd(index):
    from tests.naive.gmm_torch import torch_adapt_keys

    form, kwargs, arrays, grad = _keys_case(index)
    autograd = _torch_grads(
        lambda torch, *a: torch_adapt_keys(torch, *a, form=form, **kwargs), arrays, grad
    )
    exact = gmm.adapt_keys_vjp(*arrays, grad, **kwargs, form=form, precision="exact")
    q, keys0 = arrays
    scale = gmm_term_scale(
        q, keys0, np.zeros((S, 1)), kwargs["alpha"], 0.0, kwargs.get("prior", "uniform")
    )
    bound = gmm_vjp_bound(
        scale, L + S, D, exact, grad, np.abs(q).max() + np.abs(keys0).max(), kwargs["iters"]
    )
    for field, value, want in zip(exact._fields, autograd, exact, strict=True):
        assert_within(value, want, bound, what=f"torch twin adapt_keys {form} {field}")


PRIOR_CASES = [
    ("paper", dict(alpha=0.7, eta=0.5, iters=3)),
    ("map", dict(alpha=0.7, eta=2.0, iters=2)),
    ("paper", dict(alpha=np.array([0.6, 1.1, 1.7]), eta=np.array([0.2, 1.0, 0.0]), iters=2)),
    ("map", dict(alpha=np.array([0.6, 1.1, 1.7]), eta=np.array([0.2, 1.0, 3.0]), iters=2)),
]


def _priors_case(index):
    form, kwargs = PRIOR_CASES[index]
    rng = np.random.default_rng(23 + index)
    queries, keys = rng.standard_normal((L, D)), rng.standard_normal((S, D))
    kwargs = dict(kwargs, pi0=np.array([0.5, 0.25, 0.25]))
    return form, kwargs, (queries, keys), rng.standard_normal(S)


@pytest.mark.parametrize("index", range(len(PRIOR_CASES)))
def test_adapt_priors_vjp(index):
    form, kwargs, arrays, grad = _priors_case(index)
    exact = gmm.adapt_priors_vjp(*arrays, grad, **kwargs, form=form, precision="exact")

    def naive(queries, keys):
        return naive_adapt_priors(queries, keys, form=form, **kwargs)

    truth = central_vjp(naive, arrays, grad, dps=DPS)
    what = f"gmm.adapt_priors_vjp {form} case {index}"
    for field, value, (estimate, error) in zip(exact._fields, exact, truth, strict=True):
        _assert_rounds_to(value, estimate, error, f"{what} exact {field}")
    fast = gmm.adapt_priors_vjp(*arrays, grad, **kwargs, form=form)
    q, keys = arrays
    scale = gmm_term_scale(q, keys, np.zeros((S, 1)), kwargs["alpha"], 0.0, "uniform")
    bound = gmm_vjp_bound(scale, L + S, D, exact, grad, 2.0, kwargs["iters"])
    for field, value, want in zip(fast._fields, fast, exact, strict=True):
        assert_within(value, want, bound, what=f"{what} float64 {field}")


@pytest.mark.peers("torch")
@pytest.mark.parametrize("index", range(len(PRIOR_CASES)))
def test_adapt_priors_vjp_matches_torch_autograd(index):
    from tests.naive.gmm_torch import torch_adapt_priors

    form, kwargs, arrays, grad = _priors_case(index)
    autograd = _torch_grads(
        lambda torch, *a: torch_adapt_priors(torch, *a, form=form, **kwargs), arrays, grad
    )
    exact = gmm.adapt_priors_vjp(*arrays, grad, **kwargs, form=form, precision="exact")
    q, keys = arrays
    scale = gmm_term_scale(q, keys, np.zeros((S, 1)), kwargs["alpha"], 0.0, "uniform")
    bound = gmm_vjp_bound(scale, L + S, D, exact, grad, 2.0, kwargs["iters"])
    for field, value, want in zip(exact._fields, autograd, exact, strict=True):
        assert_within(value, want, bound, what=f"torch twin adapt_priors {form} {field}")


# --------------------------------------------------------------------------------------------
# Batches, broadcasting, dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["float64", "exact"])
def test_vjp_broadcast_inputs_sum_over_the_batch(precision):
    """keys shared by a batch of two: dkeys is the sum of the per-element gradients, and on the
    exact path that sum is rounded once (it equals the rounded sum of exact gradients only up
    to that rounding, so the exact check uses one batch element's exact parts)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, L, D))
    keys, values = rng.standard_normal((S, D)), rng.standard_normal((S, E))
    grad = rng.standard_normal((2, L, E))
    kwargs = dict(alpha=0.9, beta=0.3, iters=2, precision=precision)
    got = gmm.attention_vjp(q, keys, values, grad, **kwargs)
    assert got.dq.shape == q.shape and got.dkeys.shape == keys.shape
    parts = [gmm.attention_vjp(q[b], keys, values, grad[b], **kwargs) for b in range(2)]
    assert_same_bits(got.dq, np.stack([p.dq for p in parts]), what="dq per batch element")
    if precision == "float64":
        total = parts[0].dkeys + parts[1].dkeys
        bound = gamma(2) * (np.abs(parts[0].dkeys) + np.abs(parts[1].dkeys))
        assert_within(got.dkeys, total, bound, what="dkeys summed over the batch")
    else:

        def twice(q_both, keys_, values_):
            outs = [
                naive_gmm(q_both[b], keys_, values_, alpha=0.9, beta=0.3, iters=2)[0]
                for b in range(2)
            ]
            return outs

        truth = central_vjp(twice, (q, keys, values), grad, dps=DPS)
        _assert_rounds_to(got.dkeys, *truth[1], "dkeys summed over the batch, exact")
        _assert_rounds_to(got.dvalues, *truth[2], "dvalues summed over the batch, exact")


def test_vjp_exact_out_dtype():
    arrays, kwargs, extra, grad = _attention_case("uniform iters 3")
    got = gmm.attention_vjp(*arrays, grad, **kwargs, precision="exact", out_dtype="float32")
    truth = central_vjp(_naive_attention(kwargs, extra), arrays, grad, dps=DPS)
    for value, (estimate, _) in zip(got, truth, strict=True):
        assert value.dtype == np.float32
        assert_same_bits(
            value.astype(np.float64),
            round_nested(estimate, "float32"),
            what="gmm.attention_vjp exact float32",
        )


@pytest.mark.parametrize(
    "function, args, match",
    [
        ("attention_vjp", dict(grad_out=np.ones((L, E + 1))), "grad_out"),
        ("attention_vjp", dict(grad_out=np.full((L, E), np.nan)), "grad_out"),
        ("adapt_keys_vjp", dict(grad_out=np.ones((S + 1, D))), "grad_out"),
    ],
)
def test_vjp_rejects(function, args, match):
    rng, q, keys, values, alpha, beta = _problem(1)
    if function == "attention_vjp":
        with pytest.raises(ValueError, match=match):
            gmm.attention_vjp(q, keys, values, args["grad_out"], alpha=alpha, beta=beta)
    else:
        with pytest.raises(ValueError, match=match):
            gmm.adapt_keys_vjp(q, keys, args["grad_out"], alpha=alpha, gamma=1.0)


# --------------------------------------------------------------------------------------------
# Random cases (ties, zeros, dyadic, wide inputs; batched): float64 reverse pass near exact
# --------------------------------------------------------------------------------------------


@settings(max_examples=20)
@given(
    case=gmm_cases(max_iters=3),
    seed=st.integers(0, 2**32 - 1),
    form=st.sampled_from(["paper", "unnormalised"]),
    masking=st.sampled_from([None, "mask", "causal"]),
)
def test_attention_vjp_float64_near_exact_random(case, seed, form, masking):
    rng = np.random.default_rng(seed)
    q, keys, values = case["q"], case["keys"], case["values"]
    grad = rng.standard_normal(q.shape[:-1] + (values.shape[-1],))
    kwargs = {k: case[k] for k in ("alpha", "beta", "prior", "v_init", "iters")}
    if masking == "mask":
        kwargs["mask"] = rng.random(q.shape[-2:-1] + keys.shape[-2:-1]) < 0.6
    elif masking == "causal":
        kwargs.update(causal=True, align=str(rng.choice(["top_left", "bottom_right"])))
    exact = gmm.attention_vjp(q, keys, values, grad, **kwargs, form=form, precision="exact")
    fast = gmm.attention_vjp(q, keys, values, grad, **kwargs, form=form)
    scale = gmm_term_scale(q, keys, values, case["alpha"], case["beta"], case["prior"])
    diameter = np.ptp(values, axis=-2).max() ** 2 * values.shape[-1]
    bound = gmm_vjp_bound(
        scale,
        q.shape[-2] + keys.shape[-2],
        q.shape[-1] + values.shape[-1],
        exact,
        grad,
        np.abs(values).max(),
        case["iters"],
        1 + float(np.max(case["beta"])) * diameter,
    )
    for field, value, truth in zip(fast._fields, fast, exact, strict=True):
        assert_within(
            value, truth, bound, what=f"gmm.attention_vjp float64 {field}", case=case["style"]
        )


@settings(max_examples=15)
@given(
    problem=mixture_problems(),
    seed=st.integers(0, 2**32 - 1),
    form=st.sampled_from(["paper", "map", "map_recentred"]),
    prior=st.sampled_from(["uniform", "magnitude"]),
    iters=st.integers(1, 3),
)
def test_adapt_keys_vjp_float64_near_exact_random(problem, seed, form, prior, iters):
    q, keys0, _, style = problem
    rng = np.random.default_rng(seed)
    units = keys0.shape[-2]
    kwargs = dict(
        alpha=rng.uniform(0.3, 2.0, units),
        gamma=rng.choice([0.0, 0.7, np.inf], units),
        prior=prior,
        iters=iters,
        form=form,
    )
    grad = rng.standard_normal(keys0.shape)
    exact = gmm.adapt_keys_vjp(q, keys0, grad, **kwargs, precision="exact")
    fast = gmm.adapt_keys_vjp(q, keys0, grad, **kwargs)
    scale = gmm_term_scale(q, keys0, np.zeros(keys0.shape[:-1] + (1,)), kwargs["alpha"], 0.0, prior)
    bound = gmm_vjp_bound(
        scale,
        q.shape[-2] + units,
        q.shape[-1],
        exact,
        grad,
        np.abs(q).max() + np.abs(keys0).max(),
        iters,
        q.shape[-2] + 1,
    )
    for field, value, truth in zip(fast._fields, fast, exact, strict=True):
        assert_within(
            value, truth, bound, what=f"gmm.adapt_keys_vjp float64 {field} {form}", case=style
        )


@settings(max_examples=15)
@given(
    problem=mixture_problems(),
    seed=st.integers(0, 2**32 - 1),
    form=st.sampled_from(["paper", "map"]),
    iters=st.integers(1, 3),
)
def test_adapt_priors_vjp_float64_near_exact_random(problem, seed, form, iters):
    q, keys, _, style = problem
    rng = np.random.default_rng(seed)
    units = keys.shape[-2]
    pi0 = rng.uniform(0.1, 1.0, units)
    kwargs = dict(
        alpha=rng.uniform(0.3, 2.0, units),
        eta=float(rng.uniform(0.0, 2.0)),
        pi0=pi0 / pi0.sum(),
        iters=iters,
        form=form,
    )
    grad = rng.standard_normal(keys.shape[:-1])
    exact = gmm.adapt_priors_vjp(q, keys, grad, **kwargs, precision="exact")
    fast = gmm.adapt_priors_vjp(q, keys, grad, **kwargs)
    scale = gmm_term_scale(
        q, keys, np.zeros(keys.shape[:-1] + (1,)), kwargs["alpha"], 0.0, "uniform"
    )
    bound = gmm_vjp_bound(
        scale, q.shape[-2] + units, q.shape[-1], exact, grad, 2.0, iters, q.shape[-2] + 1
    )
    for field, value, truth in zip(fast._fields, fast, exact, strict=True):
        assert_within(
            value, truth, bound, what=f"gmm.adapt_priors_vjp float64 {field} {form}", case=style
        )


@pytest.mark.parametrize("form", ["paper", "map", "map_recentred"])
@pytest.mark.parametrize("gamma_value", [0.0, 0.5])
def test_adapt_keys_far_unit_stays_finite(form, gamma_value):
    """A unit ~56 away from every query: its responsibilities underflow in float64 (W_k = 0)
    while log W_k is finite; the MAP forms must not form 0/0 (forward and reverse)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, 2))
    keys0 = np.vstack([rng.standard_normal((2, 2)), [[40.0, 40.0]]])
    grad = rng.standard_normal(keys0.shape)
    kwargs = dict(alpha=1.0, gamma=gamma_value, iters=2, form=form)
    exact = gmm.adapt_keys_vjp(q, keys0, grad, **kwargs, precision="exact")
    fast = gmm.adapt_keys_vjp(q, keys0, grad, **kwargs)
    scale = gmm_term_scale(q, keys0, np.zeros((3, 1)), 1.0, 0.0, "uniform")
    bound = gmm_vjp_bound(
        scale, 6, 2, exact, grad, np.abs(q).max() + np.abs(keys0).max(), 2, q.shape[0] + 1
    )
    for field, value, truth in zip(fast._fields, fast, exact, strict=True):
        assert_within(value, truth, bound, what=f"far unit {form} gamma={gamma_value} {field}")
    forward = gmm.adapt_keys(q, keys0, **kwargs)
    assert np.isfinite(forward).all()
