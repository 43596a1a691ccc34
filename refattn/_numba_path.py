"""What refattn.attention checks and rewrites on the Numba CPU kernels (backend="numba")

Whether a kernel gathers the listed key indices itself (no dense (L, S) mask), the spec it
then reads, and the range check of the scores the kernels form directly in their compute
dtype; :func:`refattn.attention` and :func:`refattn.attention_vjp` call them.
"""

from __future__ import annotations

import numpy as np

from .spec import AttentionSpec

__all__ = ["check_numba_range", "numba_gather_spec", "numba_gathers", "without_listed"]

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

    from .kernels import abs_max as top  # max |x| over the finite entries, from x's bits

    dim = spec.q.shape[-1]
    from .kernels import GATHER

    k = spec.k if k_rows is None else k_rows
    listed = np.asarray(spec.key_indices) if spec.index_reading == GATHER else None
    if listed is not None and listed.size < k.shape[-2]:
        # the gather kernel reads only the listed keys: a sparse decode lists T << S of them,
        # so check those rows, not all of k (the union over batch rows and heads bounds
        # each); a prefill lists more entries than k has rows, and k itself is cheaper
        from .kernels import listed_keys

        k = listed_keys(k, listed)
    with np.errstate(over="ignore"):
        largest = abs(spec.scale_float) * dim * top(spec.q) * top(k)
    wide = np.dtype(compute_dtype) == np.float64
    if largest > 2.0 ** (MAX_EXPONENT if wide else MAX_EXPONENT_FLOAT32):
        reach = f"{largest:.3g}" if np.isfinite(largest) else "beyond 1.8e308"
        raise ValueError(
            f"q, k, scale: scores scale*q.k may reach {reach} (max |q| {top(spec.q):.3g}, "
            f"max |k| {top(k):.3g}, D = {dim}), beyond what backend='numba' computes "
            f"without overflow in {np.dtype(compute_dtype).name}; use backend='numpy' "
            "(float64, rescales such rows) or precision='exact'"
        )
