"""The report of a validation run: :class:`Report`, one per implementation, dtype and tier
(made by :func:`oracle.run.validate.validate`), its coverage, accuracy grades and renderings
(:mod:`oracle.report.formats`).

Examples
--------
>>> from oracle.judging.results import CaseResult
>>> r = CaseResult("demo", "conformance", "float32", "fail", message="out: 1 of 4 over")
>>> report = Report("impl", "float32", "suite smoke", False, [r])
>>> report.passed, report.counts()["fail"]
(False, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from oracle.catalogue.names import STRICT_ONLY
from oracle.conventions.layouts import NOT_EXPRESSIBLE
from oracle.judging.results import VERDICTS, CaseResult, json_float, ulp_summary
from oracle.reading.features import HEADLINE_FEATURES, SHAPE_CLASSES
from oracle.report.formats import summary_table, to_dict, to_html, to_json, to_junit

__all__ = ["Report", "GRADE_FACTOR", "consistent_with"]


@dataclass
class Report:
    """Results of one validation run; ``passed`` is the run's verdict."""

    impl: str
    dtype: str | None
    source: str
    strict: bool
    results: list[CaseResult]
    seconds: float = 0.0
    grads: bool = False
    isolated: bool = False  # cases ran in a supervised worker process
    required: tuple = ()  # features that must have been judged (--require)
    tolerance: str = "default"  # the tier (oracle.judging.tolerance.TIERS)
    layout: str = "bhld"  # the implementation's layout: indices are shown in its order
    strict_invariance: bool = False  # invariance warnings (bits differ, within tolerance) fail
    #: the tight tier's report of the same calls (``validate(..., tolerance="both")``)
    tight: Report | None = field(default=None, repr=False)

    def use_layout(self, layout: str) -> None:
        """Show every index in the caller's ``layout`` order (the errors stay in refattn's)."""
        self.layout = layout
        for r in self.results:
            for check in r.checks.values():
                check.worst.layout = layout

    @property
    def passed(self) -> bool:
        """No conformance case failed or errored (robustness ones too with ``strict``) and
        every required feature was judged on at least one case."""
        return not self.failures and not self.missing_required

    def coverage(self) -> dict[str, dict[str, dict[str, int]]]:
        """{"feature" | "dtype" | "shape": {name: {"judged", "unsupported", "error"}}}:
        judged = cases that reached a pass/fail verdict."""
        table: dict[str, dict[str, dict[str, int]]] = {"feature": {}, "dtype": {}, "shape": {}}
        wanted = self._headline()
        for feature in (*wanted, *self.required):
            group = "shape" if feature in SHAPE_CLASSES else "feature"
            table[group].setdefault(feature, {"judged": 0, "unsupported": 0, "error": 0})
        for r in self.results:
            if r.category == "invariance":  # a check of a case already counted
                continue
            kind = "judged" if r.verdict in ("pass", "fail") else r.verdict
            for group, names in (
                ("feature", r.features),
                ("dtype", [r.dtype]),
                ("shape", r.shape_classes),
            ):
                for name in names:
                    row = table[group].setdefault(name, {"judged": 0, "unsupported": 0, "error": 0})
                    row[kind] += 1
        return table

    @property
    def untested(self) -> list[str]:
        """Headline features (and required ones) no case judged: gradients only when asked."""
        coverage = self.coverage()
        rows = {**coverage["feature"], **coverage["shape"]}
        wanted = self._headline()
        quiet = set(self.not_expressible) - set(self.required)
        return [
            f
            for f in dict.fromkeys((*wanted, *self.required))
            if rows.get(f, {}).get("judged", 0) == 0 and f not in quiet
        ]

    @property
    def not_expressible(self) -> dict[str, str]:
        """{feature: why} for the features no case judged because the calling convention
        cannot carry them (a packed or paged layout has no place for a (B, H, L, S) mask):
        nothing the implementation's author can act on, so not in :attr:`untested`; a report
        shows them once as "not expressible in this layout"."""
        found: dict[str, str] = {}
        judged = set()
        for r in self.results:
            if r.verdict in ("pass", "fail"):
                judged.update(r.features)
            elif r.verdict == "unsupported" and NOT_EXPRESSIBLE in (r.message or ""):
                named = r.message.split(":", 1)[0]
                for feature in r.features:
                    if feature in named:
                        found.setdefault(feature, r.message)
        return {f: why for f, why in found.items() if f not in judged}

    def _headline(self) -> list[str]:
        # attention results carry shape classes; a run of variant cases only has no headline
        if not any(r.shape_classes for r in self.results):
            return []
        return [f for f in HEADLINE_FEATURES if f != "gradients" or self.grads]

    def untested_reason(self, feature: str) -> str:
        """Why ``feature`` went untested: "no selected case" or the verdict counts."""
        coverage = self.coverage()
        row = {**coverage["feature"], **coverage["shape"]}.get(feature)
        if row is None or not (row["unsupported"] or row["error"]):
            return "no selected case has it"
        return f"{row['unsupported']} unsupported, {row['error']} error"

    @property
    def missing_required(self) -> list[str]:
        """Required features (``require=``) that no case judged."""
        return [f for f in self.required if f in self.untested]

    @property
    def failures(self) -> list[CaseResult]:
        """The results that make the run fail."""
        return [
            r
            for r in self.results
            if (r.failed and (self.strict or r.category not in STRICT_ONLY))
            or (r.verdict == "warning" and self.strict_invariance)
        ]

    def counts(self, category: str | None = None) -> dict[str, int]:
        """Number of results per verdict (optionally in one category)."""
        chosen = [r for r in self.results if category is None or r.category == category]
        return {v: sum(r.verdict == v for r in chosen) for v in VERDICTS}

    def grades(self) -> dict:
        """Accuracy grades per dtype and quantity over the passing conformance cases:
        ``{dtype: {quantity: {"elements", "correctly_rounded", "ulp_median", "ulp_p99",
        "ulp_max", "nonfinite", "rms_error", "consistent_with", "models", "textbook_ratio"}}}``.

        ``textbook_ratio`` is the FlashAttention-style ratio: the rms error over the same-dtype
        textbook's (the error model whose label says "textbook"), None without that model.

        ``rms_error`` is the root mean square normalised error (T1); ``models`` the same for
        each error model of :func:`oracle.diagnose.diagnosis.error_models` on the same cases, and
        ``consistent_with`` the models whose rms error is within a factor
        :data:`GRADE_FACTOR` of the implementation's (closest first).
        """
        pooled: dict = {}
        for r in self.results:
            if r.category != "conformance" or r.verdict != "pass":
                continue  # a failing case's errors say what is wrong, not how accurate
            for name, check in r.checks.items():
                if check.grade is not None:
                    pooled.setdefault(r.dtype, {}).setdefault(name, []).append(check.grade)
        return {
            dtype: {name: _pool(grades) for name, grades in by_name.items()}
            for dtype, by_name in pooled.items()
        }

    def summary(self) -> str:
        return summary_table(self)

    def to_dict(self) -> dict:
        return to_dict(self)

    def to_json(self, path=None) -> str:
        return to_json(self, path)

    def to_junit(self, path=None) -> str:
        return to_junit(self, path)

    def to_html(self, path, *, plots="failures") -> Path:
        return to_html(self, path, plots=plots)

    def __repr__(self) -> str:
        return (
            f"Report(impl={self.impl!r}, dtype={self.dtype!r}, passed={self.passed}, "
            f"counts={self.counts()})"
        )


#: A model "fits" an implementation whose rms normalised error is within this factor of its.
GRADE_FACTOR = 2.0


def _pool(grades) -> dict:
    n = sum(g.n for g in grades)
    ulps = np.concatenate([g.ulps for g in grades]) if grades else np.zeros(0)
    summary = ulp_summary(n, sum(g.n_correct for g in grades), ulps)
    rms = math.sqrt(sum(g.sq for g in grades) / n) if n else 0.0
    labels = [m for m in grades[0].models if all(m in g.models for g in grades)] if grades else []
    models = {m: math.sqrt(sum(g.models[m] for g in grades) / n) for m in labels} if n else {}
    summary["rms_error"] = json_float(rms)
    summary["models"] = {m: json_float(x) for m, x in models.items()}
    summary["consistent_with"] = consistent_with(rms, models)
    textbook = [x for m, x in models.items() if "textbook" in m]
    summary["textbook_ratio"] = (
        json_float(rms / textbook[0] if textbook[0] > 0 else (0.0 if rms == 0 else math.inf))
        if textbook
        else None
    )
    return summary


def consistent_with(rms, models) -> list[str]:
    """Model labels whose rms error is within :data:`GRADE_FACTOR` of ``rms``, closest
    first; a model with zero error fits only an exact-zero rms."""

    def distance(x):
        if x == 0 or rms == 0:
            return 0.0 if x == rms else math.inf
        return abs(math.log(rms / x))

    close = sorted(
        (distance(x), m)
        for m, x in models.items()
        if math.isfinite(x) and distance(x) <= math.log(GRADE_FACTOR)
    )
    return [m for _, m in close]
