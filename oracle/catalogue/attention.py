"""The attention cases of the catalogue (suites smoke, default, full) and their inputs.

A :class:`~oracle.catalogue.case.Case` is a complete, JSON-serialisable description of one
attention problem: its shapes (in the shape letters of docs/conventions.md), the dtype of its
inputs, the scalar keywords of :func:`refattn.attention`, a *recipe* for the inputs, and a
seed. The catalogue is a pure function of this module's source: names are stable (they never
depend on catalogue order) and each case's seed is derived from its name.

Suites
------
``"smoke"`` (a handful of tiny cases, < 30 s to generate), ``"default"`` (every option of
``refattn.attention`` and ``refattn.attention_vjp`` and every adversarial input, each in all
four dtypes, because an implementation is validated one dtype at a time, plus 24 kernel-scale
rows per dtype: lengths around the 64/128 tiles, several query and key tiles, L > S
bottom_right, real head dims, GQA, ragged batches and the kernel input distributions over 300
keys, and five more in float16 and bfloat16 for 16-bit accumulators, 23 long rows per dtype over
1k to 128k keys whose fixtures regenerate their inputs, 8 worst-case rows per dtype and 10
refusal rows per dtype) and
``"full"`` (default plus larger shapes: S = 4096 with D = 64, sliding windows over 1024 keys, D
= 128, batches of padded sequences). smoke is a subset of default, which is a subset of full.
``"kernel"`` holds every kernel-scale case
(:func:`oracle.catalogue.attention_kernel_families.kernel_entries`), the costly ones (S up to
65536, a 32k-key decode) included.

Categories
----------
``"conformance"``: the pinned semantics; a peer that disagrees is wrong or uses another
convention. ``"robustness"``: NaN/Inf poison at *excluded* key, value or bias positions;
refattn guarantees the poison never reaches the output, peers legitimately differ (many
compute ``0 * NaN``), so these cases fail a validation only under ``--strict``.
``"refusal"``: malformed inputs a kernel must refuse with an error (no truth; fail only under
``--strict``, :mod:`oracle.catalogue.attention_refusal_families`).

The rows live in :mod:`oracle.catalogue.attention_families` (semantics, adversarial inputs,
gradients), :mod:`oracle.catalogue.attention_option_families` (sinks, kv_lengths, float8) and
:mod:`oracle.catalogue.attention_kernel_families` (kernel-scale),
:mod:`oracle.catalogue.attention_long_families` (long rows: 2k to 128k keys),
:mod:`oracle.catalogue.attention_worst_families` (worst cases),
:mod:`oracle.catalogue.attention_refusal_families` (refusal cases); their inputs in
:mod:`oracle.catalogue.attention_inputs` (recipe keys, seeding, poison).
"""

from __future__ import annotations

from oracle.catalogue.attention_entry import KERNEL_SUITES, SUITES, Entry
from oracle.catalogue.attention_families import entries
from oracle.catalogue.attention_inputs import case_allowed, make_inputs
from oracle.catalogue.attention_kernel_families import (
    DEFAULT_TILE_LENGTHS,
    TILE_LENGTHS,
    kernel_entries,
)
from oracle.catalogue.attention_long_families import long_entries
from oracle.catalogue.attention_refusal_families import refusal_entries
from oracle.catalogue.attention_tile_families import tile_entries
from oracle.catalogue.attention_worst_families import worst_entries
from oracle.catalogue.case import Case, seed_of
from oracle.catalogue.names import DTYPE_TAGS, DTYPES

__all__ = [
    "SUITES",
    "KERNEL_SUITES",
    "TILE_LENGTHS",
    "DEFAULT_TILE_LENGTHS",
    "attention_cases",
    "make_inputs",
    "case_allowed",
]


def _expand(entry: Entry) -> list[Case]:
    cases = []
    for dtype in DTYPES:
        in_smoke = dtype in entry.smoke
        in_default = in_smoke or dtype in entry.default
        in_full = in_default or dtype in entry.full
        membership = zip(SUITES[:3], (in_smoke, in_default, in_full), strict=True)
        suites = tuple(s for s, member in membership if member)
        suites += tuple(s for s in entry.extra if s not in suites)
        if not suites:
            continue
        name = f"{entry.tag}-{entry.shapes.tag()}-{DTYPE_TAGS[dtype]}"
        cases.append(
            Case(
                name=name,
                suites=suites,
                category=entry.category,
                dtype=dtype,
                shapes=entry.shapes,
                options=dict(entry.options),
                recipe=dict(entry.recipe),
                seed=seed_of(name),
                grads=entry.grads,
                description=entry.description,
            )
        )
    return cases


_CATALOGUE: dict[str, Case] | None = None


def attention_cases() -> dict[str, Case]:
    """Every attention case (all three suites) by name, in catalogue order."""
    global _CATALOGUE
    if _CATALOGUE is None:
        catalogue: dict[str, Case] = {}
        for entry in [
            *entries(),
            *kernel_entries(),
            *long_entries(),
            *worst_entries(),
            *tile_entries(),
            *refusal_entries(),
        ]:
            for case in _expand(entry):
                if case.name in catalogue:
                    raise RuntimeError(f"oracle.catalogue: duplicate case name {case.name!r}")
                catalogue[case.name] = case
        _CATALOGUE = catalogue
    return _CATALOGUE
