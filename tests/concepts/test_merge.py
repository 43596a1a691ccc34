"""refattn.merge_states and attention's base-2 lse: the semantics the registry row does not
reach (the exact path against the mpmath twin and the float64 bound are the merge_states row
of tests/registry.py).

* the chunked pipeline: attention over disjoint key chunks, merged, against attention over
  the union (float64 within the composed bounds; exact chunks within their roundings);
* empty states are the identity, all empty gives (0, -inf), large gaps;
* attention(..., lse_base=2) on every path, exact against the twin; attention_vjp's base-2
  grad_lse;
* merge_states_vjp against central differences of the mpmath twin.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn.bounds import UNIT_ROUNDOFF, float64_forward_bound, merge_bound, merge_vjp_bound
from tests.helpers import assert_same_bits, assert_within
from tests.naive.merge import mp_merge, naive_lse_base2_rounded
from tests.naive.mp import central_vjp
from tests.strategies import attention_cases, merge_states_cases

LN2 = math.log(2.0)
DTYPES = ("float64", "float32", "float16", "bfloat16")


def _dtype(name):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _chunks(keys, cuts):
    edges = [0, *sorted(set(c for c in cuts if 0 < c < keys)), keys]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False)]


def _chunked(q, k, v, pieces, **kwargs):
    """(outs (P, H, L, E), lses (P, H, L)) of attention over each key chunk."""
    outs, lses = zip(
        *(refattn.attention(q, k[:, a:b], v[:, a:b], return_lse=True, **kwargs) for a, b in pieces),
        strict=True,
    )
    return np.stack(outs), np.stack(lses)


def _problem(seed, heads=2, length=3, keys=9, dim=4, vdim=3, scale=2.0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(heads, length, dim)) * scale,
        rng.normal(size=(heads, keys, dim)),
        rng.normal(size=(heads, keys, vdim)),
    )


# ------------------------------------------------------------------------ chunked pipeline


@settings(max_examples=6)
@given(seed=st.integers(0, 2**32 - 1), cuts=st.lists(st.integers(1, 8), max_size=4))
def test_float64_chunks_merged_match_attention_over_the_union(seed, cuts):
    """|merge(float64 chunks) - exact union| <= max_p out bound_p + max_p lse bound_p *
    max|out_p - out| + merge bound + the exact union's own rounding."""
    q, k, v = _problem(seed)
    pieces = _chunks(k.shape[1], cuts)
    outs, lses = _chunked(q, k, v, pieces, scale=1.0)
    out, lse = refattn.merge_states(outs, lses)
    truth_out, truth_lse = refattn.attention(q, k, v, scale=1.0, return_lse=True, precision="exact")
    chunk_bounds = [float64_forward_bound(q, k[:, a:b], v[:, a:b], scale=1.0) for a, b in pieces]
    out_chunk = np.max([b[0] for b in chunk_bounds], axis=0)
    lse_chunk = np.max([b[1] for b in chunk_bounds], axis=0)
    spread = np.abs(outs - truth_out).max(axis=(0, -1))
    m_out, m_lse = merge_bound(outs, lses)
    bound_out = out_chunk + (lse_chunk * 2 * spread)[..., None] + m_out
    bound_out = bound_out + UNIT_ROUNDOFF * np.abs(truth_out)
    assert_within(out, truth_out, bound_out, what="merged float64 chunks: out", case=str(pieces))
    bound_lse = lse_chunk + m_lse + UNIT_ROUNDOFF * np.abs(truth_lse)
    assert_within(lse, truth_lse, bound_lse, what="merged float64 chunks: lse", case=str(pieces))


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cut=st.integers(0, 5))
def test_chunked_prefill_merged_is_causal_bottom_right(seed, cut):
    """A block of L queries (the last L positions) against its cached keys in full (split at
    ``cut``) and its own L keys causally, merged exactly from exact float64 states: causal
    bottom-right attention over all S keys, within the states' own roundings."""
    q, k, v = _problem(seed)
    keys, length = k.shape[1], q.shape[1]
    cache = keys - length
    pieces = _chunks(cache, [cut])
    outs, lses = _chunked(q, k, v, pieces, scale=1.0, precision="exact")
    own = refattn.attention(
        q, k[:, cache:], v[:, cache:], scale=1.0, causal=True, return_lse=True, precision="exact"
    )
    outs, lses = np.concatenate([outs, own[0][None]]), np.concatenate([lses, own[1][None]])
    out, lse = refattn.merge_states(outs, lses, precision="exact")
    truth_out, truth_lse = refattn.attention(
        q, k, v, scale=1.0, causal=True, align="bottom_right", return_lse=True, precision="exact"
    )
    # each state is its exact value rounded once (u relative); the merge adds one rounding
    spread = np.abs(outs - truth_out).max(axis=(0, -1))
    rounding = UNIT_ROUNDOFF * (np.abs(outs).max(axis=0) + np.abs(truth_out))
    bound_out = rounding + (2 * UNIT_ROUNDOFF * np.abs(lses).max(axis=0) * spread)[..., None]
    assert_within(out, truth_out, bound_out, what="chunked prefill: out", case=str(pieces))
    bound_lse = UNIT_ROUNDOFF * (np.abs(lses).max(axis=0) + 2 * np.abs(truth_lse))
    assert_within(lse, truth_lse, bound_lse, what="chunked prefill: lse", case=str(pieces))


@settings(max_examples=3)
@given(
    seed=st.integers(0, 2**32 - 1),
    cuts=st.lists(st.integers(1, 8), max_size=3),
    base2=st.booleans(),
)
def test_exact_pipeline_differs_from_the_union_only_by_the_chunk_roundings(seed, cuts, base2):
    """The two truths: exact chunks rounded to float64 and merged exactly stay within the
    chunks' roundings (u |out_p|, u |lse_p| propagated) of exact attention over the union."""
    q, k, v = _problem(seed)
    base = 2 if base2 else "e"
    pieces = _chunks(k.shape[1], cuts)
    outs, lses = _chunked(q, k, v, pieces, scale=1.0, precision="exact", lse_base=base)
    out, lse = refattn.merge_states(outs, lses, precision="exact", lse_base=base)
    truth_out, truth_lse = refattn.attention(
        q, k, v, scale=1.0, return_lse=True, precision="exact", lse_base=base
    )
    c = LN2 if base2 else 1.0
    lse_err = UNIT_ROUNDOFF * np.abs(lses).max(axis=0) * c
    spread = np.abs(outs - truth_out).max(axis=(0, -1))
    bound = (
        UNIT_ROUNDOFF * np.abs(outs).max(axis=0)
        + (2 * lse_err * spread)[..., None]
        + UNIT_ROUNDOFF * np.abs(truth_out)
    )
    assert_within(out, truth_out, bound, what="exact pipeline: out", case=str(pieces))
    lse_bound = 2 * lse_err / c + 2 * UNIT_ROUNDOFF * np.abs(truth_lse)
    assert_within(lse, truth_lse, lse_bound, what="exact pipeline: lse", case=str(pieces))


def test_a_chunk_with_no_allowed_key_is_an_empty_state():
    q, k, v = _problem(3)
    mask = np.ones((2, 3, 9), dtype=bool)
    mask[..., :4] = False  # the first chunk has no allowed key
    outs, lses = _chunked(q, k, v, [(0, 4), (4, 9)], mask=None)
    empty_out, empty_lse = refattn.attention(
        q, k[:, :4], v[:, :4], mask=mask[..., :4], return_lse=True
    )
    assert (empty_lse == -np.inf).all() and (empty_out == 0).all()
    merged = refattn.merge_states(np.stack([empty_out, outs[1]]), np.stack([empty_lse, lses[1]]))
    assert_same_bits(merged[0], outs[1], what="merge with an empty chunk: out")
    assert_same_bits(merged[1], lses[1], what="merge with an empty chunk: lse")


# ------------------------------------------------------------------------ empty states, gaps


@pytest.mark.parametrize("precision", ["float64", "exact"])
@pytest.mark.parametrize("base", ["e", 2])
def test_empty_states_are_the_identity(precision, base):
    rng = np.random.default_rng(0)
    outs, lses = rng.normal(size=(3, 2, 4, 5)), rng.normal(size=(3, 2, 4))
    garbage = np.full((1, 2, 4, 5), np.nan)
    merged = refattn.merge_states(outs, lses, precision=precision, lse_base=base)
    padded = refattn.merge_states(
        np.concatenate([garbage, outs, garbage]),
        np.concatenate([np.full((1, 2, 4), -np.inf), lses, np.full((1, 2, 4), -np.inf)]),
        precision=precision,
        lse_base=base,
    )
    for got, want, name in zip(padded, merged, ("out", "lse"), strict=True):
        assert_same_bits(got, want, what=f"{precision} merge with empty states: {name}")


@pytest.mark.parametrize("precision", ["float64", "exact"])
def test_all_empty_gives_zero_and_minus_infinity(precision):
    outs = np.full((4, 1, 2, 3), np.nan)
    out, lse = refattn.merge_states(outs, np.full((4, 1, 2), -np.inf), precision=precision)
    assert_same_bits(out, np.zeros((1, 2, 3)), what="all-empty out")
    assert_same_bits(lse, np.full((1, 2), -np.inf), what="all-empty lse")


@pytest.mark.parametrize("precision", ["float64", "exact"])
def test_nonfinite_rules(precision):
    outs = np.array([[1.0, np.nan, np.inf, 1.0], [2.0, 0.0, -np.inf, np.inf]])[:, None, None]
    lses = np.zeros((2, 1, 1))
    out, lse = refattn.merge_states(outs, lses, precision=precision)
    assert np.isnan(out[0, 0, 1:3]).all() and out[0, 0, 3] == np.inf and out[0, 0, 0] == 1.5
    out, lse = refattn.merge_states(outs, np.array([0.0, np.inf])[:, None, None])
    assert lse[0, 0] == np.inf and np.isnan(out).all()
    out, lse = refattn.merge_states(outs, np.array([0.0, np.nan])[:, None, None])
    assert np.isnan(lse[0, 0]) and np.isnan(out).all()


@pytest.mark.parametrize("precision", ["float64", "exact"])
@pytest.mark.parametrize("gap", [1e3, 1e9, 1e300])
def test_large_gaps_keep_the_leading_state(precision, gap):
    outs = np.array([[[[1.25, -3.0]]], [[[7.0, 9.0]]]])
    out, lse = refattn.merge_states(outs, np.array([[[0.5]], [[0.5 - gap]]]), precision=precision)
    assert_same_bits(out, outs[0], what="out beside a state far below")
    assert_same_bits(lse, np.array([[0.5]]), what="lse beside a state far below")


def test_base2_reads_flashinfer_lse():
    """FlashInfer's states hold log2 sum 2^(s log2 e): the merge in base 2 of lse/ln 2 is
    the natural merge divided by ln 2 (up to the roundings of the two conversions)."""
    rng = np.random.default_rng(1)
    outs, lses = rng.normal(size=(4, 1, 3, 2)), rng.normal(size=(4, 1, 3)) * 5
    natural = refattn.merge_states(outs, lses, precision="exact")
    base2 = refattn.merge_states(outs, lses / LN2, lse_base=2, precision="exact")
    bound = 4 * UNIT_ROUNDOFF * (1 + np.abs(lses).max(axis=0) / LN2)
    assert_within(base2[1], natural[1] / LN2, bound, what="base-2 lse")
    wrong = refattn.merge_states(outs, lses / LN2, precision="exact")  # read as natural
    assert np.abs(wrong[0] - natural[0]).max() > 100 * bound.max()


def test_bad_arguments_name_themselves():
    outs, lses = np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3))
    with pytest.raises(ValueError, match="lse_base"):
        refattn.merge_states(outs, lses, lse_base=10)
    with pytest.raises(ValueError, match="lses: expected shape"):
        refattn.merge_states(outs, lses[:, :, :2])
    with pytest.raises(ValueError, match="outs: expected shape"):
        refattn.merge_states(outs[0, 0], lses[0, 0])
    with pytest.raises(ValueError, match="lse_base"):
        refattn.attention(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 3)), lse_base=2)


# ------------------------------------------------------------------------ attention, base 2


def _check_exact_base2(case, dtype):
    q, k, v, opts = case
    _, lse = refattn.attention(
        q, k, v, return_lse=True, lse_base=2, precision="exact", out_dtype=_dtype(dtype), **opts
    )
    assert lse.dtype == _dtype(dtype)
    truth = naive_lse_base2_rounded(q, k, v, opts, _dtype(dtype))
    assert_same_bits(lse, truth, what=f"exact base-2 lse [{dtype}]", case=str(sorted(opts)))


@given(
    case=attention_cases(dtypes=("float64",), max_len=3, max_dim=2), dtype=st.sampled_from(DTYPES)
)
@settings(max_examples=6)
def test_exact_base2_lse_is_the_rounded_twin(case, dtype):
    _check_exact_base2(case, dtype)


@pytest.mark.slow
@given(
    case=attention_cases(dtypes=("float64",), max_len=5, max_dim=4), dtype=st.sampled_from(DTYPES)
)
@settings(max_examples=60)
def test_exact_base2_lse_is_the_rounded_twin_more(case, dtype):
    _check_exact_base2(case, dtype)


@given(case=attention_cases(dtypes=("float64",), max_len=5, max_dim=4))
@settings(max_examples=8)
def test_float64_base2_lse_within_its_bound(case):
    q, k, v, opts = case
    _, lse2 = refattn.attention(q, k, v, return_lse=True, lse_base=2, **opts)
    _, exact2 = refattn.attention(q, k, v, return_lse=True, lse_base=2, precision="exact", **opts)
    _, bound = float64_forward_bound(q, k, v, **opts)
    finite = np.where(np.isfinite(exact2), exact2, 0.0)
    threshold = bound / LN2 + 3 * UNIT_ROUNDOFF * np.abs(finite)
    assert_within(lse2, exact2, threshold, what="float64 base-2 lse", case=str(sorted(opts)))


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_base2_lse_is_the_natural_one_over_ln2(backend):
    q, k, v = _problem(5)
    _, natural = refattn.attention(q, k, v, return_lse=True, backend=backend)
    out, lse2 = refattn.attention(q, k, v, return_lse=True, lse_base=2, backend=backend)
    assert_same_bits(lse2, natural / LN2, what=f"{backend} base-2 lse")


@pytest.mark.parametrize("backend", ["numpy", pytest.param("numba", marks=pytest.mark.slow)])
def test_vjp_base2_grad_lse(backend):
    q, k, v = _problem(6)
    rng = np.random.default_rng(6)
    do, g = rng.normal(size=(2, 3, 3)), rng.normal(size=(2, 3))
    got = refattn.attention_vjp(q, k, v, do, grad_lse=g, lse_base=2, backend=backend)
    want = refattn.attention_vjp(q, k, v, do, grad_lse=g / LN2, backend=backend)
    for name in ("dq", "dk", "dv"):
        assert_same_bits(getattr(got, name), getattr(want, name), what=f"{backend} {name}")


def test_exact_vjp_refuses_a_nonzero_base2_grad_lse():
    q, k, v = _problem(6)
    do, g = np.ones((2, 3, 3)), np.ones((2, 3))
    with pytest.raises(NotImplementedError, match="lse_base=2"):
        refattn.attention_vjp(q, k, v, do, grad_lse=g, lse_base=2, precision="exact")


@pytest.mark.slow
def test_exact_vjp_with_a_zero_base2_grad_lse_is_the_plain_one():
    q, k, v = _problem(6)
    do = np.random.default_rng(6).normal(size=(2, 3, 3))
    exact = refattn.attention_vjp(
        q, k, v, do, grad_lse=np.zeros((2, 3)), lse_base=2, precision="exact"
    )
    plain = refattn.attention_vjp(q, k, v, do, precision="exact")
    assert_same_bits(exact.dq, plain.dq, what="exact vjp, zero base-2 grad_lse")


# ------------------------------------------------------------------------ vjp


@settings(max_examples=4, deadline=None)
@given(case=merge_states_cases(max_states=3, max_rows=2, max_vdim=2, nonfinite=False))
def test_merge_vjp_against_central_differences(case):
    outs, lses, base2 = case
    lses = np.where(np.isfinite(lses), np.clip(lses, -30, 30), -np.inf)
    live = np.isfinite(lses).all(axis=0)[0]
    if not live.any():
        return
    outs, lses = outs[:, :, live], lses[:, :, live]  # (P, 1, R, E) with every state live
    rng = np.random.default_rng(0)
    do, g = rng.normal(size=outs.shape[1:]), rng.normal(size=lses.shape[1:])
    base = 2 if base2 else "e"
    grads = refattn.merge_states_vjp(outs, lses, do, grad_lse=g, lse_base=base)

    def forward(o, l_):
        return mp_merge(o[:, 0], l_[:, 0], base2)

    grad = np.concatenate([do.ravel(), g.ravel()])
    (d_outs, e_outs), (d_lses, e_lses) = central_vjp(forward, [outs, lses], grad, dps=100)
    b_outs, b_lses = merge_vjp_bound(outs, lses, do, g, lse_base=base)
    for got, est, err, bound, name in (
        (grads.douts, d_outs, e_outs, b_outs, "douts"),
        (grads.dlses, d_lses, e_lses, b_lses, "dlses"),
    ):
        assert_within(got, est.astype(float), err.astype(float) + bound, what=f"merge vjp {name}")


def test_vjp_of_empty_states_is_zero():
    outs = np.array([[[[1.0]]], [[[np.nan]]]])
    lses = np.array([[[0.0]], [[-np.inf]]])
    grads = refattn.merge_states_vjp(outs, lses, np.ones((1, 1, 1)), grad_lse=np.ones((1, 1)))
    assert grads.douts[1].tolist() == [[[0.0]]] and grads.dlses[1].tolist() == [[0.0]]
    assert grads.douts[0].tolist() == [[[1.0]]] and grads.dlses[0].tolist() == [[1.0]]


@settings(max_examples=6, deadline=None)
@given(case=merge_states_cases(max_states=4, max_rows=2, max_vdim=3, nonfinite=False))
def test_numba_merge_within_the_kernel_bound(case):
    """backend="numba" runs the Numba attention kernel on merge.as_attention's problem: within
    that kernel's forward bound of the exact merge (base e; base 2 is refused)."""
    from refattn.kernels import numba_cpu
    from refattn.spec import canonicalize

    outs, lses, base2 = case
    lses = np.where(np.isfinite(lses), np.clip(lses, -600, 600), -np.inf)  # no exp overflow
    if base2:
        with pytest.raises(NotImplementedError, match="numba"):
            refattn.merge_states(outs, lses, lse_base=2, backend="numba")
        return
    out, lse = refattn.merge_states(outs, lses, backend="numba")
    exact_out, exact_lse = refattn.merge_states(outs, lses, precision="exact")
    problem = refattn.merge.as_attention(outs, lses)
    spec = canonicalize(**problem)
    _, _, weights = refattn.attention(**problem, return_lse=True, return_weights=True)
    keys = problem["k"].shape[2]
    out_b, lse_b = numba_cpu.forward_error_bound(spec, weights, np.float64, rescalings=keys)
    assert_within(out, exact_out, out_b.reshape(out.shape), what="numba merge out")
    finite = np.isfinite(exact_lse)
    assert_same_bits(np.isfinite(lse), finite, what="finite lse")
    assert_within(lse[finite], exact_lse[finite], lse_b.reshape(lse.shape)[finite], what="lse")


def _mp_merge_vjp(outs, lses, do, g):
    """Closed-form merge vjp in 60-digit mpmath (base e), rounded to float64 once."""
    import mpmath

    with mpmath.workdps(60):
        douts = np.zeros(outs.shape)
        dlses = np.zeros(lses.shape)
        for r in np.ndindex(*lses.shape[1:]):
            live = [p for p in range(lses.shape[0]) if np.isfinite(lses[(p, *r)])]
            if not live:
                continue
            top = max(mpmath.mpf(float(lses[(p, *r)])) for p in live)
            e = {p: mpmath.exp(mpmath.mpf(float(lses[(p, *r)])) - top) for p in live}
            z = mpmath.fsum(e.values())
            w = {p: e[p] / z for p in live}
            vdim = outs.shape[-1]
            out = [
                mpmath.fsum(w[p] * mpmath.mpf(float(outs[(p, *r, j)])) for p in live)
                for j in range(vdim)
            ]
            for p in live:
                dot = mpmath.fsum(
                    mpmath.mpf(float(do[(*r, j)])) * (mpmath.mpf(float(outs[(p, *r, j)])) - out[j])
                    for j in range(vdim)
                )
                dlses[(p, *r)] = float(w[p] * (dot + mpmath.mpf(float(g[r]))))
                for j in range(vdim):
                    douts[(p, *r, j)] = float(w[p] * mpmath.mpf(float(do[(*r, j)])))
    return douts, dlses


@settings(max_examples=5, deadline=None)
@given(case=merge_states_cases(max_states=3, max_rows=2, max_vdim=2, nonfinite=False))
def test_exact_merge_vjp_is_the_rounded_closed_form(case):
    """merge_states_vjp(precision="exact"): the exact attention vjp of as_attention's problem,
    bit-identical to the 60-digit closed form rounded once (base e)."""
    outs, lses, _ = case
    lses = np.where(np.isfinite(lses), np.clip(lses, -600, 600), -np.inf)
    rng = np.random.default_rng(1)
    do, g = rng.normal(size=outs.shape[1:]), rng.normal(size=lses.shape[1:])
    got = refattn.merge_states_vjp(outs, lses, do, grad_lse=g, precision="exact")
    douts, dlses = _mp_merge_vjp(outs, lses, do, g)
    assert_same_bits(got.douts, douts, what="douts")
    assert_same_bits(got.dlses, dlses, what="dlses")


def test_exact_merge_vjp_refuses_base2():
    outs, lses = np.ones((2, 1, 1, 1)), np.zeros((2, 1, 1))
    with pytest.raises(NotImplementedError, match="base-2"):
        refattn.merge_states_vjp(outs, lses, np.ones((1, 1, 1)), lse_base=2, precision="exact")


@settings(max_examples=4, deadline=None)
@given(case=merge_states_cases(max_states=4, max_rows=2, max_vdim=3, nonfinite=False))
def test_numba_merge_vjp_within_the_kernel_bound(case):
    """merge_states_vjp(backend="numba"): the Numba attention vjp of as_attention's problem,
    within that kernel's backward bound of the exact vjp (base e)."""
    from refattn.kernels import numba_cpu
    from refattn.spec import canonicalize

    outs, lses, _ = case
    lses = np.where(np.isfinite(lses), np.clip(lses, -600, 600), -np.inf)
    rng = np.random.default_rng(2)
    do, g = rng.normal(size=outs.shape[1:]), rng.normal(size=lses.shape[1:])
    got = refattn.merge_states_vjp(outs, lses, do, grad_lse=g, backend="numba")
    exact = refattn.merge_states_vjp(outs, lses, do, grad_lse=g, precision="exact")
    problem = refattn.merge.as_attention(outs, lses)
    rows, vdim = problem["bias"].shape[0], outs.shape[-1]
    _, _, weights = refattn.attention(**problem, return_lse=True, return_weights=True)
    bounds = numba_cpu.backward_error_bound(
        canonicalize(**problem), weights, do.reshape(rows, 1, 1, vdim), g.reshape(rows, 1, 1)
    )
    dv_bound = np.moveaxis(
        bounds[2][:, 0].reshape(lses.shape[1:] + outs.shape[:1] + (vdim,)), -2, 0
    )
    dbias_bound = np.moveaxis(bounds[3][:, 0, 0].reshape(lses.shape[1:] + outs.shape[:1]), -1, 0)
    assert_within(got.douts, exact.douts, dv_bound, what="numba merge douts")
    assert_within(got.dlses, exact.dlses, dbias_bound, what="numba merge dlses")
