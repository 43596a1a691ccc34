"""numba.cuda kernels of sigmoid attention (``normalizer="sigmoid"``): forward and backward.

Same semantics as :mod:`refattn.kernels._cpu_sigmoid` (docs/conventions.md, "The sigmoid
normaliser"): one thread owns one query row (forward, dq, dbias) or one key of one query
head (dk, dv); every sum runs sequentially in that thread (keys, resp. query rows, in
increasing order; the query heads of a kv group are added on the host in increasing head
order), so the results do not depend on the launch configuration. The scores and the allowed
set are :func:`refattn.kernels.cuda.device_functions`' ``score`` and ``row_interval``.

Examples
--------
>>> from refattn.kernels import cuda_sigmoid  # doctest: +SKIP
>>> out = cuda_sigmoid.attention(spec)  # doctest: +SKIP
"""

from __future__ import annotations

import math

import numpy as np

from .cuda import (  # noqa: F401 (cuda: the kernels need it as a module global)
    MAX_FEATURES,
    THREADS,
    _launch,
    _prepare,
    _require_cuda,
    cuda,
    device_functions,
)

__all__ = ["attention", "attention_vjp"]

_KERNELS: dict = {}


def _kernels(dtype):
    key = np.dtype(dtype).name
    if key not in _KERNELS:
        _require_cuda()
        _KERNELS[key] = _build(np.dtype(dtype))
    return _KERNELS[key]


def _build(dtype):
    import numba

    nb_dtype = numba.float64 if dtype == np.float64 else numba.float32
    width = MAX_FEATURES
    row_interval, score, kept = device_functions(nb_dtype)
    ints_dims, ints_opts, ints_kv = 0, 7, 7 + 10 + 12

    @cuda.jit(device=True)
    def sigmoid(t):
        if t >= 0:
            return 1.0 / (1.0 + math.exp(-t))
        e = math.exp(t)
        return e / (1.0 + e)

    @cuda.jit
    def forward(q, k, v, ints, fopts, bias, flags, slopes, out):
        heads, length = ints[ints_dims + 1], ints[ints_dims + 2]
        dim, vdim = ints[ints_dims + 5], ints[ints_dims + 6]
        bh = cuda.blockIdx.y
        b, h = bh // heads, bh % heads
        g = ints[ints_kv + h]
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i >= length:
            return
        qrow = cuda.local.array(width, nb_dtype)
        acc = cuda.local.array(width, nb_dtype)
        for d in range(dim):
            qrow[d] = q[b, h, i, d]
        for e in range(vdim):
            acc[e] = 0.0
        lo, hi = row_interval(i, ints)
        any_allowed = False
        ks = k[b, g]
        for j in range(lo, hi):
            ok, t, _ = score(qrow, ks, j, b, h, i, j, ints, fopts, bias, flags, slopes)
            if not ok or t == -math.inf:
                continue
            any_allowed = True
            if kept(b, h, i, j, ints, flags):
                w = sigmoid(t)
                for e in range(vdim):
                    acc[e] += w * v[b, g, j, e]
        if not any_allowed:
            fill = math.nan if ints[ints_opts + 9] != 0 else 0.0
            for e in range(vdim):
                out[b, h, i, e] = fill
        else:
            for e in range(vdim):
                out[b, h, i, e] = acc[e] * fopts[2]

    @cuda.jit(device=True)
    def ds_of(qrow, ks, j, b, h, i, ints, fopts, bias, flags, slopes, v, g, grad_out):
        """(allowed, w kept-scaled, dS, dT) of position (i, j)."""
        ok, t, deriv = score(qrow, ks, j, b, h, i, j, ints, fopts, bias, flags, slopes)
        if not ok or t == -math.inf or not kept(b, h, i, j, ints, flags):
            return False, 0.0, 0.0, 0.0
        vdim = ints[ints_dims + 6]
        dp = nb_dtype(0.0)
        for e in range(vdim):
            dp += grad_out[b, h, i, e] * v[b, g, j, e]
        w = sigmoid(t)
        ds = w * sigmoid(-t) * (dp * fopts[2])
        return True, w * fopts[2], ds, ds * deriv

    @cuda.jit
    def grad_q(q, k, v, grad_out, ints, fopts, bias, flags, slopes, dq, dbias):
        heads, length = ints[ints_dims + 1], ints[ints_dims + 2]
        dim = ints[ints_dims + 5]
        bh = cuda.blockIdx.y
        b, h = bh // heads, bh % heads
        g = ints[ints_kv + h]
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i >= length:
            return
        qrow = cuda.local.array(width, nb_dtype)
        for d in range(dim):
            qrow[d] = q[b, h, i, d]
        lo, hi = row_interval(i, ints)
        ks = k[b, g]
        for j in range(lo, hi):
            ok, _, ds, dt = ds_of(
                qrow, ks, j, b, h, i, ints, fopts, bias, flags, slopes, v, g, grad_out
            )
            if not ok:
                continue
            if ints[ints_opts + 5] != 0:
                dbias[b, h, i, j] = ds
            for d in range(dim):
                dq[b, h, i, d] += dt * fopts[0] * k[b, g, j, d]

    @cuda.jit
    def grad_kv(q, k, v, grad_out, ints, fopts, bias, flags, slopes, dk_part, dv_part):
        heads, length, keys = ints[ints_dims + 1], ints[ints_dims + 2], ints[ints_dims + 4]
        dim, vdim = ints[ints_dims + 5], ints[ints_dims + 6]
        bh = cuda.blockIdx.y
        b, h = bh // heads, bh % heads
        g = ints[ints_kv + h]
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if j >= keys:
            return
        qrow = cuda.local.array(width, nb_dtype)
        ks = k[b, g]
        for i in range(length):
            lo, hi = row_interval(i, ints)
            if j < lo or j >= hi:
                continue
            for d in range(dim):
                qrow[d] = q[b, h, i, d]
            ok, w, _, dt = ds_of(
                qrow, ks, j, b, h, i, ints, fopts, bias, flags, slopes, v, g, grad_out
            )
            if not ok:
                continue
            for d in range(dim):
                dk_part[b, h, j, d] += dt * fopts[0] * qrow[d]
            for e in range(vdim):
                dv_part[b, h, j, e] += w * grad_out[b, h, i, e]

    return forward, grad_q, grad_kv


def attention(spec, *, return_lse=False, dtype=None, threads=THREADS):
    """Sigmoid forward of ``spec`` on the GPU: out (B, H, L, E) (no lse: an error)."""
    if return_lse:
        raise ValueError("return_lse: normalizer='sigmoid' has no log-sum-exp")
    dtype, args = _prepare(spec, dtype)
    forward, _, _ = _kernels(dtype)
    batch, heads, _, length, _, _, vdim = spec.dims
    out = cuda.to_device(np.zeros((batch, heads, length, vdim), dtype))
    if length and batch * heads:
        _launch(forward, length, batch * heads, threads, *(cuda.to_device(a) for a in args), out)
    return out.copy_to_host()


def attention_vjp(spec, grad_out, grad_lse=None, *, dtype=None, threads=THREADS):
    """(dq, dk, dv, dbias) of sigmoid attention on the GPU; dbias (B, H, L, S) or None."""
    if grad_lse is not None:
        raise ValueError("grad_lse: normalizer='sigmoid' has no log-sum-exp")
    dtype, args = _prepare(spec, dtype)
    _, grad_q, grad_kv = _kernels(dtype)
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    q, k, v, ints, fopts, bias, flags, slopes = (cuda.to_device(a) for a in args)
    options = (ints, fopts, bias, flags, slopes)
    grad_dev = cuda.to_device(np.ascontiguousarray(grad_out, dtype))
    dq = cuda.to_device(np.zeros((batch, heads, length, dim), dtype))
    dk_part = cuda.to_device(np.zeros((batch, heads, keys, dim), dtype))
    dv_part = cuda.to_device(np.zeros((batch, heads, keys, vdim), dtype))
    dbias_shape = (batch, heads, length, keys) if spec.bias is not None else (1, 1, 1, 1)
    dbias = cuda.to_device(np.zeros(dbias_shape, dtype))
    if length and keys and batch * heads:
        _launch(grad_q, length, batch * heads, threads, q, k, v, grad_dev, *options, dq, dbias)
        _launch(
            grad_kv, keys, batch * heads, threads, q, k, v, grad_dev, *options, dk_part, dv_part
        )
    dk_part, dv_part = dk_part.copy_to_host(), dv_part.copy_to_host()
    dk = np.zeros((batch, kv_heads, keys, dim), dtype)
    dv = np.zeros((batch, kv_heads, keys, vdim), dtype)
    for h in range(heads):  # increasing head order within each kv group
        dk[:, spec.kv_head[h]] += dk_part[:, h]
        dv[:, spec.kv_head[h]] += dv_part[:, h]
    return dq.copy_to_host(), dk, dv, (dbias.copy_to_host() if spec.bias is not None else None)
