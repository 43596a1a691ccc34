"""Every layout hands every argument over in the shape its library documents.

Each ``checked_*`` function below asserts the documented shape of each argument it receives
(q, k, v or the caches, qv, the index lists, the block scales, block_table, cache_seqlens...)
against the others, rebuilds refattn's bhld call from them and computes it with the oracle's
textbook path: a layout that hands one array over in the wrong axis order or the padded
length fails it (an AssertionError is a fail). Two regressions are pinned directly: the
fp4-paged layout's ``cache_seqlens`` are the real per-row lengths, and the blhd layout
transposes ``qv`` with q.
"""

from __future__ import annotations

import numpy as np
import pytest

from oracle.catalogue import registry
from oracle.conventions import layouts
from oracle.conventions.layouts_fp4 import fp4_paged
from oracle.reading.baseline import textbook_attention
from oracle.run.validate import validate


def _bhld(a):
    return np.swapaxes(a, -3, -2)


def _answer(q, k, v, options):
    return_lse = options.pop("return_lse", False)
    result = textbook_attention(q, k, v, **options)
    return (result.out, result.lse) if return_lse else result.out


def _back(result):
    if isinstance(result, tuple):
        return _bhld(result[0]), result[1]
    return _bhld(result)


def checked_blhd(q, k, v, **options):
    """blhd: q (B, L, H, D), k (B, S, K, D), v (B, S, K, E); qv (B, L, H, E); key_indices
    (B, L, K, T); q_block_scale (B, L, H, D/n); k/v_block_scale (B, S, K, D/n | E/n)."""
    batch, rows, heads, _ = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    assert v.shape[:3] == (batch, keys, kv_heads)
    if options.get("qv") is not None:
        assert options["qv"].shape == (batch, rows, heads, v.shape[-1]), options["qv"].shape
    for name in ("key_indices", "key_block_indices"):
        if options.get(name) is not None:
            assert options[name].shape[1:3] == (rows, kv_heads), (name, options[name].shape)
    if options.get("q_block_scale") is not None:
        assert options["q_block_scale"].shape[:3] == (batch, rows, heads)
    for name, x in (("k_block_scale", k), ("v_block_scale", v)):
        if options.get(name) is not None:
            assert options[name].shape[:3] == x.shape[:3], (name, options[name].shape, x.shape)
    moved = dict(options)
    for name in layouts.PER_ROW + tuple(layouts.PER_KEY):
        if moved.get(name) is not None:
            moved[name] = _bhld(moved[name])
    return _back(_answer(_bhld(q), _bhld(k), _bhld(v), moved))


def _gather(cache, table, keys):
    pages = cache[table]  # (B, per_seq, page, K, X)
    seq = pages.reshape(table.shape[0], -1, *cache.shape[2:])[:, :keys]
    return np.swapaxes(seq, 1, 2)


def checked_paged(q, k_cache, v_cache, *, block_table, cache_seqlens, **options):
    """paged: q (B, L, H, D); caches (P, page, K, D | E); block_table (B, pages per sequence);
    cache_seqlens (B,) the real lengths; qv (B, L, H, E)."""
    batch, rows, heads, _ = q.shape
    assert block_table.shape[0] == batch and cache_seqlens.shape == (batch,)
    assert k_cache.shape[:3] == v_cache.shape[:3]
    keys = block_table.shape[1] * k_cache.shape[1]
    if options.get("qv") is not None:
        assert options["qv"].shape == (batch, rows, heads, v_cache.shape[-1])
        options["qv"] = _bhld(options["qv"])
    k, v = _gather(k_cache, block_table, keys), _gather(v_cache, block_table, keys)
    top = int(cache_seqlens.max())
    k, v = k[..., :top, :], v[..., :top, :]
    if np.any(cache_seqlens != top):
        options["kv_lengths"] = cache_seqlens
    return _back(_answer(_bhld(q), k, v, options))


def checked_fp4_paged(q, k_cache, v_cache, *, block_table, cache_seqlens, **options):
    """fp4-paged: q (B, L, H, D) (or packed (B, L, H, D/2) uint8); caches (P, 16, K, D/2)
    uint8; block scales paged alike; cache_seqlens (B,) the real lengths, no kv_lengths."""
    from tests.planted.fp4_impls import fp4_paged as reference

    assert "kv_lengths" not in options, "fp4-paged passes the lengths as cache_seqlens only"
    assert cache_seqlens.shape == (q.shape[0],)
    for name, cache in (("k_block_scale", k_cache), ("v_block_scale", v_cache)):
        assert options[name].shape[:3] == cache.shape[:3]
    if options.get("q_block_scale") is not None:
        assert options["q_block_scale"].shape[:3] == q.shape[:3]
    return reference(
        q, k_cache, v_cache, block_table=block_table, cache_seqlens=cache_seqlens, **options
    )


def _case_options(name):
    case = registry.get(name)
    inputs = registry.make_inputs(case)
    q, k, v = (inputs.pop(n) for n in ("q", "k", "v"))
    return case, q, k, v, {**case.options, **inputs}


def test_fp4_paged_passes_the_real_lengths_as_cache_seqlens():
    case, q, k, v, options = _case_options("fp4-nvfp4-decode-kv-B3H8K2-L1S40-D128E128-f32")
    _, kwargs, _ = fp4_paged(q, k, v, options)
    assert kwargs["cache_seqlens"].tolist() == np.asarray(options["kv_lengths"]).tolist()
    assert kwargs["cache_seqlens"].tolist() != [40, 40, 40]
    assert "kv_lengths" not in kwargs


def test_blhd_transposes_qv_with_q():
    case, q, k, v, options = _case_options("qv-causal-gqa-B2H8K2-L12S24-D16E32-f32")
    (q_blhd, _, _), kwargs, _ = layouts._LAYOUT_IN["blhd"](q, k, v, options)
    assert q_blhd.shape == (2, 12, 8, 16)
    assert kwargs["qv"].shape == (2, 12, 8, 32)


def _passes(impl, layout, cases):
    report = validate(
        impl,
        suite="default",
        dtype="float32",
        cases=cases,
        layout=layout,
        progress=False,
        isolate=False,
    )
    verdicts = {r.name: r.verdict for r in report.results}
    assert report.passed, [r.explain() for r in report.failures]
    assert any(v == "pass" for v in verdicts.values()), verdicts
    return verdicts


@pytest.mark.parametrize(
    "layout, impl, cases",
    [
        ("blhd", checked_blhd, ["qv-causal-gqa-*", "sparse-sentinels-*", "fp4-nvfp4-d64-*"]),
        ("paged", checked_paged, ["qv-causal-gqa-*", "kv-lengths-*", "batch-*"]),
        ("fp4-paged", checked_fp4_paged, ["fp4-*-decode-kv-*", "fp4-mxfp4-d64-*"]),
    ],
)
def test_each_layout_hands_over_the_documented_shapes(layout, impl, cases):
    _passes(impl, layout, cases)
