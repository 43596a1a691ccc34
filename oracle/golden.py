"""Golden fixtures: the exact truths of the case catalogue, on disk and in memory.

:func:`build` computes one :class:`Fixture` (inputs from :func:`oracle.catalogue.make_inputs`,
truth from refattn's exact path: every element the exact real result rounded once to the case
dtype, and once to float64, by a Ziv loop). :func:`generate` writes a suite as one ``.npz`` per
case plus ``manifest.json``; :func:`verify` checks a directory; :func:`load` yields fixtures.

File format (schema version 1)
------------------------------
``<case name>.npz`` -- a ZIP archive (stored, no compression) of ``.npy`` (format 1.0) members,
readable by ``numpy.load(path, allow_pickle=False)`` or any npy reader:

* ``inputs/<name>``: q, k, v and, as the case needs, mask, bias, dropout_mask, alibi_slopes,
  sinks, kv_lengths (int32), q_descale, k_descale, v_descale (float32), grad_out, grad_lse;
  a long-row case (recipe ``compact``) stores none: its ``regenerated`` member (JSON: each
  input's dtype, shape and npy sha256) lets :func:`load` rebuild them bit-identically from the
  case spec and check them (:mod:`oracle.golden_compact`);
* ``truth/<name>``: out, out_f64, lse, lse_f64 and, for gradient cases, dq, dk, dv (dbias when
  the case has a bias, dsinks when it has sinks) with their ``_f64`` twins.
  A refusal case (category "refusal", :mod:`oracle.refusal_cases`) stores its malformed inputs and
  no truth; its ``truth_kind`` (meta and manifest entry) is "refusal".
  ``out``/``lse``/``d*`` are in the case dtype;
* ``case``: the case spec (0-d unicode array holding JSON, see :meth:`oracle.catalogue.Case.spec`);
* ``options``: the scalar keywords to pass to an implementation (0-d unicode array of JSON);
  the array keywords (mask, bias, dropout_mask, alibi_slopes) are the ``inputs/`` members;
* ``meta``: JSON with the schema version, the truth kind and ``bfloat16``, the list of members
  stored as their uint16 bit patterns (npy has no bfloat16 type; view them as
  ``ml_dtypes.bfloat16``, which :func:`load` does); fixtures with float8 inputs (the fp8
  cases) also have ``float8_e4m3fn`` / ``float8_e5m2``: members stored as uint8 bit patterns,
  to view as that ml_dtypes type (fp4 cases likewise ``float4_e2m1fn``, one code per byte,
  and ``float8_e8m0fnu``; their ``*_block_scale`` inputs are stored like the descales).

Bytes are a pure function of the case: members are sorted, every ZIP date is 1980-01-01, the npy
headers are written here (not by the installed NumPy), JSON has sorted keys and Python's
shortest float repr. Regeneration therefore gives the same sha256 on every run, worker count
and machine.

``manifest.json``: ``schema_version``, ``generator``, ``refattn_version``, ``suite``,
``truth_kind`` and ``cases``: one entry per case in catalogue order with ``name``, ``spec``,
``seed``, ``dtype``, ``category``, ``file``, ``sha256``, ``truth_kind``, ``contract`` (the
truth's dtype and rounding, :func:`oracle.contract.case_contract`); ``precision_contract``: what
the folder promises, readable without refattn (:func:`oracle.contract.folder_contract`).

Atomicity and resume: every file is written to a temporary file of this run (named
``.refattn-<pid>-<random>.tmp``, created with mode 0666 minus the umask) in the same directory
and moved into place with ``os.replace``; progress is recorded in ``manifest.partial.json`` (also
atomic) and ``manifest.json`` is written last. A rerun after an interruption skips every case
whose file exists with the recorded sha256 and spec, computes the rest and removes the temporary
files of writers that are gone (a run killed with SIGKILL cannot remove its own), so the
directory is byte-identical to one written in a single run (:mod:`oracle._atomic`).

Safety: a writer holds an exclusive lock (``fcntl.flock`` on ``.refattn-oracle.lock`` in the
directory) for the whole run; a second writer fails with :class:`FixtureLockError` or, with
``wait=True``, waits. A run deletes only temporary files of this module (its own, and those of
dead writers) and the fixture files an earlier manifest of this directory recorded for cases no
longer selected; any other file is left alone.
Manifest ``file`` entries must be plain file names inside the directory (no path separator, no
``..``, not absolute, not a symlink); :func:`verify` and :func:`load` refuse anything else, naming
the entry, and report every schema problem as one line (file, key, what was expected).
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import refattn

from . import catalogue, contract, golden_compact
from . import refusal_cases as refusal
from ._atomic import (
    LOCK_FILE,
    TMP_SUFFIX,
    FixtureError,
    FixtureLockError,
    destination,
    remove_stale_temps,
    writer_lock,
)
from ._atomic import write_atomic as _write_atomic
from ._progress import Progress
from .catalogue import variants
from .catalogue.case import Case
from .catalogue.names import ARRAY_OPTIONS, DTYPES

__all__ = [
    "Fixture",
    "FixtureError",
    "FixtureLockError",
    "SCHEMA_VERSION",
    "TRUTH_KIND",
    "TRUTH_BUILDERS",
    "MANIFEST",
    "build",
    "generate",
    "write_fixture",
    "call_options",
    "Runner",
    "verify",
    "load",
    "sha256_of",
    "truth_kind_of",
]

SCHEMA_VERSION = 1
TRUTH_KIND = "exact-ziv"
MANIFEST = "manifest.json"
PARTIAL_MANIFEST = "manifest.partial.json"
GENERATOR = "oracle.golden"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)

#: ``runner(cases, out_dir)`` -> iterator of (case name, sha256) as each file is written.
Runner = Callable[[list[Case], Path], Iterator[tuple[str, str]]]


@dataclass
class Fixture:
    """One case with its inputs and its truth.

    Attributes
    ----------
    case : Case
    inputs : dict of str to ndarray
        q, k, v (case dtype) and mask, bias, dropout_mask, alibi_slopes, grad_out, grad_lse as
        the case needs.
    options : dict
        Keywords to pass to an implementation besides q, k, v: the case's scalar options plus
        its array options (the same objects as in ``inputs``).
    truth : dict of str to ndarray
        "out", "lse" in the case dtype and "out_f64", "lse_f64" (the exact values rounded to
        float64); for gradient cases "dq", "dk", "dv" and, with a bias, "dbias" (with sinks,
        "dsinks"), each with a "_f64" twin.
    truth_kind : str
        "exact-ziv": correctly rounded by refattn's exact path.
    """

    case: Case
    inputs: dict[str, np.ndarray]
    options: dict[str, Any]
    truth: dict[str, np.ndarray]
    truth_kind: str = TRUTH_KIND

    @property
    def name(self) -> str:
        return self.case.name


# ---------------------------------------------------------------------------------------------
# Truth
# ---------------------------------------------------------------------------------------------


def call_options(case: Case, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Keywords an implementation gets for ``case``: its scalar options and array options."""
    options = dict(case.options)
    for name in ARRAY_OPTIONS:
        if name in inputs:
            options[name] = inputs[name]
    return options


def _attention_truth(case: Case, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Exact forward (and backward) of refattn.attention, rounded to the case dtype and f64."""
    attention, attention_vjp = _exact_functions()
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    options = call_options(case, inputs)
    truth: dict[str, np.ndarray] = {}
    dtypes = [case.dtype] if case.dtype == "float64" else [case.dtype, "float64"]
    for dtype in dtypes:
        suffix = "" if dtype == case.dtype else "_f64"
        if options.get("normalizer") == "sigmoid":  # no lse to compare
            truth["out" + suffix] = attention(
                q, k, v, **options, precision="exact", out_dtype=dtype
            )
        else:
            out, lse = attention(
                q, k, v, **options, return_lse=True, precision="exact", out_dtype=dtype
            )
            truth["out" + suffix], truth["lse" + suffix] = out, lse
        if case.grads:
            grads = attention_vjp(
                q,
                k,
                v,
                inputs["grad_out"],
                grad_lse=inputs.get("grad_lse"),
                **options,
                precision="exact",
                out_dtype=dtype,
            )
            for name in ("dq", "dk", "dv", "dbias", "dsinks", "dqv"):
                value = getattr(grads, name, None)
                if value is not None:
                    truth[name + suffix] = value
    if case.dtype == "float64":
        for name in list(truth):
            truth[name + "_f64"] = truth[name]
    return truth


def _exact_functions():
    # imported lazily: spawn workers and `refattn-oracle verify` need not pay for it
    from refattn.attention import attention, attention_vjp

    return attention, attention_vjp


#: function name (Case.function) -> truth builder(case, inputs) -> dict of truth arrays.
#: The variants' extension point: register the exact builder of each new function here.
TRUTH_BUILDERS: dict[str, Callable[[Case, Mapping[str, np.ndarray]], dict[str, np.ndarray]]] = {
    "attention": _attention_truth,
    **variants.TRUTH_BUILDERS,
}


def build(case: Case) -> Fixture:
    """Compute the fixture of ``case`` in memory with refattn's exact path.

    Examples
    --------
    >>> from oracle import catalogue, golden
    >>> fixture = golden.build(catalogue.get("basic-H2K2-L5S7-D8E8-f32"))
    >>> fixture.truth["out"].dtype.name, fixture.truth["out_f64"].shape
    ('float32', (1, 2, 5, 8))
    """
    if case.function not in TRUTH_BUILDERS:
        raise ValueError(
            f"build: no truth builder for function {case.function!r} "
            f"(known: {sorted(TRUTH_BUILDERS)})"
        )
    inputs = catalogue.make_inputs(case)
    refuse = refusal.is_refusal(case)  # malformed inputs, no truth (oracle.refusal_cases)
    truth = (refusal.refusal_truth if refuse else TRUTH_BUILDERS[case.function])(case, inputs)
    return Fixture(case, inputs, call_options(case, inputs), truth, truth_kind_of(case))


# ---------------------------------------------------------------------------------------------
# Deterministic npz
# ---------------------------------------------------------------------------------------------


def _npy_bytes(array: np.ndarray) -> bytes:
    """npy format 1.0 bytes with a header written here (independent of NumPy's writer)."""
    array = np.asarray(array)
    if array.dtype.kind not in "biufU":
        raise TypeError(f"npz member: unsupported dtype {array.dtype} (no pickled objects)")
    dtype = array.dtype.newbyteorder("<") if array.dtype.itemsize > 1 else array.dtype
    array = np.asarray(array, dtype=dtype, order="C")
    shape = repr(tuple(int(n) for n in array.shape))
    header = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': {shape}, }}"
    # magic (6) + version (2) + header length (2) + header + padding + "\n" = multiple of 64
    pad = -(10 + len(header) + 1) % 64
    header_bytes = (header + " " * pad + "\n").encode("latin1")
    prefix = b"\x93NUMPY\x01\x00" + len(header_bytes).to_bytes(2, "little")
    return prefix + header_bytes + array.tobytes(order="C")


def _json_member(value) -> np.ndarray:
    return np.array(json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False))


def _npz_bytes(members: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(members):
            info = zipfile.ZipInfo(name + ".npy", date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3
            info.external_attr = 0o644 << 16
            archive.writestr(info, _npy_bytes(members[name]))
    return buffer.getvalue()


#: The ml_dtypes formats npy cannot name, stored as their bit patterns (uint16 / uint8) and
#: listed under their name in the ``meta`` member.
_BIT_PATTERN_DTYPES = {
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "float4_e2m1fn": np.uint8,  # one code per byte (the low nibble), as ml_dtypes stores it
    "float8_e8m0fnu": np.uint8,
}


def _storable(array: np.ndarray) -> tuple[np.ndarray, str | None]:
    array = np.asarray(array)
    if array.dtype.name in _BIT_PATTERN_DTYPES:
        return array.view(_BIT_PATTERN_DTYPES[array.dtype.name]), array.dtype.name
    return array, None


def fixture_bytes(fixture: Fixture) -> bytes:
    """The exact bytes of a fixture's .npz file."""
    members: dict[str, np.ndarray] = {}
    listed: dict[str, list[str]] = {"bfloat16": []}
    compact = golden_compact.is_compact(fixture.case)
    for group, arrays in (("inputs", fixture.inputs), ("truth", fixture.truth)):
        if compact and group == "inputs":  # regenerated on load (oracle.golden_compact)
            record = golden_compact.regeneration_record(arrays, _npy_bytes, _storable)
            members[golden_compact.MEMBER] = _json_member(record)
            continue
        for name, array in arrays.items():
            key = f"{group}/{name}"
            members[key], kind = _storable(array)
            if kind is not None:
                listed.setdefault(kind, []).append(key)
    members["case"] = _json_member(fixture.case.spec())
    members["options"] = _json_member(fixture.case.spec()["options"])
    # "bfloat16" is always present; a float8 list only when the fixture has float8 members
    # (so the bytes of fixtures without them are those of earlier releases)
    members["meta"] = _json_member(
        {
            "schema_version": SCHEMA_VERSION,
            "truth_kind": fixture.truth_kind,
            **{kind: sorted(keys) for kind, keys in listed.items()},
        }
    )
    return _npz_bytes(members)


def sha256_of(path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def json_bytes(value) -> bytes:
    return (json.dumps(value, sort_keys=True, indent=1, allow_nan=False) + "\n").encode()


# ---------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------


def _entry(case: Case, file_name: str, sha: str) -> dict:
    return {
        "name": case.name,
        "spec": case.spec(),
        "seed": case.seed,
        "dtype": case.dtype,
        "category": case.category,
        "file": file_name,
        "sha256": sha,
        "truth_kind": truth_kind_of(case),
        "contract": contract.case_contract(case),
    }


def truth_kind_of(case: Case) -> str:
    """The truth kind of ``case``'s fixture: "refusal" for a refusal case, else TRUTH_KIND."""
    return refusal.TRUTH_KIND if refusal.is_refusal(case) else TRUTH_KIND


def _manifest(suite_name: str, entries: list[dict]) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "generator": GENERATOR,
        "refattn_version": refattn.__version__,
        "suite": suite_name,
        "truth_kind": TRUTH_KIND,
        "precision_contract": contract.folder_contract(TRUTH_KIND),
        "cases": entries,
    }


def _work(spec_json: str, out_dir: str) -> tuple[str, str]:
    """Build one case and write its file atomically; return (name, sha256). Runs in workers."""
    return write_fixture(build(Case.from_spec(json.loads(spec_json))), out_dir)


def write_fixture(fixture: Fixture, out_dir) -> tuple[str, str]:
    """Write ``fixture`` as ``<name>.npz`` in ``out_dir`` atomically; return (name, sha256).

    The building block of every runner of :func:`generate` (local processes or
    :mod:`oracle.distribute`): the bytes depend on the fixture alone.
    """
    data = fixture_bytes(fixture)
    _write_atomic(Path(out_dir) / f"{fixture.name}.npz", data)
    return fixture.name, hashlib.sha256(data).hexdigest()


def _previous_entries(out: Path) -> dict[str, list[dict]]:
    entries: dict[str, list[dict]] = {}
    for name in (MANIFEST, PARTIAL_MANIFEST):
        try:
            manifest = json.loads((out / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
            continue
        cases = manifest.get("cases")
        for entry in cases if isinstance(cases, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                entries.setdefault(entry["name"], []).append(entry)
    return entries


def _reusable(case: Case, candidates: list[dict], out: Path) -> dict | None:
    """The recorded entry whose spec is the case's and whose sha256 the file on disk has."""
    path = out / f"{case.name}.npz"
    matching = [
        e for e in candidates if e.get("spec") == case.spec() and e.get("file") == path.name
    ]
    if not matching or path.is_symlink() or not path.is_file():
        return None
    sha = sha256_of(path)
    return next((e for e in matching if e.get("sha256") == sha), None)


def _remove_unselected(out: Path, previous: dict[str, list[dict]], selected: list[Case]):
    """Delete fixture files an earlier run recorded that the current selection drops.

    Only regular files whose recorded name is a plain ``<case name>.npz`` of that entry are
    removed: a manifest edited to point elsewhere never makes a run delete a user's file.
    """
    keep = {f"{c.name}.npz" for c in selected}
    for name, entries in previous.items():
        for entry in entries:
            file_name = entry.get("file")
            if (
                file_name != f"{name}.npz"
                or file_name_problem(file_name) is not None
                or file_name in keep
            ):
                continue
            path = out / file_name
            if path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)


def file_name_problem(file_name) -> str | None:
    """Why ``file_name`` is not a plain file name inside a fixture directory (None if it is).

    Examples
    --------
    >>> file_name_problem("basic.npz") is None
    True
    >>> file_name_problem("../outside/x.npz")
    'expected a plain file name inside the directory (no path separator, no ..)'
    """
    if not isinstance(file_name, str) or not file_name:
        return f"expected a non-empty string, got {type(file_name).__name__}"
    if (
        "/" in file_name
        or "\\" in file_name
        or "\0" in file_name
        or file_name in (".", "..")
        or os.path.isabs(file_name)
    ):
        return "expected a plain file name inside the directory (no path separator, no ..)"
    if not file_name.endswith(".npz"):
        return "expected a name ending in .npz"
    return None


def _select(suite: str, dtypes, cases) -> list[Case]:
    selected = list(cases) if cases is not None else catalogue.suite(suite)
    if dtypes is not None:
        wanted = {np.dtype(d).name if d != "bfloat16" else d for d in dtypes}
        unknown = wanted - set(DTYPES)
        if unknown:
            raise ValueError(f"dtypes: expected a subset of {DTYPES}, got {sorted(unknown)}")
        selected = [c for c in selected if c.dtype in wanted]
    if not selected:
        raise FixtureError(f"no case selected (suite {suite!r}, dtypes {dtypes}): nothing to write")
    names = [c.name for c in selected]
    if len(set(names)) != len(names):
        raise ValueError("cases: case names must be unique")
    return selected


def generate(
    suite: str,
    out_dir,
    *,
    dtypes: Iterable[str] | None = None,
    workers: int = 1,
    progress: bool = True,
    cases: Iterable[Case] | None = None,
    wait: bool = False,
    runner: Runner | None = None,
) -> Path:
    """Write one .npz per case and ``manifest.json`` into ``out_dir``; return the directory.

    Parameters
    ----------
    suite : str
        Suite name (recorded in the manifest; selects the cases unless ``cases`` is given).
    out_dir : path
        Created if missing. Files of an earlier or interrupted run are reused when their
        sha256 and spec match its (partial) manifest; files that run recorded for cases no
        longer selected are removed, other files are left alone.
    dtypes : iterable of str, optional
        Keep only cases of these dtypes.
    workers : int
        Processes (spawn) computing cases in parallel; the output does not depend on it.
    progress : bool
        Progress bar on stderr.
    cases : iterable of Case, optional
        Explicit cases instead of the suite's.
    wait : bool
        Wait for another writer of ``out_dir`` to finish instead of failing.
    runner : callable, optional
        ``runner(cases, out_dir)`` computes the cases still to do and yields ``(name, sha256)``
        as each file is written (with :func:`write_fixture`), in any order; default: ``workers``
        local processes. :func:`oracle.distribute.dask_runner` fans the cases (and blocks of
        one large case) out to a Dask cluster. Locking, resuming and the manifest stay here,
        so the directory is byte-identical whichever runner wrote it.

    Returns
    -------
    Path of ``out_dir``.

    Raises
    ------
    FixtureError
        ``out_dir`` is empty, not a directory or not writable (:class:`FixtureLockError` when
        another writer holds its lock and ``wait`` is false).
    OSError
        Writing failed (full disk...); every file already in place is complete and the
        partial manifest lets a rerun resume.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected an int >= 1, got {workers!r}")
    selected = _select(suite, dtypes, cases)
    out = destination(out_dir)
    if runner is None:

        def runner(todo, out):
            return _run(todo, out, workers)

    with writer_lock(out, wait=wait):
        return _generate_locked(suite, selected, out, runner, progress)


def _generate_locked(
    suite: str, selected: list[Case], out: Path, runner: Runner, progress: bool
) -> Path:
    remove_stale_temps(out)  # left by a run killed with SIGKILL; resumes match clean runs
    previous = _previous_entries(out)
    _remove_unselected(out, previous, selected)
    done: dict[str, dict] = {}
    for case in selected:
        entry = _reusable(case, previous.get(case.name, []), out)
        if entry is not None:
            done[case.name] = entry
    todo = [c for c in selected if c.name not in done]
    if todo:
        (out / MANIFEST).unlink(missing_ok=True)
    by_name = {c.name: c for c in selected}

    def record(name: str, sha: str) -> None:
        done[name] = _entry(by_name[name], f"{name}.npz", sha)
        entries = [done[c.name] for c in selected if c.name in done]
        _write_atomic(out / PARTIAL_MANIFEST, json_bytes(_manifest(suite, entries)))

    with Progress(len(selected), f"generate {suite}", enabled=progress) as bar:
        bar.advance(n=len(selected) - len(todo))
        for name, sha in runner(todo, out):
            record(name, sha)
            bar.advance(name)
    entries = [done[c.name] for c in selected]
    _write_atomic(out / MANIFEST, json_bytes(_manifest(suite, entries)))
    (out / PARTIAL_MANIFEST).unlink(missing_ok=True)
    return out


def _run(todo: list[Case], out: Path, workers: int) -> Iterator[tuple[str, str]]:
    specs = [c.spec_json() for c in todo]
    if workers == 1 or len(todo) <= 1:
        for spec in specs:
            yield _work(spec, str(out))
        return
    context = multiprocessing.get_context("spawn")
    # most expensive first keeps the workers busy to the end; order does not affect the output
    specs.sort(key=lambda s: -_cost(Case.from_spec(json.loads(s))))
    with context.Pool(workers) as pool:
        yield from pool.imap_unordered(_star_work, [(s, str(out)) for s in specs])


def _star_work(args):
    return _work(*args)


def _cost(case: Case) -> int:
    n = case.shapes
    cost = n.batch * n.H * n.L * n.S * (n.D + n.E)
    return cost * (4 if case.grads else 1) * (1 if case.dtype == "float64" else 2)


# ---------------------------------------------------------------------------------------------
# verify and load
# ---------------------------------------------------------------------------------------------

_ENTRY_TYPES = {
    "name": str,
    "spec": dict,
    "seed": int,
    "dtype": str,
    "category": str,
    "file": str,
    "sha256": str,
    "truth_kind": str,
}
_MANIFEST_TYPES = {
    "generator": str,
    "refattn_version": str,
    "suite": str,
    "truth_kind": str,
    "cases": list,
}
_TYPE_NAMES = {str: "a string", dict: "an object", int: "an integer", list: "a list"}


def _wrong_type(value, expected: type) -> bool:
    return isinstance(value, bool) or not isinstance(value, expected)


def verify(directory) -> list[str]:
    """Problems found in a fixture directory (an empty list means it is valid).

    Checks the manifest schema (one line per problem: file, key, what was expected), that every
    ``file`` is a plain file name inside the directory and not a symlink, every file's sha256,
    missing and extra files, each file's members (inputs, truth and grads as its spec says) and
    that it loads without pickle. Never raises on a bad directory.

    Examples
    --------
    >>> import tempfile
    >>> from oracle import golden
    >>> golden.verify(tempfile.mkdtemp())[0].startswith("manifest.json")
    True
    """
    root = Path(directory)
    manifest, problems = read_manifest(root)
    if problems:
        return problems
    problems = schema_problems(manifest)
    if problems:
        return problems
    listed = set()
    for entry in manifest["cases"]:
        listed.add(entry["file"])
        problems += _entry_problems(root, entry)
    for path in sorted(root.iterdir()):
        if path.name in (MANIFEST, LOCK_FILE) or path.name in listed:
            continue
        if path.name.startswith(".refattn-") and path.name.endswith(TMP_SUFFIX):
            problems.append(
                f"{path.name}: temporary file left by an interrupted run (safe to delete)"
            )
        else:
            problems.append(f"{path.name}: extra file not listed in {MANIFEST}")
    return problems


def read_manifest(root: Path) -> tuple[Any, list[str]]:
    if not root.is_dir():
        return None, [f"{root}: not a directory"]
    path = root / MANIFEST
    if path.is_symlink() or (path.exists() and not path.is_file()):
        return None, [f"{MANIFEST}: expected a regular file in {root}"]
    try:
        return json.loads(path.read_text(encoding="utf-8")), []
    except FileNotFoundError:
        return None, [f"{MANIFEST}: missing in {root}"]
    except OSError as exc:
        return None, [f"{MANIFEST}: unreadable ({exc.strerror})"]
    except ValueError as exc:
        return None, [f"{MANIFEST}: not valid JSON ({exc})"]


def schema_problems(manifest) -> list[str]:
    if not isinstance(manifest, dict):
        return [f"{MANIFEST}: expected a JSON object, got {type(manifest).__name__}"]
    version = manifest.get("schema_version")
    if _wrong_type(version, int) or version != SCHEMA_VERSION:
        return [f"{MANIFEST}: key 'schema_version': expected {SCHEMA_VERSION}, got {version!r}"]
    problems = []
    if manifest.get("truth_kind", TRUTH_KIND) != TRUTH_KIND:
        problems.append(
            f"{MANIFEST}: key 'truth_kind': expected {TRUTH_KIND!r}, got "
            f"{manifest['truth_kind']!r:.60}"
        )
    for key, expected in _MANIFEST_TYPES.items():
        if key not in manifest:
            problems.append(f"{MANIFEST}: missing key {key!r}")
        elif _wrong_type(manifest[key], expected):
            problems.append(
                f"{MANIFEST}: key {key!r}: expected {_TYPE_NAMES[expected]}, "
                f"got {manifest[key]!r:.60}"
            )
    if problems:
        return problems
    if not manifest["cases"]:
        return [f"{MANIFEST}: key 'cases': expected at least one case, got [] (nothing to check)"]
    names: dict[str, int] = {}
    files: dict[str, int] = {}
    for index, entry in enumerate(manifest["cases"]):
        problems += _case_entry_problems(index, entry, names, files)
    return problems


def _case_entry_problems(index: int, entry, names: dict, files: dict) -> list[str]:
    where = f"{MANIFEST}: cases[{index}]"
    if not isinstance(entry, dict):
        return [f"{where}: expected an object, got {entry!r:.60}"]
    problems = []
    for key, expected in _ENTRY_TYPES.items():
        if key not in entry:
            problems.append(f"{where}: missing key {key!r}")
        elif _wrong_type(entry[key], expected):
            problems.append(
                f"{where}: key {key!r}: expected {_TYPE_NAMES[expected]}, got {entry[key]!r:.60}"
            )
    if problems:
        return problems
    why = file_name_problem(entry["file"])
    if why is not None:
        problems.append(f"{where}: key 'file': {entry['file']!r}: {why}")
    for key, seen in (("name", names), ("file", files)):
        if entry[key] in seen:
            problems.append(
                f"{where}: key {key!r}: duplicate {entry[key]!r} (also cases[{seen[entry[key]]}])"
            )
        seen.setdefault(entry[key], index)
    try:
        case = Case.from_spec(entry["spec"])
    except Exception as exc:  # any malformed spec: report it, never a traceback
        return problems + [f"{where}: key 'spec': invalid case spec ({exc})"]
    if case.name != entry["name"] or case.seed != entry["seed"]:
        problems.append(f"{where}: key 'spec': name/seed disagree with the entry")
    if case.spec() != entry["spec"]:
        problems.append(
            f"{where}: key 'spec': not in canonical form (expected "
            f"{json.dumps(case.spec(), sort_keys=True):.80}...)"
        )
    for key, expected in (
        ("dtype", case.dtype),
        ("category", case.category),
        ("truth_kind", truth_kind_of(case)),
    ):
        if entry[key] != expected:
            problems.append(
                f"{where}: key {key!r}: expected {expected!r} (from the spec), "
                f"got {entry[key]!r:.60}"
            )
    return problems


def _entry_problems(root: Path, entry: dict) -> list[str]:
    path = root / entry["file"]
    if path.is_symlink():
        return [f"{entry['file']}: a symlink; expected a regular file (case {entry['name']})"]
    if not path.is_file():
        return [f"{entry['file']}: missing (case {entry['name']})"]
    try:
        sha = sha256_of(path)
    except OSError as exc:
        return [f"{entry['file']}: unreadable ({exc.strerror})"]
    if sha != entry["sha256"]:
        return [f"{entry['file']}: sha256 {sha} != manifest {entry['sha256']}"]
    try:
        fixture = _read_fixture(path)
    except FixtureError as exc:
        return [str(exc)]
    if fixture.case.spec() != entry["spec"]:
        return [f"{entry['file']}: embedded case spec differs from the manifest"]
    required = ["q", "k", "v"], ["out", "out_f64", "lse", "lse_f64"]
    if fixture.case.function != "attention":
        required = variants.required_members(fixture.case)
    elif refusal.is_refusal(fixture.case):
        required = ["q", "k", "v"], []
    elif fixture.case.grads:
        required[1].extend(["dq", "dk", "dv", "dq_f64", "dk_f64", "dv_f64"])
    missing = [f"inputs/{n}" for n in required[0] if n not in fixture.inputs]
    missing += [f"truth/{n}" for n in required[1] if n not in fixture.truth]
    return [f"{entry['file']}: missing members {missing}"] if missing else []


def _read_fixture(path: Path) -> Fixture:
    """Read one fixture file; FixtureError naming the file for anything unreadable."""
    if not zipfile.is_zipfile(path):
        raise FixtureError(
            f"{path.name}: not a ZIP archive (.npz written by `refattn-oracle generate` expected)"
        )
    try:
        return _parse_fixture(path)
    except Exception as exc:  # a corrupt archive may raise anything numpy/zipfile raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FixtureError(f"{path.name}: unreadable ({message})") from None


def _parse_fixture(path: Path) -> Fixture:
    with np.load(path, allow_pickle=False) as archive:
        members = {name: archive[name] for name in archive.files}
    meta = json.loads(str(members.pop("meta")))
    case = Case.from_spec(json.loads(str(members.pop("case"))))
    members.pop("options")
    for kind in _BIT_PATTERN_DTYPES:
        for key in meta.get(kind, []):
            members[key] = members[key].view(getattr(ml_dtypes, kind))
    inputs = {k.split("/", 1)[1]: a for k, a in members.items() if k.startswith("inputs/")}
    if golden_compact.MEMBER in members:
        record = members.pop(golden_compact.MEMBER)
        inputs = golden_compact.regenerate(case, record, _npy_bytes, _storable, path.name)
    truth = {k.split("/", 1)[1]: a for k, a in members.items() if k.startswith("truth/")}
    return Fixture(
        case=case,
        inputs=inputs,
        options=call_options(case, inputs),
        truth=truth,
        truth_kind=meta.get("truth_kind", TRUTH_KIND),
    )


def load(directory, *, names: Iterable[str] | None = None, check: bool = True) -> Iterator[Fixture]:
    """Yield the fixtures stored in ``directory`` (all, or those in ``names``) in manifest order.

    Parameters
    ----------
    directory : path
        A directory written by :func:`generate`.
    names : iterable of str, optional
        Case names to load; an unknown name is a KeyError.
    check : bool
        Compare each file's sha256 with the manifest.

    Raises
    ------
    FixtureError
        (a ValueError) for a malformed manifest, an entry that is not a plain file name inside
        the directory, a missing, symlinked, corrupt or (with ``check``) modified file; the
        message names the file and the problem.
    """
    root = Path(directory)
    manifest, problems = read_manifest(root)
    problems = problems or schema_problems(manifest)
    if problems:
        more = (
            f" (and {len(problems) - 1} more; run `refattn-oracle verify {root}`)"
            if len(problems) > 1
            else ""
        )
        raise FixtureError(f"load: {problems[0]}{more}")
    entries = manifest["cases"]
    if names is not None:
        wanted = [names] if isinstance(names, str) else list(names)
        known = {e["name"] for e in entries}
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise KeyError(f"load: no case named {unknown} in {root / MANIFEST}")
        entries = [e for e in entries if e["name"] in set(wanted)]
    for entry in entries:
        path = root / entry["file"]
        if path.is_symlink() or not path.is_file():
            raise FixtureError(
                f"load: {entry['file']}: missing or not a regular file (case {entry['name']})"
            )
        if check and sha256_of(path) != entry["sha256"]:
            raise FixtureError(f"load: {path} does not match its sha256 in {MANIFEST}")
        fixture = _read_fixture(path)
        if fixture.case.spec() != entry["spec"]:
            raise FixtureError(
                f"load: {entry['file']}: embedded case spec differs from the manifest"
            )
        yield fixture
