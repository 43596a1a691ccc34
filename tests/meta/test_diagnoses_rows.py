"""oracle.diagnose.rows: a tight-tier failure within one ulp is named as such (never a narrower
accumulation), and the worst element of a row with no allowed key is shown as "row has no
allowed key: expected 0 ..." instead of a normalised error of 1e37-1e307."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from oracle.catalogue import get
from oracle.fixtures import golden
from oracle.judging import tolerance as tol
from oracle.judging.judge import check_fixture
from refattn.attention import attention
from tests.planted.empty_row_impls import nan_on_empty_rows

_STORE = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def _other_neighbour(q, k, v, return_lse=False, **options):
    """Every output the neighbour of the truth that is *not* the correctly rounded one: a
    faithful rounding, between half an ulp and one ulp from the exact value."""
    dtype = np.asarray(q).dtype
    name = "bfloat16" if dtype == ml_dtypes.bfloat16 else dtype.name
    truth = np.asarray(attention(q, k, v, **options), dtype=np.float64)
    rounded = truth.astype(_STORE[name]).astype(np.float64)
    # the spacing on the side of the other neighbour (positive outputs: the case's v > 0)
    down, up = tol.ulp(truth, name), tol.ulp(rounded, name)
    other = np.where(rounded >= truth, rounded - down, rounded + up)
    return other.astype(_STORE[name])


@pytest.fixture(scope="module")
def bf16_case():
    return golden.build(get("k-offset-H2K2-L65S129-D64E64-bf16"))


def test_a_sub_ulp_tight_failure_is_named_within_one_ulp(bf16_case):
    assert check_fixture(_other_neighbour, bf16_case).verdict == "pass"
    result = check_fixture(_other_neighbour, bf16_case, tolerance="tight")
    assert result.verdict == "fail", result.message
    assert result.diagnosis and result.diagnosis[0].startswith("within one ulp"), result.diagnosis
    assert not any("consistent with accumulating" in note for note in result.diagnosis)


def test_an_empty_row_shows_its_expected_value_not_a_normalised_error():
    fixture = golden.build(get("mask-empty-rows-H2K2-L6S7-D8E8-f32"))
    result = check_fixture(nan_on_empty_rows, fixture)
    assert result.verdict == "fail"
    text = result.explain()
    assert "row has no allowed key: expected 0.0 (refattn's reading" in text, text
    assert "e+37" not in text and "e+307" not in text, text
