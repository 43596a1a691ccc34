"""The summary parts of a report (issue 25, item 5): verdict counts first, unsupported cases
collapsed by what is missing, the worst failures, ulp only where it means something, indices in
the caller's layout, and the (query, key) error map of the HTML report.

Examples
--------
>>> from oracle.judging.results import CaseResult
>>> rows = [CaseResult(f"c{i}", "conformance", "float32", "unsupported",
...                    "the implementation does not accept sinks= (unexpected keyword)")
...         for i in range(3)]
>>> unsupported_lines(rows)[1].split()
['3', 'sinks=']
"""

from __future__ import annotations

import math
import re
import textwrap

from oracle.diagnose.key_map import KEY_MAP_CAP, key_alignment, key_map, max_pool
from oracle.judging.refused import REFUSED
from oracle.judging.results import to_caller_layout, ulp_meaningful

__all__ = [
    "unsupported_groups",
    "unsupported_lines",
    "worst_failures",
    "ulp_meaningful",
    "to_caller_layout",
    "key_alignment",
    "key_map",
    "max_pool",
    "KEY_MAP_CAP",
]

_KEYWORD = re.compile(r"(?:does not accept|has no equivalent of) (\w+)=")
_NUMBER = re.compile(r"\b\d+(\.\d+)?\b")


def _reason(message: str) -> str:
    """What a case missed: ``name=`` for a refused keyword, else the message with its numbers
    replaced by ``N`` (so the same refusal on cases of several shapes is one row)."""
    found = _KEYWORD.search(message or "")
    if found:
        return f"{found.group(1)}="
    text = (message or "NotImplementedError").splitlines()[0].strip()
    return _NUMBER.sub("N", text)


def unsupported_groups(results, *, examples=None) -> dict[str, int]:
    """{reason: number of unsupported cases}, most frequent first; ``examples`` (a dict) gets
    one message per reason."""
    counts: dict[str, int] = {}
    for r in results:
        if r.verdict == "unsupported":
            key = _reason(r.message)
            counts[key] = counts.get(key, 0) + 1
            if examples is not None:
                examples.setdefault(key, (r.message or "").splitlines()[0] if r.message else "")
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def unsupported_lines(results) -> list[str]:
    """One table of the unsupported cases: count and what was missing (the keyword refused,
    or the implementation's message)."""
    examples: dict = {}
    groups = unsupported_groups(results, examples=examples)
    if not groups:
        return []
    total = sum(groups.values())
    lines = [f"Unsupported ({total} cases, never a pass), by what is missing:"]
    refused = sum(n for reason, n in groups.items() if reason.startswith(REFUSED))
    if refused:
        lines.append(f"  ({refused} {REFUSED}: --refusals-are-errors makes them errors)")
    for reason, n in groups.items():
        example = examples.get(reason) or ""
        lines.append(f"  {n:5d}  {reason}")
        shapes_hidden = _NUMBER.search(example) is not None  # the N row, then real shapes
        if (reason.endswith("=") or shapes_hidden) and example and example != reason:
            lines += textwrap.wrap(
                f"e.g. {example}", 110, initial_indent=" " * 9, subsequent_indent=" " * 11
            )
    return lines


def _ratio(result) -> float:
    worst = result.worst
    if worst is None:
        return math.inf if result.verdict == "error" else 0.0
    if worst.threshold <= 0:
        return math.inf
    return worst.error / worst.threshold


def worst_failures(results, n=5) -> list:
    """The ``n`` failing results with the largest error / threshold (errors first)."""
    failing = [r for r in results if r.failed]
    return sorted(failing, key=lambda r: (r.verdict != "error", -_ratio(r)))[:n]
