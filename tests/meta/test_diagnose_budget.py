"""The diagnosis budget (oracle/diagnose/budget.py): a failing case's diagnosis is bounded by a
multiple of its judging time, cheap readings are always tried, the first costly match ends the
search, the steps outside the readings (and the fp4 readings) draw on the same budget, a
diagnosis that ran out says what it tried, the readings are kept for the judge's later calls,
the vectorised kernel models equal their loop twins, and the progress bar shows the
diagnoses."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path
from types import MappingProxyType

import ml_dtypes
import numpy as np
import pytest

from oracle.cli import main
from oracle.diagnose import budget, diagnosis, sample, tiles
from oracle.diagnose.budget import CHEAP_WORK, DiagnosisBudget, case_budget
from oracle.diagnose.fp4 import diagnose_fp4
from oracle.reading.baseline import textbook_attention
from oracle.reading.case import CaseView, _shapes
from oracle.run.progress import Progress
from oracle.run.validate import validate

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.planted, in the worker too

_SPENT = DiagnosisBudget(multiple=1.0, floor=0.0)  # zero seconds for a case judged in zero


def _view(q, k, v, options, dtype="float32"):
    """The case view of plain inputs (what the judge reads from a fixture)."""
    return CaseView(
        name="case",
        dtype=dtype,
        q=q,
        k=k,
        v=v,
        options=MappingProxyType(dict(options)),
        shapes=MappingProxyType(_shapes(q, k, v)),
        single=np.ndim(q) == 2,
        key=f"case-{id(q)}",
    )


def _inputs(L, S, D=16, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((1, 1, L, D)),
        rng.standard_normal((1, 1, S, D)),
        rng.standard_normal((1, 1, S, D)),
    )


def test_budget_setting_and_seconds():
    assert DiagnosisBudget.of(True).multiple == budget.DEFAULT_MULTIPLE
    assert DiagnosisBudget.of(3).seconds(2.0) == 6.0
    assert DiagnosisBudget.of(3).seconds(0.0) == budget.FLOOR_SECONDS
    assert not DiagnosisBudget.of(math.inf).bounded
    for bad in (0, -1.0, math.nan, "5", True):
        with pytest.raises(ValueError, match="diagnose_budget"):
            DiagnosisBudget(multiple=bad)
    with pytest.raises(ValueError, match="diagnose_budget"):
        validate("refattn-float64", suite="smoke", cases=["basic-*"], diagnose_budget=0)


def test_recording_keeps_each_case_diagnosed_with_its_times():
    q, k, v = _inputs(3, 5)
    out = textbook_attention(q, k, v, dtype="float64", scale=1.0).out
    with budget.recording() as cases:
        with case_budget(True, 0.0, "small"):
            diagnosis.diagnose(_view(q, k, v, {}), out, limit=1e-6)
        with budget.recording() as inner, case_budget(2.0, 3.0, "judged"):
            pass
    with case_budget(True, 0.0, "unrecorded"):
        pass
    assert [c.name for c in cases] == ["small", "judged"] and [c.name for c in inner] == ["judged"]
    assert cases[0].seconds == budget.FLOOR_SECONDS and cases[0].elapsed > 0
    assert (cases[1].judging, cases[1].seconds) == (3.0, 6.0) and not cases[1].stopped


def test_a_spent_budget_stops_costly_readings_and_says_what_it_tried():
    q, k, v = _inputs(4, 20000)
    assert 4 * 20000 * 32 > CHEAP_WORK  # each reading is a costly one
    out = textbook_attention(q, k, v, dtype="float64", scale=1.0).out
    with case_budget(_SPENT, 0.0, "long") as spent:
        found = diagnosis.diagnose(_view(q, k, v, {}), out, limit=0.0)
    assert found == []  # "no scale (scale=1)" fits, but no reading was evaluated
    with case_budget(True, 10.0, "long"):
        assert "matches no scale (scale=1)" in diagnosis.diagnose(
            _view(q, k, v, {}), out, limit=1e-6
        )
    note = spent.notes(found=False)
    assert len(note) == 1 and note[0].startswith("diagnosis stopped after "), note
    assert (
        "(budget 1x judging): tried 0 of " in note[0] and "on 4 of 4 rows; none matched" in note[0]
    )


def test_cheap_readings_are_tried_whatever_the_budget():
    q, k, v = _inputs(3, 5)
    options = {"causal": True, "align": "top_left"}
    out = textbook_attention(q, k, v, dtype="float64", causal=True, align="bottom_right").out
    with case_budget(_SPENT, 0.0, "small") as spent:
        found = diagnosis.diagnose(_view(q, k, v, options), out, limit=1e-6)
    assert "matches align='bottom_right'" in found
    assert spent.notes(found=True) == []


def test_readings_are_kept_for_the_later_calls_of_the_case(monkeypatch):
    q, k, v = _inputs(3, 70)
    options = {"scale": 0.25}
    out = textbook_attention(q, k, v, dtype="float64", scale=1.0).out
    calls = []
    error = diagnosis._Reading.error
    monkeypatch.setattr(diagnosis._Reading, "error", lambda *a: calls.append(1) or error(*a))
    view = _view(q, k, v, options)
    with case_budget(True, 1.0, "kept"):
        first = diagnosis.diagnose(view, out, limit=1e-6)
        evaluated = len(calls)
        again = diagnosis.diagnose(view, out, limit=1e-9)
    assert first == again == ["matches no scale (scale=1)"]
    assert evaluated > 1 and len(calls) == evaluated


def _no_rescale_loop(w, size):
    """The key-by-block loop the vectorised model replaces (its naive twin)."""
    with np.errstate(divide="ignore"):
        logw = np.log(w)
    blocks = np.arange(w.shape[-1]) // size
    running = np.full(w.shape[:-1], -np.inf)
    factor = np.zeros_like(w)
    for b in range(int(blocks[-1]) + 1):
        cols = blocks == b
        running = np.maximum(running, logw[..., cols].max(axis=-1))
        with np.errstate(over="ignore"):
            factor[..., cols] = np.exp(-running)[..., None]
    return w * np.where(np.isfinite(factor), factor, 0) * w.max(axis=-1, keepdims=True)


def _split_combine_loop(w, size):
    blocks = np.arange(w.shape[-1]) // size
    out = np.zeros_like(w)
    for b in range(int(blocks[-1]) + 1):
        cols = blocks == b
        top = w[..., cols].max(axis=-1, keepdims=True)
        out[..., cols] = np.divide(
            w[..., cols], top, out=np.zeros_like(w[..., cols]), where=top > 0
        )
    total = out.sum(axis=-1, keepdims=True)
    return np.divide(out, total, out=np.zeros_like(out), where=total > 0)


@pytest.mark.parametrize("S", [1, 63, 64, 130, 1000])
def test_vectorised_kernel_models_equal_their_loops(S):
    rng = np.random.default_rng(S)
    w = rng.random((2, 3, S)) * (rng.random((2, 3, S)) < 0.7)
    w[0, 0] = 0.0  # a row with no weight
    w /= np.maximum(w.sum(axis=-1, keepdims=True), 1e-300)
    for size in (64, 128):
        np.testing.assert_array_equal(tiles.no_rescale_weights(size)(w), _no_rescale_loop(w, size))
        np.testing.assert_array_equal(
            tiles.split_combine_weights(size)(w), _split_combine_loop(w, size)
        )


def test_progress_notes_on_a_log_and_a_disabled_bar():
    stream = io.StringIO()
    with Progress(4, "run", stream=stream) as bar:
        bar.advance("a: pass")
        bar.note("diagnosing b: reading 3 of 9")
        bar.note("diagnosing b: reading 4 of 9")  # within NOTE_EVERY seconds: not logged
    lines = stream.getvalue().splitlines()
    assert lines[-1].endswith("1/4  diagnosing b: reading 3 of 9 (3 left)"), lines
    assert len(lines) == 2
    quiet = io.StringIO()
    with Progress(4, "run", enabled=False, stream=quiet) as bar:
        bar.note("diagnosing b")
    assert quiet.getvalue() == ""


def test_validate_shows_the_diagnosis_of_an_isolated_case(capsys):
    report = validate(
        "tests.planted.broken_impls:missing_scale",
        suite="smoke",
        dtype="float32",
        cases=["basic-*"],
        progress=True,
    )
    assert [r.verdict for r in report.results] == ["fail"]
    err = capsys.readouterr().err
    assert "diagnosing basic-" in err and "(1 left)" in err, err


def test_cli_refuses_a_bad_budget(capsys):
    code = main(
        ["validate", "--adapter", "refattn-float64", "--suite", "smoke", "--diagnose-budget", "0"]
    )
    assert code == 2 and "--diagnose-budget" in capsys.readouterr().err


@pytest.mark.parametrize(
    "options",
    [
        {"causal": True, "align": "bottom_right", "alibi_slopes": np.array([0.5, 0.25])},
        {"window": (3, 2), "bias": "rows", "dropout_p": 0.25, "dropout_mask": "rows"},
        {"mask": "rows", "softcap": 2.0, "bias": "rows", "empty_rows": "zero"},
    ],
)
def test_every_reading_on_a_row_sample_is_the_whole_reading_on_those_rows(options):
    L, S = 80, 150
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, L, 8))
    k, v = rng.standard_normal((2, 1, S, 8))
    rows_shape = (1, 2, L, S)
    for name, value in list(options.items()):
        if isinstance(value, str) and value == "rows":  # a per-row array of the case shape
            drawn = rng.random(rows_shape)
            options[name] = drawn < 0.8 if "mask" in name else rng.standard_normal(rows_shape)
    if "mask" in options:
        options["mask"][..., 5, :] = False  # an empty row
    out = textbook_attention(q, k, v, dtype="float64", **options).out
    setup = diagnosis._CaseSetup(_view(q, k, v, options))
    reading = diagnosis._Reading(q, k, v, options, out, setup, "float32")
    view = sample.RowView(np.array([0, 5, 6, 40, 63, 64, 79]), L, S)
    for alt in setup.candidates:
        opts, extras = alt.apply(dict(options), {})
        whole, part = reading.error(opts, extras), reading.error(opts, extras, view)
        np.testing.assert_array_equal(part, view.output(whole), err_msg=alt.label)


def test_the_first_costly_match_ends_the_search(monkeypatch):
    q, k, v = _inputs(4, 20000)
    out = textbook_attention(q, k, v, dtype="float64", scale=1.0).out
    labels = []
    error = diagnosis._Reading.error

    def counted(self, opts, extras, view=None):
        labels.append("drop_keys" in extras)
        return error(self, opts, extras, view)

    monkeypatch.setattr(diagnosis._Reading, "error", counted)
    view = _view(q, k, v, {})
    with case_budget(math.inf, 1.0, "long"):
        found = diagnosis.diagnose(view, out, limit=1e-6)
        setup = next(iter(budget.current().memo.values()))[0]
    assert found == ["matches no scale (scale=1)"]
    # the readings dropping keys come after the named ones: none of them was evaluated
    assert not any(labels) and len(labels) < len(setup.candidates)
    with case_budget(math.inf, 1.0, "long"):  # explained already: the costly ones not searched
        assert diagnosis.diagnose(view, out, limit=1e-6, costly=False) == []


def test_steps_outside_the_readings_draw_on_the_budget_and_are_named():
    spent = budget.CaseBudget(DiagnosisBudget(multiple=2.0), 10.0, "c")
    spent.measured(CHEAP_WORK * 2, 2.0)  # one second per CHEAP_WORK multiply-adds
    spent.reserve("narrow accumulation", CHEAP_WORK * 9)  # nine seconds kept
    assert not spent.allows(CHEAP_WORK * 2) and spent.allows(CHEAP_WORK)  # cheap: always
    assert spent.step("concentration", CHEAP_WORK)  # cheap
    assert spent.step("narrow accumulation", CHEAP_WORK * 9)  # its reservation is its own
    assert not spent.step("lower precision", CHEAP_WORK * 20)
    note = spent.notes(found=False)
    assert len(note) == 1, note
    assert (
        "tried 0 of 0 readings, concentration, narrow accumulation; skipped lower precision; "
        "none matched" in note[0]
    ), note


def test_fp4_readings_are_within_the_budget(monkeypatch):
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (1, 1, 8, 32)).astype(np.uint8)
    inputs = {
        "q": rng.standard_normal((1, 1, 2, 32)).astype(np.float32),
        "k": codes.view(ml_dtypes.float4_e2m1fn),
        "k_block_scale": np.ones((1, 1, 8, 2), ml_dtypes.float8_e4m3fn),
        "v": rng.standard_normal((1, 1, 8, 32)).astype(np.float32),
    }
    out = np.zeros((1, 1, 2, 32))
    monkeypatch.setattr(budget, "CHEAP_WORK", 0)  # every fp4 reading a costly one
    with case_budget(_SPENT, 0.0, "fp4") as spent:
        assert diagnose_fp4(inputs, {}, out, limit=0.0, dtype="float32") == []
    assert spent.steps == {"fp4 readings": False}
    assert "skipped fp4 readings" in spent.notes(found=False)[0]
