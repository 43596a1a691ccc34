"""Adapter for the ONNX ``Attention`` operator (opset 24) in onnxruntime's CPU provider.

The model and the option mapping are those of :mod:`oracle.adapters.onnx_reference` (see its
table); one ``InferenceSession`` is cached per (dtype, shapes, options).

What runs (onnxruntime 1.31, CPU provider): float32 and float16 use onnxruntime's own
``Attention`` kernel; float64 has no kernel and runs onnxruntime's expansion of the ONNX
function body (MatMul, Softmax, ...), which is still onnxruntime's behaviour and is judged as
such; bfloat16 fails to build (``NOT_IMPLEMENTED``) and is reported as unsupported, as is any
model onnxruntime refuses to build (float64 with ``is_causal``, a float ``attn_mask`` and
``nonpad_kv_seqlen`` fails its own type inference: an onnxruntime bug). Window
attributes need opset 25, which onnxruntime's ONNX does not know: window is unsupported.

Measured behaviour passed through unchanged (onnxruntime 1.31.1):

* fully masked rows give 0 in float32 and float16 (the kernel) but NaN in float64 (the
  function expansion has no zero-row guard);
* float64 multiplies Q and K by sqrt(scale) held as a float32 (float32-sized errors unless
  sqrt(scale) is a float32: D = 16 gives sqrt(1/4) = 1/2 and is float64-accurate, D = 8 and
  D = 64 are not) and ignores ``nonpad_kv_seqlen`` in the causal frontier, so
  ``align="bottom_right"`` with L != S comes out top-left.

Examples
--------
>>> import numpy as np
>>> from oracle.adapters import get
>>> ort_attention = get("onnxruntime")  # doctest: +SKIP
>>> q = np.ones((1, 2, 3, 4), np.float32); k = np.ones((1, 2, 5, 4), np.float32)
>>> ort_attention(q, k, k, causal=True).shape  # doctest: +SKIP
(1, 2, 3, 4)
"""

from __future__ import annotations

import numpy as np
import onnxruntime
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from oracle.adapters.onnx_reference import OnnxAttentionBase

__all__ = ["OnnxRuntimeAttention"]


class OnnxRuntimeAttention(OnnxAttentionBase):
    """refattn's calling convention over onnxruntime (CPUExecutionProvider)."""

    name = "onnxruntime"
    opset = 24
    # onnxruntime 1.31 reads models up to IR 10 with opset 24.
    ir_version = 10
    peer = f"onnxruntime {onnxruntime.__version__} Attention-24 (CPU)"
    fully_masked_rows = "zero"  # float32/float16; float64 gives NaN (see above)

    def _make_session(self, model):
        options = onnxruntime.SessionOptions()
        # One thread: results must not depend on the machine's core count.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        try:
            return onnxruntime.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
        except (_ort_state.NotImplemented, _ort_state.Fail, _ort_state.InvalidGraph) as err:
            # A model onnxruntime refuses to build is a combination it does not support
            # (e.g. no bfloat16 kernels; float64 with is_causal, a float mask and
            # nonpad_kv_seqlen fails type inference of its function expansion).
            dtype = model.graph.input[0].type.tensor_type.elem_type
            raise NotImplementedError(
                f"{self.peer} cannot build this model (ONNX element type {dtype}): {err}"
            ) from err

    def _run(self, session, feeds):
        try:
            (out,) = session.run(None, feeds)
        except _ort_state.NotImplemented as err:
            raise NotImplementedError(f"{self.peer}: {err}") from err
        return np.asarray(out)
