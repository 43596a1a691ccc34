"""What a validation run no longer pays for, with its answers unchanged: a fixture file checked
before is not hashed again until it changes (oracle.fixtures.verified), a run reads the specs
of the selected cases only, the JSON report puts each result on one line, and a closed worker
exits while the report is written. (``import oracle.cli`` loading neither mpmath nor the
variants: tests/meta/test_lazy_numba.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from oracle import catalogue
from oracle.fixtures import golden, verified
from oracle.run import supervise
from oracle.run.validate import validate

SMALL = "causal-br-H2K2-L4S7-D8E8-f32"
OTHER = "basic-H2K2-L5S7-D8E8-f32"
ROOT = Path(__file__).resolve().parents[2]


class _Counting:
    """hashlib, counting the sha256 calls."""

    def __init__(self):
        self.calls = 0

    def sha256(self, *data):
        self.calls += 1
        return hashlib.sha256(*data)

    def __getattr__(self, name):
        return getattr(hashlib, name)


@pytest.fixture()
def directory(tmp_path, monkeypatch):
    monkeypatch.delenv("REFATTN_CACHE", raising=False)
    golden.generate(
        "default", tmp_path, cases=[catalogue.get(n) for n in (SMALL, OTHER)], progress=False
    )
    for path in tmp_path.glob("*.npz"):
        os.utime(path, ns=(0, 0))  # written long ago: settled (verified.SETTLE)
    (tmp_path / ".judge-cache").mkdir(exist_ok=True)  # as a validation's first run leaves it
    return tmp_path


def test_a_checked_file_is_hashed_again_only_when_it_changed(directory, monkeypatch):
    counting = _Counting()
    monkeypatch.setattr(verified, "hashlib", counting)
    first = {f.case.name: f for f in golden.load(directory)}
    assert counting.calls == 2 and (directory / ".judge-cache" / verified.RECORD).is_file()
    again = {f.case.name: f for f in golden.load(directory)}
    assert counting.calls == 2  # both unchanged: not hashed
    for name, fixture in again.items():
        assert fixture.verified_sha256 == first[name].verified_sha256
        assert fixture.truth["out"].tobytes() == first[name].truth["out"].tobytes()
    # one bit flipped in place, same size, times set back: its change time moved
    path = directory / f"{SMALL}.npz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(0, 0))
    with pytest.raises(golden.FixtureError, match="does not match its sha256"):
        list(golden.load(directory, names=[SMALL]))
    assert golden.verify(directory)  # verify hashes every file, whatever the record says


def test_a_load_creates_no_cache_folder(directory, monkeypatch):
    (directory / ".judge-cache").rmdir()
    counting = _Counting()
    monkeypatch.setattr(verified, "hashlib", counting)
    for _ in range(2):
        list(golden.load(directory))
    assert counting.calls == 4 and not (directory / ".judge-cache").exists()


def test_a_file_written_just_now_is_not_recorded(directory, monkeypatch):
    counting = _Counting()
    monkeypatch.setattr(verified, "hashlib", counting)
    os.utime(directory / f"{SMALL}.npz")  # modified now: the same tick may hide a rewrite
    list(golden.load(directory, names=[SMALL]))
    list(golden.load(directory, names=[SMALL]))
    assert counting.calls == 2


def test_without_a_cache_folder_every_file_is_hashed(directory, monkeypatch):
    counting = _Counting()
    monkeypatch.setattr(verified, "hashlib", counting)
    monkeypatch.setenv("REFATTN_CACHE", "off")
    for _ in range(2):
        list(golden.load(directory))
    assert counting.calls == 4 and not (directory / ".judge-cache" / verified.RECORD).exists()


def test_a_foreign_record_is_an_empty_one(directory):
    record = directory / ".judge-cache" / verified.RECORD
    record.write_text("[1, 2]")
    assert len(list(golden.load(directory))) == 2
    assert json.loads(record.read_text())["version"] == 1  # written again, readable


def test_a_kept_manifest_follows_its_file(directory):
    first, _ = golden.read_manifest(directory, kept=True)
    again, _ = golden.read_manifest(directory, kept=True)
    assert again is first  # parsed once
    manifest = json.loads((directory / golden.MANIFEST).read_text())
    manifest["suite"] = "changed"
    (directory / golden.MANIFEST).write_text(json.dumps(manifest))
    changed, _ = golden.read_manifest(directory, kept=True)
    assert changed["suite"] == "changed"
    assert golden.read_manifest(directory)[0] is not changed  # a caller may change its own


def test_the_specs_of_unselected_cases_are_not_rebuilt(directory):
    manifest = json.loads((directory / golden.MANIFEST).read_text())
    for entry in manifest["cases"]:
        if entry["name"] == OTHER:
            entry["spec"] = {"not": "a spec"}
    (directory / golden.MANIFEST).write_text(json.dumps(manifest))
    (fixture,) = golden.load(directory, names=[SMALL])
    assert fixture.case.name == SMALL
    with pytest.raises(golden.FixtureError, match="invalid case spec"):
        list(golden.load(directory))
    assert any("invalid case spec" in p for p in golden.verify(directory))


def test_the_json_report_holds_one_result_a_line(directory):
    report = validate("refattn-float64", fixtures=directory, progress=False)
    text = report.to_json()
    assert json.loads(text) == json.loads(json.dumps(report.to_dict(), allow_nan=False))
    lines = text.splitlines()
    start = lines.index('  "results": [')
    assert len(lines) == start + 2 + len(report.results) + 1
    for line, result in zip(lines[start + 1 : -2], report.results, strict=True):
        assert json.loads(line.strip().rstrip(","))["name"] == result.name
    report.results = []
    assert json.loads(report.to_json())["results"] == []


def test_a_worker_closed_without_waiting_is_reaped():
    with supervise.Supervisor("refattn-float64", timeout=120) as supervisor:
        assert supervisor.start() is None
        process = supervisor._process
        supervisor.close(wait=False)  # asked to stop; waited for now or by reap_closed
        assert supervisor._process is None
    supervise.reap_closed()
    assert not supervise._CLOSING and process.poll() == 0


class _Child:
    """A closed worker that exits in time, or never (``hangs``)."""

    def __init__(self, hangs):
        self.hangs, self.killed, self.waits = hangs, False, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.hangs and not self.killed:
            raise subprocess.TimeoutExpired("worker", timeout)
        return 0

    def kill(self):
        self.killed = True


def test_reaping_waits_for_each_closed_worker_and_kills_a_hung_one():
    import time

    quiet, hung = _Child(hangs=False), _Child(hangs=True)
    supervise._CLOSING.extend([(quiet, time.monotonic() + 5.0), (hung, time.monotonic())])
    supervise.reap_closed()
    assert not supervise._CLOSING
    assert quiet.waits and not quiet.killed
    assert hung.killed and len(hung.waits) == 2  # waited, killed, waited for
