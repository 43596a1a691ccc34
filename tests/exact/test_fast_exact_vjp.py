"""The fast exact VJP (double-double first step + referee fallback) is bit-identical to the
referee (the arbitrary-precision Ziv loop) on every option, dtype and hard input."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import mpmath
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import refattn
from oracle import catalogue
from oracle.catalogue.attention import make_inputs
from oracle.fixtures.golden import call_options
from refattn import config
from refattn.exact.attention_vjp import exact_vjp
from refattn.exact.fast.doubledouble import EXP_FAST_REL, exp_dd_fast
from refattn.exact.fast.rounding_decision import round_decision
from refattn.exact.rounding import FORMATS, round_exact
from refattn.spec import canonicalize, check_cotangent
from tests.helpers import assert_same_bits, vjp_problem
from tests.strategies import attention_cases

OUT_DTYPES = ("float64", "float32", "float16", "bfloat16")


def _both(q, k, v, grad_out, grad_lse=None, out_dtype="float64", **opts):
    """(fast grads, referee grads, fast stats) of one call (flat layout)."""
    spec = canonicalize(q, k, v, **opts)
    _, heads, _, length, _, _, vdim = spec.dims
    do = check_cotangent(spec, grad_out, "grad_out", (heads, length, vdim))
    gl = None if grad_lse is None else check_cotangent(spec, grad_lse, "grad_lse", (heads, length))
    fmt = FORMATS[out_dtype]
    stats = {}
    fast = exact_vjp(spec, do, gl, fmt.dtype, engine="fast", stats=stats)
    referee = exact_vjp(spec, do, gl, fmt.dtype, engine="referee")
    return fast, referee, stats


def _assert_identical(fast, referee, case):
    __tracebackhide__ = True
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), fast, referee, strict=True):
        if b is None:
            assert a is None, f"{name}: fast path returned a dbias without bias ({case})"
            continue
        assert_same_bits(a, b, what=name, case=case, check_dtype=True)


_problem = vjp_problem


OPTION_CASES = {
    "plain": {},
    "causal-top-left": {"causal": True},
    "causal-bottom-right": {"causal": True, "align": "bottom_right"},
    "window": {"window": (1, 2)},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi_slopes": np.array([0.5, 0.25])},
    "gqa-tile": {"gqa": "tile", "kv_heads": 1},
    "dropout": {"dropout_p": 0.25, "dropout": True},
    "mask-empty-rows": {"mask": True},
    "bias-full": {"bias": (1, 2, 5, 6)},
    "bias-broadcast": {"bias": (5, 6)},
    "bias-heads": {"bias": (2, 1, 6)},
    "scale-negative": {"scale": -0.3},
    "everything": {
        "causal": True,
        "softcap": 30.0,
        "alibi_slopes": np.array([0.5, 0.125]),
        "bias": (5, 6),
        "dropout_p": 0.5,
        "dropout": True,
        "mask": True,
    },
}


def _options(rng, spec_opts, heads=2, length=5, keys=6):
    opts = dict(spec_opts)
    kv_heads = opts.pop("kv_heads", 2)
    if opts.pop("dropout", False):
        opts["dropout_mask"] = rng.random((heads, length, keys)) < 0.7
    if opts.get("mask") is True:
        mask = rng.random((heads, length, keys)) < 0.7
        mask[0, 1] = False  # an empty row
        opts["mask"] = mask
    if isinstance(opts.get("bias"), tuple):
        bias = rng.standard_normal(opts["bias"])
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        opts["bias"] = bias
    return kv_heads, opts


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("name", sorted(OPTION_CASES))
def test_fast_matches_referee_on_every_option(name, out_dtype):
    rng = np.random.default_rng(7)
    kv_heads, opts = _options(rng, OPTION_CASES[name])
    _, q, k, v, do, gl = _problem(seed=len(name), kv_heads=kv_heads)
    for grad_lse in (None, gl):
        fast, referee, _ = _both(q, k, v, do, grad_lse, out_dtype, **opts)
        _assert_identical(fast, referee, f"{name}, {out_dtype}, grad_lse={grad_lse is not None}")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_low_precision_inputs(dtype):
    cast = np.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
    _, q, k, v, do, gl = _problem(seed=3)
    q, k, v = (a.astype(cast) for a in (q, k, v))
    fast, referee, _ = _both(q, k, v, do, gl, dtype, causal=True)
    _assert_identical(fast, referee, dtype)


@given(
    case=attention_cases(dtypes=("float64", "float32", "float16", "bfloat16")),
    out_dtype=st.sampled_from(OUT_DTYPES),
    with_lse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fast_matches_referee_hypothesis(case, out_dtype, with_lse, seed):
    q, k, v, opts = case
    rng = np.random.default_rng(seed)
    do = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    gl = rng.standard_normal(q.shape[:-1]) if with_lse else None
    fast, referee, _ = _both(q, k, v, do, gl, out_dtype, **opts)
    _assert_identical(fast, referee, f"{sorted(opts)}, {out_dtype}")


def test_ties_fall_back_to_the_referee():
    """Equal scores give rational weights 1/n: gradients on rounding midpoints are settled by
    the referee's exact tie handling, and the fast step must leave them undecided."""
    q = np.zeros((1, 1, 2, 2))
    k = np.zeros((1, 1, 2, 2))
    v = np.array([[[[1.0], [2.0]]]])
    # dv_j = (1 + (1 + 2**-10)) / 2 = 1 + 2**-11: the midpoint of two float16 neighbours
    do = np.array([[[[1.0], [1.0 + 2.0**-10]]]])
    fast, referee, stats = _both(q, k, v, do, None, "float16")
    _assert_identical(fast, referee, "ties")
    assert stats["referee"] > 0
    assert stats["fast"] + stats["referee"] == stats["elements"]


@pytest.mark.parametrize("kind", ["cancelling", "logit-gap", "duplicated-keys"])
def test_hard_inputs(kind):
    rng, q, k, v, do, gl = _problem(seed=11)
    if kind == "cancelling":  # dO_i . v_j equal for all j: dS cancels to (nearly) zero
        v = np.broadcast_to(v[:, :, :1], v.shape).copy()
        v[..., 0, 0] += 2.0**-40
    elif kind == "logit-gap":
        q = q * 300.0
    else:
        k[:, :, 1:] = k[:, :, :1]
    for out_dtype in ("float64", "bfloat16"):
        fast, referee, _ = _both(q, k, v, do, gl, out_dtype, bias=rng.standard_normal((5, 6)))
        _assert_identical(fast, referee, f"{kind}, {out_dtype}")


def test_random_gaussian_is_decided_by_the_first_step():
    _, q, k, v, do, gl = _problem(seed=5, length=12, keys=16, dim=8, vdim=8)
    fast, referee, stats = _both(q, k, v, do, gl, "float64", causal=True, softcap=5.0)
    _assert_identical(fast, referee, "gaussian")
    assert stats["referee"] == 0 and stats["fast"] == stats["elements"]


@pytest.mark.parametrize("with_lse", [False, True])
def test_single_key_rows_are_exact(with_lse):
    """Causal row 0 has one allowed key: weight 1, dS = g exactly (0 without grad_lse), so the
    fast step decides it (an enclosure of a cancellation would not)."""
    rng, q, k, v, do, gl = _problem(seed=6, length=6, keys=6)
    fast, referee, stats = _both(
        q,
        k,
        v,
        do,
        gl if with_lse else None,
        "float64",
        causal=True,
        bias=rng.standard_normal((6, 6)),
        dropout_p=0.5,
        dropout_mask=rng.random((2, 6, 6)) < 0.6,
    )
    _assert_identical(fast, referee, f"single key, grad_lse={with_lse}")
    assert stats["referee"] == 0


def test_nonfinite_inputs_use_the_referee():
    _, q, k, v, do, gl = _problem(seed=2)
    q[0, 0, 1, 0] = np.nan
    v[0, 1, 2, 1] = np.inf
    grads = {}
    for engine in ("fast", "referee"):
        old = config.EXACT_VJP_ENGINE
        config.EXACT_VJP_ENGINE = engine
        try:  # the float64 path (which supplies the NaN/Inf pattern) warns on NaN products
            with np.errstate(invalid="ignore"):
                grads[engine] = refattn.attention_vjp(q, k, v, do, grad_lse=gl, precision="exact")
        finally:
            config.EXACT_VJP_ENGINE = old
    for name, a, b in zip(("dq", "dk", "dv"), grads["fast"], grads["referee"], strict=False):
        assert_same_bits(a, b, what=name)


def test_public_dispatch_uses_the_fast_engine(monkeypatch):
    _, q, k, v, do, gl = _problem(seed=4)
    fast = refattn.attention_vjp(q, k, v, do, grad_lse=gl, precision="exact", causal=True)
    monkeypatch.setattr(config, "EXACT_VJP_ENGINE", "referee")
    referee = refattn.attention_vjp(q, k, v, do, grad_lse=gl, precision="exact", causal=True)
    for name, a, b in zip(("dq", "dk", "dv"), fast, referee, strict=False):
        assert_same_bits(a, b, what=name)


def test_engine_is_validated():
    spec = canonicalize(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 1)))
    with pytest.raises(ValueError, match="engine"):
        exact_vjp(spec, np.zeros((1, 1, 1, 1)), None, np.dtype("float64"), engine="quick")


def test_exp_dd_fast_within_its_bound():
    rng = np.random.default_rng(0)
    xs = np.concatenate([-rng.random(300) * 620, rng.standard_normal(100) * 1e-3, [0.0, 1.0]])
    with mpmath.workprec(300):
        for x in xs:
            h, lo = exp_dd_fast(float(x), 0.0)
            truth = mpmath.exp(mpmath.mpf(float(x)))
            assert abs(mpmath.mpf(h) + mpmath.mpf(lo) - truth) <= EXP_FAST_REL * truth, x


def test_round_decision_ties_zeros_and_overflow():
    f64, f16 = FORMATS["float64"], FORMATS["float16"]

    def decide(h, lo, err, fmt):
        return round_decision(h, lo, err, fmt.p, fmt.emin, float(fmt.max_finite))

    assert decide(1.0, 2.0**-60, 0.0, f64) == (1.0, True)
    assert decide(1.0, 2.0**-53, 0.0, f64)[1] is False  # a tie: the referee settles it
    assert decide(1.0, 2.0**-60, 2.0**-54, f64)[1] is False  # the interval reaches a midpoint
    assert decide(0.0, 0.0, 0.0, f16) == (0.0, True)
    assert decide(0.0, 0.0, 2.0**-80, f16)[1] is False
    value, ok = decide(-(2.0**-30), 0.0, 0.0, f16)  # underflows to -0 in float16
    assert ok and value == 0.0 and math.copysign(1.0, value) < 0
    assert decide(70000.0, 0.0, 0.0, f16)[1] is False  # overflow: left to the referee


@pytest.mark.parametrize("fmt", ["float64", "float32", "float16", "bfloat16"])
def test_round_decision_is_sound_near_midpoints_and_powers_of_two(fmt):
    """A decision is the rounding of both ends of the enclosure, computed exactly: values a
    hair (beyond the float64 precision of their distance) from a midpoint, and values just
    beyond a power of two (where the spacing doubles)."""
    fmt = FORMATS[fmt]
    rng = np.random.default_rng(7)
    decided = 0
    for _ in range(3000):
        exponent = int(rng.integers(fmt.emin - 3, 6))
        mant = (
            1 << (fmt.p - 1)
            if rng.random() < 0.4
            else int(rng.integers(1 << (fmt.p - 1), 1 << fmt.p))
        )
        y = math.ldexp(float(mant), exponent - fmt.p + 1) * (1 if rng.random() < 0.5 else -1)
        spacing = math.ldexp(1.0, max(exponent, fmt.emin) - fmt.p + 1)
        where = rng.integers(4)
        step = (0.5, -0.5, -0.25, 0.75)[where] if fmt.p < 53 else (0.5, -0.5, 0.0, 0.0)[where]
        hi = y + step * spacing
        lo = float(rng.choice([1.0, -1.0])) * math.ldexp(
            abs(hi) if hi else spacing, -int(rng.integers(54, 120))
        )
        err = math.ldexp(abs(lo), -int(rng.integers(0, 40))) if rng.random() < 0.8 else 0.0
        value, ok = round_decision(hi, lo, err, fmt.p, fmt.emin, float(fmt.max_finite))
        if not ok:
            continue
        decided += 1
        x = Fraction(hi) + Fraction(lo)  # rounding is monotone: both ends settle it
        for end in (x - Fraction(err), x + Fraction(err)):
            want = round_exact(end, fmt)
            assert want == value and math.copysign(1, want) == math.copysign(1, value), (
                hi,
                lo,
                err,
                value,
                want,
            )
    assert decided > 1000


def test_round_decision_hair_from_a_midpoint():
    """1 + 2**-24 is the float32 midpoint of 1 and 1 + 2**-23: 2**-90 beyond it decides."""
    f32, bf16 = FORMATS["float32"], FORMATS["bfloat16"]

    def decide(h, lo, err, fmt):
        return round_decision(h, lo, err, fmt.p, fmt.emin, float(fmt.max_finite))

    mid = 1.0 + 2.0**-24
    assert decide(mid, 2.0**-90, 2.0**-100, f32) == (1.0 + 2.0**-23, True)
    assert decide(mid, -(2.0**-90), 2.0**-100, f32) == (1.0, True)
    assert decide(mid, 2.0**-90, 2.0**-89, f32)[1] is False  # the enclosure holds the midpoint
    # beyond a power of two the spacing doubles: 1 + 0.7 2**-8 rounds to 1 in bfloat16
    assert decide(1.0 + 0.7 * 2.0**-8, 0.0, 2.0**-60, bf16) == (1.0, True)
    assert decide(-1.0 - 0.7 * 2.0**-8, 0.0, 2.0**-60, bf16) == (-1.0, True)


@pytest.mark.parametrize("dtype", ["f64", "f32", "f16", "bf16"])
def test_logit_gap_cases_are_decided_by_the_first_step(dtype):
    """The grad-gap catalogue cases (weights ~1, ~e^-64 and ~e^-128 in every row, sums of a
    few inputs a hair from rounding midpoints): dP - Delta in the reference-key form and the
    top weight as 1 - tau keep the enclosures relative, so no element reaches the referee."""
    case = catalogue.get(f"grad-gap-H2K2-L8S12-D16E16-{dtype}")
    inputs = make_inputs(case)
    spec = canonicalize(inputs["q"], inputs["k"], inputs["v"], **call_options(case, inputs))
    _, heads, _, length, _, _, vdim = spec.dims
    do = check_cotangent(spec, inputs["grad_out"], "grad_out", (heads, length, vdim))
    for out_dtype in dict.fromkeys([case.dtype, "float64"]):
        stats = {}
        exact_vjp(spec, do, None, FORMATS[out_dtype].dtype, engine="fast", stats=stats)
        assert stats["referee"] == 0 and stats["fast"] == stats["elements"], (out_dtype, stats)


@pytest.mark.xslow
@pytest.mark.parametrize("dtype", ["f64", "bf16"])
def test_logit_gap_cases_match_the_referee(dtype):
    case = catalogue.get(f"grad-gap-H2K2-L8S12-D16E16-{dtype}")
    inputs = make_inputs(case)
    fast, referee, _ = _both(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        inputs["grad_out"],
        None,
        case.dtype,
        **call_options(case, inputs),
    )
    _assert_identical(fast, referee, case.name)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_fast_matches_referee_larger(seed):
    rng, q, k, v, do, gl = _problem(
        seed=seed, heads=4, kv_heads=2, length=24, keys=20, dim=8, vdim=6, batch=2
    )
    opts = [
        {},
        {"causal": True, "align": "bottom_right", "softcap": 2.0},
        {"bias": rng.standard_normal((4, 24, 20)), "alibi_slopes": np.arange(1, 5) / 8},
        {"dropout_mask": rng.random((2, 4, 24, 20)) < 0.8, "dropout_p": 0.2, "window": (3, 1)},
    ][seed]
    for out_dtype in ("float64", "float32"):
        fast, referee, stats = _both(q, k, v, do, gl, out_dtype, **opts)
        _assert_identical(fast, referee, f"seed {seed}, {out_dtype}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(
    "opts",
    [{}, {"causal": True, "softcap": 4.0}, {"dropout_p": 0.5}],
    ids=["plain", "causal-softcap", "dropout"],
)
def test_enclosures_hold_the_exact_gradients(dtype, opts):
    """Every fast enclosure (hi + lo, radius) holds the referee's 300-bit interval: the
    running bounds of the compensated sums (scores, dp, sigma, D) are sound, also where they
    are far below the a-priori dot_bound (70 keys cross the 64-key block)."""
    from refattn.exact.attention_vjp import ExactVJP
    from refattn.exact.fast import vjp as fast_vjp

    rng = np.random.default_rng(41)
    q, k, v = (rng.standard_normal((1, 2, n, 8)).astype(dtype) for n in (6, 70, 70))
    do = rng.standard_normal((1, 2, 6, 8)).astype(dtype)
    gl = rng.standard_normal((1, 2, 6))
    opts = dict(opts)
    if opts.pop("dropout_p", None):
        opts.update(dropout_p=0.5, dropout_mask=rng.random((1, 2, 6, 70)) < 0.5)
    spec = canonicalize(q, k, v, **opts)
    d = check_cotangent(spec, do, "grad_out", (2, 6, 8))
    g = check_cotangent(spec, gl, "grad_lse", (2, 6))
    encl = dict(zip(("dq", "dk", "dv"), fast_vjp.gradient_enclosures(spec, d, g)[:3], strict=True))
    ref = ExactVJP(spec, d, g).at(300)
    for name, enc in encl.items():
        lows, highs = ref[name]
        for ix in np.ndindex(enc.shape[1:]):
            lo, hi = Fraction(*lows[ix]), Fraction(*highs[ix])
            mid = Fraction(float(enc[(0, *ix)])) + Fraction(float(enc[(1, *ix)]))
            rad = Fraction(float(enc[(2, *ix)]))
            assert mid - rad <= lo and hi <= mid + rad, (name, ix, float(mid), float(rad))


def test_vjp_kernel_bodies_run_without_jit():
    """NUMBA_DISABLE_JIT=1: the vjp's kernels (passes A, B, C, the row pieces, the allowed set)
    run as Python on small cases (coverage of their bodies), still bit-identical to the
    referee: every option at once, a bias broadcast over heads (pass C), ties, single-key
    rows, and sinks with empty rows and a bias broadcast along the keys."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", PYTHONPATH=str(root))
    selection = (
        "ties or single_key or (every_option and float64 and (everything or bias-heads))"
        " or (with_sinks and float64 and (everything or bias_rows or kv_lengths_empty))"
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(root / "tests" / "exact" / "test_fast_exact_vjp.py"),
        str(root / "tests" / "exact" / "test_exact_vjp_sinks.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:benchmark",
        "-x",
        "-k",
        selection,
    ]
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"NUMBA_DISABLE_JIT=1 tier failed:\n{done.stdout[-3000:]}"
    assert " passed" in done.stdout and " deselected" in done.stdout, done.stdout[-3000:]
