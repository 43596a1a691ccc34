"""Gaussian-mixture attention of Movellan & Gabbur, "Probabilistic Transformers".

A database of S memory units u, each with a key xi_u (D,) and an expected value mu_u (E,),
generates query/value pairs (eqs. (1), (6)-(8))

.. math::

    p(q, v) = \\sum_u p(u)\\,\\mathcal N(q;\\,\\xi_u, \\alpha_u^{-1} I_D)\\,
              \\mathcal N(v;\\,\\mu_u, \\beta_u^{-1} I_E).

Attention is MAP inference of v given q by EM (eqs. (2)-(5), (13)-(14)); inference-time
adaptation of the keys (eqs. (25)-(29)) and of the unit priors (eqs. (30)-(34)) is EM over the
batch of queries. Equation numbers are those of the source (seed 000).

Every function has ``precision="float64"`` (NumPy, log-space: every exponential is of a
max-shifted score) and ``precision="exact"`` (each output element the exact value of the stated
finite computation -- ``iters`` EM iterations -- rounded once to ``out_dtype`` by a Ziv loop over
interval enclosures).

Pinned readings (see each function for details):

* alpha_u, beta_u may differ per unit (an extension of the paper's scalars); the Gaussian
  normalisers ``(D/2) log alpha_u`` and ``(E/2) log beta_u`` then enter the E-step (eq. (5)),
  of which eq. (14) is the equal-precision case where they cancel.
* Per-unit beta: the M-step solves eq. (12), ``v = sum w_u beta_u mu_u / sum w_u beta_u``;
  eq. (13) is its equal-beta case.
* ``v_init=None``: the first E-step uses w_u = p(u | q) (eq. (5) with the value likelihood
  marginalised out), i.e. eq. (14) with no beta term. The prior keeps its own factors: with
  ``prior="magnitude"`` the prior of eq. (15) contains ``exp(beta_u ||mu_u||^2 / 2)``, so the
  first iterate is softmax attention (eq. (20)) only when beta = 0.
* ``adapt_keys(form="paper")`` is eqs. (28)-(29) as printed; ``form="map"`` counts the Gaussian
  key prior (25) once instead of once per unit of responsibility.
* Masks: ``attention`` takes the allowed set of :mod:`refattn.masks` (``mask`` True = attend,
  ``causal``, ``window``, ``align``): excluded units get no weight in any E-step; a row with
  no allowed unit follows ``empty_rows`` ("zero" or "nan", as :func:`refattn.attention`).

Public-code readings (named options; the defaults follow the paper). The authors' public code
is apple/ml-probabilistic-attention, file ``probabilisticattention.py``,
``ProbabilisticAttention.forward``: its ``update_weights`` (the E-step), its key-adaptation
loop and its final ``v = sum_u w_u mu_u``. Which configuration each option reproduces:

* ``attention(form="unnormalised", iters=1)``: the forward without key adaptation, for
  shared or per-unit alpha and beta, with or without ``v_init`` and ``magnitude_priors``
  (``prior="magnitude"``), ``pi=None``; no positional embeddings, no ``v_fixed``, no
  ``nonzero_wts_mask`` (those are not claimed). The E-step leaves out (D/2) log
  alpha_u and (E/2) log beta_u and the M-step is the plain mean ``sum_u w_u mu_u`` (default
  "paper": the normalisers of eqs. (7)-(8) and the root of eq. (12)).
* ``adapt_keys(form="map_recentred", e_step="unnormalised", values=mu, beta=beta,
  v_init=v)``: the key-adaptation loop (``key_adaptation_iters=iters``,
  ``zeta_prior_precision`` = gamma, gamma = 0 when None) for the same configurations: the
  once-counted key prior centred on the current keys at every iteration (the paper's eq.
  (25) centres it on xi^0), responsibilities with every term of the attention E-step (the
  magnitude prior's ``beta_u ||mu_u||^2 / 2``, the value likelihood of v_init, no
  normalisers). Without ``values``/``v_init`` it is the loop for ``beta = 0`` or no
  magnitude prior and no v_init; with shared alpha ``e_step`` makes no difference. The
  forward after key adaptation is then ``attention(q, adapted_keys, mu,
  form="unnormalised", v_init=v)``.

The key loop reproduces the public code within 4e-16 relative in float64
(tests/concepts/test_gmm_public.py, twins in tests/naive/gmm.py), the attention within
1.5e-15 (measured against that code run in torch float64, issue 29). The public code adds 1e-20
to the sum of its max-shifted weights; that sum is at least 1, so no float64 weight moves.

Vector-Jacobian products: :func:`attention_vjp`, :func:`adapt_keys_vjp`,
:func:`adapt_priors_vjp`, the derivative of the finite computation as run, on both paths.
"""

from ._adapt import adapt_keys, adapt_priors
from ._forward import GMMResult, attention, log_posterior

# the option spellings and validators, module attributes as before the split (not in __all__)
from ._model import ATTENTION_FORMS as ATTENTION_FORMS
from ._model import BACKENDS as BACKENDS
from ._model import KEY_FORMS as KEY_FORMS
from ._model import PRIOR_FORMS as PRIOR_FORMS
from ._model import PRIORS as PRIORS
from ._model import batch_of as batch_of
from ._model import unit_parameter as unit_parameter
from ._vjp import (
    AdaptKeysVJP,
    AdaptPriorsVJP,
    AttentionVJP,
    adapt_keys_vjp,
    adapt_priors_vjp,
    attention_vjp,
)

__all__ = [
    "attention",
    "log_posterior",
    "adapt_keys",
    "adapt_priors",
    "GMMResult",
    "attention_vjp",
    "adapt_keys_vjp",
    "adapt_priors_vjp",
    "AttentionVJP",
    "AdaptKeysVJP",
    "AdaptPriorsVJP",
]
