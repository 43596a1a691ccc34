"""A-priori error bounds of the probabilistic variants' float64 paths: softmax mixtures in
log-space (:mod:`refattn.gmm`, :mod:`refattn.mgk`, :mod:`refattn.hopfield` and their kernels in
:mod:`refattn.kernels.variants`), iterated EM steps and normalised ratios.

Counts follow Higham (*Accuracy and Stability of Numerical Algorithms*, 2nd ed.): a sum of n
rounded terms errs by at most gamma_n times the sum of their absolute values (eq. (3.4)), and
the max-shifted log1p log-sum-exp is backward stable (Blanchard, Higham & Higham 2021).
"""

from __future__ import annotations

from .unit import gamma

__all__ = ["logit_lse_bound", "mixture_bound", "iterated_bound", "ratio_bound"]


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
