#!/usr/bin/env python
"""Benchmark the exact VJP: fast engine vs the Numba float64 VJP (and optionally the referee).

``refattn.attention_vjp(..., precision="exact")`` (the double-double first step with the
referee for undecided elements) is timed against ``refattn.attention_vjp(...,
backend="numba")`` on the same Gaussian float64 inputs, the calls interleaved (the machine may
be shared: the ratio moves far less than the absolute figures); each figure is the median of
the repetitions (the minima are reported too: on a loaded machine the Numba kernels' worker
threads wait for cores, so ``NUMBA_NUM_THREADS=1`` gives steadier ratios). The report gives
the fallback statistics (elements decided by the first step vs by the referee) and the load
average. ``--referee`` also times the referee engine alone
(``config.EXACT_VJP_ENGINE = "referee"``) once, and checks that its bits equal the fast
engine's.

Examples::

    python tools/bench_exact_vjp.py                      # B1 H2 L=S=256 D64
    python tools/bench_exact_vjp.py --length 512 --reps 3
    python tools/bench_exact_vjp.py --heads 8 --kv-heads 2 --length 16 --keys 2048 \\
        --causal --align bottom_right
    python tools/bench_exact_vjp.py --referee --json vjp.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numba
import numpy as np

import refattn
from refattn import config
from refattn.exact.attention_vjp import exact_vjp
from refattn.spec import canonicalize, check_cotangent


def _inputs(batch, heads, kv_heads, length, keys, dim, seed=0):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((batch, heads, length, dim)) for _ in range(2))
    k, v = (rng.standard_normal((batch, kv_heads, keys, dim)) for _ in range(2))
    return q, k, v, do


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, help="K (default: H)")
    parser.add_argument("--length", type=int, default=256, help="L (and S unless --keys)")
    parser.add_argument("--keys", type=int, help="S (default: L)")
    parser.add_argument("--dim", type=int, default=64, help="D = E")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--align", default="top_left", choices=("top_left", "bottom_right"))
    parser.add_argument("--referee", action="store_true", help="also time the referee once")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    keys = args.length if args.keys is None else args.keys
    q, k, v, do = _inputs(args.batch, args.heads, kv_heads, args.length, keys, args.dim)
    opts = {"causal": args.causal, "align": args.align}
    # warm-up (compiles both paths)
    refattn.attention_vjp(q, k, v, do, backend="numba", **opts)
    fast_grads = refattn.attention_vjp(q, k, v, do, precision="exact", **opts)
    numba_times, fast_times = [], []
    for _ in range(args.reps):
        numba_times.append(
            _timed(lambda: refattn.attention_vjp(q, k, v, do, backend="numba", **opts))[0]
        )
        fast_times.append(
            _timed(lambda: refattn.attention_vjp(q, k, v, do, precision="exact", **opts))[0]
        )
    spec = canonicalize(q, k, v, **opts)
    _, heads, _, length, _, _, vdim = spec.dims
    stats = {}
    exact_vjp(
        spec,
        check_cotangent(spec, do, "grad_out", (heads, length, vdim)),
        None,
        np.dtype("float64"),
        stats=stats,
    )
    report = {
        "shape": f"B{args.batch} H{args.heads} K{kv_heads} L{args.length} S{keys} D{args.dim}",
        "causal": args.causal,
        "align": args.align,
        "numba_float64_vjp_s": float(np.median(numba_times)),
        "fast_exact_vjp_s": float(np.median(fast_times)),
        "numba_float64_vjp_min_s": float(np.min(numba_times)),
        "fast_exact_vjp_min_s": float(np.min(fast_times)),
        "threads": numba.get_num_threads(),
        "stats": stats,
        "load_average": os.getloadavg(),
    }
    report["ratio"] = report["fast_exact_vjp_s"] / report["numba_float64_vjp_s"]
    report["ratio_of_minima"] = report["fast_exact_vjp_min_s"] / report["numba_float64_vjp_min_s"]
    if args.referee:
        old = config.EXACT_VJP_ENGINE
        config.EXACT_VJP_ENGINE = "referee"
        try:
            seconds, grads = _timed(
                lambda: refattn.attention_vjp(q, k, v, do, precision="exact", **opts)
            )
        finally:
            config.EXACT_VJP_ENGINE = old
        report["referee_exact_vjp_s"] = seconds
        report["referee_bits_equal"] = all(
            np.array_equal(a.view(np.int64), b.view(np.int64))
            for a, b in zip(fast_grads[:3], grads[:3], strict=True)
        )
        report["load_average_after"] = os.getloadavg()
    for key, value in report.items():
        print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
