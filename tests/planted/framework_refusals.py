"""Implementations that refuse in a framework's own exception classes (ONNX Runtime, Triton,
Paddle, TensorFlow), faked by class name and module so no framework is needed
(tests/meta/test_refusal_classes.py)."""

from __future__ import annotations

from oracle.reading.baseline import textbook_attention

__all__ = [
    "ort_invalid_argument",
    "ort_not_implemented",
    "ort_fail",
    "triton_wrapped",
    "triton_compilation",
    "paddle_not_found",
    "paddle_tagged",
    "tf_unimplemented",
    "tf_invalid_shapes",
    "refuses_in_vjp",
]


def _framework_error(module, name):
    """An exception class that reads like ``module.name`` (as the framework defines it)."""
    return type(name, (Exception,), {"__module__": module})


InvalidArgument = _framework_error("onnxruntime.capi.onnxruntime_pybind11_state", "InvalidArgument")
NotImplementedOrt = _framework_error(
    "onnxruntime.capi.onnxruntime_pybind11_state", "NotImplemented"
)
Fail = _framework_error("onnxruntime.capi.onnxruntime_pybind11_state", "Fail")
InterpreterError = _framework_error("triton.runtime.errors", "InterpreterError")
CompilationError = _framework_error("triton.compiler.errors", "CompilationError")
NotFound = _framework_error("paddle.base.core", "NotFound")
UnimplementedError = _framework_error(
    "tensorflow.python.framework.errors_impl", "UnimplementedError"
)
InvalidArgumentError = _framework_error(
    "tensorflow.python.framework.errors_impl", "InvalidArgumentError"
)


def ort_invalid_argument(q, k, v, **options):
    """ONNX Runtime's Attention contrib op on an odd head size."""
    raise InvalidArgument(
        "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : head_size must be a multiple of 8"
    )


def ort_not_implemented(q, k, v, **options):
    """No kernel registered for the node: the class says it all."""
    raise NotImplementedOrt(
        "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for "
        "MultiHeadAttention(1) node with name ''"
    )


def ort_fail(q, k, v, **options):
    """A failure whose message is no refusal: an error."""
    raise Fail("[ONNXRuntimeError] : 1 : FAIL : bad allocation")


def triton_wrapped(q, k, v, **options):
    """Triton's interpreter wraps the kernel's own refusal."""
    try:
        raise ValueError("Both operands must be same dtype. Got fp32 and fp16")
    except ValueError as err:
        raise InterpreterError("ValueError('Both operands must be same dtype')") from err


def triton_compilation(q, k, v, **options):
    """A compilation error shows the kernel source first, the refusal last."""
    raise CompilationError(
        "at 24:15:\n        p = tl.exp(s - m)\n        acc += tl.dot(p, v)\n"
        "               ^\nBoth operands must be same dtype. Got fp32 and fp16"
    )


def paddle_not_found(q, k, v, **options):
    """Paddle has no kernel for the dtype."""
    raise NotFound(
        "The kernel with key (CPU, Undefined(AnyLayout), float16) of kernel `flash_attn` "
        "is not registered."
    )


def paddle_tagged(q, k, v, **options):
    """Paddle's error kind written into a RuntimeError's message."""
    raise RuntimeError("(Unimplemented) flash_attn on CPU [operator < flash_attn > error]")


def tf_unimplemented(q, k, v, **options):
    raise UnimplementedError("Fused attention with this layout")


def tf_invalid_shapes(q, k, v, **options):
    """An argument error whose message is no refusal (a bug, e.g. a wrong transpose)."""
    raise InvalidArgumentError("Incompatible shapes: [1,4,5,8] vs. [1,2,6,8]")


def _attend(q, k, v, return_lse=False, **options):
    result = textbook_attention(q, k, v, **options)
    return (result.out, result.lse) if return_lse else result.out


def refuses_in_vjp(q, k, v, **options):
    """A correct forward whose vjp raises an argument error after the output exists."""
    return _attend(q, k, v, **options)


def _vjp(q, k, v, grad_out, **options):
    raise InvalidArgument("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : dims must be equal")


refuses_in_vjp.vjp = _vjp
