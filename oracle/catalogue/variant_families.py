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
    return Shapes(batch, H, H, L, S, D, E)


def _sites(batch, N, d):
    return Shapes(batch, 1, 1, N, N, d, d)


def entries() -> list[Entry]:
    e = Entry
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
