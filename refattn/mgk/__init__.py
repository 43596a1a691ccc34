"""Transformer-MGK and Transformer-MLK: attention with a mixture of Gaussian keys per position.

Nguyen, Nguyen, Le, Nguyen, Tran, Baraniuk, Ho & Osher, "Improving Transformers with
Probabilistic Attention Keys", ICML 2022 (seed 001, a set of notes on the paper). The notes
number no equation; refattn cites their displays in order of appearance:

* (N1) the mixture ``p(q_i) = sum_j pi_j N(q_i | k_j, sigma^2 I)``;
* (N2) the posterior ``p(t_j = 1 | q_i)`` (the attention weight);
* (N3) its normalised-inner-product form; (N4) the per-key mixture over components r;
* (N5) the MGK posterior in inner-product form, (N6) its Gaussian-kernel relaxation;
* (N7) the MGK output ``h_i = sum_j P(t_j = 1 | q_i) v_j``;
* (N8) the E-step, (N9) the hard (max) assignment.

**Sign pinned.** The notes print the MGK exponents as ``exp(||q_i - k_jr||^2 / 2 sigma^2)``
without the minus sign (N6)-(N9). A Gaussian density ``N(q | k, sigma^2)`` has
``exp(-||q - k||^2 / (2 sigma^2))`` and that is what refattn computes; the printed sign would make
far keys win. Scores are log-space throughout:

.. math::

    s_{ij} = \\operatorname{lse}_r\\Big(\\log \\pi_{jr}
              - \\frac{\\|q_i - k_{jr}\\|^2}{2\\sigma^2_{jr}}\\Big) \\ \\text{(soft)},\\qquad
    s_{ij} = \\max_r\\Big(- \\frac{\\|q_i - k_{jr}\\|^2}{2\\sigma^2_{jr}}\\Big) \\ \\text{(hard)},

then ``h_i = sum_j softmax_j(s_ij) v_j`` over the allowed keys. The public transformer-mgk code
forms ``sum_r pi exp(.)`` directly and returns 0/0 = NaN (or 0) once every exponential of a row
underflows; here every exponential is of a max-shifted score.

Public-code readings (named options, defaults follow the notes; repository
minhtannguyen/transformer-mgk): ``attention(row_eps=1e-6)`` (MGKAttn's row guard),
``attention(pi_form="free")`` (rbf2keys: independent clamped pi_0, pi_1),
``em_update_pi(pi_update="per_key", normalized=False, component_eps=1e-6)`` (soft2keys' pi
update, and the LRA soft_em update), ``linear_attention(mlk_form="lra" | "lm")``. Each
function's docstring says which configuration it reproduces, how closely, and what the
public code does that refattn leaves to the caller (pooling pi over the batch).
"""

from ._em import EMResult, em_update_pi
from ._gaussian import attention, attention_vjp
from ._inputs import BACKENDS as BACKENDS
from ._inputs import FEATURE_MAPS, LM_EPS, MLK_FORMS, MODES, PI_FORMS, PI_UPDATES, MGKGrads
from ._linear import linear_attention, linear_attention_vjp

__all__ = [
    "attention",
    "attention_vjp",
    "em_update_pi",
    "linear_attention",
    "linear_attention_vjp",
    "EMResult",
    "MGKGrads",
    "MODES",
    "FEATURE_MAPS",
    "MLK_FORMS",
    "PI_UPDATES",
    "PI_FORMS",
    "LM_EPS",
]
