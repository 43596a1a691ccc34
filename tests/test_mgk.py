"""Tests of refattn.mgk (Transformer-MGK / MLK, Nguyen et al. 2022).

Truth is a loop-level mpmath evaluation written here (60 digits, the Gaussian exponent with its
minus sign, the allowed set from docs/conventions.md), independent of refattn.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.tolerance import mixture_bound, ratio_bound
from refattn import mgk
from refattn.attention import attention
from tests.strategies import mgk_problems
from tests.test_gmm import (
    DPS,
    _div,
    _lse,
    _mp,
    _mul,
    _rounded,
    _sum,
    _weights,
    assert_same_bits,
    assert_within,
)

# --------------------------------------------------------------------------------------------
# Loop-level references
# --------------------------------------------------------------------------------------------


def naive_allowed(length, keys, *, mask=None, causal=False, window=None, align="top_left"):
    offset = 0 if align == "top_left" else keys - length
    out = np.zeros((length, keys), dtype=bool)
    for i in range(length):
        for j in range(keys):
            ok = mask is None or bool(mask[i][j])
            if causal and j > i + offset:
                ok = False
            if window is not None:
                left, right = window
                if left is not None and j < i + offset - left:
                    ok = False
                if right is not None and j > i + offset + right:
                    ok = False
            out[i, j] = ok
    return out


def _component(q_row, k, s2, log_p, mode, normalized):
    dim = len(q_row)
    term = -mpmath.fsum((_mp(a) - _mp(b)) ** 2 for a, b in zip(q_row, k, strict=True)) / (2 * s2)
    if normalized:
        term -= dim / mpmath.mpf(2) * mpmath.log(2 * mpmath.pi * s2)
    if mode == "soft":
        term += log_p
    return term


def naive_mgk(q, keys, v, *, log_pi=None, sigma2=1.0, mode="soft", normalized=False, mask=None,
              causal=False, window=None, align="top_left"):
    length, (units, comps) = len(q), keys.shape[:2]
    allowed = naive_allowed(length, units, mask=mask, causal=causal, window=window, align=align)
    s2 = np.broadcast_to(np.asarray(sigma2, dtype=np.float64), (units, comps))
    with mpmath.workdps(DPS):
        out = []
        for i in range(length):
            scores = {}
            for j in range(units):
                if not allowed[i, j]:
                    continue
                terms = []
                for r in range(comps):
                    log_p = (-mpmath.log(comps) if log_pi is None else
                             (-mpmath.inf if np.isneginf(log_pi[j][r]) else _mp(log_pi[j][r])))
                    if mode == "soft" and log_p == -mpmath.inf:
                        continue
                    terms.append(_component(q[i], keys[j][r], _mp(s2[j][r]), log_p, mode,
                                            normalized))
                scores[j] = _lse(terms) if mode == "soft" else max(terms)
            if not scores:
                out.append([mpmath.mpf(0)] * v.shape[1])
                continue
            weights = dict(zip(scores, _weights(list(scores.values())), strict=True))
            out.append([_sum(_mul(w, v[j][e]) for j, w in weights.items())
                        for e in range(v.shape[1])])
        return out


def naive_em(q, keys, *, log_pi, sigma2, mask=None):
    length, (units, comps) = len(q), keys.shape[:2]
    allowed = naive_allowed(length, units, mask=mask)
    s2 = np.broadcast_to(np.asarray(sigma2, dtype=np.float64), (units, comps))
    with mpmath.workdps(DPS):
        resp = [[[mpmath.mpf(0)] * comps for _ in range(units)] for _ in range(length)]
        for i in range(length):
            terms = {(j, r): _component(q[i], keys[j][r], _mp(s2[j][r]), _mp(log_pi[j][r]),
                                        "soft", True)
                     for j in range(units) for r in range(comps) if allowed[i, j]}
            if not terms:
                continue
            for (j, r), w in zip(terms, _weights(list(terms.values())), strict=True):
                resp[i][j][r] = w
        pi = []
        for j in range(units):
            den = _sum(resp[i][j][r] for i in range(length) for r in range(comps))
            pi.append([_div(_sum(resp[i][j][r] for i in range(length)), den) if den else
                       mpmath.exp(_mp(log_pi[j][r])) for r in range(comps)])
        return pi, resp


def _phi(x):
    x = _mp(x)
    return x + 1 if x > 0 else mpmath.exp(x)


def naive_linear(q, keys, v, *, pi, causal=False):
    units, comps, dim = keys.shape
    with mpmath.workdps(DPS):
        mixed = [[mpmath.fsum(_mp(pi[j][r]) * _phi(keys[j][r][d]) for r in range(comps))
                  for d in range(dim)] for j in range(units)]
        out = []
        for i in range(len(q)):
            phi_q = [_phi(x) for x in q[i]]
            stop = min(i, units - 1) + 1 if causal else units
            kernels = [mpmath.fsum(a * b for a, b in zip(phi_q, mixed[j], strict=True))
                       for j in range(stop)]
            den = mpmath.fsum(kernels)
            out.append([mpmath.fsum(kernels[j] * _mp(v[j][e]) for j in range(stop)) / den
                        for e in range(v.shape[1])])
        return out


def _term_scale(q, keys, opts):
    s2 = np.asarray(opts.get("sigma2", 1.0))
    reach = (np.abs(q).max() + np.abs(keys).max()) ** 2 * q.shape[-1]
    scale = reach / (2 * s2.min())
    scale += q.shape[-1] * (abs(math.log(2 * math.pi * s2.min()))
                            + abs(math.log(2 * math.pi * s2.max())))
    if "log_pi" in opts:
        scale += np.abs(opts["log_pi"]).max()
    return float(scale + math.log(keys.shape[-2]))


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------


@settings(max_examples=50)
@given(problem=mgk_problems(), mode=st.sampled_from(["soft", "hard"]),
       normalized=st.booleans())
def test_exact_is_correctly_rounded(problem, mode, normalized):
    q, keys, v, opts = problem
    out = mgk.attention(q, keys, v, mode=mode, normalized=normalized, precision="exact", **opts)
    truth = naive_mgk(q, keys, v, mode=mode, normalized=normalized, **opts)
    assert_same_bits(f"mgk.attention exact ({mode}, normalized={normalized}, {sorted(opts)})",
                     out, _rounded(truth))


@settings(max_examples=50)
@given(problem=mgk_problems(), mode=st.sampled_from(["soft", "hard"]),
       normalized=st.booleans())
def test_float64_within_bound(problem, mode, normalized):
    q, keys, v, opts = problem
    fast = mgk.attention(q, keys, v, mode=mode, normalized=normalized, **opts)
    exact = mgk.attention(q, keys, v, mode=mode, normalized=normalized, precision="exact",
                          **opts)
    bound = mixture_bound(_term_scale(q, keys, opts), keys.shape[0] * keys.shape[1],
                          q.shape[-1] + 2, np.abs(v).max())
    assert_within(f"mgk.attention float64 ({mode})", fast, exact, bound)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_out_dtype(dtype, rng):
    q, keys, v = rng.standard_normal((2, 2)), rng.standard_normal((3, 2, 2)), \
        rng.standard_normal((3, 2))
    out = mgk.attention(q, keys, v, sigma2=0.7, precision="exact", out_dtype=dtype)
    assert_same_bits(f"mgk exact out_dtype={dtype}", out.astype(np.float64),
                     _rounded(naive_mgk(q, keys, v, sigma2=0.7), dtype))


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 3), units=st.integers(1, 4),
       sigma_exp=st.integers(-2, 2), causal=st.booleans())
def test_single_component_is_softmax_attention(seed, length, units, sigma_exp, causal):
    """R = 1: soft == hard == softmax attention on -||q - k||^2 / (2 sigma2). With dyadic
    inputs and sigma2 = 2**e the attention form scale = 1/sigma2, bias = -||k||^2/(2 sigma2)
    is exact, so the exact paths agree bit for bit (the -||q||^2 term is a row constant)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-6, 7, (length, 2)) / 4.0
    k = rng.integers(-6, 7, (units, 2)) / 4.0
    v = rng.standard_normal((units, 2))
    sigma2 = 2.0**sigma_exp
    soft = mgk.attention(q, k[:, None, :], v, sigma2=sigma2, causal=causal, precision="exact")
    hard = mgk.attention(q, k[:, None, :], v, sigma2=sigma2, mode="hard", causal=causal,
                         precision="exact")
    bias = np.broadcast_to(-(k * k).sum(-1) / (2 * sigma2), (length, units))
    plain = attention(q, k, v, scale=1 / sigma2, bias=bias, causal=causal, precision="exact")
    assert_same_bits("R=1 soft vs hard (exact)", soft, hard)
    assert_same_bits("R=1 soft vs attention (exact)", soft, plain)
    soft64 = mgk.attention(q, k[:, None, :], v, sigma2=sigma2, causal=causal)
    hard64 = mgk.attention(q, k[:, None, :], v, sigma2=sigma2, mode="hard", causal=causal)
    assert_same_bits("R=1 soft vs hard (float64)", soft64, hard64)


def test_masked_key_is_removed_and_poison_ignored(rng):
    q, keys, v = rng.standard_normal((3, 2)), rng.standard_normal((4, 2, 2)), \
        rng.standard_normal((4, 2))
    mask = np.ones((3, 4), dtype=bool)
    mask[:, 2] = False
    poisoned_keys, poisoned_v = keys.copy(), v.copy()
    poisoned_keys[2] = np.nan
    poisoned_v[2] = np.inf
    for precision in ("float64", "exact"):
        full = mgk.attention(q, poisoned_keys, poisoned_v, mask=mask, precision=precision)
        cut = mgk.attention(q, keys[[0, 1, 3]], v[[0, 1, 3]], precision=precision)
        assert_same_bits(f"masked NaN key vs removed key ({precision})", full, cut)
    allowed_nan = mgk.attention(q, poisoned_keys, poisoned_v)
    assert np.isnan(allowed_nan).all(), "NaN in an allowed key must reach its rows"


def test_empty_rows_give_zero(rng):
    q, keys, v = rng.standard_normal((2, 2)), rng.standard_normal((3, 1, 2)), \
        rng.standard_normal((3, 2))
    mask = np.array([[False, False, False], [True, False, True]])
    for precision in ("float64", "exact"):
        out = mgk.attention(q, keys, v, mask=mask, precision=precision)
        assert (out[0] == 0).all() and not np.signbit(out[0]).any(), f"{precision}: {out[0]}"


def test_underflowing_scores_stay_finite(rng):
    """Scores ~ -1e4: the public transformer-mgk soft mode forms sum_r pi exp(-d / 2 sigma2)
    directly and divides 0 by 0; refattn does not."""
    q = rng.standard_normal((2, 2)) + 100.0
    keys = rng.standard_normal((3, 2, 2))
    v = rng.standard_normal((3, 2))
    with np.errstate(all="ignore"):
        dist = ((q[:, None, None, :] - keys[None]) ** 2).sum(-1)
        kernel = (0.5 * np.exp(-dist / 2)).sum(-1)
        public = (kernel @ v) / kernel.sum(-1, keepdims=True)
    assert np.isnan(public).all(), "premise: the direct formula underflows"
    fast = mgk.attention(q, keys, v)
    exact = mgk.attention(q, keys, v, precision="exact")
    assert_same_bits("mgk exact at scores ~ -1e4", exact, _rounded(naive_mgk(q, keys, v)))
    assert_within("mgk float64 at scores ~ -1e4", fast, exact,
                  mixture_bound(_term_scale(q, keys, {}), 6, 4, np.abs(v).max()))


def test_sign_of_exponent_is_pinned(rng):
    """The nearest key must get the largest weight (the notes' printed sign would invert it)."""
    q = np.array([[0.0, 0.0]])
    keys = np.array([[[0.1, 0.0]], [[3.0, 0.0]]])
    v = np.array([[1.0], [0.0]])
    assert mgk.attention(q, keys, v)[0, 0] > 0.5


# --------------------------------------------------------------------------------------------
# em_update_pi
# --------------------------------------------------------------------------------------------


@settings(max_examples=30)
@given(problem=mgk_problems())
def test_em_update_pi(problem):
    q, keys, _, opts = problem
    units, comps = keys.shape[:2]
    log_pi = opts.get("log_pi", np.full((units, comps), -math.log(comps)))
    sigma2, mask = opts.get("sigma2", 1.0), opts.get("mask")
    exact = mgk.em_update_pi(q, keys, log_pi=log_pi, sigma2=sigma2, mask=mask,
                             precision="exact")
    pi, resp = naive_em(q, keys, log_pi=log_pi, sigma2=sigma2, mask=mask)
    assert_same_bits("em_update_pi exact pi", exact.pi, _rounded(pi))
    assert_same_bits("em_update_pi exact responsibilities", exact.responsibilities,
                     _rounded(resp))
    fast = mgk.em_update_pi(q, keys, log_pi=log_pi, sigma2=sigma2, mask=mask)
    scale = _term_scale(q, keys, dict(opts, log_pi=log_pi))
    bound = mixture_bound(scale, units * comps + len(q), q.shape[-1] + 2, 2.0)
    assert_within("em_update_pi float64 pi", fast.pi, exact.pi, bound)
    assert_within("em_update_pi float64 responsibilities", fast.responsibilities,
                  exact.responsibilities, bound)


def test_em_update_pi_moves_weight_to_the_explaining_component():
    q = np.array([[0.0], [0.1]])
    keys = np.array([[[0.0], [4.0]]])
    res = mgk.em_update_pi(q, keys, log_pi=np.log(np.array([[0.5, 0.5]])), sigma2=1.0)
    assert res.pi[0, 0] > 0.99 and abs(res.pi.sum() - 1) <= mixture_bound(0.0, 2, 0, 1.0)


# --------------------------------------------------------------------------------------------
# linear_attention (MLK)
# --------------------------------------------------------------------------------------------


@st.composite
def linear_problems(draw):
    q, keys, v, _ = draw(mgk_problems())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pi = rng.uniform(0.0, 1.0, keys.shape[:2]) + 1e-3
    return q, keys, v, pi / pi.sum(-1, keepdims=True)


@settings(max_examples=40)
@given(problem=linear_problems(), causal=st.booleans())
def test_linear_attention_exact_and_float64(problem, causal):
    q, keys, v, pi = problem
    exact = mgk.linear_attention(q, keys, v, pi=pi, causal=causal, precision="exact")
    assert_same_bits(f"linear_attention exact (causal={causal})", exact,
                     _rounded(naive_linear(q, keys, v, pi=pi, causal=causal)))
    fast = mgk.linear_attention(q, keys, v, pi=pi, causal=causal)
    n_terms = q.shape[-1] + keys.shape[1] + keys.shape[0] + 4
    assert_within(f"linear_attention float64 (causal={causal})", fast, exact,
                  ratio_bound(n_terms, np.abs(v).max()))


@settings(max_examples=25)
@given(problem=linear_problems())
def test_causal_linear_attention_prefix_property(problem):
    """Causal row i == the non-causal output of row i on the prefix q, keys, v [: i + 1]."""
    q, keys, v, pi = problem
    length = min(len(q), len(keys))
    causal = mgk.linear_attention(q, keys, v, pi=pi, causal=True, precision="exact")
    causal64 = mgk.linear_attention(q, keys, v, pi=pi, causal=True)
    for i in range(length):
        prefix = mgk.linear_attention(q[: i + 1], keys[: i + 1], v[: i + 1], pi=pi[: i + 1],
                                      precision="exact")
        assert_same_bits(f"causal prefix row {i} (exact)", causal[i], prefix[i])
        prefix64 = mgk.linear_attention(q[: i + 1], keys[: i + 1], v[: i + 1], pi=pi[: i + 1])
        n_terms = q.shape[-1] + keys.shape[1] + i + 5
        assert_within(f"causal prefix row {i} (float64)", causal64[i], prefix64[i],
                      2 * ratio_bound(n_terms, np.abs(v).max()))


def test_mixture_is_formed_after_the_feature_map(rng):
    """pi = (1, 0) is exactly the single first component; an averaged key is not."""
    q, keys, v = rng.standard_normal((2, 2)), rng.standard_normal((3, 2, 2)), \
        rng.standard_normal((3, 2))
    one = mgk.linear_attention(q, keys, v, pi=np.tile([1.0, 0.0], (3, 1)), precision="exact")
    first = mgk.linear_attention(q, keys[:, :1], v, pi=np.ones((3, 1)), precision="exact")
    assert_same_bits("pi=(1,0) vs the first component", one, first)
    half = mgk.linear_attention(q, keys, v, pi=np.full((3, 2), 0.5))
    averaged = mgk.linear_attention(q, keys.mean(1, keepdims=True), v, pi=np.ones((3, 1)))
    assert np.abs(half - averaged).max() > ratio_bound(16, np.abs(v).max())


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.fixture
def rng():
    return np.random.default_rng(20260323)


@pytest.fixture
def small(rng):
    return rng.standard_normal((2, 3)), rng.standard_normal((4, 2, 3)), rng.standard_normal((4, 2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(sigma2=0.0), "sigma2"),
    (dict(sigma2=np.array([[1.0, -1.0]] * 4)), "sigma2"),
    (dict(sigma2=np.ones((3, 2))), "sigma2"),
    (dict(log_pi=np.log(np.full((4, 2), 0.4))), "log_pi"),
    (dict(log_pi=np.full((4, 2), np.nan)), "log_pi"),
    (dict(mode="sparse"), "mode"),
    (dict(window=(-1, 0)), "window"),
    (dict(align="center"), "align"),
    (dict(mask=np.ones((2, 4))), "mask"),
])
def test_attention_rejects(small, kwargs, match):
    q, keys, v = small
    with pytest.raises((TypeError, ValueError), match=match):
        mgk.attention(q, keys, v, **kwargs)


def test_shape_mismatches(small):
    q, keys, v = small
    with pytest.raises(ValueError, match="keys"):
        mgk.attention(q, keys[..., :2], v)
    with pytest.raises(ValueError, match="keys"):
        mgk.attention(q, keys[:, 0], v)
    with pytest.raises(ValueError, match="v"):
        mgk.attention(q, keys, v[:3])


@pytest.mark.parametrize("pi, match", [
    (np.full((4, 2), 0.6), "pi"),
    (np.array([[1.5, -0.5]] * 4), "pi"),
    (np.full((4, 3), 1 / 3), "pi"),
])
def test_linear_attention_rejects_non_distributions(small, pi, match):
    q, keys, v = small
    with pytest.raises(ValueError, match=match):
        mgk.linear_attention(q, keys, v, pi=pi)


def test_linear_attention_rejects_feature_map(small):
    q, keys, v = small
    with pytest.raises(ValueError, match="feature_map"):
        mgk.linear_attention(q, keys, v, pi=np.full((4, 2), 0.5), feature_map="relu")


def test_em_update_pi_rejects(small):
    q, keys, _ = small
    with pytest.raises(ValueError, match="log_pi"):
        mgk.em_update_pi(q, keys, log_pi=np.zeros((4, 2)), sigma2=1.0)
    with pytest.raises(ValueError, match="sigma2"):
        mgk.em_update_pi(q, keys, log_pi=np.log(np.full((4, 2), 0.5)), sigma2=-2.0)


def test_exact_tie_on_a_rounding_midpoint():
    """Two keys with the same two components (soft scores equal as multisets of terms): the
    weights are exactly 1/2 and the output 1/2 + 2**-54 a float64 midpoint (rounds to 0.5)."""
    q = np.zeros((1, 2))
    keys = np.zeros((2, 2, 2))
    keys[:, 1, :] = 1.0
    v = np.array([[1.0], [2.0**-53]])
    for mode in ("soft", "hard"):
        out = mgk.attention(q, keys, v, mode=mode, precision="exact")
        assert_same_bits(f"midpoint tie ({mode})", out, np.array([[0.5]]))


def test_linear_attention_with_batch_dims_equals_per_slice():
    """Non-causal MLK with leading batch dimensions (the normaliser's contraction once
    treated the batch axis as a matrix axis)."""
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 3, 4))
    keys = rng.standard_normal((2, 5, 2, 4))
    v = rng.standard_normal((2, 5, 3))
    pi = np.full((2, 5, 2), 0.5)
    batched = mgk.linear_attention(q, keys, v, pi=pi)
    sliced = np.stack([mgk.linear_attention(q[b], keys[b], v[b], pi=pi[b]) for b in range(2)])
    np.testing.assert_array_equal(batched, sliced)
