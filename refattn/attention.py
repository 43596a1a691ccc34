"""Scaled dot-product attention, forward and vector-Jacobian product, with pinned semantics.

The semantics are stated once in docs/conventions.md and summarised in
:func:`attention`'s docstring; every path (``precision="float64"``, ``precision="exact"``,
``backend="numba"``) implements the same ones.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _checks
from ._exact_sparse import (
    GATHER_READING,
    exact_gather_vjp,
    exact_gathers,
    exact_vjp_gathers,
    plain_exact_gather,
)
from ._kv_codes import k_extremes, kernel_forward, streamed_spec, with_codes
from ._numba_path import (
    MAX_EXPONENT,
    check_numba_range,
    numba_gather_spec,
    numba_gathers,
    plain_gather,
    without_listed,
)
from .broadcast import reduce_to
from .logspace import masked_softmax
from .spec import (
    AttentionSpec,
    canonicalize,
    check_cotangent,
    fold,
    needs_fold,
    options_in,
    split_qv_grads,
    split_sink_grads,
)

__all__ = [
    "attention",
    "attention_vjp",
    "AttentionGrads",
    "AttentionLatentGrads",
    "AttentionSinkGrads",
    "BACKENDS",
]

BACKENDS = ("numpy", "numba")


class AttentionGrads(NamedTuple):
    """Gradients of attention: dq (..., H, L, D), dk (..., K, S, D), dv (..., K, S, E),
    dbias (bias's own shape, or None without bias)."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dbias: np.ndarray | None


class AttentionLatentGrads(NamedTuple):
    """Gradients of attention with ``qv``: :class:`AttentionSinkGrads`'s five (dsinks None
    without sinks) and dqv (..., H, L, E), so that dqv always takes the sixth position."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dbias: np.ndarray | None
    dsinks: np.ndarray | None
    dqv: np.ndarray


class AttentionSinkGrads(NamedTuple):
    """Gradients of attention with sinks: :class:`AttentionGrads`'s four and dsinks (H,)
    (a separate type, so that four-way unpacking of calls without sinks keeps working)."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dbias: np.ndarray | None
    dsinks: np.ndarray


# --------------------------------------------------------------------------------------
# float64 path
# --------------------------------------------------------------------------------------
def _finite(x: np.ndarray) -> np.ndarray:
    """Non-finite entries replaced by 0 (their effect is accounted for separately)."""
    return np.where(np.isfinite(x), x, 0.0)


class _PlaneF64(NamedTuple):
    allowed: np.ndarray  # (L, S)
    kept: np.ndarray  # (L, S): allowed and not dropped
    raw_scores: np.ndarray  # scale * q.k (L, S), before softcap
    weights: np.ndarray  # (L, S) pre-dropout, 0 where excluded
    lse: np.ndarray  # (L,)
    derivative: np.ndarray | None = None  # (L, S) sigma'(t~) (normalizer="sigmoid" only)


_MAX_EXPONENT = MAX_EXPONENT  # scaled scores are kept below 2**1000 (sums of a few stay finite)


def _scaled_products(q: np.ndarray, k: np.ndarray, scale: float):
    """(p, E) with ``scale * q_i . k_j = p_ij * 2**E_ij`` and |p_ij| <= D: no overflow.

    q's rows and k's rows are scaled by powers of two (exact unless a component underflows,
    which moves the dot product by far less than the rounding of its largest terms).
    """
    with np.errstate(invalid="ignore"):
        q_exp = np.frexp(np.max(np.abs(q), axis=1, initial=0.0))[1]
        k_exp = np.frexp(np.max(np.abs(k), axis=1, initial=0.0))[1]
    mantissa, s_exp = np.frexp(scale)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite excluded keys
        p = mantissa * (np.ldexp(q, -q_exp[:, None]) @ np.ldexp(k, -k_exp[:, None]).T)
    return p, q_exp[:, None] + k_exp[None, :] + int(s_exp)


def _scaled_scores(p, exps, extra, allowed):
    """Scores ``p * 2**E + extra`` of rows beyond the float64 range as (t, c) with
    ``scores = t * 2**c`` row-wise, c >= 0 chosen from the row's max so that the entries near
    the max keep full precision (far smaller entries may flush to -inf: their weight is 0).
    """
    dim_bits = int(np.max(np.abs(p), initial=1.0)).bit_length() + 1
    top_exp = np.max(np.where(allowed, exps, np.iinfo(np.int64).min // 4), axis=1, keepdims=True)
    with np.errstate(over="ignore", invalid="ignore"):
        c0 = np.maximum(top_exp + dim_bits - _MAX_EXPONENT, 0)
        t0 = np.where(allowed, np.ldexp(p, exps - c0) + np.ldexp(extra, -c0), -np.inf)
        best = np.argmax(t0, axis=1)[:, None]
        direct = np.take_along_axis(np.ldexp(p, exps) + extra, best, axis=1)
        m0 = np.take_along_axis(t0, best, axis=1)
        c = np.where(
            np.isfinite(direct),
            np.maximum(np.frexp(np.where(np.isfinite(direct), direct, 1.0))[1] - _MAX_EXPONENT, 0),
            np.frexp(np.where(np.isfinite(m0), m0, 1.0))[1] + c0 - _MAX_EXPONENT,
        )
        c = np.maximum(c, 0)
        return np.ldexp(p, exps - c) + np.ldexp(extra, -c), c


def _plane_float64(spec: AttentionSpec, b: int, h: int) -> _PlaneF64:
    g = spec.kv_head[h]
    q = np.asarray(spec.q[b, h], dtype=np.float64)
    k = np.asarray(spec.k[b, g], dtype=np.float64)
    allowed = spec.allowed(b, h)
    with np.errstate(invalid="ignore", over="ignore"):  # poison at excluded keys is dropped
        raw = spec.scale_float * (q @ k.T)
        # finite inputs whose score overflowed (or whose products overflowed inside the dot
        # product): those rows are recomputed in a scaled form below
        finite_pair = np.isfinite(q).all(axis=1)[:, None] & np.isfinite(k).all(axis=1)[None, :]
        overflow = (~np.isfinite(raw) & allowed & finite_pair).any(axis=1) & (
            (finite_pair | ~allowed).all(axis=1)
        )
        products = None
        if overflow.any():
            products = _scaled_products(q[overflow], k, spec.scale_float)
            raw[overflow] = np.ldexp(*products)
        scores = raw if spec.softcap is None else spec.softcap * np.tanh(raw / spec.softcap)
        extra = np.zeros_like(scores)  # bias + ALiBi, for the scaled rows
        if spec.bias is not None:
            bias = np.where(allowed, spec.bias[b, h], 0.0)
            scores, extra = scores + bias, extra + bias
        alibi = spec.alibi(h, b)
        if alibi is not None:
            scores, extra = scores + alibi, extra + alibi
        exponent = None
        if spec.normalizer == "sigmoid":  # no normaliser: saturated scores are exact enough
            return _sigmoid_plane(spec, b, h, scores, allowed, raw, overflow)
        if products is not None and spec.softcap is None:
            exponent = np.zeros(scores.shape[:1] + (1,), dtype=int)
            scores[overflow], exponent[overflow] = _scaled_scores(
                *products, extra[overflow], allowed[overflow]
            )
        if spec.sinks is not None:  # the sink: one more always-allowed logit, no value
            column = np.full((scores.shape[0], 1), spec.sinks[h])
            if exponent is not None:  # rows kept as t * 2**c
                column = np.ldexp(column, -exponent)
            scores = np.hstack([scores, column])
            allowed = np.hstack([allowed, np.ones_like(column, dtype=bool)])
        lse, weights = masked_softmax(np.where(allowed, scores, 0.0), allowed, exponent)
    if spec.sinks is not None:
        scores, allowed, weights = scores[:, :-1], allowed[:, :-1], weights[:, :-1]
    # an infinite score (Inf in q or in an allowed key) makes its row NaN, as on the exact path
    bad = (np.isinf(scores) & allowed).any(axis=1) & ~overflow
    if bad.any():
        lse[bad] = np.nan
        weights[bad] = np.where(allowed[bad], np.nan, 0.0)
    kept = allowed if spec.dropout_mask is None else allowed & spec.dropout_mask[b, h]
    return _PlaneF64(allowed, kept, raw, weights, lse)


def _sigmoid_plane(spec, b, h, scores, allowed, raw, overflow) -> _PlaneF64:
    """The plane of ``normalizer="sigmoid"``: w = sigmoid(t~) on the allowed set (no lse)."""
    from ._sigmoid import sigmoid_plane

    weights, derivative = sigmoid_plane(scores, allowed)
    lse = np.full(scores.shape[0], np.nan)
    bad = (np.isinf(scores) & allowed).any(axis=1) & ~overflow
    if bad.any():  # Inf in q or an allowed key: the row is NaN, as with softmax
        weights[bad] = np.where(allowed[bad], np.nan, 0.0)
    kept = allowed if spec.dropout_mask is None else allowed & spec.dropout_mask[b, h]
    return _PlaneF64(allowed, kept, raw, weights, lse, derivative)


def _weighted_values(spec, plane: _PlaneF64, v: np.ndarray) -> np.ndarray:
    """sum_j keep_ij w_ij v_j / (1 - p) with non-finite values entering only where kept."""
    scaled = np.where(plane.kept, plane.weights, 0.0) / (1.0 - spec.dropout_p)
    with np.errstate(invalid="ignore"):  # NaN weights of NaN rows
        out = scaled @ _finite(v)
    bad = ~np.isfinite(v).all(axis=1)
    if bad.any():
        with np.errstate(invalid="ignore"):
            contrib = np.where(plane.kept[:, bad, None], scaled[:, bad, None] * v[None, bad], 0.0)
        out = out + contrib.sum(axis=1)
    return out


def _empty_rows(spec, plane, out, lse, weights):
    empty = ~plane.allowed.any(axis=1)
    if spec.sinks is not None:  # a row with a sink is never empty (out 0, lse = the sink)
        return out, lse, weights
    if spec.empty_rows == "nan" and empty.any():
        out[empty] = np.nan
        lse[empty] = np.nan
        weights[empty] = np.nan
    return out, lse, weights


def _forward_float64(spec: AttentionSpec, return_weights: bool):
    batch, heads, _, length, keys, _, vdim = spec.dims
    out = np.empty((batch, heads, length, vdim))
    lse = np.empty((batch, heads, length))
    weights = np.empty((batch, heads, length, keys)) if return_weights else None
    for b in range(batch):
        for h in range(heads):
            plane = _plane_float64(spec, b, h)
            v = np.asarray(spec.v[b, spec.kv_head[h]], dtype=np.float64)
            o = _weighted_values(spec, plane, v)
            w = plane.weights.copy()
            o, l_, w = _empty_rows(spec, plane, o, plane.lse.copy(), w)
            out[b, h], lse[b, h] = o, l_
            if return_weights:
                weights[b, h] = w
    return out, lse, weights


# --------------------------------------------------------------------------------------
# public forward
# --------------------------------------------------------------------------------------
def attention(
    q,
    k,
    v,
    *,
    scale=None,
    bias=None,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    softcap=None,
    alibi_slopes=None,
    gqa="interleave",
    dropout_mask=None,
    dropout_p=0.0,
    empty_rows="zero",
    return_lse=False,
    return_weights=False,
    precision="float64",
    out_dtype=None,
    backend="numpy",
    sinks=None,
    kv_lengths=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    key_indices=None,
    key_block_indices=None,
    key_block_size=None,
    index_reading="set",
    q_block_scale=None,
    k_block_scale=None,
    v_block_scale=None,
    normalizer="softmax",
    lse_base="e",
    qv=None,
):
    """Scaled dot-product attention with pinned semantics.

    .. math::

        t_{ij} = s\\, q_i \\cdot k_j, \\quad
        \\tilde t_{ij} = c \\tanh(t_{ij}/c) + b_{ij} - m_h |i + o - j|, \\quad
        \\mathrm{lse}_i = \\log \\sum_{j \\in \\mathcal{A}_i} e^{\\tilde t_{ij}}, \\\\
        w_{ij} = e^{\\tilde t_{ij} - \\mathrm{lse}_i}\\,[j \\in \\mathcal{A}_i], \\quad
        \\mathrm{out}_i = \\sum_j \\frac{\\kappa_{ij}}{1-p}\\, w_{ij}\\, v_j

    (Vaswani et al. 2017, eq. (1), with the options below; lecture notes 003, "scaled
    dot-product attention").

    Parameters
    ----------
    q : array (..., H, L, D) or (L, D)
    k : array (..., K, S, D) or (S, D)
    v : array (..., K, S, E) or (S, E)
        Any float dtype (float16, bfloat16, float32, float64); leading dims broadcast.
        H must be a multiple of K.
    scale : float, optional
        s; default 1/sqrt(D) (on the exact path the exact irrational number).
    bias : array broadcastable to (..., H, L, S), optional
        Added after softcap; -inf excludes a position. NaN/+inf at an allowed position is a
        ValueError.
    mask : bool array broadcastable to (..., H, L, S), optional
        True = attend.
    causal : bool
        Allow only j <= i + o.
    window : (left, right), optional
        Allow only i + o - left <= j <= i + o + right; None on a side means unbounded (so
        does any size >= 2**62, which is capped there).
    align : {"top_left", "bottom_right"}
        o = 0 (torch ``is_causal``) or o = S - L (FlashAttention >= 2.1, torch
        ``causal_lower_right``).
    softcap : float > 0, optional
        c: ``c * tanh(t / c)`` on the raw scores, before bias, ALiBi and the mask.
    alibi_slopes : array (H,), optional
        m_h: adds ``-m_h * |i + o - j|``.
    gqa : {"interleave", "tile"}
        Query head h reads kv head h // (H/K) (torch repeat_interleave, JAX, ONNX) or h % K.
    dropout_mask : bool array broadcastable to (..., H, L, S), optional
        kappa: the keep-mask (deterministic dropout); required when dropout_p > 0.
    dropout_p : float in [0, 1)
        Kept weights are scaled by 1/(1 - p). lse and returned weights are pre-dropout.
    empty_rows : {"zero", "nan"}
        Rows with no allowed key: out 0, lse -inf, weights 0 (torch ``_safe_softmax``, ONNX,
        FlashAttention), or NaN in all three. Does not apply with ``sinks``.
    sinks : array (H,), optional
        Attention sinks (gpt-oss; FlashAttention 3, flashinfer and MLX ``sinks``): a learnt
        logit sigma_h per query head added to every row's normaliser, with no value:
        ``lse_i = log(sum_{j in A_i} e^{t~_ij} + e^{sigma_h})``, ``w_ij = e^{t~_ij - lse_i}``.
        It is not scaled, softcapped, biased, masked or dropped. lse includes it (subtract
        ``log1p(-exp(sigma_h - lse))`` for the keys' share alone); a row with no allowed key
        gives out 0 and lse = sigma_h (never NaN). ALiBi adds nothing to it (a sink has no
        position); the exact path keeps ALiBi exact with sinks and key lengths alike.
    kv_lengths : int array (...,) (the batch shape), optional
        Per batch row key length S_b (a KV cache's ``cache_seqlens`` / ``seqused_k``): keys
        j >= S_b are excluded, and ``align="bottom_right"`` aligns each row to its own length
        (o_b = S_b - L, FlashAttention's KV-cache reading; ALiBi distances use o_b too). The
        other reading, alignment to the padded S, is a plain key-padding ``mask=`` instead.
    q_descale, k_descale, v_descale : float32 array (..., K), optional
        Inputs of dtype float8_e4m3fn or float8_e5m2 (ml_dtypes) are dequantised exactly as
        ``x * descale[b, g]`` (g the kv head; q's query head h uses its kv head's factor,
        FlashAttention 3); the truth is the exact result of the dequantised values. Only
        float8 inputs take a factor (and float4 ones: their global scale, see below).
    key_indices : int array broadcastable to (..., K, L, T), optional
        Token-level sparse attention (DeepSeek Sparse Attention's top-k indices, FlashMLA's
        sparse ``indices``, in refattn's bhld order: per batch row, kv head g and query
        row i): row i of every query head reading kv head g attends only to the set
        ``{idx[g, i, t] : 0 <= idx < S}``, intersected with every other restriction;
        entries < 0 (the -1 sentinel) or >= S are ignored and a position listed twice counts
        once (see ``index_reading``). A row left with no key follows ``empty_rows``.
    key_block_indices : int array broadcastable to (..., K, L, T), optional
        Block-sparse attention (NSA, MoBA): the listed block numbers c select the keys
        ``[c s, (c + 1) s)`` (clipped to S); the same as ``key_indices`` holding every token
        of those blocks. Needs ``key_block_size``; not together with ``key_indices``.
    key_block_size : int >= 1, optional
        s, the keys per block of ``key_block_indices``.
    index_reading : {"set", "multiset"}
        "set": duplicates count once (the set of listed positions). "multiset": what a plain
        gather kernel computes, a position listed n times enters the softmax n times
        (:mod:`refattn.sparse_multiset`; on the exact path without ALiBi or weights).
    normalizer : {"softmax", "sigmoid"}
        "sigmoid" (Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid
        Self-Attention", eq. (2); FlashSigmoid): ``w_ij = sigmoid(t~_ij)`` on the allowed set
        and ``out_i = sum_j kappa_ij w_ij v_j / (1 - p)``, with no normaliser (t~ after
        softcap, bias and ALiBi; excluded keys contribute nothing; an empty row gives 0, or
        NaN under ``empty_rows="nan"``). The paper's bias ``b = -log(S)`` is not implicit:
        pass it as ``bias=-math.log(S)`` (a scalar broadcasts). ``return_lse`` and ``sinks``
        are errors (there is no normaliser); ``return_weights`` returns the sigmoids.
        float64 bound: :func:`refattn.bounds.sigmoid_forward_bound`.
    qv : array (..., H, L, E), optional
        FlashAttention 3's ``qv`` (multi-head latent attention, :mod:`refattn.mla`): the raw
        score becomes ``t_ij = s (q_i . k_j + qv_i . v_j)`` and the default scale
        ``1/sqrt(D + E)``. q's dtype; a float8 qv is dequantised with ``q_descale``. Every
        path computes it as ``q' = [q, qv]``, ``k' = [k, v]`` (exact: the D + E products are
        summed as one dot product; the bounds are those of D + E features).
    return_lse, return_weights : bool
        Also return lse (..., H, L) and/or weights (..., H, L, S).
    precision : {"float64", "exact"}
        "float64": NumPy in float64, log-space, one (L, S) plane at a time (memory O(L*S)).
        A-priori bound (u = 2**-53, gamma_n = nu/(1-nu); derivation in :mod:`refattn.bounds`,
        evaluated per element by ``refattn.bounds.float64_forward_bound``): with score errors
        ``delta_ij <= gamma_{D+2} |s| |q_i|.|k_j| + gamma_4 (|t~_ij| + |b_ij| + |alibi_ij| + c)``,
        ``Delta_i = max_j delta_ij + gamma_{S+3} + u |lse_i|`` and
        ``rho_ij = e_ij + sum_k w_ik e_ik + gamma_{S+2}`` with
        ``e_ij = delta_ij + gamma_2 (1 + |t~_ij - m_i|)`` (m_i the row max):
        ``|out_ie - exact| <= sum_j kappa'_ij w_ij |v_je| (rho_ij + gamma_{S+2})`` and
        ``|lse_i - exact| <= Delta_i`` (to first order; the code covers the second).
        "exact": every element of out, lse and weights is the exact real result rounded once
        to ``out_dtype`` (Ziv loop).
    out_dtype : dtype, optional
        Exact path: float64 (default), float32, float16 or bfloat16. The float64 path
        returns float64 (the argument is still checked: anything else is a TypeError).
    backend : {"numpy", "numba"}
        "numba" runs the deterministic Numba CPU kernels (float64 path only; float32 inputs
        compute in float32).
    q_block_scale, k_block_scale, v_block_scale : array, optional
        Shapes (..., H, L, D/n), (..., K, S, D/n), (..., K, S, E/n).
        Block scales of float4_e2m1fn inputs (NVFP4: float8_e4m3fn, n = 16; MXFP4:
        float8_e8m0fnu, n = 32; blocks of n consecutive features of each position): the
        input is ``x[..., d] * block_scale[..., d // n] * descale``, taken exactly (see
        :mod:`refattn.blockscale`; docs/conventions.md, "fp4 inputs"). Required for float4
        inputs, an error for any other.
    lse_base : {"e", 2}
        Base of the returned lse (only with ``return_lse=True``; a ValueError otherwise):
        2 returns ``lse_i / ln 2 = log2 sum_j 2^(t~_ij / ln 2)``, the base-2 lse FlashInfer's
        kernels return and :func:`refattn.merge_states` reads with ``lse_base=2``. float64 /
        numba: the natural lse divided by ln 2 (bound ``(Delta_i + 2u |lse_i|) / ln 2``);
        exact: ``lse_i / ln 2`` rounded once.

    Returns
    -------
    out : (..., H, L, E), or a tuple (out, lse), (out, weights), (out, lse, weights).

    Notes
    -----
    Excluded positions are removed from every sum, so NaN or Inf in a masked key, value or
    bias never reaches the output. NaN (or Inf) in q, or in k at an allowed position, makes
    the rows it touches NaN; a NaN value at a kept position makes that output element NaN.

    Finite inputs whose scores exceed the float64 range (``|s q.k|`` above about 1.8e308, e.g.
    q, k ~ 1e200): the float64 path recomputes those rows with q, k and s scaled by powers of
    two and the scores kept as ``t * 2**c`` per row, so the weights stay a convex combination
    (within the stated bound, which is then the convex-combination bound of
    :mod:`refattn.bounds`) and lse is finite or +-inf as its exact value rounds.
    ``backend="numba"`` raises a ValueError for such inputs instead.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> q = np.array([[1.0, 0.0]]); k = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> v = np.array([[1.0], [3.0]])
    >>> refattn.attention(q, k, v, scale=0.0).tolist()
    [[2.0]]
    >>> refattn.attention(q, k, v, causal=True).tolist()
    [[1.0]]
    """
    if backend == "numba" and key_indices is not None:  # a decode step: the light path
        plain = plain_gather(locals())
        if plain is not None:
            return plain
    if precision == "exact" and key_indices is not None:  # an exact decode step: light too
        plain = plain_exact_gather(locals())
        if plain is not None:
            return plain
    _check_path(precision, backend, out_dtype)
    if normalizer == "sigmoid" and return_lse:
        raise ValueError(
            "return_lse: normalizer='sigmoid' has no log-sum-exp (the weights are sigmoid(t) "
            "with no normaliser); pass return_lse=False"
        )
    base = _lse_base(lse_base, return_lse)
    # set-read key indices on the Numba CPU forward: gathered by the kernel, no dense mask
    listed = (key_indices, key_block_indices, key_block_size)
    gather = numba_gathers(
        backend, precision, index_reading, listed, normalizer, return_weights, sinks, kv_lengths
    ) or exact_gathers(precision, backend, index_reading, listed, normalizer, bias, lse_base)
    options = without_listed(options_in(locals()), gather)  # quantised k, v: codes streamed
    spec, codes = streamed_spec(q, k, v, options, backend, precision, gather or base != 1)
    if gather:
        spec = numba_gather_spec(spec, listed)
    if spec.index_reading == "multiset":
        from . import sparse_multiset

        if precision == "exact":
            sparse_multiset.check_exact(spec, weights=return_weights)
        out, lse, weights = sparse_multiset.scatter_forward(
            spec,
            *_forward_paths(
                sparse_multiset.gather_spec(spec, alibi_into_bias=precision != "exact"),
                precision,
                backend,
                out_dtype,
                return_lse,
                return_weights,
                base,
            ),
        )
    else:
        out, lse, weights = _forward_paths(
            spec, precision, backend, out_dtype, return_lse, return_weights, base, codes
        )
    results = [spec.unflatten(out)]
    if return_lse:
        results.append(spec.unflatten(lse))
    if return_weights:
        results.append(spec.unflatten(weights))
    return results[0] if len(results) == 1 else tuple(results)


def _forward_paths(spec, precision, backend, out_dtype, return_lse, return_weights, base, kv=None):
    """(out, lse, weights or None) of the canonical spec, flat (B, H, L, ...), on the
    requested path; ``kv``: k, v streamed as codes (:func:`refattn._kv_codes.streamed_codes`)."""
    if precision == "exact":
        if backend != "numpy":
            raise ValueError("backend: the exact path has a single implementation; use 'numpy'")
        from . import config
        from .exact.attention import exact_forward
        from .exact.fast import fast_exact_forward

        # both engines take sinks natively (the referee folds them into one more key)
        engine = fast_exact_forward if config.EXACT_ENGINE == "fast" else exact_forward
        if spec.normalizer == "sigmoid":  # its own engines (no normaliser)
            from .exact.attention_sigmoid import exact_sigmoid_forward
            from .exact.fast.sigmoid import fast_sigmoid_forward

            fast = config.SIGMOID_EXACT_ENGINE == "fast"
            engine = fast_sigmoid_forward if fast else exact_sigmoid_forward
        if spec.index_reading == GATHER_READING:  # listed keys kept as lists: no dense mask
            from .exact.fast.gather import gather_forward as engine
        out, lse, weights = with_codes(engine, kv)(  # k, v as codes: refattn._kv_codes
            spec, _checks.out_dtype(out_dtype), return_lse=return_lse, return_weights=return_weights
        )
        if base != 1.0:
            lse = _exact_lse_base2(spec, engine, lse, _checks.out_dtype(out_dtype))
    elif backend == "numba":
        if return_weights:
            raise NotImplementedError(
                "return_weights: the numba kernels stream over keys and "
                "never form the weights; use backend='numpy'"
            )
        from . import kernels

        check_numba_range(spec, kernels.compute_dtype(spec.q.dtype), k_extremes(kv))
        work = fold(spec, alibi_into_bias=True) if needs_fold(spec) else spec
        out, lse = kernel_forward(work, kv)
        weights = None
    else:
        out, lse, weights = _forward_float64(spec, return_weights)
    if base != 1.0 and precision != "exact":
        lse = lse / base  # one rounding more: |error| <= (Delta_i + 2u |lse_i|) / ln 2
    return out, lse, weights


def _check_path(precision, backend, out_dtype) -> None:
    """The path arguments of :func:`attention` and :func:`attention_vjp`."""
    _checks.precision(precision)
    _checks.choice(backend, "backend", BACKENDS)
    _checks.out_dtype(out_dtype)  # validated on every path (the float64 path returns float64)


def _lse_base(value, return_lse) -> float:
    """The factor ln(base) of ``lse_base`` (1 for "e"); base 2 needs ``return_lse``."""
    from .logspace import base_factor

    base = base_factor(value)
    if base != 1.0 and not return_lse:
        raise ValueError(
            f"lse_base: {value!r} only applies with return_lse=True (it sets the base of the "
            "returned lse); got return_lse=False"
        )
    return base


def _exact_lse_base2(spec, engine, lse, out_dtype):
    """lse / ln 2 rounded once, from the correctly rounded float64 natural lse."""
    from .exact.lse_base2 import exact_lse_base2

    if np.dtype(out_dtype) != np.float64:
        lse = engine(spec, np.dtype(np.float64), return_lse=True, return_weights=False)[1]
    return exact_lse_base2(spec, np.asarray(lse, dtype=np.float64), out_dtype)


# --------------------------------------------------------------------------------------
# vector-Jacobian product
# --------------------------------------------------------------------------------------
def _vjp_float64(spec: AttentionSpec, grad_out: np.ndarray, grad_lse):
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    dq = np.zeros((batch, heads, length, dim))
    dk = np.zeros((batch, kv_heads, keys, dim))
    dv = np.zeros((batch, kv_heads, keys, vdim))
    dbias = np.zeros((batch, heads, length, keys)) if spec.bias is not None else None
    dsinks = None if spec.sinks is None else np.zeros((batch, heads))
    keep = 1.0 / (1.0 - spec.dropout_p)
    for b in range(batch):
        for h in range(heads):
            g = spec.kv_head[h]
            plane = _plane_float64(spec, b, h)
            q = _finite(np.asarray(spec.q[b, h], np.float64))
            k = _finite(np.asarray(spec.k[b, g], np.float64))
            v = np.asarray(spec.v[b, g], np.float64)
            do = grad_out[b, h]
            kept_w = np.where(plane.kept, plane.weights, 0.0) * keep
            dv[b, g] += kept_w.T @ do
            with np.errstate(invalid="ignore"):
                dp = np.where(plane.kept, do @ _finite(v).T, 0.0) * keep
                bad = ~np.isfinite(v).all(axis=1)
                if bad.any():  # a non-finite kept value poisons the rows that keep it
                    dp[:, bad] = np.where(plane.kept[:, bad], do @ v[bad].T, 0.0) * keep
            if plane.derivative is not None:  # sigmoid: dS = sigma'(t~) dP, no Delta term
                with np.errstate(invalid="ignore"):
                    ds = np.where(plane.allowed, plane.derivative * dp, 0.0)
                ds = np.where(np.isnan(plane.weights), np.nan, ds)
            else:
                ds = _softmax_ds(spec, plane, dp, grad_lse, dsinks, b, h)
            if dbias is not None:
                dbias[b, h] = ds
            if spec.softcap is not None:
                ds = ds * (1.0 - np.tanh(plane.raw_scores / spec.softcap) ** 2)
            ds = np.where(plane.allowed, ds, 0.0) * spec.scale_float
            dq[b, h] = ds @ k
            dk[b, g] += ds.T @ q
    return dq, dk, dv, dbias, None if dsinks is None else dsinks.sum(axis=0)


def _softmax_ds(spec, plane, dp, grad_lse, dsinks, b, h):
    """dS of the softmax: w (dP - Delta + g), and the sink's gradient into ``dsinks``."""
    with np.errstate(invalid="ignore"):
        delta = (plane.weights * dp).sum(axis=1, keepdims=True)
        if dsinks is not None:  # d lse / d sink = w_sink; d out / d sink = -w_sink out
            w_sink = np.exp(spec.sinks[h] - plane.lse)
            lse_part = 0.0 if grad_lse is None else grad_lse[b, h]
            dsinks[b, h] = np.sum(w_sink * (lse_part - delta[:, 0]))
        ds = plane.weights * (dp - delta)
        if grad_lse is not None:
            ds = ds + plane.weights * grad_lse[b, h][:, None]
        return np.where(plane.allowed, ds, 0.0)


def attention_vjp(
    q,
    k,
    v,
    grad_out,
    *,
    grad_lse=None,
    scale=None,
    bias=None,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    softcap=None,
    alibi_slopes=None,
    gqa="interleave",
    dropout_mask=None,
    dropout_p=0.0,
    empty_rows="zero",
    precision="float64",
    out_dtype=None,
    backend="numpy",
    sinks=None,
    kv_lengths=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    key_indices=None,
    key_block_indices=None,
    key_block_size=None,
    index_reading="set",
    q_block_scale=None,
    k_block_scale=None,
    v_block_scale=None,
    normalizer="softmax",
    lse_base="e",
    qv=None,
) -> AttentionGrads:
    """Vector-Jacobian product of :func:`attention` (its backward pass).

    With ``P = w`` the pre-dropout weights, ``P' = kappa * P / (1 - p)`` and cotangents
    ``dO`` (of out) and ``g`` (of lse):

    .. math::

        dV = P'^T dO, \\quad dP'_{ij} = dO_i \\cdot v_j, \\quad
        dP_{ij} = \\frac{\\kappa_{ij}}{1-p} dP'_{ij}, \\quad
        \\Delta_i = \\sum_j P_{ij} dP_{ij} = dO_i \\cdot \\mathrm{out}_i, \\\\
        dS_{ij} = P_{ij}(dP_{ij} - \\Delta_i + g_i), \\quad
        dT_{ij} = dS_{ij} (1 - \\tanh^2(t_{ij}/c)), \\quad
        dQ = s\\, dT\\, K, \\quad dK = s\\, dT^T Q, \\quad d\\mathrm{bias} = dS.

    Parameters
    ----------
    q, k, v, and every keyword
        As in :func:`attention`.
    grad_out : array, the shape of attention's output
        dO.
    grad_lse : array (..., H, L), optional
        g, the cotangent of lse (an error with ``normalizer="sigmoid"``).
    normalizer : {"softmax", "sigmoid"}
        As in :func:`attention`. With "sigmoid" the weights are ``P = sigma(t~)`` and
        ``dS_ij = sigma'(t~_ij) dP_ij`` with ``sigma' = sigma(t~) sigma(-t~)`` (no Delta_i, no
        g); dV, dT, dQ, dK and dbias follow as above.
    precision : {"float64", "exact"}
        "exact": every gradient element is the exact value rounded once to ``out_dtype``.
    lse_base : {"e", 2}
        The base of the lse whose cotangent ``grad_lse`` is: with 2 the gradient is that of
        ``lse / ln 2`` (g enters as ``g / ln 2``). precision="exact" with a nonzero base-2
        ``grad_lse`` is a NotImplementedError (``g / ln 2`` is irrational and the exact vjp
        takes g at its exact binary value).

    Returns
    -------
    AttentionGrads, AttentionSinkGrads or AttentionLatentGrads
        (dq, dk, dv, dbias), and with ``sinks`` (dq, dk, dv, dbias, dsinks); with ``qv``
        (dq, dk, dv, dbias, dsinks, dqv) (dsinks None without sinks), where
        ``dqv = s dT V`` and dv gains the score term: ``dv = P'^T dO + s dT^T qv`` (on the
        exact path that sum is rounded once). dk and dv sum
        over the G query heads sharing a kv head; dbias has bias's own shape (summed over its
        broadcast dimensions) and is None without bias. dsinks (H,) is
        ``sum_{b,i} w_sink (g_i - Delta_i)`` (on the exact path rounded once, like every
        dbias element, with or without a bias). Empty
        rows contribute zero gradients. ALiBi slopes, masks, key lengths and the dropout mask
        get no gradient; float8 and float4 inputs get the gradient with respect to their
        dequantised values (``x * block_scale * descale``); scales get none.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> q = np.zeros((1, 2)); k = np.zeros((2, 2)); v = np.array([[1.0], [3.0]])
    >>> refattn.attention_vjp(q, k, v, np.ones((1, 1))).dv.tolist()
    [[0.5], [0.5]]
    """
    _check_path(precision, backend, out_dtype)
    # set-read key indices on the Numba CPU vjp and the exact vjp: gathered, no dense mask
    listed = (key_indices, key_block_indices, key_block_size)
    gather = numba_gathers(
        backend, precision, index_reading, listed, normalizer, False, sinks, kv_lengths
    ) or exact_vjp_gathers(precision, backend, index_reading, listed, bias, alibi_slopes)
    spec = canonicalize(q, k, v, **without_listed(options_in(locals()), gather))
    if gather:
        spec = numba_gather_spec(spec, listed)
    _, heads, _, length, keys, _, vdim = spec.dims
    do = check_cotangent(spec, grad_out, "grad_out", (heads, length, vdim))
    dl = None if grad_lse is None else check_cotangent(spec, grad_lse, "grad_lse", (heads, length))
    base = _lse_base(lse_base, True)
    if base != 1.0 and dl is not None:
        if precision == "exact" and np.any(dl != 0):
            raise NotImplementedError(
                "lse_base=2 with a nonzero grad_lse on precision='exact': the exact vjp holds "
                "grad_lse as an exact binary value and g / ln 2 is irrational; use "
                "precision='float64' or pass the cotangent of the natural lse"
            )
        dl = dl / base  # d lse2 = d lse / ln 2: the natural cotangent is g / ln 2
    if spec.index_reading == "multiset":
        from . import sparse_multiset

        if precision == "exact":
            sparse_multiset.check_exact(spec, vjp=True)
        gathered = sparse_multiset.gather_spec(spec)
        rows = (gathered.q.shape[0], heads, 1)
        dq, dk, dv, dbias, dsinks = _vjp_paths(
            gathered,
            do.transpose(0, 2, 1, 3).reshape(rows + (vdim,)),
            None if dl is None else dl.transpose(0, 2, 1).reshape(rows),
            precision,
            backend,
            out_dtype,
        )
        dq, dk, dv, dbias = sparse_multiset.scatter_vjp(spec, dq, dk, dv, dbias)
        dbias = None if spec.bias is None else dbias
    else:
        dq, dk, dv, dbias, dsinks = _vjp_paths(spec, do, dl, precision, backend, out_dtype)
    if precision != "exact" and dbias is not None and dbias.shape != spec.bias_shape:
        dbias = reduce_to(dbias.reshape(spec.batch_shape + dbias.shape[1:]), spec.bias_shape)
    dqv = None
    if spec.qv_features:
        dq, dk, dv, dqv = split_qv_grads(spec, dq, dk, dv, summed=precision == "exact")
    grads = (spec.unflatten(dq), spec.unflatten(dk), spec.unflatten(dv), dbias)
    if dqv is not None:
        return AttentionLatentGrads(*grads, dsinks, spec.unflatten(dqv))
    return AttentionGrads(*grads) if dsinks is None else AttentionSinkGrads(*grads, dsinks)


def _vjp_paths(spec, do, dl, precision, backend, out_dtype):
    """(dq, dk, dv, dbias, dsinks) of the canonical spec, flat, on the requested path (the
    exact path's dbias already reduced to bias's shape, the float paths' (B, H, L, S))."""
    keys = spec.dims[4]
    if dl is not None and spec.normalizer == "sigmoid":
        raise ValueError("grad_lse: normalizer='sigmoid' has no log-sum-exp to take a cotangent")
    dsinks = None
    if precision == "exact" and spec.index_reading == GATHER_READING:  # the listed keys only
        return exact_gather_vjp(
            spec, do, dl, lambda s: _vjp_paths(s, do, dl, precision, backend, out_dtype)
        )
    if precision == "exact":
        from .exact.attention_vjp import exact_vjp

        if spec.normalizer == "sigmoid":
            from .exact.attention_sigmoid import exact_sigmoid_vjp as exact_vjp
        # the exact path reduces dbias to bias's shape itself (the sum is part of the exact
        # value that is rounded once) and takes sinks natively: with a sink its dbias is
        # (dbias, dsinks) flat, dsinks the sum of the sink's dS over batch and rows
        dq, dk, dv, dbias = exact_vjp(spec, do, dl, _checks.out_dtype(out_dtype))
        if spec.qv_features:  # dv's two terms summed exactly, rounded once
            from .exact.latent import exact_latent_dv

            dv = exact_latent_dv(spec, do, dl, _checks.out_dtype(out_dtype))
        if spec.sinks is not None:
            dbias, dsinks = split_sink_grads(spec, dbias)
        if _has_nonfinite(spec, do, dl):
            dq, dk, dv, dbias, dsinks = _nonfinite_pattern(spec, do, dl, dq, dk, dv, dbias, dsinks)
    elif backend == "numba":
        from . import kernels

        check_numba_range(spec, kernels.compute_dtype(spec.q.dtype))
        work = fold(spec, alibi_into_bias=True) if needs_fold(spec) else spec
        dq, dk, dv, dbias = kernels.attention_vjp(work, do, dl)
        if spec.sinks is not None:
            dsinks = dbias[..., -1].sum(axis=(0, 2))
            dk, dv, dbias = dk[..., :keys, :], dv[..., :keys, :], dbias[..., :-1]
        if spec.bias is None:
            dbias = None
    else:
        dq, dk, dv, dbias, dsinks = _vjp_float64(spec, do, dl)
    return dq, dk, dv, dbias, dsinks


def _has_nonfinite(spec, grad_out, grad_lse) -> bool:
    arrays = [spec.q, spec.k, spec.v, grad_out] + ([grad_lse] if grad_lse is not None else [])
    if spec.bias is not None:
        arrays.append(np.where(np.isneginf(spec.bias), 0.0, spec.bias))
    return any(not np.isfinite(np.asarray(a, dtype=np.float64)).all() for a in arrays)


def _nonfinite_pattern(spec, grad_out, grad_lse, dq, dk, dv, dbias, dsinks=None):
    """The exact gradients with the NaN/Inf entries of the float64 path's (IEEE propagation
    of non-finite inputs; the exact engine encloses the finite values)."""
    ref = _vjp_float64(spec, grad_out, grad_lse)
    if spec.qv_features:  # the exact dv already holds the score term: so does the pattern's
        ref = (ref[0], ref[1], ref[2] + ref[1][..., -spec.qv_features :], *ref[3:])
    fixed = []
    for exact, approx in zip((dq, dk, dv), ref[:3], strict=True):
        exact = exact.copy()
        bad = ~np.isfinite(approx)
        exact[bad] = approx[bad].astype(exact.dtype)
        fixed.append(exact)
    if dbias is not None:
        approx = reduce_to(ref[3].reshape(spec.batch_shape + ref[3].shape[1:]), spec.bias_shape)
        dbias = dbias.copy()
        bad = ~np.isfinite(approx)
        dbias[bad] = approx[bad].astype(dbias.dtype)
    if dsinks is not None:
        dsinks = dsinks.copy()
        bad = ~np.isfinite(ref[4])
        dsinks[bad] = ref[4][bad].astype(dsinks.dtype)
    return (*fixed, dbias, dsinks)
