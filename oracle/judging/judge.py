"""The one judge of the oracle: run an implementation on a fixture, judge every output.

Attention fixtures and variant fixtures go through :func:`check_fixture`; each output
element's normalised error (T1 of :mod:`oracle.judging.tolerance`) is compared with its threshold
(T2), computed from the textbook baseline (:mod:`oracle.reading.baseline`) and the a-priori floor,
and
every quantity becomes one :class:`~oracle.judging.results.Check` of a
:class:`~oracle.judging.results.CaseResult`. Failing attention outputs are diagnosed
(:mod:`oracle.diagnose.diagnosis`).

Calling conventions
-------------------
Attention: ``impl(q, k, v, **options)`` with NumPy arrays of the case dtype
(``ml_dtypes.bfloat16`` for bfloat16) and :func:`refattn.attention`'s keyword names. The
oracle first adds ``return_lse=True``; an implementation that rejects that keyword (TypeError
naming it) or raises NotImplementedError for it is called again without it and its lse is not
checked. A TypeError naming ``return_lse`` (the signature has no such keyword) is remembered:
for the rest of the process that implementation is called once per case, without it. A
NotImplementedError may depend on the case (lse refused with some option only), so it costs
the second call on every case that raises it (the signature presets of
:mod:`oracle.conventions.signatures` raise it before the implementation runs). It returns
``out`` or ``(out, lse)``. Gradients (``grads=True``, cases that carry them) come from
``impl.vjp(q, k, v, grad_out, [grad_lse=...,] **options) -> (dq, dk, dv[, dbias[,
dsinks]])`` (dsinks (H,) for cases with sinks). float8 inputs (fp8 cases) are passed
as stored, with their ``q_descale``/``k_descale``/``v_descale``; the output is judged in the
case dtype (bfloat16). Variants: ``impl(**inputs, **options)`` with the refattn function's
parameter names (see :mod:`oracle.catalogue.variants`); their gradients (``grads=True`` on a
case that carries them) come from ``impl.vjp(**inputs, grad_out=..., **options)`` -- or, for a
plain function ``f``, the ``f_vjp`` of its module -- returning the ``d<name>`` of each
positional array argument (a NamedTuple, a tuple in that order or a mapping).

Verdicts
--------
``pass`` / ``fail`` (some element over its threshold, a wrong shape, NaN where the truth is
finite...) / ``unsupported`` (the implementation raised NotImplementedError: never a pass) /
``error`` (any other exception; the message is kept).

Examples
--------
>>> import numpy as np
>>> from oracle.fixtures.golden import Fixture
>>> from oracle.catalogue import Case, Shapes
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

import copy
import math
import time
import weakref

import numpy as np

from oracle.catalogue.variants import FUNCTIONS, forward_inputs, grad_names, outputs_of
from oracle.diagnose import budget
from oracle.diagnose import diagnosis as _diagnose
from oracle.diagnose.budget import case_budget
from oracle.diagnose.fp4 import diagnose_fp4
from oracle.diagnose.key_map import key_map
from oracle.diagnose.merge import diagnose_merge
from oracle.diagnose.models import ORDER_ONE, narrow_accumulation_work
from oracle.diagnose.rows import mark_empty_row, within_one_ulp
from oracle.diagnose.tiles import key_concentration, storage_dtype
from oracle.judging import parts
from oracle.judging import tolerance as tol
from oracle.judging.empty_rows import read_case
from oracle.judging.linear import check_linear, is_linear
from oracle.judging.must_refuse import check_refusal, is_refusal
from oracle.judging.passing import passed_options, vjp_of
from oracle.judging.quiet import implementation_call
from oracle.judging.refused import refusing
from oracle.judging.results import CaseResult, Check, Worst, grade_of
from oracle.judging.variant_scales import condition, grad_floor_terms, grad_scale, natural_scale
from oracle.reading.baseline import (
    storage_accumulation_attention,
    variant_baseline,
    variant_vjp_baseline,
)
from oracle.reading.case import read_case as view_of

__all__ = ["check_fixture", "run_guarded", "call_forward", "passed_options"]


def call_forward(impl, q, k, v, options):
    """Run ``impl``'s forward as the judge does (``return_lse=True`` first, then without it;
    options equal to refattn's defaults left out); returns float64 (out, lse or None).

    A TypeError refusing one of the options is a NotImplementedError ("unsupported"), and so
    is an exception that reads as the implementation's refusal of the case
    (:func:`oracle.judging.refused.as_refusal`)."""
    with refusing(), implementation_call():
        return _call_forward(impl, q, k, v, options)


#: implementations whose signature refuses ``return_lse`` (a TypeError naming it): for the
#: rest of the process they are called once per case, without it
_NO_LSE_KEYWORD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _refuses_lse_keyword(impl) -> bool:
    try:
        return impl in _NO_LSE_KEYWORD
    except TypeError:  # not weakly referenceable: asked again each case
        return False


def _remember_no_lse_keyword(impl, err) -> None:
    if isinstance(err, TypeError) and "'return_lse'" in str(err):
        try:
            _NO_LSE_KEYWORD[impl] = True
        except TypeError:
            pass


def _call_forward(impl, q, k, v, options):
    copies = passed_options(options, impl)
    # a sigmoid case has no log-sum-exp to ask for (normalizer="sigmoid" refuses return_lse);
    # an implementation that took no return_lse keyword is not offered it again
    no_lse = options.get("normalizer") == "sigmoid" or _refuses_lse_keyword(impl)
    ask_lse = {} if no_lse else {"return_lse": True}
    try:
        result = impl(np.copy(q), np.copy(k), np.copy(v), **copies, **ask_lse)
    except (TypeError, NotImplementedError) as err:
        if "return_lse" not in str(err) and "lse" not in str(err):
            raise _unsupported_keyword(err, copies) from err
        if not ask_lse:  # the lse was not asked for: the refusal is of something else
            raise _unsupported_keyword(err, copies) from err
        _remember_no_lse_keyword(impl, err)
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
                return NotImplementedError(f"the implementation does not accept {name}= ({text})")
    return err


class OutputError(TypeError):
    """An implementation returned something that is not a real floating-point array."""


def _as_float64(x, quantity="out"):
    if hasattr(x, "detach"):  # a torch tensor handed back as is
        x = x.detach().float().cpu().numpy() if "bfloat16" in str(x.dtype) else x.detach().cpu()
    if not (
        isinstance(x, np.ndarray) or hasattr(x, "__array__") or hasattr(x, "__array_interface__")
    ):
        raise OutputError(f"{quantity}: expected an array, got {type(x).__name__}")
    array = np.asarray(x)
    if array.dtype.kind != "f" and array.dtype.name not in _HALF_NAMES:
        raise OutputError(
            f"{quantity}: expected a real floating dtype, got {array.dtype} "
            f"(complex, integer, bool and object outputs are errors)"
        )
    return array.astype(np.float64)


_HALF_NAMES = ("bfloat16",)  # ml_dtypes' floating types are not of kind "f"


def _truth_rounded(fixture, name):
    """The truth correctly rounded to the case dtype (float64 array), if the fixture has it."""
    value = fixture.truth.get(name)
    return None if value is None else np.asarray(value).astype(np.float64)


def _judge(quantity, value, truth, scale, threshold, dtype, rounded=None, own=None) -> Check:
    threshold = tol.with_ulp_rule(threshold, truth, scale, dtype)  # no element unjudged (T8)
    errors = tol.normalised_error(value, truth, scale, dtype)
    limit = np.broadcast_to(np.asarray(threshold.value, dtype=np.float64), errors.shape)
    ulps = tol.ulp_distance(value, truth, dtype)  # the worst element's and the grade's
    over = errors > limit
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(errors == 0, 0.0, errors / limit)
    flat = int(np.argmax(ratio)) if ratio.size else 0
    index = np.unravel_index(flat, errors.shape) if errors.size else ()
    index = tuple(int(i) for i in index)
    worst = Worst(
        quantity,
        index,
        float(value[index]) if value.size else math.nan,
        float(truth[index]) if truth.size else math.nan,
        float(errors[index]) if errors.size else 0.0,
        float(ulps[index]) if value.size else 0.0,
        float(limit[index]) if limit.size else 0.0,
    )
    passed = not over.any()
    # graded in the quantity's own storage type (a float32 lse of bfloat16 inputs)
    mine = own in (None, dtype)
    grade = grade_of(value, truth, own or dtype, rounded if mine else None, ulps if mine else None)
    grade.sq = float(np.sum(np.where(np.isfinite(errors), errors, 0.0) ** 2))
    # errors are kept for every check: the HTML report plots any case on request
    return Check(
        quantity,
        passed,
        float(errors.max()) if errors.size else 0.0,
        int(over.sum()),
        int(errors.size),
        threshold,
        worst,
        errors,
        grade=grade,
    )


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


def _check_forward(view, fixture, tier, out, lse, checks, grade=True):
    """Judge out (and lse) in ``tier`` with the fixture's judging parts
    (:func:`oracle.judging.parts.forward_part`, computed once per fixture and tier)."""
    truth_out = _truth(fixture, "out")
    out, problem = _shape_check("out", out, truth_out)
    if problem:
        return problem
    truth_lse = _truth(fixture, "lse")
    rounded = _truth_rounded(fixture, "out")
    valid = parts.forward_valid(truth_out, truth_lse)
    if grade:  # the grading models kept with the tier's part (one file a case on disk)
        part = _part(
            fixture,
            view,
            parts.with_models(tier),
            lambda: parts.forward_models_part(view, truth_out, truth_lse, tier, rounded),
            lambda found: valid(found) and isinstance(found.get("models"), dict),
        )
    else:
        part = _part(
            fixture, view, tier, lambda: parts.forward_part(view, truth_out, truth_lse, tier), valid
        )
    scale = part["out/scale"]
    threshold = parts.forward_threshold(tier, view.dtype, part["out/base"], part["out/floor"])
    checks["out"] = _judge("out", out, truth_out, scale, threshold, view.dtype, rounded=rounded)
    reading = view.options.get("empty_rows") or "zero"
    mark_empty_row(checks["out"], part["empty"], view.options, reading)
    if grade:
        checks["out"].grade.models = dict(part["models"])
    if lse is not None and truth_lse is not None:
        lse, problem = _shape_check("lse", lse, truth_lse)
        if problem:
            return problem
        threshold = parts.forward_threshold(tier, view.dtype, part["lse/base"], part["lse/floor"])
        checks["lse"] = _judge(
            "lse",
            lse,
            truth_lse,
            part["lse/scale"],
            threshold,
            view.dtype,
            rounded=_truth_rounded(fixture, "lse"),
            own=storage_dtype(lse, view.dtype),
        )
        mark_empty_row(checks["lse"], part["empty"], view.options, reading)
    return None


#: seconds of judging work served from the cache in this thread's current case: the
#: diagnosis budget (oracle.diagnose.budget) is a multiple of the judging time as if computed
_SAVED = [0.0]


def _part(fixture, view, name, compute, valid) -> dict:
    """:func:`oracle.judging.parts.judging_part`, crediting a cached part's cost to the case."""
    start = time.perf_counter()
    found = parts.judging_part(fixture, view.key, name, compute, valid)
    took = time.perf_counter() - start
    _SAVED[0] += max(float(found.get("seconds", 0.0)) - took, 0.0)
    return found


def _call_vjp(impl, fixture):
    inputs = fixture.inputs
    grad_lse = inputs.get("grad_lse")
    extra = {} if grad_lse is None else {"grad_lse": np.copy(grad_lse)}
    options = passed_options(
        {n: x for n, x in fixture.options.items() if n != "return_lse"}, impl.vjp
    )
    with implementation_call():
        result = impl.vjp(
            np.copy(inputs["q"]),
            np.copy(inputs["k"]),
            np.copy(inputs["v"]),
            np.copy(inputs["grad_out"]),
            **extra,
            **options,
        )
    return tuple(result)


def _grads_valid(truths):
    def valid(found) -> bool:
        for name, truth in truths.items():
            np.broadcast_shapes(found[f"{name}/scale"].shape, truth.shape)
            if found[f"{name}/base"].shape != truth.shape:
                return False
        return found["floor"].shape == () and found["count"].shape == ()

    return valid


def _check_grads(view, fixture, result, checks):
    """Judge the gradients ``result`` of the implementation's vjp with the fixture's
    gradient parts (:func:`oracle.judging.parts.grads_part`)."""
    inputs = fixture.inputs
    count = sum(np.size(r) for r in result if r is not None)
    truths = {n: t for n in parts.GRADS if (t := _truth(fixture, n)) is not None}
    part = _part(
        fixture,
        view,
        "grads",
        lambda: parts.grads_part(view, inputs["grad_out"], inputs.get("grad_lse"), truths, count),
        _grads_valid(truths),
    )
    floor = part["floor"] if int(part["count"]) == count else parts.floors(view, count)["grad"]
    if "dsinks" in truths and (len(result) < 5 or result[4] is None):
        raise NotImplementedError(
            "dsinks: the implementation's vjp returns no gradient of the sinks (a fifth value)"
        )
    if "dqv" in truths and (len(result) < 6 or result[5] is None):
        raise NotImplementedError("qv: the implementation's vjp returns no dqv (a sixth value)")
    for position, name in enumerate(parts.GRADS):
        truth = truths.get(name)
        if truth is None or position >= len(result) or result[position] is None:
            continue
        value, problem = _shape_check(name, _as_float64(result[position], name), truth)
        if problem:
            return problem
        threshold = tol.threshold(part[f"{name}/base"], floor, view.dtype, k=tol.K_BACKWARD)
        checks[name] = _judge(name, value, truth, part[f"{name}/scale"], threshold, view.dtype)
    return None


def check_fixture(
    impl, fixture, *, grads=False, diagnose=True, reproduce="", tolerance="default", grade=True
) -> CaseResult:
    """Run ``impl`` on one fixture and judge it (see the module docstring for verdicts).

    ``tolerance``: "default" (T2), "tight" (T7 for out and lse; gradients and variants
    keep T2), see :mod:`oracle.judging.tolerance`, or "both": one call of ``impl`` judged in
    both tiers, the default tier's result returned with the tight tier's as its ``tight``
    attribute. ``grade``: attach the accuracy grade's error models to out's check.

    Attention fixtures call ``impl(q, k, v, **options)`` (and ``impl.vjp`` with ``grads``);
    variant fixtures (``Case.function`` other than "attention") call
    ``impl(**inputs, **options)`` (inputs without grad_out) and, with ``grads`` on a case
    that carries gradients, ``vjp(**inputs, **options)`` (grad_out included) with ``vjp``
    the implementation's ``.vjp`` or, for a plain function ``f``, the ``f_vjp`` of its
    module; they ignore ``diagnose``. The fixture-only judging work (baselines, scales,
    floors) is done once per fixture and tier and kept (:mod:`oracle.judging.parts`).
    """
    tiers = _tiers(tolerance)
    case = fixture.case
    if is_refusal(case):  # malformed inputs: the implementation must raise (must_refuse)
        found = check_refusal(impl, fixture, reproduce, passed_options(fixture.options, impl))
        return _with_tiers(found, tiers)
    if is_linear(case):  # the linear-attention family (oracle.judging.linear)
        return _with_tiers(check_linear(impl, fixture, reproduce, grads, diagnose), tiers)
    if case.function != "attention":
        return _with_tiers(_check_variant(impl, fixture, reproduce, grads), tiers)
    # a declared reading of rows with no allowed key (oracle.judging.empty_rows)
    fixture, impl, note = read_case(fixture, impl, grads)
    results = [
        CaseResult(
            case.name,
            case.category,
            case.dtype,
            "pass",
            reproduce=reproduce,
            description=getattr(case, "description", ""),
        )
        for _ in tiers
    ]
    run_guarded(
        results[0], lambda: _run_checks(impl, fixture, grads, diagnose, results, tiers, grade)
    )
    for other in results[1:]:
        if results[0].verdict in ("unsupported", "error"):  # the one call refused or raised
            other.verdict, other.message = results[0].verdict, results[0].message
            other.checks, other.diagnosis = {}, []
        other.seconds = results[0].seconds
        if other.verdict == "pass":
            other.reproduce = ""
    for result in results:
        if note and result.verdict in ("pass", "fail"):
            result.message = "; ".join(x for x in (result.message, note) if x)
    return _with_tiers(results[0], tiers, results[1:])


def _tiers(tolerance) -> tuple:
    """The tiers ``tolerance`` asks for: one of :data:`~oracle.judging.tolerance.TIERS` or
    "both"."""
    if tolerance == "both":
        return tol.TIERS
    return (tol.check_tier(tolerance),)


def _with_tiers(result, tiers, others=None):
    """``result`` with the tight tier's result attached when both tiers were asked for
    (variants and refusals judge the same way in both)."""
    if len(tiers) > 1:
        if others is None:
            others = [copy.copy(result)]
            others[0].checks = dict(result.checks)
        result.tight = others[0]
    return result


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


def _run_checks(impl, fixture, grads, diagnose, results, tiers, grade=True):
    """Call ``impl`` once (and its vjp with ``grads``), then judge the outputs in each tier,
    filling ``results`` (one per tier)."""
    start = time.perf_counter()  # the judging time bounds the diagnosis (oracle.diagnose.budget)
    _SAVED[0] = 0.0
    inputs = fixture.inputs
    options = {n: x for n, x in fixture.options.items() if n != "return_lse"}
    out, lse = call_forward(impl, inputs["q"], inputs["k"], inputs["v"], options)
    # a fixture read for this run carries its content key (oracle.run.stored)
    view = view_of(fixture, getattr(fixture, "content_key", None))
    notes, gradients = [], []
    wanted = grads and _truth(fixture, "dq") is not None
    if wanted and not hasattr(impl, "vjp"):
        notes.append("gradients asked for but not checked: the implementation has no .vjp")
    for tier, result in zip(tiers, results, strict=True):
        with np.errstate(all="ignore"):
            problem = _check_forward(view, fixture, tier, out, lse, result.checks, grade)
            if problem is None and wanted and not notes:
                if not gradients:  # the vjp is called once, after a well-shaped forward
                    gradients.append(_call_vjp(impl, fixture))
                problem = _check_grads(view, fixture, gradients[0], result.checks)
        _verdict(
            view, fixture, result, problem, notes, (diagnose, start - _SAVED[0], tier), out, lse
        )


def _verdict(view, fixture, result, problem, notes, diagnosing, out, lse):
    diagnose, start, tier = diagnosing  # the judging start bounds the diagnosis
    failing = [c for c in result.checks.values() if not c.passed]
    if problem or failing:
        result.verdict = "fail"
        result.message = problem or "; ".join(
            f"{c.quantity}: {c.n_failed} of {c.size} elements over the threshold" for c in failing
        )
        if diagnose:  # True, or the DiagnosisBudget of oracle.run.validate's diagnose_budget
            # values near overflow (worst-overflow) overflow the diagnoses' norms
            with (
                np.errstate(over="ignore", invalid="ignore"),
                case_budget(diagnose, time.perf_counter() - start, result.name) as spent,
            ):
                result.diagnosis = _diagnosis(view, fixture, tier, out, result.checks, lse)
            result.diagnosis += spent.notes(any("matches" in d for d in result.diagnosis))
            with np.errstate(over="ignore", invalid="ignore"):
                result.key_map = key_map(
                    out, _truth(fixture, "out"), view.v, view.options.get("gqa")
                )
    elif notes:
        result.verdict = "unsupported"  # gradients were asked for: never a pass
    result.message = "; ".join(x for x in [result.message, *notes] if x)


def _diagnosis(view, fixture, tier, out, checks, lse=None) -> list[str]:
    """What explains the failure, most specific first: lse conventions (log2 units, the row
    max, scale/bias alternatives); the pinned convention at a narrower working precision
    (preferred when a named alternative fits too: it is the likelier story); named
    convention and tiled-kernel alternatives; the same seen through a narrower precision;
    half-precision accumulation; else plain observations (NaN leaks, where errors sit)."""
    check = checks.get("out")
    truth = _truth(fixture, "out")
    failing = [c for c in checks.values() if not c.passed]
    if not failing:
        return []
    own = {"out": view.dtype, "lse": storage_dtype(lse, view.dtype) if lse is not None else None}
    values, truths = {"out": out, "lse": lse}, {n: _truth(fixture, n) for n in own}
    sub_ulp = within_one_ulp(tier, failing, values, truths, own)
    if sub_ulp:
        return [sub_ulp]
    out_failed = check is not None and not check.passed and out.shape == truth.shape
    # errors of the order of the output itself: no precision model or online-softmax hint
    small = max(c.max_error for c in failing) < ORDER_ONE
    # the steps outside the readings draw on the case's budget (oracle.diagnose.budget): the
    # precision models keep their time from the readings (the lse's and the output's)
    spent, work = budget.current(), _reading_work(view)

    def cost(steps_work):  # every step of a case whose readings are cheap is cheap too
        return steps_work if work > budget.CHEAP_WORK else 0

    if small:
        spent.reserve("lower precision", cost(_LOWER_PRECISION_COST * work * len(failing)))
    if small and out_failed:
        spent.reserve("narrow accumulation", cost(narrow_accumulation_work(view)))
    notes = _lse_and_key_notes(view, checks, failing, lse)
    lower = []  # every failing quantity's model, or none (one alone would name a precision)
    if small and spent.step("lower precision", cost(_LOWER_PRECISION_COST * work * len(failing))):
        lower = [_lower_precision(view, c, fixture) for c in failing]
    lower_dtype = (
        lower[0][0] if lower and all(x is not None and x[0] == lower[0][0] for x in lower) else None
    )
    if out_failed:  # the readings at a narrower precision need its model of the output
        spent.reserve("narrower precisions", cost(_narrower_work(view, work)))
    found = []
    if out_failed:
        snug = max(x[1] for x in lower) if lower_dtype is not None else None
        found = _readings(view, fixture, out, check, snug)
    if lower_dtype is not None:
        if not found:
            worst = max(c.max_error for c in failing)
            return notes + [
                f"errors fit {lower_dtype} accuracy (max normalised error "
                f"{worst:.3g}): the implementation seems to compute in "
                f"{lower_dtype} (the pinned conventions at {lower_dtype} "
                f"precision)"
            ]
    if found:
        return notes + found
    if not out_failed:
        return notes
    narrower = _NARROWER.get(view.dtype, ())
    if not spent.step("narrower precisions", cost(_narrower_work(view, work))):
        narrower = ()
    for dtype in narrower:
        # a convention mismatch seen through a narrower working precision (its T7 model)
        limit = _expected(view, "out", dtype, truth, check.size) + tol.unit_roundoff(dtype)
        found = _diagnose.diagnose(view, out, limit=limit, pinned=check.errors)
        if found:
            return notes + [
                f"{label} (at {dtype} accuracy: the implementation seems to compute in {dtype})"
                for label in found
            ]
    errors = check.errors if check.errors is not None else np.zeros(out.shape)
    limit = np.broadcast_to(np.asarray(check.threshold.value), out.shape)
    where = []  # where the failing rows concentrate (partial query tile, late max)
    rows_work = work // (view.shapes["D"] + view.shapes["E"])
    if (
        small
        and np.isfinite(out).all()
        and np.isfinite(errors).all()
        and spent.step("concentration", cost(rows_work))
    ):
        where = _diagnose.concentration(view, errors, limit)
    if not small:
        pass
    elif tol.accumulation_dtype(view.dtype) != np.dtype(view.dtype) and np.isfinite(errors).all():
        found = _storage_accumulation(view, out, truth, check)
        if found:
            return notes + [found] + where
    if (
        small
        and np.isfinite(check.errors).all()
        and spent.step("narrow accumulation", cost(narrow_accumulation_work(view)))
    ):
        scale = tol.output_scale(view.dropped, view.v, gqa=view.options.get("gqa"))
        found = _diagnose.narrow_accumulation(
            view,
            out,
            truth,
            scale[0] if view.single else scale,
        )
        if found:
            return notes + [found] + where
    poisoned = any(
        not np.isfinite(np.asarray(x, dtype=np.float64)).all()
        for x in {**fixture.inputs, **view.options}.values()
        if isinstance(x, np.ndarray) and (x.dtype.kind == "f" or x.dtype.name in _HALF_NAMES)
    )
    return (
        notes
        + _diagnose.describe_failure(out, truth, errors, limit, inputs_poisoned=poisoned)
        + where
    )


#: Work of the lower-precision models of one failing quantity (the tight-tier model at two
#: narrower dtypes), in readings of the case (measured on the long rows of the default suite:
#: 2 to 3)
_LOWER_PRECISION_COST = 3


def _readings(view, fixture, out, check, snug) -> list[str]:
    """The named readings that explain ``out`` (:mod:`oracle.diagnose.diagnosis`, then the fp4
    misreadings of :mod:`oracle.diagnose.fp4`). When a narrower precision explains the errors
    too (``snug``: the largest share of its limit they use; None when none does), a reading
    wins only if it fits at least as snugly, and only the cheap readings are searched for
    one: the precision decides the diagnosis as a first match does."""
    limit, pinned = np.asarray(check.threshold.value), check.errors
    if snug is not None and snug < 1:
        return _diagnose.diagnose(
            view, out, limit=snug * limit, max_pairs=False, pinned=pinned, costly=False
        )
    found = _diagnose.diagnose(view, out, limit=limit, pinned=pinned, costly=snug is None)
    return found or diagnose_fp4(
        fixture.inputs, fixture.options, out, limit=limit, dtype=view.dtype
    )


def _expected(view, key, dtype, truth, count):
    """:func:`oracle.judging.parts.expected`, computed once per diagnosis of a case (the
    lower-precision models and the readings at a narrower precision ask the same)."""
    memo = budget.current().memo
    found = memo.get(("expected", key, dtype))
    if found is None:
        found = memo[("expected", key, dtype)] = parts.expected(view, key, dtype, truth, count)
    return found


def _narrower_work(view, work) -> int:
    """Work of the models of the output at the narrower precisions not yet computed for the
    case (:func:`_expected`), ``work`` being one reading's."""
    memo = budget.current().memo
    missing = [d for d in _NARROWER.get(view.dtype, ()) if ("expected", "out", d) not in memo]
    return len(missing) * work * _LOWER_PRECISION_COST // 2


def _reading_work(view) -> int:
    """Multiply-adds of one float64 reading of the case (B H L S (D + E)): the work unit of
    the diagnosis budget (:mod:`oracle.diagnose.budget`)."""
    shapes = view.shapes
    return shapes["B"] * shapes["H"] * shapes["L"] * shapes["S"] * (shapes["D"] + shapes["E"])


def _lse_and_key_notes(view, checks, failing, lse) -> list[str]:
    """Notes that come before the output's diagnosis: the lse conventions, and where the
    errors of a failing ``dk`` or ``dv`` concentrate among the keys."""
    notes = []
    lse_check = checks.get("lse")
    if lse_check is not None and not lse_check.passed and lse is not None:
        notes = _diagnose.diagnose_lse(
            view,
            np.reshape(lse, lse_check.errors.shape),
            limit=np.asarray(lse_check.threshold.value),
        )
    for grad in failing:
        if (
            grad.quantity in ("dk", "dv")
            and grad.errors is not None
            and np.isfinite(grad.errors).all()
        ):
            notes = notes + key_concentration(
                grad.quantity,
                grad.errors,
                np.broadcast_to(np.asarray(grad.threshold.value), grad.errors.shape),
            )
    return notes


def _storage_accumulation(view, out, truth, check) -> str | None:
    """Half types: does the output match a textbook that sums in the storage dtype?"""
    scale = tol.output_scale(view.dropped, view.v, gqa=view.options.get("gqa"))
    scale = scale[0] if view.single else scale
    fits = []
    for sums, what in (
        (("normaliser",), "the softmax normaliser"),
        (("values",), "weights @ v"),
        (("normaliser", "values"), "the softmax normaliser and weights @ v"),
    ):
        model = storage_accumulation_attention(
            view.q, view.k, view.v, view.options, view.dtype, sums=sums
        )
        model_error = float(np.max(tol.normalised_error(model, truth, scale, view.dtype)))
        if check.max_error <= tol.K_FORWARD * model_error + tol.unit_roundoff(view.dtype):
            distance = float(np.max(tol.normalised_error(out, model, scale, view.dtype)))
            fits.append((distance, what, model_error))
    if not fits:
        return None
    _, what, model_error = min(fits)  # the model closest to the output names the sum
    return (
        f"errors consistent with accumulating {what} in {view.dtype} (no float32 "
        f"accumulator; such a textbook has normalised error {model_error:.3g} here)"
    )


_NARROWER = {"float64": ("float32", "float16", "bfloat16"), "float32": ("float16", "bfloat16")}


def _narrower_limit(view, key, dtype, count) -> float:
    """k F + u of ``dtype`` for quantity ``key`` ("out", "lse" or "grad") of this case."""
    k = tol.K_BACKWARD if key == "grad" else tol.K_FORWARD
    floors = tol.forward_floors(
        dtype,
        **view.sizes,
        magnitude=view.magnitude,
        allowed=np.broadcast_to(view.exact64.allowed, view.magnitude.shape),
        count=count,
    )
    return k * float(np.max(floors[key])) + tol.unit_roundoff(dtype)


def _lower_precision(view, check, fixture) -> tuple | None:
    """(dtype, largest error / limit) for the narrower dtype whose expected error covers
    every error of ``check``, if any:
    for out and lse the tight-tier model (T7) evaluated at that dtype (realistic: what a
    correct kernel computing in it shows, calibrated against torch SDPA), for gradients
    ``k`` times the floor (T5)."""
    if check.errors is None or not np.isfinite(check.errors).all():
        return None
    key = check.quantity if check.quantity in ("out", "lse") else "grad"
    for dtype in _NARROWER.get(view.dtype, ()):
        if key == "grad":
            limit = _narrower_limit(view, key, dtype, check.size)
        else:
            truth = _truth(fixture, key)
            limit = _expected(view, key, dtype, truth, check.size) + tol.unit_roundoff(dtype)
        if np.all(check.errors <= limit):
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = float(np.max(np.where(check.errors > 0, check.errors / limit, 0.0)))
            return dtype, ratio
    return None


def _copy(x):
    return np.copy(x) if isinstance(x, np.ndarray) else x


def _check_variant(impl, fixture, reproduce, grads=False):
    """Run a variant implementation on one fixture and judge each output by (T1)/(T2) with
    the floor (V1) of :func:`oracle.judging.tolerance.variant_floor`; with ``grads`` on a gradient
    case also its vjp (:func:`_check_variant_grads`)."""
    case = fixture.case
    result = CaseResult(
        case.name,
        case.category,
        case.dtype,
        "pass",
        reproduce=reproduce,
        description=case.description,
    )
    notes = []

    def check():
        inputs = forward_inputs(fixture.inputs)
        produced = impl(
            **{k: _copy(v) for k, v in inputs.items()},
            **{k: _copy(v) for k, v in case.options.items()},
        )
        outputs = outputs_of(case, produced)
        truths = {
            n: _as_float64(fixture.truth[n + "_f64"]) for n in FUNCTIONS[case.function].outputs
        }
        base = variant_baseline(case, fixture.inputs)
        cond = condition(case, fixture.inputs, truths)
        spec = FUNCTIONS[case.function]
        floor = tol.variant_floor(
            case.dtype, condition=cond, n=spec.n_roundings(case), n_stored=spec.n_stored
        )
        problems = _judge_variant_outputs(
            case,
            fixture,
            outputs,
            truths,
            base,
            floor,
            tol.K_FORWARD,
            result.checks,
            lambda name, truth64: natural_scale(case, fixture.inputs, name, truth64),
        )
        if grads and case.grads and "grad_out" in fixture.inputs:
            vjp = vjp_of(impl)
            if vjp is None:
                notes.append(
                    "gradients asked for but not checked: the implementation has "
                    "no .vjp (nor an f_vjp beside it)"
                )
            else:
                problems += _check_variant_grads(case, fixture, vjp, cond, result.checks)
        failing = [c for c in result.checks.values() if not c.passed]
        if (problems or failing) and case.function == "merge_states":
            result.diagnosis += diagnose_merge(fixture.inputs, case.options, outputs, truths)
        if problems or failing:
            result.verdict = "fail"
            result.message = "; ".join(
                problems
                + [
                    f"{c.quantity}: {c.n_failed} of {c.size} elements over the threshold"
                    for c in failing
                ]
            )
        elif notes:
            result.verdict = "unsupported"  # gradients were asked for: never a pass
            result.message = "; ".join(notes)

    return run_guarded(result, check)


def _judge_variant_outputs(case, fixture, outputs, truths, base, floor, k, checks, scale_of):
    problems = []
    with np.errstate(all="ignore"):
        for name, truth64 in truths.items():
            if name not in outputs or outputs[name] is None:
                problems.append(f"{name}: not returned")
                continue
            value = _as_float64(outputs[name])
            if value.shape != truth64.shape:
                problems.append(f"{name} has shape {value.shape}, expected {truth64.shape}")
                continue
            scale = scale_of(name, truth64)
            base_err = np.where(
                np.isfinite(truth64),
                tol.normalised_error(base[name], truth64, scale, case.dtype),
                0.0,
            )
            threshold = tol.threshold(base_err, floor, case.dtype, k=k)
            checks[name] = _judge(name, value, truth64, scale, threshold, case.dtype)
    return problems


def _check_variant_grads(case, fixture, vjp, forward_condition, checks):
    """Judge a variant vjp: each ``d<name>`` by (T1)/(T2) against the exact gradients, with
    the baseline refattn's float64 vjp and the gradient floor of
    :func:`oracle.judging.variant_scales.grad_floor_terms`."""
    names = grad_names(case.function)
    produced = vjp(
        **{k: _copy(v) for k, v in fixture.inputs.items()},
        **{k: _copy(v) for k, v in case.options.items()},
    )
    if isinstance(produced, dict):
        outputs = {n: produced.get(n) for n in names}
    elif isinstance(produced, (tuple, list)) and not hasattr(produced, names[0]):
        outputs = dict(zip(names, produced, strict=False))
    else:
        outputs = {n: getattr(produced, n, None) for n in names}
    truths = {n: _as_float64(fixture.truth[n + "_f64"]) for n in names}
    base = variant_vjp_baseline(case, fixture.inputs)
    cond, n = grad_floor_terms(case, forward_condition)
    floor = tol.variant_floor(
        case.dtype, condition=cond, n=n, n_stored=FUNCTIONS[case.function].n_stored
    )
    return _judge_variant_outputs(
        case,
        fixture,
        outputs,
        truths,
        base,
        floor,
        tol.K_BACKWARD,
        checks,
        lambda name, truth64: grad_scale(truth64),
    )
