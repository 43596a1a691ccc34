"""How strong a suite is: which planted broken kernels its conformance cases catch.

``refattn-oracle power`` (and ``oracle.power(...)``) validates refattn's library of tiled
attention kernels (:mod:`oracle.power.planted`: three correct ones, the negative control, and the
planted bugs of ``TILED_BROKEN`` and ``POWER_BROKEN``: tile off-by-one, dropped partial tiles,
late rescale and rescales skipped past 1k, 4k, 8k or 32k keys, narrow accumulators for P@V and
for the denominator switching on past those depths, split-KV combines without the max at
several chunk sizes, lse in base 2, wrong causal offsets, 16-bit positions, an ignored scale,
the softcap order) on a suite or a fixture folder, in both tolerance tiers, and reports per bug
how many conformance cases catch it (per dtype: ``default tier / tight tier``) and which. With
``impl`` (or ``--impl`` / ``--adapter``) the cases are first restricted to those the user's
implementation supports (it does not answer "unsupported"), and ``without`` drops the cases of
named options, so the table answers: can the suite I run catch what my kernel might do wrong?

Robustness cases are not counted (peers legitimately differ there); the tiled kernels do not
support sinks, kv_lengths or float8 descales, so those cases count for no planted kernel. A
bug only an option can show (:data:`NEEDS`: the softcap order, the causal offsets) is "not
applicable" when no selected case uses that option (an implementation without softcap).

Examples
--------
>>> from oracle.power import power
>>> result = power(suite="smoke", cases=["basic-H2K2-L5S7-D8E8-f32"],
...                kernels=["tiled", "lse_log2"], progress=False)
>>> result.failures["tiled"]["default"], result.caught("lse_log2", "float32")
({}, 1)
"""

from __future__ import annotations

import fnmatch
import sys
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass, field

from oracle.catalogue import suite as catalogue_suite
from oracle.catalogue.names import DTYPES
from oracle.fixtures import golden
from oracle.judging.judge import check_fixture
from oracle.power.planted import POWER_BROKEN, TILED_BROKEN, flash, split_kv, tiled
from oracle.run.validate import validate
from refattn.spec import option as attention_option

__all__ = ["power", "PowerResult", "KERNELS", "CORRECT", "render"]

#: The negative control: correct tiled kernels (none may fail a case in either tier).
CORRECT = {"tiled": tiled, "flash": flash, "split_kv": split_kv}

#: Every planted kernel: name -> (implementation, what it does wrong; "" when correct).
KERNELS = {
    **{name: (impl, "") for name, impl in CORRECT.items()},
    **TILED_BROKEN,
    **POWER_BROKEN,
}
TIERS = ("default", "tight")

#: Planted bugs that only an option can show: with no selected case using it (the user's
#: implementation does not support it), the bug is "not applicable", not "WEAK".
NEEDS = {
    bug: attention_option(name).name  # a KeyError at import if refattn drops the option
    for bug, name in (
        ("softcap_order", "softcap"),
        ("causal_offset", "causal"),
        ("causal_top_left", "causal"),
    )
}


@dataclass
class PowerResult:
    """``failures[kernel][tier][dtype]`` = names of the conformance cases that catch it."""

    cases: dict[str, int]
    failures: dict[str, dict[str, dict[str, list[str]]]] = field(default_factory=dict)
    seconds: float = 0.0
    options: set[str] = field(default_factory=set)  # the options some selected case uses
    summed: bool = False  # a bug is caught by `need` cases over all dtypes (linear suites)

    def caught(self, kernel: str, dtype: str, tier: str = "default") -> int:
        return len(self.failures[kernel][tier].get(dtype, []))


def _uses(fixture, option: str) -> bool:
    value = fixture.options.get(option)
    return value is not None and value is not False


def _select(suite, fixtures, dtypes, cases, without) -> list:
    # only the selected cases are read (and their long inputs regenerated)
    source = golden.load(fixtures, cases=cases or None) if fixtures is not None else None
    if source is None:
        source = (
            golden.build(c)
            for c in catalogue_suite(suite or "default")
            if not cases or any(fnmatch.fnmatchcase(c.name, p) for p in cases)
        )
    chosen = []
    for fixture in source:
        case = fixture.case
        if case.function != "attention" or case.category != "conformance":
            continue
        if dtypes and case.dtype not in dtypes:
            continue
        if cases and not any(fnmatch.fnmatchcase(case.name, p) for p in cases):
            continue
        if any(_uses(fixture, option) for option in without):
            continue
        chosen.append(fixture)
    return chosen


def _failures(impl, fixtures) -> dict[str, dict[str, list[str]]]:
    """Per tier and dtype, the cases ``impl`` fails (one call of ``impl`` per case judged in
    both tiers; the fixtures' impl-independent judging parts are computed once for every
    kernel, :mod:`oracle.judging.parts`)."""
    failed: dict[str, dict[str, list[str]]] = {tier: {} for tier in TIERS}
    for fixture in fixtures:
        both = check_fixture(impl, fixture, diagnose=False, tolerance="both", grade=False)
        for tier, result in zip(TIERS, (both, both.tight), strict=True):
            if result.verdict in ("fail", "error"):
                failed[tier].setdefault(result.dtype, []).append(result.name)
    return failed


def _supported(impl, fixtures) -> list:
    """The fixtures ``impl`` does not answer "unsupported" (its options)."""
    report = validate(impl, fixtures=fixtures, dtype=None, progress=False, diagnose=False)
    refused = {r.name for r in report.results if r.verdict == "unsupported"}
    return [f for f in fixtures if f.name not in refused]


def power(
    *,
    suite: str | None = None,
    fixtures=None,
    dtypes: Iterable[str] | None = None,
    cases: Iterable[str] | None = None,
    impl=None,
    without: Iterable[str] = (),
    kernels: Iterable[str] | None = None,
    progress: bool = True,
) -> PowerResult:
    """Run the planted kernels on a suite (built in memory) or a fixture folder.

    Parameters
    ----------
    suite : str, optional
        Suite name (default "default" when ``fixtures`` is None).
    fixtures : path, optional
        A folder written by ``refattn-oracle generate``.
    dtypes, cases : optional
        Only these dtypes / the case names matching these fnmatch patterns.
    impl : callable or str, optional
        The user's implementation (as for :func:`oracle.run.validate`): only the cases it supports
        count.
    without : iterable of str
        Option keywords (e.g. "alibi_slopes", "softcap") whose cases are left out.
    kernels : iterable of str, optional
        Only these planted kernels (names of :data:`KERNELS`).
    progress : bool
        One line per kernel on stderr as it finishes.

    Returns
    -------
    PowerResult
    """
    if _linear.handles(suite, fixtures):  # the linear-attention suites (oracle.power.linear)
        return _linear.power(suite=suite, dtypes=dtypes, cases=cases, kernels=kernels,
                             progress=progress)  # fmt: skip
    start = time.perf_counter()
    names = list(kernels or KERNELS)
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"power: kernels: unknown {unknown}; expected names of {list(KERNELS)}")
    chosen = _select(suite, fixtures, list(dtypes or []), list(cases or []), list(without))
    if impl is not None:
        chosen = _supported(impl, chosen)
    counts = {d: sum(f.case.dtype == d for f in chosen) for d in DTYPES}
    result = PowerResult(cases={d: n for d, n in counts.items() if n})
    result.options = {name for f in chosen for name in f.options if _uses(f, name)}
    for index, name in enumerate(names, 1):
        result.failures[name] = _failures(KERNELS[name][0], chosen)
        if progress:
            print(
                f"[{index}/{len(names)}] {name} ({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    result.seconds = time.perf_counter() - start
    return result


def render(result: PowerResult, *, need: int = 5, list_cases: bool = False) -> str:
    """The table: per kernel and dtype ``default/tight`` caught cases, and the verdict."""
    dtypes = list(result.cases)
    lines = [
        "conformance cases: " + ", ".join(f"{d} {n}" for d, n in result.cases.items()),
        "cells: cases that catch the kernel in the default tier / in the tight tier",
        f"{'kernel':<24}" + "".join(f"{d:>12}" for d in dtypes) + "  verdict",
    ]
    for name, tiers in result.failures.items():
        cells = [f"{result.caught(name, d)}/{result.caught(name, d, 'tight')}" for d in dtypes]
        if name in NEEDS and NEEDS[name] not in result.options:
            verdict = f"not applicable: no case uses {NEEDS[name]}"
        elif {**KERNELS, **_linear.KERNELS}[name][1]:
            counted = sum if result.summed else min  # per dtype, or over the suite
            weakest = counted(result.caught(name, d, "tight") for d in dtypes) if dtypes else 0
            verdict = "caught" if weakest >= need else f"WEAK (< {need} in some dtype)"
        else:
            clean = all(not tiers[t] for t in TIERS)
            verdict = "control: no false alarm" if clean else "CONTROL FAILS"
        lines.append(f"{name:<24}" + "".join(f"{c:>12}" for c in cells) + f"  {verdict}")
    if list_cases:
        for name, tiers in result.failures.items():
            for dtype in dtypes:
                caught = sorted(
                    set(tiers["default"].get(dtype, [])) | set(tiers["tight"].get(dtype, []))
                )
                if caught:
                    lines.append(f"{name} {dtype}: {' '.join(caught)}")
    lines.append(f"({result.seconds:.0f} s)")
    return "\n".join(lines)


# the linear-attention kernels and their power run (they need PowerResult above)
from oracle.power import linear as _linear  # noqa: E402


class _CallableModule(types.ModuleType):
    """``oracle.power`` is both this module and the function (as ``oracle.run.validate``)."""

    def __call__(self, **kwargs) -> PowerResult:
        return power(**kwargs)


sys.modules[__name__].__class__ = _CallableModule


def add_parser(sub) -> None:
    """The ``power`` subcommand of ``refattn-oracle``."""
    parser = sub.add_parser("power", help="which planted broken kernels a suite catches")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--suite", help="suite built in memory (default: default)")
    source.add_argument("--fixtures", help="directory written by `refattn-oracle generate`")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="only these dtypes")
    parser.add_argument("--case", action="append", metavar="PATTERN", help="fnmatch pattern")
    parser.add_argument(
        "--impl", help="module:function or adapter name: count only the cases it supports"
    )
    parser.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="OPTION",
        help="leave out the cases using this option keyword (repeatable)",
    )
    parser.add_argument("--kernel", action="append", help="only these planted kernels")
    parser.add_argument("--need", type=int, default=5, help="cases each bug must fail")
    parser.add_argument("--list", action="store_true", help="list the catching cases")


def run_command(args) -> int:
    """Run ``refattn-oracle power``; 1 when a control fails or a bug is caught too rarely."""
    result = power(
        suite=args.suite,
        fixtures=args.fixtures,
        dtypes=args.dtype,
        cases=args.case,
        impl=args.impl,
        without=args.without,
        kernels=args.kernel,
    )
    text = render(result, need=args.need, list_cases=args.list)
    print(text)
    return 1 if ("CONTROL FAILS" in text or "WEAK" in text) else 0
