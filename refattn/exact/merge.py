"""Exact path of :func:`refattn.merge_states`: every element of out and lse is the exact real
merge of the inputs (taken at their exact binary values) rounded once.

Per row, with the finite states' lses ``l_p`` (exact), one maximal state ``r``, the exact
differences ``delta_p = l_p - l_r <= 0`` and ``c = 1`` (base e) or ``ln 2`` (base 2):
``e_p = exp(c delta_p)`` (``e_r = 1``), ``Z = 1 + sum_{p != r} e_p``,
``lse = l_r + log1p(Z - 1) / c`` and ``out_e = sum_p e_p out_pe / Z``. Every quantity is
enclosed in relative precision by directed rounding on raw mpfs and rounded by the Ziv loop
(:func:`refattn.exact.rounding.correctly_round`).

A result on a rounding boundary is settled exactly: ``out - M = sum_p e_p (out_p - M) / Z``
vanishes iff, grouping the states by ``exp(c delta_p)``'s transcendence class, every group's
rational sum vanishes. Base e: groups of equal ``delta`` (Lindemann-Weierstrass: ``e^{d}`` for
distinct rationals are linearly independent over the rationals). Base 2: ``2^delta =
2^n 2^f`` with ``n`` an integer and ``f in [0, 1)`` a dyadic fraction; the ``2^f`` of distinct
``f`` are linearly independent over Q (``x^(2^K) - 2`` is irreducible, Eisenstein), so the
groups are the classes of equal ``f`` with rational sums ``sum 2^n (out_p - M)``. lse is
rational only for one live state (base e) or integer ``delta``s whose ``sum 2^delta`` is a
power of two (base 2); those are evaluated exactly.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from mpmath.libmp import (
    from_float,
    from_man_exp,
    fzero,
    mpf_add,
    mpf_div,
    mpf_floor,
    mpf_ln2,
    mpf_mul,
    mpf_sub,
    round_ceiling,
    round_floor,
    to_int,
    to_rational,
)

from .. import config
from . import _fixed as F
from .rounding import correctly_round

__all__ = ["exact_merge", "nonfinite_pattern"]

_ONE = from_man_exp(1, 0)
_SIDE_PRECISIONS = (64, 256, 1024, 4096, 16384)
#: Largest exponent span (bits) of an exact base-2 group sum (beyond: decided by enclosures).
_EXACT_SPAN = 1 << 16


def nonfinite_pattern(outs: np.ndarray, lses: np.ndarray):
    """The results of the exact real merge where an input is not finite.

    Returns (out_value, out_set, lse_value, lse_set): NaN / +-inf values and the masks where
    they apply. Rules: an empty state (lse -inf) weighs exactly 0 whatever its out (NaN
    included); a NaN lse makes the row NaN; a +inf lse makes lse +inf and out NaN (its weight
    is undefined); otherwise every live weight is positive, so a NaN out of a live state gives
    NaN, +inf and -inf together NaN, one of them that infinity.
    """
    nan_row = np.isnan(lses).any(axis=0)
    inf_row = np.isposinf(lses).any(axis=0) & ~nan_row
    live = ~np.isneginf(lses) & ~np.isnan(lses)
    o = np.where(live[..., None], outs, 0.0)
    has_nan = np.isnan(o).any(axis=0)
    pos, neg = np.isposinf(o).any(axis=0), np.isneginf(o).any(axis=0)
    out_value = np.where(has_nan | (pos & neg), np.nan, np.where(pos, np.inf, -np.inf))
    row_bad = (nan_row | inf_row)[..., None]
    out_value = np.where(row_bad, np.nan, out_value)
    out_set = has_nan | pos | neg | row_bad
    lse_value = np.where(nan_row, np.nan, np.inf)
    return out_value, out_set, lse_value, nan_row | inf_row


def _mpf_of_fraction(x: Fraction):
    """A dyadic Fraction (a rounding boundary) as an exact raw mpf."""
    return from_man_exp(x.numerator, -(x.denominator.bit_length() - 1))


class _Row:
    """The exact data of one row: live states' exact differences and outputs."""

    def __init__(self, lses: np.ndarray, outs: np.ndarray, base2: bool):
        live = np.flatnonzero(np.isfinite(lses))
        self.ref = int(live[np.argmax(lses[live])])
        self.top = from_float(float(lses[self.ref]))
        self.live = [int(p) for p in live]
        self.delta = {p: mpf_sub(from_float(float(lses[p])), self.top) for p in self.live}
        self.outs = outs
        self.base2 = base2
        self._cache: dict = {}

    def _c(self, work):
        return (mpf_ln2(work, round_floor), mpf_ln2(work, round_ceiling)) if self.base2 else None

    def exps(self, work):
        """{p: (lo, hi)} enclosures of e_p = exp(c delta_p) and (Z_lo, Z_hi)."""
        if work in self._cache:
            return self._cache[work]
        c = self._c(work)
        e = {}
        z_lo = z_hi = _ONE
        for p in self.live:
            d = self.delta[p]
            if p == self.ref:
                e[p] = (_ONE, _ONE)
                continue
            if c is None:
                d_lo = d_hi = d
            else:  # d <= 0: the larger c gives the lower end
                d_lo = mpf_mul(d, c[1], work, round_floor)
                d_hi = mpf_mul(d, c[0], work, round_ceiling)
            e[p] = F.exp_bounds(d_lo, d_hi, work)
            z_lo = mpf_add(z_lo, e[p][0], work, round_floor)
            z_hi = mpf_add(z_hi, e[p][1], work, round_ceiling)
        self._cache = {work: (e, (z_lo, z_hi))}
        return self._cache[work]

    def log_part(self, work):
        """Enclosure of log1p(X) / c (>= 0)."""
        _, (z_lo, z_hi) = self.exps(work)
        lo, hi = F.log1p_bounds(
            mpf_sub(z_lo, _ONE, work, round_floor), mpf_sub(z_hi, _ONE, work, round_ceiling), work
        )
        c = self._c(work)
        if c is not None:
            lo = mpf_div(lo, c[1], work, round_floor)
            hi = mpf_div(hi, c[0], work, round_ceiling)
        return lo, hi

    def lse(self, work):
        lo, hi = self.log_part(work)
        return mpf_add(self.top, lo, work, round_floor), mpf_add(self.top, hi, work, round_ceiling)

    def weighted(self, e_index, work, shift=None):
        """Enclosure of sum_p e_p (out_pe - shift) (shift a raw mpf or None)."""
        e, _ = self.exps(work)
        n_lo = n_hi = fzero
        for p in self.live:
            o = from_float(float(self.outs[p, e_index]))
            if shift is not None:
                o = mpf_sub(o, shift)
            if o == fzero:
                continue
            lo, hi = e[p]
            if o[0]:  # negative
                lo, hi = hi, lo
            n_lo = mpf_add(n_lo, mpf_mul(lo, o, work, round_floor), work, round_floor)
            n_hi = mpf_add(n_hi, mpf_mul(hi, o, work, round_ceiling), work, round_ceiling)
        return n_lo, n_hi

    def out(self, e_index, work):
        n_lo, n_hi = self.weighted(e_index, work)
        _, (z_lo, z_hi) = self.exps(work)
        lo = mpf_div(n_lo, z_hi if F.sign_of(n_lo, n_lo) != -1 else z_lo, work, round_floor)
        hi = mpf_div(n_hi, z_lo if F.sign_of(n_hi, n_hi) != -1 else z_hi, work, round_ceiling)
        return lo, hi

    # -- exact decisions --------------------------------------------------------------
    def _classes(self):
        """{class key: [(p, 2-power or None)]}: base e groups equal deltas; base 2 groups
        equal fractional parts f of delta = n + f, with n (None when too large to hold)."""
        classes: dict = {}
        for p in self.live:
            d = self.delta[p]
            if not self.base2:
                classes.setdefault(d, []).append((p, 0))
                continue
            n = mpf_floor(d)
            frac = mpf_sub(d, n)
            classes.setdefault(frac, []).append((p, to_int(n)))
        return classes

    def _class_sums(self, e_index, boundary: Fraction):
        """Exact rational sums per class (None where the exponent span is too wide)."""
        sums = {}
        for key, members in self._classes().items():
            lo = min(n for _, n in members)
            if max(n for _, n in members) - lo > _EXACT_SPAN:
                return None
            sums[key] = sum(
                (Fraction(float(self.outs[p, e_index])) - boundary) * Fraction(2) ** (n - lo)
                for p, n in members
            )
        return sums

    def out_side(self, e_index, boundary: Fraction):
        """The sign of out_e - boundary, or None."""
        sums = self._class_sums(e_index, boundary)
        if sums is not None and not any(sums.values()):
            return 0
        shift = _mpf_of_fraction(boundary)
        for work in _SIDE_PRECISIONS:
            found = F.sign_of(*self.weighted(e_index, work, shift))
            if found is not None:
                return found
        return None

    def exact_lse(self):
        """The exact lse when it is rational, else None."""
        if len(self.live) == 1:
            return Fraction(*to_rational(self.top))
        if not self.base2:
            return None
        total = Fraction(0)
        for p in self.live:
            d = Fraction(*to_rational(self.delta[p]))
            if d.denominator != 1 or d < -_EXACT_SPAN:
                return None
            total += Fraction(2) ** int(d)
        num, den = total.numerator, total.denominator
        if num & (num - 1) or den & (den - 1):
            return None
        log2 = (num.bit_length() - 1) - (den.bit_length() - 1)
        return Fraction(*to_rational(self.top)) + log2

    def lse_side(self, boundary: Fraction):
        exact = self.exact_lse()
        if exact is not None:
            return (exact > boundary) - (exact < boundary)
        base = mpf_sub(self.top, _mpf_of_fraction(boundary))
        for work in _SIDE_PRECISIONS:
            lo, hi = self.log_part(work)
            found = F.sign_of(
                mpf_add(base, lo, work, round_floor), mpf_add(base, hi, work, round_ceiling)
            )
            if found is not None:
                return found
        return None

    def exact_out(self, e_index):
        """The exact out element when every weight is rational, else None."""
        classes = self._classes()
        if len(classes) != 1:
            return None
        members = next(iter(classes.values()))
        lo = min(n for _, n in members)
        if max(n for _, n in members) - lo > _EXACT_SPAN:
            return None
        weights = [(p, Fraction(2) ** (n - lo)) for p, n in members]
        total = sum(w for _, w in weights)
        return sum(w * Fraction(float(self.outs[p, e_index])) for p, w in weights) / total


def exact_merge(outs: np.ndarray, lses: np.ndarray, base2: bool, dtype):
    """Correctly rounded (out (..., L, E), lse (..., L)) of float64 (P, ..., L, E) / (P, ..., L)."""
    states, vdim = outs.shape[0], outs.shape[-1]
    rest = lses.shape[1:]
    flat_lses = np.moveaxis(lses, 0, -1).reshape(-1, states)
    flat_outs = np.moveaxis(outs, 0, -2).reshape(-1, states, vdim)
    out_value, out_set, lse_value, lse_set = nonfinite_pattern(outs, lses)
    out_value, out_set = out_value.reshape(-1, vdim), out_set.reshape(-1, vdim)
    lse_value, lse_set = lse_value.reshape(-1), lse_set.reshape(-1)
    empty = ~np.isfinite(flat_lses).any(axis=1) & ~lse_set
    rows = [
        None if (lse_set[r] or empty[r]) else _Row(flat_lses[r], flat_outs[r], base2)
        for r in range(len(flat_lses))
    ]

    def out_enclosure(prec):
        work = prec + config.ELEMENTARY_GUARD_BITS
        lo = np.empty(out_set.shape, dtype=object)
        hi = np.empty_like(lo)
        for r, row in enumerate(rows):
            for e in range(vdim):
                if out_set[r, e]:
                    lo[r, e] = hi[r, e] = float(out_value[r, e])
                elif row is None:
                    lo[r, e] = hi[r, e] = 0.0
                else:
                    lo[r, e], hi[r, e] = row.out(e, work)
        return lo, hi

    def lse_enclosure(prec):
        work = prec + config.ELEMENTARY_GUARD_BITS
        lo = np.empty(lse_set.shape, dtype=object)
        hi = np.empty_like(lo)
        for r, row in enumerate(rows):
            if lse_set[r]:
                lo[r] = hi[r] = float(lse_value[r])
            elif row is None:
                lo[r] = hi[r] = -np.inf
            else:
                lo[r], hi[r] = row.lse(work)
        return lo, hi

    def out_fallback(ix):
        row = rows[ix[0]]
        return None if row is None or out_set[ix] else row.exact_out(ix[1])

    def out_decide(ix, boundary):
        row = rows[ix[0]]
        return None if row is None or out_set[ix] else row.out_side(ix[1], boundary)

    def lse_fallback(ix):
        row = rows[ix[0]]
        return None if row is None else row.exact_lse()

    def lse_decide(ix, boundary):
        row = rows[ix[0]]
        return None if row is None else row.lse_side(boundary)

    out = correctly_round(
        out_enclosure, dtype, fallback=out_fallback, decide=out_decide, what="merged out"
    )
    lse = correctly_round(
        lse_enclosure, dtype, fallback=lse_fallback, decide=lse_decide, what="merged lse"
    )
    return out.reshape(rest + (vdim,)), lse.reshape(rest)
