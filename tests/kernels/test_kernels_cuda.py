"""Tests of the numba.cuda attention kernels (refattn.kernels.cuda) on the CUDA simulator.

The simulator must be enabled before numba is imported, so when this process has neither a
GPU nor NUMBA_ENABLE_CUDASIM=1, :func:`test_cuda_kernels_under_simulator` re-runs this file in
a subprocess with NUMBA_ENABLE_CUDASIM=1 (tiny grids: the simulator runs one Python thread
per CUDA thread). On a machine with a GPU the same tests run on the device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import refattn
from refattn.kernels import cuda as kcuda
from refattn.kernels import numba_cpu
from refattn.spec import canonicalize

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tests.helpers import assert_within  # noqa: E402

needs_cuda = pytest.mark.skipif(
    not kcuda.available(), reason="no CUDA device and NUMBA_ENABLE_CUDASIM is not set"
)
_B, _H = 1, 2


def _inputs(name, seed=0):
    rng = np.random.default_rng(seed)
    H, K, L, S, D, E = _H, _H, 6, 19, 3, 2
    if name == "gqa_tile":
        H, K = 4, 2
    q = rng.standard_normal((_B, H, L, D))
    k = rng.standard_normal((_B, K, S, D))
    v = rng.standard_normal((_B, K, S, E))
    mask = rng.random((_B, H, L, S)) > 0.3
    mask[:, :, 2] = False
    opts = {
        "plain": {},
        "gqa_tile": {"gqa": "tile", "causal": True},
        "window": {"window": (3, 1), "align": "bottom_right"},
        "everything": {
            "mask": mask,
            "bias": rng.standard_normal((L, S)),
            "softcap": 2.0,
            "causal": True,
            "align": "bottom_right",
            "alibi_slopes": np.array([0.5, 0.25]),
            "empty_rows": "nan",
            "dropout_mask": rng.random((_B, H, L, S)) > 0.2,
            "dropout_p": 0.2,
        },
    }[name]
    return q, k, v, opts, rng.standard_normal((_B, H, L, E)), rng.standard_normal((_B, H, L))


CASES = ["plain", "gqa_tile", "window", "everything"]


@pytest.mark.cudasim
@needs_cuda
@pytest.mark.parametrize("name", CASES)
def test_cuda_forward_matches_float64(name):
    q, k, v, opts, _, _ = _inputs(name)
    spec = canonicalize(q, k, v, **opts)
    out, lse = kcuda.attention(spec, return_lse=True, threads=4)
    ref_out, ref_lse, weights = refattn.attention(
        q, k, v, return_lse=True, return_weights=True, **opts
    )
    keys = spec.dims[4]
    ob, lb = numba_cpu.forward_error_bound(spec, weights, np.float64, rescalings=keys)
    ob2, lb2 = numba_cpu.forward_error_bound(spec, weights, np.float64)
    assert_within(out, ref_out, ob + ob2, what="out", case=name)
    assert_within(lse, ref_lse, lb + lb2, what="lse", case=name)


@pytest.mark.cudasim
@needs_cuda
@pytest.mark.parametrize("name", CASES)
def test_cuda_backward_matches_float64(name):
    q, k, v, opts, grad_out, grad_lse = _inputs(name)
    spec = canonicalize(q, k, v, **opts)
    got = kcuda.attention_vjp(spec, grad_out, grad_lse, threads=4)
    ref = refattn.attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, **opts)
    _, _, weights = refattn.attention(q, k, v, return_lse=True, return_weights=True, **opts)
    bounds = numba_cpu.backward_error_bound(spec, weights, grad_out, grad_lse)
    for what, value, truth, bound in zip(
        ("dq", "dk", "dv", "dbias"), got, ref, bounds, strict=True
    ):
        if truth is None:
            assert value is None, f"{name}: {what} should be None without bias"
            continue
        if what == "dbias":
            value, bound = value.sum(axis=(0, 1)), bound.sum(axis=(0, 1))
        assert_within(
            value,
            spec.unflatten(truth) if what != "dbias" else truth,
            2 * bound,
            what=what,
            case=name,
        )


@pytest.mark.cudasim
@needs_cuda
def test_cuda_poison_at_excluded_positions_is_invisible():
    q, k, v, opts, grad_out, _ = _inputs("everything", seed=3)
    opts = opts | {"dropout_mask": None, "dropout_p": 0.0, "window": (1, 1)}
    spec = canonicalize(q, k, v, **opts)
    clean = kcuda.attention(spec, return_lse=True, threads=4)
    excluded = ~spec.allowed(0, 0).any(axis=0)  # keys no row of head 0 may see
    keys = np.flatnonzero(excluded)
    assert keys.size, "the case must exclude some key for every row"
    pk, pv = k.copy(), v.copy()
    pk[0, 0, keys] = np.nan
    pv[0, 0, keys] = np.inf
    dirty = kcuda.attention(canonicalize(q, pk, pv, **opts), return_lse=True, threads=4)
    for what, a, b in zip(("out", "lse"), dirty, clean, strict=True):
        assert np.array_equal(a[:, 0], b[:, 0], equal_nan=True), (
            f"poison in excluded keys {keys} of head 0 changed {what}"
        )


@pytest.mark.cudasim
@needs_cuda
def test_cuda_is_deterministic_across_launch_shapes():
    q, k, v, opts, grad_out, grad_lse = _inputs("everything", seed=5)
    spec = canonicalize(q, k, v, **opts)
    a = kcuda.attention(spec, return_lse=True, threads=4)
    b = kcuda.attention(spec, return_lse=True, threads=8)
    for what, x, y in zip(("out", "lse"), a, b, strict=True):
        assert np.array_equal(x, y, equal_nan=True), f"{what} depends on threads per block"


def _listed(rng, shape, keys, width=9):
    """(B, K, L, width) key lists with -1 sentinels, repeats and entries past S."""
    return rng.integers(-2, keys + 3, size=shape[:2] + (shape[2], width))


@pytest.mark.cudasim
@needs_cuda
@pytest.mark.parametrize("name", CASES)
def test_cuda_gather_matches_dense_mask_and_float64(name):
    """Sparse key lists (set reading) on the CUDA kernels: each row visits its listed keys
    only, in increasing order, with the arithmetic of the dense kernels, so forward and vjp
    have the bits of the dense kernels given the listed set as a mask, and agree with the
    float64 path (and the Numba CPU gather kernel) within the kernels' bounds."""
    from refattn.kernels import gather_spec

    q, k, v, opts, grad_out, grad_lse = _inputs(name, seed=7)
    idx = _listed(np.random.default_rng(8), (_B, k.shape[1], q.shape[2]), k.shape[2])
    listed = gather_spec(canonicalize(q, k, v, **opts), idx)
    dense = canonicalize(q, k, v, key_indices=idx, **opts)
    got = kcuda.attention(listed, return_lse=True, threads=4)
    want = kcuda.attention(dense, return_lse=True, threads=4)
    for what, a, b in zip(("out", "lse"), got, want, strict=True):
        assert np.array_equal(a, b, equal_nan=True), f"{name}: gather {what} != dense mask"
    ref_out, ref_lse, weights = refattn.attention(
        q, k, v, key_indices=idx, return_lse=True, return_weights=True, **opts
    )
    ob, lb = numba_cpu.forward_error_bound(dense, weights, np.float64, rescalings=k.shape[2])
    ob2, lb2 = numba_cpu.forward_error_bound(dense, weights, np.float64)
    assert_within(got[0], ref_out, ob + ob2, what="out", case=name)
    assert_within(got[1], ref_lse, lb + lb2, what="lse", case=name)
    cpu = refattn.attention(q, k, v, key_indices=idx, backend="numba", **opts)
    assert_within(got[0], cpu, 2 * (ob + ob2), what="out vs the Numba CPU gather", case=name)
    grads = kcuda.attention_vjp(listed, grad_out, grad_lse, threads=4)
    dense_grads = kcuda.attention_vjp(dense, grad_out, grad_lse, threads=4)
    for what, a, b in zip(("dq", "dk", "dv", "dbias"), grads, dense_grads, strict=True):
        assert (a is None) == (b is None), f"{name}: {what}"
        if a is not None:
            assert np.array_equal(a, b, equal_nan=True), f"{name}: gather {what} != dense mask"


@pytest.mark.cudasim
@needs_cuda
def test_cuda_gather_reads_the_lists_as_sets():
    """Shuffled lists with repeats, -1 and out-of-range entries give the bits of the plain
    lists; a key that no row lists may hold NaN/Inf without reaching the output."""
    from refattn.kernels import gather_spec

    q, k, v, opts, grad_out, _ = _inputs("plain", seed=9)
    rng = np.random.default_rng(10)
    keys = k.shape[2]
    idx = np.stack([rng.permutation(keys - 5)[:6] for _ in range(k.shape[1] * q.shape[2])])
    idx = idx.reshape(_B, k.shape[1], q.shape[2], 6)
    noisy = np.concatenate([idx, idx[..., :3], np.full(idx.shape[:-1] + (2,), -1)], axis=-1)
    noisy[..., -1] = keys + 4
    noisy = rng.permuted(noisy, axis=-1)
    unlisted = np.setdiff1d(np.arange(keys), idx)
    assert unlisted.size, "the case must leave a key unlisted"
    pk, pv = k.copy(), v.copy()
    pk[:, :, unlisted] = np.nan
    pv[:, :, unlisted] = np.inf
    plain = kcuda.attention(gather_spec(canonicalize(q, k, v), idx), return_lse=True, threads=4)
    dirty = kcuda.attention(gather_spec(canonicalize(q, pk, pv), noisy), return_lse=True)
    for what, a, b in zip(("out", "lse"), dirty, plain, strict=True):
        assert np.array_equal(a, b, equal_nan=True), f"set reading changed {what}"
    grads = kcuda.attention_vjp(gather_spec(canonicalize(q, k, v), idx), grad_out, threads=4)
    again = kcuda.attention_vjp(gather_spec(canonicalize(q, k, v), noisy), grad_out, threads=8)
    for what, a, b in zip(("dq", "dk", "dv"), grads[:3], again[:3], strict=True):
        assert np.array_equal(a, b), f"set reading changed {what}"


def test_missing_cuda_says_what_to_do():
    if kcuda.available():
        pytest.skip("CUDA (or the simulator) is available here")
    spec = canonicalize(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(RuntimeError, match="NUMBA_ENABLE_CUDASIM=1"):
        kcuda.attention(spec)


def test_too_wide_features_are_rejected():
    wide = np.ones((2, kcuda.MAX_FEATURES + 1))
    with pytest.raises(ValueError, match="D, E <="):
        kcuda.attention(canonicalize(wide, wide, wide))


@pytest.mark.cudasim
def test_cuda_kernels_under_simulator():
    if kcuda.available():
        pytest.skip("the cudasim tests run in this process")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        __file__,
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        "error",
        "-m",
        "cudasim",
        "-k",
        "not under_simulator",
    ]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"cudasim run failed:\n{done.stdout[-4000:]}"
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], (
        f"cudasim run did not run the kernels:\n{done.stdout[-2000:]}"
    )


@pytest.mark.cudasim
@needs_cuda
def test_cuda_fp4_inputs_match_float64():
    """NVFP4 k, v with block scales and a global scale reach the CUDA kernels dequantised
    exactly by canonicalize (the same spec as every path)."""
    import ml_dtypes

    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 2, 3, 16))
    codes = rng.integers(0, 16, size=(2, 1, 1, 5, 16)).astype(np.uint8)
    k, v = (c.view(ml_dtypes.float4_e2m1fn) for c in codes)
    scales = rng.uniform(0.25, 2, size=(2, 1, 1, 5, 1)).astype(ml_dtypes.float8_e4m3fn)
    opts = {
        "k_block_scale": scales[0],
        "v_block_scale": scales[1],
        "k_descale": np.array([[0.75]], np.float32),
        "causal": True,
        "align": "bottom_right",
    }
    spec = canonicalize(q, k, v, **opts)
    out, lse = kcuda.attention(spec, return_lse=True, threads=4)
    ref_out, ref_lse, weights = refattn.attention(
        q, k, v, return_lse=True, return_weights=True, **opts
    )
    ob, lb = numba_cpu.forward_error_bound(spec, weights, np.float64, rescalings=5)
    ob2, lb2 = numba_cpu.forward_error_bound(spec, weights, np.float64)
    assert_within(out, ref_out, ob + ob2, what="out", case="fp4")
    assert_within(lse, ref_lse, lb + lb2, what="lse", case="fp4")


@pytest.mark.cudasim
@needs_cuda
def test_cuda_qv_matches_float64():
    """FlashAttention 3's qv reaches the CUDA kernels through the folded spec (q' = [q, qv],
    k' = [k, v]); the gradients split back as refattn.attention_vjp does."""
    from refattn.bounds.unit import unit_roundoff
    from refattn.spec import split_qv_grads

    q, k, v, _, grad_out, grad_lse = _inputs("plain")
    qv = np.random.default_rng(1).standard_normal(q.shape[:-1] + v.shape[-1:])
    opts = {"causal": True, "align": "bottom_right", "qv": qv}
    spec = canonicalize(q, k, v, **opts)
    out, lse = kcuda.attention(spec, return_lse=True, threads=4)
    ref_out, ref_lse, weights = refattn.attention(
        q, k, v, return_lse=True, return_weights=True, **opts
    )
    keys = spec.dims[4]
    ob, lb = numba_cpu.forward_error_bound(spec, weights, np.float64, rescalings=keys)
    ob2, lb2 = numba_cpu.forward_error_bound(spec, weights, np.float64)
    assert_within(out, ref_out, ob + ob2, what="out", case="qv")
    assert_within(lse, ref_lse, lb + lb2, what="lse", case="qv")
    got = split_qv_grads(spec, *kcuda.attention_vjp(spec, grad_out, grad_lse, threads=4)[:3])
    ref = refattn.attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, **opts)
    dq_b, dk_b, dv_b, _ = numba_cpu.backward_error_bound(spec, weights, grad_out, grad_lse)
    cut = q.shape[-1]
    u = unit_roundoff("float64")
    # both runs add the two terms of dv once more: twice the terms' bounds, and the roundings
    dv_bound = 2 * (dv_b + dk_b[..., cut:]) + 4 * u * np.abs(ref.dv)
    bounds = (2 * dq_b[..., :cut], 2 * dk_b[..., :cut], dv_bound, 2 * dq_b[..., cut:])
    for what, value, truth, bound in zip(
        ("dq", "dk", "dv", "dqv"), got, (ref.dq, ref.dk, ref.dv, ref.dqv), bounds, strict=True
    ):
        assert_within(value, truth, bound, what=what, case="qv")


@pytest.mark.cudasim
@needs_cuda
def test_cuda_merge_states_within_the_kernel_bound():
    """merge_states(backend="cuda"): the CUDA attention kernel on merge.as_attention's problem,
    within the kernel forward bound of the exact merge."""
    rng = np.random.default_rng(4)
    outs = rng.standard_normal((3, 1, 2, 2))
    lses = rng.standard_normal((3, 1, 2)) * 4
    lses[1, 0, 0] = -np.inf
    out, lse = refattn.merge_states(outs, lses, backend="cuda")
    exact_out, exact_lse = refattn.merge_states(outs, lses, precision="exact")
    problem = refattn.merge.as_attention(outs, lses)
    spec = canonicalize(**problem)
    _, _, weights = refattn.attention(**problem, return_lse=True, return_weights=True)
    ob, lb = numba_cpu.forward_error_bound(spec, weights, np.float64, rescalings=3)
    assert_within(out, exact_out, ob.reshape(out.shape), what="out", case="merge")
    assert_within(lse, exact_lse, lb.reshape(lse.shape), what="lse", case="merge")
    do = rng.standard_normal((1, 2, 2))
    got = refattn.merge_states_vjp(outs, lses, do, backend="cuda")
    ref = refattn.merge_states_vjp(outs, lses, do, precision="exact")
    bounds = numba_cpu.backward_error_bound(spec, weights, do.reshape(2, 1, 1, 2))
    dv_b = np.moveaxis(bounds[2][:, 0].reshape(1, 2, 3, 2), -2, 0)
    db_b = np.moveaxis(bounds[3][:, 0, 0].reshape(1, 2, 3), -1, 0)
    assert_within(got.douts, ref.douts, 2 * dv_b, what="douts", case="merge")
    assert_within(got.dlses, ref.dlses, 2 * db_b, what="dlses", case="merge")
