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
checked. It returns ``out`` or ``(out, lse)``. Gradients (``grads=True``, cases that carry
them) come from ``impl.vjp(q, k, v, grad_out, [grad_lse=...,] **options) -> (dq, dk, dv[,
dbias[, dsinks]])`` (dsinks (H,) for cases with sinks). float8 inputs (fp8 cases) are passed
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

import math
import time

import numpy as np

from oracle.catalogue.variants import FUNCTIONS, forward_inputs, grad_names, outputs_of
from oracle.diagnose import diagnosis as _diagnose
from oracle.diagnose.budget import case_budget
from oracle.diagnose.fp4 import diagnose_fp4
from oracle.diagnose.models import ORDER_ONE
from oracle.diagnose.tiles import storage_dtype
from oracle.judging import tolerance as tol
from oracle.judging.empty_rows import read_case
from oracle.judging.linear import check_linear, is_linear
from oracle.judging.must_refuse import check_refusal, is_refusal
from oracle.judging.passing import passed_options
from oracle.judging.results import CaseResult, Check, Worst, grade_of
from oracle.judging.variant_scales import condition, grad_floor_terms, grad_scale, natural_scale
from oracle.reading.baseline import (
    dequantised_inputs,
    storage_accumulation_attention,
    textbook_attention,
    textbook_attention_vjp,
    variant_baseline,
    variant_vjp_baseline,
)
from oracle.report.summary import key_map

__all__ = ["check_fixture", "run_guarded", "call_forward", "passed_options"]

_GRADS = ("dq", "dk", "dv", "dbias", "dsinks", "dqv")


def call_forward(impl, q, k, v, options):
    """Run ``impl``'s forward as the judge does (``return_lse=True`` first, then without it;
    options equal to refattn's defaults left out); returns float64 (out, lse or None).

    A TypeError refusing one of the options is a NotImplementedError ("unsupported"), and so
    is an exception that reads as the implementation's refusal of the case
    (:func:`oracle.judging.refused.as_refusal`)."""
    from oracle.judging.refused import refusing

    with refusing():
        return _call_forward(impl, q, k, v, options)


def _call_forward(impl, q, k, v, options):
    copies = passed_options(options, impl)
    # a sigmoid case has no log-sum-exp to ask for (normalizer="sigmoid" refuses return_lse)
    ask_lse = {} if options.get("normalizer") == "sigmoid" else {"return_lse": True}
    try:
        result = impl(np.copy(q), np.copy(k), np.copy(v), **copies, **ask_lse)
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
        float(tol.ulp_distance(value[index], truth[index], dtype)) if value.size else 0.0,
        float(limit[index]) if limit.size else 0.0,
    )
    passed = not over.any()
    # graded in the quantity's own storage type (a float32 lse of bfloat16 inputs)
    grade = grade_of(value, truth, own or dtype, rounded if own in (None, dtype) else None)
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


class _Context:
    """Float64 weights, magnitudes and floors of one fixture (shared by every check)."""

    def __init__(self, fixture, tier="default", grade=True):
        self.tier = tol.check_tier(tier)
        self.grade = grade
        inputs, options = fixture.inputs, fixture.options
        self.q, self.k, self.v = inputs["q"], inputs["k"], inputs["v"]
        self.options = {n: x for n, x in options.items() if n != "return_lse"}
        # float8 inputs: every scale, floor and baseline is of the dequantised values
        self.q, self.k, self.v, self.options = dequantised_inputs(
            self.q, self.k, self.v, self.options
        )
        self.dtype = fixture.case.dtype
        self.exact64 = textbook_attention(self.q, self.k, self.v, dtype="float64", **self.options)
        weights = self.exact64.weights
        self.dropped = weights
        if self.options.get("dropout_mask") is not None:
            keep = np.asarray(self.options["dropout_mask"], dtype=bool)
            self.dropped = np.where(keep, weights, 0) / (1 - (self.options.get("dropout_p") or 0.0))
        self.magnitude = tol.score_magnitude(self.q, self.k, **self.options)
        q3 = self.q if np.ndim(self.q) > 2 else np.asarray(self.q)[None]
        H, L, D = q3.shape[-3:]
        k3 = self.k if np.ndim(self.k) > 2 else np.asarray(self.k)[None]
        K, S = k3.shape[-3], k3.shape[-2]
        self.sizes = dict(D=D, S=S, L=L, E=np.shape(self.v)[-1], G=max(H // K, 1))
        self.single = np.ndim(self.q) == 2
        self.forward = self.lse_parts = None  # out's and lse's fixture-only judging parts

    def floors(self, count):
        n_stored = (
            1
            + (self.options.get("softcap") is not None)
            + (self.options.get("bias") is not None or self.options.get("alibi_slopes") is not None)
        )
        allowed = (
            np.broadcast_to(self.exact64.allowed, self.exact64.weights.shape)
            if not self.single
            else np.broadcast_to(self.exact64.allowed, self.magnitude.shape)
        )
        floors = tol.forward_floors(
            self.dtype,
            **self.sizes,
            magnitude=self.magnitude,
            allowed=allowed,
            n_stored=int(n_stored),
            dropout=self.options.get("dropout_mask") is not None,
            count=count,
        )
        if self.single:
            floors["out"], floors["lse"] = floors["out"][0], floors["lse"][0]
        return floors

    def _element_args(self, count):
        def heads(x):
            return x[None] if self.single else x

        n_stored = (
            1
            + (self.options.get("softcap") is not None)
            + (self.options.get("bias") is not None or self.options.get("alibi_slopes") is not None)
        )
        return dict(
            weights=heads(self.exact64.weights),
            magnitude=self.magnitude,
            dots=tol.scaled_dots(self.q, self.k, **self.options),
            D=self.sizes["D"],
            S=self.sizes["S"],
            n_stored=int(n_stored),
            softcap=self.options.get("softcap") is not None,
            count=count,
        ), heads

    def output_floor(self, truth, count, tier="default"):
        """Element-wise floor (T6) of the output (the model (T7) in the tight tier)."""
        args, heads = self._element_args(count)
        rule = tol.output_expected if tier == "tight" else tol.output_floor
        floor = rule(
            self.dtype,
            **args,
            dropped=heads(self.dropped),
            v=self.v,
            out=heads(truth),
            gqa=self.options.get("gqa"),
            dropout=self.options.get("dropout_mask") is not None,
        )
        return floor[0] if self.single else floor

    def expected(self, key, dtype, truth, count):
        """The tight-tier model (T7) of ``key`` ("out" or "lse") evaluated at ``dtype``."""
        args, heads = self._element_args(count)
        if key == "out":
            value = tol.output_expected(
                dtype,
                **args,
                dropped=heads(self.dropped),
                v=self.v,
                out=heads(truth),
                gqa=self.options.get("gqa"),
                dropout=self.options.get("dropout_mask") is not None,
            )
        else:
            value = tol.lse_expected(dtype, **args, lse=heads(truth))
        return value[0] if self.single else value

    def lse_floor(self, truth, count, tier="default"):
        """Element-wise floor (T6) of lse (the model (T7) in the tight tier)."""
        args, heads = self._element_args(count)
        rule = tol.lse_expected if tier == "tight" else tol.lse_floor
        floor = rule(self.dtype, **args, lse=heads(truth))
        return floor[0] if self.single else floor


def _forward_threshold(ctx, base_err, floor):
    if ctx.tier == "tight":
        return tol.Threshold(tol.K_FORWARD, None, floor, tol.unit_roundoff(ctx.dtype), "tight")
    return tol.threshold(base_err, floor, ctx.dtype, k=tol.K_FORWARD)


def _check_forward(ctx, fixture, out, lse, checks):
    truth_out = _truth(fixture, "out")
    out, problem = _shape_check("out", out, truth_out)
    if problem:
        return problem
    if ctx.forward is None:
        base = textbook_attention(ctx.q, ctx.k, ctx.v, dtype=ctx.dtype, **ctx.options)
        scale = tol.output_scale(ctx.dropped, ctx.v, gqa=ctx.options.get("gqa"))
        scale = scale[0] if ctx.single else scale
        err = _finite_part(tol.normalised_error(base.out, truth_out, scale, ctx.dtype), truth_out)
        floor = ctx.output_floor(truth_out, truth_out.size, ctx.tier)
        ctx.forward = base, scale, _forward_threshold(ctx, err, floor)
    base, scale, threshold = ctx.forward
    checks["out"] = _judge(
        "out", out, truth_out, scale, threshold, ctx.dtype, rounded=_truth_rounded(fixture, "out")
    )
    if ctx.grade:
        checks["out"].grade.models = {
            label: float(
                np.sum(
                    _finite_part(
                        tol.normalised_error(model, truth_out, scale, ctx.dtype), truth_out
                    )
                    ** 2
                )
            )
            for label, model in _diagnose.error_models(
                ctx.q, ctx.k, ctx.v, ctx.options, ctx.dtype, rounded=_truth_rounded(fixture, "out")
            ).items()
        }
    truth_lse = _truth(fixture, "lse")
    if lse is not None and truth_lse is not None:
        lse, problem = _shape_check("lse", lse, truth_lse)
        if problem:
            return problem
        if ctx.lse_parts is None:
            magnitude = ctx.magnitude[0] if ctx.single else ctx.magnitude
            lscale = tol.lse_scale(truth_lse, ctx.exact64.weights, magnitude)
            err = tol.normalised_error(base.lse, truth_lse, lscale, ctx.dtype)
            floor = ctx.lse_floor(truth_lse, truth_lse.size, ctx.tier)
            threshold = _forward_threshold(ctx, _finite_part(err, truth_lse), floor)
            ctx.lse_parts = lscale, threshold
        lscale, threshold = ctx.lse_parts
        checks["lse"] = _judge(
            "lse",
            lse,
            truth_lse,
            lscale,
            threshold,
            ctx.dtype,
            rounded=_truth_rounded(fixture, "lse"),
            own=storage_dtype(lse, ctx.dtype),
        )
    return None


def _finite_part(errors, truth):
    """Baseline errors where the truth is finite (a NaN truth says nothing about accuracy)."""
    return np.where(np.isfinite(truth), errors, 0.0)


def _check_grads(ctx, fixture, impl, checks):
    inputs = fixture.inputs
    grad_out, grad_lse = inputs.get("grad_out"), inputs.get("grad_lse")
    extra = {} if grad_lse is None else {"grad_lse": np.copy(grad_lse)}
    options = passed_options(
        {n: x for n, x in fixture.options.items() if n != "return_lse"}, impl.vjp
    )
    result = impl.vjp(
        np.copy(inputs["q"]),
        np.copy(inputs["k"]),
        np.copy(inputs["v"]),
        np.copy(grad_out),
        **extra,
        **options,
    )
    result = tuple(result)
    scales = tol.grad_scales(
        ctx.q,
        ctx.k,
        ctx.v,
        grad_out,
        ctx.exact64.weights,
        ctx.dropped,
        grad_lse=grad_lse,
        sink_weights=ctx.exact64.sink_weights,
        **ctx.options,
    )
    base = textbook_attention_vjp(
        ctx.q, ctx.k, ctx.v, grad_out, grad_lse=grad_lse, dtype=ctx.dtype, **ctx.options
    )
    floor = ctx.floors(sum(np.size(r) for r in result if r is not None))["grad"]
    if _truth(fixture, "dsinks") is not None and (len(result) < 5 or result[4] is None):
        raise NotImplementedError(
            "dsinks: the implementation's vjp returns no gradient of the sinks (a fifth value)"
        )
    if _truth(fixture, "dqv") is not None and (len(result) < 6 or result[5] is None):
        raise NotImplementedError("qv: the implementation's vjp returns no dqv (a sixth value)")
    for position, name in enumerate(_GRADS):
        truth = _truth(fixture, name)
        if truth is None or position >= len(result) or result[position] is None:
            continue
        value, problem = _shape_check(name, _as_float64(result[position], name), truth)
        if problem:
            return problem
        base_err = _finite_part(
            tol.normalised_error(base[position], truth, scales[name], ctx.dtype), truth
        )
        threshold = tol.threshold(base_err, floor, ctx.dtype, k=tol.K_BACKWARD)
        checks[name] = _judge(name, value, truth, scales[name], threshold, ctx.dtype)
    return None


def check_fixture(
    impl, fixture, *, grads=False, diagnose=True, reproduce="", tolerance="default"
) -> CaseResult:
    """Run ``impl`` on one fixture and judge it (see the module docstring for verdicts).

    ``tolerance``: "default" (T2) or "tight" (T7 for out and lse; gradients and variants
    keep T2), see :mod:`oracle.judging.tolerance`.

    Attention fixtures call ``impl(q, k, v, **options)`` (and ``impl.vjp`` with ``grads``);
    variant fixtures (``Case.function`` other than "attention") call
    ``impl(**inputs, **options)`` (inputs without grad_out) and, with ``grads`` on a case
    that carries gradients, ``vjp(**inputs, **options)`` (grad_out included) with ``vjp``
    the implementation's ``.vjp`` or, for a plain function ``f``, the ``f_vjp`` of its
    module; they ignore ``diagnose``.
    """
    case = fixture.case
    if is_refusal(
        case
    ):  # malformed inputs: the implementation must raise (oracle.judging.must_refuse)
        return check_refusal(impl, fixture, reproduce, passed_options(fixture.options, impl))
    if is_linear(case):  # the linear-attention family (oracle.judging.linear)
        return check_linear(impl, fixture, reproduce, grads, diagnose)
    if case.function != "attention":
        return _check_variant(impl, fixture, reproduce, grads)
    # a declared reading of rows with no allowed key (oracle.judging.empty_rows)
    fixture, impl, note = read_case(fixture, impl, grads)
    result = CaseResult(
        case.name,
        case.category,
        case.dtype,
        "pass",
        reproduce=reproduce,
        description=getattr(case, "description", ""),
    )
    tol.check_tier(tolerance)
    result = run_guarded(
        result, lambda: _run_checks(impl, fixture, grads, diagnose, result, tolerance)
    )
    if note and result.verdict in ("pass", "fail"):
        result.message = "; ".join(x for x in (result.message, note) if x)
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


def _run_checks(impl, fixture, grads, diagnose, result, tier="default"):
    start = time.perf_counter()  # the judging time bounds the diagnosis (oracle.diagnose.budget)
    inputs = fixture.inputs
    options = {n: x for n, x in fixture.options.items() if n != "return_lse"}
    out, lse = call_forward(impl, inputs["q"], inputs["k"], inputs["v"], options)
    memo = getattr(fixture, "judge_memo", None)  # oracle.power: contexts kept, ungraded
    if memo is None:
        ctx = _Context(fixture, tier)
    elif (ctx := memo.get(tier)) is None:
        ctx = memo[tier] = _Context(fixture, tier, grade=False)
    with np.errstate(all="ignore"):
        problem = _check_forward(ctx, fixture, out, lse, result.checks)
        notes = []
        if problem is None and grads and _truth(fixture, "dq") is not None:
            if hasattr(impl, "vjp"):
                problem = _check_grads(ctx, fixture, impl, result.checks)
            else:
                notes.append("gradients asked for but not checked: the implementation has no .vjp")
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
                result.diagnosis = _diagnosis(ctx, fixture, out, result.checks, lse)
            result.diagnosis += spent.notes(any("matches" in d for d in result.diagnosis))
            with np.errstate(over="ignore", invalid="ignore"):
                result.key_map = key_map(out, _truth(fixture, "out"), ctx.v, ctx.options.get("gqa"))
    elif notes:
        result.verdict = "unsupported"  # gradients were asked for: never a pass
    result.message = "; ".join(x for x in [result.message, *notes] if x)


def _diagnosis(ctx, fixture, out, checks, lse=None) -> list[str]:
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
    notes = _lse_and_key_notes(ctx, checks, failing, lse)
    out_failed = check is not None and not check.passed and out.shape == truth.shape
    # errors of the order of the output itself: no precision model or online-softmax hint
    small = max(c.max_error for c in failing) < ORDER_ONE
    lower = [_lower_precision(ctx, c, fixture) for c in failing if small]
    lower_dtype = (
        lower[0][0] if lower and all(x is not None and x[0] == lower[0][0] for x in lower) else None
    )
    found = []
    if out_failed:
        found = _diagnose.diagnose(
            ctx.q,
            ctx.k,
            ctx.v,
            ctx.options,
            out,
            limit=np.asarray(check.threshold.value),
            dtype=ctx.dtype,
        ) or diagnose_fp4(  # fp4 block-scale misreadings (oracle/diagnose/fp4.py)
            fixture.inputs,
            fixture.options,
            out,
            limit=np.asarray(check.threshold.value),
            dtype=ctx.dtype,
        )
    if lower_dtype is not None:
        # both explain it: the alternative wins only if it fits at least as snugly (within
        # the same fraction of its limit as the errors use of the narrower precision's)
        snug = max(x[1] for x in lower)
        if found and snug < 1:
            found = _diagnose.diagnose(
                ctx.q,
                ctx.k,
                ctx.v,
                ctx.options,
                out,
                limit=snug * np.asarray(check.threshold.value),
                dtype=ctx.dtype,
                max_pairs=False,
            )
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
    for dtype in _NARROWER.get(ctx.dtype, ()):
        # a convention mismatch seen through a narrower working precision (its T7 model)
        limit = ctx.expected("out", dtype, truth, check.size) + tol.unit_roundoff(dtype)
        found = _diagnose.diagnose(
            ctx.q, ctx.k, ctx.v, ctx.options, out, limit=limit, dtype=ctx.dtype
        )
        if found:
            return notes + [
                f"{label} (at {dtype} accuracy: the implementation seems to compute in {dtype})"
                for label in found
            ]
    errors = check.errors if check.errors is not None else np.zeros(out.shape)
    limit = np.broadcast_to(np.asarray(check.threshold.value), out.shape)
    where = []  # where the failing rows concentrate (partial query tile, late max)
    if small and np.isfinite(out).all() and np.isfinite(errors).all():
        where = _diagnose.concentration(ctx.q, ctx.k, ctx.v, ctx.options, errors, limit)
    if not small:
        pass
    elif tol.accumulation_dtype(ctx.dtype) != np.dtype(ctx.dtype) and np.isfinite(errors).all():
        found = _storage_accumulation(ctx, out, truth, check)
        if found:
            return notes + [found] + where
    if small and np.isfinite(check.errors).all():
        scale = tol.output_scale(ctx.dropped, ctx.v, gqa=ctx.options.get("gqa"))
        found = _diagnose.narrow_accumulation(
            ctx.q,
            ctx.k,
            ctx.v,
            ctx.options,
            out,
            truth,
            scale[0] if ctx.single else scale,
            ctx.dtype,
        )
        if found:
            return notes + [found] + where
    poisoned = any(
        not np.isfinite(np.asarray(x, dtype=np.float64)).all()
        for x in {**fixture.inputs, **ctx.options}.values()
        if isinstance(x, np.ndarray) and (x.dtype.kind == "f" or x.dtype.name in _HALF_NAMES)
    )
    return (
        notes
        + _diagnose.describe_failure(out, truth, errors, limit, inputs_poisoned=poisoned)
        + where
    )


def _lse_and_key_notes(ctx, checks, failing, lse) -> list[str]:
    """Notes that come before the output's diagnosis: the lse conventions, and where the
    errors of a failing ``dk`` or ``dv`` concentrate among the keys."""
    notes = []
    lse_check = checks.get("lse")
    if lse_check is not None and not lse_check.passed and lse is not None:
        notes = _diagnose.diagnose_lse(
            ctx.q,
            ctx.k,
            ctx.v,
            ctx.options,
            np.reshape(lse, lse_check.errors.shape),
            limit=np.asarray(lse_check.threshold.value),
            dtype=ctx.dtype,
        )
    for grad in failing:
        if (
            grad.quantity in ("dk", "dv")
            and grad.errors is not None
            and np.isfinite(grad.errors).all()
        ):
            notes = notes + _diagnose.key_concentration(
                grad.quantity,
                grad.errors,
                np.broadcast_to(np.asarray(grad.threshold.value), grad.errors.shape),
            )
    return notes


def _storage_accumulation(ctx, out, truth, check) -> str | None:
    """Half types: does the output match a textbook that sums in the storage dtype?"""
    scale = tol.output_scale(ctx.dropped, ctx.v, gqa=ctx.options.get("gqa"))
    scale = scale[0] if ctx.single else scale
    fits = []
    for sums, what in (
        (("normaliser",), "the softmax normaliser"),
        (("values",), "weights @ v"),
        (("normaliser", "values"), "the softmax normaliser and weights @ v"),
    ):
        model = storage_accumulation_attention(
            ctx.q, ctx.k, ctx.v, ctx.options, ctx.dtype, sums=sums
        )
        model_error = float(np.max(tol.normalised_error(model, truth, scale, ctx.dtype)))
        if check.max_error <= tol.K_FORWARD * model_error + tol.unit_roundoff(ctx.dtype):
            distance = float(np.max(tol.normalised_error(out, model, scale, ctx.dtype)))
            fits.append((distance, what, model_error))
    if not fits:
        return None
    _, what, model_error = min(fits)  # the model closest to the output names the sum
    return (
        f"errors consistent with accumulating {what} in {ctx.dtype} (no float32 "
        f"accumulator; such a textbook has normalised error {model_error:.3g} here)"
    )


_NARROWER = {"float64": ("float32", "float16", "bfloat16"), "float32": ("float16", "bfloat16")}


def _narrower_limit(ctx, key, dtype, count) -> float:
    """k F + u of ``dtype`` for quantity ``key`` ("out", "lse" or "grad") of this case."""
    k = tol.K_BACKWARD if key == "grad" else tol.K_FORWARD
    floors = tol.forward_floors(
        dtype,
        **ctx.sizes,
        magnitude=ctx.magnitude,
        allowed=np.broadcast_to(ctx.exact64.allowed, ctx.magnitude.shape),
        count=count,
    )
    return k * float(np.max(floors[key])) + tol.unit_roundoff(dtype)


def _lower_precision(ctx, check, fixture) -> tuple | None:
    """(dtype, largest error / limit) for the narrower dtype whose expected error covers
    every error of ``check``, if any:
    for out and lse the tight-tier model (T7) evaluated at that dtype (realistic: what a
    correct kernel computing in it shows, calibrated against torch SDPA), for gradients
    ``k`` times the floor (T5)."""
    if check.errors is None or not np.isfinite(check.errors).all():
        return None
    key = check.quantity if check.quantity in ("out", "lse") else "grad"
    for dtype in _NARROWER.get(ctx.dtype, ()):
        if key == "grad":
            limit = _narrower_limit(ctx, key, dtype, check.size)
        else:
            truth = _truth(fixture, key)
            limit = ctx.expected(key, dtype, truth, check.size) + tol.unit_roundoff(dtype)
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
            vjp = _variant_vjp(impl)
            if vjp is None:
                notes.append(
                    "gradients asked for but not checked: the implementation has "
                    "no .vjp (nor an f_vjp beside it)"
                )
            else:
                problems += _check_variant_grads(case, fixture, vjp, cond, result.checks)
        failing = [c for c in result.checks.values() if not c.passed]
        if (problems or failing) and case.function == "merge_states":
            from oracle.diagnose.merge import diagnose_merge

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


def _variant_vjp(impl):
    """``impl.vjp``, or for a plain function ``f`` the ``f_vjp`` beside it: in its module or,
    for a function defined in a package's private module (``refattn.gmm._forward``), in the
    nearest enclosing package that has one (``refattn.gmm.attention_vjp``)."""
    vjp = getattr(impl, "vjp", None)
    if vjp is not None:
        return vjp
    import sys

    name = getattr(impl, "__name__", None)
    parts = (getattr(impl, "__module__", None) or "").split(".")
    while name and parts and parts[0]:
        found = getattr(sys.modules.get(".".join(parts)), f"{name}_vjp", None)
        if found is not None:
            return found
        parts.pop()
    return None


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
