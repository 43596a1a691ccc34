"""The pytest plugin (issue 25, item 8): each case runs supervised (an implementation that ends
its process makes that case an error, not the end of the session), the coverage table is
printed at the end, and ``--refattn-require`` fails a session that judged no case of a
feature."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.meta.test_validate import ROOT, _plugin_args

_BASE = ("--pyargs", "oracle", "-q", "--refattn-suite", "smoke", "--refattn-dtype", "float32")
_TWO = ("-k", "basic or causal")  # two smoke cases: one passes, one is causal


def _pytest(*args):
    """A nested pytest in one process (tests/conftest.py adds ``-n 0``); each run starts a
    supervised worker, hence the generous timeout on a loaded machine."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("REFATTN_IMPL", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_plugin_runs_cases_supervised_and_prints_coverage():
    run = _pytest(
        *_plugin_args(),
        *_BASE,
        *_TWO,
        "--refattn-impl",
        "tests.planted.plugin_impls:exits_on_causal",
    )
    text = run.stdout
    assert run.returncode == 1, text
    assert "1 failed, 1 passed" in text and "refattn oracle coverage" in text, text
    assert "the worker exited with code 3" in text, text
    assert "Coverage (cases judged / unsupported / error)" in text, text


@pytest.mark.slow
def test_plugin_honours_require(tmp_path):
    skips = tmp_path / "skips.txt"
    skips.write_text("*causal*\n")
    args = (*_plugin_args(), *_BASE, *_TWO, "--refattn-impl", "tests.planted.broken_impls:textbook")
    run = _pytest(*args, "--refattn-skips", str(skips), "--refattn-require", "causal")
    assert run.returncode == 1, run.stdout
    assert "FAILED: required by --require: causal" in run.stdout, run.stdout
    ok = _pytest(*args, "--refattn-require", "causal")
    assert ok.returncode == 0, ok.stdout
    bad = _pytest(*args, "--refattn-require", "no-such-feature")
    assert bad.returncode != 0 and "--refattn-require" in bad.stdout + bad.stderr
