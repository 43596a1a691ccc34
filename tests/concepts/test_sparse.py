"""Sparse key selection (``key_indices``, ``key_block_indices``, ``index_reading``) on every
path: exact bit for bit against the loop twin (tests/naive/sparse.py) with causal, window,
kv_lengths, a mask, GQA, sinks and empty rows; blocks equal to their expanded tokens; float64
and Numba inside their bounds; the exact vjp against the twin's closed form and central
differences; errors that name the argument."""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from oracle.judging.tolerance import ulp
from refattn.bounds import float64_forward_bound, float64_vjp_bound
from tests.concepts.test_option_combinations import _twin_grads
from tests.helpers import assert_same_bits, assert_within
from tests.naive.attention import score_spread
from tests.naive.rounding import round_stable
from tests.naive.sparse import (
    block_tokens,
    gathered_row_problem,
    naive_sparse_attention,
    naive_sparse_rounded,
    set_mask,
)

DTYPES = ["float64", "float32", "float16", "bfloat16"]
BATCH, HEADS, LENGTH, KEYS, DIM, VDIM, SLOTS = 2, 2, 3, 6, 4, 3, 4

OPTION_SETS = [
    {},
    {"causal": True},
    {"causal": True, "align": "bottom_right"},
    {"window": (1, 1)},
    {"gqa": "tile"},
    {"softcap": 2.0, "causal": True},
]


def _problem(seed, kv_heads):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, HEADS, LENGTH, DIM))
    k = rng.standard_normal((BATCH, kv_heads, KEYS, DIM))
    v = rng.standard_normal((BATCH, kv_heads, KEYS, VDIM))
    # sentinels (-1, -2), past-the-end entries (S, S + 1) and duplicates, one empty row
    idx = rng.integers(-2, KEYS + 2, size=(BATCH, kv_heads, LENGTH, SLOTS)).astype(np.int32)
    idx[..., 1] = idx[..., 0]
    idx[0, 0, 1] = -1
    return q, k, v, idx, rng


def _extra(rng, extras):
    opts = {}
    if "sinks" in extras:
        opts["sinks"] = rng.standard_normal(HEADS)
    if "kv_lengths" in extras:
        opts["kv_lengths"] = rng.integers(0, KEYS + 1, size=BATCH)
    if "mask" in extras:
        opts["mask"] = rng.random((BATCH, HEADS, LENGTH, KEYS)) < 0.7
    if "bias" in extras:
        bias = rng.standard_normal((BATCH, HEADS, LENGTH, KEYS))
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        opts["bias"] = bias
    return opts


def _row(opts, b):
    row = {n: x for n, x in opts.items() if n != "kv_lengths"}
    if "kv_lengths" in opts:
        row["kv_length"] = int(opts["kv_lengths"][b])
    for name in ("bias", "mask"):
        if name in row:
            row[name] = row[name][b]
    return row


CASES = dict(
    seed=st.integers(0, 2**16),
    options=st.sampled_from(OPTION_SETS),
    dtype=st.sampled_from(DTYPES),
    kv_heads=st.sampled_from([1, 2]),
    reading=st.sampled_from(["set", "multiset"]),
    extras=st.sets(st.sampled_from(["sinks", "kv_lengths", "mask", "bias", "nan_rows"])),
)


def _check_exact(seed, options, dtype, kv_heads, reading, extras):
    q, k, v, idx, rng = _problem(seed, kv_heads)
    opts = {**options, **_extra(rng, extras)}
    if "nan_rows" in extras:
        opts["empty_rows"] = "nan"
    got = refattn.attention(
        q,
        k,
        v,
        **opts,
        key_indices=idx,
        index_reading=reading,
        return_lse=True,
        precision="exact",
        out_dtype=dtype,
    )
    want = [
        np.stack(x)
        for x in zip(
            *(
                naive_sparse_rounded(q[b], k[b], v[b], idx[b], _row(opts, b), dtype, reading)[:2]
                for b in range(BATCH)
            ),
            strict=True,
        )
    ]
    case = f"{options} {sorted(extras)} K={kv_heads} {reading} {dtype}"
    for name, value, truth in zip(("out", "lse"), got, want, strict=True):
        assert_same_bits(value, truth, what=name, case=case)


@settings(max_examples=3, deadline=None)
@given(**CASES)
def test_exact_matches_loop_twin(seed, options, dtype, kv_heads, reading, extras):
    """Both readings with sentinels, duplicates, past-the-end entries and an empty row, every
    option combination: out and lse bit for bit."""
    _check_exact(seed, options, dtype, kv_heads, reading, extras)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(**CASES)
def test_exact_matches_loop_twin_more(seed, options, dtype, kv_heads, reading, extras):
    _check_exact(seed, options, dtype, kv_heads, reading, extras)


def test_set_reading_weights_match_twin():
    q, k, v, idx, rng = _problem(3, 1)
    opts = {"causal": True, "kv_lengths": np.array([4, 6])}
    _, _, weights = refattn.attention(
        q, k, v, **opts, key_indices=idx, return_lse=True, return_weights=True, precision="exact"
    )
    for b in range(BATCH):
        want = naive_sparse_rounded(q[b], k[b], v[b], idx[b], _row(opts, b), "float64")[2]
        assert_same_bits(weights[b], np.asarray(want, np.float64), what="weights", case=f"b={b}")


@pytest.mark.parametrize("reading", ["set", "multiset"])
def test_blocks_equal_their_expanded_tokens(reading):
    """key_block_indices with key_block_size s is key_indices listing every token of the
    chosen blocks (clipped to S; invalid blocks ignored), on the exact path, bit for bit, and
    the twin's expansion by loops agrees with refattn's."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, 5, 4))
    k, v = rng.standard_normal((1, 1, 7, 4)), rng.standard_normal((1, 1, 7, 2))
    blocks = rng.integers(-1, 5, size=(1, 1, 5, 3))  # blocks of 3 over S=7: 0..2 valid
    tokens = block_tokens(blocks, 3, 7)
    kw = dict(causal=True, return_lse=True, precision="exact", index_reading=reading)
    by_block = refattn.attention(q, k, v, key_block_indices=blocks, key_block_size=3, **kw)
    by_token = refattn.attention(q, k, v, key_indices=tokens, **kw)
    for name, a, b in zip(("out", "lse"), by_block, by_token, strict=True):
        assert_same_bits(a, b, what=name, case=reading)
    from refattn.sparse_indices import expand_blocks

    np.testing.assert_array_equal(expand_blocks(blocks, 3, 7), tokens)


def test_no_valid_index_follows_empty_rows():
    q, k, v, idx, _ = _problem(1, 1)
    idx[:] = -1
    idx[0, 0, 0, 0] = KEYS  # past the end: ignored too
    for policy, lse in (("zero", -np.inf), ("nan", np.nan)):
        out, got = refattn.attention(q, k, v, key_indices=idx, empty_rows=policy, return_lse=True)
        np.testing.assert_array_equal(got, np.full(got.shape, lse))
    sinks = np.array([0.5, -1.0])
    out, got = refattn.attention(q, k, v, key_indices=idx, sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(got, np.broadcast_to(sinks[:, None], got.shape))
    np.testing.assert_array_equal(out, np.zeros_like(out))


@pytest.mark.parametrize("reading", ["set", "multiset"])
@pytest.mark.parametrize("options", OPTION_SETS[:3], ids=str)
def test_float64_inside_its_bound(options, reading):
    """Set: refattn's float64 bound of the call (the set is part of its mask). Multiset: the
    bound of the gathered call (the twin's gather), row by row."""
    q, k, v, idx, rng = _problem(11, 2)
    opts = {**options, **_extra(rng, {"bias", "sinks"})}
    got_out, got_lse = refattn.attention(
        q, k, v, **opts, key_indices=idx, index_reading=reading, return_lse=True
    )
    out, lse = refattn.attention(
        q, k, v, **opts, key_indices=idx, index_reading=reading, return_lse=True, precision="exact"
    )
    if reading == "set":
        out_bound, lse_bound = float64_forward_bound(q, k, v, **opts, key_indices=idx)
    else:
        out_bound, lse_bound = _gathered_bounds(q, k, v, idx, opts)
    assert_within(got_out, out, out_bound, what="out", case=f"{options} {reading}")
    assert_within(got_lse, lse, lse_bound, what="lse", case=f"{options} {reading}")


def _gathered_bounds(q, k, v, idx, opts):
    out_bound = np.zeros((BATCH, HEADS, LENGTH, VDIM))
    lse_bound = np.zeros((BATCH, HEADS, LENGTH))
    for b in range(BATCH):
        for i in range(LENGTH):
            row = _row(opts, b)
            qi, ki, vi, gathered = gathered_row_problem(q[b], k[b], v[b], idx[b], i, row)
            ob, lb = float64_forward_bound(qi, ki, vi, **gathered)
            out_bound[b, :, i], lse_bound[b, :, i] = ob[:, 0], lb[:, 0]
    return out_bound, lse_bound


@pytest.mark.parametrize("reading", ["set", "multiset"])
def test_numba_agrees_within_bound(reading):
    """The Numba kernels read the set through the folded mask (and the multiset through the
    gather): inside the float64 bound of the same call (the kernels' own bound is tighter
    than twice it for these sizes)."""
    q, k, v, idx, rng = _problem(13, 2)
    opts = {"causal": True, "align": "bottom_right", **_extra(rng, {"kv_lengths", "sinks"})}
    kw = dict(key_indices=idx, index_reading=reading, return_lse=True)
    got_out, got_lse = refattn.attention(q, k, v, **opts, **kw, backend="numba")
    out, lse = refattn.attention(q, k, v, **opts, **kw, precision="exact")
    if reading == "set":
        out_bound, lse_bound = float64_forward_bound(q, k, v, **opts, key_indices=idx)
    else:
        out_bound, lse_bound = _gathered_bounds(q, k, v, idx, opts)
    assert_within(got_out, out, 2 * out_bound, what="out", case=reading)
    assert_within(got_lse, lse, 2 * lse_bound, what="lse", case=reading)
    grad_out = rng.standard_normal(out.shape)
    fast = refattn.attention_vjp(q, k, v, grad_out, **opts, key_indices=idx, backend="numba")
    f64 = refattn.attention_vjp(q, k, v, grad_out, **opts, key_indices=idx)
    exact = refattn.attention_vjp(q, k, v, grad_out, **opts, key_indices=idx, precision="exact")
    bounds = float64_vjp_bound(q, k, v, grad_out, **opts, key_indices=idx)
    for name, bound in zip(("dq", "dk", "dv"), bounds[:3], strict=True):
        assert_within(getattr(f64, name), getattr(exact, name), bound, what=name, case="f64")
        assert_within(getattr(fast, name), getattr(exact, name), 2 * bound, what=name, case="nb")


VJP_CASES = dict(
    seed=st.integers(0, 2**16),
    options=st.sampled_from(OPTION_SETS[:4]),
    dtype=st.sampled_from(DTYPES),
    extras=st.sets(st.sampled_from(["sinks", "kv_lengths", "mask"])),
)


def _check_vjp(seed, options, dtype, extras):
    from tests.concepts import test_option_combinations as combos

    q, k, v, idx, rng = _problem(seed, 1)
    opts = {**options, **_extra(rng, extras)}
    listed = np.stack([set_mask(idx[b], HEADS, KEYS) for b in range(BATCH)])
    twin_opts = {**opts, "mask": listed & opts.get("mask", True)}
    grad_out = rng.standard_normal((BATCH, HEADS, LENGTH, VDIM))
    grad_lse = rng.standard_normal((BATCH, HEADS, LENGTH))
    got = refattn.attention_vjp(
        q,
        k,
        v,
        grad_out,
        grad_lse=grad_lse,
        **opts,
        key_indices=idx,
        precision="exact",
        out_dtype=dtype,
    )
    assert combos.BATCH == BATCH and combos.HEADS == HEADS and combos.KEYS == KEYS
    spread = score_spread(q, k, **opts)
    want = round_stable(
        lambda dps: _twin_grads(q, k, v, grad_out, grad_lse, twin_opts, None, dps), dtype, spread
    )
    at = 0
    for name in ["dq", "dk", "dv"] + (["dsinks"] if "sinks" in opts else []):
        value = np.asarray(getattr(got, name), np.float64)
        truth = want[at : at + value.size].reshape(value.shape)
        assert_same_bits(value, truth, what=name, case=f"{options} {sorted(extras)} {dtype}")
        at += value.size


@settings(max_examples=2, deadline=None)
@given(**VJP_CASES)
def test_exact_vjp_matches_twin(seed, options, dtype, extras):
    """dq, dk, dv (and dsinks) of the set reading bit for bit against the twin's closed form
    with the twin's index mask."""
    _check_vjp(seed, options, dtype, extras)


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(**VJP_CASES)
def test_exact_vjp_matches_twin_more(seed, options, dtype, extras):
    _check_vjp(seed, options, dtype, extras)


STEP = mpmath.mpf(2) ** -40


def _objective(arrays, idx, do, opts, reading):
    out, _, _ = naive_sparse_attention(
        arrays["q"], arrays["k"], arrays["v"], idx, reading=reading, dps=50, **opts
    )
    return mpmath.fsum(
        x * do[h, i, e]
        for h, rows in enumerate(out)
        for i, row in enumerate(rows)
        for e, x in enumerate(row)
    )


def _central(arrays, name, idx, do, opts, reading):
    base = arrays[name]
    grad, err = np.zeros(base.shape), np.zeros(base.shape)
    with mpmath.workdps(50):
        for index in np.ndindex(base.shape):
            estimates = []
            for step in (STEP, 2 * STEP):
                values = []
                for sign in (1, -1):
                    moved = {n: a.copy() for n, a in arrays.items()}
                    moved[name][index] = mpmath.mpf(float(base[index])) + sign * step
                    values.append(_objective(moved, idx, do, opts, reading))
                estimates.append((values[0] - values[1]) / (2 * step))
            grad[index] = float(estimates[0])
            err[index] = float(abs(estimates[1] - estimates[0]))
    return grad, err


@pytest.mark.parametrize("reading", ["set", "multiset"])
def test_vjp_matches_central_differences(reading):
    """Set: the exact vjp within half an ulp (plus the Richardson estimate) of the central
    differences of the twin. Multiset (no exact vjp): the float64 vjp within the summed
    float64 bounds of the gathered calls plus the same."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 2, 2))
    k, v = rng.standard_normal((1, 3, 2)), rng.standard_normal((1, 3, 2))
    idx = np.array([[[2, 0, 0], [1, -1, 1]]])
    do = rng.standard_normal((2, 2, 2))
    opts = {"causal": True, "align": "bottom_right"}
    arrays = {"q": q.astype(object), "k": k.astype(object), "v": v.astype(object)}
    if reading == "set":
        grads = refattn.attention_vjp(q, k, v, do, **opts, key_indices=idx, precision="exact")
        slack = [np.zeros(x.shape) for x in grads[:3]]
    else:
        grads = refattn.attention_vjp(q, k, v, do, **opts, key_indices=idx, index_reading=reading)
        slack = [np.zeros(x.shape) for x in grads[:3]]
        for i in range(2):
            qi, ki, vi, row = gathered_row_problem(q, k, v, idx, i, opts)
            bq, bk, bv, _ = float64_vjp_bound(qi, ki, vi, do[:, i : i + 1], **row)
            slack[0][:, i : i + 1] += bq
            for t, j in enumerate(idx[0, i]):
                if 0 <= j < 3:
                    slack[1][0, j] += bk[0, t]
                    slack[2][0, j] += bv[0, t]
    for n, (label, value) in enumerate(zip(("q", "k", "v"), grads[:3], strict=True)):
        fd, richardson = _central(arrays, label, idx, do, opts, reading)
        bound = 0.5 * ulp(fd, "float64") + 2 * richardson + slack[n]
        assert_within(value, fd, bound, what=f"d{label}", case=reading)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (dict(key_indices=np.ones((3, 2))), TypeError, "key_indices: expected an integer"),
        (dict(key_indices=np.ones((4, 2), int)), ValueError, "not broadcastable"),
        (dict(key_block_indices=[[0]]), ValueError, "needs key_block_size"),
        (dict(key_block_indices=[[0]], key_block_size=0), ValueError, "key_block_size"),
        (dict(key_block_indices=[[0]], key_block_size=1.5), TypeError, "key_block_size"),
        (dict(key_block_size=2), ValueError, "without key_block_indices"),
        (dict(key_indices=[[0]], key_block_indices=[[0]], key_block_size=1), ValueError, "one"),
        (dict(key_indices=[[0]], index_reading="bag"), ValueError, "index_reading"),
        (dict(key_indices=np.array([[True]])), TypeError, "key_indices"),
    ],
)
def test_bad_indices_are_named(kwargs, error, words):
    q, k, v = np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 1))
    with pytest.raises(error, match=words):
        refattn.attention(q, k, v, **kwargs)


def test_exact_multiset_refuses_what_it_cannot_round_once():
    q, k, v = np.ones((1, 2)), np.ones((2, 2)), np.ones((2, 1))
    kw = dict(key_indices=[[0, 0]], index_reading="multiset", precision="exact")
    with pytest.raises(NotImplementedError, match="return_weights"):
        refattn.attention(q, k, v, **kw, return_weights=True)
    with pytest.raises(NotImplementedError, match="attention_vjp"):
        refattn.attention_vjp(q, k, v, np.ones((1, 1)), **kw)


def test_decode_at_65536_keys_stays_small():
    """A decode step over S = 65536 keys with K = 1 builds one (1, 1, 1, S) plane (broadcast
    over the heads), not an (H, L, S) one."""
    from refattn.spec import canonicalize

    q = np.zeros((1, 8, 1, 4))
    k, v = np.zeros((1, 1, 65536, 4)), np.zeros((1, 1, 65536, 2))
    idx = np.arange(0, 65536, 32)[None, None, None]
    spec = canonicalize(q, k, v, key_indices=idx)
    assert spec.mask.base is not None and 0 in spec.mask.strides[:2]
    assert int(spec.mask[0, 0, 0].sum()) == 2048
