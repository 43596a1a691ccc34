"""The light path of a plain exact sparse-key call (refattn._exact_sparse.plain_exact_gather):
``refattn.attention(q, k, v, key_indices=..., precision="exact")`` with no option but the
scale, ``out_dtype`` and ``return_lse`` skips the general path's option handling. It must hand
the gather engine the general path's spec, give its bits and its errors, and leave every other
call to the general path."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import refattn
from refattn import config
from refattn.exact.fast import gather as G
from tests.helpers import general_attention, sparse_decode_problem

# the light path's decode problems (keyword arguments override these)
_decode = functools.partial(
    sparse_decode_problem, heads=4, kv_heads=2, length=1, keys=40, dim=9, vdim=5, top=12
)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", None])
@pytest.mark.parametrize("length", [1, 3])
def test_light_path_gives_the_general_paths_bits(monkeypatch, dtype, out_dtype, length):
    q, k, v, idx = _decode(dtype, length=length)
    for scale, return_lse in ((None, False), (0.3, True), (np.float64(-0.7), False)):
        opts = dict(
            key_indices=idx, scale=scale, precision="exact", out_dtype=out_dtype,
            return_lse=return_lse,
        )  # fmt: skip
        got = refattn.attention(q, k, v, **opts)
        want = general_attention(monkeypatch, "plain_exact_gather", q, k, v, **opts)
        got, want = (got, want) if return_lse else ((got,), (want,))
        assert all(_same_bits(g, w) for g, w in zip(got, want, strict=True))


def test_light_path_hands_the_engine_the_general_paths_spec(monkeypatch):
    q, k, v, idx = _decode(np.float32)
    specs = []
    engine = G.gather_forward

    def recording(spec, *args, **kwargs):
        specs.append(spec)
        return engine(spec, *args, **kwargs)

    monkeypatch.setattr(G, "gather_forward", recording)
    opts = dict(key_indices=idx, scale=0.25, precision="exact", out_dtype="float32")
    refattn.attention(q, k, v, **opts)
    general_attention(monkeypatch, "plain_exact_gather", q, k, v, **opts)
    light, general = specs
    for field in dataclasses.fields(light):
        a, b = getattr(light, field.name), getattr(general, field.name)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            assert _same_bits(np.asarray(a), np.asarray(b)), field.name
        else:
            assert a == b, field.name


OTHER_CALLS = {
    "causal": dict(causal=True),
    "return_weights": dict(return_weights=True),
    "lse_base": dict(lse_base=2, return_lse=True),
    "int scale": dict(scale=1),
    "return_lse not a bool": dict(return_lse=1),
    "softcap": dict(softcap=3.0),
}


@pytest.mark.parametrize("name", sorted(OTHER_CALLS))
def test_other_calls_take_the_general_path(monkeypatch, name):
    from refattn import _exact_sparse

    q, k, v, idx = _decode(np.float64)
    call = _plain_call(q, k, v, idx)
    assert _exact_sparse.plain_exact_gather(call) is not None
    call.update(OTHER_CALLS[name])
    assert _exact_sparse.plain_exact_gather(call) is None
    # the general path still answers (or refuses) as before
    opts = {n: call[n] for n in ("scale", "return_lse", "out_dtype")} | OTHER_CALLS[name]
    opts.pop("return_weights", None)
    refattn.attention(q, k, v, key_indices=idx, precision="exact", **opts)


def _plain_call(q, k, v, idx) -> dict:
    """The arguments of a plain exact sparse-key call as the light path is handed them."""
    from refattn._numba_path import PLAIN_DEFAULTS

    call = dict(
        q=q, k=k, v=v, key_indices=idx, scale=None, precision="exact", backend="numpy",
        out_dtype=None, return_lse=False, lse_base="e",
    )  # fmt: skip
    call.update((n, d) for n, d in PLAIN_DEFAULTS.items() if n not in ("precision", "out_dtype"))
    return call


def test_other_arrays_and_the_mask_engine_take_the_general_path(monkeypatch):
    from refattn import _exact_sparse

    q, k, v, idx = _decode(np.float64)
    base = _plain_call(q, k, v, idx)
    for change in (
        dict(q=q.astype(np.float16)),
        dict(q=q[0]),  # 3-D: canonicalize adds the batch axis
        dict(key_indices=idx[:, :, :, :0]),  # T = 0
        dict(backend="numba"),
    ):
        assert _exact_sparse.plain_exact_gather(base | change) is None, sorted(change)
    monkeypatch.setattr(config, "EXACT_SPARSE_KEYS", "mask")
    assert _exact_sparse.plain_exact_gather(base) is None


def test_bad_out_dtype_is_the_general_paths_error(monkeypatch):
    q, k, v, idx = _decode(np.float32)
    opts = dict(key_indices=idx, precision="exact", out_dtype="int32")
    with pytest.raises(TypeError) as light:
        refattn.attention(q, k, v, **opts)
    with pytest.raises(TypeError) as general:
        general_attention(monkeypatch, "plain_exact_gather", q, k, v, **opts)
    assert str(light.value) == str(general.value) and "out_dtype" in str(light.value)
