"""Tests of refattn.kernels.variants: the Numba kernels of gmm.attention and mgk.attention.

Truth is the float64 NumPy path (itself tested against the exact path in test_gmm/test_mgk)
and, on small cases, the exact path. Both float64 paths lie within the NumPy path's documented
bound (oracle.judging.tolerance.mixture_bound / iterated_bound) of the exact result, so the kernel
may
differ from the NumPy path by at most twice that bound, and from the exact path by the bound.

Tiers: the default tier runs the compiled kernels; ``test_disable_jit_tier`` reruns the
``small`` tests in a subprocess with NUMBA_DISABLE_JIT=1 so the kernel bodies run as Python;
``test_bit_identical_across_thread_counts`` compares NUMBA_NUM_THREADS=1 and 2 subprocesses.
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.judging.tolerance import gamma, iterated_bound, logit_lse_bound, mixture_bound
from refattn import gmm, mgk
from tests.helpers import assert_same_bits, assert_within
from tests.registry import gmm_term_scale, mgk_term_scale
from tests.strategies import gmm_cases

ROOT = Path(__file__).resolve().parents[2]
JITLESS = os.environ.get("NUMBA_DISABLE_JIT") == "1"


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


# --------------------------------------------------------------------------------------------
# Problems and bounds
# --------------------------------------------------------------------------------------------


@st.composite
def mgk_cases(draw, max_length=6, max_keys=9, max_dim=3, max_vdim=3):
    """MGK problems with R in {1, 2, 4}, an optional batch axis, mask / causal / window /
    align, per-component sigma2 and log_pi, and optionally a row with no allowed key."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    comps = draw(st.sampled_from([1, 2, 4]))
    batch = (2,) if draw(st.booleans()) else ()
    length = draw(st.integers(1, max_length))
    units = draw(st.integers(1, max_keys))
    dim, vdim = draw(st.integers(1, max_dim)), draw(st.integers(1, max_vdim))
    spread = draw(st.sampled_from([0.5, 1.0, 4.0]))
    q = rng.standard_normal(batch + (length, dim)) * spread
    keys = rng.standard_normal(batch + (units, comps, dim)) * spread
    if draw(st.booleans()):  # tied components and keys
        keys[..., :, :, :] = keys[..., :1, :1, :]
    v = rng.standard_normal(batch + (units, vdim))
    opts = {"mode": draw(st.sampled_from(["soft", "hard"])), "normalized": draw(st.booleans())}
    if draw(st.booleans()):
        weights = rng.uniform(0.05, 1.0, (units, comps))
        opts["log_pi"] = np.log(weights / weights.sum(axis=-1, keepdims=True))
    if draw(st.booleans()):
        opts["sigma2"] = rng.uniform(0.25, 2.0, batch + (units, comps))
    if draw(st.booleans()):
        opts["causal"] = True
    if draw(st.booleans()):
        opts["align"] = "bottom_right"
    if draw(st.booleans()):
        opts["window"] = (
            draw(st.one_of(st.none(), st.integers(0, 3))),
            draw(st.one_of(st.none(), st.integers(0, 3))),
        )
    if draw(st.booleans()):
        mask = rng.random(batch + (length, units)) < 0.7
        if draw(st.booleans()):
            mask[..., -1, :] = False  # an empty row
        opts["mask"] = mask
    return q, keys, v, opts


def mgk_bound(q, keys, v, opts):
    """test_mgk's bound of the float64 path against the exact path (mixture_bound)."""
    scale_opts = {k: opts[k] for k in ("sigma2", "log_pi") if k in opts}
    return mixture_bound(
        mgk_term_scale(q, keys, scale_opts),
        keys.shape[-3] * keys.shape[-2],
        q.shape[-1] + 2,
        np.abs(v).max(),
    )


def gmm_bound(case):
    """test_gmm's bound of ``iters`` EM steps of the float64 path (iterated mixture_bound)."""
    values = case["values"]
    scale = gmm_term_scale(
        case["q"], case["keys"], values, case["alpha"], case["beta"], case["prior"]
    )
    step = mixture_bound(
        scale, values.shape[-2], case["q"].shape[-1] + values.shape[-1], np.abs(values).max()
    )
    diameter = np.ptp(values, axis=-2).max() ** 2 * values.shape[-1]
    lipschitz = 1 + float(np.max(case["beta"])) * diameter
    return iterated_bound(step, lipschitz, case["iters"]), scale


def _gmm_call(case, **extra):
    kwargs = {k: case[k] for k in ("alpha", "beta", "prior", "v_init", "iters")}
    kwargs.update(extra)
    return gmm.attention(case["q"], case["keys"], case["values"], **kwargs)


def _mgk_name(opts):
    return ", ".join(f"{k}={v}" if np.ndim(v) == 0 else k for k, v in sorted(opts.items()))


# --------------------------------------------------------------------------------------------
# MGK
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(JITLESS, reason="hypothesis sweep: compiled tier only")
@settings(max_examples=60)
@given(case=mgk_cases())
def test_mgk_kernel_matches_numpy_path(case):
    q, keys, v, opts = case
    fast = mgk.attention(q, keys, v, backend="numba", **opts)
    ref = mgk.attention(q, keys, v, **opts)
    assert fast.shape == ref.shape and fast.dtype == np.float64
    assert_within(
        fast,
        ref,
        2 * mgk_bound(q, keys, v, opts),
        what=f"mgk numba vs numpy ({_mgk_name(opts)}, R={keys.shape[-2]})",
    )


@pytest.mark.skipif(JITLESS, reason="hypothesis sweep: compiled tier only")
@settings(max_examples=15)
@given(case=mgk_cases(max_length=3, max_keys=4, max_dim=2, max_vdim=2))
def test_mgk_kernel_within_bound_of_exact(case):
    q, keys, v, opts = case
    fast = mgk.attention(q, keys, v, backend="numba", **opts)
    exact = mgk.attention(q, keys, v, precision="exact", **opts)
    assert_within(
        fast,
        exact,
        mgk_bound(q, keys, v, opts),
        what=f"mgk numba vs exact ({_mgk_name(opts)}, R={keys.shape[-2]})",
    )


@pytest.mark.parametrize("comps", [1, 2, 4])
@pytest.mark.parametrize(
    "options", [{}, {"causal": True, "align": "bottom_right"}, {"window": (5, 40), "mode": "hard"}]
)
def test_small_mgk_streams_over_key_blocks(comps, options, rng):
    """S spans several KEY_BLOCKs; causal/window rows start and end inside blocks."""
    length, units = 9, 150 if not JITLESS else 150
    q = rng.standard_normal((length, 3))
    keys = rng.standard_normal((units, comps, 3))
    v = rng.standard_normal((units, 2))
    opts = dict(options, sigma2=rng.uniform(0.5, 2.0, (units, comps)), normalized=True)
    fast = mgk.attention(q, keys, v, backend="numba", **opts)
    ref = mgk.attention(q, keys, v, **opts)
    assert_within(
        fast,
        ref,
        2 * mgk_bound(q, keys, v, opts),
        what=f"mgk numba vs numpy, S={units}, R={comps}, {options}",
    )


def test_small_mgk_masked_poison_never_reaches_output(rng):
    q, keys, v = (
        rng.standard_normal((3, 2)),
        rng.standard_normal((5, 2, 2)),
        rng.standard_normal((5, 3)),
    )
    mask = np.ones((3, 5), dtype=bool)
    mask[:, 2] = False
    mask[0, 4] = False
    poisoned_keys, poisoned_v = keys.copy(), v.copy()
    poisoned_keys[2, 1, 0] = np.nan
    poisoned_v[2] = np.inf
    poisoned_keys[4] = np.inf  # excluded for row 0 only
    full = mgk.attention(q, poisoned_keys, poisoned_v, mask=mask, backend="numba")
    keep = [0, 1, 3]
    cut = mgk.attention(q[:1], keys[keep], v[keep], backend="numba")
    assert_same_bits(full[:1], cut, what="masked NaN/Inf keys vs removed keys (row 0)")
    assert np.isnan(full[1:]).all(), f"an allowed Inf key must poison its rows: {full}"
    nan_q = q.copy()
    nan_q[1, 0] = np.nan
    out = mgk.attention(nan_q, keys, v, backend="numba")
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all(), f"NaN q row: {out}"


def test_small_mgk_empty_rows_are_positive_zero(rng):
    q, keys, v = (
        rng.standard_normal((3, 2)),
        rng.standard_normal((4, 2, 2)),
        rng.standard_normal((4, 2)),
    )
    mask = np.array([[False] * 4, [True, False, True, False], [False] * 4])
    out = mgk.attention(q, keys, v, mask=mask, backend="numba")
    assert (out[[0, 2]] == 0).all() and not np.signbit(out[[0, 2]]).any(), f"{out}"
    out = mgk.attention(q, keys, v, window=(0, 0), align="bottom_right", backend="numba")
    ref = mgk.attention(q, keys, v, window=(0, 0), align="bottom_right")
    assert_same_bits(out, ref, what="single-key rows (weight exactly 1)")


def test_small_mgk_underflowing_scores_stay_finite(rng):
    """Scores ~ -1e4: every exponential is max-shifted, so no 0/0."""
    q = rng.standard_normal((2, 2)) + 100.0
    keys, v = rng.standard_normal((3, 2, 2)), rng.standard_normal((3, 2))
    fast = mgk.attention(q, keys, v, backend="numba")
    ref = mgk.attention(q, keys, v)
    assert np.isfinite(fast).all(), f"{fast}"
    assert_within(fast, ref, 2 * mgk_bound(q, keys, v, {}), what="mgk numba at scores ~ -1e4")


def test_small_mgk_broadcast_batch(rng):
    """q batched, keys/v/log_pi shared, sigma2 per batch element, mask (L, S) shared."""
    q = rng.standard_normal((2, 3, 5, 2))
    keys, v = rng.standard_normal((6, 2, 2)), rng.standard_normal((6, 3))
    weights = rng.uniform(0.1, 1.0, (6, 2))
    opts = dict(
        log_pi=np.log(weights / weights.sum(-1, keepdims=True)),
        normalized=True,
        sigma2=rng.uniform(0.5, 2.0, (3, 6, 2)),
        mask=rng.random((5, 6)) < 0.7,
    )
    fast = mgk.attention(q, keys, v, backend="numba", **opts)
    ref = mgk.attention(q, keys, v, **opts)
    assert fast.shape == ref.shape == (2, 3, 5, 3)
    assert_within(fast, ref, 2 * mgk_bound(q, keys, v, opts), what="mgk numba broadcast batch")


def test_mgk_backend_errors(rng):
    q, keys, v = (
        rng.standard_normal((2, 2)),
        rng.standard_normal((3, 1, 2)),
        rng.standard_normal((3, 2)),
    )
    with pytest.raises(ValueError, match="backend: 'numba' runs the float64 path only"):
        mgk.attention(q, keys, v, precision="exact", backend="numba")
    with pytest.raises(ValueError, match="backend: expected one of"):
        mgk.attention(q, keys, v, backend="cuda")
    with pytest.raises(ValueError, match="mask: shape"):
        mgk.attention(q, keys, v, mask=np.ones((3, 3), dtype=bool), backend="numba")
    with pytest.raises(TypeError, match="mask: expected a boolean array"):
        mgk.attention(q, keys, v, mask=np.ones((2, 3)), backend="numba")


@pytest.mark.skipif(JITLESS, reason="memory scaling: compiled tier only")
def test_mgk_memory_is_linear_in_length():
    """No (L, S) or (L, S, R) array: the traced peak of a call stays a small multiple of the
    inputs' size (the kernel's own scratch is O(S) per thread by construction)."""
    rng = np.random.default_rng(7)
    length = units = 1024
    q, keys, v = (
        rng.standard_normal((length, 4)),
        rng.standard_normal((units, 2, 4)),
        rng.standard_normal((units, 4)),
    )
    mgk.attention(q[:2], keys[:2], v[:2], backend="numba")  # compile outside the trace
    inputs = q.nbytes + keys.nbytes + v.nbytes
    tracemalloc.start()
    mgk.attention(q, keys, v, causal=True, backend="numba")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    dense = length * units * 2 * 8
    assert peak < 8 * inputs < dense, (
        f"mgk numba: peak {peak} B for inputs of {inputs} B "
        f"(an (L, S, R) array is {dense} B; threshold 8x inputs)"
    )


# --------------------------------------------------------------------------------------------
# GMM
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(JITLESS, reason="hypothesis sweep: compiled tier only")
@settings(max_examples=60)
@given(case=gmm_cases(max_iters=3))
def test_gmm_kernel_matches_numpy_path(case):
    fast = _gmm_call(case, backend="numba")
    ref = _gmm_call(case)
    bound, _ = gmm_bound(case)
    assert_within(
        fast, ref, 2 * bound, what=f"gmm numba vs numpy ({case['style']}, iters={case['iters']})"
    )


@pytest.mark.skipif(JITLESS, reason="hypothesis sweep: compiled tier only")
@settings(max_examples=12)
@given(case=gmm_cases(max_iters=2, batched=False))
def test_gmm_kernel_within_bound_of_exact(case):
    fast = _gmm_call(case, backend="numba")
    exact = _gmm_call(case, precision="exact")
    bound, _ = gmm_bound(case)
    assert_within(
        fast, exact, bound, what=f"gmm numba vs exact ({case['style']}, iters={case['iters']})"
    )


@pytest.mark.skipif(JITLESS, reason="hypothesis sweep: compiled tier only")
@settings(max_examples=30)
@given(case=gmm_cases(max_iters=3, need_trace=True))
def test_gmm_kernel_trace_is_log_posterior_of_its_iterates(case):
    """trace[t] = log p(v_t | q): the last entry equals the NumPy log_posterior of the
    kernel's own output within twice two lse bounds (lse(a + b) and lse(a), each path)."""
    res = _gmm_call(case, backend="numba", return_trace=True)
    ref = _gmm_call(case, return_trace=True)
    assert (res.iterations == case["iters"]).all() and np.isfinite(res.trace).all()
    post = gmm.log_posterior(
        res.values,
        case["q"],
        case["keys"],
        case["values"],
        alpha=case["alpha"],
        beta=case["beta"],
        prior=case["prior"],
    )
    _, scale = gmm_bound(case)
    units, dims = case["keys"].shape[-2], case["q"].shape[-1] + case["values"].shape[-1]
    magnitude = scale + math.log(units) + float(np.abs(post).max())
    bound = 4 * logit_lse_bound(scale, units, dims, magnitude) + gamma(3) * magnitude
    assert_within(
        res.trace[..., -1], post, bound, what="gmm numba trace[-1] vs log_posterior(values)"
    )
    assert res.trace.shape == ref.trace.shape


@pytest.mark.parametrize("prior", ["uniform", "magnitude", "array"])
@pytest.mark.parametrize("per_unit", [False, True])
def test_small_gmm_streams_over_unit_blocks(prior, per_unit, rng):
    """S > UNIT_BLOCK, per-unit alpha/beta (the normaliser terms), every prior kind."""
    length, units = 4, 300 if not JITLESS else 300
    q, keys, values = (
        rng.standard_normal((length, 3)),
        rng.standard_normal((units, 3)),
        rng.standard_normal((units, 2)),
    )
    alpha = rng.uniform(0.25, 2.0, units) if per_unit else 0.7
    beta = rng.uniform(0.05, 0.5, units) if per_unit else 0.3
    prior_arg = rng.standard_normal(units) if prior == "array" else prior
    if prior == "array":
        prior_arg[::7] = -np.inf
    case = dict(
        q=q, keys=keys, values=values, alpha=alpha, beta=beta, prior=prior_arg, v_init=None, iters=3
    )
    res = _gmm_call(case, backend="numba", return_trace=True)
    ref = _gmm_call(case, return_trace=True)
    bound, _ = gmm_bound(case)
    assert_within(
        res.values,
        ref.values,
        2 * bound,
        what=f"gmm numba vs numpy, S={units}, {prior}, per-unit={per_unit}",
    )
    assert (res.iterations == 3).all() and np.isfinite(res.trace).all()


def test_small_gmm_tol_stops_rows_independently(rng):
    q = np.array([[0.0, 0.0], [3.0, -2.0]])
    keys = rng.standard_normal((3, 2))
    values = np.concatenate([np.ones((3, 1)), rng.standard_normal((3, 1))], axis=-1)
    kwargs = dict(alpha=1.0, beta=0.5, iters=50, tol=1e-12, return_trace=True)
    res = gmm.attention(q, keys, values, backend="numba", **kwargs)
    ref = gmm.attention(q, keys, values, **kwargs)
    assert (res.iterations < 50).all(), f"rows did not stop: {res.iterations}"
    for i, count in enumerate(res.iterations):
        assert np.isfinite(res.trace[i, :count]).all(), f"row {i}: {res.trace[i]}"
        assert np.isnan(res.trace[i, count:]).all(), f"row {i}: trace not NaN after stop"
    assert np.abs(res.iterations - ref.iterations).max() <= 1, (res.iterations, ref.iterations)


def test_small_gmm_v_init_and_batch(rng):
    q, keys, values = (
        rng.standard_normal((2, 3, 2)),
        rng.standard_normal((2, 4, 2)),
        rng.standard_normal((2, 4, 3)),
    )
    case = dict(
        q=q,
        keys=keys,
        values=values,
        alpha=rng.uniform(0.5, 2.0, (2, 4)),
        beta=0.2,
        prior="magnitude",
        v_init=rng.standard_normal((2, 3, 3)),
        iters=2,
    )
    fast = _gmm_call(case, backend="numba")
    ref = _gmm_call(case)
    bound, _ = gmm_bound(case)
    assert_within(fast, ref, 2 * bound, what="gmm numba v_init, batched")


def test_gmm_backend_errors(rng):
    q, keys, values = (
        rng.standard_normal((2, 2)),
        rng.standard_normal((3, 2)),
        rng.standard_normal((3, 2)),
    )
    with pytest.raises(ValueError, match="backend: 'numba' runs the float64 path only"):
        gmm.attention(q, keys, values, alpha=1.0, precision="exact", backend="numba")
    with pytest.raises(ValueError, match="backend: expected one of"):
        gmm.attention(q, keys, values, alpha=1.0, backend="torch")


@pytest.mark.skipif(JITLESS, reason="compiled dispatchers only")
def test_kernels_compile_without_fastmath():
    """fastmath would let LLVM re-associate the reductions (thread-independent but not the
    stated order) and contract a*b+c; every kernel must be compiled with it off."""
    from refattn.kernels import variants

    kernels = [
        getattr(variants, name)
        for name in dir(variants)
        if name.startswith("_") and hasattr(getattr(variants, name), "targetoptions")
    ]
    assert len(kernels) >= 8, f"expected the jitted kernels, found {kernels}"
    for kernel in kernels:
        assert kernel.targetoptions.get("fastmath") is False, (
            f"{kernel.py_func.__name__}: fastmath={kernel.targetoptions.get('fastmath')!r}, "
            "expected False"
        )


# --------------------------------------------------------------------------------------------
# Tiers in subprocesses: thread counts, NUMBA_DISABLE_JIT
# --------------------------------------------------------------------------------------------


def _digest():
    """sha256 of the kernels' outputs on cases spanning several key/unit blocks."""
    rng = np.random.default_rng(5)
    digest = hashlib.sha256()
    q, keys, v = (
        rng.standard_normal((3, 67, 8)),
        rng.standard_normal((3, 130, 2, 8)),
        rng.standard_normal((3, 130, 5)),
    )
    for opts in (
        {},
        {"causal": True},
        {"mask": rng.random((67, 130)) < 0.6, "mode": "hard"},
        {
            "window": (9, 3),
            "align": "bottom_right",
            "normalized": True,
            "sigma2": rng.uniform(0.5, 2.0, (130, 2)),
        },
    ):
        digest.update(mgk.attention(q, keys, v, backend="numba", **opts).tobytes())
    keys, values = rng.standard_normal((3, 290, 8)), rng.standard_normal((3, 290, 5))
    res = gmm.attention(
        q,
        keys,
        values,
        alpha=rng.uniform(0.5, 2.0, 290),
        beta=0.1,
        iters=3,
        prior="magnitude",
        return_trace=True,
        backend="numba",
    )
    for part in res:
        digest.update(part.tobytes())
    return digest.hexdigest()


_DIGEST_SCRIPT = "from tests.kernels.test_kernels_variants import _digest; print(_digest())"


def _run(code_or_args, env_extra, timeout):
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **env_extra,
    )
    args = (
        [sys.executable, "-c", code_or_args]
        if isinstance(code_or_args, str)
        else [sys.executable, *code_or_args]
    )
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(JITLESS, reason="thread counts: compiled tier only")
def test_bit_identical_across_thread_counts():
    digests = {}
    for threads in ("1", "2"):
        proc = _run(_DIGEST_SCRIPT, {"NUMBA_NUM_THREADS": threads}, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        digests[threads] = proc.stdout.strip()
    assert digests["1"] == digests["2"], (
        f"outputs differ between NUMBA_NUM_THREADS=1 and 2: "
        f"sha256 {digests} (threshold: bit for bit)"
    )
    here = _digest()  # and equal to this process's run
    assert here == digests["1"], f"in-process run {here} != subprocess run {digests['1']}"


@pytest.mark.skipif(JITLESS, reason="this test starts the NUMBA_DISABLE_JIT tier")
def test_disable_jit_tier():
    """The ``small`` tests with the kernel bodies run as plain Python (coverable)."""
    proc = _run(
        [
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-W",
            "error",
            "-k",
            "small",
            str(Path(__file__).relative_to(ROOT)),
        ],
        {"NUMBA_DISABLE_JIT": "1"},
        timeout=600,
    )
    assert proc.returncode == 0, f"NUMBA_DISABLE_JIT=1 tier failed:\n{proc.stdout[-4000:]}"
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-2000:]
