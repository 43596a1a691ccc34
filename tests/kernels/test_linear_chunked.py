"""The chunked Numba CPU kernel of refattn.linear_attention (backend="numba-chunked").

* every form (scalar/vector gates, with/without beta, packed sequences, initial states, GVA,
  l2norm, gate base 2), float64 and float32 compute, chunks of 1 to 4 steps: within
  refattn.bounds.linear.linear_chunked_forward_bound of the mpmath twin's correctly rounded
  result;
* at the chunk boundaries of the default C = 64 (T = 63, 64, 65, 127, 128, 129): within the
  chunked bound plus the float64 path's bound of the float64 NumPy recurrence;
* deterministic: bit-identical across runs and for 1 and 2 threads (subprocesses);
* the vjp refuses the backend by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn.bounds.linear import linear_chunked_forward_bound
from refattn.linear import _float64, _inputs, _kernels
from tests.helpers import assert_same_bits, assert_within
from tests.naive.linear import naive_linear_rounded
from tests.strategies import LINEAR_FORMS, linear_attention_cases

ROOT = Path(__file__).resolve().parents[2]


def _call(case):
    opts = case["opts"]
    return _inputs.canonicalize(
        case["q"],
        case["k"],
        case["v"],
        case["g"],
        case["beta"],
        scale=opts.get("scale"),
        initial_state=opts.get("initial_state"),
        cu_seqlens=opts.get("cu_seqlens"),
        qk_l2norm=opts["qk_l2norm"],
        gate_base=opts["gate_base"],
    )


@pytest.mark.parametrize("compute", ["float64", "float32"])
@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_chunked_within_the_bound(form, compute):
    @settings(max_examples=6)
    @given(
        case=linear_attention_cases(forms=(form,), max_length=7), chunk=st.sampled_from([1, 2, 4])
    )
    def check(case, chunk):
        call = _call(case)
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


def test_the_vjp_refuses_the_chunked_backend():
    args, opts = _problem(3, "gdn")
    with pytest.raises(ValueError, match="numba-chunked"):
        refattn.linear_attention_vjp(*args, np.ones((1, 2, 3, 3)), backend="numba-chunked")


_DIGEST = """
import hashlib, refattn
from tests.kernels.test_linear_chunked import _problem
args, opts = _problem(140, "gdn", heads=4)
o = refattn.linear_attention(*args, backend="numba-chunked", **opts)
print(hashlib.sha256(o.tobytes()).hexdigest())
"""


def _digest(threads):
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _DIGEST],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"digest with {threads} threads failed:\n{done.stderr[-3000:]}"
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_bit_identical_for_1_and_2_threads():
    assert _digest(1) == _digest(2)
