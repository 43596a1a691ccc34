"""No element passes unjudged (oracle.judging.tolerance, (T8)): the floors stay finite on values
near overflow, an element whose rule gives no finite threshold is judged by the one-ulp rule,
and implementations that saturate fail the worst-overflow cases in both tiers while refattn's
own paths pass every worst case."""

from __future__ import annotations

import numpy as np
import pytest

from oracle import catalogue
from oracle.fixtures import golden
from oracle.judging import tolerance as tol
from oracle.judging.judge import check_fixture
from refattn.attention import attention
from tests.planted.broken_impls import textbook
from tests.planted.saturating_impls import float32_saturated, saturating_accumulator

_TIERS = tol.TIERS


def _worst(prefix="worst-", dtypes=None):
    return [
        c
        for c in catalogue.suite("default")
        if c.name.startswith(prefix) and (dtypes is None or c.dtype in dtypes)
    ]


@pytest.fixture(scope="module")
def fixtures():
    """Every float64 worst case and worst-overflow in every dtype, built once."""
    cases = {c.name: c for c in _worst(dtypes=("float64",)) + _worst("worst-overflow")}
    return {name: golden.build(case) for name, case in cases.items()}


def _float64_path(q, k, v, **options):
    return attention(q, k, v, **options)


def _named(fixtures, prefix, dtype=None):
    found = [f for n, f in fixtures.items() if n.startswith(prefix)]
    return [f for f in found if dtype is None or f.case.dtype == dtype]


@pytest.mark.parametrize("tier", _TIERS)
def test_worst_overflow_thresholds_are_finite(fixtures, tier):
    for fixture in _named(fixtures, "worst-overflow"):
        result = check_fixture(_float64_path, fixture, tolerance=tier)
        for check in result.checks.values():
            limit = np.broadcast_to(check.threshold.rule, check.errors.shape)
            assert np.isfinite(limit).all(), (fixture.case.name, check.quantity)
            assert check.threshold.n_fallback == 0


@pytest.mark.parametrize("tier", _TIERS)
def test_float32_saturation_fails_every_float64_worst_case(fixtures, tier):
    for fixture in _named(fixtures, "worst-", "float64"):
        result = check_fixture(float32_saturated, fixture, tolerance=tier, diagnose=False)
        assert result.verdict == "fail", (fixture.case.name, result.message)
    (overflow,) = _named(fixtures, "worst-overflow", "float64")
    out = check_fixture(float32_saturated, overflow, tolerance=tier, diagnose=False).checks["out"]
    assert out.n_failed == out.size  # every value saturated: every element fails


@pytest.mark.parametrize("tier", _TIERS)
def test_a_saturating_float16_accumulator_fails_worst_overflow(fixtures, tier):
    (fixture,) = _named(fixtures, "worst-overflow", "float16")
    result = check_fixture(saturating_accumulator, fixture, tolerance=tier, diagnose=False)
    assert result.verdict == "fail", result.message


@pytest.mark.parametrize("tier", _TIERS)
@pytest.mark.parametrize("impl", [_float64_path, textbook], ids=["float64-path", "textbook"])
def test_refattns_own_paths_pass_every_worst_case(fixtures, tier, impl):
    for fixture in fixtures.values():
        result = check_fixture(impl, fixture, tolerance=tier, diagnose=False)
        assert result.verdict == "pass", (fixture.case.name, result.message)


def _one_ulp_threshold(truth, dtype):
    nan_floor = np.full(truth.shape, np.nan)
    limits = tol.Threshold(tol.K_FORWARD, None, nan_floor, tol.unit_roundoff(dtype))
    return tol.with_ulp_rule(limits, truth, np.abs(truth), dtype)


def test_a_nan_threshold_becomes_the_one_ulp_rule():
    truth = np.array([1.0, -3.0, 1e-3])
    limits = _one_ulp_threshold(truth, "float32")
    assert limits.n_fallback == truth.size
    errors_one = tol.normalised_error(
        truth + tol.ulp(truth, "float32"), truth, np.abs(truth), "float32"
    )
    errors_two = 2 * errors_one
    assert (errors_one <= limits.value).all()
    assert (errors_two > limits.value).all()
    assert "one-ulp rule" in limits.formula((0,), truth.shape)


def test_a_non_finite_truth_under_a_nan_threshold_passes_only_when_equal():
    truth = np.array([np.inf, np.nan])
    limits = _one_ulp_threshold(truth, "float64")
    assert (limits.value == 0).all()
    same = tol.normalised_error(truth, truth, np.ones(2), "float64")
    other = tol.normalised_error(np.array([1.0, 1.0]), truth, np.ones(2), "float64")
    assert (same <= limits.value).all() and (other > limits.value).all()
