"""The results of a validation: one :class:`Check` per quantity, one :class:`CaseResult`
per case, one :class:`Report` per run (rendered by :mod:`oracle.report.formats`).

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

from oracle.catalogue.names import STRICT_ONLY
from oracle.judging.tolerance import Threshold, ulp_distance
from oracle.reading.features import HEADLINE_FEATURES, SHAPE_CLASSES

__all__ = ["VERDICTS", "Worst", "Grade", "grade_of", "Check", "CaseResult", "Report"]

VERDICTS = ("pass", "fail", "unsupported", "error", "warning")  # warning: invariance only


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
    layout: str = "bhld"  # the caller's layout, the order ``index`` is given in

    def describe(self) -> str:
        from oracle.report.summary import to_caller_layout, ulp_meaningful

        index = ", ".join(map(str, to_caller_layout(self.index, self.quantity, self.layout)))
        where = "" if self.layout == "bhld" else f" ({self.layout} order)"
        ulp = (
            f" ({self.ulp:.3g} ulp)"
            if ulp_meaningful(self)
            else " (ulp not shown: the truth is far below the element's scale)"
        )
        relation = ">" if self.error > self.threshold else "<="
        return (
            f"{self.quantity}[{index}]{where} = {self.value!r}, truth {self.truth!r}, "
            f"normalised error {self.error:.3g}{ulp} {relation} threshold {self.threshold:.3g}"
        )


@dataclass
class Grade:
    """Accuracy of one quantity beyond pass/fail: how many elements are correctly rounded,
    the error in ulp of the dtype, and (for out) the mean squared normalised error of the
    implementation and of each error model (:func:`oracle.diagnose.diagnosis.error_models`), from
    which
    :meth:`Report.grades` says what the errors are consistent with."""

    n: int  # elements with a finite truth
    n_correct: int  # equal to the correctly rounded truth
    ulps: np.ndarray = field(repr=False)  # |value - truth| in ulp, finite-truth elements
    sq: float = 0.0  # sum of squared normalised errors (finite ones)
    models: dict = field(default_factory=dict)  # label -> sum of squared normalised errors

    def summary(self) -> dict:
        return _ulp_summary(self.n, self.n_correct, self.ulps)


def _quantile(ulps, q):
    # no interpolation: an infinite ulp (a NaN output) must not make inf - inf
    return _json_float(np.quantile(ulps, q, method="higher")) if ulps.size else None


def _ulp_summary(n, n_correct, ulps) -> dict:
    finite = ulps[np.isfinite(ulps)]
    return {
        "elements": int(n),
        "correctly_rounded": _json_float(n_correct / n) if n else None,
        "ulp_median": _quantile(ulps, 0.5),
        "ulp_p99": _quantile(ulps, 0.99),
        "ulp_max": _json_float(ulps.max()) if ulps.size else None,
        "nonfinite": int(ulps.size - finite.size),
    }


def grade_of(value, truth, dtype, rounded=None) -> Grade:
    """The :class:`Grade` of ``value`` against the float64 ``truth`` (and the truth correctly
    rounded to ``dtype``, ``rounded``; when None, elements within half an ulp count).

    >>> g = grade_of(np.array([1.0, 1.5]), np.array([1.0, 1.5 + 2**-30]), "float32")
    >>> g.n_correct, g.summary()["ulp_max"] < 1
    (2, True)
    """
    value = np.asarray(value, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    finite = np.isfinite(truth)
    ulps = ulp_distance(value, truth, dtype)
    if rounded is not None and np.shape(rounded) == truth.shape:
        rounded = np.asarray(rounded, dtype=np.float64)
        correct = (value == rounded) | (np.isnan(value) & np.isnan(rounded))
    else:
        correct = ulps <= 0.5
    return Grade(int(finite.sum()), int((correct & finite).sum()), ulps[finite].astype(np.float32))


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
    grade: Grade | None = field(default=None, repr=False)

    @property
    def textbook_ratio(self) -> float | None:
        """The FlashAttention-style ratio: this check's largest normalised error over the
        same-dtype textbook's (the baseline of (T2)); None where there is no baseline."""
        base = self.threshold.baseline
        if base is None:
            return None
        if base <= 0:
            return 0.0 if self.max_error == 0 else math.inf
        return self.max_error / base

    def to_dict(self) -> dict:
        grade = {} if self.grade is None else {"grade": self.grade.summary()}
        fallback = self.threshold.n_fallback
        one_ulp = {"one_ulp_rule_elements": fallback} if fallback else {}
        return {
            **grade,
            **one_ulp,
            "textbook_ratio": _json_float(self.textbook_ratio),
            "quantity": self.quantity,
            "passed": self.passed,
            "max_error": _json_float(self.max_error),
            "n_failed": self.n_failed,
            "size": self.size,
            "threshold": _json_float(float(np.max(self.threshold.value))),
            "k": self.threshold.k,
            "baseline_error": _json_float(self.threshold.baseline),
            "floor": _json_float(float(np.max(self.threshold.floor))),
            "u_out": self.threshold.u_out,
            "tier": self.threshold.tier,
            "worst": _worst_dict(self.worst),
        }


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
    features: list[str] = field(default_factory=list)
    shape_classes: list[str] = field(default_factory=list)
    key_map: np.ndarray | None = field(default=None, repr=False)  # (L, S) |cos|, failing out

    @property
    def worst(self) -> Worst | None:
        """Worst element over the checks (the first failing check's, else the largest ratio)."""
        if not self.checks:
            return None
        return max(
            (c.worst for c in self.checks.values()), key=lambda w: _ratio(w.error, w.threshold)
        )

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
                shape = None if check.errors is None else check.errors.shape
                lines.append(
                    f"    {check.n_failed} of {check.size} elements over; threshold "
                    f"{check.worst.threshold:.3g} = "
                    f"{check.threshold.formula(check.worst.index, shape)}"
                )
                ratio = check.textbook_ratio
                if ratio is not None and math.isfinite(ratio):
                    lines.append(
                        f"    FlashAttention-style ratio: max error {ratio:.3g}x the "
                        f"{self.dtype} textbook's"
                    )
        for note in self.diagnosis:
            lines.append(f"  diagnosis: {note}")
        if self.category in STRICT_ONLY and self.failed:
            lines.append(f"  ({self.category} case: fails the run only with --strict)")
        if self.reproduce:
            lines.append(f"  reproduce: {self.reproduce}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        worst = self.worst
        return {
            "name": self.name,
            "category": self.category,
            "dtype": self.dtype,
            "verdict": self.verdict,
            "message": self.message,
            "diagnosis": self.diagnosis,
            "seconds": round(self.seconds, 4),
            "reproduce": self.reproduce,
            "description": self.description,
            "features": self.features,
            "shape_classes": self.shape_classes,
            "worst": None if worst is None else _worst_dict(worst),
            "checks": {name: c.to_dict() for name, c in self.checks.items()},
        }


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
        from oracle.conventions.layouts import NOT_EXPRESSIBLE

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
        from oracle.report.formats import summary_table

        return summary_table(self)

    def to_dict(self) -> dict:
        from oracle.report.formats import to_dict

        return to_dict(self)

    def to_json(self, path=None) -> str:
        from oracle.report.formats import to_json

        return to_json(self, path)

    def to_junit(self, path=None) -> str:
        from oracle.report.formats import to_junit

        return to_junit(self, path)

    def to_html(self, path, *, plots="failures") -> Path:
        from oracle.report.formats import to_html

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
    summary = _ulp_summary(n, sum(g.n_correct for g in grades), ulps.astype(np.float64))
    rms = math.sqrt(sum(g.sq for g in grades) / n) if n else 0.0
    labels = [m for m in grades[0].models if all(m in g.models for g in grades)] if grades else []
    models = {m: math.sqrt(sum(g.models[m] for g in grades) / n) for m in labels} if n else {}
    summary["rms_error"] = _json_float(rms)
    summary["models"] = {m: _json_float(x) for m, x in models.items()}
    summary["consistent_with"] = consistent_with(rms, models)
    textbook = [x for m, x in models.items() if "textbook" in m]
    summary["textbook_ratio"] = (
        _json_float(rms / textbook[0] if textbook[0] > 0 else (0.0 if rms == 0 else math.inf))
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


def _json_float(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else repr(x)


def _worst_dict(w: Worst) -> dict:
    return {
        "quantity": w.quantity,
        "index": list(w.index),
        "value": _json_float(w.value),
        "truth": _json_float(w.truth),
        "error": _json_float(w.error),
        "ulp": _json_float(w.ulp),
        "threshold": _json_float(w.threshold),
    }


def _ratio(error, limit):
    if error == 0:
        return 0.0
    return math.inf if limit <= 0 else error / limit
