"""Attention sinks, per-row key lengths and float8 inputs with descale factors, on every path:
exact (bit for bit against the loop twin), float64 (inside its bound), Numba (inside the
kernel bound)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn.bounds import float64_forward_bound, float64_vjp_bound
from refattn.bounds.unit import unit_roundoff
from refattn.spec import canonicalize, fold
from tests.helpers import assert_same_bits as assert_exact
from tests.helpers import assert_within
from tests.naive.attention import naive_attention, naive_attention_rounded, naive_batch_rounded

DTYPES = ["float64", "float32", "float16", "bfloat16"]


def _inputs(seed, batch=2, heads=2, kv_heads=1, length=3, keys=7, dim=4, vdim=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, length, dim))
    k = rng.standard_normal((batch, kv_heads, keys, dim))
    v = rng.standard_normal((batch, kv_heads, keys, vdim))
    return q, k, v, rng


OPTION_SETS = [
    {},
    {"causal": True, "align": "bottom_right"},
    {"causal": True},
    {"window": (1, 1), "align": "bottom_right"},
    {"softcap": 2.0, "causal": True, "align": "bottom_right"},
    {"gqa": "tile", "scale": 0.5},
]


def _naive(q, k, v, opts, dtype, sinks=None, kv_lengths=None):
    """The loop twin per batch row, rounded once to dtype (out, lse)."""
    return naive_batch_rounded(q, k, v, opts, dtype, sinks=sinks, kv_lengths=kv_lengths)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    options=st.sampled_from(OPTION_SETS),
    dtype=st.sampled_from(DTYPES),
    with_sinks=st.booleans(),
    with_lengths=st.booleans(),
)
def test_exact_matches_loop_twin(seed, options, dtype, with_sinks, with_lengths):
    q, k, v, rng = _inputs(seed)
    sinks = rng.standard_normal(2) * 3 if with_sinks else None
    lengths = rng.integers(0, 8, size=2) if with_lengths else None
    out, lse = refattn.attention(
        q,
        k,
        v,
        **options,
        sinks=sinks,
        kv_lengths=lengths,
        return_lse=True,
        precision="exact",
        out_dtype=dtype,
    )
    want_out, want_lse = _naive(q, k, v, options, dtype, sinks, lengths)
    assert_exact(out, want_out, what="out", case=f"{options} sinks={sinks} lengths={lengths}")
    assert_exact(lse, want_lse, what="lse", case=f"{options} sinks={sinks} lengths={lengths}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_with_a_fully_masked_row_matches_loop_twin(dtype):
    """A mask that empties a row (and a GQA group): with a sink the row gives out 0 and
    lse = the sink, exactly, and every other row is the loop twin's."""
    q, k, v, rng = _inputs(3, heads=4, kv_heads=2)
    mask = rng.random((2, 4, 3, 7)) < 0.7
    mask[:, :, 1] = False
    sinks = rng.standard_normal(4) * 2
    out, lse = refattn.attention(
        q,
        k,
        v,
        mask=mask,
        sinks=sinks,
        causal=True,
        align="bottom_right",
        return_lse=True,
        precision="exact",
        out_dtype=dtype,
    )
    outs, lses = [], []
    for b in range(2):
        row = {"mask": mask[b], "sinks": sinks, "causal": True, "align": "bottom_right"}
        o, m, _ = naive_attention_rounded(q[b], k[b], v[b], row, dtype)
        outs.append(o)
        lses.append(m)
    assert_exact(out, np.stack(outs), what="out", case=f"sink, masked row, {dtype}")
    assert_exact(lse, np.stack(lses), what="lse", case=f"sink, masked row, {dtype}")
    assert (np.asarray(out, np.float64)[:, :, 1] == 0).all()
    if dtype == "float64":  # lse of the empty row is the sink itself
        assert_exact(lse[:, :, 1], np.broadcast_to(sinks, (2, 4)), what="lse", case=dtype)


@pytest.mark.parametrize("options", OPTION_SETS, ids=str)
def test_float64_inside_its_bound(options):
    q, k, v, rng = _inputs(7)
    extra = {"sinks": rng.standard_normal(2) * 3, "kv_lengths": np.array([5, 2])}
    got_out, got_lse = refattn.attention(q, k, v, **options, **extra, return_lse=True)
    out, lse = refattn.attention(q, k, v, **options, **extra, return_lse=True, precision="exact")
    out_bound, lse_bound = float64_forward_bound(q, k, v, **options, **extra)
    assert_within(got_out, out, out_bound, what="out", case=str(options))
    assert_within(got_lse, lse, lse_bound, what="lse", case=str(options))


def test_float64_vjp_inside_its_bound_and_dsinks_exact():
    q, k, v, rng = _inputs(11)
    sinks = rng.standard_normal(2)
    options = {
        "causal": True,
        "align": "bottom_right",
        "sinks": sinks,
        "kv_lengths": np.array([6, 3]),
    }
    grad_out, grad_lse = rng.standard_normal((2, 2, 3, 3)), rng.standard_normal((2, 2, 3))
    got = refattn.attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, **options)
    exact = refattn.attention_vjp(
        q, k, v, grad_out, grad_lse=grad_lse, **options, precision="exact"
    )
    bounds = float64_vjp_bound(q, k, v, grad_out, grad_lse=grad_lse, **options)
    for name, bound in zip(("dq", "dk", "dv"), bounds[:3], strict=True):
        assert_within(getattr(got, name), getattr(exact, name), bound, what=name, case="sinks")
    # dsinks: the exact path against d/dsigma of the loop twin's loss (60 digits)
    import mpmath

    def loss(head, value):
        total = mpmath.mpf(0)
        for b in range(2):
            row_sinks = [mpmath.mpf(float(s)) for s in sinks]
            row_sinks[head] = value
            out, lse, _ = naive_attention(
                q[b],
                k[b],
                v[b],
                causal=True,
                align="bottom_right",
                sinks=row_sinks,
                kv_length=options["kv_lengths"][b],
                dps=120,
            )
            total += mpmath.fsum(
                out[h][i][e] * grad_out[b, h, i, e]
                for h in range(2)
                for i in range(3)
                for e in range(3)
            )
            total += mpmath.fsum(lse[h][i] * grad_lse[b, h, i] for h in range(2) for i in range(3))
        return total

    with mpmath.workdps(60):
        want = [
            float(mpmath.diff(lambda s, h=h: loss(h, s), mpmath.mpf(float(sinks[h]))))
            for h in range(2)
        ]
    assert exact.dsinks.shape == (2,) and got.dsinks.shape == (2,)
    assert_within(
        exact.dsinks,
        np.array(want),
        unit_roundoff("float64") * np.abs(want),
        what="dsinks",
        case="exact vs twin",
    )


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_float8_inputs_are_their_dequantised_values(name, out_dtype):
    q, k, v, rng = _inputs(3, kv_heads=2, heads=4)
    fp8 = getattr(ml_dtypes, name)
    q8, k8, v8 = (x.astype(fp8) for x in (q, k, v))
    descale = {n: (rng.uniform(0.5, 2, size=(2, 2))).astype(np.float32) for n in "qkv"}
    got = refattn.attention(
        q8,
        k8,
        v8,
        q_descale=descale["q"],
        k_descale=descale["k"],
        v_descale=descale["v"],
        causal=True,
        precision="exact",
        out_dtype=out_dtype,
    )
    group = np.repeat(descale["q"].astype(np.float64), 2, axis=1)[..., None, None]
    q64 = q8.astype(np.float64) * group
    k64 = k8.astype(np.float64) * descale["k"].astype(np.float64)[..., None, None]
    v64 = v8.astype(np.float64) * descale["v"].astype(np.float64)[..., None, None]
    want = refattn.attention(q64, k64, v64, causal=True, precision="exact", out_dtype=out_dtype)
    assert_exact(got, want, what="out", case=name)
    twin, _ = _naive(q64, k64, v64, {"causal": True}, out_dtype)
    assert_exact(got, twin, what="out", case=f"{name} twin")


def test_bad_new_arguments_name_themselves():
    q, k, v, _ = _inputs(0)
    with pytest.raises(ValueError, match="sinks: expected shape \\(2,\\)"):
        refattn.attention(q, k, v, sinks=np.zeros(3))
    with pytest.raises(ValueError, match="kv_lengths: expected lengths in \\[0, S = 7\\]"):
        refattn.attention(q, k, v, kv_lengths=np.array([1, 8]))
    with pytest.raises(ValueError, match="kv_lengths: expected shape \\(2,\\)"):
        refattn.attention(q, k, v, kv_lengths=np.array([1]))
    with pytest.raises(ValueError, match="q_descale: only float8 inputs"):
        refattn.attention(q, k, v, q_descale=np.ones((2, 1), np.float32))


def test_kv_lengths_bottom_right_is_not_the_padded_mask_reading():
    q, k, v, _ = _inputs(5)
    lengths = np.array([4, 7])
    ours = refattn.attention(q, k, v, causal=True, align="bottom_right", kv_lengths=lengths)
    padding = np.arange(7)[None, None, None, :] < lengths[:, None, None, None]
    padded = refattn.attention(q, k, v, causal=True, align="bottom_right", mask=padding)
    assert not np.array_equal(ours[0], padded[0])  # row 0 is aligned to its own 4 keys
    assert np.array_equal(ours[1], padded[1])  # a full-length row reads the same
    top = refattn.attention(q, k, v, causal=True, kv_lengths=lengths)
    assert np.array_equal(top, refattn.attention(q, k, v, causal=True, mask=padding))


@pytest.mark.parametrize("options", OPTION_SETS[:4], ids=str)
def test_numba_inside_the_kernel_bound(options):
    from refattn.kernels import numba_cpu

    q, k, v, rng = _inputs(13)
    extra = {"sinks": rng.standard_normal(2) * 2, "kv_lengths": np.array([7, 4])}
    got_out, got_lse = refattn.attention(
        q, k, v, **options, **extra, return_lse=True, backend="numba"
    )
    out, lse, weights = refattn.attention(
        q, k, v, **options, **extra, return_lse=True, return_weights=True, precision="exact"
    )
    spec = fold(canonicalize(q, k, v, **options, **extra), alibi_into_bias=True)
    sink_weight = np.exp(extra["sinks"][None, :, None] - lse)[..., None]
    out_bound, lse_bound = numba_cpu.forward_error_bound(
        spec, np.concatenate([weights, sink_weight], axis=-1), np.float64
    )
    assert_within(got_out, out, out_bound, what="out", case=str(options))
    assert_within(got_lse, lse, lse_bound, what="lse", case=str(options))
    got = refattn.attention_vjp(q, k, v, np.ones_like(out), **options, **extra, backend="numba")
    ref = refattn.attention_vjp(q, k, v, np.ones_like(out), **options, **extra)
    assert got.dsinks.shape == ref.dsinks.shape == (2,)
    assert got.dk.shape == k.shape and got.dbias is None


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_alibi_follows_each_rows_own_length(dtype):
    q, k, v, rng = _inputs(17)
    options = {"alibi_slopes": np.array([0.5, 0.25]), "causal": True, "align": "bottom_right"}
    lengths = np.array([5, 3])
    out, lse = refattn.attention(
        q, k, v, **options, kv_lengths=lengths, return_lse=True, precision="exact", out_dtype=dtype
    )
    want_out, want_lse = _naive(q, k, v, options, dtype, None, lengths)
    assert_exact(out, want_out, what="out", case="alibi kv_lengths")
    assert_exact(lse, want_lse, what="lse", case="alibi kv_lengths")
    got = refattn.attention(q, k, v, **options, kv_lengths=lengths)
    bound, _ = float64_forward_bound(q, k, v, **options, kv_lengths=lengths)
    assert_within(
        got,
        refattn.attention(q, k, v, **options, kv_lengths=lengths, precision="exact"),
        bound,
        what="out",
        case="f64",
    )
    grad_out = rng.standard_normal(out.shape)
    fast = refattn.attention_vjp(
        q, k, v, grad_out, **options, kv_lengths=lengths, precision="exact", out_dtype=dtype
    )
    from refattn import config

    saved = config.EXACT_VJP_ENGINE
    config.EXACT_VJP_ENGINE = "referee"
    try:
        referee = refattn.attention_vjp(
            q, k, v, grad_out, **options, kv_lengths=lengths, precision="exact", out_dtype=dtype
        )
    finally:
        config.EXACT_VJP_ENGINE = saved
    for name in ("dq", "dk", "dv"):
        assert_exact(getattr(fast, name), getattr(referee, name), what=name, case="alibi")
