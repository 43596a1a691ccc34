"""Thin wrappers from an :class:`~refattn.spec.AttentionSpec` to the kernels.

The kernels (:mod:`refattn.kernels.numba_cpu`, :mod:`refattn.kernels.cuda`) are loops over one
work unit; these wrappers own the choice of compute dtype and the return conventions that
:func:`refattn.attention` and :func:`refattn.attention_vjp` expect for ``backend="numba"``.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = [
    "GATHER",
    "gathers",
    "gather_spec",
    "attention",
    "attention_vjp",
    "compute_dtype",
    "COMPILE_MESSAGE",
    "announce_compile",
    "precompile",
    "PATHS",
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
    if _announced:
        return
    modules = module if isinstance(module, tuple) else (module,)
    entries = [
        f
        for one in modules
        for f in vars(one).values()
        if getattr(f, "targetoptions", {}).get("parallel") and names in f.__name__
    ]
    if not all(_cached_for_this_cpu(f) for f in entries):
        _announced.append(True)
        print(COMPILE_MESSAGE, file=sys.stderr, flush=True)


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

    if spec.normalizer == "sigmoid":  # no lse: a per-row plain sum (refattn.kernels._cpu_sigmoid)
        return _sigmoid_attention(spec, return_lse, _dtype(spec, dtype))
    announce_compile((_cpu_forward, _cpu_decode), names="forward")
    out, lse = numba_cpu.forward(spec, _dtype(spec, dtype))
    return (out, lse) if return_lse else out


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
        from . import _cpu_sigmoid

        if grad_lse is not None:
            raise ValueError("grad_lse: normalizer='sigmoid' has no log-sum-exp")
        announce_compile(_cpu_sigmoid)
        return _cpu_sigmoid.sigmoid_backward(spec, grad_out, _dtype(spec, dtype))
    announce_compile((_cpu_forward, _cpu_decode, _cpu_backward))
    return numba_cpu.backward(spec, grad_out, grad_lse, _dtype(spec, dtype))


def _sigmoid_attention(spec, return_lse, dtype):
    """The sigmoid forward; its "lse" is NaN (there is no normaliser)."""
    from . import _cpu_sigmoid

    announce_compile(_cpu_sigmoid, names="forward")
    out = _cpu_sigmoid.sigmoid_forward(spec, dtype)
    return (out, np.full(out.shape[:-1], np.nan, dtype)) if return_lse else out


def precompile(dtypes=("float64", "float32"), paths=PATHS, *, report=None) -> dict:
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
    paths : iterable of {"forward", "decode", "backward"}
        :data:`PATHS`: the query-block forward, the short-query (key-split) forward and the
        backward pass.
    report : callable, optional
        Called as ``report(path, dtype, seconds)`` after each one.

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
    import time

    from ..spec import canonicalize
    from . import numba_cpu

    times = {}
    for dtype in dtypes:
        dtype = np.dtype(dtype)
        if dtype not in (np.float64, np.float32):
            raise ValueError(f"dtypes: the kernels compute in float64 or float32, got {dtype}")
        for path in paths:
            if path not in PATHS:
                raise ValueError(f"paths: {path!r} is not one of {PATHS}")
            # the smallest shapes that take each path (decode: a key split of its own)
            length, keys = (1, numba_cpu.SPLIT_KEYS + 1) if path == "decode" else (2, 2)
            spec = canonicalize(
                np.zeros((1, length, 4), dtype),
                np.zeros((1, keys, 4), dtype),
                np.zeros((1, keys, 4), dtype),
            )
            start = time.perf_counter()
            if path == "backward":
                numba_cpu.backward(spec, np.zeros((1, 1, length, 4), dtype))
            else:
                numba_cpu.forward(spec)
            times[path, dtype.name] = time.perf_counter() - start
            if report is not None:
                report(path, dtype.name, times[path, dtype.name])
    return times
