"""The one tolerance policy of refattn (the only place tolerances are defined).

Everything here derives from a format's unit roundoff ``u = 2**-p`` and the case's
conditioning; nothing is a guessed literal.

* :func:`unit_roundoff` -- ``u`` of a dtype.
* :func:`gamma` -- Higham's ``gamma_n = n u / (1 - n u)``, the bound on the relative error of
  ``n`` successive roundings (Higham, *Accuracy and Stability of Numerical Algorithms*, Lemma 3.1).
* :func:`ulp` / :func:`ulp_distance` -- units in the last place of a format.

Judging an attention implementation (used by :mod:`oracle.judging.judge`)
==================================================================

Notation: ``u`` is the unit roundoff of the implementation dtype (the case dtype, which is also
the storage and output dtype), ``u_a`` that of the *accumulation* dtype (float32 for float16 and
bfloat16, the dtype itself otherwise, :func:`accumulation_dtype`), ``p_ij`` the exact softmax
weights, ``a_ij = |scale| sum_d |q_id||k_jd| + |bias_ij| + |alibi_ij|`` the magnitude of the
score ``t_ij`` (computed in float64 from the inputs, :func:`score_magnitude`) and
``A_i = max_j a_ij`` over the allowed keys of row ``i``.

1. Per-element error, normalised by the natural scale (:func:`normalised_error`)
-------------------------------------------------------------------------------
An output element ``out_ie = sum_j w_ij v_je`` (``w`` the post-dropout weights) is a weighted sum;
any algorithm that perturbs each term by a relative ``eps`` moves it by at most
``eps * sum_j w_ij |v_je|``. That sum, the *natural scale* (:func:`output_scale`), replaces
``|out_ie|`` as denominator, so an element whose terms nearly cancel (``|out| << scale``) is
not held to an accuracy no summation could reach, while a well-scaled element is held to
relative accuracy. It is computed in float64 from the truth weights (error ``~ 1e-16``
relative, irrelevant for a scale). The normalised error is

.. math::

    \\epsilon_{ie} = |\\hat o_{ie} - o_{ie}| \\,/\\, \\max(s_{ie}, \\tau),
    \\qquad s_{ie} = \\sum_j w_{ij} |v_{je}|                             \\qquad (T1)

with ``tau`` the smallest normal number of the dtype (so one rounding into the subnormal range
counts as at most ``u``). NaN against NaN and equal infinities count as 0; NaN or Inf against a
finite truth, or a finite value against a NaN/Inf truth, count as +inf. The same error is also
reported in ulp of the dtype at the truth (:func:`ulp_distance`).

Natural scales of the other quantities (first-order perturbation bounds, :func:`lse_scale`,
:func:`grad_scales`):

* lse: ``|lse_i| + sum_j p_ij a_ij + 1``: a score perturbation ``delta t_ij`` moves lse by
  ``sum_j p_ij delta t_ij``; ``|lse|`` carries the final rounding; the ``1`` is the absolute
  (nat) unit of the error of ``log(sum)``, whose argument lies in ``[1, S]``.
* gradients, with ``|dP|_ij = sum_e |dO_ie||v_je| (keep/(1-p))`` and
  ``g_ij = p_ij (|dP|_ij + sum_k p_ik |dP|_ik + |grad_lse_i|)`` (the magnitude of
  ``dS_ij = p_ij (dP_ij - Delta_i + grad_lse_i)``):
  ``dq: |scale| g |k|``, ``dk: |scale| g^T |q|``, ``dv: w^T |dO|`` (folded over the heads that
  share a kv head and summed over broadcast dimensions like the gradient itself) and
  ``dbias: g`` summed to the shape of bias.

2. Threshold (:func:`threshold`)
--------------------------------
.. math::

    T = \\max(k \\, E_{base},\\; F) + u_{out}                              \\qquad (T2)

* ``E_base`` -- the *baseline rule* (FlashAttention's test rule, generalised): the oracle runs a
  textbook implementation in the case dtype (:func:`oracle.reading.baseline.textbook_attention`;
  half
  types accumulate matmuls and the softmax in float32 but store scores, weights and outputs in
  the half type, like PyTorch's math path) and measures its largest normalised error (T1)
  against the exact truth on *this* case. ``E_base`` therefore carries the case's real
  difficulty (score range, length, cancellation) without any model. Elements where the baseline
  is NaN/Inf but the truth is finite (poison cases) make the rule void; then ``E_base = 0`` and
  ``F`` decides.
* ``k`` -- :data:`K_FORWARD` = 2 for out and lse (FlashAttention's factor: two algorithms that
  both round correctly at each step differ in error by their summation order; a factor 2 covers a
  blocked/online softmax against a two-pass one), :data:`K_BACKWARD` = 3 for gradients (the
  backward chains three matmuls and the difference ``dP - Delta``, and ``Delta_i`` may be formed
  from the rounded output, ``rowsum(dO * O)``, as FlashAttention does, or from ``P * dP`` as the
  textbook does: the two differ by more than a summation order).
* ``F`` -- an a-priori floor so that a lucky baseline (e.g. exact on small integers) does not
  make the rule unattainable. It is the *probabilistic* rounding error bound of the textbook
  algorithm with ``u_a`` accumulation (Higham & Mary 2019, "A new approach to probabilistic
  rounding error analysis", Thm. 2.4): ``n`` roundings of independent mean-zero errors give a
  relative error at most

  .. math::

      \\tilde\\gamma_n(\\lambda) = \\exp(\\lambda \\sqrt{n}\\, u_a + n u_a^2/(1-u_a)) - 1
                                                                        \\qquad (T3)

  with probability at least ``1 - 2n exp(-lambda^2 (1-u_a)^2 / 2)``. ``lambda`` is chosen so
  that this failure probability, union-bounded over every element of the case, is at most
  :data:`FAILURE_PROBABILITY` = 1e-6 (:func:`probabilistic_gamma`). The worst-case bound
  (``gamma_n``) is ``sqrt(n)/lambda`` times larger and would hide real bugs (a half-precision
  accumulation over 1024 keys is only ~30x worse than float32 accumulation).

  Forward derivation (first order, row ``i``): the score error is
  ``|delta t_ij| <= delta_s a_ij`` with

  .. math::

      \\delta_s = \\tilde\\gamma_{D}  + 2u_a + (1 + n_{st}) u             \\qquad (T4)

  (dot product, scale product and tanh in ``u_a``; the scale itself and each stored stage
  -- scores, and softcap/bias/ALiBi when present, ``n_st`` of them -- rounded to the dtype).
  Since ``p_ij`` is proportional to ``exp(t_ij)``, ``|delta p_ij / p_ij| <= 2 max_j |delta t_ij|``;
  the exponentials, the normaliser sum and the division add ``gamma~_S + 3 u_a``, storing the
  weights ``u`` (and dropout's ``1/(1-p)`` one more ``u_a + u``); ``weights @ v`` adds
  ``gamma~_S``. Hence, normalised by (T1):

  .. math::

      F_{out,i} = 2\\delta_s A_i + 2\\tilde\\gamma_S + 4u_a + 2u\\,(+u_a+u)  \\qquad (T5)

  For lse (normalised by its scale): ``F_lse = delta_s + gamma~_S + 3u_a + u``. For gradients
  (backward is the forward's perturbations propagated through ``dS = P (dP - Delta)`` plus
  the three backward matmuls):
  ``F_grad = 4 delta_s A + gamma~_E + gamma~_D + 2 gamma~_S + 2 gamma~_{LG} + 8u_a + 4u``
  (``+ 2(u_a + u)`` with dropout) with ``A = max_i A_i``. (T5) is a per-row worst case; it
  is the floor of the gradients and of the diagnosis "computes in a narrower dtype".

  *Element-wise floor of out and lse (T6, the one used for them).* (T5) charges every score
  its worst error, which in float16/bfloat16 (``delta_s A ~ 1e-2``) is two orders of magnitude
  above what any correct implementation shows. The first-order effect of score errors on
  one element is exact and linear: with ``d_ij = keep_ij/(1-p)`` (1 without dropout),

  .. math::

      \\delta o_{ie} = \\sum_j c_{ije} \\, \\delta t_{ij}, \\qquad
      c_{ije} = p_{ij} (d_{ij} v_{je} - o_{ie}),                    \\qquad (T6a)

  (softmax shift invariance removes the mean of ``delta t``). Split ``delta t`` into a
  *coherent* part -- the scale rounded once to the dtype multiplies every ``s_ij =
  scale q_i.k_j`` by the same ``1 + eps``, ``|eps| <= u`` -- whose effect is exactly
  ``u |sum_j c_ije s_ij|`` (``u sum_j |c_ije s_ij|`` with softcap, whose derivative varies
  with j), and *independent* parts (dot-product, product and storage roundings,
  ``|delta t_ij| <= delta_ind a_ij`` with ``delta_ind = gamma~_D + 2u_a + n_st u``), bounded
  and mean-zero under the model of (T3). Hoeffding's inequality bounds their sum by
  ``lambda sqrt(sum_j c_ije^2 a_ij^2) delta_ind`` with probability ``1 - 2exp(-lambda^2/2)``
  (``lambda`` again from the union bound over the case's elements); it is capped by the
  worst case ``delta_ind sum_j |c_ije| a_ij``. A factor ``1 + (delta_ind + u) A_i`` covers the
  second-order terms of ``exp``. Normalised by (T1):

  .. math::

      F_{out,ie} = \\frac{(1 + (\\delta_{ind}+u)A_i)\\,\\big(\\min(\\lambda R_{ie}, W_{ie})
                   \\delta_{ind} + u C_{ie}\\big)}{s_{ie}}
                   + 2\\tilde\\gamma_S + 4u_a + 2u\\,(+u_a+u)            \\qquad (T6)

  with ``R = sqrt(sum_j c^2 a^2)``, ``W = sum_j |c| a`` (bounded above by
  ``sum_j p a (d |v| + |o|)``) and ``C`` the coherent sum. lse is the same with
  ``c_ij = p_ij`` (``delta lse = sum_j p_ij delta t_ij``), normalised by its scale, plus
  ``gamma~_S + 3u_a + u``. All of it is computed in float64 from the truth weights
  (:func:`output_floor`, :func:`lse_floor`).
* ``u_out`` -- one rounding of the output dtype (the truth is the exact value rounded once; an
  implementation that is correct up to its final rounding may land one rounding away).

A case passes when every checked element satisfies ``epsilon <= T`` (T per element for out
and lse, (T6); per case for gradients). The worst element reported is the one with the
largest ratio ``epsilon / T``.

3. The tight tier (``tolerance="tight"``, :func:`output_expected`, :func:`lse_expected`)
----------------------------------------------------------------------------------------
(T2) must never fail a correct algorithm, so its floor is a bound: for float32 cases the
floor dominates and correct kernels use only 3-7 % of it, and a kernel that accumulates
``P @ V`` in float16 (22-93x the error of a float32 accumulator) passes. The tight tier
replaces (T2) for out and lse by ``lambda`` *standard deviations* of the error a correct
float32-accumulating kernel makes on the element, under the same model as (T3) (independent
mean-zero roundings, each uniform within ``+-u``, variance ``u^2/3``), plus the coherent scale
rounding and the final rounding:

.. math::

    T^{tight}_{ie} = \\frac{(\\lambda \\sigma_{ie} + u C_{ie})(1 + (\\delta_{ind}+u)A_i)}
                         {s_{ie}} + u_{out},                                \\qquad (T7)

    \\sigma_{ie}^2 = \\underbrace{\\Big(\\frac{u_a^2 (D+2)}{3} + \\frac{n_{st} u^2}{3}\\Big)
                    \\sum_j c_{ije}^2 a_{ij}^2}_{\\text{scores}}
                 + \\underbrace{\\sum_j \\frac{e_{ij}^2 d_{ij}^2 v_{je}^2}{3}}_{\\text{P rounded}}
                 + \\underbrace{\\big(2 u_a \\sqrt{S/3}\\, s_{ie}\\big)^2}_{\\text{float32 sums}}

* scores: a dot product of ``D`` terms in ``u_a`` has error ``sum_k delta_k x_k`` with
  every partial sum ``|x_k| <= a_ij``, plus the product and scale roundings (``D + 2``
  roundings of variance ``u_a^2 a^2 / 3``); each stage stored in the dtype (``n_st``:
  scores, softcap, bias) adds ``u^2 a^2 / 3``; (T6a) propagates them with ``c_ije``.
* P rounded: each probability rounded to the dtype before ``P @ V`` (the textbook stores the
  weights, FlashAttention's tensor-core path rounds ``P~ = exp(s - m)`` to float16/bfloat16:
  both are correct) with ``e_ij = max(u p_ij, half the subnormal spacing)``, plus the
  ``exp`` in ``u_a``.
* float32 sums: the normaliser and ``P @ V`` summed in ``u_a``, every partial sum at most
  the natural scale ``s_ie``: standard deviation at most ``u_a sqrt(S/3) s_ie`` each
  (recursive summation; blocked and pairwise sums are smaller).

``lambda`` is Hoeffding's of (T6) (the union bound over the case's elements at
:data:`FAILURE_PROBABILITY`), applied once: (T6) applies it to ``gamma~_D`` too and charges
worst cases, which is what makes it loose. For lse: ``sigma^2 = (scores) sum_j p_ij^2
a_ij^2 + (u_a sqrt(S/3))^2 + u_a^2``, normalised by the lse scale. The baseline rule is not
used (the model is the expected error, not a measured worst). Measured on the default suite
(280 cases, 4 dtypes): the textbook, refattn's float64 path, torch SDPA (CPU), a correct
tiled online-softmax kernel, its FlashAttention-style variant (P in float16/bfloat16) and a
split-KV variant pass both tiers; a float16/bfloat16 ``P @ V`` accumulator fails the tight
tier where rows are long or nearly uniform (it passes (T2)). Gradients and the variant
families keep (T2) in the tight tier.

4. Values near overflow; elements with no finite threshold (T8)
---------------------------------------------------------------
The floors (T6) and (T7) hold second moments of the values (``sum_j c_ij^2 a_ij^2`` with
``c_ij`` linear in ``v``, ``sum_j e_ij^2 v_je^2``, ``(s_ie)^2``). Formed directly they
overflow when the values lie near the top of the dtype (``worst-overflow`` in float64: ``v``
about ``2**1015``, ``v^2 = inf``) and then ``inf - inf`` made the floor NaN on most elements;
they underflow for values near the bottom. Both floors are homogeneous of degree 0 in one value
column (numerator and natural scale are of degree 1 in ``v_e`` and ``o_e``), so they are
computed with every column ``v_{.e}`` and the truth ``o_{.e}`` divided by a power of two
near its largest magnitude (exact; :func:`_column_unit`), and the natural scale divided by the
same power.

No element is ever left unjudged: where the rule (T2) or (T7) still gives no finite value (a
NaN or infinite floor or baseline), the element is judged by the dtype's own exactness,

.. math::

    T_{ie} = \\mathrm{ulp}_{dtype}(o_{ie}) \\,/\\, \\max(s_{ie}, \\tau)       \\qquad (T8)

i.e. it must lie within one ulp of the exact truth (faithful rounding; a correctly rounded
value is within half an ulp), and where even (T8) is not finite (a NaN or infinite truth or
scale) the limit is 0: only a value equal to the truth passes (:func:`with_ulp_rule`). A NaN
threshold compared with ``>`` is never exceeded, so without (T8) such an element would pass
whatever the implementation returned. The report counts the elements judged by (T8)
(``one_ulp_rule_elements``) and the worst element's threshold names the rule.

The same model evaluated at a *narrower* dtype is the diagnosis' realistic limit for "the
implementation computes in float32 / float16 / bfloat16" (:mod:`oracle.judging.judge`): what a
correct kernel computing in that dtype shows (bfloat16 torch SDPA reaches normalised errors
of 4e-4 to 1.2e-3 on the default suite; (T5) would admit 0.25).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from oracle.reading.allowed import allowed_positions
from oracle.reading.heads import alibi_bias, resolve_scale, with_heads

# The a-priori error bounds of refattn's own paths live in refattn.bounds (the library does not
# depend on its oracle); they are re-exported here for the judging policy and the tests (the
# variants' on first access, :func:`__getattr__`).
from refattn.bounds import gamma, grad_scales, unit_roundoff

if TYPE_CHECKING:  # re-exported on first access (__getattr__ below)
    from refattn.bounds import (
        fixed_point_forward_bound,
        iterated_bound,
        logit_lse_bound,
        mixture_bound,
        ratio_bound,
        transformer_forward_bound,
    )
from refattn.broadcast import expand_kv
from refattn.exact.rounding import format_of

__all__ = [
    "unit_roundoff",
    "gamma",
    "ulp",
    "ulp_distance",
    "K_FORWARD",
    "K_BACKWARD",
    "FAILURE_PROBABILITY",
    "accumulation_dtype",
    "probabilistic_gamma",
    "normalised_error",
    "finite_abs",
    "output_scale",
    "lse_scale",
    "grad_scales",
    "score_magnitude",
    "allowed_positions",
    "Threshold",
    "threshold",
    "with_ulp_rule",
    "forward_floors",
    "output_floor",
    "lse_floor",
    "TIERS",
    "check_tier",
    "output_expected",
    "lse_expected",
    "scaled_dots",
    "variant_floor",
    "fixed_point_forward_bound",
    "logit_lse_bound",
    "mixture_bound",
    "iterated_bound",
    "ratio_bound",
    "transformer_forward_bound",
]

#: the variants' bounds, re-exported from :mod:`refattn.bounds` on first access: importing
#: them imports the variants' modules (refattn.transformer, ...), which judging attention
#: never needs
_VARIANT_BOUNDS = (
    "fixed_point_forward_bound",
    "iterated_bound",
    "logit_lse_bound",
    "mixture_bound",
    "ratio_bound",
    "transformer_forward_bound",
)


def __getattr__(name):
    if name in _VARIANT_BOUNDS:
        import refattn.bounds

        return getattr(refattn.bounds, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Baseline factor for out and lse (FlashAttention's rule; see the module docstring).
K_FORWARD = 2.0
#: Baseline factor for dq, dk, dv, dbias (see the module docstring).
K_BACKWARD = 3.0
#: Probability, per case, that a correct textbook algorithm exceeds the floor F (T3).
FAILURE_PROBABILITY = 1e-6


def ulp(x, dtype) -> np.ndarray:
    """Spacing of ``dtype`` at |x| (the subnormal spacing below the normal range)."""
    fmt = format_of(dtype)
    x = np.abs(np.asarray(x, dtype=np.float64))
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.where(x > 0, x, 1.0)))
    exponent = np.maximum(exponent, fmt.emin)
    return np.ldexp(1.0, (exponent - (fmt.p - 1)).astype(int))


def ulp_distance(value, truth, dtype) -> np.ndarray:
    """|value - truth| in units of the ``dtype`` ulp at the truth (inf where one is NaN)."""
    value = np.asarray(value, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        dist = np.abs(value - truth) / ulp(truth, dtype)
        if np.isfinite(dist).all():  # value and truth finite: equal ones are 0 already
            return dist
        same = (value == truth) | (np.isnan(value) & np.isnan(truth))
    return np.where(same, 0.0, np.where(np.isnan(dist), np.inf, dist))


# ---------------------------------------------------------------------------------------------
# Judging attention implementations (the derivation is in the module docstring)
# ---------------------------------------------------------------------------------------------


def accumulation_dtype(dtype) -> np.dtype:
    """float32 for the half types (float16, bfloat16), the dtype itself otherwise.

    >>> accumulation_dtype("float16").name, accumulation_dtype("float64").name
    ('float32', 'float64')
    """
    fmt = format_of(dtype)
    return np.dtype(np.float32) if fmt.p < 24 else fmt.dtype


def _tiny(dtype) -> float:
    return math.ldexp(1.0, format_of(dtype).emin)


def probabilistic_gamma(n, dtype="float64", *, count=1) -> float:
    """Higham & Mary's probabilistic bound (T3) on ``n`` roundings in ``dtype``.

    ``lambda`` makes the failure probability, union-bounded over ``count`` such bounds, at most
    :data:`FAILURE_PROBABILITY`: ``2 n count exp(-lambda^2 (1-u)^2 / 2) = FAILURE_PROBABILITY``.

    >>> probabilistic_gamma(1024, "float32") < gamma(1024, "float32") / 4
    True
    """
    u = unit_roundoff(dtype)
    n = max(int(n), 1)
    lam = math.sqrt(2 * math.log(2 * n * max(int(count), 1) / FAILURE_PROBABILITY)) / (1 - u)
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


def normalised_error(value, truth, scale, dtype) -> np.ndarray:
    """Per-element error (T1): ``|value - truth| / max(scale, tiny(dtype))``.

    NaN vs NaN and equal infinities give 0; any other disagreement in finiteness gives +inf.

    >>> float(normalised_error(1.0 + 2**-20, 1.0, 2.0, "float32")[()]) == 2**-21
    True
    """
    value = np.asarray(value, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    scale = np.broadcast_to(np.asarray(scale, dtype=np.float64), truth.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(value - truth) / np.maximum(scale, _tiny(dtype))
    if np.isfinite(err).all():  # then value and truth are finite: err is the answer
        return err
    both_nan = np.isnan(value) & np.isnan(truth)
    same_inf = np.isinf(truth) & (value == truth)
    finite = np.isfinite(value) & np.isfinite(truth)
    return np.where(both_nan | same_inf, 0.0, np.where(finite, err, np.inf))


def finite_abs(x):
    """``|x|`` in float64 with every non-finite entry 0."""
    x = np.asarray(x, dtype=np.float64)
    return np.where(np.isfinite(x), np.abs(x), 0.0)


def score_magnitude(
    q,
    k,
    *,
    scale=None,
    bias=None,
    alibi_slopes=None,
    gqa="interleave",
    align="top_left",
    **_ignored,
) -> np.ndarray:
    """``a_ij = |scale| sum_d |q_id||k_jd| + |bias_ij| + |alibi_ij|`` in float64, (..., H, L, S).

    The magnitude of every term that makes up score ``t_ij``: the rounding errors of the score
    are proportional to it (T4). Non-finite inputs (poison) count as 0.
    """
    q3, k3 = with_heads(q, "q"), with_heads(k, "k")
    H, L, D = q3.shape[-3:]
    S = k3.shape[-2]
    k_h = expand_kv(k3, H, gqa or "interleave")
    a = abs(resolve_scale(scale, D)) * np.matmul(
        finite_abs(q3), np.swapaxes(finite_abs(k_h), -1, -2)
    )
    if bias is not None:
        a = a + finite_abs(bias)
    if alibi_slopes is not None:
        a = a + np.abs(alibi_bias(alibi_slopes, L, S, align or "top_left"))
    return a


def output_scale(weights, v, *, gqa="interleave", prepared=None) -> np.ndarray:
    """Natural scale of the output (T1): ``s_ie = sum_j w_ij |v_je|``, (..., H, L, E).

    ``weights`` are the float64 post-dropout weights (..., H, L, S); v (..., K, S, E).
    ``prepared``: a :class:`oracle.reading.baseline.PreparedKV` of ``v``, whose expanded
    ``|v|`` it reuses (the same operands: the same bits).
    """
    w = finite_abs(weights)
    if w.ndim == 2:  # a single head: (L, S) weights, (S, E) values
        return w @ finite_abs(v)
    if prepared is not None and v is prepared.v:
        return np.matmul(w, prepared.abs_values(w.shape[-3], gqa or "interleave"))
    v3 = with_heads(v, "v")
    return np.matmul(w, expand_kv(finite_abs(v3), w.shape[-3], gqa or "interleave"))


def lse_scale(lse, weights, magnitude) -> np.ndarray:
    """Natural scale of lse: ``|lse_i| + sum_j p_ij a_ij + 1`` (module docstring, item 1)."""
    spread = (finite_abs(weights) * magnitude).sum(axis=-1)
    return finite_abs(lse) + spread + 1.0


def forward_floors(
    dtype, *, D, S, L, E, G, magnitude, allowed, n_stored=1, dropout=False, count=1
) -> dict:
    """The a-priori floors F of (T5): "out" per row (..., H, L, 1), "lse" per row, "grad" scalar.

    ``magnitude`` is :func:`score_magnitude`, ``allowed`` the allowed set (broadcastable to it),
    ``n_stored`` the number of score stages stored in ``dtype`` (1 + softcap + bias + ALiBi),
    ``count`` the number of checked elements (for the union bound of (T3)).
    """
    acc = accumulation_dtype(dtype)
    u, ua = unit_roundoff(dtype), unit_roundoff(acc)

    def pg(n):
        return probabilistic_gamma(n, acc, count=count)

    delta_s = pg(D) + 2 * ua + (1 + n_stored) * u
    rows = np.where(np.broadcast_to(allowed, magnitude.shape), magnitude, 0.0).max(axis=-1)
    drop = (ua + u) if dropout else 0.0
    out = 2 * delta_s * rows + 2 * pg(S) + 4 * ua + 2 * u + drop
    lse = np.full(rows.shape, delta_s + pg(S) + 3 * ua + u)
    A = float(rows.max()) if rows.size else 0.0
    grad = (
        4 * delta_s * A
        + pg(E)
        + pg(D)
        + 2 * pg(S)
        + 2 * pg(max(L * G, 1))
        + 8 * ua
        + 4 * u
        + 2 * drop
    )
    return {"out": out[..., None], "lse": lse, "grad": grad}


def _lambda(count) -> float:
    """Hoeffding's lambda: ``2 count exp(-lambda^2 / 2) = FAILURE_PROBABILITY``."""
    return math.sqrt(2 * math.log(2 * max(int(count), 1) / FAILURE_PROBABILITY))


def scaled_dots(q, k, *, scale=None, gqa="interleave", **_ignored) -> np.ndarray:
    """Signed ``s_ij = scale (q_i . k_j)`` in float64, (..., H, L, S) (poison counts as 0)."""
    q3, k3 = with_heads(q, "q"), with_heads(k, "k")
    k_h = expand_kv(k3, q3.shape[-3], gqa or "interleave")
    clean = [np.where(np.isfinite(x), x, 0.0).astype(np.float64) for x in (q3, k_h)]
    return resolve_scale(scale, q3.shape[-1]) * np.matmul(clean[0], np.swapaxes(clean[1], -1, -2))


def _score_terms(dtype, count, D, n_stored):
    acc = accumulation_dtype(dtype)
    u, ua = unit_roundoff(dtype), unit_roundoff(acc)
    independent = probabilistic_gamma(D, acc, count=count) + 2 * ua + n_stored * u
    return u, ua, independent, _lambda(count), acc


def output_floor(
    dtype,
    *,
    weights,
    dropped,
    magnitude,
    dots,
    v,
    out,
    D,
    S,
    n_stored=1,
    softcap=False,
    dropout=False,
    gqa="interleave",
    count=1,
) -> np.ndarray:
    """Element-wise floor (T6) of the output, (..., H, L, E), normalised by (T1).

    See the module docstring for the derivation.

    ``weights`` p and ``dropped`` (p times keep/(1-p)) are the float64 truth weights,
    ``magnitude`` a (:func:`score_magnitude`), ``dots`` the signed scaled dot products
    (:func:`scaled_dots`), ``out`` the float64 truth.
    """
    u, ua, delta, lam, acc = _score_terms(dtype, count, D, n_stored)
    p, pa, d, v_h, o, spread, unit = _value_spread(weights, dropped, magnitude, v, out, gqa)
    worst = (pa * d) @ np.abs(v_h) + np.abs(o) * pa.sum(-1)[..., None]
    independent = delta * np.minimum(lam * np.sqrt(np.maximum(spread, 0.0)), worst)
    coherent, rows = _coherent(p, dots, d, v_h, o, magnitude, softcap)
    second_order = 1 + delta * rows + u * rows
    scale = np.maximum(output_scale(dropped, v, gqa=gqa), _tiny(dtype)) / unit
    drop = (ua + u) if dropout else 0.0
    first = (independent + u * coherent) * second_order / scale
    return first + 2 * probabilistic_gamma(S, acc, count=count) + 4 * ua + 2 * u + drop


def lse_floor(
    dtype, *, weights, magnitude, dots, lse, D, S, n_stored=1, softcap=False, count=1
) -> np.ndarray:
    """Element-wise floor (T6) of lse, (..., H, L), normalised by :func:`lse_scale`."""
    u, ua, delta, lam, acc = _score_terms(dtype, count, D, n_stored)
    p = finite_abs(weights)
    pa = p * magnitude
    independent = delta * np.minimum(lam * np.sqrt((pa * pa).sum(-1)), pa.sum(-1))
    ps = p * dots
    coherent = np.abs(ps).sum(-1) if softcap else np.abs(ps.sum(-1))
    rows = (np.where(p > 0, magnitude, 0.0)).max(axis=-1)
    first = (independent + u * coherent) * (1 + delta * rows + u * rows)
    return (
        first / lse_scale(lse, weights, magnitude)
        + probabilistic_gamma(S, acc, count=count)
        + 3 * ua
        + u
    )


#: The tolerance tiers: "default" (T2, no false alarm on any correct algorithm) and "tight"
#: (T7, the expected error of a correct float32-accumulating kernel).
TIERS = ("default", "tight")


def check_tier(tier) -> str:
    """``tier`` if it is one of :data:`TIERS`, else a ValueError naming the argument.

    >>> check_tier("tight")
    'tight'
    """
    if tier not in TIERS:
        raise ValueError(f"tolerance: expected one of {list(TIERS)}, got {tier!r}")
    return tier


def _expected_terms(dtype, D, S, n_stored, count):
    """Per-score error variance factor and the sums' standard deviation factor of (T7)."""
    acc = accumulation_dtype(dtype)
    u, ua = unit_roundoff(dtype), unit_roundoff(acc)
    score_var = ua * ua * (D + 2) / 3 + n_stored * u * u / 3
    sums_std = 2 * ua * math.sqrt(max(S, 1) / 3)
    return u, ua, score_var, sums_std, _lambda(count)


def output_expected(
    dtype,
    *,
    weights,
    dropped,
    magnitude,
    dots,
    v,
    out,
    D,
    S,
    n_stored=1,
    softcap=False,
    dropout=False,
    gqa="interleave",
    count=1,
) -> np.ndarray:
    """Tight-tier threshold (T7) of the output, (..., H, L, E), normalised by (T1).

    ``lambda`` standard deviations of the error a correct float32-accumulating kernel makes
    on this element (scores, probabilities rounded to the dtype, float32 sums) plus the
    coherent scale rounding and the final rounding; see the module docstring.
    """
    u, ua, score_var, sums_std, lam = _expected_terms(dtype, D, S, n_stored, count)
    p, pa, d, v_h, o, spread, unit = _value_spread(weights, dropped, magnitude, v, out, gqa)
    # each weight rounded to the dtype (a subnormal weight by half its spacing), exp in acc
    fmt = format_of(dtype)
    sub = math.ldexp(1.0, fmt.emin - fmt.p)
    rounding = np.maximum(p * u * math.sqrt(1 + dropout), sub) ** 2 + (p * ua) ** 2 * 2
    p_var = (rounding * d * d) @ (v_h * v_h) / 3
    scale = np.maximum(output_scale(dropped, v, gqa=gqa), _tiny(dtype)) / unit
    coherent, rows = _coherent(p, dots, d, v_h, o, magnitude, softcap)
    _, _, delta, _, _ = _score_terms(dtype, count, D, n_stored)
    second_order = 1 + (delta + u) * rows
    var = np.maximum(spread, 0.0) * score_var + p_var + (sums_std * scale) ** 2
    return (lam * np.sqrt(var) + u * coherent) * second_order / scale + u * dropout


def lse_expected(
    dtype, *, weights, magnitude, dots, lse, D, S, n_stored=1, softcap=False, count=1
) -> np.ndarray:
    """Tight-tier threshold (T7) of lse, (..., H, L), normalised by :func:`lse_scale`."""
    u, ua, score_var, sums_std, lam = _expected_terms(dtype, D, S, n_stored, count)
    p = finite_abs(weights)
    pa = p * magnitude
    ps = p * dots
    coherent = np.abs(ps).sum(-1) if softcap else np.abs(ps.sum(-1))
    rows = (np.where(p > 0, magnitude, 0.0)).max(axis=-1)
    _, _, delta, _, _ = _score_terms(dtype, count, D, n_stored)
    var = (pa * pa).sum(-1) * score_var + (sums_std / 2) ** 2 + ua * ua
    first = (lam * np.sqrt(var) + u * coherent) * (1 + (delta + u) * rows)
    return first / lse_scale(lse, weights, magnitude)


@dataclass
class Threshold:
    """Threshold (T2) of one quantity: ``max(k E_base, F) + u_out``; in the tight tier (T7)
    ``floor`` is the expected-error model and ``baseline`` is None.

    ``baseline`` is the textbook's largest normalised error (None when void), ``floor`` F
    (a scalar or an array broadcastable to the quantity).
    """

    k: float
    baseline: float | None
    floor: np.ndarray | float
    u_out: float
    tier: str = "default"
    #: the one-ulp limits (T8) of the elements whose rule gives no finite threshold
    fallback: np.ndarray | None = field(default=None, repr=False)

    @property
    def rule(self):
        """T of (T2) / (T7) as computed, broadcastable to the quantity (may hold NaN)."""
        base = 0.0 if self.baseline is None else self.k * self.baseline
        with np.errstate(invalid="ignore"):
            return np.maximum(base, self.floor) + self.u_out

    @property
    def value(self):
        """T, broadcastable to the quantity: the rule's value where it is finite, the one-ulp
        limit (T8) elsewhere (:func:`with_ulp_rule`)."""
        rule = self.rule
        if self.fallback is None:
            return rule
        return np.where(np.isfinite(rule), rule, self.fallback)

    @property
    def n_fallback(self) -> int:
        """How many elements are judged by the one-ulp rule (T8) because the rule gave no
        finite threshold."""
        if self.fallback is None:
            return 0
        rule = np.broadcast_to(self.rule, np.shape(self.fallback))
        return int(np.count_nonzero(~np.isfinite(rule)))

    def formula(self, index=None, shape=None) -> str:
        """``max(k x baseline, floor) + u_out`` in numbers: the floor at ``index`` of a quantity
        of ``shape`` when both are given (so the text shows the threshold of that element),
        else the largest floor."""
        base = "void" if self.baseline is None else f"{self.baseline:.3g}"
        fallback = self._fallback_at(index, shape)
        if fallback is not None:
            return (
                f"no finite threshold from the rule (floor nan or inf): one-ulp rule (T8) "
                f"{fallback:.3g}"
            )
        if index is not None and shape is not None and np.ndim(self.floor):
            floor = float(
                np.broadcast_to(np.asarray(self.floor, dtype=np.float64), shape)[tuple(index)]
            )
        else:
            floor = float(np.max(self.floor))
        if self.tier == "tight":
            return (
                f"tight: expected error of a float32-accumulating kernel {floor:.3g} "
                f"+ u_out {self.u_out:.3g}"
            )
        return f"max({self.k:g} x baseline {base}, floor {floor:.3g}) + u_out {self.u_out:.3g}"

    def _fallback_at(self, index, shape):
        """The one-ulp limit at ``index`` when that element has no finite rule, else None."""
        if self.fallback is None or index is None or shape is None:
            return None
        where = tuple(index)
        rule = float(np.broadcast_to(self.rule, shape)[where])
        if math.isfinite(rule):
            return None
        return float(np.broadcast_to(self.fallback, shape)[where])


def with_ulp_rule(limits: Threshold, truth, scale, dtype) -> Threshold:
    """``limits`` with the one-ulp rule (T8) attached where its rule gives no finite value.

    No element passes unjudged: where (T2) or (T7) is NaN or infinite the element must lie
    within one ulp of ``dtype`` of the exact truth (faithful rounding), i.e. its normalised
    error (T1) at most ``ulp(truth) / max(scale, tiny)``; where even that is not finite (a
    NaN or infinite truth or scale) the limit is 0 (only an equal value passes).

    >>> t = Threshold(2.0, None, np.array([1e-7, np.nan]), 2**-24)
    >>> t = with_ulp_rule(t, np.array([1.0, 1.0]), np.array([1.0, 1.0]), "float32")
    >>> t.n_fallback, float(t.value[1]) == 2**-23
    (1, True)
    """
    truth = np.asarray(truth, dtype=np.float64)
    rule = np.broadcast_to(limits.rule, truth.shape)
    if np.isfinite(rule).all():
        return limits
    scale = np.broadcast_to(np.asarray(scale, dtype=np.float64), truth.shape)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        one_ulp = ulp(np.where(np.isfinite(truth), truth, 0.0), dtype) / np.maximum(
            scale, _tiny(dtype)
        )
    one_ulp = np.where(np.isfinite(one_ulp) & np.isfinite(truth), one_ulp, 0.0)
    return replace(limits, fallback=one_ulp)


def threshold(baseline_error, floor, dtype, *, k=K_FORWARD) -> Threshold:
    """Threshold (T2) from the baseline's error array (normalised), the floor and the dtype.

    A non-finite baseline error (the textbook broke where the truth is finite) voids the rule.

    >>> t = threshold(np.array([1e-7, 3e-7]), 1e-7, "float32")
    >>> bool(np.isclose(t.value, 2 * 3e-7 + 2**-24))
    True
    """
    errors = np.asarray(baseline_error, dtype=np.float64)
    worst = float(errors.max()) if errors.size else 0.0
    baseline = worst if math.isfinite(worst) else None
    return Threshold(float(k), baseline, floor, unit_roundoff(dtype))


# ---------------------------------------------------------------------------------------------
# Judging variant implementations (gmm, mgk, hopfield, meanfield fixtures)
# ---------------------------------------------------------------------------------------------


def variant_floor(dtype, *, condition, n, n_stored) -> float:
    """Floor ``F`` of (T2) for a variant output (gmm, mgk, hopfield, meanfield), normalised.

    A variant implementation is judged like attention: normalised error (T1) against the
    exact truth, threshold ``T = max(k E_base, F) + u_out`` (T2) with ``k =``
    :data:`K_FORWARD`. The *baseline* ``E_base`` is refattn's float64 path evaluated on the
    case's inputs (exact in float64) and rounded once to the case dtype
    (:func:`oracle.reading.baseline.variant_baseline`): for float64 cases it carries the case's real
    difficulty (conditioning, the stopping rule of a fixed-point solver) with no model. For the
    narrower dtypes that baseline is almost always the correctly rounded truth itself
    (``E_base ~ 0``), which no implementation computing *in* that dtype can match, so the
    floor carries the rounding errors of such an implementation:

    .. math::

        F = c \\,\\big(\\gamma_n(u_a) + n_{st}\\, u\\big)                    \\qquad (V1)

    ``gamma_n(u_a)`` is Higham's worst-case bound for the ``n`` successive roundings of the
    variant's longest chain of operations in the accumulation dtype ``u_a``
    (:func:`accumulation_dtype`: float32 for the half types); ``n_st u`` covers the
    intermediates an implementation stores in the case dtype (logits, weights, iterates: a
    relative ``u`` each); ``c`` is the case's relative condition factor
    (:func:`oracle.judging.variant_scales.condition`: ``1 + 2A`` per step for a softmax mixture with
    logit terms of magnitude ``A``, as in (T5); the condition number of the linear system for
    the mean-field fixed points). The worst-case ``gamma_n`` (not the probabilistic (T3)) is
    used because the variants' operation counts are small (n < 200) and their own float64
    bounds (:func:`mixture_bound`, :func:`ratio_bound`) are stated with it.

    >>> bool(variant_floor("float64", condition=1.0, n=3, n_stored=0) == gamma(3))
    True
    """
    u = unit_roundoff(dtype)
    u_a = accumulation_dtype(dtype)
    return float(condition) * (gamma(int(n), u_a) + int(n_stored) * u)


def _coherent(p, dots, d, v_h, o, magnitude, softcap):
    """The coherent part of the P@V error (every score off by ``dots`` in the same direction:
    its effect on each output, exact unless softcap breaks the sign structure) and each row's
    largest score magnitude, shared by the default (T2) and tight (T7) tiers."""
    ps = p * dots
    if softcap:
        coherent = (np.abs(ps) * d) @ np.abs(v_h) + np.abs(o) * np.abs(ps).sum(-1)[..., None]
    else:
        coherent = np.abs((ps * d) @ v_h - o * ps.sum(-1)[..., None])
    rows = (np.where(p > 0, magnitude, 0.0)).max(axis=-1)[..., None]
    return coherent, rows


def _column_unit(v_h) -> np.ndarray:
    """A power of two at most ``max_j |v_je|`` per value column (..., 1, E); 1 for a zero
    column. The floors divide v and the truth by it (exactly) so that their second moments
    neither overflow (values near the dtype's overflow squared) nor underflow (T6/T7 in scaled
    units; the module docstring's "Values near overflow")."""
    top = np.abs(v_h).max(axis=-2, keepdims=True) if v_h.shape[-2] else np.zeros(1)
    exponent = np.frexp(top)[1] - 1
    return np.where(top > 0, np.ldexp(1.0, exponent), 1.0)


def _value_spread(weights, dropped, magnitude, v, out, gqa):
    """(p, pa, d, v_h, o, spread, unit): the finite weights, weights times the score
    magnitude, the dropout factor per weight, finite values per query head and the finite truth
    both divided by :func:`_column_unit` ``unit``, and ``sum_j (pa_j d_j)^2 (v_j - o)^2`` in
    those units: the second moment both tiers' output terms use."""
    p = finite_abs(weights)
    d = np.divide(finite_abs(dropped), p, out=np.zeros_like(p), where=p > 0)
    v_h = v if np.ndim(v) == 2 else expand_kv(with_heads(v, "v"), p.shape[-3], gqa or "interleave")
    v_h = np.where(np.isfinite(v_h), v_h, 0.0).astype(np.float64)
    unit = _column_unit(v_h)
    v_h = v_h / unit
    o = np.where(np.isfinite(out), out, 0.0) / unit
    pa = p * magnitude
    w2 = pa * pa
    spread = (w2 * d * d) @ (v_h * v_h) - 2 * o * ((w2 * d) @ v_h) + o * o * w2.sum(-1)[..., None]
    return p, pa, d, v_h, o, spread, unit
