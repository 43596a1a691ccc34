"""Quantised inputs of :func:`refattn.attention`: float8 (with descale factors) and float4
(NVFP4 / MXFP4 block scales), turned into their exact float64 values.

:func:`refattn.spec.canonicalize` calls :func:`dequantize_inputs` first, so every path (float64,
exact, Numba, CUDA; forward and vjp) sees the same dequantised values and the truth is the exact
result of those values (docs/conventions.md, "float8 inputs" and "fp4 inputs").

Examples
--------
>>> import numpy as np, ml_dtypes
>>> q = np.ones((1, 1, 2), ml_dtypes.float8_e4m3fn)
>>> k = v = np.ones((1, 1, 2))
>>> dq, dk, dv = dequantize_inputs(q, k, v, np.array([0.5], np.float32), None, None, "interleave")
>>> dq.tolist()
[[[0.5, 0.5]]]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _checks
from .blockscale import block_factors, code_table, dequantize_blocks, is_fp4

__all__ = ["FP8_DTYPES", "QuantisedRows", "dequantize_inputs", "quantised_rows"]

#: float8 input dtypes (ml_dtypes names) that take a ``*_descale`` factor
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def dequantize_inputs(q, k, v, q_descale, k_descale, v_descale, gqa, block_scales=None):
    """q, k, v as float arrays; fp8 inputs (ml_dtypes float8_e4m3fn / float8_e5m2) times their
    float32 descale factors, exactly (a float8 significand has at most 4 bits and a float32
    one 24: the product needs at most 28 of float64's 53 and stays in its range), as
    float64. fp4 inputs (float4_e2m1fn) are first multiplied by their NVFP4/MXFP4 block
    scales (:func:`refattn.blockscale.dequantize_blocks`, exact too), then by the descale."""
    block_scales = block_scales or {}
    arrays = {}
    for name, x, descale in (("q", q, q_descale), ("k", k, k_descale), ("v", v, v_descale)):
        raw = _checks.as_array(x, name) if x is not None else None
        blocks = block_scales.get(name)
        rows = _large_rows(raw, descale, blocks, name)
        if rows is not None:  # the same values, in one compiled pass
            from .kernels._cpu_codes import dequantised_rows

            arrays[name] = (dequantised_rows(rows, np.float64), None)
            continue
        if raw is not None and is_fp4(raw):
            arrays[name] = (dequantize_blocks(raw, blocks, name), descale)
            continue
        if blocks is not None:
            raise ValueError(
                f"{name}_block_scale: only float4_e2m1fn inputs take block scales "
                f"({name} has dtype {getattr(raw, 'dtype', None)})"
            )
        if raw is not None and raw.dtype.name in FP8_DTYPES:
            arrays[name] = (raw, descale)
        else:
            if descale is not None:
                raise ValueError(
                    f"{name}_descale: only float8 inputs and float4 ones take a descale factor "
                    f"({name} has dtype {getattr(raw, 'dtype', None)})"
                )
            arrays[name] = (_checks.float_array(x, name), None)
    quantised = {n for n, x in (("q", q), ("k", k), ("v", v)) if is_fp4(x)}
    if not quantised and all(
        d is None and a.dtype.name not in FP8_DTYPES for a, d in arrays.values()
    ):
        return arrays["q"][0], arrays["k"][0], arrays["v"][0]
    kv_heads = arrays["k"][0].shape[-3] if arrays["k"][0].ndim >= 3 else 1
    heads = arrays["q"][0].shape[-3] if arrays["q"][0].ndim >= 3 else 1
    out = []
    for name in ("q", "k", "v"):
        raw, descale = arrays[name]
        if raw.dtype.name not in FP8_DTYPES and name not in quantised:
            out.append(raw)
            continue
        # exact: every float8 value is a float64 (fp4 ones are already float64)
        values = raw if name in quantised else raw.astype(np.float64)
        if descale is not None:
            per_head = descale_factors(descale, name, kv_heads)
            if per_head.ndim and name == "q":  # query head h uses the factor of its kv head
                group = heads // kv_heads
                reads = (
                    np.arange(heads) // group
                    if gqa == "interleave"
                    else np.arange(heads) % kv_heads
                )
                per_head = np.take(per_head, reads, axis=-3)
            values = values * per_head  # exact, see above
        out.append(values)
    return tuple(out)


#: Elements of a k or v from which :func:`dequantize_inputs` dequantises in a compiled pass
#: (:func:`refattn.kernels._cpu_codes.dequantised_rows`; the same exact values) rather than
#: by NumPy table look-ups and products.
COMPILED_DEQUANTISE = 1 << 16


def _large_rows(raw, descale, blocks, name):
    """:func:`quantised_rows` of a large quantised k or v (None otherwise)."""
    if name == "q" or raw is None or raw.size < COMPILED_DEQUANTISE:
        return None
    return quantised_rows(raw, descale, blocks, name)


def descale_factors(descale, name: str, kv_heads: int) -> np.ndarray:
    """The checked ``*_descale`` as float64 factors shaped to multiply (..., K, N, D) values:
    (..., K, 1, 1), or a 0-d array for a scalar factor.

    float32 only (a float64 factor could make the product round), finite and positive, one
    per batch row and kv head.

    Examples
    --------
    >>> descale_factors(np.array([0.5, 2.0], np.float32), "k", 2)[:, 0, 0].tolist()
    [0.5, 2.0]
    """
    kind = _checks.float_array(descale, f"{name}_descale").dtype.name
    if kind != "float32":  # float64 factors could make the product round
        raise TypeError(
            f"{name}_descale: expected float32 factors (FlashAttention 3's descale type), "
            f"got {kind}"
        )
    factor = _checks.as_float64(np.asarray(descale))
    if not np.isfinite(factor).all() or (factor <= 0).any():
        raise ValueError(f"{name}_descale: expected finite positive factors")
    if factor.ndim and factor.shape[-1] != kv_heads:
        raise ValueError(
            f"{name}_descale: expected shape (..., K = {kv_heads}) (one factor per batch row "
            f"and kv head), got {factor.shape}"
        )
    return factor[..., None, None] if factor.ndim else factor


class QuantisedRows(NamedTuple):
    """k or v (..., K, N, D) kept as its one-byte codes and one float64 factor per block of
    n consecutive features: the value of element d of row s is

    .. math::

        x_{\\ldots s d} = \\mathrm{table}[\\mathrm{codes}_{\\ldots s d}] \\cdot
        \\mathrm{factors}_{\\ldots s \\lfloor d / n \\rfloor},
        \\qquad n = D / \\mathrm{factors.shape[-1]},

    the factor being block scale times ``*_descale`` (fp4) or the descale alone (fp8, one
    block of D features). Every factor and every product is exact in float64
    (:mod:`refattn.blockscale`), so the value is the one :func:`dequantize_inputs` returns:
    the kernels dequantise a tile of rows as they load it (:mod:`refattn.kernels`).

    Attributes
    ----------
    codes : uint8 array (..., K, N, D), C-contiguous
    factors : float64 array (..., K, N, D / n), C-contiguous
    table : float64 array (256,): the value of every code (:func:`refattn.blockscale.code_table`)
    """

    codes: np.ndarray
    factors: np.ndarray
    table: np.ndarray

    @property
    def shape(self) -> tuple:
        """The shape of the values (that of the codes)."""
        return self.codes.shape

    def dequantised(self) -> np.ndarray:
        """The float64 values (exact; what :func:`dequantize_inputs` returns)."""
        blocks = self.factors.shape[-1]
        values = self.table[self.codes].reshape(self.shape[:-1] + (blocks, -1))
        return (values * self.factors[..., None]).reshape(self.shape)


def quantised_rows(x, descale, block_scale, name: str):
    """k or v of a float8 or float4 dtype as :class:`QuantisedRows` (None for any other dtype,
    or when ``*_descale`` has batch dimensions that ``x`` lacks); the checks and messages of
    :func:`dequantize_inputs`.

    Examples
    --------
    >>> import ml_dtypes
    >>> k = np.full((1, 2, 32), 1.5, ml_dtypes.float4_e2m1fn)
    >>> scale = np.full((1, 2, 1), 4.0, ml_dtypes.float8_e8m0fnu)
    >>> rows = quantised_rows(k, np.array([0.5], np.float32), scale, "k")
    >>> rows.factors.ravel().tolist(), rows.dequantised()[0, 0, :2].tolist()
    ([2.0, 2.0], [3.0, 3.0])
    """
    raw = _checks.as_array(x, name)
    fp4 = is_fp4(raw)
    if not fp4 and raw.dtype.name not in FP8_DTYPES:
        return None
    if block_scale is not None and not fp4:
        raise ValueError(
            f"{name}_block_scale: only float4_e2m1fn inputs take block scales "
            f"({name} has dtype {raw.dtype})"
        )
    if raw.ndim < 3:
        return None
    if fp4:
        factors, _ = block_factors(raw, block_scale, name)
    else:
        factors = np.ones(raw.shape[:-1] + (1,))
    if descale is not None:
        factors = factors * descale_factors(descale, name, raw.shape[-3])  # exact
    if factors.shape[:-1] != raw.shape[:-1]:  # a descale with more batch rows than x
        return None
    codes = np.ascontiguousarray(raw).view(np.uint8)
    return QuantisedRows(codes, np.ascontiguousarray(factors), code_table(raw.dtype))
