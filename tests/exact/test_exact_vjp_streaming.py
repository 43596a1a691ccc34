"""The streaming exact VJP: allowed sets computed row by row (no (B, H, L, S) arrays), results
bit-identical to the referee, and independent of the thread count."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import refattn
from refattn.exact.attention_vjp import exact_vjp
from refattn.exact.fast import vjp as fast_vjp
from refattn.exact.fast.allowed_set import allowed_plane
from refattn.exact.rounding import FORMATS
from refattn.spec import canonicalize, check_cotangent, fold
from tests.helpers import assert_same_bits, vjp_problem


def _problem(seed=0, batch=2, heads=4, kv_heads=2, length=7, keys=9, dim=4, vdim=3):
    return vjp_problem(seed, heads, kv_heads, length, keys, dim, vdim, batch)


def _options(rng, length=7, keys=9, heads=4):
    bias = rng.standard_normal((heads, 1, keys))
    bias[1, 0, 2] = -np.inf
    return {
        "causal": {"causal": True},
        "causal_bottom_right": {"causal": True, "align": "bottom_right"},
        "window": {"window": (2, 1)},
        "window_left": {"window": (3, None), "align": "bottom_right"},
        "window_right": {"window": (None, 0)},
        "kv_lengths": {"kv_lengths": np.array([9, 4]), "causal": True, "align": "bottom_right"},
        "kv_lengths_window": {"kv_lengths": np.array([0, 6]), "window": (1, 1)},
        "mask": {"mask": rng.random((length, keys)) < 0.7},
        "mask_full": {"mask": rng.random((2, heads, length, keys)) < 0.6, "causal": True},
        "bias_neginf": {"bias": bias},
        "dropout": {"dropout_mask": rng.random((2, 1, length, keys)) < 0.8, "dropout_p": 0.25},
        "gqa_tile": {"gqa": "tile", "mask": rng.random((heads, 1, keys)) < 0.8},
        "sinks": {"sinks": np.array([0.5, -1.0, 2.0, 0.0]), "causal": True},
        "sinks_bias": {
            "sinks": np.array([0.5, -1.0, 2.0, 0.0]),
            "causal": True,
            "bias": rng.standard_normal((length, keys)),
        },
        "softcap_alibi": {
            "softcap": 3.0,
            "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]),
            "causal": True,
        },
    }


_NAMES = tuple(_options(np.random.default_rng(0)))


@pytest.mark.parametrize("name", _NAMES)
def test_row_allowed_sets_equal_the_spec(name):
    rng, q, k, v, _, _ = _problem()
    spec = canonicalize(q, k, v, **_options(rng)[name])
    if spec.sinks is not None:
        spec = fold(spec, alibi_into_bias=False)
    batch, heads = spec.dims[:2]
    for b in range(batch):
        for h in range(heads):
            allowed, kept = allowed_plane(spec, b, h)
            want = spec.allowed(b, h)
            np.testing.assert_array_equal(allowed, want, err_msg=f"{name} b={b} h={h}")
            keep = want if spec.dropout_mask is None else want & spec.dropout_mask[b, h]
            np.testing.assert_array_equal(kept, keep, err_msg=f"{name} b={b} h={h} kept")


def _grads(spec, do, gl, out_dtype, engine):
    return exact_vjp(spec, do, gl, FORMATS[out_dtype].dtype, engine=engine)


@pytest.mark.parametrize("name", _NAMES)
@pytest.mark.parametrize("out_dtype", ["float64", "bfloat16"])
def test_streaming_matches_referee(name, out_dtype):
    rng, q, k, v, do, gl = _problem(seed=3)
    spec = canonicalize(q, k, v, **_options(rng)[name])  # sinks native (no fold)
    _, heads, _, length, _, _, vdim = spec.dims
    d = check_cotangent(spec, do, "grad_out", (heads, length, vdim))
    g = check_cotangent(spec, gl, "grad_lse", (heads, length))
    fast = _grads(spec, d, g, out_dtype, "fast")
    referee = _grads(spec, d, g, out_dtype, "referee")
    for what, a, b in zip(("dq", "dk", "dv", "dbias"), fast, referee, strict=True):
        if b is None:
            assert a is None
            continue
        assert_same_bits(a, b, what=what, case=name, check_dtype=True)


def _per_thread_count(spec, do, gl, **kwargs):
    """gradient_enclosures with 1 thread, 2 threads (where configured) and the current count."""
    _, heads, _, length, _, _, vdim = spec.dims
    d = check_cotangent(spec, do, "grad_out", (heads, length, vdim))
    g = check_cotangent(spec, gl, "grad_lse", (heads, length))
    saved = numba.get_num_threads()
    runs = []
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS), saved}):
            numba.set_num_threads(threads)
            runs.append(fast_vjp.gradient_enclosures(spec, d, g, **kwargs))
    finally:
        numba.set_num_threads(saved)
    return runs


def test_results_do_not_depend_on_the_thread_count():
    rng, q, k, v, do, gl = _problem(seed=5, batch=2, heads=4, kv_heads=2, length=70, keys=80)
    spec = canonicalize(
        q, k, v, causal=True, window=(40, None), kv_lengths=np.array([80, 50]), align="bottom_right"
    )
    runs = _per_thread_count(spec, do, gl)
    for got in runs[1:]:
        for a, b in zip(runs[0], got, strict=True):
            if a is not None:
                assert_same_bits(a, b, what="enclosure", case="threads")


@pytest.mark.parametrize(
    "name",
    ["kv_lengths", "window_left", "softcap_alibi", "dropout", "bias_neginf", "sinks", "sinks_bias"],
)
def test_undecided_dq_rows_go_to_the_referee_alone(name, monkeypatch):
    """An undecided dq element is settled by a one-row spec (row_spec: original indices for
    causal, window and ALiBi, the key length as a mask), with the whole-call referee's bits."""
    from refattn.exact import attention_vjp as module

    rng, q, k, v, do, gl = _problem(seed=11)
    opts = _options(rng)[name]
    opts.setdefault("align", "bottom_right")
    spec = canonicalize(q, k, v, **opts)
    _, heads, _, length, _, _, vdim = spec.dims
    d = check_cotangent(spec, do, "grad_out", (heads, length, vdim))
    g = check_cotangent(spec, gl, "grad_lse", (heads, length))
    names = ("dq", "dk", "dv")
    dtype = np.dtype("float64")
    whole = module._referee_vjp(spec, d, g, dtype, names)
    values = {n: whole[n].copy() for n in names}
    todo = {n: np.zeros(whole[n].shape, dtype=bool) for n in names}
    for b, h, i, col in ((0, 1, 0, 2), (1, 3, 6, 0), (1, 0, 3, 1)):
        values["dq"][b, h, i, col] = np.nan
        todo["dq"][b, h, i, col] = True
    seen = []
    inner = module._referee_vjp

    def spy(sub, *args):
        seen.append(sub.q.shape)
        return inner(sub, *args)

    monkeypatch.setattr(module, "_referee_vjp", spy)
    module._referee_units(spec, d, g, dtype, values, todo)
    assert seen and all(shape[:3] == (1, 1, 1) for shape in seen), seen
    for n in names:
        assert_same_bits(values[n], whole[n], what=n, case=name)


def _bias_cases(rng, batch=2, heads=4, length=7, keys=9):
    """(bias shape, canonicalize options) of broadcast biases with the other features."""
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    return [
        ((heads, 1, keys), {"causal": True}),
        (
            (1, 1, length, keys),
            {
                "window": (2, 1),
                "dropout_p": 0.25,
                "dropout_mask": rng.random((batch, 1, length, keys)) < 0.8,
            },
        ),
        (
            (batch, 1, 1, keys),
            {"kv_lengths": np.array([9, 4]), "causal": True, "align": "bottom_right"},
        ),
        ((length, keys), {"mask": rng.random((length, keys)) < 0.6, "softcap": 3.0}),
        ((keys,), {"alibi_slopes": slopes, "causal": True}),
        ((heads, length, keys), {"kv_lengths": np.array([0, 6]), "window": (1, 1)}),
        (
            (batch, heads, 1, keys),
            {
                "mask": rng.random((heads, 1, keys)) < 0.8,
                "gqa": "tile",
                "softcap": 2.0,
                "alibi_slopes": slopes,
            },
        ),
        ((1, keys), {"window": (0, 0)}),  # single-key rows
        ((heads, 1, keys), {"mask": rng.random((batch, heads, length, keys)) < 0.3}),
    ]


@pytest.mark.parametrize("case", range(9))
@pytest.mark.parametrize("with_glse", [True, False])
def test_streamed_dbias_has_the_reduced_enclosures_bits(case, with_glse):
    """Pass C (no (B, H, L, S) array) gives the dbias enclosures of pass A's dS enclosure
    summed by reduce_enclosure, bit for bit."""
    rng, q, k, v, do, gl = _problem(seed=20 + case)
    shape, opts = _bias_cases(rng)[case]
    bias = rng.standard_normal(shape)
    bias.flat[3] = -np.inf
    spec = canonicalize(q, k, v, bias=bias, **opts)
    assert fast_vjp._dbias_stream_slots(spec) is not None
    _, heads, _, length, _, _, vdim = spec.dims
    d = check_cotangent(spec, do, "grad_out", (heads, length, vdim))
    g = check_cotangent(spec, gl, "grad_lse", (heads, length)) if with_glse else None
    new = fast_vjp.gradient_enclosures(spec, d, g)
    old = fast_vjp.gradient_enclosures(spec, d, g, stream_dbias=False)
    assert new[3].shape == (3,) + tuple(shape)
    assert new[4] is None  # dsinks: no sinks
    for what, a, b in zip(("dq", "dk", "dv", "dbias", "dsinks", "bad"), new, old, strict=True):
        if a is not None:
            assert_same_bits(a, b, what=what, case=f"{shape} {sorted(opts)}")


def test_streamed_dbias_does_not_depend_on_the_thread_count():
    rng, q, k, v, do, gl = _problem(seed=6, batch=2, heads=4, kv_heads=2, length=70, keys=150)
    spec = canonicalize(
        q,
        k,
        v,
        bias=rng.standard_normal((4, 1, 150)),
        causal=True,
        kv_lengths=np.array([150, 100]),
        align="bottom_right",
    )
    old = _per_thread_count(spec, do, gl, stream_dbias=False)[0][3]
    for got in _per_thread_count(spec, do, gl):
        assert_same_bits(got[3], old, what="dbias", case="threads")


@pytest.mark.parametrize(
    "shape", [(3, 1, 1, 6), (2, 1, 2, 1, 6), (1, 3, 2, 5, 6), (6,), (2, 1, 1, 1, 6)]
)
def test_streamed_dbias_with_a_batch_of_two_axes(shape):
    """The slots of a bias broadcast against batch axes (2, 3): slot_b per flat batch row."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 3, 2, 5, 4))
    k, v = rng.standard_normal((2, 3, 2, 6, 4)), rng.standard_normal((2, 3, 2, 6, 3))
    spec = canonicalize(q, k, v, bias=rng.standard_normal(shape), causal=True)
    assert fast_vjp._dbias_stream_slots(spec) is not None
    _, heads, _, length, _, _, vdim = spec.dims
    d = check_cotangent(
        spec, rng.standard_normal((2, 3, 2, 5, 3)), "grad_out", (heads, length, vdim)
    )
    new = fast_vjp.gradient_enclosures(spec, d, None)[3]
    old = fast_vjp.gradient_enclosures(spec, d, None, stream_dbias=False)[3]
    assert new.shape == (3,) + shape
    assert_same_bits(new, old, what="dbias", case=str(shape))


def _along_keys_problem(shape, with_glse, seed=31):
    rng, q, k, v, do, gl = _problem(seed=seed)
    opts = dict(causal=True, kv_lengths=np.array([9, 3]), align="bottom_right", softcap=2.0)
    spec = canonicalize(q, k, v, bias=rng.standard_normal(shape), **opts)
    assert fast_vjp._along_keys(spec)
    _, heads, _, length, _, _, vdim = spec.dims
    d = check_cotangent(spec, do, "grad_out", (heads, length, vdim))
    g = check_cotangent(spec, gl, "grad_lse", (heads, length)) if with_glse else None
    return spec, canonicalize(q, k, v, **opts), d, g


@pytest.mark.parametrize("shape", [(2, 4, 7, 1), (4, 1, 1), (7, 1), (2, 1, 1, 1), ()])
def test_dbias_along_the_keys_is_summed_by_rows(shape):
    """A bias broadcast along the keys: its dbias is the exact sum of the rows' grad_lse (no
    (B, H, L, S) enclosure); the decided bits are the referee's."""
    spec, _, d, g = _along_keys_problem(shape, True)
    enclosure = fast_vjp.gradient_enclosures(spec, d, g)[3]
    assert enclosure.shape == (3,) + shape
    for out_dtype in ("float64", "float32"):
        fast = _grads(spec, d, g, out_dtype, "fast")
        referee = _grads(spec, d, g, out_dtype, "referee")
        for what, a, b in zip(("dq", "dk", "dv", "dbias"), fast, referee, strict=True):
            assert_same_bits(a, b, what=what, case=f"{shape} {out_dtype}", check_dtype=True)


@pytest.mark.parametrize("shape", [(2, 4, 7, 1), ()])
def test_dbias_along_the_keys_without_grad_lse_is_zero(shape):
    """Without grad_lse a row's dS sums to exactly 0: dbias is +0, decided by the first step,
    and a bias constant along each row changes no weight, so dq, dk, dv are those of the call
    without bias (the referee's; its own proof of the zero dbias is the xslow test below)."""
    spec, plain, d, _ = _along_keys_problem(shape, False)
    stats = {}
    fast = exact_vjp(spec, d, None, np.dtype("float64"), engine="fast", stats=stats)
    assert stats["referee"] == 0
    assert fast[3].shape == shape and not fast[3].any() and not np.signbit(fast[3]).any()
    referee = _grads(plain, d, None, "float64", "referee")
    for what, a, b in zip(("dq", "dk", "dv"), fast, referee, strict=False):
        assert_same_bits(a, b, what=what, case=str(shape), check_dtype=True)


@pytest.mark.xslow  # the referee's own proof of a zero dbias: about a minute
def test_dbias_along_the_keys_without_grad_lse_matches_the_referee():
    spec, _, d, _ = _along_keys_problem((), False)
    fast = _grads(spec, d, None, "float64", "fast")
    referee = _grads(spec, d, None, "float64", "referee")
    for what, a, b in zip(("dq", "dk", "dv", "dbias"), fast, referee, strict=True):
        assert_same_bits(a, b, what=what, case="scalar", check_dtype=True)


def test_dbias_along_the_keys_rounds_an_exact_tie():
    """dbias of a scalar bias is exactly the sum of grad_lse over the rows: six copies of
    float64(0.3) sum to a float64 rounding midpoint, rounded to even (the referee's Ziv loop
    cannot settle a tie it does not know to be exact)."""
    from fractions import Fraction

    from refattn.exact.rounding import format_of, round_exact

    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 4)) for _ in range(3))
    grads = refattn.attention_vjp(
        q,
        k,
        v,
        np.ones((2, 3, 4)),
        bias=np.array(0.5),
        grad_lse=np.full((2, 3), 0.3),
        precision="exact",
    )
    exact = 6 * Fraction(0.3)
    assert (exact * 2**53).denominator == 1 and (exact * 2**52).denominator == 2  # a midpoint
    want = round_exact(exact, format_of(np.dtype("float64")))
    assert grads.dbias.shape == () and float(grads.dbias) == want


@pytest.mark.parametrize("shape", [(4, 7, 1), (1, 1, 1)])
def test_dbias_along_the_keys_with_sinks(shape):
    """With sinks a row's dS over its keys no longer sums to g_i: pass A sums the rows'
    enclosures (row_sums); the decided bits are the referee's."""
    rng, q, k, v, do, gl = _problem(seed=32)
    spec = canonicalize(
        q, k, v, bias=rng.standard_normal(shape), causal=True, sinks=np.array([0.5, -1.0, 2.0, 0.0])
    )
    _, heads, _, length, _, _, vdim = spec.dims
    d = check_cotangent(spec, do, "grad_out", (heads, length, vdim))
    g = check_cotangent(spec, gl, "grad_lse", (heads, length))
    for out_dtype in ("float64", "bfloat16"):
        fast = _grads(spec, d, g, out_dtype, "fast")
        referee = _grads(spec, d, g, out_dtype, "referee")
        for what, a, b in zip(("dq", "dk", "dv", "dbias"), fast, referee, strict=True):
            assert_same_bits(a, b, what=what, case=f"{shape} {out_dtype}", check_dtype=True)
