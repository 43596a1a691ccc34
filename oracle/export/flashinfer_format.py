"""Fixtures as FlashInfer-Trace: definitions, workloads and the exact outputs.

The FlashInfer-Trace schema (flashinfer-ai/flashinfer-bench: ``flashinfer_bench/data/
definition.py``, ``workload.py``, ``trace.py``; dataset layout ``definitions/<op_type>/``,
``workloads/<op_type>/``, ``blob/``) states an operation as a *Definition* (named axes, const
or var; typed inputs and outputs; a Python reference ``run``) and each captured call as a
*Workload* (var axis values, inputs from safetensors blobs or scalars), stored as a workload
trace (``{"definition", "workload"}``, no solution or evaluation) per JSONL line.

The attention it states is ``gqa_ragged`` prefill (as its ``gqa_ragged_prefill_causal_h32_kv8_
d128`` definition): q (total_q, H, D), k, v (total_kv, K, D) packed by ``qo_indptr`` /
``kv_indptr``, ``sm_scale`` a float32 scalar, GQA kv head ``h // (H/K)``, causal aligned
bottom-right (``j < i + 1 + kv_len - q_len``), outputs ``output`` (total_q, H, D) in the input
dtype and ``lse`` (total_q, H) float32 in base 2. A case exports when it is refattn.attention
with nothing else but causal (bottom-right, or L = S), ``kv_lengths`` (the ragged key lengths),
GQA interleave, D = E, a float32/float16/bfloat16 dtype and a scale that is a float32 (the
default 1/sqrt(D) only for D a perfect square); the rest is listed with the reason.

Written here (``out``): ``definitions/gqa_ragged/refattn_<...>.json`` (one per head/dim/dtype/
causal family), ``workloads/gqa_ragged/<definition>.jsonl``, ``blob/workloads/gqa_ragged/
<definition>/<case>.safetensors`` (q, k, v, qo_indptr, kv_indptr) and -- refattn's addition,
outside the schema -- ``expected/gqa_ragged/<definition>/<case>.safetensors``: ``output`` the
exact result rounded once to the dtype, ``lse`` the exact base-2 log-sum-exp rounded once to
float32 (certified from the float64 truth; an element it cannot certify fails the export).
"""

from __future__ import annotations

import json
import math
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np

from oracle.export._driver import NO_TRUTH, Format, has_empty_row, publish
from oracle.export.safetensors_format import read_safetensors, safetensors_bytes
from oracle.fixtures import atomic as _atomic
from oracle.fixtures import golden
from refattn.spec import canonicalize

__all__ = ["FORMAT", "OP_TYPE", "workload_plan", "read_workload"]

OP_TYPE = "gqa_ragged"
_DTYPES = ("float32", "float16", "bfloat16")
#: flashinfer-bench judges a solution at a fixed absolute and relative tolerance of 1e-2.
BENCH_TOLERANCE = 1e-2
_UUID_NAMESPACE = uuid.UUID("8a5b0d5e-2f1c-4c61-9d0a-7c2f0e6b5a11")

# The reference ``run`` of every exported definition (written for refattn; same call as the
# dataset's gqa_ragged definitions, with the empty-row guard refattn's empty_rows="zero" has).
_REFERENCE = """import math

import torch


@torch.no_grad()
def run(q, k, v, qo_indptr, kv_indptr, sm_scale):
    total_q, num_qo_heads, head_dim = q.shape
    group = num_qo_heads // k.shape[1]
    output = torch.zeros_like(q)
    lse = torch.full((total_q, num_qo_heads), -math.inf, dtype=torch.float32, device=q.device)
    for b in range(qo_indptr.shape[0] - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        qb = q[q0:q1].double()
        kb = k[k0:k1].double().repeat_interleave(group, dim=1)
        vb = v[k0:k1].double().repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", qb, kb) * float(sm_scale)
        if CAUSAL:
            rows = torch.arange(q1 - q0, device=q.device)[:, None]
            cols = torch.arange(k1 - k0, device=q.device)[None, :]
            logits = logits.masked_fill(cols > rows + (k1 - k0) - (q1 - q0), -math.inf)
        row_lse = torch.logsumexp(logits, dim=-1)
        weights = torch.exp(logits - row_lse[..., None]).nan_to_num(0.0)
        output[q0:q1] = torch.einsum("hqk,khd->qhd", weights, vb).to(q.dtype)
        lse[q0:q1] = (row_lse / math.log(2.0)).transpose(0, 1).float()
    return output, lse
"""


def _float32_exact(value: float) -> bool:
    return float(np.float32(value)) == float(value)


def _scale(case, dim: int) -> float | None:
    scale = case.options.get("scale")
    if scale is None:
        root = math.isqrt(dim)
        return 1.0 / root if root * root == dim else None
    return float(scale) if _float32_exact(scale) else None


def _why_not(fixture: golden.Fixture) -> str | None:
    case, inputs, options = fixture.case, fixture.inputs, fixture.case.options
    n = case.shapes
    if case.function != "attention":
        return f"function {case.function!r} is not attention"
    if golden.truth_kind_of(case) != golden.TRUTH_KIND:
        return NO_TRUTH
    if case.dtype not in _DTYPES:
        return f"dtype {case.dtype}: the schema's tensor dtypes have no float64"
    if inputs["q"].dtype.name.startswith("float8"):
        return "float8 inputs with descales: gqa_ragged takes q, k, v of one dtype, no descale"
    if options.get("normalizer") == "sigmoid":
        return "normalizer='sigmoid': gqa_ragged computes a softmax (and its lse)"
    if "k_block_scale" in inputs or "q_block_scale" in inputs:
        return "fp4 inputs with block scales: gqa_ragged has no block-scale input"
    for name in (
        "mask",
        "bias",
        "alibi_slopes",
        "sinks",
        "dropout_mask",
        "key_indices",
        "key_block_indices",
        "qv",
    ):
        if name in inputs:
            return f"{name}: gqa_ragged has no such input"
    for name in ("softcap", "window"):
        if options.get(name) is not None:
            return f"{name}: gqa_ragged has no such parameter"
    if options.get("dropout_p", 0.0):
        return "dropout: gqa_ragged has no such input"
    if options.get("gqa", "interleave") == "tile" and 1 < n.K < n.H:
        return "gqa='tile' (kv head h % K); gqa_ragged reads kv head h // (H/K)"
    if n.D != n.E:
        return f"D={n.D} != E={n.E}: gqa_ragged has one head_dim"
    if _scale(case, n.D) is None:
        what = case.options.get("scale")
        return (
            f"scale={what!r} is not a float32"
            if what is not None
            else f"scale 1/sqrt({n.D}) is irrational; sm_scale is a float32 input"
        )
    causal, align = options.get("causal", False), options.get("align", "top_left")
    lengths = inputs.get("kv_lengths")
    key_counts = [n.S] * n.batch if lengths is None else [int(s) for s in np.ravel(lengths)]
    if causal and align == "top_left" and any(s != n.L for s in key_counts):
        return "causal aligned top-left with S != L: gqa_ragged aligns causal bottom-right"
    if inputs["q"].ndim != 4:
        return f"q of rank {inputs['q'].ndim}: one batch dimension expected"
    return None


def _packed_keys(array: np.ndarray, counts: list[int]) -> np.ndarray:
    """(B, K, S, D) -> (sum S_b, K, D): batch row b's first S_b keys."""
    return np.concatenate([array[b, :, : counts[b]].transpose(1, 0, 2) for b in range(len(counts))])


def _lse2(lse_f64: np.ndarray) -> np.ndarray:
    """Exact log2-sum-exp rounded once to float32, from the natural lse rounded to float64.

    lse_f64 = lse (1 + d), |d| <= 2**-53; lse / ln 2 is bracketed by the float64 quotient
    widened by 4 units of 2**-53 (the quotient's and ln 2's roundings included). When both
    ends round to the same float32, that float32 is the correctly rounded value.
    """
    quotient = lse_f64 / math.log(2.0)
    finite = np.isfinite(quotient)
    width = np.where(finite, np.abs(quotient) * 4 * 2.0**-53, 0.0)
    low, high = (quotient - width).astype(np.float32), (quotient + width).astype(np.float32)
    if (low[finite] != high[finite]).any():
        raise ValueError("flashinfer-trace: a base-2 lse element cannot be certified in float32")
    return np.where(finite, low, quotient.astype(np.float32))


def workload_plan(fixture: golden.Fixture) -> dict:
    """The definition, workload tensors and exact outputs of a case (or ``{"skipped": why}``)."""
    reason = _why_not(fixture)
    if reason is None and fixture.case.options.get("empty_rows", "zero") == "nan":
        spec = canonicalize(
            fixture.inputs["q"], fixture.inputs["k"], fixture.inputs["v"], **fixture.options
        )
        if has_empty_row(spec):
            reason = "empty_rows='nan': the reference returns zero rows for empty rows"
    if reason is not None:
        return {"skipped": reason}
    case, inputs, n = fixture.case, fixture.inputs, fixture.case.shapes
    lengths = inputs.get("kv_lengths")
    counts = [n.S] * n.batch if lengths is None else [int(s) for s in np.ravel(lengths)]
    causal = bool(case.options.get("causal", False))
    tag = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[case.dtype]
    name = f"refattn_gqa_ragged_prefill{'_causal' if causal else ''}_h{n.H}_kv{n.K}_d{n.D}_{tag}"
    tensors = {
        "q": inputs["q"].transpose(0, 2, 1, 3).reshape(n.batch * n.L, n.H, n.D),
        "k": _packed_keys(inputs["k"], counts),
        "v": _packed_keys(inputs["v"], counts),
        "qo_indptr": np.arange(n.batch + 1, dtype=np.int32) * n.L,
        "kv_indptr": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
    }
    if not all(np.isfinite(t.astype(np.float64)).all() for t in tensors.values()):
        return {"skipped": "NaN/Inf in q, k or v at an excluded key the ragged layout keeps"}
    expected = {
        "output": fixture.truth["out"].transpose(0, 2, 1, 3).reshape(n.batch * n.L, n.H, n.E),
        "lse": _lse2(fixture.truth["lse_f64"]).transpose(0, 2, 1).reshape(n.batch * n.L, n.H),
    }
    return {
        "definition": _definition(name, case.dtype, n, causal),
        "tensors": tensors,
        "expected": expected,
        "sm_scale": _scale(case, n.D),
    }


def _definition(name: str, dtype: str, n, causal: bool) -> dict:
    tensor = {"dtype": dtype}
    return {
        "name": name,
        "op_type": OP_TYPE,
        "description": "Ragged (variable-length) batched GQA prefill"
        + (", causal aligned bottom-right" if causal else "")
        + "; exported by refattn with exact outputs (expected/).",
        "tags": ["stage:prefill", "source:refattn"],
        "axes": {
            "num_qo_heads": {"type": "const", "value": n.H},
            "num_kv_heads": {"type": "const", "value": n.K},
            "head_dim": {"type": "const", "value": n.D},
            "len_indptr": {"type": "var", "description": "batch size + 1"},
            "total_q": {"type": "var", "description": "query tokens of the batch"},
            "total_kv": {"type": "var", "description": "key/value tokens of the batch"},
        },
        "constraints": ["total_q == qo_indptr[-1].item()", "total_kv == kv_indptr[-1].item()"],
        "inputs": {
            "q": {**tensor, "shape": ["total_q", "num_qo_heads", "head_dim"]},
            "k": {**tensor, "shape": ["total_kv", "num_kv_heads", "head_dim"]},
            "v": {**tensor, "shape": ["total_kv", "num_kv_heads", "head_dim"]},
            "qo_indptr": {"dtype": "int32", "shape": ["len_indptr"]},
            "kv_indptr": {"dtype": "int32", "shape": ["len_indptr"]},
            "sm_scale": {"dtype": "float32", "shape": None, "description": "softmax scale"},
        },
        "outputs": {
            "output": {**tensor, "shape": ["total_q", "num_qo_heads", "head_dim"]},
            "lse": {
                "dtype": "float32",
                "shape": ["total_q", "num_qo_heads"],
                "description": "base-2 log-sum-exp of the scaled logits",
            },
        },
        "reference": _REFERENCE.replace("CAUSAL", "True" if causal else "False"),
    }


def _relative(definition: str, case: str, root: str) -> str:
    return f"{root}/{OP_TYPE}/{definition}/{case}.safetensors"


def _write(fixture: golden.Fixture, staging: Path, out: Path) -> dict:
    plan = workload_plan(fixture)
    entry = {"name": fixture.name, "dtype": fixture.case.dtype}
    if "skipped" in plan:
        return {**entry, "skipped": plan["skipped"]}
    definition = plan["definition"]["name"]
    contract = fixture.case.spec_json()
    files = []
    for root, tensors in (("blob/workloads", plan["tensors"]), ("expected", plan["expected"])):
        relative = _relative(definition, fixture.name, root)
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        _atomic.write_atomic(out / relative, safetensors_bytes(tensors, {"case": contract}))
        files.append(relative)
    counts = plan["tensors"]
    workload = {
        "axes": {
            "len_indptr": int(counts["qo_indptr"].shape[0]),
            "total_q": int(counts["q"].shape[0]),
            "total_kv": int(counts["k"].shape[0]),
        },
        "inputs": {
            **{
                key: {"type": "safetensors", "path": files[0], "tensor_key": key}
                for key in plan["tensors"]
            },
            "sm_scale": {"type": "scalar", "value": plan["sm_scale"]},
        },
        "uuid": str(uuid.uuid5(_UUID_NAMESPACE, fixture.name)),
    }
    return {
        **entry,
        "files": files,
        "definition": definition,
        "_definition_json": plan["definition"],
        "workload": workload,
    }


def _finish(out: Path, entries: list[dict], staging: Path) -> dict:
    definitions, workloads = {}, defaultdict(list)
    for entry in entries:
        if entry.get("skipped"):
            continue
        name = entry["definition"]
        definitions[name] = entry.pop("_definition_json")
        trace = {
            "definition": name,
            "workload": entry["workload"],
            "solution": None,
            "evaluation": None,
        }
        workloads[name].append(json.dumps(trace, sort_keys=True))
    for name, definition in definitions.items():
        relative = f"definitions/{OP_TYPE}/{name}.json"
        (staging / relative).parent.mkdir(parents=True, exist_ok=True)
        (staging / relative).write_text(json.dumps(definition, indent=2) + "\n")
        publish(staging, out, relative)
        relative = f"workloads/{OP_TYPE}/{name}.jsonl"
        (staging / relative).parent.mkdir(parents=True, exist_ok=True)
        (staging / relative).write_text("\n".join(workloads[name]) + "\n")
        publish(staging, out, relative)
    return {"definitions": sorted(definitions), "op_type": OP_TYPE}


FORMAT = Format("flashinfer-trace", _write, _finish)


def read_workload(out, definition: str, case: str) -> dict:
    """(tensors, expected, workload trace) of one exported case, read back from ``out``."""
    out = Path(out)
    lines = (out / f"workloads/{OP_TYPE}/{definition}.jsonl").read_text().splitlines()
    wanted = str(uuid.uuid5(_UUID_NAMESPACE, case))
    trace = next(
        json.loads(line) for line in lines if json.loads(line)["workload"]["uuid"] == wanted
    )
    inputs = trace["workload"]["inputs"]
    blob, _ = read_safetensors((out / inputs["q"]["path"]).read_bytes())
    expected, _ = read_safetensors((out / _relative(definition, case, "expected")).read_bytes())
    tensors = {
        key: blob[spec["tensor_key"]]
        for key, spec in inputs.items()
        if spec["type"] == "safetensors"
    }
    tensors["sm_scale"] = inputs["sm_scale"]["value"]
    return {"tensors": tensors, "expected": expected, "trace": trace}
