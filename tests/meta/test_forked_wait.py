""":meth:`oracle.run.forked.ForkedProcess.wait`: ends as the child exits, or at its timeout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from oracle.run.forked import ForkedProcess


def _child(code: str) -> ForkedProcess:
    """A child of this process (its exit status read by :class:`ForkedProcess` only)."""
    return ForkedProcess(os.posix_spawn(sys.executable, [sys.executable, "-c", code], os.environ))


@pytest.fixture(params=["process descriptor", "polling"])
def waiting(request, monkeypatch):
    if request.param == "polling":
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    return request.param


def test_wait_returns_the_exit_code(waiting):
    assert _child("import sys; sys.exit(7)").wait(60) == 7


def test_wait_times_out_then_a_killed_child_is_reaped(waiting):
    child = _child("import time; time.sleep(120)")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.05)
    assert child.returncode is None
    child.kill()
    assert child.wait(60) == -9
