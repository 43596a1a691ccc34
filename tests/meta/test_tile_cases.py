"""The tile-shaped cases (oracle.catalogue.attention_tile_families): at least 20 per dtype in
default, every one runnable by a kernel restricted to L == S, whole 64-tiles, no mask, causal
top-left or none and D == E (structural checks: no truth is built)."""

from __future__ import annotations

import pytest

from oracle import catalogue
from oracle.catalogue.names import DTYPES

_ALLOWED_OPTIONS = {"causal", "align"}


def _tile_cases(suite="default"):
    return [c for c in catalogue.suite(suite) if c.name.startswith("tile-")]


@pytest.mark.parametrize("dtype", DTYPES)
def test_at_least_twenty_tile_cases_per_dtype_in_default(dtype):
    assert sum(c.dtype == dtype for c in _tile_cases()) >= 20


def test_every_tile_case_fits_a_tile_only_kernel():
    for case in _tile_cases("full"):
        n = case.shapes
        assert n.L == n.S and n.L % 64 == 0 and n.D == n.E, case.name
        assert set(case.options) <= _ALLOWED_OPTIONS, case.name
        assert case.options.get("align", "top_left") == "top_left", case.name
        recipe_inputs = {"mask", "bias", "alibi", "dropout", "poison", "sinks", "kv_lengths"}
        assert not recipe_inputs & set(case.recipe), case.name
        assert not case.grads and case.category == "conformance", case.name


def test_tile_cases_cover_causal_gqa_and_both_head_dims():
    cases = _tile_cases()
    assert any(c.options.get("causal") for c in cases)
    assert any(not c.options.get("causal") for c in cases)
    assert any(c.shapes.H != c.shapes.K for c in cases)
    assert {c.shapes.D for c in cases} >= {64, 128}
    assert {c.shapes.L for c in cases} >= {64, 128, 256, 512, 1024}
