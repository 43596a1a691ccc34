"""Sigmoid attention on the Numba CPU kernels (refattn.kernels._cpu_sigmoid) and the CUDA
kernels (under NUMBA_ENABLE_CUDASIM=1): forward and vjp within the a-priori bounds of their
compute dtype (refattn.bounds.sigmoid) against the exact path.

One shape for every case (each compute dtype compiles once); float32 and the simulator are in
the slow tier (their compiles / the simulator's Python threads cost tens of seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import refattn
from refattn.bounds import sigmoid_forward_bound, sigmoid_vjp_bound
from refattn.kernels import compute_dtype
from refattn.kernels import cuda as kcuda
from refattn.spec import canonicalize
from tests.helpers import assert_within

ROOT = Path(__file__).resolve().parents[2]
CASES = ("plain", "gqa_causal", "everything", "log_s")


def _case(name, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    H, K, L, S, D, E = 2, 1, 5, 70, 3, 2  # S > one 64-key block
    q = rng.standard_normal((1, H, L, D)).astype(dtype)
    k = rng.standard_normal((1, K, S, D)).astype(dtype)
    v = rng.standard_normal((1, K, S, E)).astype(dtype)
    mask = rng.random((1, H, L, S)) > 0.3
    mask[:, :, 1] = False
    opts = {
        "plain": {},
        "gqa_causal": {"gqa": "tile", "causal": True, "align": "bottom_right"},
        "log_s": {"bias": np.float64(-np.log(S)), "window": (9, 2)},
        "everything": {
            "mask": mask,
            "bias": rng.standard_normal((L, S)),
            "softcap": 2.0,
            "causal": True,
            "align": "bottom_right",
            "alibi_slopes": np.array([0.5, 0.25]),
            "dropout_mask": rng.random((1, H, L, S)) > 0.2,
            "dropout_p": 0.2,
        },
    }[name]
    grad = rng.standard_normal((1, H, L, E))
    return q, k, v, dict(opts, normalizer="sigmoid"), grad


def _check(q, k, v, opts, grad, run_forward, run_vjp, label):
    cdt = compute_dtype(q.dtype).name
    exact = refattn.attention(q, k, v, precision="exact", **opts)
    bound = sigmoid_forward_bound(q, k, v, dtype=cdt, **opts)
    assert_within(run_forward(), exact, bound, what=f"{label} out", case=str(opts.keys()))
    grads = run_vjp()
    truth = refattn.attention_vjp(q, k, v, grad, precision="exact", **opts)
    bq, bk, bv, bs = sigmoid_vjp_bound(q, k, v, grad, dtype=cdt, **opts)
    for name, got, want, b in zip("qkv", grads[:3], truth[:3], (bq, bk, bv), strict=True):
        assert_within(got, want, b, what=f"{label} d{name}")
    if np.ndim(opts.get("bias")) == 2:  # a (L, S) bias: dbias sums the batch and heads
        dbias = np.asarray(grads[3]).reshape((-1,) + truth.dbias.shape).sum(axis=0)
        slack = bs.sum(axis=(0, 1)) + 4 * np.finfo(cdt).eps * np.abs(truth.dbias)
        assert_within(dbias, truth.dbias, slack, what=f"{label} dbias")


def _numba_runs(q, k, v, opts, grad):
    def forward():
        return refattn.attention(q, k, v, backend="numba", **opts)

    def vjp():
        return refattn.attention_vjp(q, k, v, grad, backend="numba", **opts)

    return forward, vjp


@pytest.mark.parametrize("name", CASES)
def test_numba_float64_within_bounds(name):
    q, k, v, opts, grad = _case(name)
    _check(q, k, v, opts, grad, *_numba_runs(q, k, v, opts, grad), "numba sigmoid float64")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("name", CASES)
def test_numba_float32_within_bounds(name, dtype):
    q, k, v, opts, grad = _case(name, dtype)
    _check(q, k, v, opts, grad, *_numba_runs(q, k, v, opts, grad), f"numba sigmoid {dtype}")


def test_numba_deterministic_and_decode():
    """Bit-identical on repeat; a decode step (L = 1) equals the last row of the prefill."""
    q, k, v, opts, _ = _case("gqa_causal")
    first = refattn.attention(q, k, v, backend="numba", **opts)
    again = refattn.attention(q, k, v, backend="numba", **opts)
    np.testing.assert_array_equal(first, again)
    step = refattn.attention(q[:, :, -1:], k, v, backend="numba", **opts)
    np.testing.assert_array_equal(step[:, :, 0], first[:, :, -1])


@pytest.mark.cudasim
@pytest.mark.skipif(not kcuda.available(), reason="no CUDA device and NUMBA_ENABLE_CUDASIM unset")
@pytest.mark.parametrize("name", CASES)
def test_cuda_within_bounds(name):
    q, k, v, opts, grad = _case(name)
    spec = canonicalize(q, k, v, **opts)
    do = np.asarray(grad, np.float64)

    def vjp():
        dq, dk, dv, dbias = kcuda.attention_vjp(spec, do)
        return dq, dk, dv, dbias

    _check(q, k, v, opts, grad, lambda: kcuda.attention(spec), vjp, "cuda sigmoid")


@pytest.mark.slow
def test_cuda_sigmoid_under_simulator():
    if kcuda.available():
        pytest.skip("the cudasim tests run in this process")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    cmd += ["-W", "error", "-m", "cudasim", "-k", "not under_simulator"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"cudasim run failed:\n{done.stdout[-4000:]}"
    assert " passed" in done.stdout, f"cudasim run did not run the kernels:\n{done.stdout[-2000:]}"
