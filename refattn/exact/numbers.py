"""Number systems of the exact path of the probabilistic variants (gmm, mgk, hopfield).

The same row evaluator runs on rigorous intervals (:data:`INTERVAL`, the Ziv loop) and on exact
rationals (:data:`RATIONAL`, the loop's fallback for results that may sit exactly on a rounding
boundary: this happens only when every softmax of the computation is a tie, so its weights are
exactly 1/n). The rational system raises :class:`NotRational` as soon as a transcendental value
would be needed. Both offer ``array``, ``scalar``, ``exp``, ``log``, ``log_2pi``, ``lse`` and
``softmax`` (None = an excluded term) and say which they are by ``rational``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from mpmath import iv

from . import intervals as I

__all__ = [
    "NotRational",
    "IntervalOps",
    "RationalOps",
    "INTERVAL",
    "RATIONAL",
    "is_zero",
    "dot",
    "sqdist",
]


class NotRational(Exception):
    """The requested exact value is not a rational computable from the inputs."""


class IntervalOps:
    """Rigorous interval enclosures (mpmath ``iv``) at the working precision."""

    rational = False

    @staticmethod
    def array(x) -> np.ndarray:
        return I.to_intervals(x)

    @staticmethod
    def scalar(x):
        return I.point(float(x))

    @staticmethod
    def exp(x):
        return I.exp(x)

    @staticmethod
    def log(x):
        return I.log(x)

    @staticmethod
    def log_2pi():
        return I.log(2 * iv.pi)

    @staticmethod
    def lse(terms):
        """log sum exp over the non-None terms (None = excluded); None if all excluded."""
        present = [t for t in terms if t is not None]
        if not present:
            return None
        if len(present) == 1:  # log exp t = t exactly (t - t is not 0 on a wide interval)
            return present[0]
        top = max(present, key=lambda t: float(t.mid))
        total = sum(I.exp(t - top) for t in present)
        return top + I.log(total)

    @classmethod
    def softmax(cls, terms):
        """Enclosures of the softmax weights (0 for None); a single present term has weight
        exactly 1 (and so its derivatives are exactly 0)."""
        present = [t for t in terms if t is not None]
        if len(present) == 1:
            return [0 if t is None else iv.mpf(1) for t in terms]
        lse = cls.lse(terms)
        if lse is None:
            return [0] * len(terms)
        return [0 if t is None else I.exp(t - lse) for t in terms]


class RationalOps:
    """Exact rationals (Fractions); raises :class:`NotRational` where a transcendental value
    would be needed."""

    rational = True

    @staticmethod
    def array(x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        out = np.empty(x.shape, dtype=object)
        for index, value in np.ndenumerate(x):
            if not math.isfinite(value):
                raise NotRational
            out[index] = Fraction(value)
        return out

    @staticmethod
    def scalar(x):
        if not math.isfinite(float(x)):
            raise NotRational
        return Fraction(float(x))

    @staticmethod
    def exp(x):
        if x != 0:
            raise NotRational
        return Fraction(1)

    @staticmethod
    def log(x):
        if x != 1:
            raise NotRational
        return Fraction(0)

    @staticmethod
    def log_2pi():
        raise NotRational

    @staticmethod
    def lse(terms):
        present = [t for t in terms if t is not None]
        if not present:
            return None
        if len(present) > 1:
            raise NotRational  # log(n) is irrational for n >= 2
        return present[0]

    @staticmethod
    def softmax(terms):
        present = [t for t in terms if t is not None]
        if not present:
            return [0] * len(terms)
        if any(t != present[0] for t in present):
            raise NotRational  # distinct scores: the weights are transcendental
        share = Fraction(1, len(present))
        return [0 if t is None else share for t in terms]


INTERVAL = IntervalOps()
RATIONAL = RationalOps()


def is_zero(x):
    """x is exactly zero (an int/Fraction 0 or the point interval [0, 0])."""
    if isinstance(x, iv.mpf):
        lo, hi = x._mpi_
        return not lo[1] and not hi[1]  # zero mantissas
    return x == 0


def dot(x, y):
    """Sum of elementwise products of two 1-D object arrays (intervals or Fractions)."""
    return sum((a * b for a, b in zip(x, y, strict=False)), 0)


def sqdist(x, y):
    """Squared Euclidean distance of two 1-D object arrays (intervals or Fractions)."""
    return sum(((a - b) * (a - b) for a, b in zip(x, y, strict=False)), 0)
