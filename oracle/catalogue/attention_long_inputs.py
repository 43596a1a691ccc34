"""Inputs of the long-row cases: cheap to draw, exact in every dtype, regenerated on load.

A long row (S up to 131072 keys) holds millions of inputs; the Irwin-Hall Gaussians of
:mod:`oracle.catalogue.seeding` cost twelve words each and bfloat16 rounding goes through an
object array, so these cases draw instead, from one SplitMix64 word per element, values on the
256-point grid ``(w >> 56) - 128`` times ``2**-6`` (uniform on [-2, 2), eight significant bits:
exactly representable in float64, float32, float16 and bfloat16, so the case dtype's rounding
is exact and a cast). Fixtures of these cases store no inputs: :mod:`oracle.golden_compact`
regenerates them on load and checks their sha256.

Recipe (``Case.recipe``, ``qkv = "long-grid"``)
-----------------------------------------------
``jumps`` (list of key indices, optional): every query's score at key ``jumps[m]`` is lifted to
about ``8 + 4 m`` (the rest of the row has scores of about N(0, 1.3)), so the row maximum moves
late in the row, after thousands of keys: a kernel that skips the ``exp(m_old - m_new)``
rescale of its accumulator there is off by the whole earlier mass.
``sigma`` (a power of two, default 1): q and k are multiplied by it (exact).
"""

from __future__ import annotations

import numpy as np

from . import attention_inputs
from .seeding import raw, stream_key

__all__ = ["grid"]


def grid(seed: int, name: str, shape) -> np.ndarray:
    """float64 values ``((w >> 56) - 128) * 2**-6`` in [-2, 2) (one word ``w`` per element)."""
    n = int(np.prod(shape, dtype=np.int64))
    words = (raw(stream_key(seed, name), n) >> np.uint64(56)).astype(np.int64) - 128
    return np.ldexp(words.astype(np.float64), -6).reshape(shape)


def _exact_cast(x: np.ndarray, dtype: str) -> np.ndarray:
    # every value has <= 8 significant bits and |x| < 2**14: the cast rounds nothing
    import ml_dtypes

    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    cast = x.astype(np.float32).astype(target)
    if not np.array_equal(cast.astype(np.float64), x):
        raise AssertionError("long-grid: a value is not exact in the case dtype")
    return cast


def _qkv_long_grid(stream, n, dtype, options, sigma, recipe):
    seed = stream.seed
    q = sigma * grid(seed, "q", (n.batch, n.H, n.L, n.D))
    k = sigma * grid(seed, "k", (n.batch, n.K, n.S, n.D))
    v = grid(seed, "v", (n.batch, n.K, n.S, n.E))
    jumps = [int(j) for j in recipe.get("jumps", ())]
    if jumps:
        scale = float(options.get("scale") or 1 / np.sqrt(n.D))
        q[..., 0] = 2.0
        for m, j in enumerate(jumps):
            # scale * 2 * k[j, 0] = 8 + 4 m, rounded to 8 significant bits (exact everywhere)
            target = (8.0 + 4.0 * m) / (2.0 * scale)
            exponent = np.frexp(target)[1]
            k[..., j, 0] = np.ldexp(np.round(np.ldexp(target, 8 - exponent)), exponent - 8)
    return tuple(_exact_cast(x, dtype) for x in (q, k, v))


# registered with the attention inputs (the recipe-aware builders)
attention_inputs._RECIPE_QKV["long-grid"] = _qkv_long_grid
