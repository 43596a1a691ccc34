"""FlashAttention 3's ``qv`` (multi-head latent attention) on every path.

Exact: bit for bit against the loop twin (tests/naive/attention.py, whose score is the literal
``s (q . k + qv . v)``, default ``s = 1/sqrt(D + E)``), alone and with GQA, causal, window,
softcap, bias, sinks and key lengths; the exact vjp (dq, dk, dv, dqv) rounds the central
differences of the twin; float64 and Numba inside their bounds; the fast exact engine and the
referee agree on the exactly summed dv.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn import config
from refattn.bounds import float64_forward_bound, float64_vjp_bound
from refattn.bounds.unit import unit_roundoff
from refattn.spec import canonicalize, fold
from tests.helpers import assert_same_bits, assert_within
from tests.naive.attention import naive_attention, naive_batch_rounded
from tests.naive.mp import central_vjp
from tests.naive.rounding import round_nested

DTYPES = ["float64", "float32", "float16", "bfloat16"]
OPTION_SETS = [
    {},
    {"causal": True, "align": "bottom_right"},
    {"window": (1, 0)},
    {"softcap": 2.0, "causal": True},
    {"gqa": "tile", "scale": 0.5},
    {"bias": "random"},
]


def _inputs(seed, batch=2, heads=2, kv_heads=1, length=3, keys=5, dim=2, vdim=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, length, dim))
    k = rng.standard_normal((batch, kv_heads, keys, dim))
    v = rng.standard_normal((batch, kv_heads, keys, vdim))
    qv = rng.standard_normal((batch, heads, length, vdim))
    return q, k, v, qv, rng


def _options(options, rng, shape):
    options = dict(options)
    if options.get("bias") == "random":
        options["bias"] = rng.standard_normal(shape)
    return options


def _twin(q, k, v, qv, opts, dtype, sinks=None, kv_lengths=None):
    per_row = {"qv": qv, **({"bias": opts["bias"]} if "bias" in opts else {})}
    rest = {key: val for key, val in opts.items() if key != "bias"}
    return naive_batch_rounded(
        q, k, v, rest, dtype, sinks=sinks, kv_lengths=kv_lengths, per_row=per_row
    )


@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    options=st.sampled_from(OPTION_SETS),
    dtype=st.sampled_from(DTYPES),
    with_sinks=st.booleans(),
    with_lengths=st.booleans(),
)
def test_exact_matches_loop_twin(seed, options, dtype, with_sinks, with_lengths):
    q, k, v, qv, rng = _inputs(seed)
    opts = _options(options, rng, (2, 2, 3, 5))
    sinks = rng.standard_normal(2) * 2 if with_sinks else None
    lengths = rng.integers(0, 6, size=2) if with_lengths else None
    out, lse = refattn.attention(
        q, k, v, **opts, qv=qv, sinks=sinks, kv_lengths=lengths, return_lse=True,
        precision="exact", out_dtype=dtype,
    )  # fmt: skip
    want_out, want_lse = _twin(q, k, v, qv, opts, dtype, sinks, lengths)
    case = f"qv {options} sinks={sinks is not None} lengths={lengths} {dtype}"
    assert_same_bits(out, want_out, what="out", case=case)
    assert_same_bits(lse, want_lse, what="lse", case=case)


def test_default_scale_is_one_over_sqrt_of_d_plus_e():
    q, k, v, qv, _ = _inputs(1)
    spec = canonicalize(q, k, v, qv=qv)
    assert spec.scale_float == 1 / np.sqrt(2 + 3) and spec.qv_features == 3
    explicit = refattn.attention(q, k, v, qv=qv, scale=1 / np.sqrt(5.0), precision="exact")
    # the default is the exact irrational 1/sqrt(5); 1/sqrt(5.0) rounded is another number,
    # so only the float64 paths agree bit for bit
    np.testing.assert_array_equal(
        refattn.attention(q, k, v, qv=qv), refattn.attention(q, k, v, qv=qv, scale=spec.scale)
    )
    assert explicit.shape == (2, 2, 3, 3)


@pytest.mark.parametrize("options", OPTION_SETS, ids=str)
def test_float64_and_vjp_inside_their_bounds(options):
    q, k, v, qv, rng = _inputs(7)
    opts = _options(options, rng, (2, 2, 3, 5))
    extra = {"sinks": rng.standard_normal(2), "kv_lengths": np.array([5, 3]), "qv": qv}
    got_out, got_lse = refattn.attention(q, k, v, **opts, **extra, return_lse=True)
    out, lse = refattn.attention(q, k, v, **opts, **extra, return_lse=True, precision="exact")
    out_bound, lse_bound = float64_forward_bound(q, k, v, **opts, **extra)
    assert_within(got_out, out, out_bound, what="out", case=str(options))
    assert_within(got_lse, lse, lse_bound, what="lse", case=str(options))
    grad = rng.standard_normal(out.shape)
    got = refattn.attention_vjp(q, k, v, grad, **opts, **extra)
    exact = refattn.attention_vjp(q, k, v, grad, **opts, **extra, precision="exact")
    bounds = float64_vjp_bound(q, k, v, grad, **opts, **extra)
    assert isinstance(got, refattn.AttentionLatentGrads) and got.dqv.shape == qv.shape
    for name, bound in zip(("dq", "dk", "dv"), bounds[:3], strict=True):
        assert_within(getattr(got, name), getattr(exact, name), bound, what=name, case="qv")
    assert_within(got.dqv, exact.dqv, bounds[-1], what="dqv", case=str(options))


def _assert_rounds_to(value, estimate, error, what):
    __tracebackhide__ = True
    lo, hi = round_nested(estimate - error), round_nested(estimate + error)
    decided = lo == hi
    assert_same_bits(np.asarray(value)[decided], lo[decided], what=what)
    assert ((value >= lo) & (value <= hi)).all(), f"{what}: outside the estimate"


@pytest.mark.parametrize("options", [{}, {"causal": True, "softcap": 1.5}], ids=str)
def test_exact_vjp_rounds_central_differences_of_the_twin(options):
    """dq, dk, dv (both of v's terms) and dqv against d/dx of the mpmath twin."""
    rng = np.random.default_rng(5)
    q, k, v, qv = (rng.standard_normal(s) for s in ((2, 2), (3, 2), (3, 2), (2, 2)))
    grad = rng.standard_normal((2, 2))
    got = refattn.attention_vjp(q, k, v, grad, qv=qv, **options, precision="exact")

    def forward(q_, k_, v_, qv_):
        out, _, _ = naive_attention(q_[None], k_[None], v_[None], qv=qv_[None], **options)
        return out[0]

    truth = central_vjp(forward, (q, k, v, qv), grad, dps=50)
    for name, (estimate, error) in zip(("dq", "dk", "dv", "dqv"), truth, strict=True):
        _assert_rounds_to(getattr(got, name), estimate, error, f"exact {name} {options}")


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_fast_engine_and_referee_agree_on_the_summed_dv(dtype):
    q, k, v, qv, rng = _inputs(9, batch=1, keys=4)
    opts = {"causal": True, "align": "bottom_right", "sinks": rng.standard_normal(2), "qv": qv}
    grad, grad_lse = rng.standard_normal((1, 2, 3, 3)), rng.standard_normal((1, 2, 3))
    fast = refattn.attention_vjp(
        q, k, v, grad, grad_lse=grad_lse, **opts, precision="exact", out_dtype=dtype
    )
    saved = config.EXACT_VJP_ENGINE
    config.EXACT_VJP_ENGINE = "referee"
    try:
        referee = refattn.attention_vjp(
            q, k, v, grad, grad_lse=grad_lse, **opts, precision="exact", out_dtype=dtype
        )
    finally:
        config.EXACT_VJP_ENGINE = saved
    for name in ("dq", "dk", "dv", "dsinks", "dqv"):
        assert_same_bits(getattr(fast, name), getattr(referee, name), what=name, case=dtype)


def test_numba_inside_the_kernel_bound():
    from refattn.kernels import numba_cpu

    q, k, v, qv, rng = _inputs(13)
    opts = {"causal": True, "kv_lengths": np.array([5, 2]), "qv": qv}
    got_out, got_lse = refattn.attention(q, k, v, **opts, return_lse=True, backend="numba")
    out, lse, weights = refattn.attention(
        q, k, v, **opts, return_lse=True, return_weights=True, precision="exact"
    )
    spec = fold(canonicalize(q, k, v, **opts), alibi_into_bias=True)
    out_bound, lse_bound = numba_cpu.forward_error_bound(spec, weights, np.float64)
    assert_within(got_out, out, out_bound, what="out", case="numba qv")
    assert_within(got_lse, lse, lse_bound, what="lse", case="numba qv")
    grad = rng.standard_normal(out.shape)
    got = refattn.attention_vjp(q, k, v, grad, **opts, backend="numba")
    exact = refattn.attention_vjp(q, k, v, grad, **opts, precision="exact")
    dq, dk, dv, _ = numba_cpu.backward_error_bound(spec, weights, grad, None, np.float64)
    cut = q.shape[-1]
    u = unit_roundoff("float64")
    # both terms' bounds, and the rounding of their sum: u |sum| <= u (|exact| + bounds)
    dv_bound = (1 + u) * (dv + dk[..., cut:]) + u * np.abs(exact.dv)
    assert_within(got.dq, exact.dq, dq[..., :cut], what="dq", case="numba qv")
    assert_within(got.dqv, exact.dqv, dq[..., cut:], what="dqv", case="numba qv")
    assert_within(got.dk, exact.dk, dk[..., :cut], what="dk", case="numba qv")
    assert_within(got.dv, exact.dv, dv_bound, what="dv", case="numba qv")


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_qv_takes_q_descale(name):
    q, k, v, qv, rng = _inputs(3, kv_heads=2, heads=4)
    fp8 = getattr(ml_dtypes, name)
    q8, k8, v8, qv8 = (x.astype(fp8) for x in (q, k, v, qv))
    descale = {n: rng.uniform(0.5, 2, size=(2, 2)).astype(np.float32) for n in "qkv"}
    got = refattn.attention(
        q8, k8, v8, qv=qv8, q_descale=descale["q"], k_descale=descale["k"],
        v_descale=descale["v"], precision="exact", out_dtype="bfloat16",
    )  # fmt: skip
    per_head = np.repeat(descale["q"].astype(np.float64), 2, axis=1)[..., None, None]
    kv = {n: descale[n].astype(np.float64)[..., None, None] for n in "kv"}
    want = refattn.attention(
        q8.astype(np.float64) * per_head,
        k8.astype(np.float64) * kv["k"],
        v8.astype(np.float64) * kv["v"],
        qv=qv8.astype(np.float64) * per_head,
        precision="exact",
        out_dtype="bfloat16",
    )
    assert_same_bits(got, want, what="out", case=name)


def test_bad_qv_names_itself():
    q, k, v, qv, _ = _inputs(0)
    with pytest.raises(ValueError, match="qv: expected shape"):
        refattn.attention(q, k, v, qv=qv[..., :2])
    with pytest.raises(TypeError, match="qv: expected q's dtype"):
        refattn.attention(q, k, v, qv=qv.astype(np.float32))
    with pytest.raises(ValueError, match="qv: expected shape"):
        refattn.attention(q, k, v, qv=qv[:, :1])


def test_exact_vjp_with_gqa_sinks_bias_and_key_length():
    """dq, dk, dv, dqv with two query heads on one kv head, sinks, a bias and a key length
    (bottom_right causal), against central differences of the twin."""
    rng = np.random.default_rng(8)
    q, qv = rng.standard_normal((2, 2, 2)), rng.standard_normal((2, 2, 2))
    k, v = rng.standard_normal((1, 3, 2)), rng.standard_normal((1, 3, 2))
    grad = rng.standard_normal((2, 2, 2))
    sinks, bias = rng.standard_normal(2), rng.standard_normal((2, 2, 3))
    opts = {"causal": True, "align": "bottom_right", "sinks": sinks, "bias": bias}
    got = refattn.attention_vjp(
        q[None], k[None], v[None], grad[None], qv=qv[None], kv_lengths=np.array([2]),
        precision="exact", **{**opts, "bias": bias[None]},
    )  # fmt: skip

    def forward(q_, k_, v_, qv_):
        return naive_attention(q_, k_, v_, qv=qv_, kv_length=2, **opts)[0]

    truth = central_vjp(forward, (q, k, v, qv), grad, dps=50)
    for name, (estimate, error) in zip(("dq", "dk", "dv", "dqv"), truth, strict=True):
        _assert_rounds_to(getattr(got, name)[0], estimate, error, f"exact {name} gqa sinks")
