"""FlashMLA's sparse decode in the latent-paged layout: the cases' latent keys sit on the grid
of its 656-byte fp8 cache (so the cache holds them exactly), and ``indices`` name each allowed
listed key's slot in the paged cache (-1 for the rest)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from oracle.catalogue import registry
from oracle.conventions.layouts import wrap
from oracle.conventions.layouts_latent import fp8_latent_cache
from oracle.conventions.signatures import get
from oracle.reading.allowed import options_allowed

DSA = [c.name for c in registry.suite("default") if c.name.startswith("mla-dsa-decode")]


def _decoded(token):
    """The 656-byte tokens (..., 656) back to float64 (..., 576)."""
    raw = np.ascontiguousarray(token).view(np.uint8)
    nope = raw[..., :512].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scales = np.ascontiguousarray(raw[..., 512:528]).view(np.float32).astype(np.float64)
    rope = np.ascontiguousarray(raw[..., 528:]).view(ml_dtypes.bfloat16).astype(np.float64)
    return np.concatenate([nope * np.repeat(scales, 128, axis=-1), rope], axis=-1)


def _case(name):
    case = registry.get(name)
    inputs = registry.make_inputs(case)
    options = {**case.options, **{n: x for n, x in inputs.items() if n not in ("q", "k", "v")}}
    return case, inputs, options


def test_default_holds_dsa_decode_cases_in_float32_and_bfloat16():
    assert len(DSA) >= 8
    assert {registry.get(n).dtype for n in DSA} == {"float32", "bfloat16"}


@pytest.mark.parametrize("name", DSA[:2])
def test_the_cases_keys_round_trip_through_the_fp8_cache(name):
    _, inputs, _ = _case(name)
    k = np.asarray(inputs["k"], np.float64)
    token = fp8_latent_cache(k)
    assert token.shape == k.shape[:-1] + (656,) and token.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(_decoded(token), k)


def test_an_off_grid_cache_is_not_expressible_and_unowned_slots_stay_nan():
    k = np.linspace(-1.0, 1.0, 2 * 576).reshape(2, 576) + 1e-3
    with pytest.raises(NotImplementedError, match="not expressible"):
        fp8_latent_cache(k)
    with pytest.raises(NotImplementedError, match="576 features"):
        fp8_latent_cache(np.zeros((1, 64)))
    token = fp8_latent_cache(np.full((1, 576), np.nan))
    assert np.isnan(_decoded(token)).all()


@pytest.mark.parametrize(
    "name", [n for n in DSA if ("ragged" in n or "sinks" in n) and n.endswith("f32")]
)
def test_indices_name_the_allowed_keys_slots_in_the_paged_cache(name):
    case, inputs, options = _case(name)
    called = {}

    def spy(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
            num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
            indices=None, attn_sink=None):  # fmt: skip
        called.update(cache=k_cache, indices=indices, fp8=is_fp8_kvcache, causal=causal)
        raise NotImplementedError("spy")

    flash_mla = wrap(spy, layout="latent-paged", framework="numpy",
                     signature=get("flashmla_kvcache").replace(framework="numpy"))  # fmt: skip
    with pytest.raises(NotImplementedError, match="spy"):
        flash_mla(inputs["q"], inputs["k"], inputs["v"], **options)
    assert called["fp8"] is True and called["causal"] is False
    flat = _decoded(called["cache"]).reshape(-1, 576)
    k = np.asarray(inputs["k"], np.float64)  # (B, 1, S, 576)
    batch, rows, S = k.shape[0], case.shapes.L, case.shapes.S
    lengths = np.broadcast_to(options.get("kv_lengths", S), (batch,))
    structural = {n: options[n] for n in ("causal", "align") if n in options}
    listed = np.broadcast_to(
        options["key_indices"], (batch, 1, rows, options["key_indices"].shape[-1])
    )
    for b in range(batch):
        allowed = options_allowed(rows, S, {**structural, "kv_lengths": lengths[b : b + 1]})
        allowed = np.asarray(allowed).reshape(-1, rows, S)[0]
        for i in range(rows):
            slots = called["indices"][b, i]
            want = {j for j in listed[b, 0, i] if 0 <= j < lengths[b] and allowed[i, j]}
            got = [flat[s] for s in slots if s >= 0]
            assert len(got) == len(want)
            for j in want:
                assert any(np.array_equal(row, k[b, 0, j]) for row in got)
