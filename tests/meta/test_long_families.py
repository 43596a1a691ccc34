"""The long-row and worst-case families of default: cheap structural checks (the truths are
checked by the slow tier and by ``refattn-oracle power``)."""

from __future__ import annotations

import numpy as np
import pytest

from oracle import catalogue
from oracle.catalogue.attention_long_families import DECODE_LENGTHS
from oracle.fixtures import golden

LONG_TAGS = (
    "long-decode",
    "long-prefill",
    "long-block",
    "long-window",
    "long-kv-lengths",
    "long-sinks",
    "long-softcap",
    "long-alibi",
    "long-late-max",
    "long-splits",
    "long-fade",
)
WORST_TAGS = (
    "worst-peaky-x5",
    "worst-peaky-x20",
    "worst-midpoint",
    "worst-lse-neg120",
    "worst-one-value",
    "worst-equal-keys",
    "worst-near-zero",
    "worst-overflow",
)


def _default():
    return catalogue.suite("default")


def test_every_family_in_every_dtype():
    names = [c.name for c in _default()]
    for tag in LONG_TAGS + WORST_TAGS:
        for dtag in ("f64", "f32", "f16", "bf16"):
            assert any(n.startswith(tag + "-") and n.endswith("-" + dtag) for n in names), (
                tag,
                dtag,
            )
    lengths = {c.shapes.S for c in _default() if c.name.startswith("long-decode-")}
    assert lengths == set(DECODE_LENGTHS) and max(lengths) == 131072


def test_long_inputs_exact_on_the_grid_and_jumps_placed():
    case = catalogue.get("long-late-max-H1K1-L4S9000-D16E16-bf16")
    inputs = catalogue.make_inputs(case)
    k = inputs["k"].astype(np.float64)
    scores = inputs["q"].astype(np.float64)[0, 0] @ k[0, 0].T * 0.25
    top = np.argmax(scores, axis=-1)
    assert set(top.tolist()) == {8200}
    assert scores[0, 4100] > scores[0, :4100].max()


@pytest.mark.slow
def test_compact_fixture_round_trip(tmp_path):
    case = catalogue.get("long-decode-H2K1-L1S2048-D16E16-bf16")
    fixture = golden.build(case)
    golden.write_fixture(fixture, tmp_path)
    path = tmp_path / f"{case.name}.npz"
    assert path.stat().st_size < 20_000  # no inputs stored
    with np.load(path) as archive:
        assert "regenerated.npy" in archive.files or "regenerated" in archive.files
        assert not any(n.startswith("inputs/") for n in archive.files)
    loaded = golden._read_fixture(path)
    for name, array in fixture.inputs.items():
        assert loaded.inputs[name].dtype == array.dtype
        assert np.array_equal(loaded.inputs[name].view(np.uint16), array.view(np.uint16))


@pytest.mark.slow
def test_compact_fixture_refuses_other_inputs(tmp_path, monkeypatch):
    case = catalogue.get("long-decode-H2K1-L1S2048-D16E16-f32")
    golden.write_fixture(golden.build(case), tmp_path)
    from oracle.catalogue import attention_long_inputs

    real = attention_long_inputs.grid
    monkeypatch.setattr(attention_long_inputs, "grid", lambda *a: real(*a) * 0.5)
    with pytest.raises(golden.FixtureError, match="regenerated input"):
        golden._read_fixture(tmp_path / f"{case.name}.npz")


def test_fade_inputs_keep_the_mass_before_32k_and_lift_jumps_exactly():
    case = catalogue.get("long-fade-H1K1-L2S49153-D16E16-bf16")
    inputs = catalogue.make_inputs(case)
    q, k, v = (inputs[x].astype(np.float64)[0, 0] for x in "qkv")
    scores = q @ k.T * 0.25
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    head, tail = weights[:, :32768].sum(axis=-1), weights[:, 32768:].sum(axis=-1)
    assert np.all(tail < head) and np.all(tail > 0)
    # the lifted key's score is exactly jump_base (its other components are zero)
    assert np.all(scores[:, 40000] == case.recipe["jump_base"])
    assert np.all(v[:32768] < 1) and np.all(v[32768:] >= -1)
