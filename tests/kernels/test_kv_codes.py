"""Quantised k and v streamed as codes (refattn._kv_codes) into the Numba forward
(refattn.kernels._cpu_codes: the kernels dequantise each key block as they load it) and the
fast exact engine (refattn.exact.fast.codes_inputs): the results are bit-identical to those of
the inputs dequantised whole (NVFP4, MXFP4, float8 with descales, a float k beside a float8 v;
decode key splits and the query-block path; float64 and float32 compute; the exact engine's
referee rows); the range check reads the codes; the checks keep their messages; the bits do
not depend on the thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import refattn
from refattn.exact.fast.codes_inputs import codes_inputs
from refattn.exact.fast.facts import row_facts
from refattn.kernels import codes_abs_max
from refattn.quantized import dequantize_inputs, quantised_rows
from tests.helpers import assert_same_bits

F4, E4, E5, E8 = (
    ml_dtypes.float4_e2m1fn,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
)


def _codes(rng, shape, dtype=F4):
    return (rng.standard_normal(shape) * 2).clip(-6, 6).astype(dtype)


def _scales(rng, shape, block=16, dtype=E4):
    return (rng.random(shape[:-1] + (shape[-1] // block,)) + 0.5).astype(dtype)


def _case(kind, seed, heads=4, kv_heads=2, length=1, keys=1100, dim=32):
    """(q, k, v, options) of one quantised format."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, heads, length, dim))
    shape = (2, kv_heads, keys, dim)
    descales = (rng.random((2, kv_heads)) + 0.5).astype(np.float32)
    if kind == "nvfp4":
        k, v = _codes(rng, shape), _codes(rng, shape)
        opts = dict(k_block_scale=_scales(rng, shape), v_block_scale=_scales(rng, shape))
        opts.update(k_descale=descales, v_descale=np.float32(0.75))
    elif kind == "mxfp4":
        k, v = _codes(rng, shape), _codes(rng, shape)
        opts = dict(
            k_block_scale=_scales(rng, shape, 32, E8), v_block_scale=_scales(rng, shape, 32, E8)
        )
    elif kind == "fp8":
        k, v = _codes(rng, shape, E4), _codes(rng, shape, E5)
        opts = dict(k_descale=descales, v_descale=descales[::-1].copy())
    else:  # a float k, a float8 v without descale
        k, v, opts = rng.standard_normal(shape), _codes(rng, shape, E4), {}
    return q, k, v, opts


def _dequantised(q, k, v, opts):
    """The call's k and v dequantised whole (the path that does not stream) and its other
    options."""
    blocks = {"k": opts.get("k_block_scale"), "v": opts.get("v_block_scale")}
    _, dk, dv = dequantize_inputs(
        q, k, v, None, opts.get("k_descale"), opts.get("v_descale"), "interleave", blocks
    )
    rest = {n: x for n, x in opts.items() if not n.endswith(("_descale", "_block_scale"))}
    return dk, dv, rest


@pytest.mark.parametrize(
    "kind, q_dtype, shape, extra",
    [
        ("nvfp4", "float64", {}, {"causal": True, "align": "bottom_right"}),
        ("nvfp4", "bfloat16", {}, {}),
        ("mxfp4", "float64", {"length": 2}, {"softcap": 5.0}),
        ("fp8", "float64", {}, {"window": (700, 0), "align": "bottom_right"}),
        ("mixed", "float64", {}, {}),
        ("nvfp4", "float64", {"length": 9, "keys": 90}, {"causal": True}),  # query blocks
    ],
)
def test_streamed_codes_give_the_dequantised_inputs_bits(kind, q_dtype, shape, extra):
    q, k, v, opts = _case(kind, 3, **shape)
    q = q.astype(getattr(ml_dtypes, q_dtype, q_dtype))
    got = refattn.attention(q, k, v, backend="numba", return_lse=True, **opts, **extra)
    dk, dv, rest = _dequantised(q, k, v, opts)
    want = refattn.attention(q, dk, dv, backend="numba", return_lse=True, **rest, **extra)
    case = f"{kind} q {q_dtype} {shape} {extra}"
    assert_same_bits(got[0], want[0], what="out", case=case, check_dtype=True)
    assert_same_bits(got[1], want[1], what="lse", case=case, check_dtype=True)


def test_quantised_rows_hold_the_dequantised_values():
    for kind in ("nvfp4", "mxfp4", "fp8"):
        q, k, v, opts = _case(kind, 4, keys=40)
        dk, dv, _ = _dequantised(q, k, v, opts)
        for name, x, want in (("k", k, dk), ("v", v, dv)):
            rows = quantised_rows(
                x, opts.get(f"{name}_descale"), opts.get(f"{name}_block_scale"), name
            )
            assert_same_bits(rows.dequantised(), want, what=f"{name} values", case=kind)
            top = np.max(np.abs(want), where=np.isfinite(want), initial=0.0)
            assert codes_abs_max(rows) == top, kind


def test_abs_max_skips_nan_blocks_and_codes():
    rng = np.random.default_rng(6)
    k = _codes(rng, (1, 1, 4, 32))
    scales = _scales(rng, k.shape)
    scales.view(np.uint8)[0, 0, 0, 0] = 0x7F  # a NaN scale: its block is NaN
    values = dequantize_inputs(
        k, k, k, None, None, None, "interleave", {"q": scales, "k": scales, "v": scales}
    )[1]
    rows = quantised_rows(k, None, scales, "k")
    assert np.isnan(values).any()
    assert codes_abs_max(rows) == np.max(np.abs(values), where=~np.isnan(values), initial=0.0)
    k8 = np.array([[[np.nan, 2.0, -3.0]]], E4)  # a NaN code
    assert codes_abs_max(quantised_rows(k8, None, None, "k")) == 3.0


def test_range_check_reads_the_codes():
    """float32 compute (bfloat16 q): a descale that takes s q.k beyond float32 is refused,
    naming the largest |k|, as for the dequantised inputs."""
    q, k, v, opts = _case("fp8", 7, keys=1030)
    opts["k_descale"] = np.full((2, 2), 1e36, np.float32)
    with pytest.raises(ValueError, match="max \\|k\\|") as streamed:
        refattn.attention(q.astype(ml_dtypes.bfloat16), k, v, backend="numba", **opts)
    dk, dv, rest = _dequantised(q, k, v, opts)
    with pytest.raises(ValueError, match="max \\|k\\|") as whole:
        refattn.attention(q.astype(ml_dtypes.bfloat16), dk, dv, backend="numba", **rest)
    assert str(streamed.value) == str(whole.value)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"k_block_scale": None}, "k_block_scale: k of dtype float4_e2m1fn needs block scales"),
        ({"v_descale": np.float64(2.0)}, "v_descale: expected float32 factors"),
        ({"k_descale": np.array([1.0, -1.0], np.float32)}, "k_descale: expected finite positive"),
    ],
)
def test_streamed_inputs_keep_the_checks(bad, message):
    q, k, v, opts = _case("nvfp4", 8, keys=1030)
    opts.update(bad)
    for backend in ("numpy", "numba"):
        with pytest.raises((ValueError, TypeError), match=message):
            refattn.attention(q, k, v, backend=backend, **opts)


_THREADS_SCRIPT = """
import numpy as np, ml_dtypes, refattn
rng = np.random.default_rng(9)
k = (rng.standard_normal((1, 2, 3000, 32)) * 2).clip(-6, 6).astype(ml_dtypes.float4_e2m1fn)
s = (rng.random((1, 2, 3000, 2)) + 0.5).astype(ml_dtypes.float8_e4m3fn)
q = rng.standard_normal((1, 8, 1, 32))
out, lse = refattn.attention(q, k, k, k_block_scale=s, v_block_scale=s, return_lse=True,
                             backend="numba")
print(out.tobytes().hex(), lse.tobytes().hex())
"""


def test_streamed_bits_do_not_depend_on_thread_count():
    outputs = set()
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads)
        run = subprocess.run(
            [sys.executable, "-c", _THREADS_SCRIPT], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.add(run.stdout)
    assert len(outputs) == 1, "the streamed forward's bits depend on NUMBA_NUM_THREADS"


@pytest.mark.parametrize(
    "kind, shape, extra, out_dtype, tweak",
    [
        ("nvfp4", {"keys": 300}, {}, None, None),
        ("nvfp4", {"keys": 300, "length": 3}, {"causal": True}, "bfloat16", None),
        ("mxfp4", {"keys": 200}, {"softcap": 4.0}, "float32", None),
        ("fp8", {"keys": 150}, {}, None, "zero column"),  # exact zeros: the referee's rows
        ("nvfp4", {"keys": 120}, {}, None, "nan scale"),  # a NaN plane: the referee's
    ],
)
def test_exact_engine_on_codes_gives_the_dequantised_inputs_bits(
    kind, shape, extra, out_dtype, tweak
):
    """precision="exact" with k and v streamed as codes (refattn.exact.fast.codes_inputs):
    the same bits as on the dequantised inputs, the referee's rows included."""
    q, k, v, opts = _case(kind, 11, **shape)
    if tweak == "zero column":
        v[..., 0] = 0
    if tweak == "nan scale":
        opts["v_block_scale"].view(np.uint8)[0, 0, 5, 0] = 0x7F
    call = dict(precision="exact", out_dtype=out_dtype, return_lse=True, **extra)
    got = refattn.attention(q, k, v, **opts, **call)
    dk, dv, rest = _dequantised(q, k, v, opts)
    want = refattn.attention(q, dk, dv, **rest, **call)
    case = f"{kind} {shape} {extra} {out_dtype} {tweak}"
    assert_same_bits(got[0], want[0], what="out", case=case, check_dtype=True)
    assert_same_bits(got[1], want[1], what="lse", case=case, check_dtype=True)


def test_codes_inputs_hold_the_values_and_their_facts():
    """K^T, V and the row / column facts from the codes equal those the engine computes from
    the dequantised values (row_facts), NaN and zero scales included."""
    for kind in ("nvfp4", "mxfp4", "fp8"):
        q, k, v, opts = _case(kind, 12, keys=333)
        if kind == "nvfp4":
            opts["k_block_scale"].view(np.uint8)[0, 0, 3, 1] = 0x7F  # NaN
            opts["k_block_scale"].view(np.uint8)[0, 1, 5, 1] = 0  # zero
        rows = [
            quantised_rows(x, opts.get(f"{n}_descale"), opts.get(f"{n}_block_scale"), n)
            for n, x in (("k", k), ("v", v))
        ]
        k_t, values, k_facts, v_facts = codes_inputs(*rows, 2)
        keys, vals = rows[0].dequantised(), rows[1].dequantised()
        assert_same_bits(k_t, np.swapaxes(keys, 2, 3), what="kT", case=kind)
        assert_same_bits(values, vals, what="v", case=kind)
        for what, got, want in (
            ("key rows", k_facts, _row_facts(keys)),
            ("value columns", v_facts[:2], _row_facts(np.swapaxes(vals, 2, 3))[:2]),
        ):
            assert np.array_equal(got[0], want[0]), (kind, what)
            for mine, theirs in zip(got[1:], want[1:], strict=True):  # ok rows
                assert_same_bits(mine[want[0]], theirs[want[0]], what=what, case=kind)
        top = np.max(np.abs(vals), axis=2, initial=0.0)
        assert_same_bits(v_facts[2], top, what="max |v|", case=kind)


def _row_facts(a):
    """(ok, norms, scales) of the rows of a's last axis, by the engine's row_facts."""
    flat = np.ascontiguousarray(a.reshape(-1, a.shape[-1]))
    out = [np.empty(flat.shape[0], t) for t in (np.bool_, np.float64, np.float64)]
    row_facts(flat, flat.view(np.int64), out[1], out[2], out[0])
    return [o.reshape(a.shape[:3]) for o in out]
