"""Planted linear-attention kernels: two correct ones and one per named bug.

Each kernel takes refattn's calling convention for :func:`refattn.linear_attention` (q, k, v,
g, beta, initial_state, cu_seqlens, output_final_state, qk_l2norm, gate_base, scale) and
computes in the accumulation dtype of its inputs (float32 for float16/bfloat16 inputs):

* ``recurrent`` -- the step-by-step recurrence (:mod:`oracle.reading.linear_baseline`);
* ``chunked`` -- the chunked WY form with chunks of 64, storing the normalised q and k, the
  solve's inverse, the WY factors and the state at chunk boundaries in the input dtype as
  flash-linear-attention does (:mod:`oracle.reading.linear_chunked`);
* one ``chunked`` kernel per deviation of :data:`oracle.reading.linear_chunked.DEVIATIONS`:
  the planted bugs (:data:`LINEAR_BROKEN`).

>>> import numpy as np
>>> q = k = np.ones((1, 1, 2, 1)); v = np.array([[[[1.0], [3.0]]]])
>>> LINEAR_CORRECT["chunked"](q, k, v, scale=1.0)[:, :, :, 0].tolist()
[[[1.0, 4.0]]]
"""

from __future__ import annotations

import functools

import numpy as np

from oracle.catalogue import seeding
from oracle.judging.tolerance import accumulation_dtype
from oracle.reading.linear_baseline import recurrence
from oracle.reading.linear_chunked import DEVIATIONS, chunked

__all__ = ["LINEAR_CORRECT", "LINEAR_BROKEN", "planted"]


def _dtype_of(q) -> str:
    return "bfloat16" if np.asarray(q).dtype.name == "bfloat16" else np.asarray(q).dtype.name


def _call(kernel, q, k, v, g=None, beta=None, *, output_final_state=False, **options):
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta)
    for name in ("initial_state", "cu_seqlens"):
        arrays[name] = options.pop(name, None)
    arrays = {n: x for n, x in arrays.items() if x is not None}
    dtype = _dtype_of(q)
    o, state = kernel(arrays, options, dtype)
    o, state = seeding.to_dtype(o, dtype), seeding.to_dtype(state, dtype)
    return (o, state) if output_final_state else o


def _recurrent(arrays, options, dtype):
    o, state, _ = recurrence(arrays, options, dtype)
    return np.asarray(o, dtype=np.float64), np.asarray(state, dtype=np.float64)


def _chunked(arrays, options, dtype, deviations=()):
    compute = accumulation_dtype(dtype)
    store = None if dtype == "float64" else dtype
    return chunked(arrays, options, compute=compute, store=store, deviations=deviations)


def planted(deviation: str | None):
    """The chunked kernel with ``deviation`` (None: the correct one)."""
    kernel = functools.partial(_chunked, deviations=() if deviation is None else (deviation,))
    impl = functools.partial(_call, kernel)
    impl.__name__ = f"chunked_{deviation or 'correct'}"
    return impl


#: The negative controls (no case may fail them).
LINEAR_CORRECT = {"recurrent": functools.partial(_call, _recurrent), "chunked": planted(None)}
#: name -> (kernel, what it does wrong).
LINEAR_BROKEN = {name: (planted(name), text) for name, text in DEVIATIONS.items()}
