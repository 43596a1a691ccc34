"""Every code block of README.md and docs/ runs: the documented code is the tested code.

* ```` ```python ```` blocks run in a temporary directory (one per block) that holds the smoke
  fixtures as ``fixtures/`` and ``fixtures-smoke/`` (generated once per session);
* ```` ```bash ```` blocks: their ``refattn-oracle`` command lines run (``python -m oracle``,
  this tree) with smoke-sized inputs: every ``--suite`` becomes the smoke suite of its family,
  ``--fixtures`` the session's smoke fixtures, ``--out`` and report files land in the temporary
  directory (a smoke ``generate`` starts from a copy of the session's fixtures and resumes
  them), a ``--case`` pattern no smoke case matches is dropped, ``[optional flags]`` are
  kept without their brackets. Lines that are not ``refattn-oracle`` commands (pip, pytest,
  tools) do not run. ``validate`` and ``power`` may exit with 1 (a case failed, a planted bug
  caught by too few smoke cases); any other command must exit with 0, none with 2;
* a block right after ``<!-- requires: torch -->`` (comma list) is skipped when a package is
  absent; ``<!-- not-run: reason -->`` marks a block that cannot run here (your own kernel
  module, a GPU, a Dask cluster, an export directory), and the reason is shown as the skip.

Blocks are named ``<file>:<line>`` (the fence's line).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from oracle import catalogue
from oracle.fixtures import golden

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*(requires|not-run):\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
# suites with a smoke-sized member of the same family
SMOKE_OF = {"variants": "variants-smoke", "merge": "merge-smoke"}


def _blocks() -> list:
    """(id, language, code, markers) of every fenced block of the pages."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        index = 0
        while index < len(lines):
            match = FENCE.match(lines[index])
            if not match:
                index += 1
                continue
            start, language = index, match.group(1)
            end = next(j for j in range(start + 1, len(lines)) if lines[j].startswith("```"))
            markers = {}
            back = start - 1
            while back >= 0 and not lines[back].strip():
                back -= 1
            while back >= 0 and MARKER.search(lines[back]):
                kind, value = MARKER.search(lines[back]).groups()
                markers[kind] = value
                back -= 1
            code = "\n".join(lines[start + 1 : end]) + "\n"
            found.append((f"{page.relative_to(ROOT)}:{start + 1}", language, code, markers))
            index = end + 1
    return found


BLOCKS = _blocks()


def _oracle_commands(code: str) -> list[list[str]]:
    """The refattn-oracle command lines of a bash block, continuations joined, comments cut."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        line = line.strip()
        if not line.startswith("refattn-oracle "):
            continue
        words = shlex.split(line.replace("[", " ").replace("]", " "), comments=True)
        commands.append(words[1:])
    return commands


def _smoke_suite(name: str) -> str:
    family = name.split("-")[0]
    return SMOKE_OF.get(family, "smoke")


def _smoke_args(args: list[str], fixtures: Path, tmp: Path) -> list[str]:
    """A documented command made smoke-sized (see the module docstring)."""
    names = [c.name.lower() for c in catalogue.suite("smoke")]
    out, index = [], 0
    while index < len(args):
        word = args[index]
        value = args[index + 1] if index + 1 < len(args) else None
        if word == "--suite":
            out += [word, _smoke_suite(value)]
        elif word == "--fixtures" or (word == "verify" and value and not value.startswith("-")):
            out += [word, str(fixtures)]
        elif word == "--out":
            out += [word, str(tmp / f"out-{Path(value).name}")]
        elif word in ("--json", "--junit", "--html"):
            out += [word, str(tmp / Path(value).name)]
        elif word == "--case":
            if any(fnmatch.fnmatchcase(n, value.lower()) for n in names):
                out += [word, value]
        else:
            out.append(word)
            index += 1
            continue
        index += 2
    return out


@pytest.fixture(scope="session")
def smoke_fixtures(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs-fixtures") / "fixtures"
    golden.generate("smoke", out, progress=False)
    return out


@pytest.fixture
def workdir(tmp_path, smoke_fixtures, monkeypatch) -> Path:
    for name in ("fixtures", "fixtures-smoke"):
        (tmp_path / name).symlink_to(smoke_fixtures, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    return tmp_path


def _skip_unless_runnable(markers: dict) -> None:
    if "not-run" in markers:
        pytest.skip(f"not run: {markers['not-run']}")
    for package in filter(None, (p.strip() for p in markers.get("requires", "").split(","))):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"needs {package}")


def test_every_block_is_found_and_labelled():
    """Every fence names its language, and every marker is followed by a block."""
    assert len(BLOCKS) > 20
    unlabelled = [block_id for block_id, language, _, _ in BLOCKS if not language]
    assert not unlabelled, f"fences without a language: {unlabelled}"


@pytest.mark.parametrize(
    "block_id,code,markers",
    [(b, c, m) for b, language, c, m in BLOCKS if language == "python"],
    ids=[b for b, language, _, _ in BLOCKS if language == "python"],
)
def test_python_block_runs(block_id, code, markers, workdir):
    _skip_unless_runnable(markers)
    namespace = {"__name__": "__docs__"}
    exec(compile(code, block_id, "exec"), namespace)  # noqa: S102 - the documentation's own code


_BASH = [(b, c, m) for b, language, c, m in BLOCKS if language == "bash" and _oracle_commands(c)]


@pytest.mark.parametrize("block_id,code,markers", _BASH, ids=[b for b, _, _ in _BASH])
def test_bash_block_runs(block_id, code, markers, workdir, smoke_fixtures):
    _skip_unless_runnable(markers)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for args in _oracle_commands(code):
        command = _smoke_args(args, smoke_fixtures, workdir)
        if command[:1] == ["generate"] and command[command.index("--suite") + 1] == "smoke":
            # the session's fixtures copied in first: the command resumes them (a rerun into
            # a directory checks what is there) instead of computing every truth again
            out = Path(command[command.index("--out") + 1])
            if not out.exists():
                shutil.copytree(smoke_fixtures, out)
        done = subprocess.run(
            [sys.executable, "-m", "oracle", *command],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        allowed = (0, 1) if command[0] in ("validate", "power") else (0,)
        assert done.returncode in allowed, (
            f"{block_id}: refattn-oracle {' '.join(command)} exited {done.returncode}\n"
            f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
        assert "Traceback" not in done.stderr, f"{block_id}: {done.stderr[-2000:]}"
