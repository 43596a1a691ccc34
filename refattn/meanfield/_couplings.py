"""Softmax couplings of eq. (24) (Bal 2021, section 4.1) and their vector-Jacobian product:
the bridge from softmax attention to the mean-field model of :mod:`refattn.meanfield`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _checks
from ..broadcast import reduce_to
from ..exact import meanfield as exact
from ._model import spins


def softmax_couplings(
    x,
    W_Q,
    W_K,
    W_V=None,
    *,
    scale=None,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    precision="float64",
    out_dtype=None,
):
    """Softmax couplings of eq. (24) (``\\label{eq:softmaxcouplings}``), with an allowed set.

    .. math::

        J_{ij} = \\Big[\\mathrm{softmax}_{j \\in \\mathcal{A}_i}\\big(s\\, (x W_Q)_i \\cdot
            (x W_K)_j\\big)\\Big]\\, W_V^T \\quad (j \\in \\mathcal{A}_i), \\qquad
        J_{ij} = 0 \\quad (j \\notin \\mathcal{A}_i)

    (section 4.1; with ``W_V`` the blocks ``A_ij W_V^T`` make one naive update
    :func:`naive_step` equal softmax attention plus the residual, section 4.2). The allowed
    set ``A`` is :func:`refattn.masks.allowed_mask` of ``mask``, ``causal`` and ``window``:
    an excluded pair couples with exactly zero weight (it is removed from the softmax, never
    given -1e9); a site with no allowed partner has all-zero couplings. The couplings keep
    their diagonal (a token attends to itself): pass ``diagonal="keep"`` to
    :func:`deq_attention` / :func:`deq_attention_vjp`.

    Parameters
    ----------
    x : array_like, float, (B..., N, d)
        Spins / tokens.
    W_Q, W_K : array_like, float, (d, D)
    W_V : array_like, float, (d, d), optional
        None: ``J_ij = A_ij I_d`` (the scalar couplings of eq. (24)).
    scale : float, optional
        ``s``; default ``1/sqrt(D)`` (the source's ``1/sqrt(d)`` for square ``W_Q``).
    mask : array_like of bool, broadcastable to (B..., N, N), optional
        True = couple.
    causal, window, align
        As :func:`refattn.attention`. The couplings are square (N x N), so both alignments
        give the same set; ``align`` is accepted for symmetry.
    precision : {"float64", "exact"}
        "float64": log-sum-exp weights (:func:`refattn.logspace.masked_softmax`) times
        ``W_V^T``. "exact": every block entry ``A_ij W_V[b, a]`` enclosed in interval
        arithmetic and rounded once to ``out_dtype``.
    out_dtype : dtype, optional

    Returns
    -------
    ndarray, (B..., N, N, d, d)

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import softmax_couplings
    >>> J = softmax_couplings(np.ones((3, 1)), np.ones((1, 1)), np.ones((1, 1)), causal=True)
    >>> np.round(J[..., 0, 0], 6).tolist()
    [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.333333, 0.333333, 0.333333]]
    """
    precision = _checks.precision(precision)
    x, W_Q, W_K, values, scale, allowed = _coupling_inputs(
        x, W_Q, W_K, W_V, scale, mask, causal, window, align
    )
    if precision == "exact":
        return exact.softmax_couplings(
            x, W_Q, W_K, values, allowed, scale, _checks.out_dtype(out_dtype)
        )
    weights, _, _, _ = _coupling_weights(x, W_Q, W_K, scale, allowed)
    return np.einsum("...ij,ba->...ijab", weights, values)


def _coupling_inputs(x, W_Q, W_K, W_V, scale, mask, causal, window, align):
    """Validated (x, W_Q, W_K, W_V or I, scale, allowed (B..., N, N)) of eq. (24)."""
    from .. import masks

    x = spins(x, "x")
    n, d = x.shape[-2:]
    W_Q = _checks.as_float64(_checks.float_array(W_Q, "W_Q"))
    W_K = _checks.as_float64(_checks.float_array(W_K, "W_K"))
    if W_Q.ndim != 2 or W_Q.shape[0] != d or W_K.shape != W_Q.shape:
        raise ValueError(
            f"W_Q, W_K: expected two (d, D) matrices with d = {d}, got shapes "
            f"{W_Q.shape} and {W_K.shape}"
        )
    values = np.eye(d) if W_V is None else _checks.as_float64(_checks.float_array(W_V, "W_V"))
    if values.shape != (d, d):
        raise ValueError(f"W_V: expected shape (d, d) = ({d}, {d}), got {values.shape}")
    scale = _checks.real_scalar(scale, "scale", allow_none=True)
    if mask is not None:
        mask = _checks.bool_array(mask, "mask")
        try:  # checked here: allowed_mask's own broadcast would fail naming nothing
            np.broadcast_shapes(mask.shape, x.shape[:-2] + (n, n))
        except ValueError:
            raise ValueError(
                f"mask: expected a shape broadcastable to (B..., N, N) = "
                f"{x.shape[:-2] + (n, n)} of x {x.shape}, got shape {mask.shape}"
            ) from None
    allowed = masks.allowed_mask(n, n, mask=mask, causal=causal, window=window, align=align)
    allowed = np.broadcast_to(allowed, np.broadcast_shapes(allowed.shape, x.shape[:-2] + (n, n)))
    return x, W_Q, W_K, values, scale, allowed


def _coupling_weights(x, W_Q, W_K, scale, allowed):
    """float64 (A, q, k, s): the masked log-sum-exp softmax weights of eq. (24)."""
    from ..logspace import masked_softmax

    s = 1.0 / np.sqrt(W_Q.shape[1]) if scale is None else scale
    q, k = x @ W_Q, x @ W_K
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * s
    _, weights = masked_softmax(np.broadcast_to(scores, allowed.shape), allowed)
    return weights, q, k, s


class SoftmaxCouplingsGrads(NamedTuple):
    """Gradients of :func:`softmax_couplings`: dx (x's shape), dW_Q, dW_K, dW_V (None when
    W_V is None)."""

    dx: np.ndarray
    dW_Q: np.ndarray
    dW_K: np.ndarray
    dW_V: np.ndarray | None


def softmax_couplings_vjp(
    x,
    W_Q,
    W_K,
    W_V,
    grad_out,
    *,
    scale=None,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    precision="float64",
    out_dtype=None,
) -> SoftmaxCouplingsGrads:
    """Vector-Jacobian product of :func:`softmax_couplings` (eq. (24)).

    With ``G = grad_out`` (the cotangent of J, e.g. ``dJ`` of :func:`deq_attention_vjp`),
    ``q = x W_Q``, ``k = x W_K`` and the weights ``A``:

    .. math::

        dA_{ij} = \\sum_{ab} G_{ij}^{ab} W_V[b, a], \\quad dW_V = \\Big(\\sum_{ij} A_{ij}
        G_{ij}\\Big)^T, \\quad dS = A \\odot (dA - \\mathrm{rowsum}(A \\odot dA)), \\\\
        dq = s\\, dS\\, k, \\quad dk = s\\, dS^T q, \\quad dx = dq W_Q^T + dk W_K^T, \\quad
        dW_Q = x^T dq, \\quad dW_K = x^T dk

    Excluded pairs have ``A_ij = 0`` exactly, so their cotangent reaches nothing.

    Parameters
    ----------
    x, W_Q, W_K, W_V, scale, mask, causal, window, align
        As :func:`softmax_couplings`.
    grad_out : array_like, float, (B..., N, N, d, d)
    precision : {"float64", "exact"}
        "exact": forward and backward enclosed in interval arithmetic, the weight gradients
        summed over the batch, every element rounded once.
    out_dtype : dtype, optional

    Returns
    -------
    SoftmaxCouplingsGrads

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.meanfield import softmax_couplings_vjp
    >>> G = np.zeros((2, 2, 1, 1)); G[1, 0] = 1.0
    >>> grads = softmax_couplings_vjp(np.ones((2, 1)), np.ones((1, 1)), np.ones((1, 1)), None,
    ...                               G, causal=True)
    >>> grads.dW_V, grads.dx.ravel().tolist()  # equal scores: A_10 = A_11 = 1/2
    (None, [0.25, -0.25])
    """
    precision = _checks.precision(precision)
    x, W_Q, W_K, values, scale, allowed = _coupling_inputs(
        x, W_Q, W_K, W_V, scale, mask, causal, window, align
    )
    n, d = x.shape[-2:]
    G = _checks.as_float64(_checks.float_array(grad_out, "grad_out"))
    if G.shape != allowed.shape[:-2] + (n, n, d, d):
        raise ValueError(
            f"grad_out: expected the shape of the couplings "
            f"{allowed.shape[:-2] + (n, n, d, d)}, got {G.shape}"
        )
    if precision == "exact":
        grads = exact.softmax_couplings_vjp(
            x, W_Q, W_K, values, allowed, scale, G, x.shape, _checks.out_dtype(out_dtype)
        )
    else:
        weights, q, k, s = _coupling_weights(x, W_Q, W_K, scale, allowed)
        xb, qb, kb = (
            np.broadcast_to(a, allowed.shape[:-1] + a.shape[-1:]).reshape(-1, n, a.shape[-1])
            for a in (x, q, k)
        )
        parts = [
            exact.softmax_couplings_backward(*sample, s)
            for sample in zip(
                xb,
                [W_Q] * len(xb),
                [W_K] * len(xb),
                [values] * len(xb),
                weights.reshape(-1, n, n),
                qb,
                kb,
                G.reshape(-1, n, n, d, d),
                strict=True,
            )
        ]
        dx = reduce_to(
            np.stack([p[0] for p in parts]).reshape(allowed.shape[:-2] + (n, d)), x.shape
        )
        grads = [dx] + [sum(p[m] for p in parts) for m in (1, 2, 3)]
    return SoftmaxCouplingsGrads(grads[0], grads[1], grads[2], None if W_V is None else grads[3])
