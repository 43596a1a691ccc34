"""Benchmark refattn.linear_attention: float64 NumPy against the Numba CPU kernels, same run.

Cases (Gated DeltaNet: scalar gate, beta, qk_l2norm):

* prefill: B=1, H=16, T=4096, D=E=128 (``--length``, ``--heads``, ``--dim`` change it);
* decode: one step from a cached state, B=1, H=32, T=1, D=E=128;
* exact: a small case (B=1, H=1, T=4, D=E=4) on the exact path (float64 and bfloat16 outputs).

Prefill also times the chunked kernel (``backend="numba-chunked"``, chunks of 64 steps)
against the recurrent one (``--skip-numpy`` leaves the NumPy recurrence out of prefill).

``--vjp`` times only the vjp of the prefill case: the recurrent kernel
(``backend="numba"``) against the chunked one (``backend="numba-chunked"``), same run.

Prints the machine load (``os.getloadavg``) before and after, the best of ``--repeat`` wall
times and the NumPy / Numba ratio of each case. The first Numba call compiles (or loads the
on-disk cache) and is timed separately.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import refattn


def _gdn(batch, heads, length, dim, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, length, dim))
    k = rng.standard_normal((batch, heads, length, dim))
    v = rng.standard_normal((batch, heads, length, dim))
    g = -rng.uniform(0.0, 1.0, (batch, heads, length))
    beta = rng.uniform(0.0, 1.0, (batch, heads, length))
    return q, k, v, g, beta


def _best(function, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def _load():
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def _compare(name, args, options, repeat, backends=("numpy", "numba")):
    def run(backend):
        return refattn.linear_attention(*args, qk_l2norm=True, backend=backend, **options)

    times = {}
    for backend in backends:
        if backend != "numpy":
            start = time.perf_counter()
            run(backend)
            first = time.perf_counter() - start
            print(f"{name}: {backend} first call {first:.2f} s")
        times[backend] = _best(lambda backend=backend: run(backend), repeat)
    shown = ", ".join(f"{b} {t * 1e3:.2f} ms" for b, t in times.items())
    ratios = ", ".join(
        f"{b}/{c} {times[b] / times[c]:.2f}x"
        for b, c in (("numpy", "numba"), ("numba", "numba-chunked"))
        if b in times and c in times
    )
    print(f"{name}: {shown}; {ratios}")


def vjp_figures(heads, length, dim, repeat):
    """The vjp of the GDN prefill (B1, ``heads``, ``length``, D=E=``dim``): numba against
    numba-chunked in the same run, with the load before and after."""
    args = _gdn(1, heads, length, dim)
    do = np.random.default_rng(4).standard_normal(args[2].shape)
    name = f"GDN vjp B1 H{heads} T{length} D=E={dim}"
    print(_load())
    times = {}
    for backend in ("numba", "numba-chunked"):

        def run(backend=backend):
            return refattn.linear_attention_vjp(*args, do, qk_l2norm=True, backend=backend)

        start = time.perf_counter()
        run()
        print(f"{name}: {backend} first call {time.perf_counter() - start:.2f} s")
        times[backend] = _best(run, repeat)
    shown = ", ".join(f"{b} {t:.2f} s" for b, t in times.items())
    print(f"{name}: {shown}; numba/numba-chunked {times['numba'] / times['numba-chunked']:.2f}x")
    print(_load())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="prefill T (default 4096)")
    parser.add_argument("--heads", type=int, default=16, help="prefill heads (default 16)")
    parser.add_argument("--decode-heads", type=int, default=32, help="decode heads (default 32)")
    parser.add_argument("--dim", type=int, default=128, help="D = E (default 128)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per case (best of)")
    parser.add_argument("--skip-prefill", action="store_true", help="decode and exact only")
    parser.add_argument("--skip-numpy", action="store_true", help="prefill: the Numba kernels only")
    parser.add_argument("--vjp", action="store_true", help="the prefill vjp only (two kernels)")
    args = parser.parse_args(argv)
    if args.vjp:
        vjp_figures(args.heads, args.length, args.dim, args.repeat)
        return
    print(_load())
    if not args.skip_prefill:
        prefill = _gdn(1, args.heads, args.length, args.dim)
        backends = ("numba", "numba-chunked")
        _compare(
            f"GDN prefill B1 H{args.heads} T{args.length} D=E={args.dim}",
            prefill,
            {},
            args.repeat,
            backends if args.skip_numpy else ("numpy", *backends),
        )
    q, k, v, g, beta = _gdn(1, args.decode_heads, 1, args.dim, seed=1)
    state = np.random.default_rng(2).standard_normal((1, args.decode_heads, args.dim, args.dim))
    _compare(
        f"GDN decode B1 H{args.decode_heads} T1 D=E={args.dim}",
        (q, k, v, g, beta),
        {"initial_state": state},
        max(args.repeat, 20),
    )
    small = _gdn(1, 1, 4, 4, seed=3)
    for dtype in ("float64", "bfloat16"):
        seconds = _best(
            lambda dtype=dtype: refattn.linear_attention(
                *small, qk_l2norm=True, precision="exact", out_dtype=dtype
            ),
            args.repeat,
        )
        print(f"exact B1 H1 T4 D=E=4 -> {dtype}: {seconds * 1e3:.1f} ms")
    print(_load())


if __name__ == "__main__":
    main()
