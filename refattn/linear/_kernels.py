"""The Numba backend of the linear-attention family: the kernels' arrays from a canonical call
(the same normalisation, scaling and decays as the float64 path) and back."""

from __future__ import annotations

import numpy as np

from ..kernels import linear_chunked, linear_cpu
from . import _float64
from ._inputs import LinearCall

__all__ = [
    "forward",
    "chunked_forward",
    "cuda_forward",
    "backward",
    "chunked_backward",
    "cuda_backward",
]


def _prepared(call: LinearCall, compute_dtype):
    """((qs, k, v, a), beta, h0, seg, params) in ``compute_dtype``, C-contiguous."""
    q, k = call.q, call.k
    if call.qk_l2norm:
        q, k = _float64.normalized(q)[0], _float64.normalized(k)[0]
    a, log_base = _float64.decays(call)
    if a is None:
        a = np.ones(call.q.shape)
    elif a.ndim == 3:  # a scalar gate multiplies every key row by the same factor
        a = np.broadcast_to(a[..., None], call.q.shape)
    beta = np.zeros(call.v.shape[:3]) if call.beta is None else call.beta
    h0 = np.zeros(call.state_shape) if call.h0 is None else call.h0
    seg = np.array(call.segments, dtype=np.int64).reshape(-1, 3)
    params = np.array([call.g is not None, call.beta is not None, log_base], dtype=np.float64)
    dtype = np.dtype(compute_dtype)

    def cast(x):  # writable C arrays: one specialisation per dtype whatever the caller passed
        return np.require(x, dtype, ["C", "W"])

    ins = (cast(q * call.scale), cast(k), cast(call.v), cast(a))
    return ins, cast(beta), cast(h0), seg, params


def forward(call: LinearCall, compute_dtype="float64"):
    """(o, final) as float64 arrays, computed by the kernel in ``compute_dtype``."""
    ins, beta, h0, seg, params = _prepared(call, compute_dtype)
    out, final = linear_cpu.linear_forward(ins, beta, h0, seg, params)
    return out.astype(np.float64, copy=False), final.astype(np.float64, copy=False)


def _log_decays(call: LinearCall, dtype):
    """The chunked kernels' natural-log decays (B, HV, T, 1 or D) in ``dtype``."""
    if call.g is None:
        lg = np.zeros(call.v.shape[:3] + (1,))
    else:
        lg = call.g if call.vector_gate else call.g[..., None]
        if call.gate_base == "2":
            lg = lg * np.log(2.0)
    return np.require(lg, dtype, ["C", "W"])


def chunked_forward(call: LinearCall, compute_dtype="float64", chunk=linear_chunked.CHUNK):
    """(o, final) as float64 arrays from the chunked kernel computing in ``compute_dtype``."""
    (qs, k, v, _), beta, h0, seg, _ = _prepared(call, compute_dtype)
    lg = _log_decays(call, qs.dtype)
    out, final = linear_chunked.chunked_forward(
        (qs, k, v, lg), beta, h0, seg, call.beta is not None, chunk
    )
    return out.astype(np.float64, copy=False), final.astype(np.float64, copy=False)


def cuda_forward(call: LinearCall, compute_dtype="float64", threads=None):
    """(o, final) as float64 arrays from the numba.cuda kernel computing in ``compute_dtype``."""
    from ..kernels import linear_cuda

    ins, beta, h0, seg, _ = _prepared(call, compute_dtype)
    threads = linear_cuda.THREADS if threads is None else threads
    out, final = linear_cuda.linear_forward(ins, beta, h0, seg, call.beta is not None, threads)
    return out.astype(np.float64, copy=False), final.astype(np.float64, copy=False)


def _cotangents(call: LinearCall, do, dht, dtype):
    do = np.require(do, dtype, ["C", "W"])
    dht = np.zeros(call.state_shape, dtype) if dht is None else np.require(dht, dtype, ["C", "W"])
    return do, dht


def _grads(call: LinearCall, dqs, dk, dv, dg, dbeta, dh0) -> dict:
    """The kernels' gradients (dg per key row) -> the dict of the float64 path."""
    if call.g is None:
        dg = None
    elif not call.vector_gate:
        dg = dg.sum(axis=-1)
    return {
        "q": dqs.astype(np.float64),
        "k": dk.astype(np.float64),
        "v": dv.astype(np.float64),
        "g": None if dg is None else dg.astype(np.float64),
        "beta": None if call.beta is None else dbeta.astype(np.float64),
        "h0": dh0.astype(np.float64),
    }


def backward(call: LinearCall, do, dht, compute_dtype="float64") -> dict:
    """The dict of :func:`refattn.linear._float64.backward`, computed by the kernel."""
    ins, beta, h0, seg, params = _prepared(call, compute_dtype)
    do, dht = _cotangents(call, do, dht, ins[0].dtype)
    return _grads(call, *linear_cpu.linear_backward((*ins, do), beta, (h0, dht), seg, params))


def chunked_backward(
    call: LinearCall, do, dht, compute_dtype="float64", chunk=linear_chunked.CHUNK
) -> dict:
    """The dict of :func:`refattn.linear._float64.backward`, from the chunked kernel."""
    ins, beta, h0, seg, params = _prepared(call, compute_dtype)
    do, dht = _cotangents(call, do, dht, ins[0].dtype)
    lg = _log_decays(call, ins[0].dtype)
    grads = linear_chunked.chunked_backward((*ins, do), lg, beta, (h0, dht), seg, params, chunk)
    return _grads(call, *grads)


def cuda_backward(call: LinearCall, do, dht, compute_dtype="float64", threads=None) -> dict:
    """The dict of :func:`refattn.linear._float64.backward`, from the numba.cuda kernel."""
    from ..kernels import linear_cuda

    ins, beta, h0, seg, params = _prepared(call, compute_dtype)
    do, dht = _cotangents(call, do, dht, ins[0].dtype)
    threads = linear_cuda.THREADS if threads is None else threads
    grads = linear_cuda.linear_backward((*ins, do), beta, (h0, dht), seg, params, threads)
    return _grads(call, *grads)
