"""Multi-head latent attention (MLA) as refattn attention calls: the absorbed decode recipe.

DeepSeek-V2 (DeepSeek-AI 2024, section 2.1.2-2.1.3, eqs. (9)-(19)) caches one latent row
``c_j = W^{DKV} h_j`` (C = 512 features in DeepSeek-V2/V3) and one shared rotary key
``k^R_j`` (R = 64) per token. Head i's key and value are up-projections of the latent,

.. math::

    k_{j,i} = [W^{UK}_i c_j;\\ k^R_j], \\quad v_{j,i} = W^{UV}_i c_j, \\quad
    q_{t,i} = [q^C_{t,i};\\ q^R_{t,i}], \\quad
    o_{t,i} = \\sum_j \\mathrm{softmax}_j\\Big(\\frac{q_{t,i} \\cdot k_{j,i}}
        {\\sqrt{d_h + d_h^R}}\\Big) v_{j,i}

(eqs. (17)-(19); ``d_h = 128`` nope features and ``d_h^R = 64`` rope features per head, so the
scale is ``1/sqrt(192)``). Since ``q^C_i . W^{UK}_i c_j = (W^{UK\\,T}_i q^C_i) . c_j``, the
up-projection of the key is *absorbed* into the query and that of the value deferred to the
output (section 2.1.2, "absorbed"): every head reads the same 576-wide key ``[c_j; k^R_j]``
(K = 1), whose first C features are also the value, and

.. math::

    o_{t,i} = W^{UV}_i \\sum_j w_{tj,i}\\, c_j, \\quad
    w_{tj,i} = \\mathrm{softmax}_j\\big(s\\, [W^{UK\\,T}_i q^C_{t,i};\\ q^R_{t,i}]
        \\cdot [c_j;\\ k^R_j]\\big), \\quad s = 1/\\sqrt{d_h + d_h^R}.

The scale stays the model's ``1/sqrt(192)``: absorbing changes the width of the dot product
(576), not the score, so ``1/sqrt(576)`` (the default of an attention call over 576 features)
is the classic mistake (docs/conventions.md, "Latent attention").

Two kernel forms of the same call (:func:`absorbed_inputs`):

* ``"flashmla"`` (FlashMLA): q, k 576 wide, ``v = k[..., :512]`` (``head_dim_v = 512``).
* ``"fa3"`` (FlashAttention 3's ``qv``): q, k the rope part (64), v the latent (512) and
  ``qv`` the absorbed nope query (512): ``s (q . k + qv . v)`` is the same score.

Shapes: q_nope (..., H, L, d_h), q_rope (..., H, L, R), latent (..., S, C), k_rope (..., S, R),
w_uk (H, d_h, C) and w_uv (H, d_v, C) (``k^C_{j,i} = w_uk[i] @ c_j``).
"""

from __future__ import annotations

import math

import numpy as np

from . import _checks

__all__ = ["FORMS", "absorbed_inputs", "model_scale", "multihead_inputs", "output_projection"]

FORMS = ("flashmla", "fa3")


def model_scale(nope_dim: int, rope_dim: int) -> float:
    """The softmax scale of the model's head dim, ``1/sqrt(d_h + d_h^R)`` (DeepSeek-V3:
    ``1/sqrt(128 + 64) = 1/sqrt(192)``), as a float64.

    >>> model_scale(128, 64) == 1 / math.sqrt(192)
    True
    """
    return 1.0 / math.sqrt(nope_dim + rope_dim)


def _checked(q_nope, q_rope, latent, k_rope, w_uk):
    arrays = {}
    for name, x in (("q_nope", q_nope), ("q_rope", q_rope), ("latent", latent)):
        least = 2 if name == "latent" else 3
        arrays[name] = _checks.as_float64(_checks.float_array(x, name, ndim_min=least))
    arrays["k_rope"] = _checks.as_float64(_checks.float_array(k_rope, "k_rope", ndim_min=2))
    arrays["w_uk"] = _checks.as_float64(_checks.float_array(w_uk, "w_uk", ndim_min=3))
    heads, nope = arrays["q_nope"].shape[-3], arrays["q_nope"].shape[-1]
    width = arrays["latent"].shape[-1]
    if arrays["w_uk"].shape != (heads, nope, width):
        raise ValueError(
            f"w_uk: expected (H, d_h, C) = ({heads}, {nope}, {width}) from q_nope "
            f"{arrays['q_nope'].shape} and latent {arrays['latent'].shape}, got "
            f"{arrays['w_uk'].shape}"
        )
    if arrays["q_rope"].shape[:-1] != arrays["q_nope"].shape[:-1]:
        raise ValueError(
            f"q_rope: expected q_nope's leading shape {arrays['q_nope'].shape[:-1]}, got "
            f"{arrays['q_rope'].shape}"
        )
    if arrays["k_rope"].shape[:-1] != arrays["latent"].shape[:-1] or (
        arrays["k_rope"].shape[-1] != arrays["q_rope"].shape[-1]
    ):
        raise ValueError(
            f"k_rope: expected (..., S, R) = {arrays['latent'].shape[:-1]} + "
            f"({arrays['q_rope'].shape[-1]},), got {arrays['k_rope'].shape}"
        )
    return arrays


def absorbed_inputs(q_nope, q_rope, latent, k_rope, w_uk, *, form="flashmla"):
    """The absorbed MLA decode call: keyword arguments of :func:`refattn.attention`.

    Parameters
    ----------
    q_nope : array (..., H, L, d_h)
        The per-head nope queries ``q^C``.
    q_rope : array (..., H, L, R)
        The per-head rotary queries ``q^R`` (already rotated).
    latent : array (..., S, C)
        The latent cache ``c`` (one row per key, shared by every head).
    k_rope : array (..., S, R)
        The shared rotary key ``k^R`` (already rotated).
    w_uk : array (H, d_h, C)
        The key up-projection: ``k^C_{j,i} = w_uk[i] @ c_j``.
    form : {"flashmla", "fa3"}
        FlashMLA's ``q, k`` (..., 1, S, C + R) with ``v = k[..., :C]`` (a view), or
        FlashAttention 3's ``q, k`` rope parts with ``v = latent`` and ``qv`` the absorbed
        nope query.

    Returns
    -------
    dict
        ``q``, ``k``, ``v``, ``scale`` (``1/sqrt(d_h + R)``, :func:`model_scale`), and ``qv``
        in the "fa3" form. ``refattn.attention(**absorbed_inputs(...))`` returns the latent
        output (..., H, L, C); :func:`output_projection` maps it to (..., H, L, d_v).

    Notes
    -----
    The absorbed query ``w_uk[i]^T q^C_i`` is formed in float64 (one rounding per element
    unless the products are exact); the rest is exact rearrangement.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> rng = np.random.default_rng(0)
    >>> call = absorbed_inputs(rng.standard_normal((2, 1, 4)), rng.standard_normal((2, 1, 2)),
    ...                        rng.standard_normal((5, 8)), rng.standard_normal((5, 2)),
    ...                        rng.standard_normal((2, 4, 8)))
    >>> call["q"].shape, call["k"].shape, call["v"].shape, call["scale"] == 1 / 6**0.5
    ((2, 1, 10), (1, 5, 10), (1, 5, 8), True)
    >>> refattn.attention(**call).shape
    (2, 1, 8)
    """
    _checks.choice(form, "form", FORMS)
    a = _checked(q_nope, q_rope, latent, k_rope, w_uk)
    absorbed = np.einsum("...hld,hdc->...hlc", a["q_nope"], a["w_uk"])
    latent_kv = a["latent"][..., None, :, :]  # K = 1: one latent row per key for every head
    rope_k = a["k_rope"][..., None, :, :]
    scale = model_scale(a["q_nope"].shape[-1], a["q_rope"].shape[-1])
    if form == "fa3":
        return {"q": a["q_rope"], "k": rope_k, "v": latent_kv, "qv": absorbed, "scale": scale}
    key = np.concatenate([latent_kv, rope_k], axis=-1)
    width = latent_kv.shape[-1]
    return {
        "q": np.concatenate([absorbed, a["q_rope"]], axis=-1),
        "k": key,
        "v": key[..., :width],
        "scale": scale,
    }


def output_projection(out_latent, w_uv):
    """``o_i = w_uv[i] @ out_latent_i``: (..., H, L, C) and (H, d_v, C) -> (..., H, L, d_v)
    (DeepSeek-V2 eq. (19) before ``W^O``), in float64.

    >>> output_projection(np.ones((2, 1, 3)), np.ones((2, 4, 3))).shape
    (2, 1, 4)
    """
    out = _checks.as_float64(_checks.float_array(out_latent, "out_latent", ndim_min=3))
    weights = _checks.as_float64(_checks.float_array(w_uv, "w_uv", ndim_min=3))
    if weights.shape[0] != out.shape[-3] or weights.shape[-1] != out.shape[-1]:
        raise ValueError(
            f"w_uv: expected (H, d_v, C) with H = {out.shape[-3]}, C = {out.shape[-1]}, got "
            f"{weights.shape}"
        )
    return np.einsum("...hlc,hec->...hle", out, weights)


def multihead_inputs(q_nope, q_rope, latent, k_rope, w_uk, w_uv):
    """The non-absorbed MLA call (DeepSeek-V2 eqs. (14)-(19)): per-head keys
    ``[w_uk[i] c_j; k^R_j]`` and values ``w_uv[i] c_j`` (K = H), keyword arguments of
    :func:`refattn.attention` with the model's scale; its output (..., H, L, d_v) equals
    ``output_projection(attention(**absorbed_inputs(...)), w_uv)`` in exact arithmetic.

    >>> rng = np.random.default_rng(0)
    >>> call = multihead_inputs(rng.standard_normal((2, 1, 4)), rng.standard_normal((2, 1, 2)),
    ...                         rng.standard_normal((5, 8)), rng.standard_normal((5, 2)),
    ...                         rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 3, 8)))
    >>> call["q"].shape, call["k"].shape, call["v"].shape
    ((2, 1, 6), (2, 5, 6), (2, 5, 3))
    """
    a = _checked(q_nope, q_rope, latent, k_rope, w_uk)
    up = _checks.as_float64(_checks.float_array(w_uv, "w_uv", ndim_min=3))
    if up.shape[0] != a["w_uk"].shape[0] or up.shape[-1] != a["latent"].shape[-1]:
        raise ValueError(
            f"w_uv: expected (H, d_v, C) with H = {a['w_uk'].shape[0]}, "
            f"C = {a['latent'].shape[-1]}, got {up.shape}"
        )
    keys = np.einsum("...sc,hdc->...hsd", a["latent"], a["w_uk"])
    rope = np.broadcast_to(a["k_rope"][..., None, :, :], keys.shape[:-1] + a["k_rope"].shape[-1:])
    return {
        "q": np.concatenate([a["q_nope"], a["q_rope"]], axis=-1),
        "k": np.concatenate([keys, rope], axis=-1),
        "v": np.einsum("...sc,hec->...hse", a["latent"], up),
        "scale": model_scale(a["q_nope"].shape[-1], a["q_rope"].shape[-1]),
    }
