"""Validate an attention implementation against the oracle's cases.

:func:`validate` runs an implementation on every case of a suite (fixtures built in memory by
:func:`oracle.golden.build`) or of a fixture directory (:func:`oracle.golden.load`) in one
dtype, judges each output element by the tolerance policy of :mod:`oracle.tolerance`
(normalised error (T1) against the threshold (T2)), diagnoses failures
(:mod:`oracle.diagnose`) and returns a :class:`Report`.

Calling convention
------------------
``impl(q, k, v, **options)`` with NumPy arrays of the case dtype (``ml_dtypes.bfloat16`` for
bfloat16) and :func:`refattn.attention`'s keyword names. The oracle first adds
``return_lse=True``; an implementation that rejects that keyword (TypeError naming it) or
raises NotImplementedError for it is called again without it and its lse is not checked. It
returns ``out`` or ``(out, lse)``. Gradients (``grads=True``, cases that carry them) come from
``impl.vjp(q, k, v, grad_out, [grad_lse=...,] **options) -> (dq, dk, dv[, dbias])``.
Variant cases (``Case.function`` other than "attention", suites "variants-smoke" and
"variants-default") call ``impl(**inputs, **options)`` with the refattn function's parameter
names and are judged by :func:`oracle.variant_cases.check_fixture`.

Verdicts
--------
``pass`` / ``fail`` (some element over its threshold, a wrong shape, NaN where the truth is
finite...) / ``unsupported`` (the implementation raised NotImplementedError: never a pass) /
``error`` (any other exception; the message is kept). Robustness cases (NaN/Inf poison at
excluded positions) are reported in their own category and make :attr:`Report.passed` false
only with ``strict=True``: refattn guarantees poison never reaches the output, but peers
legitimately compute ``0 * NaN`` there.

Examples
--------
>>> import numpy as np
>>> from oracle.validate import check_fixture
>>> from oracle.golden import Fixture
>>> from oracle.cases import Case, Shapes
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((1, 1, 3, 4)) for _ in range(3))
>>> from refattn.attention import attention
>>> truth = attention(q, k, v, precision="exact", return_lse=True)
>>> case = Case("demo", ("smoke",), "conformance", "float64", Shapes(1, 1, 1, 3, 3, 4, 4))
>>> fx = Fixture(case, {"q": q, "k": k, "v": v}, {}, {"out": truth[0], "lse": truth[1]})
>>> check_fixture(lambda q, k, v, **o: attention(q, k, v, **o), fx).verdict
'pass'
"""

from __future__ import annotations

import importlib
import math
import sys
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import diagnose as _diagnose
from . import tolerance as tol

__all__ = ["Worst", "Check", "CaseResult", "Report", "validate", "check_fixture",
           "judge_fixture", "OutputError", "case_features", "passed_options",
           "HEADLINE_FEATURES", "KNOWN_FEATURES",
           "resolve_impl", "VERDICTS", "ROBUSTNESS_NOTE"]

VERDICTS = ("pass", "fail", "unsupported", "error")

ROBUSTNESS_NOTE = (
    "Robustness cases put NaN/Inf into key, value or bias positions that no query may attend. "
    "refattn guarantees such poison never reaches the output; peers legitimately differ "
    "(0 * NaN = NaN in a dense weights @ v), so these cases fail a run only with --strict."
)

_GRADS = ("dq", "dk", "dv", "dbias")


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
    threshold: tol.Threshold
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
    features: list[str] = field(default_factory=list)
    shape_classes: list[str] = field(default_factory=list)

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
                shape = None if check.errors is None else check.errors.shape
                lines.append(f"    {check.n_failed} of {check.size} elements over; threshold "
                             f"{check.worst.threshold:.3g} = "
                             f"{check.threshold.formula(check.worst.index, shape)}")
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
                "description": self.description, "features": self.features,
                "shape_classes": self.shape_classes,
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
    isolated: bool = False  # cases ran in a supervised worker process
    required: tuple = ()  # features that must have been judged (--require)

    @property
    def passed(self) -> bool:
        """No conformance case failed or errored (robustness ones too with ``strict``) and
        every required feature was judged on at least one case."""
        return not self.failures and not self.missing_required

    def coverage(self) -> dict[str, dict[str, dict[str, int]]]:
        """{"feature" | "dtype" | "shape": {name: {"judged", "unsupported", "error"}}}:
        judged = cases that reached a pass/fail verdict."""
        table: dict[str, dict[str, dict[str, int]]] = {"feature": {}, "dtype": {},
                                                       "shape": {}}
        wanted = self._headline()
        for feature in (*wanted, *self.required):
            group = "shape" if feature in SHAPE_CLASSES else "feature"
            table[group].setdefault(feature, {"judged": 0, "unsupported": 0, "error": 0})
        for r in self.results:
            kind = "judged" if r.verdict in ("pass", "fail") else r.verdict
            for group, names in (("feature", r.features), ("dtype", [r.dtype]),
                                 ("shape", r.shape_classes)):
                for name in names:
                    row = table[group].setdefault(name, {"judged": 0, "unsupported": 0,
                                                         "error": 0})
                    row[kind] += 1
        return table

    @property
    def untested(self) -> list[str]:
        """Headline features (and required ones) no case judged: gradients only when asked."""
        coverage = self.coverage()
        rows = {**coverage["feature"], **coverage["shape"]}
        wanted = self._headline()
        return [f for f in dict.fromkeys((*wanted, *self.required))
                if rows.get(f, {}).get("judged", 0) == 0]

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

    def to_html(self, path, *, plots="failures") -> Path:
        from .report import to_html
        return to_html(self, path, plots=plots)

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


# ---------------------------------------------------------------------------------------------
# Resolving implementations
# ---------------------------------------------------------------------------------------------


def resolve_impl(impl):
    """A callable from a callable, ``"module:function"`` (dots allowed after the colon) or an
    adapter name (:func:`oracle.adapters.get`). Returns ``(callable, spec_string_or_None)``."""
    if callable(impl):
        return impl, _callable_spec(impl)
    if not isinstance(impl, str):
        raise TypeError(f"impl: expected a callable, 'module:function' or an adapter name, "
                        f"got {type(impl).__name__}")
    if ":" not in impl:
        from . import adapters
        return adapters.get(impl), None
    module_name, _, attr = impl.partition(":")
    if not module_name or not attr:
        raise ValueError(f"impl: {impl!r} is not of the form 'module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"impl: cannot import module {module_name!r} of {impl!r}: {err} "
                          f"(is it on sys.path / PYTHONPATH?)") from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"impl: module {module_name!r} has no attribute {attr!r} "
                                 f"(from {impl!r})") from None
    if not callable(obj):
        raise TypeError(f"impl: {impl!r} is a {type(obj).__name__}, not a callable")
    return obj, impl


def _callable_spec(impl):
    module = getattr(impl, "__module__", None)
    qualname = getattr(impl, "__qualname__", None)
    if module and qualname and "<" not in qualname and module != "__main__":
        return f"{module}:{qualname}"
    return None


def _impl_name(impl, spec):
    if spec:
        return spec
    return getattr(impl, "name", None) or getattr(impl, "__name__", None) or type(impl).__name__


# ---------------------------------------------------------------------------------------------
# Judging one fixture
# ---------------------------------------------------------------------------------------------


def _refattn_defaults() -> dict:
    import inspect

    from refattn.attention import attention

    parameters = inspect.signature(attention).parameters.items()
    return {name: p.default for name, p in parameters
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not p.empty}


def passed_options(options) -> dict:
    """The options an implementation receives: those equal to :func:`refattn.attention`'s
    defaults are left out (the implementation's own defaults then apply), so a function that
    follows the calling convention but lacks a keyword (``align``, ``gqa``, ``empty_rows``...)
    is still judged on every case that uses that keyword's default."""
    defaults = _refattn_defaults()
    return {name: np.copy(x) if isinstance(x, np.ndarray) else x
            for name, x in options.items()
            if isinstance(x, np.ndarray) or name not in defaults
            or type(x) is not type(defaults[name]) or x != defaults[name]}


def _call(impl, q, k, v, options):
    """Run the forward; returns (out, lse or None)."""
    copies = passed_options(options)
    try:
        result = impl(np.copy(q), np.copy(k), np.copy(v), **copies, return_lse=True)
    except (TypeError, NotImplementedError) as err:
        if "return_lse" not in str(err) and "lse" not in str(err):
            raise _unsupported_keyword(err, copies) from err
        try:
            result = impl(np.copy(q), np.copy(k), np.copy(v), **copies)
        except TypeError as again:
            raise _unsupported_keyword(again, copies) from again
    if isinstance(result, (tuple, list)):
        if not result:
            raise OutputError(f"out: expected an array, got an empty {type(result).__name__}")
        out = result[0]
        lse = result[1] if len(result) > 1 else None
    else:
        out, lse = result, None
    return _as_float64(out), None if lse is None else _as_float64(lse, "lse")


def _unsupported_keyword(err, options):
    """A TypeError refusing one of the case's keywords means the option is unsupported."""
    text = str(err)
    if isinstance(err, TypeError) and "keyword argument" in text:
        for name in options:
            if f"'{name}'" in text:
                return NotImplementedError(f"the implementation does not accept {name}= "
                                           f"({text})")
    return err


class OutputError(TypeError):
    """An implementation returned something that is not a real floating-point array."""


def _as_float64(x, quantity="out"):
    if hasattr(x, "detach"):  # a torch tensor handed back as is
        x = x.detach().float().cpu().numpy() if "bfloat16" in str(x.dtype) else x.detach().cpu()
    if not (isinstance(x, np.ndarray) or hasattr(x, "__array__")
            or hasattr(x, "__array_interface__")):
        raise OutputError(f"{quantity}: expected an array, got {type(x).__name__}")
    array = np.asarray(x)
    if array.dtype.kind != "f" and array.dtype.name not in _HALF_NAMES:
        raise OutputError(f"{quantity}: expected a real floating dtype, got {array.dtype} "
                          f"(complex, integer, bool and object outputs are errors)")
    return array.astype(np.float64)


_HALF_NAMES = ("bfloat16",)  # ml_dtypes' floating types are not of kind "f"


def _judge(quantity, value, truth, scale, threshold, dtype) -> Check:
    errors = tol.normalised_error(value, truth, scale, dtype)
    limit = np.broadcast_to(np.asarray(threshold.value, dtype=np.float64), errors.shape)
    over = errors > limit
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(errors == 0, 0.0, errors / limit)
    flat = int(np.argmax(ratio)) if ratio.size else 0
    index = np.unravel_index(flat, errors.shape) if errors.size else ()
    index = tuple(int(i) for i in index)
    worst = Worst(quantity, index,
                  float(value[index]) if value.size else math.nan,
                  float(truth[index]) if truth.size else math.nan,
                  float(errors[index]) if errors.size else 0.0,
                  float(tol.ulp_distance(value[index], truth[index], dtype))
                  if value.size else 0.0,
                  float(limit[index]) if limit.size else 0.0)
    passed = not over.any()
    # errors are kept for every check: the HTML report plots any case on request
    return Check(quantity, passed, float(errors.max()) if errors.size else 0.0,
                 int(over.sum()), int(errors.size), threshold, worst, errors)


def _shape_check(quantity, value, truth):
    if value.shape == truth.shape:
        return value, None
    if value.size == truth.size and quantity == "lse":
        return value.reshape(truth.shape), None
    raise OutputError(f"{quantity} has shape {value.shape}, expected {truth.shape}")


def _truth(fixture, name):
    truth = fixture.truth
    if f"{name}_f64" in truth:
        return np.asarray(truth[f"{name}_f64"], dtype=np.float64)
    if name in truth and truth[name] is not None:
        return np.asarray(truth[name]).astype(np.float64)
    return None


class _Context:
    """Float64 weights, magnitudes and floors of one fixture (shared by every check)."""

    def __init__(self, fixture):
        inputs, options = fixture.inputs, fixture.options
        self.q, self.k, self.v = inputs["q"], inputs["k"], inputs["v"]
        self.options = {n: x for n, x in options.items() if n != "return_lse"}
        self.dtype = fixture.case.dtype
        self.exact64 = tol.textbook_attention(self.q, self.k, self.v, dtype="float64",
                                              **self.options)
        weights = self.exact64.weights
        self.dropped = weights
        if self.options.get("dropout_mask") is not None:
            keep = np.asarray(self.options["dropout_mask"], dtype=bool)
            self.dropped = np.where(keep, weights, 0) / (1 - (self.options.get("dropout_p")
                                                              or 0.0))
        self.magnitude = tol.score_magnitude(self.q, self.k, **self.options)
        q3 = self.q if np.ndim(self.q) > 2 else np.asarray(self.q)[None]
        H, L, D = q3.shape[-3:]
        k3 = self.k if np.ndim(self.k) > 2 else np.asarray(self.k)[None]
        K, S = k3.shape[-3], k3.shape[-2]
        self.sizes = dict(D=D, S=S, L=L, E=np.shape(self.v)[-1], G=max(H // K, 1))
        self.single = np.ndim(self.q) == 2

    def floors(self, count):
        n_stored = 1 + (self.options.get("softcap") is not None) + (
            self.options.get("bias") is not None or self.options.get("alibi_slopes") is not None)
        allowed = np.broadcast_to(self.exact64.allowed, self.exact64.weights.shape) \
            if not self.single else np.broadcast_to(self.exact64.allowed,
                                                    self.magnitude.shape)
        floors = tol.forward_floors(
            self.dtype, **self.sizes, magnitude=self.magnitude, allowed=allowed,
            n_stored=int(n_stored), dropout=self.options.get("dropout_mask") is not None,
            count=count)
        if self.single:
            floors["out"], floors["lse"] = floors["out"][0], floors["lse"][0]
        return floors

    def _element_args(self, count):
        def heads(x):
            return x[None] if self.single else x

        n_stored = 1 + (self.options.get("softcap") is not None) + (
            self.options.get("bias") is not None or self.options.get("alibi_slopes") is not None)
        return dict(weights=heads(self.exact64.weights), magnitude=self.magnitude,
                    dots=tol.scaled_dots(self.q, self.k, **self.options),
                    D=self.sizes["D"], S=self.sizes["S"], n_stored=int(n_stored),
                    softcap=self.options.get("softcap") is not None, count=count), heads

    def output_floor(self, truth, count):
        """Element-wise floor (T6) of the output."""
        args, heads = self._element_args(count)
        floor = tol.output_floor(self.dtype, **args, dropped=heads(self.dropped), v=self.v,
                                 out=heads(truth), gqa=self.options.get("gqa"),
                                 dropout=self.options.get("dropout_mask") is not None)
        return floor[0] if self.single else floor

    def lse_floor(self, truth, count):
        """Element-wise floor (T6) of lse."""
        args, heads = self._element_args(count)
        floor = tol.lse_floor(self.dtype, **args, lse=heads(truth))
        return floor[0] if self.single else floor


def _check_forward(ctx, fixture, out, lse, checks):
    truth_out = _truth(fixture, "out")
    out, problem = _shape_check("out", out, truth_out)
    if problem:
        return problem
    base = tol.textbook_attention(ctx.q, ctx.k, ctx.v, dtype=ctx.dtype, **ctx.options)
    scale = tol.output_scale(ctx.dropped, ctx.v, gqa=ctx.options.get("gqa"))
    if ctx.single:
        scale = scale[0]
    base_err = _finite_part(tol.normalised_error(base.out, truth_out, scale, ctx.dtype),
                            truth_out)
    threshold = tol.threshold(base_err, ctx.output_floor(truth_out, truth_out.size),
                              ctx.dtype, k=tol.K_FORWARD)
    checks["out"] = _judge("out", out, truth_out, scale, threshold, ctx.dtype)
    truth_lse = _truth(fixture, "lse")
    if lse is not None and truth_lse is not None:
        lse, problem = _shape_check("lse", lse, truth_lse)
        if problem:
            return problem
        weights = ctx.exact64.weights
        magnitude = ctx.magnitude[0] if ctx.single else ctx.magnitude
        lscale = tol.lse_scale(truth_lse, weights, magnitude)
        base_err = _finite_part(tol.normalised_error(base.lse, truth_lse, lscale, ctx.dtype),
                                truth_lse)
        threshold = tol.threshold(base_err, ctx.lse_floor(truth_lse, truth_lse.size),
                                  ctx.dtype, k=tol.K_FORWARD)
        checks["lse"] = _judge("lse", lse, truth_lse, lscale, threshold, ctx.dtype)
    return None


def _finite_part(errors, truth):
    """Baseline errors where the truth is finite (a NaN truth says nothing about accuracy)."""
    return np.where(np.isfinite(truth), errors, 0.0)


def _check_grads(ctx, fixture, impl, checks):
    inputs = fixture.inputs
    grad_out, grad_lse = inputs.get("grad_out"), inputs.get("grad_lse")
    extra = {} if grad_lse is None else {"grad_lse": np.copy(grad_lse)}
    options = passed_options(ctx.options)
    result = impl.vjp(np.copy(ctx.q), np.copy(ctx.k), np.copy(ctx.v), np.copy(grad_out),
                      **extra, **options)
    result = tuple(result)
    scales = tol.grad_scales(ctx.q, ctx.k, ctx.v, grad_out, ctx.exact64.weights, ctx.dropped,
                             grad_lse=grad_lse, **ctx.options)
    base = tol.textbook_attention_vjp(ctx.q, ctx.k, ctx.v, grad_out, grad_lse=grad_lse,
                                      dtype=ctx.dtype, **ctx.options)
    floor = ctx.floors(sum(np.size(r) for r in result if r is not None))["grad"]
    for position, name in enumerate(_GRADS):
        truth = _truth(fixture, name)
        if truth is None or position >= len(result) or result[position] is None:
            continue
        value, problem = _shape_check(name, _as_float64(result[position], name), truth)
        if problem:
            return problem
        base_err = _finite_part(tol.normalised_error(base[position], truth, scales[name],
                                                     ctx.dtype), truth)
        threshold = tol.threshold(base_err, floor, ctx.dtype, k=tol.K_BACKWARD)
        checks[name] = _judge(name, value, truth, scales[name], threshold, ctx.dtype)
    return None


#: features whose absence from a run is reported prominently (and fails it with --require)
HEADLINE_FEATURES = ("causal", "mask", "gqa", "long-rows", "gradients")
#: S from which a case counts as "long rows"
LONG_ROWS = 512


def case_features(case, grads=False, inputs=()) -> tuple[list[str], list[str]]:
    """(features, shape classes) a case exercises, for the coverage table; ``inputs`` are the
    names of its arrays (a fixture's ``inputs``: mask, bias, alibi_slopes...).

    Features: causal, align-bottom-right, window, mask, bias, gqa, softcap, dropout, alibi,
    scale, empty-rows-nan, poison (robustness), gradients (only when ``grads`` is asked).
    Shape classes: single-query (L = 1), L<S, L=S, L>S, long-rows (S >= 512), batched (B > 1).
    Variant cases give their function name as the only feature.
    """
    n, options = case.shapes, case.options
    if case.function != "attention":
        return [case.function], []
    features = []
    if options.get("causal"):
        features.append("causal")
    if options.get("align") == "bottom_right" and (options.get("causal")
                                                   or options.get("window")):
        features.append("align-bottom-right")
    for name, feature in (("window", "window"), ("softcap", "softcap"),
                          ("dropout_p", "dropout"), ("scale", "scale")):
        if options.get(name):
            features.append(feature)
    for name, feature in (("mask", "mask"), ("bias", "bias"), ("alibi_slopes", "alibi")):
        if name in inputs:
            features.append(feature)
    if n.H != n.K:
        features.append("gqa")
    if options.get("empty_rows") == "nan":
        features.append("empty-rows-nan")
    if case.category == "robustness":
        features.append("poison")
    if grads and case.grads:
        features.append("gradients")
    shapes = ["single-query" if n.L == 1 else
              ("L<S" if n.L < n.S else "L=S" if n.L == n.S else "L>S")]
    if n.S >= LONG_ROWS:
        shapes.append("long-rows")
    if n.batch > 1:
        shapes.append("batched")
    return features, shapes


def judge_fixture(impl, fixture, *, grads=False, diagnose=True, reproduce="") -> CaseResult:
    """Judge one fixture of any family: attention cases by :func:`check_fixture`, variant cases
    (``Case.function`` other than "attention") by :func:`oracle.variant_cases.check_fixture`.
    """
    if fixture.case.function != "attention":
        from .variant_cases import check_fixture as check_variant
        return check_variant(impl, fixture, reproduce=reproduce)
    return check_fixture(impl, fixture, grads=grads, diagnose=diagnose, reproduce=reproduce)


def check_fixture(impl, fixture, *, grads=False, diagnose=True, reproduce="") -> CaseResult:
    """Run ``impl`` on one fixture and judge it (see the module docstring for verdicts)."""
    case = fixture.case
    result = CaseResult(case.name, case.category, case.dtype, "pass", reproduce=reproduce,
                        description=getattr(case, "description", ""))
    return run_guarded(result, lambda: _run_checks(impl, fixture, grads, diagnose, result))


def run_guarded(result, check) -> CaseResult:
    """Run ``check()`` filling ``result``; NotImplementedError makes the verdict "unsupported"
    (never "pass"), any other exception "error"; times the run."""
    start = time.perf_counter()
    try:
        check()
    except NotImplementedError as err:
        result.verdict, result.message = "unsupported", str(err) or "NotImplementedError"
        result.checks = {}
    except Exception as err:  # noqa: BLE001 - any other exception is the verdict "error"
        result.verdict, result.message = "error", f"{type(err).__name__}: {err}"
        result.checks = {}
    except SystemExit as err:  # exit() in an implementation must not end (and pass) the run
        result.verdict = "error"
        result.message = f"the implementation called exit({err.code!r})"
        result.checks = {}
    result.seconds = time.perf_counter() - start
    if result.verdict == "pass":
        result.reproduce = ""
    return result


def _run_checks(impl, fixture, grads, diagnose, result):
    inputs = fixture.inputs
    options = {n: x for n, x in fixture.options.items() if n != "return_lse"}
    out, lse = _call(impl, inputs["q"], inputs["k"], inputs["v"], options)
    ctx = _Context(fixture)
    with np.errstate(all="ignore"):
        problem = _check_forward(ctx, fixture, out, lse, result.checks)
        notes = []
        if problem is None and grads and _truth(fixture, "dq") is not None:
            if hasattr(impl, "vjp"):
                problem = _check_grads(ctx, fixture, impl, result.checks)
            else:
                notes.append("gradients asked for but not checked: the implementation has "
                             "no .vjp")
    failing = [c for c in result.checks.values() if not c.passed]
    if problem or failing:
        result.verdict = "fail"
        result.message = problem or "; ".join(
            f"{c.quantity}: {c.n_failed} of {c.size} elements over the threshold"
            for c in failing)
        if diagnose:
            result.diagnosis = _diagnosis(ctx, fixture, out, result.checks)
    elif notes:
        result.verdict = "unsupported"  # gradients were asked for: never a pass
    result.message = "; ".join(x for x in [result.message, *notes] if x)


def _diagnosis(ctx, fixture, out, checks) -> list[str]:
    """Named alternatives that explain a failing output; else a narrower working precision
    that explains every failing quantity; else plain observations."""
    check = checks.get("out")
    truth = _truth(fixture, "out")
    failing = [c for c in checks.values() if not c.passed]
    if not failing:
        return []
    out_failed = check is not None and not check.passed and out.shape == truth.shape
    if out_failed:
        found = _diagnose.diagnose(ctx.q, ctx.k, ctx.v, ctx.options, out,
                                   limit=np.asarray(check.threshold.value), dtype=ctx.dtype)
        if found:
            return found
    precisions = {_lower_precision(ctx, c) for c in failing}
    if out_failed:
        for dtype in _NARROWER.get(ctx.dtype, ()):
            # a convention mismatch seen through a narrower working precision
            limit = _narrower_limit(ctx, "out", dtype, check.size)
            found = _diagnose.diagnose(ctx.q, ctx.k, ctx.v, ctx.options, out, limit=limit,
                                       dtype=ctx.dtype)
            if found:
                return [f"{label} (at {dtype} accuracy: the implementation seems to compute "
                        f"in {dtype})" for label in found]
    if len(precisions) == 1 and None not in precisions:
        dtype = precisions.pop()
        worst = max(c.max_error for c in failing)
        return [f"errors fit {dtype} accuracy (max normalised error {worst:.3g}): the "
                f"implementation seems to compute in {dtype}"]
    if out_failed and tol.accumulation_dtype(ctx.dtype) != np.dtype(ctx.dtype) \
            and np.isfinite(check.errors).all():
        found = _storage_accumulation(ctx, out, truth, check)
        if found:
            return [found]
    if not out_failed:
        return []
    poisoned = any(not np.isfinite(np.asarray(x, dtype=np.float64)).all()
                   for x in {**fixture.inputs, **ctx.options}.values()
                   if isinstance(x, np.ndarray) and x.dtype.kind == "f")
    errors = check.errors if check.errors is not None else np.zeros(out.shape)
    limit = np.broadcast_to(np.asarray(check.threshold.value), out.shape)
    return _diagnose.describe_failure(out, truth, errors, limit, inputs_poisoned=poisoned)


def _storage_accumulation(ctx, out, truth, check) -> str | None:
    """Half types: does the output match a textbook that sums in the storage dtype?"""
    scale = tol.output_scale(ctx.dropped, ctx.v, gqa=ctx.options.get("gqa"))
    scale = scale[0] if ctx.single else scale
    fits = []
    for sums, what in ((("normaliser",), "the softmax normaliser"),
                       (("values",), "weights @ v"),
                       (("normaliser", "values"), "the softmax normaliser and weights @ v")):
        model = _diagnose.storage_accumulation_attention(ctx.q, ctx.k, ctx.v, ctx.options,
                                                         ctx.dtype, sums=sums)
        model_error = float(np.max(tol.normalised_error(model, truth, scale, ctx.dtype)))
        if check.max_error <= tol.K_FORWARD * model_error + tol.unit_roundoff(ctx.dtype):
            distance = float(np.max(tol.normalised_error(out, model, scale, ctx.dtype)))
            fits.append((distance, what, model_error))
    if not fits:
        return None
    _, what, model_error = min(fits)  # the model closest to the output names the sum
    return (f"errors consistent with accumulating {what} in {ctx.dtype} (no float32 "
            f"accumulator; such a textbook has normalised error {model_error:.3g} here)")


_NARROWER = {"float64": ("float32",), "float32": ("bfloat16", "float16")}


def _narrower_limit(ctx, key, dtype, count) -> float:
    """k F + u of ``dtype`` for quantity ``key`` ("out", "lse" or "grad") of this case."""
    k = tol.K_BACKWARD if key == "grad" else tol.K_FORWARD
    floors = tol.forward_floors(dtype, **ctx.sizes, magnitude=ctx.magnitude,
                                allowed=np.broadcast_to(ctx.exact64.allowed,
                                                        ctx.magnitude.shape),
                                count=count)
    return k * float(np.max(floors[key])) + tol.unit_roundoff(dtype)


def _lower_precision(ctx, check) -> str | None:
    """The narrower dtype whose own floor (T5) covers every error of ``check``, if any."""
    if check.errors is None or not np.isfinite(check.errors).all():
        return None
    key = check.quantity if check.quantity in ("out", "lse") else "grad"
    for dtype in _NARROWER.get(ctx.dtype, ()):
        if check.max_error <= _narrower_limit(ctx, key, dtype, check.size):
            return dtype
    return None


# ---------------------------------------------------------------------------------------------
# Running a suite
# ---------------------------------------------------------------------------------------------


def _select(items, dtype, cases):
    import fnmatch

    patterns = [p.lower() for p in cases]
    for item in items:
        case = item.case if hasattr(item, "case") else item
        if dtype is not None and case.dtype != dtype:
            continue
        if patterns and not any(fnmatch.fnmatchcase(case.name.lower(), p) for p in patterns):
            continue
        yield item


def _patterns(cases) -> list[str]:
    if cases is None:
        return []
    if isinstance(cases, str):
        return [cases]
    patterns = list(cases)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"cases: expected a pattern or a list of patterns (str), got {bad!r}")
    return patterns


def _sources(suite, fixtures, dtype, cases):
    """(description, list of Fixture-or-Case); Cases are built lazily."""
    from . import cases as cases_mod
    from . import golden

    if fixtures is not None and suite is not None:
        raise ValueError("validate: give suite= or fixtures=, not both")
    if fixtures is not None:
        if isinstance(fixtures, (str, Path)):
            items = list(_select(golden.load(fixtures), dtype, cases))
            return f"fixtures {fixtures}", items, str(fixtures)
        return "fixtures", list(_select(fixtures, dtype, cases)), None
    suite = "smoke" if suite is None else suite
    if isinstance(suite, str):
        return f"suite {suite}", list(_select(cases_mod.suite(suite), dtype, cases)), suite
    return "cases", list(_select(suite, dtype, cases)), None


def _reproduce_cmd(impl_spec, source_flag, dtype, name, grads, strict):
    impl_part = "--impl <module:function>" if impl_spec is None else (
        f"--impl {impl_spec}" if ":" in impl_spec else f"--adapter {impl_spec}")
    extra = (" --grads" if grads else "") + (" --strict" if strict else "")
    return (f"refattn-oracle validate {impl_part} {source_flag} --dtype {dtype} "
            f"--case {name}{extra}")


def validate(impl, *, suite=None, fixtures=None, dtype="float32", grads=False, strict=False,
             progress=True, cases: str | Iterable[str] | None = None, diagnose=True,
             isolate=True, timeout=None, memory_limit=None, require=()) -> Report:
    """Validate ``impl`` on a suite or a fixture directory in one dtype.

    Parameters
    ----------
    impl : callable or str
        ``impl(q, k, v, **options)``, ``"module:function"`` or an adapter name.
    suite : str or iterable of Case, optional
        Suite name (fixtures built in memory with :func:`oracle.golden.build`); default
        "smoke" when neither suite nor fixtures is given.
    fixtures : path or iterable of Fixture, optional
        A directory written by ``refattn-oracle generate`` (read with
        :func:`oracle.golden.load`), or fixtures in memory.
    dtype : {"float64", "float32", "float16", "bfloat16"} or None
        Only cases of this dtype (None: every dtype).
    grads : bool
        Also check ``impl.vjp`` on the cases that carry gradients (a case whose gradients
        cannot be checked because there is no ``vjp`` is "unsupported", never a pass).
    strict : bool
        Robustness failures fail the run too.
    progress : bool
        A progress bar on stderr.
    cases : str or iterable of str, optional
        Only the cases whose names match one of these fnmatch patterns (case-insensitive).
    isolate : bool
        Run the cases in a supervised worker process (:class:`oracle.supervise.Supervisor`):
        an implementation that exits, hangs, crashes or exhausts memory gives that case the
        verdict "error" and the run goes on. Needs an importable implementation (a
        ``module:function`` string, an adapter name or a module-level function); other
        callables (lambdas, closures) run in this process and :attr:`Report.isolated` is
        false.
    timeout : float, optional
        Seconds one isolated case may take (default
        :data:`oracle.supervise.DEFAULT_TIMEOUT`, 300 s: a JIT-compiled implementation
        compiles on its first call).
    memory_limit : int, optional
        Bytes of address space the worker may use (no limit by default).
    require : str or iterable of str
        Features (see :func:`case_features`; e.g. "causal", "mask", "gqa", "long-rows",
        "gradients") that must be judged (pass or fail) on at least one case, else the run
        fails. Untested headline features are reported in any case.

    Options equal to :func:`refattn.attention`'s defaults are not passed to the
    implementation (:func:`passed_options`): its own defaults then apply.

    Returns
    -------
    Report
        ``.passed`` and ``.results`` (one :class:`CaseResult` per case).

    Raises
    ------
    ValueError
        No case selected (an empty suite, directory or pattern match): a run that checks
        nothing never passes.
    """
    from . import golden
    from ._progress import Progress
    from .supervise import DEFAULT_TIMEOUT, Supervisor

    required = _required(require)

    if dtype is not None:
        tol.unit_roundoff(dtype)  # a clear error for an unknown dtype
    fn, spec = resolve_impl(impl)
    if spec is None and isinstance(impl, str):
        spec = impl
    patterns = _patterns(cases)
    label, items, source_arg = _sources(suite, fixtures, dtype, patterns)
    if not items:
        wanted = f", cases matching {patterns}" if patterns else ""
        raise ValueError(f"validate: no case selected ({label}, dtype {dtype or 'all'}"
                         f"{wanted}); a run that checks nothing cannot pass "
                         f"(see `refattn-oracle list cases`)")
    if source_arg is None:
        source_flag = "<the same fixtures>"
    elif fixtures is not None:
        source_flag = f"--fixtures {source_arg}"
    else:
        source_flag = f"--suite {source_arg}"
    worker_ref = _worker_ref(impl, fn, spec) if isolate else None
    supervisor = None if worker_ref is None else Supervisor(
        worker_ref, timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        memory_limit=memory_limit)
    results = []
    start = time.perf_counter()
    try:
        with Progress(len(items), f"validate {_impl_name(fn, spec)}", enabled=progress,
                      stream=sys.stderr) as bar:
            for item in items:
                fixture = golden.build(item) if not hasattr(item, "truth") else item
                repro = _reproduce_cmd(spec, source_flag, fixture.case.dtype,
                                       fixture.case.name, grads, strict)
                if supervisor is None:
                    result = judge_fixture(fn, fixture, grads=grads, diagnose=diagnose,
                                           reproduce=repro)
                else:
                    result = supervisor.run(fixture, grads=grads, diagnose=diagnose,
                                            reproduce=repro)
                result.features, result.shape_classes = case_features(
                    fixture.case, grads, fixture.inputs)
                results.append(result)
                bar.advance(f"{result.name}: {result.verdict}")
    finally:
        if supervisor is not None:
            supervisor.close()
    report = Report(_impl_name(fn, spec), dtype, label, strict, results,
                    time.perf_counter() - start, grads)
    report.isolated = supervisor is not None
    report.required = required
    return report


SHAPE_CLASSES = ("single-query", "L<S", "L=S", "L>S", "long-rows", "batched")
KNOWN_FEATURES = ("causal", "align-bottom-right", "window", "mask", "bias", "gqa", "softcap",
                  "dropout", "alibi", "scale", "empty-rows-nan", "poison", "gradients",
                  "single-query", "L<S", "L=S", "L>S", "long-rows", "batched")


def _required(require) -> tuple:
    names = [require] if isinstance(require, str) else list(require or ())
    flat = [part.strip().lower() for name in names for part in str(name).split(",")
            if part.strip()]
    unknown = [f for f in flat if f not in KNOWN_FEATURES]
    if unknown:
        raise ValueError(f"require: unknown feature(s) {unknown}; expected some of "
                         f"{list(KNOWN_FEATURES)}")
    return tuple(dict.fromkeys(flat))


def _worker_ref(impl, fn, spec):
    """What a worker process can resolve the implementation from, or None."""
    if isinstance(impl, str):
        return impl
    if spec is not None and ":" in spec and not spec.startswith("__main__:"):
        try:
            resolved, _ = resolve_impl(spec)
        except (ImportError, AttributeError, TypeError, ValueError):
            return None
        return spec if resolved is fn else None
    return None


class _CallableModule(types.ModuleType):
    """``oracle.validate`` is both this module and the function: importing the submodule
    (``from oracle.validate import Report``) rebinds the package attribute to the module, so
    the module forwards calls to :func:`validate`."""

    def __call__(self, impl, **kwargs) -> Report:
        return validate(impl, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
