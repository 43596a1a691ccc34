"""Loop twin of refattn.logspace: logsumexp, softmax and log_softmax of masked rows.

At ``dps`` decimal digits with mpmath, in cancellation-free forms; nothing here imports
refattn.
"""

from __future__ import annotations

import mpmath
import numpy as np

from .rounding import exact_plus_small, round_stable

__all__ = ["naive_logspace", "naive_logspace_rounded"]


def naive_logspace(x, where, dps):
    """(lse, softmax, log_softmax) rows at ``dps`` digits, in cancellation-free forms:
    softmax ``e^{x_j - m} / (n + rest)`` (``rest`` the sum over the entries below the maximum
    ``m``; ``1 / (1 + sum_{k != j} e^{x_k - x_j})`` in rows with infinities); lse and
    log_softmax as an exact head (the
    maximum ``m``, or ``x_j - m``) plus ``log(n) + log1p(rest / n)`` kept apart
    (:func:`naive.rounding.exact_plus_small`), ``n`` the entries equal to ``m``."""
    lse, soft, logsoft = [], [], []
    with mpmath.workdps(dps):
        for row, keep in zip(x, where, strict=True):
            vals = [mpmath.mpf(float(a)) for a, k in zip(row, keep, strict=True) if k]
            top = max(vals) if vals else None
            if top is not None and mpmath.isfinite(top):
                # log(sum e^a) = top + log(n) + log1p(rest / n): an exact head and a tail
                # that may be as small as exp(-1e9)
                count = sum(1 for a in vals if a == top)
                rest = mpmath.fsum(mpmath.exp(a - top) for a in vals if a != top)
                shift = mpmath.log(count) + mpmath.log1p(rest / count)
                lse.append(exact_plus_small(top, shift))
            else:
                shift = None
                lse.append(
                    mpmath.log(mpmath.fsum(mpmath.exp(a) for a in vals)) if vals else -mpmath.inf
                )
            soft_row, log_row = [], []
            for a, k in zip(row, keep, strict=True):
                if not k:
                    soft_row.append(mpmath.mpf(0))
                    log_row.append(-mpmath.inf)
                    continue
                a = mpmath.mpf(float(a))
                if shift is not None:  # O(n): e^{a - m} / (n + rest), no cancellation
                    soft_row.append(mpmath.exp(a - top) / (count + rest))
                    log_row.append(exact_plus_small(mpmath.fsub(a, top, exact=True), -shift))
                    continue
                others = list(vals)
                others.remove(a)
                rest = mpmath.fsum(mpmath.exp(b - a) for b in others)
                soft_row.append(1 / (1 + rest))
                log_row.append(-mpmath.log1p(rest))
            soft.append(soft_row)
            logsoft.append(log_row)
    return lse, soft, logsoft


def naive_logspace_rounded(x, where, dtype):
    """(lse, softmax, log_softmax) of :func:`naive_logspace` rounded to ``dtype`` at a precision
    that settles the rounding (:func:`naive.rounding.round_stable`)."""
    finite = np.where(where & np.isfinite(x), x.astype(np.float64), 0.0)
    spread = float(finite.max()) / 2 - float(finite.min()) / 2  # (halves: no overflow)
    spread = 2 * min(spread, 1e300)
    return tuple(
        round_stable(lambda dps, n=n: naive_logspace(x, where, dps)[n], dtype, spread)
        for n in range(3)
    )
