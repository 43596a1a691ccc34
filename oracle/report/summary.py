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

import numpy as np

__all__ = [
    "unsupported_groups",
    "unsupported_lines",
    "worst_failures",
    "ulp_meaningful",
    "to_caller_layout",
    "key_alignment",
    "key_map",
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
    from oracle.judging.refused import REFUSED

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


def ulp_meaningful(worst) -> bool:
    """Whether an element's ulp distance says something: the truth is not much smaller than
    the element's scale (its normalised error's denominator). Near a cancellation a tiny truth
    has a tiny ulp, and a perfectly good value is "1e+05 ulp" off."""
    if worst is None or worst.error == 0 or not math.isfinite(worst.ulp):
        return worst is not None
    difference = abs(worst.value - worst.truth)
    if not math.isfinite(difference) or difference == 0:
        return True
    scale = difference / worst.error
    return abs(worst.truth) >= scale / 16


#: Axis orders of a quantity's index in each layout, from refattn's (B, H, L, E) order.
_PERMUTATIONS = {"blhd": {4: (0, 2, 1, 3)}}
_BHLD_ONLY = {"lse"}  # lse keeps (B, H, L) in blhd (FlashAttention's layout)


def to_caller_layout(index, quantity, layout) -> tuple:
    """``index`` (refattn's (B, H, L, E) order) in the caller's ``layout`` order: (B, L, H, E)
    for out/dq and (B, S, K, D) for dk/dv under blhd; lse and other layouts unchanged.

    >>> to_caller_layout((0, 1, 7, 3), "out", "blhd")
    (0, 7, 1, 3)
    """
    order = _PERMUTATIONS.get(layout, {}).get(len(index))
    if order is None or quantity in _BHLD_ONLY:
        return tuple(index)
    return tuple(index[i] for i in order)


def key_alignment(out, truth, v, *, gqa="interleave", max_size=128):
    """|cos| between each row's error ``out_i - truth_i`` and ``v_j - truth_i`` for every key
    j, on the (batch, head) with the worst error: (L, S), max-pooled to at most ``max_size``
    per side. A kernel that drops or adds key j moves row i along ``v_j - o_i`` exactly, so a
    key-position bug lights up its column (a dropped partial tile, a causal frontier).
    Returns None when the shapes do not allow it."""
    out, truth = np.asarray(out, np.float64), np.asarray(truth, np.float64)
    v = np.asarray(v, np.float64)
    if out.shape != truth.shape or out.ndim < 2 or v.ndim < 2:
        return None
    error = np.where(np.isfinite(out - truth), out - truth, 0.0)
    out4 = error.reshape((-1,) + error.shape[-3:]) if error.ndim >= 3 else error[None, None]
    truth4 = truth.reshape(out4.shape)
    v4 = v.reshape((-1,) + v.shape[-3:]) if v.ndim >= 3 else v[None, None]
    if v4.shape[0] not in (1, out4.shape[0]):
        return None
    norms = np.linalg.norm(out4, axis=-1).max(axis=-1)  # (B, H)
    b, h = np.unravel_index(int(np.argmax(norms)), norms.shape)
    K, H = v4.shape[1], out4.shape[1]
    kv = h // max(H // K, 1) if gqa != "tile" else h % K
    vb = v4[min(b, v4.shape[0] - 1), kv]  # (S, E)
    e, t = out4[b, h], np.where(np.isfinite(truth4[b, h]), truth4[b, h], 0.0)  # (L, E)
    direction = vb[None, :, :] - t[:, None, :]  # (L, S, E)
    with np.errstate(all="ignore"):
        cos = np.abs(np.einsum("le,lse->ls", e, direction)) / (
            np.linalg.norm(e, axis=-1)[:, None] * np.linalg.norm(direction, axis=-1)
        )
    cos = np.where(np.isfinite(cos), cos, 0.0)
    return max_pool(cos, max_size)


def max_pool(grid, size):
    """Max-pool a 2-d grid to at most ``size`` per side."""
    for axis in (0, 1):
        n = grid.shape[axis]
        if n > size:
            step = math.ceil(n / size)
            pad = (-n) % step
            widths = [(0, 0), (0, 0)]
            widths[axis] = (0, pad)
            padded = np.pad(grid, widths)
            shape = list(padded.shape)
            shape[axis : axis + 1] = [shape[axis] // step, step]
            grid = padded.reshape(shape).max(axis=axis + 1)
    return grid


#: Largest L * S * E for which :func:`key_map` is computed (the HTML's (query, key) map).
KEY_MAP_CAP = 2**24


def key_map(out, truth, v, gqa=None):
    """:func:`key_alignment` of a failing output, or None (no output, NaN-only errors, too
    large: L S E over :data:`KEY_MAP_CAP`, or a single key)."""
    if out is None or truth is None or np.shape(out) != np.shape(truth) or np.ndim(v) < 2:
        return None
    L, S, E = np.shape(out)[-2], np.shape(v)[-2], np.shape(v)[-1]
    if S < 2 or L * S * E > KEY_MAP_CAP:
        return None
    return key_alignment(out, truth, v, gqa=gqa or "interleave").astype(np.float32)
