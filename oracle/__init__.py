"""refattn's oracle: golden fixtures, tolerance policy, validation of implementations.

* :func:`generate` / :func:`verify` / :func:`load` / :func:`build` -- golden fixtures
  (:mod:`oracle.fixtures.golden`) of the case catalogue (:mod:`oracle.catalogue`, :func:`suite`).
* :func:`validate` -- run an implementation on a suite or a fixture directory and get a
  :class:`Report` (:mod:`oracle.run.validate`, :mod:`oracle.judging.results`); every fixture is
  judged by
  :func:`check_fixture` (:mod:`oracle.judging.judge`) under the one tolerance policy
  (:mod:`oracle.judging.tolerance`, against the textbook baseline of
  :mod:`oracle.reading.baseline`) with
  convention diagnosis (:mod:`oracle.diagnose.diagnosis`).
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
    "Report": ("oracle.report.run_report", "Report"),
    "CaseResult": ("oracle.judging.results", "CaseResult"),
    "check_fixture": ("oracle.judging.judge", "check_fixture"),
    "generate": ("oracle.fixtures.golden", "generate"),
    "verify": ("oracle.fixtures.golden", "verify"),
    "load": ("oracle.fixtures.golden", "load"),
    "build": ("oracle.fixtures.golden", "build"),
    "Fixture": ("oracle.fixtures.golden", "Fixture"),
    "Case": ("oracle.catalogue", "Case"),
    "suite": ("oracle.catalogue", "suite"),
    "load_safetensors": ("oracle.export", "load_safetensors"),
}

_MODULES = {
    "tolerance": "oracle.judging.tolerance",
    "validate": "oracle.run.validate",
    "export": "oracle.export",
    "power": "oracle.power",
}


def __getattr__(name):
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    if name in _MODULES:
        # oracle.validate and oracle.power are modules callable as their function
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'oracle' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
