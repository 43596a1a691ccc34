"""The textbook attention the tolerance policy compares against (the baseline of rule (T2)).

* :func:`textbook_attention` / :func:`textbook_attention_vjp` -- two-pass max-shifted softmax
  attention and its backward in a case dtype, with float32 accumulation for the half types and
  every stored stage rounded to the dtype (PyTorch's math path). In float64 they are also the
  accurate evaluation behind the natural scales and the convention diagnosis
  (:mod:`oracle.diagnose.diagnosis`).
* :func:`storage_accumulation_attention` -- the same with sums accumulated in the storage
  dtype: the model of a half-precision implementation without a float32 accumulator.
* :func:`variant_baseline` -- the baseline of the variant fixtures: refattn's float64 path on
  the case's inputs, rounded once to the case dtype (:func:`variant_float64_path`).

The judging policy itself (errors, floors, thresholds) is :mod:`oracle.judging.tolerance`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from oracle.catalogue import seeding
from oracle.catalogue.case import Case
from oracle.catalogue.names import ATTENTION_OPTIONS
from oracle.catalogue.variants import BOOL_INPUTS, call_refattn, call_refattn_vjp
from oracle.judging.tolerance import accumulation_dtype, finite_abs
from oracle.reading.allowed import allowed_positions
from oracle.reading.heads import alibi_bias, dequantised, resolve_scale, with_heads
from oracle.reading.latent import fold_latent, split_latent
from oracle.reading.sparse import indices_as_mask
from refattn.blockscale import dequantize_blocks, is_fp4
from refattn.broadcast import expand_kv, fold_kv, reduce_to
from refattn.exact.rounding import format_of

__all__ = [
    "Textbook",
    "PreparedKV",
    "textbook_attention",
    "textbook_attention_vjp",
    "storage_accumulation_attention",
    "variant_float64_path",
    "variant_baseline",
    "dequantised_inputs",
    "variant_vjp_baseline",
]


class Textbook(NamedTuple):
    """Result of :func:`textbook_attention`: out (..., H, L, E), lse (..., H, L), weights
    (..., H, L, S) pre-dropout, ``allowed`` the allowed set used."""

    out: np.ndarray
    lse: np.ndarray
    weights: np.ndarray
    allowed: np.ndarray
    #: the sink's weight ``exp(sigma_h - lse_i)`` (..., H, L) with ``sinks``, else None
    sink_weights: np.ndarray | None = None


def _alibi(alibi_slopes, L, S, align, kv_lengths):
    if kv_lengths is None:
        return alibi_bias(alibi_slopes, L, S, align)
    lengths = np.asarray(kv_lengths)
    planes = [alibi_bias(alibi_slopes, L, S, align, int(n)) for n in lengths.reshape(-1)]
    return np.stack(planes).reshape(lengths.shape + planes[0].shape)


def dequantised_inputs(q, k, v, options):
    """float8 q, k, v (and float4 ones with their block scales) dequantised exactly (float64)
    and the options without the descales and block scales; other inputs are returned
    unchanged."""
    if not any(np.asarray(x).dtype.name.startswith(("float8", "float4")) for x in (q, k, v)):
        return q, k, v, options
    blocks = ("q_block_scale", "k_block_scale", "v_block_scale")
    if any(options.get(n) is not None for n in blocks):  # fp4: block scales first, exactly
        q, k, v = (
            dequantize_blocks(x, options.get(f"{n}_block_scale"), n) if is_fp4(x) else x
            for n, x in zip("qkv", (q, k, v), strict=True)
        )
        options = {n: x for n, x in options.items() if n not in blocks}
    gqa = options.get("gqa") or "interleave"
    heads = with_heads(q, "q").shape[-3]
    q = dequantised(q, options.get("q_descale"), heads, gqa)
    k = dequantised(k, options.get("k_descale"))
    v = dequantised(v, options.get("v_descale"))
    rest = {n: x for n, x in options.items() if n not in ("q_descale", "k_descale", "v_descale")}
    return q, k, v, rest


class PreparedKV:
    """What every evaluation of one case's k and v recomputes identically, computed once.

    A diagnosis evaluates dozens of readings of one case (:mod:`oracle.diagnose.diagnosis`),
    each a float64 :func:`textbook_attention` of the same k and v: on long rows (S up to 128k
    keys) converting, expanding and cleaning k and v took most of a reading's time. This
    keeps, per (H, gqa, dtype), k and v expanded to the query heads in the accumulation dtype
    with their non-finite entries zeroed and where those were, and ``|v|`` expanded, each
    computed exactly as an unprepared evaluation computes it (the same operations in the
    same order: the results are the same to the bit). It applies only to the very arrays it
    was made for (``k is prepared.k``, e.g. not to a latent reading's folded k); it is made
    for one case and dropped with it.

    Examples
    --------
    >>> import numpy as np
    >>> q = k = v = np.eye(2)
    >>> kv = PreparedKV(k, v)
    >>> a = textbook_attention(q, k, v, dtype="float64", prepared=kv).out
    >>> bool((a == textbook_attention(q, k, v, dtype="float64").out).all())
    True
    """

    def __init__(self, k, v):
        self.k, self.v = k, v
        self._kept = {}

    def applies(self, k, v) -> bool:
        return k is self.k and v is self.v

    def _get(self, key, compute):
        if key not in self._kept:
            self._kept[key] = compute()
        return self._kept[key]

    def keys(self, H, gqa, acc):
        """(k expanded to H heads in ``acc``, non-finite zeroed; keys with a non-finite
        entry (..., H, S); whether any has one)."""
        return self._get(("k", H, gqa, acc), lambda: _keys(with_heads(self.k, "k"), H, gqa, acc))

    def values(self, H, gqa, acc):
        """(v expanded to H heads in ``acc``, non-finite zeroed; where v is non-finite, in
        ``acc``, or None where v is finite)."""

        def compute():
            clean, bad = _values(expand_kv(with_heads(self.v, "v"), H, gqa), acc)
            return clean, bad.astype(acc) if bad.any() else None

        return self._get(("v", H, gqa, acc), compute)

    def abs_values(self, H, gqa):
        """``|v|`` in float64 (non-finite: 0) expanded to H heads, (..., H, S, E)."""

        def compute():
            return expand_kv(finite_abs(with_heads(self.v, "v")), H, gqa)

        return self._get(("|v|", H, gqa), compute)

    def allowed(self, L, S, **structure):
        """:func:`oracle.reading.allowed.allowed_positions` of the options ``structure``, each
        distinct set made once (arrays told apart by identity and kept, so that an identity
        is never reused while it is a key); read-only."""
        key = ("allowed", L, S) + tuple(
            (name, id(x) if isinstance(x, np.ndarray) else repr(x))
            for name, x in sorted(structure.items())
        )

        def compute():
            allowed = allowed_positions(L, S, **structure).view()
            allowed.flags.writeable = False
            return allowed, structure  # the arrays kept alive with their identities

        return self._get(key, compute)[0]


def _keys(k, H, gqa, acc):
    k_h = expand_kv(k, H, gqa).astype(acc)
    k_h = np.where(np.isfinite(k_h), k_h, 0)  # poison reaches only excluded scores
    poisoned_k = ~np.isfinite(expand_kv(k, H, gqa)).all(axis=-1)
    return k_h, poisoned_k, bool(poisoned_k.any())


def _values(v, acc):
    bad = ~np.isfinite(v)
    return np.where(bad, 0, v).astype(acc), bad


def _scores(q, k, v, dtype, opt, softcap_order, allowed, prepared=None):
    """Final scores in the accumulation dtype (rounded through ``dtype`` at each stored stage),
    the allowed set and the pre-softcap capped scores (for the softcap derivative). ``opt``
    holds every option (None where not given); ``prepared`` a :class:`PreparedKV` of k, v."""
    scale, bias, mask, window, softcap = (
        opt[n] for n in ("scale", "bias", "mask", "window", "softcap")
    )
    alibi_slopes, kv_lengths = opt["alibi_slopes"], opt["kv_lengths"]
    causal, align = bool(opt["causal"]), opt["align"] or "top_left"
    gqa = opt["gqa"] or "interleave"
    acc = accumulation_dtype(dtype)
    store = format_of(dtype).dtype

    def stored(x):
        return np.asarray(x, dtype=acc).astype(store).astype(acc)

    use = prepared is not None and prepared.applies(k, v)
    q, k, v = with_heads(q, "q"), with_heads(k, "k"), with_heads(v, "v")
    H, L, D = q.shape[-3:]
    S = k.shape[-2]
    k_h, poisoned_k, poisoned = prepared.keys(H, gqa, acc) if use else _keys(k, H, gqa, acc)
    with np.errstate(all="ignore"):
        raw = np.matmul(q.astype(acc), np.swapaxes(k_h, -1, -2))
        if poisoned:
            raw = np.where(poisoned_k[..., None, :], np.nan, raw)
        scores = stored(raw * acc.type(resolve_scale(scale, D)))
    if allowed is None:
        structure = {"mask": mask, "bias": bias, "causal": causal, "window": window}
        structure.update(align=align, kv_lengths=kv_lengths)
        made = prepared.allowed if use else allowed_positions
        allowed = made(L, S, **structure)
    additive = np.zeros((), dtype=acc)
    if bias is not None:
        additive = np.where(np.asarray(bias) == -np.inf, 0, np.asarray(bias, dtype=np.float64))
    if alibi_slopes is not None:
        additive = additive + _alibi(alibi_slopes, L, S, align, kv_lengths)
    has_additive = bias is not None or alibi_slopes is not None
    capped = None
    with np.errstate(all="ignore"):
        if softcap is not None and softcap_order == "before_bias":
            c = acc.type(softcap)
            capped = stored(c * np.tanh(scores / c))
            scores = capped
        if has_additive:
            scores = stored(scores + np.asarray(additive, dtype=np.float64).astype(acc))
        if softcap is not None and softcap_order == "after_bias":
            c = acc.type(softcap)
            capped = stored(c * np.tanh(scores / c))
            scores = capped
        if softcap is not None and softcap_order == "after_mask":
            c = acc.type(softcap)
            scores = stored(c * np.tanh(np.where(allowed, scores, -np.inf) / c))
            allowed = np.ones_like(allowed)
    return scores, np.broadcast_to(allowed, scores.shape), capped


def _softmax(scores, allowed, empty_rows, acc, sinks=None):
    """Weights and lse; with ``sinks`` (H,) (taken in ``acc``) each row's normaliser has one
    more term ``exp(sigma_h)`` with no value, and also the sink's weight is returned."""
    masked = np.where(allowed, scores, -np.inf)
    top = masked.max(axis=-1, keepdims=True)
    empty = ~allowed.any(axis=-1)
    sink = None
    if sinks is not None:  # a row with a sink is never empty: out 0, lse = the sink
        sink = np.asarray(sinks, dtype=np.float64).astype(acc)[:, None, None]
        top, empty = np.maximum(top, sink), np.zeros_like(empty)
    top = np.where(np.isfinite(top), top, 0)
    with np.errstate(all="ignore"):
        terms = np.where(allowed, np.exp(masked - top), 0)
        total = terms.sum(axis=-1, keepdims=True)
        if sink is not None:
            sink_term = np.exp(sink - top)
            total = total + sink_term
            sink = (sink_term / total)[..., 0].astype(acc)
        weights = terms / total
        lse = (top + np.log(total))[..., 0]
    fill = 0 if empty_rows == "zero" else np.nan
    if empty_rows == "average":  # a declared reading (oracle.judging.empty_rows): weights 1/S
        fill = 1.0 / scores.shape[-1]
    weights = np.where(empty[..., None], fill, weights).astype(acc)
    lse = np.where(empty, -np.inf if empty_rows == "zero" else np.nan, lse).astype(acc)
    return weights, lse, sink


def _sigmoid(scores, allowed, empty_rows, acc):
    """Weights sigma(t) on the allowed set (``normalizer="sigmoid"``: no normaliser, lse NaN)
    in the stable two-branch form, in ``acc``."""
    with np.errstate(all="ignore"):
        safe = np.where(allowed, scores, 0).astype(acc)
        e = np.exp(-np.abs(safe))
        weights = np.where(allowed, np.where(safe >= 0, 1 / (1 + e), e / (1 + e)), 0)
    empty = ~allowed.any(axis=-1)
    if empty_rows != "zero":
        weights = np.where(empty[..., None], np.nan, weights)
    return weights.astype(acc), np.full(weights.shape[:-1], np.nan, acc), None


def _weights_at_v(weights, v, acc, prepared=None):
    """``weights @ v`` where a NaN/Inf value reaches only the rows that give it weight;
    ``prepared``: (v clean in ``acc``, where v is non-finite in ``acc`` or None) already made."""
    if prepared is None:
        clean, bad = _values(v, acc)
        bad = bad.astype(acc) if bad.any() else None
    else:
        clean, bad = prepared
    with np.errstate(all="ignore"):
        out = np.matmul(weights, clean)
        if bad is None:  # no poisoned value: no row is hit
            return out
        hit = np.matmul((weights != 0).astype(acc), bad) > 0
    return np.where(hit, np.nan, out)


def textbook_attention(
    q, k, v, *, dtype=None, softcap_order="before_bias", allowed=None, prepared=None, **options
) -> Textbook:
    """Textbook attention in ``dtype`` (the baseline of rule (T2) and the diagnosis engine).

    Two-pass max-shifted softmax; matmuls and the softmax accumulate in
    :func:`accumulation_dtype` (float32 for half types) and every stored stage (scores, capped
    scores, biased scores, weights, dropped weights, out, lse) is rounded to ``dtype``, like
    PyTorch's math path. ``dtype=None`` means q's dtype; "float64" gives an accurate float64
    evaluation (used for natural scales). ``options`` are refattn.attention's keywords.
    ``softcap_order`` ("before_bias" pinned, "after_bias", "after_mask") and ``allowed``
    (an explicit allowed set) exist for the convention diagnosis. ``sinks`` add
    ``exp(sigma_h)`` to each row's normaliser (in the accumulation dtype; weights over the
    keys only, the sink's own in ``sink_weights``), ``kv_lengths`` exclude keys j >= S_b and
    align each batch row to its own length, float8 q, k, v are dequantised exactly with
    their descales first (then taken in the accumulation dtype like any input).
    ``prepared`` (a :class:`PreparedKV` of this k and v) reuses their conversions across the
    evaluations of one case; the result is the same to the bit.

    Examples
    --------
    >>> import numpy as np
    >>> q = k = v = np.eye(2)
    >>> r = textbook_attention(q, k, v, scale=0.0)
    >>> r.out.tolist(), r.lse.round(4).tolist()
    ([[0.5, 0.5], [0.5, 0.5]], [0.6931, 0.6931])
    """
    unknown = set(options) - set(ATTENTION_OPTIONS)
    if unknown:
        raise TypeError(f"textbook_attention: unknown options {sorted(unknown)}")
    options = indices_as_mask(q, k, options)  # sparse key indices: their set, as a mask
    if options.get("qv") is not None:  # q' = [q, qv], k' = [k, v] (oracle.reading.latent)
        q, k, options = fold_latent(*dequantised_inputs(q, k, v, options))
    q, k, v, options = dequantised_inputs(q, k, v, options)
    opt = {name: options.get(name) for name in ATTENTION_OPTIONS}
    _refuse_malformed(k, v, opt["kv_lengths"])
    dtype = np.asarray(q).dtype if dtype is None else dtype
    store = format_of(dtype).dtype
    acc = accumulation_dtype(dtype)
    squeeze = np.asarray(q).ndim == 2
    prepared = prepared if prepared is not None and prepared.applies(k, v) else None
    scores, allowed, _ = _scores(q, k, v, dtype, opt, softcap_order, allowed, prepared)
    if opt["normalizer"] == "sigmoid":
        weights, lse, sink = _sigmoid(scores, allowed, opt["empty_rows"] or "zero", acc)
    else:
        weights, lse, sink = _softmax(
            scores, allowed, opt["empty_rows"] or "zero", acc, opt["sinks"]
        )
    weights = weights.astype(store).astype(acc)
    dropped = _dropped(weights, opt["dropout_mask"], opt["dropout_p"] or 0.0, acc, store)
    H, gqa = scores.shape[-3], opt["gqa"] or "interleave"
    if prepared is None:
        out = _weights_at_v(dropped, expand_kv(with_heads(v, "v"), H, gqa), acc)
    else:
        out = _weights_at_v(dropped, None, acc, prepared.values(H, gqa, acc))
    result = Textbook(
        out.astype(store),
        lse.astype(store),
        weights.astype(store),
        allowed,
        None if sink is None else sink.astype(store),
    )
    if squeeze:
        result = Textbook(
            *(
                x if x is None else x[..., 0, :, :] if x.ndim >= 3 and i != 1 else x[..., 0, :]
                for i, x in enumerate(result)
            )
        )
    return result


def _refuse_malformed(k, v, kv_lengths):
    """Refuse what refattn.attention refuses and the broadcasting below would accept (the
    refusal cases, oracle.judging.must_refuse): k and v of different (K, S), kv_lengths outside [0,
    S]."""
    k_shape, v_shape = np.shape(k), np.shape(v)
    if k_shape[-3:-1] != v_shape[-3:-1]:
        raise ValueError(f"v: expected (..., K, S, E) matching k {k_shape}, got {v_shape}")
    lengths = None if kv_lengths is None else np.asarray(kv_lengths)
    if (
        lengths is not None
        and lengths.size
        and not 0 <= lengths.min() <= lengths.max() <= k_shape[-2]
    ):
        raise ValueError(
            f"kv_lengths: expected lengths in [0, S = {k_shape[-2]}], got {lengths.tolist()}"
        )


def _dropped(weights, dropout_mask, dropout_p, acc, store):
    if dropout_mask is None:
        return weights
    keep = np.asarray(dropout_mask, dtype=bool)
    rescale = acc.type(1) / (acc.type(1) - acc.type(dropout_p))
    return (np.where(keep, weights, 0) * rescale).astype(store).astype(acc)


def textbook_attention_vjp(q, k, v, grad_out, *, grad_lse=None, dtype=None, **options):
    """Textbook backward in ``dtype`` (float32 accumulation for half types): (dq, dk, dv, dbias,
    dsinks) (dbias None without bias, dsinks (H,) None without sinks).

    ``Delta_i = sum_j P_ij dP_ij``; ``dS = P (dP - Delta + grad_lse)``; softcap's derivative
    ``1 - (t/c)^2``; dk, dv folded over the heads sharing a kv head and every gradient summed
    to its input's shape. Empty rows get zero gradients.
    """
    unknown = set(options) - set(ATTENTION_OPTIONS)
    if unknown:
        raise TypeError(f"textbook_attention_vjp: unknown options {sorted(unknown)}")
    options = indices_as_mask(q, k, options)  # sparse key indices: their set, as a mask
    if options.get("qv") is not None:  # (..., dqv) last: oracle.reading.latent
        folded = fold_latent(*dequantised_inputs(q, k, v, options))
        grads = textbook_attention_vjp(
            folded[0],
            folded[1],
            np.asarray(v, folded[1].dtype),
            grad_out,
            grad_lse=grad_lse,
            dtype=dtype,
            **folded[2],
        )
        return split_latent(grads, np.shape(q)[-1])
    q, k, v, options = dequantised_inputs(q, k, v, options)
    opt = {name: options.get(name) for name in ATTENTION_OPTIONS}
    dtype = np.asarray(q).dtype if dtype is None else dtype
    store = format_of(dtype).dtype
    acc = accumulation_dtype(dtype)
    gqa = opt["gqa"] or "interleave"

    def stored(x):
        return np.asarray(x, dtype=acc).astype(store).astype(acc)

    q3, k3, v3 = with_heads(q, "q"), with_heads(k, "k"), with_heads(v, "v")
    H, D = q3.shape[-3], q3.shape[-1]
    K = k3.shape[-3]
    scores, allowed, capped = _scores(q, k, v, dtype, opt, "before_bias", None)
    sigmoid = opt["normalizer"] == "sigmoid"
    if sigmoid:  # dS = sigma(t) sigma(-t) dP: no Delta
        weights, _, sink = _sigmoid(scores, allowed, "zero", acc)
        weights_neg, _, _ = _sigmoid(-scores, allowed, "zero", acc)
    else:
        weights, _, sink = _softmax(scores, allowed, "zero", acc, opt["sinks"])
    weights = stored(weights)
    dO = with_heads(grad_out, "grad_out").astype(acc)
    k_h = expand_kv(k3, H, gqa).astype(acc)
    v_h = expand_kv(v3, H, gqa).astype(acc)
    with np.errstate(all="ignore"):
        dP = stored(np.matmul(dO, np.swapaxes(v_h, -1, -2)))
        if opt["dropout_mask"] is not None:
            keep = np.asarray(opt["dropout_mask"], dtype=bool)
            rescale = acc.type(1) / (acc.type(1) - acc.type(opt["dropout_p"] or 0.0))
            dP = stored(np.where(keep, dP, 0) * rescale)
        delta = (weights * dP).sum(axis=-1, keepdims=True)
        dS = dP - delta
        if sigmoid:
            dS = stored(weights_neg) * dP
        if grad_lse is not None:
            dS = dS + np.asarray(grad_lse, dtype=acc)[..., None]
        dsinks = None
        if sink is not None:  # d/d sigma_h = sum over batch and rows of w_sink (g_lse - Delta)
            lse_part = 0 if grad_lse is None else np.asarray(grad_lse, dtype=acc)
            per_row = with_heads(stored(sink) * (lse_part - delta[..., 0]), "dsinks")
            dsinks = per_row.reshape((-1,) + per_row.shape[-2:]).sum(axis=(0, 2)).astype(store)
        dS = stored(weights * dS)
        dS_raw = dS
        if opt["softcap"] is not None:
            c = acc.type(opt["softcap"])
            dS_raw = stored(dS * (1 - (capped / c) ** 2))
        s = acc.type(resolve_scale(opt["scale"], D))
        dq = np.matmul(dS_raw, k_h) * s
        dk = fold_kv(np.matmul(np.swapaxes(dS_raw, -1, -2), q3.astype(acc)) * s, K, gqa)
        dropped = _dropped(weights, opt["dropout_mask"], opt["dropout_p"] or 0.0, acc, store)
        dv = fold_kv(np.matmul(np.swapaxes(dropped, -1, -2), dO), K, gqa)
    dbias = None
    if opt["bias"] is not None:
        dbias = reduce_to(dS, np.shape(opt["bias"])).astype(store)
    return (
        reduce_to(dq, np.shape(q)).astype(store),
        reduce_to(dk, np.shape(k)).astype(store),
        reduce_to(dv, np.shape(v)).astype(store),
        dbias,
        dsinks,
    )


def storage_accumulation_attention(
    q, k, v, options, dtype, sums=("normaliser", "values")
) -> np.ndarray:
    """Attention whose softmax normaliser and ``weights @ v`` are summed key by key *in the
    storage dtype* (no float32 accumulator), the rest as the textbook baseline.

    ``sums`` names which sums are accumulated in the storage dtype (the others in float32).
    The model of a half-precision implementation that accumulates in its own format; a
    failing output that is no worse than this is diagnosed as such.
    """
    store = format_of(dtype).dtype
    options = indices_as_mask(q, k, options)  # sparse key indices: their set, as a mask
    q, k, v, options = dequantised_inputs(q, k, v, options)
    o = {name: options.get(name) for name in ATTENTION_OPTIONS}
    scores, allowed, _ = _scores(q, k, v, dtype, o, "before_bias", None)
    with np.errstate(all="ignore"):
        masked = np.where(allowed, scores, -np.inf)
        top = masked.max(axis=-1, keepdims=True)
        if o["normalizer"] == "sigmoid":  # no normaliser: only the value sum is modelled
            weights = _sigmoid(scores, allowed, "zero", np.float32)[0].astype(store)
            sums = tuple(s for s in sums if s != "normaliser")
            o = dict(o, sinks=None)
        if o["sinks"] is not None:  # the sink: one more normaliser term, no value
            sink = np.asarray(o["sinks"], dtype=np.float64)[:, None, None]
            top = np.maximum(top, sink)
            masked = np.concatenate([masked, np.broadcast_to(sink, top.shape)], axis=-1)
            allowed = np.concatenate([allowed, np.ones(top.shape, dtype=bool)], axis=-1)
        terms = np.where(allowed, np.exp(masked - np.where(np.isfinite(top), top, 0)), 0)
        terms = terms.astype(store)
        if "normaliser" in sums:
            total = np.add.accumulate(terms, axis=-1, dtype=store)[..., -1:]
        else:
            total = terms.astype(np.float32).sum(axis=-1, keepdims=True)
        if o["normalizer"] != "sigmoid":
            weights = (terms / total).astype(store)
        if o["sinks"] is not None:
            weights = weights[..., :-1]
        if o["dropout_mask"] is not None:
            keep = np.asarray(o["dropout_mask"], dtype=bool)
            weights = (np.where(keep, weights, 0) / (1 - (o["dropout_p"] or 0.0))).astype(store)
        v_h = (
            np.asarray(v)[None]
            if np.ndim(v) == 2
            else expand_kv(np.asarray(v), weights.shape[-3], o["gqa"] or "interleave")
        )
        if "values" in sums:
            products = (weights[..., :, :, None] * v_h[..., None, :, :]).astype(store)
            out = np.add.accumulate(products, axis=-2, dtype=store)[..., -1, :]
        else:
            out = np.matmul(weights.astype(np.float32), v_h.astype(np.float32)).astype(store)
    return out[0] if np.ndim(q) == 2 else out


def variant_float64_path(case: Case, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """refattn's float64 path on ``inputs`` (taken exactly in float64), as named outputs."""
    raw = {
        name: (value if name in BOOL_INPUTS else _float64(value)) for name, value in inputs.items()
    }
    return {name: _float64(value) for name, value in call_refattn(case, raw).items()}


def variant_baseline(case: Case, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The baseline of the rule (T2) for a variant case: refattn's float64 path on the case's
    inputs (exact in float64), each output rounded once to the case dtype."""
    return {
        name: _float64(seeding.to_dtype(value, case.dtype))
        for name, value in variant_float64_path(case, inputs).items()
    }


def variant_vjp_baseline(case: Case, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The baseline of (T2) for a variant gradient case: refattn's float64 vjp on the case's
    inputs (exact in float64), each gradient rounded once to the case dtype."""
    raw = {
        name: (value if name in BOOL_INPUTS else _float64(value)) for name, value in inputs.items()
    }
    return {
        name: _float64(seeding.to_dtype(_float64(value), case.dtype))
        for name, value in call_refattn_vjp(case, raw).items()
    }


def _float64(x):
    return np.asarray(x).astype(np.float64)
