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

__all__ = ["Alternative", "alternatives", "diagnose", "describe_failure", "error_models"]


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
    return found


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


# ---------------------------------------------------------------------------------------------
# Error models: what a grade's errors are consistent with
# ---------------------------------------------------------------------------------------------

#: Largest number of products (H L S E) for which the key-by-key narrow-sum model is run.
MODEL_SIZE_CAP = 2**24
_HALVES = ("bfloat16", "float16")


def _cast(x, dtype):
    """``x`` rounded to ``dtype`` ("tf32": float32 with a 10-bit fraction), as float64."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "tf32":
        bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        # round to nearest even at bit 13, on the integer pattern (no libm, exact)
        half = np.uint64(1 << 12) - np.uint64(1) + ((bits >> np.uint64(13)) & np.uint64(1))
        rounded = ((bits + half) >> np.uint64(13)) << np.uint64(13)
        out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
        return np.where(np.isfinite(x), out, x)
    import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy

    name = "bfloat16" if dtype == "bfloat16" else dtype
    with np.errstate(over="ignore"):
        return x.astype(np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else name) \
            .astype(np.float64)


def _exact_parts(q, k, v, options):
    """float64 weights (post-dropout), v expanded to the query heads, and the rows' max."""
    base = textbook_attention(q, k, v, dtype="float64", **options)
    w = np.where(np.isfinite(base.weights), base.weights, 0.0)
    if options.get("dropout_mask") is not None:
        keep = np.asarray(options["dropout_mask"], dtype=bool)
        w = np.where(keep, w, 0) / (1 - (options.get("dropout_p") or 0.0))
    w3 = w[None] if np.ndim(q) == 2 else w
    from refattn._broadcast import expand_kv

    from .heads import with_heads
    v_h = expand_kv(with_heads(np.asarray(v, dtype=np.float64), "v"), w3.shape[-3],
                    options.get("gqa") or "interleave")
    return base, w3, np.where(np.isfinite(v_h), v_h, 0.0)


def _flash_model(w3, v_h, p_dtype, sums="float32"):
    """P~ = w / max_j w (the exp of score minus row max) rounded to ``p_dtype``, P~ @ V
    summed in ``sums``, divided by l = 1 / max_j w."""
    top = w3.max(axis=-1, keepdims=True)
    with np.errstate(all="ignore"):
        p = np.where(top > 0, w3 / np.where(top > 0, top, 1), 0)
    p = _cast(p, p_dtype) if p_dtype != "float64" else p
    if sums in _HALVES:
        terms = _cast(p[..., :, :, None] * v_h[..., None, :, :], sums)
        acc = np.zeros(terms.shape[:-2] + terms.shape[-1:])
        for j in range(terms.shape[-2]):
            acc = _cast(acc + terms[..., j, :], sums)
        pv = acc
    else:
        pv = np.matmul(p, v_h)
    return pv * np.where(top > 0, top, 0)


def error_models(q, k, v, options, dtype, *, rounded=None) -> dict:
    """Outputs (float64, shaped like out) of the error models a grade compares against.

    By case dtype: the textbook in the dtype (float32 sums, stages stored in the dtype);
    the probabilities rounded to a 16-bit type before ``P @ V`` with float32 sums
    (FlashAttention's tensor-core path); ``P @ V`` summed key by key in a 16-bit type;
    TF32 matmuls (float32); float32 working precision and a float32 softmax (float64);
    and "correctly rounded" (the truth rounded once, ``rounded``). Score rounding is not
    modelled where the label does not say so (the models isolate one effect each).
    """
    dtype = str(np.dtype(dtype)) if dtype != "bfloat16" else dtype
    models = {}
    single = np.ndim(q) == 2
    with np.errstate(all="ignore"):
        base, w3, v_h = _exact_parts(q, k, v, options)

        def shaped(x):
            return x[0] if single else x

        text = textbook_attention(q, k, v, dtype=dtype, **options).out
        models[f"float32 sums, scores and weights stored in {dtype} (textbook)"
               if dtype in _HALVES else f"{dtype} textbook (two-pass softmax)"] = \
            np.asarray(text, dtype=np.float64)
        small = w3.size * v_h.shape[-1] <= MODEL_SIZE_CAP
        if dtype in _HALVES:
            models[f"P rounded to {dtype} before P@V, float32 sums (FlashAttention)"] = \
                shaped(_cast(_flash_model(w3, v_h, dtype), dtype))
            if small:
                models[f"P@V accumulated in {dtype}"] = shaped(_cast(
                    _flash_model(w3, v_h, dtype, sums=dtype), dtype))
        elif dtype == "float32":
            for half in _HALVES:
                models[f"P rounded to {half} before P@V, float32 sums"] = \
                    shaped(_cast(_flash_model(w3, v_h, half), "float32"))
                if small:
                    models[f"P@V accumulated in {half}"] = shaped(_cast(
                        _flash_model(w3, v_h, "float32", sums=half), "float32"))
            tf32 = [_cast(x, "tf32").astype(np.float32) for x in (q, k, v)]
            models["TF32 matmuls (q, k, v with 10-bit fractions)"] = np.asarray(
                textbook_attention(*tf32, dtype="float32", **options).out, dtype=np.float64)
        elif dtype == "float64":
            low = [np.asarray(x).astype(np.float32) for x in (q, k, v)]
            opts32 = {n: (np.asarray(x).astype(np.float32)
                          if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x)
                      for n, x in options.items()}
            models["float32 working precision"] = np.asarray(
                textbook_attention(*low, dtype="float32", **opts32).out, dtype=np.float64)
            models["float32 softmax, float64 matmuls"] = shaped(
                _flash_model(_cast(w3, "float32"), v_h, "float64"))
        if rounded is not None:
            models["correctly rounded (higher precision, one rounding)"] = \
                np.asarray(rounded, dtype=np.float64)
    return models
