"""``python -m refattn.kernels``: compile the Numba CPU kernels ahead of first use.

Fills Numba's on-disk cache for this CPU (see :func:`refattn.kernels.precompile`), so that the
first ``backend="numba"`` call of a later process loads the kernels instead of compiling them.
"""

from __future__ import annotations

import argparse
import sys

from ._dispatch import PATHS, precompile


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
        default=list(PATHS),
        choices=list(PATHS),
        help="kernel paths (default all)",
    )
    args = parser.parse_args(argv)

    def report(path, dtype, seconds):
        print(f"{path:>8} {dtype}: {seconds:6.1f} s", flush=True)

    times = precompile(args.dtypes, args.paths, report=report)
    print(f"total {sum(times.values()):.1f} s (a second run loads the cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
