"""Tests of refattn.hopfield (Ramsauer et al. 2020, eqs. (2)-(3)): energy and retrieval.

Truth is the loop-level mpmath twin of tests/naive/hopfield.py (60 digits), independent of
refattn; the random energy cases (exact vs the twin, float64 vs its bound) are in
tests/test_registry.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.judging.tolerance import mixture_bound
from refattn import hopfield
from refattn.attention import attention
from tests.helpers import assert_same_bits, assert_within
from tests.naive.hopfield import naive_retrieve
from tests.naive.rounding import round_nested
from tests.registry import hopfield_energy_bound
from tests.strategies import mixture_problems


def test_energy_constant_makes_it_nonnegative(rng):
    """With the paper's constant 0 <= E <= 2 M^2 (Ramsauer et al., Lemma A1)."""
    xi = rng.standard_normal((5, 3))
    X = rng.standard_normal((4, 3))
    xi = xi / np.linalg.norm(xi, axis=-1, keepdims=True) * np.linalg.norm(X, axis=-1).max()
    energy = hopfield.energy(xi, X, beta=2.0, constant=True, precision="exact")
    assert (energy >= 0).all(), f"negative energy with the constant: {energy}"


@settings(max_examples=40)
@given(problem=mixture_problems(), beta=st.sampled_from([0.125, 1.0, 3.0]))
def test_one_step_is_attention_bit_for_bit(problem, beta):
    xi, X, _, style = problem
    ours = hopfield.retrieve(xi, X, beta=beta, precision="exact")
    theirs = attention(xi, X, X, scale=beta, precision="exact")
    assert_same_bits(ours, theirs, what=f"retrieve 1 step vs attention (exact, {style})")
    assert_same_bits(
        hopfield.retrieve(xi, X, beta=beta),
        attention(xi, X, X, scale=beta),
        what=f"retrieve 1 step vs attention (float64, {style})",
    )


@settings(max_examples=25)
@given(
    problem=mixture_problems(batched=False),
    beta=st.sampled_from([0.5, 2.0]),
    steps=st.integers(1, 3),
)
def test_retrieve_exact_is_correctly_rounded(problem, beta, steps):
    xi, X, _, style = problem
    res = hopfield.retrieve(xi, X, beta=beta, steps=steps, return_trace=True, precision="exact")
    states, energies = naive_retrieve(xi, X, beta, steps)
    assert_same_bits(
        res.states, round_nested(states), what=f"retrieve exact states ({style}, steps={steps})"
    )
    assert_same_bits(
        res.energy, round_nested(energies), what=f"retrieve exact energies ({style}, steps={steps})"
    )


@settings(max_examples=25)
@given(
    problem=mixture_problems(batched=False),
    beta=st.sampled_from([0.5, 2.0, 8.0]),
    steps=st.integers(1, 5),
)
def test_energy_never_increases(problem, beta, steps):
    """Theorem 1 of Ramsauer et al.: exact energies of exact iterates, rounded once, are
    non-increasing with no slack (rounding is monotone); float64 within its bound."""
    xi, X, _, style = problem
    exact = hopfield.retrieve(xi, X, beta=beta, steps=steps, return_trace=True, precision="exact")
    steps_exact = np.diff(exact.energy, axis=-1)
    assert (steps_exact <= 0).all(), f"exact energy increased ({style}): {exact.energy}"
    fast = hopfield.retrieve(xi, X, beta=beta, steps=steps, return_trace=True)
    slack = 2 * hopfield_energy_bound(np.concatenate([xi, X]), X, beta)
    worst = float(np.diff(fast.energy, axis=-1).max())
    assert worst <= slack, f"float64 energy increased by {worst:.3e} > {slack:.3e} ({style})"


def test_retrieve_converges_to_a_stored_pattern(rng):
    X = rng.standard_normal((4, 8)) * 3
    xi = X[[1, 3]] + 0.1 * rng.standard_normal((2, 8))
    res = hopfield.retrieve(xi, X, beta=4.0, steps=20, tol=0.0, return_trace=True)
    assert_within(
        res.states,
        X[[1, 3]],
        mixture_bound(0.0, 4, 0, np.abs(X).max()),
        what="retrieval of stored patterns",
    )
    assert (res.steps < 20).all(), f"tol=0 should stop at an exact fixed point: {res.steps}"
    for i, count in enumerate(res.steps):
        assert np.isnan(res.energy[i, count + 1 :]).all()


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.fixture
def rng():
    return np.random.default_rng(20260324)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(beta=0.0), "beta"),
        (dict(beta=-1.0), "beta"),
        (dict(beta=math.inf), "beta"),
        (dict(beta=1.0, steps=0), "steps"),
        (dict(beta=1.0, tol=1e-6, precision="exact"), "tol"),
        (dict(beta=1.0, tol=-1.0), "tol"),
        (dict(beta=1.0, precision="quad"), "precision"),
    ],
)
def test_retrieve_rejects(rng, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        hopfield.retrieve(rng.standard_normal((2, 3)), rng.standard_normal((4, 3)), **kwargs)


def test_shape_errors(rng):
    with pytest.raises(ValueError, match="X"):
        hopfield.energy(rng.standard_normal((2, 3)), rng.standard_normal((4, 2)), beta=1.0)
    with pytest.raises(ValueError, match="X"):
        hopfield.retrieve(rng.standard_normal((2, 3)), np.zeros((0, 3)), beta=1.0)
    with pytest.raises(ValueError, match="batch"):
        hopfield.retrieve(rng.standard_normal((3, 2, 3)), rng.standard_normal((2, 4, 3)), beta=1.0)
    with pytest.raises(ValueError, match="xi"):
        hopfield.energy(np.full((2, 3), np.nan), rng.standard_normal((4, 3)), beta=1.0)


def test_exact_tie_on_a_rounding_midpoint():
    X = np.array([[1.0, 2.0**-53], [2.0**-53, 1.0]])
    out = hopfield.retrieve(np.zeros((1, 2)), X, beta=1.0, steps=2, precision="exact")
    assert_same_bits(out, np.array([[0.5, 0.5]]), what="midpoint tie, 2 steps")
