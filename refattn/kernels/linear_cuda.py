"""numba.cuda kernel of the linear-attention recurrence (:func:`refattn.linear_attention` with
``backend="cuda"``), forward only.

One thread block per (sequence, value head); thread ``x`` owns the state columns
``e = x, x + blockDim, ...`` (a column ``S[:, e]`` (D,) in local memory) from the first step
to the last. Every operation of the recurrence reads one column only, so the threads never
communicate, and per column the operations are those of :mod:`refattn.kernels.linear_cpu` in
the same order:

* decay ``S[d, e] *= a[d]``; delta rule: ``pred = sum_d S[d, e] k[d]`` (d ascending, fused with
  the decay loop as the CPU kernel's), ``u = v[e] - pred``, ``S[d, e] += (beta k[d]) u``;
  plain: ``S[d, e] = S[d, e] a[d] + k[d] v[e]``;
* ``o[e] = sum_d S[d, e] qs[d]`` (d ascending).

``fastmath=False`` (numba.cuda contracts multiply-adds into FMAs only under fastmath), so the
results are bit-identical to the CPU kernel's for the same compute dtype and do not depend on
the launch shape; the error bound is the same, :func:`refattn.bounds.linear_forward_bound`.

The module imports without a GPU; the kernel compiles on first use and raises a RuntimeError
that says what to do when neither a CUDA device nor the simulator (``NUMBA_ENABLE_CUDASIM=1``,
set before numba is imported) is available.
"""

from __future__ import annotations

import numpy as np

from . import cuda as _attention_cuda

try:  # numba's CUDA target imports without a GPU
    from numba import cuda
except ImportError:  # pragma: no cover
    cuda = None

__all__ = ["linear_forward", "available", "MAX_FEATURES", "THREADS"]

#: Largest key dimension D (the local column has a static size).
MAX_FEATURES = 128
#: Threads per block (state columns owned at once) unless the caller says otherwise.
THREADS = 32

_KERNELS: dict = {}


def available() -> bool:
    """True when a CUDA device or the numba.cuda simulator can run the kernel."""
    return _attention_cuda.available()


def _require_cuda():
    if not available():
        raise RuntimeError(
            "refattn.kernels.linear_cuda: no CUDA device is available (numba.cuda."
            "is_available() is False). Install an NVIDIA driver and numba-cuda (pip install "
            "refattn[cuda]), or run on the simulator with NUMBA_ENABLE_CUDASIM=1 set before "
            "numba is imported; the CPU kernel is backend='numba'."
        )


def _build(dtype):
    from numba import from_dtype

    nb_dtype = from_dtype(dtype)
    zero = dtype.type(0)

    @cuda.jit(fastmath=False)
    def forward(qs, k, v, a, beta, h0, seg, has_beta, out, final):
        heads, dim, edim = v.shape[1], k.shape[3], v.shape[3]
        n, j = cuda.blockIdx.x // heads, cuda.blockIdx.x % heads
        b, start, stop = seg[n, 0], seg[n, 1], seg[n, 2]
        col = cuda.local.array(MAX_FEATURES, nb_dtype)
        for e in range(cuda.threadIdx.x, edim, cuda.blockDim.x):
            for d in range(dim):
                col[d] = h0[n, j, d, e]
            for t in range(start, stop):
                if has_beta:
                    pred = zero
                    for d in range(dim):
                        col[d] = col[d] * a[b, j, t, d]
                        pred += col[d] * k[b, j, t, d]
                    u = v[b, j, t, e] - pred
                    for d in range(dim):
                        col[d] = col[d] + (beta[b, j, t] * k[b, j, t, d]) * u
                else:
                    for d in range(dim):
                        col[d] = col[d] * a[b, j, t, d] + k[b, j, t, d] * v[b, j, t, e]
                acc = zero
                for d in range(dim):
                    acc += col[d] * qs[b, j, t, d]
                out[b, j, t, e] = acc
            for d in range(dim):
                final[n, j, d, e] = col[d]

    return forward


def linear_forward(ins, beta, h0, seg, has_beta, threads=THREADS):
    """(o (B, HV, T, E), final (N, HV, D, E)) in the arrays' dtype (float64 or float32), the
    arguments as :func:`refattn.kernels.linear_cpu.linear_forward` (``ins = (qs, k, v, a)``)
    with ``has_beta`` a bool; ``threads`` per block (the results do not depend on it)."""
    dtype = ins[0].dtype
    if dtype.name not in ("float64", "float32"):
        raise ValueError(f"compute_dtype: expected float64 or float32, got {dtype}")
    if ins[1].shape[3] > MAX_FEATURES:
        raise ValueError(f"k: the CUDA kernel takes D <= {MAX_FEATURES}, got shape {ins[1].shape}")
    out = np.zeros(ins[2].shape, dtype=dtype)
    final = np.array(h0, dtype=dtype, copy=True)
    units = seg.shape[0] * ins[2].shape[1]
    if units == 0 or ins[2].shape[3] == 0:
        return out, final
    _require_cuda()
    if dtype.name not in _KERNELS:
        _KERNELS[dtype.name] = _build(dtype)
    kernel = _KERNELS[dtype.name]
    args = [cuda.to_device(np.ascontiguousarray(x)) for x in (*ins, beta, h0, seg)]
    d_out, d_final = cuda.to_device(out), cuda.to_device(final)
    kernel[units, int(threads)](*args, bool(has_beta), d_out, d_final)
    return d_out.copy_to_host(), d_final.copy_to_host()
