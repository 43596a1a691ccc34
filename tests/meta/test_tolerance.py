"""The tolerance policy (oracle.judging.tolerance): errors, scales, floors, thresholds; and the
textbook baseline it compares against (oracle.reading.baseline)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from oracle.judging import tolerance as tol
from oracle.reading import baseline
from refattn.exact.rounding import format_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.naive.attention import naive_attention  # noqa: E402
from tests.naive.rounding import to_float_array  # noqa: E402


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


def test_normalised_error_special_values():
    value = np.array([np.nan, np.nan, 1.0, np.inf, -np.inf, 2.0, 0.0])
    truth = np.array([np.nan, 1.0, np.nan, np.inf, np.inf, 2.0, 0.0])
    err = tol.normalised_error(value, truth, 1.0, "float32")
    assert err.tolist() == [0.0, math.inf, math.inf, 0.0, math.inf, 0.0, 0.0], err


def test_normalised_error_zero_scale_uses_smallest_normal():
    tiny = math.ldexp(1.0, -126)
    err = tol.normalised_error(np.float32(tiny / 4), 0.0, 0.0, "float32")
    assert err == 0.25, f"a quarter of the smallest normal over scale 0 gave {err}"


def test_cancelling_element_judged_by_natural_scale():
    """out = 0.5 * 1 + 0.5 * (-1 + 2**-20): |out| ~ 5e-7 but its natural scale is ~1, so an
    error of one float32 rounding of the terms is within u, not 2**20 u."""
    weights = np.array([[0.5, 0.5]])
    v = np.array([[1.0], [-1.0 + 2.0**-20]])
    scale = tol.output_scale(weights, v)
    truth = weights @ v
    value = truth + tol.unit_roundoff("float32")
    err = tol.normalised_error(value, truth, scale, "float32")
    assert scale[0, 0] == pytest.approx(1.0 - 2.0**-21, rel=tol.gamma(2)), scale
    u = tol.unit_roundoff("float32")
    assert err[0, 0] <= u / scale[0, 0] * (1 + tol.gamma(4)), (err, scale)
    relative = abs(value[0, 0] - truth[0, 0]) / abs(truth[0, 0])
    assert relative > 2**18 * u, relative  # what a relative-error rule would have judged


def test_probabilistic_gamma_below_worst_case_and_monotone():
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        values = [tol.probabilistic_gamma(n, dtype) for n in (1, 4, 64, 1024)]
        assert values == sorted(values), (dtype, values)
        n = 16  # n u < 1 in every format, so gamma_n is defined
        assert tol.probabilistic_gamma(n, dtype) < tol.gamma(8 * n, dtype), (dtype, n)
        assert tol.probabilistic_gamma(1024, "float32") < tol.gamma(1024, "float32")


@pytest.mark.parametrize("n", [256, 4096])
def test_probabilistic_gamma_bounds_float32_sums(rng, n):
    """Recursive float32 summation stays within (T3) relative to sum |x| (exact by fsum)."""
    bound = tol.probabilistic_gamma(n, "float32", count=20)
    for _ in range(20):
        x = rng.standard_normal(n).astype(np.float32)
        acc = np.float32(0)
        for term in x:  # recursive summation, the worst-ordered common algorithm
            acc = np.float32(acc + term)
        exact = math.fsum(float(t) for t in x)
        magnitude = math.fsum(abs(float(t)) for t in x)
        assert abs(float(acc) - exact) <= bound * magnitude, (n, float(acc), exact, bound)


def test_accumulation_dtype():
    assert [
        tol.accumulation_dtype(d).name for d in ("float64", "float32", "float16", "bfloat16")
    ] == ["float64", "float32", "float32", "float32"]


OPTION_SETS = {
    "plain": {},
    "causal-br": {"causal": True, "align": "bottom_right"},
    "window-tile": {"window": (1, 2), "gqa": "tile"},
    "softcap-alibi": {"softcap": 2.0, "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
    "empty-nan": {"mask": "empty", "empty_rows": "nan"},
    "bias-dropout": {"bias": "gaussian", "dropout": 0.25},
}


def _make(rng, options, dtype="float64"):
    H, K, L, S, D, E = 4, 2, 3, 6, 5, 3
    q = rng.standard_normal((H, L, D)).astype(dtype)
    k = rng.standard_normal((K, S, D)).astype(dtype)
    v = rng.standard_normal((K, S, E)).astype(dtype)
    options = dict(options)
    if options.get("mask") == "empty":
        mask = rng.random((H, L, S)) > 0.3
        mask[1, 0] = False
        options["mask"] = mask
    if options.get("bias") == "gaussian":
        options["bias"] = rng.standard_normal((H, L, S))
    if "dropout" in options:
        options["dropout_p"] = options.pop("dropout")
        options["dropout_mask"] = rng.random((H, L, S)) > options["dropout_p"]
    return q, k, v, options


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_textbook_float64_matches_naive(rng, name):
    q, k, v, options = _make(rng, OPTION_SETS[name])
    out, lse, weights = (to_float_array(x) for x in naive_attention(q, k, v, **options))
    result = baseline.textbook_attention(q, k, v, dtype="float64", **options)
    allowed = np.broadcast_to(result.allowed, result.weights.shape)
    magnitude = tol.score_magnitude(q, k, **options)
    floors = tol.forward_floors(
        "float64",
        D=5,
        S=6,
        L=3,
        E=3,
        G=2,
        magnitude=magnitude,
        allowed=allowed,
        n_stored=3,
        dropout=True,
    )
    dropped = weights
    if options.get("dropout_mask") is not None:
        dropped = np.where(options["dropout_mask"], weights, 0) / (1 - options["dropout_p"])
    err = tol.normalised_error(
        result.out, out, tol.output_scale(dropped, v, gqa=options.get("gqa")), "float64"
    )
    limit = floors["out"] + tol.unit_roundoff("float64")
    worst = np.unravel_index(np.argmax(err - limit), err.shape)
    assert np.all(err <= limit), (name, worst, result.out[worst], out[worst], limit[worst[:-1]])
    lerr = tol.normalised_error(result.lse, lse, tol.lse_scale(lse, weights, magnitude), "float64")
    assert np.all(lerr <= floors["lse"] + tol.unit_roundoff("float64")), (name, lerr.max())


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_textbook_half_types_round_to_dtype(rng, dtype):
    q, k, v, options = _make(rng, {}, dtype="float32")
    fmt_dtype = format_of(dtype).dtype
    result = baseline.textbook_attention(
        q.astype(fmt_dtype), k.astype(fmt_dtype), v.astype(fmt_dtype), **options
    )
    assert result.out.dtype == fmt_dtype and result.lse.dtype == fmt_dtype, result.out.dtype


def test_textbook_vjp_matches_refattn(rng):
    from refattn.attention import attention, attention_vjp

    q, k, v, options = _make(rng, OPTION_SETS["bias-dropout"])
    options.update(softcap=3.0, causal=True, align="bottom_right", gqa="tile")
    grad_out = rng.standard_normal((4, 3, 3))
    grad_lse = rng.standard_normal((4, 3))
    ours = baseline.textbook_attention_vjp(
        q, k, v, grad_out, grad_lse=grad_lse, dtype="float64", **options
    )
    theirs = attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, **options)
    _, _, weights = attention(q, k, v, return_lse=True, return_weights=True, **options)
    dropped = np.where(options["dropout_mask"], weights, 0) / (1 - options["dropout_p"])
    scales = tol.grad_scales(q, k, v, grad_out, weights, dropped, grad_lse=grad_lse, **options)
    magnitude = tol.score_magnitude(q, k, **options)
    floor = tol.forward_floors(
        "float64",
        D=5,
        S=6,
        L=3,
        E=3,
        G=2,
        magnitude=magnitude,
        allowed=np.ones(weights.shape, bool),
        n_stored=3,
        dropout=True,
    )["grad"]
    for i, name in enumerate(("dq", "dk", "dv", "dbias", "dsinks")):
        a, b = ours[i], theirs[i] if i < len(theirs) else None
        if a is None and b is None:  # no sinks here
            continue
        err = tol.normalised_error(a, b, scales[name], "float64")
        assert np.all(err <= 2 * floor), (
            name,
            np.unravel_index(err.argmax(), err.shape),
            err.max(),
            2 * floor,
        )


def test_textbook_sinks_and_kv_lengths_match_refattn(rng):
    """The baseline's sinks (lse includes the sink; dsinks) and per-row key lengths (each row
    aligned to its own length) agree with refattn's float64 path."""
    from refattn.attention import attention, attention_vjp

    q = rng.standard_normal((2, 4, 3, 5))
    k = rng.standard_normal((2, 2, 6, 5))
    v = rng.standard_normal((2, 2, 6, 3))
    grad_out = rng.standard_normal((2, 4, 3, 3))
    grad_lse = rng.standard_normal((2, 4, 3))
    options = dict(
        sinks=rng.standard_normal(4), kv_lengths=np.array([2, 6]), causal=True, align="bottom_right"
    )
    book = baseline.textbook_attention(q, k, v, dtype="float64", **options)
    out, lse, weights = attention(q, k, v, return_lse=True, return_weights=True, **options)
    magnitude = tol.score_magnitude(q, k, **options)
    floors = tol.forward_floors(
        "float64", D=5, S=6, L=3, E=3, G=2, magnitude=magnitude, allowed=book.allowed
    )
    scale = tol.output_scale(weights, v)
    assert np.all(tol.normalised_error(book.out, out, scale, "float64") <= floors["out"])
    assert np.all(
        tol.normalised_error(book.lse, lse, tol.lse_scale(lse, weights, magnitude), "float64")
        <= floors["lse"]
    )
    assert (book.out[0, :, 0] == 0).all(), "row 0 of batch 0 has no key (S_0 - L < 0): out 0"
    np.testing.assert_array_equal(book.lse[0, :, 0], options["sinks"])
    ours = baseline.textbook_attention_vjp(
        q, k, v, grad_out, grad_lse=grad_lse, dtype="float64", **options
    )
    theirs = attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, **options)
    scales = tol.grad_scales(
        q,
        k,
        v,
        grad_out,
        weights,
        weights,
        grad_lse=grad_lse,
        sink_weights=book.sink_weights,
        **options,
    )
    floor = tol.forward_floors(
        "float64", D=5, S=6, L=3, E=3, G=2, magnitude=magnitude, allowed=book.allowed
    )["grad"]
    for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsinks"), ours, theirs, strict=True):
        if a is None and b is None:
            continue
        err = tol.normalised_error(a, b, scales[name], "float64")
        assert np.all(err <= floor), (name, err.max(), floor)


def test_threshold_rule():
    t = tol.threshold(np.array([1e-7, 4e-7]), 1e-7, "float32")
    assert t.value == pytest.approx(
        tol.K_FORWARD * 4e-7 + tol.unit_roundoff("float32"), rel=tol.gamma(2)
    )
    void = tol.threshold(np.array([np.inf]), 3e-6, "float32", k=tol.K_BACKWARD)
    assert void.baseline is None and void.value == 3e-6 + tol.unit_roundoff("float32")
    assert "void" in void.formula()


def test_floor_grows_with_score_range_and_length():
    allowed = np.ones((1, 1, 4), bool)
    small = tol.forward_floors(
        "float16", D=8, S=4, L=1, E=8, G=1, magnitude=np.full((1, 1, 4), 1.0), allowed=allowed
    )
    large = tol.forward_floors(
        "float16", D=8, S=4, L=1, E=8, G=1, magnitude=np.full((1, 1, 4), 40.0), allowed=allowed
    )
    longer = tol.forward_floors(
        "float32", D=8, S=4096, L=1, E=8, G=1, magnitude=np.full((1, 1, 4), 1.0), allowed=allowed
    )
    shorter = tol.forward_floors(
        "float32", D=8, S=16, L=1, E=8, G=1, magnitude=np.full((1, 1, 4), 1.0), allowed=allowed
    )
    assert large["out"].max() > 10 * small["out"].max(), (small, large)
    assert longer["out"].max() > shorter["out"].max(), (shorter, longer)


def test_existing_helpers_unchanged():
    assert tol.unit_roundoff("float32") == 2.0**-24
    assert tol.ulp(1.0, "float16") == 2.0**-10
    assert tol.ulp_distance(1.0 + 2.0**-9, 1.0, "float16") == 2.0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_element_floor_covers_the_textbook_and_is_below_the_row_floor(rng, dtype):
    """(T6) bounds the error of the textbook algorithm it models (any seed), and is tighter
    than the per-row worst case (T5)."""
    from refattn.attention import attention

    store = format_of(dtype).dtype
    H, L, S, D, E = 2, 4, 256, 16, 8
    for sigma in (0.5, 2.0):
        q = (sigma * rng.standard_normal((H, L, D))).astype(store)
        k = (sigma * rng.standard_normal((H, S, D))).astype(store)
        v = rng.standard_normal((H, S, E)).astype(store)
        out, _, weights = attention(
            q, k, v, return_lse=True, return_weights=True, precision="exact"
        )
        base = baseline.textbook_attention(q, k, v)
        magnitude = tol.score_magnitude(q, k)
        floor = tol.output_floor(
            dtype,
            weights=weights,
            dropped=weights,
            magnitude=magnitude,
            dots=tol.scaled_dots(q, k),
            v=v,
            out=out,
            D=D,
            S=S,
            count=out.size,
        )
        err = tol.normalised_error(base.out, out, tol.output_scale(weights, v), dtype)
        limit = floor + tol.unit_roundoff(dtype)
        worst = np.unravel_index(np.argmax(err / limit), err.shape)
        assert np.all(err <= limit), (
            dtype,
            sigma,
            worst,
            base.out[worst],
            out[worst],
            limit[worst],
        )
        rows = tol.forward_floors(
            dtype,
            D=D,
            S=S,
            L=L,
            E=E,
            G=1,
            magnitude=magnitude,
            allowed=np.ones(weights.shape, bool),
            count=out.size,
        )["out"]
        assert np.all(floor <= rows), (dtype, sigma, float(floor.max()), float(rows.max()))
