"""How many conformance cases each deliberately broken tiled kernel fails, per dtype and tier.

The tiled kernels of ``tests/planted/tiled_kernels.py`` (three correct ones: ``tiled``, ``flash``,
``split_kv``; nine broken ones, ``TILED_BROKEN``) are validated on a fixture directory written
by ``refattn-oracle generate`` (or, with ``--suite``, on fixtures built in memory) in both
tolerance tiers (``default`` and ``tight``). The table gives, per kernel and dtype,
``failures in the default tier / failures in the tight tier`` over the conformance cases of
that dtype (robustness cases are not counted: peers legitimately differ there). Issue #14's
must-reach asks each broken kernel to fail at least ``--need`` cases in every dtype it affects
(the narrow accumulators counted in the tight tier) and the correct kernels to fail none in
either tier; the last column says whether that holds.

Usage::

    python -m oracle.cli generate --suite default --out fixtures/ --workers 2
    python tools/broken_counts.py --fixtures fixtures/
    python tools/broken_counts.py --suite default --cases 'k-*' --dtype float32
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT))

from oracle import catalogue, golden, judge  # noqa: E402
from oracle.catalogue.names import DTYPES  # noqa: E402
from oracle.validate import validate  # noqa: E402
from tests.planted.tiled_kernels import TILED_BROKEN, flash, split_kv, tiled  # noqa: E402

#: broken kernel -> (dtypes it affects, the tier its must-reach is counted in)
AFFECTS = {name: (DTYPES, "default") for name in TILED_BROKEN}
AFFECTS["accumulate_float16"] = (("float64", "float32", "float16"), "tight")
AFFECTS["accumulate_bfloat16"] = (DTYPES, "tight")

CORRECT = {"tiled": tiled, "flash": flash, "split_kv": split_kv}
TIERS = ("default", "tight")


def _fixtures(args) -> list:
    """Attention fixtures of the chosen source, dtypes and case patterns."""
    patterns = args.cases or None
    if args.fixtures:
        found = golden.load(args.fixtures)
    else:
        found = (
            golden.build(c)
            for c in catalogue.suite(args.suite)
            if not patterns or any(fnmatch.fnmatchcase(c.name, p) for p in patterns)
        )
    chosen = []
    for fixture in found:
        case = fixture.case if hasattr(fixture, "case") else fixture
        if case.function != "attention" or case.category != "conformance":
            continue
        if args.dtype and case.dtype not in args.dtype:
            continue
        if patterns and not any(fnmatch.fnmatchcase(case.name, p) for p in patterns):
            continue
        chosen.append(fixture)
    return chosen


def _without_grades() -> None:
    """Verdicts do not depend on the accuracy grades' error models, which cost several
    textbook evaluations per case: this count skips them (the judge's context, grade=False)."""
    init = judge._Context.__init__
    init.__defaults__ = (init.__defaults__[0], False)


def _failures(impl, fixtures, tier) -> dict[str, list[str]]:
    """dtype -> names of the conformance cases ``impl`` fails in ``tier`` (verdict fail or
    error; "unsupported" cases, e.g. sinks for kernels without them, are not counted)."""
    report = validate(
        impl, fixtures=fixtures, dtype=None, progress=False, tolerance=tier, diagnose=False
    )
    failed: dict[str, list[str]] = {}
    for result in report.results:
        if result.verdict in ("fail", "error"):
            failed.setdefault(result.dtype, []).append(result.name)
    return failed


def _row(name, counts, dtypes, need=None, affects=None):
    cells = []
    ok = True
    for dtype in dtypes:
        d, t = (len(counts[tier].get(dtype, [])) for tier in TIERS)
        cells.append(f"{d:>4}/{t:<4}")
        if need is not None and dtype in affects[0]:
            got = d if affects[1] == "default" else t
            ok &= got >= need
        elif need is None:
            ok &= d == 0 and t == 0
    return f"{name:<22}" + "".join(f"{c:>12}" for c in cells) + ("   ok" if ok else "   NOT MET")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--fixtures", help="a directory written by refattn-oracle generate")
    source.add_argument(
        "--suite",
        default="default",
        help="build this suite's fixtures in memory (default: default)",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        choices=DTYPES,
        help="only these dtypes (repeatable; default: all)",
    )
    parser.add_argument("--cases", action="append", help="case name patterns (repeatable)")
    parser.add_argument("--kernels", action="append", help="only these kernels (repeatable)")
    parser.add_argument(
        "--need",
        type=int,
        default=5,
        help="failures each broken kernel must reach per dtype (default 5)",
    )
    parser.add_argument(
        "--list", action="store_true", help="also list the failing cases of each broken kernel"
    )
    args = parser.parse_args(argv)

    start = time.perf_counter()
    _without_grades()
    fixtures = _fixtures(args)
    dtypes = [d for d in DTYPES if any(f.case.dtype == d for f in fixtures)]
    totals = {d: sum(f.case.dtype == d for f in fixtures) for d in dtypes}
    print(
        f"{len(fixtures)} conformance cases ({', '.join(f'{d}: {totals[d]}' for d in dtypes)})"
        f", loaded in {time.perf_counter() - start:.0f} s"
    )
    print("cells: failures in the default tier / in the tight tier")
    print(f"{'kernel':<22}" + "".join(f"{d:>12}" for d in dtypes))
    wanted = set(args.kernels or [*CORRECT, *TILED_BROKEN])
    for name, impl in CORRECT.items():
        if name in wanted:
            counts = {tier: _failures(impl, fixtures, tier) for tier in TIERS}
            print(_row(name, counts, dtypes), flush=True)
    listing = []
    for name, (impl, _) in TILED_BROKEN.items():
        if name not in wanted:
            continue
        counts = {tier: _failures(impl, fixtures, tier) for tier in TIERS}
        print(_row(name, counts, dtypes, args.need, AFFECTS[name]), flush=True)
        listing.append((name, counts))
    if args.list:
        for name, counts in listing:
            for dtype in dtypes:
                print(f"{name} {dtype}: {' '.join(sorted(counts['tight'].get(dtype, [])))}")
    print(
        f"({time.perf_counter() - start:.0f} s; must-reach: broken kernels >= {args.need} "
        f"failures per affected dtype, narrow accumulators in the tight tier; correct "
        f"kernels 0 in both tiers)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
