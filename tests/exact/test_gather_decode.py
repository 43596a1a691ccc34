"""The decode path of the fast exact gather (refattn.exact.fast.gather): the double-precision
step reads the listed keys from their own rows (no gathered float64 key table) and forms their
facts in the same pass, its N sums run branch-free on masked weights, and the results are the
referee's bits, whatever the thread count; bad keys and values still go to the referee."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import refattn
from refattn import config
from refattn.exact.fast import fallback_stats
from refattn.exact.fast import gather as G
from refattn.exact.fast import gather_kernels as GK
from refattn.exact.fast import gather_lanes as GL
from refattn.exact.fast.facts import row_facts, row_facts_serial
from refattn.exact.fast.forward import kernel_params
from tests.helpers import digest_with_threads

# The lanes' pure-Python twins (NUMBA_DISABLE_JIT=1) do not fuse the fma: bits are compiled-only.
pytestmark = pytest.mark.skipif(
    numba.config.DISABLE_JIT, reason="bit equality holds for the compiled loops only"
)


def _bits_equal(a, b):
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dim,count,heads", [(576, 21, 9), (40, 16, 4), (33, 5, 1)])
def test_source_dots_are_the_scalar_chains_and_the_key_facts(dtype, dim, count, heads):
    """Dot products and magnitude sums of the blocked scalar chains (rows with and without a
    zero feature, a last part panel), and the keys' range checks and exactness scales of
    row_facts on the widened rows."""
    rng = np.random.default_rng(dim + count)
    src = (rng.standard_normal((60, dim)) * 2.0 ** rng.integers(-20, 20, (60, dim))).astype(dtype)
    src[3] = 0.0
    src[4, 1] = np.nan
    src[8, 2] = np.finfo(dtype).tiny / 4  # subnormal
    used = np.sort(np.r_[[3, 4, 8], rng.permutation(np.arange(9, 60))[: count - 3]])
    cols = np.arange(count)
    q = rng.standard_normal((1, heads, 1, dim))
    q[0, heads // 2, 0, ::7] = 0.0  # one group of four rows has zero features
    rows = src[used].astype(np.float64)
    want_s, want_ab = np.zeros((heads, count)), np.zeros((heads, count))
    GK._blocked_dots(q[0], np.arange(heads), heads, 0, rows.T.copy(), 0, 0, want_s, want_ab)
    s, ab = np.zeros((heads, count)), np.zeros((heads, count))
    ok, scales = np.zeros(count, bool), np.zeros(count)
    qh = np.ascontiguousarray(q[0, :, 0])
    GL.source_dots(qh, src, used, cols, GK.DOT_BLOCK, s, ab, (ok, scales))
    finite = np.isfinite(rows).all(axis=1)
    assert _bits_equal(s[:, finite], want_s[:, finite])
    assert _bits_equal(ab[:, finite], want_ab[:, finite])
    want = (np.empty(count), np.empty(count), np.empty(count, bool))
    row_facts(rows, rows.view(np.int64), want[0], want[1], want[2])
    assert _bits_equal(ok, want[2]) and _bits_equal(scales, want[1])
    assert not ok[1]  # the NaN key


@pytest.mark.parametrize("vdim,rows", [(512, 16), (45, 9), (20, 3)])
def test_sums_rows_on_masked_weights_keep_the_bits(vdim, rows):
    """Eight rows branch-free with unused weights at +0: the bits of the loop that skips the
    unused keys (negative zeros and underflowing products included)."""
    rng = np.random.default_rng(vdim + rows)
    nb = 70
    vp = rng.standard_normal((90, vdim))
    vp[5] = -0.0
    vp[6, ::2] = 2.0**-1000
    cols = rng.permutation(90)[:nb]
    cols[:2] = (5, 6)
    wts = rng.random((rows, nb)) * 2.0 ** rng.integers(-80, 2, (rows, nb))
    wts[:, 1] = 2.0**-70  # products below the subnormal range
    use = rng.random((rows, nb)) > 0.3
    use[0] = False
    got = np.zeros((rows, vdim))
    GL.sums_rows(vp, cols, 3, nb, rows, wts, use, got)
    want = np.zeros((rows, vdim))
    whole = vdim - vdim % GL.W
    for r in range(rows):  # the loop that skips the unused keys, lane-wise (its bits)
        for e in range(0, whole, GL.W):
            GL._sums1(vp, cols, 3, nb, wts[r], use[r], e, want[r])
    assert _bits_equal(got[:, :whole], want[:, :whole])


def _decode(seed, *, heads=16, kv_heads=2, keys=70, top=24, dim=40, vdim=24, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, heads, 1, dim)).astype(dtype)
    k = rng.standard_normal((1, kv_heads, keys, dim)).astype(dtype)
    v = rng.standard_normal((1, kv_heads, keys, vdim)).astype(dtype)
    idx = np.stack([rng.permutation(keys)[:top] for _ in range(kv_heads)])[None, :, None, :]
    return q, k, v, idx


def _exact(q, k, v, idx, engine="fast", **opts):
    saved = config.EXACT_ENGINE
    config.EXACT_ENGINE = engine
    try:
        out = refattn.attention(q, k, v, key_indices=idx, precision="exact", **opts)
        return out, dict(fallback_stats()) if engine == "fast" else None
    finally:
        config.EXACT_ENGINE = saved


@pytest.mark.parametrize("case", ["plain", "nan_key", "inf_value", "zero_key", "float16"])
def test_decode_step_is_the_referee_and_bad_rows_go_to_it(case):
    """A float32 decode step (the double-precision step, items of several heads) gives the
    referee's bits; a listed NaN key or Inf value sends its kv-head plane's rows to the
    referee, an unlisted one is never read."""
    q, k, v, idx = _decode(7, dtype=np.float16 if case == "float16" else np.float32)
    listed = idx[0, 0, 0]
    if case == "nan_key":
        k[0, 0, listed[3], 2] = np.nan
        k[0, 1, np.setdiff1d(np.arange(k.shape[2]), idx[0, 1, 0])[0], 0] = np.nan
    elif case == "inf_value":
        v[0, 1, idx[0, 1, 0, 5], 1] = np.inf
    elif case == "zero_key":
        k[0, 0, listed[1]] = 0.0
    got, stats = _exact(q, k, v, idx, out_dtype="float32")
    want, _ = _exact(q, k, v, idx, engine="referee", out_dtype="float32")
    assert got.dtype == want.dtype and _bits_equal(got, want)
    bad_planes = {"nan_key": 1, "inf_value": 1}.get(case, 0)
    assert stats["referee_rows"] == bad_planes * 8  # eight query heads per kv head
    assert stats["double_rows"] == 16 - bad_planes * 8


def test_decode_bits_do_not_depend_on_thread_count():
    """A decode step whose heads split into two work items at two threads: the same bytes
    with NUMBA_NUM_THREADS=1 and 2."""
    code = (
        "import numpy as np, refattn, hashlib\n"
        "rng = np.random.default_rng(5)\n"
        "q, k, v = (rng.standard_normal(s).astype(np.float32) for s in "
        "((1, 32, 1, 64), (1, 1, 300, 64), (1, 1, 300, 48)))\n"
        "idx = rng.permutation(300)[None, None, None, :101]\n"
        "out = refattn.attention(q, k, v, key_indices=idx, precision='exact',\n"
        "                        out_dtype='float32')\n"
        "print(hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest())\n"
    )
    assert digest_with_threads(code, 1) == digest_with_threads(code, 2)


def test_kept_kernel_parameters_are_fresh_copies():
    """The parameters kept per value equal kernel_params' and are the caller's to change."""
    from refattn.kernels import gather_spec
    from refattn.spec import canonicalize

    q, k, v, idx = _decode(2, heads=4, kv_heads=1)
    spec = gather_spec(canonicalize(q, k, v, scale=0.3), idx)
    first, ok = G._kernel_params(spec)
    want, want_ok = kernel_params(spec)
    assert _bits_equal(first, want) and _bits_equal(ok, want_ok)
    first[...] = np.nan
    again, _ = G._kernel_params(spec)
    assert _bits_equal(again, want)


def test_serial_twins_of_the_small_passes_keep_the_bits():
    """The thread-free compiles of compact_lists and row_facts (the small passes of a decode
    step) give the parallel ones' results; every thread-free twin has a cache name of its own
    (the cache keys a function by its name and argument types: sharing the threaded one's,
    each would load whichever machine code was saved first)."""
    twins = [
        (GK.compact_lists, GK.compact_lists_serial),
        (GK.gather_d, GK.gather_d_serial),
        (GK.decode_dots, GK.decode_dots_serial),
        (row_facts, row_facts_serial),
    ]
    for threaded, twin in twins:
        assert twin.py_func.__qualname__ == threaded.py_func.__qualname__ + "_serial"
        assert twin.py_func.__code__ is threaded.py_func.__code__
    rng = np.random.default_rng(11)
    idx = rng.integers(-1, 50, (6, 33))
    got = (np.zeros_like(idx), np.zeros(6, np.int64))
    want = (np.zeros_like(idx), np.zeros(6, np.int64))
    GK.compact_lists_serial(idx, *got)
    GK.compact_lists(idx, *want)
    assert all(_bits_equal(g, w) for g, w in zip(got, want, strict=True))
    x = rng.standard_normal((7, 29)) * 2.0 ** rng.integers(-40, 40, (7, 29))
    x[2, 3] = np.inf
    got = (np.empty(7), np.empty(7), np.empty(7, bool))
    want = (np.empty(7), np.empty(7), np.empty(7, bool))
    row_facts_serial(x, x.view(np.int64), *got)
    row_facts(x, x.view(np.int64), *want)
    assert all(_bits_equal(g, w) for g, w in zip(got, want, strict=True))


def test_decode_spans_form_the_one_pass_bits(monkeypatch):
    """The decode pass by spans of DECODE_SPAN columns (three spans, the last a part one),
    that a parallel decode step runs: each query head's dot products and magnitude sums, the
    keys' checks and scales, and the gathered values with their maxima are those of one pass
    over all the keys; a NaN value in the last span flags its plane (its maxima skip it, as
    value_rows does)."""
    from refattn.kernels import gather_spec
    from refattn.spec import canonicalize

    monkeypatch.setattr(G, "SERIAL_WORK", 0)  # the step of a large decode: in parallel

    count = 2 * G.DECODE_SPAN + 34
    q, k, v, idx = _decode(4, heads=9, kv_heads=1, keys=count + 20, top=count, vdim=20)
    u = np.sort(idx[0, 0, 0])
    for bad in (False, True):
        if bad:
            v[0, 0, u[-3], 7] = np.nan
        x = G._Gathered(gather_spec(canonicalize(q, k, v), idx), fused=True)
        assert x.fused and x.decode and x.source[4].shape == (1, 1, 9, count)
        fs, fab, fks = (a[0, 0] for a in x.source[4:7])
        s, ab = np.zeros((9, count)), np.zeros((9, count))
        ok, scales = np.zeros(count, bool), np.zeros(count)
        qh = np.ascontiguousarray(q[0, :, 0], dtype=np.float64)
        GL.source_dots(qh, k[0, 0], u, np.arange(count), GK.DOT_BLOCK, s, ab, (ok, scales))
        assert _bits_equal(fs, s) and _bits_equal(fab, ab) and _bits_equal(fks, scales)
        vals, vmax = np.zeros((count, v.shape[-1])), np.zeros(v.shape[-1])
        assert GL.value_rows(v[0, 0], u, vals, vmax) != bad
        assert _bits_equal(x.v[0, 0, :count], vals) and _bits_equal(x.vmax[0, 0], vmax)
        assert bool(x.ok.all()) != bad


def test_decode_steps_serial_and_by_spans_give_the_mask_engines_bits(monkeypatch):
    """A float32 decode step with more listed keys than DECODE_SPAN on two kv heads of three
    query heads each (part spans, a head row outside the four-row tiles) gives the bits of
    the dense-mask engine on the calling thread alone (a small step: the thread-free
    compile), by spans (SERIAL_WORK 0) with the items after the pass, and by parallel items
    that form their own panels (SERIAL_ITEMS 0: a large step), at one thread (the pass's
    thread-free compile, serial items) and at two threads (both in parallel)."""
    q, k, v, idx = _decode(9, heads=6, kv_heads=2, keys=400, top=G.DECODE_SPAN + 77)
    idx[0, 1, 0, -40:] = -1  # the second plane lists fewer keys
    # the pass in parallel whenever Numba has two threads, however the machine's load
    monkeypatch.setattr(G._PACE, "serial", lambda: numba.get_num_threads() == 1)
    saved, threads = config.EXACT_SPARSE_KEYS, numba.get_num_threads()
    try:
        config.EXACT_SPARSE_KEYS = "mask"
        want, _ = _exact(q, k, v, idx, out_dtype="float32", return_lse=True)
        config.EXACT_SPARSE_KEYS = "gather"
        got, stats = _exact(q, k, v, idx, out_dtype="float32", return_lse=True)
        assert all(_bits_equal(g, w) for g, w in zip(got, want, strict=True))
        assert stats["double_rows"] == 6
        monkeypatch.setattr(G, "SERIAL_WORK", 0)
        for items in (G.SERIAL_ITEMS, 0):  # the pass, then items; parallel items alone
            monkeypatch.setattr(G, "SERIAL_ITEMS", items)
            for count in sorted({1, threads}):
                numba.set_num_threads(count)
                got, _ = _exact(q, k, v, idx, out_dtype="float32", return_lse=True)
                assert all(_bits_equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        config.EXACT_SPARSE_KEYS = saved
        numba.set_num_threads(threads)


def test_kept_setup_is_the_setups_own():
    """The allowed-set rule, kernel parameters and decode-pass layout kept per shape are what
    the setup forms afresh for every spec they are kept for (a changed scale, causal flag,
    window or alignment is another entry, never a stale one)."""
    from refattn.exact.fast.allowed_set import allowed_rule
    from refattn.spec import canonicalize

    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((2, 4, 3, 6)), rng.standard_normal((2, 2, 9, 6))
    v = rng.standard_normal((2, 2, 9, 5))
    calls = [
        dict(scale=0.5),
        dict(scale=0.25),
        dict(),
        dict(causal=True),
        dict(causal=True, align="bottom_right"),
        dict(window=(2, 1)),
        dict(softcap=3.0),
    ]
    for _ in range(2):  # the second round reads what the first kept
        for opts in calls:
            spec = canonicalize(q, k, v, **opts)
            got, want = G._allowed_rule(spec), allowed_rule(spec)
            assert all(_bits_equal(g, w) for g, w in zip(got, want, strict=True)), opts
            got, want = G._kernel_params(spec), kernel_params(spec)
            assert all(_bits_equal(g, w) for g, w in zip(got, want, strict=True)), opts
    kv_head = np.array([0, 0, 1, 1, 1])
    group, place, tasks, starts = G._decode_layout(kv_head, 2, (0, G.DECODE_SPAN + 3, 5, 0))
    assert group.tolist() == [[0, 1, -1], [2, 3, 4]] and place.tolist() == [0, 1, 0, 1, 2]
    span = G.DECODE_SPAN
    assert tasks.tolist() == [[0, 1, 0, span, 0], [0, 1, span, span + 3, 1], [1, 0, 0, 5, 2]]
    assert starts.tolist() == [0, 2]


def test_decode_pass_keeps_to_the_calling_thread_while_parallel_passes_are_slower(
    monkeypatch,
):
    """The decode pass's route (gather._Pace): thread-free first (to time it), then in
    parallel while a parallel pass is no slower per multiply-add than the fastest thread-free
    one; after a slower one, thread-free for CONTENDED_HOLD seconds."""
    clock = [100.0]
    monkeypatch.setattr(G.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(G.numba, "get_num_threads", lambda: 2)
    pace = G._Pace()
    assert pace.serial()  # nothing timed yet
    pace.record(True, 2e-9)
    assert not pace.serial()
    pace.record(False, 1e-9)  # twice as fast in parallel: stays parallel
    assert not pace.serial()
    pace.record(False, 3e-9)  # slower than the thread-free pass: a busy core
    assert pace.serial()
    clock[0] += G.CONTENDED_HOLD / 2
    assert pace.serial()
    clock[0] += G.CONTENDED_HOLD
    assert not pace.serial()
    monkeypatch.setattr(G.numba, "get_num_threads", lambda: 1)
    assert pace.serial()
