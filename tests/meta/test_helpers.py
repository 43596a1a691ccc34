"""Meta tests of tests/helpers.py: the NaN/Inf rule, the failure message, the hidden frame."""

from __future__ import annotations

import math
import traceback

import numpy as np
import pytest

from oracle.judging.tolerance import ulp
from tests.helpers import (
    assert_norm_within,
    assert_same_bits,
    assert_within,
    elementwise_error,
    reproduction,
)

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "value, truth, error",
    [
        (1.0, 1.0, 0.0),
        (NAN, NAN, 0.0),
        (INF, INF, 0.0),
        (-INF, -INF, 0.0),
        (0.0, -0.0, 0.0),
        (1.5, 1.0, 0.5),
        (NAN, 1.0, INF),
        (1.0, NAN, INF),
        (1.0, INF, INF),
        (INF, 1.0, INF),
        (INF, -INF, INF),
        (NAN, INF, INF),
    ],
)
def test_one_nan_inf_rule(value, truth, error):
    assert elementwise_error(value, truth)[()] == error


@pytest.mark.parametrize(
    "value, truth", [(NAN, 1.0), (1.0, NAN), (INF, 1.0), (1.0, -INF), (INF, -INF)]
)
def test_within_never_excuses_a_nan_or_inf_disagreement(value, truth):
    with pytest.raises(AssertionError):
        assert_within(np.array([value]), np.array([truth]), np.inf, what="x")
    with pytest.raises(AssertionError):
        assert_norm_within(np.array([value]), np.array([truth]), 1e300, what="x")


def test_within_passes_on_agreement_and_on_the_threshold():
    truth = np.array([1.0, NAN, INF, -INF, 2.0])
    value = np.array([1.0 + 2**-52, NAN, INF, -INF, 2.0])
    assert_within(value, truth, 2**-52, what="x")
    assert_within(value, truth, 0.0, what="x", ulps=1.0)


def test_within_message_names_the_worst_element():
    truth = np.zeros((2, 3))
    value = truth.copy()
    value[0, 1] = 1e-3
    value[1, 2] = 4e-3  # the worst ratio to the threshold
    with pytest.raises(AssertionError) as info:
        assert_within(value, truth, np.full((2, 3), 1e-3) / 2, what="out", case="demo-f64")
    message = str(info.value)
    assert "out [demo-f64]: 2 of 6 elements over the threshold" in message
    assert "out[1, 2]: value 0.004, truth 0.0" in message
    assert "ulp of float64" in message
    assert "error 4.000e-03 > threshold 5.000e-04" in message


def test_within_adds_ulps_of_the_truth():
    truth = np.array([1.0, 1024.0])
    value = truth + ulp(truth, "float64")
    assert_within(value, truth, 0.0, what="x", ulps=1.0)
    with pytest.raises(AssertionError):
        assert_within(value, truth, 0.0, what="x", ulps=0.5)


def test_same_bits_distinguishes_signed_zeros_and_matches_nan():
    assert_same_bits(np.array([NAN, 1.0, -0.0]), np.array([NAN, 1.0, -0.0]), what="x")
    with pytest.raises(AssertionError, match=r"1 of 3 elements differ"):
        assert_same_bits(np.array([NAN, 1.0, 0.0]), np.array([NAN, 1.0, -0.0]), what="x")


def test_same_bits_dtype_check():
    value = np.ones(2, dtype=np.float32)
    assert_same_bits(value, np.ones(2), what="x")
    with pytest.raises(AssertionError, match="dtype float32"):
        assert_same_bits(value, np.ones(2), what="x", check_dtype=True)


@pytest.mark.parametrize("helper", ["bits", "within", "norm"])
def test_shapes_must_match(helper):
    value, truth = np.zeros((2, 3)), np.zeros(3)
    call = {
        "bits": lambda: assert_same_bits(value, truth, what="x"),
        "within": lambda: assert_within(value, truth, 1.0, what="x"),
        "norm": lambda: assert_norm_within(value, truth, 1.0, what="x"),
    }[helper]
    with pytest.raises(AssertionError, match=r"shape \(2, 3\), truth has shape \(3,\)"):
        call()


def test_norm_per_sample_names_the_sample():
    truth = np.zeros((3, 2))
    value = truth.copy()
    value[2] = [3.0, 4.0]  # norm 5
    assert_norm_within(value, truth, [0.0, 0.0, 5.0], what="z", per_sample=True)
    with pytest.raises(AssertionError) as info:
        assert_norm_within(value, truth, [1.0, 1.0, 4.0], what="z", per_sample=True)
    assert "sample 2: 2-norm error 5.000e+00 > bound 4.000e+00" in str(info.value)
    assert "z[2, 1]: value 4.0" in str(info.value)
    with pytest.raises(AssertionError, match="2-norm error 5.000e\\+00 > bound 4.900e\\+00"):
        assert_norm_within(value, truth, 4.9, what="z")


def test_failure_carries_a_reproduction_line():
    assert reproduction().startswith("python -m pytest '")
    assert "test_failure_carries_a_reproduction_line" in reproduction()
    with pytest.raises(AssertionError, match="reproduce: python -m pytest"):
        assert_within(np.ones(1), np.zeros(1), 0.5, what="x")


def test_helper_frames_are_hidden():
    with pytest.raises(AssertionError) as info:
        assert_within(np.ones(1), np.zeros(1), 0.5, what="x")
    hidden = [entry for entry in info.traceback if not entry.ishidden(info)]
    names = [entry.name for entry in hidden]
    assert names == ["test_helper_frames_are_hidden"], names
    assert traceback.format_exception(info.value)  # the message renders
