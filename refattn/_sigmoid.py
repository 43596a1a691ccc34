"""The sigmoid normaliser of :func:`refattn.attention` on the float64 path.

``normalizer="sigmoid"`` (Ramapuram et al., "Theory, Analysis, and Best Practices for Sigmoid
Self-Attention", 2024, eq. (2); their FlashSigmoid kernel) replaces the softmax weights by
``w_ij = sigmoid(t~_ij)`` on the allowed set, with no normaliser: ``out_i = sum_j kappa_ij
w_ij v_j / (1 - p)``. The sigmoid is evaluated in the form that never overflows and keeps
full relative precision for either sign (``e^{-|t|}`` only):

.. math::

    \\sigma(t) = \\frac{1}{1 + e^{-t}} \\; (t \\ge 0), \\qquad
    \\sigma(t) = \\frac{e^{t}}{1 + e^{t}} \\; (t < 0), \\qquad
    \\sigma'(t) = \\sigma(t)\\, \\sigma(-t)

(the derivative as a product of the two stable halves, not ``w (1 - w)``, which loses all
relative precision where ``w`` rounds to 1).
"""

from __future__ import annotations

import numpy as np

__all__ = ["sigmoid", "sigmoid_derivative", "sigmoid_plane"]


def sigmoid(x: np.ndarray) -> np.ndarray:
    """The logistic function, elementwise, without overflow for any float64 input.

    Examples
    --------
    >>> sigmoid(np.array([0.0, -np.inf, np.inf, -800.0])).tolist()
    [0.5, 0.0, 1.0, 0.0]
    """
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(-np.abs(x))
        return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def sigmoid_derivative(x: np.ndarray) -> np.ndarray:
    """sigma'(x) = sigma(x) sigma(-x), elementwise.

    Examples
    --------
    >>> sigmoid_derivative(np.array([0.0])).tolist()
    [0.25]
    """
    return sigmoid(x) * sigmoid(-np.asarray(x, np.float64))


def sigmoid_plane(scores: np.ndarray, allowed: np.ndarray):
    """(weights, derivative) of one (L, S) plane: sigmoid and sigma' of the final scores on
    the allowed set, 0 elsewhere (an excluded key contributes nothing, whatever its score)."""
    safe = np.where(allowed, scores, 0.0)
    return np.where(allowed, sigmoid(safe), 0.0), np.where(allowed, sigmoid_derivative(safe), 0.0)
