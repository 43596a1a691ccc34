"""The case catalogue: named cases in suites, their inputs and their seeds.

* :mod:`oracle.catalogue.names` -- dtypes, dtype tags, categories, option keywords.
* :mod:`oracle.catalogue.case` -- :class:`Case` and :class:`Shapes` (JSON specs, seeds).
* :mod:`oracle.catalogue.seeding` -- machine-independent random streams.
* :mod:`oracle.catalogue.attention` -- the attention suites smoke, default, full.
* :mod:`oracle.catalogue.variants` -- the suites of refattn's variants.
* :mod:`oracle.catalogue.registry` -- every suite by name, case lookup, inputs of any case.

Dependencies point down that list; this package re-exports the names a user needs.

Examples
--------
>>> from oracle import catalogue
>>> case = catalogue.get("basic-H2K2-L5S7-D8E8-f32")
>>> case.dtype, sorted(catalogue.make_inputs(case))
('float32', ['k', 'q', 'v'])
"""

from __future__ import annotations

from oracle.catalogue.attention import case_allowed
from oracle.catalogue.case import Case, Shapes, seed_of
from oracle.catalogue.names import (
    ARRAY_OPTIONS,
    ATTENTION_OPTIONS,
    CATEGORIES,
    DTYPE_TAGS,
    DTYPES,
    OPTION_NAMES,
)
from oracle.catalogue.registry import (
    INPUT_BUILDERS,
    SUITES,
    get,
    make_inputs,
    register_suite,
    suite,
    suite_names,
    unregister_suite,
)

__all__ = [
    "Case",
    "Shapes",
    "seed_of",
    "SUITES",
    "CATEGORIES",
    "DTYPES",
    "DTYPE_TAGS",
    "OPTION_NAMES",
    "ATTENTION_OPTIONS",
    "ARRAY_OPTIONS",
    "INPUT_BUILDERS",
    "suite_names",
    "suite",
    "get",
    "make_inputs",
    "register_suite",
    "unregister_suite",
    "case_allowed",
]
