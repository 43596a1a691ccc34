"""Inputs of the long-row cases: cheap to draw, exact in every dtype, regenerated on load.

A long row (S up to 131072 keys) holds millions of inputs; the Irwin-Hall Gaussians of
:mod:`oracle.catalogue.seeding` cost twelve words each and bfloat16 rounding goes through an
object array, so these cases draw instead, from one SplitMix64 word per element, values on the
256-point grid ``(w >> 56) - 128`` times ``2**-6`` (uniform on [-2, 2), eight significant bits:
exactly representable in float64, float32, float16 and bfloat16, so the case dtype's rounding
is exact and a cast). Fixtures of these cases store no inputs: :mod:`oracle.fixtures.compact`
regenerates them on load and checks their sha256.

Recipe (``Case.recipe``, ``qkv = "long-grid"``)
-----------------------------------------------
``jumps`` (list of key indices, optional): every query's score at key ``jumps[m]`` is lifted to
about ``8 + 4 m`` (the rest of the row has scores of about N(0, 1.3)), so the row maximum moves
late in the row, after thousands of keys: a kernel that skips the ``exp(m_old - m_new)``
rescale of its accumulator there is off by the whole earlier mass.
``jump_base``, ``jump_step`` (default 8 and 4): the lifted score of ``jumps[m]`` is
``jump_base + jump_step m`` (with ``fade``: exactly, the jump keys' other components zeroed).
``fade`` (a key index, optional): the row's mass sits before key ``fade`` (every score there is
lifted by 3, the keys from ``fade`` on weigh about e^-3 as much) and ``v`` is shifted by -1 before
it and +1 from it on, so the output does not cancel: a kernel whose float16 accumulator (of the
denominator or of ``P @ V``) past ``fade`` keys drops the faint tail's tile sums (each under
half an ulp of the sum) is off by the tail's whole mass, about 5% at twice ``fade`` keys.
``sigma`` (a power of two, default 1): q and k are multiplied by it (exact).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from oracle.catalogue import attention_inputs
from oracle.catalogue.seeding import raw, stream_key

__all__ = ["grid"]


def grid(seed: int, name: str, shape) -> np.ndarray:
    """float64 values ``((w >> 56) - 128) * 2**-6`` in [-2, 2) (one word ``w`` per element)."""
    n = int(np.prod(shape, dtype=np.int64))
    words = (raw(stream_key(seed, name), n) >> np.uint64(56)).astype(np.int64) - 128
    return np.ldexp(words.astype(np.float64), -6).reshape(shape)


def _exact_cast(x: np.ndarray, dtype: str) -> np.ndarray:
    # every value has <= 8 significant bits and |x| < 2**14: the cast rounds nothing
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
    scale = float(options.get("scale") or 1 / np.sqrt(n.D))
    fade = recipe.get("fade")
    if fade is not None:
        q[..., 0] = 2.0
        # scale * 2 * k[:fade, 0] = 3 (a power-of-two multiple of 3/2: exact everywhere)
        k[..., :fade, 0] = 3.0 / (2.0 * scale)
        k[..., fade:, 0] = 0.0
        v[..., :fade, :] -= 1.0  # |v| < 4 on the 2**-6 grid: still 8 significant bits
        v[..., fade:, :] += 1.0
    if jumps:
        q[..., 0] = 2.0
        base, step = float(recipe.get("jump_base", 8.0)), float(recipe.get("jump_step", 4.0))
        for m, j in enumerate(jumps):
            # scale * 2 * k[j, 0] = base + step m, rounded to 8 significant bits (exact)
            target = (base + step * m) / (2.0 * scale)
            exponent = np.frexp(target)[1]
            k[..., j, 0] = np.ldexp(np.round(np.ldexp(target, 8 - exponent)), exponent - 8)
            if fade is not None:
                k[..., j, 1:] = 0.0  # the lifted score exactly: the mass stays in the head
    return tuple(_exact_cast(x, dtype) for x in (q, k, v))


# registered with the attention inputs (the recipe-aware builders)
attention_inputs._RECIPE_QKV["long-grid"] = _qkv_long_grid
