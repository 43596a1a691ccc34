#!/usr/bin/env python
"""Regression run: refattn's own fast kernels against golden fixtures (or a suite).

Runs the Numba CPU kernels (``--impl numba``, default), the numba.cuda kernels (``--impl
cuda``; on a machine without a GPU set NUMBA_ENABLE_CUDASIM=1 and keep to small suites) or the
float64 NumPy path (``--impl float64``) through :func:`oracle.run.validate.validate` and exits
with 0 only when every case passes (robustness cases count with ``--strict``).

Examples::

    refattn-oracle generate --suite default --out goldens/        # once: the exact truths
    python tools/regression.py --fixtures goldens/ --dtype all --grads
    python tools/regression.py --suite smoke --impl numba         # fixtures built in memory
    NUMBA_ENABLE_CUDASIM=1 python tools/regression.py --suite smoke --impl cuda
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IMPLS = {
    "numba": ("oracle.adapters.refattn_kernels", "RefattnNumba"),
    "cuda": ("oracle.adapters.refattn_kernels", "RefattnCuda"),
    "float64": ("oracle.adapters.refattn_numpy", "RefattnFloat64"),
}
DTYPES = ("float64", "float32", "float16", "bfloat16")


def _impl(name: str):
    import importlib

    module, attribute = IMPLS[name]
    return getattr(importlib.import_module(module), attribute)()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--fixtures", type=Path, help="directory written by `refattn-oracle generate`"
    )
    source.add_argument("--suite", help="suite built in memory (default: smoke)")
    parser.add_argument("--impl", choices=sorted(IMPLS), default="numba")
    parser.add_argument("--dtype", default="all", choices=(*DTYPES, "all"))
    parser.add_argument("--grads", action="store_true", help="also check the vjp")
    parser.add_argument("--strict", action="store_true", help="robustness failures fail too")
    parser.add_argument(
        "--case",
        action="append",
        metavar="PATTERN",
        help="only cases matching this fnmatch pattern (repeatable)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="write the JSON report(s) here (one file per dtype: NAME.DTYPE.json)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from oracle.run.validate import validate

    impl = _impl(args.impl)
    dtypes = DTYPES if args.dtype == "all" else (args.dtype,)
    source = {"fixtures": str(args.fixtures)} if args.fixtures else {"suite": args.suite or "smoke"}
    passed = True
    for dtype in dtypes:
        report = validate(
            impl,
            dtype=dtype,
            grads=args.grads,
            strict=args.strict,
            progress=not args.quiet,
            cases=args.case,
            **source,
        )
        if not report.results:
            continue
        print(report.summary(), flush=True)
        if args.json:
            report.to_json(args.json.with_suffix(f".{dtype}.json"))
        passed &= report.passed
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
