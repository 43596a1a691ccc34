"""oracle.judging.refused: an implementation's refusal of a case in its framework's words
(ValueError
"... must match", an assert "only supports") is "unsupported" with its message, counted in the
report; other exceptions, wrong shapes and the oracle's own conversion errors stay "error" /
"fail"; ``refusals_are_errors`` turns refusals back into errors."""

from __future__ import annotations

from pathlib import Path

import pytest

import oracle
from oracle.catalogue import get
from oracle.fixtures import golden
from oracle.judging.judge import check_fixture
from oracle.judging.refused import REFUSED, as_refusal
from oracle.report.summary import unsupported_lines
from oracle.run.validate import validate
from tests.planted import refusal_impls as impls

_GQA = "gqa-interleave-H4K2-L5S6-D8E8-f32"


@pytest.fixture(scope="module")
def gqa():
    return golden.build(get(_GQA))


@pytest.mark.parametrize(
    ("impl", "said"),
    [
        (impls.refuses_gqa, "ValueError: number of heads of q (4) and k (2) must match"),
        (impls.asserts_shape, "AssertionError: this kernel only supports H == K"),
    ],
)
def test_a_refusal_is_unsupported_with_its_message(gqa, impl, said):
    result = check_fixture(impl, gqa)
    assert result.verdict == "unsupported", result.message
    assert result.message == f"{REFUSED}: {said}"


@pytest.mark.parametrize(
    ("impl", "verdict", "said"),
    [
        (impls.says_bad_value, "error", "ValueError: bad value"),
        (impls.index_error, "error", "IndexError"),
        (impls.drops_a_column, "error", "OutputError: out has shape"),
    ],
)
def test_other_exceptions_and_wrong_shapes_are_no_refusal(gqa, impl, verdict, said):
    result = check_fixture(impl, gqa)
    assert result.verdict == verdict and said in result.message, result.message


def test_the_oracles_own_errors_are_no_refusal():
    where = str(Path(oracle.__file__).parent / "conventions" / "layouts.py")
    try:  # an error raised in the oracle's conversion code, not by the implementation
        exec(compile("raise ValueError('kv_lengths must be int32')", where, "exec"))
    except ValueError as err:
        assert as_refusal(err) is None
    try:
        exec(compile("raise ValueError('kv_lengths must be int32')", "user.py", "exec"))
    except ValueError as err:
        assert str(as_refusal(err)) == f"{REFUSED}: ValueError: kv_lengths must be int32"


def test_refusals_are_counted_and_can_be_errors():
    options = dict(suite="smoke", dtype="float32", cases=["gqa-*", "basic-*"], progress=False)
    report = validate(impls.refuses_gqa, **options)
    assert [r.verdict for r in report.results] == ["pass", "unsupported"]
    lines = unsupported_lines(report.results)
    assert any(f"1 {REFUSED}: --refusals-are-errors" in line for line in lines), lines
    strict = validate(impls.refuses_gqa, refusals_are_errors=True, **options)
    assert [r.verdict for r in strict.results] == ["pass", "error"]
    assert not strict.passed
