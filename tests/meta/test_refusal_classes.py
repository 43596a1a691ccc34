"""oracle.judging.refused: refusals in a framework's own exception classes (ONNX Runtime,
Triton, Paddle, TensorFlow; faked by class name and module) are "unsupported" with the message
that reads as a refusal; argument errors with other messages, and anything raised after the
output exists, stay "error"."""

from __future__ import annotations

import pytest

from oracle.catalogue import get
from oracle.fixtures import golden
from oracle.judging.judge import check_fixture
from oracle.judging.refused import REFUSED, framework_kind
from tests.planted import framework_refusals as impls


@pytest.fixture(scope="module")
def basic():
    return golden.build(get("basic-H2K2-L5S7-D8E8-f32"))


@pytest.mark.parametrize(
    ("impl", "said"),
    [
        (impls.ort_invalid_argument, "InvalidArgument: [ONNXRuntimeError] : 2 : INVALID_ARGUMENT"),
        (impls.ort_not_implemented, "NotImplemented: [ONNXRuntimeError] : 9 : NOT_IMPLEMENTED"),
        (impls.triton_wrapped, "InterpreterError: ValueError('Both operands must be same dtype')"),
        (impls.triton_compilation, "CompilationError: Both operands must be same dtype. Got"),
        (impls.paddle_not_found, "NotFound: The kernel with key (CPU, Undefined(AnyLayout)"),
        (impls.paddle_tagged, "RuntimeError: (Unimplemented) flash_attn on CPU"),
        (impls.tf_unimplemented, "UnimplementedError: Fused attention with this layout"),
    ],
)
def test_framework_refusals_are_unsupported(basic, impl, said):
    result = check_fixture(impl, basic)
    assert result.verdict == "unsupported", result.message
    assert result.message.startswith(f"{REFUSED}: {said}"), result.message


@pytest.mark.parametrize("impl", [impls.ort_fail, impls.tf_invalid_shapes])
def test_framework_errors_without_refusal_words_stay_errors(basic, impl):
    result = check_fixture(impl, basic)
    assert result.verdict == "error", result.message


def test_an_exception_after_the_output_exists_stays_an_error():
    fixture = golden.build(get("grad-bias-H2K2-L4S5-D8E8-f32"))
    result = check_fixture(impls.refuses_in_vjp, fixture, grads=True)
    assert result.verdict == "error" and "INVALID_ARGUMENT" in result.message, result.message


def test_classes_are_read_by_module_and_name_not_by_name_alone():
    own = type("InvalidArgument", (Exception,), {"__module__": "mykernels.errors"})
    assert framework_kind(own("head_size must be a multiple of 8")) is None
    base = type("NotImplemented", (Exception,), {"__module__": "onnxruntime.capi"})
    derived = type("KernelMissing", (base,), {"__module__": "onnxruntime.capi"})
    assert framework_kind(derived("no kernel")) == "refusal"
