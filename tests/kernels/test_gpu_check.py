"""The prepared GPU script (tools/gpu_check.py), rehearsed on the numba.cuda simulator.

A real GPU run costs scarce device time, so the script is exercised here first on a CPU:
NUMBA_ENABLE_CUDASIM=1, torch on the CPU, one tiny case family, every phase. The run must
exit 0 and leave a summary with every phase in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.cudasim
def test_gpu_check_rehearsal(tmp_path):
    pytest.importorskip("torch")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_check.py"),
            "--rehearse",
            "--case",
            "basic-*-f32",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    phases = summary["phases"]
    assert set(phases) >= {"kernels", "ptx", "agreement", "torch", "timing"}
    assert summary["kernels_passed"] is True
    assert phases["agreement"]["cases"] >= 1
    assert phases["agreement"]["nondeterministic_cases"] == 0
    assert phases["torch"]["sdpa_math/float32/default"]["conformance"]["fail"] == 0


def test_gpu_check_refuses_bad_arguments(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_check.py"),
            "--phases",
            "nope",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "--phases" in run.stderr
