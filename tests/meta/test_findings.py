"""docs/findings.md re-checked where the peer installs (deselected otherwise): Keras' numpy
backend computes float64 inputs in float32 and accumulates P@V in float16 for float16 inputs
(the long-fade rows)."""

from __future__ import annotations

import pytest

from oracle.run.validate import validate

_KERAS = "tests.planted.keras_attention:attention"
_RUN = dict(suite="default", progress=False, isolate=False)


@pytest.mark.peers("keras", "jax")
def test_keras_computes_float64_in_float32():
    report = validate(_KERAS, dtype="float64", cases=["basic-H2K2-L5S7-*"], **_RUN)
    (result,) = report.results
    assert result.verdict == "fail"
    assert any("compute in float32" in note for note in result.diagnosis), result.diagnosis


@pytest.mark.slow
@pytest.mark.peers("keras", "jax")
def test_keras_float16_long_fade_rows_fail():
    report = validate(_KERAS, dtype="float16", cases=["long-fade-H1K1-L2S49153-*"], **_RUN)
    (result,) = report.results
    assert result.verdict == "fail" and result.checks["out"].n_failed == result.checks["out"].size
