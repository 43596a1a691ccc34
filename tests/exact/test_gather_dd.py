"""The double-double step of the fast exact gather (refattn.exact.fast.gather_dd): grid dot
products within their bound, rows forced into the step give the dense-mask engine's bits on
every option and output dtype, the features a one-word sum leaves undecided are settled by
Dot2, and the bits do not depend on the thread count."""

from __future__ import annotations

from fractions import Fraction

import numba
import numpy as np
import pytest

import refattn
from refattn import config
from refattn.exact.fast import doubledouble as D
from refattn.exact.fast import fallback_stats
from refattn.exact.fast import gather as G
from refattn.exact.fast import gather_dd as GD
from refattn.exact.fast.gather_lanes import W
from tests.helpers import digest_with_threads

OUT_DTYPES = ["float32", "bfloat16", "float16", "float64"]

# Compiled kernels only: the pure-Python twins (NUMBA_DISABLE_JIT=1) run too slowly here.
pytestmark = pytest.mark.skipif(numba.config.DISABLE_JIT, reason="compiled kernels only")


def _run(mode, q, k, v, **opts):
    saved = config.EXACT_SPARSE_KEYS
    config.EXACT_SPARSE_KEYS = mode
    try:
        result = refattn.attention(q, k, v, precision="exact", **opts)
        return (result if isinstance(result, tuple) else (result,)), dict(fallback_stats())
    finally:
        config.EXACT_SPARSE_KEYS = saved


def _same_bits(a, b):
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    same = ((a64 == b64) & (np.signbit(a64) == np.signbit(b64))) | (np.isnan(a64) & np.isnan(b64))
    return a.dtype == b.dtype and a.shape == b.shape and bool(same.all())


def _assert_as_mask(q, k, v, **opts):
    """The gather engine's results are the dense-mask engine's bytes; returns its stats."""
    gathered, stats = _run("gather", q, k, v, **opts)
    dense, _ = _run("mask", q, k, v, **opts)
    for n, (a, b) in enumerate(zip(gathered, dense, strict=True)):
        assert _same_bits(a, b), (n, sorted(opts), stats)
    return stats


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("heads", [1, 4, 5])
def test_grid_dots_are_within_their_bound(dtype, heads):
    """The grid sums hi + lo of every (row, key) against the exact dot product (rationals),
    with elements of widely spread magnitudes and exact zeros; hi is exactly T_D - sigma."""
    rng = np.random.default_rng(heads)
    dim = 37
    q = rng.standard_normal((heads, dim)) * 2.0 ** rng.integers(-30, 30, (heads, dim))
    keys = rng.standard_normal((W, dim)) * 2.0 ** rng.integers(-30, 30, (W, dim))
    q[0, 3] = 0.0
    keys[2] = 0.0
    q, keys = q.astype(dtype).astype(np.float64), keys.astype(dtype).astype(np.float64)
    panel = np.ascontiguousarray(keys.T)
    kn = np.empty(W)
    GD._panel_norms(panel, W, kn)
    qn = np.sqrt((q**2).sum(axis=1)) * (1.0 + 2.0**-30)
    sig = np.array([[GD._grid(qn[r], kn[c]) for c in range(W)] for r in range(heads)])
    hi, lo = np.empty((heads, W)), np.empty((heads, W))
    for r in range(0, heads - heads % 4, 4):
        GD._grid4(q[r : r + 4], panel, dim, sig[r : r + 4], hi[r : r + 4], lo[r : r + 4])
    for r in range(heads - heads % 4, heads):
        GD._grid1(q[r], panel, dim, sig[r], hi[r], lo[r])
    for r in range(heads):
        for c in range(W):
            exact = sum(Fraction(a) * Fraction(b) for a, b in zip(q[r], keys[c], strict=True))
            assert sig[r, c] >= 8 * qn[r] * kn[c] and sig[r, c] >= GD.GRID_MIN
            err = abs(Fraction(hi[r, c]) + Fraction(lo[r, c]) - exact)
            assert err <= Fraction(GD.grid_dot_bound(dim, sig[r, c])), (r, c)


def _cancelling(seed, *, heads=6, keys=80, top=40, dim=24, vdim=20):
    """A decode step whose feature 0 nearly cancels: two listed keys with the same key row
    (the same weight in every head) carry values 1 and -(1 - 2**-22) there, every other value
    of that feature is 0, so N_0 is 2**-22 of its magnitude sum: a one-word sum cannot round
    it to float32, Dot2 can."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, heads, 1, dim)).astype(np.float32)
    k = rng.standard_normal((1, 1, keys, dim)).astype(np.float32)
    v = rng.standard_normal((1, 1, keys, vdim)).astype(np.float32)
    idx = rng.permutation(keys)[:top]
    a, b = idx[0], idx[1]
    k[0, 0, b] = k[0, 0, a]
    v[0, 0, :, 0] = 0.0
    v[0, 0, a, 0] = 1.0
    v[0, 0, b, 0] = -(1.0 - 2.0**-22)
    return q, k, v, idx[None, None, None, :]


def test_cancelling_features_are_settled_by_dot2():
    """The rows the double-precision step leaves undecided on a cancelling feature are
    decided by the double-double step (no referee), with the dense-mask engine's bits."""
    q, k, v, idx = _cancelling(3)
    stats = _assert_as_mask(q, k, v, key_indices=idx, out_dtype="float32", scale=0.3)
    assert stats["double_double_rows"] > 0
    assert stats["referee_rows"] == 0


def _skip_double_step(monkeypatch):
    """The double-precision step does nothing: every row the first steps take goes to the
    double-double step."""

    def nothing(items, inputs, lists, rule, target, results, source):
        return None

    monkeypatch.setattr(G, "gather_d", nothing)
    monkeypatch.setattr(G, "gather_d_serial", nothing)


OPTIONS = [
    {},
    {"causal": True, "align": "bottom_right", "window": (3, 0)},
    {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
    {"softcap": 3.0, "alibi_slopes": np.array([0.25, 0.5, 0.125, 1.0])},
    {"mask": np.arange(23) % 3 != 1},
    {"dropout_p": 0.25, "dropout_mask": np.random.default_rng(9).random((2, 4, 5, 23)) > 0.25},
]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_rows_forced_into_the_step_match_the_dense_mask(monkeypatch, opts, out_dtype):
    """Every row in the double-double step (the double-precision step skipped), with lse
    and weights asked for or not: the dense-mask engine's bytes."""
    _skip_double_step(monkeypatch)
    rng = np.random.default_rng(len(opts))
    q = rng.standard_normal((2, 4, 5, 6))
    k = rng.standard_normal((2, 2, 23, 6))
    v = rng.standard_normal((2, 2, 23, 3))
    idx = rng.integers(-1, 23, (2, 2, 5, 9))
    asked = {"return_lse": True, "return_weights": True} if out_dtype == "float64" else {}
    stats = _assert_as_mask(q, k, v, key_indices=idx, out_dtype=out_dtype, **asked, **opts)
    assert stats["double_double_rows"] > 0


def test_forced_float32_decode_step_with_cancelling_features(monkeypatch):
    """The float32 outputs of rows forced into the step, some features cancelling (Dot2),
    several row groups (two batch rows, two query rows) and a head count that is not a
    multiple of four: the dense-mask engine's bytes, no referee row."""
    _skip_double_step(monkeypatch)
    q, k, v, idx = _cancelling(5, heads=7)
    q = np.concatenate([q, q[:, :, :, ::-1]], axis=2)
    q, k, v = (np.concatenate([x, x * np.float32(0.5)]) for x in (q, k, v))
    idx = np.concatenate([idx, idx[..., ::-1]], axis=2)
    idx = np.concatenate([idx, idx])
    stats = _assert_as_mask(q, k, v, key_indices=idx, out_dtype="float32", scale=0.3)
    assert stats["double_double_rows"] == q.shape[0] * q.shape[1] * q.shape[2]
    assert stats["referee_rows"] == 0


def test_exp_lanes_are_the_scalar_exponentials():
    """exp_dd_fast_lanes gives exp_dd_fast's bits, NaN outside the domain."""
    rng = np.random.default_rng(0)
    xh = -np.abs(rng.standard_normal(101)) * 40.0
    xh[:4] = [0.0, 1.0, -619.5, -700.0]
    xl = xh * 2.0**-60 * rng.standard_normal(101)
    eh, el = np.empty(101), np.empty(101)
    D.exp_dd_fast_lanes(xh, xl, eh, el)
    for j in range(101):
        want = D.exp_dd_fast(xh[j], xl[j])
        assert _same_bits(np.array([eh[j], el[j]]), np.array(want)), j


def test_dd_step_bits_do_not_depend_on_thread_count():
    """A decode step large enough for the step's parallel passes, every row in it (a
    cancelling feature): the same bytes with NUMBA_NUM_THREADS=1 and 2."""
    code = (
        "import numpy as np, refattn, hashlib\n"
        "from refattn.exact.fast import fallback_stats\n"
        "from tests.exact.test_gather_dd import _cancelling\n"
        "q, k, v, idx = _cancelling(8, heads=9, keys=1200, top=600, dim=160, vdim=144)\n"
        "out = refattn.attention(q, k, v, key_indices=idx, precision='exact',\n"
        "                        out_dtype='float32', scale=0.1)\n"
        "assert fallback_stats()['double_double_rows'] == 9, fallback_stats()\n"
        "print(hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest())\n"
    )
    assert digest_with_threads(code, 1) == digest_with_threads(code, 2)


@pytest.mark.parametrize("dim", [5, 37, 64])
@pytest.mark.parametrize("m", [3, W])
def test_source_panels_hold_the_listed_keys(dim, m):
    """gather_lanes.source_panel, which the step reads its keys through (eight features
    transposed at a time, the tail one by one): the listed rows widened exactly, key l in
    lane l, +0 in the missing keys' lanes."""
    from refattn.exact.fast.gather_lanes import source_panel

    rng = np.random.default_rng(dim + m)
    src = rng.standard_normal((30, dim)).astype(np.float32)
    rows = rng.permutation(30)
    cols = rng.permutation(20)
    got = np.full((dim, W), np.nan)
    none = (np.empty(0, np.bool_), np.empty(0))
    source_panel(src, rows, cols, (4, 4), m, np.empty((W, dim)), got, none)
    want = np.zeros((dim, W))
    want[:, :m] = src[rows[cols[4 : 4 + m]]].astype(np.float64).T
    assert _same_bits(got, want)
