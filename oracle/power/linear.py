"""``refattn-oracle power --suite linear-default``: the planted linear-attention kernels.

The same question as :mod:`oracle.power` for the linear-attention suites: which planted bugs
(:data:`oracle.power.linear_planted.LINEAR_BROKEN`: the decay off by one at a chunk boundary,
the gate cumsum in bfloat16, the normalisation's eps outside the root or missing, the
triangular solve in bfloat16, no state reset at a packed-sequence boundary, beta applied
twice, exp for base-2 gates, the state transposed, the final state one step early) do the
conformance cases catch, and do the correct kernels (``recurrent``, ``chunked``) pass them
all. Linear cases have one tolerance tier (the default (T2), :mod:`oracle.judging.linear`);
the table's second number repeats it.

>>> result = power(suite="linear-smoke", cases=["lin-gdn-basic-*"], kernels=["chunked",
...                "beta_twice"], progress=False)
>>> result.failures["chunked"]["default"], result.caught("beta_twice", "float64")
({}, 1)
"""

from __future__ import annotations

import fnmatch
import sys
import time

from oracle.catalogue import suite as catalogue_suite
from oracle.catalogue.linear_families import SUITES
from oracle.catalogue.names import DTYPES
from oracle.fixtures import golden
from oracle.judging.linear import check_linear, is_linear
from oracle.power import PowerResult
from oracle.power.linear_planted import LINEAR_BROKEN, LINEAR_CORRECT

__all__ = ["KERNELS", "handles", "power"]

#: name -> (kernel, what it does wrong; "" for the controls)
KERNELS = {
    **{name: (impl, "") for name, impl in LINEAR_CORRECT.items()},
    **LINEAR_BROKEN,
}


def handles(suite, fixtures) -> bool:
    """Whether a power run is over a linear-attention suite (built in memory)."""
    return fixtures is None and suite in SUITES


def _fixtures(suite, dtypes, cases):
    chosen = []
    for case in catalogue_suite(suite):
        if not is_linear(case) or case.category != "conformance":
            continue
        if dtypes and case.dtype not in dtypes:
            continue
        if cases and not any(fnmatch.fnmatchcase(case.name, p) for p in cases):
            continue
        chosen.append(golden.build(case))
    return chosen


def power(*, suite, dtypes=None, cases=None, kernels=None, progress=True, **_ignored):
    """Run the planted linear kernels on ``suite``; a :class:`oracle.power.PowerResult`."""
    start = time.perf_counter()
    names = list(kernels or KERNELS)
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"power: kernels: unknown {unknown}; expected names of {list(KERNELS)}")
    chosen = _fixtures(suite, list(dtypes or []), list(cases or []))
    counts = {d: sum(f.case.dtype == d for f in chosen) for d in DTYPES}
    # a bug below a dtype's resolution (a bfloat16 cumsum on bfloat16 inputs) cannot show in
    # that dtype: a linear bug is caught when `need` cases of the suite catch it
    result = PowerResult(cases={d: n for d, n in counts.items() if n}, summed=True)
    for index, name in enumerate(names, 1):
        failed = {}
        for fixture in chosen:
            verdict = check_linear(KERNELS[name][0], fixture, diagnose=False).verdict
            if verdict in ("fail", "error"):
                failed.setdefault(fixture.case.dtype, []).append(fixture.case.name)
        result.failures[name] = {"default": failed, "tight": failed}
        if progress:
            print(
                f"[{index}/{len(names)}] {name} ({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    result.seconds = time.perf_counter() - start
    return result
