"""Tests of refattn.gmm (Movellan & Gabbur): EM attention, log posterior, key/prior adaptation.

Truth is the loop-level mpmath twin of tests/naive/gmm.py, from the paper's equations (60 digits,
independent of refattn); the exact path must equal it rounded once, the float64 path must lie
within the documented first-order bounds of oracle.judging.tolerance.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.judging.tolerance import iterated_bound, logit_lse_bound, mixture_bound
from refattn import gmm
from refattn.attention import attention
from refattn.exact.rounding import FORMATS
from tests.helpers import assert_same_bits, assert_within
from tests.naive.gmm import (
    DPS,
    naive_adapt_keys,
    naive_adapt_priors,
    naive_gmm,
    naive_query_terms,
    naive_value_terms,
)
from tests.naive.mp import exact_div, exact_mul, exact_sum, lse, mp, per_unit, softmax_weights
from tests.naive.rounding import round_nested
from tests.registry import gmm_term_scale
from tests.strategies import gmm_cases, mixture_problems

# --------------------------------------------------------------------------------------------
# Problem builders
# --------------------------------------------------------------------------------------------


def _first(x):
    """The first batch element of a (possibly batched) problem."""
    return x[0] if x.ndim == 3 else x


def _call(case, **extra):
    kwargs = {k: case[k] for k in ("alpha", "beta", "prior", "v_init", "iters")}
    kwargs.update(extra)
    return gmm.attention(case["q"], case["keys"], case["values"], **kwargs)


# --------------------------------------------------------------------------------------------
# attention: exact path == mpmath truth rounded once (random cases: tests/test_registry.py)
# --------------------------------------------------------------------------------------------


@settings(max_examples=20)
@given(case=gmm_cases(need_trace=True, batched=False))
def test_exact_trace_is_correctly_rounded(case):
    res = _call(case, precision="exact", return_trace=True)
    _, trace = naive_gmm(
        case["q"],
        case["keys"],
        case["values"],
        alpha=case["alpha"],
        beta=case["beta"],
        prior=case["prior"],
        v_init=case["v_init"],
        iters=case["iters"],
    )
    assert_same_bits(res.trace, round_nested(trace), what="gmm.attention exact trace")
    assert (res.iterations == case["iters"]).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_exact_out_dtypes(dtype, rng):
    q, keys, values = (
        rng.standard_normal((2, 3)),
        rng.standard_normal((4, 3)),
        rng.standard_normal((4, 2)),
    )
    out = gmm.attention(
        q, keys, values, alpha=0.7, beta=0.3, iters=2, precision="exact", out_dtype=dtype
    )
    assert out.dtype == FORMATS[dtype].dtype
    truth, _ = naive_gmm(q, keys, values, alpha=0.7, beta=0.3, iters=2)
    assert_same_bits(
        out.astype(np.float64),
        round_nested(truth, dtype),
        what=f"gmm.attention exact out_dtype={dtype}",
    )


def test_exact_takes_inputs_at_their_binary_value(rng):
    """float16 inputs are the same numbers as their float64 widening on the exact path."""
    q = rng.standard_normal((2, 2)).astype(np.float16)
    keys = rng.standard_normal((3, 2)).astype(np.float16)
    values = rng.standard_normal((3, 2)).astype(np.float16)
    narrow = gmm.attention(q, keys, values, alpha=1.0, precision="exact")
    wide = gmm.attention(
        *(x.astype(np.float64) for x in (q, keys, values)), alpha=1.0, precision="exact"
    )
    assert_same_bits(narrow, wide, what="gmm.attention float16 inputs")


# --------------------------------------------------------------------------------------------
# attention: float64 path within its bound (one iteration: tests/test_registry.py)
# --------------------------------------------------------------------------------------------


@settings(max_examples=30)
@given(case=gmm_cases(max_iters=3, need_trace=True))
def test_float64_within_bound_iterated(case):
    fast = _call(case)
    exact = _call(case, precision="exact")
    scale = gmm_term_scale(
        case["q"], case["keys"], case["values"], case["alpha"], case["beta"], case["prior"]
    )
    values = case["values"]
    step = mixture_bound(
        scale, values.shape[-2], case["q"].shape[-1] + values.shape[-1], np.abs(values).max()
    )
    diameter = np.ptp(values, axis=-2).max() ** 2 * values.shape[-1]
    lipschitz = 1 + float(np.max(case["beta"])) * diameter
    bound = iterated_bound(step, lipschitz, case["iters"])
    assert_within(fast, exact, bound, what=f"gmm.attention float64 iters={case['iters']}")


# --------------------------------------------------------------------------------------------
# attention: properties
# --------------------------------------------------------------------------------------------


@settings(max_examples=40)
@given(problem=mixture_problems(), alpha=st.sampled_from([0.125, 0.7, 1.0, 3.0]))
def test_magnitude_prior_beta0_is_softmax_attention_bit_for_bit(problem, alpha):
    """Eqs. (15)-(20): p(u) ∝ exp(alpha ||xi_u||^2 / 2), beta = 0, one iteration is
    refattn.attention(q, keys, values, scale=alpha); both exact paths round the same real."""
    q, keys, values, style = problem
    ours = gmm.attention(q, keys, values, alpha=alpha, prior="magnitude", precision="exact")
    theirs = attention(q, keys, values, scale=alpha, precision="exact")
    assert_same_bits(ours, theirs, what=f"gmm magnitude vs attention ({style}, alpha={alpha})")


@settings(max_examples=40)
@given(case=gmm_cases(max_iters=6, need_trace=True))
def test_em_trace_never_decreases_float64(case):
    res = _call(case, return_trace=True)
    scale = gmm_term_scale(
        case["q"], case["keys"], case["values"], case["alpha"], case["beta"], case["prior"]
    )
    slack = 4 * logit_lse_bound(
        scale, case["keys"].shape[-2], case["q"].shape[-1] + case["values"].shape[-1], scale
    )
    steps = np.diff(res.trace, axis=-1)
    worst = np.unravel_index(int(np.argmin(steps)), steps.shape) if steps.size else None
    assert worst is None or steps[worst] >= -slack, (
        f"gmm EM trace decreased at {list(worst)}: step {steps[worst]!r} < -{slack:.3e}"
    )
    if case["v_init"] is not None:
        start = gmm.log_posterior(
            np.broadcast_to(case["v_init"], res.values.shape),
            case["q"],
            case["keys"],
            case["values"],
            alpha=case["alpha"],
            beta=case["beta"],
            prior=case["prior"],
        )
        assert (res.trace[..., 0] >= start - slack).all(), "first EM step decreased log p(v|q)"


@settings(max_examples=20)
@given(case=gmm_cases(max_iters=4, need_trace=True, batched=False))
def test_em_trace_never_decreases_exact(case):
    """Rounding is monotone, so the correctly rounded trace of a non-decreasing sequence is
    non-decreasing with no slack at all."""
    res = _call(case, precision="exact", return_trace=True)
    steps = np.diff(res.trace, axis=-1)
    assert (steps >= 0).all(), f"exact EM trace decreased: {res.trace.tolist()}"


def test_first_e_step_has_no_beta_term(rng):
    """v_init=None: v_1 does not depend on beta (uniform prior), and equals plain EM from a
    v_0 with beta -> 0."""
    q, keys, values = (
        rng.standard_normal((2, 3)),
        rng.standard_normal((4, 3)),
        rng.standard_normal((4, 2)),
    )
    small = gmm.attention(q, keys, values, alpha=1.0, beta=0.1, precision="exact")
    large = gmm.attention(q, keys, values, alpha=1.0, beta=7.0, precision="exact")
    none = gmm.attention(q, keys, values, alpha=1.0, beta=0.0, precision="exact")
    assert_same_bits(small, large, what="v_1 with beta=0.1 vs beta=7")
    assert_same_bits(small, none, what="v_1 with beta=0.1 vs beta=0")


def test_excluded_unit_is_removed(rng):
    """A -inf log prior removes the unit exactly: same result as without it."""
    q, keys, values = (
        rng.standard_normal((2, 3)),
        rng.standard_normal((4, 3)),
        rng.standard_normal((4, 2)),
    )
    prior = np.array([0.3, -0.2, 0.1, -np.inf])
    full = gmm.attention(
        q, keys, values, alpha=1.0, beta=0.5, prior=prior, iters=2, precision="exact"
    )
    cut = gmm.attention(
        q, keys[:3], values[:3], alpha=1.0, beta=0.5, prior=prior[:3], iters=2, precision="exact"
    )
    assert_same_bits(full, cut, what="-inf prior unit vs removed unit")


def test_batch_matches_loop(rng):
    q, keys, values = (
        rng.standard_normal((2, 2, 3)),
        rng.standard_normal((2, 3, 3)),
        rng.standard_normal((2, 3, 2)),
    )
    alpha = rng.uniform(0.5, 2.0, (2, 3))
    batched = gmm.attention(q, keys, values, alpha=alpha, beta=0.2, iters=2, precision="exact")
    for b in range(2):
        single = gmm.attention(
            q[b], keys[b], values[b], alpha=alpha[b], beta=0.2, iters=2, precision="exact"
        )
        assert_same_bits(batched[b], single, what=f"batch element {b}")


def test_underflowing_scores_stay_finite(rng):
    """Scores ~ -1e4: a direct sum of exponentials is 0/0 (NaN), the log-space path is not."""
    q = rng.standard_normal((2, 2)) + 70.0
    keys = rng.standard_normal((3, 2))
    values = rng.standard_normal((3, 2))
    with np.errstate(all="ignore"):
        raw = np.exp(-1.0 / 2 * ((q[:, None, :] - keys[None]) ** 2).sum(-1))
        naive_out = (raw @ values) / raw.sum(-1, keepdims=True)
    assert np.isnan(naive_out).all(), "premise: the unshifted formula underflows"
    fast = gmm.attention(q, keys, values, alpha=1.0)
    exact = gmm.attention(q, keys, values, alpha=1.0, precision="exact")
    truth, _ = naive_gmm(q, keys, values, alpha=1.0, beta=0.0)
    assert_same_bits(exact, round_nested(truth), what="gmm exact at scores ~ -1e4")
    scale = gmm_term_scale(q, keys, values, 1.0, 0.0, "uniform")
    assert_within(
        fast,
        exact,
        mixture_bound(scale, 3, 2, np.abs(values).max()),
        what="gmm float64 at scores ~ -1e4",
    )


def test_tol_stops_rows_independently(rng):
    q = np.array([[0.0, 0.0], [3.0, -2.0]])
    keys = rng.standard_normal((3, 2))
    values = np.array([[1.0], [1.0], [1.0]])  # every row converges at once ...
    values = np.concatenate([values, rng.standard_normal((3, 1))], axis=-1)
    res = gmm.attention(
        q, keys, values, alpha=1.0, beta=0.5, iters=50, tol=1e-12, return_trace=True
    )
    assert (res.iterations < 50).all(), f"rows did not stop: {res.iterations}"
    for i, count in enumerate(res.iterations):
        assert np.isfinite(res.trace[i, :count]).all()
        assert np.isnan(res.trace[i, count:]).all(), f"row {i}: trace not NaN after stop"


def test_log_posterior_exact_and_float64(rng):
    q, keys, values = (
        rng.standard_normal((3, 2)),
        rng.standard_normal((4, 2)),
        rng.standard_normal((4, 2)),
    )
    v = rng.standard_normal((3, 2))
    alpha, beta = np.array([0.5, 1.0, 2.0, 1.5]), 0.75
    exact = gmm.log_posterior(v, q, keys, values, alpha=alpha, beta=beta, precision="exact")
    with mpmath.workdps(DPS):
        a_u, b_u = per_unit(alpha, 4), per_unit(beta, 4)
        truth = []
        for i in range(3):
            a = naive_query_terms(q[i], keys, values, a_u, b_u, "uniform")
            b = naive_value_terms([mp(x) for x in v[i]], values, b_u)
            truth.append(lse([s + t for s, t in zip(a, b, strict=True)]) - lse(a))
    assert_same_bits(exact, round_nested(truth), what="gmm.log_posterior exact")
    fast = gmm.log_posterior(v, q, keys, values, alpha=alpha, beta=beta)
    scale = gmm_term_scale(q, keys, values, alpha, beta, "uniform") + np.abs(v).max() ** 2 * 4
    assert_within(
        fast, exact, 2 * logit_lse_bound(scale, 4, 4, scale), what="gmm.log_posterior float64"
    )


# --------------------------------------------------------------------------------------------
# adapt_keys
# --------------------------------------------------------------------------------------------


@settings(max_examples=25)
@given(
    problem=mixture_problems(batched=False),
    gamma=st.sampled_from([0.0, 0.5, 3.0]),
    form=st.sampled_from(["paper", "map", "map_recentred"]),
    prior=st.sampled_from(["uniform", "magnitude"]),
    iters=st.integers(1, 2),
)
def test_adapt_keys_exact_and_float64(problem, gamma, form, prior, iters):
    q, keys, _, style = problem
    exact = gmm.adapt_keys(
        q, keys, alpha=0.8, gamma=gamma, prior=prior, iters=iters, form=form, precision="exact"
    )
    truth = naive_adapt_keys(q, keys, alpha=0.8, gamma=gamma, prior=prior, iters=iters, form=form)
    assert_same_bits(
        exact, round_nested(truth), what=f"adapt_keys exact ({style}, {form}, gamma={gamma})"
    )
    fast = gmm.adapt_keys(q, keys, alpha=0.8, gamma=gamma, prior=prior, iters=iters, form=form)
    scale = gmm_term_scale(q, keys, keys, 0.8, 0.0, "uniform")
    magnitude = np.abs(q).max() + np.abs(keys).max()
    bound = mixture_bound(scale, q.shape[0] + keys.shape[0], q.shape[1], magnitude)
    if form != "paper":
        bound *= q.shape[0] + 1  # sum_i w q_i / (gamma + alpha W): W up to L
    if iters == 1 or form == "map_recentred":  # re-centred: each step maps xi^t -> xi^t+1
        bound = iterated_bound(bound, q.shape[0] + 1, iters)
        assert_within(fast, exact, bound, what=f"adapt_keys float64 ({style}, {form})")


def test_gamma_infinity_leaves_keys_unchanged(rng):
    q, keys = rng.standard_normal((4, 3)), rng.standard_normal((2, 3))
    for form in ("paper", "map"):
        for precision in ("float64", "exact"):
            out = gmm.adapt_keys(
                q, keys, alpha=1.0, gamma=np.inf, form=form, iters=3, precision=precision
            )
            assert_same_bits(out, keys, what=f"gamma=inf ({form}, {precision})")


@pytest.mark.parametrize("form", ["paper", "map"])
def test_gamma_large_approaches_keys(form, rng):
    """|xi - xi0| <= alpha / (alpha + gamma) |q̄ - xi0| (paper) and the map form's smaller
    share: the deviation vanishes like 1/gamma."""
    q, keys = rng.standard_normal((4, 3)), rng.standard_normal((2, 3))
    reach = np.abs(q).max() + np.abs(keys).max()
    for gamma in (1e2, 1e6, 1e12):
        out = gmm.adapt_keys(q, keys, alpha=1.0, gamma=gamma, form=form, precision="exact")
        share = q.shape[0] / (1.0 + gamma) if form == "map" else 1.0 / (1.0 + gamma)
        deviation = np.abs(out - keys).max()
        assert deviation <= share * reach * (1 + mixture_bound(0.0, 1, 0, 1.0)), (
            f"gamma={gamma} ({form}): deviation {deviation:.3e} > {share * reach:.3e}"
        )


def test_key_forms_coincide(rng):
    """gamma = 0 (both forms give q̄: DNA) and W_k = 1 (one unit, one query)."""
    q, keys = rng.standard_normal((3, 2)), rng.standard_normal((2, 2))
    paper = gmm.adapt_keys(q, keys, alpha=1.0, gamma=0.0, form="paper", precision="exact")
    mapped = gmm.adapt_keys(q, keys, alpha=1.0, gamma=0.0, form="map", precision="exact")
    assert_same_bits(paper, mapped, what="gamma=0: paper vs map")
    one_q, one_key = q[:1], keys[:1]
    paper = gmm.adapt_keys(one_q, one_key, alpha=1.0, gamma=2.5, form="paper", precision="exact")
    mapped = gmm.adapt_keys(one_q, one_key, alpha=1.0, gamma=2.5, form="map", precision="exact")
    assert_same_bits(paper, mapped, what="W=1: paper vs map")
    differ = gmm.adapt_keys(q, keys, alpha=1.0, gamma=2.5, form="paper")
    gap = np.abs(differ - gmm.adapt_keys(q, keys, alpha=1.0, gamma=2.5, form="map")).max()
    assert gap > mixture_bound(1.0, 5, 2, 1.0), "forms should differ beyond rounding"


def test_gamma_zero_magnitude_is_dna(rng):
    """gamma -> 0 with the magnitude prior: xi_k = sum_i w_k^i q_i / sum_i w_k^i with
    w^i = softmax_k(alpha xi_k . q_i) (Ding et al.'s double-normalised attention)."""
    q, keys = rng.standard_normal((3, 2)), rng.standard_normal((2, 2))
    out = gmm.adapt_keys(q, keys, alpha=0.9, gamma=0.0, prior="magnitude", precision="exact")
    with mpmath.workdps(DPS):
        scores = [
            [mp(0.9) * mpmath.fsum(mp(a) * mp(b) for a, b in zip(qi, k, strict=True)) for k in keys]
            for qi in q
        ]
        weights = [softmax_weights(row) for row in scores]
        truth = [
            [
                exact_div(
                    exact_sum(exact_mul(weights[i][k], q[i][d]) for i in range(3)),
                    exact_sum(weights[i][k] for i in range(3)),
                )
                for d in range(2)
            ]
            for k in range(2)
        ]
    assert_same_bits(out, round_nested(truth), what="gamma=0 magnitude vs DNA")


# --------------------------------------------------------------------------------------------
# adapt_priors
# --------------------------------------------------------------------------------------------


@settings(max_examples=25)
@given(
    problem=mixture_problems(batched=False),
    eta=st.sampled_from([0.0, 1.0, 10.0]),
    form=st.sampled_from(["paper", "map"]),
    iters=st.integers(1, 2),
)
def test_adapt_priors_exact_and_float64(problem, eta, form, iters):
    q, keys, _, style = problem
    units = keys.shape[0]
    pi0 = np.full(units, 1.0 / units)
    exact = gmm.adapt_priors(
        q, keys, alpha=0.8, eta=eta, pi0=pi0, iters=iters, form=form, precision="exact"
    )
    truth = naive_adapt_priors(q, keys, alpha=0.8, eta=eta, pi0=pi0, iters=iters, form=form)
    assert_same_bits(
        exact, round_nested(truth), what=f"adapt_priors exact ({style}, {form}, eta={eta})"
    )
    fast = gmm.adapt_priors(q, keys, alpha=0.8, eta=eta, pi0=pi0, iters=iters, form=form)
    scale = gmm_term_scale(q, keys, keys, 0.8, 0.0, "uniform") + 2 * abs(math.log(units) + 1)
    bound = iterated_bound(mixture_bound(scale, q.shape[0] + units, q.shape[1], 2.0), 2, iters)
    assert_within(fast, exact, bound, what=f"adapt_priors float64 ({style}, {form})")
    assert abs(fast.sum() - 1) <= mixture_bound(0.0, units, 0, 1.0)


def test_eta_scalar_means_proportional_to_pi0(rng):
    q, keys = rng.standard_normal((3, 2)), rng.standard_normal((2, 2))
    pi0 = np.array([0.25, 0.75])
    scalar = gmm.adapt_priors(q, keys, alpha=1.0, eta=4.0, pi0=pi0, precision="exact")
    array = gmm.adapt_priors(q, keys, alpha=1.0, eta=4.0 * pi0, pi0=pi0, precision="exact")
    assert_same_bits(scalar, array, what="eta=4 vs eta=4*pi0")


def test_map_form_large_eta_recovers_pi0(rng):
    q, keys = rng.standard_normal((3, 2)), rng.standard_normal((2, 2))
    pi0 = np.array([0.25, 0.75])
    out = gmm.adapt_priors(q, keys, alpha=1.0, eta=1e15, pi0=pi0, form="map")
    assert_within(
        out, pi0, 4 * q.shape[0] / 1e15 + mixture_bound(0.0, 2, 0, 1.0), what="map form, eta=1e15"
    )


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.fixture
def rng():
    return np.random.default_rng(20260322)


@pytest.fixture
def small(rng):
    return rng.standard_normal((2, 3)), rng.standard_normal((4, 3)), rng.standard_normal((4, 2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alpha=0.0), "alpha"),
        (dict(alpha=-1.0), "alpha"),
        (dict(alpha=np.array([1.0, 1.0, np.nan, 1.0])), "alpha"),
        (dict(alpha=1.0, beta=-0.5), "beta"),
        (dict(alpha=1.0, beta=np.array([0.0, 1.0, 1.0, 1.0])), "beta"),
        (dict(alpha=np.ones(3)), "alpha"),
        (dict(alpha=1.0, prior="gauss"), "prior"),
        (dict(alpha=1.0, prior=np.array([0.0, np.nan, 0.0, 0.0])), "prior"),
        (dict(alpha=1.0, prior=np.full(4, -np.inf)), "prior"),
        (dict(alpha=1.0, iters=0), "iters"),
        (dict(alpha=1.0, tol=1e-3, precision="exact"), "tol"),
        (dict(alpha=1.0, return_trace=True), "return_trace"),
        (dict(alpha=1.0, beta=1.0, v_init=np.zeros((3, 2))), "v_init"),
        (dict(alpha=1.0, precision="double"), "precision"),
    ],
)
def test_attention_rejects(small, kwargs, match):
    q, keys, values = small
    with pytest.raises((TypeError, ValueError), match=match):
        gmm.attention(q, keys, values, **kwargs)


def test_shape_mismatches(small):
    q, keys, values = small
    with pytest.raises(ValueError, match="keys"):
        gmm.attention(q, keys[:, :2], values, alpha=1.0)
    with pytest.raises(ValueError, match="values"):
        gmm.attention(q, keys, values[:3], alpha=1.0)
    with pytest.raises(ValueError, match="batch"):
        gmm.attention(np.stack([q, q, q]), np.stack([keys, keys]), values, alpha=1.0)
    with pytest.raises(TypeError, match="q"):
        gmm.attention(q.astype(int), keys, values, alpha=1.0)
    with pytest.raises(ValueError, match="q"):
        gmm.attention(np.full_like(q, np.nan), keys, values, alpha=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(eta=1.0, pi0=np.array([0.5, 0.6, -0.1, 0.0])), "pi0"),
        (dict(eta=1.0, pi0=np.array([0.5, 0.4, 0.0, 0.0])), "pi0"),
        (dict(eta=1.0, pi0=np.full(3, 1 / 3)), "pi0"),
        (dict(eta=-1.0, pi0=np.full(4, 0.25)), "eta"),
        (dict(eta=np.array([1.0, -1.0, 0.0, 0.0]), pi0=np.full(4, 0.25)), "eta"),
        (dict(eta=1.0, pi0=np.full(4, 0.25), form="bayes"), "form"),
    ],
)
def test_adapt_priors_rejects(small, kwargs, match):
    q, keys, _ = small
    with pytest.raises((TypeError, ValueError), match=match):
        gmm.adapt_priors(q, keys, alpha=1.0, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(gamma=-1.0), "gamma"),
        (dict(gamma=np.nan), "gamma"),
        (dict(gamma=1.0, form="exactish"), "form"),
        (dict(gamma=1.0, alpha=0.0), "alpha"),
    ],
)
def test_adapt_keys_rejects(small, kwargs, match):
    q, keys, _ = small
    kwargs.setdefault("alpha", 1.0)
    with pytest.raises((TypeError, ValueError), match=match):
        gmm.adapt_keys(q, keys, **kwargs)


def test_log_posterior_needs_positive_beta(small):
    q, keys, values = small
    with pytest.raises(ValueError, match="beta"):
        gmm.log_posterior(np.zeros((2, 2)), q, keys, values, alpha=1.0, beta=0.0)


def test_exact_tie_on_a_rounding_midpoint():
    """Equal scores make the weights exactly 1/2, and the mean 1/2 + 2**-54 is a float64
    midpoint: only the exact rational fallback can round it (to even: 0.5)."""
    q, keys = np.zeros((1, 2)), np.zeros((2, 2))
    values = np.array([[1.0], [2.0**-53]])
    for iters, beta in ((1, 0.0), (3, 1.0)):
        out = gmm.attention(q, keys, values, alpha=1.0, beta=beta, iters=iters, precision="exact")
        assert_same_bits(out, np.array([[0.5]]), what=f"midpoint tie, iters={iters}")


@pytest.mark.parametrize("prior", ["uniform", "magnitude"])
def test_float64_path_takes_half_precision_inputs(prior):
    """float16/bfloat16 inputs are widened exactly: the float64 path equals its run on the
    same values given as float64."""
    import ml_dtypes

    rng = np.random.default_rng(13)
    q, keys, values = (
        rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
        for shape in ((2, 3, 4), (2, 5, 4), (2, 5, 3))
    )
    wide = [a.astype(np.float64) for a in (q, keys, values)]
    np.testing.assert_array_equal(
        gmm.attention(q, keys, values, alpha=1.0, prior=prior),
        gmm.attention(*wide, alpha=1.0, prior=prior),
    )
    np.testing.assert_array_equal(
        gmm.adapt_keys(q.astype(np.float16), keys, alpha=1.0, gamma=1.0),
        gmm.adapt_keys(wide[0], wide[1], alpha=1.0, gamma=1.0),
    )


# --------------------------------------------------------------------------------------------
# Public-code readings (forms) and masks
# --------------------------------------------------------------------------------------------


def _per_unit_problem(rng, length=3, units=4, dim=3, vdim=2):
    q = rng.standard_normal((length, dim))
    keys, values = rng.standard_normal((units, dim)), rng.standard_normal((units, vdim))
    return q, keys, values, rng.uniform(0.3, 3.0, units), rng.uniform(0.3, 3.0, units)


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1),
    prior=st.sampled_from(["uniform", "magnitude"]),
    iters=st.integers(1, 3),
    with_init=st.booleans(),
)
def test_unnormalised_form_reproduces_its_reading(seed, prior, iters, with_init):
    """form="unnormalised": E-step without (D/2) log alpha_u, (E/2) log beta_u, M-step the
    plain mean -- against the twin's independent reading of that description."""
    rng = np.random.default_rng(seed)
    q, keys, values, alpha, beta = _per_unit_problem(rng)
    v_init = rng.standard_normal((q.shape[0], values.shape[1])) if with_init else None
    kwargs = dict(alpha=alpha, beta=beta, prior=prior, v_init=v_init, iters=iters)
    exact = gmm.attention(q, keys, values, **kwargs, form="unnormalised", precision="exact")
    truth, _ = naive_gmm(q, keys, values, **kwargs, normalisers=False)
    assert_same_bits(exact, round_nested(truth), what="gmm.attention form=unnormalised exact")
    fast = gmm.attention(q, keys, values, **kwargs, form="unnormalised")
    scale = gmm_term_scale(q, keys, values, alpha, beta, prior)
    step = mixture_bound(scale, keys.shape[0], q.shape[1] + values.shape[1], np.abs(values).max())
    diameter = np.ptp(values, axis=-2).max() ** 2 * values.shape[-1]
    bound = iterated_bound(step, 1 + float(np.max(beta)) * diameter, iters)
    assert_within(fast, exact, bound, what="gmm.attention form=unnormalised float64")


def test_unnormalised_form_is_the_paper_form_for_equal_precisions(rng):
    q, keys, values = (
        rng.standard_normal((3, 2)),
        rng.standard_normal((4, 2)),
        rng.standard_normal((4, 2)),
    )
    for precision in ("float64", "exact"):
        paper = gmm.attention(q, keys, values, alpha=0.7, beta=0.4, iters=2, precision=precision)
        other = gmm.attention(
            q, keys, values, alpha=0.7, beta=0.4, iters=2, form="unnormalised", precision=precision
        )
        assert_same_bits(other, paper, what=f"unnormalised == paper ({precision})")


def test_map_recentred_is_map_chained_one_iteration_at_a_time(rng):
    q, keys0 = rng.standard_normal((5, 3)), rng.standard_normal((4, 3))
    kwargs = dict(alpha=rng.uniform(0.5, 2.0, 4), gamma=rng.uniform(0.0, 2.0, 4))
    chained = keys0
    for _ in range(3):
        chained = gmm.adapt_keys(q, chained, **kwargs, form="map")
    got = gmm.adapt_keys(q, keys0, **kwargs, iters=3, form="map_recentred")
    assert_same_bits(got, chained, what="map_recentred == chained map")


@settings(max_examples=15)
@given(
    iters=st.integers(1, 2),
    per_unit=st.booleans(),
    style=st.sampled_from(["causal", "window", "mask"]),
    bottom_right=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_masked_attention_exact_and_float64(iters, per_unit, style, bottom_right, seed):
    """The allowed set (True = attend) against the twin given the set by the textbook rule."""
    rng = np.random.default_rng(seed)
    length, units = 3, 4
    q, keys, values, alpha, beta = _per_unit_problem(rng, length, units)
    if not per_unit:
        alpha, beta = 0.8, 0.5
    offset = units - length if bottom_right else 0
    rows, cols = np.arange(length)[:, None] + offset, np.arange(units)[None, :]
    options = dict(align="bottom_right" if bottom_right else "top_left")
    if style == "causal":
        allowed = cols <= rows
        options["causal"] = True
    elif style == "window":
        allowed = (cols >= rows - 1) & (cols <= rows)
        options["window"] = (1, 0)
    else:
        allowed = rng.random((length, units)) < 0.6
        options = dict(mask=allowed)
    kwargs = dict(alpha=alpha, beta=beta, iters=iters)
    exact = gmm.attention(q, keys, values, **kwargs, **options, precision="exact")
    truth, _ = naive_gmm(q, keys, values, **kwargs, allowed=allowed)
    assert_same_bits(exact, round_nested(truth), what=f"gmm.attention exact {style} mask")
    fast = gmm.attention(q, keys, values, **kwargs, **options)
    scale = gmm_term_scale(q, keys, values, alpha, beta, "uniform")
    step = mixture_bound(scale, units, q.shape[1] + values.shape[1], np.abs(values).max())
    diameter = np.ptp(values, axis=-2).max() ** 2 * values.shape[-1]
    bound = iterated_bound(step, 1 + float(np.max(beta)) * diameter, iters)
    assert_within(fast, exact, bound, what=f"gmm.attention float64 {style} mask")


@pytest.mark.parametrize("precision", ["float64", "exact"])
def test_empty_rows_follow_refattn_convention(precision, rng):
    q, keys, values = (
        rng.standard_normal((2, 2)),
        rng.standard_normal((3, 2)),
        rng.standard_normal((3, 2)),
    )
    mask = np.array([[False] * 3, [True, False, True]])
    zero = gmm.attention(
        q, keys, values, alpha=1.0, beta=0.5, iters=2, mask=mask, precision=precision
    )
    nan = gmm.attention(
        q,
        keys,
        values,
        alpha=1.0,
        beta=0.5,
        iters=2,
        mask=mask,
        empty_rows="nan",
        precision=precision,
    )
    assert_same_bits(zero[0], np.zeros(2), what="empty row, empty_rows='zero'")
    assert np.isnan(nan[0]).all()
    assert_same_bits(nan[1], zero[1], what="non-empty row unchanged by empty_rows")
    res = gmm.attention(
        q,
        keys,
        values,
        alpha=1.0,
        beta=0.5,
        iters=2,
        mask=mask,
        return_trace=True,
        precision=precision,
    )
    assert np.isnan(res.trace[0]).all() and np.isfinite(res.trace[1]).all()


def test_all_true_mask_is_no_mask(rng):
    q, keys, values = (
        rng.standard_normal((2, 3)),
        rng.standard_normal((4, 3)),
        rng.standard_normal((4, 2)),
    )
    plain = gmm.attention(q, keys, values, alpha=0.9, beta=0.2, iters=2)
    masked = gmm.attention(
        q, keys, values, alpha=0.9, beta=0.2, iters=2, mask=np.ones((2, 4), dtype=bool)
    )
    assert_same_bits(masked, plain, what="all-True mask")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mask=np.ones((2, 5), dtype=bool)), "mask"),
        (dict(causal=True, backend="numba"), "backend"),
        (dict(form="apple"), "form"),
        (dict(empty_rows="skip"), "empty_rows"),
        (dict(window=(-1, 0)), "window"),
        (dict(align="centre"), "align"),
    ],
)
def test_attention_rejects_mask_and_form_options(kwargs, match, rng):
    q, keys, values = (
        rng.standard_normal((2, 3)),
        rng.standard_normal((4, 3)),
        rng.standard_normal((4, 2)),
    )
    with pytest.raises(ValueError, match=match):
        gmm.attention(q, keys, values, alpha=1.0, **kwargs)


def test_first_iterate_with_magnitude_prior_keeps_the_value_norms(rng):
    """v_init=None under prior="magnitude": the first E-step has no value likelihood, but the
    prior of eq. (15) keeps beta ||mu_u||^2 / 2, so the first iterate is softmax attention with
    that bias -- plain attention (eq. (20)) only when beta = 0."""
    q = rng.integers(-2, 3, (2, 3)).astype(float)
    keys = rng.integers(-2, 3, (4, 3)).astype(float)
    values = rng.integers(-2, 3, (4, 2)).astype(float)
    got = gmm.attention(q, keys, values, alpha=0.5, beta=2.0, prior="magnitude", precision="exact")
    bias = np.broadcast_to((values**2).sum(-1), (2, 4))  # beta/2 ||mu||^2 with beta = 2
    want = attention(q, keys, values, scale=0.5, bias=bias, precision="exact")
    assert_same_bits(got, want, what="first iterate = attention with bias beta/2 ||mu||^2")
    plain = attention(q, keys, values, scale=0.5, precision="exact")
    assert not np.array_equal(got, plain)
