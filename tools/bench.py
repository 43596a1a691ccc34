#!/usr/bin/env python
"""Benchmark refattn's attention paths: NumPy float64 path vs Numba kernels vs torch SDPA.

Every ratio is measured in the same run, with the paths' calls interleaved (the machine may
be shared: absolute figures move, ratios much less). Throughput counts 4*B*H*L*S*D flops for
the forward (the two products q k^T and w v; softmax and masking are not counted, causal masks
are not discounted) and 10*B*H*L*S*D for the backward (five products). "vjp" is the whole
``attention_vjp`` call, which re-runs the forward first; "backward pass alone" reuses a saved
forward (out, lse), as a training step would.

Examples::

    python tools/bench.py                         # L in 512 1024 4096 16384 + decode, both dtypes
    python tools/bench.py --lengths 1024 --dtypes float64 --backward
    python tools/bench.py --long                  # also L = 65536, one head, peak memory
    python tools/bench.py --json bench.json --plot bench.png
    python tools/bench.py --targets --json t.json  # the shapes of the speed targets, pass/fail
    python tools/bench.py --targets --compile      # ... and the first compile from an empty cache

``--targets`` times exactly the shapes the kernels' speed targets name (float64 and float32
forward B1 H8 L=S=1024 D64, the backward pass reusing a saved forward, GQA decode L1 S8192
H32/K8 D128 float64, and L = S = 65536 one head with its peak RSS), each as the median of
interleaved repetitions (without the NumPy path, and with a 50 ms pause before each call so
that the previous library's spinning worker threads do not steal the cores), and says which
targets are met. Every report names the CPU (its
model, LLVM's name for it and ``NUMBA_CPU_NAME``), the load average before and after, and the
peak RSS of the benchmark process, since the ratios on a shared machine move with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import refattn  # noqa: E402
from refattn.kernels import numba_cpu  # noqa: E402
from refattn.spec import canonicalize  # noqa: E402


def _best(fn, repeat: int, budget: float) -> float:
    """Best wall time of up to ``repeat`` calls (stops early once ``budget`` seconds pass)."""
    times = []
    start = time.perf_counter()
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget:
            break
    return min(times)


def _race(fns: dict, repeat: int, budget: float, stat=min, settle: float = 0.0) -> dict:
    """``stat`` (default: the best) of each function's wall times, calls interleaved
    round-robin so that a change of machine load hits every path alike (the ratios stay fair
    on a shared machine). ``settle`` seconds of sleep before each call let the previous
    library's worker threads stop spinning (OpenMP and BLAS pools busy-wait after a call)."""
    times = {name: [] for name in fns}
    start = time.perf_counter()
    for _ in range(repeat):
        for name, fn in fns.items():
            if settle:
                time.sleep(settle)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget:
            break
    return {name: stat(values) for name, values in times.items()}


def cpu_info() -> dict:
    """The CPU as the OS and as LLVM (the code generator) see it, and the load average."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import llvmlite.binding as llvm

        llvm_cpu = llvm.get_host_cpu_name()
    except Exception:  # pragma: no cover - llvmlite comes with numba
        llvm_cpu = None
    return {
        "cpu_model": model,
        "llvm_cpu": llvm_cpu,
        "numba_cpu_name": os.environ.get("NUMBA_CPU_NAME"),
        "cores": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
    }


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _inputs(batch, heads, length, keys, dim, dtype, seed=0, kv_heads=None):
    rng = np.random.default_rng(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    q = rng.standard_normal((batch, heads, length, dim)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, keys, dim)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, keys, dim)).astype(dtype)
    return q, k, v


def bench_shape(
    name, batch, heads, length, keys, dim, dtype, args, torch, kv_heads=None, saved_backward=False
):
    """Time one shape on every path; returns a JSON-ready row. ``saved_backward`` adds the
    backward pass reusing a saved forward to the interleaved race."""
    kv_heads = heads if kv_heads is None else kv_heads
    q, k, v = _inputs(batch, heads, length, keys, dim, dtype, kv_heads=kv_heads)
    flops = 4.0 * batch * heads * length * keys * dim
    spec = canonicalize(q, k, v)
    numba_cpu.forward(spec)  # compile / warm
    row = {
        "shape": name,
        "B": batch,
        "H": heads,
        "K": kv_heads,
        "L": length,
        "S": keys,
        "D": dim,
        "dtype": np.dtype(dtype).name,
        "flops_forward": flops,
    }
    fns = {"numba": lambda: numba_cpu.forward(spec)}
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        gqa = {"enable_gqa": True} if kv_heads != heads else {}
        sdpa(tq, tk, tv, **gqa)
        fns["torch"] = lambda: sdpa(tq, tk, tv, **gqa)
    if length * keys <= args.numpy_max_plane and kv_heads == heads and not args.targets:
        fns["numpy"] = lambda: refattn.attention(q, k, v)
    if saved_backward:
        grad = np.random.default_rng(1).standard_normal((batch, heads, length, dim))
        saved = numba_cpu.saved_forward(spec)
        numba_cpu.backward(spec, grad, saved=saved)
        fns["numba_backward_pass"] = lambda: numba_cpu.backward(spec, grad, saved=saved)
    stat = np.median if args.median else min
    for name, seconds in _race(fns, args.repeat, args.budget, stat, args.settle).items():
        row[f"{name}_s"] = float(seconds)
    if saved_backward:
        row["backward_pass_over_forward"] = row["numba_backward_pass_s"] / row["numba_s"]
    if args.backward:
        grad = np.random.default_rng(1).standard_normal((batch, heads, length, dim))
        numba_cpu.backward(spec, grad)
        row["numba_backward_s"] = _best(
            lambda: numba_cpu.backward(spec, grad), args.repeat, args.budget
        )
        saved = numba_cpu.saved_forward(spec)
        row["numba_backward_pass_s"] = _best(
            lambda: numba_cpu.backward(spec, grad, saved=saved), args.repeat, args.budget
        )
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
            tg = torch.from_numpy(grad.astype(dtype))

            def torch_vjp():
                out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
                torch.autograd.grad(out, (tq, tk, tv), tg)

            torch_vjp()
            row["torch_backward_s"] = _best(torch_vjp, args.repeat, args.budget)
    for path in ("numba", "torch", "numpy"):
        if f"{path}_s" in row:
            row[f"{path}_gflops"] = flops / row[f"{path}_s"] / 1e9
    if "torch_s" in row:
        row["numba_over_torch"] = row["torch_s"] / row["numba_s"]
    if "numpy_s" in row:
        row["numba_over_numpy"] = row["numpy_s"] / row["numba_s"]
    if "numba_backward_s" in row:
        row["backward_over_forward"] = row["numba_backward_s"] / row["numba_s"]
        row["backward_pass_over_forward"] = row["numba_backward_pass_s"] / row["numba_s"]
        row["numba_backward_gflops"] = 2.5 * flops / row["numba_backward_s"] / 1e9
    if "torch_backward_s" in row:
        row["numba_backward_over_torch"] = row["torch_backward_s"] / row["numba_backward_s"]
    return row


_LONG_SCRIPT = """
import resource, sys, time, numpy as np
sys.path.insert(0, {root!r})
from refattn.spec import canonicalize
from refattn.kernels import numba_cpu
def high_water():
    # VmHWM after "5 > clear_refs" is the peak since the reset (Linux); else ru_maxrss
    try:
        with open("/proc/self/status") as f:
            return int(next(x for x in f if x.startswith("VmHWM")).split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
small = canonicalize(*(np.ones((1, 1, 4, {dim})) for _ in range(3)))
numba_cpu.forward(small)  # compile (or load the cache) before measuring
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
base = high_water()
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, {length}, {dim})) for _ in range(3))
t0 = time.perf_counter()
out, lse = numba_cpu.forward(canonicalize(q, k, v))
elapsed = time.perf_counter() - t0
print(elapsed, high_water(), base, bool(np.isfinite(out).all()))
"""


def bench_compile() -> dict:
    """First compile of every kernel path and dtype from an empty Numba cache, then the load
    from that cache, each in a fresh process (``python -m refattn.kernels``); seconds."""
    import tempfile

    result = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(
            os.environ,
            NUMBA_CACHE_DIR=cache,
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        for phase in ("compile", "cached"):
            done = subprocess.run(
                [sys.executable, "-m", "refattn.kernels"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            for line in done.stdout.splitlines():
                if ":" in line and line.strip().endswith(" s"):
                    name, seconds = line.split(":")
                    result[f"{phase} {' '.join(name.split())}"] = float(seconds.split()[0])
    return result


def bench_long(length: int, dim: int) -> dict:
    """L = S = ``length``, one head, float64 forward in a fresh process: time and peak RSS."""
    script = _LONG_SCRIPT.format(root=str(ROOT), length=length, dim=dim)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    elapsed, peak, base, finite = done.stdout.split()
    flops = 4.0 * length * length * dim
    return {
        "shape": f"long L={length}",
        "B": 1,
        "H": 1,
        "L": length,
        "S": length,
        "D": dim,
        "dtype": "float64",
        "numba_s": float(elapsed),
        "numba_gflops": flops / float(elapsed) / 1e9,
        "peak_rss_bytes": int(peak),
        "rss_before_bytes": int(base),
        "finite": finite == "True",
    }


#: (name, row index, key, comparison, threshold) of the speed targets
TARGETS = [
    ("float64 forward B1 H8 L=S=1024 D64 >= 1.0x torch", 0, "numba_over_torch", ">=", 1.0),
    ("float32 forward, same shape, >= 0.6x torch", 1, "numba_over_torch", ">=", 0.6),
    ("GQA decode L1 S8192 H32/K8 D128 float64 >= 0.5x torch", 2, "numba_over_torch", ">=", 0.5),
    (
        "backward pass (saved forward) <= 2.5x the forward",
        0,
        "backward_pass_over_forward",
        "<=",
        2.5,
    ),
    ("L = S = 65536, one head: peak RSS under 1 GiB", 3, "peak_rss_bytes", "<=", 2.0**30),
]


def run_targets(args, torch):
    """The shapes of the speed targets; returns (rows, [target results])."""
    rows = [
        bench_shape(
            "B1 H8 L1024", 1, 8, 1024, 1024, 64, "float64", args, torch, saved_backward=True
        ),
        bench_shape("B1 H8 L1024", 1, 8, 1024, 1024, 64, "float32", args, torch),
        bench_shape("GQA decode L1 S8192", 1, 32, 1, 8192, 128, "float64", args, torch, kv_heads=8),
        bench_long(65536, 64),
    ]
    for row in rows:
        print_row(row)
    results = []
    for name, index, key, op, threshold in TARGETS:
        value = rows[index].get(key)
        met = value is not None and (value >= threshold if op == ">=" else value <= threshold)
        results.append({"target": name, "value": value, "met": bool(met)})
        shown = (
            "n/a"
            if value is None
            else (f"{value / 2**30:.2f} GiB" if "rss" in key else f"{value:.2f}")
        )
        print(f"  [{'met' if met else 'NOT met'}] {name}: {shown}", flush=True)
    return rows, results


def _fmt(row, key, spec="{:8.1f}"):
    return spec.format(row[key]) if key in row else " " * (len(spec.format(0.0)))


def print_row(row):
    line = (
        f"{row['shape']:>18} {row['dtype']:>8}  numba {_fmt(row, 'numba_gflops')}  "
        f"torch {_fmt(row, 'torch_gflops')}  numpy {_fmt(row, 'numpy_gflops')} GFLOP/s"
        f"  numba/torch {_fmt(row, 'numba_over_torch', '{:5.2f}')}"
        f"  numba/numpy {_fmt(row, 'numba_over_numpy', '{:6.1f}')}"
    )
    if "backward_pass_over_forward" in row and "backward_over_forward" not in row:
        line += f"  backward pass/fwd {row['backward_pass_over_forward']:.2f}"
    if "backward_over_forward" in row:
        line += (
            f"  vjp/fwd {row['backward_over_forward']:.2f}"
            f" (backward pass alone {row['backward_pass_over_forward']:.2f})"
            f"  bwd {row['numba_backward_gflops']:.1f} GFLOP/s"
        )
        if "numba_backward_over_torch" in row:
            line += f" (vs torch {row['numba_backward_over_torch']:.2f})"
    if "peak_rss_bytes" in row:
        line += (
            f"  {row['numba_s']:.1f} s, peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB "
            f"(before the inputs: {row['rss_before_bytes'] / 2**30:.2f} GiB)"
        )
    print(line, flush=True)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, dtype in zip(axes, ("float64", "float32"), strict=True):
        sel = [r for r in rows if r["dtype"] == dtype and r["L"] > 1 and r["H"] > 1]
        for path_name in ("numba", "torch", "numpy"):
            pts = [(r["L"], r[f"{path_name}_gflops"]) for r in sel if f"{path_name}_gflops" in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=path_name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"forward {dtype}")
        ax.set_xlabel("L = S")
        ax.legend()
    axes[0].set_ylabel("GFLOP/s")
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[512, 1024, 4096, 16384],
        help="L = S values (batch 1, --heads heads)",
    )
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64, help="D = E")
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    parser.add_argument(
        "--decode-keys", type=int, default=4096, help="S of the decode shape (L = 1); 0 skips it"
    )
    parser.add_argument("--backward", action="store_true", help="also time the vjp")
    parser.add_argument(
        "--long",
        type=int,
        nargs="?",
        const=65536,
        default=0,
        help="also run L = S = LONG (default 65536), one head, float64, "
        "in a fresh process and report its peak RSS",
    )
    parser.add_argument("--repeat", type=int, default=5, help="best of this many calls")
    parser.add_argument(
        "--budget",
        type=float,
        default=20.0,
        help="stop repeating a measurement after this many seconds",
    )
    parser.add_argument(
        "--numpy-max-plane",
        type=int,
        default=4096 * 4096,
        help="skip the NumPy path (which forms L x S planes) above this L*S",
    )
    parser.add_argument(
        "--median",
        action="store_true",
        help="report the median of the interleaved calls (default: the best)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=None,
        help="sleep this many seconds before each timed call so that the "
        "previous library's spinning worker threads go idle (default 0; "
        "0.05 with --targets)",
    )
    parser.add_argument(
        "--targets",
        action="store_true",
        help="time only the speed targets' shapes (median of --repeat "
        "interleaved calls) and say which are met",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time the first compile of every kernel path and dtype from "
        "an empty Numba cache, and the load from the cache (fresh "
        "processes)",
    )
    parser.add_argument("--json", type=Path, help="write the rows and machine info here")
    parser.add_argument("--plot", type=Path, help="write a GFLOP/s plot (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.settle is None:
        args.settle = 0.05 if args.targets else 0.0
    torch = _torch()
    threads = int(os.environ.get("NUMBA_NUM_THREADS", os.cpu_count() or 1))
    import numba

    if torch is not None:
        torch.set_num_threads(numba.get_num_threads())
    info = cpu_info()
    print(
        f"refattn bench: {info['cpu_model']} (LLVM cpu {info['llvm_cpu']}, NUMBA_CPU_NAME "
        f"{info['numba_cpu_name']}), numba {numba.__version__} ({numba.get_num_threads()} "
        f"threads), torch {torch.__version__ if torch else 'absent'}, load "
        f"{' '.join(f'{x:.2f}' for x in info['loadavg'])}",
        flush=True,
    )
    rows = []
    targets = None
    if args.targets:
        args.median = True
        rows, targets = run_targets(args, torch)
    for dtype in args.dtypes if not args.targets else ():
        for length in args.lengths:
            rows.append(
                bench_shape(
                    f"B1 H{args.heads} L{length}",
                    1,
                    args.heads,
                    length,
                    length,
                    args.dim,
                    dtype,
                    args,
                    torch,
                )
            )
            print_row(rows[-1])
        if args.decode_keys:
            rows.append(
                bench_shape(
                    f"decode L1 S{args.decode_keys}",
                    1,
                    args.heads,
                    1,
                    args.decode_keys,
                    args.dim,
                    dtype,
                    args,
                    torch,
                )
            )
            print_row(rows[-1])
    if args.long and not args.targets:
        rows.append(bench_long(args.long, args.dim))
        print_row(rows[-1])
    compile_times = None
    if args.compile:
        compile_times = bench_compile()
        print(
            "first compile (empty cache) / cached load, s: "
            + ", ".join(f"{name} {seconds:.1f}" for name, seconds in compile_times.items()),
            flush=True,
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"peak RSS of this process {peak / 2**30:.2f} GiB; load after "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    if args.json:
        info |= {
            "threads": threads,
            "peak_rss_bytes": peak,
            "numba": numba.__version__,
            "torch": torch.__version__ if torch else None,
            "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "statistic": "median" if args.median else "best",
            "settle_s": args.settle,
            "loadavg_after": list(os.getloadavg()),
        }
        report = {"info": info, "rows": rows}
        if targets is not None:
            report["targets"] = targets
        if compile_times is not None:
            report["compile_s"] = compile_times
        args.json.write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
