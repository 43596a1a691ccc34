"""tools/bench_linear.py's figures run end to end on a tiny shape and label what they measured."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_linear.py"
TINY = ["--length", "16", "--heads", "2", "--dim", "4", "--decode-heads", "2", "--repeat", "1"]


def _tool():
    spec = importlib.util.spec_from_file_location("bench_linear", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.slow
def test_exact_figures_print_the_measured_subset(capsys):
    _tool().main([*TINY, "--exact-prefill", "--exact-decode", "--exact-length", "4"])
    out = capsys.readouterr().out
    assert "exact B1 H1 T4 D=E=4 (subset, measured, one run)" in out, out
    assert "numba B1 H2 T16 D=E=4:" in out and "per (head, step)" in out, out
    assert "exact B1 H2 T1 D=E=4 (measured, best of" in out, out
    assert "GDN prefill" not in out  # a figure flag runs that figure only


@pytest.mark.slow
@pytest.mark.peers("torch", "transformers")
def test_transformers_figure_runs_both_functions(capsys):
    _tool().main([*TINY, "--transformers", "--threads", "1"])
    out = capsys.readouterr().out
    for name in ("refattn numba-chunked", "torch_recurrent", "torch_chunk"):
        assert f"transformers: transformers {name}" in out or f"transformers: {name}" in out, out
    assert "threads 1" in out, out
