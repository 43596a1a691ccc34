"""Compare the oracle's per-element thresholds (T2/T7, with T8 where present) of two trees.

Each source tree (a checkout or a ``git archive`` export of a refattn commit) judges the same
fixtures with its own judging code, in a subprocess whose ``PYTHONPATH`` is that tree: an
implementation that returns the fixture's float64 truth (out, lse and every gradient the
fixture holds) is passed to the tree's ``check_fixture`` in each tier, and the threshold each
output element is judged against -- ``np.broadcast_to(check.threshold.value, shape)``, the
array the judge compares the normalised errors (T1) with -- is kept for every quantity.

Thresholds depend on the fixture alone (the truth, the inputs and the number of gradient
elements an implementation returns, here all of them), not on what is judged, so an element's
verdict can change between the trees, for any implementation, only where its threshold
changed: it flips exactly when its error lies between the old and the new threshold. The
report counts, per dtype, tier and kind of quantity (forward: out and lse; gradients):
elements whose threshold is bit-identical; finite in both but different (with the largest
relative change, and how many got stricter or looser); NaN/inf before and finite now; other.

    python tools/compare_thresholds.py --old /tmp/base --new . \
        --fixtures /tmp/refattn-default --dtype float32 --json /tmp/thresholds.json

``--keep DIR`` keeps each tree's dump (``<fixtures>-old.npz``, ``<fixtures>-new.npz``: one
array of thresholds per ``<case>|<tier>|<quantity>``) for a closer look at changed elements.

Only the cases both trees' ``default`` suites hold are compared, and only those whose inputs
the old tree's catalogue rebuilds byte for byte from the fixture's case (same seed, shapes
and recipe: the same inputs, checked by sha256). The judging-parts disk cache is turned off
(``REFATTN_CACHE=off``) so every threshold is computed by the tree's own code.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TIERS = ("default", "tight")
FORWARD = ("out", "lse")


# ---------------------------------------------------------------------------------------------
# The dump: run inside one tree (its oracle on sys.path)
# ---------------------------------------------------------------------------------------------


class _Truth:
    """An implementation returning the fixture's float64 truth: out and lse from the forward,
    every gradient the fixture holds from the vjp."""

    def __init__(self, truth):
        self.truth = truth

    def _get(self, name):
        for key in (f"{name}_f64", name):
            value = self.truth.get(key)
            if value is not None:
                return np.asarray(value).astype(np.float64)
        return None

    def __call__(self, q, k, v, **options):
        lse = self._get("lse")
        out = self._get("out")
        return (out, lse) if options.get("return_lse") and lse is not None else out

    def vjp(self, q, k, v, grad_out, **options):
        return tuple(self._get(n) for n in ("dq", "dk", "dv", "dbias", "dsinks", "dqv"))


def _sha(arrays: dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        x = np.ascontiguousarray(np.asarray(arrays[name]))
        digest.update(f"{name}:{x.dtype.str}:{x.shape}".encode())
        digest.update(x.tobytes())
    return digest.hexdigest()


def _load(directory, names):
    """The tree's fixtures of ``names`` from ``directory``; when the tree's loader refuses the
    manifest as a whole (entries of cases it does not know), the files one by one."""
    from oracle.fixtures import golden

    try:
        return list(golden.load(directory, names=names))
    except (ValueError, KeyError):
        manifest = json.loads((Path(directory) / "manifest.json").read_text())
        files = {e["name"]: e["file"] for e in manifest["cases"]}
        read = golden._read_fixture  # the tree's own reader of one file
        return [read(Path(directory) / files[n]) for n in names]


def _inputs_sha(name):
    """sha256 of the inputs this tree's catalogue builds for case ``name`` (None: unknown)."""
    from oracle.catalogue import registry

    try:
        case = registry.get(name)
    except KeyError:
        return None
    return _sha(registry.make_inputs(case))


def _judge_tier(fixture, tier, grads):
    from oracle.judging.judge import check_fixture

    impl = _Truth(fixture.truth)
    keywords = dict(grads=grads, diagnose=False, tolerance=tier)
    if "grade" in inspect.signature(check_fixture).parameters:
        keywords["grade"] = False
    else:
        fixture.judge_memo = {}  # the older judge's ungraded context (oracle.power's memo)
    return check_fixture(impl, fixture, **keywords)


def dump(directory, names, out_path) -> None:
    """Write every threshold of the fixtures ``names`` in both tiers to ``out_path`` (npz):
    ``<case>|<tier>|<quantity>`` arrays, and a JSON member ``meta`` with each case's input
    sha256 (of the stored fixture and as this tree's catalogue builds it) and verdicts."""
    arrays, meta = {}, {}
    for fixture in _load(directory, names):
        name = fixture.case.name
        info = meta[name] = {
            "fixture_sha": _sha(fixture.inputs),
            "catalogue_sha": _inputs_sha(name),
            "verdicts": {},
        }
        grads = fixture.truth.get("dq") is not None
        for tier in TIERS:
            result = _judge_tier(fixture, tier, grads)
            info["verdicts"][tier] = [result.verdict, result.message[:200]]
            for quantity, check in result.checks.items():
                if check.errors is None:
                    continue
                value = np.asarray(check.threshold.value, dtype=np.float64)
                arrays[f"{name}|{tier}|{quantity}"] = np.broadcast_to(value, check.errors.shape)
    np.savez(out_path, meta=np.array(json.dumps(meta)), **arrays)


# ---------------------------------------------------------------------------------------------
# The comparison: run from any interpreter
# ---------------------------------------------------------------------------------------------


def _suite_names(tree: Path) -> list[str]:
    code = (
        "import json; from oracle.catalogue import registry; "
        "print(json.dumps([c.name for c in registry.suite('default')]))"
    )
    return json.loads(_python(tree, ["-c", code]).splitlines()[-1])


def _python(tree: Path, arguments) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree), REFATTN_CACHE="off")
    done = subprocess.run(
        [sys.executable, *arguments],
        cwd=tree,  # the tree's root first on sys.path, whatever the caller's directory
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"{tree}: {done.stderr[-3000:]}")
    return done.stdout


def _dump_in(tree: Path, directory, names, out_path) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(names, handle)
    start = time.perf_counter()
    try:
        script = str(Path(__file__).resolve())
        _python(tree, [script, "dump", str(directory), handle.name, str(out_path)])
    finally:
        os.unlink(handle.name)
    return time.perf_counter() - start


def _group(quantity: str) -> str:
    return "forward" if quantity in FORWARD else "grads"


def _new_row() -> dict:
    return {
        "elements": 0,
        "identical": 0,
        "finite_changed": 0,
        "stricter": 0,
        "looser": 0,
        "max_rel_change": 0.0,
        "old_nonfinite_new_finite": 0,
        "other": 0,
    }


def _tally(row, old, new, key, changes) -> None:
    """Add one quantity's element classes to ``row``; note its changed finite elements."""
    same = old.view(np.uint64) == new.view(np.uint64)
    both = np.isfinite(old) & np.isfinite(new)
    changed = both & ~same
    gained = ~np.isfinite(old) & np.isfinite(new)
    row["elements"] += old.size
    row["identical"] += int(same.sum())
    row["finite_changed"] += int(changed.sum())
    row["old_nonfinite_new_finite"] += int(gained.sum())
    row["other"] += int((~same & ~changed & ~gained).sum())
    if changed.any():
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.abs(new - old) / np.abs(old)
        row["stricter"] += int((changed & (new < old)).sum())
        row["looser"] += int((changed & (new > old)).sum())
        worst = float(np.max(np.where(changed, rel, 0.0)))
        row["max_rel_change"] = max(row["max_rel_change"], worst)
        flat = int(np.argmax(np.where(changed, rel, -1.0)))
        index = [int(i) for i in np.unravel_index(flat, old.shape)]
        changes.append(
            {
                "key": key,
                "count": int(changed.sum()),
                "max_rel_change": worst,
                "index": index,
                "old": float(old.flat[flat]),
                "new": float(new.flat[flat]),
            }
        )


def compare(old_npz, new_npz, dtype_of) -> dict:
    """Per (dtype, tier, group) rows of element classes, and the changed finite elements."""
    old, new = np.load(old_npz), np.load(new_npz)
    rows, changes, missing = {}, [], []
    for key in sorted(set(old.files) | set(new.files)):
        if key == "meta":
            continue
        if key not in old.files or key not in new.files or old[key].shape != new[key].shape:
            missing.append(key)
            continue
        case, tier, quantity = key.split("|")
        if case not in dtype_of:  # left out: its inputs differ between the trees
            continue
        row = rows.setdefault(f"{dtype_of[case]}|{tier}|{_group(quantity)}", _new_row())
        _tally(row, old[key].astype(np.float64), new[key].astype(np.float64), key, changes)
    return {"rows": rows, "changes": changes, "unmatched": missing}


def _common_cases(old: Path, new: Path, directory: Path, dtypes) -> tuple[list, dict]:
    manifest = json.loads((directory / "manifest.json").read_text())
    dtype_of = {e["name"]: e["dtype"] for e in manifest["cases"]}
    both = set(_suite_names(old)) & set(_suite_names(new))
    names = [n for n in dtype_of if n in both and (not dtypes or dtype_of[n] in dtypes)]
    return names, dtype_of


def _checked(meta_old, meta_new, names) -> tuple[list, list]:
    """Cases whose stored inputs both trees' catalogues rebuild byte for byte."""
    kept, dropped = [], []
    for name in names:
        old, new = meta_old.get(name, {}), meta_new.get(name, {})
        shas = {old.get("fixture_sha"), old.get("catalogue_sha"), new.get("catalogue_sha")}
        (kept if len(shas) == 1 and None not in shas else dropped).append(name)
    return kept, dropped


def run(args) -> dict:
    old, new = Path(args.old).resolve(), Path(args.new).resolve()
    report = {"old": str(old), "new": str(new), "fixtures": [], "seconds": {}}
    merged = {"rows": {}, "changes": [], "unmatched": [], "inputs_differ": []}
    work = Path(args.keep or tempfile.mkdtemp(prefix="thresholds-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        _compare_all(args, old, new, work, report, merged)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report.update(merged)
    return report


def _compare_all(args, old, new, work, report, merged) -> None:
    """Dump both trees' thresholds of each fixture directory into ``work`` and compare."""
    for directory in map(Path, args.fixtures):
        names, dtype_of = _common_cases(old, new, directory, args.dtype)
        names = names[: args.limit] if args.limit else names
        report["fixtures"].append({"directory": str(directory), "cases": len(names)})
        dumps = {}
        for label, tree in (("old", old), ("new", new)):
            dumps[label] = work / f"{directory.name}-{label}.npz"
            seconds = _dump_in(tree, directory, names, dumps[label])
            report["seconds"][f"{directory.name}/{label}"] = round(seconds, 1)
        metas = {k: json.loads(str(np.load(p)["meta"])) for k, p in dumps.items()}
        kept, dropped = _checked(metas["old"], metas["new"], names)
        merged["inputs_differ"] += dropped
        found = compare(dumps["old"], dumps["new"], {n: dtype_of[n] for n in kept})
        for key, row in found["rows"].items():
            total = merged["rows"].setdefault(key, _new_row())
            for field, value in row.items():
                total[field] = (
                    max(total[field], value)
                    if field == "max_rel_change"
                    else (total[field] + value)
                )
        merged["changes"] += found["changes"]
        merged["unmatched"] += found["unmatched"]
        for label, meta in metas.items():
            verdicts = merged.setdefault("verdicts", {}).setdefault(label, {})
            verdicts.update({n: m["verdicts"] for n, m in meta.items()})


def _print(report) -> None:
    print(f"old {report['old']}\nnew {report['new']}")
    for entry in report["fixtures"]:
        print(f"fixtures {entry['directory']}: {entry['cases']} cases in both suites")
    print(f"cases whose inputs differ (left out): {len(report['inputs_differ'])}")
    print(f"quantities in one tree only or of another shape: {len(report['unmatched'])}")
    head = ("dtype|tier|group", "elements", "identical", "finite_changed", "max_rel_change",
            "stricter", "looser", "old_nonfinite_new_finite", "other")  # fmt: skip
    print(" ".join(f"{h:>24}" if i == 0 else f"{h:>14}" for i, h in enumerate(head)))
    for key in sorted(report["rows"]):
        row = report["rows"][key]
        cells = [f"{row[h]:.3g}" if h == "max_rel_change" else str(row[h]) for h in head[1:]]
        print(f"{key:>24} " + " ".join(f"{c:>14}" for c in cells))
    for change in sorted(report["changes"], key=lambda c: -c["max_rel_change"])[:20]:
        print(f"changed: {change}")
    for label, verdicts in report.get("verdicts", {}).items():
        counts: dict = {}
        for tiers in verdicts.values():
            for tier, (verdict, _) in tiers.items():
                counts[f"{tier}:{verdict}"] = counts.get(f"{tier}:{verdict}", 0) + 1
        print(f"verdicts of the truth in the {label} tree: {counts}")
    print(f"seconds: {report['seconds']}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "dump":  # inside one tree: dump DIRECTORY NAMES_JSON OUT_NPZ
        dump(argv[1], json.loads(Path(argv[2]).read_text()), argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the older source tree")
    parser.add_argument("--new", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--fixtures", action="append", required=True, help="generated suite")
    parser.add_argument("--dtype", action="append", help="only these dtypes (repeatable)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many cases per dir")
    parser.add_argument("--json", help="write the full report here")
    parser.add_argument("--keep", help="keep the dumps (<dir>-old.npz, <dir>-new.npz) here")
    args = parser.parse_args(argv)
    report = run(args)
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
