"""The refined double-double step of the fast exact forward
(refattn.exact.fast.forward_refine): bit-identical to the referee on every option and dtype
when it takes every row, decides the long rows whose result lies a hair (but not exactly) on a
rounding midpoint, and hands exact ties to the referee."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from mpmath import mp

import refattn
from refattn import config
from refattn.exact.fast import forward as FA
from refattn.exact.fast import forward_refine as FR
from tests.strategies import attention_cases

OUT_DTYPES = ["float64", "float32", "float16", "bfloat16"]


def _run(engine, args, out_dtype="float64", **opts):
    saved = config.EXACT_ENGINE
    config.EXACT_ENGINE = engine
    try:
        return refattn.attention(
            **args, precision="exact", out_dtype=out_dtype, return_lse=True, **opts
        )
    finally:
        config.EXACT_ENGINE = saved


def _same(fast, slow):
    __tracebackhide__ = True
    for name, a, b in zip(("out", "lse", "weights"), fast, slow, strict=False):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        same = (a64 == b64) & (np.signbit(a64) == np.signbit(b64)) | (np.isnan(a64) & np.isnan(b64))
        assert same.all(), f"{name}: fast {a64[~same]} != referee {b64[~same]}"


@pytest.fixture
def refine_only(monkeypatch):
    """The first two steps decide nothing: every row of a plane they take goes to the
    refined step (and what it leaves, to the referee)."""
    monkeypatch.setattr(FA, "forward_d", lambda *args: None)
    monkeypatch.setattr(FA, "forward_dd", lambda *args: None)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=attention_cases(dtypes=("float64", "float32", "float16", "bfloat16")))
def test_refined_step_alone_matches_referee_on_every_option(refine_only, out_dtype, case):
    q, k, v, opts = case
    args = dict(q=q, k=k, v=v)
    fast = _run("fast", args, out_dtype, return_weights=True, **opts)
    _same(fast, _run("referee", args, out_dtype, return_weights=True, **opts))


def _nvfp4(rng, heads=4, kv_heads=2, keys=96, dim=32):
    fp4, fp8 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn

    def codes(shape):
        return rng.standard_normal(shape).clip(-6, 6).astype(fp4)

    def scales(shape):
        return (rng.random(shape[:-1] + (shape[-1] // 16,)) + 0.5).astype(fp8)

    q = codes((1, heads, 2, dim))
    k, v = codes((1, kv_heads, keys, dim)), codes((1, kv_heads, keys, dim))
    return dict(
        q=q,
        k=k,
        v=v,
        q_block_scale=scales(q.shape),
        k_block_scale=scales(k.shape),
        v_block_scale=scales(v.shape),
        k_descale=(rng.random((1, kv_heads)) + 0.5).astype(np.float32),
        v_descale=(rng.random((1, kv_heads)) + 0.5).astype(np.float32),
    )


@pytest.mark.parametrize("out_dtype", ["float64", "bfloat16"])
def test_refined_step_alone_on_nvfp4_codes(refine_only, out_dtype):
    """NVFP4 k, v read from their codes: exact scores (the exactness scales), the refined
    sums; every row decided by the refined step, the referee's bits."""
    args = _nvfp4(np.random.default_rng(5))
    fast = _run("fast", args, out_dtype, causal=True, align="bottom_right")
    stats = FA.fallback_stats()
    assert stats["refine_rows"] == stats["rows"] == 8 and stats["referee_rows"] == 0
    _same(fast, _run("referee", args, out_dtype, causal=True, align="bottom_right"))


def _near_midpoint_row(keys, offset):
    """(q, k, v, bias) of one float64 row whose output is ``m (1 + offset)`` up to 2**-100,
    ``m`` a float64 rounding midpoint: the last key's weight is about 2**-52, its value
    (solved in 200-bit arithmetic) moves the output there. D = 4: the scale 1/2 is exact."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 4))
    k = rng.standard_normal((keys, 4))
    v = 1.0 + np.abs(rng.standard_normal((keys, 1)))  # positive: out ~ sum_j w_j |v_j|
    bias = np.zeros((1, keys))
    bias[0, -1] = -28.0
    v[-1, 0] = 0.0
    with mp.workprec(200):
        t = [
            mp.fsum(mp.mpf(a) * mp.mpf(b) for a, b in zip(q[0], k[j], strict=True)) / 2
            for j in range(keys)
        ]
        t[-1] += mp.mpf(bias[0, -1])
        z = mp.fsum(mp.exp(x) for x in t)
        w = [mp.exp(x) / z for x in t]
        out0 = mp.fsum(w[j] * mp.mpf(float(v[j, 0])) for j in range(keys))
        near = float(out0)
        mid = Fraction(near) + Fraction(math.ulp(near)) / 2  # a midpoint of float64
        target = mp.mpf(mid.numerator) / mid.denominator * (1 + mp.mpf(offset))
        v[-1, 0] = float((target - out0) / w[-1])
    return q, k, v, bias


def test_near_midpoint_long_row_is_decided_by_the_refined_step():
    """A result 2**-84 (relative) from a float64 midpoint at S = 4096: inside the
    double-double step's radius (its Dot2 bound grows like S**2: 2**-81), outside the refined
    step's; the referee is not called, and the bits are the referee's."""
    q, k, v, bias = _near_midpoint_row(4096, 2.0**-84)
    args = dict(q=q, k=k, v=v)
    fast = _run("fast", args, bias=bias)
    stats = FA.fallback_stats()
    assert stats["refine_rows"] == 1 and stats["referee_rows"] == 0, stats
    _same(fast, _run("referee", args, bias=bias))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_exact_midpoint_long_row_goes_to_the_referee(out_dtype):
    """Equal scores over 512 keys averaging values 1 and 1 + ulp: the output is exactly a
    midpoint, which no enclosure decides; the refined step hands it on."""
    ulp = 2.0 ** -{"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7}[out_dtype]
    v = np.where(np.arange(512)[:, None] % 2 == 0, 1.0, 1.0 + ulp)
    args = dict(q=np.zeros((1, 2)), k=np.zeros((512, 2)), v=v)
    fast = _run("fast", args, out_dtype)
    stats = FA.fallback_stats()
    assert stats["referee_rows"] == 1 and stats["refine_rows"] == 1, stats
    _same(fast, _run("referee", args, out_dtype))


@pytest.mark.parametrize("out_dtype", ["float64", "float32"])
def test_exactly_representable_long_row_is_decided(refine_only, out_dtype):
    """Varied scores over 512 keys, a value column all equal to a dyadic 0.375 (the output
    exactly 0.375, representable) and one of random values: the refined step decides both."""
    rng = np.random.default_rng(3)
    v = np.stack([np.full(512, 0.375), rng.standard_normal(512)], axis=1)
    args = dict(q=rng.standard_normal((3, 8)), k=rng.standard_normal((512, 8)), v=v)
    fast = _run("fast", args, out_dtype)
    stats = FA.fallback_stats()
    assert stats["referee_rows"] == 0, stats
    assert (np.asarray(fast[0], np.float64)[..., 0] == 0.375).all()
    _same(fast, _run("referee", args, out_dtype))


def test_block_bound_is_linear():
    """The block bound is the Dot2 bound of one block, far below the double-double step's
    whole-row bound at long rows."""
    from refattn.exact.fast import doubledouble as D

    assert FR.refine_bounds() == D.dot_bound(2 * FR.REFINE_BLOCK)
    assert FR.refine_bounds() * 2**16 < D.dot_bound(2 * 32768)


@pytest.mark.parametrize("q_kind", ["nvfp4", "float64"])
def test_long_rows_of_codes_read_the_codes_directly(monkeypatch, q_kind):
    """Rows of at least REFINE_KEYS keys with k, v as codes and a float64 target: the refined
    step alone, reading the codes (no float64 K^T or V is formed); exact dot products for
    NVFP4 q, Dot2 ones for a float64 q; the referee's bits (weights too)."""
    monkeypatch.setattr(FA, "REFINE_KEYS", 64)
    stored = []
    real = FA.codes_inputs

    def spy(*args):
        stored.append(args[-1])
        return real(*args)

    monkeypatch.setattr(FA, "codes_inputs", spy)
    rng = np.random.default_rng(8)
    args = _nvfp4(rng)
    if q_kind == "float64":
        args["q"] = rng.standard_normal(args["q"].shape)
        del args["q_block_scale"]
    opts = dict(causal=True, align="bottom_right", return_weights=True)
    fast = _run("fast", args, **opts)
    stats = FA.fallback_stats()
    assert stored == [False] and stats["refine_rows"] == stats["rows"] == 8, (stored, stats)
    assert stats["double_double_rows"] == 0
    _same(fast, _run("referee", args, **opts))


def test_codes_facts_alone_are_those_of_the_stored_inputs():
    """codes_inputs(store=False): the same key and value facts, no K^T or V formed."""
    from refattn.exact.fast.codes_inputs import codes_inputs
    from refattn.quantized import quantised_rows

    args = _nvfp4(np.random.default_rng(9))
    rows = [
        quantised_rows(args[n], args[f"{n}_descale"], args[f"{n}_block_scale"], n) for n in "kv"
    ]
    k_t, v, k_facts, v_facts = codes_inputs(*rows, 1, 4)
    k_t0, v0, k_facts0, v_facts0 = codes_inputs(*rows, 1, 4, False)
    assert k_t.shape == (1, 2, 32, 100) and not k_t[..., 96:].any()
    assert k_t0.shape == (1, 2, 32, 0) and v0.shape == (1, 2, 0, 32)
    for mine, theirs in zip(k_facts + v_facts, k_facts0 + v_facts0, strict=True):
        assert np.array_equal(mine, theirs)
