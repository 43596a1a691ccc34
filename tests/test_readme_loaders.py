"""README checks: the torch / JAX fixture loaders read bfloat16 correctly; CI runs command 2.

The loaders are taken from docs/fixtures.md itself (so the documented loader is the tested one)
and run on a bfloat16 smoke fixture; every member must equal ``oracle.load``'s value bit for
bit. Skipped when torch / JAX are absent (they are not in the test extra).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from oracle.fixtures import golden

README = Path(__file__).resolve().parent.parent / "README.md"
FIXTURES_PAGE = README.parent / "docs" / "fixtures.md"
SECTION = "## Using the fixtures from torch / JAX"


def _section() -> str:
    text = FIXTURES_PAGE.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    end = len(text) if end < 0 else end
    return text[start:end]


@pytest.fixture(scope="module")
def bf16_fixture(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16")
    golden.generate("smoke", out, dtypes=["bfloat16"], progress=False)
    fixture = next(iter(golden.load(out)))
    path = out / f"{fixture.case.name}.npz"
    if not path.exists():  # the manifest names the file
        entry = json.loads((out / "manifest.json").read_text())["cases"][0]
        path = out / entry["file"]
    return path, fixture


def _expected(fixture):
    members = {f"inputs/{n}": a for n, a in fixture.inputs.items()}
    members.update({f"truth/{n}": a for n, a in fixture.truth.items()})
    return members


@pytest.mark.peers("torch")
def test_torch_loader_reads_bfloat16_bits(bf16_fixture):
    torch = pytest.importorskip("torch")
    block = re.search(r"```python\n(.*?)```", _section(), re.S).group(1)
    namespace: dict = {}
    exec(compile(block, str(FIXTURES_PAGE), "exec"), namespace)  # noqa: S102 (the page's own code)
    path, fixture = bf16_fixture
    loaded = namespace["load_case"](path)
    expected = _expected(fixture)
    assert set(loaded) == set(expected)
    assert any(t.dtype == torch.bfloat16 for t in loaded.values()), "no bfloat16 member"
    for name, want in expected.items():
        got = loaded[name]
        if got.dtype == torch.bfloat16:
            got = got.float().numpy()
            want = np.asarray(want, dtype=np.float32)
        else:
            got = got.numpy()
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.peers("jax")
def test_jax_conversion_reads_bfloat16_bits(bf16_fixture):
    jnp = pytest.importorskip("jax.numpy")
    line = re.search(r"`(jnp\.asarray\(npz\[n\].*?)`", _section()).group(1)
    path, fixture = bf16_fixture
    with np.load(path, allow_pickle=False) as npz:
        bf16 = json.loads(str(npz["meta"]))["bfloat16"]
        assert bf16, "the fixture has no bfloat16 member"
        loaded = {
            n: eval(line, {"jnp": jnp, "npz": npz, "bf16": bf16, "n": n})  # noqa: S307
            for n in npz.files
            if n.startswith(("inputs/", "truth/"))
        }
    for name, want in _expected(fixture).items():
        got = loaded[name]
        if got.dtype == jnp.bfloat16:
            assert np.asarray(want).dtype.name == "bfloat16", name
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        else:  # JAX keeps float64 only with jax_enable_x64 (docs/fixtures.md says so)
            want = np.asarray(want).astype(got.dtype)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)


def test_ci_runs_readme_command_2_exactly():
    """`.ci/run` runs the README's command 2 character for character (issue #11 item 1)."""
    text = README.read_text()
    block = text[text.index("# 2. install the test extras") :]
    command = block.splitlines()[1]
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert command == 'python -m pip install -e ".[test]" && python -m pytest'
    assert command in ci, f".ci/run does not run {command!r}"
    assert "set -euo pipefail" in ci
