"""Attention sinks in the fast exact VJP: taken natively (no folded (B, H, L, S + 1) spec),
bit-identical to the referee (which folds the sink into one more key), with dsinks in the flat
``(dbias.ravel(), dsinks)`` layout."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import refattn
from refattn.exact import attention_vjp as vjp_module
from refattn.exact.attention_vjp import exact_vjp
from refattn.exact.fast import vjp as fast_vjp
from refattn.exact.rounding import FORMATS
from refattn.spec import canonicalize, check_cotangent
from tests.helpers import assert_same_bits, vjp_problem

BATCH, HEADS, KV_HEADS, LENGTH, KEYS = 2, 4, 2, 7, 9
SINKS = np.array([0.5, -1.0, 2.0, 0.0])


def _problem(seed):
    return vjp_problem(seed, HEADS, KV_HEADS, LENGTH, KEYS, 4, 3, BATCH)


def _options(rng):
    """Every option that meets the sink: structure, empty rows, bias layouts, score terms."""
    empty_rows = rng.random((BATCH, HEADS, LENGTH, KEYS)) < 0.6
    empty_rows[0, 1, 2] = False  # a row with no allowed key: the sink alone
    empty_rows[1, :, 4] = False
    neginf_bias = rng.standard_normal((HEADS, 1, KEYS))
    neginf_bias[1, 0, 2] = -np.inf
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    return {
        "plain": {},
        "causal": {"causal": True},
        "causal_bottom_right": {"causal": True, "align": "bottom_right"},
        "window": {"window": (2, 1)},
        "kv_lengths_empty": {"kv_lengths": np.array([0, 6]), "window": (1, 1)},
        "kv_lengths_causal": {
            "kv_lengths": np.array([9, 4]),
            "causal": True,
            "align": "bottom_right",
        },
        "mask_empty_rows": {"mask": empty_rows},
        "bias_full": {"bias": rng.standard_normal((BATCH, HEADS, LENGTH, KEYS))},
        "bias_heads": {"bias": neginf_bias, "causal": True},
        "bias_rows": {"bias": rng.standard_normal((LENGTH, 1))},  # broadcast along the keys
        "softcap": {"softcap": 1.5},
        "alibi": {"alibi_slopes": slopes, "causal": True, "align": "bottom_right"},
        "dropout": {"dropout_mask": rng.random((BATCH, 1, LENGTH, KEYS)) < 0.7, "dropout_p": 0.25},
        "gqa_tile": {"gqa": "tile", "mask": rng.random((HEADS, 1, KEYS)) < 0.8},
        "everything": {
            "causal": True,
            "softcap": 30.0,
            "alibi_slopes": slopes,
            "bias": rng.standard_normal((LENGTH, KEYS)),
            "dropout_p": 0.5,
            "dropout_mask": rng.random((HEADS, LENGTH, KEYS)) < 0.7,
            "mask": empty_rows[0],
        },
    }


_NAMES = tuple(_options(np.random.default_rng(0)))


def _spec_and_cotangents(q, k, v, do, gl, **opts):
    spec = canonicalize(q, k, v, **opts)
    _, heads, _, length, _, _, vdim = spec.dims
    d = check_cotangent(spec, do, "grad_out", (heads, length, vdim))
    g = None if gl is None else check_cotangent(spec, gl, "grad_lse", (heads, length))
    return spec, d, g


def _fast_and_referee(spec, d, g, out_dtype):
    stats = {}
    dtype = FORMATS[out_dtype].dtype
    fast = exact_vjp(spec, d, g, dtype, engine="fast", stats=stats)
    referee = exact_vjp(spec, d, g, dtype, engine="referee")
    return fast, referee, stats


def _assert_identical(fast, referee, case):
    __tracebackhide__ = True
    for what, a, b in zip(("dq", "dk", "dv", "dbias+dsinks"), fast, referee, strict=True):
        assert_same_bits(a, b, what=what, case=case, check_dtype=True)


@pytest.mark.parametrize("name", _NAMES)
@pytest.mark.parametrize("out_dtype", ["float64", "float32", "bfloat16"])
def test_fast_matches_referee_with_sinks(name, out_dtype):
    rng, q, k, v, do, gl = _problem(seed=len(name))
    opts = _options(rng)[name]
    for grad_lse in (gl, None):
        spec, d, g = _spec_and_cotangents(q, k, v, do, grad_lse, sinks=SINKS, **opts)
        fast, referee, stats = _fast_and_referee(spec, d, g, out_dtype)
        n_bias = 0 if spec.bias is None else int(np.prod(spec.bias_shape))
        assert fast[3].shape == (n_bias + HEADS,)
        assert fast[1].shape[2] == KEYS and fast[2].shape[2] == KEYS
        assert stats["fast"] > 0, stats
        _assert_identical(fast, referee, f"{name}, {out_dtype}, grad_lse={g is not None}")


@pytest.mark.parametrize("offset", [80.0, -80.0, 0.0])
def test_sinks_far_from_the_scores(offset):
    """A sink far above every score (the reference key of every row; the keys' weights
    ~e^-80), far below (weight ~e^-80), or tied with scores of zero (q = 0)."""
    rng, q, k, v, do, gl = _problem(seed=9)
    if offset == 0.0:
        q = np.zeros_like(q)  # every score 0: the sink ties with every key
    sinks = SINKS + offset
    for opts in ({"causal": True}, {"mask": rng.random((LENGTH, KEYS)) < 0.3, "softcap": 2.0}):
        spec, d, g = _spec_and_cotangents(q, k, v, do, gl, sinks=sinks, **opts)
        fast, referee, _ = _fast_and_referee(spec, d, g, "float64")
        _assert_identical(fast, referee, f"offset={offset}, {sorted(opts)}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_inputs_with_sinks(dtype):
    cast = np.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
    rng, q, k, v, do, gl = _problem(seed=4)
    q, k, v = (a.astype(cast) for a in (q, k, v))
    spec, d, g = _spec_and_cotangents(q, k, v, do, gl, sinks=SINKS, causal=True)
    fast, referee, _ = _fast_and_referee(spec, d, g, dtype)
    _assert_identical(fast, referee, dtype)


def test_the_fast_path_does_not_fold(monkeypatch):
    """A call the first step decides whole never builds the folded (B, H, L, S + 1) spec; the
    enclosures have S keys and dsinks (3, H)."""
    rng, q, k, v, do, gl = _problem(seed=2)
    spec, d, g = _spec_and_cotangents(
        q, k, v, do, gl, sinks=SINKS, causal=True, bias=rng.standard_normal((HEADS, 1, KEYS))
    )
    want = exact_vjp(spec, d, g, np.dtype("float64"), engine="referee")

    def refuse(*args, **kwargs):
        raise AssertionError("the fast path folded the spec")

    monkeypatch.setattr(vjp_module, "fold", refuse)
    stats = {}
    got = exact_vjp(spec, d, g, np.dtype("float64"), engine="fast", stats=stats)
    assert stats["referee"] == 0, stats
    _assert_identical(got, want, "no fold")
    dq, dk, dv, dbias, dsinks, bad = fast_vjp.gradient_enclosures(spec, d, g)
    assert dk.shape == (3, BATCH, KV_HEADS, KEYS, 4) and dbias.shape == (3, HEADS, 1, KEYS)
    assert dsinks.shape == (3, HEADS) and not bad.any()


def test_sinks_do_not_depend_on_the_thread_count():
    rng, q, k, v, do, gl = vjp_problem(5, 4, 2, 70, 80, 4, 3, 2)
    spec, d, g = _spec_and_cotangents(
        q,
        k,
        v,
        do,
        gl,
        sinks=SINKS,
        causal=True,
        kv_lengths=np.array([80, 30]),
        align="bottom_right",
    )
    saved = numba.get_num_threads()
    runs = []
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS), saved}):
            numba.set_num_threads(threads)
            runs.append(fast_vjp.gradient_enclosures(spec, d, g))
    finally:
        numba.set_num_threads(saved)
    for got in runs[1:]:
        for a, b in zip(runs[0], got, strict=True):
            if a is not None:
                assert_same_bits(a, b, what="enclosure", case="threads")


def test_public_exact_vjp_with_sinks_matches_the_referee(monkeypatch):
    """refattn.attention_vjp's exact branch passes the unfolded spec; the referee-only engine
    gives the same bits and the same (dq, dk, dv, dbias, dsinks) shapes."""
    rng, q, k, v, do, gl = _problem(seed=6)
    bias = rng.standard_normal((LENGTH, KEYS))
    kwargs = dict(sinks=SINKS, causal=True, bias=bias, precision="exact", out_dtype="float32")
    fast = refattn.attention_vjp(q, k, v, do, grad_lse=gl, **kwargs)
    monkeypatch.setattr(refattn.config, "EXACT_VJP_ENGINE", "referee")
    referee = refattn.attention_vjp(q, k, v, do, grad_lse=gl, **kwargs)
    assert fast.dsinks.shape == (HEADS,) and fast.dbias.shape == bias.shape
    for what, a, b in zip(("dq", "dk", "dv", "dbias", "dsinks"), fast, referee, strict=True):
        assert_same_bits(a, b, what=what, case="public", check_dtype=True)


def test_sinks_beyond_the_input_limit_go_to_the_referee():
    _, q, k, v, do, gl = _problem(seed=1)
    spec, d, g = _spec_and_cotangents(q, k, v, do, gl, sinks=SINKS * fast_vjp.INPUT_LIMIT)
    assert not fast_vjp.fast_inputs_ok(spec, d, g)
    spec, d, g = _spec_and_cotangents(q, k, v, do, gl, sinks=SINKS)
    assert fast_vjp.fast_inputs_ok(spec, d, g)


def test_the_referee_engine_refuses_an_unfolded_sink():
    """ExactVJP has no sink (its forward engine has none): the callers fold first."""
    _, q, k, v, do, gl = _problem(seed=1)
    spec, d, g = _spec_and_cotangents(q, k, v, do, gl, sinks=SINKS)
    with pytest.raises(ValueError, match="sinks"):
        vjp_module.ExactVJP(spec, d, g)
