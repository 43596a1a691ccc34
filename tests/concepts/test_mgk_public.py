"""Issue 29: the transformer-mgk language-modelling configurations (minhtannguyen/
transformer-mgk, language-modeling/lmtool-fwms/src/mem_transformer.py, class MGKAttn) as
refattn options, at the public code's own hyperparameters (sigma^2 = sqrt(D), sqrt(D)/3, the
1e-6 guards, pi initialised at 0.5 or learnt and clamped), against twins written from that
code's description (tests/naive/mgk.py, mpmath): the float64 option within
:data:`~tests.naive.gmm.PUBLIC_CODE_RTOL` of the twin, the exact path within the float64 path's
error bound, and the option moving the result by more than that (the difference it removes).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from oracle.judging.tolerance import mixture_bound
from refattn import mgk
from refattn.bounds import mgk_vjp_bound
from tests.helpers import assert_within
from tests.naive.gmm import PUBLIC_CODE_RTOL
from tests.naive.mgk import (
    MGK_GUARD,
    lm_two_key_variances,
    naive_lm_rbf2keys,
    naive_lm_soft2keys_pi,
)
from tests.registry import mgk_term_scale

B, L, S, D, E = 2, 4, 5, 8, 3


def _variances():
    return np.array([float(s) for s in lm_two_key_variances(D)])


def _two_keys(rng, scale, batch=()):
    q = scale * rng.standard_normal(batch + (L, D))
    k0, k1 = (scale * rng.standard_normal(batch + (S, D)) for _ in range(2))
    return q, k0, k1, np.stack([k0, k1], axis=-2)


@pytest.mark.parametrize("scale", [2.0, 1.0, 0.3])
def test_soft2keys_pi_update(scale):
    """pi_update="per_key", normalized=False, component_eps=1e-6, pooled over the batch by
    the caller's mean over axis 0 (equal query counts), reproduces soft2keys' pi update."""
    rng = np.random.default_rng(int(scale * 10))
    q, k0, k1, keys = _two_keys(rng, scale, (B,))
    pi = np.full(S, 0.5)  # the buffer's initial value
    log_pi = np.log(np.stack([pi, 1 - pi], axis=-1))
    twin = np.array(naive_lm_soft2keys_pi(q, k0, k1, pi), dtype=float)
    options = dict(log_pi=log_pi, sigma2=_variances(), pi_update="per_key")
    public = dict(options, normalized=False, component_eps=MGK_GUARD)
    fast = mgk.em_update_pi(q, keys, **public)
    tolerance = PUBLIC_CODE_RTOL * np.abs(twin).max()
    assert_within(fast.pi[..., 0].mean(axis=0), twin, tolerance, what=f"soft2keys pi ({scale})")
    exact = mgk.em_update_pi(q, keys, **public, precision="exact")
    bound = mixture_bound(mgk_term_scale(q, keys, options), 3, D, 1.0)
    assert_within(fast.pi, exact.pi, bound, what=f"soft2keys pi float64 vs exact ({scale})")
    before = mgk.em_update_pi(q, keys, **options).pi[..., 0].mean(axis=0)
    assert np.abs(before - twin).max() > tolerance, "premise: the options change pi"


def test_component_eps_is_the_guard_and_needs_the_unnormalised_kernels():
    rng = np.random.default_rng(5)
    q, _, _, keys = _two_keys(rng, 2.0)
    options = dict(log_pi=np.log(np.full((S, 2), 0.5)), sigma2=_variances(), pi_update="per_key")
    guarded = mgk.em_update_pi(q, keys, **options, normalized=False, component_eps=MGK_GUARD)
    plain = mgk.em_update_pi(q, keys, **options, normalized=False)
    assert (guarded.responsibilities.sum(-1) <= plain.responsibilities.sum(-1)).all()
    with pytest.raises(ValueError, match="normalized=False"):
        mgk.em_update_pi(q, keys, **options, component_eps=MGK_GUARD)
    with pytest.raises(ValueError, match="per_key"):
        mgk.em_update_pi(
            q, keys, log_pi=options["log_pi"], sigma2=1.0, normalized=False, component_eps=1e-6
        )


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_rbf2keys_attention(scale):
    """pi_form="free" with clamped independent pi_0, pi_1, row_eps=1e-6, causal with the
    memory first (bottom_right), reproduces rbf2keys' attention."""
    rng = np.random.default_rng(int(scale * 100))
    q, k0, k1, keys = _two_keys(rng, scale)
    q = q[:3]  # a segment shorter than memory + segment
    v = rng.standard_normal((S, E))
    pi0, pi1 = rng.uniform(-0.2, 1.2, S), rng.uniform(-0.2, 1.2, S)  # learnt, then clamped
    twin = np.array(naive_lm_rbf2keys(q, k0, k1, v, pi0, pi1), dtype=float)
    with np.errstate(divide="ignore"):
        log_pi = np.log(np.clip(np.stack([pi0, pi1], axis=-1), 0.0, 1.0))
    options = dict(
        log_pi=log_pi, sigma2=_variances(), row_eps=MGK_GUARD, causal=True, align="bottom_right"
    )
    fast = mgk.attention(q, keys, v, **options, pi_form="free")
    tolerance = PUBLIC_CODE_RTOL * np.abs(twin).max()
    assert_within(fast, twin, tolerance, what=f"rbf2keys attention ({scale})")
    exact = mgk.attention(q, keys, v, **options, pi_form="free", precision="exact")
    scale_terms = mgk_term_scale(q, keys, {"sigma2": _variances()})
    bound = mixture_bound(scale_terms, 2 * S, D, np.abs(v).max())
    assert_within(fast, exact, bound, what=f"rbf2keys float64 vs exact ({scale})")
    with pytest.raises(ValueError, match="distribution"):
        mgk.attention(q, keys, v, **options)
    normalised = log_pi - np.logaddexp.reduce(log_pi, axis=-1, keepdims=True)
    before = mgk.attention(q, keys, v, **dict(options, log_pi=normalised))
    assert np.abs(before - twin).max() > tolerance, "premise: renormalising pi changes it"


def test_rbf2keys_attention_vjp():
    """The vjp with free pi (row_eps=0, where mgk_vjp_bound holds): float64 vs exact."""
    rng = np.random.default_rng(7)
    q, _, _, keys = _two_keys(rng, 0.7)
    v, grad = rng.standard_normal((S, E)), rng.standard_normal((L, E))
    log_pi = np.log(rng.uniform(0.1, 1.0, (S, 2)))
    options = dict(log_pi=log_pi, sigma2=_variances(), causal=True, pi_form="free")
    exact = mgk.attention_vjp(q, keys, v, grad, **options, precision="exact")
    fast = mgk.attention_vjp(q, keys, v, grad, **options)
    bounds = mgk_vjp_bound(q, keys, v, grad, sigma2=_variances(), log_pi=log_pi)
    for field, value, want in zip(fast._fields, fast, exact, strict=True):
        assert_within(value, want, bounds[field], what=f"free-pi vjp {field}")


def test_lm_variances():
    assert _variances().tolist() == [math.sqrt(D), math.sqrt(D) / 3]
