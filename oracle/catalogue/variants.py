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
>>> from oracle.validate import validate
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
Built from :mod:`oracle.catalogue.seeding` like the attention cases (SplitMix64 per named array,
Irwin-Hall Gaussians, one rounding to the case dtype; machine- and NumPy-independent). Any
normalisation uses powers of two (exact) or ``math.fsum`` (correctly rounded), never a
NumPy reduction whose summation order could vary. Distributions (``pi0``, ``pi``,
``log_pi``) are formed in float64 and rounded once; they sum to 1 within the few roundings
the variants accept. Coupling matrices are scaled by a power of two so that the max row sum of
``|J|`` is at most 1/2 (a contraction: every fixed point exists and is unique) with zero
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

Calling convention of an implementation under test (:func:`oracle.judge.check_fixture`)
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
Like attention: normalised error (T1 of :mod:`oracle.tolerance`) by the natural scale of the
function (:func:`oracle.variant_scales.natural_scale`), threshold (T2) with the baseline rule
and the floor :func:`oracle.tolerance.variant_floor` (V1); see :mod:`oracle.variant_scales`.
Gradients: scale :func:`oracle.variant_scales.grad_scale`, baseline refattn's float64 vjp
(:func:`oracle.baseline.variant_vjp_baseline`), floor (V1) with
:func:`oracle.variant_scales.grad_floor_terms`, ``k =`` K_BACKWARD.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from . import seeding
from .case import Case, Shapes, seed_of
from .names import DTYPE_TAGS, DTYPES
from .seeding import Streams

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
]

#: The variant suites: variants-smoke within variants-default.
SUITES = ("variants-smoke", "variants-default")


@dataclass(frozen=True)
class Function:
    """A variant function: its module attribute, array inputs, outputs and floor sizes.

    ``n_roundings(case)`` is ``n`` and ``n_stored`` the stored stages of (V1) in
    :func:`oracle.tolerance.variant_floor`.
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


# ---------------------------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------------------------

_ALL = DTYPES
_SMOKE = ("float64", "float32")


@dataclass(frozen=True)
class _Entry:
    function: str
    tag: str
    shapes: Shapes
    description: str
    smoke: tuple[str, ...] = ()
    default: tuple[str, ...] = _ALL
    options: Mapping[str, Any] = field(default_factory=dict)
    recipe: Mapping[str, Any] = field(default_factory=dict)
    grads: bool = False


def _mix(batch, H, L, S, D, E):
    return Shapes(batch, H, H, L, S, D, E)


def _sites(batch, N, d):
    return Shapes(batch, 1, 1, N, N, d, d)


def _entries() -> list[_Entry]:
    e = _Entry
    small = _mix(1, 2, 4, 6, 4, 4)
    mix = _mix(1, 2, 6, 10, 8, 8)
    return [
        # --- GMM attention (Movellan & Gabbur eqs. (13)-(14)) ----------------------------------
        e(
            "gmm.attention",
            "gmm-attn-basic",
            small,
            "one EM step, uniform prior (plain attention)",
            smoke=_SMOKE,
            options={"alpha": 0.5, "beta": 0.5, "iters": 1},
        ),
        e(
            "gmm.attention",
            "gmm-attn-iters3",
            mix,
            "three EM steps, scalar alpha and beta",
            options={"alpha": 0.25, "beta": 0.5, "iters": 3},
        ),
        e(
            "gmm.attention",
            "gmm-attn-magnitude",
            mix,
            "magnitude prior (eqs. (15)-(18)), two steps",
            options={"alpha": 0.125, "beta": 0.25, "prior": "magnitude", "iters": 2},
        ),
        e(
            "gmm.attention",
            "gmm-attn-prior-array",
            mix,
            "log prior array, v_init, two steps",
            options={"alpha": 0.25, "beta": 0.5, "iters": 2},
            recipe={"prior": True, "v_init": True},
        ),
        e(
            "gmm.attention",
            "gmm-attn-per-unit",
            mix,
            "per-unit alpha and beta arrays (root of eq. (12)), two steps",
            recipe={"alpha": True, "beta": True},
            options={"iters": 2},
        ),
        e(
            "gmm.adapt_keys",
            "gmm-keys",
            small,
            "key adaptation, paper form (eq. (28))",
            smoke=_SMOKE,
            options={"alpha": 0.5, "gamma": 1.0, "iters": 1, "form": "paper"},
        ),
        e(
            "gmm.adapt_keys",
            "gmm-keys-map",
            mix,
            "key adaptation, MAP form, magnitude prior, two iterations",
            options={"alpha": 0.25, "gamma": 0.5, "iters": 2, "form": "map", "prior": "magnitude"},
        ),
        e(
            "gmm.adapt_priors",
            "gmm-priors",
            small,
            "Dirichlet prior adaptation, paper form (eq. (33))",
            smoke=_SMOKE,
            options={"alpha": 0.5, "eta": 1.0, "iters": 1, "form": "paper"},
        ),
        e(
            "gmm.adapt_priors",
            "gmm-priors-map",
            mix,
            "prior adaptation, MAP form, three iterations",
            options={"alpha": 0.25, "eta": 2.0, "iters": 3, "form": "map"},
        ),
        # --- MGK / MLK (Nguyen et al. 2022) ---------------------------------------------------
        e(
            "mgk.attention",
            "mgk-soft",
            small,
            "soft MGK, R = 2, uniform pi",
            smoke=_SMOKE,
            options={"sigma2": 2.0},
            recipe={"R": 2},
        ),
        e(
            "mgk.attention",
            "mgk-soft-logpi",
            mix,
            "soft MGK, R = 2, log_pi array, sigma2 = 4",
            default=("float64",),
            options={"sigma2": 4.0},
            recipe={"R": 2, "log_pi": True},
        ),
        e(
            "mgk.attention",
            "mgk-hard",
            mix,
            "hard MGK (N9), R = 2",
            options={"sigma2": 2.0, "mode": "hard"},
            recipe={"R": 2},
        ),
        e(
            "mgk.attention",
            "mgk-normalized",
            mix,
            "normalized soft MGK, sigma2 per component",
            options={"normalized": True},
            recipe={"R": 2, "sigma2": True},
        ),
        e(
            "mgk.attention",
            "mgk-mask",
            mix,
            "soft MGK with a random mask (some empty rows)",
            options={"sigma2": 2.0},
            recipe={"R": 2, "mask": True},
        ),
        e(
            "mgk.attention",
            "mgk-causal-br",
            _mix(1, 2, 5, 9, 8, 8),
            "soft MGK, causal bottom_right, L < S",
            options={"sigma2": 2.0, "causal": True, "align": "bottom_right"},
            recipe={"R": 2},
        ),
        e(
            "mgk.attention",
            "mgk-window",
            mix,
            "hard MGK, window (3, 1), top_left",
            options={"sigma2": 2.0, "mode": "hard", "window": (3, 1)},
            recipe={"R": 3},
        ),
        e(
            "mgk.linear_attention",
            "mlk-basic",
            small,
            "linear MLK attention, R = 2",
            smoke=_SMOKE,
            recipe={"R": 2},
        ),
        e(
            "mgk.linear_attention",
            "mlk-causal",
            mix,
            "causal linear MLK attention, R = 3",
            options={"causal": True},
            recipe={"R": 3},
        ),
        # --- Hopfield (Ramsauer et al.) -------------------------------------------------------
        e(
            "hopfield.retrieve",
            "hopfield-retrieve",
            small,
            "one retrieval update",
            smoke=_SMOKE,
            options={"beta": 0.5, "steps": 1},
        ),
        e(
            "hopfield.retrieve",
            "hopfield-retrieve-steps3",
            mix,
            "three updates, beta 1/4",
            options={"beta": 0.25, "steps": 3},
        ),
        e(
            "hopfield.energy",
            "hopfield-energy",
            small,
            "energy (E), constant 0",
            smoke=_SMOKE,
            options={"beta": 0.5},
        ),
        e(
            "hopfield.energy",
            "hopfield-energy-constant",
            mix,
            "energy with the paper's constant",
            options={"beta": 2.0, "constant": True},
        ),
        # --- gradients (grads=True: exact vjps in the fixture; present only for the functions
        # whose module has a ``<function>_vjp``, see vjp_of) ------------------------------------
        e(
            "mgk.attention",
            "mgk-soft-grad",
            small,
            "vjp of soft MGK, R = 2",
            smoke=("float64",),
            options={"sigma2": 2.0},
            recipe={"R": 2},
            grads=True,
        ),
        e(
            "mgk.attention",
            "mgk-hard-grad",
            small,
            "vjp of hard MGK (ties split equally)",
            options={"sigma2": 2.0, "mode": "hard"},
            recipe={"R": 2},
            grads=True,
        ),
        e(
            "mgk.attention",
            "mgk-mask-grad",
            small,
            "vjp of soft MGK with a random mask",
            options={"sigma2": 2.0},
            recipe={"R": 2, "mask": True},
            grads=True,
        ),
        e(
            "mgk.linear_attention",
            "mlk-grad",
            small,
            "vjp of linear MLK attention",
            smoke=("float64",),
            recipe={"R": 2},
            grads=True,
        ),
        e(
            "mgk.linear_attention",
            "mlk-causal-grad",
            small,
            "vjp of causal linear MLK",
            options={"causal": True},
            recipe={"R": 2},
            grads=True,
        ),
        e(
            "hopfield.retrieve",
            "hopfield-retrieve-grad",
            small,
            "vjp of one retrieval update",
            smoke=("float64",),
            options={"beta": 0.5, "steps": 1},
            grads=True,
        ),
        e(
            "hopfield.retrieve",
            "hopfield-retrieve-steps2-grad",
            small,
            "vjp of two updates",
            options={"beta": 0.25, "steps": 2},
            grads=True,
        ),
        e(
            "gmm.attention",
            "gmm-attn-grad",
            small,
            "vjp of one EM step",
            smoke=("float64",),
            options={"alpha": 0.5, "beta": 0.5, "iters": 1},
            grads=True,
        ),
        e(
            "gmm.attention",
            "gmm-attn-iters2-grad",
            small,
            "vjp of two EM steps",
            options={"alpha": 0.25, "beta": 0.5, "iters": 2},
            grads=True,
        ),
        e(
            "gmm.adapt_keys",
            "gmm-keys-grad",
            small,
            "vjp of key adaptation (eq. (28))",
            smoke=("float64",),
            options={"alpha": 0.5, "gamma": 1.0, "iters": 1, "form": "paper"},
            grads=True,
        ),
        e(
            "gmm.adapt_priors",
            "gmm-priors-grad",
            small,
            "vjp of prior adaptation (eq. (33))",
            smoke=("float64",),
            options={"alpha": 0.5, "eta": 1.0, "iters": 1, "form": "paper"},
            grads=True,
        ),
        e(
            "meanfield.adaptive_tap",
            "meanfield-atap-grad",
            _sites(1, 4, 2),
            "vjp of the adaptive TAP means",
            smoke=("float64",),
            grads=True,
        ),
        e(
            "meanfield.ising_tap",
            "meanfield-ising-grad",
            _sites(1, 5, 1),
            "vjp of the binary-spin TAP means",
            smoke=("float64",),
            grads=True,
        ),
        e(
            "meanfield.deq_attention",
            "meanfield-deq-grad",
            _sites(1, 4, 2),
            "vjp of the DEQ fixed point",
            smoke=("float64",),
            grads=True,
        ),
        # --- mean field (Bal 2021) ------------------------------------------------------------
        e(
            "meanfield.naive_step",
            "meanfield-naive",
            _sites(2, 4, 2),
            "one naive update (eq. (23) without correction), self-couplings kept",
            smoke=_SMOKE,
            recipe={"diagonal": True},
        ),
        e(
            "meanfield.adaptive_tap",
            "meanfield-atap",
            _sites(2, 4, 2),
            "adaptive TAP, Gaussian prior, site reading",
            smoke=_SMOKE,
        ),
        e(
            "meanfield.adaptive_tap",
            "meanfield-atap-prior",
            _sites(1, 3, 2),
            "adaptive TAP with a prior precision matrix",
            recipe={"prior_precision": True},
        ),
        e(
            "meanfield.ising_tap",
            "meanfield-ising",
            _sites(2, 5, 1),
            "binary-spin TAP",
            smoke=_SMOKE,
        ),
        e(
            "meanfield.deq_attention",
            "meanfield-deq",
            _sites(2, 4, 2),
            "deep implicit attention fixed point without correction",
            smoke=_SMOKE,
        ),
        e(
            "meanfield.deq_attention",
            "meanfield-deq-keep",
            _sites(1, 5, 2),
            "DEQ fixed point, self-couplings kept (diagonal='keep')",
            options={"diagonal": "keep"},
            recipe={"diagonal": True},
        ),
    ]


def _tag(shapes: Shapes, function: str) -> str:
    batch = f"B{shapes.batch}" if shapes.batch != 1 else ""
    if function.startswith("meanfield."):
        return f"{batch}N{shapes.L}d{shapes.D}"
    return f"{batch}H{shapes.H}-L{shapes.L}S{shapes.S}-D{shapes.D}E{shapes.E}"


def _expand(entry: _Entry) -> list[Case]:
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
        catalogue = [c for entry in _entries() for c in _expand(entry)]
        names = [c.name for c in catalogue]
        if len(set(names)) != len(names):
            raise RuntimeError("oracle.catalogue: duplicate variant case names")
        _CATALOGUE = catalogue
    return list(_CATALOGUE)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _distribution(stream, name, shape) -> np.ndarray:
    """Dyadic distributions over the last axis that sum to exactly 1 in every dtype.

    Integer weights c in [1, 4] for all but the last entry, the last ``2**m - sum`` (>= 1,
    < 2**(m-1) + 1: at most 7 significant bits, exact in bfloat16), divided by ``2**m``. A
    rounded float distribution would not sum to 1 within the few roundings the variants
    accept once upcast to the float64 of the baseline.
    """
    counts = 1 + (stream.uniform(name, shape) * 4).astype(np.int64)
    head = counts[..., :-1].sum(axis=-1)  # integer sums: exact, order-independent
    m = int(head.max()).bit_length() + 1 if shape[-1] > 1 else 0
    counts[..., -1] = (1 << m) - head
    return np.ldexp(counts.astype(np.float64), -m)


def _couplings(stream, shape, keep_diagonal):
    """Couplings with max row sum of |J| in (1/4, 1/2]: a power-of-two scale (exact)."""
    N, d = shape[0], shape[2] if len(shape) == 4 else 1
    J = stream.gaussian("J", shape)
    if not keep_diagonal:
        J[np.arange(N), np.arange(N)] = 0.0
    big = np.swapaxes(J, 1, 2).reshape(N * d, N * d) if len(shape) == 4 else J
    row = max(math.fsum(np.abs(r)) for r in big)
    return np.ldexp(J, -(math.frexp(row)[1] + 1))


def _inputs64(case: Case) -> dict[str, np.ndarray]:
    n, recipe, fn = case.shapes, case.recipe, case.function
    st = Streams(case.seed)
    b, H, L, S, D, E = n.batch, n.H, n.L, n.S, n.D, n.E
    R = int(recipe.get("R", 1))
    out: dict[str, np.ndarray] = {}
    if fn == "gmm.attention":
        out["q"] = st.gaussian("q", (b, H, L, D))
        out["keys"] = st.gaussian("keys", (b, H, S, D))
        out["values"] = st.gaussian("values", (b, H, S, E))
        if recipe.get("alpha"):
            out["alpha"] = 0.125 + 0.375 * st.uniform("alpha", (b, H, S))
        if recipe.get("beta"):
            out["beta"] = 0.25 + 0.75 * st.uniform("beta", (b, H, S))
        if recipe.get("prior"):
            out["prior"] = st.gaussian("prior", (b, H, S))
        if recipe.get("v_init"):
            out["v_init"] = st.gaussian("v_init", (b, H, L, E))
    elif fn == "gmm.adapt_keys":
        out["queries"] = st.gaussian("queries", (b, H, L, D))
        out["keys0"] = st.gaussian("keys0", (b, H, S, D))
    elif fn == "gmm.adapt_priors":
        out["queries"] = st.gaussian("queries", (b, H, L, D))
        out["keys"] = st.gaussian("keys", (b, H, S, D))
        out["pi0"] = _distribution(st, "pi0", (b, H, S))
    elif fn in ("mgk.attention", "mgk.linear_attention"):
        out["q"] = st.gaussian("q", (b, H, L, D))
        out["keys"] = st.gaussian("keys", (b, H, S, R, D))
        out["v"] = st.gaussian("v", (b, H, S, E))
        if fn == "mgk.linear_attention":
            out["pi"] = _distribution(st, "pi", (b, H, S, R))
        if recipe.get("log_pi"):
            # float64 cases only: a rounded log_pi is a distribution only within its own dtype's
            # roundings, which the float64 baseline's check (float64 roundings) rejects
            # (mpmath, not libm: the same bits on every machine)
            import mpmath

            pi = _distribution(st, "pi", (b, H, S, R))
            out["log_pi"] = np.vectorize(
                lambda p: float(mpmath.log(mpmath.mpf(p))), otypes=[np.float64]
            )(pi)
        if recipe.get("sigma2"):
            out["sigma2"] = np.ldexp(1.0, (st.uniform("sigma2", (b, H, S, R)) * 4).astype(int) - 1)
        if recipe.get("mask"):
            mask = st.bernoulli("mask", (b, H, L, S), Fraction(3, 4))
            mask[:, :, 1::4, :] = False  # every fourth row empty: its output is 0
            out["mask"] = mask
    elif fn in ("hopfield.retrieve", "hopfield.energy"):
        out["xi"] = st.gaussian("xi", (b, H, L, D))
        out["X"] = st.gaussian("X", (b, H, S, D))
    elif fn == "meanfield.naive_step":
        out["m"] = st.gaussian("m", (b, L, D))
        out["J"] = _couplings(st, (L, L, D, D), keep_diagonal=True)
        out["x"] = st.gaussian("x", (b, L, D))
    elif fn in ("meanfield.adaptive_tap", "meanfield.deq_attention"):
        out["x"] = st.gaussian("x", (b, L, D))
        out["J"] = _couplings(st, (L, L, D, D), keep_diagonal=bool(recipe.get("diagonal")))
        if recipe.get("prior_precision"):
            # symmetric positive definite, dyadic entries (exact in every dtype)
            out["prior_precision"] = np.diag(np.full(D, 2.0)) + np.ldexp(
                np.ones((D, D)) - np.eye(D), -1
            )
    elif fn == "meanfield.ising_tap":
        out["x"] = st.gaussian("x", (b, L))
        J = _couplings(st, (L, L), keep_diagonal=False)
        out["J"] = np.ldexp(J + J.T, -1)  # symmetric, same row-sum bound
    else:
        raise ValueError(f"make_inputs: unknown variant function {fn!r}")
    return out


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
    raw = _inputs64(case)
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
    import importlib

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
    import importlib

    spec = FUNCTIONS[function]
    try:
        module = importlib.import_module(spec.module)
    except ImportError:
        return None
    return getattr(module, spec.attribute + "_vjp", None)


def grad_names(function: str) -> tuple[str, ...]:
    """``d<name>`` for each positional array argument of the function's vjp (those before
    grad_out), or () without a vjp."""
    import inspect

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


#: Case.function -> truth builder; merged into :data:`oracle.golden.TRUTH_BUILDERS`.
TRUTH_BUILDERS = {name: truth for name in FUNCTIONS}
#: Case.function -> inputs builder; merged into :data:`oracle.catalogue.INPUT_BUILDERS`.
INPUT_BUILDERS = {name: make_inputs for name in FUNCTIONS}


def required_members(case: Case) -> tuple[list[str], list[str]]:
    """(inputs, truth) member names a fixture file of ``case`` must hold (for verify)."""
    spec = FUNCTIONS[case.function]
    outputs = spec.outputs + (grad_names(case.function) if case.grads else ())
    inputs = list(spec.inputs) + (["grad_out"] if case.grads else [])
    return inputs, [n + s for n in outputs for s in ("", "_f64")]
