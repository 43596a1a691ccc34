"""The results of a validation: one :class:`Check` per quantity, one :class:`CaseResult`
per case (a run's :class:`oracle.report.run_report.Report` collects them).

Examples
--------
>>> r = CaseResult("demo", "conformance", "float32", "fail", message="out: 1 of 4 over")
>>> r.failed, r.verdict
(True, 'fail')
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from oracle.catalogue.names import STRICT_ONLY
from oracle.judging.tolerance import Threshold, ulp_distance

__all__ = [
    "VERDICTS",
    "Worst",
    "Grade",
    "grade_of",
    "Check",
    "CaseResult",
    "json_float",
    "ulp_summary",
    "ulp_meaningful",
    "to_caller_layout",
]

VERDICTS = ("pass", "fail", "unsupported", "error", "warning")  # warning: invariance only


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
    # the reading of empty rows when the element's row has no allowed key (scale 0: its
    # normalised error is meaningless, oracle.diagnose.rows.mark_empty_row)
    empty_row: str | None = None

    def describe(self) -> str:
        index = ", ".join(map(str, to_caller_layout(self.index, self.quantity, self.layout)))
        where = "" if self.layout == "bhld" else f" ({self.layout} order)"
        if self.empty_row is not None:
            whose = "refattn's reading" if self.empty_row == "zero" else "the declared reading"
            return (
                f"{self.quantity}[{index}]{where}: row has no allowed key: expected "
                f"{self.truth!r} ({whose}, empty_rows={self.empty_row!r}), got {self.value!r}"
            )
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
        return ulp_summary(self.n, self.n_correct, self.ulps)


def _quantiles(ulps, qs) -> list:
    """``np.quantile(ulps, qs, method="higher")`` of a 1-d array, each as :func:`json_float`
    (None for an empty one): the same elements, found by one partition. (A report takes two
    quantiles of each check's ulps; ``np.quantile``'s own bookkeeping cost more than the
    partition of these small arrays, 0.1 ms a call.)

    >>> x = np.array([3.0, 1.0, np.inf, 2.0], dtype=np.float32)
    >>> _quantiles(x, (0.5, 0.99)) == [json_float(np.quantile(x, q, method="higher"))
    ...                                for q in (0.5, 0.99)]
    True
    """
    if not ulps.size:
        return [None for _ in qs]
    # no interpolation: an infinite ulp (a NaN output) must not make inf - inf; numpy's
    # index for "higher" is ceil((n - 1) q), and a NaN (sorted last) makes every quantile NaN
    indices = [math.ceil((ulps.size - 1) * q) for q in qs]
    if ulps.dtype == np.float32 and not np.signbit(ulps).any():
        # ulp distances (>= +0, NaN last): ordered as their bit patterns, whose integer
        # partition is a third faster than the float one (a report pools a million of them)
        ordered = np.partition(ulps.view(np.uint32), [*indices, -1]).view(np.float32)
    else:
        ordered = np.partition(ulps, [*indices, -1])
    if np.isnan(ordered[-1]):
        return [json_float(math.nan) for _ in qs]
    return [json_float(ordered[i]) for i in indices]


def ulp_summary(n, n_correct, ulps) -> dict:
    finite = int(np.count_nonzero(np.isfinite(ulps)))
    median, p99 = _quantiles(ulps, (0.5, 0.99))
    return {
        "elements": int(n),
        "correctly_rounded": json_float(n_correct / n) if n else None,
        "ulp_median": median,
        "ulp_p99": p99,
        "ulp_max": json_float(ulps.max()) if ulps.size else None,
        "nonfinite": int(ulps.size - finite),
    }


def grade_of(value, truth, dtype, rounded=None, ulps=None) -> Grade:
    """The :class:`Grade` of ``value`` against the float64 ``truth`` (and the truth correctly
    rounded to ``dtype``, ``rounded``; when None, elements within half an ulp count).
    ``ulps``: ``ulp_distance(value, truth, dtype)`` when the caller has it already.

    >>> g = grade_of(np.array([1.0, 1.5]), np.array([1.0, 1.5 + 2**-30]), "float32")
    >>> g.n_correct, g.summary()["ulp_max"] < 1
    (2, True)
    """
    value = np.asarray(value, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    finite = np.isfinite(truth)
    ulps = ulp_distance(value, truth, dtype) if ulps is None else ulps
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

    def figures(self) -> tuple:
        """(largest threshold, largest floor, grade summary or None, elements judged by the
        one-ulp rule) of the report, computed once: a check's arrays do not change once judged,
        and a run computes them while its worker judges the next case
        (:mod:`oracle.run.stored`)."""
        found = getattr(self, "_figures", None)
        if found is None:
            limit, floor, fallback = getattr(self, "_limits", None) or self._threshold_figures()
            summary = None if self.grade is None else self.grade.summary()
            found = self._figures = (limit, floor, summary, fallback)
        return found

    def _threshold_figures(self) -> tuple:
        """(largest threshold, largest floor, elements judged by the one-ulp rule)."""
        return (
            json_float(float(np.max(self.threshold.value))),
            json_float(float(np.max(self.threshold.floor))),
            self.threshold.n_fallback,
        )

    def lighten(self) -> None:
        """Drop what the report does not read of a passing check: its per-element normalised
        errors and the per-element floor and one-ulp limits of its threshold (a floor is kept
        as its largest value), the threshold's figures (:meth:`figures`) computed first. A
        failing check keeps everything (its explanation and plots read them); the grade is
        kept (a report pools the elements' ulp distances; its summary is computed where the
        report is made). A worker judging a run whose report plots no passing check lightens
        the results it sends back (the per-element arrays were most of their bytes)."""
        if not self.passed:
            return
        if getattr(self, "_limits", None) is None:
            self._limits = self._threshold_figures()
        self.errors = None
        if np.ndim(self.threshold.floor) or self.threshold.fallback is not None:
            largest = float(np.max(self.threshold.floor))
            self.threshold = dataclasses.replace(self.threshold, floor=largest, fallback=None)

    def to_dict(self) -> dict:
        limit, floor, summary, fallback = self.figures()
        grade = {} if summary is None else {"grade": dict(summary)}
        one_ulp = {"one_ulp_rule_elements": fallback} if fallback else {}
        return {
            **grade,
            **one_ulp,
            "textbook_ratio": json_float(self.textbook_ratio),
            "quantity": self.quantity,
            "passed": self.passed,
            "max_error": json_float(self.max_error),
            "n_failed": self.n_failed,
            "size": self.size,
            "threshold": limit,
            "k": self.threshold.k,
            "baseline_error": json_float(self.threshold.baseline),
            "floor": floor,
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
    #: the same call judged in the tight tier (``tolerance="both"``), else None
    tight: CaseResult | None = field(default=None, repr=False)

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


def json_float(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else repr(x)


def _worst_dict(w: Worst) -> dict:
    return {
        "quantity": w.quantity,
        "index": list(w.index),
        "value": json_float(w.value),
        "truth": json_float(w.truth),
        "error": json_float(w.error),
        "ulp": json_float(w.ulp),
        "threshold": json_float(w.threshold),
    }


def _ratio(error, limit):
    if error == 0:
        return 0.0
    return math.inf if limit <= 0 else error / limit
