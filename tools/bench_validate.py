"""Time `refattn-oracle validate` of adapters on a suite (target: "default" in < 60 s on 2 cores).

Fixtures are generated into --fixtures DIR first when the directory has no manifest (that
time is reported separately: it is the fixture generation, not the validation).

    python tools/bench_validate.py --fixtures /tmp/refattn-default --adapter refattn-float64 \
        --adapter torch --dtype all
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="default")
    parser.add_argument(
        "--fixtures", default=None, help="fixture directory (default: a temporary one)"
    )
    parser.add_argument(
        "--adapter", action="append", help="adapter name (repeatable; default refattn-float64)"
    )
    parser.add_argument("--dtype", default="all")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args(argv)

    from oracle.fixtures import golden
    from oracle.run.validate import validate

    directory = Path(args.fixtures or f"/tmp/refattn-fixtures-{args.suite}")
    figures = {"suite": args.suite, "fixtures": str(directory)}
    if not (directory / "manifest.json").exists():
        start = time.perf_counter()
        golden.generate(args.suite, directory, workers=args.workers, progress=True)
        figures["generate_seconds"] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    fixtures = list(golden.load(directory))
    figures["load_seconds"] = round(time.perf_counter() - start, 2)
    dtype = None if args.dtype == "all" else args.dtype
    figures["adapters"] = {}
    for name in args.adapter or ["refattn-float64"]:
        start = time.perf_counter()
        report = validate(name, fixtures=fixtures, dtype=dtype, progress=False)
        seconds = time.perf_counter() - start
        counts = {c: report.counts(c) for c in ("conformance", "robustness")}
        figures["adapters"][name] = {
            "seconds": round(seconds, 2),
            "passed": report.passed,
            "counts": counts,
        }
        print(f"{name:16s} {seconds:7.2f} s  passed={report.passed}  {counts}", flush=True)
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
