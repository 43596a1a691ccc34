"""Reproducibility checks of an implementation: determinism, batch invariance, decode = prefill.

These are guarantees about *bits*, not accuracy: a kernel whose reduction order depends on the
batch it happens to be in, on a race between threads, or on the number of queries in the call
gives a row different bits in different runs even when every result is within the tolerance
(after "Defeating nondeterminism in LLM inference" and vLLM's batch-invariant mode). Each check
runs on a case's inputs and is its own verdict (category "invariance"):

``determinism``
    ``RERUNS`` calls on the same inputs return the same bits.
``batch-invariance``
    Every row's bits stay the same when its batch element runs alone, when the batch is
    reversed, and when the batch is padded with other elements (the batch followed by itself
    reversed).
``padding-invariance``
    Every row's bits stay the same when the keys are padded past the next 64-key tile with
    keys excluded by the mask (as in a padded variable-length batch). Not checked where the
    padding would move a causal/window/ALiBi alignment (``align="bottom_right"``); an
    implementation without ``mask=`` gets "unsupported".
``decode``
    The last query row computed alone (``align="bottom_right"`` where causal, window or ALiBi
    needs an offset: a decode step) equals the prefill's last row.

Equality is bitwise on the float64 view of the outputs (out and, when returned, lse), with NaNs
of any payload equal; -0.0 and +0.0 differ. A check that finds a difference names the first
differing element and the variant, and judges the deviating run as a whole against the truth
(:mod:`oracle.judging.tolerance`): outside the tolerance it is a "fail"; within it, a "warning"
with its
own count, which fails the run only with ``strict_invariance`` (``--strict-invariance``).
Robustness and variant cases are not checked.

Examples
--------
>>> from oracle import catalogue
>>> from oracle.fixtures import golden
>>> from refattn import attention
>>> fixture = golden.build(catalogue.get("basic-H2K2-L5S7-D8E8-f32"))
>>> exact = lambda q, k, v, **options: attention(q, k, v, **options, precision="exact")
>>> [check_invariance(exact, fixture, c).verdict for c in CHECKS]
['pass', 'pass', 'pass', 'pass']

refattn's exact path passes every check by construction (each element is the exact value
rounded once); its float64 path multiplies with BLAS, whose blocking depends on the shapes, and
need not pass ``decode`` or ``padding-invariance``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from oracle.judging.judge import call_forward, check_fixture, run_guarded
from oracle.judging.results import CaseResult
from oracle.reading.batching import batch_size, take_batch

__all__ = ["CHECKS", "RERUNS", "TILE", "parse_checks", "applies", "check_invariance"]

CHECKS = ("determinism", "batch-invariance", "padding-invariance", "decode")
#: calls of the determinism check
RERUNS = 3
#: key padding goes past the next multiple of this (a common key-tile width)
TILE = 64

_ROW_ARRAYS = ("mask", "bias", "dropout_mask")  # (..., L, S): rows on axis -2, keys on -1


def parse_checks(checks: str | Iterable[str] | None) -> tuple[str, ...]:
    """Check names from a comma list or an iterable (ValueError naming ``checks``)."""
    if checks is None:
        return ()
    names = [checks] if isinstance(checks, str) else list(checks)
    flat = [part.strip().lower() for name in names for part in str(name).split(",") if part.strip()]
    unknown = [name for name in flat if name not in CHECKS]
    if unknown:
        raise ValueError(f"checks: unknown check(s) {unknown}; expected some of {list(CHECKS)}")
    return tuple(dict.fromkeys(flat))


def applies(fixture) -> bool:
    """Invariance checks run on attention conformance cases."""
    case = fixture.case
    return case.function == "attention" and case.category == "conformance"


def check_invariance(
    impl, fixture, check: str, *, reruns: int = RERUNS, reproduce: str = ""
) -> CaseResult:
    """Run one invariance ``check`` of ``impl`` on ``fixture``; a :class:`CaseResult` named
    ``<case>::<check>`` in category "invariance" (pass / fail / unsupported / error)."""
    (check,) = parse_checks(check)
    case = fixture.case
    result = CaseResult(
        f"{case.name}::{check}",
        "invariance",
        case.dtype,
        "pass",
        reproduce=reproduce,
        description=f"{check} on {case.name}",
    )
    runner = {
        "determinism": _determinism,
        "batch-invariance": _batch_invariance,
        "padding-invariance": _padding_invariance,
        "decode": _decode,
    }[check]
    return run_guarded(result, lambda: runner(impl, fixture, result, reruns))


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


def _options(fixture) -> dict:
    return {n: x for n, x in fixture.options.items() if n != "return_lse"}


def _arrays(fixture):
    inputs = {n: fixture.inputs[n] for n in fixture.inputs if n not in ("grad_out", "grad_lse")}
    options = _options(fixture)
    for name in _ROW_ARRAYS + ("alibi_slopes",):
        if name in options:
            inputs[name] = options.pop(name)
    return inputs, options


def _call(impl, inputs, options):
    arrays = {n: a for n, a in inputs.items() if n not in ("q", "k", "v")}
    return call_forward(impl, inputs["q"], inputs["k"], inputs["v"], {**options, **arrays})


def _determinism(impl, fixture, result, reruns):
    inputs, options = _arrays(fixture)
    out, lse = _call(impl, inputs, options)
    for run in range(1, reruns):
        again, again_lse = _call(impl, inputs, options)
        where = _difference(out, lse, again, again_lse)
        if where is not None:
            _fail(
                result,
                fixture,
                f"run {run + 1} of {reruns} differs from run 1",
                where,
                again,
                again_lse,
            )
            return


def _batch_invariance(impl, fixture, result, reruns):
    inputs, options = _arrays(fixture)
    out, lse = _call(impl, inputs, options)
    batch = batch_size(inputs)
    order = list(range(batch))
    variants = [(f"batch element {b} alone", [b]) for b in order]
    if batch > 1:
        variants.append(("the batch reversed", order[::-1]))
    variants.append((f"the batch padded to {2 * batch} elements", order + order[::-1]))
    for label, indices in variants:
        got, got_lse = _call(impl, take_batch(inputs, indices), options)
        # variant element m holds original element indices[m]
        where = _difference(out[indices], None if lse is None else lse[indices], got, got_lse)
        if where is not None:
            (m, *rest), quantity, mine, theirs = where
            full, full_lse = _placed(out, lse, got, got_lse, indices)
            _fail(
                result,
                fixture,
                f"differs with {label}",
                ((indices[m], *rest), quantity, mine, theirs),
                full,
                full_lse,
            )
            return


def _padding_invariance(impl, fixture, result, reruns):
    inputs, options = _arrays(fixture)
    offset_dependent = (
        options.get("causal") or options.get("window") is not None or "alibi_slopes" in inputs
    )
    if offset_dependent and options.get("align", "top_left") == "bottom_right":
        result.diagnosis.append(
            "not checked: with align='bottom_right' padding keys moves "
            "the causal/window/ALiBi alignment"
        )
        return
    out, lse = _call(impl, inputs, options)
    padded, label = _pad_keys(inputs)
    got, got_lse = _call(impl, padded, options)
    where = _difference(out, lse, got, got_lse)
    if where is not None:
        _fail(result, fixture, f"differs with {label}", where, got, got_lse)


def _pad_keys(inputs):
    keys = inputs["k"].shape[-2]
    extra = (TILE - keys % TILE) % TILE + 1
    padded = dict(inputs)
    for name in ("k", "v"):
        array = inputs[name]
        tail = np.repeat(array[..., -1:, :], extra, axis=-2)
        padded[name] = np.concatenate([array, tail], axis=-2)
    rows = inputs["q"].shape[-2]
    mask = inputs.get("mask")
    if mask is None:
        mask = np.ones((rows, keys), dtype=bool)
    padded["mask"] = _extend_keys(mask, extra, False)
    if "bias" in inputs:
        padded["bias"] = _extend_keys(inputs["bias"], extra, 0)
    if "dropout_mask" in inputs:
        padded["dropout_mask"] = _extend_keys(inputs["dropout_mask"], extra, True)
    label = f"{extra} masked-out keys appended (S {keys} -> {keys + extra})"
    return padded, label


def _extend_keys(array, extra, value):
    tail = np.full((*array.shape[:-1], extra), value, dtype=array.dtype)
    return np.concatenate([array, tail], axis=-1)


def _decode(impl, fixture, result, reruns):
    inputs, options = _arrays(fixture)
    rows = inputs["q"].shape[-2]
    if rows == 1:
        result.diagnosis.append("decode not checked: the case has a single query row")
        return
    out, lse = _call(impl, inputs, options)
    last = dict(inputs)
    last["q"] = inputs["q"][..., -1:, :]
    for name in _ROW_ARRAYS:
        if name in inputs and inputs[name].ndim >= 2 and inputs[name].shape[-2] == rows:
            last[name] = inputs[name][..., -1:, :]
    step = dict(options)
    keys = inputs["k"].shape[-2]
    offset_dependent = (
        options.get("causal") or options.get("window") is not None or "alibi_slopes" in inputs
    )
    if offset_dependent:
        if options.get("align", "top_left") != "bottom_right" and rows != keys:
            result.diagnosis.append(
                "decode not checked: a top-left aligned causal/window/ALiBi "
                "case with L != S has no single-row equivalent"
            )
            return
        step["align"] = "bottom_right"
    got, got_lse = _call(impl, last, step)
    where = _difference(out[..., -1:, :], None if lse is None else lse[..., -1:], got, got_lse)
    if where is not None:
        index, quantity, mine, theirs = where
        index = (*index[:-2], rows - 1, index[-1]) if quantity == "out" else (*index[:-1], rows - 1)
        full, full_lse = out.copy(), None if lse is None else lse.copy()
        full[..., -1:, :] = got
        if full_lse is not None and got_lse is not None:
            full_lse[..., -1:] = got_lse
        _fail(
            result,
            fixture,
            "the last row computed alone (a decode step) differs from the prefill's last row",
            (index, quantity, mine, theirs),
            full,
            full_lse,
        )


# ---------------------------------------------------------------------------------------------
# Comparing and reporting
# ---------------------------------------------------------------------------------------------


def _first(a, b):
    """Index of the first element whose bits differ (NaNs equal), or None."""
    if a.shape != b.shape:
        raise ValueError(f"a rerun returned shape {b.shape}, the first run {a.shape}")
    same = (a.view(np.uint64) == b.view(np.uint64)) | (np.isnan(a) & np.isnan(b))
    if same.all():
        return None
    return tuple(int(i) for i in np.argwhere(~same)[0])


def _difference(out, lse, got, got_lse):
    """(index, quantity, first value, other value) of the first differing bit, or None."""
    for quantity, mine, theirs in (("out", out, got), ("lse", lse, got_lse)):
        if mine is None or theirs is None:
            continue
        index = _first(mine, theirs)
        if index is not None:
            return index, quantity, float(mine[index]), float(theirs[index])
    return None


def _placed(out, lse, got, got_lse, indices):
    """The first run's outputs with the variant's rows put back in place."""
    full, full_lse = out.copy(), None if lse is None else lse.copy()
    for m, b in enumerate(indices):
        full[b] = got[m]
        if full_lse is not None and got_lse is not None:
            full_lse[b] = got_lse[m]
    return full, full_lse


def _fail(result, fixture, what, where, full, full_lse):
    index, quantity, mine, theirs = where
    judged = check_fixture(
        lambda q, k, v, **_: (full, full_lse) if full_lse is not None else full,
        fixture,
        diagnose=False,
    )
    within = (
        "the deviating run is still within the tolerance: a warning (--strict-invariance fails it)"
        if judged.verdict == "pass"
        else f"the deviating run is also outside the tolerance ({judged.message})"
    )
    result.verdict = "warning" if judged.verdict == "pass" else "fail"
    result.message = (
        f"{quantity}[{', '.join(map(str, index))}] {what}: {mine!r} vs {theirs!r}; {within}"
    )
