"""pytest plugin of the oracle: one test per case against your implementation.

Usage (the plugin is registered by the ``pytest11`` entry point ``refattn_oracle`` when refattn
is installed; from a source checkout that is not installed add ``-p oracle.pytest_plugin``, but
never both: pluggy refuses to register one module under two names)::

    pytest --pyargs oracle --refattn-impl mypkg.attn:attention [--refattn-suite default]
           [--refattn-fixtures DIR] [--refattn-dtype float16] [--refattn-skips FILE]
           [--refattn-xfails FILE] [--refattn-strict] [--refattn-grads]

The current directory is put on ``sys.path`` (as ``refattn-oracle validate --impl`` does),
so a module next to where pytest runs is found. Each option has an environment twin
(``REFATTN_IMPL``, ``REFATTN_SUITE``, ``REFATTN_FIXTURES``,
``REFATTN_DTYPE``, ``REFATTN_SKIPS``, ``REFATTN_XFAILS``). ``--refattn-impl`` takes
``module:function`` or an adapter name. Test ids are the case names; a failure shows the worst
element, the threshold, the diagnosis and a one-line reproduction. Unsupported cases
(NotImplementedError) are skipped; robustness failures xfail unless ``--refattn-strict``.
The fp8 cases (float8 q, k, v with descales) are bfloat16 cases: ``--refattn-dtype bfloat16``
runs them; cases with ``sinks`` / ``kv_lengths`` pass those keywords (see
:mod:`oracle.judge` for the calling convention, ``dsinks`` included).

Skip/xfail files (like array-api-tests): one fnmatch pattern over case names per line, ``#``
starts a comment.

The plugin is inert unless an implementation is given: it only adds command-line options and
a report-header line; the tests live in :mod:`oracle.test_conformance`, which pytest collects
only when asked to (``--pyargs oracle`` or a path inside the package), never from a project's
own ``testpaths``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["settings", "read_patterns"]

_OPTIONS = {
    # name: (environment variable, default, help)
    "impl": ("REFATTN_IMPL", None, "implementation under test: module:function or an adapter name"),
    "suite": ("REFATTN_SUITE", None, "suite built in memory (default: smoke)"),
    "fixtures": ("REFATTN_FIXTURES", None, "fixture directory from `refattn-oracle generate`"),
    "dtype": ("REFATTN_DTYPE", "float32", "implementation dtype, or 'all'"),
    "skips": ("REFATTN_SKIPS", None, "file of case-name patterns to skip"),
    "xfails": ("REFATTN_XFAILS", None, "file of case-name patterns expected to fail"),
    "layout": ("REFATTN_LAYOUT", "bhld", "the implementation's layout: bhld, blhd, packed, paged"),
    "framework": ("REFATTN_FRAMEWORK", "numpy", "arrays it takes: numpy, torch, jax"),
    "device": ("REFATTN_DEVICE", "cpu", "device of torch tensors: cpu, cuda"),
}


def pytest_addoption(parser):
    group = parser.getgroup("refattn-oracle", "refattn oracle conformance tests")
    for name, (env, default, text) in _OPTIONS.items():
        group.addoption(
            f"--refattn-{name}",
            dest=f"refattn_{name}",
            default=None,
            help=f"{text} (env {env}; default {default})",
        )
    group.addoption(
        "--refattn-strict",
        dest="refattn_strict",
        action="store_true",
        default=False,
        help="robustness failures fail instead of xfail",
    )
    group.addoption(
        "--refattn-grads",
        dest="refattn_grads",
        action="store_true",
        default=False,
        help="also check impl.vjp on gradient cases",
    )


def settings(config) -> dict | None:
    """The plugin's settings from options and environment; None when no impl is given."""
    values = {}
    for name, (env, default, _) in _OPTIONS.items():
        value = config.getoption(f"refattn_{name}", default=None)
        values[name] = value if value is not None else os.environ.get(env, default)
    if not values["impl"]:
        return None
    values["strict"] = bool(config.getoption("refattn_strict", default=False))
    values["grads"] = bool(config.getoption("refattn_grads", default=False))
    if values["dtype"] == "all":
        values["dtype"] = None
    from .conventions import check_convention

    try:
        values["convention"] = check_convention(
            values.pop("layout"), values.pop("framework"), values.pop("device")
        )
    except ValueError as err:
        import pytest

        raise pytest.UsageError(f"--refattn-{str(err).split(':')[0]}: {err}") from None
    return values


def pytest_configure(config):
    """Put the current directory on sys.path when an implementation is given, as the CLI
    does, so ``--refattn-impl mymodule:attention`` finds ``./mymodule.py``."""
    if settings(config) is not None and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def read_patterns(path) -> list[str]:
    """Patterns of a skip/xfail file (blank lines and ``#`` comments ignored)."""
    if not path:
        return []
    with open(path, encoding="utf-8") as handle:
        lines = (line.split("#", 1)[0].strip() for line in handle)
        return [line for line in lines if line]


def pytest_report_header(config):
    values = settings(config)
    if values is None:
        return None
    source = (
        f"fixtures {values['fixtures']}"
        if values["fixtures"]
        else f"suite {values['suite'] or 'smoke'}"
    )
    return f"refattn-oracle: impl {values['impl']}, {source}, dtype {values['dtype'] or 'all'}"
