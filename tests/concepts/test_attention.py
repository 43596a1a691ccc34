"""refattn.attention: exact path vs an independent 60-digit loop, float64 path within its
derived bound, bit-exact algebraic properties, poison, empty rows and bad input."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import refattn
from oracle.judging.tolerance import ulp_distance
from refattn.bounds import float64_forward_bound
from tests.helpers import assert_same_bits, assert_within
from tests.naive.attention import naive_attention_rounded
from tests.strategies import attention_cases

DTYPES = ("float64", "float32", "float16", "bfloat16")


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# ----------------------------------------------------------------------------------------
# exact path == independent 60-digit evaluation, bit for bit, in four dtypes (random cases:
# tests/test_registry.py, rows attention[<dtype>]; adversarial ones here)
# ----------------------------------------------------------------------------------------
ADVERSARIAL = {
    # logit gaps > 40 between the top key and the rest
    "logit-gap-60": lambda rng: (
        rng.standard_normal((1, 3, 4)) * 30,
        rng.standard_normal((1, 5, 4)),
        rng.standard_normal((1, 5, 3)),
    ),
    # every score equal: weights exactly 1/S, outputs exact means (rounding ties)
    "ties-at-max": lambda rng: (
        np.zeros((1, 3, 4)),
        rng.standard_normal((1, 6, 4)),
        np.array([1.0, 1.0 + 2.0**-23, 3.0, 5.0, 7.0, 9.0])[None, :, None],
    ),
    # values spanning the subnormal range: outputs near underflow
    "near-underflow": lambda rng: (
        rng.standard_normal((1, 2, 3)),
        rng.standard_normal((1, 4, 3)),
        rng.standard_normal((1, 4, 2)) * 1e-310,
    ),
    # mixed-sign values that nearly cancel
    "near-cancelling": lambda rng: (
        rng.standard_normal((1, 2, 3)) * 1e-3,
        rng.standard_normal((1, 4, 3)),
        np.array([[1.0], [-1.0], [1.0 + 2.0**-40], [-1.0]])[None],
    ),
    # ascending score order, large scores (|t| up to ~1400: gaps of hundreds between keys)
    "huge-scores": lambda rng: (
        np.full((1, 2, 2), 10.0),
        np.linspace(-100, 100, 6)[None, :, None].repeat(2, axis=2),
        rng.standard_normal((1, 6, 2)),
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_exact_path_adversarial(name, dtype):
    rng = np.random.default_rng(sorted(ADVERSARIAL).index(name))
    q, k, v = ADVERSARIAL[name](rng)
    mask = np.ones((q.shape[0], q.shape[1], k.shape[1]), dtype=bool)
    mask[0, -1] = False  # one fully masked row in every case
    out, lse = refattn.attention(
        q, k, v, mask=mask, precision="exact", out_dtype=_dtype(dtype), return_lse=True
    )
    n_out, n_lse, _ = naive_attention_rounded(q, k, v, {"mask": mask}, _dtype(dtype))
    assert_same_bits(out, n_out, what="out", case=name)
    assert_same_bits(lse, n_lse, what="lse", case=name)


def test_tie_midpoint_rounds_to_even():
    """Two equal scores average 1 and 1 + 2**-23: exactly a float32 midpoint (ties to even)."""
    v = np.array([[1.0], [1.0 + 2.0**-23]])
    out = refattn.attention(
        np.zeros((1, 2)), np.zeros((2, 2)), v, precision="exact", out_dtype="float32"
    )
    assert out[0, 0] == np.float32(1.0)
    out64 = refattn.attention(np.zeros((1, 2)), np.zeros((2, 2)), v, precision="exact")
    assert out64[0, 0] == 1.0 + 2.0**-24


# ----------------------------------------------------------------------------------------
# float64 path within its a-priori bound (random cases: tests/test_registry.py)
# ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_float64_path_long_rows():
    """S = 4096 on the float64 path, against the exact path and the bound."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, 8)) * 3
    k = rng.standard_normal((1, 4096, 8))
    v = rng.standard_normal((1, 4096, 3))
    out = refattn.attention(q, k, v, causal=True, align="bottom_right")
    exact = refattn.attention(q, k, v, causal=True, align="bottom_right", precision="exact")
    bound, _ = float64_forward_bound(q, k, v, causal=True, align="bottom_right")
    assert_within(out, exact, bound, what="out S=4096")


def test_float64_bound_is_informative():
    """The bound is a few hundred u of the natural scale, not a vacuous number."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 16, 8)) for _ in range(3))
    bound, _ = float64_forward_bound(q, k, v)
    weights = refattn.attention(q, k, v, return_weights=True)[1]
    natural = weights @ np.abs(v)
    ratio = bound / natural
    # gamma_{S+2} alone is ~ (S + 2) u; the score terms add gamma_{D+2} |s||q||k| per weight
    assert ratio.max() < 64 * (16 + 8 + 2) * 2.0**-53 * (1 + np.abs(q).max() ** 2 * 8)


# ----------------------------------------------------------------------------------------
# bit-exact algebraic properties (exact path: equal exact values round identically)
# ----------------------------------------------------------------------------------------
def _exact(q, k, v, **opts):
    return refattn.attention(q, k, v, precision="exact", return_lse=True, **opts)


@given(case=attention_cases(), shift=st.integers(-8, 8))
def test_row_shift_invariance(case, shift):
    q, k, v, opts = case
    bias = np.broadcast_to(
        opts.pop("bias", np.zeros((q.shape[1], k.shape[1]))), (q.shape[1], k.shape[1])
    )
    bias = np.round(bias * 2.0**20) / 2.0**20  # on a 2**-20 grid, so adding integers is exact
    shifted = bias + shift * np.arange(q.shape[1])[:, None]
    assert (shifted - shift * np.arange(q.shape[1])[:, None] == bias).all()
    out_a, lse_a = _exact(q, k, v, bias=bias, **opts)
    out_b, lse_b = _exact(q, k, v, bias=shifted, **opts)
    assert_same_bits(out_b, out_a, what="out under a per-row score shift")
    finite = np.isfinite(lse_a)
    assert (np.isfinite(lse_b) == finite).all(), "the shift changed which rows are empty"


@given(case=attention_cases(), seed=st.integers(0, 1000))
def test_key_permutation_equivariance(case, seed):
    q, k, v, opts = case
    keys = k.shape[1]
    perm = np.random.default_rng(seed).permutation(keys)
    for name in ("causal", "window", "alibi_slopes"):  # position-dependent options
        opts.pop(name, None)
    permuted = {
        n: (
            np.broadcast_to(a, (q.shape[0], q.shape[1], keys))[..., perm]
            if n in ("mask", "bias", "dropout_mask")
            else a
        )
        for n, a in opts.items()
    }
    out_a, lse_a = _exact(q, k, v, **opts)
    out_b, lse_b = _exact(q, k[:, perm], v[:, perm], **permuted)
    assert_same_bits(out_b, out_a, what="out under key permutation")
    assert_same_bits(lse_b, lse_a, what="lse under key permutation")


@given(case=attention_cases())
def test_bool_mask_equals_neg_inf_bias(case):
    q, k, v, opts = case
    mask = opts.pop("mask", None)
    if mask is None:
        mask = np.random.default_rng(0).random((q.shape[0], q.shape[1], k.shape[1])) < 0.5
    bias = np.broadcast_to(opts.pop("bias", 0.0), mask.shape)
    out_a, lse_a = _exact(q, k, v, mask=mask, bias=bias, **opts)
    out_b, lse_b = _exact(q, k, v, bias=np.where(mask, bias, -np.inf), **opts)
    assert_same_bits(out_b, out_a, what="out")
    assert_same_bits(lse_b, lse_a, what="lse")


@given(case=attention_cases())
def test_gqa_equals_repeated_heads(case):
    q, k, v, opts = case
    heads, kv_heads = q.shape[0], k.shape[0]
    mode = opts.get("gqa", "interleave")
    index = (
        np.arange(heads) // (heads // kv_heads)
        if mode == "interleave"
        else np.arange(heads) % kv_heads
    )
    out_a, lse_a = _exact(q, k, v, **opts)
    out_b, lse_b = _exact(q, k[index], v[index], **opts)
    assert_same_bits(out_b, out_a, what=f"out, gqa={mode}")
    assert_same_bits(lse_b, lse_a, what=f"lse, gqa={mode}")


@given(case=attention_cases())
def test_alignments_agree_when_square(case):
    q, k, v, opts = case
    keys = k.shape[1]
    q = q[:, :keys] if q.shape[1] >= keys else q
    k, v = k[:, : q.shape[1]], v[:, : q.shape[1]]
    opts = {
        n: (a[..., : q.shape[1], : q.shape[1]] if n in ("mask", "bias", "dropout_mask") else a)
        for n, a in opts.items()
    }
    opts.pop("align", None)
    top, _ = _exact(q, k, v, align="top_left", **opts)
    bottom, _ = _exact(q, k, v, align="bottom_right", **opts)
    assert_same_bits(bottom, top, what="out, L == S")


@given(case=attention_cases())
def test_window_wider_than_keys_is_no_window(case):
    q, k, v, opts = case
    opts.pop("window", None)
    wide = q.shape[1] + k.shape[1]
    out_a, _ = _exact(q, k, v, **opts)
    out_b, _ = _exact(q, k, v, window=(wide, wide), **opts)
    out_c, _ = _exact(q, k, v, window=(None, None), **opts)
    assert_same_bits(out_b, out_a, what="window wider than S")
    assert_same_bits(out_c, out_a, what="window (None, None)")


@given(case=attention_cases(options=False))
def test_softcap_limit(case):
    """c tanh(t / c) -> t: with c = 2**60 the exact results round identically."""
    q, k, v, _ = case
    assert_same_bits(_exact(q, k, v, softcap=2.0**60)[0], _exact(q, k, v)[0], what="softcap")


@given(case=attention_cases(options=False), power=st.integers(-3, 3))
def test_scale_identity(case, power):
    """scale 2**p s with q equals scale s with 2**p q (both exact)."""
    q, k, v, _ = case
    s = 0.375
    a, _ = _exact(q, k, v, scale=s * 2.0**power)
    b, _ = _exact(q * 2.0**power, k, v, scale=s)
    assert_same_bits(a, b, what="scale identity")


@given(case=attention_cases(options=False))
def test_dropout_identities(case):
    q, k, v, _ = case
    keep_all = np.ones((q.shape[0], q.shape[1], k.shape[1]), dtype=bool)
    base, lse = _exact(q, k, v)
    half, lse_half = _exact(q, k, v, dropout_mask=keep_all, dropout_p=0.5)
    assert_same_bits(half, 2 * base, what="all-keep dropout at p = 1/2 doubles out")
    assert_same_bits(lse_half, lse, what="lse is pre-dropout")
    none_kept, _ = _exact(q, k, v, dropout_mask=~keep_all, dropout_p=0.25)
    assert_same_bits(none_kept, np.zeros_like(base), what="nothing kept")


# ----------------------------------------------------------------------------------------
# poison, empty rows, batching, return conventions
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["float64", "exact"])
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_poison_at_masked_positions_never_reaches_output(precision, poison):
    rng = np.random.default_rng(11)
    q, k, v = (
        rng.standard_normal((2, 3, 4)),
        rng.standard_normal((2, 5, 4)),
        rng.standard_normal((2, 5, 2)),
    )
    mask = np.ones((2, 3, 5), dtype=bool)
    mask[..., 2] = False
    bias = rng.standard_normal((2, 3, 5))
    clean = refattn.attention(q, k, v, mask=mask, bias=bias, precision=precision)
    k_p, v_p, bias_p = k.copy(), v.copy(), bias.copy()
    k_p[:, 2], v_p[:, 2], bias_p[..., 2] = poison, poison, poison
    dirty = refattn.attention(q, k_p, v_p, mask=mask, bias=bias_p, precision=precision)
    assert_same_bits(dirty, clean, what=f"poison {poison}")


@pytest.mark.parametrize("precision", ["float64", "exact"])
def test_nan_in_allowed_query_propagates_to_its_row(precision):
    q = np.zeros((3, 2))
    q[1, 0] = np.nan
    out = refattn.attention(q, np.ones((4, 2)), np.ones((4, 3)), precision=precision)
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_or_posinf_bias_at_allowed_position_is_an_error(value):
    bias = np.zeros((2, 3))
    bias[1, 2] = value
    with pytest.raises(ValueError, match=r"bias: .* allowed position .*row 1, key 2"):
        refattn.attention(np.zeros((2, 4)), np.zeros((3, 4)), np.zeros((3, 1)), bias=bias)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_broadcast_bias_is_checked_where_it_is_allowed(value):
    """A bias broadcast along rows (zero strides): a NaN/+inf key is an error where a row sees
    it (causal: the last key, from the last row on) and none where every row masks it."""
    q, k, v = np.zeros((3, 4)), np.zeros((3, 4)), np.zeros((3, 1))
    keys = np.zeros(3)
    keys[2] = value
    with pytest.raises(ValueError, match=r"bias: .* allowed position .*row 2, key 2"):
        refattn.attention(q, k, v, bias=keys, causal=True)
    mask = np.array([True, True, False])
    out = refattn.attention(q, k, v, bias=keys, mask=mask)
    assert np.isfinite(out).all()
    with pytest.raises(ValueError, match=r"bias: .* allowed position .*row 0, key 0"):
        refattn.attention(q, k, v, bias=np.float64(value))


@pytest.mark.parametrize("precision", ["float64", "exact"])
def test_empty_rows(precision):
    mask = np.array([[True, True], [False, False]])
    q, k, v = np.ones((2, 2)), np.ones((2, 2)), np.arange(4.0).reshape(2, 2)
    out, lse, w = refattn.attention(
        q, k, v, mask=mask, precision=precision, return_lse=True, return_weights=True
    )
    assert (out[1] == 0).all() and lse[1] == -np.inf and (w[1] == 0).all()
    assert not np.signbit(out[1]).any()
    out, lse, w = refattn.attention(
        q,
        k,
        v,
        mask=mask,
        precision=precision,
        return_lse=True,
        return_weights=True,
        empty_rows="nan",
    )
    assert np.isnan(out[1]).all() and np.isnan(lse[1]) and np.isnan(w[1]).all()
    assert np.isfinite(out[0]).all()


def test_leading_dims_broadcast():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 2, 4, 5))
    k = rng.standard_normal((1, 2, 6, 5))
    v = rng.standard_normal((2, 6, 3))
    out = refattn.attention(q, k, v, precision="exact")
    assert out.shape == (3, 2, 4, 3)
    for b in range(3):
        assert_same_bits(
            out[b], refattn.attention(q[b], k[0], v, precision="exact"), what=f"batch {b}"
        )


def test_return_order():
    q, k, v = np.ones((2, 2)), np.ones((3, 2)), np.ones((3, 1))
    assert isinstance(refattn.attention(q, k, v), np.ndarray)
    out, lse = refattn.attention(q, k, v, return_lse=True)
    assert lse.shape == (2,)
    out, w = refattn.attention(q, k, v, return_weights=True)
    assert w.shape == (2, 3)
    out, lse, w = refattn.attention(q, k, v, return_lse=True, return_weights=True)
    assert (out.shape, lse.shape, w.shape) == ((2, 1), (2,), (2, 3))


def test_exact_distance_to_float64_is_small():
    """The float64 path is within a few ulp on benign inputs (a sanity anchor for the bound)."""
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 8, 8)) for _ in range(3))
    dist = ulp_distance(
        refattn.attention(q, k, v), refattn.attention(q, k, v, precision="exact"), "float64"
    )
    assert np.isfinite(dist).all()


# ----------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------
_Q, _K, _V = np.zeros((2, 3, 4)), np.zeros((1, 5, 4)), np.zeros((1, 5, 6))
BAD = [
    (dict(q=np.zeros((2, 3, 4), dtype=np.int64)), TypeError, r"q: expected a float array.*int64"),
    (dict(q=np.zeros((2, 3, 4), dtype=np.complex128)), TypeError, r"q: .*complex128"),
    (dict(k=np.zeros((1, 5, 3))), ValueError, r"k: feature size 3 != q's 4"),
    (dict(v=np.zeros((1, 4, 6))), ValueError, r"v: expected \(\.\.\., 1, 5, E\)"),
    (
        dict(q=np.zeros((3, 3, 4)), k=np.zeros((2, 5, 4)), v=np.zeros((2, 5, 6))),
        ValueError,
        r"3 query heads is not a multiple of k's 2",
    ),
    (dict(q=np.zeros(4)), ValueError, r"q: expected shape"),
    (dict(window=(-1, 2)), ValueError, r"window: left size must be >= 0"),
    (dict(window=(1,)), ValueError, r"window: expected a pair"),
    (
        dict(dropout_p=1.0, dropout_mask=np.ones((2, 3, 5), bool)),
        ValueError,
        r"dropout_p: expected a value in \[0, 1\)",
    ),
    (dict(dropout_p=0.5), ValueError, r"dropout_mask: dropout is deterministic"),
    (dict(softcap=0.0), ValueError, r"softcap: expected a positive number"),
    (dict(softcap=-1.0), ValueError, r"softcap"),
    (dict(mask=np.ones((4, 5), bool)), ValueError, r"mask: shape \(4, 5\) is not broadcastable"),
    (dict(mask=np.ones((3, 5))), TypeError, r"mask: expected a boolean array"),
    (dict(bias=np.zeros((2, 2))), ValueError, r"bias: shape \(2, 2\) is not broadcastable"),
    (dict(align="center"), ValueError, r"align: expected one of"),
    (dict(gqa="repeat"), ValueError, r"gqa: expected one of"),
    (dict(empty_rows="skip"), ValueError, r"empty_rows: expected one of"),
    (dict(precision="float32"), ValueError, r"precision: expected one of"),
    (dict(alibi_slopes=np.ones(3)), ValueError, r"alibi_slopes: expected shape \(2,\)"),
    (dict(precision="exact", out_dtype="int32"), TypeError, r"out_dtype"),
    (dict(backend="cuda"), ValueError, r"backend: expected one of"),
]


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    BAD,
    ids=[m.split(":")[0] + str(i) for i, (_, _, m) in enumerate(BAD)],
)
def test_bad_input_is_named(changes, error, message):
    args = dict(q=_Q, k=_K, v=_V)
    args.update(changes)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=message):
        refattn.attention(q, k, v, **args)


@pytest.mark.parametrize("precision", ["float64", "exact"])
@pytest.mark.parametrize(
    "shapes",
    [
        ((0, 4), (3, 4), (3, 2)),
        ((2, 4), (0, 4), (0, 2)),
        ((2, 4), (3, 4), (3, 0)),
        ((2, 2, 3, 4), (2, 1, 0, 4), (2, 1, 0, 5)),
    ],
    ids=["L0", "S0", "E0", "batched-S0"],
)
def test_zero_sizes(shapes, precision):
    """Zero-size axes: S = 0 makes every row empty (out 0, lse -inf); the vjp has the
    arguments' shapes."""
    q, k, v = (np.zeros(s) for s in shapes)
    out, lse = refattn.attention(q, k, v, precision=precision, return_lse=True)
    assert out.shape == q.shape[:-1] + v.shape[-1:] and lse.shape == q.shape[:-1]
    if k.shape[-2] == 0:
        assert (out == 0).all() and (lse == -np.inf).all()
    grads = refattn.attention_vjp(q, k, v, np.zeros(out.shape), precision=precision)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
