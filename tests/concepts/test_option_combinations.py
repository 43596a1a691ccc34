"""Sinks and per-row key lengths together with ALiBi, a bias and float8 inputs, on every path:
exact bit for bit against the loop twin (out, lse and weights; the gradients, dsinks included,
against the loop twin's weights in closed form), float64 inside :mod:`refattn.bounds`, Numba
inside the kernel bound."""

from __future__ import annotations

import ml_dtypes
import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn.bounds import float64_forward_bound, float64_vjp_bound, gamma, grad_scales
from refattn.spec import canonicalize, fold
from tests.helpers import assert_same_bits as assert_exact
from tests.helpers import assert_within
from tests.naive.attention import naive_attention, naive_attention_rounded, score_spread
from tests.naive.rounding import round_stable

DTYPES = ["float64", "float32", "float16", "bfloat16"]
BATCH, HEADS, KV_HEADS, LENGTH, KEYS, DIM, VDIM = 2, 2, 1, 3, 6, 4, 3

#: options drawn with ALiBi (and with the bias of the gradient tests)
OPTION_SETS = [
    {},
    {"causal": True, "align": "bottom_right"},
    {"causal": True},
    {"window": (2, 0), "align": "bottom_right"},
    {"softcap": 2.0, "align": "bottom_right"},
    {"scale": 0.75, "causal": True, "align": "bottom_right"},
    {"dropout_p": 0.25, "causal": True, "align": "bottom_right"},  # a keep-mask is drawn
]
#: forward only: rows left without keys are NaN (the vjp gives them zero gradients)
FORWARD_SETS = OPTION_SETS + [{"empty_rows": "nan", "causal": True, "align": "bottom_right"}]


def _inputs(seed, heads=HEADS, kv_heads=KV_HEADS):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, heads, LENGTH, DIM))
    k = rng.standard_normal((BATCH, kv_heads, KEYS, DIM))
    v = rng.standard_normal((BATCH, kv_heads, KEYS, VDIM))
    return q, k, v, rng


def _fp8(q, k, v, rng, name):
    """(fp8 inputs with float32 descale factors, the same values dequantised in float64)."""
    fp8 = getattr(ml_dtypes, name)
    raw = [x.astype(fp8) for x in (q, k, v)]
    descale = [rng.uniform(0.5, 2, size=(BATCH, KV_HEADS)).astype(np.float32) for _ in "qkv"]
    values = [
        x.astype(np.float64) * d.astype(np.float64)[..., None, None]
        for x, d in zip(raw, descale, strict=True)
    ]
    kwargs = dict(zip(("q_descale", "k_descale", "v_descale"), descale, strict=True))
    return raw, kwargs, values


def _new_options(rng, new, options):
    """sinks and/or kv_lengths (the options under test), ALiBi slopes with full significands
    (their products with the distances are not float64 numbers), a keep-mask with dropout."""
    extra = {"alibi_slopes": rng.uniform(0.05, 1.5, size=HEADS)}
    if "dropout_p" in options:
        extra["dropout_mask"] = rng.random((BATCH, HEADS, LENGTH, KEYS)) < 0.75
    if new in ("sinks", "both"):
        extra["sinks"] = rng.standard_normal(HEADS) * 3
    if new in ("kv_lengths", "both"):
        extra["kv_lengths"] = rng.integers(0, KEYS + 1, size=BATCH)
    return extra


def _row_options(opts, b):
    """The loop twin's options of batch row b (its own key length, its planes)."""
    row = {name: value for name, value in opts.items() if name != "kv_lengths"}
    if "kv_lengths" in opts:
        row["kv_length"] = int(opts["kv_lengths"][b])
    for name in ("bias", "mask", "dropout_mask"):
        if name in row:
            row[name] = np.broadcast_to(row[name], (BATCH, HEADS, LENGTH, KEYS))[b]
    return row


FORWARD_CASES = dict(
    seed=st.integers(0, 2**16),
    options=st.sampled_from(FORWARD_SETS),
    dtype=st.sampled_from(DTYPES),
    new=st.sampled_from(["sinks", "kv_lengths", "both"]),
    fp8=st.sampled_from([None, "float8_e4m3fn", "float8_e5m2"]),
)


@settings(max_examples=4, deadline=None)
@given(**FORWARD_CASES)
def test_exact_alibi_with_sinks_or_lengths_matches_loop_twin(seed, options, dtype, new, fp8):
    """ALiBi with sinks and/or per-row key lengths (and float8 inputs): out, lse and
    weights bit for bit (ALiBi's ``-m |i + o_b - j|`` exact, o_b from each row's own length
    under bottom_right, no ALiBi term on the sink)."""
    _check_forward(seed, options, dtype, new, fp8)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(**FORWARD_CASES)
def test_exact_alibi_with_sinks_or_lengths_matches_loop_twin_more(seed, options, dtype, new, fp8):
    _check_forward(seed, options, dtype, new, fp8)


def _check_forward(seed, options, dtype, new, fp8):
    q, k, v, rng = _inputs(seed)
    extra = _new_options(rng, new, options)
    args, descale = (q, k, v), {}
    if fp8 is not None:
        args, descale, (q, k, v) = _fp8(q, k, v, rng, fp8)
        dtype = "float32" if dtype == "float64" else dtype  # fp8 results: 16/32-bit dtypes
    opts = {**options, **extra}
    got = refattn.attention(
        *args,
        **opts,
        **descale,
        return_lse=True,
        return_weights=True,
        precision="exact",
        out_dtype=dtype,
    )
    want = [
        np.stack(x)
        for x in zip(
            *(
                naive_attention_rounded(q[b], k[b], v[b], _row_options(opts, b), dtype)
                for b in range(BATCH)
            ),
            strict=True,
        )
    ]
    case = f"{options} {sorted(extra)} fp8={fp8} {dtype}"
    for name, value, truth in zip(("out", "lse", "weights"), got, want, strict=True):
        assert_exact(value, truth, what=name, case=case)


def _dot(x, y):
    """x . y of two float64 vectors at their exact values, at the current precision."""
    return mpmath.fsum(
        mpmath.mpf(float(a)) * mpmath.mpf(float(b)) for a, b in zip(x, y, strict=True)
    )


def _twin_grads(q, k, v, grad_out, grad_lse, opts, bias_shape, dps):
    """(dq, dk, dv, dbias, dsinks) as one flat list of mpf at ``dps`` digits, from the loop
    twin's weights in closed form (:func:`refattn.attention_vjp`'s docstring):
    ``dP_ij = kappa_ij/(1-p) dO_i.v_j``, ``Delta_i = sum_j w_ij dP_ij``,
    ``dS_ij = w_ij (dP_ij - Delta_i + g_i)``, ``dT = dS (1 - tanh^2(r_ij/c))`` (r the scaled
    score before the softcap), ``dq = s dT K``, ``dk = s dT^T Q`` (summed over a kv group),
    ``dv = P'^T dO``, ``dbias = dS`` summed over bias's broadcast dimensions and
    ``dsinks_h = sum_{b,i} w_sink (g_i - Delta_i)`` with ``w_sink = exp(sink_h - lse_i)``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    mp = mpmath.mpf
    with mpmath.workdps(dps):
        scale = 1 / mpmath.sqrt(DIM) if "scale" not in opts else mp(opts["scale"])
        keep = 1 / (1 - mp(opts.get("dropout_p", 0.0)))
        dq = np.full(q.shape, mp(0), dtype=object)
        dk = np.full(k.shape, mp(0), dtype=object)
        dv = np.full(v.shape, mp(0), dtype=object)
        ds = np.full((BATCH, heads, LENGTH, KEYS), mp(0), dtype=object)
        dsinks = [mp(0)] * heads
        for b in range(BATCH):
            row = _row_options(opts, b)
            _, lse, w = naive_attention(q[b], k[b], v[b], dps=dps, **row)
            for h in range(heads):
                g = h // group
                for i in range(LENGTH):
                    gi = mp(0) if grad_lse is None else mp(float(grad_lse[b, h, i]))
                    kept = [
                        row.get("dropout_mask") is None or row["dropout_mask"][h][i][j]
                        for j in range(KEYS)
                    ]
                    dp = [
                        keep * _dot(grad_out[b, h, i], v[b, g, j]) if kept[j] else mp(0)
                        for j in range(KEYS)
                    ]
                    delta = mpmath.fsum(w[h][i][j] * dp[j] for j in range(KEYS))
                    if "sinks" in opts:
                        w_sink = mpmath.exp(mp(float(opts["sinks"][h])) - lse[h][i])
                        dsinks[h] += w_sink * (gi - delta)
                    for j in range(KEYS):
                        ds[b, h, i, j] = w[h][i][j] * (dp[j] - delta + gi)
                        dt = ds[b, h, i, j]
                        if "softcap" in opts:
                            cap = mp(opts["softcap"])
                            raw = scale * _dot(q[b, h, i], k[b, g, j])
                            dt = dt * (1 - mpmath.tanh(raw / cap) ** 2)
                        for d in range(DIM):
                            dq[b, h, i, d] += scale * dt * mp(float(k[b, g, j, d]))
                            dk[b, g, j, d] += scale * dt * mp(float(q[b, h, i, d]))
                        if kept[j]:
                            for e in range(VDIM):
                                dv[b, g, j, e] += (
                                    keep * w[h][i][j] * mp(float(grad_out[b, h, i, e]))
                                )
        parts = [dq.ravel(), dk.ravel(), dv.ravel()]
        if bias_shape is not None:
            lead = ds.ndim - len(bias_shape)
            axes = tuple(range(lead)) + tuple(lead + a for a, n in enumerate(bias_shape) if n == 1)
            parts.append(ds.sum(axis=axes, keepdims=True).reshape(bias_shape).ravel())
        if "sinks" in opts:
            parts.append(np.array(dsinks, dtype=object))
        return list(np.concatenate(parts))


BIAS_SHAPES = [(BATCH, HEADS, LENGTH, KEYS), (HEADS, LENGTH, KEYS), (1, 1, LENGTH, KEYS)]


VJP_CASES = dict(
    seed=st.integers(0, 2**16),
    options=st.sampled_from(OPTION_SETS),
    dtype=st.sampled_from(DTYPES),
    new=st.sampled_from(["sinks", "kv_lengths", "both"]),
    bias_shape=st.sampled_from([None] + BIAS_SHAPES),
    alibi=st.booleans(),
    fp8=st.sampled_from([None, None, "float8_e4m3fn", "float8_e5m2"]),
)


@settings(max_examples=3, deadline=None)
@given(**VJP_CASES)
def test_exact_vjp_matches_twin(seed, options, dtype, new, bias_shape, alibi, fp8):
    """dq, dk, dv, dbias and dsinks bit for bit, with sinks and a bias of each shape (dsinks
    and dbias are each one rounding of their sums), ALiBi, per-row key lengths and float8
    inputs (gradients with respect to their dequantised values)."""
    _check_vjp(seed, options, dtype, new, bias_shape, alibi, fp8)


def test_exact_dsinks_with_a_broadcast_bias_and_alibi():
    """The combination refused before: dsinks with a bias (broadcast over batch), ALiBi and
    per-row key lengths, bottom_right causal, float64."""
    _check_vjp(5, OPTION_SETS[1], "float64", "both", BIAS_SHAPES[1], True, None)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(**VJP_CASES)
def test_exact_vjp_matches_twin_more(seed, options, dtype, new, bias_shape, alibi, fp8):
    _check_vjp(seed, options, dtype, new, bias_shape, alibi, fp8)


def _check_vjp(seed, options, dtype, new, bias_shape, alibi, fp8):
    q, k, v, rng = _inputs(seed)
    args, descale = (q, k, v), {}
    if fp8 is not None:
        args, descale, (q, k, v) = _fp8(q, k, v, rng, fp8)
    opts = {**options, **_new_options(rng, new, options)}
    if not alibi:
        del opts["alibi_slopes"]
    if bias_shape is not None:
        opts["bias"] = rng.standard_normal(bias_shape)
    grad_out = rng.standard_normal((BATCH, HEADS, LENGTH, VDIM))
    grad_lse = rng.standard_normal((BATCH, HEADS, LENGTH))
    got = refattn.attention_vjp(
        *args, grad_out, grad_lse=grad_lse, **opts, **descale, precision="exact", out_dtype=dtype
    )
    spread = score_spread(q, k, **opts)
    want = round_stable(
        lambda dps: _twin_grads(q, k, v, grad_out, grad_lse, opts, bias_shape, dps), dtype, spread
    )
    names = (
        ["dq", "dk", "dv"]
        + (["dbias"] if bias_shape else [])
        + (["dsinks"] if "sinks" in opts else [])
    )
    at = 0
    for name in names:
        value = np.asarray(getattr(got, name), np.float64)
        assert_exact(
            value,
            want[at : at + value.size].reshape(value.shape),
            what=name,
            case=f"{options} {sorted(opts)} bias {bias_shape} fp8={fp8} {dtype}",
        )
        at += value.size
    assert at == want.size


@pytest.mark.parametrize("new", ["sinks", "kv_lengths", "both"])
@pytest.mark.parametrize("options", OPTION_SETS[:4], ids=str)
def test_float64_inside_its_bound(options, new):
    q, k, v, rng = _inputs(21)
    opts = {
        **options,
        **_new_options(rng, new, options),
        "bias": rng.standard_normal((BATCH, HEADS, LENGTH, KEYS)),
    }
    got_out, got_lse = refattn.attention(q, k, v, **opts, return_lse=True)
    out, lse = refattn.attention(q, k, v, **opts, return_lse=True, precision="exact")
    out_bound, lse_bound = float64_forward_bound(q, k, v, **opts)
    assert_within(got_out, out, out_bound, what="out", case=f"{options} {new}")
    assert_within(got_lse, lse, lse_bound, what="lse", case=f"{options} {new}")
    grad_out, grad_lse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    got = refattn.attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, **opts)
    exact = refattn.attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, **opts, precision="exact")
    bounds = float64_vjp_bound(q, k, v, grad_out, grad_lse=grad_lse, **opts)
    names = ("dq", "dk", "dv", "dbias") + (("dsinks",) if "sinks" in opts else ())
    for name, bound in zip(names, bounds, strict=True):
        assert_within(
            getattr(got, name), getattr(exact, name), bound, what=name, case=f"{options} {new}"
        )


@pytest.mark.parametrize("options", OPTION_SETS[:4], ids=str)
def test_numba_inside_the_kernel_bound(options):
    """The kernels' forward and backward (dsinks: the sink column's dbias bound summed over
    batch and rows, plus the float64 sum of those B L terms)."""
    from refattn.kernels import numba_cpu

    q, k, v, rng = _inputs(23)
    opts = {
        **options,
        **_new_options(rng, "both", options),
        "bias": rng.standard_normal((BATCH, HEADS, LENGTH, KEYS)),
    }
    got_out, got_lse = refattn.attention(q, k, v, **opts, return_lse=True, backend="numba")
    out, lse, weights = refattn.attention(
        q, k, v, **opts, return_lse=True, return_weights=True, precision="exact"
    )
    spec = fold(canonicalize(q, k, v, **opts), alibi_into_bias=True)
    full = np.concatenate([weights, np.exp(opts["sinks"][None, :, None] - lse)[..., None]], axis=-1)
    out_bound, lse_bound = numba_cpu.forward_error_bound(spec, full, np.float64)
    assert_within(got_out, out, out_bound, what="out", case=str(options))
    assert_within(got_lse, lse, lse_bound, what="lse", case=str(options))
    grad_out, grad_lse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    got = refattn.attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, **opts, backend="numba")
    exact = refattn.attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, **opts, precision="exact")
    bounds = numba_cpu.backward_error_bound(spec, full, grad_out, grad_lse, np.float64)
    for name, bound in zip(("dq", "dk", "dv"), bounds[:3], strict=True):
        keys = bound[..., :KEYS, :] if name != "dq" else bound
        assert_within(getattr(got, name), getattr(exact, name), keys, what=name, case=str(options))
    assert_within(got.dbias, exact.dbias, bounds[3][..., :KEYS], what="dbias", case=str(options))
    column = bounds[3][..., KEYS].sum(axis=(0, 2))  # the sink column's terms, summed
    magnitude = grad_scales(
        q, k, v, grad_out, weights, weights, grad_lse=grad_lse, sink_weights=full[..., KEYS]
    )["dsinks"]
    dsinks_bound = column + gamma(BATCH * LENGTH) * (magnitude + column)
    assert_within(got.dsinks, exact.dsinks, dsinks_bound, what="dsinks", case=str(options))


@pytest.mark.parametrize("alibi", [False, True])
def test_referee_units_keep_each_rows_key_length(alibi):
    """The undecided (batch, kv head) units of the fast vjp go to the referee one at a time,
    each with its own row's key length and ALiBi offset: every unit recomputed that way gives
    the whole-call referee's bits."""
    from refattn.exact import attention_vjp as exact_vjp_module

    q, k, v, rng = _inputs(29)
    opts = {"kv_lengths": np.array([KEYS, 2]), "causal": True, "align": "bottom_right"}
    if alibi:
        opts["alibi_slopes"] = rng.uniform(0.05, 1.5, size=HEADS)
    spec = canonicalize(q, k, v, **opts)
    grad_out = rng.standard_normal((BATCH, HEADS, LENGTH, VDIM))
    names = ("dq", "dk", "dv")
    whole = exact_vjp_module._referee_vjp(spec, grad_out, None, np.dtype("float64"), names)
    units = {name: np.zeros_like(whole[name]) for name in names}
    todo = {name: np.ones(whole[name].shape, dtype=bool) for name in names}
    exact_vjp_module._referee_units(spec, grad_out, None, np.dtype("float64"), units, todo)
    for name in names:
        assert_exact(units[name], whole[name], what=name, case=f"units, alibi={alibi}")
