"""tools/compare_thresholds.py classifies each element's threshold change as it says."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from oracle.fixtures import golden

GROUPS = ("forward", "grads")
TOOL = Path(__file__).resolve().parents[2] / "tools" / "compare_thresholds.py"


def _tool():
    spec = importlib.util.spec_from_file_location("compare_thresholds", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_elements_are_classified_identical_changed_gained_or_other(tmp_path):
    old = {
        "c|default|out": np.array([1.0, 2.0, np.nan, np.inf, 4.0]),
        "c|default|dq": np.array([1.0, np.nan]),
    }
    new = {
        "c|default|out": np.array([1.0, 1.5, 3.0, 0.0, np.nan]),
        "c|default|dq": np.array([1.0, np.nan]),
    }
    for name, arrays in (("old", old), ("new", new)):
        np.savez(tmp_path / f"{name}.npz", meta=np.array(json.dumps({})), **arrays)
    found = _tool().compare(tmp_path / "old.npz", tmp_path / "new.npz", {"c": "float32"})
    forward = found["rows"]["float32|default|forward"]
    assert forward["elements"] == 5 and forward["identical"] == 1
    assert forward["finite_changed"] == 1 and forward["stricter"] == 1
    assert forward["max_rel_change"] == 0.25
    assert forward["old_nonfinite_new_finite"] == 2 and forward["other"] == 1
    grads = found["rows"]["float32|default|grads"]
    assert grads["identical"] == 2 and grads["elements"] == 2  # the same NaN bits
    (change,) = found["changes"]
    assert change["key"] == "c|default|out" and change["index"] == [1]
    assert (change["old"], change["new"]) == (2.0, 1.5)


@pytest.mark.slow
def test_a_tree_compared_with_itself_is_identical_everywhere(tmp_path):
    fixtures = golden.generate("smoke", tmp_path / "fixtures", dtypes=["float64"], progress=False)
    root = str(TOOL.parents[1])
    report = tmp_path / "report.json"
    argv = ["--old", root, "--new", root, "--fixtures", str(fixtures), "--json", str(report)]
    assert _tool().main(argv) == 0
    rows = json.loads(report.read_text())["rows"]
    assert set(rows) == {f"float64|{t}|{g}" for t in ("default", "tight") for g in GROUPS}
    for row in rows.values():
        assert row["elements"] > 0 and row["identical"] == row["elements"], row
