"""The variant case families: one row per refattn variant function and option set.

:func:`entries` lists the rows in catalogue order; :func:`oracle.catalogue.variants.variant_cases`
expands each into one case per dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oracle.catalogue.case import Shapes
from oracle.catalogue.names import DTYPES

__all__ = ["Entry", "entries"]

_ALL = DTYPES
_SMOKE = ("float64", "float32")


@dataclass(frozen=True)
class Entry:
    """A catalogue row: one case per dtype of ``function`` (a :data:`FUNCTIONS` key of
    :mod:`oracle.catalogue.variants`), member of the suites its dtypes say."""

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
    return Shapes(batch=batch, H=H, K=H, L=L, S=S, D=D, E=E)


def _sites(batch, N, d):
    return Shapes(batch=batch, H=1, K=1, L=N, S=N, D=d, E=d)


_SMALL_MIX = _mix(1, 2, 4, 6, 4, 4)
_MIX = _mix(1, 2, 6, 10, 8, 8)


def entries() -> list[Entry]:
    """Every variant row, in catalogue order (one family after another)."""
    return [
        *gmm_rows(),
        *mgk_rows(),
        *hopfield_rows(),
        *mgk_gradient_rows(),
        *other_gradient_rows(),
        *meanfield_rows(),
    ]


def gmm_rows() -> list[Entry]:
    """GMM attention (Movellan & Gabbur eqs. (13)-(14)) and its key and prior adaptation."""
    e = Entry
    return [
        # --- GMM attention (Movellan & Gabbur eqs. (13)-(14)) ----------------------------------
        e(
            "gmm.attention",
            "gmm-attn-basic",
            _SMALL_MIX,
            "one EM step, uniform prior (plain attention)",
            smoke=_SMOKE,
            options={"alpha": 0.5, "beta": 0.5, "iters": 1},
        ),
        e(
            "gmm.attention",
            "gmm-attn-iters3",
            _MIX,
            "three EM steps, scalar alpha and beta",
            options={"alpha": 0.25, "beta": 0.5, "iters": 3},
        ),
        e(
            "gmm.attention",
            "gmm-attn-magnitude",
            _MIX,
            "magnitude prior (eqs. (15)-(18)), two steps",
            options={"alpha": 0.125, "beta": 0.25, "prior": "magnitude", "iters": 2},
        ),
        e(
            "gmm.attention",
            "gmm-attn-prior-array",
            _MIX,
            "log prior array, v_init, two steps",
            options={"alpha": 0.25, "beta": 0.5, "iters": 2},
            recipe={"prior": True, "v_init": True},
        ),
        e(
            "gmm.attention",
            "gmm-attn-per-unit",
            _MIX,
            "per-unit alpha and beta arrays (root of eq. (12)), two steps",
            recipe={"alpha": True, "beta": True},
            options={"iters": 2},
        ),
        e(
            "gmm.adapt_keys",
            "gmm-keys",
            _SMALL_MIX,
            "key adaptation, paper form (eq. (28))",
            smoke=_SMOKE,
            options={"alpha": 0.5, "gamma": 1.0, "iters": 1, "form": "paper"},
        ),
        e(
            "gmm.adapt_keys",
            "gmm-keys-map",
            _MIX,
            "key adaptation, MAP form, magnitude prior, two iterations",
            options={"alpha": 0.25, "gamma": 0.5, "iters": 2, "form": "map", "prior": "magnitude"},
        ),
        e(
            "gmm.adapt_priors",
            "gmm-priors",
            _SMALL_MIX,
            "Dirichlet prior adaptation, paper form (eq. (33))",
            smoke=_SMOKE,
            options={"alpha": 0.5, "eta": 1.0, "iters": 1, "form": "paper"},
        ),
        e(
            "gmm.adapt_priors",
            "gmm-priors-map",
            _MIX,
            "prior adaptation, MAP form, three iterations",
            options={"alpha": 0.25, "eta": 2.0, "iters": 3, "form": "map"},
        ),
    ]


def mgk_rows() -> list[Entry]:
    """MGK and MLK attention (Nguyen et al. 2022)."""
    e = Entry
    return [
        # --- MGK / MLK (Nguyen et al. 2022) ---------------------------------------------------
        e(
            "mgk.attention",
            "mgk-soft",
            _SMALL_MIX,
            "soft MGK, R = 2, uniform pi",
            smoke=_SMOKE,
            options={"sigma2": 2.0},
            recipe={"R": 2},
        ),
        e(
            "mgk.attention",
            "mgk-soft-logpi",
            _MIX,
            "soft MGK, R = 2, log_pi array, sigma2 = 4",
            default=("float64",),
            options={"sigma2": 4.0},
            recipe={"R": 2, "log_pi": True},
        ),
        e(
            "mgk.attention",
            "mgk-hard",
            _MIX,
            "hard MGK (N9), R = 2",
            options={"sigma2": 2.0, "mode": "hard"},
            recipe={"R": 2},
        ),
        e(
            "mgk.attention",
            "mgk-normalized",
            _MIX,
            "normalized soft MGK, sigma2 per component",
            options={"normalized": True},
            recipe={"R": 2, "sigma2": True},
        ),
        e(
            "mgk.attention",
            "mgk-mask",
            _MIX,
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
            _MIX,
            "hard MGK, window (3, 1), top_left",
            options={"sigma2": 2.0, "mode": "hard", "window": (3, 1)},
            recipe={"R": 3},
        ),
        e(
            "mgk.linear_attention",
            "mlk-basic",
            _SMALL_MIX,
            "linear MLK attention, R = 2",
            smoke=_SMOKE,
            recipe={"R": 2},
        ),
        e(
            "mgk.linear_attention",
            "mlk-causal",
            _MIX,
            "causal linear MLK attention, R = 3",
            options={"causal": True},
            recipe={"R": 3},
        ),
    ]


def hopfield_rows() -> list[Entry]:
    """Modern Hopfield retrieval and energy (Ramsauer et al.)."""
    e = Entry
    return [
        # --- Hopfield (Ramsauer et al.) -------------------------------------------------------
        e(
            "hopfield.retrieve",
            "hopfield-retrieve",
            _SMALL_MIX,
            "one retrieval update",
            smoke=_SMOKE,
            options={"beta": 0.5, "steps": 1},
        ),
        e(
            "hopfield.retrieve",
            "hopfield-retrieve-steps3",
            _MIX,
            "three updates, beta 1/4",
            options={"beta": 0.25, "steps": 3},
        ),
        e(
            "hopfield.energy",
            "hopfield-energy",
            _SMALL_MIX,
            "energy (E), constant 0",
            smoke=_SMOKE,
            options={"beta": 0.5},
        ),
        e(
            "hopfield.energy",
            "hopfield-energy-constant",
            _MIX,
            "energy with the paper's constant",
            options={"beta": 2.0, "constant": True},
        ),
    ]


def mgk_gradient_rows() -> list[Entry]:
    """Gradients of MGK and MLK attention (exact vjps in the fixture)."""
    e = Entry
    _mix(1, 2, 6, 10, 8, 8)
    return [
        # --- gradients (grads=True: exact vjps in the fixture; present only for the functions
        # whose module has a ``<function>_vjp``, see vjp_of) ------------------------------------
        e(
            "mgk.attention",
            "mgk-soft-grad",
            _SMALL_MIX,
            "vjp of soft MGK, R = 2",
            smoke=("float64",),
            options={"sigma2": 2.0},
            recipe={"R": 2},
            grads=True,
        ),
        e(
            "mgk.attention",
            "mgk-hard-grad",
            _SMALL_MIX,
            "vjp of hard MGK (ties split equally)",
            options={"sigma2": 2.0, "mode": "hard"},
            recipe={"R": 2},
            grads=True,
        ),
        e(
            "mgk.attention",
            "mgk-mask-grad",
            _SMALL_MIX,
            "vjp of soft MGK with a random mask",
            options={"sigma2": 2.0},
            recipe={"R": 2, "mask": True},
            grads=True,
        ),
        e(
            "mgk.linear_attention",
            "mlk-grad",
            _SMALL_MIX,
            "vjp of linear MLK attention",
            smoke=("float64",),
            recipe={"R": 2},
            grads=True,
        ),
        e(
            "mgk.linear_attention",
            "mlk-causal-grad",
            _SMALL_MIX,
            "vjp of causal linear MLK",
            options={"causal": True},
            recipe={"R": 2},
            grads=True,
        ),
    ]


def other_gradient_rows() -> list[Entry]:
    """Gradients of Hopfield retrieval, GMM attention and adaptation, and the mean-field solvers."""
    e = Entry
    _mix(1, 2, 6, 10, 8, 8)
    return [
        e(
            "hopfield.retrieve",
            "hopfield-retrieve-grad",
            _SMALL_MIX,
            "vjp of one retrieval update",
            smoke=("float64",),
            options={"beta": 0.5, "steps": 1},
            grads=True,
        ),
        e(
            "hopfield.retrieve",
            "hopfield-retrieve-steps2-grad",
            _SMALL_MIX,
            "vjp of two updates",
            options={"beta": 0.25, "steps": 2},
            grads=True,
        ),
        e(
            "gmm.attention",
            "gmm-attn-grad",
            _SMALL_MIX,
            "vjp of one EM step",
            smoke=("float64",),
            options={"alpha": 0.5, "beta": 0.5, "iters": 1},
            grads=True,
        ),
        e(
            "gmm.attention",
            "gmm-attn-iters2-grad",
            _SMALL_MIX,
            "vjp of two EM steps",
            options={"alpha": 0.25, "beta": 0.5, "iters": 2},
            grads=True,
        ),
        e(
            "gmm.adapt_keys",
            "gmm-keys-grad",
            _SMALL_MIX,
            "vjp of key adaptation (eq. (28))",
            smoke=("float64",),
            options={"alpha": 0.5, "gamma": 1.0, "iters": 1, "form": "paper"},
            grads=True,
        ),
        e(
            "gmm.adapt_priors",
            "gmm-priors-grad",
            _SMALL_MIX,
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
    ]


def meanfield_rows() -> list[Entry]:
    """Mean-field attention (Bal 2021): naive, adaptive TAP, Ising TAP, DEQ."""
    e = Entry
    _mix(1, 2, 4, 6, 4, 4)
    _mix(1, 2, 6, 10, 8, 8)
    return [
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
