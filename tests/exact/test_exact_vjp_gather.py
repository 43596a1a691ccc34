"""The exact vjp on sparse keys by gather (refattn.exact.fast.vjp_gather): only the keys some row
lists are visited, on a compacted key axis, and every gradient is bit-identical to the
dense-mask route's (``config.EXACT_SPARSE_KEYS = "mask"``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refattn
from refattn import config
from refattn._exact_sparse import exact_vjp_gathers
from refattn.exact.attention_vjp import exact_vjp
from refattn.exact.fast import vjp_gather as VG
from refattn.exact.fast.gather_kernels import compact_lists
from refattn.kernels import gather_spec
from refattn.spec import canonicalize


def _grads(mode, q, k, v, do, **opts):
    """The exact gradients on the route ``mode``: "gather" (the compacted keys, whatever the
    walk-length rule :func:`VG.gathers` would pick), "auto" (the rule's pick) or "mask"."""
    saved = config.EXACT_SPARSE_KEYS, VG.gathers
    config.EXACT_SPARSE_KEYS = "mask" if mode == "mask" else "gather"
    if mode == "gather":
        VG.gathers = lambda spec, keys_of: True
    try:
        return tuple(refattn.attention_vjp(q, k, v, do, precision="exact", **opts))
    finally:
        config.EXACT_SPARSE_KEYS, VG.gathers = saved


def _assert_identical(q, k, v, do, mode="gather", **opts):
    """The gather (or "auto") and dense-mask routes give the same bytes (NaN where both are
    NaN)."""
    __tracebackhide__ = True
    gathered = _grads(mode, q, k, v, do, **opts)
    dense = _grads("mask", q, k, v, do, **opts)
    assert len(gathered) == len(dense)
    for n, (a, b) in enumerate(zip(gathered, dense, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, n
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, n
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        same = ((a64 == b64) & (np.signbit(a64) == np.signbit(b64))) | (
            np.isnan(a64) & np.isnan(b64)
        )
        if not same.all():
            where = tuple(int(i) for i in np.argwhere(~same)[0])
            raise AssertionError(
                f"gradient {n} at {list(where)} ({sorted(opts)}): gather {a64[where]!r} != "
                f"mask {b64[where]!r}"
            )
    return gathered


def _sparse_case(seed, *, heads=4, kv_heads=2, length=3, keys=13, top=5, dim=4, vdim=3):
    """Gaussian q, k, v, dO (B=2, GQA) and indices with duplicates, -1, out-of-range entries
    and one row listing no valid key."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, heads, length, dim))
    k = rng.standard_normal((2, kv_heads, keys, dim))
    v = rng.standard_normal((2, kv_heads, keys, vdim))
    do = rng.standard_normal((2, heads, length, vdim))
    idx = rng.integers(0, keys, (2, kv_heads, length, top))
    idx[..., 1] = idx[..., 0]  # duplicates
    idx[..., 2] = -1
    idx[0, 0, 0, 3] = keys  # out of range
    idx[1, -1, 2, 4] = 10**9
    idx[0, -1, 1] = -1  # a row with no valid key
    return q, k, v, do, idx


OPTIONS = [
    {},
    {"causal": True},
    {"causal": True, "align": "bottom_right", "window": (2, 0)},
    {"kv_lengths": np.array([13, 6])},
    {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
    {"softcap": 3.0},
    {"gqa": "tile"},
    {"empty_rows": "nan"},
    {"mask": np.arange(13) % 3 != 1},
    {
        "dropout_p": 0.25,
        "dropout_mask": np.random.default_rng(9).random((2, 4, 3, 13)) > 0.25,
    },
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_gather_vjp_matches_dense_mask(opts):
    q, k, v, do, idx = _sparse_case(0)
    _assert_identical(q, k, v, do, key_indices=idx, out_dtype="float32", **opts)


@pytest.mark.parametrize("out_dtype", ["float64", "bfloat16"])
def test_gather_vjp_matches_with_grad_lse(out_dtype):
    q, k, v, do, idx = _sparse_case(1)
    dl = np.random.default_rng(2).standard_normal(q.shape[:3])
    _assert_identical(q, k, v, do, key_indices=idx, grad_lse=dl, out_dtype=out_dtype)


def test_two_dimensional_inputs_match():
    q, k, v, do, idx = (a[0, 0] for a in _sparse_case(13))
    _assert_identical(q, k, v, do, key_indices=idx, out_dtype="float32")


def test_unlisted_keys_get_exactly_zero_gradient():
    q, k, v, do, idx = _sparse_case(3)
    idx = np.where(idx >= 0, idx % 9, -1)  # keys 9..12 are never listed
    grads = _assert_identical(q, k, v, do, key_indices=idx, out_dtype="float64")
    for grad in grads[1:3]:
        assert not grad[:, :, 9:].any() and not np.signbit(grad[:, :, 9:]).any()


def test_unlisted_non_finite_keys_change_nothing():
    """NaN and Inf in keys no row lists: the gather route never reads them, and the dense
    route's gradients are finite there too."""
    q, k, v, do, idx = _sparse_case(9)
    idx = np.where(idx >= 0, idx % 10, -1)  # keys 10..12 are never listed
    k[:, :, 11, 0] = np.nan
    v[:, :, 12, 1] = np.inf
    grads = _assert_identical(q, k, v, do, key_indices=idx, out_dtype="float32")
    assert all(np.isfinite(g).all() for g in grads[:3])


def test_non_finite_rows_take_the_dense_route_pattern():
    """A NaN cotangent or an Inf query reaches dv's and dk's columns at unlisted keys on the
    dense route's float64 pattern: the gather route hands such calls to it."""
    q, k, v, do, idx = _sparse_case(14)
    do[0, 0, 1, 0] = np.nan
    q[1, 1, 0, 1] = np.inf
    _assert_identical(q, k, v, do, key_indices=idx, out_dtype="float32")
    q, k, v, do, idx = _sparse_case(15)
    k[0, 0, idx[0, 0, 0, 0], 1] = np.nan  # a listed key
    _assert_identical(q, k, v, do, key_indices=idx, out_dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_narrow_inputs_match(dtype):
    import ml_dtypes

    cast = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, do, idx = (a.astype(cast) if a.dtype.kind == "f" else a for a in _sparse_case(10))
    _assert_identical(q, k, v, do, key_indices=idx, out_dtype=dtype)


def test_block_indices_and_sigmoid_match():
    q, k, v, do, _ = _sparse_case(4)
    blocks = np.array([[[[0, 2, -1]] * 3] * 2] * 2)  # keys 0-3 and 8-11 of blocks of 4
    _assert_identical(q, k, v, do, key_block_indices=blocks, key_block_size=4, out_dtype="float32")
    idx = _sparse_case(4)[-1]
    _assert_identical(q, k, v, do, key_indices=idx, normalizer="sigmoid", out_dtype="float32")


def test_ties_and_empty_rows_match():
    """Equal scores (weights exactly 1/n: the referee's ties) and rows listing no valid key."""
    q, k, v, do, idx = _sparse_case(5)
    q[0, 1] = 0.0  # every score of these rows is 0 (head 1 reads kv head 0)
    idx[0, 0] = [1, 2, 3, 3, -1]
    _assert_identical(q, k, v, do, key_indices=idx, out_dtype="float64")
    # one kv head (its plane a broadcast view over the query heads) on the referee
    q, k, v, do, idx = _sparse_case(5, heads=2, kv_heads=1)
    q[0] = 0.0
    stats = {}
    _assert_identical(q, k, v, do, key_indices=idx, out_dtype="float64")
    spec = gather_spec(canonicalize(q, k, v), idx)
    compact, _ = VG.compact_spec(spec)
    exact_vjp(compact, do, None, np.dtype("float64"), stats=stats)
    assert stats["referee"] > 0


def test_qv_latent_matches():
    """MLA's qv (k' = [k, v]): dv's two terms summed and rounded once on the compacted keys."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, 2, 4))
    qv = rng.standard_normal((1, 2, 2, 3))
    k = rng.standard_normal((1, 1, 11, 4))
    v = rng.standard_normal((1, 1, 11, 3))
    do = rng.standard_normal((1, 2, 2, 3))
    idx = np.array([[[[3, 7, 7, -1], [0, 10, 11, 3]]]])
    grads = _assert_identical(q, k, v, do, key_indices=idx, qv=qv, out_dtype="float32")
    assert grads[-1] is not None  # dqv


def test_a_sparse_decode_step_compacts_to_the_listed_keys():
    """A decode step's compacted spec has the listed keys alone: no (L, S) plane."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, 2048, 8)).astype(np.float32)
    v = rng.standard_normal((1, 1, 2048, 4)).astype(np.float32)
    idx = rng.permutation(2048)[:32][None, None, None, :]
    spec = gather_spec(canonicalize(q, k, v), idx)
    compact, keys_of = VG.compact_spec(spec)
    assert compact.k.shape == (1, 1, 32, 8) and compact.mask.shape == (1, 4, 1, 32)
    assert compact.mask.strides[1] == 0  # one kv head: the query heads share its plane
    assert keys_of.ravel().tolist() == sorted(idx.ravel().tolist())
    do = rng.standard_normal((1, 4, 1, 4)).astype(np.float32)
    _assert_identical(q, k, v, do, key_indices=idx)


def test_listed_rows_is_the_set_reading_of_compact_lists():
    rng = np.random.default_rng(11)
    idx = rng.integers(-3, 14, (2, 2, 3, 9))
    q, k, v, _, _ = _sparse_case(0)
    spec = gather_spec(canonicalize(q, k, v), np.where(idx < 0, -1, idx))
    lists, counts = VG._listed_rows(spec)
    flat = np.where((spec.key_indices >= 0) & (spec.key_indices < 13), spec.key_indices, -1)
    flat = np.ascontiguousarray(flat, np.int64).reshape(-1, 9)
    want, want_counts = np.zeros_like(flat), np.zeros(flat.shape[0], np.int64)
    compact_lists(flat, want, want_counts)
    assert counts.ravel().tolist() == want_counts.tolist()
    valid = np.arange(9) < want_counts[:, None]
    assert np.array_equal(lists.reshape(-1, 9)[valid], want[valid])


def test_the_shorter_walk_is_chosen_and_both_match():
    """A causal prefill listing nearly every key keeps the dense route (its intervals are
    shorter); a decode step gathers; both give the dense route's bits."""
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 2, 6, 3))
    k = rng.standard_normal((1, 1, 6, 3))
    v = rng.standard_normal((1, 1, 6, 2))
    do = rng.standard_normal((1, 2, 6, 2))
    idx = np.tile(np.arange(6), (1, 1, 6, 1))
    spec = gather_spec(canonicalize(q, k, v, causal=True), idx)
    assert not VG.gathers(spec, VG.gathered_keys(spec)[0])
    _assert_identical(q, k, v, do, mode="auto", key_indices=idx, causal=True)
    spec = gather_spec(canonicalize(q[:, :, :1], k, v), idx[:, :, :1, :2])
    assert VG.gathers(spec, VG.gathered_keys(spec)[0])
    _assert_identical(q[:, :, :1], k, v, do[:, :, :1], mode="auto", key_indices=idx[..., :1, :2])


def test_exact_vjp_gathers_only_where_it_applies():
    listed = (np.zeros((1, 1)), None, None)
    assert exact_vjp_gathers("exact", "numpy", "set", listed, None, None)
    assert not exact_vjp_gathers("float64", "numpy", "set", listed, None, None)
    assert not exact_vjp_gathers("exact", "numpy", "multiset", listed, None, None)
    assert not exact_vjp_gathers("exact", "numpy", "set", (None, None, None), None, None)
    assert not exact_vjp_gathers("exact", "numpy", "set", listed, np.zeros(1), None)
    assert not exact_vjp_gathers("exact", "numpy", "set", listed, None, np.ones(1))
    saved = config.EXACT_SPARSE_KEYS
    config.EXACT_SPARSE_KEYS = "mask"
    try:
        assert not exact_vjp_gathers("exact", "numpy", "set", listed, None, None)
    finally:
        config.EXACT_SPARSE_KEYS = saved


def test_gather_vjp_is_the_default_route(monkeypatch):
    calls = []
    real = VG.compact_spec

    def counting(spec, gathered=None):
        calls.append(spec.key_indices.shape)
        return real(spec, gathered)

    monkeypatch.setattr(VG, "compact_spec", counting)
    q, k, v, do, idx = _sparse_case(8, keys=40)  # each kv head lists at most 15 of 40 keys
    refattn.attention_vjp(q, k, v, do, key_indices=idx, precision="exact")
    assert calls == [idx.shape]


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**16),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    length=st.integers(1, 3),
    keys=st.integers(1, 9),
    top=st.integers(1, 6),
    causal=st.booleans(),
)
def test_random_sparse_vjp_matches(seed, kv_heads, group, length, keys, top, causal):
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    q = rng.standard_normal((1, heads, length, 3))
    k = rng.standard_normal((1, kv_heads, keys, 3))
    v = rng.standard_normal((1, kv_heads, keys, 2))
    do = rng.standard_normal((1, heads, length, 2))
    idx = rng.integers(-2, keys + 2, (1, kv_heads, length, top))
    idx = np.where(idx < 0, -1, idx)
    opts = {"causal": True, "align": "bottom_right"} if causal else {}
    _assert_identical(q, k, v, do, key_indices=idx, out_dtype="float32", **opts)
