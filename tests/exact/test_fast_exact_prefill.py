"""The prefill path of the fast exact forward: the one-pass set-up (refattn.exact.fast.facts.
input_facts), the rows fused from their dot products (refattn.exact.fast.forward_exps), the
exact half-spacing of the quick rounding test (rounding_decision.half_gap). Each is checked
against what it replaces or against the referee, bit for bit, on small cases, and the results
do not depend on the thread count."""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest

import refattn
from refattn import config
from refattn.exact.fast import facts
from refattn.exact.fast import forward as FA
from refattn.exact.fast._params import frozen
from refattn.exact.fast.forward_kernels import KEY_TILE
from refattn.exact.fast.rounding_decision import decide_one, decide_quick, half_gap
from tests.helpers import assert_same_bits

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _exact(engine, q, k, v, out_dtype, **opts):
    saved = config.EXACT_ENGINE
    config.EXACT_ENGINE = engine
    try:
        return refattn.attention(q, k, v, precision="exact", out_dtype=out_dtype, **opts)
    finally:
        config.EXACT_ENGINE = saved


def _inputs(seed, dtype, heads=2, length=45, keys=45, dim=24, scale=1.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((1, heads, length, dim)) * scale).astype(dtype)
    k = rng.standard_normal((1, heads, keys, dim)).astype(dtype)
    v = rng.standard_normal((1, heads, keys, dim)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "opts",
    [
        dict(causal=True, align="bottom_right"),
        dict(causal=True, align="bottom_right", return_lse=True),
        dict(causal=True, sinks=np.array([0.5, 3.0])),
        dict(window=(13, 0), align="bottom_right", return_lse=True),
        dict(),
    ],
    ids=["causal", "causal-lse", "sinks", "window", "full"],
)
def test_fused_rows_match_the_referee(dtype, opts):
    """Without weights (the rows fused from their dot products) the fast engine returns the
    referee's bits, lse included; float32 inputs take the second pass too (fallback_stats)."""
    q, k, v = _inputs(1, DTYPES[dtype], scale=2.0)
    fast = _exact("fast", q, k, v, DTYPES[dtype], **opts)
    stats = FA.fallback_stats()
    slow = _exact("referee", q, k, v, DTYPES[dtype], **opts)
    fast, slow = (r if isinstance(r, tuple) else (r,) for r in (fast, slow))
    for a, b in zip(fast, slow, strict=True):
        assert_same_bits(a, b, what="fast vs referee", case=f"{dtype} {sorted(opts)} {stats}")
    assert stats["double_rows"] == q.shape[1] * q.shape[2]


def test_second_pass_rows_match_the_referee():
    """Large float32 scores leave rows to the magnitude-bound pass and the double-double step:
    their results are the referee's too."""
    q, k, v = _inputs(5, np.float32, length=70, keys=70, dim=40, scale=6.0)
    opts = dict(causal=True, align="bottom_right")
    fast = _exact("fast", q, k, v, np.float32, **opts)
    stats = FA.fallback_stats()
    slow = _exact("referee", q, k, v, np.float32, **opts)
    assert_same_bits(fast, slow, what="out", case=str(stats))
    assert stats["double_magnitude_rows"] > 0


def test_bits_do_not_depend_on_the_thread_count():
    """The first steps under 1 thread and under 2 (where configured) give the same bits."""
    q, k, v = _inputs(3, np.float32, heads=3, length=80, keys=80, dim=32, scale=4.0)
    opts = dict(causal=True, align="bottom_right", return_lse=True)
    saved = numba.get_num_threads()
    results = []
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS), saved}):
            numba.set_num_threads(threads)
            results.append(_exact("fast", q, k, v, np.float32, **opts))
    finally:
        numba.set_num_threads(saved)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert_same_bits(b, a, what="result", case="threads")


def _old_facts(q, k, v):
    """The float64 copies and facts the separate passes give (row_facts, plane_key_facts,
    plane_value_facts): what input_facts replaces."""
    q64, k64 = frozen(q, np.float64), frozen(k, np.float64)
    vdim = v.shape[3]
    epad = max(KEY_TILE, -(-vdim // KEY_TILE) * KEY_TILE)
    v64 = np.zeros(v.shape[:3] + (epad,))
    v64[..., :vdim] = v
    flat = frozen(q64.reshape(-1, q.shape[3]))
    qf = [np.empty(flat.shape[0], t) for t in (np.bool_, float, float)]
    facts.row_facts(flat, flat.view(np.int64), qf[1], qf[2], qf[0])
    kT = np.zeros(k.shape[:2] + (k.shape[3], k.shape[2] + KEY_TILE))
    kf = [np.empty(k.shape[:3], t) for t in (np.bool_, float, float)]
    facts.plane_key_facts(k64, kT, kf[1], kf[2], kf[0])
    vf = [np.empty(v.shape[:2] + (vdim,), t) for t in (np.bool_, float, float)]
    facts.plane_value_facts(frozen(v64), vf[1], vf[2], vf[0])
    return (q64, kT, v64), [a.reshape(q.shape[:3]) for a in qf], kf, vf


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("shape", [(2, 3, 70, 20), (1, 1, 1, 40), (1, 2, 33, 32)])
def test_input_facts_equal_the_separate_passes(dtype, shape):
    """input_facts widens q, K (into K^T) and V (zero-padded features) and gives each row's
    and feature's facts exactly as the separate float64 passes do, out-of-range values (the
    planes the referee takes) included."""
    rng = np.random.default_rng(11)
    source = np.float64 if dtype == "float64" else DTYPES.get(dtype, np.float32)
    q, k, v = (rng.standard_normal(shape).astype(source) for _ in range(3))
    q[0, 0, 0, 0] = np.inf
    k[0, -1, -1, 1] = np.nan
    v[0, 0, 0, -1] = source(2.0**-130) if dtype != "bfloat16" else source(2.0**-120)
    want = _old_facts(q, k, v)
    got_q = np.empty(q.shape)
    got_kT = np.zeros(k.shape[:2] + (k.shape[3], k.shape[2] + KEY_TILE))
    got_v = np.empty(want[0][2].shape)
    qf = [np.empty(q.shape[:3], t) for t in (np.bool_, float, float)]
    kf = [np.empty(k.shape[:3], t) for t in (np.bool_, float, float)]
    vf = [np.empty(v.shape[:2] + (v.shape[3],), t) for t in (np.bool_, float, float)]
    sources = tuple(FA._kernel_source(a) for a in (q, k, v))
    facts.input_facts(sources, (got_q, got_kT, got_v), (tuple(qf), tuple(kf), tuple(vf)))
    for name, a, b in zip(("q", "kT", "v"), (got_q, got_kT, got_v), want[0], strict=True):
        assert_same_bits(a, b, what=name, case=dtype)
    for name, got, ref in (("q", qf, want[1]), ("k", kf, want[2]), ("v", vf, want[3])):
        for what, a, b in zip(("ok", "norm", "scale/max"), got, ref, strict=True):
            assert_same_bits(a, b, what=f"{name} {what}", case=dtype)


@pytest.mark.parametrize("p", [8, 11, 24])
def test_half_gap_is_half_the_smaller_spacing(p):
    """half_gap(y) is half the distance from y to its nearer neighbour among p-bit floats
    (the spacing toward zero halves at a power of two)."""
    rng = np.random.default_rng(p)
    mant = rng.integers(2 ** (p - 1), 2**p, size=200).astype(np.float64)
    mant[:3] = 2 ** (p - 1)  # powers of two
    exps = rng.integers(-60, 60, size=200)
    y = np.ldexp(mant, exps - p) * np.where(rng.random(200) < 0.5, -1.0, 1.0)
    for value in y:
        m, e = np.frexp(abs(value))  # |value| = m 2**e, 1/2 <= m < 1
        up = np.ldexp(1.0, int(e) - p)  # the spacing above |value|
        down = up / 2 if m == 0.5 else up
        want = min(up, down) / 2
        assert half_gap(float(value), 2.0**-p, 2.0 ** (-p - 1)) == want, value


def test_decide_quick_agrees_with_decide_one_near_midpoints():
    """Enclosures around points just inside and beyond midpoints of float32 and bfloat16:
    wherever decide_quick decides, decide_one decides the same value."""
    rng = np.random.default_rng(2)
    for p, emin, top in ((24, -126, float(np.finfo(np.float32).max)), (8, -126, 3.38e38)):
        for _ in range(400):
            y = np.ldexp(float(rng.integers(2 ** (p - 1), 2**p)), int(rng.integers(-20, 20)) - p)
            up = np.ldexp(1.0, int(np.frexp(y)[1]) - p)
            x = y + up * (0.5 - 2.0 ** -float(rng.integers(1, 40)))
            r = abs(up) * 2.0 ** -float(rng.integers(2, 45))
            value, decided = decide_quick(x, 0.0, r, p, emin, top)
            if decided:
                assert (value, True) == decide_one(x, 0.0, r, p, emin, top)
