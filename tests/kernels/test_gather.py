"""The sparse-key gather forward of the Numba CPU kernels (refattn.kernels._cpu_gather).

``refattn.attention(..., key_indices=..., backend="numba")`` (set reading) gathers each row's
listed keys instead of ANDing them into a dense mask. It must agree with the float64 NumPy path
within the kernels' a-priori bound (the reduction order differs from the dense kernels', so not
bit for bit), read the set as refattn pins it (duplicates once, -1 and out-of-range ignored,
intersected with causal, window, mask and -inf bias), keep NaN/Inf at unlisted keys out of the
output, and give the same bits for any thread count; the same for the vjp.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import refattn
from refattn.kernels import gather_spec, numba_cpu
from refattn.spec import canonicalize
from tests.helpers import assert_same_bits, assert_within


def _inputs(seed, *, heads=4, kv_heads=2, length=5, keys=150, dim=8, vdim=6, width=40):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, heads, length, dim))
    k = rng.standard_normal((2, kv_heads, keys, dim))
    v = rng.standard_normal((2, kv_heads, keys, vdim))
    # -1 sentinels, repeats and entries past S: the set reading ignores / merges them
    idx = rng.integers(-3, keys + 5, size=(2, kv_heads, length, width))
    return q, k, v, idx, rng


CASES = {
    "plain": {},
    "causal": {"causal": True, "align": "bottom_right"},
    "window": {"window": (40, 3), "align": "bottom_right"},
    "softcap_alibi": {"softcap": 3.0, "alibi_slopes": np.array([0.5, 0.25, 0.1, 0.05])},
    "mask_bias": "mask_bias",
    "dropout": "dropout",
    "nan_rows": {"causal": True, "empty_rows": "nan"},
}


def _options(name, rng, heads=4, length=5, keys=150):
    opts = CASES[name]
    if opts == "mask_bias":
        bias = rng.standard_normal((2, heads, length, keys))
        bias[..., ::7] = -np.inf
        return {"mask": rng.random((2, heads, length, keys)) < 0.7, "bias": bias}
    if opts == "dropout":
        return {"dropout_mask": rng.random((2, heads, length, keys)) < 0.8, "dropout_p": 0.2}
    return opts


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", list(CASES))
def test_gather_matches_float64(name, dtype):
    q, k, v, idx, rng = _inputs(len(name))
    opts = _options(name, rng)
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    out, lse = refattn.attention(q, k, v, key_indices=idx, return_lse=True, backend="numba", **opts)
    ref_out, ref_lse, weights = refattn.attention(
        q, k, v, key_indices=idx, return_lse=True, return_weights=True, **opts
    )
    spec = canonicalize(q, k, v, key_indices=idx, **opts)
    ct = refattn.kernels.compute_dtype(dtype)
    kernel = numba_cpu.forward_error_bound(spec, weights, ct)
    own = numba_cpu.forward_error_bound(spec, weights, np.float64)
    assert out.dtype == ct
    assert_within(out, ref_out, kernel[0] + own[0], what="out", case=name)
    assert_within(lse, ref_lse, kernel[1] + own[1], what="lse", case=name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", ["plain", "causal", "softcap_alibi", "mask_bias", "dropout"])
def test_gather_vjp_matches_float64(name, dtype):
    """In float32 too: the kernel computes every step in the compute dtype (it once mixed
    float64 constants into float32 fused multiply-adds and did not compile)."""
    q, k, v, idx, rng = _inputs(len(name) + 7)
    opts = _options(name, rng)
    grad_out = rng.standard_normal((2, 4, 5, 6))
    grad_lse = rng.standard_normal((2, 4, 5))
    q, k, v, grad_out, grad_lse = (a.astype(dtype) for a in (q, k, v, grad_out, grad_lse))
    got = refattn.attention_vjp(
        q, k, v, grad_out, grad_lse=grad_lse, key_indices=idx, backend="numba", **opts
    )
    ref = refattn.attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, key_indices=idx, **opts)
    weights = refattn.attention(q, k, v, key_indices=idx, return_weights=True, **opts)[1]
    spec = canonicalize(q, k, v, key_indices=idx, **opts)
    ct = refattn.kernels.compute_dtype(dtype)
    kernel = numba_cpu.backward_error_bound(spec, weights, grad_out, grad_lse, ct)
    own = numba_cpu.backward_error_bound(spec, weights, grad_out, grad_lse)
    parts = zip(("dq", "dk", "dv", "dbias"), got, ref, kernel, own, strict=True)
    for what, value, truth, b, b64 in parts:
        if truth is None:
            assert value is None, f"{name}: {what} should be None without bias"
            continue
        assert value.dtype == ct, f"{name}: {what} in {value.dtype}, expected {ct}"
        assert_within(value, truth, 2 * (b + b64), what=what, case=name)


def test_gather_path_is_taken_and_builds_no_mask():
    """The call routes through the gather kernel: the kernel's spec holds the (B, K, L, T)
    lists and no (B, H, L, S) mask."""
    q, k, v, idx, _ = _inputs(1)
    spec = gather_spec(canonicalize(q, k, v), idx)
    assert spec.mask is None and spec.index_reading == refattn.kernels.GATHER
    assert spec.key_indices.shape == idx.shape
    out = refattn.kernels.attention(spec)
    dense = refattn.kernels.attention(canonicalize(q, k, v, key_indices=idx))
    bound = numba_cpu.forward_error_bound(
        canonicalize(q, k, v, key_indices=idx),
        refattn.attention(q, k, v, key_indices=idx, return_weights=True)[1],
    )[0]
    assert_within(out, dense, 2 * bound, what="out", case="gather vs dense kernel")


def test_set_reading_ignores_order_repeats_and_invalid_entries():
    """Shuffling a row's list, repeating entries and adding -1 / >= S entries change no bit."""
    q, k, v, idx, rng = _inputs(2)
    keys = k.shape[2]
    noisy = np.concatenate([idx, idx[..., :7], np.full(idx.shape[:-1] + (3,), -1)], axis=-1)
    noisy[..., -1] = keys + 9
    noisy = rng.permuted(noisy, axis=-1)
    got = refattn.attention(q, k, v, key_indices=noisy, backend="numba")
    want = refattn.attention(q, k, v, key_indices=idx, backend="numba")
    assert_same_bits(got, want, what="out", case="noisy lists")


def test_unlisted_poison_never_reaches_the_output():
    q, k, v, idx, _ = _inputs(3)
    listed = np.zeros(k.shape[:3], bool)
    for b in range(2):
        for g in range(2):
            valid = idx[b, g][(idx[b, g] >= 0) & (idx[b, g] < k.shape[2])]
            listed[b, g, valid] = True
    k2, v2 = k.copy(), v.copy()
    k2[~listed] = np.nan
    v2[~listed] = np.inf
    got = refattn.attention(q, k2, v2, key_indices=idx, backend="numba")
    want = refattn.attention(q, k, v, key_indices=idx, backend="numba")
    assert_same_bits(got, want, what="out", case="poisoned unlisted keys")


def test_large_group_splits_into_head_blocks():
    """A group of more than BLOCK_Q query heads (DeepSeek Sparse Attention decode: H 128,
    K 1) runs in head blocks; each block's rows agree with the float64 path."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 130, 1, 16))
    k = rng.standard_normal((1, 1, 300, 16))
    v = k[..., :12]
    idx = rng.permutation(300)[None, None, None, :70]
    out, lse = refattn.attention(q, k, v, key_indices=idx, return_lse=True, backend="numba")
    ref_out, ref_lse, weights = refattn.attention(
        q, k, v, key_indices=idx, return_lse=True, return_weights=True
    )
    spec = canonicalize(q, k, v, key_indices=idx)
    out_bound, lse_bound = numba_cpu.forward_error_bound(spec, weights)
    assert_within(out, ref_out, 2 * out_bound, what="out", case="H130 K1")
    assert_within(lse, ref_lse, 2 * lse_bound, what="lse", case="H130 K1")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", list(CASES))
def test_wide_decode_gives_the_bits_of_head_blocks(name, dtype, monkeypatch):
    """A decode step with many heads per kv head (B2 H66 K1 L1: few units) runs all the heads
    of a unit together with the work split inside it (refattn.kernels._cpu_gather's
    _gather_wide); every option gives the bits of the head-block path and agrees with the
    float64 path within the bound. D 77 and E 70 leave tail features and columns, H 66
    leftover rows of every tile."""
    from refattn.kernels import _cpu_gather

    heads = 66
    q, k, v, idx, rng = _inputs(
        len(name) + 20, heads=heads, kv_heads=1, length=1, keys=300, dim=77, vdim=70, width=90
    )
    assert _cpu_gather.wide_units(2, heads)
    opts = _options(name, rng, heads=heads, length=1, keys=300)
    if "alibi_slopes" in opts:
        opts = dict(opts, alibi_slopes=np.linspace(0.5, 0.01, heads))
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    wide = refattn.attention(q, k, v, key_indices=idx, return_lse=True, backend="numba", **opts)
    monkeypatch.setattr(_cpu_gather, "wide_units", lambda units, group: False)
    blocks = refattn.attention(q, k, v, key_indices=idx, return_lse=True, backend="numba", **opts)
    assert_same_bits(wide[0], blocks[0], what="out", case=name)
    assert_same_bits(wide[1], blocks[1], what="lse", case=name)
    ref_out, ref_lse, weights = refattn.attention(
        q, k, v, key_indices=idx, return_lse=True, return_weights=True, **opts
    )
    spec = canonicalize(q, k, v, key_indices=idx, **opts)
    kernel = numba_cpu.forward_error_bound(spec, weights, refattn.kernels.compute_dtype(dtype))
    own = numba_cpu.forward_error_bound(spec, weights, np.float64)
    assert_within(wide[0], ref_out, kernel[0] + own[0], what="out", case=name)
    assert_within(wide[1], ref_lse, kernel[1] + own[1], what="lse", case=name)


_THREADS_SCRIPT = """
import numpy as np, refattn
rng = np.random.default_rng(5)
q = rng.standard_normal((1, 8, 3, 16)); k = rng.standard_normal((1, 2, 500, 16))
v = rng.standard_normal((1, 2, 500, 8)); idx = rng.integers(-1, 500, (1, 2, 3, 200))
out, lse = refattn.attention(q, k, v, key_indices=idx, return_lse=True, backend="numba")
g = refattn.attention_vjp(q, k, v, np.ones_like(out), key_indices=idx, backend="numba")
print(out.tobytes().hex()[:4000], lse.tobytes().hex(), [x.tobytes().hex()[:2000] for x in g[:3]])
for dtype in (np.float32, np.float64):  # a decode step, MLA's v = k[..., :E] read in place
    q = rng.standard_normal((1, 40, 1, 70)).astype(dtype)
    k = rng.standard_normal((1, 1, 900, 70)).astype(dtype)
    idx = rng.permutation(900)[None, None, None, :301]
    out = refattn.attention(q, k, k[..., :45], key_indices=idx, backend="numba")
    print(out.tobytes().hex())
    q = rng.standard_normal((1, 70, 1, 70)).astype(dtype)  # many heads: the split inside a unit
    out = refattn.attention(q, k, k[..., :45], key_indices=idx, backend="numba")
    print(out.tobytes().hex())
"""


def test_gather_bits_do_not_depend_on_thread_count():
    outputs = set()
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads)
        run = subprocess.run(
            [sys.executable, "-c", _THREADS_SCRIPT], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.add(run.stdout)
    assert len(outputs) == 1, "the gather forward's bits depend on NUMBA_NUM_THREADS"


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_uneven_tiles_and_values_read_from_the_keys(dtype):
    """Feature, value and head counts that are not multiples of the register tiles (D 37,
    E 21, H 7, an odd number of listed keys) agree with the float64 path within the bound;
    v = k[..., :E] (MLA's absorbed form, read from the key rows without a copy) gives the
    bits of the same values passed as a contiguous array."""
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 7, 2, 37)).astype(dtype)
    k = rng.standard_normal((1, 1, 200, 37)).astype(dtype)
    idx = rng.integers(-2, 205, (1, 1, 2, 61))
    view = k[..., :21]
    out, lse = refattn.attention(q, k, view, key_indices=idx, return_lse=True, backend="numba")
    copied = refattn.attention(q, k, view.copy(), key_indices=idx, backend="numba")
    assert_same_bits(out, copied, what="out", case="v = k[..., :E] vs a copy")
    ref_out, ref_lse, weights = refattn.attention(
        q, k, view, key_indices=idx, return_lse=True, return_weights=True
    )
    spec = canonicalize(q, k, view, key_indices=idx)
    ct = refattn.kernels.compute_dtype(dtype)
    kernel = numba_cpu.forward_error_bound(spec, weights, ct)
    own = numba_cpu.forward_error_bound(spec, weights, np.float64)
    assert_within(out, ref_out, kernel[0] + own[0], what="out", case="uneven tiles")
    assert_within(lse, ref_lse, kernel[1] + own[1], what="lse", case="uneven tiles")


def test_range_check_reads_only_the_listed_keys():
    """On a sparse decode (fewer listed entries than keys) the pre-kernel range check looks at
    the keys the gather reads: a float32 key too large for s q.k in float32 is refused when
    listed and harmless when not."""
    q, k, v, idx, _ = _inputs(11, length=1, keys=400, width=20)
    assert idx.size < k.shape[-2]
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    huge = np.finfo(np.float32).max / 4
    listed = np.unique(idx[(idx >= 0) & (idx < k.shape[-2])])
    unlisted = np.setdiff1d(np.arange(k.shape[-2]), listed)
    assert unlisted.size, "the case must leave some key unlisted"
    far = k.copy()
    far[..., unlisted[0], :] = huge
    near = refattn.attention(q, k, v, key_indices=idx, backend="numba")
    far_out = refattn.attention(q, far, v, key_indices=idx, backend="numba")
    assert_same_bits(far_out, near, what="a large unlisted key")
    k[..., listed[0], :] = huge
    with pytest.raises(ValueError, match="q, k, scale: scores"):
        refattn.attention(q, k, v, key_indices=idx, backend="numba")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("dim", [5, 16, 37])
def test_listed_keys_is_the_largest_listed_magnitude(dtype, dim):
    """The range check's compiled row reader (four rows side by side, vectors then the tail
    features) returns max |x| over exactly the listed in-range rows, NaN skipped."""
    rng = np.random.default_rng(dim)
    k = rng.standard_normal((2, 3, 50, dim)).astype(dtype)
    k[0, 1, 7, 2] = np.nan
    k[1, 2, 9, -1] = -40.0
    idx = rng.integers(-3, 55, (2, 3, 2, 11))
    idx[1, 2, 0, 0] = 9
    listed = [(b, g, j) for b in range(2) for g in range(3) for j in idx[b, g].ravel()]
    rows = [k[b, g, j] for b, g, j in listed if 0 <= j < 50]
    got = refattn.kernels.listed_keys(k, idx)
    assert got.shape == (1,) and got[0] == np.nanmax(np.abs(np.array(rows)))
