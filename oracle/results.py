"""The results of a validation: one :class:`Check` per quantity, one :class:`CaseResult`
per case, one :class:`Report` per run (rendered by :mod:`oracle.report`).

Examples
--------
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

from .tolerance import Threshold

__all__ = ["VERDICTS", "Worst", "Check", "CaseResult", "Report"]

VERDICTS = ("pass", "fail", "unsupported", "error")


@dataclass
class Worst:
    """The element with the largest ratio of normalised error to threshold."""

    quantity: str
    index: tuple
    value: float
    truth: float
    error: float  # normalised error (T1)
    ulp: float  # |value - truth| in ulp of the dtype
    threshold: float

    def describe(self) -> str:
        return (f"{self.quantity}[{', '.join(map(str, self.index))}] = {self.value!r}, "
                f"truth {self.truth!r}, normalised error {self.error:.3g} "
                f"({self.ulp:.3g} ulp) > threshold {self.threshold:.3g}"
                if self.error > self.threshold else
                f"{self.quantity}[{', '.join(map(str, self.index))}] = {self.value!r}, "
                f"truth {self.truth!r}, normalised error {self.error:.3g} "
                f"({self.ulp:.3g} ulp) <= threshold {self.threshold:.3g}")


@dataclass
class Check:
    """The judgement of one quantity (out, lse, dq, ...) of one case."""

    quantity: str
    passed: bool
    max_error: float
    n_failed: int
    size: int
    threshold: Threshold
    worst: Worst
    errors: np.ndarray | None = field(default=None, repr=False)  # kept for failing checks

    def to_dict(self) -> dict:
        return {"quantity": self.quantity, "passed": self.passed,
                "max_error": _json_float(self.max_error), "n_failed": self.n_failed,
                "size": self.size, "threshold": _json_float(float(np.max(self.threshold.value))),
                "k": self.threshold.k, "baseline_error": _json_float(self.threshold.baseline),
                "floor": _json_float(float(np.max(self.threshold.floor))),
                "u_out": self.threshold.u_out, "worst": _worst_dict(self.worst)}


@dataclass
class CaseResult:
    """Outcome of one case: verdict, checks, diagnosis and how to reproduce it."""

    name: str
    category: str
    dtype: str
    verdict: str
    message: str = ""
    diagnosis: list[str] = field(default_factory=list)
    checks: dict[str, Check] = field(default_factory=dict)
    seconds: float = 0.0
    reproduce: str = ""
    description: str = ""

    @property
    def worst(self) -> Worst | None:
        """Worst element over the checks (the first failing check's, else the largest ratio)."""
        if not self.checks:
            return None
        return max((c.worst for c in self.checks.values()),
                   key=lambda w: _ratio(w.error, w.threshold))

    @property
    def threshold(self) -> float | None:
        worst = self.worst
        return None if worst is None else worst.threshold

    @property
    def failed(self) -> bool:
        return self.verdict in ("fail", "error")

    def explain(self) -> str:
        """Multi-line account: verdict, message, worst element, threshold, diagnosis, repro."""
        lines = [f"{self.name} [{self.category}, {self.dtype}]: {self.verdict}"]
        if self.message:
            lines.append(f"  {self.message}")
        for check in self.checks.values():
            if not check.passed:
                lines.append(f"  {check.worst.describe()}")
                lines.append(f"    {check.n_failed} of {check.size} elements over; threshold "
                             f"{check.threshold.formula()}")
        for note in self.diagnosis:
            lines.append(f"  diagnosis: {note}")
        if self.category == "robustness" and self.failed:
            lines.append("  (robustness case: fails the run only with --strict)")
        if self.reproduce:
            lines.append(f"  reproduce: {self.reproduce}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        worst = self.worst
        return {"name": self.name, "category": self.category, "dtype": self.dtype,
                "verdict": self.verdict, "message": self.message, "diagnosis": self.diagnosis,
                "seconds": round(self.seconds, 4), "reproduce": self.reproduce,
                "description": self.description,
                "worst": None if worst is None else _worst_dict(worst),
                "checks": {name: c.to_dict() for name, c in self.checks.items()}}


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

    @property
    def passed(self) -> bool:
        """No conformance case failed or errored (robustness ones too with ``strict``)."""
        return not self.failures

    @property
    def failures(self) -> list[CaseResult]:
        """The results that make the run fail."""
        return [r for r in self.results
                if r.failed and (self.strict or r.category != "robustness")]

    def counts(self, category: str | None = None) -> dict[str, int]:
        """Number of results per verdict (optionally in one category)."""
        chosen = [r for r in self.results if category is None or r.category == category]
        return {v: sum(r.verdict == v for r in chosen) for v in VERDICTS}

    def summary(self) -> str:
        from .report import summary_table
        return summary_table(self)

    def to_dict(self) -> dict:
        from .report import to_dict
        return to_dict(self)

    def to_json(self, path=None) -> str:
        from .report import to_json
        return to_json(self, path)

    def to_junit(self, path=None) -> str:
        from .report import to_junit
        return to_junit(self, path)

    def to_html(self, path) -> Path:
        from .report import to_html
        return to_html(self, path)

    def __repr__(self) -> str:
        return (f"Report(impl={self.impl!r}, dtype={self.dtype!r}, passed={self.passed}, "
                f"counts={self.counts()})")


def _json_float(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else repr(x)


def _worst_dict(w: Worst) -> dict:
    return {"quantity": w.quantity, "index": list(w.index), "value": _json_float(w.value),
            "truth": _json_float(w.truth), "error": _json_float(w.error),
            "ulp": _json_float(w.ulp), "threshold": _json_float(w.threshold)}


def _ratio(error, limit):
    if error == 0:
        return 0.0
    return math.inf if limit <= 0 else error / limit
