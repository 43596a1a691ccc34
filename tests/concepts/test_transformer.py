"""Tests of refattn.transformer: exact path bit-for-bit against plain mpmath loops, float64 path
within its stated a-priori bound, properties from the lecture notes, bad input."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import ml_dtypes
import mpmath
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import refattn.transformer as T
from oracle.judging.tolerance import gamma, transformer_forward_bound
from refattn import bounds
from refattn.attention import attention
from tests.concepts.params import (
    random_attention_params,
    random_decoder_params,
    random_encoder_params,
)
from tests.helpers import assert_same_bits, assert_within
from tests.naive.transformer import (
    mp_array,
    naive_decoder,
    naive_encoder,
    naive_feed_forward,
    naive_layer_norm,
    naive_mha,
    naive_positions,
)
from tests.strategies import head_layouts, position_shifts

DTYPES = ["float64", "float32", "float16", "bfloat16"]
FORMAT = {
    "float64": (53, -1022),
    "float32": (24, -126),
    "float16": (11, -14),
    "bfloat16": (8, -126),
}
DPS = 60


# ----------------------------------------------------------------------------- helpers


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def round_mp(x, name) -> float:
    """Round an mpf to the format ``name`` (nearest, ties to even; subnormals included),
    written independently of refattn.exact.rounding."""
    if mpmath.isnan(x):
        return math.nan
    if x == 0:
        return 0.0
    p, emin = FORMAT[name]
    _, e = mpmath.frexp(x)  # x = m 2^e with 1/2 <= |m| < 1
    quantum = max(e - 1, emin) - (p - 1)
    return float(mpmath.ldexp(mpmath.nint(mpmath.ldexp(x, -quantum)), quantum))


def expected_bits(truth, name) -> np.ndarray:
    flat = [round_mp(v, name) for v in np.asarray(truth, dtype=object).ravel()]
    return np.array(flat, dtype=np.float64).reshape(np.shape(truth)).astype(_dtype(name))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


@pytest.fixture
def rows(rng):
    x = rng.standard_normal((4, 5)) * 3 + 1
    x[1] = 2.5  # a constant row: exact zero centred values
    x[2, 0] = 1e3  # a dominant entry
    return x


@pytest.fixture
def encoder_params():
    return random_encoder_params(4, 2, 6, seed=7)


@pytest.fixture
def mha_case(rng):
    """Cross attention with GQA (H=2, K=1), biases, x_q (3, 4), x_kv (5, 3)."""
    params = random_attention_params(4, 2, seed=11, num_kv_heads=1, kv_dim=3, head_dim=2)
    return rng.standard_normal((3, 4)), rng.standard_normal((5, 3)), params


def _mha_call(x_q, x_kv, p, function=T.multihead_attention, **kw):
    return function(
        x_q,
        x_kv,
        p.W_Q,
        p.W_K,
        p.W_V,
        p.W_O,
        b_Q=p.b_Q,
        b_K=p.b_K,
        b_V=p.b_V,
        b_O=p.b_O,
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        **kw,
    )


def _mha_bound(x_q, x_kv, p, **kw):
    bound = partial(transformer_forward_bound, T.multihead_attention)
    return _mha_call(x_q, x_kv, p, bound, **kw)


# ----------------------------------------------------------------------------- exact path


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_exact_correctly_rounded(rows, rng, dtype):
    norm = T.NormParams(gamma=rng.standard_normal(5), beta=rng.standard_normal(5), eps=1e-5)
    got = T.layer_norm(
        rows, gamma=norm.gamma, beta=norm.beta, eps=norm.eps, precision="exact", out_dtype=dtype
    )
    with mpmath.workdps(DPS):
        want = expected_bits(naive_layer_norm(mp_array(rows), norm), dtype)
    assert_same_bits(got, want, what=f"layer_norm exact, out_dtype={dtype}", check_dtype=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_exact_low_precision_inputs(rng, dtype):
    x = rng.standard_normal((3, 7)).astype(_dtype(dtype))
    got = T.layer_norm(x, eps=0.0, precision="exact", out_dtype=dtype)
    with mpmath.workdps(DPS):
        want = expected_bits(
            naive_layer_norm(mp_array(x.astype(np.float64)), T.NormParams(eps=0.0)), dtype
        )
    assert_same_bits(got, want, what=f"layer_norm exact of {dtype} inputs, eps=0", check_dtype=True)


@pytest.mark.parametrize("layout", ["interleave", "concat"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_positions_exact_correctly_rounded(dtype, layout):
    for length, dim, base in ((12, 6, 10000.0), (5, 4, 7.5)):
        got = T.sinusoidal_positions(length, dim, base, layout, precision="exact", out_dtype=dtype)
        with mpmath.workdps(DPS):
            want = expected_bits(naive_positions(length, dim, base, layout), dtype)
        assert_same_bits(
            got,
            want,
            what=f"sinusoidal_positions({length}, {dim}, {base}, {layout})",
            check_dtype=True,
        )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mha_exact_low_precision_inputs_and_large_gaps(rng, dtype):
    """float16/bfloat16 inputs and weights taken at their exact values; scores with logit
    gaps above 40 (x scaled by 8)."""
    p = random_attention_params(4, 2, seed=13, dtype=_dtype(dtype))
    x = (rng.standard_normal((3, 4)) * 8).astype(_dtype(dtype))
    got = _mha_call(x, None, p, precision="exact", out_dtype=dtype)
    wide = T.AttentionParams(
        *(
            None if a is None else np.asarray(a, dtype=np.float64)
            for a in (p.W_Q, p.W_K, p.W_V, p.W_O, p.b_Q, p.b_K, p.b_V, p.b_O)
        ),
        num_heads=2,
    )
    x64 = x.astype(np.float64)
    with mpmath.workdps(DPS):
        want = naive_mha(mp_array(x64), mp_array(x64), wide, np.ones((3, 3), dtype=bool))
    assert_same_bits(
        got, expected_bits(want, dtype), what=f"MHA of {dtype} inputs, large gaps", check_dtype=True
    )


def test_layer_norm_exact_extreme_magnitudes():
    """Rows near overflow and underflow: the exact path is still correctly rounded, and the
    float64 path (which rescales such rows by a power of two) stays inside its bound."""
    x = np.array([[1e300, -3e299, 7e299], [1e-300, 5e-301, -2e-300], [1e-320, 0.0, 3e-321]])
    got = T.layer_norm(x, eps=0.0, precision="exact")
    with mpmath.workdps(DPS):
        want = expected_bits(naive_layer_norm(mp_array(x), T.NormParams(eps=0.0)), "float64")
    assert_same_bits(got, want, what="layer_norm exact, extreme magnitudes", check_dtype=True)
    fast = T.layer_norm(x, eps=0.0)
    bound = transformer_forward_bound(T.layer_norm, x, eps=0.0)
    assert np.isfinite(bound).all()
    assert_within(fast, want, bound, what="layer_norm float64, extreme magnitudes", ulps=0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mha_exact_correctly_rounded(mha_case, dtype):
    x_q, x_kv, p = mha_case
    got = _mha_call(x_q, x_kv, p, precision="exact", out_dtype=dtype)
    with mpmath.workdps(DPS):
        want = naive_mha(mp_array(x_q), mp_array(x_kv), p, np.ones((3, 5), dtype=bool))
    assert_same_bits(
        got, expected_bits(want, dtype), what=f"cross MHA (H=2, K=1), {dtype}", check_dtype=True
    )


def test_mha_exact_causal_self(encoder_params, rng):
    x = rng.standard_normal((4, 4))
    got = _mha_call(x, None, encoder_params.attn, causal=True, precision="exact")
    with mpmath.workdps(DPS):
        want = naive_mha(
            mp_array(x), mp_array(x), encoder_params.attn, np.tril(np.ones((4, 4), dtype=bool))
        )
    assert_same_bits(got, expected_bits(want, "float64"), what="causal self MHA", check_dtype=True)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_feed_forward_exact_correctly_rounded(rng, activation, dtype):
    p = random_encoder_params(4, 2, 6, seed=3, activation=activation).ffn
    x = rng.standard_normal((3, 4))
    got = T.feed_forward(x, p.W1, p.b1, p.W2, p.b2, activation, precision="exact", out_dtype=dtype)
    with mpmath.workdps(DPS):
        want = expected_bits(naive_feed_forward(mp_array(x), p), dtype)
    assert_same_bits(got, want, what=f"feed_forward {activation}, {dtype}", check_dtype=True)


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_exact_correctly_rounded(rng, norm, activation):
    p = random_encoder_params(4, 2, 6, seed=5, activation=activation)
    x = rng.standard_normal((3, 4))
    got = T.encoder_block(x, p, norm=norm, precision="exact")
    with mpmath.workdps(DPS):
        want = expected_bits(naive_encoder(mp_array(x), p, norm), "float64")
    assert_same_bits(got, want, what=f"encoder_block norm={norm}, {activation}", check_dtype=True)


@pytest.mark.parametrize(
    "norm,dtype",
    [("post", "float64"), ("post", "float16"), ("pre", "float32"), ("pre", "bfloat16")],
)
def test_decoder_exact_correctly_rounded(rng, norm, dtype):
    p = random_decoder_params(4, 2, 6, seed=9, memory_dim=3, num_kv_heads=1)
    x, memory = rng.standard_normal((3, 4)), rng.standard_normal((2, 3))
    got = T.decoder_block(x, memory, p, norm=norm, precision="exact", out_dtype=dtype)
    with mpmath.workdps(DPS):
        want = expected_bits(naive_decoder(mp_array(x), mp_array(memory), p, norm), dtype)
    assert_same_bits(got, want, what=f"decoder_block {norm}, {dtype}", check_dtype=True)


def test_encoder_exact_larger_gqa(rng):
    """A larger block (L=6, M=8, H=4, K=2, F=16, batch of 2) against the mpmath loops."""
    p = random_encoder_params(8, 4, 16, seed=21, num_kv_heads=2, activation="gelu")
    x = rng.standard_normal((2, 6, 8))
    got = T.encoder_block(x, p, precision="exact")
    with mpmath.workdps(DPS):
        want = np.stack([naive_encoder(mp_array(x[b]), p, "post") for b in range(2)])
    assert_same_bits(
        got,
        expected_bits(want, "float64"),
        what="encoder L=6 M=8 H=4 K=2, batch 2",
        check_dtype=True,
    )


# ----------------------------------------------------------------------------- float64 vs exact


def _bounded(function, *args, case, **kwargs):
    got = function(*args, **kwargs)
    exact = function(*args, precision="exact", **kwargs)
    bound_of = _mha_bound if function is _mha_call else partial(transformer_forward_bound, function)
    assert_within(got, exact, bound_of(*args, **kwargs), what=case, ulps=0.5)


def test_bound_uses_the_tolerance_policy_gamma():
    """The transformer bound's gamma_n is the one of refattn.bounds, oracle.judging.tolerance's."""
    for n in (1, 7, 64, 4099):
        assert bounds.gamma(n) == gamma(n, "float64"), f"gamma_{n}: {bounds.gamma(n)} != {gamma(n)}"


def test_float64_layer_norm_within_bound(rows, rng):
    g, b = rng.standard_normal(5), rng.standard_normal(5)
    _bounded(T.layer_norm, rows, gamma=g, beta=b, case="layer_norm")
    _bounded(T.layer_norm, rows.T, axis=0, eps=1e-3, case="layer_norm axis=0")


def test_float64_positions_within_bound():
    for layout in ("interleave", "concat"):
        _bounded(T.sinusoidal_positions, 64, 8, case=f"positions {layout}", layout=layout)
    _bounded(T.sinusoidal_positions, 2048, 2, 3.0, case="positions long, base 3")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"causal": True},
        {"softcap": 1.5, "alibi_slopes": np.array([0.5, 0.125])},
        {"mask": np.array([[True, False, True, True, False]] * 3), "scale": 0.75},
        {"bias": np.array([[0.0, -np.inf, 1.0, 2.0, -0.5]]), "gqa": "tile"},
    ],
    ids=["plain", "causal", "softcap-alibi", "mask-scale", "bias-tile"],
)
def test_float64_mha_within_bound(mha_case, kwargs):
    x_q, x_kv, p = mha_case
    _bounded(_mha_call, x_q, x_kv, p, case=f"multihead_attention {kwargs}", **kwargs)


@given(head_layouts(), st.booleans(), st.sampled_from([0.5, 4.0]))
def test_float64_mha_within_bound_random_layouts(case, mqa, input_scale):
    heads, dim, seed = case
    rng = np.random.default_rng(seed)
    p = random_attention_params(3, heads, seed=seed, head_dim=dim, num_kv_heads=1 if mqa else heads)
    x_q, x_kv = rng.standard_normal((2, 3)) * input_scale, rng.standard_normal((4, 3))
    _bounded(_mha_call, x_q, x_kv, p, case=f"MHA H={heads} D={dim} mqa={mqa} seed={seed}")


def test_float64_blocks_within_bound(rng):
    x, memory = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4))
    for norm in ("post", "pre"):
        for activation in ("relu", "gelu"):
            enc = random_encoder_params(4, 2, 6, seed=1, activation=activation)
            dec = random_decoder_params(4, 2, 6, seed=2, activation=activation)
            _bounded(T.encoder_block, x, enc, norm=norm, case=f"encoder {norm} {activation}")
            _bounded(
                T.decoder_block, x, memory, dec, norm=norm, case=f"decoder {norm} {activation}"
            )
        ffn = random_encoder_params(4, 2, 6, seed=1, activation="gelu").ffn
        _bounded(T.feed_forward, x * 4, ffn.W1, ffn.b1, ffn.W2, ffn.b2, "gelu", case="ffn gelu")


# ----------------------------------------------------------------------------- properties


def test_layer_norm_moments(rows):
    """[L17]: "normalize values in each layer to have 0 mean and 1 variance": with eps=0 and
    no gain/shift the output rows have mean 0 and (biased) variance 1 up to the bound."""
    finite_rows = rows[[0, 2, 3]]
    y = T.layer_norm(finite_rows, eps=0.0)
    err = transformer_forward_bound(T.layer_norm, finite_rows, eps=0.0)
    width = y.shape[-1]
    mean_tol = err.mean(axis=-1) + gamma(width, "float64") * np.abs(y).mean(axis=-1)
    assert (np.abs(y.mean(axis=-1)) <= mean_tol).all(), (
        f"layer_norm mean: {y.mean(axis=-1)} exceeds {mean_tol}"
    )
    var_tol = 2 * (np.abs(y) * err).mean(axis=-1) + gamma(width + 2, "float64")
    var = (y * y).mean(axis=-1)
    assert (np.abs(var - 1) <= var_tol).all(), f"layer_norm variance: {var} vs 1 (tol {var_tol})"


@given(st.integers(-8, 8), st.floats(-4, 4, allow_nan=False), st.sampled_from(DTYPES))
def test_layer_norm_exact_affine_invariance(power, shift, dtype):
    """LN(2^k x + c) = LN(x) exactly (eps=0), so the exact path agrees bit for bit whenever
    the transformed inputs are exact floats."""
    x = np.array([[0.5, -1.25, 3.0, 2.0], [1.0, 1.0, 1.0, 1.5]])
    moved = np.ldexp(x, power) + shift
    if not np.array_equal((moved - shift) / 2.0**power, x):
        return  # the transformed input is not exact: nothing to compare
    a = T.layer_norm(x, eps=0.0, precision="exact", out_dtype=dtype)
    b = T.layer_norm(moved, eps=0.0, precision="exact", out_dtype=dtype)
    assert_same_bits(b, a, what=f"LN(2^{power} x + {shift}) vs LN(x), {dtype}", check_dtype=True)


def test_layer_norm_constant_and_nonfinite_rows():
    x = np.array([[2.0, 2.0, 2.0], [1.0, np.inf, 0.0], [1.0, np.nan, 0.0]])
    for precision in ("float64", "exact"):
        y = T.layer_norm(x, precision=precision)
        assert (y[0] == 0).all() and not np.signbit(y[0]).any(), f"{precision}: {y[0]}"
        assert np.isnan(y[1:]).all(), f"{precision}: non-finite rows should be NaN: {y[1:]}"
        z = T.layer_norm(x[:1], eps=0.0, precision=precision)
        assert np.isnan(z).all(), f"{precision}: constant row with eps=0 is 0/0, got {z}"


@given(position_shifts())
def test_positions_shift_is_rotation(case):
    """PE(pos + k) = R(k) PE(pos) per frequency: [sin, cos](a(p+k)) is the rotation by a*k of
    [sin, cos](a p), with the rotation read off the table row k (Vaswani's motivation)."""
    pos, shift, dim, base, layout = case
    table = T.sinusoidal_positions(pos + shift + 1, dim, base, layout, precision="exact")
    half = dim // 2
    sin_cols, cos_cols = (
        (slice(0, None, 2), slice(1, None, 2))
        if layout == "interleave"
        else (slice(0, half), slice(half, None))
    )
    s_p, c_p = table[pos, sin_cols], table[pos, cos_cols]
    s_k, c_k = table[shift, sin_cols], table[shift, cos_cols]
    rotated = np.stack([s_p * c_k + c_p * s_k, c_p * c_k - s_p * s_k])
    target = np.stack([table[pos + shift, sin_cols], table[pos + shift, cos_cols]])
    # each table entry is within u of the truth (|entry| <= 1); two products and a sum
    tol = gamma(8, "float64")
    err = np.abs(rotated - target)
    assert (err <= tol).all(), (
        f"rotation pos={pos} k={shift} dim={dim} base={base} {layout}: worst "
        f"{np.unravel_index(np.argmax(err), err.shape)} error {err.max():.3g} > {tol:.3g}"
    )


def test_positions_layouts_are_permutations():
    for precision in ("float64", "exact"):
        inter = T.sinusoidal_positions(6, 8, precision=precision)
        concat = T.sinusoidal_positions(6, 8, layout="concat", precision=precision)
        order = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
        assert np.array_equal(inter[:, order], concat), f"{precision}: concat != permuted"
    first = T.sinusoidal_positions(3, 4)
    assert first[0].tolist() == [0.0, 1.0, 0.0, 1.0], f"PE(0) = {first[0]}"


@pytest.mark.parametrize("precision", ["float64", "exact"])
def test_mha_one_head_identity_is_attention(rng, precision):
    """One head, identity projections, no biases: MHA == refattn.attention (bit for bit: the
    projections are exact, so both paths compute the same thing)."""
    x, memory = rng.standard_normal((3, 4)), rng.standard_normal((5, 4))
    eye = np.eye(4)
    mask = np.array([[True, False, True, True, False]] * 2 + [[False] * 5])  # row 2 empty
    bias = np.where(rng.random((3, 5)) < 0.3, -np.inf, rng.standard_normal((3, 5)))
    for kwargs in (
        {},
        {"causal": True, "align": "bottom_right"},
        {"softcap": 2.0},
        {"mask": mask, "bias": bias, "alibi_slopes": np.array([0.375])},
        {"window": (1, 0), "scale": 0.3, "empty_rows": "nan", "mask": mask},
        {"dropout_mask": rng.random((3, 5)) < 0.6, "dropout_p": 0.25},
    ):
        got = T.multihead_attention(
            x, memory, eye, eye, eye, eye, num_heads=1, precision=precision, **kwargs
        )
        want = attention(x, memory, memory, precision=precision, **kwargs)
        assert_same_bits(
            got, want, what=f"one-head identity MHA {kwargs}, {precision}", check_dtype=True
        )


@pytest.mark.parametrize("gqa", ["interleave", "tile"])
def test_mha_identity_heads_are_attention_heads(rng, gqa):
    """H=4, K=2 with identity-like projections: head h of MHA is refattn.attention on columns
    h*D:(h+1)*D (the documented head split), bit for bit on the exact path."""
    x, memory = rng.standard_normal((3, 8)), rng.standard_normal((4, 4))
    eye8, eye4 = np.eye(8), np.eye(4)
    got = T.multihead_attention(
        x,
        memory,
        eye8,
        eye4,
        eye4,
        np.eye(8)[:, :8],
        num_heads=4,
        num_kv_heads=2,
        gqa=gqa,
        precision="exact",
    )
    q = x.reshape(3, 4, 2).transpose(1, 0, 2)
    kv = memory.reshape(4, 2, 2).transpose(1, 0, 2)
    heads = attention(q, kv, kv, gqa=gqa, precision="exact")
    assert_same_bits(
        got, heads.transpose(1, 0, 2).reshape(3, 8), what=f"head split, gqa={gqa}", check_dtype=True
    )


def test_mha_masked_poison_never_reaches_output(mha_case):
    """NaN/Inf in masked rows of x_kv (float64 path): the output equals attention over the
    remaining rows (conventions: excluded positions are removed from every sum)."""
    x_q, x_kv, p = mha_case
    poisoned = x_kv.copy()
    poisoned[1] = np.nan
    poisoned[3, 0] = np.inf
    keep = np.array([True, False, True, False, True])
    got = _mha_call(x_q, poisoned, p, mask=keep)
    clean = x_kv[keep]
    exact = _mha_call(x_q, clean, p, precision="exact")
    bound = _mha_bound(x_q, clean, p)
    assert_within(got, exact, bound, what="MHA with NaN/Inf in masked memory rows", ulps=0.5)


def test_mha_gqa_equals_repeated_kv_heads(mha_case):
    """GQA (K=1) == full multi-head with the kv projection columns repeated (exact path: the
    same real function, so the same bits)."""
    x_q, x_kv, p = mha_case
    full = replace(
        p,
        W_K=np.tile(p.W_K, 2),
        W_V=np.tile(p.W_V, 2),
        b_K=np.tile(p.b_K, 2),
        b_V=np.tile(p.b_V, 2),
        num_kv_heads=2,
    )
    a = _mha_call(x_q, x_kv, p, precision="exact")
    b = _mha_call(x_q, x_kv, full, precision="exact")
    assert_same_bits(a, b, what="GQA K=1 vs repeated kv heads", check_dtype=True)


@given(head_layouts())
def test_mha_head_permutation_and_key_permutation(case):
    """Permuting heads (column blocks of W_Q/W_K/W_V, row blocks of W_O) or the key/value rows
    of x_kv leaves the exact output unchanged, bit for bit."""
    heads, dim, seed = case
    rng = np.random.default_rng(seed)
    p = random_attention_params(3, heads, seed=seed, head_dim=dim)
    x_q, x_kv = rng.standard_normal((2, 3)), rng.standard_normal((3, 3))
    perm = rng.permutation(heads)
    cols = np.concatenate([np.arange(h * dim, (h + 1) * dim) for h in perm])
    permuted = replace(
        p,
        W_Q=p.W_Q[:, cols],
        W_K=p.W_K[:, cols],
        W_V=p.W_V[:, cols],
        W_O=p.W_O[cols],
        b_Q=p.b_Q[cols],
        b_K=p.b_K[cols],
        b_V=p.b_V[cols],
    )
    base = _mha_call(x_q, x_kv, p, precision="exact")
    assert_same_bits(
        _mha_call(x_q, x_kv, permuted, precision="exact"),
        base,
        what=f"head permutation {perm.tolist()}",
        check_dtype=True,
    )
    keys = rng.permutation(3)
    assert_same_bits(
        _mha_call(x_q, x_kv[keys], p, precision="exact"),
        base,
        what=f"key permutation {keys.tolist()}",
        check_dtype=True,
    )


def test_mha_batch_and_broadcast(rng, encoder_params):
    p = encoder_params.attn
    x = rng.standard_normal((2, 3, 4))
    batched = _mha_call(x, None, p)
    for b in range(2):
        single = _mha_call(x[b], None, p)
        assert_within(
            batched[b], single, _mha_bound(x[b], None, p), what=f"batch element {b}", ulps=0.5
        )
    shared = _mha_call(x, x[0], p, precision="exact")
    assert_same_bits(
        shared[0],
        _mha_call(x[0], None, p, precision="exact"),
        what="x_kv broadcast over the batch",
        check_dtype=True,
    )


def test_encoder_with_zero_sublayers_is_layer_norm(rng, encoder_params):
    """W_O = 0 and W_2 = 0 (zero biases): post-LN gives LN2(LN1(x)) = LN2(x) for eps = 0 and
    no affine in LN1 (LN is invariant under x -> a x + c); pre-LN gives x itself."""
    x = rng.standard_normal((3, 4))
    p = encoder_params
    zero = replace(
        p,
        attn=replace(p.attn, W_O=np.zeros_like(p.attn.W_O), b_O=None),
        ffn=replace(p.ffn, W2=np.zeros_like(p.ffn.W2), b2=None),
        norm1=T.NormParams(eps=0.0),
        norm2=replace(p.norm2, eps=0.0),
    )
    got = T.encoder_block(x, zero, precision="exact")
    want = T.layer_norm(x, gamma=p.norm2.gamma, beta=p.norm2.beta, eps=0.0, precision="exact")
    assert_same_bits(got, want, what="post-LN encoder with zero sublayers", check_dtype=True)
    pre = T.encoder_block(x, zero, norm="pre", precision="exact")
    assert_same_bits(pre, x, what="pre-LN encoder with zero sublayers", check_dtype=True)
    f64 = T.encoder_block(x, zero)
    assert_within(
        f64,
        want,
        transformer_forward_bound(T.encoder_block, x, zero),
        what="post-LN zero sublayers, float64",
        ulps=0.5,
    )


def test_encoder_zero_ffn_matches_attention_sublayer(rng, encoder_params):
    """Zero FFN weights: the block is LN2(h + b2) with h = LN1(x + MHA(x)); with b2 = 0,
    eps2 = 0 and no affine on either norm, LN2(h) = h."""
    x = rng.standard_normal((3, 4))
    p = replace(
        encoder_params,
        ffn=replace(encoder_params.ffn, W2=np.zeros((6, 4)), b2=None),
        norm1=T.NormParams(eps=0.0),
        norm2=T.NormParams(eps=0.0),
    )
    a = p.attn
    got = T.encoder_block(x, p, precision="exact")
    with mpmath.workdps(DPS):
        h = naive_layer_norm(
            mp_array(x) + naive_mha(mp_array(x), mp_array(x), a, np.ones((3, 3), dtype=bool)),
            p.norm1,
        )
    assert_same_bits(
        got,
        expected_bits(h, "float64"),
        what="zero-FFN encoder == LN1(x + MHA x)",
        check_dtype=True,
    )


def test_encoder_empty_rows_nan(rng, encoder_params):
    """empty_rows="nan": a query row with no allowed key is NaN in the block output on both
    paths (the exact path poisons it after the interval chain); other rows stay finite."""
    x = rng.standard_normal((3, 4))
    mask = np.array([[True, True, False], [False, False, False], [True, False, True]])
    for precision in ("float64", "exact"):
        out = T.encoder_block(x, encoder_params, mask=mask, empty_rows="nan", precision=precision)
        assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all(), (
            f"{precision}: NaN pattern {np.isnan(out).astype(int).tolist()}"
        )


def test_decoder_is_causal(rng):
    """Row i of the decoder output does not depend on x rows after i (masked self-attention)."""
    p = random_decoder_params(4, 2, 6, seed=4)
    x, memory = rng.standard_normal((4, 4)), rng.standard_normal((3, 4))
    changed = x.copy()
    changed[2:] = rng.standard_normal((2, 4))
    a = T.decoder_block(x, memory, p, precision="exact")
    b = T.decoder_block(changed, memory, p, precision="exact")
    assert_same_bits(
        a[:2], b[:2], what="decoder rows 0-1 after changing rows 2-3", check_dtype=True
    )
    assert not np.array_equal(a[2:], b[2:]), "decoder rows 2-3 should change"


def test_decoder_memory_mask_empty_row(rng):
    """A query row with no allowed memory key gets zero cross-attention (empty_rows="zero"),
    so the cross sublayer contributes only b_O."""
    p = random_decoder_params(4, 2, 6, seed=6)
    x, memory = rng.standard_normal((2, 4)), rng.standard_normal((3, 4))
    mask = np.array([[False] * 3, [True] * 3])
    got = T.decoder_block(x, memory, p, memory_mask=mask, precision="exact")
    other = T.decoder_block(x, memory * 7, p, memory_mask=mask, precision="exact")
    assert_same_bits(
        got[0], other[0], what="row 0 ignores the (fully masked) memory", check_dtype=True
    )


# ----------------------------------------------------------------------------- bad input


def _eye(n, m=None):
    return np.eye(n, m)


BAD_MHA = [
    ({"x_q": np.ones((3, 4), dtype=np.int64)}, TypeError, "x_q"),
    ({"x_q": np.ones(4)}, ValueError, "x_q"),
    ({"W_Q": _eye(3, 4)}, ValueError, "W_Q"),
    ({"W_Q": _eye(4, 6), "num_heads": 4}, ValueError, "W_Q"),
    ({"W_K": _eye(4, 2)}, ValueError, "W_K"),
    ({"W_O": _eye(3, 4)}, ValueError, "W_O"),
    ({"b_Q": np.ones(3)}, ValueError, "b_Q"),
    ({"num_heads": 0}, ValueError, "num_heads"),
    ({"num_kv_heads": 3, "num_heads": 2}, ValueError, "num_heads"),
    ({"return_weights": True}, TypeError, "return_weights"),
    ({"gqa": "spread"}, ValueError, "gqa"),
    ({"mask": np.ones((5, 5), dtype=bool)}, ValueError, "mask"),
    ({"precision": "half"}, ValueError, "precision"),
    ({"precision": "exact", "out_dtype": "int8"}, TypeError, "out_dtype"),
    ({"precision": "exact", "x_q": np.full((3, 4), np.nan)}, ValueError, "x_q"),
    ({"precision": "exact", "W_V": np.full((4, 4), np.inf)}, ValueError, "W_V"),
]


@pytest.mark.parametrize(
    "change,error,name", BAD_MHA, ids=[c[2] + str(i) for i, c in enumerate(BAD_MHA)]
)
def test_mha_bad_input(change, error, name):
    args = {
        "x_q": np.ones((3, 4)),
        "x_kv": None,
        "W_Q": _eye(4),
        "W_K": _eye(4),
        "W_V": _eye(4),
        "W_O": _eye(4),
        "num_heads": 2,
    }
    args.update(change)
    with pytest.raises(error, match=name):
        T.multihead_attention(
            args.pop("x_q"),
            args.pop("x_kv"),
            args.pop("W_Q"),
            args.pop("W_K"),
            args.pop("W_V"),
            args.pop("W_O"),
            **args,
        )


@pytest.mark.parametrize(
    "call,error,name",
    [
        (lambda: T.layer_norm(np.ones((2, 3)), eps=-1.0), ValueError, "eps"),
        (lambda: T.layer_norm(np.ones((2, 3)), axis=2), ValueError, "axis"),
        (lambda: T.layer_norm(np.ones((2, 3)), gamma=np.ones(2)), ValueError, "gamma"),
        (lambda: T.layer_norm(np.ones(3, dtype=complex)), TypeError, "x"),
        (
            lambda: T.layer_norm(np.ones(3), precision="exact", beta=np.array([1, np.nan, 1.0])),
            ValueError,
            "beta",
        ),
        (lambda: T.sinusoidal_positions(4, 5), ValueError, "dim"),
        (lambda: T.sinusoidal_positions(-1, 4), ValueError, "length"),
        (lambda: T.sinusoidal_positions(4, 4, base=0.0), ValueError, "base"),
        (lambda: T.sinusoidal_positions(4, 4, layout="split"), ValueError, "layout"),
        (
            lambda: T.feed_forward(np.ones((2, 3)), _eye(3), None, _eye(3), None, "swish"),
            ValueError,
            "activation",
        ),
        (lambda: T.feed_forward(np.ones((2, 3)), _eye(3), None, _eye(4), None), ValueError, "W2"),
        (
            lambda: T.encoder_block(
                np.ones((2, 4)), random_encoder_params(4, 2, 6, seed=0), norm="sandwich"
            ),
            ValueError,
            "norm",
        ),
        (lambda: T.encoder_block(np.ones((2, 4)), {"attn": None}), TypeError, "params"),
        (
            lambda: T.encoder_block(np.ones((2, 3)), random_encoder_params(4, 2, 6, seed=0)),
            ValueError,
            "W_Q",
        ),
        (
            lambda: T.encoder_block(
                np.ones((2, 4)),
                random_encoder_params(4, 2, 6, seed=0),
                mask=np.ones((3, 3), dtype=bool),
            ),
            ValueError,
            "mask",
        ),
        (
            lambda: T.decoder_block(
                np.ones((2, 4)), np.ones((3, 5)), random_decoder_params(4, 2, 6, seed=0)
            ),
            ValueError,
            "W_K",
        ),
        (
            lambda: transformer_forward_bound(T.layer_norm, np.ones(3), precision="exact"),
            ValueError,
            "precision",
        ),
    ],
    ids=lambda c: c if isinstance(c, str) else "",
)
def test_bad_input(call, error, name):
    with pytest.raises(error, match=name):
        call()
