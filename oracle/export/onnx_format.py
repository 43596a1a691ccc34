"""Fixtures as ONNX backend tests: one ``Attention`` node (opset 23/24) per expressible case.

Layout, as onnx's backend test data (``onnx/backend/test/data/node/<test>/``): per case a folder
``<case>/model.onnx`` + ``<case>/test_data_set_0/input_<i>.pb`` (one TensorProto per graph
input, in order) and ``output_0.pb``: ``Y``, refattn's exact ``out`` rounded once to the case
dtype. ``export.json`` lists every case, exported or ``skipped`` with the reason; the same list
is in ``README.md``.

The node's conventions (ONNX ``docs/Operators.md``, ``Attention``; reference implementation
``onnx/reference/ops/op_attention.py``) and how a case maps onto them:

* inputs ``Q (B, H, L, D)``, ``K (B, K, S, D)``, ``V (B, K, S, E)`` (4-D: no
  ``q_num_heads``/``kv_num_heads``); GQA reads kv head ``h // (H/K)`` = refattn's
  ``gqa="interleave"`` (``"tile"`` is expressible only when K is 1 or H);
* ``scale`` (float32 attribute; refattn's default 1/sqrt(D) is the node's default, so it is
  left unset); ``softcap`` (float32 attribute) applied to the scaled scores before mask and
  bias, as refattn's softcap (the spec: "applied before mask / bias addition and softmax");
* ``is_causal``: ``j <= i + offset`` with offset 0 without a cache (refattn's top-left),
  ``nonpad_kv_seqlen[b] - L`` with opset 24's ``nonpad_kv_seqlen`` -- refattn's
  ``align="bottom_right"`` with (or without) ``kv_lengths``; any other combination, and every
  ``window``, is folded into a boolean ``attn_mask`` from :mod:`refattn.spec`'s intervals
  (same allowed set, the node's is_causal off);
* ``attn_mask``: bool (True = attend; refattn's mask, and the folded structure) or, with a
  bias, a float mask of the case dtype added to the scores (the bias, -inf where excluded);
* fully masked rows give zero output (the spec's errata), as refattn's ``empty_rows="zero"``.

Not expressible (listed, never exported under other semantics): sinks, dropout, ALiBi (no
input; an additive mask in the case dtype would round ``-m_h |i + o - j|``), float8 inputs with
descales, ``gqa="tile"`` with 1 < K < H, a scale or softcap that is not a float32, a bias not in
the case dtype, NaN/Inf in q, k or v (the node excludes a key by adding -inf to its score, so
NaN keys or values still reach the result), ``empty_rows="nan"`` with an empty row, gradients
(only the forward ``Y`` is a node output; gradient cases export their forward part).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx  # ModuleNotFoundError(name="onnx") when absent: oracle.export names it
from onnx import TensorProto, helper, numpy_helper

from oracle.export._driver import NO_TRUTH, Format, has_empty_row, publish
from oracle.fixtures import atomic as _atomic
from oracle.fixtures import golden
from refattn.spec import canonicalize

__all__ = ["FORMAT", "node_plan", "OPSET_WITHOUT_LENGTHS", "OPSET_WITH_LENGTHS"]

OPSET_WITHOUT_LENGTHS = 23
OPSET_WITH_LENGTHS = 24  # nonpad_kv_seqlen first appears in Attention-24
_ELEMENT_TYPES = {
    "float64": TensorProto.DOUBLE,
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
    "bool": TensorProto.BOOL,
    "int64": TensorProto.INT64,
}


def _float32_exact(value: float) -> bool:
    return float(np.float32(value)) == float(value)


def _why_not(fixture: golden.Fixture) -> str | None:
    """Why one Attention node cannot state the case (None when it can)."""
    case, inputs, options = fixture.case, fixture.inputs, fixture.case.options
    shapes = case.shapes
    if case.function != "attention":
        return f"function {case.function!r} is not attention"
    if golden.truth_kind_of(case) != golden.TRUTH_KIND:
        return NO_TRUTH
    if "q_descale" in inputs or inputs["q"].dtype.name.startswith("float8"):
        return "float8 inputs with descales: the node's T1 has no float8 type"
    if "k_block_scale" in inputs or "q_block_scale" in inputs:
        return "fp4 inputs with block scales: the node has no float4 type or block scales"
    if "sinks" in inputs:
        return "attention sinks: the node has no sink input"
    if "key_indices" in inputs or "key_block_indices" in inputs:
        return "sparse key indices: the node has no index input"
    if options.get("normalizer") == "sigmoid":
        return "normalizer='sigmoid': the node computes a softmax"
    if "qv" in inputs:
        return "qv (FlashAttention 3's latent term): the node has no such input"
    if "dropout_mask" in inputs or options.get("dropout_p", 0.0):
        return "dropout: the node has no keep-mask input"
    if "alibi_slopes" in inputs:
        return (
            "ALiBi: the node has no slope input, and an additive attn_mask in the case dtype "
            "would round -m_h|i+o-j|"
        )
    if options.get("gqa", "interleave") == "tile" and 1 < shapes.K < shapes.H:
        return "gqa='tile' (head h reads kv head h % K); the node reads kv head h // (H/K)"
    for name in ("scale", "softcap"):
        value = options.get(name)
        if value is not None and not _float32_exact(value):
            return f"{name}={value!r} is not a float32 (the node's attribute is a float32)"
    if "bias" in inputs and inputs["bias"].dtype.name != case.dtype:
        return f"bias of dtype {inputs['bias'].dtype}: a float attn_mask has the case dtype"
    for name in ("q", "k", "v"):
        if not np.isfinite(inputs[name].astype(np.float64)).all():
            return (
                f"NaN/Inf in {name} at excluded positions: the node excludes a key by adding "
                "-inf to its score, so they still reach the result"
            )
    if inputs["q"].ndim != 4:
        return f"q of rank {inputs['q'].ndim}: the node takes one batch dimension"
    return None


def _canonical(fixture: golden.Fixture):
    return canonicalize(
        fixture.inputs["q"], fixture.inputs["k"], fixture.inputs["v"], **fixture.options
    )


def node_plan(fixture: golden.Fixture) -> dict:
    """How the case is stated as one Attention node: inputs, attributes, opset (or a reason).

    Returns ``{"skipped": reason}`` or ``{"inputs": {name: array}, "attributes": {...},
    "opset": int, "output": array, "folded": bool}``.
    """
    reason = _why_not(fixture)
    if reason is not None:
        return {"skipped": reason}
    spec = _canonical(fixture)
    batch, heads, _, length, keys, _, _ = spec.dims
    options, inputs = fixture.case.options, fixture.inputs
    causal, window = bool(options.get("causal", False)), options.get("window")
    lengths = inputs.get("kv_lengths")
    if lengths is None and causal and window is None and spec.offset != 0:
        lengths = np.full(batch, keys)  # bottom-right without lengths: nonpad = S, offset S - L
    node_offsets = (
        np.zeros(batch, np.int64) if lengths is None else np.asarray(lengths, np.int64) - length
    )
    refattn_offsets = np.array([spec.row_offset(b) for b in range(batch)], np.int64)
    native_causal = causal and window is None and (node_offsets == refattn_offsets).all()
    folded = (causal or window is not None) and not native_causal
    lo, hi = spec.intervals()  # (B, L): the structural rule of refattn.spec
    columns = np.arange(keys)
    structural = ((columns >= lo[..., None]) & (columns < hi[..., None]))[:, None]
    allowed = np.ones((batch, heads, length, keys), bool)
    if folded:
        allowed &= structural
    if "mask" in inputs:
        allowed &= np.broadcast_to(inputs["mask"], allowed.shape)
    if options.get("empty_rows", "zero") == "nan" and has_empty_row(spec):
        return {"skipped": "empty_rows='nan': the node returns zero rows for empty rows"}
    graph_inputs = {name: inputs[name] for name in ("q", "k", "v")}
    if "bias" in inputs:
        bias = np.broadcast_to(inputs["bias"], allowed.shape)
        # -inf at every excluded position, natively causal ones included: a bias poisoned
        # there (NaN) would otherwise reach the sum, as -inf + NaN is NaN
        excluded = ~(allowed & structural)
        graph_inputs["attn_mask"] = np.where(excluded, -np.inf, bias).astype(bias.dtype)
    elif folded or "mask" in inputs:
        graph_inputs["attn_mask"] = allowed
    if lengths is not None:
        graph_inputs["nonpad_kv_seqlen"] = np.asarray(lengths, np.int64)
    attributes = {"is_causal": 1} if native_causal else {}
    for name in ("scale", "softcap"):
        if options.get(name) is not None:
            attributes[name] = float(options[name])
    return {
        "inputs": graph_inputs,
        "attributes": attributes,
        "opset": OPSET_WITH_LENGTHS if lengths is not None else OPSET_WITHOUT_LENGTHS,
        "output": fixture.truth["out"],
        "folded": folded,
    }


_NODE_INPUTS = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
_GRAPH_NAMES = {
    "q": "Q",
    "k": "K",
    "v": "V",
    "attn_mask": "attn_mask",
    "nonpad_kv_seqlen": "nonpad_kv_seqlen",
}


def _value_info(name: str, array: np.ndarray):
    kind = "bool" if array.dtype == bool else array.dtype.name
    return helper.make_tensor_value_info(name, _ELEMENT_TYPES[kind], list(array.shape))


def model_of(plan: dict, name: str) -> onnx.ModelProto:
    """The one-node model of a plan (graph inputs in node order, output ``Y``)."""
    present = {_GRAPH_NAMES[k]: v for k, v in plan["inputs"].items()}
    used = [n for n in _NODE_INPUTS if n in present]
    node_inputs = _NODE_INPUTS[: _NODE_INPUTS.index(used[-1]) + 1]
    node = helper.make_node(
        "Attention",
        [n if n in present else "" for n in node_inputs],
        ["Y"],
        **plan["attributes"],
    )
    graph = helper.make_graph(
        [node],
        name.replace("-", "_"),
        [_value_info(n, present[n]) for n in used],
        [_value_info("Y", plan["output"])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", plan["opset"])],
        producer_name="refattn oracle.export",
    )
    model.ir_version = 10 if plan["opset"] <= 23 else 11
    return model


def _tensor_bytes(array: np.ndarray, name: str) -> bytes:
    return numpy_helper.from_array(np.ascontiguousarray(array), name).SerializeToString()


def _write(fixture: golden.Fixture, staging: Path, out: Path) -> dict:
    plan = node_plan(fixture)
    entry = {"name": fixture.name, "dtype": fixture.case.dtype}
    if "skipped" in plan:
        return {**entry, "skipped": plan["skipped"]}
    folder = staging / fixture.name
    data = folder / "test_data_set_0"
    data.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(model_of(plan, fixture.name).SerializeToString())
    for index, (key, array) in enumerate(plan["inputs"].items()):
        (data / f"input_{index}.pb").write_bytes(_tensor_bytes(array, _GRAPH_NAMES[key]))
    (data / "output_0.pb").write_bytes(_tensor_bytes(plan["output"], "Y"))
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    publish(staging, out, fixture.name)
    return {
        **entry,
        "files": [fixture.name],
        "opset": plan["opset"],
        "attributes": plan["attributes"],
        "graph_inputs": [_GRAPH_NAMES[k] for k in plan["inputs"]],
        "structure_folded_into_mask": plan["folded"],
        "gradients_not_exported": fixture.case.grads,
        "bytes": size,
    }


def _finish(out: Path, entries: list[dict], staging: Path) -> dict:
    lines = [
        "# ONNX Attention backend tests exported by refattn",
        "",
        "One folder per case: `model.onnx` (one Attention node, opset 23, or 24 with",
        "`nonpad_kv_seqlen`) and `test_data_set_0/` (`input_*.pb`, `output_0.pb`). The expected",
        "output is refattn's exact result rounded once to the case dtype (ties to even).",
        "",
        "## Cases the node cannot express",
        "",
    ]
    skipped = [e for e in entries if e.get("skipped")]
    lines += [f"- `{e['name']}`: {e['skipped']}" for e in skipped] or ["(none)"]
    _atomic.write_atomic(out / "README.md", ("\n".join(lines) + "\n").encode())
    return {"readme": "README.md", "node": "Attention", "domain": "ai.onnx"}


FORMAT = Format("onnx", _write, _finish)
