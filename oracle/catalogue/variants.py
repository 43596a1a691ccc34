"""The variant cases of the catalogue: refattn's probabilistic attention variants.

Two suites (listed by :mod:`oracle.catalogue.registry`):

* ``"variants-smoke"`` -- one tiny case per variant function in float64 and float32 (22
  forward cases, about 1 s of computation) and one float64 gradient case per function with a
  vjp;
* ``"variants-default"`` -- every variant function with its options (GMM iterations, priors,
  per-unit precisions, key/prior adaptation forms; MGK soft/hard/normalised with masks, causal
  and windows; MLK linear attention; Hopfield retrieval and energy; the mean-field updates and
  fixed points), each in the four dtypes (109 forward cases, about 10 s on one core; the log_pi
  case is float64 only, see :func:`make_inputs`), plus the gradient cases. variants-smoke is a
  subset of variants-default.

Gradient cases (``Case.grads``, names ending in ``-grad``) exist for every function whose
module defines ``<function>_vjp`` (:func:`vjp_of`; mgk.attention, mgk.linear_attention,
hopfield.retrieve, and the gmm and mean-field functions once theirs exist): the fixture also
holds the cotangent ``inputs/grad_out`` (shaped like the first output) and the exact
gradients ``truth/d<name>`` (+ ``_f64``) of the positional array arguments
(:func:`grad_names`). A missing vjp only means no gradient case; the forward cases and their
bytes do not depend on it.

Examples
--------
>>> from oracle.run.validate import validate
>>> from refattn import mgk
>>> report = validate(mgk.attention, suite="variants-smoke", dtype="float32",
...                            cases=["mgk-*"], progress=False)
>>> report.passed, [r.verdict for r in report.results]
(True, ['pass'])

Each :class:`oracle.catalogue.Case` names in ``function`` the refattn function whose exact path
gives its truth (``"gmm.attention"``, ``"gmm.adapt_keys"``, ``"gmm.adapt_priors"``,
``"mgk.attention"``, ``"mgk.linear_attention"``, ``"hopfield.retrieve"``,
``"hopfield.energy"``, ``"meanfield.naive_step"``, ``"meanfield.adaptive_tap"``,
``"meanfield.ising_tap"``, ``"meanfield.deq_attention"``, see :data:`FUNCTIONS`). Names are
``<prefix>-<case tag>-<sizes>-<dtype>``, e.g. ``gmm-attn-iters3-H2-L6S10-D8E8-f32``; the
prefix names the function, so ``--case 'mgk-*'`` (or ``validate(..., cases=["mgk-*"])``)
selects one function's cases: ``gmm-attn`` (gmm.attention), ``gmm-keys`` (adapt_keys),
``gmm-priors`` (adapt_priors), ``mgk`` (mgk.attention), ``mlk`` (linear_attention),
``hopfield-retrieve``, ``hopfield-energy``, ``meanfield-naive``, ``meanfield-atap``
(adaptive_tap), ``meanfield-ising``, ``meanfield-deq`` (:data:`PREFIXES`). No name collides
with the attention catalogue.

Sizes
-----
``Case.shapes`` reuses the attention shape letters: batch, H (heads, also the number of kv
heads K), L (queries / states / sites N), S (units, keys, stored patterns; S = L = N for the
mean-field cases), D (query/key dimension, spin dimension d), E (value dimension). The number
R of MGK components per key is ``recipe["R"]``.

Inputs (:func:`make_inputs`)
----------------------------
The rows are :mod:`oracle.catalogue.variant_families`; the float64 inputs
:mod:`oracle.catalogue.variant_inputs`. Built from :mod:`oracle.catalogue.seeding` like the
attention cases (SplitMix64 per named array, Irwin-Hall Gaussians, one rounding to the case dtype;
machine- and NumPy-independent). Any normalisation uses powers of two (exact) or ``math.fsum``
(correctly rounded), never a NumPy reduction whose summation order could vary. Distributions
(``pi0``, ``pi``, ``log_pi``) are formed in float64 and rounded once; they sum to 1 within the few
roundings the variants accept. Coupling matrices are scaled by a power of two so that the max row
sum of ``|J|`` is at most 1/2 (a contraction: every fixed point exists and is unique) with zero
diagonal blocks unless the case keeps them.

Truth (:data:`TRUTH_BUILDERS`)
------------------------------
The function's exact path (``precision="exact"``): every element the exact real result
rounded once, to the case dtype (``truth/<output>``) and to float64 (``truth/<output>_f64``).
Iterative functions: the exact value of the stated number of iterations (gmm, hopfield), or
the closed-form / certified fixed point (mean-field; see each function's docstring).
Outputs are ``out`` for single-array functions, ``means``, ``cavity_var``, ``chi_diag`` for
``adaptive_tap`` and ``ising_tap`` and ``means`` for ``deq_attention`` (its correction is
None).

Calling convention of an implementation under test (:func:`oracle.judging.judge.check_fixture`)
--------------------------------------------------------------------------------------
``impl(**inputs, **options)``: every array argument is in ``fixture.inputs`` under the refattn
function's parameter name (case dtype; ``ml_dtypes.bfloat16`` for bfloat16), every scalar
keyword in ``fixture.case.options`` (the npz member ``options``). It returns the single output
array, a tuple of the outputs in the order of :data:`FUNCTIONS` ``[function].outputs``, a
mapping from output names, or an object with those attributes (a
:class:`refattn.meanfield.MeanFieldResult`). NotImplementedError gives the verdict
"unsupported", any other exception "error". Gradient cases judged with ``grads=True`` (CLI
``--grads``) also call ``impl.vjp(**inputs, **options)`` -- grad_out included -- or, for a plain
function ``f``, the ``f_vjp`` of its module, which returns the ``d<name>`` (a NamedTuple, a
tuple in :func:`grad_names` order or a mapping); no vjp gives "unsupported".

Judging
-------
Like attention: normalised error (T1 of :mod:`oracle.judging.tolerance`) by the natural scale of the
function (:func:`oracle.judging.variant_scales.natural_scale`), threshold (T2) with the baseline
rule
and the floor :func:`oracle.judging.tolerance.variant_floor` (V1); see
:mod:`oracle.judging.variant_scales`.
Gradients: scale :func:`oracle.judging.variant_scales.grad_scale`, baseline refattn's float64 vjp
(:func:`oracle.reading.baseline.variant_vjp_baseline`), floor (V1) with
:func:`oracle.judging.variant_scales.grad_floor_terms`, ``k =`` K_BACKWARD.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from oracle.catalogue import seeding
from oracle.catalogue.case import Case, Shapes, seed_of
from oracle.catalogue.names import DTYPE_TAGS, DTYPES
from oracle.catalogue.seeding import Streams
from oracle.catalogue.variant_families import Entry, entries
from oracle.catalogue.variant_inputs import float64_inputs

__all__ = [
    "SUITES",
    "FUNCTIONS",
    "PREFIXES",
    "Function",
    "TRUTH_BUILDERS",
    "variant_cases",
    "make_inputs",
    "truth",
    "required_members",
    "call_refattn",
    "call_refattn_vjp",
    "forward_inputs",
    "vjp_of",
    "grad_names",
    "outputs_of",
    "INPUT_BUILDERS",
    "BOOL_INPUTS",
    "MEMBERS",
]

#: The variant suites: variants-smoke within variants-default.
SUITES = ("variants-smoke", "variants-default")


@dataclass(frozen=True)
class Function:
    """A variant function: its module attribute, array inputs, outputs and floor sizes.

    ``n_roundings(case)`` is ``n`` and ``n_stored`` the stored stages of (V1) in
    :func:`oracle.judging.tolerance.variant_floor`.
    """

    module: str
    attribute: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    n_roundings: Callable[[Case], int]
    n_stored: int


def _mixture_n(case: Case) -> int:
    # logits: a dot product of D (+E) terms; max-shifted lse and the weighted sum of S (R) terms
    n = case.shapes
    return n.D + n.E + 3 * n.S * int(case.recipe.get("R", 1)) + 12


FUNCTIONS: dict[str, Function] = {
    "gmm.attention": Function(
        "refattn.gmm", "attention", ("q", "keys", "values"), ("out",), _mixture_n, 3
    ),
    "gmm.adapt_keys": Function(
        "refattn.gmm",
        "adapt_keys",
        ("queries", "keys0"),
        ("out",),
        lambda c: c.shapes.D + 3 * (c.shapes.L + c.shapes.S) + 12,
        3,
    ),
    "gmm.adapt_priors": Function(
        "refattn.gmm",
        "adapt_priors",
        ("queries", "keys", "pi0"),
        ("out",),
        lambda c: c.shapes.D + 3 * (c.shapes.L + c.shapes.S) + 12,
        3,
    ),
    "mgk.attention": Function(
        "refattn.mgk", "attention", ("q", "keys", "v"), ("out",), _mixture_n, 3
    ),
    "mgk.linear_attention": Function(
        "refattn.mgk",
        "linear_attention",
        ("q", "keys", "v", "pi"),
        ("out",),
        lambda c: 2 * (c.shapes.D + int(c.recipe.get("R", 1)) + c.shapes.S + 4) + 2,
        3,
    ),
    "hopfield.retrieve": Function(
        "refattn.hopfield", "retrieve", ("xi", "X"), ("out",), _mixture_n, 3
    ),
    "hopfield.energy": Function(
        "refattn.hopfield",
        "energy",
        ("xi", "X"),
        ("out",),
        lambda c: c.shapes.D + c.shapes.S + 6,
        2,
    ),
    "meanfield.naive_step": Function(
        "refattn.meanfield",
        "naive_step",
        ("m", "J", "x"),
        ("out",),
        lambda c: c.shapes.L * c.shapes.D + 1,
        0,
    ),
    "meanfield.adaptive_tap": Function(
        "refattn.meanfield",
        "adaptive_tap",
        ("x", "J"),
        ("means", "cavity_var", "chi_diag"),
        lambda c: 3 * c.shapes.L * c.shapes.D,
        2,
    ),
    "meanfield.ising_tap": Function(
        "refattn.meanfield",
        "ising_tap",
        ("x", "J"),
        ("means", "cavity_var", "chi_diag"),
        lambda c: 3 * c.shapes.L + 8,
        2,
    ),
    "meanfield.deq_attention": Function(
        "refattn.meanfield",
        "deq_attention",
        ("x", "J"),
        ("means",),
        lambda c: 3 * c.shapes.L * c.shapes.D,
        2,
    ),
}


#: Case-name prefix of each function's cases (``f"{prefix}-*"`` selects exactly them).
PREFIXES = {
    "gmm.attention": "gmm-attn",
    "gmm.adapt_keys": "gmm-keys",
    "gmm.adapt_priors": "gmm-priors",
    "mgk.attention": "mgk",
    "mgk.linear_attention": "mlk",
    "hopfield.retrieve": "hopfield-retrieve",
    "hopfield.energy": "hopfield-energy",
    "meanfield.naive_step": "meanfield-naive",
    "meanfield.adaptive_tap": "meanfield-atap",
    "meanfield.ising_tap": "meanfield-ising",
    "meanfield.deq_attention": "meanfield-deq",
}


def _tag(shapes: Shapes, function: str) -> str:
    batch = f"B{shapes.batch}" if shapes.batch != 1 else ""
    if function.startswith("meanfield."):
        return f"{batch}N{shapes.L}d{shapes.D}"
    return f"{batch}H{shapes.H}-L{shapes.L}S{shapes.S}-D{shapes.D}E{shapes.E}"


def _expand(entry: Entry) -> list[Case]:
    out = []
    if entry.grads and vjp_of(entry.function) is None:
        return out  # no vjp (yet): no gradient case
    for dtype in DTYPES:
        in_smoke = dtype in entry.smoke
        in_default = in_smoke or dtype in entry.default
        suites = tuple(
            s for s, member in zip(SUITES, (in_smoke, in_default), strict=True) if member
        )
        if not suites:
            continue
        name = f"{entry.tag}-{_tag(entry.shapes, entry.function)}-{DTYPE_TAGS[dtype]}"
        out.append(
            Case(
                name=name,
                suites=suites,
                category="conformance",
                dtype=dtype,
                shapes=entry.shapes,
                options=dict(entry.options),
                recipe=dict(entry.recipe),
                seed=seed_of(name),
                grads=entry.grads,
                description=entry.description,
                function=entry.function,
            )
        )
    return out


_CATALOGUE: list[Case] | None = None


def variant_cases() -> list[Case]:
    """Every variant case (both suites), in catalogue order; names are unique."""
    global _CATALOGUE
    if _CATALOGUE is None:
        catalogue = [c for entry in entries() for c in _expand(entry)]
        names = [c.name for c in catalogue]
        if len(set(names)) != len(names):
            raise RuntimeError("oracle.catalogue: duplicate variant case names")
        _CATALOGUE = catalogue
    return list(_CATALOGUE)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


#: The boolean inputs (kept as they are; every other input is a float array).
BOOL_INPUTS = ("mask",)


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """Inputs of a variant case (refattn parameter names), bit-identical on every machine.

    Examples
    --------
    >>> from oracle import catalogue
    >>> inputs = make_inputs(catalogue.get("mgk-soft-H2-L4S6-D4E4-f32"))
    >>> sorted(inputs), inputs["keys"].shape, inputs["keys"].dtype.name
    (['keys', 'q', 'v'], (1, 2, 6, 2, 4), 'float32')
    """
    raw = float64_inputs(case)
    if case.grads:
        # a cotangent shaped like the (first) output: the float64 path's shape
        forward = call_refattn(case, raw)
        shape = np.shape(forward[FUNCTIONS[case.function].outputs[0]])
        raw["grad_out"] = Streams(case.seed).gaussian("grad_out", shape)
    return {
        name: (x if name in BOOL_INPUTS else seeding.to_dtype(x, case.dtype))
        for name, x in raw.items()
    }


# ---------------------------------------------------------------------------------------------
# Truth
# ---------------------------------------------------------------------------------------------


def _function(case: Case):
    spec = FUNCTIONS[case.function]
    return getattr(importlib.import_module(spec.module), spec.attribute)


def outputs_of(case: Case, result) -> dict[str, Any]:
    """The named outputs of a result: an array, tuple, mapping or object with attributes."""
    names = FUNCTIONS[case.function].outputs
    if isinstance(result, Mapping):
        return {n: result[n] for n in names if n in result}
    if isinstance(result, (tuple, list)):
        return dict(zip(names, result, strict=False))
    if all(hasattr(result, n) for n in names):
        return {n: getattr(result, n) for n in names}
    return {names[0]: result}


def forward_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The inputs of the forward call: all but the cotangent ``grad_out``."""
    return {k: v for k, v in inputs.items() if k != "grad_out"}


def call_refattn(case: Case, inputs: Mapping[str, np.ndarray], **extra) -> dict[str, Any]:
    """Run the case's refattn function on ``inputs`` (without grad_out) with the case options
    and ``extra``."""
    result = _function(case)(**forward_inputs(inputs), **dict(case.options), **extra)
    return outputs_of(case, result)


def vjp_of(function: str):
    """The vjp of a variant function: ``<attribute>_vjp`` of its module, or None.

    The convention of refattn (and of an implementation's ``.vjp``): ``f_vjp(<f's positional
    array arguments>, grad_out, **<f's keywords>)`` returning a NamedTuple with a field
    ``d<name>`` per positional array argument; ``grad_out`` is the cotangent of f's first
    output (``out``; ``means`` for the mean-field fixed points).
    """
    spec = FUNCTIONS[function]
    try:
        module = importlib.import_module(spec.module)
    except ImportError:
        return None
    return getattr(module, spec.attribute + "_vjp", None)


def grad_names(function: str) -> tuple[str, ...]:
    """``d<name>`` for each positional array argument of the function's vjp (those before
    grad_out), or () without a vjp."""
    vjp = vjp_of(function)
    if vjp is None:
        return ()
    names = []
    for name in inspect.signature(vjp).parameters:
        if name == "grad_out":
            break
        names.append("d" + name)
    return tuple(names)


def call_refattn_vjp(case: Case, inputs: Mapping[str, np.ndarray], **extra) -> dict[str, Any]:
    """Run the case function's refattn vjp on ``inputs`` (with grad_out) and the options."""
    result = vjp_of(case.function)(**inputs, **dict(case.options), **extra)
    return {name: getattr(result, name) for name in grad_names(case.function)}


def truth(case: Case, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Exact outputs rounded to the case dtype and (``_f64``) to float64."""
    result: dict[str, np.ndarray] = {}
    dtypes = [case.dtype] if case.dtype == "float64" else [case.dtype, "float64"]
    for dtype in dtypes:
        suffix = "" if dtype == case.dtype else "_f64"
        for name, value in call_refattn(case, inputs, precision="exact", out_dtype=dtype).items():
            result[name + suffix] = np.asarray(value)
        if case.grads:
            for name, value in call_refattn_vjp(
                case, inputs, precision="exact", out_dtype=dtype
            ).items():
                result[name + suffix] = np.asarray(value)
    if case.dtype == "float64":
        for name in list(result):
            result[name + "_f64"] = result[name]
    return result


#: Case.function -> truth builder; merged into :data:`oracle.fixtures.golden.TRUTH_BUILDERS`.
TRUTH_BUILDERS = {name: truth for name in FUNCTIONS}
#: Case.function -> inputs builder; merged into :data:`oracle.catalogue.INPUT_BUILDERS`.
INPUT_BUILDERS = {name: make_inputs for name in FUNCTIONS}


#: Case.function -> required_members(case) of a family with its own fixture members.
MEMBERS: dict[str, Callable[[Case], tuple[list[str], list[str]]]] = {}


def required_members(case: Case) -> tuple[list[str], list[str]]:
    """(inputs, truth) member names a fixture file of ``case`` must hold (for verify)."""
    if case.function in MEMBERS:
        return MEMBERS[case.function](case)
    spec = FUNCTIONS[case.function]
    outputs = spec.outputs + (grad_names(case.function) if case.grads else ())
    inputs = list(spec.inputs) + (["grad_out"] if case.grads else [])
    return inputs, [n + s for n in outputs for s in ("", "_f64")]
