"""Independent certification of exact attention results with arb ball arithmetic (python-flint).

refattn's exact path (:mod:`refattn.exact.attention`) uses exact integer dot products and
fixed-point enclosures built on mpmath. This module re-derives the same results by a different
route -- FLINT's arb balls evaluating the textbook formula directly -- and checks that every
ball rounds, at both ends, to the bits the exact path returned:

.. math::

    \\mathrm{lse}_i = \\log \\sum_{j \\in \\mathcal{A}_i} e^{t_{ij}}, \\qquad
    \\mathrm{out}_{ie} = \\sum_{j} \\frac{\\kappa_{ij}}{1-p} e^{t_{ij} - \\mathrm{lse}_i} v_{je}.

The working precision doubles until each ball's rounding is decided (or a cap is reached;
results on an exact rounding tie stay undecided here and are reported as such, not as
failures). Install with ``pip install refattn[certify]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..spec import canonicalize
from .rounding import format_of, round_exact

__all__ = ["CertificationReport", "certify_attention"]


def _flint():
    try:
        import flint
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "refattn.exact.certify needs python-flint: pip install 'refattn[certify]'"
        ) from exc
    return flint


@dataclass(frozen=True)
class CertificationReport:
    """Per-element outcome: ``certified`` (the ball rounds to the given bits), ``contradicted``
    (the ball rounds, at both ends, to other bits) and ``undecided`` (a tie or the cap)."""

    certified: np.ndarray
    contradicted: np.ndarray
    undecided: np.ndarray
    max_prec: int

    @property
    def ok(self) -> bool:
        """No element is contradicted."""
        return not self.contradicted.any()


def _ball_bounds(ball):
    lo, hi = ball.lower().man_exp(), ball.upper().man_exp()
    return tuple(_as_ratio(int(m), int(e)) for m, e in (lo, hi))


def _as_ratio(man: int, exp: int):
    return (man << exp, 1) if exp >= 0 else (man, 1 << -exp)


def _plane_balls(spec, b, h, arb):
    """arb balls of out (L, E) and lse (L,) of one plane; None entries for special rows."""
    g = int(spec.kv_head[h])
    q = np.asarray(spec.q[b, h], np.float64)
    k = np.asarray(spec.k[b, g], np.float64)
    v = np.asarray(spec.v[b, g], np.float64)
    allowed = spec.allowed(b, h)
    kept = allowed if spec.dropout_mask is None else allowed & spec.dropout_mask[b, h]
    length, keys = allowed.shape
    scale = arb(1) / arb(q.shape[1]).sqrt() if spec.scale is None else arb(spec.scale)
    keep = arb(1) / (arb(1) - arb(spec.dropout_p))
    alibi = spec.alibi_slopes
    distance = None if alibi is None else spec.alibi_distance(b)
    out, lse = [], []
    for i in range(length):
        cols = np.flatnonzero(allowed[i])
        if len(cols) == 0 or not np.isfinite(q[i]).all() or not np.isfinite(k[cols]).all():
            out.append(None)
            lse.append(None)
            continue
        scores = []
        for j in cols:
            t = scale * sum(
                (arb(float(a)) * arb(float(c)) for a, c in zip(q[i], k[j], strict=True)), arb(0)
            )
            if spec.softcap is not None:
                cap = arb(spec.softcap)
                t = cap * (t / cap).tanh()
            if spec.bias is not None:
                t += arb(float(spec.bias[b, h, i, j]))
            if alibi is not None:
                t -= arb(float(alibi[h])) * int(distance[i, j])
            scores.append(t)
        row_lse = sum((s.exp() for s in scores), arb(0)).log()
        weights = [(s - row_lse).exp() for s in scores]
        row_out = []
        for e in range(v.shape[1]):
            terms = [
                w * keep * arb(float(v[j, e]))
                for w, j in zip(weights, cols, strict=True)
                if kept[i, j]
            ]
            row_out.append(sum(terms, arb(0)))
        out.append(row_out)
        lse.append(row_lse)
    return out, lse


def certify_attention(q, k, v, out, lse=None, *, out_dtype=None, max_prec=4096, **options):
    """Certify ``out`` (and ``lse``) returned by ``refattn.attention(..., precision="exact")``.

    Parameters
    ----------
    q, k, v, **options
        The arguments of the :func:`refattn.attention` call (finite inputs).
    out, lse : arrays
        Its results, shapes (..., H, L, E) and (..., H, L).
    out_dtype : dtype, optional
        The dtype the results were rounded to (default: out's dtype).
    max_prec : int
        Largest arb working precision in bits.

    Returns
    -------
    CertificationReport
        For out (and lse, concatenated after out's elements in ``.certified`` etc.).

    Examples
    --------
    >>> import numpy as np, refattn
    >>> from refattn.exact.certify import certify_attention
    >>> q, k, v = np.eye(2), np.eye(2), np.array([[1.0], [3.0]])
    >>> out = refattn.attention(q, k, v, precision="exact")
    >>> certify_attention(q, k, v, out).ok
    True
    """
    flint = _flint()
    arb = flint.arb
    spec = canonicalize(q, k, v, **options)
    fmt = format_of(out_dtype if out_dtype is not None else np.asarray(out).dtype)
    batch, heads, _, length, _, _, vdim = spec.dims
    given_out = np.asarray(out, dtype=np.float64).reshape(batch, heads, length, vdim)
    targets = [given_out]
    if lse is not None:
        targets.append(np.asarray(lse, dtype=np.float64).reshape(batch, heads, length))
    pending = [np.ones(t.shape, dtype=bool) for t in targets]
    certified = [np.zeros(t.shape, dtype=bool) for t in targets]
    contradicted = [np.zeros(t.shape, dtype=bool) for t in targets]
    saved, prec = flint.ctx.prec, 128
    try:
        while any(p.any() for p in pending) and prec <= max_prec:
            flint.ctx.prec = prec
            for b in range(batch):
                for h in range(heads):
                    if not any(p[b, h].any() for p in pending):
                        continue
                    balls = _plane_balls(spec, b, h, arb)
                    for n, _ in enumerate(targets):
                        _decide(
                            balls[n],
                            targets[n][b, h],
                            pending[n][b, h],
                            certified[n][b, h],
                            contradicted[n][b, h],
                            fmt,
                        )
            prec *= 2
    finally:
        flint.ctx.prec = saved
    flat = [
        np.concatenate([a.ravel() for a in group]) for group in (certified, contradicted, pending)
    ]
    return CertificationReport(flat[0], flat[1], flat[2], prec // 2)


def _decide(balls, given, pending, certified, contradicted, fmt):
    for index in zip(*np.nonzero(pending), strict=True):
        row = balls[index[0]]
        if row is None:  # empty or NaN row: the convention, not a value to certify
            pending[index] = False
            certified[index] = True
            continue
        ball = row[index[1]] if len(index) > 1 else row
        lo, hi = (round_exact(x, fmt) for x in _ball_bounds(ball))
        if lo == hi and np.signbit(lo) == np.signbit(hi):
            pending[index] = False
            if lo == given[index] and np.signbit(lo) == np.signbit(given[index]):
                certified[index] = True
            else:
                contradicted[index] = True
