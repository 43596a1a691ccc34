"""Inputs and truth of the linear-attention cases (:mod:`oracle.catalogue.linear_families`).

Inputs, in refattn's layout and parameter names (the case dtype; ``cu_seqlens`` int64):
``q``, ``k`` (B, K, T, D), ``v`` (B, H, T, E) (``Shapes.H`` value heads, ``Shapes.K`` key
heads), ``g`` (B, H, T) or (B, H, T, D) by form, ``beta`` (B, H, T), ``initial_state`` (N, H,
D, E) and ``cu_seqlens`` when the row has them; gradient rows add the cotangents ``do`` (B, H,
T, E) and ``dht`` (N, H, D, E). Built from :mod:`oracle.catalogue.seeding` (SplitMix64 per named
array, rounded once to the case dtype): q, k, v, initial states and cotangents Gaussian; keys
and queries scaled by a power of two (``short_keys``: norm ~1, so that the un-normalised delta
rule stays a contraction; ``tiny_qk``: norm ~2^-10); gates ``-(0.02 + U/2)`` (``near0``:
``-U 1e-4``; ``deep``: ``-(2 + 18 U)``); beta uniform in [0, 1) (``edges``: 0 or 1).

Truth: :func:`truth` (see the family's docstring); options passed to the implementation are
``case.options`` (``qk_l2norm``, ``gate_base``) plus the array keywords.

Examples
--------
>>> from oracle import catalogue
>>> inputs = make_inputs(catalogue.get("lin-kda-varlen-H2K2-T70-D8E8-bf16"))
>>> sorted(inputs), inputs["g"].shape, inputs["cu_seqlens"].tolist()
(['beta', 'cu_seqlens', 'g', 'initial_state', 'k', 'q', 'v'], (1, 2, 70, 8), [0, 1, 1, 40, 70])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import numpy as np

import refattn
from oracle.catalogue import seeding, variants
from oracle.catalogue.case import Case
from oracle.catalogue.linear_families import FORMS, FUNCTION, SUITES, TRUTH_BOUNDED, linear_cases
from oracle.catalogue.seeding import Streams

__all__ = [
    "make_inputs",
    "truth",
    "arrays_of",
    "call_refattn",
    "OUTPUTS",
    "GRADS",
    "required_members",
    "truth_kind",
    "register",
    "sampled_positions",
]

#: The outputs an implementation returns (with ``output_final_state=True``).
OUTPUTS = ("o", "final_state")
#: The gradients of a gradient case, in refattn.linear_attention_vjp's order.
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
_ARRAYS = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens")


def _sequences(case: Case) -> int:
    cu = case.recipe.get("cu")
    return len(cu) - 1 if cu else case.shapes.batch


def _gates(st: Streams, shape, style):
    u = st.uniform("g", shape)
    if style == "near0":
        return -u * 1e-4
    if style == "deep":
        return -(2.0 + 18.0 * u)
    return -(0.02 + 0.5 * u)


def _float64_inputs(case: Case) -> dict[str, np.ndarray]:
    n, recipe = case.shapes, case.recipe
    st = Streams(case.seed)
    gate, has_beta = FORMS[recipe["form"]]
    qk_shape = (n.batch, n.K, n.L, n.D)
    q, k = st.gaussian("q", qk_shape), st.gaussian("k", qk_shape)
    if recipe.get("short_keys"):  # norm ~1: beta |k|^2 <= 2 keeps the delta rule contracting
        factor = math.ldexp(1.0, -math.ceil(math.log2(n.D) / 2))
        q, k = q * factor, k * factor
    if recipe.get("tiny_qk"):
        q, k = np.ldexp(q, -10), np.ldexp(k, -10)
    out = {"q": q, "k": k, "v": st.gaussian("v", (n.batch, n.H, n.L, n.E))}
    value_shape = (n.batch, n.H, n.L)
    if gate is not None:
        shape = value_shape + ((n.D,) if gate == "vector" else ())
        out["g"] = _gates(st, shape, recipe.get("gates"))
    if has_beta:
        beta = st.uniform("beta", value_shape)
        out["beta"] = np.round(beta) if recipe.get("beta") == "edges" else beta
    state_shape = (_sequences(case), n.H, n.D, n.E)
    if recipe.get("h0"):
        out["initial_state"] = st.gaussian("initial_state", state_shape)
    if case.grads:
        out["do"] = st.gaussian("do", (n.batch, n.H, n.L, n.E))
        out["dht"] = st.gaussian("dht", state_shape)
    return out


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """The case's inputs (see the module docstring), bit-identical on every machine."""
    inputs = {name: seeding.to_dtype(x, case.dtype) for name, x in _float64_inputs(case).items()}
    if case.recipe.get("cu"):
        inputs["cu_seqlens"] = np.asarray(case.recipe["cu"], dtype=np.int64)
    return inputs


def arrays_of(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The forward call's array arguments (refattn names) among a fixture's inputs."""
    return {name: inputs[name] for name in _ARRAYS if name in inputs}


def call_refattn(case: Case, inputs: Mapping[str, np.ndarray], **extra):
    """refattn.linear_attention on the case -> (o, final_state)."""
    return refattn.linear_attention(
        **arrays_of(inputs), **dict(case.options), output_final_state=True, **extra
    )


def _vjp(case, inputs, **extra):
    arrays = arrays_of(inputs)
    q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
    g, beta = arrays.pop("g", None), arrays.pop("beta", None)
    return refattn.linear_attention_vjp(
        q, k, v, g, beta, inputs["do"], inputs["dht"], **arrays, **dict(case.options), **extra
    )


def _rounded_float64(case, inputs, dtype):
    """The float64 recurrence rounded once to ``dtype`` (the long rows' truth)."""
    o, state = call_refattn(case, inputs)
    return seeding.to_dtype(o, dtype), seeding.to_dtype(state, dtype)


@functools.lru_cache(maxsize=4)
def _bounds_of(name: str):
    case = next(c for c in linear_cases() if c.name == name)
    inputs = make_inputs(case)
    arrays = arrays_of(inputs)
    q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
    g, beta = arrays.pop("g", None), arrays.pop("beta", None)
    return refattn.linear.forward_error_bound(q, k, v, g, beta, **arrays, **dict(case.options))


def truth(case: Case, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Exact outputs (and gradients) rounded once to the case dtype and (``_f64``) to
    float64; the long rows: the float64 recurrence rounded once, with ``bound_o`` and
    ``bound_final_state`` (float64), the a-priori bounds on its distance to the exact result,
    o and bound_o kept at the steps ``positions`` only (:func:`sampled_positions`)."""
    result: dict[str, np.ndarray] = {}
    dtypes = [case.dtype] if case.dtype == "float64" else [case.dtype, "float64"]
    bounded = case.recipe.get("truth") == TRUTH_BOUNDED
    for dtype in dtypes:
        suffix = "" if dtype == case.dtype else "_f64"
        if bounded:
            outputs = _rounded_float64(case, inputs, dtype)
        else:
            outputs = call_refattn(case, inputs, precision="exact", out_dtype=dtype)
        for name, value in zip(OUTPUTS, outputs, strict=True):
            result[name + suffix] = np.asarray(value)
        if case.grads:
            grads = _vjp(case, inputs, precision="exact", out_dtype=dtype)
            for name, value in zip(GRADS, grads, strict=True):
                if value is not None:
                    result[name + suffix] = np.asarray(value)
    if case.dtype == "float64":
        for name in list(result):
            result[name + "_f64"] = result[name]
    if bounded:
        bound_o, bound_state = _bounds_of(case.name)
        result["bound_o"], result["bound_final_state"] = bound_o, bound_state
        positions = sampled_positions(case.shapes.L)
        for name in [n for n in result if n.startswith(("o", "bound_o"))]:
            result[name] = np.ascontiguousarray(result[name][:, :, positions])
        result["positions"] = positions
    return result


def sampled_positions(length: int) -> np.ndarray:
    """The steps whose outputs a long row's fixture stores (every 256th and the last 128):
    every output depends on the whole history, so sampled steps still see the errors carried
    through all T steps, and the folder stays small."""
    steps = np.union1d(np.arange(0, length, 256), np.arange(max(length - 128, 0), length))
    return steps.astype(np.int64)


def truth_kind(case: Case) -> str | None:
    """ "float64-bounded" for the long rows, None (the default exact kind) otherwise."""
    return case.recipe.get("truth") if case.function == FUNCTION else None


def required_members(case: Case) -> tuple[list[str], list[str]]:
    """(inputs, truth) member names a fixture of ``case`` must hold (for verify)."""
    gate, has_beta = FORMS[case.recipe["form"]]
    inputs = ["q", "k", "v"] + (["g"] if gate else []) + (["beta"] if has_beta else [])
    outputs = list(OUTPUTS)
    if case.grads:
        inputs += ["do", "dht"]
        outputs += ["dq", "dk", "dv"] + (["dg"] if gate else []) + (["dbeta"] if has_beta else [])
        outputs += ["dh0"] if case.recipe.get("h0") else []
    return inputs, [n + s for n in outputs for s in ("", "_f64")]


def register(input_builders, register_suite) -> None:
    """Add the family to the catalogue (idempotent): its inputs and truth builders, the
    members verify expects, and its two suites."""
    input_builders[FUNCTION] = make_inputs
    variants.TRUTH_BUILDERS[FUNCTION] = truth
    variants.MEMBERS[FUNCTION] = required_members
    for suite in SUITES:
        register_suite(suite, lambda suite=suite: [c for c in linear_cases() if suite in c.suites])
