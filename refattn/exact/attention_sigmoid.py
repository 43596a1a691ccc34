"""Exact sigmoid attention (``normalizer="sigmoid"``): the referee engine, forward and vjp.

Every element is the exact real result rounded once (the Ziv loop of
:func:`refattn.exact.rounding.correctly_round`). This is the referee: the default engine
(:mod:`refattn.exact.fast.sigmoid`, ``config.SIGMOID_EXACT_ENGINE = "fast"``) decides most rows
with a compiled double-double first step and sends only its undecided rows here.

Forward, one (batch, head) plane at working precision P bits (the referee's score machinery,
:class:`refattn.exact.attention.ExactForward`, reused as is):

1. the scores ``t_ij`` are enclosed to an absolute ``2**-work`` from the exact integer dot
   products (:class:`~refattn.exact.attention._ScoreArithmetic`), and the row's largest score
   ``t_ir`` is found (the sigmoid is increasing, so it is also the largest weight);
2. row i is scaled by ``2**-c_i`` with ``sigma(t_ir) <= 2**c_i``, and each weight becomes
   fixed-point integers ``W_lo <= 2**(P - c_i) sigma(t_ij) <= W_hi`` (sigmoid enclosed by
   directed rounding, ``1 / (1 + e^{-t})``); a key with ``t_ij - t_ir < -(P + 1)`` is enclosed
   as [0, 1] without evaluating it, since ``sigma(t_j) / sigma(t_r) <= e^{t_j - t_r}`` for
   ``t_j <= t_r``;
3. ``out_ie = 2**(c_i - P) sum_j kappa_ij W_ij v_je / (1 - p)`` by exact integer sums, as a
   raw mpf pair (an exponent of -1e300 costs nothing: the rounding reads it off).

The loop's rational fallback knows ``sigma(0) = 1/2``: a row whose allowed scores are all
exactly 0 has a rational output, settled exactly. Any other output is irrational except for
coincidences such as ``sigma(t) + sigma(-t) = 1`` with equal values; such a result exactly on a
rounding midpoint is not settled (:class:`~refattn.exact.rounding.UndecidedRoundingError`).

VJP (:func:`exact_sigmoid_vjp`): rigorous intervals (mpmath ``iv``) at the working precision,
``dS_ij = sigma(t) sigma(-t) kappa_ij dO_i . v_j / (1 - p)``, ``dT = dS (1 - tanh^2(x/c))``,
``dq = s dT k``, ``dk = s dT^T q`` (summed over the query heads of a kv head),
``dv = P'^T dO``, ``dbias`` = dS summed into bias's shape; each sum is part of the one rounding.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from mpmath import iv
from mpmath.libmp import (
    fone,
    from_int,
    from_man_exp,
    mpf_add,
    mpf_cmp,
    mpf_div,
    mpf_neg,
    mpf_shift,
    round_ceiling,
    round_floor,
)

from .. import config
from ..spec import AttentionSpec
from . import _fixed as F
from . import intervals as I
from .attention import ExactForward, ExactPlane, ScoreArithmetic, scale_bounds
from .rounding import correctly_round

__all__ = ["ExactSigmoidForward", "exact_sigmoid_forward", "exact_sigmoid_vjp", "sigmoid_bounds"]

_NAN = float("nan")


def sigmoid_bounds(lo, hi, prec: int):
    """Raw mpf enclosure [sigma(lo), sigma(hi)] of the sigmoid over [lo, hi] (increasing):
    ``1 / (1 + e^{-t})`` with every step rounded outward."""
    _, e_hi = F.exp_bounds(mpf_neg(lo), mpf_neg(lo), prec)
    e_lo, _ = F.exp_bounds(mpf_neg(hi), mpf_neg(hi), prec)
    work = prec + config.ELEMENTARY_GUARD_BITS
    low = mpf_div(fone, mpf_add(fone, e_hi, work, round_ceiling), work, round_floor)
    high = mpf_div(fone, mpf_add(fone, e_lo, work, round_floor), work, round_ceiling)
    return low, high


def _top(x) -> int:
    """An int c with |x| <= 2**c for a nonzero raw mpf x."""
    return x[2] + x[3]


class ExactSigmoidForward(ExactForward):
    """Enclosures of out and the weights of a sigmoid attention call, cached per precision."""

    def _evaluate(self, prec: int) -> dict:
        batch, heads, _, length, _, _, vdim = self.spec.dims
        out_lo = np.empty((batch, heads, length, vdim), dtype=object)
        out_hi = np.empty_like(out_lo)
        for (b, h), plane in self.planes.items():
            self._sigmoid_outputs(
                plane, self._fixed_weights(plane, prec), prec, out_lo[b, h], out_hi[b, h]
            )
        return {"out": (out_lo, out_hi)}

    def _fixed_weights(self, plane: ExactPlane, prec: int):
        """Per row the shift c_i and fixed-point enclosures (W_lo, W_hi) (L, S) of
        ``2**(P - c_i) sigma(t_ij)`` (0 where excluded)."""
        work = prec + config.ELEMENTARY_GUARD_BITS
        length, keys = plane.allowed.shape
        w_lo = np.zeros((length, keys), dtype=object)
        w_hi = np.zeros((length, keys), dtype=object)
        shifts = [0] * length
        negligible = from_man_exp(-(prec + 1), 0)
        arith = self._arithmetic
        for i in range(length):
            row = self._row(plane, i, work)
            if row is None:
                continue
            parts, ref, diffs = row
            _, top = sigmoid_bounds(*arith.score(parts[ref], work), work)
            c = _top(top)
            shifts[i] = c
            for j, (_, d_hi) in diffs.items():
                if mpf_cmp(d_hi, negligible) < 0:
                    w_lo[i, j], w_hi[i, j] = 0, 1
                    continue
                lo, hi = sigmoid_bounds(*arith.score(parts[j], work), work)
                w_lo[i, j] = F.floor_scaled(mpf_shift(lo, -c), prec)
                w_hi[i, j] = F.ceil_scaled(mpf_shift(hi, -c), prec)
        return shifts, w_lo, w_hi

    def _sigmoid_outputs(self, plane, ex, prec, out_lo, out_hi):
        spec = self.spec
        shifts, w_lo, w_hi = ex
        kept = plane.kept
        mid2 = np.where(kept, w_lo + w_hi, 0) @ plane.v.ints
        rad2 = np.where(kept, w_hi - w_lo, 0) @ np.abs(plane.v.ints)
        keep = spec.keep_scale
        den = from_int(keep.denominator)
        work = prec + config.ELEMENTARY_GUARD_BITS
        bad_v = self._nonfinite_contributions(plane)
        for i in range(plane.allowed.shape[0]):
            if plane.nan_rows[i] or (plane.empty[i] and spec.empty_rows == "nan"):
                out_lo[i, :] = out_hi[i, :] = _NAN
                continue
            if plane.empty[i]:
                out_lo[i, :] = out_hi[i, :] = 0
                continue
            exp = shifts[i] - prec + plane.v.exp - 1  # mid2, rad2 are twice the midpoint form
            for e in range(out_lo.shape[1]):
                if bad_v is not None and bad_v[i, e] != 0:  # +-inf or NaN reaches it
                    out_lo[i, e] = out_hi[i, e] = bad_v[i, e]
                    continue
                n_lo = (mid2[i, e] - rad2[i, e]) * keep.numerator
                n_hi = (mid2[i, e] + rad2[i, e]) * keep.numerator
                out_lo[i, e] = mpf_div(from_man_exp(n_lo, exp), den, work, round_floor)
                out_hi[i, e] = mpf_div(from_man_exp(n_hi, exp), den, work, round_ceiling)

    def weights(self, prec: int):
        """Enclosures of the weights ``sigma(t_ij)`` (0 where excluded)."""
        spec = self.spec
        batch, heads, _, length, keys, _, _ = spec.dims
        w_lo = np.zeros((batch, heads, length, keys), dtype=object)
        w_hi = np.zeros_like(w_lo)
        work = prec + config.ELEMENTARY_GUARD_BITS
        arith = self._arithmetic
        for (b, h), plane in self.planes.items():
            for i in range(length):
                if plane.nan_rows[i] or (plane.empty[i] and spec.empty_rows == "nan"):
                    fill = np.where(plane.allowed[i] | plane.empty[i], _NAN, 0.0)
                    w_lo[b, h, i] = w_hi[b, h, i] = fill
                    continue
                for j in np.flatnonzero(plane.allowed[i]):
                    lo, hi = sigmoid_bounds(*arith.score(arith.parts(plane, i, j), work), work)
                    w_lo[b, h, i, j], w_hi[b, h, i, j] = lo, hi
        return w_lo, w_hi

    def side(self, name, index, boundary):  # no relative-precision side test for sigmoid
        return None

    def exact_value(self, name: str, index: tuple):
        """The exact value when every allowed score of the row is exactly 0 (sigma = 1/2)."""
        b, h, i = index[:3]
        plane = self.planes[b, h]
        if plane.nan_rows[i] or plane.empty[i]:
            return None
        cols = np.flatnonzero(plane.allowed[i])
        if any(self._exact_score(plane, i, int(j)) != 0 for j in cols):
            return None
        if name == "weights":
            return Fraction(1, 2) if plane.allowed[i, index[3]] else Fraction(0)
        column = plane.v.ints[:, index[3]]
        total = sum(int(column[j]) for j in cols if plane.kept[i, j])
        return Fraction(total, 2) * Fraction(2) ** plane.v.exp * self.spec.keep_scale


def exact_sigmoid_forward(
    spec: AttentionSpec, out_dtype, *, return_lse=False, return_weights=False
):
    """Correctly rounded (out, None, weights) of a sigmoid call in the flat (B, H, ...) layout."""
    if return_lse:
        raise ValueError("return_lse: normalizer='sigmoid' has no log-sum-exp")
    engine = ExactSigmoidForward(spec)
    out = correctly_round(
        lambda p: engine.at(p)["out"],
        out_dtype,
        fallback=lambda ix: engine.exact_value("out", ix),
        what="out",
    )
    weights = None
    if return_weights:
        weights = correctly_round(
            engine.weights,
            out_dtype,
            fallback=lambda ix: engine.exact_value("weights", ix),
            what="weights",
        )
    return out, None, weights


# --------------------------------------------------------------------------------------
# vjp
# --------------------------------------------------------------------------------------
class _SigmoidVJP:
    """Interval enclosures of dq, dk, dv and dbias at a working precision."""

    def __init__(self, spec: AttentionSpec, grad_out: np.ndarray):
        self.spec = spec
        batch, heads, *_ = spec.dims
        self.planes = {(b, h): ExactPlane(spec, b, h) for b in range(batch) for h in range(heads)}
        self.arith = ScoreArithmetic(spec)
        finite = lambda x: np.nan_to_num(np.asarray(x, np.float64), nan=0.0, posinf=0.0, neginf=0.0)  # noqa: E731
        self.q, self.k, self.v = finite(spec.q), finite(spec.k), finite(spec.v)
        self.do = finite(grad_out)
        self._cache: dict = {}

    def at(self, prec: int) -> dict:
        if prec not in self._cache:
            with I.workprec(prec):
                self._cache = {prec: self._evaluate(prec)}
        return self._cache[prec]

    def _plane_ds(self, plane, b, h, prec):
        """(P' (L, S), dT (L, S), dS (L, S)) of one plane as interval object arrays."""
        spec, arith = self.spec, self.arith
        work = prec + config.ELEMENTARY_GUARD_BITS
        g = spec.kv_head[h]
        length, keys = plane.allowed.shape
        keep = I.point(spec.keep_scale)
        do = I.to_intervals(self.do[b, h])
        v = I.to_intervals(self.v[b, g])
        weights = np.zeros((length, keys), dtype=object)
        dt = np.zeros((length, keys), dtype=object)
        ds = np.zeros((length, keys), dtype=object)
        cap = None if spec.softcap is None else I.point(float(spec.softcap))
        for i, j in zip(*np.nonzero(plane.allowed), strict=True):
            parts = arith.parts(plane, i, j)
            t = iv.make_mpf(arith.score(parts, work))
            sig, sig_neg = 1 / (1 + I.exp(-t)), 1 / (1 + I.exp(t))
            if plane.kept[i, j]:
                weights[i, j] = sig * keep
                ds[i, j] = sig * sig_neg * keep * sum(do[i] * v[j])
            dt[i, j] = ds[i, j]
            if cap is not None:
                y = iv.make_mpf(arith._times_scale(parts[0], work))  # noqa: SLF001
                th = I.tanh(y / cap)
                dt[i, j] = ds[i, j] * (1 - th * th)
        return weights, dt, ds

    def _evaluate(self, prec: int) -> dict:
        spec = self.spec
        batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
        s_lo, s_hi = scale_bounds(spec, prec)
        scale = iv.make_mpf((s_lo, s_hi))
        zero = iv.mpf(0)
        dq = np.full((batch, heads, length, dim), zero, dtype=object)
        dk = np.full((batch, kv_heads, keys, dim), zero, dtype=object)
        dv = np.full((batch, kv_heads, keys, vdim), zero, dtype=object)
        ds_all = np.zeros((batch, heads, length, keys), dtype=object)
        for (b, h), plane in self.planes.items():
            g = spec.kv_head[h]
            weights, dt, ds = self._plane_ds(plane, b, h, prec)
            ds_all[b, h] = ds
            q, k = I.to_intervals(self.q[b, h]), I.to_intervals(self.k[b, g])
            dq[b, h] = (dt @ k) * scale
            dk[b, g] = dk[b, g] + (dt.T @ q) * scale
            dv[b, g] = dv[b, g] + weights.T @ I.to_intervals(self.do[b, h])
        result = {"dq": dq, "dk": dk, "dv": dv}
        if spec.bias is not None:
            index, shape = spec.dbias_slots()
            slots = np.full(int(np.prod(shape)), zero, dtype=object)
            np.add.at(slots, index.ravel(), ds_all.ravel())
            result["dbias"] = slots.reshape(shape)
        return {name: I.endpoints(value) for name, value in result.items()}


def exact_sigmoid_vjp(spec: AttentionSpec, grad_out, grad_lse, out_dtype, **_):
    """Correctly rounded (dq, dk, dv, dbias) of a sigmoid call (flat layout; dbias in bias's
    shape, None without bias). Non-finite inputs: the caller takes their pattern from the
    float64 path (this engine encloses the finite values, non-finite ones read as 0)."""
    if grad_lse is not None:
        raise ValueError("grad_lse: normalizer='sigmoid' has no log-sum-exp")
    engine = _SigmoidVJP(spec, grad_out)
    names = ("dq", "dk", "dv") + (("dbias",) if spec.bias is not None else ())
    results = [
        correctly_round(lambda p, name=name: engine.at(p)[name], out_dtype, what=name)
        for name in names
    ]
    return (*results[:3], results[3] if spec.bias is not None else None)
