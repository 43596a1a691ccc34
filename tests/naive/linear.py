"""Loop twin of refattn.linear_attention (plain Python loops; nothing here imports refattn).

Written from the recurrence as the papers and docs/conventions.md state it, per sequence n and
value head j (reading key head ``j // (HV // H)``), state S (D rows, E columns):

    S' = diag(base**g_t) S;  delta rule: S = S' + beta_t k_t (v_t - S'^T k_t)^T;
    plain: S = S' + k_t v_t^T;  o_t = scale * S^T q_t  (after the update).

Numbers: exact Fractions when the whole computation is rational (no gates, or base-2 gates at
integer values; no normalisation; a rational scale), else mpf at the caller's digits.

* :func:`naive_linear` -- o and the final states as nested lists (mpf or Fraction);
* :func:`naive_linear_rounded` -- both rounded once to a dtype (stable across digits);
* :func:`float_linear` -- the same loops in Python floats (a float64 twin for differences);
* :func:`mp_linear` -- the twin on object arrays of mpf (for central differences).

>>> import numpy as np
>>> q = k = np.ones((1, 1, 2, 1)); v = np.array([[[[1.0], [3.0]]]])
>>> o, s = naive_linear(q, k, v, scale=1.0)
>>> [x[0] for x in o[0][0]], s[0][0]
([Fraction(1, 1), Fraction(4, 1)], [[Fraction(4, 1)]])
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np

from .rounding import round_stable

__all__ = ["naive_linear", "naive_linear_rounded", "float_linear", "mp_linear", "EPS"]

#: the epsilon inside the root of the q/k normalisation
EPS = 1e-6


def _rational_gates(g, base):
    return g is None or (base == "2" and all(float(x).is_integer() for x in np.ravel(g)))


def _rational_scale(scale, dim):
    if scale is not None:
        return Fraction(float(scale))
    root = math.isqrt(dim)
    return Fraction(1, root) if root * root == dim else None


class _Numbers:
    """Exact Fractions when possible, else mpf at the current digits."""

    def __init__(self, exact):
        self.exact = exact

    def of(self, x):
        if isinstance(x, Fraction | mpmath.mpf):
            return (
                x
                if self.exact or isinstance(x, mpmath.mpf)
                else mpmath.mpf(x.numerator) / x.denominator
            )
        return Fraction(float(x)) if self.exact else mpmath.mpf(float(x))

    def decay(self, g, base):
        if self.exact:
            return Fraction(2) ** int(g)
        g = self.of(g)
        return mpmath.power(2, g) if base == "2" else mpmath.exp(g)


def _normalise(x, numbers):
    eps = numbers.of(EPS)
    norm = mpmath.sqrt(sum(numbers.of(a) * numbers.of(a) for a in x) + eps)
    return [numbers.of(a) / norm for a in x]


def _scale(scale, dim, numbers):
    if scale is not None:
        return numbers.of(scale)
    if numbers.exact:
        return _rational_scale(None, dim)
    return 1 / mpmath.sqrt(dim)


def _sequences(batch, length, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    return [(0, int(a), int(b)) for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False)]


def _run(q, k, v, g, beta, h0, numbers, opts):
    """The loops over sequences, heads and steps, in the number system ``numbers``."""
    batch, heads, length, dim = np.shape(q)
    value_heads, edim = np.shape(v)[1], np.shape(v)[-1]
    group = value_heads // heads
    scale = _scale(opts.get("scale"), dim, numbers)
    l2 = opts.get("qk_l2norm", False)
    base = str(opts.get("gate_base", "e"))
    zero = numbers.of(0)
    out = [
        [[[zero] * edim for _ in range(length)] for _ in range(value_heads)] for _ in range(batch)
    ]
    finals = []
    for n, (b, start, stop) in enumerate(_sequences(batch, length, opts.get("cu_seqlens"))):
        per_head = []
        for j in range(value_heads):
            kh = j // group
            state = [
                [numbers.of(h0[n][j][d][e]) if h0 is not None else zero for e in range(edim)]
                for d in range(dim)
            ]
            for t in range(start, stop):
                qt, kt = list(q[b][kh][t]), list(k[b][kh][t])
                if l2:
                    qt, kt = _normalise(qt, numbers), _normalise(kt, numbers)
                qt = [numbers.of(x) for x in qt]
                kt = [numbers.of(x) for x in kt]
                vt = [numbers.of(x) for x in v[b][j][t]]
                if g is not None:
                    gate = g[b][j][t]
                    for d in range(dim):
                        a = numbers.decay(gate[d] if np.ndim(gate) else gate, base)
                        state[d] = [a * s for s in state[d]]
                if beta is not None:
                    bt = numbers.of(beta[b][j][t])
                    for e in range(edim):
                        pred = sum((state[d][e] * kt[d] for d in range(dim)), zero)
                        delta = vt[e] - pred
                        for d in range(dim):
                            state[d][e] = state[d][e] + bt * kt[d] * delta
                else:
                    for d in range(dim):
                        for e in range(edim):
                            state[d][e] = state[d][e] + kt[d] * vt[e]
                for e in range(edim):
                    read = sum((state[d][e] * qt[d] for d in range(dim)), zero)
                    out[b][j][t][e] = scale * read
            per_head.append(state)
        finals.append(per_head)
    return out, finals


def naive_linear(q, k, v, g=None, beta=None, *, initial_state=None, **opts):
    """(o (B, HV, T, E), final states (N, HV, D, E)) as nested lists of exact numbers
    (Fractions) when the case is rational, else mpf at the current ``mpmath.mp.dps``."""
    dim = np.shape(q)[-1]
    exact = (
        _rational_gates(g, str(opts.get("gate_base", "e")))
        and not opts.get("qk_l2norm", False)
        and _rational_scale(opts.get("scale"), dim) is not None
    )
    arrays = [None if x is None else np.asarray(x, dtype=np.float64) for x in (g, beta)]
    h0 = None if initial_state is None else np.asarray(initial_state, np.float64)
    return _run(
        np.asarray(q, np.float64),
        np.asarray(k, np.float64),
        np.asarray(v, np.float64),
        *arrays,
        h0,
        _Numbers(exact),
        opts,
    )


def naive_linear_rounded(q, k, v, g=None, beta=None, *, dtype="float64", **opts):
    """(o, final states) rounded once to ``dtype`` (float64 arrays of the dtype's values),
    identical at 60 and 120 digits (tests.naive.rounding.round_stable)."""

    def compute(part):
        def at(dps):
            with mpmath.workdps(dps):
                return naive_linear(q, k, v, g, beta, **opts)[part]

        return at

    batch, length = np.shape(q)[0], np.shape(q)[2]
    sequences = len(_sequences(batch, length, opts.get("cu_seqlens")))
    state_shape = (sequences, np.shape(v)[1], np.shape(q)[-1], np.shape(v)[-1])
    return (
        round_stable(compute(0), dtype).reshape(np.shape(v)),  # (T = 0 loses E in lists)
        round_stable(compute(1), dtype).reshape(state_shape),
    )


class _Floats:
    exact = False

    @staticmethod
    def of(x):
        return float(x)

    @staticmethod
    def decay(g, base):
        return 2.0 ** float(g) if base == "2" else math.exp(float(g))


def float_linear(q, k, v, g=None, beta=None, *, initial_state=None, **opts):
    """The same loops in Python floats: (o, final) as float64 arrays (no rounding analysis;
    a float64 twin)."""
    opts = dict(opts)
    if opts.get("qk_l2norm"):
        q = np.asarray(q, np.float64)
        k = np.asarray(k, np.float64)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + EPS)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + EPS)
        opts["qk_l2norm"] = False
    if opts.get("scale") is None:
        opts["scale"] = 1.0 / math.sqrt(np.shape(q)[-1])
    out, finals = _run(q, k, v, g, beta, initial_state, _Floats(), opts)
    return np.array(out, dtype=np.float64), np.array(finals, dtype=np.float64)


class _Mp:
    exact = False

    @staticmethod
    def of(x):
        return x if isinstance(x, mpmath.mpf) else mpmath.mpf(float(x))

    @staticmethod
    def decay(g, base):
        return mpmath.power(2, g) if base == "2" else mpmath.exp(g)


def mp_linear(q, k, v, g=None, beta=None, *, initial_state=None, **opts):
    """The twin on object arrays of mpf (central differences perturb any element): a flat
    list of o's elements followed by the final states'."""
    opts = dict(opts)
    if opts.get("scale") is None:
        opts["scale"] = 1 / mpmath.sqrt(np.shape(q)[-1])
    out, finals = _run(q, k, v, g, beta, initial_state, _Mp(), opts)
    flat = list(np.array(out, dtype=object).ravel()) + list(np.array(finals, dtype=object).ravel())
    return flat
