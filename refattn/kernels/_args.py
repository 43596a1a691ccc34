"""The argument layout shared by the CPU (:mod:`.numba_cpu`) and CUDA (:mod:`.cuda`) kernels.

An :class:`~refattn.spec.AttentionSpec` becomes a fixed tuple of flat arrays (kernels take no
Python objects): the tensors in the compute dtype, the shape vector ``dims``, the integer and
float option vectors ``opts`` and ``fopts``, and the tuple ``terms`` of the optional
per-position terms: every (B, H, L, S) plane (bias, mask, dropout) as flat data with element
strides (0 on broadcast axes), and the ALiBi slopes.

Compiled functions take these records (and the kernels' own tuples of work arrays) instead of
long positional lists: a heterogeneous tuple of arrays costs nothing in Numba (it is passed as
its fields), and no compiled function takes more than 12 parameters. The CUDA kernels cannot
take tuples of device arrays, so :mod:`.cuda` stacks the same arrays into a few larger ones.
"""

from __future__ import annotations

import numpy as np

from .._arrays import read_only
from ..spec import window_sides

#: The slots of ``dims``, in :attr:`refattn.spec.AttentionSpec.dims`' order (B, H, K, L, S, D, E).
DIMS = ("batch", "heads", "kv_heads", "length", "keys", "dim", "vdim")
#: The slots of the integer option vector ``opts`` (window sides -1 when unbounded).
OPTS = (
    "offset",
    "causal",
    "left",
    "right",
    "has_softcap",
    "has_bias",
    "has_mask",
    "has_alibi",
    "has_dropout",
    "empty_rows_nan",
)
#: The fields of ``terms``, the last element of :func:`kernel_arguments`, in order.
TERMS = ("bias", "bias_strides", "mask", "mask_strides", "drop", "drop_strides", "slopes")
#: The slots of the float option vector ``fopts`` (softcap 1 when off; keep_scale 1/(1-p)).
FOPTS = ("scale", "softcap", "keep_scale", "neg_inf")


def index_constants(prefix: str, names) -> dict:
    """``{PREFIX + NAME: slot}`` for a tuple of slot names: the kernels read an argument vector
    by these module-level ints (compile-time constants in Numba), never by a bare number.

    Examples
    --------
    >>> index_constants("DIM_", ("batch", "heads"))
    {'DIM_BATCH': 0, 'DIM_HEADS': 1}
    """
    return {prefix + name.upper(): slot for slot, name in enumerate(names)}


# DIM_BATCH ... DIM_VDIM, OPT_OFFSET ... OPT_EMPTY_ROWS_NAN, FOPT_SCALE ... FOPT_NEG_INF,
# TERM_BIAS ... TERM_SLOPES
_SLOTS = {
    **index_constants("DIM_", DIMS),
    **index_constants("OPT_", OPTS),
    **index_constants("FOPT_", FOPTS),
    **index_constants("TERM_", TERMS),
}
globals().update(_SLOTS)

__all__ = [  # noqa: PLE0604 (the slot constants are generated from the tuples above)
    "DIMS",
    "OPTS",
    "FOPTS",
    "TERMS",
    "index_constants",
    "kernel_arguments",
    "plane",
    "read_only",
    *_SLOTS,
]


def plane(view):
    """A (B, H, L, S) view as (1-D contiguous data, element strides); (dummy, zeros) for None.

    Broadcast axes (stride 0) keep stride 0, so a broadcast plane is never materialised.

    Examples
    --------
    >>> data, strides = plane(np.broadcast_to(np.arange(3.0), (2, 4, 5, 3)))
    >>> data.tolist(), strides.tolist()
    ([0.0, 1.0, 2.0], [0, 0, 0, 1])
    """
    if view is None:
        return read_only(np.zeros(1, np.float64)), np.zeros(4, np.int64)
    compact = view[tuple(slice(0, 1) if st == 0 else slice(None) for st in view.strides)]
    data = np.require(compact, requirements=["C"])
    if data.dtype == np.bool_:
        data = data.view(np.uint8)
    strides = np.array(
        [
            0 if st == 0 else ds // data.itemsize
            for st, ds in zip(view.strides, data.strides, strict=True)
        ],
        np.int64,
    )
    return read_only(data.reshape(-1)), strides


def kernel_arguments(spec, dtype, bf16_bits=False):
    """The kernels' positional arguments for ``spec`` in compute ``dtype``.

    With ``bf16_bits`` (compute dtype float32), a bfloat16 k or v passes as its uint16 bits
    (a view, no copy) for the loads that widen them as they read
    (:mod:`refattn.kernels._cpu_codes`): a decode step reads 2 bytes per element once
    instead of converting all of k and v first.

    Returns ``(q, k, v, kv_head, dims, opts, fopts, terms)``: q, k, v C-contiguous in
    ``dtype``; ``kv_head`` (H,) int64; ``dims`` =
    ``[B, H, K, L, S, D, E]`` int64 (:data:`DIMS`); ``opts`` int64 (:data:`OPTS`: offset,
    causal, left, right, has_softcap, has_bias, has_mask, has_alibi, has_dropout,
    empty_rows_nan; window sides -1 when unbounded); ``fopts`` in ``dtype`` (:data:`FOPTS`:
    scale, softcap (1 when off), 1/(1-p), -inf); the kernels read them by the slot
    constants (``DIM_KEYS``, ``OPT_CAUSAL``, ``FOPT_SCALE``, ...); ``terms`` = ``(bias,
    bias_strides, mask, mask_strides, drop, drop_strides, slopes)`` (:data:`TERMS`): each
    optional (B, H, L, S) plane as (flat data, element strides) from :func:`plane` (mask
    and dropout as uint8) and ``slopes`` (H,) float64 or a dummy. Every array input is a
    read-only view (:func:`read_only`): the kernels never write to them.

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 5, 4)), np.zeros((1, 2, 5, 4)))
    >>> args = kernel_arguments(spec, np.float64)
    >>> args[4].tolist(), args[5][:2].tolist()
    ([1, 2, 2, 3, 5, 4, 4], [0, 0])
    """
    left, right = window_sides(spec.window)  # -1: an unbounded side (spec.UNBOUNDED)
    dims = np.array(spec.dims, np.int64)
    option_values = dict(
        offset=spec.offset,
        causal=spec.causal,
        left=left,
        right=right,
        has_softcap=spec.softcap is not None,
        has_bias=spec.bias is not None,
        has_mask=spec.mask is not None,
        has_alibi=spec.alibi_slopes is not None,
        has_dropout=spec.dropout_mask is not None,
        empty_rows_nan=spec.empty_rows == "nan",
    )
    opts = np.array([option_values[name] for name in OPTS], np.int64)
    float_values = dict(
        scale=spec.scale_float,
        softcap=spec.softcap or 1.0,
        keep_scale=1.0 / (1.0 - spec.dropout_p),
        neg_inf=-np.inf,
    )
    fopts = np.array([float_values[name] for name in FOPTS], dtype)
    bias, bstr = plane(spec.bias)
    mask, mstr = plane(spec.mask)
    drop, dstr = plane(spec.dropout_mask)
    if mask.dtype != np.uint8:
        mask = read_only(mask.astype(np.uint8))
    if drop.dtype != np.uint8:
        drop = read_only(drop.astype(np.uint8))
    slopes = read_only(
        np.zeros(1)
        if spec.alibi_slopes is None
        else np.require(spec.alibi_slopes, np.float64, ["C"])
    )
    # read-only views: no copy of a read-only (e.g. broadcast-view) input, one array type
    q, k, v = (read_only(_operand(a, dtype, bf16_bits)) for a in (spec.q, spec.k, spec.v))
    if bf16_bits:
        q = read_only(np.require(spec.q, dtype, ["C"]))
    kv_head = read_only(np.require(spec.kv_head, np.int64, ["C"]))
    terms = (bias, bstr, mask, mstr, drop, dstr, slopes)
    return q, k, v, kv_head, dims, opts, fopts, terms


def _operand(a, dtype, bf16_bits):
    """``a`` C-contiguous in ``dtype``; with ``bf16_bits`` a bfloat16 array (compute dtype
    float32) as its C-contiguous uint16 bits instead."""
    a = np.asarray(a)
    if bf16_bits and a.dtype.name == "bfloat16" and np.dtype(dtype) == np.float32:
        return np.require(a, requirements=["C"]).view(np.uint16)
    return np.require(a, dtype, ["C"])
