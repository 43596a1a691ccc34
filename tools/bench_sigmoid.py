"""Time sigmoid attention (``normalizer="sigmoid"``): the exact path against the Numba CPU
kernels at one shape, with the machine's load.

The exact path (the referee engine: the fast double-double engine is softmax-specific) costs
about one directed-rounding sigmoid per (row, key) in Python, so it is timed on ``--exact-rows``
query rows of one head and reported per row and extrapolated to the whole shape (stated as
such); the Numba forward and backward run the whole shape (after a warm-up call that compiles
or loads the cache).

    python tools/bench_sigmoid.py                      # B1 H8 L=S=2048 D64, float64
    python tools/bench_sigmoid.py --length 1024 --exact-rows 2
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import time

import numpy as np

import refattn


def _uptime() -> str:
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:  # pragma: no cover
        return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _best(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048, help="L = S (default %(default)s)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--exact-rows", type=int, default=2, help="query rows timed exactly")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    B, H, L, D = args.batch, args.heads, args.length, args.dim
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D)) for _ in range(3))
    grad = rng.standard_normal((B, H, L, D))
    opts = dict(normalizer="sigmoid", bias=np.float64(-math.log(L)), causal=True)
    print(f"shape B{B} H{H} L=S={L} D{D} float64, causal, bias -log S")
    print("before:", _uptime())
    refattn.attention(q[:, :, :64], k, v, backend="numba", **opts)  # compile / load
    refattn.attention_vjp(q[:, :, :64], k, v, grad[:, :, :64], backend="numba", **opts)
    fwd = _best(lambda: refattn.attention(q, k, v, backend="numba", **opts), args.repeats)
    bwd = _best(lambda: refattn.attention_vjp(q, k, v, grad, backend="numba", **opts), args.repeats)
    print(f"numba forward  {fwd * 1e3:10.1f} ms (whole shape, best of {args.repeats})")
    print(f"numba backward {bwd * 1e3:10.1f} ms (whole shape, best of {args.repeats})")
    rows = args.exact_rows
    # the last rows of a causal shape read every key: the most expensive rows
    sub = dict(opts, align="bottom_right")
    start = time.perf_counter()
    refattn.attention(q[0, 0, L - rows :], k[0, 0], v[0, 0], precision="exact", **sub)
    exact = time.perf_counter() - start
    per_row = exact / rows
    total = per_row * B * H * L / 2  # causal: a row reads (i + 1) keys, about S / 2 on average
    print(
        f"exact forward  {exact:10.2f} s for {rows} full rows ({per_row:.2f} s per row of S keys)"
    )
    print(f"exact forward  ~{total / 3600:9.1f} h extrapolated to the whole causal shape")
    print(f"exact / numba forward ~{total / fwd:.3g}x")
    print("after: ", _uptime())


if __name__ == "__main__":
    main()
