"""fp4 inputs with block scales (NVFP4, MXFP4): the dequantisation rule, stated once.

:func:`refattn.spec.canonicalize` calls :func:`dequantize_blocks` through
:func:`refattn.quantized.dequantize_inputs` (the
one home of input formats), so every path (float64, exact, Numba CPU, CUDA; forward and vjp)
sees the same float64 values.

Formats (``ml_dtypes``; OCP Microscaling Formats spec v1.0 for MXFP4, NVIDIA's NVFP4):

* element ``float4_e2m1fn``: 1 sign, 2 exponent, 1 mantissa bit, values
  {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives; no Inf, no NaN;
* NVFP4: one ``float8_e4m3fn`` scale per block of 16 consecutive features (the scale's sign
  bit is unused: a negative scale is an error; 0x7F/0xFF are NaN), plus the float32 global
  scale, which is refattn's ``*_descale``;
* MXFP4: one ``float8_e8m0fnu`` scale (a power of two 2**(e - 127), e in 0..254; 0xFF is NaN)
  per block of 32 consecutive features, and an optional global ``*_descale`` as well.

Blocks run along the last (feature) axis D (or E for v), one row of scales per key / query
position: for x of shape (..., S, D) the scale has shape (..., S, D / n) and

.. math::

    \\hat x_{\\ldots s d} = x_{\\ldots s d} \\cdot \\mathrm{scale}_{\\ldots s \\lfloor d / n
    \\rfloor} \\cdot \\mathrm{descale}

with n = 16 (NVFP4) or 32 (MXFP4), read from the scale's dtype and checked against D / (the
scale's last axis).

Exactness: every product is exact in float64. An e2m1 value has a 2-bit significand, an e4m3
scale 4 bits (e8m0: 1), a float32 descale 24: the product needs at most 30 of float64's 53
bits. Magnitudes: nonzero |x| >= 2**-1 and <= 6, e4m3 scales in [2**-9, 448], e8m0 in
[2**-127, 2**127], float32 in [2**-149, 2**128): every nonzero product lies in
[2**-277, 2**261], inside float64's normal range [2**-1022, 2**1024). So the dequantised
input is the real value ``x * scale * descale``, whatever the order of the two products.

A NaN scale (e4m3 0x7F/0xFF, e8m0 0xFF) makes its whole block NaN, zeros included (the
value ``x * NaN``, as every kernel multiplying by it computes); NaN then follows refattn's
non-finite rules (a NaN key or value at an excluded position never reaches the output).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "FP4_DTYPES",
    "BLOCK_SIZES",
    "block_factors",
    "code_table",
    "dequantize_blocks",
    "is_fp4",
]

#: The fp4 element formats that take a block scale.
FP4_DTYPES = ("float4_e2m1fn",)

#: Block size of each scale format: NVFP4 (e4m3 per 16 values), MXFP4 (e8m0 per 32).
BLOCK_SIZES = {"float8_e4m3fn": 16, "float8_e8m0fnu": 32}

_FORMAT = {"float8_e4m3fn": "NVFP4", "float8_e8m0fnu": "MXFP4"}


def is_fp4(x) -> bool:
    """True when ``x`` is an array of an fp4 element format (see :data:`FP4_DTYPES`)."""
    return getattr(getattr(x, "dtype", None), "name", None) in FP4_DTYPES


def block_factors(x, block_scale, name: str):
    """The checked block scales of fp4 ``x`` as float64 factors, and the block size n.

    Parameters
    ----------
    x, block_scale, name
        As :func:`dequantize_blocks` (the same checks and messages).

    Returns
    -------
    factors : float64 array (..., N, D / n)
        ``block_scale`` decoded exactly (every e4m3 / e8m0 value is a float64).
    size : int
        n: 16 (NVFP4) or 32 (MXFP4).

    Examples
    --------
    >>> import ml_dtypes, numpy as np
    >>> x = np.zeros((1, 32), ml_dtypes.float4_e2m1fn)
    >>> factors, size = block_factors(x, np.array([[4.0]], ml_dtypes.float8_e8m0fnu), "k")
    >>> factors.tolist(), size
    ([[4.0]], 32)
    """
    arg = f"{name}_block_scale"
    if block_scale is None:
        raise ValueError(
            f"{arg}: {name} of dtype float4_e2m1fn needs block scales: float8_e4m3fn of shape "
            f"{x.shape[:-1] + (max(x.shape[-1] // 16, 1),)} (NVFP4) or float8_e8m0fnu of shape "
            f"{x.shape[:-1] + (max(x.shape[-1] // 32, 1),)} (MXFP4)"
        )
    scale = np.asarray(block_scale)
    kind = scale.dtype.name
    if kind not in BLOCK_SIZES:
        raise TypeError(
            f"{arg}: expected dtype float8_e4m3fn (NVFP4, one scale per 16 values) or "
            f"float8_e8m0fnu (MXFP4, one per 32), got {kind}"
        )
    if x.ndim < 1 or scale.shape[:-1] != x.shape[:-1] or scale.ndim != x.ndim:
        raise ValueError(
            f"{arg}: expected shape {x.shape[:-1]} + (D / block,) (one row of scales per "
            f"position of {name} {x.shape}, blocks along the last axis), got {scale.shape}"
        )
    features, blocks = x.shape[-1], scale.shape[-1]
    size = features // blocks if blocks and features % blocks == 0 else None
    if size != BLOCK_SIZES[kind]:
        raise ValueError(
            f"{arg}: {_FORMAT[kind]} ({kind}) takes one scale per {BLOCK_SIZES[kind]} values, "
            f"so {features} features need {features / BLOCK_SIZES[kind]:g} scales on the last "
            f"axis; got {blocks} (shape {scale.shape})"
        )
    factors = _decode(scale)  # exact: every e4m3 / e8m0 value is a float64
    if (factors < 0).any():
        raise ValueError(
            f"{arg}: expected non-negative scales (NVFP4's scale is unsigned e4m3; the sign "
            f"bit is unused), got {factors[factors < 0][0]}"
        )
    return factors, size


def dequantize_blocks(x, block_scale, name: str) -> np.ndarray:
    """fp4 ``x`` (..., N, D) times its block scales (..., N, D / n), exactly, as float64.

    Parameters
    ----------
    x : float4_e2m1fn array (..., N, D)
        The fp4 elements (N: S for k and v, L for q; D: the feature axis, E for v).
    block_scale : float8_e4m3fn array (..., N, D / 16) or float8_e8m0fnu array (..., N, D / 32)
        NVFP4 or MXFP4 block scales; the block size n comes from the dtype and must equal
        D / (the scale's last axis).
    name : str
        "q", "k" or "v" (for the messages).

    Returns
    -------
    float64 array (..., N, D): ``x[..., d] * block_scale[..., d // n]``, exact (module
    docstring); the global ``*_descale`` is applied by the caller.

    Examples
    --------
    >>> import ml_dtypes, numpy as np
    >>> x = np.full((1, 32), 1.5, ml_dtypes.float4_e2m1fn)
    >>> s = np.array([[2.0]], ml_dtypes.float8_e8m0fnu)
    >>> dequantize_blocks(x, s, "k")[0, :2].tolist()
    [3.0, 3.0]
    """
    factors, size = block_factors(x, block_scale, name)
    blocks = factors.shape[-1]
    values = _decode(x).reshape(x.shape[:-1] + (blocks, size))  # exact
    return (values * factors[..., None]).reshape(x.shape)  # exact, see the module docstring


def _decode(x) -> np.ndarray:
    """float64 values of a one-byte ml_dtypes array through its 256-entry table (the cast
    itself is an element-by-element loop in ml_dtypes; the table holds the same values)."""
    return code_table(x.dtype)[np.ascontiguousarray(x).view(np.uint8)]


def code_table(dtype) -> np.ndarray:
    """float64 (256,): the value of every byte of a one-byte ml_dtypes format (fp4: the code
    in the low nibble, the high one ignored); read-only, exact (every value is a float64).

    Examples
    --------
    >>> import ml_dtypes
    >>> code_table(ml_dtypes.float4_e2m1fn)[[0x01, 0x07, 0x17]].tolist()
    [0.5, 6.0, 6.0]
    """
    dtype = np.dtype(dtype)
    table = _TABLES.get(dtype.name)
    if table is None:
        table = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
        if dtype.name in FP4_DTYPES:  # the code sits in the low nibble
            table = np.tile(table[:16], 16)
        table.flags.writeable = False
        _TABLES[dtype.name] = table
    return table


_TABLES: dict = {}
