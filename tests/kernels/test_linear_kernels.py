"""The Numba CPU kernel of refattn.linear_attention (backend="numba"), forward and reverse.

* every form, float64 compute, within refattn.bounds.linear_forward_bound of the mpmath twin's
  correctly rounded result (float32 compute within the float32 bound);
* the reverse pass within refattn.linear.vjp_error_bound of the float64 NumPy vjp (both
  computations err by at most their bound);
* deterministic: bit-identical across runs and for 1 and 2 threads (subprocesses);
* a NUMBA_DISABLE_JIT=1 tier (subprocess) runs the kernel bodies as Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

import refattn
from refattn.linear import _kernels
from tests.helpers import assert_same_bits, assert_within, digest_with_threads
from tests.naive.linear import naive_linear_rounded
from tests.strategies import LINEAR_FORMS, linear_attention_cases, linear_call

ROOT = Path(__file__).resolve().parents[2]
JITLESS = os.environ.get("NUMBA_DISABLE_JIT") == "1"


@pytest.mark.parametrize("compute", ["float64", "float32"])
@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_forward_within_the_bound(form, compute):
    @settings(max_examples=3 if JITLESS else 6)
    @given(case=linear_attention_cases(forms=(form,), max_length=6))
    def check(case):
        o, state = _kernels.forward(linear_call(case), compute)
        args = (case["q"], case["k"], case["v"], case["g"], case["beta"])
        truth_o, truth_s = naive_linear_rounded(*args, **case["opts"])
        o_bound, s_bound = refattn.bounds.linear_forward_bound(*args, dtype=compute, **case["opts"])
        half = refattn.bounds.UNIT_ROUNDOFF
        assert_within(o, truth_o, o_bound + half * np.abs(truth_o), what=f"{form} {compute} o")
        assert_within(
            state, truth_s, s_bound + half * np.abs(truth_s), what=f"{form} {compute} state"
        )

    check()


@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_reverse_within_the_bound_of_numpy(form):
    @settings(max_examples=3 if JITLESS else 6)
    @given(case=linear_attention_cases(forms=(form,), max_length=6))
    def check(case):
        rng = np.random.default_rng(3)
        do = rng.normal(size=case["v"].shape)
        args = (case["q"], case["k"], case["v"], case["g"], case["beta"], do)
        numpy_grads = refattn.linear_attention_vjp(*args, **case["opts"])
        kernel_grads = refattn.linear_attention_vjp(*args, backend="numba", **case["opts"])
        bounds = refattn.linear.vjp_error_bound(*args, **case["opts"])
        for name in numpy_grads._fields:
            ours, theirs = getattr(kernel_grads, name), getattr(numpy_grads, name)
            if theirs is None:
                assert ours is None, name
                continue
            assert_within(ours, theirs, 2 * bounds[name], what=f"{form} numba {name}")

    check()


def _problem():
    rng = np.random.default_rng(11)
    q = rng.normal(size=(1, 2, 40, 8))
    k = rng.normal(size=(1, 2, 40, 8))
    v = rng.normal(size=(1, 4, 40, 5))
    g = -rng.uniform(0, 1, size=(1, 4, 40))
    beta = rng.uniform(0, 1, size=(1, 4, 40))
    return q, k, v, g, beta


def test_bit_identical_across_runs():
    q, k, v, g, beta = _problem()
    first = refattn.linear_attention(q, k, v, g, beta, qk_l2norm=True, backend="numba")
    second = refattn.linear_attention(q, k, v, g, beta, qk_l2norm=True, backend="numba")
    assert_same_bits(first, second, what="two runs of the Numba kernel")


_DIGEST = """
import hashlib, numpy as np, refattn
from tests.kernels.test_linear_kernels import _problem
q, k, v, g, beta = _problem()
o = refattn.linear_attention(q, k, v, g, beta, qk_l2norm=True, backend="numba")
grads = refattn.linear_attention_vjp(q, k, v, g, beta, np.ones_like(v), backend="numba")
print(hashlib.sha256(o.tobytes() + grads.dk.tobytes() + grads.dg.tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_bit_identical_for_1_and_2_threads():
    assert digest_with_threads(_DIGEST, 1) == digest_with_threads(_DIGEST, 2)


@pytest.mark.slow
@pytest.mark.skipif(JITLESS, reason="already the NUMBA_DISABLE_JIT=1 tier")
def test_kernel_bodies_without_jit():
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "within"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"NUMBA_DISABLE_JIT=1 tier failed:\n{done.stdout[-3000:]}"
