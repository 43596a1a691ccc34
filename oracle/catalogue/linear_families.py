"""Cases of :func:`refattn.linear_attention`: suites ``linear-smoke`` within ``linear-default``.

The four named forms of the linear-attention family (docs/linear.md): the gated delta rule
(``gdn``: scalar gate and beta, Gated DeltaNet / Qwen3-Next), Kimi Delta Attention (``kda``:
a vector gate and beta), GLA (``gla``: a vector gate, no beta) and simple GLA (``sgla``: a
scalar gate, no beta: RetNet, Lightning Attention), each in the four dtypes. Rows probe the
chunk boundaries of chunked kernels (T = 63, 65, 127, 129 around the chunk sizes 64 and
128), gates near 0 and down to -20 (products of a chunk's decays underflow), beta at 0 and 1,
the q/k normalisation on and off (and keys so short that its eps dominates), packed sequences
(``cu_seqlens`` with an empty and a one-token sequence), one decode step from a cached state
(T = 1 with ``initial_state``), grouped value heads (GVA: value head j reads key head ``j //
(HV / H)``), initial states, base-2 gates, gradients (dq, dk, dv, dg, dbeta, dh0 on the
``-grad`` rows) and two long rows of T = 65536 (compact fixtures: inputs regenerated on load).

Sizes in :class:`oracle.catalogue.case.Shapes`: ``H`` the value heads (HV), ``K`` the key heads
(H of refattn's docstring), ``L = S = T``, ``D`` the key dimension, ``E`` the value dimension,
``batch`` B. Names: ``lin-<form>-<tag>-B?H?K?-T?-D?E?-<dtype>``.

Truth (:mod:`oracle.catalogue.linear_inputs`): refattn's exact path (every element of ``o`` and
``final_state`` the exact real result rounded once; ``_f64`` rounded to float64), except for the
long rows (recipe ``truth`` = "float64-bounded"), whose truth is refattn's float64 recurrence
rounded once to the member's dtype together with the rigorous a-priori bound
:func:`refattn.linear.forward_error_bound` on its distance to the exact result (members
``bound_o``, ``bound_final_state``); the exact path at T = 65536 takes minutes per dtype.
Their fixtures say so (``truth_kind`` "float64-bounded" in the meta and the manifest entry).

Examples
--------
>>> from oracle import catalogue
>>> case = catalogue.get("lin-gdn-varlen-H2K2-T70-D8E8-f32")
>>> case.function, case.recipe["cu"]
('linear_attention', [0, 0, 1, 30, 30, 70])
"""

from __future__ import annotations

from oracle.catalogue.case import Case, Shapes, seed_of
from oracle.catalogue.names import DTYPE_TAGS, DTYPES

__all__ = ["SUITES", "FUNCTION", "FORMS", "linear_cases", "TRUTH_BOUNDED"]

SUITES = ("linear-smoke", "linear-default")
FUNCTION = "linear_attention"
#: The truth kind of the long rows: the float64 recurrence with its a-priori bound.
TRUTH_BOUNDED = "float64-bounded"

#: form -> (gate: None, "scalar" or "vector"; beta given)
FORMS = {
    "gdn": ("scalar", True),
    "kda": ("vector", True),
    "gla": ("vector", False),
    "sgla": ("scalar", False),
}

_SMOKE_DTYPES = ("float64", "float32")
_NORM = {"qk_l2norm": True}

# (form, tag, (B, HV, H, T, D, E), recipe, options, smoke, grads, description)
_ROWS = (
    ("gdn", "basic", (1, 2, 2, 16, 8, 8), {}, _NORM, True, False, "gated delta rule"),
    ("gdn", "chunk63", (1, 2, 2, 63, 8, 8), {"h0": True}, _NORM, False, False, "T = 64 - 1"),
    ("gdn", "chunk65", (1, 2, 2, 65, 8, 8), {"h0": True}, _NORM, False, False, "T = 64 + 1"),
    ("gdn", "chunk127", (1, 1, 1, 127, 8, 8), {}, _NORM, False, False, "T = 128 - 1"),
    ("gdn", "chunk129", (1, 1, 1, 129, 8, 8), {"h0": True}, _NORM, False, False, "T = 128 + 1"),
    ("gdn", "near0", (1, 2, 2, 65, 8, 8), {"gates": "near0"}, _NORM, False, False, "g ~ -1e-4"),
    (
        "gdn",
        "deep",
        (1, 2, 2, 65, 8, 8),
        {"gates": "deep", "h0": True},
        _NORM,
        False,
        False,
        "g in [-20, -2]: a chunk's decay products underflow",
    ),
    ("gdn", "beta01", (1, 2, 2, 65, 8, 8), {"beta": "edges"}, _NORM, False, False, "beta 0 or 1"),
    (
        "gdn",
        "nonorm",
        (1, 2, 2, 65, 8, 8),
        {"short_keys": True, "h0": True},
        {},
        False,
        False,
        "no q/k normalisation (keys of norm ~1)",
    ),
    (
        "gdn",
        "tinynorm",
        (1, 2, 2, 20, 8, 8),
        {"tiny_qk": True},
        _NORM,
        False,
        False,
        "q, k of norm ~2^-10: the normalisation's eps dominates",
    ),
    (
        "gdn",
        "varlen",
        (1, 2, 2, 70, 8, 8),
        {"cu": [0, 0, 1, 30, 30, 70], "h0": True},
        _NORM,
        False,
        False,
        "packed: an empty, a one-token and two longer sequences",
    ),
    (
        "gdn",
        "decode",
        (2, 2, 2, 1, 8, 8),
        {"h0": True},
        _NORM,
        True,
        False,
        "one decode step from a cached state",
    ),
    ("gdn", "gva", (1, 4, 1, 65, 8, 8), {"h0": True}, _NORM, False, False, "GVA: HV 4, H 1"),
    (
        "gdn",
        "exp2",
        (1, 2, 2, 65, 8, 8),
        {"h0": True},
        {**_NORM, "gate_base": "2"},
        False,
        False,
        "base-2 gates",
    ),
    ("gdn", "grad", (1, 2, 1, 12, 4, 4), {"h0": True}, _NORM, False, True, "gradients"),
    ("kda", "basic", (1, 2, 2, 16, 8, 8), {}, _NORM, True, False, "Kimi Delta Attention"),
    ("kda", "chunk65", (1, 2, 2, 65, 8, 8), {"h0": True}, _NORM, False, False, "T = 64 + 1"),
    ("kda", "deep", (1, 2, 2, 65, 8, 8), {"gates": "deep"}, _NORM, False, False, "g to -20"),
    (
        "kda",
        "varlen",
        (1, 2, 2, 70, 8, 8),
        {"cu": [0, 1, 1, 40, 70], "h0": True},
        _NORM,
        False,
        False,
        "packed sequences",
    ),
    ("kda", "decode", (2, 2, 2, 1, 8, 8), {"h0": True}, _NORM, False, False, "decode step"),
    ("kda", "exp2", (1, 2, 2, 65, 8, 8), {}, {**_NORM, "gate_base": "2"}, False, False, "base 2"),
    ("kda", "grad", (1, 2, 2, 10, 4, 4), {"h0": True}, _NORM, False, True, "gradients"),
    ("gla", "basic", (1, 2, 2, 16, 8, 8), {"short_keys": True}, {}, True, False, "GLA"),
    (
        "gla",
        "chunk129",
        (1, 1, 1, 129, 8, 8),
        {"short_keys": True, "h0": True},
        {},
        False,
        False,
        "T = 128 + 1",
    ),
    (
        "gla",
        "varlen",
        (1, 2, 2, 70, 8, 8),
        {"short_keys": True, "cu": [0, 0, 1, 30, 30, 70], "h0": True},
        {},
        False,
        False,
        "packed sequences",
    ),
    ("gla", "grad", (1, 2, 2, 10, 4, 4), {"short_keys": True}, {}, False, True, "gradients"),
    ("sgla", "basic", (1, 2, 2, 16, 8, 8), {"short_keys": True}, {}, True, False, "simple GLA"),
    (
        "sgla",
        "chunk65",
        (1, 2, 2, 65, 8, 8),
        {"short_keys": True, "h0": True},
        {},
        False,
        False,
        "T = 64 + 1",
    ),
    (
        "sgla",
        "deep",
        (1, 2, 2, 65, 8, 8),
        {"short_keys": True, "gates": "deep"},
        {},
        False,
        False,
        "g to -20",
    ),
    (
        "sgla",
        "exp2",
        (1, 2, 2, 65, 8, 8),
        {"short_keys": True, "h0": True},
        {"gate_base": "2"},
        False,
        False,
        "base 2",
    ),
    ("sgla", "grad", (1, 2, 2, 10, 4, 4), {"short_keys": True}, {}, False, True, "gradients"),
    (
        "gdn",
        "long",
        (1, 1, 1, 65536, 4, 4),
        {"compact": True, "truth": TRUTH_BOUNDED, "h0": True},
        _NORM,
        False,
        False,
        "T = 65536 (float64 truth with its a-priori bound)",
    ),
    (
        "sgla",
        "long",
        (1, 1, 1, 65536, 4, 4),
        {"compact": True, "truth": TRUTH_BOUNDED, "short_keys": True},
        {},
        False,
        False,
        "T = 65536 (float64 truth with its a-priori bound)",
    ),
)


def _shape_tag(shapes: Shapes) -> str:
    batch = f"B{shapes.batch}" if shapes.batch != 1 else ""
    return f"{batch}H{shapes.H}K{shapes.K}-T{shapes.L}-D{shapes.D}E{shapes.E}"


def _cases_of(row) -> list[Case]:
    form, tag, (batch, hv, heads, length, dim, edim), recipe, options, smoke, grads, text = row
    shapes = Shapes(batch=batch, H=hv, K=heads, L=length, S=length, D=dim, E=edim)
    out = []
    for dtype in DTYPES:
        name = f"lin-{form}-{tag}-{_shape_tag(shapes)}-{DTYPE_TAGS[dtype]}"
        suites = SUITES if smoke and dtype in _SMOKE_DTYPES else SUITES[1:]
        out.append(
            Case(
                name,
                suites,
                "conformance",
                dtype,
                shapes,
                options=dict(options),
                recipe={"form": form, **recipe},
                seed=seed_of(name),
                grads=grads,
                description=f"{form}: {text}",
                function=FUNCTION,
            )
        )
    return out


_CATALOGUE: list[Case] | None = None


def linear_cases() -> list[Case]:
    """Every linear-attention case (both suites), in catalogue order."""
    global _CATALOGUE
    if _CATALOGUE is None:
        _CATALOGUE = [case for row in _ROWS for case in _cases_of(row)]
    return list(_CATALOGUE)
