"""One EM step for the mixture weights of Transformer-MGK (:func:`em_update_pi`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _checks
from ..exact import mgk as exact
from ..logspace import log_softmax, logsumexp, softmax
from ._gaussian import component_terms64
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
    q, keys, *, log_pi, sigma2, mask=None, pi_update="joint", precision="float64", out_dtype=None
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
        "joint" (default): the M-step above. "per_key": the public code's update (repository
        minhtannguyen/transformer-mgk, file language-modeling/lmtool-fwms/src/mem_transformer.py,
        class MGKAttn, soft mode), which averages over the queries the *per-key*
        responsibilities ``p(z_r = 1 | t_j = 1, q_i) = softmax_r(log pi_jr + log N(q_i | k_jr,
        sigma2_jr))``: ``pi_jr = mean_{i: (i, j) allowed} p(z_r | t_j, q_i)``. It weighs every
        query equally instead of by ``p(t_j | q_i)`` (the two pi differ by 0.11 on the
        two-query example of tests/concepts/test_mgk_vjp.py). The public code also adds 1e-6 to the
        per-key normaliser, omits the Gaussian normaliser (the same when sigma2 is shared) and
        averages over every query; refattn keeps the normaliser, adds nothing and averages
        over the allowed queries.
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
            True,
        )
        resp = softmax(terms, axis=-1, where=~np.isneginf(terms)) * allowed[..., None]
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
            True,
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
            q, keys, log_pi, sigma2, sigma_varies, allowed, pi_update, _checks.out_dtype(out_dtype)
        )
    )
