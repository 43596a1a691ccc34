"""Benchmark the probabilistic variants: NumPy float64 path vs the Numba kernels.

Usage: python tools/bench_variants.py [--json FILE] [--quick] [--repeat N] [--no-numpy]

Measured in the same run, float64, one batch element:

* MGK (:func:`refattn.mgk.attention`, soft mode): L = S in {512, 1024}, D = E = 64, R = 2,
  full and causal;
* GMM (:func:`refattn.gmm.attention`, uniform prior, beta > 0): L = S in {512, 1024},
  D = E = 64, iters = 3.

For each: the best-of-N wall time of both backends, GFLOP/s by the arithmetic counts of
:func:`refattn.kernels.variants.mgk_flops` / :func:`~refattn.kernels.variants.gmm_flops`
(exponentials and logs not counted; the causal count is the full one, so its GFLOP/s is
"effective"), the speedup, the traced peak memory of the NumPy path (tracemalloc; the Numba
kernel's own scratch is O(S) per thread and not traced), the largest difference between
the two outputs, the process CPU times (on a loaded machine the wall time includes waiting for a
CPU), the number of Numba threads and the load average. Compilation happens before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refattn import gmm, mgk  # noqa: E402
from refattn.kernels.variants import gmm_flops, mgk_flops  # noqa: E402


def _best(fn, repeat):
    """(best wall time, best process CPU time, output) of ``repeat`` runs."""
    best, best_cpu, out = np.inf, np.inf, None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best, best_cpu, out


def _peak(fn):
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def _measure(name, call, flops, repeat, numpy_too):
    call("numba")  # compile (or load the cache) and warm up
    t_numba, cpu_numba, out_numba = _best(lambda: call("numba"), repeat)
    row = {
        "case": name,
        "numba_s": t_numba,
        "numba_cpu_s": cpu_numba,
        "numba_gflops": flops / t_numba / 1e9,
        "flops": flops,
    }
    line = (
        f"{name:40s} numba {t_numba * 1e3:7.1f} ms (cpu {cpu_numba * 1e3:7.1f}) "
        f"{row['numba_gflops']:5.2f} GFLOP/s"
    )
    if numpy_too:
        t_numpy, cpu_numpy, out_numpy = _best(lambda: call("numpy"), repeat)
        row.update(
            numpy_s=t_numpy,
            numpy_cpu_s=cpu_numpy,
            numpy_gflops=flops / t_numpy / 1e9,
            speedup=t_numpy / t_numba,
            numpy_peak_bytes=_peak(lambda: call("numpy")),
            max_abs_diff=float(np.max(np.abs(out_numba - out_numpy))),
        )
        line += (
            f" | numpy {t_numpy * 1e3:7.1f} ms {row['numpy_gflops']:5.2f} GFLOP/s"
            f" (peak {row['numpy_peak_bytes'] / 2**20:6.1f} MiB) | speedup "
            f"{row['speedup']:4.1f}x | max|diff| {row['max_abs_diff']:.1e}"
        )
    print(line, flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="L = S = 256 only (a smoke run)")
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    parser.add_argument(
        "--no-numpy",
        action="store_true",
        help="time the Numba kernels only (the NumPy MGK path forms an "
        "(L, S, R, D) array: 1 GiB at L = S = 1024)",
    )
    args = parser.parse_args(argv)
    import numba

    rng = np.random.default_rng(0)
    sizes = (256,) if args.quick else (512, 1024)
    D = E = 64
    R, iters = 2, 3
    rows = []
    for n in sizes:
        q = rng.standard_normal((n, D))
        keys = rng.standard_normal((n, R, D))
        v = rng.standard_normal((n, E))
        for causal in (False, True):
            rows.append(
                _measure(
                    f"mgk soft L=S={n} D=E={D} R={R}{' causal' if causal else ''}",
                    lambda backend, q=q, keys=keys, v=v, causal=causal: mgk.attention(
                        q, keys, v, sigma2=D / 4, causal=causal, backend=backend
                    ),
                    mgk_flops(n, n, R, D, E),
                    args.repeat,
                    not args.no_numpy,
                )
            )
        keys = rng.standard_normal((n, D))
        values = rng.standard_normal((n, E))
        rows.append(
            _measure(
                f"gmm uniform L=S={n} D=E={D} iters={iters}",
                lambda backend, q=q, keys=keys, values=values: gmm.attention(
                    q, keys, values, alpha=4.0 / D, beta=4.0 / E, iters=iters, backend=backend
                ),
                gmm_flops(n, n, D, E, iters),
                args.repeat,
                not args.no_numpy,
            )
        )
    meta = {
        "numba_threads": numba.get_num_threads(),
        "numba": numba.__version__,
        "numpy": np.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
    }
    print(
        f"numba {meta['numba']} with {meta['numba_threads']} threads, numpy {meta['numpy']}, "
        f"{meta['cpus']} CPUs, load average {meta['load_average_1min']:.1f} (wall times "
        f"include waiting for the CPU on a loaded machine; cpu = process CPU time)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": rows}, fh, indent=2, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
