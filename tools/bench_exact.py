"""Time the exact engines against the Numba float64 kernel, as ratios measured in one run.

Usage: python tools/bench_exact.py [--preset NAME | --B .. --H .. --L .. --S .. --D .. --E ..]
                                   [--in-dtype T] [--out-dtype T] [--which forward|vjp|both]
                                   [--old-budget SECONDS] [--json FILE]

For forward (out + lse) and vjp (dq, dk, dv) it times

* ``numba``: the float64 kernel (``backend="numba"``), the speed reference;
* ``exact``: ``precision="exact"`` with the engine the library dispatches (the fast first step
  with referee fallback when present), with the fraction of elements the referee had to
  settle (read from the engines' statistics; "n/a" when they expose none);
* ``old``: the arbitrary-precision referee forced (``config.EXACT_ENGINE`` /
  ``config.EXACT_VJP_ENGINE = "referee"``; without such a switch, the current exact path).

An exact engine is first timed on a slice (one head, a few query rows) and its full time
estimated by scaling with the number of (head, row) pairs; when the estimate exceeds
``--old-budget`` the full run is skipped and the estimate printed instead (a run that still
exceeds ``--timeout``, e.g. when a slow fallback hits rows the slice did not have, is abandoned
and reported as such). Figures are the best
of ``--repeat`` runs; the CPU name and the load average are printed with them (the machine is
shared: compare ratios taken in one run, never absolute times across runs).

Presets: ``default`` B1 H2 L=S=256 D=E=64 float64 -> float64; ``h8`` B1 H8 L=S=1024 D=E=64;
``h32`` B1 H32 L=S=4096 D=E=128 bfloat16 -> float32 (``--out-dtype bfloat16`` for bfloat16 out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import time

import ml_dtypes
import numpy as np

import refattn
from refattn import config

PRESETS = {
    "default": dict(B=1, H=2, L=256, S=256, D=64, E=64, in_dtype="float64", out_dtype="float64"),
    "h8": dict(B=1, H=8, L=1024, S=1024, D=64, E=64, in_dtype="float64", out_dtype="float64"),
    "h32": dict(B=1, H=32, L=4096, S=4096, D=128, E=128, in_dtype="bfloat16", out_dtype="float32"),
}
SWITCH = {"forward": "EXACT_ENGINE", "vjp": "EXACT_VJP_ENGINE"}


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def engine(kind: str, name: str):
    """Select the exact engine ("fast" / "referee") for ``kind`` when the switch exists."""
    attr = SWITCH[kind]
    if not hasattr(config, attr):
        yield False
        return
    saved = getattr(config, attr)
    setattr(config, attr, name)
    try:
        yield True
    finally:
        setattr(config, attr, saved)


@contextlib.contextmanager
def vjp_stats(sink: dict):
    """Collect the vjp engines' statistics (``stats=``) when exact_vjp accepts them."""
    import inspect

    from refattn.exact import attention_vjp as module

    original = module.exact_vjp
    if "stats" not in inspect.signature(original).parameters:
        yield
        return

    def counting(*args, **kwargs):
        kwargs.setdefault("stats", sink)
        return original(*args, **kwargs)

    module.exact_vjp = counting
    try:
        yield
    finally:
        module.exact_vjp = original


def forward_fraction():
    """Fraction of elements the referee settled in the last fast forward call, or None."""
    try:
        from refattn.exact.fast import fallback_stats
    except ImportError:
        return None
    stats = fallback_stats()
    if not stats or not stats.get("elements"):
        return None
    return stats.get("referee_elements", 0) / stats["elements"]


def inputs(shape: dict, seed=0):
    rng = np.random.default_rng(seed)
    dtype = _dtype(shape["in_dtype"])
    b, h, length, keys, dim, vdim = (shape[x] for x in "BHLSDE")
    q = rng.standard_normal((b, h, length, dim)).astype(dtype)
    k = rng.standard_normal((b, h, keys, dim)).astype(dtype)
    v = rng.standard_normal((b, h, keys, vdim)).astype(dtype)
    grad = rng.standard_normal((b, h, length, vdim)).astype(dtype)
    return q, k, v, grad


def call(kind, path, q, k, v, grad, out_dtype):
    if kind == "forward":
        if path == "numba":
            return refattn.attention(q, k, v, backend="numba", return_lse=True)
        return refattn.attention(q, k, v, precision="exact", out_dtype=out_dtype, return_lse=True)
    if path == "numba":
        return refattn.attention_vjp(q, k, v, grad, backend="numba")
    return refattn.attention_vjp(q, k, v, grad, precision="exact", out_dtype=out_dtype)


class RunTimeout(Exception):
    """An exact run exceeded --timeout (the slice estimate missed a slow fallback)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`RunTimeout` after ``seconds`` (SIGALRM; no limit where unavailable)."""
    if not hasattr(signal, "SIGALRM") or seconds <= 0:
        yield
        return

    def expire(signum, frame):
        raise RunTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def best_of(fn, repeat):
    best = np.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def exact_run(kind, name, shape, args, arrays):
    """{"s": seconds or None, "estimate_s", "fallback"} for one exact engine."""
    out_dtype = _dtype(shape["out_dtype"])
    q, k, v, grad = arrays
    rows = min(shape["L"], args.slice_rows)
    part = (q[:, :1, :rows], k[:, :1], v[:, :1], grad[:, :1, :rows])
    with engine(kind, name):
        call(kind, name, *part, out_dtype)  # compile / warm caches
        small = best_of(lambda: call(kind, name, *part, out_dtype), 1)
        estimate = small * shape["B"] * shape["H"] * shape["L"] / rows
        row = {"estimate_s": estimate, "s": None, "fallback": None}
        if estimate > args.old_budget:
            return row
        sink: dict = {}
        with vjp_stats(sink) if kind == "vjp" else contextlib.nullcontext():
            try:
                with time_limit(args.timeout):
                    row["s"] = best_of(
                        lambda: call(kind, name, q, k, v, grad, out_dtype), args.repeat
                    )
            except RunTimeout:
                row["timed_out_s"] = args.timeout
                return row
        if kind == "forward":
            row["fallback"] = forward_fraction()
        elif sink.get("elements"):
            row["fallback"] = sink.get("referee", 0) / sink["elements"]
    return row


def bench(kind, shape, args, arrays):
    q, k, v, grad = arrays
    if shape["in_dtype"] == "bfloat16":
        numba_arrays = tuple(a.astype(np.float32) for a in arrays)
    else:
        numba_arrays = arrays
    call(kind, "numba", *numba_arrays, None)  # compile
    result = {"numba_s": best_of(lambda: call(kind, "numba", *numba_arrays, None), args.repeat)}
    result["numba_inputs"] = str(numba_arrays[0].dtype)
    has_switch = hasattr(config, SWITCH[kind])
    result["exact"] = exact_run(kind, "fast", shape, args, arrays)
    if has_switch:
        result["old"] = exact_run(kind, "referee", shape, args, arrays)
    else:  # no switch in this tree: the current exact path is the old engine
        result["old"] = dict(result["exact"], note="no engine switch: the current exact path")
    return result


def _fmt_seconds(row):
    if row["s"] is not None:
        return f"{row['s']:9.3f} s"
    if "timed_out_s" in row:
        return f"timed out after {row['timed_out_s']:.0f} s (estimate {row['estimate_s']:.0f} s)"
    return f"skipped (estimate {row['estimate_s']:.0f} s)"


def report(kind, result):
    numba_s = result["numba_s"]
    exact, old = result["exact"], result["old"]
    fraction = "n/a" if exact["fallback"] is None else f"{100 * exact['fallback']:.4f} %"
    print(f"  {kind:7s} numba ({result['numba_inputs']}) {numba_s:9.4f} s")
    print(f"  {kind:7s} exact {_fmt_seconds(exact)}   referee fallback {fraction}")
    print(
        f"  {kind:7s} old   {_fmt_seconds(old)}" + (f"   ({old['note']})" if "note" in old else "")
    )
    ratios = {}
    if exact["s"] is not None:
        ratios["exact/numba"] = exact["s"] / numba_s
    if old["s"] is not None:
        ratios["old/numba"] = old["s"] / numba_s
        if exact["s"] is not None:
            ratios["old/exact"] = old["s"] / exact["s"]
    if ratios:
        print("  " + "  ".join(f"{name} = {value:,.1f}x" for name, value in ratios.items()))
    result["ratios"] = ratios


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    for letter in "BHLSDE":
        parser.add_argument(f"--{letter}", type=int, help=f"override the preset's {letter}")
    parser.add_argument("--in-dtype", choices=["float64", "float32", "bfloat16", "float16"])
    parser.add_argument("--out-dtype", choices=["float64", "float32", "bfloat16", "float16"])
    parser.add_argument("--which", choices=["forward", "vjp", "both"], default="both")
    parser.add_argument("--repeat", type=int, default=3, help="best of N (default 3)")
    parser.add_argument(
        "--slice-rows",
        type=int,
        default=4,
        help="query rows of the slice that estimates an exact run (default 4)",
    )
    parser.add_argument(
        "--old-budget",
        type=float,
        default=120.0,
        help="skip an exact run whose estimate exceeds this (s, default 120)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="abandon one full exact run after this many seconds (default 600)",
    )
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    shape = dict(PRESETS[args.preset])
    for letter in "BHLSDE":
        if getattr(args, letter) is not None:
            shape[letter] = getattr(args, letter)
    for name in ("in_dtype", "out_dtype"):
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    load = os.getloadavg()
    cpu = cpu_name()
    print(
        f"bench_exact: {cpu}, {os.cpu_count()} cores, load {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}"
    )
    print(
        "shape "
        + " ".join(f"{x}={shape[x]}" for x in "BHLSDE")
        + f" {shape['in_dtype']} -> {shape['out_dtype']}"
    )
    arrays = inputs(shape)
    kinds = ["forward", "vjp"] if args.which == "both" else [args.which]
    results = {"cpu": cpu, "cores": os.cpu_count(), "load": list(load), "shape": shape}
    for kind in kinds:
        results[kind] = bench(kind, shape, args, arrays)
        report(kind, results[kind])
    results["load_after"] = list(os.getloadavg())
    print(f"load after {results['load_after'][0]:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, sort_keys=True, default=str)
    return results


if __name__ == "__main__":
    main()
