"""Deterministic, NumPy-version-independent random numbers for the case catalogue.

The oracle's fixtures must be bit-identical on every machine and with every NumPy release, so
nothing here uses ``numpy.random.Generator`` (whose algorithms may change between releases) or a
host ``libm`` function (``log``/``cos`` differ in their last bit between C libraries). Every
value is built from 64-bit integers with exactly specified operations:

* **Raw stream** -- SplitMix64 in counter mode (Steele, Lea & Flood, "Fast splittable
  pseudorandom number generators", OOPSLA 2014): the ``n``-th word of stream ``key`` is
  ``mix(key + (n + 1) * 0x9E3779B97F4A7C15 mod 2**64)`` with
  ``mix(z) = z3 ^ (z3 >> 31)``, ``z3 = (z2 ^ (z2 >> 27)) * 0x94D049BB133111EB``,
  ``z2 = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9`` (all mod 2**64).
* **Stream keys** -- ``key = int.from_bytes(sha256(f"{seed}:{stream}").digest()[:8], "little")``,
  so each array of a case (q, k, v, mask, ...) has its own stream and adding an array to a
  recipe never shifts the others.
* **Uniform** -- ``(word >> 11) * 2**-53`` (exact in float64), in [0, 1).
* **Gaussian** -- Irwin-Hall with 12 terms: ``(sum_{t<12} (word_t >> 14) - 6 * 2**50) * 2**-50``
  (integer sum, exact in float64 since |value| < 2**53): mean 0, variance 1 up to 2**-50,
  support [-6, 6]. It is a smooth bell, not an exact normal; the oracle only needs reproducible
  realistic data.
* **Bernoulli(p)** -- ``(word >> 11) < floor(p * 2**53)`` with ``p`` taken at its exact
  binary value (Fraction), an integer comparison.

Further scaling uses only IEEE 754 basic operations (correctly rounded, hence identical on
every machine); rounding to the case dtype is done by :func:`to_dtype` (NumPy's casts for
float32/float16, refattn's integer rounder for bfloat16).
"""

from __future__ import annotations

import hashlib
from fractions import Fraction

import numpy as np

from refattn.exact.rounding import format_of, round_array

__all__ = ["stream_key", "raw", "uniform", "gaussian", "bernoulli", "to_dtype", "Streams"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def stream_key(seed: int, stream: str) -> int:
    """64-bit key of the named stream of a seed (sha256 based, see the module docstring)."""
    digest = hashlib.sha256(f"{seed}:{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def raw(key: int, n: int) -> np.ndarray:
    """The first ``n`` uint64 words of the SplitMix64 stream ``key`` (counter mode)."""
    counter = np.arange(1, n + 1, dtype=np.uint64)
    # uint64 array arithmetic wraps modulo 2**64 silently, which is the algorithm's definition
    z = np.full(n, key, dtype=np.uint64) + counter * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def uniform(key: int, shape) -> np.ndarray:
    """float64 uniforms on the grid k * 2**-53 in [0, 1)."""
    n = int(np.prod(shape, dtype=np.int64))
    return np.ldexp((raw(key, n) >> np.uint64(11)).astype(np.float64), -53).reshape(shape)


def gaussian(key: int, shape) -> np.ndarray:
    """float64 Irwin-Hall(12) variates: mean 0, variance 1, on the grid k * 2**-50."""
    n = int(np.prod(shape, dtype=np.int64))
    words = (raw(key, 12 * n) >> np.uint64(14)).reshape(n, 12)
    total = words.sum(axis=1, dtype=np.uint64).astype(np.int64) - 6 * (1 << 50)
    return np.ldexp(total.astype(np.float64), -50).reshape(shape)


def bernoulli(key: int, shape, p) -> np.ndarray:
    """Boolean array, True with probability ``p`` (exact dyadic threshold)."""
    n = int(np.prod(shape, dtype=np.int64))
    threshold = int(Fraction(p) * (1 << 53))
    return ((raw(key, n) >> np.uint64(11)) < np.uint64(threshold)).reshape(shape)


def to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values once to ``dtype`` (round to nearest, ties to even)."""
    fmt = format_of(dtype)
    if fmt.name == "bfloat16":
        # ml_dtypes may round float64 -> float32 -> bfloat16 (double rounding): round once
        # here, then the cast is exact
        return _round_bfloat16(np.asarray(x, dtype=np.float64), fmt).astype(fmt.dtype)
    return np.asarray(x, dtype=np.float64).astype(fmt.dtype)


#: |x| from which a float64 rounds to a normal bfloat16 (2**-126) and below which it overflows
_BF16_NORMAL, _BF16_TOP = 2.0**-126, 2.0**127


def _round_bfloat16(x: np.ndarray, fmt) -> np.ndarray:
    """float64 ``x`` rounded once to bfloat16's values (nearest, ties to even), as float64.

    In bfloat16's normal range the rounding is integer arithmetic on the float64 bits (keep
    the sign, the exponent and 7 of the 52 fraction bits, round half to even; a carry into
    the exponent is the correct result); zeros, subnormal results, overflow, inf and NaN go
    through refattn's integer-only rounder (:func:`refattn.exact.rounding.round_array`), as
    every element did before (same values, ~100x faster on large arrays)."""
    x = np.array(x, dtype=np.float64)
    size = np.abs(x)
    normal = (size >= _BF16_NORMAL) & (size < _BF16_TOP)
    bits = x[normal].view(np.uint64)
    low = np.uint64((1 << 45) - 1)
    odd = (bits >> np.uint64(45)) & np.uint64(1)
    bits = (bits + (np.uint64(1 << 44) - np.uint64(1)) + odd) & ~low
    x[normal] = bits.view(np.float64)
    rest = ~normal
    if rest.any():
        x[rest] = round_array(np.asarray(x[rest], dtype=object), fmt).astype(np.float64)
    return x


class Streams:
    """Named random streams of one seed (one stream per array, see this module)."""

    def __init__(self, seed: int):
        self.seed = seed

    def gaussian(self, name, shape):
        return gaussian(stream_key(self.seed, name), shape)

    def uniform(self, name, shape):
        return uniform(stream_key(self.seed, name), shape)

    def bernoulli(self, name, shape, p):
        return bernoulli(stream_key(self.seed, name), shape, p)
