"""Shared test configuration: hypothesis profiles, tiers, mpmath hygiene."""

from __future__ import annotations

import os

import mpmath
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("REFATTN_XSLOW") == "1":
        return
    skip = pytest.mark.skip(reason="xslow: set REFATTN_XSLOW=1 to run")
    for item in items:
        if "xslow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _mpmath_precision_unchanged():
    """Every test must leave mpmath's global precision (mp and iv) as it found it."""
    before = (mpmath.mp.prec, mpmath.iv.prec)
    yield
    after = (mpmath.mp.prec, mpmath.iv.prec)
    mpmath.mp.prec, mpmath.iv.prec = before
    assert after == before, f"mpmath global precision changed from {before} to {after}"
