"""Judging a linear-attention implementation (the ``linear-*`` suites): the tolerance rule.

The rule is the policy's (:mod:`oracle.judging.tolerance`, (T1)-(T2)) with the family's natural
scale, baseline and floor:

(L1) *Natural scale.* An output ``o_te = scale * sum_d q_td S_t[d, e]`` is a dot product of the
query with a state column, and the state is a sum of decayed, rank-one updates whose own
sizes are those of the state and the values; a perturbation of every factor by a relative
``eps`` moves it by at most ``eps |scale| ||q^_t||_2 ||S_t[:, e]||_2``. The scale of ``o_te`` is
``|scale| ||q^_t||_2 M_ne`` and that of the final state column ``S_T[:, e]`` is ``M_ne``, with
``q^`` the (normalised) query and ``M_ne`` the largest column norm ``||S_t[:, e]||_2`` over the
states S_0 .. S_T of sequence n plus the largest ``|v_te|`` (the size of the state the
recurrence carries, :func:`oracle.reading.linear_baseline.recurrence`); errors made in earlier
steps are carried (decayed or contracted) into later states, so the sequence's largest state
is their scale. Gradients: the largest ``|truth|`` of the gradient per batch row
(:func:`oracle.judging.variant_scales.grad_scale`).

(L2) *Threshold* ``T = max(k E_base, F) + u_out`` (T2) with ``k`` = K_FORWARD (o, final state)
or K_BACKWARD (gradients). ``E_base`` is the largest normalised error of the *same-dtype
textbook implementation*: the step-by-step recurrence on the inputs' values in the case dtype
with float32 accumulation for float16/bfloat16 (state kept in the accumulation dtype, outputs
rounded once to the case dtype; :func:`oracle.reading.linear_baseline.recurrence`); for the
gradients, refattn's float64 vjp rounded once to the case dtype.

(L3) *Floor* ``F = c (gamma~_n(u_a) + n_st u)`` -- (V1) of :func:`oracle.judging.tolerance.
variant_floor` with the probabilistic ``gamma~`` (T3) -- the rounding error of one step of a
correct kernel in its accumulation dtype ``u_a``, n = 2D + E + 8 roundings (the recall
``S'^T k``, the update, the readout ``S^T q`` and the normalisation), plus ``n_st = 4`` values a
chunked kernel stores in the case dtype (the normalised q and k, the chunk's new values or
WY factors, the state at chunk boundaries: FLA stores them in the input dtype), with the
condition factor ``c = 1 + max_t beta_t ||k^_t||^2`` (the norm of the delta rule's map
``I - beta k k^T`` bounds how much a stored error is amplified per step; 2 for the forms
without beta, whose update adds ``k v^T`` to the decayed state). Gradients: ``2c`` and
``2n + D + E`` (the reverse pass re-runs the forward chain and as many operations through its
transpose).

(L4) *A truth with a bound.* The long rows' truth is the float64 recurrence rounded once, with
a rigorous a-priori bound ``b`` on its distance to the exact result (truth kind
"float64-bounded", :mod:`oracle.catalogue.linear_families`): their threshold adds ``b / s``
(normalised by the element's scale ``s``). Their fixtures keep o at sampled steps (member
``positions``, :func:`oracle.catalogue.linear_inputs.sampled_positions`); o is judged there.

Calling convention: ``impl(q, k, v, [g=..., beta=..., initial_state=..., cu_seqlens=...,]
output_final_state=True, **case.options)`` with refattn's names and layout (q, k (B, H, T, D),
v (B, HV, T, E), states (N, HV, D, E)), returning ``(o, final_state)``. Gradients
(``grads=True``): ``impl.vjp`` or the ``<name>_vjp`` beside a plain function, called like
:func:`refattn.linear_attention_vjp` ``(q, k, v, g, beta, do, dht, **keywords)`` and returning
(dq, dk, dv, dg, dbeta, dh0) (a NamedTuple, tuple or mapping).

Examples
--------
>>> import refattn
>>> from oracle import catalogue
>>> from oracle.fixtures import golden
>>> fixture = golden.build(catalogue.get("lin-gdn-basic-H2K2-T16-D8E8-f32"))
>>> check_linear(refattn.linear_attention, fixture).verdict
'pass'
"""

from __future__ import annotations

import time

import numpy as np

import refattn
from oracle.catalogue import seeding
from oracle.catalogue.linear_families import FUNCTION, TRUTH_BOUNDED
from oracle.catalogue.linear_inputs import GRADS, OUTPUTS, arrays_of
from oracle.diagnose.linear import diagnose_linear
from oracle.judging import tolerance as tol
from oracle.judging.passing import vjp_of
from oracle.judging.results import CaseResult, Check, Worst, grade_of
from oracle.judging.variant_scales import grad_scale
from oracle.reading.linear_baseline import L2NORM_EPS, recurrence, segments_of

__all__ = [
    "is_linear",
    "check_linear",
    "natural_scales",
    "floor",
    "call_linear",
]

#: Values a chunked kernel stores in the case dtype per step (L3).
STORED = 4


def is_linear(case) -> bool:
    return case.function == FUNCTION


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def call_linear(impl, inputs, options):
    """``impl`` on a fixture's forward arrays -> {"o": ..., "final_state": ...}."""
    arrays = {n: np.copy(x) for n, x in arrays_of(inputs).items()}
    result = impl(**arrays, **dict(options), output_final_state=True)
    if isinstance(result, (tuple, list)):
        return dict(zip(OUTPUTS, result, strict=False))
    return {"o": result}


def _normalised_queries(inputs, options):
    q = _f64(inputs["q"])
    heads = np.shape(inputs["v"])[1]
    q = np.repeat(q, heads // q.shape[1], axis=1)
    if options.get("qk_l2norm"):
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + L2NORM_EPS)
    return np.sqrt((q * q).sum(-1))


def natural_scales(inputs, options) -> dict[str, np.ndarray]:
    """(L1): the scale of o (B, HV, T, E) and of the final states (N, HV, D, E)."""
    arrays = arrays_of(inputs)
    _, _, sizes = recurrence(arrays, options, "float64", magnitudes=True)
    scale = options.get("scale")
    dim = np.shape(inputs["q"])[-1]
    factor = abs(float(scale)) if scale is not None else dim**-0.5
    qnorm = _normalised_queries(inputs, options)
    o_scale = np.zeros(np.shape(inputs["v"]))
    for n, (b, start, stop) in enumerate(segments_of(arrays)):
        o_scale[b, :, start:stop] = factor * qnorm[b, :, start:stop, None] * sizes[n][:, None]
    state = np.broadcast_to(sizes[:, :, None, :], sizes.shape[:2] + (dim, sizes.shape[-1]))
    return {"o": o_scale, "final_state": state}


def _condition(inputs, options) -> float:
    beta = inputs.get("beta")
    if beta is None:
        return 2.0
    k = _f64(inputs["k"])
    k = np.repeat(k, np.shape(inputs["v"])[1] // k.shape[1], axis=1)
    squares = (k * k).sum(-1)
    if options.get("qk_l2norm"):
        squares = squares / (squares + L2NORM_EPS)
    return 1.0 + float((np.abs(_f64(beta)) * squares).max(initial=0.0))


def floor(case, inputs, options, *, backward=False) -> float:
    """(L3): the floor of (T2) for the outputs (or, ``backward``, the gradients)."""
    n = case.shapes
    steps = 2 * n.D + n.E + 8
    c = _condition(inputs, options)
    if backward:
        c, steps = 2 * c, 2 * steps + n.D + n.E
    count = max(int(np.prod(np.shape(inputs["v"]))), 1)
    u = tol.unit_roundoff(case.dtype)
    gamma = tol.probabilistic_gamma(steps, tol.accumulation_dtype(case.dtype), count=count)
    return c * (gamma + STORED * u)


def _judge(name, value, truth, scale, threshold, dtype) -> Check:
    errors = tol.normalised_error(value, truth, scale, dtype)
    limit = np.broadcast_to(np.asarray(threshold.value, dtype=np.float64), errors.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(errors == 0, 0.0, errors / limit)
    index = np.unravel_index(int(np.argmax(ratio)), errors.shape) if errors.size else ()
    index = tuple(int(i) for i in index)
    worst = Worst(
        name,
        index,
        float(value[index]) if value.size else float("nan"),
        float(truth[index]) if truth.size else float("nan"),
        float(errors[index]) if errors.size else 0.0,
        float(tol.ulp_distance(value[index], truth[index], dtype)) if value.size else 0.0,
        float(limit[index]) if limit.size else 0.0,
    )
    over = errors > limit
    return Check(
        name,
        not over.any(),
        float(errors.max()) if errors.size else 0.0,
        int(over.sum()),
        int(errors.size),
        threshold,
        worst,
        errors,
        grade=grade_of(value, truth, dtype),
    )


def _judge_all(case, produced, truths, base, scales, floor_value, k, checks, extra=None):
    problems = []
    with np.errstate(all="ignore"):
        for name, truth64 in truths.items():
            value = produced.get(name)
            if value is None:
                problems.append(f"{name}: not returned")
                continue
            value = _f64(value)
            if value.shape != truth64.shape:
                problems.append(f"{name} has shape {value.shape}, expected {truth64.shape}")
                continue
            scale = scales[name] if isinstance(scales, dict) else scales(truth64)
            base_err = tol.normalised_error(base[name], truth64, scale, case.dtype)
            limit = floor_value
            if extra and name in extra:
                limit = floor_value + extra[name] / np.maximum(scale, np.finfo(float).tiny)
            threshold = tol.threshold(base_err, limit, case.dtype, k=k)
            checks[name] = _judge(name, value, truth64, scale, threshold, case.dtype)
    return problems


def _grads_of(produced) -> dict:
    if isinstance(produced, dict):
        return {n: produced.get(n) for n in GRADS}
    if isinstance(produced, (tuple, list)) and not hasattr(produced, "dq"):
        return dict(zip(GRADS, produced, strict=False))
    return {n: getattr(produced, n, None) for n in GRADS}


def _call_vjp(vjp, inputs, options):
    arrays = {n: np.copy(x) for n, x in arrays_of(inputs).items()}
    q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
    g, beta = arrays.pop("g", None), arrays.pop("beta", None)
    return vjp(q, k, v, g, beta, np.copy(inputs["do"]), np.copy(inputs["dht"]), **arrays, **options)


def _check_grads(case, fixture, vjp, checks):
    options = dict(case.options)
    produced = _grads_of(_call_vjp(vjp, fixture.inputs, options))
    names = [n for n in GRADS if n + "_f64" in fixture.truth]
    truths = {n: _f64(fixture.truth[n + "_f64"]) for n in names}
    reference = _grads_of(_call_vjp(refattn.linear_attention_vjp, fixture.inputs, options))
    base = {n: _f64(_rounded(reference[n], case.dtype)) for n in names}
    floor_value = floor(case, fixture.inputs, options, backward=True)
    return _judge_all(case, produced, truths, base, grad_scale, floor_value, tol.K_BACKWARD, checks)


def _rounded(x, dtype):
    return seeding.to_dtype(_f64(x), dtype)


def _forward(impl, fixture, result, grads, notes):
    case = fixture.case
    options = dict(case.options)
    produced = call_linear(impl, fixture.inputs, options)
    truths = {n: _f64(fixture.truth[n + "_f64"]) for n in OUTPUTS}
    base_o, base_state, _ = recurrence(arrays_of(fixture.inputs), options, case.dtype)
    base = {"o": _f64(base_o), "final_state": _f64(base_state)}
    scales = natural_scales(fixture.inputs, options)
    extra = None
    if case.recipe.get("truth") == TRUTH_BOUNDED:
        extra = {"o": fixture.truth["bound_o"], "final_state": fixture.truth["bound_final_state"]}
    if "positions" in fixture.truth:  # a long row keeps sampled steps of o (L4)
        produced, base, scales = _sampled(fixture.truth["positions"], produced, base, scales)
    floor_value = floor(case, fixture.inputs, options)
    problems = _judge_all(
        case, produced, truths, base, scales, floor_value, tol.K_FORWARD, result.checks, extra
    )
    if grads and case.grads:
        vjp = vjp_of(impl)
        if vjp is None:
            notes.append("gradients asked for but not checked: the implementation has no .vjp")
        else:
            problems += _check_grads(case, fixture, vjp, result.checks)
    return produced, truths, problems


def _sampled(positions, produced, base, scales):
    """o, its baseline and its scale at the stored steps (the other quantities whole)."""
    steps = np.asarray(positions, dtype=np.int64)
    produced = dict(produced)
    length = np.shape(base["o"])[2]
    if produced.get("o") is not None and np.ndim(produced["o"]) == 4:
        if np.shape(produced["o"])[2] == length:
            produced["o"] = np.asarray(produced["o"])[:, :, steps]
    base = {**base, "o": base["o"][:, :, steps]}
    scales = {**scales, "o": scales["o"][:, :, steps]}
    return produced, base, scales


def check_linear(impl, fixture, reproduce="", grads=False, diagnose=True) -> CaseResult:
    """Run ``impl`` on one linear-attention fixture and judge it by (L1)-(L4); failing
    outputs are diagnosed (:mod:`oracle.diagnose.linear`)."""
    case = fixture.case
    result = CaseResult(
        case.name, case.category, case.dtype, "pass", reproduce=reproduce,
        description=case.description,
    )  # fmt: skip
    notes: list[str] = []

    def check():
        produced, truths, problems = _forward(impl, fixture, result, grads, notes)
        failing = [c for c in result.checks.values() if not c.passed]
        if problems or failing:
            result.verdict = "fail"
            result.message = "; ".join(
                problems
                + [f"{c.quantity}: {c.n_failed} of {c.size} elements over the threshold"
                   for c in failing]
            )  # fmt: skip
            if diagnose:
                result.diagnosis += diagnose_linear(fixture, produced)
        elif notes:
            result.verdict = "unsupported"
            result.message = "; ".join(notes)

    return _guarded(result, check)


def _guarded(result, check) -> CaseResult:
    """``check()`` filling ``result``: NotImplementedError -> "unsupported", any other
    exception -> "error" (the verdicts of :func:`oracle.judging.judge.run_guarded`)."""
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
        result.verdict, result.message = "error", f"the implementation called exit({err.code!r})"
        result.checks = {}
    result.seconds = time.perf_counter() - start
    if result.verdict == "pass":
        result.reproduce = ""
    return result
