"""Three public implementations in refattn's calling convention, for docs/findings.md: (B, H, L,
D) NumPy arrays in, the output out; options other than ``scale`` and ``causal`` (and, for
transformers, equal head counts) are refused (NotImplementedError: "unsupported", never a fail).

* :func:`transformers_eager`: ``transformers.models.llama.modeling_llama.eager_attention_forward``
  (the eager path every model's attention shares), causal as transformers' own additive mask
  (``finfo.min`` above the top-left diagonal);
* :func:`openvino_sdpa`: OpenVINO's ``opset13.scaled_dot_product_attention`` compiled for the
  CPU plugin, inputs in the case dtype (bfloat16 passed as its bit patterns), the plugin's
  default inference precision; :func:`openvino_sdpa_f32` with ``INFERENCE_PRECISION_HINT="f32"``;
* :func:`ort_multihead`: onnxruntime's contrib operator ``com.microsoft.MultiHeadAttention``
  (CPU provider, float32) with ``unidirectional=1`` for causal, its (B, L, H D) layout.

Each peer is imported on the first call (optional peers: the tests that use them are
deselected when they are absent, tests/conftest.py).
"""

from __future__ import annotations

import numpy as np

__all__ = ["transformers_eager", "openvino_sdpa", "openvino_sdpa_f32", "ort_multihead"]


def _refuse_others(peer, options) -> None:
    given = {n: x for n, x in options.items() if x is not None and n != "align"}
    if given:
        raise NotImplementedError(f"{peer}: no mapping for {sorted(given)}")


def _top_left_only(peer, q, k, causal, options) -> None:
    if np.ndim(q) != 4 or np.ndim(k) != 4:
        raise NotImplementedError(f"{peer}: (B, H, L, D) inputs only")
    if causal and q.shape[-2] != k.shape[-2] and options.get("align") != "top_left":
        raise NotImplementedError(f"{peer}: causal is top-left aligned here")


class _Module:
    """The two attributes eager_attention_forward reads from its attention module."""

    num_key_value_groups = 1
    training = False


def transformers_eager(q, k, v, scale=None, causal=False, **options):
    """transformers' eager attention: softmax(q k^T * scaling + mask) v, the softmax taken in
    float32 (``dtype=torch.float32``) and its weights cast back to the input dtype."""
    _refuse_others("transformers eager", options)
    _top_left_only("transformers eager", q, k, causal, options)
    if q.shape[-3] != k.shape[-3]:
        raise NotImplementedError("transformers eager: grouped heads not mapped here")
    import torch  # optional peers: imported on first use
    from transformers.models.llama.modeling_llama import eager_attention_forward

    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    mask = None
    if causal:
        above = torch.ones(L, S, dtype=torch.bool).triu(1)
        mask = torch.zeros(L, S, dtype=tq.dtype).masked_fill(above, torch.finfo(tq.dtype).min)
    scaling = q.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch.no_grad():
        out, _ = eager_attention_forward(_Module(), tq, tk, tv, mask, scaling)
    return np.swapaxes(out.numpy(), 1, 2).astype(q.dtype)


_OV_COMPILED: dict = {}


def openvino_sdpa(q, k, v, scale=None, causal=False, **options):
    """OpenVINO's ScaledDotProductAttention (opset 13) on the CPU plugin, its default
    inference precision (bfloat16 on a CPU with bfloat16 instructions)."""
    return _openvino(q, k, v, scale, causal, options, {})


def openvino_sdpa_f32(q, k, v, scale=None, causal=False, **options):
    """As :func:`openvino_sdpa` with ``INFERENCE_PRECISION_HINT="f32"``."""
    return _openvino(q, k, v, scale, causal, options, {"INFERENCE_PRECISION_HINT": "f32"})


def _openvino(q, k, v, scale, causal, options, config):
    _refuse_others("openvino", options)
    _top_left_only("openvino", q, k, causal, options)
    name = q.dtype.name
    if name not in ("float64", "float32", "float16", "bfloat16"):
        raise NotImplementedError(f"openvino: {name} inputs not mapped")
    import openvino as ov  # optional peer: imported on first use

    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    key = (q.shape, k.shape, v.shape, name, scale, bool(causal), tuple(config.items()))
    if key not in _OV_COMPILED:
        element = getattr(ov.Type, {"bfloat16": "bf16"}.get(name, name.replace("float", "f")))
        params = [
            ov.opset13.parameter(list(x.shape), element, name=n)
            for n, x in (("q", q), ("k", k), ("v", v))
        ]
        if name == "bfloat16":  # constants made in float32, converted by the graph
            scale_node, mask = (
                ov.opset13.convert(ov.opset13.constant(np.float32(x)), "bf16") for x in (scale, 0)
            )
        else:
            scale_node = ov.opset13.constant(np.asarray(scale, dtype=q.dtype))
            mask = ov.opset13.constant(np.zeros((), dtype=q.dtype))
        sdpa = ov.opset13.scaled_dot_product_attention(
            *params, mask, scale_node, causal=bool(causal)
        )
        model = ov.Model([sdpa], params, "sdpa")
        _OV_COMPILED[key] = ov.Core().compile_model(
            model, "CPU", {"INFERENCE_NUM_THREADS": 1, **config}
        )
    compiled = _OV_COMPILED[key]
    if name != "bfloat16":
        result = compiled([np.ascontiguousarray(x) for x in (q, k, v)])
        return np.asarray(result[compiled.output(0)]).astype(q.dtype)
    # bfloat16 as its bit patterns; the output tensor's bits come back labelled float16
    request = compiled.create_infer_request()
    request.infer(
        [
            ov.Tensor(np.ascontiguousarray(x).view(np.uint16), list(x.shape), ov.Type.bf16)
            for x in (q, k, v)
        ]
    )
    bits = np.array(request.get_output_tensor(0).data).view(np.uint16)
    return bits.view(q.dtype)


_ORT_SESSIONS: dict = {}


def ort_multihead(q, k, v, scale=None, causal=False, **options):
    """onnxruntime's com.microsoft.MultiHeadAttention, ``unidirectional=1`` when causal."""
    _refuse_others("onnxruntime MultiHeadAttention", options)
    _top_left_only("onnxruntime MultiHeadAttention", q, k, False, options)
    if q.dtype.name != "float32":
        raise NotImplementedError(f"onnxruntime MultiHeadAttention: {q.dtype.name} not mapped")
    if q.shape[-3] != k.shape[-3]:
        raise NotImplementedError("onnxruntime MultiHeadAttention: grouped heads not mapped")
    import onnxruntime  # optional peers: imported on first use
    from onnx import TensorProto, helper

    B, H, L, D = q.shape
    S, E = k.shape[-2], v.shape[-1]
    scale = D**-0.5 if scale is None else float(scale)
    key = (q.shape, k.shape, v.shape, scale, bool(causal))
    if key not in _ORT_SESSIONS:
        node = helper.make_node(
            "MultiHeadAttention",
            ["query", "key", "value"],
            ["output"],
            domain="com.microsoft",
            num_heads=H,
            scale=scale,
            unidirectional=int(bool(causal)),
        )
        f32 = TensorProto.FLOAT
        graph = helper.make_graph(
            [node],
            "mha",
            [
                helper.make_tensor_value_info("query", f32, [B, L, H * D]),
                helper.make_tensor_value_info("key", f32, [B, S, H * D]),
                helper.make_tensor_value_info("value", f32, [B, S, H * E]),
            ],
            [helper.make_tensor_value_info("output", f32, [B, L, H * E])],
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
        settings = onnxruntime.SessionOptions()
        settings.intra_op_num_threads = settings.inter_op_num_threads = 1
        _ORT_SESSIONS[key] = onnxruntime.InferenceSession(
            model.SerializeToString(), settings, providers=["CPUExecutionProvider"]
        )
    packed = [
        np.ascontiguousarray(np.swapaxes(x, 1, 2).reshape(B, -1, H * x.shape[-1]))
        for x in (q, k, v)
    ]
    (out,) = _ORT_SESSIONS[key].run(None, dict(zip(("query", "key", "value"), packed, strict=True)))
    return np.swapaxes(out.reshape(B, L, H, E), 1, 2)
