"""The fast exact attention engine (refattn.exact.fast.forward) is bit-identical to the
referee engine (refattn.exact.attention) on every option, dtype and hard input, and really falls
back to the referee where the first step cannot decide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import refattn
from refattn import config
from refattn.exact.fast import allowed_set, facts
from refattn.exact.fast import forward as FA
from refattn.exact.fast._params import frozen
from tests.helpers import exact_result
from tests.strategies import attention_cases, logspace_rows

OUT_DTYPES = ["float64", "float32", "float16", "bfloat16"]


def _assert_identical(q, k, v, out_dtype="float64", **opts):
    __tracebackhide__ = True
    fast = exact_result("fast", q, k, v, out_dtype, **opts)
    stats = FA.fallback_stats()
    slow = exact_result("referee", q, k, v, out_dtype, **opts)
    for name, a, b in zip(("out", "lse", "weights"), fast, slow, strict=True):
        assert a.dtype == b.dtype, name
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        same = (a64 == b64) & (np.signbit(a64) == np.signbit(b64)) | (np.isnan(a64) & np.isnan(b64))
        if not same.all():
            where = tuple(int(i) for i in np.argwhere(~same)[0])
            raise AssertionError(
                f"{name}{list(where)} ({out_dtype}, options {sorted(opts)}): fast "
                f"{a64[where]!r} != referee {b64[where]!r}; fallback {stats}"
            )
    return stats


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@settings(max_examples=15)
@given(case=attention_cases(dtypes=("float64", "float32", "float16", "bfloat16")))
def test_fast_engine_matches_referee_on_every_option(out_dtype, case):
    q, k, v, opts = case
    _assert_identical(q, k, v, out_dtype, **opts)


def _gaussian(seed, length=24, keys=40, dim=8, vdim=5, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal(s).astype(dtype)
        for s in ((2, length, dim), (2, keys, dim), (2, keys, vdim))
    ]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_random_gaussian_float64_needs_no_fallback(out_dtype):
    q, k, v = _gaussian(0)
    stats = _assert_identical(q, k, v, out_dtype)
    assert stats["referee_rows"] == 0 and stats["rows"] == 48


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_equal_scores_match(out_dtype):
    """Every score equal: weights exactly 1/S, outputs exact means (representable here)."""
    q = np.zeros((1, 4, 3))
    k = np.ones((1, 6, 3))
    v = np.arange(12.0).reshape(1, 6, 2)
    _assert_identical(q, k, v, out_dtype)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_rounding_midpoint_output_falls_back(out_dtype):
    """Two equal scores average 1 and 1 + ulp: exactly a midpoint of out_dtype."""
    ulp = 2.0 ** -{"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7}[out_dtype]
    v = np.array([[1.0], [1.0 + ulp]])
    stats = _assert_identical(np.zeros((1, 2)), np.zeros((2, 2)), v, out_dtype)
    assert stats["referee_rows"] == 1


@pytest.mark.parametrize("gap", [60.0, 300.0, 700.0])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_logit_gaps(gap, out_dtype):
    q, k, v = _gaussian(1, length=6, keys=9, dim=4, vdim=3)
    bias = np.zeros((6, 9))
    bias[:, ::2] = -gap
    _assert_identical(q, k, v, out_dtype, bias=bias)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_ties_at_the_max_and_near_cancelling_outputs(out_dtype):
    q, k, v = _gaussian(2, length=5, keys=8, dim=3, vdim=4)
    k[:, 3] = k[:, 0]  # equal scores at whatever the max is
    v[:, 3] = -v[:, 0] * (1 + 2.0**-40)  # near-cancelling contributions
    _assert_identical(q, k, v, out_dtype)


@pytest.mark.parametrize("out_dtype", ["float64", "float32"])
def test_subnormal_and_tiny_inputs(out_dtype):
    q, k, v = _gaussian(3, length=4, keys=5, dim=3, vdim=2)
    v[:, 1, 0] = 5e-324
    q[:, 2] *= 1e-300
    _assert_identical(q, k, v, out_dtype)


@pytest.mark.parametrize("out_dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_long_rows_narrow_inputs(dtype, out_dtype):
    q, k, v = _gaussian(4, length=3, keys=2048, dim=16, vdim=4, dtype=dtype)
    stats = _assert_identical(q, k, v, out_dtype, causal=True, align="bottom_right")
    assert stats["referee_rows"] < stats["rows"]


def test_nan_inputs_and_empty_rows_go_to_referee():
    q, k, v = _gaussian(5, length=4, keys=5, dim=3, vdim=2)
    q[0, 1, 0] = np.nan
    mask = np.ones((4, 5), dtype=bool)
    mask[2] = False
    for empty_rows in ("zero", "nan"):
        stats = _assert_identical(q, k, v, mask=mask, empty_rows=empty_rows)
        assert stats["referee_rows"] >= 4 + 1  # the NaN plane whole, the empty row


def test_row_spec_keeps_original_row_indices():
    q, k, v = _gaussian(6, length=7, keys=9, dim=3, vdim=2)
    opts = dict(
        causal=True,
        window=(2, 1),
        align="bottom_right",
        alibi_slopes=np.array([0.5, 0.25]),
        bias=np.arange(63.0).reshape(7, 9) / 8,
    )
    spec = refattn.spec.canonicalize(q, k, v, **opts)
    full = refattn.exact.attention.exact_forward(spec, np.dtype(np.float64), return_lse=True)
    part = refattn.exact.attention.exact_forward(
        FA.row_spec(spec, 0, 1, 3, 6), np.dtype(np.float64), return_lse=True
    )
    assert np.array_equal(part[0][0, 0], full[0][0, 1, 3:6])
    assert np.array_equal(part[1][0, 0], full[1][0, 1, 3:6])


# ------------------------------------------------------------------------------ log-space
LOGSPACE = [refattn.logsumexp, refattn.softmax, refattn.log_softmax]


def _logspace_identical(fn, x, where, out_dtype):
    __tracebackhide__ = True
    saved = config.EXACT_ENGINE
    try:
        config.EXACT_ENGINE = "fast"
        fast = np.asarray(fn(x, where=where, precision="exact", out_dtype=out_dtype), np.float64)
        config.EXACT_ENGINE = "referee"
        slow = np.asarray(fn(x, where=where, precision="exact", out_dtype=out_dtype), np.float64)
    finally:
        config.EXACT_ENGINE = saved
    same = ((fast == slow) & (np.signbit(fast) == np.signbit(slow))) | (
        np.isnan(fast) & np.isnan(slow)
    )
    assert same.all(), (
        fn.__name__,
        out_dtype,
        np.argwhere(~same)[0],
        fast[~same][0],
        slow[~same][0],
    )


@pytest.mark.parametrize("fn", LOGSPACE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@given(case=logspace_rows())
def test_fast_logspace_matches_referee(fn, out_dtype, case):
    x, where = case
    _logspace_identical(fn, x, where, out_dtype)


@pytest.mark.parametrize("fn", LOGSPACE, ids=lambda f: f.__name__)
def test_fast_logspace_hard_rows(fn):
    x = np.array(
        [
            [0.0, 0.0, 0.0, 0.0],  # weights exactly 1/4, lse = log 4
            [1.0, np.nan, 2.0, 3.0],  # NaN: the referee
            [np.inf, 0.0, 1.0, 2.0],  # +inf: the referee
            [-1e5, 1e5, 0.0, 5.0],  # far beyond CUT
            [0.0, -700.0, -60.0, -745.5],  # logit gaps to the underflow range
            [5e-324, -5e-324, 0.0, 2.0**-1074],
        ]
    )  # subnormals
    for out_dtype in OUT_DTYPES:
        _logspace_identical(fn, x, None, out_dtype)


@pytest.mark.parametrize("out_dtype", ["float64", "bfloat16"])
def test_one_by_one_plane_with_bias(out_dtype):
    """A (1, 1) plane: the bias array has the shape of the kernels' 'no bias' placeholder."""
    q, k, v = _gaussian(7, length=1, keys=1, dim=2, vdim=2)
    _assert_identical(q, k, v, out_dtype, bias=np.array([[0.75]]))


def test_kernel_bodies_run_without_jit():
    """NUMBA_DISABLE_JIT=1: the first-step kernels run as Python (coverage of their bodies)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", PYTHONPATH=str(root))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(root / "tests" / "exact" / "test_fast_exact.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "-x",
        "-k",
        "midpoint or one_by_one or (hard_rows and softmax) or row_spec",
    ]
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"NUMBA_DISABLE_JIT=1 tier failed:\n{done.stdout[-3000:]}"


def _row_facts(x):
    """(ok, norms, scales) of the rows of a 2-D float64 array by the compiled pass."""
    ok, norms, scales = np.empty(len(x), bool), np.empty(len(x)), np.empty(len(x))
    x = frozen(x)  # as the engine passes it (one compiled specialisation)
    facts.row_facts(x, x.view(np.int64), norms, scales, ok)
    return ok, norms, scales


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_exactness_scales_claim_is_true(dtype):
    """Where sq_i sk_j < 2**52, the fma chain of q_i . k_j equals the exact sum."""
    from fractions import Fraction

    rng = np.random.default_rng(9)
    q = rng.standard_normal((3, 32)).astype(dtype).astype(np.float64)
    k = rng.standard_normal((4, 32)).astype(dtype).astype(np.float64)
    q[0] *= 2.0**-12  # a wide range across rows
    sq, sk = _row_facts(q)[2], _row_facts(k)[2]
    claims = 0
    for a, s_a in zip(q, sq, strict=True):
        for b, s_b in zip(k, sk, strict=True):
            chain = 0.0
            for x, y in zip(a, b, strict=True):
                chain = float(Fraction(x) * Fraction(y) + Fraction(chain))  # fma
            exact = sum(Fraction(x) * Fraction(y) for x, y in zip(a, b, strict=True))
            if s_a * s_b < 2.0**52:
                claims += 1
                assert Fraction(chain) == exact
    assert (claims > 0) == (dtype != np.float64)


def test_scores_far_beyond_exp_domain_match_the_referee():
    """float32 q, k ~ 1e20: score gaps ~1e40 leave exp's domain (once an out-of-bounds
    table index); the fast engine hands such terms on and agrees with the referee."""
    from refattn import config

    rng = np.random.default_rng(0)
    q = (rng.standard_normal((2, 3)) * 1e20).astype(np.float32)
    k = (rng.standard_normal((3, 3)) * 1e20).astype(np.float32)
    v = rng.standard_normal((3, 3)).astype(np.float32)
    fast = refattn.attention(q, k, v, precision="exact", return_lse=True)
    saved = config.EXACT_ENGINE
    config.EXACT_ENGINE = "referee"
    try:
        referee = refattn.attention(q, k, v, precision="exact", return_lse=True)
    finally:
        config.EXACT_ENGINE = saved
    for got, want in zip(fast, referee, strict=True):
        assert got.tobytes() == want.tobytes()


def _option_specs():
    """Specs of every option that shapes the allowed set, sinks folded as the exact path does."""
    from refattn.spec import canonicalize, fold

    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 9, 3), (2, 2, 13, 3), (2, 2, 13, 2)))
    bias = rng.standard_normal((2, 4, 9, 13))
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    mask = rng.random((9, 13)) < 0.7
    drop = rng.random((2, 4, 9, 13)) < 0.6
    options = [
        {},
        dict(causal=True),
        dict(causal=True, align="bottom_right"),
        dict(window=(2, 1)),
        dict(window=(None, 0), align="bottom_right"),
        dict(window=(3, None), causal=True),
        dict(kv_lengths=np.array([13, 4])),
        dict(kv_lengths=np.array([0, 7]), causal=True, align="bottom_right"),
        dict(mask=mask),
        dict(mask=mask[None, None, :1]),
        dict(bias=bias),
        dict(bias=bias[0, 0]),
        dict(bias=bias[:, :1]),
        dict(dropout_mask=drop, dropout_p=0.5),
        dict(sinks=np.array([0.5, -1.0, 2.0, 0.0]), causal=True, mask=mask, bias=bias),
        dict(
            sinks=np.array([0.5, -1.0, 2.0, 0.0]),
            kv_lengths=np.array([3, 13]),
            dropout_mask=drop,
            dropout_p=0.25,
            window=(4, 0),
        ),
    ]
    for opts in options:
        spec = canonicalize(q, k, v, **opts)
        yield opts, spec if spec.sinks is None else fold(spec, alibi_into_bias=False)


def test_allowed_rule_is_spec_allowed():
    """The kernels' allowed set (key intervals + compact mask, bias, dropout mask) is the one
    rule of AttentionSpec.allowed, on every plane of every option that shapes it."""
    for opts, spec in _option_specs():
        rule = allowed_set.allowed_rule(spec)
        batch, heads, _, _, keys, _, _ = spec.dims
        for b in range(batch):
            for h in range(heads):
                allowed, kept = allowed_set.rule_allowed(rule, b, h, keys)
                want = spec.allowed(b, h)
                assert np.array_equal(allowed, want), (sorted(opts), b, h)
                want_kept = want if spec.dropout_mask is None else want & spec.dropout_mask[b, h]
                assert np.array_equal(kept, want_kept), (sorted(opts), b, h)
        for part in (rule.mask, rule.bias, rule.keep):  # never larger than what was passed
            assert part.size <= max(1, spec.q.shape[0] * spec.q.shape[1] * spec.q.shape[2] * keys)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, ml_dtypes.bfloat16])
def test_row_facts_scales_are_exactness_scales(dtype):
    """The compiled row pass gives exactness_scales of its own norms, and flags out-of-range
    rows (the planes those rows belong to go to the referee)."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((1, 2, 7, 16)).astype(dtype).astype(np.float64)
    x[0, 0, 1] *= 2.0**-30
    x[0, 0, 2] = 0.0
    x[0, 1, 3, 4] = 2.0**-1070  # a subnormal: out of range
    x[0, 1, 4, 5] = np.inf
    flat = x.reshape(-1, 16)
    ok, norms, scales = _row_facts(flat)
    assert ok.tolist() == [i not in (10, 11) for i in range(14)]
    finite = np.isfinite(flat).all(axis=1)
    assert np.array_equal(scales[finite], FA.exactness_scales(flat[finite], norms[finite]))
    assert (norms[finite] >= np.sqrt((flat[finite] ** 2).sum(axis=1))).all()


def test_bits_do_not_depend_on_thread_count():
    """The same bytes with NUMBA_NUM_THREADS=1 and 2 (rows run in parallel over every plane)."""
    root = Path(__file__).resolve().parents[2]
    code = (
        "import numpy as np, ml_dtypes, refattn, hashlib\n"
        "rng = np.random.default_rng(3)\n"
        "q, k, v = (rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in "
        "((2, 4, 33, 16), (2, 2, 70, 16), (2, 2, 70, 8)))\n"
        "h = hashlib.sha256()\n"
        "for od in ('float64', 'float32', 'bfloat16'):\n"
        "    for r in refattn.attention(q, k, v, precision='exact', out_dtype=od, causal=True,\n"
        "                               return_lse=True, return_weights=True,\n"
        "                               kv_lengths=np.array([70, 41]), align='bottom_right'):\n"
        "        h.update(np.ascontiguousarray(r).tobytes())\n"
        "print(h.hexdigest())\n"
    )
    digests = []
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads, PYTHONPATH=str(root))
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        digests.append(done.stdout.split()[-1])
    assert digests[0] == digests[1]


@pytest.mark.parametrize("out_dtype", ["float64", "bfloat16"])
def test_no_keys_no_values_and_out_of_range_bias_rows(out_dtype):
    """S = 0 and E = 0 planes; a bias value outside [SAFE_MIN, SAFE_MAX] at an allowed
    position sends its row (only) to the referee."""
    rng = np.random.default_rng(13)
    for shapes in (
        ((3, 2), (0, 2), (0, 2)),
        ((3, 2), (4, 2), (4, 0)),
        ((1, 2, 3, 2), (1, 2, 0, 2), (1, 2, 0, 3)),
    ):
        _assert_identical(*(rng.standard_normal(s) for s in shapes), out_dtype)
    q, k, v = (rng.standard_normal(s) for s in ((3, 4), (5, 4), (5, 2)))
    bias = rng.standard_normal((3, 5))
    bias[2, 0], bias[0, 1], bias[1, 3] = 1e300, -np.inf, 2.0**-1070
    stats = _assert_identical(q, k, v, out_dtype, bias=bias)
    assert stats["referee_rows"] == 2


SINK_OPTIONS = [
    {},
    {"causal": True},
    {"causal": True, "align": "top_left"},
    {"window": (2, 1)},
    {"softcap": 2.5},
    {"alibi_slopes": np.array([0.5, 0.25, 0.125, 1 / 16])},
    {"kv_lengths": np.array([0, 5])},
    {"dropout_p": 0.25},
    {"bias": np.linspace(-1.0, 1.0, 9)},
    {"gqa": "interleave"},
]


@pytest.mark.parametrize("out_dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("sink_scale", [1.0, 60.0, -60.0, 1e-310])
@pytest.mark.parametrize("opts", SINK_OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_native_sinks_match_the_folded_referee(opts, sink_scale, out_dtype):
    """The first steps take the sink as one more logit (max and Z, no value); the referee folds
    it into one more key. Sinks far above the scores (keys' weights ~e^-60), far below, and
    subnormal; rows with no allowed key (kv_lengths 0, masked rows) hold the sink alone."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 6, 8))
    k = rng.standard_normal((2, 2, 9, 8))
    v = rng.standard_normal((2, 2, 9, 5))
    opts = dict(opts)
    if opts.pop("dropout_p", None):
        opts.update(dropout_p=0.25, dropout_mask=rng.random((2, 4, 6, 9)) < 0.75)
    mask = rng.random((2, 4, 6, 9)) < 0.7
    mask[:, :, 0] = False  # rows with no allowed key: the sink alone
    sinks = rng.standard_normal(4) * sink_scale
    _assert_identical(q, k, v, out_dtype, sinks=sinks, mask=mask, **opts)


def test_native_sinks_never_fold_in_the_first_steps(monkeypatch):
    """A call the first steps decide entirely never builds the folded (L, S + 1) arrays."""
    import refattn.exact.attention as EA

    def no_fold(*args, **kwargs):
        raise AssertionError("fold called")

    monkeypatch.setattr(EA, "fold", no_fold)
    q, k, v = _gaussian(3)
    sinks = np.array([0.5, -1.0])
    out, lse, weights = refattn.attention(
        q, k, v, precision="exact", sinks=sinks, return_lse=True, return_weights=True
    )
    assert FA.fallback_stats()["referee_rows"] == 0
    assert weights.shape == q.shape[:-1] + (k.shape[-2],)
    monkeypatch.undo()
    ref = exact_result("referee", q, k, v, sinks=sinks)
    for a, b in zip((out, lse, weights), ref, strict=True):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("out_dtype", ["float64", "bfloat16"])
def test_sink_rows_left_to_the_referee_with_a_broadcast_bias(out_dtype):
    """A row the first steps leave to the referee (a bias value below SAFE_MIN) is folded
    alone, with a bias broadcast over the batch."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    bias = rng.standard_normal((1, 3, 5, 5))
    bias[0, 1, 2, 3] = 2.0**-700
    stats = _assert_identical(q, k, v, out_dtype, bias=bias, sinks=np.array([0.5, -2.0, 1.0]))
    assert stats["referee_rows"] == 2  # row 2 of head 1 in both batch rows
