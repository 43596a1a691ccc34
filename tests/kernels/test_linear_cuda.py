"""The numba.cuda kernel of refattn.linear_attention (backend="cuda") on the CUDA simulator.

The simulator must be enabled before numba is imported, so when this process has neither a GPU
nor NUMBA_ENABLE_CUDASIM=1, :func:`test_linear_cuda_under_simulator` re-runs this file in a
subprocess with NUMBA_ENABLE_CUDASIM=1 on tiny shapes (one Python thread per CUDA thread). On a
machine with a GPU the same tests run on the device.

* every form (GVA, packed sequences, initial states, l2norm): bit-identical to the CPU kernel
  (backend="numba", same operations in the same order) and within the float64 path's bound of
  the float64 NumPy recurrence, for two launch shapes;
* the vjp (the reverse recurrence, every form, packed sequences with an empty one, dht): bit-
  identical to the CPU kernel's vjp and within the vjp bound of the float64 NumPy vjp, float64
  and float32 compute, for 1, 2 and 32 threads per block;
* a missing device says what to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import refattn
from refattn.kernels import linear_cuda
from refattn.linear import _inputs, _kernels
from tests.helpers import assert_same_bits, assert_within
from tests.strategies import LINEAR_FORMS

ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(
    not linear_cuda.available(), reason="no CUDA device and NUMBA_ENABLE_CUDASIM is not set"
)


def _problem(form, packed=False, seed=0):
    gate_kind, delta = LINEAR_FORMS[form]
    rng = np.random.default_rng(seed)
    length, dim, vdim, heads = 5, 3, 3, 2
    q = rng.normal(size=(1, 1, length, dim))
    k = rng.normal(size=(1, 1, length, dim))
    v = rng.normal(size=(1, heads, length, vdim))
    g = None
    if gate_kind is not None:
        g = -rng.uniform(
            0.0, 1.0, size=(1, heads, length) + ((dim,) if gate_kind == "vector" else ())
        )
    beta = rng.uniform(0.0, 1.0, size=(1, heads, length)) if delta else None
    opts = {"qk_l2norm": True, "gate_base": "2" if seed % 2 else "e"}
    sequences = 1
    if packed:
        opts["cu_seqlens"] = np.array([0, 2, 2, length])
        sequences = 3
    opts["initial_state"] = rng.normal(size=(sequences, heads, dim, vdim))
    return (q, k, v, g, beta), opts


def _canonical(args, opts):
    full = dict(scale=None, initial_state=None, cu_seqlens=None, qk_l2norm=False, gate_base="e")
    full.update(opts)
    return _inputs.canonicalize(*args, **full)


@pytest.mark.cudasim
@needs_cuda
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_cuda_matches_the_cpu_kernel_bit_for_bit(form, packed):
    args, opts = _problem(form, packed, seed=len(form))
    o, state = refattn.linear_attention(*args, output_final_state=True, backend="cuda", **opts)
    cpu_o, cpu_s = refattn.linear_attention(*args, output_final_state=True, backend="numba", **opts)
    assert_same_bits(o, cpu_o, what=f"{form} cuda o against numba")
    assert_same_bits(state, cpu_s, what=f"{form} cuda state against numba")
    ref_o, ref_s = refattn.linear_attention(*args, output_final_state=True, **opts)
    bound_o, bound_s = refattn.linear.forward_error_bound(*args, **opts)
    assert_within(o, ref_o, 2 * bound_o, what=f"{form} cuda o")
    assert_within(state, ref_s, 2 * bound_s, what=f"{form} cuda state")


@pytest.mark.cudasim
@needs_cuda
def test_cuda_float32_and_launch_shapes():
    args, opts = _problem("gdn", packed=True, seed=3)
    call = _canonical(args, opts)
    one = _kernels.cuda_forward(call, "float32", threads=1)
    two = _kernels.cuda_forward(call, "float32", threads=2)
    cpu = _kernels.forward(call, "float32")
    for x, y, z, what in zip(one, two, cpu, ("o", "state"), strict=True):
        assert_same_bits(x, y, what=f"float32 {what}: 1 and 2 threads per block")
        assert_same_bits(x, z, what=f"float32 {what}: cuda and numba")


def _cotangents(args, opts, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=args[2].shape), rng.normal(size=opts["initial_state"].shape)


@pytest.mark.cudasim
@needs_cuda
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_cuda_vjp_matches_the_cpu_kernel_bit_for_bit(form, packed):
    args, opts = _problem(form, packed, seed=len(form))
    do, dht = _cotangents(args, opts)
    grads = refattn.linear_attention_vjp(*args, do, dht, backend="cuda", **opts)
    cpu = refattn.linear_attention_vjp(*args, do, dht, backend="numba", **opts)
    ref = refattn.linear_attention_vjp(*args, do, dht, **opts)
    bounds = refattn.linear.vjp_error_bound(*args, do, dht, **opts)
    for name in grads._fields:
        ours, theirs = getattr(grads, name), getattr(cpu, name)
        if theirs is None:
            assert ours is None and getattr(ref, name) is None, name
            continue
        assert_same_bits(ours, theirs, what=f"{form} cuda {name} against numba")
        assert_within(ours, getattr(ref, name), 2 * bounds[name], what=f"{form} cuda {name}")


@pytest.mark.cudasim
@needs_cuda
def test_cuda_vjp_float32_and_launch_shapes():
    args, opts = _problem("kda", packed=True, seed=3)
    call = _canonical(args, opts)
    do, dht = _cotangents(args, opts, seed=2)
    cpu = _kernels.backward(call, do, dht, "float32")
    for threads in (1, 2, 32):
        grads = _kernels.cuda_backward(call, do, dht, "float32", threads=threads)
        for name, x in grads.items():
            y = cpu[name]
            assert_same_bits(x, y, what=f"float32 vjp {name}: cuda ({threads} threads) and numba")


def test_missing_cuda_says_what_to_do():
    if linear_cuda.available():
        pytest.skip("CUDA (or the simulator) is available here")
    args, opts = _problem("gla")
    with pytest.raises(RuntimeError, match="NUMBA_ENABLE_CUDASIM=1"):
        refattn.linear_attention(*args, backend="cuda", **opts)


@pytest.mark.slow
@pytest.mark.cudasim
def test_linear_cuda_under_simulator():
    if linear_cuda.available():
        pytest.skip("the cudasim tests run in this process")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    cmd += ["-n", "0", "-m", "cudasim", "-k", "not under_simulator"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"cudasim run failed:\n{done.stdout[-4000:]}"
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], (
        f"cudasim run did not run the kernel:\n{done.stdout[-2000:]}"
    )
