"""The compiled first step of the exact sigmoid-attention forward (refattn.exact.fast.sigmoid).

* its double-double and double-precision enclosures of out contain the 60-digit mpmath loop twin
  (tests/naive/sigmoid.py) on every option (causal, window, mask, bias, softcap, ALiBi, dropout,
  GQA) in four input dtypes;
* the exact path with the first step is bit-identical to the referee alone
  (``config.SIGMOID_EXACT_ENGINE = "referee"``) in four output dtypes, with weights, on empty
  rows (zero and NaN fill), -inf bias, non-finite values and out-of-range inputs (planes and
  rows the first step leaves to the referee);
* on ordinary cases it decides every row (the referee evaluates nothing).
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn import config
from refattn.exact.fast.sigmoid import sigmoid_enclosures, sigmoid_fallback_stats
from refattn.exact.fast.sigmoid_kernels import OK
from refattn.spec import canonicalize
from tests.helpers import assert_same_bits, digest_with_threads
from tests.naive.sigmoid import naive_sigmoid_attention

DTYPES = ("float64", "float32", "float16", "bfloat16")


def _dtype(name):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@st.composite
def sigmoid_cases(draw, max_length=5):
    """(q, k, v, opts, input dtype) of one batch row: random shapes and options."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 2))
    length, keys = draw(st.integers(1, max_length)), draw(st.integers(1, max_length + 2))
    dim, vdim = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1.0, 3.0]))
    q = (rng.standard_normal((heads, length, dim)) * scale).astype(_dtype(dtype))
    k = rng.standard_normal((kv_heads, keys, dim)).astype(_dtype(dtype))
    v = rng.standard_normal((kv_heads, keys, vdim)).astype(_dtype(dtype))
    opts = {"normalizer": "sigmoid"}
    if draw(st.booleans()):
        opts["causal"] = True
        opts["align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if draw(st.booleans()):
        mask = rng.random((heads, length, keys)) > 0.3
        if draw(st.booleans()):
            mask[:, 0] = False  # an empty row
        opts["mask"] = mask
    if draw(st.booleans()):
        bias = rng.standard_normal((heads, length, keys)) * 2
        bias[rng.random(bias.shape) < 0.15] = -np.inf
        opts["bias"] = bias
    if draw(st.booleans()):
        opts["window"] = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    if draw(st.integers(0, 3)) == 0:
        opts["softcap"] = 2.5
    if draw(st.integers(0, 3)) == 0:
        opts["alibi_slopes"] = rng.uniform(0.1, 1.0, heads)
    if draw(st.integers(0, 3)) == 0:
        opts["dropout_p"] = 0.25
        opts["dropout_mask"] = rng.random((heads, length, keys)) > 0.25
    if draw(st.booleans()):
        opts["empty_rows"] = "nan"
    return q, k, v, opts, dtype


def _exact(engine, q, k, v, opts, out_dtype, weights=True):
    saved = config.SIGMOID_EXACT_ENGINE
    config.SIGMOID_EXACT_ENGINE = engine
    try:
        result = refattn.attention(
            q, k, v, precision="exact", out_dtype=out_dtype, return_weights=weights, **opts
        )
        return result, sigmoid_fallback_stats()
    finally:
        config.SIGMOID_EXACT_ENGINE = saved


def _same(q, k, v, opts, out_dtype, what, weights=True):
    fast, _ = _exact("fast", q, k, v, opts, out_dtype, weights)
    ref, _ = _exact("referee", q, k, v, opts, out_dtype, weights)
    if not weights:  # the double-precision step runs for targets of <= 24 bits
        fast, ref = (fast, None), (ref, None)
    for name, a, b in (("out", fast[0], ref[0]), ("weights", fast[1], ref[1])):
        if a is not None:
            assert_same_bits(a, b, what=f"{what} {name} fast vs referee ({out_dtype})")


@settings(max_examples=60, deadline=None)
@given(case=sigmoid_cases(), out_dtype=st.sampled_from(DTYPES), weights=st.booleans())
def test_bit_identical_to_the_referee(case, out_dtype, weights):
    q, k, v, opts, dtype = case
    _same(q, k, v, opts, _dtype(out_dtype), f"{dtype} inputs", weights)


@settings(max_examples=25, deadline=None)
@given(case=sigmoid_cases(), step=st.sampled_from(["double-double", "double"]))
def test_enclosures_contain_the_twin(case, step):
    q, k, v, opts, _ = case
    spec = canonicalize(q[None], k[None], v[None], **opts)
    enclosure, status = sigmoid_enclosures(spec, step)
    twin_opts = {
        name: value
        for name, value in opts.items()
        if name not in ("normalizer", "empty_rows") and value is not None
    }
    with mpmath.workdps(60):
        truth, _ = naive_sigmoid_attention(q, k, v, **twin_opts)
        for h, i, e in np.ndindex(enclosure.shape[1:4]):
            if status[0, h, i] != OK:
                continue
            hi, lo, rad = (float(x) for x in enclosure[0, h, i, e])
            gap = abs(truth[h][i][e] - (mpmath.mpf(hi) + mpmath.mpf(lo)))
            assert gap <= rad, f"out[{h}, {i}, {e}]: {truth[h][i][e]} outside {hi} + {lo} +- {rad}"


def test_decides_ordinary_rows_without_the_referee():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 40, 8)) for _ in range(3))
    opts = dict(normalizer="sigmoid", causal=True, bias=-np.log(40.0))
    for out_dtype in DTYPES:
        out, stats = _exact("fast", q, k, v, opts, _dtype(out_dtype), weights=False)
        assert stats["referee_rows"] == 0 and stats["rows"] == 80, (out_dtype, stats)
        ref, _ = _exact(
            "referee", q[:, :, -3:], k, v, dict(opts, align="bottom_right"), out_dtype, False
        )
        assert_same_bits(out[:, :, -3:], ref, what=f"last rows ({out_dtype})")


@pytest.mark.parametrize(
    "what", ["inf value", "nan query", "huge key", "tiny value", "huge bias", "all-zero scores"]
)
def test_rows_left_to_the_referee_are_identical(what):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 4, 3)) for _ in range(3))
    opts = dict(normalizer="sigmoid", bias=rng.standard_normal((4, 4)))
    if what == "inf value":
        v[0, 1, 2, 0] = np.inf
    elif what == "nan query":
        q[0, 0, 1, 1] = np.nan
    elif what == "huge key":
        k[0, 0, 0, 0] = 2.0**500
    elif what == "tiny value":
        v[0, 0, 0, 0] = 2.0**-500
    elif what == "huge bias":
        opts["bias"][2, 1] = 1e200
    else:  # sigma(0) = 1/2 exactly: rational outputs, on rounding boundaries at times
        q[:] = 0.0
        opts["bias"] = None
    for out_dtype in ("float64", "float16"):
        _same(q, k, v, opts, out_dtype, what)
        _same(q, k, v, opts, out_dtype, what, weights=False)
        _, stats = _exact("fast", q, k, v, opts, out_dtype)
        if what != "all-zero scores":  # decided unless a sum lands on a midpoint
            assert stats["referee_rows"] > 0, f"{what}: no row went to the referee"


def test_rows_the_double_step_leaves_are_decided_alike():
    """float32 outputs: the rows the double-precision step leaves undecided (scattered rows,
    grouped by plane for the double-double step) get the values the double-double step alone
    gives every row (both are the correctly rounded values)."""
    from refattn.exact.fast import sigmoid as fast
    from refattn.exact.rounding import format_of

    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 256, 64)).astype(np.float32) for _ in range(3))
    spec = canonicalize(q, k, v, normalizer="sigmoid", causal=True, bias=-np.log(256.0))
    fmt = format_of(np.float32)
    scratch = np.zeros((1, 2, 256, 64, 3))
    _, _, after_double = fast._first_step(spec, fmt, False, (scratch, "double"))
    assert (after_double != OK).any(), "the double step decided every row: no leftover to test"
    both, _, status = fast._first_step(spec, fmt, False)
    alone, _, status_alone = fast._first_step(spec, fmt, False, (scratch, "double-double"))
    assert (status == OK).all() and (status_alone == OK).all()
    assert_same_bits(both, alone, what="double then double-double vs double-double alone")


@pytest.mark.parametrize("step", ["double-double", "double"])
def test_enclosures_contain_the_twin_over_key_blocks(step):
    """Rows of 150 keys (the double step's blocked sums restart every 64 keys)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 4)) * 2
    k = rng.standard_normal((1, 150, 4))
    v = rng.standard_normal((1, 150, 2))
    opts = {"causal": True, "align": "bottom_right", "bias": rng.standard_normal((2, 3, 150))}
    spec = canonicalize(q[None], k[None], v[None], normalizer="sigmoid", **opts)
    enclosure, status = sigmoid_enclosures(spec, step)
    assert (status == OK).all()
    with mpmath.workdps(60):
        truth, _ = naive_sigmoid_attention(q, k, v, **opts)
        for h, i, e in np.ndindex(enclosure.shape[1:4]):
            hi, lo, rad = (float(x) for x in enclosure[0, h, i, e])
            gap = abs(truth[h][i][e] - (mpmath.mpf(hi) + mpmath.mpf(lo)))
            assert gap <= rad, f"out[{h}, {i}, {e}]: {truth[h][i][e]} outside {hi} + {lo} +- {rad}"


def _contains_the_twin(q, k, v, opts, step):
    """The dense step's enclosures (``step``) of every row contain the 60-digit twin (``opts``
    with a bias: the spec's bias, broadcast for the twin)."""
    spec = canonicalize(q[None], k[None], v[None], normalizer="sigmoid", **opts)
    enclosure, status = sigmoid_enclosures(spec, step)
    assert (status == OK).all(), status
    bias = np.broadcast_to(opts["bias"], q.shape[:2] + k.shape[1:2])  # the twin's (H, L, S)
    with mpmath.workdps(60):
        truth, _ = naive_sigmoid_attention(q, k, v, **dict(opts, bias=bias))
        for h, i, e in np.ndindex(enclosure.shape[1:4]):
            hi, lo, rad = (float(x) for x in enclosure[0, h, i, e])
            gap = abs(truth[h][i][e] - (mpmath.mpf(hi) + mpmath.mpf(lo)))
            assert gap <= rad, f"out[{h}, {i}, {e}]: {truth[h][i][e]} outside {hi} + {lo} +- {rad}"


@pytest.mark.parametrize("step", ["double", "double-magnitude"])
def test_dense_enclosures_with_a_scalar_bias_and_far_scores(step):
    """The dense step's constant-bias scores (a scalar bias taken out of the rule) and far
    keys (|t| > 400: weights within TINY of 0 or 1), first pass and magnitude-sum pass."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 40, 4)) * np.array([1.0, 300.0])[:, None, None]
    k = rng.standard_normal((2, 40, 4))
    v = rng.standard_normal((2, 40, 3))
    opts = {"causal": True, "bias": -np.log(40.0)}
    scores = np.einsum("hid,hjd->hij", q, k) / 2.0 - np.log(40.0)
    assert (np.abs(np.tril(scores[1])) > 400).any(), "no far score in the case"
    _contains_the_twin(q, k, v, opts, step)
    for out_dtype in ("float32", "float16"):
        _same(q[None], k[None], v[None], opts, out_dtype, f"{step} far", weights=False)


_THREADS_SCRIPT = """
import hashlib
import numpy as np
import refattn
rng = np.random.default_rng(5)
digest = hashlib.sha256()
for dtype, bias in ((np.float32, -np.log(300.0)), (np.float16, None)):
    q, k, v = (rng.standard_normal((1, 3, 300, 16)).astype(dtype) for _ in range(3))
    out = refattn.attention(q, k, v, normalizer="sigmoid", causal=True, bias=bias,
                            precision="exact", out_dtype=dtype)
    digest.update(np.ascontiguousarray(out).tobytes())
print(digest.hexdigest())
"""


def test_dense_step_bits_do_not_depend_on_the_thread_count():
    """Dense blocks of D_ROW_BLOCK rows, the magnitude-sum pass over scattered rows and the
    double-double step: the same bits on 1 and 2 threads."""
    assert digest_with_threads(_THREADS_SCRIPT, 1) == digest_with_threads(_THREADS_SCRIPT, 2)
