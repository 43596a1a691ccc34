"""refattn.linear_attention and linear_attention_vjp, float64 path: what the registry row
(exact == rounded twin, float64 within its bound) does not reach.

* the named forms against the mpmath twin within refattn.linear.forward_error_bound;
* structural identities: packed sequences == separate calls, GVA == expanded key heads,
  zero-length sequences keep their initial state, beta = 0 is the pure decay;
* the vjp against central differences of the mpmath twin (tests.naive.mp.central_vjp, whose
  Richardson error estimate is part of the tolerance) within refattn.linear.vjp_error_bound;
* argument validation names the argument, its shape or dtype and what was expected.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

import refattn
from tests.helpers import assert_same_bits, assert_within
from tests.naive.linear import mp_linear, naive_linear_rounded
from tests.naive.mp import central_vjp
from tests.strategies import LINEAR_FORMS, linear_attention_cases

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _call(case, **extra):
    return refattn.linear_attention(
        case["q"], case["k"], case["v"], case["g"], case["beta"], **case["opts"], **extra
    )


@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_forms_within_the_bound_of_the_twin(form):
    @settings(max_examples=8)
    @given(case=linear_attention_cases(forms=(form,), max_length=6))
    def check(case):
        o, state = _call(case, output_final_state=True)
        truth_o, truth_s = naive_linear_rounded(
            case["q"], case["k"], case["v"], case["g"], case["beta"], **case["opts"]
        )
        o_bound, s_bound = refattn.linear.forward_error_bound(
            case["q"], case["k"], case["v"], case["g"], case["beta"], **case["opts"]
        )
        half = refattn.bounds.UNIT_ROUNDOFF
        assert_within(o, truth_o, o_bound + half * np.abs(truth_o), what=f"{form} o")
        assert_within(state, truth_s, s_bound + half * np.abs(truth_s), what=f"{form} state")

    check()


def _problem(seed, batch=1, heads=2, group=2, length=5, dim=3, vdim=2, vector=False):
    rng = np.random.default_rng(seed)
    vheads = heads * group
    q = rng.normal(size=(batch, heads, length, dim))
    k = rng.normal(size=(batch, heads, length, dim))
    v = rng.normal(size=(batch, vheads, length, vdim))
    g = -rng.uniform(0, 1, size=(batch, vheads, length) + ((dim,) if vector else ()))
    beta = rng.uniform(0, 1, size=(batch, vheads, length))
    return q, k, v, g, beta


def test_packed_sequences_are_separate_calls():
    q, k, v, g, beta = _problem(0, length=7)
    cu = np.array([0, 0, 1, 4, 4, 7])
    rng = np.random.default_rng(1)
    h0 = rng.normal(size=(5, 4, 3, 2))
    o, state = refattn.linear_attention(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=True
    )
    for n, (a, b) in enumerate(zip(cu, cu[1:], strict=False)):
        part = [x[:, :, a:b] for x in (q, k, v, g, beta)]
        o_n, s_n = refattn.linear_attention(
            *part, initial_state=h0[n : n + 1], output_final_state=True
        )
        assert_same_bits(o[:, :, a:b], o_n, what=f"packed o, sequence {n}")
        assert_same_bits(state[n : n + 1], s_n, what=f"packed state, sequence {n}")
    assert_same_bits(state[0], h0[0], what="an empty sequence keeps its initial state")


def test_value_head_j_reads_key_head_j_div_group():
    q, k, v, g, beta = _problem(2, heads=2, group=3)
    o = refattn.linear_attention(q, k, v, g, beta, qk_l2norm=True)
    expanded = [np.repeat(x, 3, axis=1) for x in (q, k)]
    o_expanded = refattn.linear_attention(*expanded, v, g, beta, qk_l2norm=True)
    assert_same_bits(o, o_expanded, what="GVA against repeat_interleave of the key heads")
    tiled = [np.tile(x, (1, 3, 1, 1)) for x in (q, k)]
    assert not np.array_equal(o, refattn.linear_attention(*tiled, v, g, beta, qk_l2norm=True))


def test_beta_zero_is_the_pure_decay_of_the_initial_state():
    q, k, v, g, beta = _problem(3)
    h0 = np.random.default_rng(4).normal(size=(1, 4, 3, 2))
    _, state = refattn.linear_attention(
        q, k, v, g, np.zeros_like(beta), initial_state=h0, output_final_state=True
    )
    truth = naive_linear_rounded(q, k, v, g, np.zeros_like(beta), initial_state=h0, scale=1.0)[1]
    half = refattn.bounds.UNIT_ROUNDOFF
    # decays multiply: one rounding per step and the exponentials' (within 2u each)
    bound = 8 * q.shape[2] * half * np.abs(truth)
    assert_within(state, truth, bound, what="beta = 0 state")


def _vjp_problem(case):
    rng = np.random.default_rng(7)
    do = rng.normal(size=case["v"].shape)
    opts = case["opts"]
    dht = None
    if "initial_state" in opts:
        dht = rng.normal(size=opts["initial_state"].shape)
    return do, dht


def _central(case, do, dht):
    """(estimate, error) pairs per gradient name from central differences of the twin."""
    opts = dict(case["opts"])
    h0 = opts.pop("initial_state", None)
    names = ["dq", "dk", "dv"]
    arrays = [case["q"], case["k"], case["v"]]
    for name, array in (("dg", case["g"]), ("dbeta", case["beta"]), ("dh0", h0)):
        if array is not None:
            names.append(name)
            arrays.append(array)

    def function(*args):
        given = dict(zip(names, args, strict=True))
        return mp_linear(
            given["dq"],
            given["dk"],
            given["dv"],
            given.get("dg"),
            given.get("dbeta"),
            initial_state=given.get("dh0"),
            **opts,
        )

    weights = np.concatenate([do.ravel(), np.zeros(0) if dht is None else dht.ravel()])
    if dht is None and h0 is not None:
        weights = np.concatenate([weights, np.zeros(h0.size)])
    elif h0 is None:
        sequences = len(opts["cu_seqlens"]) - 1 if "cu_seqlens" in opts else case["q"].shape[0]
        state_size = sequences * case["v"].shape[1] * case["q"].shape[-1] * case["v"].shape[-1]
        weights = np.concatenate([weights, np.zeros(state_size)])
    return dict(zip(names, central_vjp(function, arrays, weights, dps=40), strict=True))


@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_vjp_against_central_differences(form):
    @settings(max_examples=4)
    @given(case=linear_attention_cases(forms=(form,), max_length=3, max_dim=2))
    def check(case):
        do, dht = _vjp_problem(case)
        grads = refattn.linear_attention_vjp(
            case["q"], case["k"], case["v"], case["g"], case["beta"], do, dht, **case["opts"]
        )
        bounds = refattn.linear.vjp_error_bound(
            case["q"], case["k"], case["v"], case["g"], case["beta"], do, dht, **case["opts"]
        )
        for name, (estimate, error) in _central(case, do, dht).items():
            truth = np.asarray(estimate, dtype=np.float64)
            margin = np.asarray(error, dtype=np.float64)
            assert_within(getattr(grads, name), truth, bounds[name] + margin, what=f"{form} {name}")
        for name in GRAD_NAMES:
            if bounds[name] is None:
                assert getattr(grads, name) is None, name

    check()


def test_vjp_of_gate_base_2_is_ln2_times_base_e():
    q, k, v, g, beta = _problem(5, vector=True)
    do = np.random.default_rng(6).normal(size=v.shape)
    base_e = refattn.linear_attention_vjp(q, k, v, g * np.log(2.0), beta, do)
    base_2 = refattn.linear_attention_vjp(q, k, v, g, beta, do, gate_base="2")
    bound = refattn.linear.vjp_error_bound(q, k, v, g, beta, do, gate_base="2")["dg"]
    assert_within(base_2.dg, base_e.dg * np.log(2.0), 4 * bound, what="dg base 2")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(k=np.zeros((1, 2, 5, 4))), r"k: expected the shape of q"),
        (dict(v=np.zeros((1, 3, 5, 2))), r"v: the value heads HV = 3 must be a positive multiple"),
        (dict(g=np.zeros((1, 4, 5, 2))), r"g: expected shape \(B, HV, T\)"),
        (dict(beta=np.zeros((1, 4, 4))), r"beta: expected shape \(B, HV, T\)"),
        (dict(q=np.zeros((2, 5, 3))), r"q: expected shape \(B, H, T, D\)"),
        (dict(q=np.zeros((1, 2, 5, 3), dtype=int)), r"q: expected a float array"),
        (dict(initial_state=np.zeros((1, 4, 2, 3))), r"initial_state: expected shape"),
        (dict(cu_seqlens=np.array([0, 3])), r"cu_seqlens: expected non-decreasing offsets"),
        (dict(cu_seqlens=np.array([0.0, 5.0])), r"cu_seqlens: expected a 1-D integer array"),
        (dict(gate_base="10"), r"gate_base: expected one of"),
        (dict(qk_l2norm=1), r"qk_l2norm: expected True or False"),
        (dict(backend="triton"), r"backend: expected one of"),
    ],
)
def test_bad_arguments_are_named(change, message):
    q, k, v, g, beta = _problem(8)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        refattn.linear_attention(**args)


def test_packed_sequences_need_batch_one():
    q, k, v, g, beta = _problem(9, batch=2)
    with pytest.raises(ValueError, match=r"cu_seqlens: packed sequences need batch B = 1"):
        refattn.linear_attention(q, k, v, g, beta, cu_seqlens=np.array([0, 5]))


DOCS = Path(__file__).resolve().parents[2] / "docs" / "linear.md"


@pytest.mark.parametrize("index", range(2))
def test_docs_page_code_blocks_run(index):
    guide = DOCS.read_text().split("## Validating a linear-attention kernel")[0]  # oracle: after
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    assert len(blocks) == 2, "docs/linear.md: expected two python blocks"
    exec(compile(blocks[index], f"docs/linear.md block {index}", "exec"), {})


def test_exact_path_refuses_non_finite_inputs():
    q, k, v, g, beta = _problem(10)
    v[0, 1, 2, 0] = np.nan
    with pytest.raises(ValueError, match=r"v: precision='exact' needs finite values"):
        refattn.linear_attention(q, k, v, g, beta, precision="exact")
