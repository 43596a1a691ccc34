"""Error models of the accuracy grades (split from :mod:`oracle.diagnose.diagnosis`): what a
kernel's
errors are consistent with (16-bit probabilities before ``P @ V``, ``P @ V`` summed in a 16-bit
type, TF32 matmuls, float32 working precision, correct rounding).

Examples
--------
>>> import numpy as np
>>> from oracle.diagnose.models import cast_to
>>> float(cast_to(np.float64(1 + 2**-12), "bfloat16"))
1.0
"""

from __future__ import annotations

import math

import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy
import numpy as np

from oracle.judging import tolerance as tol
from oracle.reading.baseline import textbook_attention
from oracle.reading.heads import with_heads
from refattn.broadcast import expand_kv

__all__ = ["error_models", "narrow_accumulation", "narrow_accumulation_work", "ORDER_ONE"]

#: Largest normalised error (a share of the output's own scale) a precision model may explain:
#: errors of the order of the output itself are a semantic bug, never a narrow accumulator.
ORDER_ONE = 0.25

# ---------------------------------------------------------------------------------------------
# Error models: what a grade's errors are consistent with
# ---------------------------------------------------------------------------------------------

#: Largest number of products (H L S E) for which the key-by-key narrow-sum model is run.
MODEL_SIZE_CAP = 2**24
_HALVES = ("bfloat16", "float16")
#: Cost of one product of the key-by-key 16-bit sum (a float32 product rounded to the half
#: type, then a sequential half-type sum) in multiply-adds of a float64 reading: the unit of
#: :mod:`oracle.diagnose.budget` (measured on the long rows of the default suite: about 2.5).
HALF_SUM_COST = 3


def cast_to(x, dtype):
    """``x`` rounded to ``dtype`` ("tf32": float32 with a 10-bit fraction), as float64."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "tf32":
        bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        # round to nearest even at bit 13, on the integer pattern (no libm, exact)
        half = np.uint64(1 << 12) - np.uint64(1) + ((bits >> np.uint64(13)) & np.uint64(1))
        rounded = ((bits + half) >> np.uint64(13)) << np.uint64(13)
        out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
        return np.where(np.isfinite(x), out, x)
    name = "bfloat16" if dtype == "bfloat16" else dtype
    with np.errstate(over="ignore"):
        return x.astype(np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else name).astype(
            np.float64
        )


def _narrow_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def exact_parts(q, k, v, options, allowed=None, base=None, prepared=None):
    """float64 textbook, weights (post-dropout, with a head axis), v expanded to the query
    heads; ``allowed`` overrides the allowed set; ``base``: the float64 textbook already
    evaluated (:attr:`oracle.reading.case.CaseView.exact64`); ``prepared``: the case's
    :class:`~oracle.reading.baseline.PreparedKV` (the same parts, to the bit, sooner)."""
    if base is None:
        base = textbook_attention(
            q, k, v, dtype="float64", allowed=allowed, prepared=prepared, **options
        )
    w = np.where(np.isfinite(base.weights), base.weights, 0.0)
    if options.get("dropout_mask") is not None:
        keep = np.asarray(options["dropout_mask"], dtype=bool)
        w = np.where(keep, w, 0) / (1 - (options.get("dropout_p") or 0.0))
    w3 = w[None] if np.ndim(q) == 2 else w
    gqa = options.get("gqa") or "interleave"
    if prepared is not None and prepared.applies(k, v):  # v in float64, non-finite zeroed
        return base, w3, prepared.values(w3.shape[-3], gqa, np.dtype(np.float64))[0]
    v_h = expand_kv(with_heads(np.asarray(v, dtype=np.float64), "v"), w3.shape[-3], gqa)
    return base, w3, np.where(np.isfinite(v_h), v_h, 0.0)


def _flash_model(w3, v_h, p_dtype, sums="float32"):
    """P~ = w / max_j w (the exp of score minus row max) rounded to ``p_dtype``, P~ @ V
    summed in ``sums``, divided by l = 1 / max_j w."""
    top = w3.max(axis=-1, keepdims=True)
    with np.errstate(all="ignore"):
        p = np.where(top > 0, w3 / np.where(top > 0, top, 1), 0)
    p = cast_to(p, p_dtype) if p_dtype != "float64" else p
    if sums in _HALVES:
        # key by key in the narrow type: each product rounded to it, then a sequential sum
        narrow = _narrow_dtype(sums)
        terms = (
            p[..., :, :, None].astype(np.float32) * v_h[..., None, :, :].astype(np.float32)
        ).astype(narrow)
        pv = np.add.accumulate(terms, axis=-2, dtype=narrow)[..., -1, :].astype(np.float64)
    else:
        pv = np.matmul(p, v_h)
    return pv * np.where(top > 0, top, 0)


def narrow_accumulation_work(view) -> int:
    """The work (multiply-adds of a float64 reading) of :func:`narrow_accumulation` on the
    case ``view`` (:class:`oracle.reading.case.CaseView`): B H L S E products per half type;
    0 when the case is over :data:`MODEL_SIZE_CAP` (the models are not run)."""
    shapes = view.shapes
    products = shapes["B"] * shapes["H"] * shapes["L"] * shapes["S"] * shapes["E"]
    return 0 if products > MODEL_SIZE_CAP else products * len(_HALVES) * HALF_SUM_COST


def narrow_accumulation(view, out, truth, scale, *, k_factor=2.0):
    """A label when ``out``'s errors are of the size of ``P @ V`` summed key by key in
    float16 or bfloat16 (the closest in its largest normalised error), else None.

    ``view`` is the case (:class:`oracle.reading.case.CaseView`)."""
    q, k, v, options, dtype = view.q, view.k, view.v, view.options, view.dtype
    err = float(np.max(tol.normalised_error(out, truth, scale, dtype)))
    if not math.isfinite(err):
        return None
    fits = []
    with np.errstate(all="ignore"):
        _, w3, v_h = exact_parts(q, k, v, options, base=view.exact64)
        if w3.size * v_h.shape[-1] > MODEL_SIZE_CAP:
            return None
        for half in _HALVES:
            model = _flash_model(w3, v_h, "float64", sums=half)
            model = model[0] if np.ndim(q) == 2 else model
            model_err = float(np.max(tol.normalised_error(model, truth, scale, dtype)))
            if model_err / k_factor <= err <= k_factor * model_err + tol.unit_roundoff(dtype):
                fits.append(
                    (abs(math.log(err / model_err)) if model_err > 0 else math.inf, half, model_err)
                )
    if not fits:
        return None
    _, half, model_err = min(fits)
    return (
        f"errors consistent with accumulating P@V in {half} (a {half} accumulator; "
        f"such a kernel has normalised error {model_err:.3g} here)"
    )


def error_models(view, *, rounded=None) -> dict:
    """Outputs (float64, shaped like out) of the error models a grade compares against.

    By case dtype: the textbook in the dtype (float32 sums, stages stored in the dtype);
    the probabilities rounded to a 16-bit type before ``P @ V`` with float32 sums
    (FlashAttention's tensor-core path); ``P @ V`` summed key by key in a 16-bit type;
    TF32 matmuls (float32); float32 working precision and a float32 softmax (float64);
    and "correctly rounded" (the truth rounded once, ``rounded``). Score rounding is not
    modelled where the label does not say so (the models isolate one effect each).
    """
    q, k, v, options, dtype = view.q, view.k, view.v, view.options, view.dtype
    dtype = str(np.dtype(dtype)) if dtype != "bfloat16" else dtype
    models = {}
    single = np.ndim(q) == 2
    with np.errstate(all="ignore"):
        base, w3, v_h = exact_parts(q, k, v, options, base=view.exact64)

        def shaped(x):
            return x[0] if single else x

        text = view.textbook(dtype).out
        models[
            f"float32 sums, scores and weights stored in {dtype} (textbook)"
            if dtype in _HALVES
            else f"{dtype} textbook (two-pass softmax)"
        ] = np.asarray(text, dtype=np.float64)
        small = w3.size * v_h.shape[-1] <= MODEL_SIZE_CAP
        if dtype in _HALVES:
            models[f"P rounded to {dtype} before P@V, float32 sums (FlashAttention)"] = shaped(
                cast_to(_flash_model(w3, v_h, dtype), dtype)
            )
            if small:
                models[f"P@V accumulated in {dtype}"] = shaped(
                    cast_to(_flash_model(w3, v_h, dtype, sums=dtype), dtype)
                )
        elif dtype == "float32":
            for half in _HALVES:
                models[f"P rounded to {half} before P@V, float32 sums"] = shaped(
                    cast_to(_flash_model(w3, v_h, half), "float32")
                )
                if small:
                    models[f"P@V accumulated in {half}"] = shaped(
                        cast_to(_flash_model(w3, v_h, "float32", sums=half), "float32")
                    )
            tf32 = [cast_to(x, "tf32").astype(np.float32) for x in (q, k, v)]
            models["TF32 matmuls (q, k, v with 10-bit fractions)"] = np.asarray(
                textbook_attention(*tf32, dtype="float32", **options).out, dtype=np.float64
            )
        elif dtype == "float64":
            low = [np.asarray(x).astype(np.float32) for x in (q, k, v)]
            opts32 = {
                n: (
                    np.asarray(x).astype(np.float32)
                    if isinstance(x, np.ndarray) and x.dtype.kind == "f"
                    else x
                )
                for n, x in options.items()
            }
            models["float32 working precision"] = np.asarray(
                textbook_attention(*low, dtype="float32", **opts32).out, dtype=np.float64
            )
            models["float32 softmax, float64 matmuls"] = shaped(
                _flash_model(cast_to(w3, "float32"), v_h, "float64")
            )
        if rounded is not None:
            models["correctly rounded (higher precision, one rounding)"] = np.asarray(
                rounded, dtype=np.float64
            )
    return models
