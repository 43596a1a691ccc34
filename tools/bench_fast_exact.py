#!/usr/bin/env python
"""Time the fast exact attention forward against the Numba float64 kernel in the same run.

Prints, per output dtype, the exact forward's time, its ratio to ``backend="numba"`` on the same
inputs (converted to float64), the fallback statistics
(:func:`refattn.exact.fast.fallback_stats`) and, with ``--referee``, the old engine's
time and a bit-identity check. The load average is printed with the figures (the machine may be
shared: ratios move less than absolute times). The exact (B, H, L, S, D, E) shapes the issue
names::

    python tools/bench_fast_exact.py --shape 1 2 256 256 64 64 --referee
    python tools/bench_fast_exact.py --shape 1 8 1024 1024 64 64 --input bfloat16 \\
        --out float32 bfloat16
    python tools/bench_fast_exact.py --shape 1 32 4096 4096 128 128 --input bfloat16 \\
        --out bfloat16 float32
"""

from __future__ import annotations

import argparse
import os
import time

import ml_dtypes
import numpy as np

import refattn
from refattn import config
from refattn.exact import fast as fast_exact


def _timed(fn, repeat):
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape",
        type=int,
        nargs=6,
        default=[1, 2, 256, 256, 64, 64],
        metavar=("B", "H", "L", "S", "D", "E"),
    )
    parser.add_argument(
        "--input", default="float64", choices=["float64", "float32", "float16", "bfloat16"]
    )
    parser.add_argument(
        "--out",
        nargs="+",
        default=["float64"],
        choices=["float64", "float32", "float16", "bfloat16"],
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--referee",
        action="store_true",
        help="also time the old (referee) engine and check bit identity",
    )
    parser.add_argument("--causal", action="store_true", help="causal (bottom-right) masking")
    parser.add_argument("--lse", action="store_true", help="also return the lse")
    args = parser.parse_args(argv)
    batch, heads, length, keys, dim, vdim = args.shape
    rng = np.random.default_rng(0)
    dtype = ml_dtypes.bfloat16 if args.input == "bfloat16" else np.dtype(args.input)
    q, k, v = (
        rng.standard_normal(s).astype(dtype)
        for s in (
            (batch, heads, length, dim),
            (batch, heads, keys, dim),
            (batch, heads, keys, vdim),
        )
    )
    wide = [x.astype(np.float64) for x in (q, k, v)]
    opts = dict(causal=args.causal, align="bottom_right") if args.causal else {}
    refattn.attention(*(x[:, :1, :8] for x in wide), backend="numba", **opts)  # compile
    numba_time, _ = _timed(lambda: refattn.attention(*wide, backend="numba", **opts), args.repeat)
    opts["return_lse"] = args.lse
    print(
        f"shape B,H,L,S,D,E = {args.shape}, inputs {args.input}, causal {args.causal}; load "
        f"{os.getloadavg()[0]:.1f}; numba float64 kernel {numba_time * 1e3:.1f} ms"
    )
    for out in args.out:
        config.EXACT_ENGINE = "fast"
        refattn.attention(
            *(x[:, :1, :8] for x in (q, k, v)), precision="exact", out_dtype=out, **opts
        )
        fast, result = _timed(
            lambda out=out: refattn.attention(q, k, v, precision="exact", out_dtype=out, **opts),
            args.repeat,
        )
        print(
            f"  exact -> {out}: {fast * 1e3:.1f} ms = {fast / numba_time:.1f}x numba; "
            f"{fast_exact.fallback_stats()}"
        )
        if args.referee:
            config.EXACT_ENGINE = "referee"
            slow, reference = _timed(
                lambda out=out: refattn.attention(
                    q, k, v, precision="exact", out_dtype=out, **opts
                ),
                1,
            )
            config.EXACT_ENGINE = "fast"
            same = np.array_equal(np.asarray(result, np.float64), np.asarray(reference, np.float64))
            print(
                f"  referee -> {out}: {slow:.2f} s = {slow / numba_time:.0f}x numba; "
                f"bit-identical: {same}"
            )
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
