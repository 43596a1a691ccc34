"""Preset gaps closed: FlashInfer's base-2 lse is judged (brought to the natural log),
FlashAttention 3's ``page_table`` is spoken when the function takes it, xformers' grouped
heads go in its 5-D form. NumPy functions with the libraries' signatures
(tests/planted/library_like_numpy.py) under each preset with framework "numpy"."""

from __future__ import annotations

import pytest

from oracle.conventions.signatures import get
from oracle.run.validate import validate
from tests.planted import library_like_numpy as lib

_SMOKE = dict(suite="smoke", dtype="float32", progress=False, isolate=False)


def _numpy(name):
    return get(name).replace(framework="numpy")


def test_flashinfer_lse_is_judged_in_base_two():
    report = validate(
        lib.single_prefill_with_kv_cache,
        signature=_numpy("flashinfer"),
        cases=["basic-*", "causal-*"],
        **_SMOKE,
    )
    assert report.passed and [r.verdict for r in report.results] == ["pass", "pass"]
    assert all("lse" in r.checks for r in report.results), [r.checks for r in report.results]
    natural = validate(
        lib.single_prefill_natural_lse,
        signature=_numpy("flashinfer"),
        cases=["basic-*"],
        **_SMOKE,
    )
    assert [r.verdict for r in natural.results] == ["fail"]
    assert not natural.results[0].checks["lse"].passed


def test_flash_attention_3_page_table():
    report = validate(
        lib.flash_attn_with_kvcache,
        signature=_numpy("flash_attn_with_kvcache"),
        cases=["basic-*", "causal-*", "gqa-*"],
        **_SMOKE,
    )
    assert [r.verdict for r in report.results] == ["pass"] * 3, [
        r.explain() for r in report.results
    ]


@pytest.mark.parametrize("cases", [["gqa-*"], ["basic-*", "causal-*"]])
def test_xformers_grouped_heads_in_five_dims(cases):
    report = validate(
        lib.memory_efficient_attention, signature=_numpy("xformers"), cases=cases, **_SMOKE
    )
    assert report.results and all(r.verdict == "pass" for r in report.results), [
        r.explain() for r in report.results
    ]
