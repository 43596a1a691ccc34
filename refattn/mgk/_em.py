"""One EM step for the mixture weights of Transformer-MGK (:func:`em_update_pi`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _checks
from ..exact import mgk as exact
from ..logspace import log_softmax, logsumexp
from ._gaussian import component_terms64, guarded_softmax64
from ._inputs import PI_UPDATES, allowed_set, checked_log_pi, checked_sigma2, validated_inputs


class EMResult(NamedTuple):
    """Result of :func:`em_update_pi`.

    pi : (..., S, R) the updated mixture weights.
    responsibilities : (..., L, S, R) p(t_j = 1, z_r = 1 | q_i) (0 at excluded (i, j)).
    """

    pi: np.ndarray
    responsibilities: np.ndarray


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def em_update_pi(
    q,
    keys,
    *,
    log_pi,
    sigma2,
    mask=None,
    pi_update="joint",
    normalized=True,
    component_eps=0.0,
    precision="float64",
    out_dtype=None,
):
    """One EM step for the mixture weights pi of Transformer-MGK (notes (N8)).

    E-step: the joint responsibility of key j and its component r for query i (uniform key
    prior, the minus sign of the Gaussian exponent pinned),

    .. math::

        \\rho_{ijr} = p(t_j = 1, z_r = 1 \\mid q_i) =
            \\frac{\\pi_{jr} \\mathcal N(q_i \\mid k_{jr}, \\sigma^2_{jr})}
                 {\\sum_{j' \\in A_i} \\sum_{r'} \\pi_{j'r'}
                  \\mathcal N(q_i \\mid k_{j'r'}, \\sigma^2_{j'r'})};

    (the notes' (N8) prints a sum over r in the numerator and no minus sign; refattn reads it
    as the standard E-step of the two-level mixture, key prior uniform as in (N2)). M-step
    (maximising the expected complete log-likelihood subject to sum_r pi_jr = 1; the notes
    learn pi by gradient descent instead):

    .. math:: \\pi^{new}_{jr} = \\frac{\\sum_i \\rho_{ijr}}{\\sum_i \\sum_{r'} \\rho_{ijr'}} .

    The Gaussian normaliser ``(2 pi sigma2_jr)^(-D/2)`` is included (it is part of N). A key
    that no query may attend (all its (i, j) excluded) keeps its pi.

    Parameters
    ----------
    q : array (..., L, D)
    keys : array (..., S, R, D)
    log_pi : array (..., S, R)
        Current log weights (each key's a distribution).
    sigma2 : float or array (..., S, R), > 0
    mask : bool array broadcastable to (..., L, S), optional
    pi_update : {"joint", "per_key"}
        "joint" (default): the M-step above. "per_key": the public code's rule, which averages
        over the queries the *per-key* responsibilities ``p(z_r = 1 | t_j = 1, q_i) =
        softmax_r(log pi_jr + log N(q_i | k_jr, sigma2_jr))``: ``pi_jr = mean_{i: (i, j)
        allowed} p(z_r | t_j, q_i)``. It weighs every query equally instead of by
        ``p(t_j | q_i)`` (the two pi differ by 0.11 on the two-query example of
        tests/concepts/test_mgk_vjp.py).
    normalized : bool
        True (default): the components are the Gaussian densities ``N(q | k_jr, sigma2_jr)``
        with their normaliser ``(2 pi sigma2_jr)^(-D/2)`` (it cancels when sigma2 is equal
        over the components). False: the unnormalised kernels ``exp(-||q - k_jr||^2 / (2
        sigma2_jr))`` of the public code.
    component_eps : float >= 0
        ``pi_update="per_key"`` with ``normalized=False`` only: the per-key normaliser gains
        ``component_eps``, ``p(z_r | t_j, q_i) = pi_jr e_ijr / (sum_r pi_jr e_ijr +
        component_eps)`` (evaluated in log-space, as ``attention``'s ``row_eps``). Default 0.

    **Which public configurations these reproduce** (repository minhtannguyen/transformer-mgk):

    * language-modeling/lmtool-fwms/src/mem_transformer.py, class ``MGKAttn``,
      ``update_mode="soft2keys"`` (its training-time pi update): two keys with ``sigma2 =
      (sqrt(D), sqrt(D) / 3)`` (from ``-(1/sqrt(D))/2 |q - k0|^2`` and ``-1.5/sqrt(D) |q -
      k1|^2``, so never shared), no Gaussian normaliser and 1e-6 added to the per-key
      mixture: ``pi_update="per_key", normalized=False, component_eps=1e-6``, ``mask=None``
      (that code averages over every query; the causal mask is applied to the attention
      afterwards). Reproduced to 2e-15 relative (tests/concepts/test_mgk_public.py).
      Without ``normalized=False`` the factor ``3^(D/2)`` between the two normalisers moves
      pi by 0.9-1.0 relative at D = 16, input scales 0.3-1 (80 at scale 4, where the guard
      dominates).
    * lra/attention.py, ``SoftmaxAttention`` with ``key2`` and ``soft_em``: shared ``sigma2 =
      sqrt(D)`` (normalized has no effect), the same 1e-6 per-key guard
      (``component_eps=1e-6, normalized=False``), the average over the unmasked queries
      (``mask`` as a (L, S) padding mask); its count gains another 1e-6 (relative 1e-6 / L,
      not modelled).

    **Batch pooling**: both public codes pool the update over the batch (``sum_{b, i} / (B
    L)`` in the language-modelling code, ``sum_{b, i}`` over the unmasked queries in the LRA
    code) and over the heads they share pi with; refattn updates each batch element on its
    own. With equal query counts the pooled pi is ``result.pi.mean(axis=0)`` (the tests do
    this); the per-batch pi differ from the pooled one by 0.05-0.09 relative at B = 2, D =
    16, input scales 0.3-1 (0.5-1.0 at scales 2-4).

    **The guard's size**: ``component_eps=1e-6`` is not small once the mixture values
    ``sum_r pi_jr e_ijr`` fall near or below 1e-6 (far queries, large D or large inputs):
    responsibilities then shrink towards 0. On the soft2keys configuration above it moves pi
    by 2e-6, 1e-5, 4e-4, 1.4 and 80 relative at input scales 0.3, 0.6, 1, 2 and 4 (D = 16);
    issue 29 measured up to 0.89 on the LRA code.
    precision, out_dtype : as :func:`attention`.

    Returns
    -------
    EMResult(pi (..., S, R), responsibilities (..., L, S, R)); with ``pi_update="per_key"``
    the responsibilities are the per-key ones ``p(z_r | t_j, q_i)`` (0 at excluded (i, j)).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import mgk
    >>> q = np.array([[0.0], [0.0]]); keys = np.array([[[0.0], [50.0]]])
    >>> res = mgk.em_update_pi(q, keys, log_pi=np.log(np.array([[0.5, 0.5]])), sigma2=1.0)
    >>> res.pi.tolist()
    [[1.0, 0.0]]
    """
    precision = _checks.precision(precision)
    pi_update = _checks.choice(pi_update, "pi_update", PI_UPDATES)
    q, keys, _, batch = validated_inputs(q, keys, None)
    comp_shape = batch + keys.shape[-3:-1]
    sigma2, sigma_varies = checked_sigma2(sigma2, comp_shape)
    log_pi, _ = checked_log_pi(log_pi, comp_shape)
    normalized, component_eps = _checked_public_options(normalized, component_eps, pi_update)
    for name, arr in (("q", q), ("keys", keys)):
        if not np.isfinite(_checks.as_float64(arr)).all():
            raise ValueError(f"{name}: expected finite values (shape {arr.shape})")
    length, units, comps = q.shape[-2], keys.shape[-3], keys.shape[-2]
    allowed = allowed_set(length, units, batch, mask)
    if precision == "float64" and pi_update == "per_key":
        terms = component_terms64(
            _checks.as_float64(q),
            _checks.as_float64(keys),
            log_pi,
            sigma2,
            sigma_varies,
            "soft",
            normalized,
        )
        resp = guarded_softmax64(terms, ~np.isneginf(terms), component_eps) * allowed[..., None]
        count = allowed.sum(axis=-2)[..., None]  # (..., S, 1) allowed queries per key
        with np.errstate(invalid="ignore"):
            pi = np.where(count > 0, resp.sum(axis=-3) / np.maximum(count, 1), np.exp(log_pi))
        return EMResult(pi, resp)
    if precision == "float64":
        terms = component_terms64(
            _checks.as_float64(q),
            _checks.as_float64(keys),
            log_pi,
            sigma2,
            sigma_varies,
            "soft",
            normalized,
        )
        flat = terms.reshape(terms.shape[:-2] + (-1,))
        where = (np.repeat(allowed, comps, axis=-1)) & ~np.isneginf(flat)
        log_resp = log_softmax(flat, axis=-1, where=where).reshape(terms.shape)
        col = np.moveaxis(log_resp, -3, -1)  # (..., S, R, L)
        log_num = logsumexp(col, axis=-1, where=~np.isneginf(col))  # (..., S, R)
        log_den = logsumexp(log_num, axis=-1, where=~np.isneginf(log_num))  # (..., S)
        keep = np.isneginf(log_den)[..., None]
        with np.errstate(invalid="ignore"):
            pi = np.where(
                keep, np.exp(log_pi), np.exp(log_num - np.where(keep, 0.0, log_den[..., None]))
            )
        return EMResult(pi, np.exp(log_resp))

    return EMResult(
        *exact.em_update_pi(
            q,
            keys,
            log_pi,
            sigma2,
            sigma_varies,
            allowed,
            pi_update,
            normalized,
            component_eps,
            _checks.out_dtype(out_dtype),
        )
    )


def _checked_public_options(normalized, component_eps, pi_update):
    """(normalized, component_eps) validated: the guard belongs to the per-key update and is
    compared with the unnormalised kernels ``pi_jr exp(-||q - k||^2 / (2 sigma2))``."""
    if not isinstance(normalized, bool | np.bool_):
        raise TypeError(f"normalized: expected a bool, got {normalized!r}")
    component_eps = _checks.real_scalar(component_eps, "component_eps")
    if component_eps < 0:
        raise ValueError(f"component_eps: expected a number >= 0, got {component_eps!r}")
    if component_eps and pi_update != "per_key":
        raise ValueError("component_eps: only the per-key update has it; pass pi_update='per_key'")
    if component_eps and normalized:
        raise ValueError(
            "component_eps: the guard is added to the unnormalised mixture sum_r pi_jr "
            "exp(-||q - k_jr||^2 / (2 sigma2_jr)) (its absolute level matters); pass "
            "normalized=False"
        )
    return bool(normalized), component_eps
