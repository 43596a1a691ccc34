#!/usr/bin/env python
"""Same-run ratios of softmax attention: refattn's exact path against its Numba kernel, and the
Numba kernel against torch's ``scaled_dot_product_attention``.

Usage: python tools/bench_softmax_exact.py [--rows NAME ...] [--repeat N] [--json FILE]

Rows (``--rows``, default all but the 8192 ones; ``prefill-*`` are causal, bottom-right):

* ``sdpa-f32``: float32 causal B1 H8 L=S=1024 D=E=64; Numba float32 vs torch SDPA float32 and
  exact (-> float32) vs Numba;
* ``prefill-2048``, ``prefill-4096``, ``prefill-8192``: bfloat16 causal B1 H8 L=S D=E=128;
  exact (-> bfloat16) vs Numba (bfloat16 inputs compute in float32) and Numba vs torch SDPA
  on the same bfloat16 inputs widened to float32;
* ``decode-2048``, ``decode-4096``, ``decode-8192``: bfloat16 B1 H8 L1 S D=E=128, the same
  three columns.

Each figure is the best of ``--repeat`` calls after one warm-up call (which compiles); the
implementations are called alternately in one process, so a ratio compares the same machine
state, the Numba and torch calls each after two untimed calls of their own (so that the other
library's idle threads have stopped spinning). The load average (``os.getloadavg``) is
printed before and after every row: the machine may be shared, so compare ratios, not
absolute times. Every figure is a measurement of that row; nothing is extrapolated.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import ml_dtypes
import numba
import numpy as np

import refattn
from refattn import config
from refattn.exact import fast as fast_exact

ROWS = {
    "sdpa-f32": ("float32", 1024, 1024, 64, True),
    "prefill-2048": ("bfloat16", 2048, 2048, 128, True),
    "prefill-4096": ("bfloat16", 4096, 4096, 128, True),
    "prefill-8192": ("bfloat16", 8192, 8192, 128, True),
    "decode-2048": ("bfloat16", 1, 2048, 128, False),
    "decode-4096": ("bfloat16", 1, 4096, 128, False),
    "decode-8192": ("bfloat16", 1, 8192, 128, False),
}
DEFAULT_ROWS = [name for name in ROWS if not name.endswith("8192")]


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


#: Untimed calls before each timed one of a path in a round (0 for the slow exact path):
#: torch's and Numba's OpenMP worker threads spin for a while after a parallel call, and on
#: a 2-core machine a call timed right after the other library's would time that spinning.
SETTLE = {"numba": 2, "torch": 2}


def _alternate(fns: dict, repeat: int) -> dict:
    """Best time of each callable over ``repeat`` rounds, called alternately after a warm-up
    (each after :data:`SETTLE` untimed calls of its own)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            for _ in range(SETTLE.get(name, 0)):
                fn()
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench_row(name: str, repeat: int) -> dict:
    """Time one row: Numba, exact and (when torch is installed) torch SDPA, alternately."""
    dtype_name, length, keys, dim, causal = ROWS[name]
    dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 8, length, dim)).astype(dtype)
    k, v = (rng.standard_normal((1, 8, keys, dim)).astype(dtype) for _ in range(2))
    opts = dict(causal=True, align="bottom_right") if causal else {}
    config.EXACT_ENGINE = "fast"
    fns = {
        "numba": lambda: refattn.attention(q, k, v, backend="numba", **opts),
        "exact": lambda: refattn.attention(q, k, v, precision="exact", out_dtype=dtype, **opts),
    }
    torch = _torch()
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(np.asarray(a, np.float32)) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run_torch():
            with torch.inference_mode():
                sdpa(tq, tk, tv, is_causal=causal)

        fns["torch"] = run_torch
    load_before = os.getloadavg()[0]
    best = _alternate(fns, repeat)
    result = {
        "shape": f"B1 H8 L{length} S{keys} D=E={dim} {dtype_name}" + (" causal" if causal else ""),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    result.update({f"{k}_ms": round(t * 1e3, 2) for k, t in best.items()})
    result["exact_over_numba"] = round(best["exact"] / best["numba"], 2)
    if "torch" in best:
        result["numba_speedup_over_torch"] = round(best["torch"] / best["numba"], 2)
    stats = fast_exact.fallback_stats()
    result["referee_rows"] = stats.get("referee_rows")
    result["double_double_rows"] = stats.get("double_double_rows")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=DEFAULT_ROWS)
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds per row")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    print(f"numba threads {numba.get_num_threads()}, cpus {os.cpu_count()}")
    results = {}
    for name in args.rows:
        results[name] = bench_row(name, args.repeat)
        print(name, json.dumps(results[name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
