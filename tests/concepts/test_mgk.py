"""Tests of refattn.mgk (Transformer-MGK / MLK, Nguyen et al. 2022).

Truth is the loop-level mpmath twin of tests/naive/mgk.py (60 digits, the Gaussian exponent with its
minus sign, the allowed set from docs/conventions.md), independent of refattn.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.judging.tolerance import mixture_bound, ratio_bound
from refattn import mgk
from refattn.attention import attention
from tests.helpers import assert_same_bits, assert_within
from tests.naive.mgk import naive_em, naive_mgk
from tests.naive.rounding import round_nested
from tests.registry import mgk_term_scale
from tests.strategies import linear_problems, mgk_problems

# --------------------------------------------------------------------------------------------
# attention (random cases, exact vs the naive twin and float64 vs its bound, and the same for
# linear_attention: tests/test_registry.py)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_out_dtype(dtype, rng):
    q, keys, v = (
        rng.standard_normal((2, 2)),
        rng.standard_normal((3, 2, 2)),
        rng.standard_normal((3, 2)),
    )
    out = mgk.attention(q, keys, v, sigma2=0.7, precision="exact", out_dtype=dtype)
    assert_same_bits(
        out.astype(np.float64),
        round_nested(naive_mgk(q, keys, v, sigma2=0.7), dtype),
        what=f"mgk exact out_dtype={dtype}",
    )


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**32 - 1),
    length=st.integers(1, 3),
    units=st.integers(1, 4),
    sigma_exp=st.integers(-2, 2),
    causal=st.booleans(),
)
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
    hard = mgk.attention(
        q, k[:, None, :], v, sigma2=sigma2, mode="hard", causal=causal, precision="exact"
    )
    bias = np.broadcast_to(-(k * k).sum(-1) / (2 * sigma2), (length, units))
    plain = attention(q, k, v, scale=1 / sigma2, bias=bias, causal=causal, precision="exact")
    assert_same_bits(soft, hard, what="R=1 soft vs hard (exact)")
    assert_same_bits(soft, plain, what="R=1 soft vs attention (exact)")
    soft64 = mgk.attention(q, k[:, None, :], v, sigma2=sigma2, causal=causal)
    hard64 = mgk.attention(q, k[:, None, :], v, sigma2=sigma2, mode="hard", causal=causal)
    assert_same_bits(soft64, hard64, what="R=1 soft vs hard (float64)")


def test_masked_key_is_removed_and_poison_ignored(rng):
    q, keys, v = (
        rng.standard_normal((3, 2)),
        rng.standard_normal((4, 2, 2)),
        rng.standard_normal((4, 2)),
    )
    mask = np.ones((3, 4), dtype=bool)
    mask[:, 2] = False
    poisoned_keys, poisoned_v = keys.copy(), v.copy()
    poisoned_keys[2] = np.nan
    poisoned_v[2] = np.inf
    for precision in ("float64", "exact"):
        full = mgk.attention(q, poisoned_keys, poisoned_v, mask=mask, precision=precision)
        cut = mgk.attention(q, keys[[0, 1, 3]], v[[0, 1, 3]], precision=precision)
        assert_same_bits(full, cut, what=f"masked NaN key vs removed key ({precision})")
    allowed_nan = mgk.attention(q, poisoned_keys, poisoned_v)
    assert np.isnan(allowed_nan).all(), "NaN in an allowed key must reach its rows"


def test_empty_rows_give_zero(rng):
    q, keys, v = (
        rng.standard_normal((2, 2)),
        rng.standard_normal((3, 1, 2)),
        rng.standard_normal((3, 2)),
    )
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
    assert_same_bits(exact, round_nested(naive_mgk(q, keys, v)), what="mgk exact at scores ~ -1e4")
    assert_within(
        fast,
        exact,
        mixture_bound(mgk_term_scale(q, keys, {}), 6, 4, np.abs(v).max()),
        what="mgk float64 at scores ~ -1e4",
    )


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
    exact = mgk.em_update_pi(q, keys, log_pi=log_pi, sigma2=sigma2, mask=mask, precision="exact")
    pi, resp = naive_em(q, keys, log_pi=log_pi, sigma2=sigma2, mask=mask)
    assert_same_bits(exact.pi, round_nested(pi), what="em_update_pi exact pi")
    assert_same_bits(
        exact.responsibilities, round_nested(resp), what="em_update_pi exact responsibilities"
    )
    fast = mgk.em_update_pi(q, keys, log_pi=log_pi, sigma2=sigma2, mask=mask)
    scale = mgk_term_scale(q, keys, dict(opts, log_pi=log_pi))
    bound = mixture_bound(scale, units * comps + len(q), q.shape[-1] + 2, 2.0)
    assert_within(fast.pi, exact.pi, bound, what="em_update_pi float64 pi")
    assert_within(
        fast.responsibilities,
        exact.responsibilities,
        bound,
        what="em_update_pi float64 responsibilities",
    )


def test_em_update_pi_moves_weight_to_the_explaining_component():
    q = np.array([[0.0], [0.1]])
    keys = np.array([[[0.0], [4.0]]])
    res = mgk.em_update_pi(q, keys, log_pi=np.log(np.array([[0.5, 0.5]])), sigma2=1.0)
    assert res.pi[0, 0] > 0.99 and abs(res.pi.sum() - 1) <= mixture_bound(0.0, 2, 0, 1.0)


# --------------------------------------------------------------------------------------------
# linear_attention (MLK)
# --------------------------------------------------------------------------------------------


@settings(max_examples=25)
@given(problem=linear_problems())
def test_causal_linear_attention_prefix_property(problem):
    """Causal row i == the non-causal output of row i on the prefix q, keys, v [: i + 1]."""
    q, keys, v, pi = problem
    length = min(len(q), len(keys))
    causal = mgk.linear_attention(q, keys, v, pi=pi, causal=True, precision="exact")
    causal64 = mgk.linear_attention(q, keys, v, pi=pi, causal=True)
    for i in range(length):
        prefix = mgk.linear_attention(
            q[: i + 1], keys[: i + 1], v[: i + 1], pi=pi[: i + 1], precision="exact"
        )
        assert_same_bits(causal[i], prefix[i], what=f"causal prefix row {i} (exact)")
        prefix64 = mgk.linear_attention(q[: i + 1], keys[: i + 1], v[: i + 1], pi=pi[: i + 1])
        n_terms = q.shape[-1] + keys.shape[1] + i + 5
        assert_within(
            causal64[i],
            prefix64[i],
            2 * ratio_bound(n_terms, np.abs(v).max()),
            what=f"causal prefix row {i} (float64)",
        )


def test_mixture_is_formed_after_the_feature_map(rng):
    """pi = (1, 0) is exactly the single first component; an averaged key is not."""
    q, keys, v = (
        rng.standard_normal((2, 2)),
        rng.standard_normal((3, 2, 2)),
        rng.standard_normal((3, 2)),
    )
    one = mgk.linear_attention(q, keys, v, pi=np.tile([1.0, 0.0], (3, 1)), precision="exact")
    first = mgk.linear_attention(q, keys[:, :1], v, pi=np.ones((3, 1)), precision="exact")
    assert_same_bits(one, first, what="pi=(1,0) vs the first component")
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


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma2=0.0), "sigma2"),
        (dict(sigma2=np.array([[1.0, -1.0]] * 4)), "sigma2"),
        (dict(sigma2=np.ones((3, 2))), "sigma2"),
        (dict(log_pi=np.log(np.full((4, 2), 0.4))), "log_pi"),
        (dict(log_pi=np.full((4, 2), np.nan)), "log_pi"),
        (dict(mode="sparse"), "mode"),
        (dict(window=(-1, 0)), "window"),
        (dict(align="center"), "align"),
        (dict(mask=np.ones((2, 4))), "mask"),
    ],
)
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


@pytest.mark.parametrize(
    "pi, match",
    [
        (np.full((4, 2), 0.6), "pi"),
        (np.array([[1.5, -0.5]] * 4), "pi"),
        (np.full((4, 3), 1 / 3), "pi"),
    ],
)
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
        assert_same_bits(out, np.array([[0.5]]), what=f"midpoint tie ({mode})")


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
