"""Validation of the linear-attention arguments into one canonical call.

Every path (float64, exact, Numba) reads the same :class:`LinearCall`: float64 arrays in
refattn's (B, heads, T, features) layout with the key heads already expanded to the value
heads (value head j reads key head ``j // (HV // H)``), the sequences as (batch row, start,
stop) segments, and the options checked once.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .. import _checks, config

__all__ = [
    "LinearCall",
    "canonicalize",
    "cotangents",
    "fold_heads",
    "GATE_BASES",
    "L2NORM_EPS",
    "BACKENDS",
]

#: The epsilon inside the root of the query/key normalisation, ``x / sqrt(sum x^2 + eps)``
#: (flash-linear-attention's ``l2norm`` and transformers' qwen3_next ``l2norm`` default).
L2NORM_EPS = config.LINEAR_L2NORM_EPS
GATE_BASES = ("e", "2")
BACKENDS = ("numpy", "numba", "numba-chunked", "cuda")


@dataclass(frozen=True)
class LinearCall:
    """The canonical linear-attention call (all arrays float64, value heads expanded).

    q, k : (B, HV, T, D) raw (un-normalised) queries and keys of each value head
    v : (B, HV, T, E)
    g : None, (B, HV, T) (scalar gate) or (B, HV, T, D) (vector gate), log base ``gate_base``
    beta : None or (B, HV, T)
    h0 : None or (N, HV, D, E)
    segments : ((batch row, start, stop), ...) one per sequence n = 0 .. N-1
    scale : the float64 scale (``default_scale``: it is 1/sqrt(D), exact on the exact path)
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray | None
    beta: np.ndarray | None
    h0: np.ndarray | None
    segments: tuple
    scale: float
    default_scale: bool
    qk_l2norm: bool
    gate_base: str
    key_heads: int
    in_dtype: np.dtype

    @property
    def vector_gate(self) -> bool:
        return self.g is not None and self.g.ndim == 4

    @property
    def group(self) -> int:
        return self.v.shape[1] // self.key_heads

    @property
    def state_shape(self) -> tuple:
        return (len(self.segments), self.v.shape[1], self.q.shape[-1], self.v.shape[-1])

    @property
    def packed(self) -> bool:
        return len(self.segments) != self.q.shape[0] or any(
            (s, e) != (0, self.q.shape[2]) for _, s, e in self.segments
        )


def _float4(x, name, expected):
    arr = _checks.float_array(x, name)
    if arr.ndim != 4:
        raise ValueError(f"{name}: expected shape {expected} (4 dimensions), got {arr.shape}")
    return arr


def _segments(cu_seqlens, batch, length):
    if cu_seqlens is None:
        return tuple((b, 0, length) for b in range(batch))
    cu = _checks.as_array(cu_seqlens, "cu_seqlens")
    if cu.dtype.kind not in "iu" or cu.ndim != 1 or cu.size < 1:
        raise TypeError(
            "cu_seqlens: expected a 1-D integer array of sequence offsets [0, ..., T], got "
            f"dtype {cu.dtype.name} with shape {cu.shape}"
        )
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch B = 1 (q of B = {batch})")
    cu = [int(x) for x in cu]
    if cu[0] != 0 or cu[-1] != length or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(
            f"cu_seqlens: expected non-decreasing offsets from 0 to T = {length}, got {cu}"
        )
    return tuple((0, a, b) for a, b in zip(cu, cu[1:], strict=False))


def _heads(q, k, v):
    batch, heads, length, dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q (B, H, T, D) = {q.shape}, got {k.shape}")
    if v.shape[0] != batch or v.shape[2] != length:
        raise ValueError(
            f"v: expected shape (B, HV, T, E) with B = {batch}, T = {length} (from q), "
            f"got {v.shape}"
        )
    if heads == 0 or v.shape[1] % heads:
        raise ValueError(
            f"v: the value heads HV = {v.shape[1]} must be a positive multiple of the key heads "
            f"H = {heads} (q {q.shape})"
        )
    if dim == 0:
        raise ValueError(f"q: the key dimension D must be positive, got shape {q.shape}")


def _gate(g, value_shape, dim):
    if g is None:
        return None
    arr = _checks.float_array(g, "g")
    scalar, vector = value_shape[:3], value_shape[:3] + (dim,)
    if arr.shape not in (scalar, vector):
        raise ValueError(
            f"g: expected shape (B, HV, T) = {scalar} (scalar gate) or (B, HV, T, D) = {vector} "
            f"(vector gate), got {arr.shape}"
        )
    return arr


def _beta(beta, value_shape):
    if beta is None:
        return None
    arr = _checks.float_array(beta, "beta")
    if arr.shape != value_shape[:3]:
        raise ValueError(f"beta: expected shape (B, HV, T) = {value_shape[:3]}, got {arr.shape}")
    return arr


def _state(x, shape, name):
    if x is None:
        return None
    arr = _checks.float_array(x, name)
    if arr.shape != shape:
        raise ValueError(f"{name}: expected shape (N, HV, D, E) = {shape}, got {arr.shape}")
    return arr


def _scale(scale, dim):
    if scale is None:
        return 1.0 / math.sqrt(dim)
    return _checks.real_scalar(scale, "scale")


def _flag(value, name):
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def _base(gate_base):
    if isinstance(gate_base, numbers.Integral) and not isinstance(gate_base, bool):
        gate_base = str(int(gate_base))
    return _checks.choice(gate_base, "gate_base", GATE_BASES)


def canonicalize(
    q, k, v, g, beta, *, scale, initial_state, cu_seqlens, qk_l2norm, gate_base
) -> LinearCall:
    """Check every argument once and return the :class:`LinearCall` (named errors)."""
    q = _float4(q, "q", "(B, H, T, D)")
    k = _float4(k, "k", "(B, H, T, D)")
    v = _float4(v, "v", "(B, HV, T, E)")
    _heads(q, k, v)
    g = _gate(g, v.shape, q.shape[-1])
    beta = _beta(beta, v.shape)
    segments = _segments(cu_seqlens, q.shape[0], q.shape[2])
    state_shape = (len(segments), v.shape[1], q.shape[-1], v.shape[-1])
    h0 = _state(initial_state, state_shape, "initial_state")
    dtypes = [a.dtype for a in (q, k, v, g, beta, h0) if a is not None]
    group = v.shape[1] // q.shape[1]
    return LinearCall(
        q=np.repeat(_checks.as_float64(q), group, axis=1),
        k=np.repeat(_checks.as_float64(k), group, axis=1),
        v=_checks.as_float64(v),
        g=None if g is None else _checks.as_float64(g),
        beta=None if beta is None else _checks.as_float64(beta),
        h0=None if h0 is None else _checks.as_float64(h0),
        segments=segments,
        scale=_scale(scale, q.shape[-1]),
        default_scale=scale is None,
        qk_l2norm=_flag(qk_l2norm, "qk_l2norm"),
        gate_base=_base(gate_base),
        key_heads=q.shape[1],
        in_dtype=np.result_type(*dtypes),
    )


def cotangents(call: LinearCall, do, dht):
    """Validated (do (B, HV, T, E), dht (N, HV, D, E) or None) as float64."""
    do = _float4(do, "do", "(B, HV, T, E)")
    if do.shape != call.v.shape:
        raise ValueError(
            f"do: expected the shape of v (B, HV, T, E) = {call.v.shape}, got {do.shape}"
        )
    dht = _state(dht, call.state_shape, "dht")
    return _checks.as_float64(do), None if dht is None else _checks.as_float64(dht)


def fold_heads(grad: np.ndarray, key_heads: int) -> np.ndarray:
    """Sum a (B, HV, T, D) gradient over the value heads sharing a key head -> (B, H, T, D)."""
    b, hv = grad.shape[:2]
    return grad.reshape((b, key_heads, hv // key_heads) + grad.shape[2:]).sum(axis=2)
