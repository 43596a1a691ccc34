"""numba.cuda kernel of the linear-attention recurrence (:func:`refattn.linear_attention` with
``backend="cuda"``), forward and reverse mode.

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

Reverse mode (:func:`linear_backward`): the CPU kernel's reverse recurrence, with its
checkpoints (every ``floor(sqrt(T_n))`` steps) and the block's recomputed states in global
scratch memory. Each reversed step has a column half (thread x owns columns e = x, x +
blockDim, ...: S_t recomputed from S_{t-1} with its residual u, ``dS += qs do^T``,
``du = beta dS^T k``, dv) and a row half (thread x owns key rows d = x, x + blockDim, ...:
``dqs = S_t do``, ``dsu = dS u``, dk, dg and the carry ``dS -> dS_{t-1}``), separated by
barriers; thread 0 then forms ``dbeta = k . dsu``. Every sum runs in the CPU kernel's order,
so the gradients are bit-identical to ``backend="numba"``'s for any launch shape and the
bound is :func:`refattn.bounds.linear_vjp_bound`.

The module imports without a GPU; the kernel compiles on first use and raises a RuntimeError
that says what to do when neither a CUDA device nor the simulator (``NUMBA_ENABLE_CUDASIM=1``,
set before numba is imported) is available.
"""

from __future__ import annotations

import math

import numpy as np

from . import cuda as _attention_cuda

try:  # numba's CUDA target imports without a GPU
    from numba import cuda
except ImportError:  # pragma: no cover
    cuda = None

__all__ = ["linear_forward", "linear_backward", "available", "MAX_FEATURES", "THREADS"]

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


def _device(dtype):
    """The device functions shared by the forward and reverse kernels, for ``dtype``."""
    zero = dtype.type(0)

    @cuda.jit(device=True, fastmath=False)
    def column_step(s, c, a_t, k_t, v_e, beta_t, has_beta):
        """One update of the state column ``s[:, c]`` (the CPU kernel's ``_step`` for one e);
        returns the delta-rule residual u (0 without beta)."""
        if has_beta:
            pred = zero
            for d in range(k_t.shape[0]):
                s[d, c] = s[d, c] * a_t[d]
                pred += s[d, c] * k_t[d]
            u = v_e - pred
            for d in range(k_t.shape[0]):
                s[d, c] = s[d, c] + (beta_t * k_t[d]) * u
            return u
        for d in range(k_t.shape[0]):
            s[d, c] = s[d, c] * a_t[d] + k_t[d] * v_e
        return zero

    @cuda.jit(device=True, fastmath=False)
    def reverse_columns(mats, vecs, before, row, x, beta_t, has_beta, dv_t):
        """The column half of a reversed step (thread x: columns x, x + blockDim, ...):
        S_t recomputed from ``before`` into ``mats[0]`` with its residual u, dS += qs do^T,
        du = beta (dS^T k) (dS in ``mats[1]``; u, du in ``vecs[0]``, ``vecs[1]``)."""
        qs_t, k_t, a_t, v_t, do_t = row
        state, d_state = mats[0], mats[1]
        for e in range(x, v_t.shape[0], cuda.blockDim.x):
            for d in range(k_t.shape[0]):
                state[d, e] = before[d, e]
            vecs[0, e] = column_step(state, e, a_t, k_t, v_t[e], beta_t, has_beta)
            for d in range(k_t.shape[0]):
                d_state[d, e] += qs_t[d] * do_t[e]
            du = zero
            for d in range(k_t.shape[0]):
                du += d_state[d, e] * k_t[d]
            du = beta_t * du if has_beta else du
            vecs[1, e] = du
            dv_t[e] = du

    @cuda.jit(device=True, fastmath=False)
    def reverse_rows(mats, vecs, before, row, x, beta_t, flags, grads):
        """The row half (thread x: rows x, x + blockDim, ...): dqs, dsu = dS u (in
        ``vecs[2]``), dk, dg, and dS -> dS_{t-1}; ``flags = (has_gate, has_beta, log_base)``,
        ``grads = (dqs_t, dk_t, dg_t)``."""
        qs_t, k_t, a_t, v_t, do_t = row
        state, d_state = mats[0], mats[1]
        has_gate, has_beta, log_base = flags
        for d in range(x, k_t.shape[0], cuda.blockDim.x):
            acc = zero
            for e in range(v_t.shape[0]):
                acc += state[d, e] * do_t[e]
            grads[0][d] = acc
            acc = zero
            for e in range(v_t.shape[0]):
                acc += d_state[d, e] * (vecs[0, e] if has_beta else v_t[e])
            vecs[2, d] = acc
            if has_beta:
                acc = zero
                for e in range(v_t.shape[0]):
                    acc += (before[d, e] * a_t[d]) * vecs[1, e]
                grads[1][d] = beta_t * vecs[2, d] - acc
                for e in range(v_t.shape[0]):
                    d_state[d, e] = d_state[d, e] - k_t[d] * vecs[1, e]
            else:
                grads[1][d] = vecs[2, d]
            if has_gate:
                acc = zero
                for e in range(v_t.shape[0]):
                    acc += d_state[d, e] * before[d, e]
                grads[2][d] = acc * a_t[d] * log_base
                for e in range(v_t.shape[0]):
                    d_state[d, e] = d_state[d, e] * a_t[d]

    return column_step, reverse_columns, reverse_rows


def _build(dtype):
    from numba import from_dtype

    nb_dtype = from_dtype(dtype)
    zero = dtype.type(0)
    column_step = _device(dtype)[0]

    @cuda.jit(fastmath=False)
    def forward(qs, k, v, a, beta, h0, seg, has_beta, out, final):
        heads, dim, edim = v.shape[1], k.shape[3], v.shape[3]
        n, j = cuda.blockIdx.x // heads, cuda.blockIdx.x % heads
        b, start, stop = seg[n, 0], seg[n, 1], seg[n, 2]
        col = cuda.local.array((MAX_FEATURES, 1), nb_dtype)
        for e in range(cuda.threadIdx.x, edim, cuda.blockDim.x):
            for d in range(dim):
                col[d, 0] = h0[n, j, d, e]
            for t in range(start, stop):
                column_step(col, 0, a[b, j, t], k[b, j, t], v[b, j, t, e], beta[b, j, t], has_beta)
                acc = zero
                for d in range(dim):
                    acc += col[d, 0] * qs[b, j, t, d]
                out[b, j, t, e] = acc
            for d in range(dim):
                final[n, j, d, e] = col[d, 0]

    return forward


def _build_backward(dtype):
    zero = dtype.type(0)
    column_step, reverse_columns, reverse_rows = _device(dtype)

    @cuda.jit(fastmath=False)
    def backward(keys, vals, beta, states, seg, params, saved, mats, vecs, dkeys, dv, dbeta):
        """keys = (qs, k, a), vals = (v, do), states = (h0, dht) stacked; params [has gate,
        has beta, log(base)]; saved (units, blocks, D, E) checkpoints; mats (units, 2 + block,
        D, E): S_t, dS (dh0 on exit), the block's states; vecs (units, 3, max(D, E))."""
        heads, dim, edim = vals.shape[2], keys.shape[4], vals.shape[4]
        unit, x = cuda.blockIdx.x, cuda.threadIdx.x
        n, j = unit // heads, unit % heads
        b, start, stop = seg[n, 0], seg[n, 1], seg[n, 2]
        flags = (params[0] != zero, params[1] != zero, params[2])
        has_beta = flags[1]
        block = 1  # floor(sqrt(T_n)), at least 1: the CPU kernel's checkpoint spacing
        while (block + 1) * (block + 1) <= stop - start:
            block += 1
        here = mats[unit]
        for e in range(x, edim, cuda.blockDim.x):
            for d in range(dim):
                here[0, d, e] = states[0, n, j, d, e]
                here[1, d, e] = states[1, n, j, d, e]
            for t in range(start, stop):
                if (t - start) % block == 0:
                    for d in range(dim):
                        saved[unit, (t - start) // block, d, e] = here[0, d, e]
                column_step(
                    here[0],
                    e,
                    keys[2, b, j, t],
                    keys[1, b, j, t],
                    vals[0, b, j, t, e],
                    beta[b, j, t],
                    has_beta,
                )
        for index in range((stop - start + block - 1) // block - 1, -1, -1):
            first = start + index * block
            last = min(first + block, stop)
            for e in range(x, edim, cuda.blockDim.x):
                for d in range(dim):
                    here[2, d, e] = saved[unit, index, d, e]
                for t in range(first, last - 1):
                    for d in range(dim):
                        here[3 + t - first, d, e] = here[2 + t - first, d, e]
                    column_step(
                        here[3 + t - first],
                        e,
                        keys[2, b, j, t],
                        keys[1, b, j, t],
                        vals[0, b, j, t, e],
                        beta[b, j, t],
                        has_beta,
                    )
            cuda.syncthreads()
            for t in range(last - 1, first - 1, -1):
                row = (
                    keys[0, b, j, t],
                    keys[1, b, j, t],
                    keys[2, b, j, t],
                    vals[0, b, j, t],
                    vals[1, b, j, t],
                )
                before = here[2 + t - first]
                reverse_columns(
                    here, vecs[unit], before, row, x, beta[b, j, t], has_beta, dv[b, j, t]
                )
                cuda.syncthreads()
                grads = (dkeys[0, b, j, t], dkeys[1, b, j, t], dkeys[2, b, j, t])
                reverse_rows(here, vecs[unit], before, row, x, beta[b, j, t], flags, grads)
                cuda.syncthreads()
                if has_beta and x == 0:
                    total = zero
                    for d in range(dim):
                        total += keys[1, b, j, t, d] * vecs[unit, 2, d]
                    dbeta[b, j, t] = total

    return backward


def _prologue(ins, h0, kind):
    """Checks and the compiled kernel of ``kind`` ("forward" or "backward") for ins' dtype."""
    dtype = ins[0].dtype
    if dtype.name not in ("float64", "float32"):
        raise ValueError(f"compute_dtype: expected float64 or float32, got {dtype}")
    if ins[1].shape[3] > MAX_FEATURES:
        raise ValueError(f"k: the CUDA kernel takes D <= {MAX_FEATURES}, got shape {ins[1].shape}")
    units = h0.shape[0] * ins[2].shape[1]
    if units == 0 or ins[2].shape[3] == 0:
        return None
    _require_cuda()
    key = (kind, dtype.name)
    if key not in _KERNELS:
        _KERNELS[key] = (_build if kind == "forward" else _build_backward)(dtype)
    return _KERNELS[key]


def linear_forward(ins, beta, h0, seg, has_beta, threads=THREADS):
    """(o (B, HV, T, E), final (N, HV, D, E)) in the arrays' dtype (float64 or float32), the
    arguments as :func:`refattn.kernels.linear_cpu.linear_forward` (``ins = (qs, k, v, a)``)
    with ``has_beta`` a bool; ``threads`` per block (the results do not depend on it)."""
    kernel = _prologue(ins, h0, "forward")
    out = np.zeros(ins[2].shape, dtype=ins[0].dtype)
    final = np.array(h0, dtype=ins[0].dtype, copy=True)
    if kernel is None:
        return out, final
    args = [cuda.to_device(np.ascontiguousarray(x)) for x in (*ins, beta, h0, seg)]
    d_out, d_final = cuda.to_device(out), cuda.to_device(final)
    kernel[seg.shape[0] * ins[2].shape[1], int(threads)](*args, bool(has_beta), d_out, d_final)
    return d_out.copy_to_host(), d_final.copy_to_host()


def _checkpoints(seg):
    """(most checkpoints, longest block) over the sequences: the CPU kernel's spacing
    ``floor(sqrt(T_n))`` (at least 1)."""
    lengths = [int(stop - start) for _, start, stop in seg] or [0]
    blocks = [max(1, math.isqrt(n)) for n in lengths]
    return max(1, *(-(-n // m) for n, m in zip(lengths, blocks, strict=True))), max(blocks)


def linear_backward(ins, beta, states, seg, params, threads=THREADS):
    """The reverse pass, the arguments and results as
    :func:`refattn.kernels.linear_cpu.linear_backward`'s (``ins = (qs, k, v, a, do)``,
    ``states = (h0, dht)``), bit-identical to it; ``threads`` per block (the results do not
    depend on it)."""
    qs, k, v, a, do = ins
    dtype, (h0, dht) = qs.dtype, states
    kernel = _prologue(ins, h0, "backward")
    dkeys = np.zeros((3,) + qs.shape, dtype)
    dv, dbeta = np.zeros(v.shape, dtype), np.zeros(beta.shape, dtype)
    if kernel is None:
        return dkeys[0], dkeys[1], dv, dkeys[2], dbeta, np.array(dht, dtype=dtype, copy=True)
    units, (dim, edim) = h0.shape[0] * h0.shape[1], h0.shape[2:]
    blocks, block = _checkpoints(seg)
    host = (
        np.stack([qs, k, a]),
        np.stack([v, do]),
        beta,
        np.stack([h0, dht]),
        seg,
        np.asarray(params, dtype),
    )
    args = [cuda.to_device(np.ascontiguousarray(x)) for x in host]
    scratch = [
        cuda.to_device(np.zeros(shape, dtype))
        for shape in ((units, blocks, dim, edim), (units, 2 + block, dim, edim))
    ]
    scratch.append(cuda.to_device(np.zeros((units, 3, max(dim, edim)), dtype)))
    outs = [cuda.to_device(x) for x in (dkeys, dv, dbeta)]
    kernel[units, int(threads)](*args, *scratch, *outs)
    dkeys, dv, dbeta = (x.copy_to_host() for x in outs)
    dh0 = scratch[1].copy_to_host()[:, 1].reshape(h0.shape)
    return dkeys[0], dkeys[1], dv, dkeys[2], dbeta, dh0
