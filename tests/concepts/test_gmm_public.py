"""Issue 29: gmm.adapt_keys reproduces the authors' public key adaptation
(apple/ml-probabilistic-attention, probabilisticattention.py: update_weights and the key loop).

Each configuration runs at the public code's own hyperparameters (alpha = 1/sqrt(D), the
docstring's special case, or per-unit alpha; ``key_adaptation_iters`` = 3; a key prior
precision or none) against a twin written from that code's description
(:func:`tests.naive.gmm.naive_apple_adapt_keys`, mpmath): the float64 option within
:data:`~tests.naive.gmm.PUBLIC_CODE_RTOL` of the twin, the exact path within the float64
path's error bound, and the option moving the result by more than that (the difference it
removes).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from oracle.judging.tolerance import iterated_bound, mixture_bound
from refattn import gmm
from tests.helpers import assert_within
from tests.naive.gmm import DPS, PUBLIC_CODE_RTOL, naive_apple_adapt_keys
from tests.naive.mp import central_vjp
from tests.registry import gmm_term_scale, gmm_vjp_bound

L, S, D, E = 5, 4, 3, 2
ITERS = 3  # key_adaptation_iters

#: name -> (the public configuration as adapt_keys options, the options without issue 29's
#: additions that the default readings would use)
CONFIGURATIONS = {
    "magnitude prior, beta > 0": dict(prior="magnitude", beta=0.5, values=True),
    "v_init": dict(beta=0.5, values=True, v_init=True),
    "per-unit alpha": dict(alpha="per_unit"),
    "per-unit alpha and beta, magnitude, v_init": dict(
        alpha="per_unit", beta="per_unit", prior="magnitude", values=True, v_init=True
    ),
    "no key prior precision": dict(gamma=None, beta=0.5, values=True, v_init=True),
}


def _configuration(name):
    spec = dict(CONFIGURATIONS[name])
    rng = np.random.default_rng(sorted(CONFIGURATIONS).index(name) + 29)
    queries, keys0 = rng.standard_normal((L, D)), rng.standard_normal((S, D))
    values, v_init = rng.standard_normal((S, E)), rng.standard_normal((L, E))
    alpha = rng.uniform(0.3, 3.0, S) if spec.get("alpha") == "per_unit" else 1 / math.sqrt(D)
    beta = rng.uniform(0.3, 3.0, S) if spec.get("beta") == "per_unit" else spec.get("beta", 0.0)
    options = dict(alpha=alpha, gamma=spec.get("gamma", 1.0), prior=spec.get("prior", "uniform"))
    if spec.get("values"):
        options.update(values=values, beta=beta)
    if spec.get("v_init"):
        options["v_init"] = v_init
    return queries, keys0, options, rng


def _refattn_options(options):
    """The twin's options as adapt_keys takes them (gamma None: the loop without a prior)."""
    out = dict(options, form="map_recentred", e_step="unnormalised")
    if out["gamma"] is None:
        out["gamma"] = 0.0
    return out


def _float64_bound(queries, keys0, options):
    values = options.get("values", np.zeros((S, 1)))
    reach = np.abs(values).max() + np.abs(options.get("v_init", values)).max()
    scale = gmm_term_scale(
        queries, keys0, values, options["alpha"], options.get("beta", 0.0), options["prior"]
    )
    scale += float(np.max(options.get("beta", 0.0))) * values.shape[-1] * reach**2
    step = mixture_bound(scale, L + S, D, np.abs(queries).max() + np.abs(keys0).max())
    return iterated_bound(step * (L + 1), L + 1, ITERS)


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_adapt_keys_reproduces_the_public_key_adaptation(name):
    queries, keys0, options, _ = _configuration(name)
    twin = np.array(naive_apple_adapt_keys(queries, keys0, iters=ITERS, **options), dtype=float)
    chosen = _refattn_options(options)
    fast = gmm.adapt_keys(queries, keys0, iters=ITERS, **chosen)
    tolerance = PUBLIC_CODE_RTOL * np.abs(twin).max()
    assert_within(fast, twin, tolerance, what=f"adapt_keys vs the public loop ({name})")
    exact = gmm.adapt_keys(queries, keys0, iters=ITERS, **chosen, precision="exact")
    bound = _float64_bound(queries, keys0, options)
    assert_within(fast, exact, bound, what=f"adapt_keys float64 vs exact ({name})")
    assert_within(exact, twin, tolerance + bound, what=f"adapt_keys exact vs twin ({name})")
    default = {k: v for k, v in chosen.items() if k not in ("values", "beta", "v_init", "e_step")}
    before = gmm.adapt_keys(queries, keys0, iters=ITERS, **default)
    assert np.abs(before - twin).max() > tolerance, "premise: issue 29's options change it"


@pytest.mark.parametrize("name", ["magnitude prior, beta > 0", "v_init", "per-unit alpha"])
def test_adapt_keys_vjp_with_the_public_options(name):
    """The vjp of the public configuration: the exact path against central differences of the
    twin, the float64 path against the exact path (gmm_vjp_bound, as the other key vjps)."""
    queries, keys0, options, rng = _configuration(name)
    grad = rng.standard_normal((S, D))
    chosen = _refattn_options(options)
    exact = gmm.adapt_keys_vjp(queries, keys0, grad, iters=2, **chosen, precision="exact")
    fast = gmm.adapt_keys_vjp(queries, keys0, grad, iters=2, **chosen)
    values = options.get("values", np.zeros((S, 1)))
    scale = gmm_term_scale(
        queries, keys0, values, options["alpha"], options.get("beta", 0.0), options["prior"]
    )
    reach = np.abs(queries).max() + np.abs(keys0).max()
    bound = gmm_vjp_bound(scale, L + S, D, exact, grad, reach, 2, lipschitz=L + 1)
    for field, value, want in zip(fast._fields, fast, exact, strict=True):
        assert_within(value, want, bound, what=f"adapt_keys_vjp float64 {field} ({name})")

    def twin(q, k):
        return naive_apple_adapt_keys(q, k, iters=2, **options)

    truth = central_vjp(twin, (queries, keys0), grad, dps=DPS)
    for field, value, (estimate, error) in zip(exact._fields, exact, truth, strict=True):
        tolerance = error.astype(float) + PUBLIC_CODE_RTOL * np.abs(estimate.astype(float)).max()
        assert_within(value, estimate.astype(float), tolerance, what=f"exact {field} ({name})")


def test_value_terms_need_values():
    queries, keys0 = np.zeros((2, 2)), np.zeros((3, 2))
    with pytest.raises(ValueError, match="values"):
        gmm.adapt_keys(queries, keys0, alpha=1.0, gamma=1.0, v_init=np.zeros((2, 1)))
    with pytest.raises(ValueError, match="values"):
        gmm.adapt_keys(queries, keys0, alpha=1.0, gamma=1.0, beta=0.5)
    with pytest.raises(ValueError, match="e_step"):
        gmm.adapt_keys(queries, keys0, alpha=1.0, gamma=1.0, e_step="apple")


def test_defaults_unchanged_by_the_new_options():
    """values with beta = 0, no v_init, paper E-step: the keys of the paper's eq. (23)."""
    rng = np.random.default_rng(3)
    queries, keys0, values = (rng.standard_normal(s) for s in ((L, D), (S, D), (S, E)))
    for precision in ("float64", "exact"):
        plain = gmm.adapt_keys(queries, keys0, alpha=0.7, gamma=1.0, iters=2, precision=precision)
        with_values = gmm.adapt_keys(
            queries, keys0, alpha=0.7, gamma=1.0, iters=2, values=values, precision=precision
        )
        np.testing.assert_array_equal(with_values, plain)
