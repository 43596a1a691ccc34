"""The chunked Numba CPU kernel of refattn.linear_attention (backend="numba-chunked").

* every form (scalar/vector gates, with/without beta, packed sequences, initial states, GVA,
  l2norm, gate base 2), float64 and float32 compute, chunks of 1 to 4 steps: within
  refattn.bounds.linear.linear_chunked_forward_bound of the mpmath twin's correctly rounded
  result;
* at the chunk boundaries of the default C = 64 (T = 63, 64, 65, 127, 128, 129): within the
  chunked bound plus the float64 path's bound of the float64 NumPy recurrence;
* the vjp (boundary states from the chunked form, each chunk reversed step by step): every
  form, float64 and float32 compute, chunks of 1 to 4 steps, within
  refattn.bounds.linear.linear_chunked_vjp_bound of the exact vjp (each element the exact
  derivative rounded once); at the default chunk boundaries and on packed sequences with empty
  and 1-token sequences, within that bound plus the recurrent vjp's of the Numba recurrent
  kernel's vjp;
* deterministic: bit-identical across runs and for 1 and 2 threads (subprocesses).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn.bounds.linear import linear_chunked_forward_bound, linear_chunked_vjp_bound
from refattn.linear import _api, _float64, _kernels
from tests.helpers import assert_same_bits, assert_within, digest_with_threads
from tests.naive.linear import naive_linear_rounded
from tests.strategies import LINEAR_FORMS, linear_attention_cases, linear_call


@pytest.mark.parametrize("compute", ["float64", "float32"])
@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_chunked_within_the_bound(form, compute):
    @settings(max_examples=6)
    @given(
        case=linear_attention_cases(forms=(form,), max_length=7), chunk=st.sampled_from([1, 2, 4])
    )
    def check(case, chunk):
        call = linear_call(case)
        o, state = _kernels.chunked_forward(call, compute, chunk)
        args = (case["q"], case["k"], case["v"], case["g"], case["beta"])
        truth_o, truth_s = naive_linear_rounded(*args, **case["opts"])
        norms = _float64.forward(call, keep_norms=True)[2]
        o_bound, s_bound = linear_chunked_forward_bound(
            *args, chunk=chunk, state_norms=norms, dtype=compute, **case["opts"]
        )
        half = refattn.bounds.UNIT_ROUNDOFF
        what = f"{form} {compute} chunk {chunk}"
        assert_within(o, truth_o, o_bound + half * np.abs(truth_o), what=f"{what} o")
        assert_within(state, truth_s, s_bound + half * np.abs(truth_s), what=f"{what} state")

    check()


def _problem(length, form, heads=2, dim=4, seed=5):
    gate_kind, delta = LINEAR_FORMS[form]
    rng = np.random.default_rng(seed + length)
    q = rng.normal(size=(1, 1, length, dim))
    k = rng.normal(size=(1, 1, length, dim))
    v = rng.normal(size=(1, heads, length, dim - 1))
    g = None
    if gate_kind is not None:
        shape = (1, heads, length) + ((dim,) if gate_kind == "vector" else ())
        g = -rng.uniform(0.0, 0.5, size=shape)
    beta = rng.uniform(0.0, 1.0, size=(1, heads, length)) if delta else None
    opts = {"qk_l2norm": True, "initial_state": rng.normal(size=(1, heads, dim, dim - 1))}
    return (q, k, v, g, beta), opts


@pytest.mark.parametrize("length", [63, 64, 65, 127, 128, 129])
@pytest.mark.parametrize("form", ["gdn", "kda", "gla", "linear"])
def test_chunk_boundaries_against_the_float64_path(form, length):
    args, opts = _problem(length, form)
    o, state = refattn.linear_attention(
        *args, output_final_state=True, backend="numba-chunked", **opts
    )
    ref_o, ref_s = refattn.linear_attention(*args, output_final_state=True, **opts)
    chunked = refattn.linear.forward_error_bound(*args, backend="numba-chunked", **opts)
    plain = refattn.linear.forward_error_bound(*args, **opts)
    assert_within(o, ref_o, chunked[0] + plain[0], what=f"{form} T={length} o")
    assert_within(state, ref_s, chunked[1] + plain[1], what=f"{form} T={length} state")


def test_packed_sequences_restart_their_chunks():
    args, opts = _problem(70, "gdn", heads=1)
    cu = np.array([0, 3, 3, 70])
    opts["initial_state"] = np.zeros((3, 1, 4, 3))
    packed = refattn.linear_attention(*args, cu_seqlens=cu, backend="numba-chunked", **opts)
    ref = refattn.linear_attention(*args, cu_seqlens=cu, **opts)
    bound = refattn.linear.forward_error_bound(
        *args, cu_seqlens=cu, backend="numba-chunked", **opts
    )[0]
    assert_within(packed, ref, 2 * bound, what="packed GDN")


def test_bit_identical_across_runs():
    args, opts = _problem(70, "kda")
    first = refattn.linear_attention(*args, backend="numba-chunked", **opts)
    second = refattn.linear_attention(*args, backend="numba-chunked", **opts)
    assert_same_bits(first, second, what="two runs of the chunked kernel")
    do = np.ones_like(args[2])
    one = refattn.linear_attention_vjp(*args, do, backend="numba-chunked", **opts)
    two = refattn.linear_attention_vjp(*args, do, backend="numba-chunked", **opts)
    for name, x, y in zip(one._fields, one, two, strict=True):
        assert_same_bits(x, y, what=f"two runs of the chunked vjp: {name}")


def _exact_grads(case, do, dht):
    args = (case["q"], case["k"], case["v"], case["g"], case["beta"], do, dht)
    return refattn.linear_attention_vjp(*args, precision="exact", **case["opts"])


@pytest.mark.parametrize("compute", ["float64", "float32"])
@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_chunked_vjp_within_the_bound(form, compute):
    @settings(max_examples=4, deadline=None)
    @given(
        case=linear_attention_cases(forms=(form,), max_length=6), chunk=st.sampled_from([1, 2, 4])
    )
    def check(case, chunk):
        call = linear_call(case)
        rng = np.random.default_rng(7)
        do = rng.normal(size=case["v"].shape)
        dht = rng.normal(size=call.state_shape) if chunk != 4 else None
        grads = _api._assemble(call, _kernels.chunked_backward(call, do, dht, compute, chunk))
        truth = _exact_grads(case, do, dht)
        args = (case["q"], case["k"], case["v"], case["g"], case["beta"], do, dht)
        norms = _float64.forward(call, keep_norms=True)[2]
        bounds = linear_chunked_vjp_bound(
            *args, chunk=chunk, state_norms=norms, dtype=compute, **case["opts"]
        )
        half = refattn.bounds.UNIT_ROUNDOFF
        for name in truth._fields:
            ours, exact = getattr(grads, name), getattr(truth, name)
            if exact is None:
                assert ours is None, name
                continue
            bound = bounds[name] + half * np.abs(exact)
            assert_within(ours, exact, bound, what=f"{form} {compute} chunk {chunk} {name}")

    check()


def _against_the_recurrent_vjp(args, opts, what):
    """The chunked vjp and the recurrent kernel's each within their bound of the truth."""
    rng = np.random.default_rng(len(what))
    do = rng.normal(size=args[2].shape)
    h0 = opts["initial_state"]
    dht = rng.normal(size=h0.shape)
    chunked = refattn.linear_attention_vjp(*args, do, dht, backend="numba-chunked", **opts)
    recurrent = refattn.linear_attention_vjp(*args, do, dht, backend="numba", **opts)
    bound = refattn.linear.vjp_error_bound(*args, do, dht, backend="numba-chunked", **opts)
    plain = refattn.linear.vjp_error_bound(*args, do, dht, **opts)
    for name in chunked._fields:
        ours, theirs = getattr(chunked, name), getattr(recurrent, name)
        if theirs is None:
            assert ours is None, name
            continue
        assert_within(ours, theirs, bound[name] + plain[name], what=f"{what} {name}")


@pytest.mark.parametrize("length", [63, 64, 65, 127, 128, 129])
@pytest.mark.parametrize("form", ["gdn", "kda", "gla", "deltanet"])
def test_chunked_vjp_at_the_chunk_boundaries(form, length):
    args, opts = _problem(length, form)
    _against_the_recurrent_vjp(args, opts, f"{form} T={length}")


@pytest.mark.parametrize("form", ["gdn", "simple_gla", "linear"])
def test_chunked_vjp_on_packed_sequences(form):
    args, opts = _problem(131, form)
    opts["cu_seqlens"] = np.array([0, 0, 1, 66, 66, 131])
    opts["initial_state"] = np.random.default_rng(2).normal(size=(5, 2, 4, 3))
    opts["gate_base"] = "2"
    _against_the_recurrent_vjp(args, opts, f"packed {form}")


def test_chunked_vjp_of_empty_and_one_token_sequences():
    """Only empty and 1-token sequences: dh0 = dht on the empty ones; one chunk each."""
    args, opts = _problem(2, "kda")
    opts["cu_seqlens"] = np.array([0, 0, 1, 1, 2])
    opts["initial_state"] = np.random.default_rng(3).normal(size=(4, 2, 4, 3))
    dht = np.random.default_rng(4).normal(size=(4, 2, 4, 3))
    grads = refattn.linear_attention_vjp(*args, np.ones((1, 2, 2, 3)), dht, **opts)
    chunked = refattn.linear_attention_vjp(
        *args, np.ones((1, 2, 2, 3)), dht, backend="numba-chunked", **opts
    )
    assert_same_bits(chunked.dh0[[0, 2]], dht[[0, 2]], what="dh0 of the empty sequences")
    bounds = refattn.linear.vjp_error_bound(
        *args, np.ones((1, 2, 2, 3)), dht, backend="numba-chunked", **opts
    )
    for name in grads._fields:
        assert_within(getattr(chunked, name), getattr(grads, name), 2 * bounds[name], what=name)


_DIGEST = """
import hashlib, numpy as np, refattn
from tests.kernels.test_linear_chunked import _problem
args, opts = _problem(140, "gdn", heads=4)
o = refattn.linear_attention(*args, backend="numba-chunked", **opts)
grads = refattn.linear_attention_vjp(*args, np.ones_like(args[2]), backend="numba-chunked", **opts)
print(hashlib.sha256(o.tobytes() + b"".join(x.tobytes() for x in grads)).hexdigest())
"""


@pytest.mark.slow
def test_bit_identical_for_1_and_2_threads():
    assert digest_with_threads(_DIGEST, 1) == digest_with_threads(_DIGEST, 2)
