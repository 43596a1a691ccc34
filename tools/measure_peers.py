"""Measure how accurate peer attention implementations are against refattn's exact path.

For each shape and input scale, q, k, v are drawn i.i.d. Gaussian (q and k with standard
deviation ``sigma``, v with 1) in float64, rounded to the measured dtype, and the exact
output (every element the exact real result rounded once to the dtype, refattn's
``precision="exact"``) is compared with each implementation's output:

* ``correct``: the fraction of output elements that equal the correctly rounded result;
* ``ulp``: |impl - exact| in ulps of the dtype at the exact value
  (oracle.judging.tolerance.ulp_distance),
  reported as median, 99th percentile and maximum (the maximum is usually a near-cancelling
  element, whose ulp is tiny next to the terms summed);
* ``nat``: max |impl - exact| / (u nat), the error in unit roundoffs of the natural scale
  ``nat_ie = sum_j w_ij |v_je|`` of each element (the oracle's normalisation).

Implementations: the oracle adapters ``torch`` (SDPA), ``jax`` (jax.nn.dot_product_attention),
``onnxruntime`` and ``onnx-reference`` (an ONNX Attention node), ``refattn-float64`` (the
control), and ``numpy-textbook``: ``softmax(q k^T / sqrt(D)) v`` with the max shift, in the
dtype, every intermediate rounded to the dtype (no float32 accumulation for half types: it
is the plain NumPy recipe).
Peers that are not installed or decline a case are listed as skipped.

Examples
--------
    python tools/measure_peers.py                       # B1 H2 L=S=64 D=E=64, sigma 1 and 4
    python tools/measure_peers.py --dtypes float64 float32 --json peers.json
    python tools/measure_peers.py --shape 1 2 128 128 64 64 --sigmas 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oracle import adapters  # noqa: E402
from oracle.judging.tolerance import ulp_distance, unit_roundoff  # noqa: E402
from refattn.attention import attention  # noqa: E402
from refattn.exact.rounding import format_of  # noqa: E402

PEERS = ("torch", "jax", "onnxruntime", "onnx-reference", "refattn-float64", "numpy-textbook")


def numpy_textbook(q, k, v):
    """softmax(q k^T / sqrt(D)) v with the max shift, every step rounded to q's dtype.

    (NumPy computes some bfloat16 operations in float32: each result is cast back.)
    """
    dtype = q.dtype
    scale = np.asarray(1 / np.sqrt(q.shape[-1])).astype(dtype)
    scores = ((q @ np.swapaxes(k, -1, -2)).astype(dtype) * scale).astype(dtype)
    scores = (scores - scores.max(axis=-1, keepdims=True)).astype(dtype)
    weights = np.exp(scores).astype(dtype)
    weights = (weights / weights.sum(axis=-1, keepdims=True).astype(dtype)).astype(dtype)
    return (weights @ v).astype(dtype)


def _implementation(name):
    if name == "numpy-textbook":
        return numpy_textbook
    return adapters.get(name)


def make_inputs(shape, sigma, dtype, seed):
    """q (B, H, L, D), k (B, H, S, D), v (B, H, S, E): Gaussian, rounded once to dtype."""
    batch, heads, length, keys, dim, vdim = shape
    rng = np.random.default_rng(seed)
    target = format_of(dtype).dtype
    q = (sigma * rng.standard_normal((batch, heads, length, dim))).astype(target)
    k = (sigma * rng.standard_normal((batch, heads, keys, dim))).astype(target)
    v = rng.standard_normal((batch, heads, keys, vdim)).astype(target)
    return q, k, v


def error_summary(got, truth, natural, dtype):
    """Fraction correctly rounded, ulp quantiles and the natural-scale error of ``got``."""
    got = np.asarray(got, np.float64)
    truth = np.asarray(truth, np.float64)
    dist = ulp_distance(got, truth, dtype)
    normalised = np.abs(got - truth) / (unit_roundoff(dtype) * natural)
    return {
        "correct": float(np.mean(dist == 0)),
        "ulp_median": float(np.median(dist)),
        "ulp_p99": float(np.quantile(dist, 0.99)),
        "ulp_max": float(dist.max()),
        "nat_max": float(np.nanmax(np.where(np.isnan(normalised), np.inf, normalised))),
    }


def measure(shape, sigma, dtype, peers, seed, repeats):
    """One row per peer for one (shape, sigma, dtype)."""
    q, k, v = make_inputs(shape, sigma, dtype, seed)
    start = time.perf_counter()
    truth = attention(q, k, v, precision="exact", out_dtype=dtype)
    exact_seconds = time.perf_counter() - start
    natural = attention(q, k, np.abs(np.asarray(v, np.float64)))
    rows = []
    for name in peers:
        row = {"peer": name, "shape": list(shape), "sigma": sigma, "dtype": dtype}
        try:
            impl = _implementation(name)
            out = impl(q, k, v)
            start = time.perf_counter()
            for _ in range(repeats):
                out = impl(q, k, v)
            row["seconds"] = (time.perf_counter() - start) / repeats
        except (ImportError, NotImplementedError) as err:
            row["skipped"] = f"{type(err).__name__}: {err}"
            rows.append(row)
            continue
        row.update(error_summary(out, truth, natural, dtype))
        rows.append(row)
    return rows, exact_seconds


def format_table(rows) -> str:
    header = (
        f"{'peer':<16} {'dtype':<8} {'shape':<20} {'sigma':>5} {'correct':>8} "
        f"{'median':>8} {'p99':>9} {'max':>10} {'nat':>9} {'ms':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        shape = "x".join(str(n) for n in row["shape"])
        head = f"{row['peer']:<16} {row['dtype']:<8} {shape:<20} {row['sigma']:>5g}"
        if "skipped" in row:
            lines.append(f"{head} skipped ({row['skipped'][:70]})")
            continue
        lines.append(
            f"{head} {row['correct']:>8.1%} {row['ulp_median']:>8.3g} {row['ulp_p99']:>9.3g} "
            f"{row['ulp_max']:>10.4g} {row['nat_max']:>9.3g} {1e3 * row['seconds']:>8.2f}"
        )
    return "\n".join(lines)


def _versions():
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for module in ("torch", "jax", "onnx", "onnxruntime"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = None
    return versions


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Fraction of correctly rounded outputs and ulp errors of peer attention "
        "implementations against refattn's exact path; prints a table and writes JSON.",
    )
    parser.add_argument(
        "--shape",
        nargs=6,
        type=int,
        action="append",
        metavar=("B", "H", "L", "S", "D", "E"),
        help="shape to measure (repeatable; default 1 2 64 64 64 64)",
    )
    parser.add_argument(
        "--sigmas",
        nargs="+",
        type=float,
        default=[1.0, 4.0],
        help="standard deviations of q and k (default: 1 4)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float64"],
        choices=["float64", "float32", "float16", "bfloat16"],
        help="dtypes to measure (default: float64)",
    )
    parser.add_argument(
        "--peers",
        nargs="+",
        default=list(PEERS),
        choices=PEERS,
        help="implementations to measure (default: all)",
    )
    parser.add_argument("--seed", type=int, default=20261122, help="input seed")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per peer")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path("measure_peers.json"),
        help="where to write the results (default: measure_peers.json)",
    )
    args = parser.parse_args(argv)
    shapes = [tuple(s) for s in (args.shape or [(1, 2, 64, 64, 64, 64)])]
    rows, exact_times = [], []
    for shape in shapes:
        for sigma in args.sigmas:
            for dtype in args.dtypes:
                found, seconds = measure(shape, sigma, dtype, args.peers, args.seed, args.repeats)
                rows.extend(found)
                exact_times.append(
                    {"shape": list(shape), "sigma": sigma, "dtype": dtype, "exact_seconds": seconds}
                )
    print(format_table(rows))
    for entry in exact_times:
        print(
            f"exact path {entry['dtype']} {entry['shape']} sigma {entry['sigma']:g}: "
            f"{entry['exact_seconds']:.2f} s"
        )
    payload = {"seed": args.seed, "versions": _versions(), "exact": exact_times, "rows": rows}
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
