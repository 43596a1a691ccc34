"""The streaming, atomic loop every export format shares.

Each format is a :class:`Format`: ``write(fixture, staging, out) -> entry`` writes one case's
files under ``staging`` (a temporary directory of this run inside ``out``) and returns its
manifest entry (``{"name", "files", ...}`` or ``{"name", "skipped": reason}``); ``finish(out,
entries, staging)`` writes the format's shared files. Fixtures are read one at a time
(:func:`oracle.fixtures.golden.load`), so memory stays that of one case.

Atomicity (as :func:`oracle.fixtures.golden.generate`): the writer holds ``out``'s lock, every file
is
first written under the staging directory ``.refattn-<pid>-<random>.tmp`` and moved into place
with ``os.replace`` once complete; ``export.json`` (the manifest) is removed at the start and
written last, so a directory with an ``export.json`` is complete. On any failure the staging
directory is removed: only complete files of this or earlier runs remain.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import refattn
from oracle.fixtures import atomic as _atomic
from oracle.fixtures import golden
from oracle.run.progress import Progress

__all__ = [
    "Format",
    "ExportError",
    "EXPORT_MANIFEST",
    "run_export",
    "publish",
    "precision_contract",
    "NO_TRUTH",
]

EXPORT_MANIFEST = "export.json"
EXPORT_SCHEMA_VERSION = 1
#: Why a refusal case (malformed inputs a kernel must refuse, oracle.judging.must_refuse) has no
# ONNX node
#: or FlashInfer workload (safetensors exports its inputs and contract, without truth).
NO_TRUTH = "refusal case: malformed inputs a kernel must refuse, no truth to export"


class ExportError(golden.FixtureError):
    """Bad export input or destination (one-line message)."""


@dataclass
class Format:
    """One export format: per-case writer, shared-files writer and its own notes."""

    name: str
    write: Callable  # (fixture, staging: Path, out: Path) -> dict
    finish: Callable = field(default=lambda out, entries, staging: {})  # -> extra manifest keys


def precision_contract(truth_kind: str) -> dict:
    """What the exported truths are, stated once for every format's metadata."""
    return {
        "truth": "every truth element is the exact real result of the case (docs/conventions.md) "
        "rounded once to the stored dtype, round to nearest, ties to even; <name>_f64 rounded "
        "once to float64",
        "truth_kind": truth_kind,
        "conventions_version": f"refattn {refattn.__version__} docs/conventions.md",
        "refattn_version": refattn.__version__,
    }


def _staging(out: Path) -> Path:
    staging = out / _atomic.temp_name()
    staging.mkdir(mode=0o777)
    return staging


def publish(staging: Path, out: Path, relative: str) -> None:
    """Move ``staging/relative`` (a complete file or folder) to ``out/relative`` atomically.

    A folder replaces an earlier one of the same name: the old one is first renamed aside, so
    at every moment the destination is either the old complete folder or the new one.
    """
    source, target = staging / relative, out / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir() and target.exists():
        aside = staging / (_atomic.temp_name() + "-old")
        os.replace(target, aside)
        os.replace(source, target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(source, target)


def _fixture_names(fixtures: Path, names: Iterable[str] | None) -> list[str]:
    manifest, problems = golden.read_manifest(fixtures)
    problems = problems or golden.schema_problems(manifest)
    if problems:
        raise ExportError(f"fixtures: {problems[0]} (run `refattn-oracle verify {fixtures}`)")
    known = [e["name"] for e in manifest["cases"]]
    if names is None:
        return known
    wanted = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in wanted if n not in set(known)]
    if unknown:
        raise ExportError(f"names: no case named {unknown[:3]} in {fixtures / golden.MANIFEST}")
    return [n for n in known if n in set(wanted)]


def run_export(
    fmt: Format, fixtures, out, *, names=None, progress: bool = True, check: bool = True
) -> Path:
    """Export the fixtures in ``fixtures`` to ``out`` in format ``fmt``; return ``out``."""
    if fixtures is None or str(fixtures) == "":
        raise ExportError("fixtures: expected a fixture directory, got an empty string")
    fixtures = Path(fixtures)
    if not fixtures.is_dir():
        raise ExportError(f"fixtures: {fixtures} is not a directory")
    selected = _fixture_names(fixtures, names)
    try:
        out = _atomic.destination(out)
    except golden.FixtureError as exc:
        raise ExportError(str(exc)) from None
    if out.resolve() == fixtures.resolve():
        raise ExportError(f"out: {out} is the fixture directory; choose another one")
    with _lock(out):
        (out / EXPORT_MANIFEST).unlink(missing_ok=True)
        staging = _staging(out)
        try:
            entries = _export_cases(fmt, fixtures, out, staging, selected, progress, check)
            extra = fmt.finish(out, entries, staging) or {}
            manifest = _manifest(fmt, fixtures, entries, extra)
            _atomic.write_atomic(out / EXPORT_MANIFEST, golden.json_bytes(manifest))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


class _lock(_atomic.writer_lock):
    """``out``'s writer lock, failing at once with an ExportError when another writer holds it."""

    def __init__(self, out: Path):
        super().__init__(out, wait=False)

    def __enter__(self):
        try:
            return super().__enter__()
        except golden.FixtureError as exc:
            raise ExportError(str(exc).replace("`generate`", "writer")) from None


def _export_cases(fmt, fixtures, out, staging, selected, progress, check) -> list[dict]:
    entries = []
    with Progress(len(selected), f"export {fmt.name}", enabled=progress) as bar:
        for fixture in golden.load(fixtures, names=selected, check=check):
            entries.append(fmt.write(fixture, staging, out))
            bar.advance(fixture.name)
    for entry in entries:
        entry.setdefault("skipped", None)
    return entries


def _manifest(fmt: Format, fixtures: Path, entries: list[dict], extra: dict) -> dict:
    source = json.loads((fixtures / golden.MANIFEST).read_text())
    exported = [e for e in entries if e["skipped"] is None]
    return {
        "export_schema_version": EXPORT_SCHEMA_VERSION,
        "format": fmt.name,
        "generator": "oracle.export",
        "suite": source.get("suite"),
        "source_refattn_version": source.get("refattn_version"),
        "precision_contract": precision_contract(source.get("truth_kind", golden.TRUTH_KIND)),
        "counts": {"exported": len(exported), "not_expressible": len(entries) - len(exported)},
        **extra,
        "cases": entries,
    }


def has_empty_row(spec) -> bool:
    """Whether a row of a canonical :class:`refattn.spec.AttentionSpec` has no allowed key."""
    lo, hi = spec.intervals()
    if (hi <= lo).any():
        return True
    batch, heads, _, length, keys, _, _ = spec.dims
    columns = np.arange(keys)
    structural = ((columns >= lo[..., None]) & (columns < hi[..., None]))[:, None]
    allowed = np.broadcast_to(structural, (batch, heads, length, keys))
    if spec.mask is not None:
        allowed = allowed & spec.mask
    if spec.bias is not None:
        allowed = allowed & (spec.bias != -np.inf)
    return bool((~allowed.any(-1)).any())
