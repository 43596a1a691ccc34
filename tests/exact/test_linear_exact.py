"""The exact path of refattn.linear_attention and linear_attention_vjp.

* every form, bit for bit the mpmath twin rounded once, in four dtypes, on cases built to sit
  on rounding midpoints (small integers, base-2 integer gates, beta 1/2: every value rational,
  the rational fallback decides them) and on general ones (exp gates, l2norm, GVA, packed
  sequences with empty and 1-token sequences, initial states);
* exact zeros are +0;
* the exact vjp rounds the central-difference derivative of the mpmath twin (its Richardson
  interval), for every form.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

import refattn
from tests.concepts.test_linear import _central, _vjp_problem
from tests.helpers import assert_rounds_derivative, assert_same_bits
from tests.naive.linear import naive_linear_rounded
from tests.strategies import LINEAR_FORMS, linear_attention_cases

DTYPES = ("float64", "float32", "float16", "bfloat16")


def _dtype(name):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _rational_case(form, seed):
    """Integer inputs, base-2 integer gates, beta 1/2, scale 1/2, packed sequences [0, 1, 1, 5]
    with an empty and a one-token sequence: results are dyadic rationals, often midpoints."""
    gate_kind, delta = LINEAR_FORMS[form]
    rng = np.random.default_rng(seed)
    length, dim, vdim, heads, group = 5, 2, 2, 1, 2
    q = rng.integers(-2, 3, (1, heads, length, dim)).astype(float)
    k = rng.integers(-1, 2, (1, heads, length, dim)).astype(float)
    v = rng.integers(-3, 4, (1, heads * group, length, vdim)).astype(float)
    g = None
    if gate_kind is not None:
        shape = (1, heads * group, length) + ((dim,) if gate_kind == "vector" else ())
        g = -rng.integers(0, 3, shape).astype(float)
    beta = np.full((1, heads * group, length), 0.5) if delta else None
    cu = np.array([0, 1, 1, 5])
    h0 = rng.integers(-2, 3, (3, heads * group, dim, vdim)).astype(float)
    opts = dict(cu_seqlens=cu, initial_state=h0, gate_base="2", scale=0.5)
    return q, k, v, g, beta, opts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_rational_cases_bit_for_bit(form, dtype):
    q, k, v, g, beta, opts = _rational_case(form, seed=len(form) + len(dtype))
    o, state = refattn.linear_attention(
        q, k, v, g, beta, output_final_state=True, precision="exact", out_dtype=dtype, **opts
    )
    truth_o, truth_s = naive_linear_rounded(q, k, v, g, beta, dtype=_dtype(dtype), **opts)
    assert o.dtype == _dtype(dtype) and state.dtype == _dtype(dtype)
    assert_same_bits(o, truth_o, what=f"{form} exact o ({dtype})")
    assert_same_bits(state, truth_s, what=f"{form} exact state ({dtype})")


@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_general_cases_bit_for_bit(form):
    @settings(max_examples=6)
    @given(case=linear_attention_cases(dtypes=DTYPES, forms=(form,), max_length=5))
    def check(case):
        dtype = _dtype(case["dtype"])
        o, state = refattn.linear_attention(
            case["q"],
            case["k"],
            case["v"],
            case["g"],
            case["beta"],
            output_final_state=True,
            precision="exact",
            out_dtype=dtype,
            **case["opts"],
        )
        truth_o, truth_s = naive_linear_rounded(
            case["q"], case["k"], case["v"], case["g"], case["beta"], dtype=dtype, **case["opts"]
        )
        assert_same_bits(o, truth_o, what=f"{form} exact o", check_dtype=False)
        assert_same_bits(state, truth_s, what=f"{form} exact state", check_dtype=False)

    check()


def test_exact_zero_is_positive_zero():
    q = np.zeros((1, 1, 2, 2))
    k = np.ones((1, 1, 2, 2))
    v = -np.ones((1, 1, 2, 2))
    o = refattn.linear_attention(q, k, v, np.full((1, 1, 2), -1.0), precision="exact")
    assert (o == 0).all() and not np.signbit(o).any()


@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_exact_vjp_rounds_the_derivative(form):
    @settings(max_examples=3)
    @given(case=linear_attention_cases(forms=(form,), max_length=3, max_dim=2))
    def check(case):
        do, dht = _vjp_problem(case)
        grads = refattn.linear_attention_vjp(
            case["q"],
            case["k"],
            case["v"],
            case["g"],
            case["beta"],
            do,
            dht,
            precision="exact",
            out_dtype="float32",
            **case["opts"],
        )
        for name, (estimate, error) in _central(case, do, dht).items():
            truth = np.stack([estimate, error], axis=-1)
            got = getattr(grads, name)
            assert got.dtype == np.float32, name
            assert_rounds_derivative(got, truth, what=f"{form} exact {name}", dtype="float32")

    check()
