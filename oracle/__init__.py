"""refattn's oracle: golden fixtures, tolerance policy, validation of implementations.

* :func:`generate` / :func:`verify` / :func:`load` / :func:`build` -- golden fixtures
  (:mod:`oracle.golden`) of the case catalogue (:mod:`oracle.catalogue`, :func:`suite`).
* :func:`validate` -- run an implementation on a suite or a fixture directory and get a
  :class:`Report` (:mod:`oracle.validate`, :mod:`oracle.results`); every fixture is judged by
  :func:`check_fixture` (:mod:`oracle.judge`) under the one tolerance policy
  (:mod:`oracle.tolerance`, against the textbook baseline of :mod:`oracle.baseline`) with
  convention diagnosis (:mod:`oracle.diagnose`).
* Command line: ``refattn-oracle`` (:mod:`oracle.cli`); pytest: ``pytest --pyargs oracle
  --refattn-impl module:function`` (:mod:`oracle.pytest_plugin`).

Names are imported lazily (PEP 562) so that importing ``oracle`` -- which pytest does for
the plugin in every run once refattn is installed -- stays cheap.
"""

from __future__ import annotations

import importlib

__all__ = [
    "validate",
    "Report",
    "CaseResult",
    "check_fixture",
    "generate",
    "verify",
    "load",
    "build",
    "Fixture",
    "Case",
    "suite",
    "tolerance",
    "export",
    "load_safetensors",
    "power",
]

_LAZY = {
    "Report": ("oracle.results", "Report"),
    "CaseResult": ("oracle.results", "CaseResult"),
    "check_fixture": ("oracle.judge", "check_fixture"),
    "generate": ("oracle.golden", "generate"),
    "verify": ("oracle.golden", "verify"),
    "load": ("oracle.golden", "load"),
    "build": ("oracle.golden", "build"),
    "Fixture": ("oracle.golden", "Fixture"),
    "Case": ("oracle.catalogue", "Case"),
    "suite": ("oracle.catalogue", "suite"),
    "load_safetensors": ("oracle.export", "load_safetensors"),
}


def __getattr__(name):
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    if name in ("tolerance", "validate", "export", "power"):
        # oracle.validate is the module, callable as the function (see oracle.validate)
        return importlib.import_module(f"oracle.{name}")
    raise AttributeError(f"module 'oracle' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
