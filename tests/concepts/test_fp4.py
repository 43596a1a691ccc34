"""fp4 inputs with NVFP4 / MXFP4 block scales on every path: the dequantised products exact
for every representable combination, the exact path bit for bit against the loop twin fed by
an independent bit-pattern dequantiser (tests/naive/fp4.py), float64 and Numba inside their
bounds, the vjp as the gradient of the dequantised values, NaN scales, and the errors."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn.bounds import float64_forward_bound, float64_vjp_bound
from refattn.spec import canonicalize
from tests.helpers import assert_same_bits as assert_exact
from tests.helpers import assert_within
from tests.naive.attention import naive_attention
from tests.naive.fp4 import E2M1, e4m3_value, e8m0_value, naive_dequantize
from tests.naive.rounding import SPREAD_CAP, round_stable

F4 = ml_dtypes.float4_e2m1fn
#: format -> (scale dtype, block size, twin's scale decoder name, largest finite scale byte)
FORMATS = {
    "nvfp4": (ml_dtypes.float8_e4m3fn, 16, "e4m3", 0x7E),
    "mxfp4": (ml_dtypes.float8_e8m0fnu, 32, "e8m0", 0xFE),
}
BATCH, HEADS, KV_HEADS, LENGTH, KEYS, DIM = 2, 4, 2, 3, 5, 32
#: float32 descales spanning the format: the smallest subnormal, 1, a full significand, max
DESCALES = np.array([2.0**-149, 1 + 2.0**-23, 3.4028235e38], dtype=np.float32)
OPTION_SETS = [
    {},
    {"causal": True},
    {"gqa": "tile", "causal": True, "align": "bottom_right"},
    {"kv_lengths": np.array([2, KEYS])},
]


def _fp4(codes):
    return np.asarray(codes, dtype=np.uint8).view(F4)


def _blocks(rng, shape, fmt, style):
    """(e2m1 codes, scale bytes) for x of ``shape`` (..., N, D) in ``style``: "random",
    "zero" (zero codes in some blocks, zero scales in others: e4m3 only has a zero scale),
    "max" (largest codes and largest scale), "collapse" (smallest nonzero scales)."""
    _, block, kind, top = FORMATS[fmt]
    codes = rng.integers(0, 16, size=shape).astype(np.uint8)
    scale_shape = shape[:-1] + (shape[-1] // block,)
    if kind == "e4m3":
        scales = rng.integers(0x20, 0x48, size=scale_shape).astype(np.uint8)  # ~2**-3..2**1
    else:
        scales = rng.integers(124, 130, size=scale_shape).astype(np.uint8)
    if style == "zero":
        codes[..., : block // 2] = 0
        codes[..., 1::3, :] = rng.choice([0, 8], size=codes[..., 1::3, :].shape)  # +-0
        if kind == "e4m3":
            scales[..., ::2, :] = 0
    elif style == "max":
        codes[..., ::2, :] = rng.choice([7, 15], size=codes[..., ::2, :].shape)  # +-6
        scales[..., ::2, :] = top
    elif style == "collapse":
        scales[...] = 0x01 if kind == "e4m3" else 0x00  # 2**-9, 2**-127
    return codes, scales


def _descale(rng, fmt, style):
    """float32 (BATCH, KV_HEADS) global scales keeping the products' range sane for the
    style (MXFP4's 2**127 block scale times 6 must stay well inside float32 outputs)."""
    base = rng.uniform(0.5, 2, size=(BATCH, KV_HEADS))
    if style == "max" and fmt == "mxfp4":
        base = base * 2.0**-124
    if style == "collapse":
        base = base * 2.0**-20
    return base.astype(np.float32)


def _case(seed, fmt, style, which, gqa="interleave"):
    """(arguments of refattn.attention, the twin's float64 q, k, v) for a drawn case."""
    rng = np.random.default_rng(seed)
    scale_dtype, block, kind, _ = FORMATS[fmt]
    shapes = {
        "q": (BATCH, HEADS, LENGTH, DIM),
        "k": (BATCH, KV_HEADS, KEYS, DIM),
        "v": (BATCH, KV_HEADS, KEYS, DIM),
    }
    args, values = {}, {}
    for name, shape in shapes.items():
        if name not in which:
            values[name] = args[name] = rng.standard_normal(shape)
            continue
        codes, scales = _blocks(rng, shape, fmt, style)
        descale = _descale(rng, fmt, style)
        args[name] = _fp4(codes)
        args[f"{name}_block_scale"] = scales.view(scale_dtype)
        args[f"{name}_descale"] = descale
        per = descale
        if name == "q":  # query head h uses the descale of the kv head it reads
            group = HEADS // KV_HEADS
            per = (
                np.repeat(descale, group, axis=1)
                if gqa == "interleave"
                else np.tile(descale, group)
            )
        values[name] = naive_dequantize(codes, scales, kind, block, per)
    return args, values


def _twin(values, options, dtype):
    """The loop twin per batch row, rounded once (out, lse). Collapsed scales give scores
    near 2**-300: out is the mean of the values up to a relative 2**-300, which can sit on a
    rounding midpoint, so the twin always carries the digits of its largest spread."""
    outs, lses = [], []
    for b in range(BATCH):
        row = {n: x for n, x in options.items() if n != "kv_lengths"}
        if "kv_lengths" in options:
            row["kv_length"] = int(options["kv_lengths"][b])
        q, k, v = values["q"][b], values["k"][b], values["v"][b]
        out, lse = (
            round_stable(
                lambda dps, n=n, x=(q, k, v), row=row: naive_attention(*x, dps=dps, **row)[n],
                dtype,
                SPREAD_CAP,
            )
            for n in range(2)
        )
        outs.append(out)
        lses.append(lse)
    return np.stack(outs), np.stack(lses)


def test_products_are_exact_for_every_representable_combination():
    """Every e2m1 code times every finite scale times float32 descales from the smallest
    subnormal to the largest: the float64 input refattn uses is the exact real product."""
    for fmt, (scale_dtype, block, kind, top) in FORMATS.items():
        decode = e4m3_value if kind == "e4m3" else e8m0_value
        scale_bytes = np.arange(top + 1, dtype=np.uint8)[:, None]  # every non-negative finite
        codes = np.tile(np.arange(16, dtype=np.uint8), (len(scale_bytes), block // 16))
        k = _fp4(codes)[None, None].repeat(len(DESCALES), axis=0)
        scales = scale_bytes.view(scale_dtype)[None, None].repeat(len(DESCALES), axis=0)
        spec = canonicalize(
            np.zeros((1, 1, 1, block)),
            k,
            np.zeros((1, 1, len(scale_bytes), 1)),
            k_block_scale=scales,
            k_descale=DESCALES[:, None],
        )
        got = spec.k.reshape(len(DESCALES), len(scale_bytes), block)
        for d, descale in enumerate(DESCALES):
            for s, byte in enumerate(scale_bytes[:, 0]):
                for j, code in enumerate(codes[s]):
                    want = Fraction(E2M1[code]) * decode(int(byte)) * Fraction(float(descale))
                    assert Fraction(float(got[d, s, j])) == want, (fmt, descale, byte, code)


CASES = dict(
    seed=st.integers(0, 2**16),
    fmt=st.sampled_from(sorted(FORMATS)),
    style=st.sampled_from(["random", "zero", "max", "collapse"]),
    which=st.sampled_from(["kv", "k", "v", "qkv"]),
    options=st.sampled_from(OPTION_SETS),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
)


@settings(max_examples=2, deadline=None)
@given(**CASES)
def test_exact_matches_loop_twin(seed, fmt, style, which, options, dtype):
    _check_exact(seed, fmt, style, which, options, dtype)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(**CASES)
def test_exact_matches_loop_twin_more(seed, fmt, style, which, options, dtype):
    _check_exact(seed, fmt, style, which, options, dtype)


def _check_exact(seed, fmt, style, which, options, dtype):
    args, values = _case(seed, fmt, style, which, options.get("gqa", "interleave"))
    got = refattn.attention(**args, **options, return_lse=True, precision="exact", out_dtype=dtype)
    want = _twin(values, options, dtype)
    case = f"{fmt} {style} {which} {options} {dtype} seed={seed}"
    assert_exact(got[0], want[0], what="out", case=case)
    assert_exact(got[1], want[1], what="lse", case=case)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize(
    "style",
    ["max", "collapse"] + [pytest.param(s, marks=pytest.mark.slow) for s in ("random", "zero")],
)
def test_float64_and_numba_inside_their_bounds(fmt, style):
    from refattn.kernels import numba_cpu

    args, _ = _case(3, fmt, style, "qkv")
    options = {"causal": True, "align": "bottom_right"}
    got = refattn.attention(**args, **options, return_lse=True)
    out, lse, weights = refattn.attention(
        **args, **options, return_lse=True, return_weights=True, precision="exact"
    )
    out_bound, lse_bound = float64_forward_bound(**args, **options)
    assert_within(got[0], out, out_bound, what="out", case=f"float64 {fmt} {style}")
    assert_within(got[1], lse, lse_bound, what="lse", case=f"float64 {fmt} {style}")
    fast = refattn.attention(**args, **options, return_lse=True, backend="numba")
    spec = canonicalize(**args, **options)
    out_bound, lse_bound = numba_cpu.forward_error_bound(spec, weights, np.float64)
    assert_within(fast[0], out, out_bound, what="out", case=f"numba {fmt} {style}")
    assert_within(fast[1], lse, lse_bound, what="lse", case=f"numba {fmt} {style}")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_vjp_is_the_gradient_of_the_dequantised_values(fmt):
    """fp4 inputs get the gradient with respect to ``x * block_scale * descale`` (as float8
    inputs do): bit for bit the vjp of those float64 values; float64 inside its bound."""
    args, values, grad_out, options = _vjp_case(fmt)
    got = refattn.attention_vjp(**args, grad_out=grad_out, **options)
    want = refattn.attention_vjp(**values, grad_out=grad_out, **options)
    full = refattn.attention_vjp(**args, grad_out=grad_out, **options, precision="exact")
    bounds = float64_vjp_bound(**args, grad_out=grad_out, **options)
    for name, bound in zip(("dq", "dk", "dv"), bounds[:3], strict=True):
        assert_exact(getattr(got, name), getattr(want, name), what=name, case=fmt)
        assert_within(getattr(got, name), getattr(full, name), bound, what=name, case=fmt)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_exact_vjp_is_the_exact_vjp_of_the_dequantised_values(fmt):
    args, values, grad_out, options = _vjp_case(fmt)
    exact = refattn.attention_vjp(
        **args, grad_out=grad_out, **options, precision="exact", out_dtype="float32"
    )
    want = refattn.attention_vjp(
        **values, grad_out=grad_out, **options, precision="exact", out_dtype="float32"
    )
    for name in ("dq", "dk", "dv"):
        assert_exact(getattr(exact, name), getattr(want, name), what=name, case=fmt)


def _vjp_case(fmt):
    options = {"causal": True, "gqa": "tile"}
    args, values = _case(5, fmt, "random", "qkv", options["gqa"])
    grad_out = np.random.default_rng(6).standard_normal((BATCH, HEADS, LENGTH, DIM))
    return args, values, grad_out, options


def test_nan_scale_reaches_only_the_rows_that_read_its_block():
    """A NaN block scale (e4m3 0x7F, e8m0 0xFF) makes its block NaN, zeros included: an
    excluded key's NaN never reaches the output, an allowed one's makes its rows NaN."""
    for fmt, (scale_dtype, _, _, _) in FORMATS.items():
        args, _ = _case(7, fmt, "random", "k")
        scales = args["k_block_scale"].view(np.uint8).copy()
        scales[:, :, KEYS - 1, 0] = 0x7F if fmt == "nvfp4" else 0xFF
        args["k_block_scale"] = scales.view(scale_dtype)
        lengths = np.array([KEYS - 1, KEYS - 1])
        out = refattn.attention(**args, kv_lengths=lengths, precision="exact")
        assert np.isfinite(out).all()
        out = refattn.attention(**args)
        assert np.isnan(out).all()


def test_bad_block_scales_name_themselves():
    args, _ = _case(0, "nvfp4", "random", "k")
    k, scale = args["k"], args["k_block_scale"]
    rest = {"q": args["q"], "v": args["v"]}
    with pytest.raises(ValueError, match="k_block_scale: k of dtype float4_e2m1fn needs"):
        refattn.attention(k=k, **rest)
    with pytest.raises(TypeError, match="k_block_scale: expected dtype float8_e4m3fn"):
        refattn.attention(k=k, k_block_scale=scale.astype(np.float32), **rest)
    with pytest.raises(ValueError, match="NVFP4 .* one scale per 16 values, so 32 features"):
        refattn.attention(k=k, k_block_scale=scale[..., :1], **rest)
    mx = np.ones(scale.shape, ml_dtypes.float8_e8m0fnu)
    with pytest.raises(ValueError, match="MXFP4 .* one scale per 32 values"):
        refattn.attention(k=k, k_block_scale=mx, **rest)
    with pytest.raises(ValueError, match="k_block_scale: expected shape"):
        refattn.attention(k=k, k_block_scale=np.swapaxes(scale, -1, -2), **rest)
    with pytest.raises(ValueError, match="k_block_scale: expected non-negative"):
        refattn.attention(k=k, k_block_scale=-scale, **rest)
    with pytest.raises(ValueError, match="v_block_scale: only float4_e2m1fn inputs"):
        refattn.attention(k=k, k_block_scale=scale, v_block_scale=scale, **rest)
    with pytest.raises(TypeError, match="k_descale: expected float32"):
        refattn.attention(k=k, k_block_scale=scale, k_descale=np.ones((2, 2)), **rest)
