"""The exact path on its hardest inputs, bit for bit against the independent loop twins.

* every input of issue #9 item 5 (score gaps up to 1e10, scores beyond the float range, a bias
  of 1e300, inputs at the float maximum): a correctly rounded result, never an abort, an
  OverflowError or a ZeroDivisionError;
* hypothesis sweeps of hard cases (tests/strategies.py: ties at the maximum, results on or a
  hair from rounding midpoints, gaps 60 .. 1e9, near-cancelling outputs, subnormal and
  near-overflow values) for logspace, attention (out, lse, weights) and attention_vjp;
* long rows (S = 4096 slow, 65536 xslow) and rows of a case crossing 64- and 128-key tiles.

The twins (tests/naive) keep results near a boundary as an exact head plus a small tail, so
they settle ``midpoint + exp(-1e9)`` without 4e8 digits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import refattn
from tests.helpers import assert_same_bits
from tests.naive.attention import naive_attention_rounded, naive_attention_vjp
from tests.naive.logspace import naive_logspace_rounded
from tests.naive.rounding import round_nested
from tests.strategies import hard_attention_cases, hard_logspace_rows

BIG = float(np.finfo(np.float64).max)


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def check_logspace(x, where, target="float64", case=""):
    """logsumexp / softmax / log_softmax (exact) == the rounded twin, bit for bit."""
    dtype = _dtype(target)
    want = naive_logspace_rounded(x, where, dtype)
    for function, truth in zip(
        (refattn.logsumexp, refattn.softmax, refattn.log_softmax), want, strict=True
    ):
        got = function(x, where=where, precision="exact", out_dtype=dtype)
        assert_same_bits(got, truth, what=f"{function.__name__} exact", case=case)


def check_attention(q, k, v, opts, target="float64", case=""):
    """out, lse, weights (exact) == the rounded twin; q (H, L, D), k, v (K, S, .)."""
    dtype = _dtype(target)
    got = refattn.attention(
        q, k, v, precision="exact", out_dtype=dtype, return_lse=True, return_weights=True, **opts
    )
    want = naive_attention_rounded(q, k, v, opts, dtype)
    for name, value, truth in zip(("out", "lse", "weights"), got, want, strict=True):
        assert_same_bits(value, truth, what=f"attention exact {name}", case=case)


def check_vjp(q, k, v, grad_out, scale, target="float64", case=""):
    """dq, dk, dv (exact) == the rounded twin; plain single-head q (L, D), k, v (S, .)."""
    dtype = _dtype(target)
    got = refattn.attention_vjp(q, k, v, grad_out, scale=scale, precision="exact", out_dtype=dtype)
    want = naive_attention_vjp(q, k, v, grad_out, scale=scale)
    for name, value, truth in zip(("dq", "dk", "dv"), got[:3], want, strict=True):
        assert_same_bits(
            value, round_nested(truth, dtype), what=f"attention_vjp exact {name}", case=case
        )


# ----------------------------------------------------------------------------- item 5 inputs
LOGSPACE_ROWS = {
    "gap 1e10": [1e10, 0.0],
    "gap 1e9": [1e9, 0.0],
    "1e250": [1e250, 0.0],
    "float max twice": [BIG, BIG],
    "1e300 and -1e300": [1e300, -1e300],
    "max and -max": [BIG, -BIG],
    "ties below a 1e9 tail": [3.0, 3.0, 3.0 - 1e9],
}


@pytest.mark.parametrize("target", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("label", list(LOGSPACE_ROWS))
def test_logspace_item5_inputs(label, target):
    x = np.array([LOGSPACE_ROWS[label]])
    check_logspace(x, np.ones(x.shape, dtype=bool), target, case=label)


def _beyond_range(seed, size=1e200):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((1, 2, 3)) * size,
        rng.standard_normal((1, 3, 3)) * size,
        rng.standard_normal((1, 3, 2)),
    )


ATTENTION_CASES = {
    "q,k ~ 1e200": lambda: (*_beyond_range(0), {"scale": 1.0}),
    "q,k ~ 1e300": lambda: (*_beyond_range(1, 1e300), {"scale": 1.0}),
    "scale 1e308": lambda: (*_beyond_range(2, 1.0), {"scale": 1e308}),
    "gap 1e10": lambda: (
        np.array([[[1e5]]]),
        np.array([[[1e5], [0.0]]]),
        np.array([[[1.0], [2.0]]]),
        {"scale": 1.0},
    ),
    "bias +-1e300": lambda: (
        np.ones((1, 1, 2)),
        np.ones((1, 2, 2)),
        np.array([[[1.0], [2.0]]]),
        {"bias": np.array([[[1e300, -1e300]]])},
    ),
    "bias cancels the score": lambda: (
        np.array([[[1e150]]]),
        np.array([[[1e150], [0.0]]]),
        np.array([[[1.0], [2.0]]]),
        {"scale": 1.0, "bias": np.array([[[-1e300, 0.0]]])},
    ),
    "v below a -0 tail": lambda: (
        np.array([[[1.0]]]),
        np.array([[[1e5], [0.0]]]),
        np.array([[[0.0], [-1.0]]]),
        {"scale": 1.0},
    ),
}


@pytest.mark.parametrize("label", list(ATTENTION_CASES))
def test_attention_item5_inputs(label):
    q, k, v, opts = ATTENTION_CASES[label]()
    check_attention(q, k, v, opts, case=label)


def test_attention_beyond_range_with_default_scale_and_softcap():
    """1/sqrt(D) irrational and a softcap: finite, correctly rounded convex combinations."""
    q, k, v = _beyond_range(3)
    for opts in ({}, {"softcap": 30.0}):
        out, lse = refattn.attention(q, k, v, precision="exact", return_lse=True, **opts)
        assert np.isfinite(out).all(), opts
        assert (np.isinf(lse) | np.isfinite(lse)).all(), opts
        check_attention(q, k, v, opts, case=f"q,k ~ 1e200 {opts}")


VJP_CASES = {
    "gap 1e10": (
        np.array([[1e5]]),
        np.array([[1e5], [0.0]]),
        np.array([[1.0], [2.0]]),
        np.ones((1, 1)),
        1.0,
    ),
    "q,k ~ 1e200": (*(a[0] for a in _beyond_range(0)), np.ones((2, 2)), 1.0),
    "q,k ~ 1e200, 1/sqrt(D)": (
        *(a[0] for a in _beyond_range(4)),
        np.random.default_rng(5).standard_normal((2, 2)),
        None,
    ),
    "dv on a midpoint + exp(-1e5)": (
        np.array([[1.0], [1.0]]),
        np.array([[1e5], [0.0]]),
        np.array([[1.0], [2.0]]),
        np.array([[1.0], [2.0**-53]]),
        1.0,
    ),
}


@pytest.mark.parametrize("label", list(VJP_CASES))
def test_vjp_item5_inputs(label):
    check_vjp(*VJP_CASES[label], case=label)


# ----------------------------------------------------------------------------- sweeps
@settings(max_examples=40, deadline=None)
@given(case=hard_logspace_rows())
def test_logspace_hard_sweep(case):
    x, where, target = case
    check_logspace(x, where, target, case=f"x={x.tolist()} where={where.tolist()} {target}")


@settings(max_examples=40, deadline=None)
@given(case=hard_attention_cases())
def test_attention_hard_sweep(case):
    q, k, v, opts, target = case
    check_attention(q, k, v, opts, target, case=f"k={k.ravel().tolist()} v={v.tolist()} {target}")


@settings(max_examples=25, deadline=None)
@given(case=hard_attention_cases(max_keys=4))
def test_vjp_hard_sweep(case):
    q, k, v, opts, target = case
    grad_out = np.linspace(-1.0, 1.0, q.shape[1] * v.shape[2]).reshape(q.shape[1], v.shape[2])
    check_vjp(
        q[0],
        k[0],
        v[0],
        grad_out,
        opts["scale"],
        target,
        case=f"k={k.ravel().tolist()} v={v.tolist()} {target}",
    )


# ----------------------------------------------------------------------------- long rows
def _long_row(keys, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, keys)) * 30
    x[0, : keys // 3] = x.max()  # many ties at the maximum
    x[0, -3:] -= 1e9
    return x


@pytest.mark.slow
def test_logspace_long_row():
    x = _long_row(4096, 0)
    check_logspace(x, np.ones(x.shape, dtype=bool), "float32", case="S=4096")


@pytest.mark.xslow
def test_logspace_very_long_row():
    x = _long_row(65536, 1)
    check_logspace(x, np.ones(x.shape, dtype=bool), "bfloat16", case="S=65536")


def _sampled_rows_match(length, keys, dim, rows, seed, **opts):
    """Rows of a larger bfloat16 case vs the twin at 60 digits (only the sampled rows)."""
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((1, length, dim)).astype(bf16)
    k = rng.standard_normal((1, keys, dim)).astype(bf16)
    v = rng.standard_normal((1, keys, dim)).astype(bf16)
    k[0, 70] = k[0, 3]  # a tie across a 64-key tile
    k[0, 200] = k[0, 130]  # and across a 128-key tile
    out, lse = refattn.attention(
        q, k, v, precision="exact", out_dtype=np.float32, return_lse=True, **opts
    )
    for i in rows:
        want_out, want_lse, _ = naive_attention_rounded(q[:, i : i + 1], k, v, opts, np.float32)
        assert_same_bits(out[:, i : i + 1], want_out, what="attention exact out", case=f"row {i}")
        assert_same_bits(lse[:, i : i + 1], want_lse, what="attention exact lse", case=f"row {i}")


@pytest.mark.slow
def test_rows_crossing_key_tiles():
    # the last, partial query tile; each sampled row costs its 60-digit twin (~5 s)
    _sampled_rows_match(130, 300, 128, rows=(129,), seed=7)


@pytest.mark.xslow
def test_rows_crossing_key_tiles_first_tiles():
    _sampled_rows_match(130, 300, 128, rows=(0, 64), seed=7)


def test_vjp_dbias_signed_zeros():
    """One query row, q = 1, scale 1: dbias_j = dS_j = dk_j, so dbias takes the twin's dk
    bits (tiny dS of both signs underflow to -0 and +0)."""
    q, k, v, grad_out = (
        np.array([[1.0]]),
        np.array([[1e5], [0.0]]),
        np.array([[1.0], [2.0]]),
        np.array([[1.0]]),
    )
    got = refattn.attention_vjp(
        q, k, v, grad_out, bias=np.zeros((1, 2)), scale=1.0, precision="exact"
    )
    _, dk, _ = naive_attention_vjp(q, k, v, grad_out, scale=1.0)
    assert_same_bits(
        got.dbias.ravel(), round_nested(dk).ravel(), what="attention_vjp dbias", case="gap 1e5"
    )


def _engine_agreement(*args):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "tools" / "engine_agreement.py"), *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=3 * 3600,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_engine_agreement_on_smoke_whole_and_sampled():
    """tools/engine_agreement.py: the fast engine equals the referee on smoke cases compared
    whole, and on sampled rows (the kernel-scale method)."""
    assert "identical" in _engine_agreement("--suite", "smoke", "--match", "basic")
    assert "sampled rows" in _engine_agreement(
        "--suite", "smoke", "--full-below", "0", "--match", "grad-"
    )


@pytest.mark.xslow
def test_engine_agreement_on_kernel_scale_cases():
    """Every attention case of the kernel and full suites: whole below 2e6 multiply-adds, on
    sampled rows (tile boundaries, first, last, random; out, lse, dq) above."""
    _engine_agreement("--suite", "full", "--suite", "kernel", "--sample", "grad-gap", "--jobs", "2")
