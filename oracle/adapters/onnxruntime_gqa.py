"""Adapter for onnxruntime's contrib operator ``GroupQueryAttention`` (domain com.microsoft) on
the CPU: the KV-cache attention of decoder models, with per-row cache lengths (``seqlens_k``)
and attention sinks (``head_sink``, onnxruntime >= 1.23).

The operator is causal by construction: query token i of batch row b sits at position
``S_b - L + i`` of a cache holding S_b keys, so key j is allowed iff
``S_b - L + i - w < j <= S_b - L + i`` (``w = local_window_size``, unbounded when -1): refattn's
``causal=True, align="bottom_right"`` with ``kv_lengths`` (offset o_b = S_b - L) and
``window=(w - 1, 0)``. The adapter states every case in that form and runs it only when the
operator's allowed set *equals* refattn's for every batch row (compared element by element,
:meth:`OnnxRuntimeGQA._window`); anything else is unsupported.

Option mapping (refattn -> GroupQueryAttention, onnxruntime 1.32):

=================  ==================================================================
refattn            GroupQueryAttention
=================  ==================================================================
q (B, H, L, D)     ``query`` (B, L, H*D)
k, v (B, K, S, D)  ``past_key``/``past_value`` (B, K, S, D) hold the cache; ``key``/``value``
                   (B, L, K*D) are its last L positions of each row (S_b - L .. S_b - 1),
                   which the operator writes back in place: the same values. With L > 1
                   and B > 1 each batch row is one call (the operator takes batches of
                   several rows only with one query token each)
kv_lengths         ``seqlens_k = S_b - 1`` (int32), ``total_sequence_length = S``; without
                   kv_lengths every S_b = S. Rows with S_b < L are unsupported (no cache
                   position for their first queries)
causal, window     the operator's own causal set and ``local_window_size = left + 1``
sinks              ``head_sink`` (H,), in q's dtype
scale, softcap     ``scale`` / ``softcap`` attributes (32-bit floats: exactly, or unsupported)
GQA (interleave)   ``num_heads = H``, ``kv_num_heads = K`` (head h reads kv head h // G)
=================  ==================================================================

Unsupported (NotImplementedError): float64 (no such type), bfloat16 (no CPU kernel), E != D,
mask, bias, ALiBi, dropout, ``gqa="tile"``, return_lse (the output has no lse), float8 inputs,
and any causal/window/alignment whose allowed set is not the operator's. Measured
(onnxruntime 1.32.0): float32 and float16 agree with the exact truth within the oracle's
thresholds on the catalogue's sink and cache-length cases.

Examples
--------
>>> import numpy as np
>>> from oracle.adapters import get
>>> gqa = get("onnxruntime-gqa")  # doctest: +SKIP
>>> q = np.ones((1, 4, 1, 8), np.float32); k = np.ones((1, 2, 6, 8), np.float32)
>>> gqa(q, k, k, causal=True, align="bottom_right", sinks=np.zeros(4, np.float32)).shape
... # doctest: +SKIP
(1, 4, 1, 8)
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import onnxruntime
from onnx import TensorProto, helper
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from oracle.adapters import Adapter, exact_cast, reject_common

__all__ = ["OnnxRuntimeGQA"]

_ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
_INPUTS = (
    "query",
    "key",
    "value",
    "past_key",
    "past_value",
    "seqlens_k",
    "total_sequence_length",
    "cos_cache",
    "sin_cache",
    "position_ids",
    "attention_bias",
    "head_sink",
)


class OnnxRuntimeGQA(Adapter):
    """refattn's calling convention over onnxruntime's GroupQueryAttention (CPU)."""

    name = "onnxruntime-gqa"
    peer = f"onnxruntime {onnxruntime.__version__} GroupQueryAttention (com.microsoft, CPU)"
    fully_masked_rows = "none (every row it accepts has a key)"
    cache_size = 32

    def __init__(self):
        self._cache: OrderedDict = OrderedDict()

    def _float32_attribute(self, option, value) -> float:
        single = float(np.float32(value))
        if single != value:
            self.unsupported(
                option, value, f"its attribute is a 32-bit float and {value!r} is not one"
            )
        return single

    def _window(self, spec) -> int:
        """``local_window_size`` whose causal set equals refattn's allowed set in every batch
        row (else NotImplementedError)."""
        length, keys = spec.q.shape[2], spec.k.shape[2]
        lengths = spec.kv_lengths if spec.kv_lengths is not None else np.full(spec.q.shape[0], keys)
        if (lengths < length).any():
            self.unsupported(
                "kv_lengths",
                lengths.tolist(),
                f"a cache shorter than the L = "
                f"{length} queries has no position for its first queries",
            )
        left = None if spec.window is None else spec.window[0]
        size = -1 if left is None else left + 1
        rows, cols = np.arange(length)[:, None], np.arange(keys)[None, :]
        for b, own in enumerate(lengths.tolist()):
            position = rows + own - length
            theirs = (cols <= position) & ((size < 0) | (cols > position - size))
            if not np.array_equal(spec.structural(b=b), theirs):
                self.unsupported(
                    "causal",
                    spec.causal,
                    "its only allowed set is causal, "
                    "bottom-right aligned to each row's cache length (with a "
                    "left window); this case's set differs",
                )
        return size

    def _feeds(self, spec, return_lse):
        reject_common(
            self,
            spec,
            softcap=True,
            window=True,
            return_lse=return_lse,
            sinks=True,
            kv_lengths=True,
        )
        dtype = spec.q.dtype
        if dtype.name not in _ELEM:
            self.unsupported("q", f"<{dtype.name}>", "its CPU kernel takes float32 and float16")
        if spec.mask is not None or spec.bias is not None:
            self.unsupported(
                "mask" if spec.bias is None else "bias",
                "<array>",
                "the adapter maps no attention_bias",
            )
        batch, heads, length, dim = spec.q.shape
        kv_heads, keys, vdim = spec.v.shape[1:]
        if vdim != dim:
            self.unsupported("v", f"E={vdim} != D={dim}", "value heads must have the key size")
        attributes = {
            "num_heads": heads,
            "kv_num_heads": kv_heads,
            "local_window_size": self._window(spec),
        }
        if spec.scale is not None:
            attributes["scale"] = self._float32_attribute("scale", spec.scale)
        if spec.softcap is not None:
            attributes["softcap"] = self._float32_attribute("softcap", spec.softcap)
        lengths = spec.kv_lengths if spec.kv_lengths is not None else np.full(batch, keys)
        new_k = np.stack([spec.k[b, :, n - length : n] for b, n in enumerate(lengths.tolist())])
        new_v = np.stack([spec.v[b, :, n - length : n] for b, n in enumerate(lengths.tolist())])

        def packed(x):  # (B, X, L, D) -> (B, L, X*D)
            return np.ascontiguousarray(np.swapaxes(x, 1, 2).reshape(batch, length, -1))

        feeds = {
            "query": packed(spec.q),
            "key": packed(new_k),
            "value": packed(new_v),
            "past_key": np.array(spec.k, copy=True),
            "past_value": np.array(spec.v, copy=True),
            "seqlens_k": (np.asarray(lengths) - 1).astype(np.int32),
            "total_sequence_length": np.array(keys, dtype=np.int32),
        }
        if spec.sinks is not None:
            feeds["head_sink"] = exact_cast(spec.sinks, dtype, "sinks", self.peer)
        return attributes, feeds

    def _session(self, dtype_name, feeds, attributes):
        key = (
            dtype_name,
            tuple((n, a.dtype.name, a.shape) for n, a in feeds.items()),
            tuple(sorted(attributes.items())),
        )
        if key not in self._cache:
            self._cache[key] = self._build(dtype_name, feeds, attributes)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key]

    def _build(self, dtype_name, feeds, attributes):
        used = [name if name in feeds else "" for name in _INPUTS]
        while used[-1] == "":
            used.pop()
        elem = _ELEM[dtype_name]
        node = helper.make_node(
            "GroupQueryAttention",
            used,
            ["Y", "present_key", "present_value"],
            domain="com.microsoft",
            **attributes,
        )
        inputs = [
            helper.make_tensor_value_info(
                name,
                TensorProto.INT32 if feeds[name].dtype == np.int32 else elem,
                list(feeds[name].shape),
            )
            for name in used
            if name
        ]
        outputs = [
            helper.make_tensor_value_info(name, elem, None)
            for name in ("Y", "present_key", "present_value")
        ]
        graph = helper.make_graph([node], "refattn_gqa", inputs, outputs)
        model = helper.make_model(
            graph,
            ir_version=10,
            opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        )
        options = onnxruntime.SessionOptions()
        # One thread: results must not depend on the machine's core count.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # a refused call is reported as unsupported, not logged
        try:
            return onnxruntime.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
        except (_ort_state.NotImplemented, _ort_state.Fail, _ort_state.InvalidGraph) as err:
            raise NotImplementedError(
                f"{self.peer} cannot build this model ({dtype_name}): {err}"
            ) from err

    def _forward(self, spec, return_lse):
        attributes, feeds = self._feeds(spec, return_lse)
        batch, heads, length, dim = spec.q.shape
        # the operator takes a batch of several rows only for one query token each (decode);
        # with L > 1 each batch row is its own call (the rows are independent problems)
        parts = (
            [feeds]
            if batch == 1 or length == 1
            else [
                {
                    name: a[b : b + 1] if a.ndim and name != "head_sink" else a
                    for name, a in feeds.items()
                }
                for b in range(batch)
            ]
        )
        outs = []
        for part in parts:
            session = self._session(spec.q.dtype.name, part, attributes)
            try:
                outs.append(np.asarray(session.run(["Y"], part)[0]))
            except (_ort_state.NotImplemented, _ort_state.InvalidArgument) as err:
                raise NotImplementedError(
                    f"{self.peer} refuses this call: {str(err).splitlines()[0]}"
                ) from err
        out = np.concatenate(outs, axis=0)
        return np.swapaxes(out.reshape(batch, length, heads, dim), 1, 2), None
