"""The compiled first step of the exact linear-attention forward (refattn.exact.fast.linear).

* its double-double enclosures contain the mpmath twin's value, on every form and option (gate
  bases e and 2, vector and scalar gates, delta rule and plain update, l2norm, initial states,
  packed sequences with empty and 1-token sequences, GVA, gates near 0 and down to -20, beta 0
  and 1) with inputs in four dtypes;
* the exact path with the first step is bit-identical to the referee alone
  (``config.LINEAR_EXACT_ENGINE = "referee"``), in four output dtypes, and on rows the first
  step cannot bound (a growing gate, huge inputs) or whose decays leave the exp domain;
* on ordinary cases it decides every element (the referee evaluates nothing), and a row whose
  final state is decided goes to the referee only up to its last undecided o row;
* its enclosures do not depend on the number of Numba threads.
"""

from __future__ import annotations

import os
from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings

import refattn
from refattn import config
from refattn.exact.fast.linear import linear_enclosures
from refattn.exact.linear import linear_fallback_stats
from tests.helpers import assert_same_bits, digest_with_threads
from tests.naive.linear import naive_linear
from tests.strategies import LINEAR_FORMS, linear_attention_cases, linear_call

DTYPES = ("float64", "float32", "float16", "bfloat16")
JITLESS = os.environ.get("NUMBA_DISABLE_JIT") == "1"


def _dtype(name):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _exact(engine, case, dtype):
    saved = config.LINEAR_EXACT_ENGINE
    config.LINEAR_EXACT_ENGINE = engine
    try:
        result = refattn.linear_attention(
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
        return result, linear_fallback_stats()
    finally:
        config.LINEAR_EXACT_ENGINE = saved


def _contains(enclosure, truth, ok_rows, what):
    """Every element of the rows the kernel bounded: |truth - (hi + lo)| <= radius."""
    hi, lo, rad = enclosure
    for index in np.ndindex(hi.shape):
        if not ok_rows(index):
            continue
        number = Fraction if isinstance(truth[index], Fraction) else mpmath.mpf
        mid = number(float(hi[index])) + number(float(lo[index]))
        gap = abs(truth[index] - mid)
        assert gap <= number(float(rad[index])), (
            f"{what}{index}: truth {truth[index]} outside {mid} +- {rad[index]}"
        )


def _check_enclosures(case, what):
    """The kernel's enclosures of a case contain the 60-digit mpmath twin (rows it bounded);
    returns the rows' ok flags."""
    call = linear_call(case)
    out, state, ok = linear_enclosures(call)
    with mpmath.workdps(60):
        o_true, s_true = naive_linear(
            case["q"], case["k"], case["v"], case["g"], case["beta"], **case["opts"]
        )
        owner = {}
        for n, (b, start, stop) in enumerate(call.segments):
            owner.update({(b, t): n for t in range(start, stop)})
        o_true = np.array(o_true, dtype=object).reshape(call.v.shape)
        s_true = np.array(s_true, dtype=object).reshape(call.state_shape)
        _contains(out, o_true, lambda i: ok[owner[i[0], i[2]], i[1]], f"{what} o")
        _contains(state, s_true, lambda i: ok[i[0], i[1]], f"{what} state")
    return ok


@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_enclosures_contain_the_twin(form):
    @settings(max_examples=3 if JITLESS else 8)
    @given(case=linear_attention_cases(dtypes=DTYPES, forms=(form,), max_length=5))
    def check(case):
        ok = _check_enclosures(case, form)
        assert ok.all()  # inputs and gates of these cases are within the kernel's range

    check()


@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_bit_identical_to_the_referee(form):
    @settings(max_examples=3 if JITLESS else 6)
    @given(case=linear_attention_cases(dtypes=DTYPES, forms=(form,), max_length=4))
    def check(case):
        dtype = _dtype(case["dtype"])
        (o, state), stats = _exact("fast", case, dtype)
        (o_ref, s_ref), ref_stats = _exact("referee", case, dtype)
        assert_same_bits(o, o_ref, what=f"{form} o, fast vs referee ({dtype})")
        assert_same_bits(state, s_ref, what=f"{form} state, fast vs referee ({dtype})")
        assert ref_stats["referee_rows"] == ref_stats["rows"] or not ref_stats["elements"]
        assert stats["referee_elements"] >= stats["fast_undecided_elements"]

    check()


def _gdn(heads=2, length=6, dim=4, seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        q=rng.normal(size=(1, heads, length, dim)),
        k=rng.normal(size=(1, heads, length, dim)),
        v=rng.normal(size=(1, heads, length, dim)),
        g=-rng.uniform(0.0, 1.0, (1, heads, length)),
        beta=rng.uniform(0.0, 1.0, (1, heads, length)),
        opts={"qk_l2norm": True},
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_ordinary_cases_need_no_referee(dtype):
    case = _gdn(heads=2, length=8, dim=8, seed=len(dtype))
    (o, state), stats = _exact("fast", case, _dtype(dtype))
    assert stats["engine"] == "fast" and stats["elements"] == o.size + state.size
    assert stats["fast_undecided_elements"] == 0 and stats["referee_rows"] == 0


@pytest.mark.parametrize(
    "change",
    ["growing_gate", "huge_input", "deep_gate_e", "deep_gate_2", "integer_gates_2", "subnormal"],
)
def test_hard_rows_bit_identical(change):
    """Rows left to the referee (a gate above the kernel's range, an input above its range),
    decays below the exp domain (bounded by [0, 2**-893]) and products in the subnormal range
    (the absolute allowance ETA) give the referee's bits, and the enclosures of the rows the
    kernel bounded contain the twin."""
    case = _gdn(heads=2, length=3, dim=2, seed=3)
    if change == "growing_gate":
        case["g"][0, 1, 1] = 80.0
    elif change == "huge_input":
        case["v"][0, 0, 2, 1] = 1e250
    elif change == "deep_gate_e":
        case["g"][0, 0, 1] = -700.0
    elif change == "deep_gate_2":
        case["g"][0, :, 1] = [-2000.0, -900.5]
        case["opts"]["gate_base"] = "2"
    elif change == "integer_gates_2":
        case["g"] = -np.arange(6.0).reshape(1, 2, 3) / 2
        case["opts"]["gate_base"] = "2"
    else:
        case["q"], case["k"] = case["q"] * 2.0**-530, case["k"] * 2.0**-530
        case["opts"]["qk_l2norm"] = False
    _check_enclosures(case, change)
    for dtype in ("float64", "bfloat16"):
        (o, state), stats = _exact("fast", case, _dtype(dtype))
        (o_ref, s_ref), _ = _exact("referee", case, _dtype(dtype))
        assert_same_bits(o, o_ref, what=f"{change} o ({dtype})")
        assert_same_bits(state, s_ref, what=f"{change} state ({dtype})")
        if change in ("growing_gate", "huge_input"):
            assert stats["referee_rows"] == 1 < stats["rows"]


_DIGEST = """
import hashlib, numpy as np
from refattn.exact.fast.linear import linear_enclosures
from refattn.linear._inputs import canonicalize
from tests.exact.test_linear_exact_fast import _gdn
case = _gdn(heads=4, length=12, dim=8, seed=5)
call = canonicalize(case["q"], case["k"], case["v"], case["g"], case["beta"], scale=None,
                    initial_state=None, cu_seqlens=None, qk_l2norm=True, gate_base="e")
out, state, ok = linear_enclosures(call)
print(hashlib.sha256(out.tobytes() + state.tobytes() + ok.tobytes()).hexdigest())
"""


@pytest.mark.slow
@pytest.mark.skipif(JITLESS, reason="no threads without the JIT")
def test_enclosures_bit_identical_for_1_and_2_threads():
    assert digest_with_threads(_DIGEST, 1) == digest_with_threads(_DIGEST, 2)


def test_referee_evaluates_a_prefix_when_the_state_is_decided():
    """o_0 = 257 is a bfloat16 midpoint (the first step cannot decide it), o_1, o_2 and the
    final state (258, 260) are decided: the referee evaluates the first token's o row alone."""
    ones = np.ones((1, 1, 3, 1))
    case = dict(
        q=ones,
        k=ones,
        v=np.array([257.0, 1.0, 2.0]).reshape(1, 1, 3, 1),
        g=None,
        beta=None,
        opts={"scale": 1.0},
    )
    (o, state), stats = _exact("fast", case, _dtype("bfloat16"))
    (o_ref, s_ref), _ = _exact("referee", case, _dtype("bfloat16"))
    assert_same_bits(o, o_ref, what="o, fast vs referee")
    assert_same_bits(state, s_ref, what="state, fast vs referee")
    assert stats["fast_undecided_elements"] == stats["referee_elements"] == 1
