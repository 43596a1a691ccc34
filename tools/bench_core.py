"""Measure refattn's core figures: exact-path time and float64-path memory.

Usage: python tools/bench_core.py [--json FILE]

* exact path, H=2, L=S=64, D=E=64 (issue target: < 10 s on 2 cores), out float64/float32/
  float16/bfloat16, forward (+lse) and vjp;
* float64 path peak memory (tracemalloc) for one head at S = 1024, 2048, 4096 with L = S,
  against the L*S*8-byte size of one score plane (the path keeps O(L*S) per head);
* float64 path time for B1 H8 L1024 D64.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc

import ml_dtypes
import numpy as np

import refattn


def _timed(fn, repeat=3):
    best = np.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    results = {}
    q, k, v = (rng.standard_normal((2, 64, 64)) for _ in range(3))
    for name, dtype in (
        ("float64", np.float64),
        ("float32", np.float32),
        ("float16", np.float16),
        ("bfloat16", ml_dtypes.bfloat16),
    ):
        seconds = _timed(
            lambda dtype=dtype: refattn.attention(
                q, k, v, precision="exact", out_dtype=dtype, return_lse=True
            ),
            repeat=1,
        )
        results[f"exact_fwd_H2_L64_S64_D64_{name}_s"] = seconds
        print(f"exact forward+lse H2 L=S=D=E=64 -> {name:9s}: {seconds:6.2f} s")
    grad = rng.standard_normal((2, 64, 64))
    seconds = _timed(lambda: refattn.attention_vjp(q, k, v, grad, precision="exact"), repeat=1)
    results["exact_vjp_H2_L64_S64_D64_float64_s"] = seconds
    print(f"exact vjp H2 L=S=D=E=64 -> float64   : {seconds:6.2f} s")
    for keys in (1024, 2048, 4096):
        q1, k1, v1 = (rng.standard_normal((1, keys, 64)) for _ in range(3))
        tracemalloc.start()
        refattn.attention(q1, k1, v1)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        plane = keys * keys * 8
        results[f"f64_peak_bytes_L{keys}_S{keys}"] = peak
        print(
            f"float64 path, one head L=S={keys}: peak {peak / 2**20:8.1f} MiB = "
            f"{peak / plane:4.1f} x one (L, S) float64 plane"
        )
    q8, k8, v8 = (rng.standard_normal((1, 8, 1024, 64)) for _ in range(3))
    seconds = _timed(lambda: refattn.attention(q8, k8, v8))
    flops = 4 * 8 * 1024 * 1024 * 64
    results["f64_B1_H8_L1024_D64_s"] = seconds
    print(
        f"float64 path B1 H8 L1024 D64: {seconds * 1e3:7.1f} ms ({flops / seconds / 1e9:.1f} "
        "GFLOP/s)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
