"""The one-line message before a first Numba compile (stderr, once per process, silent when
the kernels are already cached for this CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from refattn.kernels import COMPILE_MESSAGE

ROOT = Path(__file__).resolve().parents[2]

TINY = textwrap.dedent("""
    from numba import njit

    @njit(parallel=True, cache=True)
    def entry_forward(x):
        return x + 1.0
""")

RUN = (
    "import tiny_kernels as m; from refattn.kernels import announce_compile; "
    "announce_compile(m); announce_compile(m); print(m.entry_forward(1.0))"
)


def _run(tmp_path):
    env = dict(
        os.environ,
        NUMBA_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
    )
    env.pop("NUMBA_DISABLE_JIT", None)
    return subprocess.run(
        [sys.executable, "-c", RUN],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )


def test_message_once_before_compile_and_silent_when_cached(tmp_path):
    (tmp_path / "tiny_kernels.py").write_text(TINY)
    first = _run(tmp_path)
    assert first.stderr.count(COMPILE_MESSAGE) == 1, first.stderr
    assert first.stdout.strip() == "2.0"
    second = _run(tmp_path)
    assert COMPILE_MESSAGE not in second.stderr, second.stderr
