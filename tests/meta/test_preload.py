"""A worker preloaded by `refattn-oracle validate` (oracle.cli.early,
oracle.run.supervise.preload_worker) is taken over by the first supervisor without a memory
limit and with the same sys.path, and stopped otherwise."""

from __future__ import annotations

import sys

from oracle import catalogue
from oracle.fixtures import golden
from oracle.run import supervise


def _preloaded_process():
    supervise.preload_worker()
    return supervise._PRELOADED[0][1][0]


def test_the_first_supervisor_takes_the_preloaded_worker_over():
    process = _preloaded_process()
    fixture = golden.build(catalogue.get("basic-H2K2-L5S7-D8E8-f64"))
    with supervise.Supervisor("refattn-float64", timeout=120) as worker:
        assert worker.run(fixture).verdict == "pass"
        assert worker._process is process and not supervise._PRELOADED


def test_a_memory_limit_starts_a_fresh_worker():
    process = _preloaded_process()
    with supervise.Supervisor("refattn-float64", timeout=120, memory_limit=2**36) as worker:
        assert worker.start() is None and worker._process is not process
    assert supervise._PRELOADED  # still there for a supervisor without a limit
    supervise._discard_preloaded()
    assert process.poll() is not None


def test_another_sys_path_stops_the_preloaded_worker(monkeypatch, tmp_path):
    process = _preloaded_process()
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    with supervise.Supervisor("refattn-float64", timeout=120) as worker:
        assert worker.start() is None and worker._process is not process
    assert not supervise._PRELOADED and process.poll() is not None
