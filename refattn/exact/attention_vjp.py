"""Exact vector-Jacobian product of attention (enclosures + Ziv loop).

At working precision P the forward engine (:mod:`refattn.exact.attention`) gives fixed-point
enclosures of ``e_ij = exp(t_ij - m_i)`` and of ``Z_i``; the weights are enclosed as
``P_ij in [floor(2**P E_lo / Z_hi), ceil(2**P E_hi / Z_lo)] * 2**-P``. Everything after that is
linear or a product of enclosures, carried in midpoint-radius ("ball") form on exact integers:

* ``dP''_ij = dO_i . v_j`` exactly (integer matmul), ``dP = keep dP'' / (1 - p)``;
* ``Delta_i = sum_j P_ij dP_ij`` and ``T_ij = dP_ij - Delta_i + g_i`` as balls;
* ``dS = P * T`` (ball product), the softcap factor ``1 - tanh^2(t/c)`` as a ball;
* ``dQ = s dT K``, ``dK = s dT^T Q``, ``dV = P'^T dO`` as ball matmuls (sums over the query
  heads of a kv group are exact), then the scale ``s`` (an interval when irrational).

Every enclosure endpoint is an exact rational, rounded by the Ziv loop. Rows whose allowed
scores are all equal have rational weights 1/n; gradient elements that depend only on such
rows are settled exactly when their rounding is a tie (:meth:`ExactVJP.exact_value`).

Non-finite inputs: when q, k, v, bias or the cotangents contain NaN or Inf, the positions of
non-finite gradients are those of the float64 path (which follows the same exclusion rules);
all finite elements are exact.
"""

from __future__ import annotations

import dataclasses
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
    mpf_neg,
    mpf_sqrt,
    round_ceiling,
    round_floor,
    to_float,
)

from .. import config
from ..spec import AttentionSpec, fold, split_sink_grads
from . import _fixed as F
from . import fast as _fast
from .attention import ExactForward, scale_bounds
from .rounding import correctly_round, format_of

__all__ = ["exact_vjp"]


def _ball_from_bounds(lo, hi):
    """(mid2, rad2) with value in [(mid2 - rad2)/2, (mid2 + rad2)/2]."""
    return lo + hi, hi - lo


def _ball_mul(m1, r1, m2, r2):
    """Product of balls given as (mid2, rad2) pairs: returns (mid4, rad4) (scale 1/4)."""
    return m1 * m2, np.abs(m1) * r2 + r1 * np.abs(m2) + r1 * r2


class ExactVJP:
    """Enclosures of (dq, dk, dv, dbias) at a working precision, cached per precision."""

    def __init__(self, spec: AttentionSpec, grad_out: np.ndarray, grad_lse):
        if spec.sinks is not None:  # the forward engine has no sink: fold it into a key first
            raise ValueError(
                "ExactVJP: expected a spec without sinks (fold it first: "
                "refattn.spec.fold(spec, alibi_into_bias=False))"
            )
        self.spec = spec
        self.forward = ExactForward(spec)
        self.do = F.to_fixed(grad_out)  # (B, H, L, E)
        self.g = None if grad_lse is None else F.to_fixed(grad_lse)  # (B, H, L)
        self.q = F.to_fixed(spec.q)
        self.k = F.to_fixed(spec.k)
        self.v = F.to_fixed(spec.v)
        self._cache: dict[int, dict] = {}
        self._rows: dict[tuple, list | None] = {}
        self._splits: dict[tuple, object] = {}

    # ------------------------------------------------------------------------------------
    def at(self, prec: int) -> dict:
        if prec not in self._cache:
            self._cache = {prec: self._evaluate(prec)}
        return self._cache[prec]

    def _weights(self, b, h, prec):
        """Fixed-point bounds (scale 2**-prec) of the pre-dropout weights of one plane."""
        got = self.forward.at(prec)["state"][b, h]
        _, _, (_, e_lo, e_hi) = got
        z_lo, z_hi = e_lo.sum(axis=1), e_hi.sum(axis=1)
        z_lo = np.where(z_lo == 0, 1, z_lo)[:, None]  # empty/NaN rows: E == 0, so P == 0
        z_hi = np.where(z_hi == 0, 1, z_hi)[:, None]
        p_lo = np.left_shift(e_lo, prec) // z_hi
        p_hi = -(np.left_shift(-e_hi, prec) // z_lo)
        return p_lo, p_hi

    def _softcap_factor(self, b, h, prec):
        """Fixed-point bounds (scale 2**-prec) of 1 - tanh^2(t/c), or None without softcap."""
        spec = self.spec
        if spec.softcap is None:
            return None
        plane = self.forward.planes[b, h]
        work = prec + config.ELEMENTARY_GUARD_BITS
        s_lo, s_hi = scale_bounds(spec, prec)
        cap_num, cap_den = Fraction(spec.softcap).as_integer_ratio()
        cap = from_man_exp(cap_num, -(cap_den.bit_length() - 1))
        length, keys = plane.allowed.shape
        f_lo = np.zeros((length, keys), dtype=object)
        f_hi = np.zeros((length, keys), dtype=object)
        one = 1 << prec
        for i, j in zip(*np.nonzero(plane.allowed), strict=True):
            x = from_man_exp(int(plane.dot[i, j]), plane.dot_exp)
            a, c = sorted(
                (mpf_mul(x, s_lo, work, round_floor), mpf_mul(x, s_hi, work, round_ceiling)),
                key=lambda r: F.floor_scaled(r, work),
            )
            t_lo, t_hi = F.tanh_bounds(
                mpf_div(a, cap, work, round_floor), mpf_div(c, cap, work, round_ceiling), prec
            )
            th_lo, th_hi = F.floor_scaled(t_lo, prec), F.ceil_scaled(t_hi, prec)
            sq_hi = max(th_lo * th_lo, th_hi * th_hi)
            sq_lo = 0 if th_lo <= 0 <= th_hi else min(th_lo * th_lo, th_hi * th_hi)
            # 1 - th^2 in scale 2**-2prec, taken back to 2**-prec outward
            f_lo[i, j] = ((one << prec) - sq_hi) >> prec
            f_hi[i, j] = -((sq_lo - (one << prec)) >> prec)
        return f_lo, f_hi

    def _evaluate(self, prec: int) -> dict:
        spec = self.spec
        batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
        keep = spec.keep_scale
        do, v, q, k = self.do, self.v, self.q, self.k
        # dq (B,H,L,D), dk (B,K,S,D), dv (B,K,S,E) as (mid, rad) ints with shared exponents
        dq_mid = np.zeros((batch, heads, length, dim), dtype=object)
        dq_rad = np.zeros_like(dq_mid)
        dk_mid = np.zeros((batch, kv_heads, keys, dim), dtype=object)
        dk_rad = np.zeros_like(dk_mid)
        dv_mid = np.zeros((batch, kv_heads, keys, vdim), dtype=object)
        dv_rad = np.zeros_like(dv_mid)
        ds_mid = np.zeros((batch, heads, length, keys), dtype=object)
        ds_rad = np.zeros_like(ds_mid)
        # exponent bookkeeping: P ints carry 2**-prec; dP'' carries 2**(e_do + e_v)
        e_x = do.exp + v.exp
        e_g = self.g.exp if self.g is not None else e_x
        c = min(e_x - prec, e_g)
        for b in range(batch):
            for h in range(heads):
                g = int(spec.kv_head[h])
                plane = self.forward.planes[b, h]
                kept = plane.kept
                p_lo, p_hi = self._weights(b, h, prec)
                pm, pr = _ball_from_bounds(p_lo, p_hi)  # P in (pm +- pr)/2 * 2**-prec
                dpk = np.where(kept, do.ints[b, h] @ v.ints[b, g].T, 0)  # exact, 2**e_x
                # dv: keep/(1-p) * P^T dO  -> (mid2, rad2) * 2**(e_do - prec) * keep
                dv_mid[b, g] += np.where(kept, pm, 0).T @ do.ints[b, h]
                dv_rad[b, g] += np.where(kept, pr, 0).T @ np.abs(do.ints[b, h])
                # Delta_i = keep * sum_j P_ij dP''_ij: (mid2, rad2) * 2**(e_x - prec) * keep
                delta_m = (pm * dpk).sum(axis=1)
                delta_r = (pr * np.abs(dpk)).sum(axis=1)
                # T = keep (dP'' - Delta) + g, as kd * T * 2**-c (mid2, rad2)
                shift_x = e_x - prec - c
                t_mid = keep.numerator * np.left_shift(
                    2 * np.left_shift(dpk, prec) - delta_m[:, None], shift_x
                )
                t_rad = keep.numerator * np.left_shift(
                    np.broadcast_to(delta_r[:, None], dpk.shape), shift_x
                )
                if self.g is not None:
                    g_row = np.left_shift(self.g.ints[b, h], e_g - c)[:, None]
                    t_mid = t_mid + 2 * keep.denominator * g_row
                # dS = P * T: scale 2**(c - prec) / (4 kd)
                m4, r4 = _ball_mul(pm, pr, t_mid, t_rad)
                m4 = np.where(plane.allowed, m4, 0)
                r4 = np.where(plane.allowed, r4, 0)
                ds_mid[b, h], ds_rad[b, h] = m4, r4
                factor = self._softcap_factor(b, h, prec)
                if factor is not None:  # dT = dS * f, taken back to dS's resolution
                    fm, fr = _ball_from_bounds(*factor)
                    m4, r4 = _halve_scale(*_ball_mul(m4, r4, fm, fr), prec + 1)
                dq_mid[b, h] = m4 @ k.ints[b, g]
                dq_rad[b, h] = r4 @ np.abs(k.ints[b, g])
                dk_mid[b, g] += m4.T @ q.ints[b, h]
                dk_rad[b, g] += r4.T @ np.abs(q.ints[b, h])
        scale_lo, scale_hi = scale_bounds(spec, prec)
        ds_scale = (Fraction(2) ** (c - prec)) / (4 * keep.denominator)
        # with softcap, dT's (mid2, rad2) form carries one more factor 1/2 (see _halve_scale)
        dt_scale = ds_scale / 2 if spec.softcap is not None else ds_scale
        return {
            "dq": _scaled_bounds(
                dq_mid, dq_rad, dt_scale * Fraction(2) ** k.exp, (scale_lo, scale_hi)
            ),
            "dk": _scaled_bounds(
                dk_mid, dk_rad, dt_scale * Fraction(2) ** q.exp, (scale_lo, scale_hi)
            ),
            "dv": _scaled_bounds(dv_mid, dv_rad, keep * Fraction(2) ** (do.exp - prec) / 2, None),
            "ds": (ds_mid, ds_rad, ds_scale),
        }

    def dbias(self, prec: int):
        """Enclosures of dbias: dS summed into the slots of :meth:`AttentionSpec.dbias_slots`
        (the caller's bias shape; a folded sink's column into dsinks)."""
        ds_mid, ds_rad, ds_scale = self.at(prec)["ds"]
        index, shape = self.spec.dbias_slots()
        mid, rad = (_slot_sums(x, index, shape) for x in (ds_mid, ds_rad))
        return _scaled_bounds(mid, rad, ds_scale, None)

    def _dbias_positions(self, index: tuple):
        """The (b, h, i, j) positions whose dS add up to dbias element ``index``."""
        slots, shape = self.spec.dbias_slots()
        flat = int(np.ravel_multi_index(index, shape)) if shape else 0
        return [tuple(int(x) for x in p) for p in np.argwhere(slots == flat)]

    # ------------------------------------------------------------------------------------
    def _rational_row(self, b, h, i):
        """Exact dS row (list of Fractions) when row i's weights are rational, else None."""
        key = (b, h, i)
        if key not in self._rows:
            self._rows[key] = self._compute_rational_row(b, h, i)
        return self._rows[key]

    def _compute_rational_row(self, b, h, i):
        forward = self.forward
        plane = forward.planes[b, h]
        if plane.nan_rows[i] or plane.empty[i]:
            return [Fraction(0)] * plane.allowed.shape[1]
        groups = forward._groups(plane, i)
        if len(groups) != 1:
            return None
        n = len(groups[0])
        spec = self.spec
        keep = spec.keep_scale
        g = int(spec.kv_head[h])
        weight = Fraction(1, n)
        dpp = [
            Fraction(int(x)) * Fraction(2) ** (self.do.exp + self.v.exp) * keep
            if plane.kept[i, j]
            else Fraction(0)
            for j, x in enumerate(self.do.ints[b, h, i] @ self.v.ints[b, g].T)
        ]
        delta = sum(weight * dpp[j] for j in groups[0])
        g_i = (
            0
            if self.g is None
            else Fraction(int(self.g.ints[b, h, i])) * Fraction(2) ** (self.g.exp)
        )
        return [
            weight * (dpp[j] - delta + g_i) if plane.allowed[i, j] else Fraction(0)
            for j in range(len(dpp))
        ]

    # -- a result a hair from a rounding boundary ----------------------------------------
    def side(self, name: str, index: tuple, boundary: Fraction):
        """The sign of ``x - boundary`` for a dq / dk / dv element ``x``, or None (see
        :func:`refattn.exact.rounding.correctly_round`'s ``decide``).

        Each weight is split as ``P_ij = A_ij + dP_ij`` with the exact part ``A_ij = 1/n_i``
        on the ``n_i`` keys tied at the row maximum (0 elsewhere) and the remainder enclosed
        in relative precision (it may be ``exp(-1e9)``). Every gradient element is then an
        exact rational *head* (computed from ``A``) times the scale plus a small *tail*, so a
        gradient a hair from a rounding midpoint or from 0 is settled at once (dbias: the sum
        of dS over the positions it reduces). Softcapped calls are left to the Ziv loop.
        """
        spec = self.spec
        if name not in ("dq", "dk", "dv", "dbias") or spec.softcap is not None:
            return None
        for work in (64, 256, 1024):
            found = self._side_at(name, index, boundary, work)
            if found is not None:
                return found
        return None

    def _split_row(self, b, h, i, work):
        """({j: A_ij (Fraction)}, {j: (lo, hi) of P_ij - A_ij}) in relative precision, None
        for an empty / NaN row, "undecided" when the top group is not yet separated."""
        key = (b, h, i, work)
        if key in self._splits:
            return self._splits[key]
        forward = self.forward
        plane = forward.planes[b, h]
        row = forward._row(plane, i, work)
        if row is None:
            self._splits[key] = None
            return None
        _, _, diffs = row
        groups = forward._groups(plane, i)
        best = max(groups, key=lambda g: _float_key(diffs[g[0]][0]))
        for members in groups:
            if members is not best and mpf_cmp(diffs[members[0]][1], diffs[best[0]][0]) >= 0:
                self._splits[key] = "undecided"
                return "undecided"
        exps = {j: F.exp_bounds(lo, hi, work) for j, (lo, hi) in diffs.items()}
        rest_lo = rest_hi = fzero  # Z - n: the keys outside the top group
        for members in groups:
            if members is not best:
                for j in members:
                    rest_lo = mpf_add(rest_lo, exps[j][0], work, round_floor)
                    rest_hi = mpf_add(rest_hi, exps[j][1], work, round_ceiling)
        n = len(best)
        top = set(best)
        z_lo = mpf_add(from_man_exp(n, 0), rest_lo, work, round_floor)
        z_hi = mpf_add(from_man_exp(n, 0), rest_hi, work, round_ceiling)
        exact = {j: Fraction(1, n) if j in top else Fraction(0) for j in diffs}
        delta = {}
        for j, (e_lo, e_hi) in exps.items():
            if j in top:  # 1/Z - 1/n = -(Z - n) / (n Z)
                den_lo = mpf_mul(from_man_exp(n, 0), z_lo, work, round_floor)
                den_hi = mpf_mul(from_man_exp(n, 0), z_hi, work, round_ceiling)
                delta[j] = (
                    mpf_neg(mpf_div(rest_hi, den_lo, work, round_ceiling)),
                    mpf_neg(mpf_div(rest_lo, den_hi, work, round_floor)),
                )
            else:
                delta[j] = (
                    mpf_div(e_lo, z_hi, work, round_floor),
                    mpf_div(e_hi, z_lo, work, round_ceiling),
                )
        self._splits[key] = (exact, delta)
        return exact, delta

    def _ds_split(self, b, h, i, work):
        """({j: exact head of dS_ij}, {j: (lo, hi) tail}) or None / "undecided"."""
        split = self._split_row(b, h, i, work)
        if split is None or split == "undecided":
            return split
        exact, delta = split
        spec = self.spec
        plane = self.forward.planes[b, h]
        g = int(spec.kv_head[h])
        dots = self.do.ints[b, h, i] @ self.v.ints[b, g].T
        unit = spec.keep_scale * Fraction(2) ** (self.do.exp + self.v.exp)
        dp = {j: unit * (int(dots[j]) if plane.kept[i, j] else 0) for j in exact}
        g_i = (
            Fraction(0)
            if self.g is None
            else Fraction(int(self.g.ints[b, h, i])) * Fraction(2) ** self.g.exp
        )
        heads, tails = {}, {}
        for j in exact:
            t_head = g_i + sum((exact[k] * (dp[j] - dp[k]) for k in exact), Fraction(0))
            t_tail = _sum_scaled([(delta[k], dp[j] - dp[k]) for k in exact], work)
            heads[j] = exact[j] * t_head
            # dS - A T^A = dP T^A + A (T - T^A) + dP (T - T^A)
            tail = _sum_scaled([(delta[j], t_head)], work)
            tail = _add(tail, _interval_times(*t_tail, _point(exact[j], work), work), work)
            tails[j] = _add(tail, _interval_times(*delta[j], t_tail, work), work)
        return heads, tails

    def _dbias_side(self, index, boundary, work):
        """Side of a dbias element: the sum of dS over the positions it reduces."""
        head, tail = Fraction(0), (fzero, fzero)
        for b, h, i, j in self._dbias_positions(index):
            split = self._ds_split(b, h, i, work)
            if split == "undecided":
                return None
            if split is None or j not in split[0]:
                continue
            head += split[0][j]
            tail = _add(tail, split[1][j], work)
        return F.sign_of(*_add(tail, _point(head - boundary, work), work))

    def _side_at(self, name, index, boundary, work):
        spec = self.spec
        if name == "dbias":
            return self._dbias_side(index, boundary, work)
        head, tail = Fraction(0), (fzero, fzero)
        if name == "dq":
            b, h, i, d = index
            g = int(spec.kv_head[h])
            split = self._ds_split(b, h, i, work)
            if split == "undecided":
                return None
            if split is not None:
                heads, tails = split
                factors = {j: _exact_value(self.k.ints[b, g, j, d], self.k.exp) for j in heads}
                head = sum((heads[j] * factors[j] for j in heads), Fraction(0))
                tail = _sum_scaled([(tails[j], factors[j]) for j in heads], work)
        else:
            b, g, j, col = index
            for h in np.flatnonzero(spec.kv_head == g):
                h = int(h)
                plane = self.forward.planes[b, h]
                for i in np.flatnonzero(plane.allowed[:, j]):
                    i = int(i)
                    if name == "dv" and not plane.kept[i, j]:
                        continue
                    split = (self._split_row if name == "dv" else self._ds_split)(b, h, i, work)
                    if split == "undecided":
                        return None
                    if split is None:
                        continue
                    heads, tails = split
                    if name == "dv":
                        factor = spec.keep_scale * _exact_value(
                            self.do.ints[b, h, i, col], self.do.exp
                        )
                    else:
                        factor = _exact_value(self.q.ints[b, h, i, col], self.q.exp)
                    head += heads[j] * factor
                    tail = _add(tail, _sum_scaled([(tails[j], factor)], work), work)
        if name == "dv":
            return F.sign_of(*_add(tail, _point(head - boundary, work), work))
        # x = s (head + tail): compare head + tail with boundary / s
        exact = spec.scale_exact
        if isinstance(exact, Fraction):
            if exact == 0:
                return None
            found = F.sign_of(*_add(tail, _point(head - boundary / exact, work), work))
            return None if found is None else (found if exact > 0 else -found)
        # s = 1/sqrt(D) > 0: boundary / s = boundary sqrt(D), enclosed
        root_lo, root_hi = (
            mpf_sqrt(from_man_exp(exact[1], 0), work, rnd) for rnd in (round_floor, round_ceiling)
        )
        shift = _interval_times(*_point(-boundary, work), (root_lo, root_hi), work)
        return F.sign_of(*_add(_add(tail, _point(head, work), work), shift, work))

    def exact_value(self, name: str, index: tuple):
        """Exact value of a gradient element when every row it depends on has rational
        weights (all allowed scores equal), else None."""
        spec = self.spec
        if name == "dbias":
            return self._dbias_exact(index)
        if spec.softcap is not None and name in ("dq", "dk"):
            return None  # the softcap factor 1 - tanh^2 is transcendental
        if name == "dq":
            b, h, i, d = index
            row = self._rational_row(b, h, i)
            if row is None:
                return None
            g = int(spec.kv_head[h])
            total = sum(r * int(x) for r, x in zip(row, self.k.ints[b, g, :, d], strict=True))
            return self._times_scale(total * Fraction(2) ** self.k.exp)
        b, g, j, col = index
        total = Fraction(0)
        for h in np.flatnonzero(spec.kv_head == g):
            plane = self.forward.planes[b, int(h)]
            for i in np.flatnonzero(plane.allowed[:, j]):
                if name == "dv":
                    if not plane.kept[i, j]:
                        continue
                    groups = self.forward._groups(plane, int(i))
                    if len(groups) != 1:
                        return None
                    total += (
                        Fraction(1, len(groups[0]))
                        * spec.keep_scale
                        * int(self.do.ints[b, h, i, col])
                        * Fraction(2) ** self.do.exp
                    )
                else:
                    row = self._rational_row(b, int(h), int(i))
                    if row is None:
                        return None
                    total += row[j] * int(self.q.ints[b, h, i, col]) * Fraction(2) ** self.q.exp
        return total if name == "dv" else self._times_scale(total)

    def _dbias_exact(self, index: tuple):
        """dbias element = sum of dS over the (batch, head, row, key) positions it reduces."""
        total = Fraction(0)
        for b, h, i, j in self._dbias_positions(index):
            row = self._rational_row(b, h, i)
            if row is None:
                return None
            total += row[j]
        return total

    def _times_scale(self, value: Fraction):
        exact = self.spec.scale_exact
        if value == 0:
            return Fraction(0)
        return value * exact if isinstance(exact, Fraction) else None


def _slot_sums(x, index, shape):
    """Exact sums of the object array x (B, H, L, S) into the slots ``index`` (-1: none)."""
    out = np.zeros(int(np.prod(shape)), dtype=object)
    flat, where = index.ravel(), x.ravel()
    used = flat >= 0
    np.add.at(out, flat[used], where[used])
    return out.reshape(shape)


def _halve_scale(mid, rad, bits):
    """Enclose [mid - rad, mid + rad] / 2**bits by integers [lo, hi], returned in
    (mid2, rad2) = (lo + hi, hi - lo) form, which represents the value times 2."""
    lo = (mid - rad) >> bits
    hi = -((-(mid + rad)) >> bits)
    return lo + hi, hi - lo


def _scaled_bounds(mid, rad, factor: Fraction, scale_bounds):
    """Exact (lo, hi) object arrays of (mid -+ rad) * factor [* scale interval]."""
    lo = np.empty(mid.shape, dtype=object)
    hi = np.empty(mid.shape, dtype=object)
    num, den = factor.numerator, factor.denominator
    if scale_bounds is not None:
        (s_lo_num, s_lo_den), (s_hi_num, s_hi_den) = (_raw_ratio(s) for s in scale_bounds)
    for index in np.ndindex(mid.shape):
        m, r = mid[index], rad[index]
        a, b = (m - r) * num, (m + r) * num
        if scale_bounds is None:
            lo[index], hi[index] = (a, den), (b, den)
            continue
        # the scale interval [s_lo, s_hi] never contains 0 in its interior (1/sqrt(D) > 0, a
        # user scale is a point), so the bounding endpoint products follow from the signs
        lo[index] = (a * s_lo_num, den * s_lo_den) if a >= 0 else (a * s_hi_num, den * s_hi_den)
        hi[index] = (b * s_hi_num, den * s_hi_den) if b >= 0 else (b * s_lo_num, den * s_lo_den)
        if s_hi_num < 0:  # a negative (point) scale: the two endpoints are equal anyway
            lo[index], hi[index] = (a * s_lo_num, den * s_lo_den), (b * s_lo_num, den * s_lo_den)
            lo[index], hi[index] = hi[index], lo[index]
    return lo, hi


def _float_key(x) -> float:
    """A raw mpf as an orderable float (sign-preserving beyond the float range)."""
    if not x[1]:
        return 0.0
    if x[2] + x[3] > 1000:
        return -np.inf if x[0] else np.inf
    if x[2] + x[3] < -1000:
        return -0.0 if x[0] else 0.0
    return to_float(x)


def _exact_value(man, exp) -> Fraction:
    return Fraction(int(man)) * Fraction(2) ** exp


def _point(x: Fraction, work):
    """An exact rational as a (lo, hi) enclosure at ``work`` bits."""
    return (
        from_rational(x.numerator, x.denominator, work, round_floor),
        from_rational(x.numerator, x.denominator, work, round_ceiling),
    )


def _add(a, b, work):
    return mpf_add(a[0], b[0], work, round_floor), mpf_add(a[1], b[1], work, round_ceiling)


def _sum_scaled(terms, work):
    """Sum of intervals times exact rationals: [(interval, Fraction)]."""
    total = (fzero, fzero)
    for interval, factor in terms:
        if factor:
            total = _add(total, _interval_times(*interval, _point(factor, work), work), work)
    return total


def _interval_times(lo, hi, other, work):
    """[lo, hi] times the interval ``other`` (every sign case)."""
    products = [
        mpf_mul(a, c, work, rnd)
        for a in (lo, hi)
        for c in other
        for rnd in (round_floor, round_ceiling)
    ]
    low = products[0]
    high = products[0]
    for x in products[1:]:
        low = x if mpf_cmp(x, low) < 0 else low
        high = x if mpf_cmp(x, high) > 0 else high
    return low, high


def _raw_ratio(raw):
    sign, man, exp, _ = raw
    man = -man if sign else man
    return (man << exp, 1) if exp >= 0 else (man, 1 << -exp)


def exact_vjp(spec: AttentionSpec, grad_out, grad_lse, out_dtype, *, engine=None, stats=None):
    """Correctly rounded (dq, dk, dv, dbias) in the flat layout (dbias in bias's shape).

    With ``spec.sinks`` (H,) the fourth element is the flat ``(dbias.ravel(), dsinks)``
    (:func:`refattn.spec.split_sink_grads` splits it; dsinks ``= sum_{b,i} dS_{i,sink}``,
    the sink's column of the folded spec, rounded once); dk and dv have the S keys.

    ``engine`` "fast" (the default, :data:`refattn.config.EXACT_VJP_ENGINE`) computes double-
    double enclosures first (:mod:`refattn.exact.fast.vjp`) and sends only the undecided
    elements to the referee; "referee" runs the referee (:class:`ExactVJP` and the Ziv loop)
    on everything. Both return the same bits. ``stats``, a dict, receives the element counts
    ``elements``, ``fast`` (decided by the first step) and ``referee``.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((2, 2)), np.array([[1.0], [3.0]]))
    >>> stats = {}
    >>> dq, dk, dv, dbias = exact_vjp(spec, np.ones((1, 1, 1, 1)), None, np.dtype("float64"),
    ...                               stats=stats)
    >>> dv.ravel().tolist(), stats
    ([0.5, 0.5], {'elements': 8, 'fast': 8, 'referee': 0})
    """
    engine = config.EXACT_VJP_ENGINE if engine is None else engine
    if engine not in ("fast", "referee"):
        raise ValueError(f"engine: expected 'fast' or 'referee', got {engine!r}")
    if engine == "fast" and _fast.fast_inputs_ok(spec, grad_out, grad_lse):
        return _fast_then_referee(spec, grad_out, grad_lse, out_dtype, stats)
    names = _NAMES + (("dsinks",) if spec.sinks is not None else ())
    results = _referee_vjp(spec, grad_out, grad_lse, out_dtype, names)
    if stats is not None:
        total = sum(r.size for r in results.values() if r is not None)
        stats.update(elements=total, fast=0, referee=total)
    # NaN/Inf inputs: refattn.attention.attention_vjp takes the non-finite pattern from the
    # float64 path (the exact engine encloses finite values only)
    return (
        results["dq"],
        results["dk"],
        results["dv"],
        _flat_dbias(spec, results.get("dbias"), results.get("dsinks")),
    )


_NAMES = ("dq", "dk", "dv", "dbias")


def _flat_dbias(spec, dbias, dsinks):
    """dbias, or with sinks the flat ``(dbias.ravel(), dsinks)`` (dsinks alone without bias)."""
    if spec.sinks is None:
        return dbias
    return dsinks if dbias is None else np.concatenate([dbias.ravel(), dsinks])


def _referee_vjp(spec, grad_out, grad_lse, out_dtype, names):
    """The referee's correctly rounded gradients named in ``names`` (dbias only with bias;
    dsinks (H,) only with sinks)."""
    if spec.sinks is not None:
        return _referee_with_sinks(spec, grad_out, grad_lse, out_dtype, names)
    engine = ExactVJP(spec, grad_out, grad_lse)
    results = {}
    for name in names:
        if name == "dbias":
            if spec.bias is not None:
                results[name] = correctly_round(
                    engine.dbias,
                    out_dtype,
                    what="dbias",
                    fallback=lambda ix: engine.exact_value("dbias", ix),
                    decide=lambda ix, m: engine.side("dbias", ix, m),
                )
            continue
        results[name] = correctly_round(
            lambda p, name=name: engine.at(p)[name],
            out_dtype,
            fallback=lambda ix, name=name: engine.exact_value(name, ix),
            decide=lambda ix, m, name=name: engine.side(name, ix, m),
            what=name,
        )
    return results


def _referee_with_sinks(spec, grad_out, grad_lse, out_dtype, names):
    """:func:`_referee_vjp` of a spec with sinks: the referee runs on the folded spec
    (:func:`refattn.spec.fold`, the sink as one more key, ALiBi exact), whose dk, dv are cut
    back to the S keys and whose flat dbias ``(dbias, dsinks)`` (one rounding per element) is
    split into "dbias" (with bias) and "dsinks"."""
    keys = spec.dims[4]
    inner = [n for n in names if n not in ("dbias", "dsinks")]
    if "dsinks" in names or ("dbias" in names and spec.bias is not None):
        inner.append("dbias")
    results = _referee_vjp(fold(spec, alibi_into_bias=False), grad_out, grad_lse, out_dtype, inner)
    for name in ("dk", "dv"):
        if name in results:
            results[name] = results[name][..., :keys, :]
    if "dbias" in results:
        dbias, dsinks = split_sink_grads(spec, results.pop("dbias"))
        if "dbias" in names and dbias is not None:
            results["dbias"] = dbias
        if "dsinks" in names:
            results["dsinks"] = dsinks
    return results


def _fast_then_referee(spec, grad_out, grad_lse, out_dtype, stats):
    """The fast first step, then the referee on what it left undecided (a (batch, kv head)
    unit for dk/dv, a query row for dq: :func:`_referee_units`)."""
    fmt = format_of(out_dtype)
    dq, dk, dv, dbias, dsinks, bad = _fast.gradient_enclosures(spec, grad_out, grad_lse)
    encl = {"dq": dq, "dk": dk, "dv": dv}
    if dbias is not None:
        encl["dbias"] = dbias
    if dsinks is not None:
        encl["dsinks"] = dsinks
    values, todo = {}, {}
    for name, enc in encl.items():
        values[name], decided = _fast.decide(enc, fmt)
        todo[name] = ~decided
    bad_heads = bad[:, spec.kv_head]
    todo["dq"] |= bad_heads[:, :, None, None]
    todo["dk"] |= bad[:, :, None, None]
    todo["dv"] |= bad[:, :, None, None]
    whole = [n for n in ("dbias", "dsinks") if n in todo]  # sums over every unit
    if bad.any():
        for name in whole:
            todo[name][...] = True
    if stats is not None:
        total = sum(v.size for v in values.values())
        undecided = sum(int(t.sum()) for t in todo.values())
        stats.update(elements=total, fast=total - undecided, referee=undecided)
    if any(todo[n].any() for n in whole):  # dbias, dsinks may sum over every unit: whole call
        names = [n for n in todo if todo[n].any()]
        ref = _referee_vjp(spec, grad_out, grad_lse, out_dtype, names)
        for name in names:
            values[name][todo[name]] = ref[name][todo[name]]
    else:
        _referee_units(spec, grad_out, grad_lse, out_dtype, values, todo)
    dtype = fmt.dtype
    cast = {name: value.astype(dtype) for name, value in values.items()}
    return (
        cast["dq"],
        cast["dk"],
        cast["dv"],
        _flat_dbias(spec, cast.get("dbias"), cast.get("dsinks")),
    )


def _referee_units(spec, grad_out, grad_lse, out_dtype, values, todo):
    """Undecided dq/dk/dv elements from the referee, on the smallest spec that determines them.

    An undecided dk or dv element of kv head g sends its (batch, kv head) unit: ``dk_j`` and
    ``dv_j`` sum over every row of every query head of the group, and each row's weights need
    the row's whole normaliser ``Z_i`` (every key), so no smaller spec determines them. An
    undecided dq element depends on its query row alone (``dq_i = s sum_j dT_ij k_j``): it
    sends that row (:func:`refattn.exact.fast.row_spec`, a one-row spec whose offset
    keeps the original indices for causal, window and ALiBi and whose key length becomes a
    mask), unless its unit goes to the referee anyway, which then settles its dq too.
    """
    units = set(
        zip(*np.nonzero(todo["dk"].any(axis=(2, 3)) | todo["dv"].any(axis=(2, 3))), strict=True)
    )
    units = {(int(b), int(g)) for b, g in units}
    for b, g in sorted(units):
        heads = np.flatnonzero(spec.kv_head == g)
        sub = unit_spec(spec, b, g, heads)
        names = [n for n in ("dq", "dk", "dv") if todo[n][b, heads if n == "dq" else [g]].any()]
        ref = _referee_vjp(
            sub,
            grad_out[b : b + 1, heads],
            None if grad_lse is None else grad_lse[b : b + 1, heads],
            out_dtype,
            names,
        )
        for name in names:
            where = (b, heads) if name == "dq" else (b, [g])
            mask = todo[name][where]
            values[name][where] = np.where(mask, ref[name][0], values[name][where])
    rows = zip(*np.nonzero(todo["dq"].any(axis=3)), strict=True)
    for b, h, i in sorted((int(b), int(h), int(i)) for b, h, i in rows):
        if (b, int(spec.kv_head[h])) in units:
            continue
        sub = _fast.row_spec(spec, b, h, i, i + 1)
        ref = _referee_vjp(
            sub,
            grad_out[b : b + 1, h : h + 1, i : i + 1],
            None if grad_lse is None else grad_lse[b : b + 1, h : h + 1, i : i + 1],
            out_dtype,
            ["dq"],
        )
        mask = todo["dq"][b, h, i]
        values["dq"][b, h, i] = np.where(mask, ref["dq"][0, 0, 0], values["dq"][b, h, i])


def unit_spec(spec: AttentionSpec, b: int, g: int, heads):
    """The spec of batch b restricted to the query heads of kv head g (one kv head)."""

    def rows(x):
        return None if x is None else x[b : b + 1][:, heads]

    return dataclasses.replace(
        spec,
        q=spec.q[b : b + 1][:, heads],
        k=spec.k[b : b + 1, g : g + 1],
        v=spec.v[b : b + 1, g : g + 1],
        batch_shape=(1,),
        single_head=False,
        bias=rows(spec.bias),
        bias_shape=None if spec.bias is None else (1, len(heads)) + spec.bias.shape[2:],
        mask=rows(spec.mask),
        dropout_mask=rows(spec.dropout_mask),
        alibi_slopes=None if spec.alibi_slopes is None else spec.alibi_slopes[heads],
        sinks=None if spec.sinks is None else spec.sinks[heads],
        kv_head=np.zeros(len(heads), dtype=spec.kv_head.dtype),
        kv_lengths=None if spec.kv_lengths is None else spec.kv_lengths[b : b + 1],
        alibi_offsets=None if spec.alibi_offsets is None else spec.alibi_offsets[b : b + 1],
        dbias_index=None,
    )
