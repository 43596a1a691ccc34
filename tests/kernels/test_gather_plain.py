"""The light path of a plain sparse-key call on the Numba CPU kernels (refattn._numba_path's
plain_gather): ``refattn.attention(q, k, v, key_indices=..., backend="numba")`` with no option
but the scale skips canonicalize and builds the gather kernel's arguments directly. It must
give the bits and the errors of the general path, compile no other specialisation, and leave
every other call to the general path.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import refattn
from refattn import _numba_path
from refattn.kernels import _cpu_gather
from tests.helpers import assert_same_bits, general_attention, sparse_decode_problem

# the light path's decode problems (keyword arguments override these)
_decode = functools.partial(
    sparse_decode_problem, heads=6, kv_heads=2, length=3, keys=120, dim=37, vdim=21, top=40
)


VALUES = ["contiguous", "leading features of k", "strided"]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize("scale", [None, 0.3, np.float64(1 / np.sqrt(7.0))])
def test_plain_call_gives_the_bits_of_the_general_path(dtype, values, scale, monkeypatch):
    q, k, v, idx = _decode(dtype)
    if values == "leading features of k":  # MLA's absorbed form: v read from the key rows
        v = k[..., :21]
    elif values == "strided":
        v = np.ascontiguousarray(np.repeat(v, 2, axis=-1))[..., ::2]
    q = np.asfortranarray(q)  # any layout: the light path copies like the general one
    opts = dict(key_indices=idx, scale=scale, backend="numba", return_lse=True)
    assert _numba_path.plain_gather(dict(_call(q, k, v), **opts)) is not None
    got = refattn.attention(q, k, v, **opts)
    want = general_attention(monkeypatch, "plain_gather", q, k, v, **opts)
    for what, a, b in zip(("out", "lse"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert_same_bits(a, b, what=what, case=f"{values}, scale {scale!r}")
    assert_same_bits(
        refattn.attention(q, k, v, key_indices=idx, scale=scale, backend="numba"),
        got[0],
        what="out",
        case="return_lse=False",
    )


def _call(q, k, v, **changes):
    """The keywords of a refattn.attention call at their defaults (its ``locals()``)."""
    call = dict(_numba_path.PLAIN_DEFAULTS, q=q, k=k, v=v, scale=None, return_lse=False)
    call.update(backend="numba", key_indices=None)
    call.update(changes)
    return call


def test_large_groups_take_the_light_path_too(monkeypatch):
    """A DeepSeek-style decode (H 70, K 1, L 1: the split inside the unit) alike."""
    q, k, _, idx = _decode(np.float32, heads=70, kv_heads=1, length=1, keys=300, dim=40)
    assert _cpu_gather.wide_units(2, 70)
    got = refattn.attention(q, k, k[..., :32], key_indices=idx, backend="numba")
    want = general_attention(
        monkeypatch, "plain_gather", q, k, k[..., :32], key_indices=idx, backend="numba"
    )
    assert_same_bits(got, want, what="out", case="H70 K1")


def test_no_other_specialisation_is_compiled(monkeypatch):
    q, k, v, idx = _decode(np.float32, seed=3)
    general_attention(monkeypatch, "plain_gather", q, k, v, key_indices=idx, backend="numba")
    before = len(_cpu_gather._gather_units.signatures)
    refattn.attention(q, k, v, key_indices=idx, backend="numba")
    assert len(_cpu_gather._gather_units.signatures) == before


def test_range_error_is_the_general_paths(monkeypatch):
    q, k, v, idx = _decode(np.float32, seed=4)
    listed = idx[(idx >= 0) & (idx < k.shape[-2])]
    k[0, 0, listed[0], 0] = np.finfo(np.float32).max / 4
    messages = []
    for run in (
        refattn.attention,
        lambda *a, **kw: general_attention(monkeypatch, "plain_gather", *a, **kw),
    ):
        with pytest.raises(ValueError, match="q, k, scale: scores") as info:
            run(q, k, v, key_indices=idx, backend="numba")
        messages.append(str(info.value))
    assert messages[0] == messages[1]


OTHER_CALLS = {
    "an option": {"causal": True},
    "an option at an equal but other value": {"dropout_p": 0},
    "return_weights": {"return_weights": True},
    "exact": {"precision": "exact"},
    "the multiset reading": {"index_reading": "multiset"},
    "an integer scale": {"scale": 1},
    "a NaN scale": {"scale": float("nan")},
}


@pytest.mark.parametrize("name", list(OTHER_CALLS))
def test_other_calls_take_the_general_path(name):
    q, k, v, idx = _decode(np.float64)
    assert _numba_path.plain_gather(_call(q, k, v, key_indices=idx)) is not None
    assert _numba_path.plain_gather(_call(q, k, v, key_indices=idx, **OTHER_CALLS[name])) is None


@pytest.mark.parametrize(
    "change",
    ["float16", "mixed dtypes", "broadcast batch", "3-D", "uint indices", "list", "empty"],
)
def test_other_arrays_take_the_general_path(change):
    q, k, v, idx = _decode(np.float64)
    if change == "float16":
        q, k, v = (x.astype(np.float16) for x in (q, k, v))
    elif change == "mixed dtypes":
        q = q.astype(np.float32)
    elif change == "broadcast batch":
        k, v, idx = k[:1], v[:1], idx[:1]
    elif change == "3-D":
        q, k, v, idx = q[0], k[0], v[0], idx[0]
    elif change == "uint indices":
        idx = np.abs(idx).astype(np.uint32)
    elif change == "list":
        idx = idx.tolist()
    else:
        idx = idx[..., :0]
    assert _numba_path.plain_gather(_call(q, k, v, key_indices=idx)) is None


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("heads", [6, 70])
def test_kernel_reads_the_largest_listed_magnitude(dtype, heads):
    """The gather kernel's own max |x| over the key rows it reads (taken while they are in
    cache) is listed_keys's value: the range check of a plain call reads it instead of
    reading the listed rows a second time. NaN skipped; D 37 leaves tail features."""
    from refattn.kernels import listed_keys, numba_cpu

    kv_heads = 2 if heads == 6 else 1
    q, k, v, idx = _decode(dtype, heads=heads, kv_heads=kv_heads, length=2, keys=300, seed=5)
    listed = np.where((idx >= 0) & (idx < 300), idx, -1).astype(np.int64)
    listed.sort(axis=-1)
    k[1, 0, listed[1, 0, 1, -1], 3] = np.nan
    k[0, kv_heads - 1, listed[0, kv_heads - 1, 0, -2], -1] = -40.0
    top = numba_cpu.plain_gather_forward(q, k, v, listed, None)[2]
    assert top == listed_keys(k, listed)[0] == 40.0


@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_non_finite_listed_keys_read_as_the_general_path(value, monkeypatch):
    """An Inf (or NaN) in a listed key row: the light path's range check reads the finite
    entries as the general one does (the same output, or the same error)."""
    q, k, v, idx = _decode(np.float32, seed=6)
    k[0, 1, idx[0, 1][(idx[0, 1] >= 0) & (idx[0, 1] < k.shape[-2])][0], 2] = value
    got = refattn.attention(q, k, v, key_indices=idx, backend="numba")
    want = general_attention(monkeypatch, "plain_gather", q, k, v, key_indices=idx, backend="numba")
    assert_same_bits(got, want, what="out", case=f"{value} in a listed key")
