"""pytest plugin of the oracle: one test per case against your implementation.

Usage (the plugin is registered by the ``pytest11`` entry point ``refattn_oracle`` when refattn
is installed; from a source checkout that is not installed add ``-p oracle.pytest_plugin``, but
never both: pluggy refuses to register one module under two names)::

    pytest --pyargs oracle --refattn-impl mypkg.attn:attention [--refattn-suite default]
           [--refattn-fixtures DIR] [--refattn-dtype float16] [--refattn-skips FILE]
           [--refattn-xfails FILE] [--refattn-strict] [--refattn-grads]
           [--refattn-require causal,mask] [--refattn-signature flash_attn]
           [--refattn-causal-align bottom_right] [--refattn-keyword scale=softmax_scale]
           [--refattn-empty-rows nan]

The current directory is put on ``sys.path`` (as ``refattn-oracle validate --impl`` does),
so a module next to where pytest runs is found. Each option has an environment twin
(``REFATTN_IMPL``, ``REFATTN_SUITE``, ``REFATTN_FIXTURES``,
``REFATTN_DTYPE``, ``REFATTN_SKIPS``, ``REFATTN_XFAILS``, ``REFATTN_SIGNATURE``,
``REFATTN_CAUSAL_ALIGN``, ``REFATTN_KEYWORD``, ``REFATTN_EMPTY_ROWS``). ``--refattn-impl`` takes
``module:function`` or an adapter name. Test ids are the case names; a failure shows the worst
element, the threshold, the diagnosis and a one-line reproduction. Unsupported cases
(NotImplementedError) are skipped; robustness and refusal failures xfail unless
``--refattn-strict``.
The fp8 cases (float8 q, k, v with descales) are bfloat16 cases: ``--refattn-dtype bfloat16``
runs them; cases with ``sinks`` / ``kv_lengths`` pass those keywords (see
:mod:`oracle.judging.judge` for the calling convention, ``dsinks`` included).
``--refattn-signature``, ``--refattn-causal-align`` and ``--refattn-keyword`` are the CLI's
``--signature``, ``--causal-align`` and ``--keyword`` (:mod:`oracle.conventions.signatures`): a
function
written with a library's own signature is tested as it stands. ``--refattn-empty-rows`` is the
CLI's ``--empty-rows`` (:mod:`oracle.judging.empty_rows`).

Skip/xfail files (like array-api-tests): one fnmatch pattern over case names per line, ``#``
starts a comment.

Each case runs in one supervised worker process kept across the session, as
``refattn-oracle validate`` runs it (an implementation that exits, crashes or hangs makes that
case an error, never the end of the session); the coverage table (judged / unsupported / error
per feature, dtype and shape class) is printed at the end, and ``--refattn-require FEATURES``
(env ``REFATTN_REQUIRE``) fails the session unless some case judged each feature.

The plugin is inert unless an implementation is given: it only adds command-line options and
a report-header line; the tests live in :mod:`oracle.pytest_plugin.test_conformance`, which pytest
collects
only when asked to (``--pyargs oracle`` or a path inside the package), never from a project's
own ``testpaths``.
"""

from __future__ import annotations

import os
import sys

import pytest

from oracle.reading.features import KNOWN_FEATURES, case_features

__all__ = ["settings", "read_patterns", "session", "Session"]

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
    "require": (
        "REFATTN_REQUIRE",
        None,
        "comma list of features some case must judge, else the session fails (causal, mask...)",
    ),
    "signature": (
        "REFATTN_SIGNATURE",
        None,
        "the implementation speaks this library's keywords and conventions (flash_attn, "
        "flash_attn_varlen, flash_attn_with_kvcache, flashinfer, xformers, torch_sdpa, jax)",
    ),
    "causal_align": (
        "REFATTN_CAUSAL_ALIGN",
        None,
        "without a signature: the alignment of its causal/window (top_left, bottom_right)",
    ),
    "empty_rows": (
        "REFATTN_EMPTY_ROWS",
        None,
        "what it gives rows with no allowed key: zero (refattn's), nan, average",
    ),
    "keyword": (
        "REFATTN_KEYWORD",
        None,
        "without a signature: its name for a refattn option, OPTION=NAME (repeatable or a "
        "comma list, e.g. scale=softmax_scale)",
    ),
}


def pytest_addoption(parser):
    group = parser.getgroup("refattn-oracle", "refattn oracle conformance tests")
    for name, (env, default, text) in _OPTIONS.items():
        group.addoption(
            f"--refattn-{name.replace('_', '-')}",
            dest=f"refattn_{name}",
            default=None,
            action="append" if name == "keyword" else "store",
            help=f"{text} (env {env}; default {default})",
        )
    group.addoption(
        "--refattn-strict",
        dest="refattn_strict",
        action="store_true",
        default=False,
        help="robustness and refusal failures fail instead of xfail",
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
    values["require"] = _required(values["require"])
    # start-up cost: numpy loads only with an implementation (pytest loads this plugin always)
    from oracle.conventions.layouts import check_convention

    try:
        values["convention"] = check_convention(
            values.pop("layout"),
            values.pop("framework"),
            values.pop("device"),
            values.pop("signature"),
            values.pop("causal_align"),
            values.pop("keyword"),
            values.pop("empty_rows"),
        )
    except ValueError as err:
        option = str(err).split(":")[0].replace("_", "-")
        raise pytest.UsageError(f"--refattn-{option}: {err}") from None
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


def _required(text) -> tuple:
    names = [p.strip().lower() for p in str(text or "").split(",") if p.strip()]
    unknown = [n for n in names if n not in KNOWN_FEATURES]
    if unknown:
        raise pytest.UsageError(
            f"--refattn-require: unknown feature(s) {unknown}; expected some of "
            f"{list(KNOWN_FEATURES)}"
        )
    return tuple(dict.fromkeys(names))


class Session:
    """The plugin's state over one pytest session: the supervised worker process every case
    runs in (as ``refattn-oracle validate`` does: an implementation that exits, crashes or
    hangs is that case's "error", not the end of pytest) and the results, from which the
    coverage table is printed at the end and ``--refattn-require`` is checked."""

    def __init__(self, values):
        self.values = values
        self.results = []
        self.supervisor = None

    def run(self, fixture, reproduce):
        # start-up cost: loaded by the first case, not by every pytest run
        from oracle.run.supervise import DEFAULT_TIMEOUT, Supervisor

        if self.supervisor is None:
            ref = self.values["impl"]
            if self.values["convention"] != {
                "layout": "bhld",
                "framework": "numpy",
                "device": "cpu",
            }:
                ref = (ref, self.values["convention"])
            self.supervisor = Supervisor(ref, timeout=DEFAULT_TIMEOUT)
        result = self.supervisor.run(fixture, grads=self.values["grads"], reproduce=reproduce)
        result.features, result.shape_classes = case_features(
            fixture.case, self.values["grads"], fixture.inputs
        )
        self.results.append(result)
        return result

    def report(self):
        # start-up cost: refattn and Numba (~3 s) load only in a conformance session
        from oracle.report.run_report import Report

        values = self.values
        source = (
            f"fixtures {values['fixtures']}"
            if values["fixtures"]
            else (f"suite {values['suite'] or 'smoke'}")
        )
        report = Report(values["impl"], values["dtype"], source, values["strict"], self.results)
        report.grads, report.isolated = values["grads"], True
        report.required = values["require"]
        return report

    def close(self):
        if self.supervisor is not None:
            self.supervisor.close()
            self.supervisor = None


_SESSIONS: dict = {}


def session(config) -> Session | None:
    """The :class:`Session` of this pytest run (None without an implementation)."""
    values = settings(config)
    if values is None:
        return None
    return _SESSIONS.setdefault(id(config), Session(values))


def pytest_sessionfinish(session, exitstatus):
    state = _SESSIONS.get(id(session.config))
    if state is None:
        return
    state.close()
    if state.results and state.report().missing_required and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = _SESSIONS.pop(id(config), None)
    if state is None or not state.results:
        return
    # start-up cost: refattn and Numba (~3 s) load only in a conformance session
    from oracle.report.formats import coverage_lines

    terminalreporter.section("refattn oracle coverage")
    for line in coverage_lines(state.report()):
        terminalreporter.write_line(line)


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
