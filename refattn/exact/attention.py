"""Exact scaled dot-product attention: enclosures at a working precision, rounded by the Ziv loop.

How an enclosure is computed for one (batch, head) plane at working precision P bits:

1. q, k, v, bias and ALiBi slopes are taken at their exact binary values as integers times a
   shared power of two (:func:`refattn.exact._fixed.to_fixed`); every dot product ``q_i . k_j``
   is an exact integer (object matmul), so no rounding happens before the scale.
2. The score ``t_ij = scale * (q_i . k_j)`` [softcap] ``+ bias_ij + alibi_ij`` is enclosed in
   [t_lo, t_hi] (exact when the scale is dyadic and there is no softcap; 1/sqrt(D) is enclosed
   by directed-rounding square root and division).
3. Row i is taken relative to a reference key ``r`` at (or within ``2**-work`` of) its maximum:
   the differences ``d_ij = t_ij - t_ir`` and the shift ``m_i = t_ir`` are enclosed to an
   *absolute* width of about ``2**-work`` whatever their magnitude (exact integer differences of
   the dot products, the scale taken at ``work + log2|s x|`` bits, exact sums; see
   :class:`_ScoreArithmetic`), so scores far beyond the float range cost bounded time.
   ``e_ij = exp(d_ij)`` becomes fixed-point integers ``E_lo <= 2**P e <= E_hi``; a term with
   ``d_ij < -(P + 1)`` is enclosed as [0, 1] without evaluating it (any gap, even 1e300).
4. ``Z_i = sum_j E_ij`` and ``N_ie = sum_j keep_ij E_ij v_je`` are exact integer sums of the
   enclosures (midpoint-radius form: two object matmuls), so
   ``out_ie = N_ie / Z_i * 2**e_v / (1 - p)`` is enclosed by exact rationals;
   ``lse_i = m_i + log(Z_i 2**-P)`` and ``w_ij = exp(d_ij - log(Z_i 2**-P))`` by directed
   rounding.

The widths shrink like ``S * 2**-P`` relative to the natural scale ``sum_j w_ij |v_je|``;
the Ziv loop doubles P until every rounding is decided. A result a hair from a rounding
boundary (a midpoint plus ``exp(-1e9)``; an output that underflows to -0) is settled by its
side of the boundary, computed in relative precision (:meth:`ExactForward.side`). Results
beyond the range of ``out_dtype`` (an lse of 1e400) round to +-inf: the IEEE 754
round-to-nearest value of a finite real beyond the largest finite number.

Exact ties (results that are rationals, possibly on a rounding midpoint) are settled by
:meth:`ExactForward.exact_value`: when every allowed score of a row is equal the weights are
exactly 1/n; when groups of equal scores all have the same mean value the output equals that
mean; a single allowed key with a rational score has lse equal to that score. By the
Lindemann-Weierstrass theorem every other output is irrational, so the loop terminates.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from mpmath.libmp import (
    from_man_exp,
    from_rational,
    fzero,
    mpf_add,
    mpf_cmp,
    mpf_div,
    mpf_mul,
    mpf_sub,
    round_ceiling,
    round_floor,
    to_float,
)

from .. import config
from ..spec import AttentionSpec, fold
from . import _fixed as F
from .rounding import correctly_round

__all__ = ["ExactForward", "ExactPlane", "ScoreArithmetic", "exact_forward", "scale_bounds"]

_NAN = float("nan")


def scale_bounds(spec: AttentionSpec, prec: int):
    """Bounds (lo, hi) (mpf raw tuples) of the exact score scale at working precision ``prec``:
    exact for a dyadic scale, else enclosed (1/sqrt(D), a user scale that is not dyadic)."""
    exact = spec.scale_exact
    if isinstance(exact, tuple):
        return F.invsqrt_bounds(exact[1], prec)
    num, den = exact.numerator, exact.denominator
    if den & (den - 1) == 0:  # dyadic: exact
        value = from_man_exp(num, -(den.bit_length() - 1))
        return value, value
    work = prec + config.ELEMENTARY_GUARD_BITS
    n, d = from_man_exp(num, 0), from_man_exp(den, 0)
    return mpf_div(n, d, work, round_floor), mpf_div(n, d, work, round_ceiling)


class _Plane:
    """Exact, precision-independent data of one (batch, query head) plane."""

    def __init__(self, spec: AttentionSpec, b: int, h: int):
        g = int(spec.kv_head[h])
        self.allowed = spec.allowed(b, h)
        q = F.to_fixed(spec.q[b, h])
        k = F.to_fixed(spec.k[b, g])
        self.v = F.to_fixed(spec.v[b, g])
        # float values kept only when some are non-finite (needed for NaN/inf bookkeeping)
        self.v_raw = np.asarray(spec.v[b, g], np.float64) if self.v.nonfinite.any() else None
        self.kept = self.allowed.copy()
        if spec.dropout_mask is not None:
            self.kept &= spec.dropout_mask[b, h]
        has_keys = self.allowed.any(axis=1)
        self.empty = ~has_keys
        self.nan_rows = (q.nonfinite.any(axis=1) & has_keys) | (
            self.allowed & k.nonfinite.any(axis=1)[None, :]
        ).any(axis=1)
        self.dot = q.ints @ k.ints.T
        self.dot_exp = q.exp + k.exp
        self.add, self.add_exp = self._additive(spec, b, h)

    @staticmethod
    def _additive(spec, b, h):
        """Exact bias + ALiBi as (ints (L, S), exp), or (None, 0)."""
        terms = []
        if spec.bias is not None:
            bias = F.to_fixed(spec.bias[b, h])  # -inf (excluded) becomes 0
            terms.append((bias.ints, bias.exp))
        if spec.alibi_slopes is not None:
            slope = F.to_fixed(spec.alibi_slopes[h : h + 1])
            dist = spec.alibi_distance(b)
            terms.append((-int(slope.ints[0]) * dist.astype(object), slope.exp))
        if not terms:
            return None, 0
        base = min(exp for _, exp in terms)
        total = sum(np.left_shift(ints, exp - base) for ints, exp in terms)
        return total, base


class ExactForward:
    """Enclosures of out, lse and weights of one attention call, cached per precision."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        batch, heads, *_ = spec.dims
        self.planes = {(b, h): _Plane(spec, b, h) for b in range(batch) for h in range(heads)}
        self._cache: dict[int, dict] = {}
        self._arithmetic = _ScoreArithmetic(spec)

    # -- scores -------------------------------------------------------------------------
    def _scores(self, plane: _Plane, prec: int):
        """Per row: score differences ``d_ij = t_ij - t_ir`` to a reference key ``r`` near
        the row maximum, as lists (d_lo, d_hi) of raw mpfs (None where excluded), and the
        shift enclosures ``(m_lo, m_hi)`` of ``m_i = t_ir`` (None for empty / NaN rows).

        Both are enclosed to an *absolute* width of about ``2**-work`` whatever the magnitude
        of the scores (see :class:`_ScoreArithmetic`), so scores far beyond the float range
        (q, k ~ 1e200, a bias of 1e300) cost bounded time and never empty a row's sum.
        """
        work = prec + config.ELEMENTARY_GUARD_BITS
        d_lo, d_hi, shifts = [], [], []
        length, keys = plane.allowed.shape
        for i in range(length):
            row_lo, row_hi = [None] * keys, [None] * keys
            row = self._row(plane, i, work)
            if row is None:
                shifts.append(None)
            else:
                parts, ref, diffs = row
                for j, (lo, hi) in diffs.items():
                    row_lo[j], row_hi[j] = lo, hi
                shifts.append(self._arithmetic.score(parts[ref], work))
            d_lo.append(row_lo)
            d_hi.append(row_hi)
        return d_lo, d_hi, shifts

    def _row(self, plane: _Plane, i: int, work: int):
        """(parts, ref, diffs) of row i: exact score parts per allowed key, the reference key
        and the differences {j: (lo, hi)}; None for an empty or NaN row."""
        if plane.nan_rows[i] or plane.empty[i]:
            return None
        arith = self._arithmetic
        cols = [int(j) for j in np.flatnonzero(plane.allowed[i])]
        parts = {j: arith.parts(plane, i, j) for j in cols}
        ref = max(cols, key=lambda j: arith.approx(parts[j]))
        diffs = {j: arith.difference(parts[j], parts[ref], work) for j in cols}
        best = ref
        for j in cols:
            if mpf_cmp(diffs[j][1], diffs[best][1]) > 0:
                best = j
        if mpf_cmp(diffs[best][1], _HALF) > 0:  # the float approximation missed the maximum
            ref = best
            diffs = {j: arith.difference(parts[j], parts[ref], work) for j in cols}
        return parts, ref, diffs

    # -- one precision ------------------------------------------------------------------
    def at(self, prec: int) -> dict:
        """Enclosures at ``prec`` bits: {"out": (lo, hi), "lse": (lo, hi), "rows": ...}."""
        if prec not in self._cache:
            self._cache = {prec: self._evaluate(prec)}
        return self._cache[prec]

    def _evaluate(self, prec: int) -> dict:
        spec = self.spec
        batch, heads, _, length, keys, _, vdim = spec.dims
        out_lo = np.empty((batch, heads, length, vdim), dtype=object)
        out_hi = np.empty_like(out_lo)
        lse_lo = np.empty((batch, heads, length), dtype=object)
        lse_hi = np.empty_like(lse_lo)
        state = {}
        for (b, h), plane in self.planes.items():
            d_lo, d_hi, shifts = self._scores(plane, prec)
            ex = self._exponentials(plane, d_lo, d_hi, shifts, prec)
            state[b, h] = (d_lo, d_hi, ex)
            self._outputs(plane, ex, prec, out_lo[b, h], out_hi[b, h])
            self._lse(plane, ex, prec, lse_lo[b, h], lse_hi[b, h])
        return {"out": (out_lo, out_hi), "lse": (lse_lo, lse_hi), "state": state}

    def _exponentials(self, plane, d_lo, d_hi, shifts, prec):
        """Row shifts (m_lo, m_hi) and fixed-point enclosures E_lo, E_hi (object (L, S)) of
        ``2**P exp(d_ij)``; a term below ``2**-(P + 1)`` is enclosed as [0, 1] without
        evaluating its exponential (bounded cost for any score gap)."""
        length, keys = plane.allowed.shape
        e_lo = np.zeros((length, keys), dtype=object)
        e_hi = np.zeros((length, keys), dtype=object)
        negligible = from_man_exp(-(prec + 1), 0)  # exp(-(P + 1)) < 2**-(P + 1)
        for i in range(length):
            for j in range(keys):
                if d_hi[i][j] is None:
                    continue
                if mpf_cmp(d_hi[i][j], negligible) < 0:
                    e_lo[i, j], e_hi[i, j] = 0, 1
                    continue
                lo, hi = F.exp_bounds(d_lo[i][j], d_hi[i][j], prec)
                e_lo[i, j] = F.floor_scaled(lo, prec)
                e_hi[i, j] = F.ceil_scaled(hi, prec)
        return shifts, e_lo, e_hi

    def _outputs(self, plane, ex, prec, out_lo, out_hi):
        spec = self.spec
        _, e_lo, e_hi = ex
        kept = plane.kept
        mid2 = np.where(kept, e_lo + e_hi, 0) @ plane.v.ints
        rad2 = np.where(kept, e_hi - e_lo, 0) @ np.abs(plane.v.ints)
        z_lo, z_hi = e_lo.sum(axis=1), e_hi.sum(axis=1)
        keep = spec.keep_scale
        num_scale = keep.numerator << max(plane.v.exp, 0)
        den_scale = 2 * keep.denominator << max(-plane.v.exp, 0)
        bad_v = self._nonfinite_contributions(plane)
        for i in range(plane.allowed.shape[0]):
            if plane.nan_rows[i] or (plane.empty[i] and spec.empty_rows == "nan"):
                out_lo[i, :] = out_hi[i, :] = _NAN
                continue
            if plane.empty[i]:
                out_lo[i, :] = out_hi[i, :] = 0
                continue
            for e in range(out_lo.shape[1]):
                if bad_v is not None and not np.isnan(bad_v[i, e]) and bad_v[i, e] != 0:
                    out_lo[i, e] = out_hi[i, e] = bad_v[i, e]
                    continue
                if bad_v is not None and np.isnan(bad_v[i, e]):
                    out_lo[i, e] = out_hi[i, e] = _NAN
                    continue
                n_lo, n_hi = mid2[i, e] - rad2[i, e], mid2[i, e] + rad2[i, e]
                out_lo[i, e] = (n_lo * num_scale, den_scale * (z_hi[i] if n_lo >= 0 else z_lo[i]))
                out_hi[i, e] = (n_hi * num_scale, den_scale * (z_lo[i] if n_hi >= 0 else z_hi[i]))

    def _nonfinite_contributions(self, plane):
        """Per (row, column) the effect of non-finite values at kept positions, or None.

        0 where there is none, +-inf where only infinities of one sign reach the element, NaN
        where a NaN (or infinities of both signs) does; weights are positive in exact
        arithmetic, so an infinity times its weight stays infinite.
        """
        bad = plane.v.nonfinite
        if not bad.any():
            return None
        raw_v = plane.v_raw
        length = plane.allowed.shape[0]
        effect = np.zeros((length, bad.shape[1]))
        for j in np.flatnonzero(bad.any(axis=1)):
            rows = plane.kept[:, j]
            with np.errstate(invalid="ignore"):
                effect[rows] = effect[rows] + np.where(bad[j], raw_v[j], 0.0)
        return effect

    def _lse(self, plane, ex, prec, lse_lo, lse_hi):
        shifts, e_lo, e_hi = ex
        work = prec + config.ELEMENTARY_GUARD_BITS
        logs = _log_sums(e_lo, e_hi, prec)
        for i in range(plane.allowed.shape[0]):
            if plane.nan_rows[i] or (plane.empty[i] and self.spec.empty_rows == "nan"):
                lse_lo[i] = lse_hi[i] = _NAN
                continue
            if plane.empty[i]:
                lse_lo[i] = lse_hi[i] = -np.inf
                continue
            (m_lo, m_hi), (lo, hi) = shifts[i], logs[i]
            lse_lo[i] = mpf_add(m_lo, lo, work, round_floor)
            lse_hi[i] = mpf_add(m_hi, hi, work, round_ceiling)

    def weights(self, prec: int):
        """Enclosures of the (pre-dropout) weights ``w_ij = exp(d_ij - log(Z_i 2**-P))``
        (the differences ``d`` never cancel: no loss for scores beyond the float range)."""
        spec = self.spec
        batch, heads, _, length, keys, _, _ = spec.dims
        got = self.at(prec)
        w_lo = np.zeros((batch, heads, length, keys), dtype=object)
        w_hi = np.zeros_like(w_lo)
        work = prec + config.ELEMENTARY_GUARD_BITS
        for (b, h), plane in self.planes.items():
            d_lo, d_hi, (_, e_lo, e_hi) = got["state"][b, h]
            logs = _log_sums(e_lo, e_hi, prec)
            for i in range(length):
                if plane.nan_rows[i] or (plane.empty[i] and spec.empty_rows == "nan"):
                    w_lo[b, h, i] = w_hi[b, h, i] = np.where(
                        plane.allowed[i] | plane.empty[i], _NAN, 0.0
                    )
                    continue
                for j in np.flatnonzero(plane.allowed[i]):
                    lo, hi = F.exp_bounds(
                        mpf_sub(d_lo[i][j], logs[i][1], work, round_floor),
                        mpf_sub(d_hi[i][j], logs[i][0], work, round_ceiling),
                        prec,
                    )
                    w_lo[b, h, i, j], w_hi[b, h, i, j] = lo, hi
        return w_lo, w_hi

    # -- a result a hair from a rounding boundary ----------------------------------------
    def side(self, name: str, index: tuple, boundary: Fraction):
        """The sign of ``x - boundary`` for an out or lse element ``x``, or None.

        Computed in floating (relative) precision, so a boundary plus ``exp(-1e9)`` or a
        negative output that underflows to -0 is settled at once. For out,
        ``out - M = sum_j w_j (keep_j v_j / (1 - p) - M)`` (the weights sum to 1): the sign of
        ``sum_g exp(d_g) U_g`` over groups ``g`` of equal scores with exact sums ``U_g``; all
        ``U_g = 0`` means ``out = M`` exactly (Lindemann-Weierstrass for distinct ``d_g``).
        For lse, ``lse - M = (t_r - M) + log1p(sum_{j != r} exp(d_j))``.
        """
        b, h, i = index[:3]
        plane = self.planes[b, h]
        if plane.nan_rows[i] or plane.empty[i] or name not in ("out", "lse"):
            return None
        if name == "out":
            e = index[3]
            if plane.v.nonfinite[plane.kept[i], e].any():
                return None
            sums = self._group_sums(plane, i, e, boundary)
            if not any(sums.values()):
                return 0
        for work in _SIDE_PRECISIONS:
            found = (
                self._out_side(plane, i, sums, work)
                if name == "out"
                else self._lse_side(plane, i, boundary, work)
            )
            if found is not None:
                return found
        return None

    def _group_sums(self, plane, i, e, boundary):
        """{first key of a group of equal scores: exact sum of keep_j v_je / (1 - p) - M}."""
        keep = self.spec.keep_scale * Fraction(2) ** plane.v.exp
        column = plane.v.ints[:, e]
        return {
            members[0]: sum(
                (keep * int(column[j]) if plane.kept[i, j] else Fraction(0)) - boundary
                for j in members
            )
            for members in self._groups(plane, i)
        }

    def _out_side(self, plane, i, sums, work):
        _, _, diffs = self._row(plane, i, work)
        total_lo = total_hi = fzero
        for j, u in sums.items():
            if u == 0:
                continue
            e_lo, e_hi = F.exp_bounds(*diffs[j], work)
            lo, hi = _interval_product(e_lo, e_hi, u, work)
            total_lo = mpf_add(total_lo, lo, work, round_floor)
            total_hi = mpf_add(total_hi, hi, work, round_ceiling)
        return F.sign_of(total_lo, total_hi)

    def _lse_side(self, plane, i, boundary, work):
        parts, ref, diffs = self._row(plane, i, work)
        t_lo, t_hi = self._arithmetic.score(parts[ref], work)
        m = _dyadic_raw(boundary)
        x_lo = x_hi = fzero
        for j, (d_lo, d_hi) in diffs.items():
            if j != ref:
                e_lo, e_hi = F.exp_bounds(d_lo, d_hi, work)
                x_lo = mpf_add(x_lo, e_lo, work, round_floor)
                x_hi = mpf_add(x_hi, e_hi, work, round_ceiling)
        l_lo, l_hi = F.log1p_bounds(x_lo, x_hi, work)
        return F.sign_of(
            mpf_add(mpf_sub(t_lo, m), l_lo, work, round_floor),
            mpf_add(mpf_sub(t_hi, m), l_hi, work, round_ceiling),
        )

    # -- exact ties -----------------------------------------------------------------------
    def _score_key(self, plane: _Plane, i: int, j: int):
        """A key equal for two keys exactly when their scores are equal (see module doc)."""
        spec = self.spec
        exact_scale = spec.scale_exact
        add = 0 if plane.add is None else int(plane.add[i, j])
        if isinstance(exact_scale, Fraction) and spec.softcap is None:
            return (
                exact_scale * Fraction(int(plane.dot[i, j])) * Fraction(2) ** plane.dot_exp
                + Fraction(add) * Fraction(2) ** plane.add_exp
            )
        return (int(plane.dot[i, j]), add)

    def _groups(self, plane: _Plane, i: int) -> list[list[int]]:
        groups: dict = {}
        for j in np.flatnonzero(plane.allowed[i]):
            groups.setdefault(self._score_key(plane, i, j), []).append(int(j))
        return list(groups.values())

    def _exact_score(self, plane: _Plane, i: int, j: int):
        """The score as a Fraction when it is rational, else None."""
        spec = self.spec
        dot = int(plane.dot[i, j])
        add = Fraction(0 if plane.add is None else int(plane.add[i, j])) * Fraction(2) ** (
            plane.add_exp
        )
        if dot == 0:
            return add  # softcap(0) = 0 and the scale drops out
        if spec.softcap is not None or isinstance(spec.scale_exact, tuple):
            return None
        return spec.scale_exact * dot * Fraction(2) ** plane.dot_exp + add

    def exact_value(self, name: str, index: tuple):
        """The exact value of one result element when it is provably rational, else None."""
        b, h, i = index[:3]
        plane = self.planes[b, h]
        if plane.nan_rows[i] or plane.empty[i]:
            return None
        groups = self._groups(plane, i)
        if name == "lse":
            if len(groups) == 1 and len(groups[0]) == 1:
                return self._exact_score(plane, i, groups[0][0])
            return None
        if name == "weights":
            j = index[3]
            return Fraction(1, len(groups[0])) if len(groups) == 1 and plane.allowed[i, j] else None
        e = index[3]
        column = plane.v.ints[:, e]
        means = set()
        for members in groups:
            kept = [j for j in members if plane.kept[i, j]]
            means.add(Fraction(sum(int(column[j]) for j in kept), len(members)))
            if len(means) > 1:
                return None
        (mean,) = means
        return mean * Fraction(2) ** plane.v.exp * self.spec.keep_scale


_SIDE_PRECISIONS = (64, 256, 1024, 4096)


def _interval_product(e_lo, e_hi, u: Fraction, work: int):
    """Bounds of ``e * u`` for ``0 <= e_lo <= e <= e_hi`` and an exact rational ``u``."""
    u_lo = from_rational(u.numerator, u.denominator, work, round_floor)
    u_hi = from_rational(u.numerator, u.denominator, work, round_ceiling)
    if u > 0:
        return mpf_mul(e_lo, u_lo, work, round_floor), mpf_mul(e_hi, u_hi, work, round_ceiling)
    return mpf_mul(e_hi, u_lo, work, round_floor), mpf_mul(e_lo, u_hi, work, round_ceiling)


def _dyadic_raw(x: Fraction):
    """A dyadic Fraction (a rounding boundary) as an exact raw mpf."""
    return from_man_exp(x.numerator, -(x.denominator.bit_length() - 1))


def _dyadic(x: float) -> tuple[int, int]:
    num, den = Fraction(x).as_integer_ratio()
    return num, -(den.bit_length() - 1)


def _softcap(lo, hi, cap, work):
    """Enclosure of c * tanh(t / c) over [lo, hi] (c > 0: increasing)."""
    a, b = F.tanh_bounds(
        mpf_div(lo, cap, work, round_floor), mpf_div(hi, cap, work, round_ceiling), work
    )
    return mpf_mul(a, cap, work, round_floor), mpf_mul(b, cap, work, round_ceiling)


_HALF = from_man_exp(1, -1)


def _log_sums(e_lo, e_hi, prec):
    """Per row, (lo, hi) of ``log(Z_i 2**-P)`` from the fixed-point sums (None for rows with
    no term: empty or NaN)."""
    z_lo, z_hi = e_lo.sum(axis=1), e_hi.sum(axis=1)
    return [
        F.log_bounds(from_man_exp(int(lo), -prec), from_man_exp(int(hi), -prec), prec)
        if hi
        else None
        for lo, hi in zip(z_lo, z_hi, strict=True)
    ]


def _magnitude(x) -> int:
    """An integer ``k`` with ``|x| < 2**k`` for a raw mpf (0 for zero)."""
    return x[2] + x[3] if x[1] else 0


class _ScoreArithmetic:
    """Scores ``t = f(x) + a`` of one call: ``x = q . k`` and the bias + ALiBi term ``a`` exact,
    ``f(x) = s x`` or, with a softcap ``c``, ``c tanh(s x / c)``.

    Every enclosure is tight to an absolute ``2**-work``: the products with an irrational
    scale are taken at ``work + log2|s x|`` bits (at most ~2200 more than ``work``: the inputs
    are floats) and every sum of exact terms is exact, so differences of scores far beyond
    the float range (or of a huge bias and a huge product) lose nothing.
    """

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        exact = spec.scale_exact
        self.dyadic = None
        self.scale_magnitude = 0  # |s| < 2**scale_magnitude
        if isinstance(exact, Fraction):
            num, den = exact.numerator, exact.denominator
            self.scale_magnitude = max(num.bit_length() - den.bit_length() + 1, 0)
            if den & (den - 1) == 0:
                self.dyadic = from_man_exp(num, -(den.bit_length() - 1))
        self.cap = None if spec.softcap is None else F.raw(*_dyadic(spec.softcap))
        self._scales: dict[int, tuple] = {}

    def parts(self, plane: _Plane, i: int, j: int):
        """The exact (x, a) of score (i, j) as raw mpfs."""
        x = from_man_exp(int(plane.dot[i, j]), plane.dot_exp)
        a = fzero if plane.add is None else from_man_exp(int(plane.add[i, j]), plane.add_exp)
        return x, a

    def approx(self, parts) -> float:
        """A rough value of the score (Python float, possibly +-inf) to pick a reference."""
        x, a = parts
        s = self.spec.scale_float
        with np.errstate(over="ignore", invalid="ignore"):
            if self.cap is not None:
                c = float(self.spec.softcap)
                y = s * _to_float(x) / c
                fx = c * float(np.tanh(y)) if np.isfinite(y) else c * np.sign(y)
            else:
                fx = float(np.float64(s) * np.float64(_to_float(x)))
            value = fx + _to_float(a)
        return -np.inf if np.isnan(value) else value

    def _scale(self, prec: int):
        prec = -(-prec // 64) * 64  # few distinct precisions: cache per 64-bit step
        if prec not in self._scales:
            self._scales[prec] = scale_bounds(self.spec, prec)
        return self._scales[prec]

    def _times_scale(self, x, work: int):
        """(lo, hi) of ``s x`` to an absolute 2**-work."""
        if self.dyadic is not None:
            exact = mpf_mul(x, self.dyadic)
            return exact, exact
        prec = work + max(_magnitude(x) + self.scale_magnitude, 0) + 2
        s_lo, s_hi = self._scale(prec)
        if x[0]:  # x < 0: the larger scale gives the smaller product
            s_lo, s_hi = s_hi, s_lo
        return mpf_mul(x, s_lo, prec, round_floor), mpf_mul(x, s_hi, prec, round_ceiling)

    def _capped(self, x, work: int):
        """(lo, hi) of ``c tanh(s x / c)`` to an absolute 2**-work (|c tanh| <= c)."""
        cap = self.cap
        prec = work + max(_magnitude(cap), 0) + 2
        y_lo, y_hi = self._times_scale(x, prec)
        return _softcap(y_lo, y_hi, cap, prec)

    def difference(self, parts, ref, work: int):
        """(lo, hi) of ``t - t_ref`` (exact endpoints, width about 2**-work)."""
        (x, a), (x_ref, a_ref) = parts, ref
        extra = mpf_sub(a, a_ref)
        if self.cap is None:
            lo, hi = self._times_scale(mpf_sub(x, x_ref), work)
        else:
            f_lo, f_hi = self._capped(x, work + 1)
            r_lo, r_hi = self._capped(x_ref, work + 1)
            lo, hi = mpf_sub(f_lo, r_hi), mpf_sub(f_hi, r_lo)
        return mpf_add(lo, extra), mpf_add(hi, extra)

    def score(self, parts, work: int):
        """(lo, hi) of the score itself (exact endpoints, width about 2**-work)."""
        x, a = parts
        lo, hi = self._times_scale(x, work) if self.cap is None else self._capped(x, work)
        return mpf_add(lo, a), mpf_add(hi, a)


def _to_float(x) -> float:
    """A raw mpf as a float (+-inf beyond the range)."""
    if not x[1]:
        return 0.0
    if _magnitude(x) > 1025:
        return -np.inf if x[0] else np.inf
    return to_float(x)


def exact_forward(spec: AttentionSpec, out_dtype, *, return_lse=False, return_weights=False):
    """Correctly rounded (out, lse, weights) in the flat (B, H, ...) layout.

    A spec with ``sinks`` is folded first (:func:`refattn.spec.fold`: the sink becomes one
    more key with value 0 and its logit as bias, ALiBi kept exact) and the sink's weight
    column is dropped from the weights.
    """
    if spec.sinks is not None:
        out, lse, weights = exact_forward(
            fold(spec, alibi_into_bias=False),
            out_dtype,
            return_lse=return_lse,
            return_weights=return_weights,
        )
        return out, lse, None if weights is None else weights[..., :-1]
    engine = ExactForward(spec)
    out = correctly_round(
        lambda p: engine.at(p)["out"],
        out_dtype,
        fallback=lambda ix: engine.exact_value("out", ix),
        decide=lambda ix, m: engine.side("out", ix, m),
        what="out",
    )
    lse = weights = None
    if return_lse:
        lse = correctly_round(
            lambda p: engine.at(p)["lse"],
            out_dtype,
            fallback=lambda ix: engine.exact_value("lse", ix),
            decide=lambda ix, m: engine.side("lse", ix, m),
            what="lse",
        )
    if return_weights:
        weights = correctly_round(
            engine.weights,
            out_dtype,
            fallback=lambda ix: engine.exact_value("weights", ix),
            what="weights",
        )
    return out, lse, weights


#: Public names of the plane data and the score arithmetic (the sigmoid engine,
#: :mod:`refattn.exact.attention_sigmoid`, reuses both).
ExactPlane = _Plane
ScoreArithmetic = _ScoreArithmetic
