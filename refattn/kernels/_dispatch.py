"""Thin wrappers from an :class:`~refattn.spec.AttentionSpec` to the kernels.

The kernels (:mod:`refattn.kernels.numba_cpu`, :mod:`refattn.kernels.cuda`) are loops over one
work unit; these wrappers own the choice of compute dtype and the return conventions that
:func:`refattn.attention` and :func:`refattn.attention_vjp` expect for ``backend="numba"``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

__all__ = [
    "GATHER",
    "gathers",
    "gather_spec",
    "listed_keys",
    "attention",
    "plain_gather_attention",
    "attention_vjp",
    "compute_dtype",
    "COMPILE_MESSAGE",
    "announce_compile",
    "precompile",
    "PATHS",
    "FAMILIES",
]

COMPILE_MESSAGE = (
    "refattn: compiling Numba kernels for this CPU (first use, 10-20 s per path "
    "and dtype; cached afterwards; `python -m refattn.kernels` compiles all "
    "ahead of time)"
)
#: The separately compiled kernel paths of :mod:`.numba_cpu` (each compiles on first use):
#: ``_cpu_forward``, ``_cpu_decode`` and ``_cpu_backward``.
PATHS = ("forward", "decode", "backward")
_announced = []
_all_cached = set()


def _cached_for_this_cpu(dispatcher) -> bool:
    """Whether ``dispatcher`` is compiled in memory or has an on-disk cache entry for this CPU.

    Best effort through Numba's cache index (not a public API): if it cannot be read, say
    "cached" (no message) rather than announce a compile that may not happen.
    """
    try:
        if dispatcher.overloads:
            return True
        magic = dispatcher.targetctx.codegen().magic_tuple()
        index = dispatcher._cache._cache_file._load_index()  # noqa: SLF001 (Numba internals)
        return any(key[1] == magic for key in index)
    except Exception:  # NUMBA_DISABLE_JIT, another Numba layout, no cache: stay silent
        return True


def announce_compile(module, *, names: str = "") -> None:
    """Print :data:`COMPILE_MESSAGE` to stderr once per process before a Numba compile.

    The entry kernels of ``module`` (a module or a tuple of modules: their ``parallel=True``
    dispatchers whose name contains ``names``) are checked; if one is neither in memory nor
    cached on disk for this CPU, the call about to run will compile (18-120 s here), so the
    user is told why it is silent.
    """
    if _announced or os.environ.get("REFATTN_COMPILE_MESSAGE") == "0":
        return
    modules = module if isinstance(module, tuple) else (module,)
    key = (tuple(one.__name__ for one in modules), names)
    if key in _all_cached:  # checked before: every entry compiled or cached (reading Numba's
        return  # on-disk index costs ~1 ms a call, a decode step costs less)
    entries = [
        f
        for one in modules
        for f in vars(one).values()
        if getattr(f, "targetoptions", {}).get("parallel") and names in f.__name__
    ]
    if not all(_cached_for_this_cpu(f) for f in entries):
        _announced.append(True)
        print(COMPILE_MESSAGE, file=sys.stderr, flush=True)
    else:
        _all_cached.add(key)


#: The ``index_reading`` of a spec whose key indices the Numba CPU forward gathers itself (set
#: reading; the listed set is NOT in the spec's mask): :func:`gather_spec`.
GATHER = "gather"


def gathers(*, backend, precision, key_indices, key_block_indices, index_reading, options):
    """Whether ``refattn.attention`` hands the set-read key indices to the gather kernel
    (:mod:`._cpu_gather`) instead of ANDing them into a dense mask: backend "numba", the
    float64 precision, the set reading, the softmax, no weights returned, and no option that
    :func:`refattn.spec.fold` rewrites (sinks, kv_lengths). ``options``: the call's other
    keywords by name (``normalizer``, ``return_weights``, ``sinks``, ``kv_lengths``)."""
    return (
        backend == "numba"
        and precision == "float64"
        and index_reading == "set"
        and (key_indices is not None or key_block_indices is not None)
        and options.get("normalizer", "softmax") == "softmax"
        and not options.get("return_weights", False)
        and options.get("sinks") is None
        and options.get("kv_lengths") is None
    )


def gather_spec(spec, key_indices, key_block_indices=None, key_block_size=None):
    """``spec`` (canonicalised without key indices) with its validated (B, K, L, T) key indices
    (:func:`refattn.sparse_indices.canonical_indices`, the set reading) kept as lists for the
    gather kernel: ``index_reading`` = :data:`GATHER`, the mask left as the caller's (no dense
    (B, K, L, S) plane of the listed set is built).

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.ones((1, 4)), np.ones((3, 4)), np.arange(3.0)[:, None])
    >>> spec = gather_spec(spec, np.array([[2, 2, -1]]))
    >>> attention(spec).ravel().tolist()
    [2.0]
    """
    import dataclasses

    from ..sparse_indices import canonical_indices

    _, _, kv_heads, length, keys, _, _ = spec.dims
    indices = canonical_indices(
        key_indices,
        key_block_indices,
        key_block_size,
        "set",
        batch_shape=tuple(spec.batch_shape),
        kv_heads=kv_heads,
        length=length,
        keys=keys,
        single_head=spec.single_head,
    )
    return dataclasses.replace(spec, key_indices=indices, index_reading=GATHER)


def listed_keys(k, listed):
    """What the range check of ``refattn.attention(..., backend="numba")`` reads of ``k``
    (B, K, S, D) for a gather forward: the rows that the (B, K, L, T) ``listed`` indices name
    (entries outside [0, S) ignored). A float32/float64 k with a contiguous feature axis is
    read in place by a compiled loop and stands in as one value, its largest finite |x| over
    those rows (no gathered copy of a decode step's T rows); otherwise the rows themselves
    (NumPy, the distinct listed keys along S).

    Examples
    --------
    >>> k = np.arange(12.0).reshape(1, 1, 4, 3)
    >>> listed_keys(k, np.array([[[[0, 2, -1, 9]]]])).tolist()
    [8.0]
    """
    from ._cpu_gather import listed_top

    k, listed = np.asarray(k), np.asarray(listed, np.int64)
    if (
        k.dtype in (np.float32, np.float64)
        and k.ndim == listed.ndim == 4
        and k.shape[:2] == listed.shape[:2]
        and k.strides[-1] == k.itemsize
    ):
        found = listed_top(k, listed, k.dtype.type(-1))
        if np.isfinite(found):  # Inf among the rows: NumPy's pass skips it below
            return np.array([found], k.dtype)
    keys = np.unique(listed[(listed >= 0) & (listed < k.shape[-2])])
    return np.take(k, keys, axis=-2)


def compute_dtype(dtype) -> np.dtype:
    """float64 inputs compute in float64; float32, float16 and bfloat16 compute in float32.

    Examples
    --------
    >>> compute_dtype(np.float16)
    dtype('float32')
    """
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _dtype(spec, dtype):
    if dtype is None:
        return compute_dtype(spec.q.dtype)
    dtype = np.dtype(dtype)
    if dtype not in (np.float64, np.float32):
        raise ValueError(f"dtype: the kernels compute in float64 or float32, got {dtype}")
    return dtype


def attention(spec, *, return_lse: bool = False, dtype=None):
    """Forward attention of ``spec`` by the Numba CPU kernel.

    Parameters
    ----------
    spec : AttentionSpec
        From :func:`refattn.spec.canonicalize` (flat batch: q (B, H, L, D), ...).
    return_lse : bool
        Also return the log-sum-exp (B, H, L) of the final scores (pre-dropout).
    dtype : {None, float64, float32}
        Compute dtype; default :func:`compute_dtype` of q's dtype. Outputs have this dtype.

    Returns
    -------
    out : ndarray (B, H, L, E), and lse : ndarray (B, H, L) when ``return_lse``.

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> q = k = v = np.ones((1, 1, 2, 8))
    >>> attention(canonicalize(q, k, v, causal=True))[0, 0, :, 0].tolist()
    [1.0, 1.0]
    """
    from . import _cpu_decode, _cpu_forward, numba_cpu

    if spec.normalizer == "sigmoid":  # no lse: plain sums (refattn.kernels._cpu_sigmoid_tiles)
        return _sigmoid_attention(spec, return_lse, _dtype(spec, dtype))
    announce_compile((_cpu_forward, _cpu_decode), names="forward")
    out, lse = numba_cpu.forward(spec, _dtype(spec, dtype))
    return (out, lse) if return_lse else out


def plain_gather_attention(q, k, v, listed, scale):
    """(out, lse, top) of :func:`attention` for a plain sparse-key call (no option but
    ``scale``) without its spec: :func:`refattn.kernels.numba_cpu.plain_gather_forward` (the
    arguments and the bits of the spec's gather forward; ``top`` max |x| over the key rows
    read, NaN skipped, Inf kept). q (B, H, L, D), k (B, K, S, D), v (B, K, S, E) of one
    dtype, float32 or float64; ``listed`` (B, K, L, T) sorted int64.

    Examples
    --------
    >>> q = k = v = np.ones((1, 1, 1, 4))
    >>> plain_gather_attention(q, k, v, np.array([[[[0]]]]), None)[0].ravel().tolist()
    [1.0, 1.0, 1.0, 1.0]
    """
    from . import _cpu_decode, _cpu_forward, numba_cpu

    announce_compile((_cpu_forward, _cpu_decode), names="forward")
    return numba_cpu.plain_gather_forward(q, k, v, listed, scale)


def attention_vjp(spec, grad_out, grad_lse=None, *, dtype=None):
    """Vector-Jacobian product of attention by the Numba CPU kernels.

    Parameters
    ----------
    spec : AttentionSpec
    grad_out : ndarray (B, H, L, E)
        Cotangent of the output.
    grad_lse : ndarray (B, H, L), optional
        Cotangent of the log-sum-exp.
    dtype : {None, float64, float32}
        Compute dtype (default from q's dtype).

    Returns
    -------
    (dq, dk, dv, dbias): dq (B, H, L, D), dk (B, K, S, D), dv (B, K, S, E) summed over the
    query heads sharing a kv head; dbias (B, H, L, S) or None without bias (the caller sums
    it back to the bias's own shape). Empty rows have zero gradients.
    """
    from . import _cpu_backward, _cpu_decode, _cpu_forward, numba_cpu

    if spec.normalizer == "sigmoid":
        if grad_lse is not None:
            raise ValueError("grad_lse: normalizer='sigmoid' has no log-sum-exp")
        return _sigmoid_vjp(spec, grad_out, _dtype(spec, dtype))
    announce_compile((_cpu_forward, _cpu_decode, _cpu_backward))
    return numba_cpu.backward(spec, grad_out, grad_lse, _dtype(spec, dtype))


def _sigmoid_attention(spec, return_lse, dtype):
    """The sigmoid forward (tiled); its "lse" is NaN (there is no normaliser)."""
    from . import _cpu_sigmoid_tiles

    announce_compile(_cpu_sigmoid_tiles, names="forward")
    out = _cpu_sigmoid_tiles.sigmoid_forward_tiled(spec, dtype)
    return (out, np.full(out.shape[:-1], np.nan, dtype)) if return_lse else out


def _sigmoid_vjp(spec, grad_out, dtype):
    """The sigmoid vjp: the tiled kernel for finite q, k, v and grad_out, else the scalar
    per-row kernel (the same bits where both apply; a zero weight must not meet inf there)."""
    from . import _cpu_sigmoid, _cpu_sigmoid_tiles

    finite = all(np.isfinite(x).all() for x in (spec.q, spec.k, spec.v, grad_out))
    if finite:
        announce_compile(_cpu_sigmoid_tiles)
        return _cpu_sigmoid_tiles.sigmoid_backward_tiled(spec, grad_out, dtype)
    announce_compile(_cpu_sigmoid)
    return _cpu_sigmoid.sigmoid_backward(spec, grad_out, dtype)


#: What :func:`precompile` can compile: the Numba CPU attention paths of :data:`PATHS`, the
#: sparse gather (forward and vjp), sigmoid attention (forward and vjp), the linear-attention
#: kernels (recurrent and chunked, forward and vjp) and the exact engine's compiled first steps
#: (attention forward and vjp, sigmoid-attention forward, linear-attention forward; they
#: compute in float64 and double-double whatever the dtype).
FAMILIES = PATHS + ("gather", "sigmoid", "linear", "exact")


def _tiny(dtype, length, keys, dim=4, heads=1):
    rng = np.random.default_rng(0)
    return tuple(
        rng.standard_normal((1, heads, n, dim)).astype(dtype) for n in (length, keys, keys)
    )


def _warm_attention(path, dtype):
    """The smallest call that takes ``path`` in ``dtype`` (through the public functions where
    the path has one, so the kernels see the arrays every caller hands them)."""
    from .. import attention, attention_vjp, linear_attention, linear_attention_vjp
    from ..spec import canonicalize
    from . import numba_cpu

    if path in PATHS:
        length, keys = (1, numba_cpu.SPLIT_KEYS + 1) if path == "decode" else (2, 2)
        spec = canonicalize(*(np.zeros((1, n, 4), dtype) for n in (length, keys, keys)))
        if path == "backward":
            return numba_cpu.backward(spec, np.zeros((1, 1, length, 4), dtype))
        return numba_cpu.forward(spec)
    q, k, v = _tiny(dtype, 2, 3)
    do = np.ones((1, 1, 2, 4), dtype)
    if path in ("gather", "sigmoid"):
        options = (
            {"key_indices": np.array([[[[0, 2], [1, -1]]]])}
            if path == "gather"
            else {"normalizer": "sigmoid"}
        )
        attention(q, k, v, backend="numba", **options)
        if path == "gather":  # a decode's range check (fewer listed entries than keys)
            listed_keys(k, np.zeros((1, 1, 1, 1), np.int64))
        return attention_vjp(q, k, v, do, backend="numba", **options)
    if path == "exact":
        attention(q, k, v, precision="exact", out_dtype=dtype)
        attention(q, k, v, precision="exact", out_dtype=dtype, normalizer="sigmoid")
        linear_attention(q, q, q, -np.abs(q[..., 0]), precision="exact", out_dtype=dtype)
        return attention_vjp(q, k, v, do, precision="exact", out_dtype=dtype)
    q, k, v = _tiny(dtype, 2, 2)
    g = -np.abs(q[..., 0])
    beta = np.full(g.shape, 0.5, dtype)
    for backend in ("numba", "numba-chunked"):
        linear_attention(q, k, v, g, beta, backend=backend)
        linear_attention_vjp(q, k, v, g, beta, do, backend=backend)
    return None


def precompile(dtypes=("float64", "float32"), paths=PATHS, *, report=None, jobs: int = 1) -> dict:
    """Compile (or load from Numba's on-disk cache) the CPU kernels ahead of first use.

    Each (path, compute dtype) is one set of Numba specialisations (every option is a runtime
    flag and float16/bfloat16 inputs compute in float32, so there is nothing else to compile);
    once compiled they are cached per CPU in ``refattn/kernels/__pycache__`` (or
    ``NUMBA_CACHE_DIR``), and later processes load them in well under a second. Run it once
    after installing, e.g. ``python -m refattn.kernels``.

    Parameters
    ----------
    dtypes : iterable of {"float64", "float32"}
        Compute dtypes.
    paths : iterable of :data:`FAMILIES`
        :data:`PATHS` (the query-block forward, the short-query (key-split) forward and the
        backward pass of ``backend="numba"``), ``"gather"`` (sparse key indices),
        ``"sigmoid"``, ``"linear"`` (:func:`refattn.linear_attention`'s Numba kernels) and
        ``"exact"`` (the exact engine's compiled first steps).
    report : callable, optional
        Called as ``report(path, dtype, seconds)`` after each one.
    jobs : int
        Processes compiling at once: with ``jobs > 1`` the (path, dtype) pairs are shared out
        among ``jobs`` fresh interpreters (``python -m refattn.kernels``) that fill the cache,
        so each kernel is compiled once, on every core; the times are then those of the
        subprocesses.

    Returns
    -------
    dict
        ``{(path, dtype): seconds}``: wall time of each first call (compile or cache load).

    Examples
    --------
    >>> times = precompile(["float64"], ["forward"])
    >>> list(times)
    [('forward', 'float64')]
    """
    units = []
    for dtype in dtypes:
        dtype = np.dtype(dtype)
        if dtype not in (np.float64, np.float32):
            raise ValueError(f"dtypes: the kernels compute in float64 or float32, got {dtype}")
        for path in paths:
            if path not in FAMILIES:
                raise ValueError(f"paths: {path!r} is not one of {FAMILIES}")
            units.append((path, dtype))
    if jobs > 1 and len(units) > 1:
        return _precompile_parallel(units, jobs, report)
    times = {}
    for path, dtype in units:
        start = time.perf_counter()
        _warm_attention(path, dtype)
        times[path, dtype.name] = time.perf_counter() - start
        if report is not None:
            report(path, dtype.name, times[path, dtype.name])
    return times


#: Relative compile cost of each group of :func:`precompile` units (measured cold, 2-core
#: EPYC): the exact engine and the linear kernels compile their float64 code for either
#: dtype, and the backward compiles the forward it saves, so each group stays in one process.
_GROUP_COST = {"exact": 55, "linear": 44, "attention": 45, "gather": 25, "sigmoid": 15}


def _group(unit):
    path, dtype = unit
    return ("attention", dtype.name) if path in PATHS else (path,)


def _shares(units, jobs):
    """``units`` in ``jobs`` lists: whole groups (:func:`_group`), largest first, each to the
    least loaded list; within a list the backward before the forward it compiles anyway."""
    groups = {}
    for unit in units:
        groups.setdefault(_group(unit), []).append(unit)
    order = sorted(groups, key=lambda g: (-_GROUP_COST[g[0]], g))
    shares, load = [[] for _ in range(jobs)], [0] * jobs
    for key in order:
        least = load.index(min(load))
        first = sorted(groups[key], key=lambda u: (u[0] != "backward", u[1].name != "float64"))
        shares[least] += first
        load[least] += _GROUP_COST[key[0]]
    return [share for share in shares if share]


def _precompile_parallel(units, jobs, report):
    """:func:`precompile` of ``units`` in ``jobs`` subprocesses (:func:`_shares`)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "refattn.kernels", "--units"]
            + [f"{path}:{dtype.name}" for path, dtype in share],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "REFATTN_COMPILE_MESSAGE": "0"},  # the caller says it, once
        )
        for share in _shares(units, jobs)
    ]
    times, failed = {}, []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            failed.append(f"{' '.join(proc.args[4:])} (exit {proc.returncode})")
        for line in out.splitlines():
            path, dtype, seconds = line.split()
            times[path, dtype] = float(seconds)
            if report is not None:
                report(path, dtype, float(seconds))
    if failed:
        raise RuntimeError(f"precompile: these units failed: {'; '.join(failed)}")
    return times
