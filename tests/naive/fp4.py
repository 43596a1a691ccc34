"""fp4 dequantisation by loops, from the bit patterns (imports nothing from refattn).

e2m1 (OCP MX spec v1.0, table "FP4 E2M1"): bit 3 sign, bits 2-1 exponent (bias 1), bit 0
mantissa; exponent 0 is subnormal (0 or 0.5). e4m3fn: bit 7 sign, bits 6-3 exponent (bias 7),
bits 2-0 mantissa, 0x7F / 0xFF NaN, no Inf. e8m0: 2**(byte - 127), 0xFF NaN. Each value is a
:class:`fractions.Fraction` (NaN as float("nan")), and the dequantised element
``x * scale * descale`` is formed exactly and converted once to float64 (exact whenever the
product is a float64, which the tests check separately).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

__all__ = ["E2M1", "e4m3_value", "e8m0_value", "naive_dequantize", "pack_low_first"]

#: the sixteen e2m1 values by code, read off the format (not computed by a library)
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def e4m3_value(byte: int):
    """The e4m3fn value of ``byte`` as a Fraction (NaN as float)."""
    if byte & 0x7F == 0x7F:
        return float("nan")
    sign = -1 if byte & 0x80 else 1
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0:
        return sign * Fraction(mantissa, 8) * Fraction(1, 2**6)
    return sign * (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)


def e8m0_value(byte: int):
    """The e8m0 value of ``byte``: 2**(byte - 127), NaN for 0xFF."""
    return float("nan") if byte == 0xFF else Fraction(2) ** (byte - 127)


def naive_dequantize(codes, scale_bytes, scale_format, block, descale=None):
    """float64 (..., N, D) from e2m1 codes (..., N, D) (uint8 0..15) and scale bytes
    (..., N, D / block) (uint8) of ``scale_format`` ("e4m3" or "e8m0"), times ``descale``
    (a float, or an array (..., ) broadcast over (N, D); default 1), element by element."""
    codes, scale_bytes = np.asarray(codes), np.asarray(scale_bytes)
    decode = e4m3_value if scale_format == "e4m3" else e8m0_value
    out = np.empty(codes.shape, dtype=np.float64)
    factors = np.broadcast_to(
        np.asarray(1.0 if descale is None else descale, dtype=np.float64)[..., None, None],
        codes.shape,
    )
    for index in np.ndindex(codes.shape):
        x = E2M1[int(codes[index])]
        s = decode(int(scale_bytes[index[:-1] + (index[-1] // block,)]))
        if isinstance(s, float):  # NaN scale: the whole block is NaN
            out[index] = float("nan")
            continue
        exact = Fraction(x) * s * Fraction(float(factors[index]))
        # scales are >= 0, so the product has x's sign (-0.0 times anything stays -0.0)
        out[index] = math.copysign(float(exact), x)
    return out


def pack_low_first(codes):
    """uint8 (..., D / 2) from e2m1 codes (..., D): element 2i in the low nibble, 2i + 1 in
    the high one."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
