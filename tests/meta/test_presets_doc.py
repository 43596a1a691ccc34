"""Every python block of docs/presets-2026.md runs (the preset examples)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.peers("torch")

DOC = Path(__file__).resolve().parents[2] / "docs" / "presets-2026.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
SLOW = ("flashmla_sparse", "merge-default")


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, marks=pytest.mark.slow) if any(s in b for s in SLOW) else b for b in BLOCKS],
    ids=[re.findall(r'"(flash\w+)"', b)[0] for b in BLOCKS],
)
def test_doc_example_runs(block):
    exec(compile(block, str(DOC), "exec"), {})
