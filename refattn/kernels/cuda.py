"""numba.cuda attention kernels: flash-style forward and deterministic backward.

Same semantics as :mod:`refattn.kernels.numba_cpu` (docs/conventions.md). One thread owns one
query row (forward, dq) or one key (dk, dv); key/value (or query/grad) tiles of
``TILE`` rows are staged in shared memory by the whole block, and the forward keeps the
online-softmax state of its row (Milakov & Gimelshein 2018, Algorithm 3, applied key by key)
in registers and local memory:

.. math::

    m \\leftarrow \\max(m, t_j), \\quad
    \\ell \\leftarrow \\ell e^{m_{old} - m} + e^{t_j - m}, \\quad
    o \\leftarrow o\\, e^{m_{old} - m} + \\kappa_j e^{t_j - m} v_j / (1-p).

Every reduction runs sequentially in one thread (keys in increasing order for the forward and
dq; query rows in increasing order for dk and dv; query heads of a kv group in increasing order
on the host), so results are deterministic and independent of the launch configuration. Excluded
positions are skipped, never multiplied by zero, so NaN/Inf poison there cannot reach outputs.

Sparse key lists (a spec from :func:`refattn.kernels.gather_spec`, set reading): the forward
and dq threads walk their row's sorted list (duplicates once; entries < 0 or outside the row's
interval skipped) instead of all S keys, and the dk/dv threads test their key's membership in
each row's list by binary search: no dense (L, S) plane, and the bits of the dense kernels
given the listed set as a mask (the same keys in the same order with the same operations).

The module imports without a GPU; the kernels compile on first use and raise a RuntimeError
that says what to do when neither a CUDA device nor the simulator
(``NUMBA_ENABLE_CUDASIM=1``, set before numba is imported) is available.

Examples
--------
>>> from refattn.kernels import cuda  # doctest: +SKIP
>>> out, lse = cuda.attention(spec, return_lse=True)  # doctest: +SKIP
"""

from __future__ import annotations

import math

import numpy as np

from ..spec import key_interval
from ._args import (
    DIM_DIM,
    DIM_HEADS,
    DIM_KEYS,
    DIM_KV_HEADS,
    DIM_LENGTH,
    DIM_VDIM,
    DIMS,
    FOPT_KEEP_SCALE,
    FOPT_SCALE,
    FOPT_SOFTCAP,
    OPT_CAUSAL,
    OPT_EMPTY_ROWS_NAN,
    OPT_HAS_ALIBI,
    OPT_HAS_BIAS,
    OPT_HAS_DROPOUT,
    OPT_HAS_MASK,
    OPT_HAS_SOFTCAP,
    OPT_LEFT,
    OPT_OFFSET,
    OPT_RIGHT,
    OPTS,
)

try:  # numba's CUDA target imports without a GPU; kernels need it as a module global
    from numba import cuda
except ImportError:  # pragma: no cover
    cuda = None

__all__ = ["available", "attention", "attention_vjp", "MAX_FEATURES", "TILE"]

#: Rows of K/V (forward, dq) or Q/dO (dk, dv) staged in shared memory per step.
TILE = 16
#: Largest D and E the kernels take (local and shared arrays have static sizes).
MAX_FEATURES = 128
#: Threads per block (query rows or keys per block) unless the caller says otherwise.
THREADS = 64

_KERNELS: dict = {}

# The option layout of the CUDA kernels: the arrays of :func:`._args.kernel_arguments` stacked
# into a few larger ones (a kernel cannot take a tuple of device arrays): ``ints`` (int64) =
# dims, opts, the bias, mask and dropout strides (4 each), kv_head (H); ``flags`` (uint8, 2
# rows) = the mask and dropout planes; ``stats`` = lse and delta (2, B, H, L). A slot of dims
# or opts is read as ``ints[_DIMS + DIM_KEYS]``, ``ints[_OPTS + OPT_CAUSAL]``.
_DIMS, _OPTS = 0, len(DIMS)
_BIAS_STRIDES = _OPTS + len(OPTS)
_MASK_STRIDES, _DROP_STRIDES, _KV_HEAD = _BIAS_STRIDES + 4, _BIAS_STRIDES + 8, _BIAS_STRIDES + 12
# the ints slots the kernels read, as plain module constants (compile-time in numba.cuda)
_I_HEADS, _I_KV_HEADS = _DIMS + DIM_HEADS, _DIMS + DIM_KV_HEADS
_I_LENGTH, _I_KEYS = _DIMS + DIM_LENGTH, _DIMS + DIM_KEYS
_I_DIM, _I_VDIM = _DIMS + DIM_DIM, _DIMS + DIM_VDIM
_I_OFFSET, _I_CAUSAL = _OPTS + OPT_OFFSET, _OPTS + OPT_CAUSAL
_I_LEFT, _I_RIGHT = _OPTS + OPT_LEFT, _OPTS + OPT_RIGHT
_I_SOFTCAP, _I_BIAS = _OPTS + OPT_HAS_SOFTCAP, _OPTS + OPT_HAS_BIAS
_I_MASK, _I_ALIBI = _OPTS + OPT_HAS_MASK, _OPTS + OPT_HAS_ALIBI
_I_DROPOUT, _I_NAN_ROWS = _OPTS + OPT_HAS_DROPOUT, _OPTS + OPT_EMPTY_ROWS_NAN


def available() -> bool:
    """True when a CUDA device or the numba.cuda simulator can run the kernels."""
    return cuda is not None and bool(cuda.is_available())


def _require_cuda():
    if cuda is None:  # pragma: no cover
        raise RuntimeError(
            "refattn.kernels.cuda needs numba's CUDA target; install "
            "numba-cuda (pip install refattn[cuda])"
        )
    if not cuda.is_available():
        raise RuntimeError(
            "refattn.kernels.cuda: no CUDA device is available (numba.cuda.is_available() is "
            "False). Install an NVIDIA driver and the CUDA toolkit (pip install "
            "refattn[cuda]), or run on the simulator with NUMBA_ENABLE_CUDASIM=1 set before "
            "numba is imported; the CPU kernels are backend='numba'."
        )
    return cuda


def _kernels(dtype):
    """Compile (once per dtype) and return the forward, dq and dkv kernels."""
    key = np.dtype(dtype).name
    if key not in _KERNELS:
        _require_cuda()
        _KERNELS[key] = _build(np.dtype(dtype))
    return _KERNELS[key]


def device_functions(nb_dtype):
    """The device functions shared by the kernels of one compute dtype: ``row_interval(i,
    ints)``, ``score(...) -> (allowed, final score, d softcap / d raw)`` and ``kept(...)``
    (also used by the sigmoid kernels)."""
    # the one allowed-set rule (refattn.spec), compiled from the same Python function as the
    # CPU kernels' key_interval_jit
    key_interval_device = cuda.jit(device=True)(key_interval)

    @cuda.jit(device=True)
    def row_interval(i, ints):
        """[lo, hi) of query row i: :func:`refattn.spec.key_interval` on the option layout."""
        return key_interval_device(
            i, ints[_I_OFFSET], ints[_I_KEYS], ints[_I_CAUSAL] != 0, ints[_I_LEFT], ints[_I_RIGHT]
        )

    @cuda.jit(device=True)
    def score(qrow, ks, jj, b, h, i, j, ints, fopts, bias, flags, slopes):
        """(allowed, final score, d softcap / d raw) of position (i, j)."""
        dim = ints[_I_DIM]
        bstr = ints[_BIAS_STRIDES : _BIAS_STRIDES + 4]
        mstr = ints[_MASK_STRIDES : _MASK_STRIDES + 4]
        mask = flags[0]
        if ints[_I_MASK] != 0 and mask[mstr[0] * b + mstr[1] * h + mstr[2] * i + mstr[3] * j] == 0:
            return False, 0.0, 0.0
        bv = 0.0
        if ints[_I_BIAS] != 0:
            bv = bias[bstr[0] * b + bstr[1] * h + bstr[2] * i + bstr[3] * j]
            if bv == -math.inf:
                return False, 0.0, 0.0
        acc = nb_dtype(0.0)
        for d in range(dim):
            acc += qrow[d] * ks[jj, d]
        t = acc * fopts[FOPT_SCALE]
        deriv = 1.0
        if ints[_I_SOFTCAP] != 0:
            th = math.tanh(t / fopts[FOPT_SOFTCAP])
            t = fopts[FOPT_SOFTCAP] * th
            deriv = 1.0 - th * th
        t = t + bv
        if ints[_I_ALIBI] != 0:
            t = t - slopes[h] * abs(i + ints[_I_OFFSET] - j)
        return True, t, deriv

    @cuda.jit(device=True)
    def kept(b, h, i, j, ints, flags):
        dstr = ints[_DROP_STRIDES : _DROP_STRIDES + 4]
        drop = flags[1]
        return (
            ints[_I_DROPOUT] == 0
            or drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * j] != 0
        )

    return row_interval, score, kept


def _unit_functions():
    """The prologue every kernel of :func:`_build` shares, as two device functions:
    ``unit(ints) -> (b, h, g, tx, index)`` (this thread's batch, query head, kv head,
    thread within the block and row or key index) and ``stage(dst_a, dst_b, src_a, src_b,
    start, count, dim, vdim, tx)``, the whole block copying rows ``start .. start + TILE`` of
    two (count, features) sources into shared tiles (D and E features)."""

    @cuda.jit(device=True)
    def unit(ints):
        heads = ints[_I_HEADS]
        bh = cuda.blockIdx.y
        h = bh % heads
        tx = cuda.threadIdx.x
        return bh // heads, h, ints[_KV_HEAD + h], tx, cuda.blockIdx.x * cuda.blockDim.x + tx

    @cuda.jit(device=True)
    def stage(dst_a, dst_b, src_a, src_b, start, count, dim, vdim, tx):
        width = dst_a.shape[1]
        for x in range(tx, dst_a.shape[0] * width, cuda.blockDim.x):
            rr = x // width
            d = x % width
            if start + rr < count and d < dim:
                dst_a[rr, d] = src_a[start + rr, d]
            if start + rr < count and d < vdim:
                dst_b[rr, d] = src_b[start + rr, d]

    return unit, stage


def _listed_functions():
    """The sparse key lists (set reading) as the kernels read them: the host appends to
    ``ints``, after kv_head, T (-1 without lists) and the (B, K, L, T) lists sorted along T
    (:func:`refattn.kernels.gather_spec`). ``listed_start(ints, b, g, i) -> (start, T)``
    locates row i's sorted list; ``listed_in(ints, b, g, i, j)`` says whether key j is in it
    (a binary search; True without lists)."""

    @cuda.jit(device=True)
    def listed_start(ints, b, g, i):
        base = _KV_HEAD + ints[_I_HEADS]
        top = ints[base]
        row = (b * ints[_I_KV_HEADS] + g) * ints[_I_LENGTH] + i
        return base + 1 + row * top, top

    @cuda.jit(device=True)
    def listed_in(ints, b, g, i, j):
        start, top = listed_start(ints, b, g, i)
        if top < 0:
            return True
        lo, hi = start, start + top
        while lo < hi:  # the first entry >= j
            mid = (lo + hi) // 2
            if ints[mid] < j:
                lo = mid + 1
            else:
                hi = mid
        return lo < start + top and ints[lo] == j

    return listed_start, listed_in


def _build(dtype):
    """The forward, dq and dk/dv kernels of one compute dtype."""
    import numba

    nb_dtype = numba.float64 if dtype == np.float64 else numba.float32
    shared = device_functions(nb_dtype) + _unit_functions() + _listed_functions()
    return (
        _build_forward(nb_dtype, shared),
        _build_grad_q(nb_dtype, shared),
        _build_grad_kv(nb_dtype, shared),
        _build_gather_forward(nb_dtype, shared),
        _build_gather_grad_q(nb_dtype, shared),
    )


def _build_forward(nb_dtype, shared):
    """The forward kernel: one thread per query row, the online softmax key by key."""
    tile, width = TILE, MAX_FEATURES
    row_interval, score, kept, unit, stage, _, listed_in = shared

    @cuda.jit
    def forward(q, k, v, ints, fopts, bias, flags, slopes, out, lse):
        length, keys, dim, vdim = ints[_I_LENGTH], ints[_I_KEYS], ints[_I_DIM], ints[_I_VDIM]
        b, h, g, tx, i = unit(ints)
        ks = cuda.shared.array((tile, width), nb_dtype)
        vs = cuda.shared.array((tile, width), nb_dtype)
        qrow = cuda.local.array(width, nb_dtype)
        acc = cuda.local.array(width, nb_dtype)
        active = i < length
        lo, hi = 0, 0
        if active:
            lo, hi = row_interval(i, ints)
            for d in range(dim):
                qrow[d] = q[b, h, i, d]
            for e in range(vdim):
                acc[e] = 0.0
        m = -math.inf
        total = 0.0
        for c0 in range(0, keys, tile):
            stage(ks, vs, k[b, g], v[b, g], c0, keys, dim, vdim, tx)
            cuda.syncthreads()
            if active:
                for jj in range(min(tile, keys - c0)):
                    j = c0 + jj
                    if j < lo or j >= hi:
                        continue
                    ok, t, _ = score(qrow, ks, jj, b, h, i, j, ints, fopts, bias, flags, slopes)
                    if not ok or t == -math.inf:
                        continue
                    if t > m:
                        alpha = math.exp(m - t)
                        total = total * alpha
                        for e in range(vdim):
                            acc[e] = acc[e] * alpha
                        m = t
                    p = math.exp(t - m)
                    total += p
                    if kept(b, h, i, j, ints, flags):
                        for e in range(vdim):
                            acc[e] += p * vs[jj, e]
            cuda.syncthreads()
        if active:
            if total == 0.0:
                fill = math.nan if ints[_I_NAN_ROWS] != 0 else 0.0
                for e in range(vdim):
                    out[b, h, i, e] = fill
                lse[b, h, i] = math.nan if ints[_I_NAN_ROWS] != 0 else -math.inf
            else:
                inv = fopts[FOPT_KEEP_SCALE] / total
                for e in range(vdim):
                    out[b, h, i, e] = acc[e] * inv
                lse[b, h, i] = m + math.log(total)

    return forward


def _build_grad_q(nb_dtype, shared):
    """The dq (and dbias) kernel: one thread per query row, keys in increasing order."""
    tile, width = TILE, MAX_FEATURES
    row_interval, score, kept, unit, stage, _, listed_in = shared

    @cuda.jit
    def grad_q(q, k, v, grad_out, stats, ints, fopts, bias, flags, slopes, dq, dbias):
        length, keys, dim, vdim = ints[_I_LENGTH], ints[_I_KEYS], ints[_I_DIM], ints[_I_VDIM]
        lse, delta = stats[0], stats[1]
        b, h, g, tx, i = unit(ints)
        ks = cuda.shared.array((tile, width), nb_dtype)
        vs = cuda.shared.array((tile, width), nb_dtype)
        qrow = cuda.local.array(width, nb_dtype)
        dorow = cuda.local.array(width, nb_dtype)
        dqrow = cuda.local.array(width, nb_dtype)
        active = i < length
        lo, hi = 0, 0
        row_lse = -math.inf
        d_i = 0.0
        if active:
            row_lse = lse[b, h, i]
            d_i = delta[b, h, i]
            lo, hi = row_interval(i, ints)
            for d in range(dim):
                qrow[d] = q[b, h, i, d]
                dqrow[d] = 0.0
            for e in range(vdim):
                dorow[e] = grad_out[b, h, i, e]
        for c0 in range(0, keys, tile):
            stage(ks, vs, k[b, g], v[b, g], c0, keys, dim, vdim, tx)
            cuda.syncthreads()
            if active and row_lse != -math.inf:
                for jj in range(min(tile, keys - c0)):
                    j = c0 + jj
                    if j < lo or j >= hi:
                        continue
                    ok, t, deriv = score(qrow, ks, jj, b, h, i, j, ints, fopts, bias, flags, slopes)
                    if not ok or t == -math.inf:
                        continue
                    p = math.exp(t - row_lse)
                    dp = 0.0
                    if kept(b, h, i, j, ints, flags):
                        for e in range(vdim):
                            dp += dorow[e] * vs[jj, e]
                        dp = dp * fopts[FOPT_KEEP_SCALE]
                    ds = p * (dp - d_i)
                    if ints[_I_BIAS] != 0:
                        dbias[b, h, i, j] = ds
                    ds = ds * deriv * fopts[FOPT_SCALE]
                    for d in range(dim):
                        dqrow[d] += ds * ks[jj, d]
            cuda.syncthreads()
        if active:
            for d in range(dim):
                dq[b, h, i, d] = dqrow[d]

    return grad_q


def _build_grad_kv(nb_dtype, shared):
    """The dk, dv kernel: one thread per key of one query head, rows in increasing order."""
    tile, width = TILE, MAX_FEATURES
    row_interval, score, kept, unit, stage, _, listed_in = shared

    @cuda.jit
    def grad_kv(q, k, v, grad_out, stats, ints, fopts, bias, flags, slopes, dk_part, dv_part):
        length, keys, dim, vdim = ints[_I_LENGTH], ints[_I_KEYS], ints[_I_DIM], ints[_I_VDIM]
        lse, delta = stats[0], stats[1]
        b, h, g, tx, j = unit(ints)
        qs = cuda.shared.array((tile, width), nb_dtype)
        dos = cuda.shared.array((tile, width), nb_dtype)
        krow = cuda.local.array(width, nb_dtype)
        vrow = cuda.local.array(width, nb_dtype)
        dkrow = cuda.local.array(width, nb_dtype)
        dvrow = cuda.local.array(width, nb_dtype)
        ktile = cuda.local.array((1, width), nb_dtype)
        active = j < keys
        if active:
            for d in range(dim):
                krow[d] = k[b, g, j, d]
                ktile[0, d] = krow[d]
                dkrow[d] = 0.0
            for e in range(vdim):
                vrow[e] = v[b, g, j, e]
                dvrow[e] = 0.0
        for r0 in range(0, length, tile):
            stage(qs, dos, q[b, h], grad_out[b, h], r0, length, dim, vdim, tx)
            cuda.syncthreads()
            if active:
                for rr in range(min(tile, length - r0)):
                    i = r0 + rr
                    row_lse = lse[b, h, i]
                    if row_lse == -math.inf:
                        continue
                    lo, hi = row_interval(i, ints)
                    if j < lo or j >= hi or not listed_in(ints, b, g, i, j):
                        continue
                    # score(q_i, k_j): the same expression and order as in forward / grad_q
                    qrow = qs[rr]
                    ok, t, deriv = score(
                        qrow, ktile, 0, b, h, i, j, ints, fopts, bias, flags, slopes
                    )
                    if not ok or t == -math.inf:
                        continue
                    p = math.exp(t - row_lse)
                    dp = 0.0
                    if kept(b, h, i, j, ints, flags):
                        w = p * fopts[FOPT_KEEP_SCALE]
                        for e in range(vdim):
                            dp += dos[rr, e] * vrow[e]
                            dvrow[e] += w * dos[rr, e]
                        dp = dp * fopts[FOPT_KEEP_SCALE]
                    ds = p * (dp - delta[b, h, i]) * deriv * fopts[FOPT_SCALE]
                    for d in range(dim):
                        dkrow[d] += ds * qs[rr, d]
            cuda.syncthreads()
        if active:
            for d in range(dim):
                dk_part[b, h, j, d] = dkrow[d]
            for e in range(vdim):
                dv_part[b, h, j, e] = dvrow[e]

    return grad_kv


def _build_gather_forward(nb_dtype, shared):
    """The sparse-key forward: one thread per query row, its listed keys in increasing order
    (duplicates once; entries < 0 or outside the row's interval skipped), read from global
    memory; the arithmetic and order of ``forward`` on the listed set, so the same bits as
    ``forward`` with that set as a dense mask."""
    width = MAX_FEATURES
    row_interval, score, kept, unit, _, listed_start, _ = shared

    @cuda.jit
    def forward_gather(q, k, v, ints, fopts, bias, flags, slopes, out, lse):
        length, dim, vdim = ints[_I_LENGTH], ints[_I_DIM], ints[_I_VDIM]
        b, h, g, _, i = unit(ints)
        qrow = cuda.local.array(width, nb_dtype)
        acc = cuda.local.array(width, nb_dtype)
        if i >= length:
            return
        lo, hi = row_interval(i, ints)
        start, top = listed_start(ints, b, g, i)
        kb, vb = k[b, g], v[b, g]
        for d in range(dim):
            qrow[d] = q[b, h, i, d]
        for e in range(vdim):
            acc[e] = 0.0
        m = -math.inf
        total = 0.0
        last = -1
        for t in range(top):
            j = ints[start + t]
            if j < lo or j >= hi or j == last:
                continue
            last = j
            ok, s, _ = score(qrow, kb, j, b, h, i, j, ints, fopts, bias, flags, slopes)
            if not ok or s == -math.inf:
                continue
            if s > m:
                alpha = math.exp(m - s)
                total = total * alpha
                for e in range(vdim):
                    acc[e] = acc[e] * alpha
                m = s
            p = math.exp(s - m)
            total += p
            if kept(b, h, i, j, ints, flags):
                for e in range(vdim):
                    acc[e] += p * vb[j, e]
        if total == 0.0:
            fill = math.nan if ints[_I_NAN_ROWS] != 0 else 0.0
            for e in range(vdim):
                out[b, h, i, e] = fill
            lse[b, h, i] = math.nan if ints[_I_NAN_ROWS] != 0 else -math.inf
        else:
            inv = fopts[FOPT_KEEP_SCALE] / total
            for e in range(vdim):
                out[b, h, i, e] = acc[e] * inv
            lse[b, h, i] = m + math.log(total)

    return forward_gather


def _build_gather_grad_q(nb_dtype, shared):
    """The sparse-key dq (and dbias) kernel: one thread per query row, its listed keys in
    increasing order (the operations of ``grad_q`` on the listed set)."""
    width = MAX_FEATURES
    row_interval, score, kept, unit, _, listed_start, _ = shared

    @cuda.jit
    def grad_q_gather(q, k, v, grad_out, stats, ints, fopts, bias, flags, slopes, dq, dbias):
        length, dim, vdim = ints[_I_LENGTH], ints[_I_DIM], ints[_I_VDIM]
        b, h, g, _, i = unit(ints)
        qrow = cuda.local.array(width, nb_dtype)
        dorow = cuda.local.array(width, nb_dtype)
        dqrow = cuda.local.array(width, nb_dtype)
        if i >= length:
            return
        row_lse, d_i = stats[0, b, h, i], stats[1, b, h, i]
        lo, hi = row_interval(i, ints)
        start, top = listed_start(ints, b, g, i)
        kb, vb = k[b, g], v[b, g]
        for d in range(dim):
            qrow[d] = q[b, h, i, d]
            dqrow[d] = 0.0
        for e in range(vdim):
            dorow[e] = grad_out[b, h, i, e]
        last = -1
        for t in range(top if row_lse != -math.inf else 0):
            j = ints[start + t]
            if j < lo or j >= hi or j == last:
                continue
            last = j
            ok, s, deriv = score(qrow, kb, j, b, h, i, j, ints, fopts, bias, flags, slopes)
            if not ok or s == -math.inf:
                continue
            p = math.exp(s - row_lse)
            dp = 0.0
            if kept(b, h, i, j, ints, flags):
                for e in range(vdim):
                    dp += dorow[e] * vb[j, e]
                dp = dp * fopts[FOPT_KEEP_SCALE]
            ds = p * (dp - d_i)
            if ints[_I_BIAS] != 0:
                dbias[b, h, i, j] = ds
            ds = ds * deriv * fopts[FOPT_SCALE]
            for d in range(dim):
                dqrow[d] += ds * kb[j, d]
        for d in range(dim):
            dq[b, h, i, d] = dqrow[d]

    return grad_q_gather


def _prepare(spec, dtype):
    """(compute dtype, host arrays ``(q, k, v, ints, fopts, bias, flags, slopes)``)."""
    from ._args import kernel_arguments
    from ._dispatch import compute_dtype

    dtype = compute_dtype(spec.q.dtype) if dtype is None else np.dtype(dtype)
    _, _, _, _, _, dim, vdim = spec.dims
    if max(dim, vdim) > MAX_FEATURES:
        raise ValueError(
            f"q/v: the CUDA kernels take D, E <= {MAX_FEATURES}, got D={dim}, E={vdim}"
        )
    q, k, v, kv_head, dims, opts, fopts, terms = kernel_arguments(spec, dtype)
    bias, bstr, mask, mstr, drop, dstr, slopes = terms
    ints = np.concatenate([dims, opts, bstr, mstr, dstr, kv_head, _listed_ints(spec)])
    flags = np.zeros((2, max(mask.size, drop.size)), np.uint8)
    flags[0, : mask.size] = mask
    flags[1, : drop.size] = drop
    return dtype, (q, k, v, ints, fopts, bias, flags, slopes)


def _listed_ints(spec):
    """[T, the (B, K, L, T) lists sorted along T, flat] of a gather spec
    (:func:`refattn.kernels.gather_spec`: the set-read key indices kept as lists), else [-1]."""
    from ._dispatch import GATHER

    if spec.index_reading != GATHER:
        return np.array([-1], np.int64)
    listed = np.sort(np.asarray(spec.key_indices, np.int64), axis=-1)
    return np.concatenate([[listed.shape[-1]], listed.ravel()])


def _launch(kernel, rows, batch_heads, threads, *args):
    blocks = (max(1, -(-rows // threads)), max(1, batch_heads))
    kernel[blocks, threads](*args)


def _gathers(spec) -> bool:
    from ._dispatch import GATHER

    if spec.index_reading == GATHER and spec.normalizer != "softmax":
        raise NotImplementedError(
            "key_indices: the CUDA sigmoid kernels take the listed set as a dense mask; "
            "canonicalize(..., key_indices=...) instead of gather_spec"
        )
    return spec.index_reading == GATHER


def attention(spec, *, return_lse=False, dtype=None, threads=THREADS):
    """Forward attention of ``spec`` on the GPU; returns out (B, H, L, E) [, lse (B, H, L)].

    ``dtype``: compute dtype (default float64 for float64 inputs, else float32);
    ``threads``: query rows per block. A gather spec (:func:`refattn.kernels.gather_spec`)
    visits each row's listed keys only (set reading: duplicates once, -1 and out-of-range
    entries ignored), with no dense (L, S) plane.
    """
    if not _gathers(spec) and spec.normalizer == "sigmoid":
        return _sigmoid_attention(spec, return_lse, dtype, threads)
    dtype, args = _prepare(spec, dtype)
    _require_cuda()
    forward = _kernels(dtype)[3 if _gathers(spec) else 0]
    batch, heads, _, length, _, _, vdim = spec.dims
    out = cuda.device_array((batch, heads, length, vdim), dtype)
    lse = cuda.device_array((batch, heads, length), dtype)
    if length and batch * heads:
        device_args = [cuda.to_device(a) for a in args]
        _launch(forward, length, batch * heads, threads, *device_args, out, lse)
    out, lse = out.copy_to_host(), lse.copy_to_host()
    return (out, lse) if return_lse else out


def attention_vjp(spec, grad_out, grad_lse=None, *, dtype=None, threads=THREADS):
    """(dq, dk, dv, dbias) of attention on the GPU; dbias (B, H, L, S) or None.

    dk, dv are summed over the query heads of each kv group on the host in increasing head
    order (deterministic); empty rows have zero gradients.
    """
    if not _gathers(spec) and spec.normalizer == "sigmoid":
        return _sigmoid_vjp(spec, grad_out, grad_lse, dtype, threads)
    dtype, args = _prepare(spec, dtype)
    _require_cuda()
    forward, grad_q, grad_kv, forward_gather, grad_q_gather = _kernels(dtype)
    if _gathers(spec):  # the listed keys only; grad_kv tests each key's membership
        forward, grad_q = forward_gather, grad_q_gather
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    q, k, v, ints, fopts, bias, flags, slopes = args
    ints = ints.copy()
    ints[_I_NAN_ROWS] = 0  # the backward needs lse = -inf on empty rows
    q, k, v, ints, fopts, bias, flags, slopes = (
        cuda.to_device(a) for a in (q, k, v, ints, fopts, bias, flags, slopes)
    )
    options = (ints, fopts, bias, flags, slopes)
    out = cuda.device_array((batch, heads, length, vdim), dtype)
    lse = cuda.device_array((batch, heads, length), dtype)
    dq = cuda.to_device(np.zeros((batch, heads, length, dim), dtype))
    dk_part = cuda.to_device(np.zeros((batch, heads, keys, dim), dtype))
    dv_part = cuda.to_device(np.zeros((batch, heads, keys, vdim), dtype))
    dbias_shape = (batch, heads, length, keys) if spec.bias is not None else (1, 1, 1, 1)
    dbias = cuda.to_device(np.zeros(dbias_shape, dtype))
    if length and keys and batch * heads:
        _launch(forward, length, batch * heads, threads, q, k, v, *options, out, lse)
        host_out = out.copy_to_host()
        grad_out = np.ascontiguousarray(grad_out, dtype)
        delta = np.zeros((batch, heads, length), dtype)
        for e in range(vdim):  # sequential over E: a fixed order
            delta += grad_out[..., e] * host_out[..., e]
        if grad_lse is not None:
            delta -= np.asarray(grad_lse, dtype)
        stats = cuda.to_device(np.stack([lse.copy_to_host(), delta]))
        grad_dev = cuda.to_device(grad_out)
        _launch(
            grad_q, length, batch * heads, threads, q, k, v, grad_dev, stats, *options, dq, dbias
        )
        _launch(
            grad_kv,
            keys,
            batch * heads,
            threads,
            q,
            k,
            v,
            grad_dev,
            stats,
            *options,
            dk_part,
            dv_part,
        )
    dk_part, dv_part = dk_part.copy_to_host(), dv_part.copy_to_host()
    dk = np.zeros((batch, kv_heads, keys, dim), dtype)
    dv = np.zeros((batch, kv_heads, keys, vdim), dtype)
    for h in range(heads):  # increasing head order within each kv group
        dk[:, spec.kv_head[h]] += dk_part[:, h]
        dv[:, spec.kv_head[h]] += dv_part[:, h]
    return dq.copy_to_host(), dk, dv, (dbias.copy_to_host() if spec.bias is not None else None)


# --------------------------------------------------------------------------------------
# sigmoid attention (normalizer="sigmoid"): no normaliser, so no online rescaling. One
# thread owns one query row (forward, dq, dbias) or one key of one query head (dk, dv);
# every sum runs sequentially in that thread (keys, resp. query rows, in increasing
# order; the heads of a kv group are added on the host in increasing head order), as in
# refattn.kernels._cpu_sigmoid.
# --------------------------------------------------------------------------------------
_SIGMOID_KERNELS: dict = {}


def _sigmoid_kernels(dtype):
    key = np.dtype(dtype).name
    if key not in _SIGMOID_KERNELS:
        _require_cuda()
        _SIGMOID_KERNELS[key] = _build_sigmoid(np.dtype(dtype))
    return _SIGMOID_KERNELS[key]


def _build_sigmoid(dtype):
    """The sigmoid kernels (forward, dq and dbias, dk and dv) of one compute dtype."""
    import numba

    nb_dtype = numba.float64 if dtype == np.float64 else numba.float32
    shared = device_functions(nb_dtype) + _unit_functions()[:1] + (_sigmoid_device(),)
    return (_build_sigmoid_forward(nb_dtype, shared),) + _build_sigmoid_grads(nb_dtype, shared)


def _sigmoid_device():
    """sigmoid(t) as a device function (the form that does not overflow for either sign)."""

    @cuda.jit(device=True)
    def sigmoid(t):
        if t >= 0:
            return 1.0 / (1.0 + math.exp(-t))
        e = math.exp(t)
        return e / (1.0 + e)

    return sigmoid


def _build_sigmoid_forward(nb_dtype, shared):
    """The sigmoid forward kernel: one thread per query row, keys in increasing order."""
    width = MAX_FEATURES
    row_interval, score, kept, unit, sigmoid = shared

    @cuda.jit
    def forward(q, k, v, ints, fopts, bias, flags, slopes, out):
        length, dim, vdim = ints[_I_LENGTH], ints[_I_DIM], ints[_I_VDIM]
        b, h, g, _, i = unit(ints)
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
            fill = math.nan if ints[_I_NAN_ROWS] != 0 else 0.0
            for e in range(vdim):
                out[b, h, i, e] = fill
        else:
            for e in range(vdim):
                out[b, h, i, e] = acc[e] * fopts[FOPT_KEEP_SCALE]

    return forward


def _build_sigmoid_grads(nb_dtype, shared):
    """The sigmoid dq (and dbias) and dk, dv kernels."""
    width = MAX_FEATURES
    row_interval, score, kept, unit, sigmoid = shared

    @cuda.jit(device=True)
    def dp_of(grad_out, v, b, h, g, i, j, vdim):
        """dO_i . v_j, sequential over E."""
        dp = nb_dtype(0.0)
        for e in range(vdim):
            dp += grad_out[b, h, i, e] * v[b, g, j, e]
        return dp

    @cuda.jit(device=True)
    def ds_of(qrow, ks, j, b, h, i, ints, fopts, bias, flags, slopes, dp):
        """(allowed and kept, w kept-scaled, dS, dT) of position (i, j) given dP = dO_i . v_j."""
        ok, t, deriv = score(qrow, ks, j, b, h, i, j, ints, fopts, bias, flags, slopes)
        if not ok or t == -math.inf or not kept(b, h, i, j, ints, flags):
            return False, 0.0, 0.0, 0.0
        w = sigmoid(t)
        ds = w * sigmoid(-t) * (dp * fopts[FOPT_KEEP_SCALE])
        return True, w * fopts[FOPT_KEEP_SCALE], ds, ds * deriv

    @cuda.jit
    def grad_q(q, k, v, grad_out, ints, fopts, bias, flags, slopes, dq, dbias):
        length, dim = ints[_I_LENGTH], ints[_I_DIM]
        b, h, g, _, i = unit(ints)
        if i >= length:
            return
        qrow = cuda.local.array(width, nb_dtype)
        for d in range(dim):
            qrow[d] = q[b, h, i, d]
        lo, hi = row_interval(i, ints)
        ks = k[b, g]
        for j in range(lo, hi):
            dp = dp_of(grad_out, v, b, h, g, i, j, ints[_I_VDIM])
            ok, _, ds, dt = ds_of(qrow, ks, j, b, h, i, ints, fopts, bias, flags, slopes, dp)
            if not ok:
                continue
            if ints[_I_BIAS] != 0:
                dbias[b, h, i, j] = ds
            for d in range(dim):
                dq[b, h, i, d] += dt * fopts[FOPT_SCALE] * k[b, g, j, d]

    @cuda.jit
    def grad_kv(q, k, v, grad_out, ints, fopts, bias, flags, slopes, dk_part, dv_part):
        length, keys = ints[_I_LENGTH], ints[_I_KEYS]
        dim, vdim = ints[_I_DIM], ints[_I_VDIM]
        b, h, g, _, j = unit(ints)
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
            dp = dp_of(grad_out, v, b, h, g, i, j, vdim)
            ok, w, _, dt = ds_of(qrow, ks, j, b, h, i, ints, fopts, bias, flags, slopes, dp)
            if not ok:
                continue
            for d in range(dim):
                dk_part[b, h, j, d] += dt * fopts[FOPT_SCALE] * qrow[d]
            for e in range(vdim):
                dv_part[b, h, j, e] += w * grad_out[b, h, i, e]

    return grad_q, grad_kv


def _sigmoid_attention(spec, return_lse, dtype, threads):
    """Sigmoid forward of ``spec`` on the GPU: out (B, H, L, E) (no lse: an error)."""
    if return_lse:
        raise ValueError("return_lse: normalizer='sigmoid' has no log-sum-exp")
    dtype, args = _prepare(spec, dtype)
    forward, _, _ = _sigmoid_kernels(dtype)
    batch, heads, _, length, _, _, vdim = spec.dims
    out = cuda.to_device(np.zeros((batch, heads, length, vdim), dtype))
    if length and batch * heads:
        _launch(forward, length, batch * heads, threads, *(cuda.to_device(a) for a in args), out)
    return out.copy_to_host()


def _sigmoid_vjp(spec, grad_out, grad_lse, dtype, threads):
    """(dq, dk, dv, dbias) of sigmoid attention on the GPU; dbias (B, H, L, S) or None."""
    if grad_lse is not None:
        raise ValueError("grad_lse: normalizer='sigmoid' has no log-sum-exp")
    dtype, args = _prepare(spec, dtype)
    _, grad_q, grad_kv = _sigmoid_kernels(dtype)
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
