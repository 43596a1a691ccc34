"""Supervised workers forked from a loaded process, and fixtures read by the worker.

:mod:`oracle.run.forked` (a worker that is a fork of the validating process, not a fresh
interpreter) and :mod:`oracle.run.stored` (the cases of a fixture directory read by the worker
and answered as a stream) must keep every verdict and the isolation of single cases: an
implementation that exits, crashes or hangs costs its case an "error" and the run goes on.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from oracle import catalogue
from oracle.fixtures import golden
from oracle.run.forked import FORK_VARIABLE, fork_problem
from oracle.run.validate import validate

ROOT = Path(__file__).resolve().parents[2]
#: basic, causal (the planted implementation exits on it), then one more after it
CASES = (
    "basic-H2K2-L5S7-D8E8-f32",
    "causal-br-H2K2-L4S7-D8E8-f32",
    "gqa-interleave-H4K2-L5S6-D8E8-f32",
)


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    out = tmp_path_factory.mktemp("fork-fixtures")
    return golden.generate(
        "smoke", out, progress=False, cases=[catalogue.get(name) for name in CASES]
    )


def _table(report) -> list:
    """The results without their times and reproduce commands (fixtures in memory have no
    directory to name)."""
    skip = ("seconds", "reproduce")
    return [{k: v for k, v in r.to_dict().items() if k not in skip} for r in report.results]


def test_cases_read_by_the_worker_judge_as_fixtures_read_here(directory):
    """A directory's cases read by the worker (a stream) give the results, features and
    messages of the same fixtures read here and sent one by one; a case that ends the worker
    is an "error" and a new worker takes the next case."""
    impl = "tests.planted.plugin_impls:exits_on_causal"
    stored = validate(impl, fixtures=directory, dtype="float32", progress=False, timeout=60)
    fixtures = list(golden.load(directory))
    sent = validate(impl, fixtures=fixtures, dtype="float32", progress=False, timeout=60)
    assert [r.verdict for r in stored.results] == ["pass", "error", "pass"]
    assert "exited with code 3" in stored.results[1].message
    assert _table(stored) == _table(sent)
    assert stored.results[1].features == ["causal", "align-bottom-right"]
    assert f"--fixtures {directory} " in stored.results[1].reproduce


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux")
@pytest.mark.parametrize(
    ("impl", "reason"), [("hangs_on_causal", "timeout"), ("segfaults_on_causal", "SIGSEGV")]
)
def test_a_hang_or_crash_in_a_read_case_is_that_cases_error(directory, impl, reason):
    """Cases read by the worker answer in one message each: a case that hangs or crashes
    the worker before its answer is still that case's "error" (with its own features, read
    here), and a new worker judges the next case."""
    report = validate(
        f"tests.planted.plugin_impls:{impl}",
        fixtures=directory,
        dtype="float32",
        progress=False,
        timeout=5,
    )
    assert [r.verdict for r in report.results] == ["pass", "error", "pass"]
    assert reason in report.results[1].message
    assert [r.features for r in report.results] == [[], ["causal", "align-bottom-right"], ["gqa"]]
    assert report.results[1].shape_classes == ["L<S"]


def test_an_unreadable_fixture_raises_where_the_run_reaches_it(directory, tmp_path):
    """A fixture the worker cannot read raises its FixtureError, as reading it here would."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in directory.iterdir():
        if path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    damaged = sorted(copy.glob("causal-*.npz"))[0]
    damaged.write_bytes(damaged.read_bytes()[:-7] + b"\0" * 7)
    with pytest.raises(golden.FixtureError, match="does not match its sha256"):
        validate("refattn-float64", fixtures=copy, dtype="float32", progress=False, timeout=60)


def test_fork_problem_names_each_condition(monkeypatch):
    """No fork under a memory limit, with another thread running, or when turned off."""
    assert "memory limit" in fork_problem(memory_limit=2**30)
    monkeypatch.setenv(FORK_VARIABLE, "0")
    assert "off" in fork_problem()
    monkeypatch.delenv(FORK_VARIABLE)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert fork_problem() == "this process runs other threads"
    finally:
        stop.set()
        thread.join()


def test_a_forked_worker_keeps_the_memory_it_frees():
    """glibc's mallopt takes the thresholds (in a fresh interpreter: this one keeps its own)."""
    script = "from oracle.run.forked import keep_freed_memory; print(keep_freed_memory())"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert done.stdout.strip() in (("True",) if glibc else ("True", "False"))


_SCRIPT = """
import json, sys
from oracle.fixtures import golden
from oracle.run.supervise import Supervisor
fixtures = list(golden.load(sys.argv[1]))
found = {}
for name in ("good", "calls_os_exit", "segfaults", "hangs", "calls_sys_exit"):
    timeout = 3 if name == "hangs" else 120  # a first case may take seconds on a busy machine
    with Supervisor("tests.planted.fuzz_impls:" + name, timeout=timeout) as supervisor:
        results = [supervisor.run(f) for f in fixtures[:2]]
        found[name] = [supervisor.forked, supervisor.starts, [r.verdict for r in results],
                       results[0].message]
print(json.dumps(found))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux")
def test_forked_workers_isolate_exits_crashes_and_hangs(directory):
    """In a process that may fork (a fresh one that read fixtures), the worker is a fork, and
    an exit, a segfault or a hang is that case's "error"; the next case gets a new worker."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(FORK_VARIABLE, None)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(directory)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["good"][:3] == [True, 1, ["pass", "pass"]]
    for name, reason in (
        ("calls_os_exit", "exited with code 0"),
        ("segfaults", "SIGSEGV"),
        ("hangs", "timeout"),
        ("calls_sys_exit", "exit(0)"),
    ):
        forked, starts, verdicts, message = found[name]
        assert forked and verdicts == ["error", "error"], (name, found[name])
        assert reason in message, (name, message)
        assert starts == (1 if name == "calls_sys_exit" else 2), (name, starts)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux")
def test_cli_with_a_forked_worker_reports_every_case(directory, tmp_path):
    """``refattn-oracle validate`` over a directory (forked worker, cases read by it): the case
    that ends the worker is an "error", the others are judged, exit 1 with a report."""
    report = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(FORK_VARIABLE, None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "oracle",
            "validate",
            "--impl",
            "tests.planted.plugin_impls:exits_on_causal",
            "--fixtures",
            str(directory),
            "--quiet",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    results = json.loads(report.read_text())["results"]
    assert [(r["name"], r["verdict"]) for r in results] == list(
        zip(CASES, ["pass", "error", "pass"], strict=True)
    )


def test_parts_read_ahead_are_taken_once_and_checked(directory, tmp_path, monkeypatch):
    """A judging part read ahead from the disk cache (the worker's reading thread) is taken by
    the case's judging_part as a disk read would be: checked by ``valid``, recomputed when
    refused, and not kept once taken or forgotten."""
    from oracle.judging import parts
    from oracle.reading.case import fixture_key

    monkeypatch.setenv(parts.CACHE_VARIABLE, str(tmp_path / "cache"))
    parts.clear_memory()
    fixture = next(golden.load(directory, names=[CASES[0]]))
    key = fixture_key(fixture)
    computed = []

    def compute():
        computed.append(1)
        return {"x": np.arange(3.0)}

    parts.judging_part(fixture, key, "demo", compute, lambda found: True)
    parts.clear_memory()
    parts.read_ahead(fixture, key, ["demo", "absent"])
    assert set(parts._AHEAD) == {(key, "demo")}
    found = parts.judging_part(fixture, key, "demo", compute, lambda found: True)
    assert computed == [1] and found["x"].tolist() == [0.0, 1.0, 2.0] and not parts._AHEAD
    parts.clear_memory()
    parts.read_ahead(fixture, key, ["demo"])
    parts.judging_part(fixture, key, "demo", compute, lambda found: False)
    assert computed == [1, 1] and not parts._AHEAD
    parts.clear_memory()
    parts.read_ahead(fixture, key, ["demo"])
    parts.forget_ahead(key, ["demo"])
    assert not parts._AHEAD
    parts.clear_memory()
