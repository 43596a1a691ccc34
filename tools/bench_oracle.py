"""Time golden-fixture generation of the oracle's suites (oracle.fixtures.golden.generate).

Examples
--------
    python tools/bench_oracle.py                       # smoke and default, 1 and 2 workers
    python tools/bench_oracle.py --suite full --workers 2 --slowest 15

Each run writes into a fresh temporary directory (removed afterwards unless --keep), checks it
with oracle.fixtures.golden.verify and reports wall time, case count, size on disk and, with
--slowest,
the most expensive cases (timed one by one with oracle.fixtures.golden.build in this process).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oracle import catalogue
from oracle.fixtures import golden  # noqa: E402


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


def bench_generate(suite: str, workers: int, keep: bool) -> dict:
    """Generate ``suite`` into a temporary directory; return timing and size figures."""
    out = Path(tempfile.mkdtemp(prefix=f"refattn-{suite}-w{workers}-"))
    start = time.perf_counter()
    golden.generate(suite, out, workers=workers, progress=False)
    seconds = time.perf_counter() - start
    problems = golden.verify(out)
    figures = {
        "suite": suite,
        "workers": workers,
        "cases": len(catalogue.suite(suite)),
        "seconds": seconds,
        "bytes": _size(out),
        "problems": len(problems),
        "dir": out,
    }
    if not keep:
        shutil.rmtree(out)
    return figures


def slowest(suite: str, count: int) -> list[tuple[float, str]]:
    """The ``count`` most expensive cases of ``suite`` (build time, name)."""
    timings = []
    for case in catalogue.suite(suite):
        start = time.perf_counter()
        golden.build(case)
        timings.append((time.perf_counter() - start, case.name))
    return sorted(timings, reverse=True)[:count]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite",
        action="append",
        choices=catalogue.SUITES,
        help="suite to time (repeatable; default: smoke and default)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        action="append",
        help="worker processes (repeatable; default: 1 and 2)",
    )
    parser.add_argument(
        "--slowest",
        type=int,
        default=0,
        metavar="N",
        help="also list the N slowest cases of each suite",
    )
    parser.add_argument("--keep", action="store_true", help="keep the generated directories")
    args = parser.parse_args(argv)
    suites = args.suite or ["smoke", "default"]
    workers = args.workers or [1, 2]
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"python {platform.python_version()}"
    )
    print(f"{'suite':8s} {'workers':>7s} {'cases':>6s} {'seconds':>8s} {'MB':>6s} problems")
    status = 0
    for suite in suites:
        for count in workers:
            f = bench_generate(suite, count, args.keep)
            print(
                f"{f['suite']:8s} {f['workers']:7d} {f['cases']:6d} {f['seconds']:8.1f} "
                f"{f['bytes'] / 1e6:6.2f} {f['problems']}" + (f"  {f['dir']}" if args.keep else "")
            )
            status |= f["problems"] > 0
        if args.slowest:
            for seconds, name in slowest(suite, args.slowest):
                print(f"    {seconds:7.2f} s  {name}")
    return int(status)


if __name__ == "__main__":
    raise SystemExit(main())
