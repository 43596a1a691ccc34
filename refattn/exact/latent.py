"""The exact dv of attention with ``qv`` (FlashAttention 3's latent term): one rounding.

With ``qv`` the canonical spec holds ``q' = [q, qv]`` and ``k' = [k, v]``
(:func:`refattn.spec.canonicalize`), so v enters twice: as the values and as the last E
features of the keys. Its gradient is the sum of both terms,

.. math::

    dv_j = \\sum_i P'_{ij}\\, dO_i + s \\sum_i dT_{ij}\\, qv_i
         = dv^{\\text{values}}_j + dk'_{j, D:},

and the exact path returns that sum rounded once (not the two correctly rounded parts
added). The fast engine's double-double enclosures of both terms
(:func:`refattn.exact.fast.vjp.gradient_enclosures`) are added with a rigorous error term and
decided; the undecided (batch, kv head) units go to the referee (:class:`ExactVJP`), whose
enclosures of both terms at each Ziv precision are added exactly.

A sum that is exactly a rounding boundary is settled by the referee's exact fallback when
every row it reads has rational weights (equal scores); the referee's "hair from a boundary"
decision (``ExactVJP.side``) is not extended to the sum, so such a sum that is not rational
is settled at the Ziv loop's precision cap (:func:`refattn.exact.rounding.correctly_round`).
"""

from __future__ import annotations

import numpy as np

from .. import config
from ..spec import AttentionSpec, fold
from . import fast as _fast
from .attention_vjp import ExactVJP, unit_spec
from .rounding import correctly_round, format_of

__all__ = ["exact_latent_dv"]

_U = 2.0**-53


def _two_sum(a, b):
    s = a + b
    t = s - a
    return s, (a - (s - t)) + (b - t)


def _dd_sum(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The enclosure (3, ...) = (hi, lo, error bound) of the sum of two such enclosures.

    ``hi_x + hi_y = s + e`` exactly (two-sum); ``t = fl(fl(lo_x + lo_y) + e)`` errs by at
    most ``2u (|lo_x| + |lo_y| + |e|)``; ``s + t`` is renormalised exactly (fast two-sum);
    the error bounds add, rounded up by the factor ``1 + 2**-50``, with ``2**-1060`` for
    underflow."""
    s, e = _two_sum(x[0], y[0])
    with np.errstate(invalid="ignore", over="ignore"):
        t = (x[1] + y[1]) + e
        hi, lo = _two_sum(s, t)
        err = (x[2] + y[2] + 2 * _U * (np.abs(x[1]) + np.abs(y[1]) + np.abs(e))) * (
            1 + 2.0**-50
        ) + 2.0**-1060
    bad = ~(np.isfinite(hi) & np.isfinite(lo) & np.isfinite(err))
    err = np.where(bad, np.inf, err)
    return np.stack([np.where(bad, 0.0, hi), np.where(bad, 0.0, lo), err])


def _ratio_sum(a, b):
    """Exact sum of two enclosure ends: (num, den) ratios, or floats (NaN, inf)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return (a[0] * b[1] + b[0] * a[1], a[1] * b[1])
    fa = a if not isinstance(a, tuple) else a[0] / a[1]
    fb = b if not isinstance(b, tuple) else b[0] / b[1]
    return float(fa) + float(fb)


def _referee_dv(spec: AttentionSpec, grad_out, grad_lse, out_dtype) -> np.ndarray:
    """The referee's correctly rounded combined dv (B, K, S, E)."""
    keys, latent = spec.dims[4], spec.qv_features
    work = fold(spec, alibi_into_bias=False) if spec.sinks is not None else spec
    engine = ExactVJP(work, grad_out, grad_lse)
    dim = work.dims[5] - latent

    def evaluate(prec):
        got = engine.at(prec)
        (v_lo, v_hi), (k_lo, k_hi) = got["dv"], got["dk"]
        lo = np.empty(v_lo.shape, dtype=object)
        hi = np.empty(v_lo.shape, dtype=object)
        for index in np.ndindex(v_lo.shape):
            other = index[:-1] + (dim + index[-1],)
            lo[index] = _ratio_sum(v_lo[index], k_lo[other])
            hi[index] = _ratio_sum(v_hi[index], k_hi[other])
        return lo, hi

    def fallback(index):
        values = engine.exact_value("dv", index)
        scores = engine.exact_value("dk", index[:-1] + (dim + index[-1],))
        return None if values is None or scores is None else values + scores

    result = correctly_round(evaluate, out_dtype, fallback=fallback, what="dv")
    return result[..., :keys, :]


def exact_latent_dv(spec: AttentionSpec, grad_out, grad_lse, out_dtype) -> np.ndarray:
    """dv (B, K, S, E) of a qv spec: ``P'^T dO + s dT^T qv`` rounded once to ``out_dtype``.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 1)), np.zeros((2, 1)), np.array([[1.0], [3.0]]),
    ...                     qv=np.ones((1, 1)))
    >>> exact_latent_dv(spec, np.ones((1, 1, 1, 1)), None, np.dtype("float64")).dtype
    dtype('float64')
    """
    fmt = format_of(out_dtype)
    latent = spec.qv_features
    if config.EXACT_VJP_ENGINE != "fast" or not _fast.fast_inputs_ok(spec, grad_out, grad_lse):
        return _referee_dv(spec, grad_out, grad_lse, out_dtype)
    _, dk, dv, _, _, bad = _fast.gradient_enclosures(spec, grad_out, grad_lse)
    values, decided = _fast.decide(_dd_sum(dv, dk[..., -latent:]), fmt)
    todo = ~decided | bad[:, :, None, None]
    pending = np.nonzero(todo.any(axis=(2, 3)))
    units = sorted({(int(b), int(g)) for b, g in zip(*pending, strict=True)})
    for b, g in units:
        heads = np.flatnonzero(spec.kv_head == g)
        ref = _referee_dv(
            unit_spec(spec, b, g, heads),
            grad_out[b : b + 1, heads],
            None if grad_lse is None else grad_lse[b : b + 1, heads],
            out_dtype,
        )
        values[b, g] = np.where(todo[b, g], ref[0, 0], values[b, g])
    return values.astype(fmt.dtype)
