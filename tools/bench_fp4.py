#!/usr/bin/env python
"""Time an NVFP4 (or MXFP4) decode step on refattn's exact path and its Numba path, same run.

The inputs: q (B, H, L, D) bfloat16 Gaussian, k and v float4_e2m1fn with block scales and
(NVFP4) float32 global scales, quantised from Gaussians as the catalogue's fp4 cases are
(``oracle/catalogue/fp4_inputs.py``). Timed: ``refattn.attention(..., precision="exact",
out_dtype="bfloat16", return_lse=True)`` (every element rounded once) and
``backend="numba"`` (float64 kernels) on the same inputs, each after one warm-up call (Numba
compile, exact engine compile); the dequantisation is inside both calls. The load average
(``uptime``) before and after is printed, since the machine may be shared.

Examples::

    python tools/bench_fp4.py                       # NVFP4, B1 H32 K8 L1 S32768 D128
    python tools/bench_fp4.py --format mxfp4 --keys 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import refattn  # noqa: E402
from oracle.catalogue import Shapes  # noqa: E402
from oracle.catalogue.fp4_inputs import quantised_fp4  # noqa: E402
from oracle.catalogue.seeding import to_dtype  # noqa: E402


def _inputs(fmt, batch, heads, kv_heads, length, keys, dim):
    rng = np.random.default_rng(2026)
    n = Shapes(batch=batch, H=heads, K=kv_heads, L=length, S=keys, D=dim, E=dim)
    raw = {
        "q": rng.standard_normal((batch, heads, length, dim)),
        "k": rng.standard_normal((batch, kv_heads, keys, dim)),
        "v": rng.standard_normal((batch, kv_heads, keys, dim)),
    }
    args = {**raw, **quantised_fp4(raw, n, {"fp4": fmt})}
    args["q"] = to_dtype(raw["q"], "bfloat16")
    return args


def _time(fn, repeats):
    fn()  # warm-up: compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), float(np.median(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=("nvfp4", "mxfp4"), default="nvfp4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--length", type=int, default=1)
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(
        "uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    )
    inputs = _inputs(
        args.format, args.batch, args.heads, args.kv_heads, args.length, args.keys, args.dim
    )
    shape = (
        f"{args.format.upper()} B{args.batch} H{args.heads} K{args.kv_heads} L{args.length} "
        f"S{args.keys} D{args.dim}"
    )
    common = dict(inputs, causal=True, align="bottom_right", return_lse=True)

    def exact():
        return refattn.attention(**common, precision="exact", out_dtype="bfloat16")

    def numba():
        return refattn.attention(**common, backend="numba")

    for name, fn in (("exact (bfloat16, rounded once)", exact), ("numba (float64)", numba)):
        best, median = _time(fn, args.repeats)
        print(f"{shape}  {name:32s} best {best * 1e3:10.1f} ms  median {median * 1e3:10.1f} ms")
    out_exact, _ = exact()
    out_numba, _ = numba()
    gap = np.max(np.abs(out_exact.astype(np.float64) - out_numba))
    print(f"max |exact - numba| = {gap:.3g} (bfloat16 rounding of the exact result)")
    print(
        "uptime after: ", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    )


if __name__ == "__main__":
    main()
