"""Named alternatives of a failing merge_states case: the reported merge bugs.

Each alternative is computed by refattn's float64 merge on the case's inputs with the bug
applied; a failing output that the alternative explains (closer to it than to the truth, on
the elements that fail) gets the alternative's name:

* "base-2 lse merged as natural": base-2 lses weighed by ``e^(lse_p - lse)``;
* "empty-state merge gives NaN": NaN where the truth is an all-empty row (0, -inf);
* "empty chunk with a finite lse": an lse of -inf replaced by 0 (an empty chunk that
  returned a finite lse), so its zero out counts.

Examples
--------
>>> import numpy as np
>>> outs = np.array([[[[1.0]]], [[[3.0]]]]); lses = np.array([[[0.0]], [[1.0]]])
>>> import refattn
>>> wrong = refattn.merge_states(outs, lses)  # natural, where base 2 was asked
>>> diagnose_merge({"outs": outs, "lses": lses}, {"lse_base": 2}, _named(wrong))
['base-2 lse merged as natural: matches the natural-log merge of the base-2 lses']
"""

from __future__ import annotations

import numpy as np

import refattn

__all__ = ["diagnose_merge"]


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _named(result):
    return {"out": result[0], "lse": result[1]}


def _closer(value, alternative, truth) -> bool:
    """value is nearer the alternative than the truth where they differ (NaN = NaN)."""
    value, alternative, truth = _f64(value), _f64(alternative), _f64(truth)
    with np.errstate(invalid="ignore"):
        differ = ~((alternative == truth) | (np.isnan(alternative) & np.isnan(truth)))
        if not differ.any():
            return False
        to_alt = np.where(np.isnan(value) & np.isnan(alternative), 0.0, np.abs(value - alternative))
        to_truth = np.where(np.isnan(value) & np.isnan(truth), 0.0, np.abs(value - truth))
        to_alt, to_truth = np.nan_to_num(to_alt, nan=np.inf), np.nan_to_num(to_truth, nan=np.inf)
        return bool((to_alt[differ] < to_truth[differ]).all())


def diagnose_merge(inputs, options, outputs, truths=None) -> list[str]:
    """Names of the bugs the failing ``outputs`` ({"out", "lse"}) of a merge case match."""
    outs, lses = _f64(inputs["outs"]), _f64(inputs["lses"])
    base = options.get("lse_base", "e")
    truth = truths or _named(refattn.merge_states(outs, lses, lse_base=base))
    notes = []
    got = {k: _f64(v) for k, v in outputs.items() if v is not None}
    if base == 2:
        alt = _named(refattn.merge_states(outs, lses))
        if "out" in got and _closer(got["out"], alt["out"], truth["out"]):
            notes.append(
                "base-2 lse merged as natural: matches the natural-log merge of the base-2 lses"
            )
    empty_rows = ~np.isfinite(lses).any(axis=0)
    if empty_rows.any() and any(np.isnan(v[empty_rows]).any() for v in got.values()):
        notes.append(
            "empty-state merge gives NaN: rows whose states are all empty (lse -inf) must give "
            "out 0 and lse -inf"
        )
    if np.isneginf(lses).any():
        zeroed = np.where(np.isneginf(lses), 0.0, lses)
        alt = _named(refattn.merge_states(outs, zeroed, lse_base=base))
        if "out" in got and _closer(got["out"], alt["out"], truth["out"]):
            notes.append(
                "empty chunk with a finite lse: the output matches merging the empty states "
                "with lse 0 (an empty chunk must return lse -inf, which weighs 0)"
            )
    return notes
