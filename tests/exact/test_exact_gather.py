"""The fast exact engine on sparse keys by gather (refattn.exact.fast.gather): each row visits
only its listed keys, without a dense (L, S) plane, and its results are bit-identical to the
dense-mask engine (``config.EXACT_SPARSE_KEYS = "mask"``) on every option and output dtype."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import refattn
from refattn import config, sparse_indices
from refattn.exact.fast import fallback_stats
from refattn.exact.fast import gather as G
from refattn.exact.fast import gather_kernels as GK

OUT_DTYPES = ["float64", "float32", "bfloat16", "float16"]


def _run(mode, q, k, v, **opts):
    saved = config.EXACT_SPARSE_KEYS
    config.EXACT_SPARSE_KEYS = mode
    try:
        result = refattn.attention(q, k, v, precision="exact", **opts)
        return (result if isinstance(result, tuple) else (result,)), fallback_stats()
    finally:
        config.EXACT_SPARSE_KEYS = saved


def _assert_identical(q, k, v, **opts):
    """Gather and dense-mask engines give the same bytes; returns the gather run's stats."""
    __tracebackhide__ = True
    gathered, stats = _run("gather", q, k, v, **opts)
    dense, _ = _run("mask", q, k, v, **opts)
    for n, (a, b) in enumerate(zip(gathered, dense, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        same = ((a64 == b64) & (np.signbit(a64) == np.signbit(b64))) | (
            np.isnan(a64) & np.isnan(b64)
        )
        if not same.all():
            where = tuple(int(i) for i in np.argwhere(~same)[0])
            raise AssertionError(
                f"result {n} at {list(where)} ({sorted(opts)}): gather {a64[where]!r} != "
                f"mask {b64[where]!r}; stats {stats}"
            )
    return stats


def _sparse_case(seed, *, heads=4, kv_heads=2, length=5, keys=23, top=7, dim=6, vdim=3):
    """Gaussian q, k, v (B=2) and indices with duplicates, -1, out-of-range entries and one
    row listing no valid key."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, heads, length, dim))
    k = rng.standard_normal((2, kv_heads, keys, dim))
    v = rng.standard_normal((2, kv_heads, keys, vdim))
    idx = rng.integers(0, keys, (2, kv_heads, length, top))
    idx[..., 1] = idx[..., 0]  # duplicates
    idx[..., 2] = -1
    idx[0, 0, 0, 3] = keys  # out of range
    idx[1, -1, 2, 4] = 10**9
    idx[0, -1, 1] = -1  # a row with no valid key
    return q, k, v, idx


OPTIONS = [
    {},
    {"causal": True},
    {"causal": True, "align": "bottom_right", "window": (3, 0)},
    {"kv_lengths": np.array([23, 11])},
    {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
    {"softcap": 3.0, "alibi_slopes": np.array([0.25, 0.5, 0.125, 1.0])},
    {"mask": np.arange(23) % 3 != 1},
    {
        "dropout_p": 0.25,
        "dropout_mask": np.random.default_rng(9).random((2, 4, 5, 23)) > 0.25,
    },
]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_gather_matches_dense_mask(opts, out_dtype):
    q, k, v, idx = _sparse_case(len(opts))
    stats = _assert_identical(
        q,
        k,
        v,
        key_indices=idx,
        out_dtype=out_dtype,
        return_lse=True,
        return_weights=out_dtype == "float64",
        **opts,
    )
    assert stats["referee_rows"] < stats["rows"]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_gather_matches_on_narrow_inputs_and_a_broadcast_list(dtype, out_dtype):
    """Narrow inputs (exactness scales), one (L, T) list for every head (broadcast)."""
    q, k, v, idx = _sparse_case(11, heads=3, kv_heads=1, length=6, keys=40, top=12, dim=20)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    _assert_identical(
        q, k, v, key_indices=idx[0, 0], out_dtype=out_dtype, return_lse=True, causal=True
    )


def test_block_indices_expand_lazily_and_match():
    q, k, v, _ = _sparse_case(3, keys=30)
    blocks = np.array([[0, 2, 2, -1], [5, 1, 9, 3], [4, 4, 4, 4], [-1, -1, -1, -1], [0, 1, 6, 7]])
    stats = _assert_identical(
        q,
        k,
        v,
        key_block_indices=blocks,
        key_block_size=4,
        out_dtype="float32",
        return_lse=True,
        return_weights=True,
    )
    assert stats["rows"] == 2 * 4 * 5


def test_ties_and_empty_rows_go_to_the_referee_with_their_listed_set():
    """Equal scores (weights exactly 1/n: undecided) and rows with no listed key are settled by
    the referee on the row's listed set."""
    q, k, v, idx = _sparse_case(5)
    q[0, 1] = 0.0  # every score of these rows is 0 (head 1 reads kv head 0)
    idx[0, 0] = [1, 2, 3, 4, 4, -1, 23]  # four distinct keys: weights exactly 1/4
    stats = _assert_identical(
        q, k, v, key_indices=idx, out_dtype="float64", return_lse=True, return_weights=True
    )
    assert stats["referee_rows"] >= 5 + 2  # the tied rows and the row with no valid key


def test_unlisted_non_finite_keys_are_never_read():
    """NaN and Inf in keys no row lists change nothing, and the rows stay on the first steps
    (the dense-mask engine sends such planes to the referee)."""
    q, k, v, idx = _sparse_case(8)
    idx = np.where(idx >= 0, idx % 20, -1)  # keys 20..22 are never listed
    k[:, :, 21, 0] = np.nan
    v[:, :, 22, 1] = np.inf
    stats = _assert_identical(q, k, v, key_indices=idx, out_dtype="float32", return_lse=True)
    assert stats["referee_rows"] == 2  # only the two rows that list no valid key


def test_no_dense_index_plane_outside_the_referee_rows(monkeypatch):
    """A decode step builds the listed set's (rows, S) mask for referee rows only."""
    built = []

    def counting(indices, keys):
        built.append(indices.shape[-2])
        return sparse_indices.index_mask(indices, keys)

    monkeypatch.setattr(G, "index_mask", counting)
    monkeypatch.setattr(refattn._fold.sparse_indices, "index_mask", counting)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 4096, 16)).astype(np.float32)
    v = rng.standard_normal((1, 1, 4096, 8)).astype(np.float32)
    idx = rng.permutation(4096)[:64][None, None, None, :]
    _run("gather", q, k, v, key_indices=idx, out_dtype="float32")
    assert sum(built) == fallback_stats()["referee_rows"]


def test_compact_lists_is_the_set_reading():
    rng = np.random.default_rng(1)
    idx = rng.integers(-3, 12, (40, 9))
    idx = np.where(idx < 0, -1, idx)
    lists = np.zeros_like(idx)
    counts = np.zeros(40, np.int64)
    GK.compact_lists(idx, lists, counts)
    for row, out, n in zip(idx, lists, counts, strict=True):
        assert out[:n].tolist() == sorted(set(row[row >= 0].tolist()))


def test_gather_row_spec_mask_is_the_listed_set():
    from refattn.kernels import gather_spec
    from refattn.spec import canonicalize

    q, k, v, idx = _sparse_case(2)
    spec = gather_spec(canonicalize(q, k, v, causal=True), idx)
    dense = canonicalize(q, k, v, causal=True, key_indices=idx)
    for b, h in ((0, 0), (1, 3)):
        sub = G.gather_row_spec(spec, b, h, 1, 4)
        assert np.array_equal(sub.allowed(0, 0), dense.allowed(b, h)[1:4])


def test_exact_gathers_only_where_the_engine_applies():
    from refattn._exact_sparse import GATHER_READING, exact_gathers
    from refattn.kernels import GATHER

    assert GATHER_READING == GATHER
    listed = (np.zeros((1, 1), np.int64), None, None)
    base = ["exact", "numpy", "set", listed, "softmax", None, "e"]

    def with_(slot, value):
        return [value if n == slot else x for n, x in enumerate(base)]

    assert exact_gathers(*base)
    assert not exact_gathers(*with_(5, np.zeros((1, 1))))  # a bias
    assert not exact_gathers(*with_(4, "sigmoid"))
    assert not exact_gathers(*with_(6, 2))
    assert not exact_gathers(*with_(2, "multiset"))
    assert not exact_gathers(*with_(3, (None, None, None)))
    saved = config.EXACT_SPARSE_KEYS
    config.EXACT_SPARSE_KEYS = "mask"
    try:
        assert not exact_gathers(*base)
    finally:
        config.EXACT_SPARSE_KEYS = saved


@pytest.mark.parametrize("seed", range(6))
def test_random_sparse_configurations(seed):
    """Random shapes, GQA groupings, list lengths (T below and above S) and options."""
    rng = np.random.default_rng(100 + seed)
    kv_heads = int(rng.integers(1, 3))
    heads = kv_heads * int(rng.integers(1, 4))
    keys, length, top = (int(x) for x in rng.integers(1, 30, 3))
    q, k, v, _ = _sparse_case(seed, heads=heads, kv_heads=kv_heads, length=length, keys=keys)
    idx = rng.integers(-2, keys + 3, (2, kv_heads, length, top))
    opts = {}
    if rng.random() < 0.5:
        opts["causal"] = True
        opts["align"] = str(rng.choice(["top_left", "bottom_right"]))
    if rng.random() < 0.3:
        opts["sinks"] = rng.standard_normal(heads)
    out_dtype = str(rng.choice(OUT_DTYPES))
    _assert_identical(
        q,
        k,
        v,
        key_indices=idx,
        out_dtype=out_dtype,
        return_lse=True,
        return_weights=bool(rng.random() < 0.5),
        **opts,
    )


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float64"])
def test_decode_and_prefill_steps_at_moderate_size(out_dtype):
    """A DSA-like decode step (GQA, every head one list) and a causal top-k prefill: many rows
    decided by each first step, the same bytes as the dense mask."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 8, 1, 72)).astype(np.float32)
    k = rng.standard_normal((1, 2, 3000, 72)).astype(np.float32)
    v = np.ascontiguousarray(k[..., :64])
    idx = np.stack([rng.permutation(3000)[:200] for _ in range(2)])[None, :, None, :]
    _assert_identical(q, k, v, key_indices=idx, out_dtype=out_dtype, return_lse=True, scale=0.2)
    q, k, v = (rng.standard_normal((1, h, 96, 16)).astype(np.float32) for h in (4, 1, 1))
    idx = np.full((96, 24), -1)
    for i in range(96):
        idx[i, : min(24, i + 1)] = rng.choice(i + 1, min(24, i + 1), replace=False)
    _assert_identical(q, k, v, key_indices=idx, out_dtype=out_dtype, causal=True, return_lse=True)


def test_gather_bits_do_not_depend_on_thread_count():
    """The same bytes with NUMBA_NUM_THREADS=1 and 2 (work items run in parallel)."""
    import hashlib
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import numpy as np, refattn, hashlib\n"
        "rng = np.random.default_rng(3)\n"
        "q, k, v = (rng.standard_normal(s).astype(np.float32) for s in "
        "((2, 4, 17, 24), (2, 2, 90, 24), (2, 2, 90, 8)))\n"
        "idx = rng.integers(-1, 95, (2, 2, 17, 30))\n"
        "h = hashlib.sha256()\n"
        "for od in ('float64', 'float32'):\n"
        "    for r in refattn.attention(q, k, v, key_indices=idx, precision='exact',\n"
        "                               out_dtype=od, causal=True, return_lse=True,\n"
        "                               return_weights=True, align='bottom_right'):\n"
        "        h.update(np.ascontiguousarray(r).tobytes())\n"
        "print(h.hexdigest())\n"
    )
    digests = []
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads, PYTHONPATH=str(root))
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        digests.append(done.stdout.split()[-1])
    assert digests[0] == digests[1]
    assert hashlib.sha256(b"").hexdigest() not in digests


def test_edge_shapes():
    """Empty lists (T = 0), one head without batch axes, unsigned indices, block lists."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal(s) for s in ((3, 4), (5, 4), (5, 2)))
    for listed in (
        {"key_indices": np.zeros((3, 0), np.int64)},
        {"key_indices": np.array([[0, 1], [4, 4], [-1, 9]])},
        {"key_indices": np.array([[0, 1], [4, 4], [3, 2]], np.uint8)},
        {"key_block_indices": np.array([[0], [1], [2]]), "key_block_size": 2},
    ):
        _assert_identical(q, k, v, return_lse=True, **listed)


def test_reused_work_arrays_hold_no_stale_keys():
    """Calls of one shape reuse the gathered tables: a later call listing fewer keys in some
    planes (stale columns left behind) gives the same bytes as the dense mask."""
    q, k, v, idx = _sparse_case(12, keys=40, top=48)
    idx[0, 0, :, :40] = np.arange(40)  # one plane lists every key: the tables' width is 40
    _assert_identical(q, k, v, key_indices=idx, out_dtype="float32", return_lse=True)
    table = G._SCRATCH.arrays["kT"]
    fewer = idx.copy()
    fewer[1] = np.where(np.arange(48) < 4, fewer[1], -1)
    q2, k2, v2, _ = _sparse_case(13, keys=40, top=48)
    _assert_identical(q2, k2, v2, key_indices=fewer, out_dtype="float32", return_weights=True)
    assert G._SCRATCH.arrays["kT"] is table


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_sum_blocks_with_keys_below_the_cut_match(out_dtype):
    """Scores spread over more than -CUT (some keys' terms below the cut, others not, in the
    same sum block) take the key-by-key loop of their blocks, the rest the branch-free one:
    the same bytes as the dense mask."""
    rng = np.random.default_rng(11)
    q = (300.0 * rng.standard_normal((1, 4, 1, 16))).astype(np.float32)
    k = rng.standard_normal((1, 2, 300, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 300, 8)).astype(np.float32)
    idx = np.stack([rng.permutation(300)[:200] for _ in range(2)])[None, :, None, :]
    _assert_identical(q, k, v, key_indices=idx, out_dtype=out_dtype, return_lse=True)
    _assert_identical(q, k, v, key_indices=idx, out_dtype=out_dtype)
