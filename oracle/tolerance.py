"""The one tolerance policy of refattn (the only place tolerances are defined).

Everything here derives from a format's unit roundoff ``u = 2**-p`` and the case's
conditioning; nothing is a guessed literal.

* :func:`unit_roundoff` -- ``u`` of a dtype.
* :func:`gamma` -- Higham's ``gamma_n = n u / (1 - n u)``, the bound on the relative error of
  ``n`` successive roundings (Higham, *Accuracy and Stability of Numerical Algorithms*, Lemma 3.1).
* :func:`ulp` / :func:`ulp_distance` -- units in the last place of a format.

Judging an attention implementation (used by :func:`oracle.validate`)
======================================================================

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
  textbook implementation in the case dtype (:func:`textbook_attention`; half types accumulate
  matmuls and the softmax in float32 but store scores, weights and outputs in the half type,
  like PyTorch's math path) and measures its largest normalised error (T1) against the exact
  truth on *this* case. ``E_base`` therefore carries the case's real difficulty (score range,
  length, cancellation) without any model. Elements where the baseline is NaN/Inf but the
  truth is finite (poison cases) make the rule void; then ``E_base = 0`` and ``F`` decides.
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

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
    "output_scale",
    "lse_scale",
    "grad_scales",
    "score_magnitude",
    "allowed_positions",
    "Threshold",
    "threshold",
    "forward_floors",
    "output_floor",
    "lse_floor",
    "scaled_dots",
    "textbook_attention",
    "textbook_attention_vjp",
    "Textbook",
]

#: Baseline factor for out and lse (FlashAttention's rule; see the module docstring).
K_FORWARD = 2.0
#: Baseline factor for dq, dk, dv, dbias (see the module docstring).
K_BACKWARD = 3.0
#: Probability, per case, that a correct textbook algorithm exceeds the floor F (T3).
FAILURE_PROBABILITY = 1e-6


def unit_roundoff(dtype) -> float:
    """``u = 2**-p`` for a float dtype (float64, float32, float16, bfloat16)."""
    return format_of(dtype).unit_roundoff


def gamma(n, dtype="float64") -> float:
    """Higham's gamma_n = n u / (1 - n u): bound on the relative error of n roundings."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma: n * u = {nu} >= 1, the bound is void (n={n}, dtype={dtype})")
    return nu / (1 - nu)


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
        same = (value == truth) | (np.isnan(value) & np.isnan(truth))
        dist = np.abs(value - truth) / ulp(truth, dtype)
    return np.where(same, 0.0, np.where(np.isnan(dist), np.inf, dist))


# ---------------------------------------------------------------------------------------------
# Judging attention implementations (the derivation is in the module docstring).
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
    both_nan = np.isnan(value) & np.isnan(truth)
    same_inf = np.isinf(truth) & (value == truth)
    finite = np.isfinite(value) & np.isfinite(truth)
    return np.where(both_nan | same_inf, 0.0, np.where(finite, err, np.inf))


def allowed_positions(L, S, *, mask=None, bias=None, causal=False, window=None,
                      align="top_left") -> np.ndarray:
    """The allowed set of docs/conventions.md: mask AND causal AND window AND bias > -inf.

    Shape (L, S) or the broadcast of mask/bias with it.

    >>> allowed_positions(2, 3, causal=True, align="bottom_right").astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    # the one definition of the rule; unvalidated, since the diagnosis alternatives use
    # out-of-range windows (e.g. "causal admits one key past the diagonal")
    from refattn.masks import offset_of, structural_mask

    allowed = structural_mask(range(L), range(S), causal=causal, window=window,
                              offset=offset_of(align, L, S))
    if mask is not None:
        allowed = allowed & np.asarray(mask, dtype=bool)
    if bias is not None:
        allowed = allowed & ~(np.asarray(bias, dtype=np.float64) == -np.inf)
    return allowed


def _heads(x, name):
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"{name}: expected at least 2 dimensions, got shape {x.shape}")
    return x if x.ndim > 2 else x[None]


def _expand_kv(x, H, gqa):
    """(..., K, S, .) -> (..., H, S, .): query head h reads kv head h // G or h % K."""
    K = x.shape[-3]
    if H % K:
        raise ValueError(f"H={H} is not a multiple of K={K}")
    if gqa == "interleave":
        return np.repeat(x, H // K, axis=-3)
    if gqa == "tile":
        return np.concatenate([x] * (H // K), axis=-3)
    raise ValueError(f"gqa: expected 'interleave' or 'tile', got {gqa!r}")


def _fold_kv(x, K, gqa):
    """Inverse of :func:`_expand_kv` for gradients: sum the heads sharing a kv head."""
    H = x.shape[-3]
    G = H // K
    if gqa == "interleave":
        return x.reshape(*x.shape[:-3], K, G, *x.shape[-2:]).sum(axis=-3)
    return x.reshape(*x.shape[:-3], G, K, *x.shape[-2:]).sum(axis=-4)


def _sum_to_shape(x, shape):
    """Sum ``x`` over the dimensions that broadcasting added or stretched to reach its shape."""
    shape = tuple(shape)
    extra = x.ndim - len(shape)
    if extra > 0:
        x = x.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True))
            if b == 1 and a != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape)


def _alibi(slopes, L, S, align):
    offset = 0 if align == "top_left" else S - L
    dist = np.abs(np.arange(L)[:, None] + offset - np.arange(S)[None, :]).astype(np.float64)
    slopes = np.asarray(slopes, dtype=np.float64)
    return -slopes[..., None, None] * dist


def _scale_value(scale, D):
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


class Textbook(NamedTuple):
    """Result of :func:`textbook_attention`: out (..., H, L, E), lse (..., H, L), weights
    (..., H, L, S) pre-dropout, ``allowed`` the allowed set used."""

    out: np.ndarray
    lse: np.ndarray
    weights: np.ndarray
    allowed: np.ndarray


_OPTION_NAMES = ("scale", "bias", "mask", "causal", "window", "align", "softcap",
                 "alibi_slopes", "gqa", "dropout_mask", "dropout_p", "empty_rows")


def _scores(q, k, v, dtype, scale, bias, mask, causal, window, align, softcap, alibi_slopes,
            gqa, softcap_order, allowed):
    """Final scores in the accumulation dtype (rounded through ``dtype`` at each stored stage),
    the allowed set and the pre-softcap capped scores (for the softcap derivative)."""
    acc = accumulation_dtype(dtype)
    store = format_of(dtype).dtype

    def stored(x):
        return np.asarray(x, dtype=acc).astype(store).astype(acc)

    q, k, v = _heads(q, "q"), _heads(k, "k"), _heads(v, "v")
    H, L, D = q.shape[-3:]
    S = k.shape[-2]
    k_h = _expand_kv(k, H, gqa).astype(acc)
    k_h = np.where(np.isfinite(k_h), k_h, 0)  # poison reaches only excluded scores
    poisoned_k = ~np.isfinite(_expand_kv(k, H, gqa)).all(axis=-1)
    with np.errstate(all="ignore"):
        raw = np.matmul(q.astype(acc), np.swapaxes(k_h, -1, -2))
        raw = np.where(poisoned_k[..., None, :], np.nan, raw)
        scores = stored(raw * acc.type(_scale_value(scale, D)))
    if allowed is None:
        allowed = allowed_positions(L, S, mask=mask, bias=bias, causal=causal, window=window,
                                    align=align)
    additive = np.zeros((), dtype=acc)
    if bias is not None:
        additive = np.where(np.asarray(bias) == -np.inf, 0, np.asarray(bias, dtype=np.float64))
    if alibi_slopes is not None:
        additive = additive + _alibi(alibi_slopes, L, S, align)
    has_additive = bias is not None or alibi_slopes is not None
    capped = None
    with np.errstate(all="ignore"):
        if softcap is not None and softcap_order == "before_bias":
            c = acc.type(softcap)
            capped = stored(c * np.tanh(scores / c))
            scores = capped
        if has_additive:
            scores = stored(scores + np.asarray(additive, dtype=np.float64).astype(acc))
        if softcap is not None and softcap_order == "after_bias":
            c = acc.type(softcap)
            capped = stored(c * np.tanh(scores / c))
            scores = capped
        if softcap is not None and softcap_order == "after_mask":
            c = acc.type(softcap)
            scores = stored(c * np.tanh(np.where(allowed, scores, -np.inf) / c))
            allowed = np.ones_like(allowed)
    return scores, np.broadcast_to(allowed, scores.shape), capped


def _softmax(scores, allowed, empty_rows, acc):
    masked = np.where(allowed, scores, -np.inf)
    top = masked.max(axis=-1, keepdims=True)
    empty = ~allowed.any(axis=-1)
    top = np.where(np.isfinite(top), top, 0)
    with np.errstate(all="ignore"):
        terms = np.where(allowed, np.exp(masked - top), 0)
        total = terms.sum(axis=-1, keepdims=True)
        weights = terms / total
        lse = (top + np.log(total))[..., 0]
    fill = 0 if empty_rows == "zero" else np.nan
    weights = np.where(empty[..., None], fill, weights).astype(acc)
    lse = np.where(empty, -np.inf if empty_rows == "zero" else np.nan, lse).astype(acc)
    return weights, lse


def _weights_at_v(weights, v, acc):
    """``weights @ v`` where a NaN/Inf value reaches only the rows that give it weight."""
    bad = ~np.isfinite(v)
    clean = np.where(bad, 0, v).astype(acc)
    with np.errstate(all="ignore"):
        out = np.matmul(weights, clean)
        hit = np.matmul((weights != 0).astype(acc), bad.astype(acc)) > 0
    return np.where(hit, np.nan, out)


def textbook_attention(q, k, v, *, dtype=None, softcap_order="before_bias", allowed=None,
                       **options) -> Textbook:
    """Textbook attention in ``dtype`` (the baseline of rule (T2) and the diagnosis engine).

    Two-pass max-shifted softmax; matmuls and the softmax accumulate in
    :func:`accumulation_dtype` (float32 for half types) and every stored stage (scores, capped
    scores, biased scores, weights, dropped weights, out, lse) is rounded to ``dtype``, like
    PyTorch's math path. ``dtype=None`` means q's dtype; "float64" gives an accurate float64
    evaluation (used for natural scales). ``options`` are refattn.attention's keywords.
    ``softcap_order`` ("before_bias" pinned, "after_bias", "after_mask") and ``allowed``
    (an explicit allowed set) exist for the convention diagnosis.

    Examples
    --------
    >>> import numpy as np
    >>> q = k = v = np.eye(2)
    >>> r = textbook_attention(q, k, v, scale=0.0)
    >>> r.out.tolist(), r.lse.round(4).tolist()
    ([[0.5, 0.5], [0.5, 0.5]], [0.6931, 0.6931])
    """
    unknown = set(options) - set(_OPTION_NAMES)
    if unknown:
        raise TypeError(f"textbook_attention: unknown options {sorted(unknown)}")
    opt = {name: options.get(name) for name in _OPTION_NAMES}
    dtype = np.asarray(q).dtype if dtype is None else dtype
    store = format_of(dtype).dtype
    acc = accumulation_dtype(dtype)
    squeeze = np.asarray(q).ndim == 2
    scores, allowed, _ = _scores(
        q, k, v, dtype, opt["scale"], opt["bias"], opt["mask"], bool(opt["causal"]),
        opt["window"], opt["align"] or "top_left", opt["softcap"], opt["alibi_slopes"],
        opt["gqa"] or "interleave", softcap_order, allowed)
    weights, lse = _softmax(scores, allowed, opt["empty_rows"] or "zero", acc)
    weights = weights.astype(store).astype(acc)
    dropped = _dropped(weights, opt["dropout_mask"], opt["dropout_p"] or 0.0, acc, store)
    H = scores.shape[-3]
    v_h = _expand_kv(_heads(v, "v"), H, opt["gqa"] or "interleave")
    out = _weights_at_v(dropped, v_h, acc)
    result = Textbook(out.astype(store), lse.astype(store), weights.astype(store), allowed)
    if squeeze:
        result = Textbook(*(x[..., 0, :, :] if x.ndim >= 3 and i != 1 else x[..., 0, :]
                            for i, x in enumerate(result)))
    return result


def _dropped(weights, dropout_mask, dropout_p, acc, store):
    if dropout_mask is None:
        return weights
    keep = np.asarray(dropout_mask, dtype=bool)
    rescale = acc.type(1) / (acc.type(1) - acc.type(dropout_p))
    return (np.where(keep, weights, 0) * rescale).astype(store).astype(acc)


def textbook_attention_vjp(q, k, v, grad_out, *, grad_lse=None, dtype=None, **options):
    """Textbook backward in ``dtype`` (float32 accumulation for half types): (dq, dk, dv, dbias).

    ``Delta_i = sum_j P_ij dP_ij``; ``dS = P (dP - Delta + grad_lse)``; softcap's derivative
    ``1 - (t/c)^2``; dk, dv folded over the heads sharing a kv head and every gradient summed
    to its input's shape. Empty rows get zero gradients.
    """
    opt = {name: options.get(name) for name in _OPTION_NAMES}
    unknown = set(options) - set(_OPTION_NAMES)
    if unknown:
        raise TypeError(f"textbook_attention_vjp: unknown options {sorted(unknown)}")
    dtype = np.asarray(q).dtype if dtype is None else dtype
    store = format_of(dtype).dtype
    acc = accumulation_dtype(dtype)
    gqa = opt["gqa"] or "interleave"

    def stored(x):
        return np.asarray(x, dtype=acc).astype(store).astype(acc)

    q3, k3, v3 = _heads(q, "q"), _heads(k, "k"), _heads(v, "v")
    H, D = q3.shape[-3], q3.shape[-1]
    K = k3.shape[-3]
    scores, allowed, capped = _scores(
        q, k, v, dtype, opt["scale"], opt["bias"], opt["mask"], bool(opt["causal"]),
        opt["window"], opt["align"] or "top_left", opt["softcap"], opt["alibi_slopes"], gqa,
        "before_bias", None)
    weights, _ = _softmax(scores, allowed, "zero", acc)
    weights = stored(weights)
    dO = _heads(grad_out, "grad_out").astype(acc)
    k_h = _expand_kv(k3, H, gqa).astype(acc)
    v_h = _expand_kv(v3, H, gqa).astype(acc)
    with np.errstate(all="ignore"):
        dP = stored(np.matmul(dO, np.swapaxes(v_h, -1, -2)))
        if opt["dropout_mask"] is not None:
            keep = np.asarray(opt["dropout_mask"], dtype=bool)
            rescale = acc.type(1) / (acc.type(1) - acc.type(opt["dropout_p"] or 0.0))
            dP = stored(np.where(keep, dP, 0) * rescale)
        delta = (weights * dP).sum(axis=-1, keepdims=True)
        dS = dP - delta
        if grad_lse is not None:
            dS = dS + np.asarray(grad_lse, dtype=acc)[..., None]
        dS = stored(weights * dS)
        dS_raw = dS
        if opt["softcap"] is not None:
            c = acc.type(opt["softcap"])
            dS_raw = stored(dS * (1 - (capped / c) ** 2))
        s = acc.type(_scale_value(opt["scale"], D))
        dq = np.matmul(dS_raw, k_h) * s
        dk = _fold_kv(np.matmul(np.swapaxes(dS_raw, -1, -2), q3.astype(acc)) * s, K, gqa)
        dropped = _dropped(weights, opt["dropout_mask"], opt["dropout_p"] or 0.0, acc, store)
        dv = _fold_kv(np.matmul(np.swapaxes(dropped, -1, -2), dO), K, gqa)
    dbias = None
    if opt["bias"] is not None:
        dbias = _sum_to_shape(dS, np.shape(opt["bias"])).astype(store)
    return (_sum_to_shape(dq, np.shape(q)).astype(store),
            _sum_to_shape(dk, np.shape(k)).astype(store),
            _sum_to_shape(dv, np.shape(v)).astype(store), dbias)


def _finite_abs(x):
    x = np.asarray(x, dtype=np.float64)
    return np.where(np.isfinite(x), np.abs(x), 0.0)


def score_magnitude(q, k, *, scale=None, bias=None, alibi_slopes=None, gqa="interleave",
                    align="top_left", **_ignored) -> np.ndarray:
    """``a_ij = |scale| sum_d |q_id||k_jd| + |bias_ij| + |alibi_ij|`` in float64, (..., H, L, S).

    The magnitude of every term that makes up score ``t_ij``: the rounding errors of the score
    are proportional to it (T4). Non-finite inputs (poison) count as 0.
    """
    q3, k3 = _heads(q, "q"), _heads(k, "k")
    H, L, D = q3.shape[-3:]
    S = k3.shape[-2]
    k_h = _expand_kv(k3, H, gqa or "interleave")
    a = abs(_scale_value(scale, D)) * np.matmul(_finite_abs(q3), np.swapaxes(_finite_abs(k_h),
                                                                            -1, -2))
    if bias is not None:
        a = a + _finite_abs(bias)
    if alibi_slopes is not None:
        a = a + np.abs(_alibi(alibi_slopes, L, S, align or "top_left"))
    return a


def output_scale(weights, v, *, gqa="interleave") -> np.ndarray:
    """Natural scale of the output (T1): ``s_ie = sum_j w_ij |v_je|``, (..., H, L, E).

    ``weights`` are the float64 post-dropout weights (..., H, L, S); v (..., K, S, E).
    """
    w = _finite_abs(weights)
    if w.ndim == 2:  # a single head: (L, S) weights, (S, E) values
        return w @ _finite_abs(v)
    v3 = _heads(v, "v")
    return np.matmul(w, _expand_kv(_finite_abs(v3), w.shape[-3], gqa or "interleave"))


def lse_scale(lse, weights, magnitude) -> np.ndarray:
    """Natural scale of lse: ``|lse_i| + sum_j p_ij a_ij + 1`` (module docstring, item 1)."""
    spread = (_finite_abs(weights) * magnitude).sum(axis=-1)
    return _finite_abs(lse) + spread + 1.0


def grad_scales(q, k, v, grad_out, weights, dropped, *, grad_lse=None, scale=None, bias=None,
                gqa="interleave", **_ignored) -> dict:
    """Natural scales of dq, dk, dv, dbias (module docstring, item 1), shaped like them.

    ``weights`` are the float64 pre-dropout weights, ``dropped`` the post-dropout ones (the same
    array without dropout).
    """
    gqa = gqa or "interleave"
    q3, k3, v3 = _heads(q, "q"), _heads(k, "k"), _heads(v, "v")
    H, D = q3.shape[-3], q3.shape[-1]
    K = k3.shape[-3]
    p = _finite_abs(weights)
    dO = _finite_abs(_heads(grad_out, "grad_out"))
    rescale = np.divide(_finite_abs(dropped), p, out=np.ones_like(p), where=p > 0)
    dP = np.matmul(dO, np.swapaxes(_expand_kv(_finite_abs(v3), H, gqa), -1, -2)) * rescale
    delta = (p * dP).sum(axis=-1, keepdims=True)
    g_lse = 0.0 if grad_lse is None else _finite_abs(grad_lse)[..., None]
    g = p * (dP + delta + g_lse)
    s = abs(_scale_value(scale, D))
    dq = s * np.matmul(g, _expand_kv(_finite_abs(k3), H, gqa))
    dk = _fold_kv(s * np.matmul(np.swapaxes(g, -1, -2), _finite_abs(q3)), K, gqa)
    dv = _fold_kv(np.matmul(np.swapaxes(_finite_abs(dropped), -1, -2), dO), K, gqa)
    scales = {"dq": _sum_to_shape(dq, np.shape(q)), "dk": _sum_to_shape(dk, np.shape(k)),
              "dv": _sum_to_shape(dv, np.shape(v))}
    if bias is not None:
        scales["dbias"] = _sum_to_shape(g, np.shape(bias))
    return scales


def forward_floors(dtype, *, D, S, L, E, G, magnitude, allowed, n_stored=1, dropout=False,
                   count=1) -> dict:
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
    grad = (4 * delta_s * A + pg(E) + pg(D) + 2 * pg(S) + 2 * pg(max(L * G, 1)) + 8 * ua
            + 4 * u + 2 * drop)
    return {"out": out[..., None], "lse": lse, "grad": grad}


def _lambda(count) -> float:
    """Hoeffding's lambda: ``2 count exp(-lambda^2 / 2) = FAILURE_PROBABILITY``."""
    return math.sqrt(2 * math.log(2 * max(int(count), 1) / FAILURE_PROBABILITY))


def scaled_dots(q, k, *, scale=None, gqa="interleave", **_ignored) -> np.ndarray:
    """Signed ``s_ij = scale (q_i . k_j)`` in float64, (..., H, L, S) (poison counts as 0)."""
    q3, k3 = _heads(q, "q"), _heads(k, "k")
    k_h = _expand_kv(k3, q3.shape[-3], gqa or "interleave")
    clean = [np.where(np.isfinite(x), x, 0.0).astype(np.float64) for x in (q3, k_h)]
    return _scale_value(scale, q3.shape[-1]) * np.matmul(clean[0], np.swapaxes(clean[1], -1, -2))


def _score_terms(dtype, count, D, n_stored):
    acc = accumulation_dtype(dtype)
    u, ua = unit_roundoff(dtype), unit_roundoff(acc)
    independent = probabilistic_gamma(D, acc, count=count) + 2 * ua + n_stored * u
    return u, ua, independent, _lambda(count), acc


def output_floor(dtype, *, weights, dropped, magnitude, dots, v, out, D, S, n_stored=1,
                 softcap=False, dropout=False, gqa="interleave", count=1) -> np.ndarray:
    """Element-wise floor (T6) of the output, (..., H, L, E), normalised by (T1).

    See the module docstring for the derivation.

    ``weights`` p and ``dropped`` (p times keep/(1-p)) are the float64 truth weights,
    ``magnitude`` a (:func:`score_magnitude`), ``dots`` the signed scaled dot products
    (:func:`scaled_dots`), ``out`` the float64 truth.
    """
    u, ua, delta, lam, acc = _score_terms(dtype, count, D, n_stored)
    p = _finite_abs(weights)
    d = np.divide(_finite_abs(dropped), p, out=np.zeros_like(p), where=p > 0)
    v_h = v if np.ndim(v) == 2 else _expand_kv(_heads(v, "v"), p.shape[-3], gqa or "interleave")
    v_h = np.where(np.isfinite(v_h), v_h, 0.0).astype(np.float64)
    o = np.where(np.isfinite(out), out, 0.0)
    pa = p * magnitude
    w2 = pa * pa
    spread = (w2 * d * d) @ (v_h * v_h) - 2 * o * ((w2 * d) @ v_h) + o * o * w2.sum(-1)[..., None]
    worst = (pa * d) @ np.abs(v_h) + np.abs(o) * pa.sum(-1)[..., None]
    independent = delta * np.minimum(lam * np.sqrt(np.maximum(spread, 0.0)), worst)
    ps = p * dots
    if softcap:
        coherent = (np.abs(ps) * d) @ np.abs(v_h) + np.abs(o) * np.abs(ps).sum(-1)[..., None]
    else:
        coherent = np.abs((ps * d) @ v_h - o * ps.sum(-1)[..., None])
    rows = (np.where(p > 0, magnitude, 0.0)).max(axis=-1)[..., None]
    second_order = 1 + delta * rows + u * rows
    scale = np.maximum(output_scale(dropped, v, gqa=gqa), _tiny(dtype))
    drop = (ua + u) if dropout else 0.0
    first = (independent + u * coherent) * second_order / scale
    return first + 2 * probabilistic_gamma(S, acc, count=count) + 4 * ua + 2 * u + drop


def lse_floor(dtype, *, weights, magnitude, dots, lse, D, S, n_stored=1, softcap=False,
              count=1) -> np.ndarray:
    """Element-wise floor (T6) of lse, (..., H, L), normalised by :func:`lse_scale`."""
    u, ua, delta, lam, acc = _score_terms(dtype, count, D, n_stored)
    p = _finite_abs(weights)
    pa = p * magnitude
    independent = delta * np.minimum(lam * np.sqrt((pa * pa).sum(-1)), pa.sum(-1))
    ps = p * dots
    coherent = np.abs(ps).sum(-1) if softcap else np.abs(ps.sum(-1))
    rows = (np.where(p > 0, magnitude, 0.0)).max(axis=-1)
    first = (independent + u * coherent) * (1 + delta * rows + u * rows)
    return (first / lse_scale(lse, weights, magnitude) + probabilistic_gamma(S, acc, count=count)
            + 3 * ua + u)


@dataclass
class Threshold:
    """Threshold (T2) of one quantity: ``max(k E_base, F) + u_out``.

    ``baseline`` is the textbook's largest normalised error (None when void), ``floor`` F
    (a scalar or an array broadcastable to the quantity).
    """

    k: float
    baseline: float | None
    floor: np.ndarray | float
    u_out: float

    @property
    def value(self):
        """T, broadcastable to the quantity."""
        base = 0.0 if self.baseline is None else self.k * self.baseline
        return np.maximum(base, self.floor) + self.u_out

    def formula(self, index=None, shape=None) -> str:
        """``max(k x baseline, floor) + u_out`` in numbers: the floor at ``index`` of a quantity
        of ``shape`` when both are given (so the text shows the threshold of that element),
        else the largest floor."""
        base = "void" if self.baseline is None else f"{self.baseline:.3g}"
        if index is not None and shape is not None and np.ndim(self.floor):
            floor = float(np.broadcast_to(np.asarray(self.floor, dtype=np.float64),
                                          shape)[tuple(index)])
        else:
            floor = float(np.max(self.floor))
        return (f"max({self.k:g} x baseline {base}, floor {floor:.3g}) + u_out {self.u_out:.3g}")


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


# ----------------------------------------------------------------------------- fixed points
# (refattn.fixedpoint / refattn.meanfield; appended by the fixed-point / mean-field area)


def fixed_point_forward_bound(residual_norm, inverse_norm, rounding_scale, n, dtype="float64"):
    """Bound on ``||z - z*||`` for an iterate ``z`` of a map ``f`` with fixed point ``z*``.

    For an affine map ``f(z) = A z + b`` the identity ``z - z* = (I - A)^{-1} (z - f(z))`` gives
    ``||z - z*|| <= ||(I - A)^{-1}|| ||f(z) - z||``; for a contraction with Lipschitz constant
    ``q`` the same holds with ``1 / (1 - q)`` in place of ``||(I - A)^{-1}||``. The residual
    is measured with a *computed* ``f``, whose rounding error is at most
    ``gamma_n * rounding_scale`` (``rounding_scale`` the norm of the sum of the absolute values
    of the terms of ``f``, ``n`` the number of roundings per entry), so

    .. math:: \\lVert z - z^* \\rVert \\le \\kappa \\big(\\lVert \\tilde f(z) - z \\rVert
              + \\gamma_n\\, s\\big).

    >>> bool(fixed_point_forward_bound(0.0, 2.0, 1.0, 3) == 2 * gamma(3))
    True
    """
    return float(inverse_norm) * (float(residual_norm) + gamma(n, dtype) * float(rounding_scale))


__all__ += ["fixed_point_forward_bound"]


# ----------------------------------------------------------------------------- seed mechanisms
# (refattn.gmm / refattn.mgk / refattn.hopfield; appended by the seed-mechanism area)


def logit_lse_bound(term_scale, n, dim, lse_magnitude=0.0, dtype="float64"):
    """First-order bound on the absolute float error of ``lse_j(s_j)`` computed in log-space.

    Each logit ``s_j`` is a sum of at most ``dim + 2`` rounded terms whose absolute values sum
    to at most ``term_scale`` (error <= gamma_{dim+2} term_scale, Higham eq. (3.4)); the
    max-shifted log1p lse of ``n`` logits adds gamma_{n+4} (1 + |lse|) (Blanchard, Higham &
    Higham 2021, Theorem 2.2).

    >>> bool(logit_lse_bound(0.0, 1, 0) == gamma(5))
    True
    """
    return (gamma(dim + 2, dtype) * float(term_scale)
            + gamma(n + 4, dtype) * (1.0 + abs(float(lse_magnitude))))


def mixture_bound(term_scale, n, dim, value_scale, dtype="float64"):
    """First-order bound on the absolute float error of ``sum_j softmax(s)_j v_j``.

    Every weight ``exp(s_j - lse)`` carries the logit error and the lse error (so twice
    :func:`logit_lse_bound`'s logit part, doubled again for safety against the second-order
    terms), the exponential and the subtraction each one rounding at most ``u (1 + |s_j -
    lse|) w_j <= u`` absolute, and the weighted sum of ``n`` values gamma_n; all scaled by
    ``value_scale = max |v_j|``.

    >>> bool(mixture_bound(0.0, 1, 0, 1.0) == gamma(13))
    True
    """
    return float(value_scale) * (4 * gamma(dim + 2, dtype) * float(term_scale)
                                 + gamma(3 * n + 10, dtype))


def iterated_bound(step_bound, lipschitz, iters):
    """Error after ``iters`` steps of a map with Lipschitz constant ``lipschitz`` when every step
    adds at most ``step_bound``: ``step_bound * sum_{t < iters} lipschitz**t``.

    >>> iterated_bound(1.0, 0.5, 3)
    1.75
    """
    return float(step_bound) * sum(float(lipschitz) ** t for t in range(int(iters)))


def ratio_bound(n_terms, value_scale, dtype="float64"):
    """Bound on the float error of ``sum_j c_j v_j / sum_j c_j`` with all ``c_j >= 0`` each
    known to relative error gamma_{n_terms}: the quotient is a convex combination, so the error
    is at most ``value_scale * 2 gamma_{2 n_terms + 2}``.

    >>> bool(ratio_bound(1, 1.0) == 2 * gamma(4))
    True
    """
    return float(value_scale) * 2 * gamma(2 * int(n_terms) + 2, dtype)


__all__ += ["logit_lse_bound", "mixture_bound", "iterated_bound", "ratio_bound"]


# ----------------------------------------------------------------------------- transformer pieces
# (refattn.transformer; appended by the transformer area)


def transformer_forward_bound(function, *args, **kwargs) -> np.ndarray:
    """A-priori bound on ``|function(*args, **kwargs) - exact|`` for the float64 path of a
    :mod:`refattn.transformer` function (multihead_attention, layer_norm, sinusoidal_positions,
    feed_forward, encoder_block, decoder_block), elementwise.

    Running first-order forward error analysis along the same composition, every rounding
    counted as :func:`gamma` of its operation count (the derivation, stage by stage, is in
    :func:`refattn.transformer.float64_error_bound`). Tests add half an :func:`ulp` of the
    exact value (the exact path's own rounding).
    """
    from refattn.transformer import float64_error_bound

    return float64_error_bound(function, *args, **kwargs)


__all__ += ["transformer_forward_bound"]


# ----------------------------------------------------------------------------- variant fixtures
# (oracle.variant_cases: judging implementations of refattn's probabilistic variants)


def variant_floor(dtype, *, condition, n, n_stored) -> float:
    """Floor ``F`` of (T2) for a variant output (gmm, mgk, hopfield, meanfield), normalised.

    A variant implementation is judged like attention: normalised error (T1) against the
    exact truth, threshold ``T = max(k E_base, F) + u_out`` (T2) with ``k =``
    :data:`K_FORWARD`. The *baseline* ``E_base`` is refattn's float64 path evaluated on the
    case's inputs (exact in float64) and rounded once to the case dtype
    (:func:`oracle.variant_cases.baseline`): for float64 cases it carries the case's real
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
    (:func:`oracle.variant_cases.condition`: ``1 + 2A`` per step for a softmax mixture with
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


__all__ += ["variant_floor"]
