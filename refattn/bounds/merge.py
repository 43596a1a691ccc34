"""A-priori bound of :func:`refattn.merge_states`' float64 path (per element).

The float64 path forms ``d_p = c fl(l_p - m)`` (relative error <= 3u with the rounded ln 2),
``e_p = exp(d_p)`` (error ``|delta d_p| + u``), ``Z = 1 + sum e_p`` (``gamma_P``), the weights
``e_p / Z``, the products with out_p and their sum (``gamma_P``). With ``|d| e^d <= 1/e`` the
denominator's relative error is below ``gamma_{2P+2}``, so to first order

* ``|out_e - exact| <= sum_p w_p |out_pe| (gamma_{4P+8} + 3u |d_p|)``;
* ``|lse - exact| <= 2 gamma_{4P+8} + 2u |lse|`` (log1p's argument error, the division by
  ln 2 in base 2 (a factor 1/ln 2 < 2), the addition of the shift).

Each bound is on the distance to the real merge; callers comparing with the exact path's
float64 rounding add that rounding's half ulp (``u |exact|``).
"""

from __future__ import annotations

import math

import numpy as np

from .unit import UNIT_ROUNDOFF, gamma

__all__ = ["merge_bound", "merge_vjp_bound"]


def merge_bound(outs, lses, *, lse_base="e"):
    """(out bound (..., L, E), lse bound (..., L)) of the float64 merge of ``outs`` (P, ..., L,
    E) and ``lses`` (P, ..., L); 0 where the result is not finite (those are exact).

    >>> o, l = merge_bound(np.zeros((2, 1, 1)), np.zeros((2, 1)))
    >>> bool(o.max() == 0), bool(l.max() < 1e-14)
    (True, True)
    """
    outs = np.asarray(outs, dtype=np.float64)
    lses = np.asarray(lses, dtype=np.float64)
    states = lses.shape[0]
    c = 1.0 if lse_base == "e" else math.log(2.0)
    finite = np.isfinite(lses)
    top = np.max(np.where(finite, lses, -np.inf), axis=0)
    shift = np.where(np.isfinite(top), top, 0.0)
    d = np.where(finite, (np.where(finite, lses, shift) - shift) * c, -np.inf)
    w = np.exp(d) / np.exp(d).sum(axis=0).clip(min=1.0)
    term = gamma(4 * states + 8) + 3 * UNIT_ROUNDOFF * np.abs(np.where(finite, d, 0.0))
    size = np.abs(np.where(finite[..., None] & np.isfinite(outs), outs, 0.0))
    out_bound = np.einsum("p...,p...e->...e", w * term, size) * (1 + gamma(4 * states + 8))
    lse = shift + np.log1p(np.maximum(np.exp(d).sum(axis=0) - 1.0, 0.0)) / c
    lse_bound = 2 * gamma(4 * states + 8) + 2 * UNIT_ROUNDOFF * np.abs(lse)
    return out_bound, np.where(np.isfinite(top), lse_bound, 0.0)


def merge_vjp_bound(outs, lses, grad_out, grad_lse=None, *, lse_base="e"):
    """(douts bound, dlses bound) of :func:`refattn.merge_states_vjp`: a first-order
    estimate (no proof claimed), ``gamma_{4P+8}`` plus the shift's ``3u |d_p|`` relative to
    the magnitudes of the terms ``w_p |dO|`` and ``w_p (c |dO| . (|out_p| + |out|) + |g|)``."""
    outs = np.asarray(outs, dtype=np.float64)
    lses = np.asarray(lses, dtype=np.float64)
    grad_out = np.abs(np.asarray(grad_out, dtype=np.float64))
    g = 0.0 if grad_lse is None else np.abs(np.asarray(grad_lse, dtype=np.float64))
    states = lses.shape[0]
    c = 1.0 if lse_base == "e" else math.log(2.0)
    finite = np.isfinite(lses)
    top = np.max(np.where(finite, lses, -np.inf), axis=0)
    shift = np.where(np.isfinite(top), top, 0.0)
    d = np.where(finite, (np.where(finite, lses, shift) - shift) * c, -np.inf)
    w = np.exp(d) / np.exp(d).sum(axis=0).clip(min=1.0)
    rel = 2 * gamma(4 * states + 8) + 3 * UNIT_ROUNDOFF * np.abs(np.where(finite, d, 0.0))
    size = np.abs(np.where(finite[..., None], outs, 0.0))
    merged = np.einsum("p...,p...e->...e", w, size)
    douts = (w * rel)[..., None] * grad_out
    spread = np.einsum("p...e,...e->p...", size + merged, grad_out)
    return douts, w * rel * (c * spread + g) * 2
