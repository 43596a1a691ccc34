"""normalizer="sigmoid": exact path bit-identical to the loop twin, float64 path within its
bound, the vjp against the exact vjp and central differences of the mpmath twin, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn.bounds import sigmoid_forward_bound, sigmoid_vjp_bound
from tests.helpers import assert_within
from tests.naive.mp import central_vjp
from tests.naive.sigmoid import naive_sigmoid_loss, naive_sigmoid_rounded


@st.composite
def sigmoid_cases(draw, max_len=4, max_keys=5):
    """(q (H, L, D), k, v, options): one batch row, small shapes, the options drawn."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    heads, kv_heads = draw(st.sampled_from([(1, 1), (2, 1), (2, 2)]))
    length, keys = draw(st.integers(1, max_len)), draw(st.integers(1, max_keys))
    dim, vdim = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    mag = draw(st.sampled_from([0.5, 2.0, 8.0]))
    q = mag * rng.standard_normal((heads, length, dim))
    k = rng.standard_normal((kv_heads, keys, dim))
    v = rng.standard_normal((kv_heads, keys, vdim))
    opts = {}
    plane = (heads, length, keys)
    if draw(st.booleans()):
        opts["causal"] = True
    if draw(st.booleans()):
        opts["window"] = (draw(st.integers(0, 2)), draw(st.sampled_from([None, 0, 1])))
    if draw(st.booleans()):
        opts["align"] = "bottom_right"
    if draw(st.booleans()):
        opts["softcap"] = draw(st.sampled_from([1.0, 5.0]))
    if draw(st.booleans()):
        opts["alibi_slopes"] = rng.uniform(0.0, 1.0, heads)
    if heads != kv_heads and draw(st.booleans()):
        opts["gqa"] = "tile"
    bias_kind = draw(st.sampled_from(["none", "log_s", "plane"]))
    if bias_kind == "log_s":  # the paper's b = -log(S), a scalar
        opts["bias"] = np.float64(-math.log(keys))
    elif bias_kind == "plane":
        bias = rng.standard_normal(plane)
        bias[rng.random(plane) < 0.2] = -np.inf
        opts["bias"] = bias
    if draw(st.booleans()):
        opts["mask"] = rng.random(plane) > 0.3
    if draw(st.booleans()):
        opts["dropout_mask"] = rng.random(plane) > 0.25
        opts["dropout_p"] = 0.25
    if draw(st.booleans()):
        opts["empty_rows"] = "nan"
    return q, k, v, opts


@given(case=sigmoid_cases(), dtype=st.sampled_from(["float64", "float32", "float16", "bfloat16"]))
def test_exact_bit_identical_to_twin(case, dtype):
    q, k, v, opts = case
    out, weights = refattn.attention(
        q,
        k,
        v,
        normalizer="sigmoid",
        precision="exact",
        out_dtype=dtype,
        return_weights=True,
        **opts,
    )
    twin_out, twin_w = naive_sigmoid_rounded(q, k, v, opts, dtype)
    np.testing.assert_array_equal(out.astype(np.float64), twin_out)
    np.testing.assert_array_equal(np.signbit(out.astype(np.float64)), np.signbit(twin_out))
    np.testing.assert_array_equal(weights.astype(np.float64), twin_w)


@given(case=sigmoid_cases())
def test_float64_within_bound(case):
    q, k, v, opts = case
    exact = refattn.attention(q, k, v, normalizer="sigmoid", precision="exact", **opts)
    approx = refattn.attention(q, k, v, normalizer="sigmoid", **opts)
    bound = sigmoid_forward_bound(q, k, v, **opts)
    assert_within(approx, exact, bound, what="sigmoid out (float64)")


def _dbias_bound(ds_bound, ds_abs, bias_shape, batch_shape):
    """dbias bound: the dS plane's bound summed to bias's shape, plus that float64 sum."""
    from refattn.bounds import gamma
    from refattn.broadcast import reduce_to

    full = ds_bound.reshape(batch_shape + ds_bound.shape[-3:])
    count = max(full.size // max(int(np.prod(bias_shape)), 1), 1)
    return reduce_to(full, bias_shape) + gamma(count + 1) * reduce_to(full + ds_abs, bias_shape)


@settings(max_examples=12)
@given(case=sigmoid_cases(max_len=3, max_keys=4))
def test_vjp_float64_within_bound(case):
    q, k, v, opts = case
    opts.pop("empty_rows", None)
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(q.shape[:2] + v.shape[-1:])
    exact = refattn.attention_vjp(q, k, v, grad, normalizer="sigmoid", precision="exact", **opts)
    approx = refattn.attention_vjp(q, k, v, grad, normalizer="sigmoid", **opts)
    bq, bk, bv, bs = sigmoid_vjp_bound(q, k, v, grad, **opts)
    for name, a, e, b in zip("qkv", approx[:3], exact[:3], (bq, bk, bv), strict=True):
        assert_within(a, e, b, what=f"sigmoid d{name} (float64)")
    if "bias" in opts:
        shape = np.shape(opts["bias"])
        bound = _dbias_bound(bs, np.abs(exact.dbias).max(), shape, ())
        assert_within(approx.dbias, exact.dbias, bound, what="sigmoid dbias (float64)")


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_exact_vjp_matches_central_differences(softcap):
    rng = np.random.default_rng(7)
    q, k, v = (
        rng.standard_normal((1, 2, 2)),
        rng.standard_normal((1, 3, 2)),
        rng.standard_normal((1, 3, 2)),
    )
    bias = rng.standard_normal((1, 2, 3))
    grad = rng.standard_normal((1, 2, 2))
    opts = {"causal": True, "alibi_slopes": np.array([0.3])}
    if softcap is not None:
        opts["softcap"] = softcap
    exact = refattn.attention_vjp(
        q, k, v, grad, bias=bias, normalizer="sigmoid", precision="exact", **opts
    )
    numeric = central_vjp(naive_sigmoid_loss(opts), [q, k, v, bias], grad, dps=40)
    for name, got, (estimate, error) in zip(
        ("dq", "dk", "dv", "dbias"), exact, numeric, strict=True
    ):
        truth = np.array(estimate, dtype=np.float64)
        tol = np.array(error, dtype=np.float64)
        assert_within(got, truth, tol, ulps=2, what=f"sigmoid {name} vs central differences")


def test_empty_rows_and_excluded_keys():
    q, k, v = np.ones((2, 2)), np.ones((3, 2)), np.full((3, 1), np.nan)
    mask = np.zeros((2, 3), bool)
    for precision in ("float64", "exact"):
        out = refattn.attention(q, k, v, mask=mask, normalizer="sigmoid", precision=precision)
        assert out.tolist() == [[0.0], [0.0]]
        nan = refattn.attention(
            q, k, v, mask=mask, empty_rows="nan", normalizer="sigmoid", precision=precision
        )
        assert np.isnan(nan).all()


def test_scale_zero_is_half_sum():
    """sigma(0) = 1/2 exactly: the exact path settles rational outputs (no Ziv cap)."""
    q, k = np.ones((1, 2)), np.ones((4, 2))
    v = np.array([[1.0], [2.0], [3.0], [2.0**-60]])
    out = refattn.attention(
        q, k, v, scale=0.0, normalizer="sigmoid", precision="exact", out_dtype="float16"
    )
    assert out.tolist() == [[3.0]]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda q: refattn.attention(q, q, q, normalizer="sigmoid", return_lse=True), "return_lse"),
        (lambda q: refattn.attention(q, q, q, normalizer="sigmoid", sinks=np.zeros(1)), "sinks"),
        (lambda q: refattn.attention(q, q, q, normalizer="sigmax"), "normalizer"),
        (
            lambda q: refattn.attention_vjp(q, q, q, q, grad_lse=np.ones(2), normalizer="sigmoid"),
            "grad_lse",
        ),
    ],
)
def test_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call(np.ones((2, 2)))
