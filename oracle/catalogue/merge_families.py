"""Case family of :func:`refattn.merge_states`: suites ``merge-smoke`` within ``merge-default``.

Each case holds P attention states ``outs (P, 1, H, L, E)``, ``lses (P, 1, H, L)`` in the case
dtype and the exact merge of those (rounded) states as its truth (``Case.function =
"merge_states"``; judged by the variant machinery of :mod:`oracle.judging.judge`, which calls
``impl(outs=..., lses=..., **options)``, options ``lse_base`` for base-2 cases; see
:mod:`oracle.conventions.merge` for the pairwise convention ``impl(out_a, lse_a, out_b,
lse_b)``).

Families (every dtype): random states; empty states (lse -inf, out 0) among live ones; rows
where every state is empty; large lse gaps; base-2 lses; states of attention over S split at
tile boundaries (multiples of 64) and at ragged ones (the states are the exact chunk
attention rounded to the case dtype, so the truth is the merge of the rounded states: truth
(1) of docs/conventions.md); chunked prefill (a block of L queries, the last L positions,
against its cached keys in full and its own keys causally: merged, causal bottom-right
attention over all S keys); 64 states.

Examples
--------
>>> from oracle import catalogue
>>> case = catalogue.get("merge-empty-P8-H2L4E8-f32")
>>> inputs = catalogue.make_inputs(case)
>>> inputs["outs"].shape, inputs["lses"].shape, inputs["outs"].dtype.name
((8, 1, 2, 4, 8), (8, 1, 2, 4), 'float32')
"""

from __future__ import annotations

import functools

import numpy as np

import refattn
from oracle.catalogue import seeding, variants
from oracle.catalogue.case import Case, Shapes, seed_of
from oracle.catalogue.merge_large_families import LARGE_FAMILIES, large_lses
from oracle.catalogue.names import DTYPE_TAGS, DTYPES
from oracle.catalogue.seeding import Streams

__all__ = ["SUITES", "FUNCTION", "merge_cases", "make_inputs", "register"]

SUITES = ("merge-smoke", "merge-default")
FUNCTION = "merge_states"

# (tag, P, recipe, options, in smoke)
_FAMILIES = (
    ("merge-random-P2", 2, {"style": "random"}, {}, True),
    ("merge-empty-P8", 8, {"style": "random", "empty": 3, "empty_rows": 1}, {}, True),
    ("merge-allempty-P4", 4, {"style": "random", "empty_rows": 1}, {}, False),
    ("merge-gaps-P16", 16, {"style": "gaps"}, {}, False),
    ("merge-base2-P8", 8, {"style": "random", "empty": 2}, {"lse_base": 2}, True),
    ("merge-chunks-tile-P4", 4, {"style": "chunks", "cuts": (64, 128, 192), "S": 256}, {}, False),
    (
        "merge-chunks-ragged-P5",
        5,
        {"style": "chunks", "cuts": (37, 100, 129, 250), "S": 300},
        {},
        False,
    ),
    (
        "merge-chunks-base2-P3",
        3,
        {"style": "chunks", "cuts": (64, 97), "S": 160},
        {"lse_base": 2},
        False,
    ),
    ("merge-many-P64", 64, {"style": "random", "empty": 10, "empty_rows": 1}, {}, False),
    # chunked prefill: the L query rows are the last L positions; the cache (split at the cuts)
    # is attended in full, the block's own keys causally (together: causal bottom-right)
    ("merge-prefill-P2", 2, {"style": "chunks", "cuts": (), "S": 68, "prefill": True}, {}, False),
    (
        "merge-prefill-split-P3",
        3,
        {"style": "chunks", "cuts": (64,), "S": 133, "prefill": True},
        {},
        False,
    ),
)
_FAMILIES += LARGE_FAMILIES  # large lses, base-2 empty states: merge_large_families
_SHAPES = Shapes(batch=1, H=2, K=2, L=4, S=0, D=16, E=8)  # H2 L4 E8 (S, D: of the chunk attention)


def merge_cases() -> list[Case]:
    cases = []
    for tag, states, recipe, options, smoke in _FAMILIES:
        shapes = _SHAPES._replace(S=int(recipe.get("S", states)))
        for dtype in DTYPES:
            name = f"{tag}-H{shapes.H}L{shapes.L}E{shapes.E}-{DTYPE_TAGS[dtype]}"
            suites = SUITES if smoke and dtype in ("float64", "float32") else SUITES[1:]
            cases.append(
                Case(
                    name,
                    suites,
                    "conformance",
                    dtype,
                    shapes,
                    options=dict(options),
                    recipe={**recipe, "P": states},
                    seed=seed_of(name),
                    description=f"merge of {states} states ({recipe['style']})",
                    function=FUNCTION,
                )
            )
    return cases


@functools.lru_cache(maxsize=64)
def _chunk_states_of(name: str):
    """(outs, lses) float64 of a chunk case, cached by name (exact chunk attention costs ~1 s;
    every validate run rebuilds its fixtures). Callers get copies."""
    case = next(c for c in merge_cases() if c.name == name)
    return _chunk_states(case, Streams(case.seed))


def _chunk_states(case: Case, st: Streams):
    n, recipe = case.shapes, case.recipe
    q = seeding.to_dtype(st.gaussian("q", (n.H, n.L, n.D)), case.dtype)
    k = seeding.to_dtype(st.gaussian("k", (n.H, n.S, n.D)), case.dtype)
    v = seeding.to_dtype(st.gaussian("v", (n.H, n.S, n.E)), case.dtype)
    prefill = bool(recipe.get("prefill"))
    edges = [0, *recipe["cuts"], *([n.S - n.L] if prefill else []), n.S]
    outs, lses = [], []
    for a, b in zip(edges, edges[1:], strict=False):
        own_block = prefill and b == n.S  # the query block against its own keys: causal
        out, lse = refattn.attention(
            q,
            k[:, a:b],
            v[:, a:b],
            causal=own_block,
            return_lse=True,
            precision="exact",
            out_dtype=case.dtype,
            lse_base=case.options.get("lse_base", "e"),
        )
        outs.append(np.asarray(out, dtype=np.float64))
        lses.append(np.asarray(lse, dtype=np.float64))
    return np.stack(outs)[:, None], np.stack(lses)[:, None]


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """outs (P, 1, H, L, E), lses (P, 1, H, L) in the case dtype, bit-identical everywhere."""
    n, recipe = case.shapes, case.recipe
    states = int(recipe["P"])
    st = Streams(case.seed)
    if recipe["style"] == "chunks":
        outs, lses = (np.copy(x) for x in _chunk_states_of(case.name))
    else:
        outs = st.gaussian("outs", (states, 1, n.H, n.L, n.E))
        scale = 3.0 if recipe["style"] in ("random", "large") else 1.0
        lses = st.gaussian("lses", (states, 1, n.H, n.L)) * scale
        if recipe["style"] == "large":  # near +-1e4: exp over/underflows without the max
            lses = large_lses(lses / scale, recipe["sign"])
        if recipe["style"] == "gaps":  # states 1e1 .. 1e4 below the leader
            lses = lses - np.ldexp(1.0, (np.arange(states) % 14))[:, None, None, None]
        empty = int(recipe.get("empty", 0))
        if empty:
            which = np.argsort(st.uniform("empty", (states,)))[:empty]
            lses[which] = -np.inf
            outs[which] = 0.0
        if recipe.get("empty_rows"):
            lses[:, :, :, 0] = -np.inf
            outs[:, :, :, 0] = 0.0
    return {
        "outs": seeding.to_dtype(outs, case.dtype),
        "lses": seeding.to_dtype(lses, case.dtype),
    }


def natural_scale(inputs, name: str, truth64: np.ndarray) -> np.ndarray:
    """out: the largest |out_pe| of a live state in the row; lse: 1 + the largest finite
    |lse_p| of the row (an lse carries absolute error ~ u |lse|)."""
    outs = np.asarray(inputs["outs"], dtype=np.float64)
    lses = np.asarray(inputs["lses"], dtype=np.float64)
    live = np.isfinite(lses)
    if name == "out":
        size = np.abs(np.where(live[..., None], outs, 0.0)).max(axis=(0, -1))
        return np.broadcast_to(np.maximum(size, np.finfo(float).tiny)[..., None], truth64.shape)
    return 1.0 + np.abs(np.where(live, lses, 0.0)).max(axis=0)


def condition(case: Case) -> float:
    """``3 + P``: an lse_p error eta moves weight w_p by ``w_p eta |d_p| <= eta / e`` (w_p <=
    e^-|d_p|), P such terms in out and in the normaliser."""
    return 3.0 + int(case.recipe["P"])


def register(input_builders, register_suite) -> None:
    """Add the function to the variant machinery (idempotent): its :class:`Function` row, truth
    and inputs builders (into ``input_builders``, the catalogue's), case-name prefix and the
    suites (with the catalogue's ``register_suite``)."""
    variants.FUNCTIONS[FUNCTION] = variants.Function(
        "refattn", "merge_states", ("outs", "lses"), ("out", "lse"), _roundings, 1
    )
    variants.PREFIXES[FUNCTION] = "merge"
    variants.TRUTH_BUILDERS[FUNCTION] = variants.truth
    input_builders[FUNCTION] = make_inputs
    for suite in SUITES:
        register_suite(suite, lambda suite=suite: [c for c in merge_cases() if suite in c.suites])


def _roundings(case: Case) -> int:
    return 4 * int(case.recipe["P"]) + 8
