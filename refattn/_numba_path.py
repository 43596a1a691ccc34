"""What refattn.attention checks and rewrites on the Numba CPU kernels (backend="numba")

Whether a kernel gathers the listed key indices itself (no dense (L, S) mask), the spec it
then reads, and the range check of the scores the kernels form directly in their compute
dtype; :func:`refattn.attention` and :func:`refattn.attention_vjp` call them. A plain
sparse-key call (a decode step with no option but the scale) takes :func:`plain_gather`,
the same kernel without the general path's Python.
"""

from __future__ import annotations

import math

import numpy as np

from .spec import AttentionSpec, defaults

__all__ = [
    "check_numba_range",
    "numba_gather_spec",
    "numba_gathers",
    "plain_arrays",
    "plain_gather",
    "plain_scale",
    "is_default",
    "without_listed",
]

#: scaled scores are kept below 2**MAX_EXPONENT (float64) or 2**MAX_EXPONENT_FLOAT32
#: (float32): the margins of :mod:`refattn.attention`'s float64 path
MAX_EXPONENT = 1000
MAX_EXPONENT_FLOAT32 = 100


def without_listed(options: dict, gather: bool) -> dict:
    """The options with the listed key indices left out when a gather kernel reads them
    (:func:`numba_gather_spec` puts them back on the spec, without a dense mask)."""
    if gather:
        options.update(key_indices=None, key_block_indices=None, key_block_size=None)
    return options


def numba_gathers(
    backend, precision, reading, listed, normalizer, return_weights, sinks, kv_lengths
):
    """Whether the Numba kernels gather the key indices ``listed`` = (key_indices,
    key_block_indices, key_block_size) themselves (:func:`refattn.kernels.gathers`)."""
    if backend != "numba" or (listed[0] is None and listed[1] is None):
        return False
    from .kernels import gathers

    options = dict(
        normalizer=normalizer, return_weights=return_weights, sinks=sinks, kv_lengths=kv_lengths
    )
    return gathers(
        backend=backend,
        precision=precision,
        key_indices=listed[0],
        key_block_indices=listed[1],
        index_reading=reading,
        options=options,
    )


def numba_gather_spec(spec, listed):
    """:func:`refattn.kernels.gather_spec` of ``spec`` with ``listed`` (see
    :func:`numba_gathers`)."""
    from .kernels import gather_spec

    return gather_spec(spec, *listed)


def check_numba_range(spec: AttentionSpec, compute_dtype, k_rows=None) -> None:
    """The Numba kernels form ``s q.k`` directly in their compute dtype: refuse inputs whose
    scores may exceed its range (they would turn into NaN) and say what handles them."""
    from .kernels import GATHER

    k = spec.k if k_rows is None else k_rows
    listed = spec.key_indices if spec.index_reading == GATHER else None
    _check_scores_range(spec.q, k, listed, spec.scale_float, compute_dtype)


def _top(x) -> float:
    """max |x| over the finite entries (:func:`refattn.kernels.abs_max`: from the bits of a
    float16 or bfloat16 x, no float32 copy of a large k)."""
    from .kernels import abs_max

    return abs_max(x)


def _check_scores_range(q, k, listed, scale: float, compute_dtype) -> None:
    """:func:`check_numba_range` of q (B, H, L, D), k (B, K, S, D) and, for a gather forward,
    the (B, K, L, T) ``listed`` key indices (entries outside [0, S) ignored), else None."""
    dim = q.shape[-1]
    if listed is not None and np.asarray(listed).size < k.shape[-2]:
        # the gather kernel reads only the listed keys: a sparse decode lists T << S of them,
        # so check those rows, not all of k (the union over batch rows and heads bounds
        # each); a prefill lists more entries than k has rows, and k itself is cheaper
        from .kernels import listed_keys

        k = listed_keys(k, listed)
    largest = abs(scale) * dim * _top(q) * _top(k)  # Python floats: inf past the range
    wide = np.dtype(compute_dtype) == np.float64
    if largest > 2.0 ** (MAX_EXPONENT if wide else MAX_EXPONENT_FLOAT32):
        reach = f"{largest:.3g}" if np.isfinite(largest) else "beyond 1.8e308"
        raise ValueError(
            f"q, k, scale: scores scale*q.k may reach {reach} (max |q| {_top(q):.3g}, "
            f"max |k| {_top(k):.3g}, D = {dim}), beyond what backend='numba' computes "
            f"without overflow in {np.dtype(compute_dtype).name}; use backend='numpy' "
            "(float64, rescales such rows) or precision='exact'"
        )


#: The keywords of refattn.attention that a plain sparse-key call (:func:`plain_gather`)
#: leaves at their defaults: every option but the scale and the key indices, and the path
#: arguments the Numba gather forward ignores.
PLAIN_DEFAULTS = {
    **{name: value for name, value in defaults().items() if name not in ("scale", "key_indices")},
    "return_weights": False,
    "precision": "float64",
    "out_dtype": None,
}


def is_default(value, default) -> bool:
    """``value`` is ``default`` itself or an equal str/float (never an array comparison)."""
    if value is default:
        return True
    return type(value) is type(default) and isinstance(default, str | float) and value == default


def plain_scale(scale) -> bool:
    """``scale`` is None or a finite float (Python or NumPy float64): what a light path takes
    as it is."""
    return scale is None or (type(scale) in (float, np.float64) and math.isfinite(scale))


def plain_arrays(q, k, v, indices) -> bool:
    """q (B, H, L, D), k (B, K, S, D), v (B, K, S, E) plain float32 or float64 ndarrays of one
    dtype (no broadcasting, no empty axis, K dividing H) and (B, K, L, T) signed integer
    ``indices``: what canonicalize accepts unchanged."""
    arrays = (q, k, v, indices)
    if any(type(x) is not np.ndarray or x.ndim != 4 for x in arrays):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (np.float32, np.float64)):
        return False
    batch, heads, length, dim = q.shape
    _, kv_heads, keys, vdim = v.shape
    return (
        indices.dtype.kind == "i"
        and min(batch, heads, length, dim, kv_heads, keys, vdim, indices.shape[-1]) > 0
        and heads % kv_heads == 0
        and k.shape == (batch, kv_heads, keys, dim)
        and indices.shape[:3] == (batch, kv_heads, length)
    )


def plain_gather(call: dict):
    """refattn.attention's result for a plain sparse-key call on ``backend="numba"``, or None
    for any other call. ``call``: the keywords by name (refattn.attention's ``locals()``).

    Plain: q, k, v and ``key_indices`` as :func:`plain_arrays` reads them, a float scale
    (or None) and every other keyword at its default (:data:`PLAIN_DEFAULTS`). Such a call
    needs none of canonicalize's rewrites: the indices (entries outside [0, S) set to -1, then
    sorted) and the gather kernel's arguments (:func:`refattn.kernels.plain_gather_attention`)
    are formed directly, and the range check of :func:`check_numba_range` runs after the
    kernel on the largest |x| of the listed key rows that the kernel took while it read them
    (no second pass over the rows); same results and errors as the general path (a decode
    step spent a third of its time on the general path's Python and the separate pass).
    """
    q, k, v, indices, scale = (call[n] for n in ("q", "k", "v", "key_indices", "scale"))
    if not plain_arrays(q, k, v, indices):
        return None
    if not plain_scale(scale):
        return None
    if not all(is_default(call[name], value) for name, value in PLAIN_DEFAULTS.items()):
        return None
    from .kernels import listed_keys, plain_gather_attention

    keys = k.shape[-2]
    listed = np.where((indices >= 0) & (indices < keys), indices, -1).astype(np.int64)
    listed.sort(axis=-1)  # refattn.kernels._cpu_gather.sorted_indices
    scale = None if scale is None else float(scale)
    out, lse, top = plain_gather_attention(q, k, v, listed, scale)
    # the range check after the kernel (its result is only returned if the check passes):
    # the kernel read the listed rows, all of [0, S) being every row's interval here, and
    # took their largest |x| while they were in cache (listed_keys's value; with Inf among
    # them its NumPy reading skips the Inf)
    k_rows = k
    if listed.size < keys:
        k_rows = np.array([top], q.dtype) if math.isfinite(top) else listed_keys(k, listed)
    scale_float = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    _check_scores_range(q, k_rows, None, scale_float, q.dtype)
    return (out, lse) if call["return_lse"] else out
