"""Loop twin of refattn.logspace: logsumexp, softmax and log_softmax of masked rows.

At ``dps`` decimal digits with mpmath, in cancellation-free forms; nothing here imports
refattn.
"""

from __future__ import annotations

import mpmath
import numpy as np

from .rounding import round_stable

__all__ = ["naive_logspace", "naive_logspace_rounded"]


def naive_logspace(x, where, dps):
    """(lse, softmax, log_softmax) rows at ``dps`` digits, in cancellation-free forms:
    ``1 / (1 + sum_{k != j} e^{x_k - x_j})`` and ``-log1p(sum_{k != j} e^{x_k - x_j})``."""
    lse, soft, logsoft = [], [], []
    with mpmath.workdps(dps):
        for row, keep in zip(x, where, strict=True):
            vals = [mpmath.mpf(float(a)) for a, k in zip(row, keep, strict=True) if k]
            lse.append(mpmath.log(mpmath.fsum(mpmath.exp(a) for a in vals)) if vals
                       else -mpmath.inf)
            soft_row, log_row = [], []
            for a, k in zip(row, keep, strict=True):
                if not k:
                    soft_row.append(mpmath.mpf(0))
                    log_row.append(-mpmath.inf)
                    continue
                a = mpmath.mpf(float(a))
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
    spread = finite.max() - finite.min()
    return tuple(round_stable(lambda dps, n=n: naive_logspace(x, where, dps)[n], dtype,
                              spread) for n in range(3))
