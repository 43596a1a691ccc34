"""Conformance tests of an implementation, one per oracle case (see oracle.pytest_plugin).

Collected only by ``pytest --pyargs oracle --refattn-impl module:function``; without an
implementation every test here is skipped.
"""

from __future__ import annotations

import fnmatch

import pytest

from oracle import catalogue
from oracle.fixtures import golden
from oracle.pytest_plugin import read_patterns, session, settings
from oracle.run.validate import reproduce_command, resolve_impl


def _items(values):
    dtype = values["dtype"]
    if values["fixtures"]:
        found = list(golden.load(values["fixtures"]))
        source_flag = f"--fixtures {values['fixtures']}"
    else:
        found = catalogue.suite(values["suite"] or "smoke")
        source_flag = f"--suite {values['suite'] or 'smoke'}"
    chosen = []
    for item in found:
        case = getattr(item, "case", item)
        if getattr(case, "function", "attention") != "attention":
            continue
        if dtype is None or case.dtype == dtype:
            chosen.append(item)
    return chosen, source_flag


def pytest_generate_tests(metafunc):
    if "oracle_item" not in metafunc.fixturenames:
        return
    values = settings(metafunc.config)
    if values is None:
        metafunc.parametrize(
            "oracle_item",
            [
                pytest.param(
                    None,
                    marks=pytest.mark.skip(
                        reason="no implementation: give --refattn-impl "
                        "module:function or set REFATTN_IMPL"
                    ),
                )
            ],
            ids=["no-impl"],
        )
        return
    try:
        resolve_impl(values["impl"])
    except (ImportError, AttributeError, TypeError, ValueError, KeyError) as err:
        raise pytest.UsageError(f"--refattn-impl: {err}") from err
    skips, xfails = read_patterns(values["skips"]), read_patterns(values["xfails"])
    items, source_flag = _items(values)
    params = []
    for item in items:
        case = getattr(item, "case", item)
        marks = []
        if any(fnmatch.fnmatchcase(case.name, p) for p in skips):
            marks.append(pytest.mark.skip(reason="listed in the skips file"))
        if any(fnmatch.fnmatchcase(case.name, p) for p in xfails):
            marks.append(pytest.mark.xfail(reason="listed in the xfails file", strict=False))
        params.append(pytest.param((item, source_flag), marks=marks, id=case.name))
    metafunc.parametrize("oracle_item", params)


def test_case(oracle_item, request):
    __tracebackhide__ = True
    values = settings(request.config)
    item, source_flag = oracle_item
    fixture = item if hasattr(item, "truth") else golden.build(item)
    _, spec = resolve_impl(values["impl"])
    spec = spec or values["impl"]
    repro = reproduce_command(
        spec,
        source_flag,
        fixture.case.dtype,
        fixture.case.name,
        values["grads"],
        values["strict"],
        convention=values["convention"],
    )
    # supervised, as the CLI runs it; the session prints the coverage table at the end
    result = session(request.config).run(fixture, repro)
    if result.verdict == "unsupported":
        pytest.skip(f"unsupported: {result.message}")
    if result.failed:
        if result.category in ("robustness", "refusal") and not values["strict"]:
            pytest.xfail(result.explain())
        pytest.fail(result.explain(), pytrace=False)
