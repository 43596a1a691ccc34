#!/usr/bin/env python
"""Time refattn.merge_states: the exact path and the float64 path, in the same run.

The target shape is 64 states of H32 L4096 E128 (16.8 M output elements; the float32 states
alone are 4.3 GB). The exact path is timed on ``--rows`` of the L query rows and the full-shape
time extrapolated linearly (rows are independent: the cost is per (row, E) element and per
state). Base e runs on refattn's exact attention engine (a merge is attention over the states
with the lses as scores); base 2 on the per-element mpmath path, far slower (time few rows). The
float64 path is timed on the same rows and, with ``--full-float64``, on the whole shape. The
report gives ``uptime``'s load before and after: the machine may be shared.

Examples::

    python tools/bench_merge.py --rows 512            # P64 H32 L4096 E128, exact on 512 rows
    python tools/bench_merge.py --rows 2 --dtype bfloat16 --base 2
    python tools/bench_merge.py --full-float64        # also the float64 path on all of L
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import numpy as np

import refattn


def _uptime() -> str:
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        return "uptime unavailable"


def _states(states, heads, rows, vdim, seed=0):
    rng = np.random.default_rng(seed)
    outs = rng.standard_normal((states, heads, rows, vdim)).astype(np.float32)
    lses = (rng.standard_normal((states, heads, rows)) * 3).astype(np.float32)
    lses[rng.random((states, heads, rows)) < 0.1] = -np.inf  # some empty chunks
    return outs, lses


def _time(fn, repeat=1):
    best = np.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=64)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--vdim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=2, help="query rows timed on the exact path")
    parser.add_argument("--dtype", default="float32", help="exact path's out_dtype")
    parser.add_argument("--base", default="e", choices=("e", "2"))
    parser.add_argument("--full-float64", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    base = 2 if args.base == "2" else "e"
    load_before = _uptime()
    outs, lses = _states(args.states, args.heads, args.rows, args.vdim)
    refattn.merge_states(outs[:, :1, :1], lses[:, :1, :1], precision="exact")  # imports
    exact = _time(
        lambda: refattn.merge_states(
            outs, lses, lse_base=base, precision="exact", out_dtype=args.dtype
        )
    )
    f64 = _time(lambda: refattn.merge_states(outs, lses, lse_base=base), repeat=5)
    scale = args.length / args.rows
    report = {
        "shape": f"P{args.states} H{args.heads} L{args.length} E{args.vdim}",
        "timed_rows": args.rows,
        "out_dtype": args.dtype,
        "lse_base": args.base,
        "exact_s_timed": exact,
        "exact_s_full_extrapolated": exact * scale,
        "float64_s_timed": f64,
        "float64_s_full_extrapolated": f64 * scale,
    }
    if args.full_float64:
        outs, lses = _states(args.states, args.heads, args.length, args.vdim)
        report["float64_s_full_measured"] = _time(
            lambda: refattn.merge_states(outs, lses, lse_base=base)
        )
    report["uptime_before"], report["uptime_after"] = load_before, _uptime()
    for key, value in report.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return report


if __name__ == "__main__":
    main()
