"""Vector-Jacobian products of refattn.transformer: layer norm, feed-forward, multi-head
attention, encoder and decoder blocks.

References: mpmath central differences with a Richardson step on the loop twins of
tests/naive/transformer.py (no refattn code) for the exact path (correctly rounded gradients),
and torch autograd of an independent float64 implementation of the lecture notes' pieces.
The float64 gradients of layer norm, feed-forward and multi-head attention are checked against
the first-order bounds of refattn.bounds (``layer_norm_vjp_bound``, ``feed_forward_vjp_bound``,
``multihead_attention_vjp_bound``); the blocks have no such bound yet (see docs/variants.md) and are
compared with the exact path at a
first-order estimate, ``gamma(n)`` times the gradients' largest magnitude, ``n`` the number of
differentiated scalars (every rounding of the reverse pass is one of at most that many terms
of a contraction).
"""

from __future__ import annotations

from dataclasses import fields, replace

import mpmath
import numpy as np
import pytest

import refattn.transformer as T
from refattn.bounds import (
    feed_forward_vjp_bound,
    gamma,
    layer_norm_vjp_bound,
    multihead_attention_vjp_bound,
)
from tests.concepts.params import (
    random_attention_params,
    random_decoder_params,
    random_encoder_params,
)
from tests.helpers import assert_same_bits, assert_within
from tests.naive.mp import richardson_gradient
from tests.naive.transformer import (
    naive_decoder,
    naive_encoder,
    naive_feed_forward,
    naive_layer_norm,
    naive_mha,
)

DPS = 60

# ----------------------------------------------------------------------------- helpers


def _arrays(obj):
    """(path, array) of every array field of a (nested) params dataclass, in field order."""
    out = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, np.ndarray):
            out.append(((f.name,), value))
        elif hasattr(value, "__dataclass_fields__"):
            out.extend(((f.name,) + path, a) for path, a in _arrays(value))
    return out


def _with_arrays(obj, values):
    """The dataclass with its array fields replaced, in :func:`_arrays` order."""
    values = iter(values)
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, np.ndarray):
            changes[f.name] = next(values)
        elif hasattr(value, "__dataclass_fields__"):
            count = len(_arrays(value))
            changes[f.name] = _with_arrays(value, [next(values) for _ in range(count)])
    return replace(obj, **changes)


def _richardson(forward, inputs, params, grad_out, free=None):
    """Richardson gradients of ``sum(grad_out * forward(*inputs, params))`` (mpf twins) with
    respect to every input and parameter array: lists of (gradient, error) in that order."""
    arrays = list(inputs) + [a for _, a in _arrays(params)]
    sizes = [a.size for a in arrays]
    theta = np.concatenate([a.ravel() for a in arrays])

    def loss(flat):
        parts, start = [], 0
        for a, size in zip(arrays, sizes, strict=True):
            parts.append(np.array(flat[start : start + size], dtype=object).reshape(a.shape))
            start += size
        out = forward(*parts[: len(inputs)], _with_arrays(params, parts[len(inputs) :]))
        return mpmath.fsum(
            float(g) * v for g, v in zip(np.ravel(grad_out), out.ravel(), strict=True)
        )

    grad, error = richardson_gradient(loss, theta, True if free is None else free, DPS)
    out, start = [], 0
    for a, size in zip(arrays, sizes, strict=True):
        out.append(
            (
                grad[start : start + size].reshape(a.shape),
                error[start : start + size].reshape(a.shape),
            )
        )
        start += size
    return out


def assert_rounds_to(value, grad, error, *, what, free=None):
    """``value`` is the float64 rounding of a gradient known to lie in ``grad +- error``:
    bit-identical where the interval rounds to one float64, else one of its two roundings.
    Elements outside ``free`` (not differentiated) are skipped."""
    __tracebackhide__ = True
    with mpmath.workdps(DPS):
        lo = np.vectorize(lambda g, e: float(g - e), otypes=[float])(grad, error)
        hi = np.vectorize(lambda g, e: float(g + e), otypes=[float])(grad, error)
    keep = (lo == hi) & (np.ones(lo.shape, bool) if free is None else free)
    assert_same_bits(np.where(keep, value, lo), lo, what=what)
    inside = (value >= lo) & (value <= hi)
    assert (inside | ~(np.ones(lo.shape, bool) if free is None else free)).all(), (
        f"{what}: outside the Richardson interval"
    )


def _estimate(exact, count):
    """The first-order float64 estimate of the module docstring; ``exact`` is one gradient or
    a list of all gradients of the call (their common magnitude: a gradient can be exactly
    zero, e.g. a key bias's under softmax's shift invariance, while its float64 value is not)."""
    arrays = exact if isinstance(exact, list | tuple) else [exact]
    return gamma(count) * max(
        float(np.max(np.abs(a), initial=0.0)) for a in arrays if a is not None
    )


@pytest.fixture
def rng():
    return np.random.default_rng(2026_13)


def _norm(rng, width):
    return T.NormParams(
        gamma=1 + 0.1 * rng.standard_normal(width), beta=0.1 * rng.standard_normal(width), eps=1e-5
    )


# ----------------------------------------------------------------------------- layer norm


@pytest.mark.parametrize("axis", [-1, 0])
def test_layer_norm_vjp_exact_against_richardson(rng, axis):
    x = rng.standard_normal((3, 5)) * 2 + 1
    norm = _norm(rng, x.shape[axis])
    g = rng.standard_normal(x.shape)
    grads = T.layer_norm_vjp(
        x, g, gamma=norm.gamma, beta=norm.beta, eps=norm.eps, axis=axis, precision="exact"
    )
    moved, g_moved = np.moveaxis(x, axis, -1), np.moveaxis(g, axis, -1)
    (dx, ex), (dg, eg), (db, eb) = _richardson(naive_layer_norm, [moved], norm, g_moved)
    assert_rounds_to(np.moveaxis(grads.dx, axis, -1), dx, ex, what="layer_norm_vjp dx")
    assert_rounds_to(grads.dgamma, dg, eg, what="layer_norm_vjp dgamma")
    assert_rounds_to(grads.dbeta, db, eb, what="layer_norm_vjp dbeta")
    approx = T.layer_norm_vjp(x, g, gamma=norm.gamma, beta=norm.beta, eps=norm.eps, axis=axis)
    bound = layer_norm_vjp_bound(x, g, gamma=norm.gamma, beta=norm.beta, eps=norm.eps, axis=axis)
    for name in ("dx", "dgamma", "dbeta"):
        # the bound is first order: one unit of the exact gradient covers the rest
        assert_within(
            getattr(approx, name),
            getattr(grads, name),
            getattr(bound, name),
            ulps=1,
            what=f"layer_norm_vjp float64 {name}",
        )


def test_layer_norm_vjp_without_affine_and_bad_cotangent(rng):
    x = rng.standard_normal((2, 4))
    grads = T.layer_norm_vjp(x, np.ones((2, 4)))
    assert grads.dgamma is None and grads.dbeta is None
    # a constant cotangent is orthogonal to the normalised row's Jacobian: dx = 0 up to rounding
    assert_within(grads.dx, np.zeros_like(x), _estimate(np.ones(1), x.size), what="dx of ones")
    with pytest.raises(ValueError, match="grad_out"):
        T.layer_norm_vjp(x, np.ones((2, 3)))


# ----------------------------------------------------------------------------- feed-forward


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feed_forward_vjp_exact_against_richardson(rng, activation):
    p = random_encoder_params(4, 2, 6, seed=5, activation=activation).ffn
    x = rng.standard_normal((3, 4))
    g = rng.standard_normal((3, 4))
    grads = T.feed_forward_vjp(x, p.W1, p.b1, p.W2, p.b2, g, activation, precision="exact")
    reference = _richardson(naive_feed_forward, [x], p, g)
    for name, value, (grad, error) in zip(
        ("dx", "dW1", "db1", "dW2", "db2"), grads, reference, strict=True
    ):
        assert_rounds_to(value, grad, error, what=f"feed_forward_vjp {activation} {name}")
    approx = T.feed_forward_vjp(x, p.W1, p.b1, p.W2, p.b2, g, activation)
    bound = feed_forward_vjp_bound(x, p.W1, p.b1, p.W2, p.b2, g, activation)
    for name, value, exact, limit in zip(
        ("dx", "dW1", "db1", "dW2", "db2"), approx, grads, bound, strict=True
    ):
        assert_within(value, exact, limit, ulps=1, what=f"feed_forward float64 {name}")


def test_feed_forward_vjp_relu_slope_at_zero_is_zero():
    x = np.array([[0.0, 1.0]])
    grads = T.feed_forward_vjp(
        x, np.eye(2), None, np.eye(2), None, np.ones((1, 2)), precision="exact"
    )
    assert grads.dx.tolist() == [[0.0, 1.0]] and grads.db1 is None


@pytest.mark.parametrize("seed", range(6))
def test_float64_bounds_hold_on_random_scales(seed):
    # magnitudes from 1e-3 to 1e3, offsets (cancellation in the mean), eps 0, 1e-5, 1
    rng = np.random.default_rng(seed)
    width, rows = int(rng.integers(2, 7)), int(rng.integers(1, 4))
    x = rng.standard_normal((rows, width)) * 10.0 ** rng.integers(
        -3, 4
    ) + rng.standard_normal() * 10.0 ** rng.integers(-2, 3)
    g, gain, shift = (
        rng.standard_normal(x.shape),
        rng.standard_normal(width),
        rng.standard_normal(width),
    )
    eps = (0.0, 1e-5, 1.0)[seed % 3]
    kw = dict(gamma=gain, beta=shift, eps=eps)
    exact = T.layer_norm_vjp(x, g, **kw, precision="exact")
    for value, truth, limit, name in zip(
        T.layer_norm_vjp(x, g, **kw),
        exact,
        layer_norm_vjp_bound(x, g, **kw),
        exact._fields,
        strict=True,
    ):
        assert_within(value, truth, limit, ulps=1, what=f"layer_norm_vjp {name}", case=seed)
    hidden = int(rng.integers(1, 7))
    W1, b1 = rng.standard_normal((width, hidden)), rng.standard_normal(hidden)
    W2, b2 = rng.standard_normal((hidden, width)), rng.standard_normal(width)
    activation = ("relu", "gelu")[seed % 2]
    args = (x / np.abs(x).max(), W1, b1, W2, b2, g, activation)
    exact = T.feed_forward_vjp(*args, precision="exact")
    for value, truth, limit, name in zip(
        T.feed_forward_vjp(*args), exact, feed_forward_vjp_bound(*args), exact._fields, strict=True
    ):
        assert_within(value, truth, limit, ulps=1, what=f"feed_forward_vjp {name}", case=seed)


# ----------------------------------------------------------------------------- attention


def _mha_grads(x_q, x_kv, p, g, function=T.multihead_attention_vjp, **kw):
    return function(
        x_q,
        x_kv,
        p.W_Q,
        p.W_K,
        p.W_V,
        p.W_O,
        g,
        b_Q=p.b_Q,
        b_K=p.b_K,
        b_V=p.b_V,
        b_O=p.b_O,
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        **kw,
    )


_MHA_NAMES = ("dW_Q", "dW_K", "dW_V", "dW_O", "db_Q", "db_K", "db_V", "db_O")


@pytest.mark.parametrize("case", ["cross_gqa", "self_causal"])
def test_mha_vjp_exact_against_richardson(rng, case):
    if case == "cross_gqa":
        p = random_attention_params(4, 2, seed=11, num_kv_heads=1, kv_dim=3, head_dim=2)
        x_q, x_kv, kw = rng.standard_normal((3, 4)), rng.standard_normal((4, 3)), {}
        allowed = np.ones((3, 4), bool)
    else:
        p = random_attention_params(4, 2, seed=12)
        x_q, x_kv, kw = rng.standard_normal((3, 4)), None, {"causal": True}
        allowed = np.tril(np.ones((3, 3), bool))
    g = rng.standard_normal((3, 4))
    grads = _mha_grads(x_q, x_kv, p, g, precision="exact", **kw)
    if x_kv is None:
        reference = _richardson(lambda x, q: naive_mha(x, x, q, allowed), [x_q], p, g)
        reference.insert(1, None)
    else:
        reference = _richardson(lambda a, b, q: naive_mha(a, b, q, allowed), [x_q, x_kv], p, g)
    names = ("dx_q", "dx_kv") + _MHA_NAMES
    for name, value, ref in zip(names, grads, reference, strict=True):
        if ref is None:
            assert value is None, name
            continue
        assert_rounds_to(value, *ref, what=f"multihead_attention_vjp {case} {name}")
    approx = _mha_grads(x_q, x_kv, p, g, **kw)
    bound = _mha_grads(x_q, x_kv, p, g, function=multihead_attention_vjp_bound, **kw)
    for name, value, exact, limit in zip(names, approx, grads, bound, strict=True):
        if exact is not None:
            assert_within(value, exact, limit, ulps=1, what=f"mha float64 {name}")


def test_mha_vjp_masked_keys_get_exact_zero_gradients(rng):
    p = random_attention_params(4, 1, seed=3)
    x = rng.standard_normal((3, 4))
    mask = np.array([[True, True, False]] * 3)  # key 2 is never attended
    exact = _mha_grads(x, x.copy(), p, rng.standard_normal((3, 4)), mask=mask, precision="exact")
    assert np.array_equal(exact.dx_kv[2], np.zeros(4)), "an excluded key has no gradient"


def test_mha_vjp_broadcast_memory_sums_over_the_batch(rng):
    # x_q (B, L, M) against one shared x_kv (S, N): dx_kv and the key/value weights sum B
    p = random_attention_params(4, 2, seed=8)
    x_q, x_kv, g = (rng.standard_normal(s) for s in ((2, 3, 4), (2, 4), (2, 3, 4)))
    exact = _mha_grads(x_q, x_kv, p, g, precision="exact")
    approx = _mha_grads(x_q, x_kv, p, g)
    assert exact.dx_kv.shape == x_kv.shape and exact.dx_q.shape == x_q.shape
    per_sample = [_mha_grads(x_q[b], x_kv, p, g[b], precision="exact") for b in range(2)]
    bound = _mha_grads(x_q, x_kv, p, g, function=multihead_attention_vjp_bound)
    for name in ("dx_kv", "dW_K", "dW_V", "dW_O"):
        # the sum of two correctly rounded halves is within one rounding of each half of
        # the correctly rounded total
        halves = sum(getattr(s, name) for s in per_sample)
        magnitude = sum(np.abs(getattr(s, name)) for s in per_sample)
        assert_within(
            getattr(exact, name), halves, gamma(3) * magnitude, what=f"batched exact {name}"
        )
        assert_within(
            getattr(approx, name),
            getattr(exact, name),
            getattr(bound, name),
            ulps=1,
            what=f"batched float64 {name}",
        )
    low = _mha_grads(x_q, x_kv, p, g, precision="exact", out_dtype="float32")
    assert low.dW_Q.dtype == np.float32


@pytest.mark.parametrize("seed", range(4))
def test_mha_float64_bound_holds_on_random_layouts(seed):
    # self/cross attention, MHA/GQA, causal or a key mask, inputs of two magnitudes
    rng = np.random.default_rng(100 + seed)
    heads, kv_heads = (1, None) if seed % 2 == 0 else (2, 1 + seed % 3 // 2)
    p = random_attention_params(4, heads, seed=seed, num_kv_heads=kv_heads)
    x_q = rng.standard_normal((3, 4)) * (1, 4)[seed % 2]
    x_kv = None if seed < 2 else rng.standard_normal((4, 4))
    kw = (
        {"causal": True}
        if seed % 2 == 0
        else {"mask": np.array([[1, 1, 0, 1]] * 3, bool)[:, : 3 if x_kv is None else 4]}
    )
    g = rng.standard_normal((3, 4))
    exact = _mha_grads(x_q, x_kv, p, g, precision="exact", **kw)
    approx = _mha_grads(x_q, x_kv, p, g, **kw)
    bound = _mha_grads(x_q, x_kv, p, g, function=multihead_attention_vjp_bound, **kw)
    for name, value, truth, limit in zip(exact._fields, approx, exact, bound, strict=True):
        if truth is not None:
            assert_within(value, truth, limit, ulps=1, what=f"mha float64 {name}", case=seed)


# ----------------------------------------------------------------------------- blocks


def _sample_free(rng, count, size):
    free = np.zeros(size, bool)
    free[rng.choice(size, count, replace=False)] = True
    return free


def _check_block(rng, grads_exact, grads_float, forward, inputs, params, g, count, what):
    arrays = list(inputs) + [a for _, a in _arrays(params)]
    total = sum(a.size for a in arrays)
    free = _sample_free(rng, min(count, total), total)
    reference = _richardson(forward, inputs, params, g, free)
    exact = list(grads_exact[: len(inputs)]) + [a for _, a in _arrays(grads_exact[-1])]
    approx = list(grads_float[: len(inputs)]) + [a for _, a in _arrays(grads_float[-1])]
    start = 0
    for value, float_value, (grad, error) in zip(exact, approx, reference, strict=True):
        chosen = free[start : start + value.size].reshape(value.shape)
        assert_rounds_to(value, grad, error, what=what, free=chosen)
        assert_within(float_value, value, _estimate(exact, total), what=what + " float64")
        start += value.size


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_encoder_vjp_exact_against_richardson(rng, norm):
    p = random_encoder_params(4, 2, 6, seed=21)
    x, g = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    exact = T.encoder_block_vjp(x, p, g, norm=norm, precision="exact")
    approx = T.encoder_block_vjp(x, p, g, norm=norm)
    _check_block(
        rng,
        exact,
        approx,
        lambda h, q: naive_encoder(h, q, norm),
        [x],
        p,
        g,
        12,
        f"encoder_block_vjp {norm}",
    )


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decoder_vjp_exact_against_richardson(rng, norm):
    p = random_decoder_params(4, 2, 6, seed=22)
    x, memory, g = (rng.standard_normal(s) for s in ((3, 4), (2, 4), (3, 4)))
    exact = T.decoder_block_vjp(x, memory, p, g, norm=norm, precision="exact")
    approx = T.decoder_block_vjp(x, memory, p, g, norm=norm)
    _check_block(
        rng,
        exact,
        approx,
        lambda h, m, q: naive_decoder(h, m, q, norm),
        [x, memory],
        p,
        g,
        10,
        f"decoder_block_vjp {norm}",
    )


@pytest.mark.slow
def test_encoder_vjp_exact_against_richardson_every_coordinate(rng):
    p = random_encoder_params(4, 2, 6, seed=23)
    x, g = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    exact = T.encoder_block_vjp(x, p, g, precision="exact")
    approx = T.encoder_block_vjp(x, p, g)
    _check_block(
        rng,
        exact,
        approx,
        lambda h, q: naive_encoder(h, q, "post"),
        [x],
        p,
        g,
        10**6,
        "encoder_block_vjp (every coordinate)",
    )


# ----------------------------------------------------------------------------- torch


def _torch():
    return pytest.importorskip("torch")


def _torch_layer_norm(torch, x, norm):
    """[L17] "Other layers": g / sigma (h - mu) + beta, biased variance, eps inside the root."""
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.gamma + norm.beta


def _torch_mha(torch, x_q, x_kv, p, allowed):
    """[AMT] multi-head display: per-head softmax(q k^T / sqrt(D)) v, concat, W_O."""
    heads, kv_heads = p.num_heads, p.num_kv_heads or p.num_heads
    q, k, v = x_q @ p.W_Q + p.b_Q, x_kv @ p.W_K + p.b_K, x_kv @ p.W_V + p.b_V
    dim, vdim = q.shape[-1] // heads, v.shape[-1] // kv_heads
    outs = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        scores = q[:, h * dim : (h + 1) * dim] @ k[:, g * dim : (g + 1) * dim].T / dim**0.5
        scores = scores.masked_fill(~torch.as_tensor(allowed), float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ v[:, g * vdim : (g + 1) * vdim])
    return torch.cat(outs, dim=-1) @ p.W_O + p.b_O


def _torch_ffn(torch, x, p):
    hidden = x @ p.W1 + p.b1
    act = (
        torch.relu(hidden)
        if p.activation == "relu"
        else torch.nn.functional.gelu(hidden, approximate="none")
    )
    return act @ p.W2 + p.b2


def _torch_encoder(torch, x, p):
    full = np.ones((x.shape[0], x.shape[0]), bool)
    h = _torch_layer_norm(torch, x + _torch_mha(torch, x, x, p.attn, full), p.norm1)
    return _torch_layer_norm(torch, h + _torch_ffn(torch, h, p.ffn), p.norm2)


def _torch_decoder(torch, x, memory, p):
    causal = np.tril(np.ones((x.shape[0], x.shape[0]), bool))
    full = np.ones((x.shape[0], memory.shape[0]), bool)
    h = _torch_layer_norm(torch, x + _torch_mha(torch, x, x, p.self_attn, causal), p.norm1)
    h = _torch_layer_norm(torch, h + _torch_mha(torch, h, memory, p.cross_attn, full), p.norm2)
    return _torch_layer_norm(torch, h + _torch_ffn(torch, h, p.ffn), p.norm3)


def _torch_grads(torch, forward, inputs, params, g):
    leaves = [torch.tensor(a, requires_grad=True) for a in inputs]
    param_leaves = [torch.tensor(a, requires_grad=True) for _, a in _arrays(params)]
    out = forward(*leaves, _with_arrays(params, param_leaves))
    out.backward(torch.tensor(g))
    return [t.grad.numpy() for t in leaves + param_leaves]


@pytest.mark.peers("torch")
@pytest.mark.parametrize("piece", ["layer_norm", "feed_forward", "mha", "encoder", "decoder"])
def test_vjps_match_torch_autograd(rng, piece):
    torch = _torch()
    x, memory, g = (rng.standard_normal(s) for s in ((3, 4), (2, 4), (3, 4)))
    if piece == "layer_norm":
        params, inputs = _norm(rng, 4), [x]
        forward = lambda h, q: _torch_layer_norm(torch, h, q)  # noqa: E731
        grads = T.layer_norm_vjp(
            x, g, gamma=params.gamma, beta=params.beta, eps=params.eps, precision="exact"
        )
        exact = list(grads)
    elif piece == "feed_forward":
        params, inputs = random_encoder_params(4, 2, 6, seed=31, activation="gelu").ffn, [x]
        forward = lambda h, q: _torch_ffn(torch, h, q)  # noqa: E731
        exact = list(
            T.feed_forward_vjp(
                x, params.W1, params.b1, params.W2, params.b2, g, "gelu", precision="exact"
            )
        )
    elif piece == "mha":
        params, inputs = random_attention_params(4, 2, seed=32, num_kv_heads=1), [x, memory]
        allowed = np.ones((3, 2), bool)
        forward = lambda a, b, q: _torch_mha(torch, a, b, q, allowed)  # noqa: E731
        grads = _mha_grads(x, memory, params, g, precision="exact")
        exact = list(grads[:2]) + [getattr(grads, n) for n in _MHA_NAMES]
    elif piece == "encoder":
        params, inputs = random_encoder_params(4, 2, 6, seed=33), [x]
        forward = lambda h, q: _torch_encoder(torch, h, q)  # noqa: E731
        grads = T.encoder_block_vjp(x, params, g, precision="exact")
        exact = [grads.dx] + [a for _, a in _arrays(grads.dparams)]
    else:
        params, inputs = random_decoder_params(4, 2, 6, seed=34), [x, memory]
        forward = lambda h, m, q: _torch_decoder(torch, h, m, q)  # noqa: E731
        grads = T.decoder_block_vjp(x, memory, params, g, precision="exact")
        exact = [grads.dx, grads.dmemory] + [a for _, a in _arrays(grads.dparams)]
    reference = _torch_grads(torch, forward, inputs, params, g)
    total = sum(a.size for a in reference)
    for k, (value, truth) in enumerate(zip(reference, exact, strict=True)):
        assert_within(value, truth, _estimate(exact, total), what=f"torch {piece} gradient {k}")
