"""Fuzz harness of the oracle's trust rules (issue #11): fixture files and destinations.

Every try records one outcome in a tally; the acceptable outcomes are a clear rejection (verify
lists problems, load raises :class:`oracle.fixtures.golden.FixtureError` or ``KeyError``, the CLI
exits
with 1 or 2 and one ``refattn-oracle: error:`` line) or a clean acceptance of a harmless change.
Unacceptable: a traceback (any other exception), a directory that verifies with nothing checked,
a file read from outside the directory, a hang, a stray or half-written file, a deletion of a
user's file, a file mode that ignores the umask. Each test asserts zero unacceptable outcomes
and prints its tally (``pytest -s -m fuzz tests/meta/test_fuzz_oracle.py`` shows them).

The tries are enumerated (every manifest key with every bad value, every structural defect) and
then drawn from a seeded generator, so the run is bounded (a few seconds) and reproducible.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from oracle import catalogue as cases
from oracle import cli
from oracle.fixtures import golden

pytestmark = pytest.mark.fuzz

_CASES = ("basic-H2K2-L5S7-D8E8-f32", "basic-H2K2-L5S7-D8E8-f64")
_BAD_VALUES = (
    5,
    None,
    12,
    "x",
    True,
    False,
    [],
    {},
    1.5,
    -1,
    "",
    2**70,
    ["x"],
    {"a": 1},
    "../x.npz",
    "/etc/passwd",
    "../../../outside/x.npz",
    "a/b.npz",
    "..",
    ".",
    "x\\y.npz",
    "nul\0.npz",
    "manifest.json",
    "\u00e9.npz",
)
_TOP_KEYS = ("schema_version", "generator", "refattn_version", "suite", "truth_kind", "cases")
_ENTRY_KEYS = ("name", "spec", "seed", "dtype", "category", "file", "sha256", "truth_kind")
_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz-reference")
    golden.generate("smoke", out, cases=[cases.get(n) for n in _CASES], progress=False)
    assert golden.verify(out) == []
    return out


def _fresh(reference: Path, root: Path) -> Path:
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(reference, root)
    return root


def _manifest(directory: Path) -> dict:
    return json.loads((directory / golden.MANIFEST).read_text())


def _write_manifest(directory: Path, value) -> None:
    (directory / golden.MANIFEST).write_text(json.dumps(value))


def _judge_directory(directory: Path, outside: Path | None = None) -> str:
    """Outcome of verify + load + `refattn-oracle verify` on one (possibly broken) directory."""
    try:
        problems = golden.verify(directory)
    except Exception as exc:  # the harness's point: any exception here is a finding
        return f"BAD traceback in verify: {exc!r}"
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        return f"BAD verify returned {problems!r}"
    if any("\n" in p for p in problems):
        return f"BAD multi-line problem {problems!r}"
    try:
        loaded = list(golden.load(directory))
        load_error = None
    except (golden.FixtureError, KeyError) as exc:
        loaded, load_error = [], str(exc)
    except Exception as exc:
        return f"BAD traceback in load: {exc!r}"
    if load_error is not None and "\n" in load_error:
        return f"BAD multi-line load error {load_error!r}"
    code = _cli(["verify", str(directory)])
    if isinstance(code, str):
        return code
    if code != (1 if problems else 0):
        return f"BAD verify exit {code} with problems {problems}"
    if not problems:
        if load_error is not None:
            return f"BAD verify passed, load failed: {load_error}"
        if not loaded:
            return "BAD verify passed a directory with nothing to check"
        if outside is not None:
            return "BAD read a file outside the directory"
        return "accepted"
    return "rejected" if load_error is not None else "rejected by verify, loadable"


def _cli(argv) -> int | str:
    import contextlib
    import io

    err = io.StringIO()
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = cli.main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    except Exception as exc:
        return f"BAD traceback in CLI {argv}: {exc!r}"
    if "Traceback" in err.getvalue() + out.getvalue():
        return f"BAD traceback text from CLI {argv}"
    if code == 2 and len(err.getvalue().strip().splitlines()) != 1:
        return f"BAD CLI error not one line: {err.getvalue()!r}"
    return code


def _tally_ok(tally: collections.Counter, label: str) -> None:
    __tracebackhide__ = True
    print(f"\nfuzz {label}: {sum(tally.values())} tries, {dict(tally)}")
    bad = {k: v for k, v in tally.items() if k.startswith("BAD")}
    assert not bad, f"unacceptable outcomes: {bad}"


def _mutations():
    """(label, function(manifest) -> manifest or None to delete) for every key and bad value."""
    for key in _TOP_KEYS:
        yield f"drop {key}", lambda m, key=key: {k: v for k, v in m.items() if k != key}
        for value in _BAD_VALUES:
            yield f"{key}={value!r}", lambda m, key=key, value=value: {**m, key: value}
    for key in _ENTRY_KEYS:

        def drop(m, key=key):
            m["cases"][0].pop(key)
            return m

        yield f"cases[0] drop {key}", drop
        for value in _BAD_VALUES:

            def put(m, key=key, value=value):
                m["cases"][0][key] = value
                return m

            yield f"cases[0].{key}={value!r}", put
    for key in ("name", "dtype", "shapes", "options", "seed", "suites", "category"):
        for value in _BAD_VALUES[:14]:

            def spec(m, key=key, value=value):
                m["cases"][0]["spec"][key] = value
                return m

            yield f"spec.{key}={value!r}", spec
    for value in (5, None, "x", True, [], [5], [None]):
        yield f"manifest={value!r}", lambda m, value=value: value
    yield "duplicate entry", lambda m: {**m, "cases": [m["cases"][0], *m["cases"]]}
    yield (
        "duplicate file",
        lambda m: {**m, "cases": [m["cases"][0], {**m["cases"][1], "file": m["cases"][0]["file"]}]},
    )
    yield "no cases", lambda m: {**m, "cases": []}


def test_fuzz_manifest_schema(tmp_path, reference):
    tally = collections.Counter()
    for label, mutate in _mutations():
        directory = _fresh(reference, tmp_path / "d")
        manifest = mutate(_manifest(directory))
        _write_manifest(directory, manifest)
        outcome = _judge_directory(directory)
        tally[outcome if not outcome.startswith("BAD") else f"{outcome} [{label}]"] += 1
    _tally_ok(tally, "manifest schema")


def test_fuzz_random_manifest_bytes(tmp_path, reference):
    """Seeded random edits of the manifest text: byte flips, truncation, random key values."""
    rng = random.Random(11)
    tally = collections.Counter()
    text = (reference / golden.MANIFEST).read_text()
    for index in range(120):
        directory = _fresh(reference, tmp_path / "d")
        if index % 3 == 0:
            cut = rng.randrange(len(text))
            new = text[:cut] + text[cut + 1 :] if index % 2 else text[:cut]
        elif index % 3 == 1:
            chars = list(text)
            for _ in range(rng.randint(1, 4)):
                chars[rng.randrange(len(chars))] = rng.choice('{}[]",:0123456789 xnul/.\\')
            new = "".join(chars)
        else:
            manifest = _manifest(directory)
            entry = rng.choice(manifest["cases"])
            entry[rng.choice(_ENTRY_KEYS)] = rng.choice(_BAD_VALUES)
            new = json.dumps(manifest)
        (directory / golden.MANIFEST).write_text(new)
        outcome = _judge_directory(directory)
        tally[outcome if not outcome.startswith("BAD") else f"{outcome} [try {index}]"] += 1
    _tally_ok(tally, "random manifest bytes")


def _set_file(directory: Path, index: int, data: bytes | None = None, file_name=None):
    """Replace entry ``index``'s file (or rename the entry) and record its new sha256."""
    manifest = _manifest(directory)
    entry = manifest["cases"][index]
    if file_name is not None:
        entry["file"] = file_name
    if data is not None:
        (directory / entry["file"]).write_bytes(data)
        entry["sha256"] = golden.sha256_of(directory / entry["file"])
    _write_manifest(directory, manifest)
    return entry


def _pickled_npz() -> bytes:
    import io

    buffer = io.BytesIO()
    np.savez(buffer, meta=np.array([{"x": 1}], dtype=object))
    return buffer.getvalue()


def test_fuzz_fixture_files(tmp_path, reference):
    """Path traversal, absolute paths, symlinks, non-zip, truncated and pickled files."""
    tally = collections.Counter()
    outside = tmp_path / "outside"
    outside.mkdir()
    good = (reference / f"{_CASES[0]}.npz").read_bytes()
    (outside / "x.npz").write_bytes(good)
    tries = []
    for target in (
        "../outside/x.npz",
        str(outside / "x.npz"),
        "/etc/passwd",
        "../../../outside/x.npz",
        "sub/x.npz",
        "..",
        "/dev/null",
    ):
        tries.append((f"file={target}", lambda d, t=target: _set_file(d, 0, file_name=t)))

    def symlink_file(d):
        path = d / f"{_CASES[0]}.npz"
        path.unlink()
        path.symlink_to(outside / "x.npz")

    def symlink_manifest(d):
        real = d.parent / "elsewhere.json"
        real.write_text((d / golden.MANIFEST).read_text())
        (d / golden.MANIFEST).unlink()
        (d / golden.MANIFEST).symlink_to(real)

    def manifest_dir(d):
        (d / golden.MANIFEST).unlink()
        (d / golden.MANIFEST).mkdir()

    def file_dir(d):
        (d / f"{_CASES[0]}.npz").unlink()
        (d / f"{_CASES[0]}.npz").mkdir()

    tries += [
        ("symlinked npz", symlink_file),
        ("symlinked manifest", symlink_manifest),
        ("manifest is a directory", manifest_dir),
        ("npz is a directory", file_dir),
        ("npz missing", lambda d: (d / f"{_CASES[0]}.npz").unlink()),
        ("text npz", lambda d: _set_file(d, 0, b"not a zip at all")),
        ("empty npz", lambda d: _set_file(d, 0, b"")),
        ("truncated npz", lambda d: _set_file(d, 0, good[: len(good) // 2])),
        ("pickled npz", lambda d: _set_file(d, 0, _pickled_npz())),
        ("invalid JSON", lambda d: (d / golden.MANIFEST).write_text("{")),
        ("empty manifest", lambda d: (d / golden.MANIFEST).write_text("")),
        ("binary manifest", lambda d: (d / golden.MANIFEST).write_bytes(b"\xff\xfe\x00")),
        ("not a directory", None),
        ("missing directory", None),
    ]
    for label, change in tries:
        directory = _fresh(reference, tmp_path / "d")
        if label == "not a directory":
            shutil.rmtree(directory)
            directory.write_text("x")
        elif label == "missing directory":
            shutil.rmtree(directory)
        else:
            change(directory)
        outcome = _judge_directory(directory, outside=outside if "out" in label else None)
        if directory.is_file():
            directory.unlink()
        if "x.npz" in label and outcome == "accepted":
            outcome = "BAD read a file outside the directory"
        if label.startswith(("file=", "symlinked npz", "text npz", "pickled")):
            problems = golden.verify(directory) if directory.is_dir() else []
            named = Path(label.split("=", 1)[-1]).name if "=" in label else f"{_CASES[0]}.npz"
            if problems and not any(named in p or "file" in p for p in problems):
                outcome = f"BAD problem does not name the entry: {problems}"
        tally[outcome if not outcome.startswith("BAD") else f"{outcome} [{label}]"] += 1
    _tally_ok(tally, "fixture files")


# ---------------------------------------------------------------------------------------------
# writers: destinations, flags, lock, deletions, modes
# ---------------------------------------------------------------------------------------------


def _listing(directory: Path) -> dict[str, bytes]:
    return {
        p.name: (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(directory.iterdir())
    }


def test_fuzz_bad_destinations_and_flags(tmp_path, monkeypatch):
    tally = collections.Counter()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    a_file = tmp_path / "a-file"
    a_file.write_text("user data")
    base = ["generate", "--suite", "smoke", "--dtype", "float32", "--quiet"]
    tries = [
        ("empty out", base + ["--out", ""]),
        ("out is a file", base + ["--out", str(a_file)]),
        ("out is /dev/null", base + ["--out", "/dev/null"]),
        ("out under a file", base + ["--out", str(a_file / "sub")]),
        ("workers 0", base + ["--out", str(tmp_path / "w0"), "--workers", "0"]),
        ("workers -3", base + ["--out", str(tmp_path / "w3"), "--workers", "-3"]),
        ("unknown suite", ["generate", "--suite", "nope", "--out", str(tmp_path / "s")]),
        ("no out", ["generate", "--suite", "smoke"]),
        ("workers not int", base + ["--out", str(tmp_path / "wx"), "--workers", "x"]),
    ]
    if os.geteuid() != 0:  # root ignores directory permissions
        read_only = tmp_path / "ro"
        read_only.mkdir()
        read_only.chmod(0o555)
        tries.append(("read-only out", base + ["--out", str(read_only)]))
    for label, argv in tries:
        code = _cli(argv)
        stray = list(cwd.iterdir())
        if isinstance(code, str):
            outcome = code
        elif code != 2:
            outcome = f"BAD exit {code}"
        elif stray:
            outcome = f"BAD wrote into the current directory: {stray}"
        elif a_file.read_text() != "user data":
            outcome = "BAD changed a user's file"
        else:
            outcome = "refused"
        tally[outcome if not outcome.startswith("BAD") else f"{outcome} [{label}]"] += 1
    _tally_ok(tally, "destinations and flags")


@pytest.mark.parametrize("failure", ["ENOSPC", "EROFS", "EACCES"])
def test_fuzz_failing_disk(tmp_path, monkeypatch, failure):
    """A write failing midway: one-line error, exit 2, no temp file, no manifest, user files."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".user.tmp").write_text("mine")
    before = _listing(out)
    code = getattr(errno, failure)
    calls = []

    def failing_fsync(fd):
        calls.append(fd)
        if len(calls) >= 2:
            raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    result = _cli(["generate", "--suite", "smoke", "--quiet", "--out", str(out)])
    monkeypatch.undo()
    after = _listing(out)
    assert result == 2, result
    assert after[".user.tmp"] == before[".user.tmp"], "a user's file changed"
    assert golden.MANIFEST not in after, "manifest.json written by a failed run"
    assert not [n for n in after if n.startswith(".refattn-") and n.endswith(".tmp")], after
    assert golden.verify(out), "a failed run verifies"


def test_fuzz_user_files_survive_and_modes_follow_umask(tmp_path):
    tally = collections.Counter()
    user_files = {
        ".user.tmp": b"1",
        ".basic-H2K2-L5S7-D8E8-f32.npz.abc.tmp": b"2",
        "notes.txt": b"3",
        "user.npz": b"4",
        ".refattn-1-abc.txt": b"5",
    }
    chosen = [cases.get(_CASES[0])]
    for mask in (0o022, 0o002, 0o077, 0o027, 0o000):
        out = tmp_path / f"umask-{mask:03o}"
        out.mkdir()
        for name, data in user_files.items():
            (out / name).write_bytes(data)
        old = os.umask(mask)
        try:
            golden.generate("smoke", out, cases=chosen, progress=False)
            golden.generate("smoke", out, cases=chosen, progress=False)  # resume path too
        finally:
            os.umask(old)
        listing = _listing(out)
        for name, data in user_files.items():
            if listing.get(name) != data:
                tally[f"BAD user file {name} changed or deleted [umask {mask:03o}]"] += 1
        for path in out.iterdir():
            if path.name in user_files:
                continue
            mode = path.stat().st_mode & 0o777
            expected = 0o666 & ~mask
            ok = mode == expected
            tally["mode ok" if ok else f"BAD mode {mode:o} != {expected:o} ({path.name})"] += 1
        stray = [n for n in listing if n.endswith(".tmp") and n not in user_files]
        tally[f"BAD stray {stray}" if stray else "no stray file"] += 1
    _tally_ok(tally, "user files and modes")


def test_fuzz_manifest_cannot_make_generate_delete_user_files(tmp_path, reference):
    """A planted manifest naming user files (outside, absolute, renamed) deletes nothing."""
    tally = collections.Counter()
    victim_outside = tmp_path / "victim.npz"
    for target in (
        "../victim.npz",
        str(victim_outside),
        "notes.npz",
        "user.npz",
        f"../{tmp_path.name}/victim.npz",
    ):
        directory = _fresh(reference, tmp_path / "d")
        victim_outside.write_text("outside")
        (directory / "notes.npz").write_text("inside")
        (directory / "user.npz").write_text("inside")
        manifest = _manifest(directory)
        manifest["cases"].append({**manifest["cases"][0], "name": "planted", "file": target})
        _write_manifest(directory, manifest)
        golden.generate("smoke", directory, cases=[cases.get(_CASES[0])], progress=False)
        lost = [
            p
            for p in (victim_outside, directory / "notes.npz", directory / "user.npz")
            if not p.exists()
        ]
        tally[f"BAD deleted {lost} [{target}]" if lost else "nothing deleted"] += 1
    _tally_ok(tally, "planted manifests")


def test_fuzz_writer_lock(tmp_path):
    tally = collections.Counter()
    out = tmp_path / "locked"
    out.mkdir()
    lock = os.open(out / golden.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        code = _cli(["generate", "--suite", "smoke", "--quiet", "--out", str(out)])
        tally["refused while locked" if code == 2 else f"BAD exit {code} while locked"] += 1
        timer = threading.Timer(0.3, lambda: fcntl.flock(lock, fcntl.LOCK_UN))
        timer.start()
        start = time.monotonic()
        golden.generate("smoke", out, cases=[cases.get(_CASES[0])], progress=False, wait=True)
        waited = time.monotonic() - start
        tally["waited then wrote" if waited >= 0.25 else f"BAD did not wait ({waited:.2f}s)"] += 1
        timer.join()
    finally:
        os.close(lock)
    tally["verified" if golden.verify(out) == [] else f"BAD {golden.verify(out)}"] += 1
    _tally_ok(tally, "writer lock")


def test_fuzz_two_concurrent_generate_processes(tmp_path):
    """Two writers into one directory with different dtypes: no unlisted file at the end."""
    out = tmp_path / "race"
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    commands = [
        [
            sys.executable,
            "-m",
            "oracle.cli",
            "generate",
            "--suite",
            "smoke",
            "--quiet",
            "--out",
            str(out),
            "--dtype",
            dtype,
        ]
        for dtype in ("float32", "float64")
    ]
    procs = [
        subprocess.Popen(
            c, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for c in commands
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    tally = collections.Counter()
    for code, err in results:
        if "Traceback" in err:
            tally["BAD traceback"] += 1
        elif code == 0:
            tally["wrote"] += 1
        elif code == 2 and "lock" in err and len(err.strip().splitlines()) == 1:
            tally["refused (locked)"] += 1
        else:
            tally[f"BAD exit {code}: {err[-200:]}"] += 1
    problems = golden.verify(out)
    tally["directory verifies" if problems == [] else f"BAD {problems[:3]}"] += 1
    _tally_ok(tally, "concurrent writers")


# ---------------------------------------------------------------------------------------------
# validation: nothing passes by accident
# ---------------------------------------------------------------------------------------------

#: the ones that end, stall or kill the worker process (default run), then bad outputs (the
#: default run keeps two of them; every one runs in the xslow twin)
_MISBEHAVING_PROCESS = ("calls_sys_exit", "calls_os_exit", "hangs", "segfaults", "eats_memory")
_MISBEHAVING = (
    *_MISBEHAVING_PROCESS,
    "complex_out",
    "int_out",
    "object_out",
    "list_out",
    "none_out",
    "scalar_out",
    "wrong_shape",
    "empty_tuple",
    "nan_out",
    "raises_keyboard_free",
)
_TIMEOUT = 4.0  # seconds per case for the hanging implementation (bounds the harness)


def _validate_cli(argv, json_path):
    code = _cli(["validate", *argv, "--quiet", "--json", str(json_path)])
    data = json.loads(json_path.read_text()) if json_path.exists() else None
    if json_path.exists():
        json_path.unlink()
    return code, data


def test_fuzz_misbehaving_implementations(tmp_path):
    """Exit, os._exit, hang, segfault, memory blow-up and two bad outputs: each an error
    verdict for the case, the run goes on to the next case and exits 1 with a report."""
    _misbehaving(tmp_path, (*_MISBEHAVING_PROCESS, "object_out", "wrong_shape"))


@pytest.mark.xslow
def test_fuzz_every_misbehaving_implementation(tmp_path):
    """The same for every misbehaving implementation (each bad output kind)."""
    _misbehaving(tmp_path, _MISBEHAVING)


def _misbehaving(tmp_path, names):
    tally = collections.Counter()
    for name in names:
        start = time.monotonic()
        code, data = _validate_cli(
            [
                "--impl",
                f"tests.planted.fuzz_impls:{name}",
                "--suite",
                "smoke",
                "--dtype",
                "float32",
                "--case",
                "BASIC-*",
                "--case",
                "causal-*",
                "--timeout",
                str(_TIMEOUT),
                "--memory-limit",
                "4096",
            ],
            tmp_path / "r.json",
        )
        took = time.monotonic() - start
        if isinstance(code, str):
            outcome = code
        elif code != 1 or data is None:
            outcome = f"BAD exit {code} (report {'written' if data else 'missing'})"
        elif len(data["results"]) != 2:
            outcome = f"BAD run stopped after {len(data['results'])} of 2 cases"
        elif any(r["verdict"] == "pass" for r in data["results"]):
            outcome = "BAD a misbehaving implementation passed a case"
        elif took > 4 * _TIMEOUT + 30:
            outcome = f"BAD took {took:.0f} s"
        else:
            outcome = "reported: " + "/".join(sorted({r["verdict"] for r in data["results"]}))
        tally[outcome if not outcome.startswith("BAD") else f"{outcome} [{name}]"] += 1
    _tally_ok(tally, "misbehaving implementations")


def test_fuzz_selection_never_passes_empty(tmp_path, reference):
    """Patterns are case-insensitive; zero selected cases (pattern, empty manifest) is exit 2;
    cases= accepts a string."""
    from oracle.run.validate import validate

    tally = collections.Counter()
    base = ["--impl", "tests.planted.fuzz_impls:good", "--suite", "smoke", "--dtype", "float32"]
    for pattern, expect in (
        ("BASIC-*-F32", 1),
        ("basic-*-f32", 1),
        ("Causal*", 1),
        ("nomatch*", 0),
        ("", 0),
        ("[", 0),
    ):
        code, data = _validate_cli([*base, "--case", pattern], tmp_path / "r.json")
        if expect == 0:
            ok = code == 2 and data is None
        else:
            ok = code == 0 and data is not None and len(data["results"]) >= expect
        tally["ok" if ok else f"BAD pattern {pattern!r}: exit {code}"] += 1
    empty = _fresh(reference, tmp_path / "empty")
    manifest = _manifest(empty)
    manifest["cases"] = []
    _write_manifest(empty, manifest)
    code, _ = _validate_cli(
        ["--impl", "tests.planted.fuzz_impls:good", "--fixtures", str(empty)], tmp_path / "r.json"
    )
    tally["ok" if code == 2 else f"BAD empty manifest: exit {code}"] += 1
    import tests.planted.fuzz_impls as fuzz_impls

    report = validate(fuzz_impls.good, suite="smoke", cases="causal*", progress=False)
    names = [r.name for r in report.results]
    ok = names and all(n.startswith("causal") for n in names)
    tally["ok" if ok else f"BAD cases='causal*' ran {names}"] += 1
    with pytest.raises(ValueError, match="no case selected"):
        validate(fuzz_impls.good, suite="smoke", cases="nothing*", progress=False)
    tally["ok"] += 1
    _tally_ok(tally, "selection")


def test_fuzz_grads_without_vjp_and_coverage(tmp_path):
    """--grads without a vjp is never a pass; thin coverage is said; --require fails it; a
    minimal (q, k, v, scale, causal) function is judged on causal cases."""
    tally = collections.Counter()
    code, data = _validate_cli(
        [
            "--impl",
            "tests.planted.fuzz_impls:good",
            "--suite",
            "default",
            "--dtype",
            "float32",
            "--case",
            "grad-bias-*",
            "--grads",
        ],
        tmp_path / "r.json",
    )
    grads = [r for r in data["results"]] if data else []
    ok = grads and all(r["verdict"] != "pass" for r in grads) and "gradients" in data["untested"]
    tally["grads unsupported" if ok else f"BAD --grads without vjp: {code}"] += 1
    code, _ = _validate_cli(
        [
            "--impl",
            "tests.planted.fuzz_impls:good",
            "--suite",
            "default",
            "--dtype",
            "float32",
            "--case",
            "grad-bias-*",
            "--grads",
            "--require",
            "gradients",
        ],
        tmp_path / "r.json",
    )
    tally["require fails" if code == 1 else f"BAD --require gradients exit {code}"] += 1
    code, data = _validate_cli(
        [
            "--impl",
            "tests.planted.fuzz_impls:minimal_bottom_right",
            "--suite",
            "default",
            "--dtype",
            "float32",
            "--case",
            "causal-*",
        ],
        tmp_path / "r.json",
    )
    causal = data["coverage"]["feature"].get("causal", {}) if data else {}
    ok = code == 1 and causal.get("judged", 0) > 0
    tally["alignment bug caught" if ok else f"BAD bottom-right bug: exit {code} {causal}"] += 1
    code, data = _validate_cli(
        [
            "--impl",
            "tests.planted.fuzz_impls:minimal",
            "--suite",
            "smoke",
            "--dtype",
            "float32",
            "--require",
            "mask,causal",
        ],
        tmp_path / "r.json",
    )
    ok = code == 1 and data and "mask" in data["untested"] and not data["passed"]
    tally["thin coverage fails with --require" if ok else f"BAD minimal: exit {code}"] += 1
    code, _ = _validate_cli(
        ["--impl", "tests.planted.fuzz_impls:good", "--require", "nonsense"], tmp_path / "r.json"
    )
    tally["unknown feature refused" if code == 2 else f"BAD --require nonsense {code}"] += 1
    _tally_ok(tally, "grads and coverage")


# ---------------------------------------------------------------------------------------------
# newcomer friction: failure text, terminal table, HTML report, plugin sys.path
# ---------------------------------------------------------------------------------------------


def test_fuzz_report_texts(tmp_path):
    import re

    import tests.planted.fuzz_impls as fuzz_impls
    from oracle.report.formats import PLOT_HINT, plotting_available
    from oracle.run.validate import validate

    tally = collections.Counter()
    report = validate(
        fuzz_impls.nan_out, suite="smoke", dtype="float32", progress=False, isolate=False
    )
    for result in report.failures:
        text = result.explain()
        shown = set(re.findall(r"threshold ([0-9.e+-]+)", text))
        per_check = len([c for c in result.checks.values() if not c.passed]) or 1
        tally["one threshold" if len(shown) <= per_check else f"BAD thresholds {shown}"] += 1
    long_reason = "x" * 30 + " " + "word " * 60
    report.results[0].message = long_reason
    report.results[0].verdict = "error"
    table = " ".join(report.summary().split())
    tally["full reason" if " ".join(long_reason.split()) in table else "BAD reason cut"] += 1
    page = report.to_html(tmp_path / "r.html", plots="all").read_text()
    hrefs = set(re.findall(r"href='#([^']+)'", page))
    ids = set(re.findall(r"id='([^']+)'", page))
    tally["anchors resolve" if hrefs and hrefs <= ids else f"BAD dangling {hrefs - ids}"] += 1
    images = page.count("<img")
    if plotting_available():
        tally["plots per case" if images >= len(report.results) else f"BAD {images} plots"] += 1
    else:  # without the plot extra the page says how to get plots instead
        tally["plot hint" if PLOT_HINT in page else "BAD no plot hint"] += 1
    _tally_ok(tally, "report texts")


def test_fuzz_plugin_finds_module_in_cwd(tmp_path):
    (tmp_path / "my_attention.py").write_text(
        "from refattn import attention\n\n"
        "def attn(q, k, v, **options):\n"
        "    return attention(q, k, v, **options)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    env.pop("PYTEST_ADDOPTS", None)
    script = Path(sys.executable).parent / "pytest"  # the console script: no cwd on sys.path
    if not script.exists():
        pytest.skip("no pytest console script next to the interpreter")
    proc = subprocess.run(
        [
            str(script),
            "--pyargs",
            "oracle",
            "-q",
            "-p",
            "no:cacheprovider",
            "--refattn-impl",
            "my_attention:attn",
            "--refattn-suite",
            "smoke",
            "--refattn-dtype",
            "float64",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tally = collections.Counter()
    ok = proc.returncode == 0 and "passed" in proc.stdout
    tally[
        "plugin imported ./my_attention.py"
        if ok
        else f"BAD plugin rc {proc.returncode}: {proc.stdout[-300:]} {proc.stderr[-300:]}"
    ] += 1
    _tally_ok(tally, "plugin sys.path")


def test_fuzz_script_without_main_guard(tmp_path):
    """A plain script calling oracle.run.validate (no __main__ guard) runs isolated and ends."""
    script = tmp_path / "check.py"
    script.write_text(
        "import oracle\nimport fuzz_impls\n"
        "report = oracle.validate(fuzz_impls.good, suite='smoke', progress=False)\n"
        "print('isolated', report.isolated, 'passed', report.passed)\n"
    )
    planted = _ROOT / "tests" / "planted"  # fuzz_impls lives there since tests/ has layers
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_ROOT), str(planted)])}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tally = collections.Counter()
    ok = proc.returncode == 0 and "isolated True passed True" in proc.stdout
    tally["ran isolated" if ok else f"BAD rc {proc.returncode}: {proc.stderr[-300:]}"] += 1
    _tally_ok(tally, "script without main guard")


# ---------------------------------------------------------------------------------------------
# issue 28: no run that judged nothing exits 0; every bad input gets one line and exit 2
# ---------------------------------------------------------------------------------------------

#: module source -> what the implementation does; each written into tmp_path as its own module
_IMPORT_TIME = {
    "exits_0": "import sys\nsys.exit(0)\n",
    "exits_3": "import sys\nsys.exit(3)\n",
    "os_exits_0": "import os\nos._exit(0)\n",
    "raises": "raise RuntimeError('boom at import')\n",
    "syntax_error": "def attention(:\n",
}
_IN_A_CASE = {
    "keyboard_interrupt": "def attention(q, k, v, **options):\n    raise KeyboardInterrupt\n",
}
_ONE_CASE = ["--suite", "smoke", "--dtype", "float32", "--case", "basic-*", "--quiet"]


def _user_modules(tmp_path, monkeypatch, sources) -> None:
    """Write each source as module ``fuzz28_<name>`` in tmp_path, the cwd and on sys.path
    (names of their own: the import system caches modules)."""
    for name, source in sources.items():
        tail = (
            "" if "def attention" in source else "\ndef attention(q, k, v, **options):\n    pass\n"
        )
        (tmp_path / f"fuzz28_{name}.py").write_text(source + tail)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))


def _cli_fd(argv, capfd) -> tuple[int | str, str]:
    """Exit code and all stderr text of one CLI call: this process's and what reached file
    descriptor 2 from elsewhere (the worker process writes there)."""
    import contextlib
    import io

    capfd.readouterr()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    except Exception as exc:  # the harness's point: any exception here is a finding
        return f"BAD traceback in CLI {argv}: {exc!r}", ""
    return code, err.getvalue() + capfd.readouterr().err


def test_fuzz_user_module_misbehaves_at_import(tmp_path, monkeypatch, capfd):
    """sys.exit / os._exit / an exception / a SyntaxError at import: one line, exit 2, never
    the exit 0 of a run that judged nothing (isolated and, but for os._exit, in-process)."""
    _user_modules(tmp_path, monkeypatch, _IMPORT_TIME)
    tally = collections.Counter()
    for name in _IMPORT_TIME:
        modes = [[]] if name == "os_exits_0" else [[], ["--in-process"]]
        for mode in modes:
            argv = ["validate", "--impl", f"fuzz28_{name}:attention", *_ONE_CASE, *mode]
            code, err = _cli_fd(argv, capfd)
            lines = err.strip().splitlines()
            if isinstance(code, str):
                outcome = code
            elif code != 2:
                outcome = f"BAD exit {code} (a run that judged nothing)"
            elif "Traceback" in err or len(lines) != 1 or f"fuzz28_{name}" not in err:
                outcome = f"BAD not one line naming the module: {err[-300:]!r}"
            else:
                outcome = "refused"
            label = f"{name}{' in-process' if mode else ''}"
            tally[outcome if not outcome.startswith("BAD") else f"{outcome} [{label}]"] += 1
    _tally_ok(tally, "import-time misbehaviour")


def test_fuzz_keyboard_interrupt_inside_a_case(tmp_path, monkeypatch, capfd):
    """Isolated: the verdict "error" naming KeyboardInterrupt, no worker traceback, exit 1.
    In-process (it cannot be told from Ctrl-C there): a clean abort, one line, exit 2."""
    _user_modules(tmp_path, monkeypatch, _IN_A_CASE)
    tally = collections.Counter()
    impl = ["--impl", "fuzz28_keyboard_interrupt:attention"]
    report = tmp_path / "r.json"
    code, err = _cli_fd(["validate", *impl, *_ONE_CASE, "--json", str(report)], capfd)
    data = json.loads(report.read_text()) if report.exists() else None
    verdicts = [(r["verdict"], r["message"]) for r in data["results"]] if data else []
    if isinstance(code, str):
        outcome = code
    elif code != 1 or not verdicts:
        outcome = f"BAD exit {code}, results {verdicts}"
    elif "Traceback" in err:
        outcome = f"BAD worker traceback on stderr: {err[-300:]!r}"
    elif not all(v == "error" and "KeyboardInterrupt" in m for v, m in verdicts):
        outcome = f"BAD verdicts {verdicts}"
    else:
        outcome = "error verdict"
    tally[outcome] += 1
    code, err = _cli_fd(["validate", *impl, *_ONE_CASE, "--in-process"], capfd)
    one_line = len(err.strip().splitlines()) == 1 and "interrupted" in err
    tally["aborted (in-process)" if code == 2 and one_line else f"BAD in-process {code}"] += 1
    _tally_ok(tally, "KeyboardInterrupt in a case")


def test_fuzz_cli_selections_and_output_paths(tmp_path, monkeypatch):
    """Every selection and output path the CLI takes, made bad: exit 2 and one line, checked
    before any case runs (report paths included: a long run must not end in a traceback)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("user data")
    base = ["validate", "--adapter", "refattn-float64", *_ONE_CASE]
    tries = [
        ("list unknown suite", ["list", "cases", "--suite", "nosuch"]),
        ("list empty suite", ["list", "cases", "--suite", ""]),
        ("unknown suite", [*base[:3], "--suite", "nosuch"]),
        ("fixtures is a file", [*base[:3], "--fixtures", str(tmp_path / "a-file")]),
        ("unknown check", [*base, "--check", "nope"]),
        ("unknown feature", [*base, "--require", "nope"]),
        ("case matches nothing", [*base[:5], "--case", "nomatch*"]),
        ("timeout inf", [*base, "--timeout", "inf"]),
        ("timeout nan", [*base, "--timeout", "nan"]),
        ("timeout 1e300", [*base, "--timeout", "1e300"]),
        ("memory-limit inf", [*base, "--memory-limit", "inf"]),
        ("memory-limit 1e30", [*base, "--memory-limit", "1e30"]),
        ("impl relative module", ["validate", "--impl", ".x:f", *_ONE_CASE]),
        ("impl no function", ["validate", "--impl", "tests.planted.fuzz_impls:", *_ONE_CASE]),
        ("impl not callable", ["validate", "--impl", "oracle.cli:__all__", *_ONE_CASE]),
    ]
    for flag in ("--json", "--junit", "--html"):
        tries += [
            (f"{flag} a directory", [*base, flag, str(tmp_path / "a-dir")]),
            (f"{flag} empty", [*base, flag, ""]),
            (f"{flag} missing folder", [*base, flag, str(tmp_path / "no" / "r")]),
            (f"{flag} under a file", [*base, flag, str(tmp_path / "a-file" / "r")]),
        ]
    tally = collections.Counter()
    for label, argv in tries:
        code = _cli(argv)
        if isinstance(code, str):
            outcome = code
        elif code != 2:
            outcome = f"BAD exit {code}"
        elif (tmp_path / "a-file").read_text() != "user data":
            outcome = "BAD changed a user's file"
        else:
            outcome = "refused"
        tally[outcome if not outcome.startswith("BAD") else f"{outcome} [{label}]"] += 1
    _tally_ok(tally, "selections and output paths")


def test_fuzz_impl_and_adapter_together_are_both_judged(capsys):
    """``--impl X --adapter Y`` (documented: repeatable and mixable) judges both, each summary
    headed by its implementation, exit 1 when either fails: nothing is silently dropped."""
    argv = ["validate", "--in-process", *_ONE_CASE]
    argv += ["--adapter", "refattn-float64", "--impl", "tests.planted.broken_impls:missing_scale"]
    code = cli.main(argv)
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("== ")]
    tally = collections.Counter()
    expected = ["== tests.planted.broken_impls:missing_scale: FAILED", "== refattn-float64: passed"]
    ok = code == 1 and headers == expected
    tally["both judged, each named" if ok else f"BAD exit {code}, headers {headers}"] += 1
    _tally_ok(tally, "--impl with --adapter")


def test_fuzz_report_write_failing_after_the_run(tmp_path, monkeypatch):
    """The disk fills up while the report is written: one line and exit 2, after the summary."""
    from oracle.report.run_report import Report

    def full_disk(self, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(Report, "to_json", full_disk)
    argv = ["validate", "--adapter", "refattn-float64", *_ONE_CASE, "--in-process"]
    code = _cli([*argv, "--json", str(tmp_path / "r.json")])
    tally = collections.Counter()
    tally["refused" if code == 2 else f"BAD exit {code}"] += 1
    _tally_ok(tally, "report write failing")


_BLOCKING_GENERATE = """
import os, sys, time
from oracle import catalogue
from oracle.fixtures import golden
real_replace = os.replace
def replace_then_block(src, dst):
    if str(dst).endswith({last!r}):  # the last fixture's temp file is complete: stop here
        print("temp file written", flush=True)
        time.sleep(600)
    real_replace(src, dst)
os.replace = replace_then_block
golden.generate("smoke", sys.argv[1], cases=[catalogue.get(n) for n in {names!r}],
                progress=False)
"""


def _generate_until_killed(out: Path) -> list[str]:
    """Run generate in a subprocess, SIGKILL it while its last temp file exists; return the
    temp files it left."""
    import select
    import signal

    script = _BLOCKING_GENERATE.format(last=f"{_CASES[-1]}.npz", names=list(_CASES))
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(out)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready and proc.stdout.readline().strip() == "temp file written", "no temp file"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
        proc.stdout.close()
    return sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp"))


def test_fuzz_resume_after_sigkill_matches_a_clean_run(tmp_path, reference):
    """generate killed with SIGKILL mid-write leaves its temp file; the resumed run removes it
    (its writer is gone) and the folder is byte-identical to a clean run's. Temp files of a live
    writer and files that only look like temp files stay."""
    tally = collections.Counter()
    out = tmp_path / "killed"
    left = _generate_until_killed(out)
    tally["temp file left by the kill" if left else "BAD kill left no temp file (no test)"] += 1
    golden.generate("smoke", out, cases=[cases.get(n) for n in _CASES], progress=False)
    same = _listing(out) == _listing(reference)
    stray = sorted(set(_listing(out)) ^ set(_listing(reference)))
    tally["byte-identical to a clean run" if same else f"BAD resume differs: {stray}"] += 1
    planted = _fresh(reference, tmp_path / "planted")
    alive = f".refattn-{os.getppid()}-{'0' * 12}.tmp"  # a live process: maybe still writing
    lookalikes = [".refattn-1-abc.tmp", ".refattn-x-000000000000.tmp", ".refattn-7-0.tmp.bak"]
    dead = f".refattn-{2**22 + 1}-{'a' * 12}.tmp"  # above Linux's pid_max: never alive
    for name in (alive, dead, *lookalikes):
        (planted / name).write_bytes(b"partial")
    golden.generate("smoke", planted, cases=[cases.get(n) for n in _CASES], progress=False)
    names = set(_listing(planted))
    kept = {alive, *lookalikes} <= names
    tally["live writer's and look-alike files kept" if kept else "BAD deleted a file"] += 1
    tally["dead writer's temp file removed" if dead not in names else "BAD stale temp kept"] += 1
    _tally_ok(tally, "resume after SIGKILL")
