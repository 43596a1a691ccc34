"""Deliberately broken attention implementations (the oracle must catch every one of them).

Each is a plain ``impl(q, k, v, **options)`` in the calling convention of
:func:`oracle.run.validate`, computing in the case dtype like a real implementation would
(float32 accumulation for the half types). Each carries ``BROKEN[name]``: the case-name
patterns it must fail and the diagnosis it must receive (None when no named alternative
describes the bug: numerical bugs have no convention to match).

``textbook`` is the *correct* counterpart (the oracle's own baseline algorithm): it must pass
every conformance case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from oracle.judging.tolerance import accumulation_dtype, allowed_positions
from oracle.reading.baseline import textbook_attention

__all__ = ["BROKEN", "Broken", "textbook"]

_OPTIONS = (
    "scale",
    "bias",
    "mask",
    "causal",
    "window",
    "align",
    "softcap",
    "alibi_slopes",
    "gqa",
    "dropout_mask",
    "dropout_p",
    "empty_rows",
)


def _forward(q, k, v, return_lse=False, softcap_order="before_bias", **options):
    result = textbook_attention(q, k, v, softcap_order=softcap_order, **options)
    return (result.out, result.lse) if return_lse else result.out


def textbook(q, k, v, **options):
    """Correct textbook attention in the case dtype (must pass)."""
    return _forward(q, k, v, **options)


def missing_scale(q, k, v, **options):
    """Scores are q . k, never scaled."""
    return _forward(q, k, v, **{**options, "scale": 1.0})


def wrong_alignment(q, k, v, **options):
    """Causal/window aligned at the other corner."""
    align = options.get("align") or "top_left"
    other = "bottom_right" if align == "top_left" else "top_left"
    return _forward(q, k, v, **{**options, "align": other})


def tile_gqa(q, k, v, **options):
    """Query head h reads kv head h % K (older ONNX contrib ops) whatever gqa says."""
    gqa = options.get("gqa") or "interleave"
    return _forward(q, k, v, **{**options, "gqa": "tile" if gqa == "interleave" else "interleave"})


def softcap_after_mask(q, k, v, **options):
    """Masking by a -inf bias *before* the softcap: masked scores become -softcap."""
    return _forward(q, k, v, softcap_order="after_mask", **options)


def nan_rows(q, k, v, **options):
    """Fully masked rows come out NaN (0/0), whatever empty_rows says."""
    return _forward(q, k, v, **{**options, "empty_rows": "nan"})


def inverted_mask(q, k, v, **options):
    """Reads the boolean mask as True = masked out."""
    if options.get("mask") is not None:
        options = {**options, "mask": ~np.asarray(options["mask"], dtype=bool)}
    return _forward(q, k, v, **options)


def window_off_by_one(q, k, v, **options):
    """Window bounds exclusive on the left (``j > i - left``): one key fewer."""
    window = options.get("window")
    if window is not None and window[0] is not None and window[0] > 0:
        options = {**options, "window": (window[0] - 1, window[1])}
    return _forward(q, k, v, **options)


def no_dropout_rescale(q, k, v, **options):
    """Dropout zeroes weights but does not rescale the kept ones by 1/(1-p)."""
    options.pop("dropout_p", None)
    # dropout_p = 0 keeps the keep-mask but rescales by 1: exactly the missing-rescale bug
    return _forward(q, k, v, **options, dropout_p=0.0)


def _core(q, k, v, options):
    """Scores (acc dtype, already scaled/capped/biased), allowed set, kv-expanded v."""
    store = np.asarray(q).dtype
    acc = accumulation_dtype(store)
    H, L, D = q.shape[-3:]
    S = k.shape[-2]
    G = H // k.shape[-3]
    k_h = (
        np.repeat(k, G, axis=-3)
        if (options.get("gqa") or "interleave") == "interleave"
        else np.concatenate([k] * G, axis=-3)
    )
    v_h = (
        np.repeat(v, G, axis=-3)
        if (options.get("gqa") or "interleave") == "interleave"
        else np.concatenate([v] * G, axis=-3)
    )
    scale = options.get("scale")
    scale = 1 / math.sqrt(D) if scale is None else scale
    scores = np.matmul(q.astype(acc), np.swapaxes(k_h, -1, -2).astype(acc)) * acc.type(scale)
    allowed = allowed_positions(
        L,
        S,
        mask=options.get("mask"),
        bias=options.get("bias"),
        causal=bool(options.get("causal")),
        window=options.get("window"),
        align=options.get("align") or "top_left",
    )
    if options.get("bias") is not None:
        bias = np.asarray(options["bias"], dtype=np.float64)
        scores = scores + np.where(np.isfinite(bias), bias, 0).astype(acc)
    return scores, np.broadcast_to(allowed, scores.shape), v_h, store, acc


def _unsupported(options, allowed_names):
    used = [n for n in ("softcap", "alibi_slopes", "dropout_mask") if options.get(n) is not None]
    if set(used) - set(allowed_names):
        raise NotImplementedError(f"this broken implementation does not do {used}")


def half_softmax_no_max_shift(q, k, v, **options):
    """Softmax evaluated in the storage dtype as exp(s) / sum exp(s): no max shift."""
    _unsupported(options, ())
    scores, allowed, v_h, store, acc = _core(q, k, v, options)
    with np.errstate(all="ignore"):
        e = np.where(allowed, np.exp(scores.astype(store)), 0).astype(store)
        weights = (e / e.sum(axis=-1, keepdims=True, dtype=store)).astype(store)
        return np.matmul(weights.astype(acc), v_h.astype(acc)).astype(store)


def corrupted_element(q, k, v, **options):
    """In rows of at least 1024 keys, the middle key's score is off by one (a stale
    accumulator in one lane of a vectorised loop): one element in a long row."""
    _unsupported(options, ())
    scores, allowed, v_h, store, acc = _core(q, k, v, options)
    S = scores.shape[-1]
    if S >= 1024:
        scores = scores.copy()
        scores[..., S // 2] += 1
    masked = np.where(allowed, scores, -np.inf)
    with np.errstate(all="ignore"):
        e = np.exp(masked - masked.max(axis=-1, keepdims=True))
        weights = np.where(allowed, e / e.sum(axis=-1, keepdims=True), 0).astype(store)
        return np.matmul(weights.astype(acc), v_h.astype(acc)).astype(store)


def half_accumulation(q, k, v, **options):
    """weights @ v accumulated key by key in the storage dtype (no float32 accumulator)."""
    _unsupported(options, ())
    scores, allowed, v_h, store, acc = _core(q, k, v, options)
    masked = np.where(allowed, scores, -np.inf)
    with np.errstate(all="ignore"):
        e = np.exp(masked - masked.max(axis=-1, keepdims=True))
        weights = np.where(allowed, e / e.sum(axis=-1, keepdims=True), 0).astype(store)
        terms = (weights[..., :, :, None] * v_h[..., None, :, :]).astype(store)
        return np.add.accumulate(terms, axis=-2, dtype=store)[..., -1, :]


@dataclass(frozen=True)
class Broken:
    """A broken implementation, the cases it must fail and the diagnosis it must get."""

    impl: object
    cases: tuple  # fnmatch patterns over case names
    diagnosis: str | None


BROKEN = {
    "missing_scale": Broken(missing_scale, ("basic-*-f32", "basic-*-f64"), "no scale"),
    "wrong_alignment": Broken(wrong_alignment, ("causal-br-H*-f32",), "align='top_left'"),
    "tile_gqa": Broken(tile_gqa, ("gqa-interleave-H8*-f32",), "gqa='tile'"),
    "softcap_after_mask": Broken(softcap_after_mask, ("softcap-mask-*-f32",), "softcap after mask"),
    "half_softmax_no_max_shift": Broken(half_softmax_no_max_shift, ("gap-H*-f16",), None),
    "window_off_by_one": Broken(window_off_by_one, ("window-both-H*-f32",), "window=("),
    "no_dropout_rescale": Broken(
        no_dropout_rescale, ("dropout-H*-f32",), "dropout without the 1/(1-p) rescale"
    ),
    "nan_rows": Broken(nan_rows, ("mask-empty-rows-H*-f32",), "empty_rows='nan'"),
    "corrupted_element": Broken(
        corrupted_element, ("long-H*-f32", "long-decode-*S2048-*-f32"), None
    ),
    "half_accumulation": Broken(
        half_accumulation, ("positive-long-*-f16",), "accumulating weights @ v in float16"
    ),
    "inverted_mask": Broken(inverted_mask, ("mask-random-*-f32",), "mask polarity inverted"),
}
