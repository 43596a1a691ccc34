"""Declared readings of rows with no allowed key (oracle.judging.empty_rows): a function that
gives NaN or the mean of v on such rows passes with ``empty_rows=`` and no wrapper; the
declaration is judged (refattn's own zeros fail a "nan" declaration), gradient cases it cannot
be judged on are "not expressible", and the declaration travels to the supervised worker, the
reproduction command and the CLI."""

from __future__ import annotations

import pytest

from oracle.cli import build_parser
from oracle.conventions import signatures
from oracle.judging.empty_rows import NOT_EXPRESSIBLE, check_reading
from oracle.run.validate import validate
from refattn.attention import attention
from tests.planted.empty_row_impls import average_on_empty_rows, nan_on_empty_rows

_EMPTY = ["*empty*"]
_RUN = dict(suite="default", dtype="float32", progress=False, isolate=False)


def _float64_path(q, k, v, **options):
    return attention(q, k, v, **options)


def _verdicts(report):
    return {r.name: r.verdict for r in report.results}


@pytest.mark.parametrize(
    ("impl", "reading"), [(nan_on_empty_rows, "nan"), (average_on_empty_rows, "average")]
)
def test_a_declared_reading_passes_without_a_wrapper(impl, reading):
    undeclared = validate(impl, cases=_EMPTY, **_RUN)
    assert not undeclared.passed
    declared = validate(impl, cases=_EMPTY, empty_rows=reading, **_RUN)
    assert declared.passed, [(r.name, r.message) for r in declared.results if r.verdict != "pass"]
    assert "fail" not in _verdicts(declared).values()


def test_the_lse_of_averaged_rows_is_not_compared_and_said_so():
    report = validate(
        average_on_empty_rows, cases=["mask-empty-rows-H2*"], empty_rows="average", **_RUN
    )
    (result,) = report.results
    assert result.verdict == "pass" and "lse not checked" in result.message
    assert "lse" not in result.checks


def test_the_declaration_is_judged_not_trusted():
    report = validate(_float64_path, cases=["mask-empty-rows-H2*"], empty_rows="nan", **_RUN)
    assert [r.verdict for r in report.results] == ["fail"]


def test_gradients_under_nan_rows_are_not_expressible():
    report = validate(
        nan_on_empty_rows, cases=["grad-empty-rows-*"], empty_rows="nan", grads=True, **_RUN
    )
    (result,) = report.results
    assert result.verdict == "unsupported" and result.message.startswith(NOT_EXPRESSIBLE)


def test_the_declaration_reaches_the_isolated_worker_and_the_reproduction():
    spec = "tests.planted.empty_row_impls:nan_on_empty_rows"
    options = {**_RUN, "isolate": True}
    report = validate(spec, cases=["causal-br-empty-H2*", "basic-H2K2-L5S7*"], **options)
    failed = [r for r in report.results if r.verdict == "fail"]
    assert failed and "--empty-rows" not in failed[0].reproduce
    declared = validate(spec, cases=["causal-br-empty-H2*"], empty_rows="nan", **options)
    assert declared.isolated and declared.passed


def test_the_cli_flag_and_a_bad_value():
    args = build_parser().parse_args(
        ["validate", "--impl", "m:f", "--suite", "smoke", "--empty-rows", "average"]
    )
    assert signatures.options_of(args)["empty_rows"] == "average"
    with pytest.raises(ValueError, match="empty_rows: expected one of"):
        check_reading("mean")
