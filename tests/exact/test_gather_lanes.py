"""The lane-wise loops of the fast exact gather (refattn.exact.fast.gather_lanes) give the bits
of the scalar loops they replace: dot products and their magnitude sums, the weighted value
sums, the keys' facts (norms, exactness scales, range check) and the values' maxima."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from refattn.exact.fast import gather_kernels as GK
from refattn.exact.fast import gather_lanes as GL
from refattn.exact.fast.facts import row_facts
from refattn.exact.fast.forward_kernels import ROW_BLOCK

# The lanes' pure-Python twins (NUMBA_DISABLE_JIT=1) do not fuse the fma: bits are compiled-only.
pytestmark = pytest.mark.skipif(
    numba.config.DISABLE_JIT, reason="bit equality holds for the compiled loops only"
)


def _bits_equal(a, b):
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("dim,keys,heads", [(37, 21, 3), (64, 16, 8), (576, 40, 5)])
def test_dot_tiles_match_the_scalar_chains(dim, keys, heads):
    rng = np.random.default_rng(dim + keys)
    q = rng.standard_normal((1, heads, 2, dim))
    q[0, 1, 1, ::5] = 0.0  # skipped features
    kT = rng.standard_normal((dim, keys + 3)) * 2.0 ** rng.integers(-30, 30, (dim, keys + 3))
    head_ids = np.arange(heads)
    want_s, want_ab = np.zeros((ROW_BLOCK, keys)), np.zeros((ROW_BLOCK, keys))
    GK._blocked_dots(q[0], head_ids, heads, 1, kT, 3, 0, want_s, want_ab)
    s, ab = np.zeros((ROW_BLOCK, keys)), np.zeros((ROW_BLOCK, keys))
    GL.dot_tiles(np.ascontiguousarray(q[0, :, 1]), kT[:, 3:], keys, GK.DOT_BLOCK, s, ab)
    GK._blocked_dots(q[0], head_ids, heads, 1, kT, 3, keys - keys % GL.W, s, ab)
    assert _bits_equal(s, want_s) and _bits_equal(ab, want_ab)


@pytest.mark.parametrize("vdim,rows", [(512, 8), (45, 5), (3, 1)])
def test_weighted_rows_match_the_scalar_sums(vdim, rows):
    rng = np.random.default_rng(vdim)
    nb = 29
    vp = rng.standard_normal((40, vdim))
    cols = rng.permutation(40)[:nb]
    wts = rng.random((ROW_BLOCK, nb)) * 2.0 ** rng.integers(-60, 2, (ROW_BLOCK, nb))
    use = rng.random((ROW_BLOCK, nb)) > 0.2
    start = rng.standard_normal((2, ROW_BLOCK, vdim))
    n, a = start[0].copy(), start[1].copy()
    GL.weighted_rows(vp, cols, nb, rows, wts, use, n, a)
    want_n, want_a = start[0].copy(), start[1].copy()
    for r in range(rows):
        GL._weighted_tail(vp, cols, nb, wts[r], use[r], 0, want_n[r], want_a[r])
    assert _bits_equal(n, want_n) and _bits_equal(a, want_a)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [64, 45, 6])
def test_key_facts_are_row_facts_of_the_widened_keys(dtype, count):
    rng = np.random.default_rng(count)
    src = (rng.standard_normal((100, 70)) * 2.0 ** rng.integers(-20, 20, (100, 70))).astype(dtype)
    src[5] = 0.0
    src[7, 3] = np.nan
    src[9, 1] = np.inf
    src[11, 2] = np.finfo(dtype).tiny / 4  # subnormal
    src[13, :] = 2.0**-60
    used = np.sort(np.r_[[5, 7, 9, 11, 13], rng.permutation(np.arange(14, 100))[: count - 5]])
    rows = src[used].astype(np.float64)
    want = (np.empty(count), np.empty(count), np.empty(count, bool))
    row_facts(rows, rows.view(np.int64), want[0], want[1], want[2])
    kT = np.full((70, count + 2), np.nan)
    got = (np.empty(count), np.empty(count), np.empty(count, bool))
    GL.key_facts(src, used, kT, *got)
    assert _bits_equal(kT[:, :count], rows.T) and np.isnan(kT[:, count:]).all()
    assert all(_bits_equal(g, w) for g, w in zip(got, want, strict=True))


def test_value_rows_gather_widen_and_check():
    rng = np.random.default_rng(3)
    src = rng.standard_normal((30, 19)).astype(np.float32)
    used = np.array([2, 5, 11, 29])
    out, vmax = np.empty((4, 19)), np.empty(19)
    assert GL.value_rows(src, used, out, vmax)
    assert _bits_equal(out, src[used].astype(np.float64))
    assert _bits_equal(vmax, np.abs(src[used]).max(axis=0).astype(np.float64))
    src[11, 4] = np.nan
    assert not GL.value_rows(src, used, out, vmax)
    src[11, 4] = -np.inf
    assert not GL.value_rows(src, used, out, vmax)
    wide = src.astype(np.float64)
    wide[11, 4] = 2.0**-1060  # subnormal: out of the first steps' range
    assert not GL.value_rows(wide, used, out, vmax)
    wide[11, 4] = 0.0
    assert GL.value_rows(wide, used, out, vmax)
    assert GL.value_rows(src, used[:2], out, vmax)


@pytest.mark.parametrize("opts", [{}, {"causal": True}], ids=["plain", "causal"])
def test_tiled_paths_match_the_dense_mask_engine(opts):
    """Nine query heads per kv head (the eight- and four-row tiles and a single row), a value
    width with a scalar tail, listed keys past whole tiles: the bytes of the dense-mask path."""
    from tests.exact.test_exact_gather import _assert_identical, _sparse_case

    q, k, v, idx = _sparse_case(5, heads=9, kv_heads=1, length=3, keys=200, top=70, dim=70)
    v = np.random.default_rng(6).standard_normal((2, 1, 200, 45))
    for out_dtype in ("float32", "float64"):
        _assert_identical(q, k, v, key_indices=idx, out_dtype=out_dtype, return_lse=True, **opts)
