"""``python -m refattn.kernels``: compile the Numba CPU kernels ahead of first use.

Fills Numba's on-disk cache for this CPU (see :func:`refattn.kernels.precompile`), so that the
first ``backend="numba"`` call of a later process loads the kernels instead of compiling them.
"""

from __future__ import annotations

import argparse
import sys

from ._dispatch import FAMILIES, precompile


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m refattn.kernels", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float64", "float32"],
        choices=["float64", "float32"],
        help="compute dtypes (default both)",
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        default=list(FAMILIES),
        choices=list(FAMILIES),
        help="kernel paths (default all)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="processes compiling at once (default 1)"
    )
    parser.add_argument("--units", nargs="+", help=argparse.SUPPRESS)  # PATH:DTYPE, for --jobs
    args = parser.parse_args(argv)
    if args.units:  # one share of a parallel precompile: "path dtype seconds" per line
        for unit in args.units:
            path, dtype = unit.split(":")
            seconds = precompile([dtype], [path])[path, dtype]
            print(f"{path} {dtype} {seconds:.3f}", flush=True)
        return 0

    def report(path, dtype, seconds):
        print(f"{path:>8} {dtype}: {seconds:6.1f} s", flush=True)

    times = precompile(args.dtypes, args.paths, report=report, jobs=args.jobs)
    print(f"total {sum(times.values()):.1f} s (a second run loads the cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
