"""Adapter for the ONNX ``Attention`` operator run by ``onnx.reference`` (and the model builder
shared with the onnxruntime adapter).

The adapter builds a one-node model on the fly with ``onnx.helper`` (inputs Q (B, H, L, D),
K (B, K, S, D), V (B, K, S, E) and, as the options ask, ``attn_mask`` and
``nonpad_kv_seqlen``) and caches the evaluator per (dtype, shapes, options).

Option mapping (refattn -> ONNX Attention, opset 24 in onnxruntime; the newest opset the
installed ``onnx`` defines for ``onnx.reference``, 25 with onnx 1.23):

=================  ==================================================================
refattn            ONNX
=================  ==================================================================
scale              ``scale`` attribute, a 32-bit float: a scale that float32 does not
                   hold exactly is unsupported (default: the op's own 1/sqrt(D))
softcap            ``softcap`` attribute (32-bit float, same rule)
mask (bool)        ``attn_mask`` bool (True = attend)
bias (float)       ``attn_mask`` float in q's dtype (exactly, or unsupported)
mask and bias      ``attn_mask = where(mask, bias, -inf)`` (the op takes one attn_mask and
                   the spec defines a bool mask as exactly this -inf bias)
causal             ``is_causal=1`` (offset 0 without a cache: top-left)
align bottom_right ``nonpad_kv_seqlen = [S] * B`` (opset >= 24): the spec's causal and window
                   frontier is ``j <= i + nonpad_kv_seqlen - L``, i.e. offset S - L, with no
                   key padded
window (l, r)      ``left_window_size``/``right_window_size`` (-1 = unbounded) where the
                   opset defines them (25); unsupported in opset 24
GQA (interleave)   4-D inputs with K | H kv heads (the spec maps head h to kv head h // G)
kv_lengths         ``nonpad_kv_seqlen = kv_lengths``: keys j >= S_b excluded, frontier
                   ``j <= i + S_b - L`` (bottom_right aligned to each row's length, as refattn
                   reads it); with causal/window and top_left only when every S_b = L
=================  ==================================================================

Unsupported (NotImplementedError): return_lse (the op returns no lse), ALiBi, dropout,
``gqa="tile"``, a scale or softcap that is not a float32, a bias not in q's dtype, sinks (the
``Attention`` op has no sink input; onnxruntime's contrib GroupQueryAttention has one, see
:mod:`oracle.adapters.onnxruntime_gqa`), float8 inputs.

What the peers do that differs from refattn is passed through unchanged and reported by the
oracle (see ``tools/measure_peers.py``): softcap order relative to the bias (onnx issue #7865:
the opset-23 diagram puts softcap before the mask add; implementations have differed), the
fully-masked-row guard (the spec's errata: a zero row), the default scale applied as
``Q*sqrt(scale)`` and ``K*sqrt(scale)`` (two roundings in the input dtype).

Measured (onnx 1.23.2, onnxruntime 1.31.1): both peers cap before the bias (refattn's order,
so #7865 no longer shows here) and give zero rows where every key is excluded (onnxruntime
float64 excepted: NaN, see :mod:`oracle.adapters.onnxruntime`). onnx.reference takes
``sqrt(scale)`` of the float32 ``scale`` attribute in float32, so a float64 model with an
explicit scale has float32-sized score errors (the default scale is computed in float64).

Examples
--------
>>> import numpy as np
>>> from oracle.adapters import get
>>> onnx_ref = get("onnx-reference")  # doctest: +SKIP
>>> q = np.ones((1, 2, 3, 4), np.float32); k = np.ones((1, 2, 5, 4), np.float32)
>>> onnx_ref(q, k, k, causal=True).shape  # doctest: +SKIP
(1, 2, 3, 4)
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import onnx
from onnx import TensorProto, helper

from oracle.adapters import Adapter, exact_cast, reject_common

__all__ = ["OnnxAttentionBase", "OnnxReferenceAttention", "build_attention_model", "ELEM_TYPES"]

#: NumPy dtype name -> ONNX tensor element type.
ELEM_TYPES = {
    "float64": TensorProto.DOUBLE,
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
}

_INPUTS = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")


def _latest_attention_opset() -> int:
    return onnx.defs.get_schema("Attention").since_version


def build_attention_model(
    opset: int, dtype_name: str, shapes: dict, attributes: dict, ir_version: int | None = None
) -> onnx.ModelProto:
    """One ``Attention`` node; ``shapes`` maps each used input name to (dtype name, shape)."""
    used = [name if name in shapes else "" for name in _INPUTS]
    while used and used[-1] == "":
        used.pop()
    node = helper.make_node("Attention", used, ["Y"], **attributes)
    elem = ELEM_TYPES[dtype_name]
    inputs = []
    for name in used:
        if not name:
            continue
        input_dtype, shape = shapes[name]
        input_elem = {"bool": TensorProto.BOOL, "int64": TensorProto.INT64}.get(
            input_dtype, ELEM_TYPES.get(input_dtype)
        )
        inputs.append(helper.make_tensor_value_info(name, input_elem, list(shape)))
    graph = helper.make_graph(
        [node], "refattn_attention", inputs, [helper.make_tensor_value_info("Y", elem, None)]
    )
    opsets = [helper.make_opsetid("", opset)]
    if ir_version is None:
        ir_version = helper.find_min_ir_version_for(opsets)
    return helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)


class OnnxAttentionBase(Adapter):
    """Maps refattn's options to one ONNX Attention node; subclasses run the model."""

    opset = 24
    cache_size = 64
    #: IR version of the built models (None: the lowest that the opset needs).
    ir_version: int | None = None

    def __init__(self):
        self._cache: OrderedDict = OrderedDict()
        attributes = onnx.defs.get_schema("Attention", self.opset).attributes
        self.has_window = "left_window_size" in attributes

    def _float32_attribute(self, option: str, value) -> float:
        single = float(np.float32(value))
        if single != value:
            self.unsupported(
                option,
                value,
                f"its attribute is a 32-bit float and {value!r} is not one (nearest: {single!r})",
            )
        return single

    def _model_inputs(self, spec, return_lse):
        """(attributes, feeds) for the spec, or NotImplementedError."""
        reject_common(
            self,
            spec,
            softcap=True,
            window=self.has_window,
            return_lse=return_lse,
            kv_lengths=self.opset >= 24,
        )
        dtype = spec.q.dtype
        attributes = {}
        if spec.scale is not None:
            attributes["scale"] = self._float32_attribute("scale", spec.scale)
        if spec.softcap is not None:
            attributes["softcap"] = self._float32_attribute("softcap", spec.softcap)
        if spec.causal:
            attributes["is_causal"] = 1
        if spec.window is not None:
            left, right = (-1 if side is None else side for side in spec.window)
            attributes["left_window_size"] = left
            attributes["right_window_size"] = right
        feeds = {"Q": spec.q, "K": spec.k, "V": spec.v}
        feeds = {name: np.ascontiguousarray(a) for name, a in feeds.items()}
        if spec.bias is not None:
            bias = exact_cast(spec.bias, dtype, "bias", self.peer)
            if spec.mask is not None:
                bias = np.where(spec.mask, bias, np.array(-np.inf, dtype))
            feeds["attn_mask"] = np.ascontiguousarray(bias)
        elif spec.mask is not None:
            feeds["attn_mask"] = np.ascontiguousarray(spec.mask)
        if spec.kv_lengths is not None:
            self._kv_lengths(spec, feeds)
        elif spec.offset != 0 and (spec.causal or spec.window is not None):
            if self.opset < 24:
                self.unsupported(
                    "align",
                    spec.align,
                    f"opset {self.opset} has no nonpad_kv_seqlen to move the causal frontier",
                )
            keys = spec.k.shape[2]
            feeds["nonpad_kv_seqlen"] = np.full(spec.q.shape[0], keys, dtype=np.int64)
        return attributes, feeds

    def _kv_lengths(self, spec, feeds):
        """kv_lengths -> ``nonpad_kv_seqlen``: keys j >= S_b excluded and the causal/window
        frontier ``j <= i + S_b - L``, refattn's bottom_right reading; top_left agrees only
        when every S_b = L (or without causal and window)."""
        length = spec.q.shape[2]
        structural = spec.causal or spec.window is not None
        if structural and spec.align == "top_left" and (spec.kv_lengths != length).any():
            self.unsupported(
                "kv_lengths",
                spec.kv_lengths.tolist(),
                "with top_left alignment: its nonpad_kv_seqlen aligns the causal and window "
                "frontier to each row's length (bottom_right)",
            )
        feeds["nonpad_kv_seqlen"] = np.asarray(spec.kv_lengths, dtype=np.int64)

    def _session(self, dtype_name, feeds, attributes):
        key = (
            dtype_name,
            tuple((n, a.dtype.name, a.shape) for n, a in feeds.items()),
            tuple(sorted(attributes.items())),
        )
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        shapes = {name: (a.dtype.name, a.shape) for name, a in feeds.items()}
        model = build_attention_model(
            self.opset, dtype_name, shapes, attributes, ir_version=self.ir_version
        )
        session = self._make_session(model)
        self._cache[key] = session
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return session

    def _forward(self, spec, return_lse):
        attributes, feeds = self._model_inputs(spec, return_lse)
        session = self._session(spec.q.dtype.name, feeds, attributes)
        return self._run(session, feeds), None

    def _make_session(self, model):  # pragma: no cover - abstract
        raise NotImplementedError

    def _run(self, session, feeds):  # pragma: no cover - abstract
        raise NotImplementedError


class OnnxReferenceAttention(OnnxAttentionBase):
    """refattn's calling convention over onnx.reference's Attention."""

    name = "onnx-reference"
    opset = _latest_attention_opset()
    peer = f"onnx {onnx.__version__} onnx.reference Attention-{opset}"
    fully_masked_rows = "zero"

    def _make_session(self, model):
        # optional package (onnx extra): its reference evaluator loads when this adapter runs
        from onnx.reference import ReferenceEvaluator

        return ReferenceEvaluator(model)

    def _run(self, session, feeds):
        (out,) = session.run(None, feeds)
        return np.asarray(out)
