"""Named alternatives of a failing merge_states case: the reported merge bugs.

Each alternative is computed by refattn's float64 merge on the case's inputs with the bug
applied; a failing output that the alternative explains (closer to it than to the truth, on
the elements that fail) gets the alternative's name:

* "base-2 lse merged as natural": base-2 lses weighed by ``e^(lse_p - lse)``;
* "empty-state merge gives NaN": NaN where the truth is an all-empty row (0, -inf);
* "empty chunk with a finite lse": an lse of -inf replaced by 0 (an empty chunk that
  returned a finite lse), so its zero out counts;
* "natural lse merged as base 2": natural-log lses weighed by ``2^(lse_p - lse)`` (a
  base-2-only merge such as FlashInfer's handed natural lses);
* "merge without the max subtraction": ``e^lse_p`` overflowing (or underflowing to 0/0) where
  the truth is finite;
* "merged lse returned in base 2 / the natural log": out right, the lse times log2(e) or ln 2.

The diagnosis costs at most four float64 merges of the case's inputs, each as costly as its
truth, whatever the case: it needs no diagnosis budget (:mod:`oracle.diagnose.budget`).

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
    else:
        alt = _named(refattn.merge_states(outs, lses, lse_base=2))
        if "out" in got and _closer(got["out"], alt["out"], truth["out"]):
            notes.append(
                "natural lse merged as base 2: matches the base-2 merge of the natural-log lses"
            )
    notes += _overflow_notes(outs, lses, base, got, truth)
    if not notes:  # out right: the lse alone in the other base
        notes += _lse_base_notes(base, got, truth)
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


def _without_max(outs, lses, base):
    """The merge as sum_p e^lse_p o_p / sum_p e^lse_p with no max subtracted (float64)."""
    factor = np.log(2.0) if base == 2 else 1.0
    with np.errstate(all="ignore"):
        weights = np.exp(lses * factor)
        total = weights.sum(axis=0)
        out = (weights[..., None] * outs).sum(axis=0) / total[..., None]
        return {"out": out, "lse": np.log(total) / factor}


def _overflow_notes(outs, lses, base, got, truth) -> list[str]:
    """ "merge without the max subtraction" where that merge overflows or underflows (inf,
    NaN or 0/0) on rows the truth has finite, and the failing output is not finite there."""
    alt = _without_max(outs, lses, base)
    bad = ~np.isfinite(alt["out"]) & np.isfinite(truth["out"])
    if not bad.any() or "out" not in got:
        return []
    if np.isfinite(got["out"][bad]).any():
        return []
    return [
        "merge without the max subtraction: e^lse overflows (or underflows to 0/0) at "
        f"|lse| ~ {np.nanmax(np.abs(np.where(np.isfinite(lses), lses, np.nan))):.3g}; "
        "subtract the row's largest lse first"
    ]


def _lse_base_notes(base, got, truth) -> list[str]:
    """The merged lse returned in the other base (out right)."""
    if "lse" not in got:
        return []
    factor = np.log2(np.e) if base != 2 else np.log(2.0)
    want, value = truth["lse"], got["lse"]
    live = np.isfinite(want) & (np.abs(want) > 1.0)
    if not live.any():
        return []
    with np.errstate(all="ignore"):
        near = np.abs(value[live] - want[live] * factor) < np.abs(value[live] - want[live])
    if near.all():
        other = "base 2" if base != 2 else "the natural log"
        return [f"merged lse returned in {other}: lse x {factor:.6g}"]
    return []
