"""Loop twin of refattn.logspace: logsumexp, softmax and log_softmax of masked rows.

At ``dps`` decimal digits with mpmath, in cancellation-free forms; nothing here imports
refattn.
"""

from __future__ import annotations

import mpmath

__all__ = ["naive_logspace"]


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
