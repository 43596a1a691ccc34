"""docs/findings.md re-checked where the peer installs (deselected otherwise): Keras' numpy
backend computes float64 inputs in float32 and accumulates P@V in float16 for float16 inputs
(the long-fade rows); transformers' eager attention and OpenVINO's CPU plugin compute float64
in float32 (or lower) and OpenVINO saturates where the output overflows float32;
onnxruntime's MultiHeadAttention ``unidirectional=1`` takes another causal set when L != S
(tests/planted/peer_findings.py)."""

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


_PEERS = "tests.planted.peer_findings:"


@pytest.mark.peers("transformers", "torch")
def test_transformers_eager_computes_float64_in_float32():
    report = validate(_PEERS + "transformers_eager", dtype="float64", cases=["basic-*"], **_RUN)
    assert report.results and all(r.verdict == "fail" for r in report.results)
    for result in report.results:
        assert result.checks["out"].n_failed == result.checks["out"].size
        assert any("compute in float32" in note for note in result.diagnosis), result.diagnosis


@pytest.mark.peers("openvino")
def test_openvino_float32_hint_computes_float64_in_float32():
    report = validate(
        _PEERS + "openvino_sdpa_f32", dtype="float64", cases=["basic-H2K2-L5S7-*"], **_RUN
    )
    (result,) = report.results
    assert result.verdict == "fail"
    assert any("compute in float32" in note for note in result.diagnosis), result.diagnosis


@pytest.mark.peers("openvino")
def test_openvino_saturates_instead_of_overflowing():
    case = "worst-overflow-H2K2-L12S80-*"
    for precision in ("openvino_sdpa_f32", "openvino_sdpa"):
        for tier in ("default", "tight"):
            report = validate(
                _PEERS + precision, dtype="float64", cases=[case], tolerance=tier, **_RUN
            )
            (result,) = report.results
            assert result.verdict == "fail", (precision, tier)
            assert result.checks["out"].n_failed == result.checks["out"].size, (precision, tier)


@pytest.mark.peers("onnxruntime", "onnx")
def test_onnxruntime_multihead_causal_set_when_l_differs_from_s():
    cases = ["causal-tl-H2K2-L12S32-*", "causal-br-H2K2-L12S32-*", "causal-br-H2K2-L4S7-*"]
    report = validate(_PEERS + "ort_multihead", dtype="float32", cases=cases, **_RUN)
    assert len(report.results) == len(cases)
    for result in report.results:
        assert result.verdict == "fail", result.name
        assert any("full last row" in note for note in result.diagnosis), result.diagnosis
    same = validate(_PEERS + "ort_multihead", dtype="float32", cases=["basic-H2K2-L5S7-*"], **_RUN)
    assert same.passed  # L != S without causal: the operator itself is accurate
