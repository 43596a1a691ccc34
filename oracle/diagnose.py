"""Convention diagnosis: which named alternative semantics does a failing output match?

When a case fails, the oracle re-evaluates the truth in float64 under each *named alternative*
of the conventions pinned in docs/conventions.md and reports those the implementation's output
fits within the case's own threshold (:mod:`oracle.tolerance`, (T2)). These are the silent
mismatches that fill peers' issue trackers:

=================================  ==========================================================
label                              alternative
=================================  ==========================================================
``align='bottom_right'`` (etc.)    causal/window alignment flipped (flash-attention #951)
``gqa='tile'`` (etc.)              query head h reads kv head h % K instead of h // G
``softcap after bias``             ``c tanh((t + bias + alibi)/c)`` (onnx #7865)
``softcap after mask``             excluded positions enter tanh as -inf and come out as ``-c``:
                                   they stay in the softmax with weight ``~exp(-c)``
``empty_rows='nan'`` (etc.)        fully-masked rows NaN instead of 0 (pytorch #103749)
``fully masked rows average ...``  masking by ``finfo.min`` instead of removing: a row with
                                   no allowed key averages every value (JAX, many kernels)
``mask polarity inverted``         True = masked out
``dropout without 1/(1-p)``        kept weights not rescaled
``dropout_mask polarity inverted`` True = dropped
``scale 1/sqrt(E)``                the value size instead of the key size
``no scale``                       scale = 1
``window=(l+-1, r)`` (etc.)        inclusive/exclusive window bounds
``causal excludes the diagonal``   ``j < i + offset`` (and the converse, one key more)
``bias ignored``, ``ALiBi ignored`` the additive term dropped
``sinks ignored``                  no sink term in the normaliser
``kv_lengths as a key-padding      causal/window aligned to the padded S (a padding mask)
mask``                             instead of each row's own length (FlashAttention's
                                   KV-cache reading, which refattn pins)
=================================  ==========================================================

Single alternatives are tried first; when none fits, pairs (lowerings often get several wrong
at once, tracel-ai/burn #5783). The alternatives are evaluated by
:func:`oracle.baseline.textbook_attention` in float64, whose own error is at most the float64
floor of (T5); that floor is added to the case threshold.

Examples
--------
>>> import numpy as np
>>> from oracle.diagnose import alternatives
>>> [a.label for a in alternatives({"causal": True, "align": "top_left"}, H=2, K=2, L=2, S=3,
...                                D=4, E=4, has_empty=False, has_excluded=True)][:2]
["align='bottom_right'", 'causal excludes the diagonal (j < i + offset)']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import tolerance as tol
from .baseline import textbook_attention

__all__ = ["Alternative", "alternatives", "diagnose", "describe_failure"]


@dataclass(frozen=True)
class Alternative:
    """A named alternative semantics: ``apply(options, extras) -> (options, extras)``.

    ``extras`` holds textbook-only switches: ``softcap_order`` and ``out_factor`` (a factor
    applied to the output, e.g. ``1 - p`` for dropout without rescaling).
    """

    label: str
    keys: frozenset
    apply: Callable


def _set(**changes):
    def apply(options, extras):
        return {**options, **changes}, extras
    return apply


def _extra(**changes):
    def apply(options, extras):
        return options, {**extras, **changes}
    return apply


def _causal_shift(shift):
    def apply(options, extras):
        left, right = options.get("window") or (None, None)
        right = 0 if right is None else min(right, 0)
        return {**options, "causal": False, "window": (left, right + shift)}, extras
    return apply


def _window_alternatives(window):
    left, right = window
    found = []
    for side, value in (("left", left), ("right", right)):
        if value is None:
            continue
        for delta in (1, -1):
            if value + delta < 0:
                continue
            new = (value + delta, right) if side == "left" else (left, value + delta)
            found.append(Alternative(f"window={new}", frozenset({"window"}), _set(window=new)))
    return found


def alternatives(options, *, H, K, L, S, D, E, has_empty, has_excluded) -> list[Alternative]:
    """The named alternatives that can change the result of a case with these options/sizes."""
    found = []
    causal, window = bool(options.get("causal")), options.get("window")
    align = options.get("align") or "top_left"
    if (causal or window is not None) and L != S:
        other = "bottom_right" if align == "top_left" else "top_left"
        found.append(Alternative(f"align={other!r}", frozenset({"align"}), _set(align=other)))
    if causal:
        found.append(Alternative("causal excludes the diagonal (j < i + offset)",
                                 frozenset({"causal", "window"}), _causal_shift(-1)))
        found.append(Alternative("causal admits one key past the diagonal",
                                 frozenset({"causal", "window"}), _causal_shift(1)))
    if window is not None:
        found.extend(_window_alternatives(window))
    gqa = options.get("gqa") or "interleave"
    if K > 1 and H // K > 1:
        other = "tile" if gqa == "interleave" else "interleave"
        found.append(Alternative(f"gqa={other!r}", frozenset({"gqa"}), _set(gqa=other)))
    if options.get("softcap") is not None:
        if options.get("bias") is not None or options.get("alibi_slopes") is not None:
            found.append(Alternative("softcap after bias", frozenset({"softcap_order"}),
                                     _extra(softcap_order="after_bias")))
        if has_excluded:
            found.append(Alternative("softcap after mask (masked scores become -softcap)",
                                     frozenset({"softcap_order"}),
                                     _extra(softcap_order="after_mask")))
    if has_empty:
        other = "nan" if (options.get("empty_rows") or "zero") == "zero" else "zero"
        found.append(Alternative(f"empty_rows={other!r}", frozenset({"empty_rows"}),
                                 _set(empty_rows=other)))
        found.append(Alternative("fully masked rows average every value (masking by a large "
                                 "finite negative such as finfo.min)",
                                 frozenset({"empty_rows"}), _extra(empty_uniform=True)))
    if options.get("mask") is not None:
        inverted = ~np.asarray(options["mask"], dtype=bool)
        found.append(Alternative("mask polarity inverted (True = masked out)",
                                 frozenset({"mask"}), _set(mask=inverted)))
    p = options.get("dropout_p") or 0.0
    if options.get("dropout_mask") is not None:
        if p > 0:
            found.append(Alternative("dropout without the 1/(1-p) rescale",
                                     frozenset({"out_factor"}), _extra(out_factor=1 - p)))
        inverted = ~np.asarray(options["dropout_mask"], dtype=bool)
        found.append(Alternative("dropout_mask polarity inverted (True = dropped)",
                                 frozenset({"dropout_mask"}), _set(dropout_mask=inverted)))
    scale = options.get("scale")
    if scale is None and D != E:
        found.append(Alternative("scale 1/sqrt(E) instead of 1/sqrt(D)", frozenset({"scale"}),
                                 _set(scale=1 / math.sqrt(E))))
    if scale is None or scale != 1:
        found.append(Alternative("no scale (scale=1)", frozenset({"scale"}), _set(scale=1.0)))
    if options.get("bias") is not None:
        found.append(Alternative("bias ignored", frozenset({"bias"}), _set(bias=None)))
    if options.get("alibi_slopes") is not None:
        found.append(Alternative("ALiBi ignored", frozenset({"alibi_slopes"}),
                                 _set(alibi_slopes=None)))
    if options.get("sinks") is not None:
        found.append(Alternative("sinks ignored", frozenset({"sinks"}), _set(sinks=None)))
    if options.get("kv_lengths") is not None and (causal or window is not None) \
            and align == "bottom_right":
        found.append(Alternative("kv_lengths as a key-padding mask (causal/window aligned to "
                                 "the padded S, not to each row's length)",
                                 frozenset({"kv_lengths", "mask"}), _padding_reading(S)))
    return found


def _padding_reading(S):
    """kv_lengths read as a plain key-padding mask (keys j >= S_b excluded, alignment to S)."""
    def apply(options, extras):
        lengths = np.asarray(options["kv_lengths"])
        padding = (np.arange(S)[None, :] < lengths.reshape(-1, 1)).reshape(
            lengths.shape + (1, 1, S))
        mask = options.get("mask")
        mask = padding if mask is None else np.asarray(mask, dtype=bool) & padding
        return {**options, "kv_lengths": None, "mask": mask}, extras
    return apply


def _alternative_out(q, k, v, options, extras):
    result = textbook_attention(q, k, v, dtype="float64",
                                softcap_order=extras.get("softcap_order", "before_bias"),
                                **options)
    factor = extras.get("out_factor", 1.0)
    dropped = result.weights
    if options.get("dropout_mask") is not None:
        keep = np.asarray(options["dropout_mask"], dtype=bool)
        dropped = np.where(keep, result.weights, 0) / (1 - (options.get("dropout_p") or 0.0))
    out = result.out * factor
    scale = tol.output_scale(dropped * factor, v, gqa=options.get("gqa"))
    if extras.get("empty_uniform"):
        empty = ~np.broadcast_to(result.allowed, result.weights.shape).any(axis=-1)
        uniform = np.full(result.weights.shape, 1.0 / result.weights.shape[-1])
        flat = textbook_attention(q, k, v, dtype="float64", gqa=options.get("gqa"),
                                  scale=0.0).out
        out = np.where(empty[..., None], flat, out)
        scale = np.where(empty[..., None],
                         tol.output_scale(uniform, v, gqa=options.get("gqa")), scale)
    return out, scale


def _fits(out, truth, scale, limit, dtype) -> bool:
    if out.shape != truth.shape:
        return False
    err = tol.normalised_error(out, truth, scale, dtype)
    return bool(np.all(err <= limit))


def diagnose(q, k, v, options, out, *, limit, dtype, max_pairs=True) -> list[str]:
    """Labels of the alternatives whose float64 truth ``out`` fits within ``limit``.

    ``limit`` is the case's output threshold (scalar or per row, (T2)); the float64 floor of the
    textbook that evaluates the alternatives is added to it. Returns "matches <label>" strings
    (a pair as "matches <a> + <b>"); an empty list when nothing fits.
    """
    out = np.asarray(out, dtype=np.float64)
    q3 = q if np.ndim(q) > 2 else np.asarray(q)[None]
    H, L, D = np.shape(q3)[-3:]
    K, S, E = np.shape(k)[-3] if np.ndim(k) > 2 else 1, np.shape(k)[-2], np.shape(v)[-1]
    base = textbook_attention(q, k, v, dtype="float64", **options)
    allowed = np.broadcast_to(base.allowed, base.weights.shape)
    has_empty = bool((~allowed.any(axis=-1)).any())
    has_excluded = bool((~allowed).any())
    candidates = alternatives(options, H=H, K=K, L=L, S=S, D=D, E=E, has_empty=has_empty,
                              has_excluded=has_excluded)
    magnitude = tol.score_magnitude(q, k, **options)
    f64 = tol.forward_floors("float64", D=D, S=S, L=L, E=E, G=max(H // K, 1),
                             magnitude=magnitude, allowed=allowed)["out"]
    limit = np.asarray(limit) + float(np.max(f64))
    if np.ndim(q) == 2 and np.ndim(limit) >= 3:
        limit = limit[..., 0, :, :]
    found = []
    with np.errstate(all="ignore"):
        finite = np.isfinite(_alternative_out(q, k, v, dict(options), {})[0])
        bias = options.get("bias")
        poisoned = not all(np.isfinite(np.asarray(a, np.float64)).all() for a in (q, k, v)) or (
            bias is not None and np.isnan(np.asarray(bias, np.float64)).any()
            or bias is not None and np.isposinf(np.asarray(bias, np.float64)).any())

        def explains(opts, extras):
            alt_out, scale = _alternative_out(q, k, v, opts, extras)
            # with poisoned inputs, an alternative that is NaN where the truth is finite only
            # "explains" leaked poison by admitting a poisoned (excluded) position: that is
            # not a convention
            if poisoned and alt_out.shape == finite.shape and (
                    ~np.isfinite(alt_out) & finite).any():
                return False
            return _fits(out, alt_out, scale, limit, dtype)

        for alt in candidates:
            if explains(*alt.apply(dict(options), {})):
                found.append(f"matches {alt.label}")
        if found or not max_pairs:
            return found
        for first, second in itertools.combinations(candidates, 2):
            if first.keys & second.keys:
                continue
            if explains(*second.apply(*first.apply(dict(options), {}))):
                found.append(f"matches {first.label} + {second.label}")
    return found


def describe_failure(value, truth, errors, limit, *, inputs_poisoned=False) -> list[str]:
    """Plain observations on a failure when no alternative fits (NaN leaks, where errors sit)."""
    value = np.asarray(value, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    notes = []
    leaked = ~np.isfinite(value) & np.isfinite(truth)
    if leaked.any():
        where = "; poison at excluded positions reached the output" if inputs_poisoned else ""
        notes.append(f"NaN/Inf in {int(leaked.sum())} elements where the truth is finite{where}")
    missing = np.isnan(truth) & ~np.isnan(value)
    if missing.any():
        notes.append(f"finite values in {int(missing.sum())} elements where the truth is NaN")
    bad = np.asarray(errors > limit)
    if bad.any() and not leaked.any() and bad.ndim >= 2:
        rows = bad.any(axis=-1)
        notes.append(f"{int(bad.sum())} of {bad.size} elements over the threshold, "
                     f"in {int(rows.sum())} of {rows.size} rows")
    return notes
