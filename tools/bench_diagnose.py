#!/usr/bin/env python
"""Benchmark the diagnosis budget: ``validate`` with and without diagnoses, in the same run.

The planted long-row kernels of ``refattn-oracle power`` (:mod:`oracle.power.planted`:
int16 positions, a rescale or a 16-bit accumulator missing past a depth) fail on the long-row
cases of the default suite (S up to 128k keys). For each kernel the tool validates the same
fixtures (built once, in memory, before any timing) twice, back to back: without diagnoses and
with them at ``--budget`` (a multiple of each case's judging time,
:mod:`oracle.diagnose.budget`), and prints both wall times and their ratio, the failing
cases, the diagnoses that ran out of budget, and the load average before and after (the
machine may be shared: absolute figures move with the load, the same-run ratio much less; the
ratio of the process's CPU times, printed beside it, moves least; "within the run" is the run
with diagnoses against its own time less its diagnoses'). For each kernel it also
prints the largest ratio of one case's diagnosis to that case's judging time (both measured in
the run with diagnoses, :func:`oracle.diagnose.budget.recording`) and how many diagnoses had
only the floor (:data:`~oracle.diagnose.budget.FLOOR_SECONDS`) as their budget.
``--names`` prints every failing case's diagnosis, ``--cases`` each failing case's times.

Examples::

    python tools/bench_diagnose.py                               # 7 kernels, long-* float32
    python tools/bench_diagnose.py --kernel positions16 --names
    python tools/bench_diagnose.py --case 'long-decode-*' --budget 3
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from oracle import catalogue  # noqa: E402
from oracle.diagnose import budget  # noqa: E402
from oracle.diagnose.budget import DEFAULT_MULTIPLE  # noqa: E402
from oracle.fixtures import golden  # noqa: E402
from oracle.judging import parts  # noqa: E402
from oracle.power.planted import POWER_BROKEN  # noqa: E402
from oracle.run.validate import validate  # noqa: E402

#: The planted kernels whose bugs show only on long rows.
LONG_ROW_KERNELS = (
    "positions16",
    "no_rescale_after_8k",
    "no_rescale_after_32k",
    "narrow_pv_after_1k",
    "narrow_pv_after_32k",
    "narrow_l_after_1k",
    "narrow_l_after_32k",
)


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _fixtures(suite, dtype, patterns):
    cases = [
        c
        for c in catalogue.suite(suite)
        if c.dtype == dtype and any(fnmatch.fnmatchcase(c.name, p) for p in patterns)
    ]
    return [golden.build(c) for c in cases]


def _run(kernel, fixtures, args, diagnose):
    impl = POWER_BROKEN[kernel][0]  # a partial: judged in this process (as `power` does)
    parts.clear_memory()  # each run computes its judging parts, as a command-line run does
    start, cpu = time.perf_counter(), time.process_time()
    with budget.recording() as cases:
        report = validate(
            impl,
            fixtures=fixtures,
            dtype=None,
            progress=args.progress,
            diagnose=diagnose,
            diagnose_budget=args.budget,
            isolate=False,
        )
    return report, time.perf_counter() - start, time.process_time() - cpu, cases


def _within(wall, cases) -> float:
    """The run with diagnoses against its own judging (its wall time less the diagnoses'):
    the ratio free of a load that changed between the two runs."""
    diagnosing = sum(c.elapsed for c in cases)
    return wall / (wall - diagnosing) if wall > diagnosing else math.nan


def _per_case(cases, plain, args) -> str:
    """The largest ratio of a case's diagnosis to its judging time, and the floor's share."""
    if not cases:
        return "  no diagnosis"
    ratios = [(c.elapsed / max(c.judging, 1e-9), c) for c in cases]
    ratio, worst = max(ratios, key=lambda x: x[0])
    floored = [c for c in cases if c.seconds > c.budget.multiple * c.judging]
    for c in cases if args.cases else ():
        print(
            f"  {c.name:42s} judged {plain.get(c.name, math.nan):5.2f} s alone, "
            f"{c.judging:5.2f} s before its diagnosis, budget {c.seconds:5.2f} s, "
            f"diagnosis {c.elapsed:5.2f} s ({c.elapsed / max(c.judging, 1e-9):4.1f}x)"
            + (" stopped" if c.stopped else "")
        )
    return (
        f"  per case: diagnosis at most {ratio:.2f}x its judging time ({worst.name}: "
        f"{worst.elapsed:.2f} s for {worst.judging:.2f} s), {len(floored)} of {len(cases)} "
        f"on the floor ({sum(c.elapsed for c in floored):.1f} s of "
        f"{sum(c.elapsed for c in cases):.1f} s diagnosing)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", action="append", choices=sorted(POWER_BROKEN), default=[])
    parser.add_argument("--case", action="append", default=[], help="fnmatch (default long-*)")
    parser.add_argument("--suite", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget", type=float, default=DEFAULT_MULTIPLE, help="multiple")
    parser.add_argument("--progress", action="store_true", help="the progress bars on stderr")
    parser.add_argument("--names", action="store_true", help="print each failing diagnosis")
    parser.add_argument("--cases", action="store_true", help="print each failing case's times")
    args = parser.parse_args(argv)
    kernels = args.kernel or list(LONG_ROW_KERNELS)
    print(f"before: {_load()} ({os.cpu_count()} CPUs)")
    start = time.perf_counter()
    fixtures = _fixtures(args.suite, args.dtype, args.case or ["long-*"])
    print(f"{len(fixtures)} fixtures built in {time.perf_counter() - start:.1f} s (not timed)")
    totals, everything = [0.0, 0.0, 0.0, 0.0], []
    for kernel in kernels:
        judged, plain, plain_cpu, _ = _run(kernel, fixtures, args, False)
        diagnosed, with_diagnoses, diagnoses_cpu, cases = _run(kernel, fixtures, args, True)
        totals[0] += plain
        totals[1] += with_diagnoses
        totals[2] += plain_cpu
        totals[3] += diagnoses_cpu
        everything += cases
        failing = [r for r in diagnosed.results if r.verdict == "fail"]
        stopped = [r for r in failing if any("diagnosis stopped" in d for d in r.diagnosis)]
        print(
            f"{kernel:22s} {len(failing):2d} failing: {plain:7.1f} s judged, "
            f"{with_diagnoses:7.1f} s with diagnoses, ratio {with_diagnoses / plain:5.2f} "
            f"(CPU time {diagnoses_cpu / plain_cpu:5.2f}; within the run "
            f"{_within(with_diagnoses, cases):5.2f}), {len(stopped)} stopped on the budget"
        )
        print(_per_case(cases, {r.name: r.seconds for r in judged.results}, args))
        if [r.verdict for r in judged.results] != [r.verdict for r in diagnosed.results]:
            print(f"  {kernel}: the verdicts differ between the two runs")
        for result in failing if args.names else ():
            print(f"  {result.name} ({result.seconds:.1f} s)")
            for line in result.diagnosis:
                print(f"    {line}")
    ratio = totals[1] / totals[0] if totals[0] else math.nan
    cpu = totals[3] / totals[2] if totals[2] else math.nan
    print(
        f"all: {totals[0]:.1f} s judged, {totals[1]:.1f} s with diagnoses, ratio {ratio:.2f} "
        f"(CPU time {cpu:.2f}; within the run {_within(totals[1], everything):.2f}; budget "
        f"{args.budget:g}x judging)"
    )
    if everything:
        worst = max(everything, key=lambda c: c.elapsed / max(c.judging, 1e-9))
        print(
            f"per case: diagnosis at most {worst.elapsed / max(worst.judging, 1e-9):.2f}x its "
            f"judging time ({worst.name}), {len(everything)} diagnoses"
        )
    print(f"after: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
