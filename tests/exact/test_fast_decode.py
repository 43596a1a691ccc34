"""The decode step of the fast exact forward (refattn.exact.fast.decode): k and v read in place
from bfloat16, float16, float32 and float64, bit-identical to the referee engine
(refattn.exact.attention) on small decode cases, its facts equal to the dense step's, bad
inputs sent to the referee, and no bit depending on the thread count."""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest
from hypothesis import given, settings

from refattn.exact.fast import decode as DEC
from refattn.exact.fast import decode_kernels as DK
from refattn.exact.fast import facts
from refattn.exact.fast import forward as FA
from refattn.exact.fast.doubledouble import gamma_up
from refattn.exact.fast.forward_kernels import OK, UNDECIDED
from refattn.exact.rounding import FORMATS
from refattn.spec import canonicalize
from tests.helpers import exact_result
from tests.strategies import attention_cases

IN_DTYPES = {
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
}
TARGETS = ["float32", "bfloat16", "float64"]


def _same_bits(a, b) -> np.ndarray:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a64 == b64) & (np.signbit(a64) == np.signbit(b64)) | (np.isnan(a64) & np.isnan(b64))


def _assert_identical(q, k, v, out_dtype, **opts):
    """The fast engine's (out, lse, weights) bit-identical to the referee's; its stats."""
    __tracebackhide__ = True
    fast = exact_result("fast", q, k, v, out_dtype, **opts)
    stats = FA.fallback_stats()
    slow = exact_result("referee", q, k, v, out_dtype, **opts)
    for name, a, b in zip(("out", "lse", "weights"), fast, slow, strict=True):
        assert a.dtype == b.dtype, name
        same = _same_bits(a, b)
        if not same.all():
            where = tuple(int(i) for i in np.argwhere(~same)[0])
            raise AssertionError(
                f"{name}{list(where)} ({out_dtype}, options {sorted(opts)}): fast "
                f"{np.asarray(a, np.float64)[where]!r} != referee "
                f"{np.asarray(b, np.float64)[where]!r}; fallback {stats}"
            )
    return stats


def _decode_problem(seed, dtype, *, batch=2, heads=4, kv_heads=2, length=1, keys=70, dim=16):
    """q (B, H, L, D), k (B, K, S, D), v (B, K, S, E) of ``dtype``: S crosses a SUM_BLOCK
    boundary, GQA groups of two heads."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, length, dim)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, keys, dim)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, keys, 7)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("out_dtype", TARGETS)
@pytest.mark.parametrize("in_dtype", list(IN_DTYPES))
def test_decode_matches_referee(in_dtype, out_dtype):
    q, k, v = _decode_problem(0, IN_DTYPES[in_dtype])
    stats = _assert_identical(q, k, v, out_dtype)
    # the decode step runs for targets of <= 24 bits (float64: the double-double step)
    assert stats["decode_rows"] == (stats["rows"] if out_dtype != "float64" else 0)


@pytest.mark.parametrize("in_dtype", list(IN_DTYPES))
def test_decode_decides_plain_rows_itself(in_dtype):
    """Gaussian decode rows need no later step: the decode step decides them all."""
    q, k, v = _decode_problem(1, IN_DTYPES[in_dtype], length=2, dim=5)
    stats = _assert_identical(q, k, v, "bfloat16")
    assert stats["decode_rows"] == stats["rows"] == 16
    assert stats["double_magnitude_rows"] == stats["referee_rows"] == 0


@pytest.mark.parametrize(
    "opts",
    [
        dict(causal=True, align="bottom_right"),
        dict(causal=True, window=(5, None), align="bottom_right"),
        dict(kv_lengths=np.array([70, 23])),
        dict(kv_lengths=np.array([0, 40]), causal=True, align="bottom_right"),
        dict(mask=np.arange(70) % 3 != 1),
        dict(bias=np.linspace(-3.0, 3.0, 70)),
        dict(softcap=5.0),
        dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
        dict(sinks=np.array([0.5, -1.0, 3.0, 40.0])),
        dict(dropout_p=0.25, dropout_mask=np.arange(3 * 70).reshape(3, 70) % 4 != 0),
    ],
    ids=lambda opts: "-".join(sorted(opts)),
)
@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32"])
def test_decode_options_match_referee(in_dtype, opts):
    q, k, v = _decode_problem(2, IN_DTYPES[in_dtype], length=3)
    stats = _assert_identical(q, k, v, "float32", **opts)
    assert stats["decode_rows"] == stats["rows"]


def test_large_groups_take_the_dense_steps():
    """More than GROUP_ROWS query rows per kv head: the dense first pass, not the decode step."""
    q, k, v = _decode_problem(6, np.float32, batch=1, heads=DEC.GROUP_ROWS + 1, kv_heads=1, keys=9)
    stats = _assert_identical(q, k, v, "float32")
    assert stats["decode_rows"] == 0 and stats["double_rows"] == stats["rows"]


@pytest.mark.parametrize(
    "where",
    ["nan k outside the interval", "inf v", "huge q", "nan q one head", "subnormal k"],
)
def test_bad_inputs_go_to_the_referee(where):
    dtype = np.float64 if where in ("huge q", "subnormal k") else np.float32
    q, k, v = _decode_problem(3, dtype, length=2)
    opts = {}
    if where == "nan k outside the interval":
        k[0, 1, 69, 2] = np.nan  # read by no row (key lengths 40): the plane still goes
        opts = dict(kv_lengths=np.array([40, 70]))
    elif where == "inf v":
        v[1, 0, 3, 1] = np.inf
    elif where == "huge q":
        q[0, 2, 1, 0] = 1e300
    elif where == "nan q one head":
        q[1, 3, 0, 4] = np.nan
    else:
        k[0, 0, 5, :] = 1e-310
    stats = _assert_identical(q, k, v, "float32", **opts)
    assert stats["referee_rows"] >= (4 if where != "huge q" and where != "nan q one head" else 2)


def _decode_status(spec, fmt, serial: bool):
    batch, heads, _, length, keys, _, vdim = spec.dims
    out = np.zeros((batch, heads, length, vdim))
    lse = np.zeros((batch, heads, length))
    weights = np.zeros((batch, heads, length, keys))
    status = np.full((batch, heads, length), UNDECIDED, np.int8)
    saved = DEC.SERIAL_ELEMENTS
    DEC.SERIAL_ELEMENTS = 2**62 if serial else -1
    try:
        results = (out, lse, weights, status)
        DEC.decode_first_step(spec, None, fmt, (True, True), results, FA.kernel_params)
    finally:
        DEC.SERIAL_ELEMENTS = saved
    return out, lse, weights, status


def test_results_do_not_depend_on_the_thread_count():
    q, k, v = _decode_problem(4, ml_dtypes.bfloat16, batch=3, kv_heads=4, length=2, keys=150)
    spec = canonicalize(q, k, v, causal=True, align="bottom_right")
    fmt = FORMATS["float32"]
    saved = numba.get_num_threads()
    runs = [_decode_status(spec, fmt, serial=True)]
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            runs.append(_decode_status(spec, fmt, serial=False))
    finally:
        numba.set_num_threads(saved)
    assert (runs[0][3] == OK).all()
    for run in runs[1:]:
        for a, b in zip(runs[0], run, strict=True):
            assert a.tobytes() == b.tobytes()


def _all_bits(dtype):
    """Every finite value of a 16-bit format, as (int16 bits, float64 values)."""
    bits = np.arange(-(2**15), 2**15, dtype=np.int64).astype(np.int16)
    with np.errstate(invalid="ignore"):  # the NaN patterns
        values = bits.view(dtype).astype(np.float64)
    keep = np.isfinite(values)
    return bits[keep], values[keep]


@numba.njit
def _widen_all(bits, kind, half, out):
    for n in range(bits.shape[0]):
        out[n] = DK.widen(bits[n], kind, half)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_widening_is_exact_on_every_16_bit_value(name):
    bits, values = _all_bits(IN_DTYPES[name])
    out = np.empty(values.shape)
    _widen_all(bits, DK.BF16 if name == "bfloat16" else DK.F16, DK.HALF_SCALES, out)
    assert out.tobytes() == values.tobytes()


@numba.njit
def _scales(bits, kind):
    ulp = np.empty(bits.shape[0], np.int64)
    exact = np.empty(bits.shape[0], np.int64)
    ok = np.empty(bits.shape[0], np.int64)
    for n in range(bits.shape[0]):
        good, ulp[n] = DK._bits_ulp(bits[n], kind)
        good2, exact[n] = DK._bits_facts(bits[n], kind)
        ok[n] = good and good2
    return ulp, exact, ok


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_exactness_scales_from_the_bits_are_the_dense_steps(name):
    """The lowest set bit read from the stored bits gives row_fact's exactness scale; the
    ulp bound is never above it (so its scale bounds the exact one from above)."""
    rng = np.random.default_rng(5)
    span = 10 if name == "float16" else 30  # inside the format's range
    rows = rng.standard_normal((200, 9)) * np.exp2(rng.integers(-span, span, (200, 1)))
    rows[::7, ::2] = 0.0
    rows[3] = 0.0
    rows[5, :] = float(ml_dtypes.finfo(IN_DTYPES[name]).smallest_subnormal) * 3
    stored = rows.astype(IN_DTYPES[name])
    kind = {"bfloat16": DK.BF16, "float16": DK.F16, "float32": DK.F32}[name]
    bits = stored.view(np.int32 if name == "float32" else np.int16)
    ulp, exact, ok = _scales(bits, kind)
    widened = stored.astype(np.float64)
    n = widened.shape[0]
    good, norms, scales = np.empty(n, bool), np.empty(n), np.empty(n)
    facts.row_facts(widened, widened.view(np.int64), norms, scales, good)
    assert ok.all() and good.all()
    assert np.array_equal(np.ldexp(norms, -exact), scales)
    assert (ulp <= exact).all()


@settings(max_examples=12)
@given(case=attention_cases(max_len=6, dtypes=("float32", "float16", "bfloat16")))
def test_decode_sweep_matches_referee(case):
    q, k, v, opts = case
    _assert_identical(q, k, v, "float32", **opts)


@numba.njit
def _dots(q, k):
    out = np.empty((k.shape[0], 3))
    for j in range(k.shape[0]):
        s, sab = DK._dot_mag(q, k[j])
        out[j, 0], out[j, 1], out[j, 2] = s, sab, DK._dot_error(sab, q.shape[0])
    return out


@pytest.mark.parametrize("dim", [3, 16, 37])
def test_running_dot_bound_holds(dim):
    """The lane dot products of the decode step are within their running error bound of the
    exact sum, and the gamma_D a-priori bound holds too."""
    from fractions import Fraction

    rng = np.random.default_rng(dim)
    width = -(-dim // 8) * 8
    q = np.zeros(width)
    k = np.zeros((40, width))
    q[:dim] = rng.standard_normal(dim).astype(np.float32)
    k[:, :dim] = (rng.standard_normal((40, dim)) * np.exp2(rng.integers(-8, 8, (40, 1)))).astype(
        np.float32
    )
    k[5, :dim] = -k[4, :dim] * (1 + 2.0**-20)  # a cancelling row
    gamma = gamma_up(dim)
    for row, (s, _, bound) in zip(k, _dots(q, k), strict=True):
        exact = sum(Fraction(a) * Fraction(b) for a, b in zip(q, row, strict=True))
        error = abs(Fraction(s) - exact)
        assert error <= Fraction(bound)
        assert error <= Fraction(gamma) * sum(
            abs(Fraction(a) * Fraction(b)) for a, b in zip(q, row, strict=True)
        )
