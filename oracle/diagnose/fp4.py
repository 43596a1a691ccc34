"""Named alternatives of fp4 block-scaled inputs (NVFP4, MXFP4): how kernels misread them.

Each alternative re-dequantises the stored fp4 inputs the wrong way (the same way for every
fp4 array of the case: a kernel that misreads one cache misreads the other) and evaluates
the pinned attention of those values in float64
(:func:`oracle.reading.baseline.textbook_attention`);
a failing output it explains within the case's threshold is reported as "matches <label>".

* ``block scales applied per 32 values`` (NVFP4 data) / ``per 16 values`` (MXFP4 data): the
  kernel walks the scale memory of each position with the other format's block size (stride
  and index), so position s, feature d reads flat entry ``s * (D / n') + d // n'`` of the
  (..., S * D / n) scales (wrapping at the end);
* ``block size misread``: the position's own scale row, each scale applied to 32 (NVFP4
  data) or 16 (MXFP4 data) features: feature d reads scale ``d // n'`` of its row;
* ``block scales along the position axis``: the scale memory read as (..., D / n, S), block b
  of position s taken from flat entry ``b * S + s``;
* ``global scale (descale) missing``: the ``*_descale`` of NVFP4 arrays ignored;
* ``packed nibbles swapped``: elements 2i and 2i + 1 exchanged (the high nibble read first).

Examples
--------
>>> import ml_dtypes, numpy as np
>>> x = np.arange(32, dtype=np.uint8).reshape(1, 1, 1, 32) % 16
>>> [a[0] for a in fp4_alternatives({"k": x.view(ml_dtypes.float4_e2m1fn),
...     "k_block_scale": np.ones((1, 1, 1, 2), ml_dtypes.float8_e4m3fn)})][:1]
['block scales applied per 32 values (MXFP4 blocks on NVFP4 data)']
"""

from __future__ import annotations

import time

import numpy as np

from oracle.diagnose import budget
from oracle.judging import tolerance as tol
from oracle.reading.baseline import textbook_attention
from oracle.reading.heads import dequantised

__all__ = ["fp4_alternatives", "diagnose_fp4"]

_BLOCK = {"float8_e4m3fn": 16, "float8_e8m0fnu": 32}
_NAMES = ("q", "k", "v")


def _fp4_names(inputs):
    return [
        n
        for n in _NAMES
        if getattr(inputs.get(n), "dtype", None) is not None
        and inputs[n].dtype.name == "float4_e2m1fn"
        and inputs.get(f"{n}_block_scale") is not None
    ]


def _per_value(x, scale, block, reading):
    """float64 per-value scales (..., N, D) of ``scale`` (..., N, D / block) under
    ``reading``: "pinned", "stride" (the other block size), "positions" (transposed)."""
    n_pos, feats, n_blocks = x.shape[-2], x.shape[-1], scale.shape[-1]
    flat = scale.astype(np.float64).reshape(scale.shape[:-2] + (-1,))
    d = np.arange(feats)
    s = np.arange(n_pos)[:, None]
    other = 32 if block == 16 else 16
    if reading == "stride":
        index = (s * (feats // other) + d[None, :] // other) % flat.shape[-1]
    elif reading == "block":  # the row found right, each scale read for `other` features
        index = s * n_blocks + np.minimum(d[None, :] // other, n_blocks - 1)
    elif reading == "positions":
        index = (d[None, :] // block) * n_pos + s
    else:
        index = s * n_blocks + d[None, :] // block
    return flat[..., index]


def _values(x, scale, reading, swap):
    codes = x.astype(np.float64)
    if swap:
        codes = codes.reshape(codes.shape[:-1] + (-1, 2))[..., ::-1].reshape(codes.shape)
    return codes * _per_value(x, scale, _BLOCK[scale.dtype.name], reading)


def fp4_alternatives(inputs) -> list[tuple[str, dict]]:
    """(label, {name: (reading, swap, keep_descale)}) of the alternatives that apply to the
    fp4 arrays of ``inputs`` (empty when there are none)."""
    names = _fp4_names(inputs)
    if not names:
        return []
    kinds = {inputs[f"{n}_block_scale"].dtype.name for n in names}
    found = []
    for kind in sorted(kinds):
        wrong = (
            "32 values (MXFP4 blocks on NVFP4 data)"
            if kind == "float8_e4m3fn"
            else ("16 values (NVFP4 blocks on MXFP4 data)")
        )
        found.append((f"block scales applied per {wrong}", {"reading": "stride", "kind": kind}))
        found.append(
            (
                f"block size misread: each scale of a position applied to {wrong.split(' (')[0]}"
                f" (scale b read for features b*{32 if kind == 'float8_e4m3fn' else 16}..)",
                {"reading": "block", "kind": kind},
            )
        )
    found.append(
        (
            "block scales along the position axis (scale rows read as columns)",
            {"reading": "positions"},
        )
    )
    if any(inputs.get(f"{n}_descale") is not None for n in names):
        found.append(("global scale (descale) missing", {"descale": False}))
    found.append(("packed nibbles swapped (elements 2i, 2i + 1 exchanged)", {"swap": True}))
    return found


def _dequantised(inputs, names, change):
    arrays = {}
    for n in names:
        scale = inputs[f"{n}_block_scale"]
        reading = change.get("reading", "pinned")
        if "kind" in change and scale.dtype.name != change["kind"]:
            reading = "pinned"
        arrays[n] = _values(inputs[n], scale, reading, change.get("swap", False))
    return arrays


def diagnose_fp4(inputs, options, out, *, limit, dtype) -> list[str]:
    """ "matches <label>" for each fp4 alternative whose float64 output explains ``out``
    within ``limit`` (the case's output threshold); [] for a case without fp4 inputs.

    Each alternative is one float64 evaluation of the case: they are tried within the case's
    diagnosis budget (:mod:`oracle.diagnose.budget`; cheap ones always), and a diagnosis that
    ran out says so (its "fp4 readings" skipped)."""
    names = _fp4_names({**inputs, **options})
    if not names:
        return []
    found = []
    out = np.asarray(out, dtype=np.float64)
    merged = {**inputs, **options}
    spent = budget.current()  # the case's diagnosis budget: one float64 reading each
    work = np.size(out) // max(np.shape(out)[-1], 1) * np.shape(inputs["k"])[-2]
    work *= np.shape(inputs["q"])[-1] + np.shape(out)[-1]
    for label, change in fp4_alternatives(merged):
        if not spent.allows(work):
            spent.steps.setdefault("fp4 readings", False)
            break
        start = time.perf_counter()
        values = _dequantised(merged, names, change)
        q, k, v = (values.get(n, inputs[n]) for n in _NAMES)
        opts = {
            n: x for n, x in options.items() if not n.endswith("_block_scale") and n != "return_lse"
        }
        q, k, v, opts = _descaled(q, k, v, opts, names, change.get("descale", True))
        with np.errstate(all="ignore"):
            result = textbook_attention(q, k, v, dtype="float64", **opts)
            scale = tol.output_scale(result.weights, v, gqa=opts.get("gqa"))
            if result.out.shape != out.shape:
                continue
            err = tol.normalised_error(out, result.out, scale, dtype)
        spent.measured(work, time.perf_counter() - start)
        if bool(np.all(err <= limit)):
            found.append(f"matches {label}")
    return found


def _descaled(q, k, v, options, names, keep):
    """The values times their descale (per batch row and kv head; q per its kv head), or
    without it; the options without descales."""
    arrays = {"q": q, "k": k, "v": v}
    heads = np.shape(q)[-3]
    gqa = options.get("gqa") or "interleave"
    for n in names:
        descale = options.get(f"{n}_descale") if keep else None
        arrays[n] = dequantised(arrays[n], descale, heads if n == "q" else None, gqa)
    for n in _NAMES:  # float8 arrays next to fp4 ones keep their own descale
        if n not in names and options.get(f"{n}_descale") is not None:
            arrays[n] = dequantised(
                arrays[n], options[f"{n}_descale"], heads if n == "q" else None, gqa
            )
    rest = {n: x for n, x in options.items() if not n.endswith("_descale")}
    return arrays["q"], arrays["k"], arrays["v"], rest
