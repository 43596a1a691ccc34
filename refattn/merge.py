"""Merging attention states: the partial results of attention over disjoint key sets.

Chunked prefill, cascade (shared-prefix) attention, split-KV decode and context-parallel ring
attention compute attention over P disjoint key chunks and combine the partial states
``(out_p, lse_p)``. For softmax attention over the union of the chunks' keys

.. math::

    \\mathrm{lse} = \\log \\sum_p e^{\\mathrm{lse}_p}, \\qquad
    \\mathrm{out} = \\sum_p e^{\\mathrm{lse}_p - \\mathrm{lse}}\\, \\mathrm{out}_p

(Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", eq. (4) merged over
chunks; Dao et al. 2022, FlashAttention Algorithm 1, lines 10-12; FlashInfer documents the
same merge with base-2 lse in its ``merge_state`` / ``merge_states``).

This module holds the float64 path and the dispatch; the exact path is
:mod:`refattn.exact.merge`, the a-priori bound :func:`refattn.bounds.merge_bound`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _checks
from .exact.merge import nonfinite_pattern
from .logspace import LSE_BASES, base_factor

__all__ = ["as_attention", "merge_states", "merge_states_vjp", "MergeGrads", "LSE_BASES"]

_BACKENDS = ("numpy", "numba", "cuda")


class MergeGrads(NamedTuple):
    """Cotangents of :func:`merge_states`' inputs: d outs (P, ..., L, E), d lses (P, ..., L)."""

    douts: np.ndarray
    dlses: np.ndarray


def _states(outs, lses):
    """Validated (outs, lses) as float64 arrays, with their input dtype."""
    outs = _checks.float_array(outs, "outs")
    lses = _checks.float_array(lses, "lses")
    if outs.ndim < 3:
        raise ValueError(f"outs: expected shape (P, ..., L, E) with ndim >= 3, got {outs.shape}")
    if lses.shape != outs.shape[:-1]:
        raise ValueError(
            f"lses: expected shape (P, ..., L) = {outs.shape[:-1]} (outs {outs.shape} without "
            f"its last axis E), got {lses.shape}"
        )
    dtype = np.result_type(outs.dtype, lses.dtype)
    return _checks.as_float64(outs), _checks.as_float64(lses), dtype


def _weights(lses: np.ndarray, c: float):
    """(w (P, ..., L), lse (..., L) in the base of lses, empty (..., L)): the
    max-shifted, log1p form ``lse = m + log1p(sum_{p != r} e^{d_p})``, ``d_p = c (l_p - m)``."""
    finite = np.isfinite(lses)
    safe = np.where(finite, lses, -np.inf)
    ref = np.argmax(safe, axis=0)  # one maximal state r per row
    top = np.take_along_axis(safe, ref[None], axis=0)[0]
    empty = np.isneginf(top)
    shift = np.where(empty, 0.0, top)
    d = np.where(finite, (np.where(finite, lses, shift) - shift) * c, -np.inf)
    e = np.exp(d)
    np.put_along_axis(e, ref[None], 0.0, axis=0)
    tail = e.sum(axis=0)
    np.put_along_axis(e, ref[None], 1.0, axis=0)
    e = np.where(finite, e, 0.0)
    w = e / (1.0 + tail)
    lse = np.where(empty, -np.inf, shift + np.log1p(tail) / c)  # in the base of lses
    return np.where(empty, 0.0, w), lse, empty


def _merge_float64(outs, lses, c):
    w, lse, _ = _weights(lses, c)
    live = w > 0
    with np.errstate(invalid="ignore", over="ignore"):  # the nonfinite pattern replaces them
        out = np.einsum("p...,p...e->...e", w, np.where(live[..., None], outs, 0.0))
    out_value, out_set, lse_value, lse_set = nonfinite_pattern(outs, lses)
    out = np.where(out_set, out_value, out)
    lse = np.where(lse_set, lse_value, lse)
    return out, lse


def merge_states(outs, lses, *, lse_base="e", precision="float64", out_dtype=None, backend="numpy"):
    """Merge P attention states over disjoint key sets into the state over their union.

    .. math::

        \\mathrm{lse} = \\log_b \\sum_p b^{\\mathrm{lse}_p}, \\qquad
        \\mathrm{out}_{ie} = \\sum_p b^{\\mathrm{lse}_{pi} - \\mathrm{lse}_i}\\,
        \\mathrm{out}_{pie}

    with b = e (default) or b = 2 (``lse_base=2``: lse read and written in base 2, FlashInfer's
    ``merge_state`` convention: its kernels keep ``log2 sum 2^(s log2 e)``). Computed in the
    max-shifted, log1p form ``lse = m + log1p(sum_{p != r} e^{d_p}) / c``, ``d_p = c (lse_p -
    m)``, ``c = 1`` or ``ln 2`` (Blanchard, Higham & Higham 2021, eqs. (2.3)-(2.4)).

    Parameters
    ----------
    outs : array (P, ..., L, E)
        The P partial outputs (each normalised over its own keys, as attention returns it).
    lses : array (P, ..., L)
        Their log-sum-exps (base ``lse_base``).
    lse_base : {"e", 2}
        The base of ``lses`` and of the returned lse.
    precision : {"float64", "exact"}
        "float64": log-space NumPy; ``|error| <= refattn.bounds.merge_bound(...)`` (a gamma
        count of the shift, the exponentials, the sums and the division, plus ``3u |d_p|`` per
        state for the shift's rounding). "exact": every element of out and lse is the exact
        real merge of the inputs, taken at their exact binary values, rounded once to
        ``out_dtype``.
    out_dtype : dtype, optional
        Output dtype of the exact path (float64 default; float32, float16, bfloat16); the
        float64 path returns float64 (the argument is still checked).
    backend : {"numpy", "numba", "cuda"}
        The float64 path's implementation: "numpy" (log-space NumPy, bound above), "numba"
        or "cuda" (refattn's Numba CPU or numba.cuda attention kernel on
        :func:`as_attention`'s inputs, base e and finite-or-empty states only; within that
        kernel's forward bound, :func:`refattn.kernels.numba_cpu.forward_error_bound`).

    Returns
    -------
    out : (..., L, E)
    lse : (..., L)

    Notes
    -----
    Conventions pinned:

    * an **empty state** (lse = -inf: no allowed key in its chunk) is the identity of the merge
      and contributes nothing, whatever its out holds (zeros, NaN or garbage); all states
      empty give out 0 and lse -inf (never NaN), as attention's empty rows;
    * a NaN lse makes the row's out and lse NaN; a +inf lse gives lse +inf and out NaN;
      otherwise every non-empty state's weight is positive, so a NaN out element of a
      non-empty state gives NaN there, +inf and -inf together NaN, one of them that infinity
      (on both paths: the float64 path applies the exact rule, never ``0 * inf``);
    * P = 1 returns the state itself (``lse_base`` unchanged).

    Two truths a merge can be judged against: (1) the exact merge of the *given* states (what
    ``precision="exact"`` returns: the states as rounded by whoever computed them), and (2)
    attention over the union of the keys (the whole chunked pipeline: chunk attention, its
    rounding to the chunk's dtype, then the merge). (1) judges the merge alone; (2) also
    charges the chunks' own roundings, which the merge can only propagate (weights sum to 1,
    so an error of ``delta`` in every out_p stays ``delta``, and an lse_p error of ``eps``
    moves out by at most ``eps * max|out_p - out|``).

    Examples
    --------
    >>> import numpy as np, refattn
    >>> outs = np.array([[[[1.0]]], [[[3.0]]]])          # P=2, H=1, L=1, E=1
    >>> lses = np.array([[[0.0]], [[0.0]]])
    >>> out, lse = refattn.merge_states(outs, lses)
    >>> out.tolist(), round(float(lse[0, 0]), 12)
    ([[[2.0]]], 0.69314718056)
    >>> refattn.merge_states(outs, lses, lse_base=2)[1].tolist()
    [[1.0]]
    >>> out, lse = refattn.merge_states(outs, np.full((2, 1, 1), -np.inf))
    >>> out.tolist(), lse.tolist()
    ([[[0.0]]], [[-inf]])
    """
    c = base_factor(lse_base)
    _checks.precision(precision)
    _checks.choice(backend, "backend", _BACKENDS)
    dtype = _checks.out_dtype(out_dtype)
    outs, lses, _ = _states(outs, lses)
    if backend != "numpy" and precision != "exact":
        if c != 1.0 or not _attention_shaped(outs, lses):
            raise NotImplementedError(
                f"backend={backend!r}: base-e states whose lses are finite or -inf (with finite "
                "outs where live) only; use backend='numpy' for base 2 or non-finite inputs"
            )
        if backend == "cuda":
            return _via_cuda(outs, lses)
        return _via_attention(outs, lses, precision="float64", backend="numba")
    if precision == "exact":
        if c == 1.0 and _attention_shaped(outs, lses):
            return _via_attention(outs, lses, precision="exact", out_dtype=dtype)
        from .exact.merge import exact_merge

        return exact_merge(outs, lses, c != 1.0, dtype)
    return _merge_float64(outs, lses, c)


#: rows per call of the exact attention engine in :func:`_exact_as_attention` (bounds memory)
_ROWS_PER_CALL = 8192


def _attention_shaped(outs, lses) -> bool:
    """True when every lse is finite or -inf and every live state's out is finite: the merge
    is then attention over the states (see :func:`_exact_as_attention`)."""
    if np.isnan(lses).any() or np.isposinf(lses).any():
        return False
    live = np.isfinite(lses)[..., None]
    return bool(np.isfinite(np.where(live, outs, 0.0)).all())


def as_attention(outs, lses):
    """The attention problem whose solution is the base-e merge of ``outs``, ``lses``.

    A natural-log merge of one row is attention of one query over the P states as keys, their
    lses as scores: with ``q = 0``, ``k = 0`` (D = 1), ``bias_p = lse_p`` and ``v_p = out_p``
    the score is ``0 * 0 + lse_p = lse_p`` exactly, so the softmax weights are
    ``exp(lse_p - lse)``, the output ``sum_p exp(lse_p - lse) out_p`` and the log-sum-exp
    ``log sum_p exp(lse_p)``. An empty state (lse -inf) is an excluded key (its out never
    read); all states empty make an empty row (out 0, lse -inf). The vjp carries over too:
    ``d out_p = dv_p`` and ``d lse_p = dbias_p``.

    Parameters
    ----------
    outs : array (P, ..., L, E)
    lses : array (P, ..., L)

    Returns
    -------
    dict
        ``q`` (N, 1, 1, 1), ``k`` (N, 1, P, 1), ``v`` (N, 1, P, E), ``bias`` (N, 1, 1, P) with
        one batch row per merged row (N = the product of ``...`` and L), float64.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> outs = np.array([[[[1.0]]], [[[3.0]]]]); lses = np.zeros((2, 1, 1))
    >>> problem = refattn.merge.as_attention(outs, lses)
    >>> out, lse = refattn.attention(**problem, return_lse=True)
    >>> out.ravel().tolist(), lse.ravel().round(12).tolist()
    ([2.0], [0.69314718056])
    """
    outs, lses, _ = _states(outs, lses)
    states, vdim = outs.shape[0], outs.shape[-1]
    values = np.moveaxis(outs, 0, -2).reshape(-1, 1, states, vdim)
    scores = np.moveaxis(lses, 0, -1).reshape(-1, 1, 1, states)
    rows = scores.shape[0]
    return {
        "q": np.zeros((rows, 1, 1, 1)),
        "k": np.zeros((rows, 1, states, 1)),
        "v": values,
        "bias": scores,
    }


def _via_cuda(outs, lses):
    """The base-e merge on the numba.cuda attention kernels (compute dtype float64)."""
    from .kernels import cuda
    from .spec import canonicalize

    rest, vdim = lses.shape[1:], outs.shape[-1]
    out, lse = cuda.attention(canonicalize(**as_attention(outs, lses)), return_lse=True)
    return out[:, 0, 0].reshape(rest + (vdim,)), lse[:, 0, 0].reshape(rest)


def _via_attention(outs, lses, **options):
    """The base-e merge through :func:`refattn.attention` on :func:`as_attention`'s problem,
    ``_ROWS_PER_CALL`` rows at a time (the engines round each element once on the exact path:
    bit-identical to :func:`refattn.exact.merge.exact_merge`; base 2 and non-finite inputs go
    there, since 2^x is not an exact score and their NaN/+inf rules differ)."""
    from .attention import attention

    rest, vdim = lses.shape[1:], outs.shape[-1]
    problem = as_attention(outs, lses)
    rows = problem["bias"].shape[0]
    parts_out, parts_lse = [], []
    for lo in range(0, rows, _ROWS_PER_CALL):
        chunk = {name: x[lo : lo + _ROWS_PER_CALL] for name, x in problem.items()}
        out, lse = attention(**chunk, return_lse=True, **options)
        parts_out.append(out[:, 0, 0])
        parts_lse.append(lse[:, 0, 0])
    out = np.concatenate(parts_out) if parts_out else np.zeros((0, vdim))
    lse = np.concatenate(parts_lse) if parts_lse else np.zeros(0)
    return out.reshape(rest + (vdim,)), lse.reshape(rest)


def merge_states_vjp(
    outs,
    lses,
    grad_out,
    *,
    grad_lse=None,
    lse_base="e",
    precision="float64",
    out_dtype=None,
    backend="numpy",
):
    """Vector-Jacobian product of :func:`merge_states`.

    With weights ``w_p = b^{lse_p - lse}``, ``c = ln b``, cotangents ``dO`` (of out) and ``g``
    (of lse, in the same base):

    .. math::

        d\\mathrm{out}_p = w_p\\, dO, \\qquad
        d\\mathrm{lse}_p = w_p \\left(c\\, dO \\cdot (\\mathrm{out}_p - \\mathrm{out})
        + g\\right).

    Empty states (lse -inf) get zero cotangents; an all-empty row gives zeros.

    Parameters
    ----------
    outs, lses, lse_base
        As in :func:`merge_states`.
    grad_out : array (..., L, E)
        dO.
    grad_lse : array (..., L), optional
        g.
    precision : {"float64", "exact"}
        "exact": every element of douts and dlses the exact value rounded once to
        ``out_dtype``, through the exact attention vjp of :func:`as_attention`'s problem
        (``douts = dv``, ``dlses = dbias``); base e with finite-or-empty states only.
    out_dtype : dtype, optional
        Output dtype of the exact path.
    backend : {"numpy", "numba", "cuda"}
        The float64 path's implementation: the closed form above in NumPy, or the vjp of
        refattn's Numba CPU / numba.cuda attention kernels on :func:`as_attention`'s problem
        (base e, finite-or-empty states; within the kernels' backward bound).

    Returns
    -------
    MergeGrads
        (douts (P, ..., L, E), dlses (P, ..., L)).

    Examples
    --------
    >>> import numpy as np, refattn
    >>> outs = np.array([[[[1.0]]], [[[3.0]]]]); lses = np.zeros((2, 1, 1))
    >>> g = refattn.merge_states_vjp(outs, lses, np.ones((1, 1, 1)))
    >>> g.douts.ravel().tolist(), g.dlses.ravel().tolist()
    ([0.5, 0.5], [-0.5, 0.5])
    """
    c = base_factor(lse_base)
    _checks.precision(precision)
    dtype = _checks.out_dtype(out_dtype)
    outs, lses, _ = _states(outs, lses)
    do = _cotangent(grad_out, outs.shape[1:], "grad_out")
    _checks.choice(backend, "backend", _BACKENDS)
    if precision == "exact":
        return _vjp_via_attention(outs, lses, do, grad_lse, c, dtype=dtype)
    if backend != "numpy":
        return _vjp_via_attention(outs, lses, do, grad_lse, c, backend=backend)
    g = (
        np.zeros(lses.shape[1:])
        if grad_lse is None
        else _cotangent(grad_lse, lses.shape[1:], "grad_lse")
    )
    w, _, _ = _weights(lses, c)
    out, _ = _merge_float64(outs, lses, c)
    live = w > 0
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as the exact rule gives
        spread = np.where(live[..., None], outs - out, 0.0)
        dlses = w * (c * np.einsum("p...e,...e->p...", spread, do) + g)
    douts = w[..., None] * do
    return MergeGrads(douts, np.where(live, dlses, 0.0))


def _cotangent(x, shape, name):
    arr = _checks.as_float64(_checks.float_array(x, name))
    if arr.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {arr.shape}")
    return arr


def _vjp_via_attention(outs, lses, do, grad_lse, c, *, backend="numpy", dtype=None):
    """merge_states_vjp as the attention vjp of :func:`as_attention`'s problem
    (``douts = dv``, ``dlses = dbias``): exact when ``dtype`` is given, else on refattn's
    Numba CPU or numba.cuda kernels (``backend``)."""
    if c != 1.0 or not _attention_shaped(outs, lses):
        where = "precision='exact'" if dtype is not None else f"backend={backend!r}"
        raise NotImplementedError(
            f"merge_states_vjp({where}): base-e states whose lses are finite or -inf (with "
            "finite outs where live) only; the base-2 cotangent g / ln 2 is irrational exactly "
            "and the kernels take natural lses: use backend='numpy'"
        )
    states, vdim = outs.shape[0], outs.shape[-1]
    rest = lses.shape[1:]
    problem = as_attention(outs, lses)
    rows = problem["bias"].shape[0]
    grad_out = do.reshape(rows, 1, 1, vdim)
    g = None if grad_lse is None else _cotangent(grad_lse, rest, "grad_lse").reshape(rows, 1, 1)
    if backend == "cuda" and dtype is None:
        from .kernels import cuda
        from .spec import canonicalize

        _, _, dv, dbias = cuda.attention_vjp(canonicalize(**problem), grad_out, g)
    else:
        from .attention import attention_vjp

        path = {"precision": "exact", "out_dtype": dtype} if dtype is not None else {}
        _, _, dv, dbias = attention_vjp(
            **problem, grad_out=grad_out, grad_lse=g, backend="numpy" if path else backend, **path
        )
    douts = np.moveaxis(dv[:, 0].reshape(rest + (states, vdim)), -2, 0)
    dlses = np.moveaxis(np.asarray(dbias)[:, 0, 0].reshape(rest + (states,)), -1, 0)
    return MergeGrads(douts, dlses)
