"""Every suite of the catalogue by name, case lookup, and the inputs of any case.

The attention suites (:mod:`oracle.catalogue.attention`: smoke, default, full) and the
variant suites (:mod:`oracle.catalogue.variants`: variants-smoke, variants-default) are
listed here. Further suites register with :func:`register_suite`; their cases set
``Case.function`` to the refattn function whose exact path gives the truth, add an inputs
builder to :data:`INPUT_BUILDERS`, and :mod:`oracle.fixtures.golden` dispatches on ``Case.function``
(``golden.TRUTH_BUILDERS``).

Examples
--------
>>> suite_names()[:3]
['smoke', 'default', 'full']
>>> smoke = suite("smoke")
>>> all(c.name in {d.name for d in suite("default")} for c in smoke)
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from oracle.catalogue import attention, variants
from oracle.catalogue.case import Case

__all__ = [
    "SUITES",
    "INPUT_BUILDERS",
    "suite_names",
    "suite",
    "get",
    "make_inputs",
    "register_suite",
    "unregister_suite",
]

#: The built-in (attention) suites; the variants' and registered suites follow them.
SUITES = attention.SUITES

#: Case.function -> inputs builder(case) -> dict of arrays.
INPUT_BUILDERS: dict[str, Callable[[Case], dict[str, np.ndarray]]] = {
    "attention": attention.make_inputs,
    **variants.INPUT_BUILDERS,
}


def _variant_suite(name):
    def factory():
        return [c for c in variants.variant_cases() if name in c.suites]

    return factory


_EXTRA_SUITES: dict[str, Callable[[], Iterable[Case]]] = {
    name: _variant_suite(name) for name in variants.SUITES
}


def register_suite(name: str, factory: Callable[[], Iterable[Case]]) -> None:
    """Register a further suite (the extension point for new case families).

    ``factory()`` returns the suite's cases; their names must not collide with the
    attention catalogue. Registration is idempotent for the same factory.
    """
    if name in SUITES:
        raise ValueError(f"register_suite: name {name!r} is a built-in suite")
    _EXTRA_SUITES[name] = factory


def unregister_suite(name: str) -> None:
    """Remove a suite added by :func:`register_suite` (nothing happens for an unknown name)."""
    _EXTRA_SUITES.pop(name, None)


def suite_names() -> list[str]:
    """Every suite: the built-in ones, then the registered ones (the variants) by name."""
    return list(SUITES) + sorted(_EXTRA_SUITES)


def suite(name: str) -> list[Case]:
    """The cases of suite ``name``, in catalogue order."""
    if name in _EXTRA_SUITES:
        return list(_EXTRA_SUITES[name]())
    if name not in SUITES:
        raise ValueError(f"suite: expected one of {suite_names()}, got {name!r}")
    return [c for c in attention.attention_cases().values() if name in c.suites]


def get(name: str) -> Case:
    """The case called ``name`` (searching registered suites too)."""
    catalogue = attention.attention_cases()
    if name in catalogue:
        return catalogue[name]
    for factory in _EXTRA_SUITES.values():
        for case in factory():
            if case.name == name:
                return case
    raise KeyError(f"get: no case named {name!r}")


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """Inputs of any case, bit-identical on every machine and NumPy version.

    Examples
    --------
    >>> inputs = make_inputs(get("basic-H2K2-L5S7-D8E8-f32"))
    >>> sorted(inputs), inputs["q"].shape, inputs["q"].dtype.name
    (['k', 'q', 'v'], (1, 2, 5, 8), 'float32')
    """
    return INPUT_BUILDERS[case.function](case)


# the merge_states family hooks itself into the variant machinery (suites merge-*)
from oracle.catalogue import merge_families as _merge_families  # noqa: E402

_merge_families.register(INPUT_BUILDERS, register_suite)

# the linear-attention family hooks itself in the same way (suites linear-*)
from oracle.catalogue import linear_inputs as _linear_inputs  # noqa: E402

_linear_inputs.register(INPUT_BUILDERS, register_suite)
