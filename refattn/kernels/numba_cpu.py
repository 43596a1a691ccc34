"""Deterministic Numba CPU kernels for scaled dot-product attention (forward and backward).

The kernels implement exactly the semantics of docs/conventions.md (the order scores ->
softcap -> + bias -> + ALiBi -> allowed set -> softmax -> dropout -> @ v) by streaming over
key blocks with the online softmax of Milakov & Gimelshein (2018, Algorithm 3), per block:

.. math::

    m^{(t)} = \\max(m^{(t-1)}, \\max_j s_j), \\qquad
    \\ell^{(t)} = \\ell^{(t-1)} e^{m^{(t-1)} - m^{(t)}} + \\sum_j e^{s_j - m^{(t)}},

    o^{(t)} = o^{(t-1)} e^{m^{(t-1)} - m^{(t)}} + \\sum_j e^{s_j - m^{(t)}} v_j ,

so no (L, S) matrix is ever formed: the working memory of a work unit is a few
``BLOCK_Q x BLOCK_K`` tiles and the whole call needs O(L*E + S*D) memory.

Layout
------
This module holds the public wrappers (shapes, dtypes, allocation) and re-exports; the
compiled loops live in one private module per job: ``_cpu_tiles`` (register-tile products,
row loads and row reductions), ``_cpu_scores`` (a tile's final scores: the allowed set from
:func:`refattn.spec.key_interval` and the optional terms), ``_cpu_forward`` (the query-block
forward), ``_cpu_decode`` (the short-query key-split forward) and ``_cpu_backward`` (the
backward pass). Compiled functions take the argument records of
:func:`refattn.kernels._args.kernel_arguments` and tuples of their work arrays.

Determinism
-----------
Work is split into units (batch, head, query block) for the forward pass and
(batch, head, query chunk) for the backward pass, run with ``prange``; the key blocks are first
packed once per (batch, kv head) (K transposed, V padded: pure copies). Short queries (the
query rows of a whole kv-head group fit one tile, ``(H/K) L <= BLOCK_Q``, and S >
:data:`SPLIT_KEYS`: decoding) use units (batch, kv head, key split) instead: the rows of all
query heads of a group share each loaded key block, and each split of :data:`SPLIT_KEYS` keys
(a fixed size, not a fixed count) leaves a partial (max, sum, accumulator) per row that is
combined in increasing split order. Each unit writes only its own outputs and computes every
reduction in an order fixed by the shapes alone, so the results are bit-identical for any
number of threads, any batch and any run. ``fastmath`` is off; products
that are accumulated use ``llvm.fma`` explicitly (one rounding, the same on every machine).

The reduction orders are:

* scores ``q_i . k_j``: sequential over the D axis (one fused multiply-add per term); on the
  short-query path with one query row per kv head (an MHA decode step, D a multiple of the
  lanes) the keys are read in place instead of transposed: lane ``w`` sums the features
  ``x = w mod W`` in increasing order, then the lanes in increasing order, and the weighted
  values are added key by key in increasing order (the chain of the tiles), skipping keys
  whose score is -inf;
* ``sum_j p_ij v_j``, ``dq``, ``dk``, ``dv``: sequential over keys (queries) within a block,
  blocks in increasing order;
* the softmax normaliser of a block: ``W`` lane-wise partial sums (lane ``w`` sums the keys
  ``j = w mod W`` of the block in increasing order), then the lanes in increasing order. ``W``
  is 8 (float64) or 16 (float32), so a 64-byte vector holds one partial sum per lane;
* dk, dv partials of the query chunks and of the query heads sharing a kv head: added in
  increasing (head, chunk) order;
* short-query path: the splits' partials rescaled to the overall maximum and added with one
  fused multiply-add each, in increasing split order.

Vectorisation is across independent outputs only (SIMD lanes over keys or value columns in
4-row x 4-vector register tiles, the columns padded to a multiple of four vectors); no
reduction is re-associated by the compiler. The tile shape changes no bit: each output element
is the same sequential chain of fused multiply-adds. On a key block that ends past what the
first rows of a query block may read (the causal diagonal), each 4-row group computes the
scores and weighted values of the keys up to its last row's reach only: the skipped scores are
excluded positions (set to -inf without being read), the skipped terms of ``sum_j p_ij v_j``
are ``fma(+0, v, a)``, which is ``a`` except for ``a = -0``, whose chain is replayed: the same
bits.

Where the time goes
-------------------
Measured on a 2-core AMD EPYC Zen 4 (LLVM cpu ``znver4``, AVX-512; 64-byte vectors issue as
two 32-byte halves), B1 H8 L=S=1024 D64 float64 forward, one thread, per phase (before ->
after the present layout; machine shared, load about 2): q k^T tiles 23.5 ms and p v tiles
22.5 ms (each 537 M fused multiply-adds, about 46 GFLOP/s), max + exp + row sums 15.8 ->
13.4 ms (scalar exp, then :func:`~refattn.kernels._simd.vexp` on 8 lanes: the degree-13
Horner chain of 8.4 M exponentials is the largest cost besides the products), loading K^T and
V blocks 8.2 ms (repeated for every query block) -> 4.5 ms (packed once per kv head), scaling
the scores 1.9 -> 1.3 ms -> folded into the loads of the max and exp passes (the same
product per score, so the same bits); the rest (zeroing tiles, rescaling accumulators,
normalising) about 8 ms. The whole forward went from 74 to 64 ms on one thread (float32: 42
-> 32 ms). Outside the kernels, every call used to copy q, k and v (the argument layout asked
for writeable arrays, and the inputs arrive as read-only views): 3 x 4 MiB here, 2 x 64 MiB
for a GQA decode step at S 8192; they now pass as read-only views.

The products are near the machine's limit: a loop of register-only 512-bit fused
multiply-adds reaches 58.7 GFLOP/s on one core (3.7 GHz x 16 float64 flops per cycle), one
64 x 64 x 64 product tile 48 GFLOP/s (10.9 us; 82 %). The inner tiles compile to
``vfmadd231pd`` on ``zmm`` registers with broadcast operands
(``_cpu_forward._forward_units.inspect_asm(...signatures[0])``, with the cache off): 512-bit
vectors are used whatever LLVM's preferred vector width for the target, since the kernels
spell the vector type themselves; accumulators stay in registers (16 of the 32 zmm), only
address registers spill. Bytes per flop: a 64-key block of K^T and V (2 x 32 KiB) serves 64
query rows (one byte of L2 traffic per 8 flops); the tiles read 0.5 operands from L1 per
fused multiply-add. ``NUMBA_CPU_NAME`` (``znver4`` = host, ``znver3``, ``skylake-avx512``,
``sapphirerapids``) moved the forward by less than the run-to-run noise of this shared
machine (0.83-1.07x torch across targets and runs), so the host default is kept.

Backward (same shape, one thread, CPU time so that the load of the shared machine, 9-12,
does not count): per (query block, key block) pair five 64 x 64 x 64 products (S = q k^T
recomputed, dP = dO v^T, dq += dS k, dk += dS^T q, dv += P^T dO; 10.9 us each) and P, dS
(exp and five vector operations, 4.3 us), against two products and about 5 us of max, exp
and sums in the forward: the floor of backward / forward for this split of the work is about
(5 x 10.9 + 4.9) / (2 x 10.9 + 5.2) = 2.2; measured, the units take 2.09x the forward (138.5
vs 66.4 ms) and the whole pass 2.15-2.3x. Memory is not the limit: per pair the backward
reads three 32 KiB key-side blocks and updates 32 KiB dk and dv tiles while the query side
(q, q^T, dO, dO^T, the dq accumulator: 160 KiB) stays in L2, 12 flops per byte moved from
L3. What made two threads worse (2.26-2.65x) was around the units: four query chunks per head
(32 units) each kept its own (S, D) and (S, E) dk, dv partials, 32 MiB of fresh pages per
call (page faults and zeroing) read back by a separate reduction (17.8 ms on two threads
under load, 0.18x the forward). A unit is now a whole head whenever B H >= 8
(:func:`backward_chunks`): with H == K it writes dk and dv directly, and units are handed to
threads one at a time (``parallel_chunksize(1)``) so that a core busy with other work does
not hold up the rest.

First-use compile (Numba, from an empty cache, CPU seconds with the machine at load 10;
LLVM is about 65 %), before -> after: forward float64 15.9 -> 12.9, backward 27.1 -> 20.8,
decode 14.5 -> 10.2; float32 18.0 -> 12.1, 22.0 -> 16.8, 14.0 -> 11.5 (all six 111 -> 84 s);
the two versions compiling side by side (the same load for both): forward, backward, decode
float64 and forward float32 19.6 -> 14.4, 37.3 -> 26.9, 14.5 -> 14.1, 16.6 -> 13.5 (88 -> 69 s).
Every option is a runtime flag (one specialisation per path and compute dtype; float16 and
bfloat16 inputs compute in float32); what was duplicated: each work unit compiled twice (the
``prange`` index is unsigned in the parallel loop body and signed when the call is typed),
literal-0 copies of the row helpers on the short-query path, and 8 x 2-vector tiles beside
the 4 x 4 ones in every product. The compiled kernels are cached per CPU (Numba's cache index
keys on the CPU name and features) and a later process loads all six in about a second;
``python -m refattn.kernels`` (:func:`refattn.kernels.precompile`) fills the cache ahead of
first use. Numba's ahead-of-time compiler (``numba.pycc``, deprecated) cannot build
``parallel=True`` functions, so the cache is the ahead-of-time path.

Precision
---------
float64 inputs compute in float64; float32, float16 and bfloat16 inputs compute in float32
(float32 accumulation). The optional terms (softcap, bias, ALiBi) are evaluated in float64
and rounded once to the compute dtype. ``exp`` is a polynomial kernel accurate to about one
ulp (:func:`exp_float64`, :func:`exp_float32`).

Conventions pinned here
-----------------------
* A score equal to -inf after softcap/bias/ALiBi is treated as an excluded position (its
  weight is zero and its value row is not read); this only differs from the NumPy path
  when q . k overflows to -inf.
* Backward: dq is final per unit; dk, dv are summed over query chunks and query heads in a
  fixed order (one chunk per head when B H >= 8); dbias is returned as a full (B, H, L, S)
  array (only when bias is given).
"""

from __future__ import annotations

import math

import numpy as np

from ..bounds.kernels import online_backward_bound, online_forward_bound
from ..spec import canonicalize
from ._args import DIM_KEYS, DIM_VDIM, FOPT_SCALE, OPT_EMPTY_ROWS_NAN, kernel_arguments, read_only
from ._cpu_backward import backward_chunks, backward_units, delta_rows, sum_parts
from ._cpu_decode import SPLIT_KEYS, forward_splits, split_keys
from ._cpu_forward import forward_blocks
from ._cpu_gather import gather_forward, sorted_indices
from ._cpu_gather_backward import gather_backward
from ._cpu_tiles import BLOCK_K, BLOCK_Q, padded
from ._simd import exp_float32, exp_float64

__all__ = [
    "BLOCK_Q",
    "BLOCK_K",
    "SPLIT_KEYS",
    "split_keys",
    "backward_chunks",
    "compute_dtype",
    "forward",
    "plain_gather_forward",
    "saved_forward",
    "backward",
    "forward_error_bound",
    "backward_error_bound",
    "exp_float64",
    "exp_float32",
]


def compute_dtype(dtype) -> np.dtype:
    """Compute dtype of the kernels for an input dtype: float64 stays, all else is float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# --------------------------------------------------------------------------------------
# wrappers: own shapes, dtypes, padding and allocation
# --------------------------------------------------------------------------------------
def forward(spec, dtype=None):
    """Run the forward kernel: returns out (B, H, L, E) and lse (B, H, L) in the compute dtype.

    Streams over key blocks with the online softmax (module docstring; Milakov &
    Gimelshein 2018, Algorithm 3); memory O(L*E + S*D).

    Parameters
    ----------
    spec : refattn.spec.AttentionSpec
    dtype : float dtype, optional
        Compute dtype (default :func:`compute_dtype` of q's dtype).

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> q = np.zeros((1, 1, 1, 4)); k = np.zeros((1, 1, 2, 4))
    >>> v = np.array([[[[1.0], [3.0]]]])
    >>> out, lse = forward(canonicalize(q, k, v))
    >>> out.ravel().tolist(), bool(np.isclose(lse.item(), np.log(2.0)))
    ([2.0], True)
    """
    _softmax_only(spec)
    dtype = compute_dtype(spec.q.dtype) if dtype is None else np.dtype(dtype)
    if spec.index_reading == "gather" and _leading_features(spec.v, spec.k):
        return _run_forward(spec, _values_in_keys(spec, dtype), dtype)
    # the key splits (decode) read bfloat16 k, v as their bits, widening each once
    splits = spec.index_reading != "gather" and split_keys(*spec.dims[1:5])
    return _run_forward(spec, kernel_arguments(spec, dtype, bf16_bits=bool(splits)), dtype)


def plain_gather_forward(q, k, v, listed, scale):
    """:func:`forward` of a plain sparse-key call without building its spec: the arguments
    :func:`~refattn.kernels._args.kernel_arguments` gives a spec with no option but ``scale``
    (the set-read key indices gathered, ``gqa="interleave"``), passed to the same gather
    kernel, so the same bits. q (B, H, L, D), k (B, K, S, D), v (B, K, S, E) of one dtype,
    float32 or float64 (the compute dtype); ``listed`` (B, K, L, T) the sorted int64 lists of
    :func:`~refattn.kernels._cpu_gather.sorted_indices`; ``scale`` a float (1/sqrt(D) when
    None). Returns (out (B, H, L, E), lse (B, H, L), top): ``top`` the largest |x| of the key
    rows the kernel read (NaN skipped, Inf kept), the listed rows in [0, S) (no interval
    option): :func:`refattn.kernels.listed_keys`'s reading for a plain call's range check.

    Examples
    --------
    >>> q = np.zeros((1, 2, 1, 4)); k = np.zeros((1, 1, 3, 4))
    >>> v = np.arange(3.0).reshape(1, 1, 3, 1)
    >>> out, lse, top = plain_gather_forward(q, k, v, np.array([[[[-1, 0, 2]]]]), None)
    >>> out.ravel().tolist(), top
    ([1.0, 1.0], 0.0)
    """
    dtype = q.dtype
    batch, heads, length, dim = q.shape
    _, kv_heads, keys, vdim = v.shape
    template = _PLAIN_ARGUMENTS.get(dtype)
    if template is None:  # the option slots of a spec with every option at its default
        tiny = np.zeros((1, 1, 1, 1), dtype)
        template = _PLAIN_ARGUMENTS[dtype] = kernel_arguments(canonicalize(tiny, tiny, tiny), dtype)
    _, _, _, _, _, opts, fopts, terms = template
    fopts = fopts.copy()
    fopts[FOPT_SCALE] = 1.0 / math.sqrt(dim) if scale is None else scale
    values = k if _leading_features(v, k) else np.require(v, dtype, ["C"])
    q, k, values = (read_only(np.require(a, dtype, ["C"])) for a in (q, k, values))
    dims = np.array([batch, heads, kv_heads, length, keys, dim, vdim], np.int64)
    kv_head = np.arange(heads) // (heads // kv_heads)
    out = np.empty((batch, heads, length, vdim), dtype)
    lse = np.empty((batch, heads, length), dtype)
    top = gather_forward(listed, q, k, values, kv_head, dims, opts, fopts, terms, out, lse)
    return out, lse, top


#: kernel_arguments of a spec with every option at its default, per compute dtype
#: (:func:`plain_gather_forward` reads its option slots)
_PLAIN_ARGUMENTS: dict = {}


def _leading_features(v, k) -> bool:
    """Whether ``v`` is ``k[..., :E]`` in memory (MLA's absorbed form: the value is the
    leading features of the latent key), so the gather kernel reads the values from the key
    rows instead of copying a non-contiguous (B, K, S, E) view."""
    v, k = np.asarray(v), np.asarray(k)
    return (
        v.dtype == k.dtype
        and v.shape[:-1] == k.shape[:-1]
        and v.shape[-1] <= k.shape[-1]
        and v.strides == k.strides
        and v.__array_interface__["data"][0] == k.__array_interface__["data"][0]
    )


def _values_in_keys(spec, dtype):
    """:func:`kernel_arguments` with v the (compute-dtype) key array itself and E in dims."""
    import dataclasses

    args = list(kernel_arguments(dataclasses.replace(spec, v=spec.k), dtype))
    args[2] = args[1]
    args[4] = args[4].copy()
    args[4][DIM_VDIM] = spec.v.shape[-1]
    return tuple(args)


def _softmax_only(spec):
    if spec.normalizer != "softmax":  # the online softmax: sigmoid has kernels of its own
        raise ValueError(
            f"normalizer: these kernels compute the softmax, got {spec.normalizer!r}; "
            "refattn.kernels.attention / attention_vjp dispatch sigmoid to _cpu_sigmoid"
        )


def _run_forward(spec, args, dtype):
    """Short queries run key splits (:func:`split_keys`), the rest query blocks."""
    batch, heads, kv_heads, length, keys, _, vdim = spec.dims
    out = np.empty((batch, heads, length, vdim), dtype)
    lse = np.empty((batch, heads, length), dtype)
    if lse.size:
        nsplit = split_keys(heads, kv_heads, length, keys)
        if spec.index_reading == "gather":  # the listed keys only (refattn.kernels._cpu_gather)
            gather_forward(sorted_indices(spec.key_indices), *args, out, lse)
        elif nsplit:
            forward_splits(nsplit, *args, out, lse)
        else:
            forward_blocks(*args, out, lse)
    return out, lse


def saved_forward(spec, dtype=None):
    """(out, lse) as the backward pass needs them: lse = -inf on empty rows whatever
    ``empty_rows`` says (a NaN lse then only marks rows poisoned by NaN inputs)."""
    dtype = compute_dtype(spec.q.dtype) if dtype is None else np.dtype(dtype)
    args = kernel_arguments(spec, dtype)
    zero_rows = args[5].copy()
    zero_rows[OPT_EMPTY_ROWS_NAN] = 0
    return _run_forward(spec, args[:5] + (zero_rows,) + args[6:], dtype)


def backward(spec, grad_out, grad_lse=None, dtype=None, *, saved=None):
    """Run the backward kernel: (dq, dk, dv, dbias) with dbias (B, H, L, S) or None.

    With ``P`` the weights, ``z`` the dropout factors and ``delta_i = dO_i . O_i - dlse_i``
    (FlashAttention-2, Dao 2023, Alg. 2):

    .. math::

        dP_{ij} = z_{ij}\\, dO_i \\cdot v_j, \\quad dS_{ij} = P_{ij}(dP_{ij} - \\delta_i),
        \\quad dq_i = s \\sum_j c'_{ij} dS_{ij} k_j, \\quad
        dk_j = s \\sum_i c'_{ij} dS_{ij} q_i, \\quad dv_j = \\sum_i z_{ij} P_{ij} dO_i

    (c' the softcap derivative, 1 without softcap; dbias = dS on allowed positions).

    Parameters
    ----------
    spec : refattn.spec.AttentionSpec
    grad_out : array (B, H, L, E)
    grad_lse : array (B, H, L), optional
    dtype : float dtype, optional
        Compute dtype (default :func:`compute_dtype` of q's dtype).
    saved : (out, lse), optional
        :func:`saved_forward` of this spec and dtype, when the caller kept it (otherwise
        the forward is re-run first).

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> q = np.zeros((1, 1, 1, 4)); k = np.zeros((1, 1, 2, 4))
    >>> v = np.array([[[[1.0], [3.0]]]])
    >>> dq, dk, dv, dbias = backward(canonicalize(q, k, v), np.ones((1, 1, 1, 1)))
    >>> dv.ravel().tolist(), dbias is None
    ([0.5, 0.5], True)
    """
    _softmax_only(spec)
    if spec.index_reading == "gather":  # the listed keys only (_cpu_gather_backward)
        return _gather_vjp(spec, grad_out, grad_lse, dtype, saved)
    dtype = compute_dtype(spec.q.dtype) if dtype is None else np.dtype(dtype)
    q, k, v, kv_head, dims, opts, fopts, terms = kernel_arguments(spec, dtype)
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    out, lse = saved_forward(spec, dtype) if saved is None else saved
    # read-only like every kernel input: one array type for the row loads (one specialisation)
    grad_out = read_only(np.ascontiguousarray(grad_out, dtype))
    has_glse = grad_lse is not None
    glse = np.ascontiguousarray(grad_lse, dtype) if has_glse else np.zeros((1, 1, 1), dtype)
    delta = np.empty((batch, heads, length), dtype)
    if delta.size:
        delta_rows(grad_out, out, glse, has_glse, delta)
    dpad, epad = padded(dim, dtype), padded(vdim, dtype)
    kpad = -(-keys // BLOCK_K) * BLOCK_K
    nchunks = backward_chunks(batch, heads, length, keys)
    # every unit zeroes its own partials and writes all its dq rows (in parallel)
    dq = (np.empty if keys else np.zeros)((batch, heads, length, dim), dtype)
    dk_part = np.empty((batch, heads, nchunks, kpad, dpad), dtype)
    dv_part = np.empty((batch, heads, nchunks, kpad, epad), dtype)
    dbias = np.zeros((batch, heads, length, keys), dtype) if spec.bias is not None else None
    if length and keys:
        saved_rows = (grad_out, lse, delta)
        grads = (
            dq,
            dk_part,
            dv_part,
            dbias if dbias is not None else np.zeros((1, 1, 1, 1), dtype),
        )
        backward_units(q, k, v, kv_head, saved_rows, nchunks, dims, opts, fopts, terms, grads)
    dk = sum_parts(dk_part, kv_head, kv_heads, keys, dim, length)
    dv = sum_parts(dv_part, kv_head, kv_heads, keys, vdim, length)
    return dq, dk, dv, dbias


def _gather_vjp(spec, grad_out, grad_lse, dtype, saved):
    """(dq, dk, dv, dbias) of a gather spec (:func:`refattn.kernels.gather_spec`) by
    :func:`~refattn.kernels._cpu_gather_backward.gather_backward`."""
    dtype = compute_dtype(spec.q.dtype) if dtype is None else np.dtype(dtype)
    args = kernel_arguments(spec, dtype)
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    out, lse = saved_forward(spec, dtype) if saved is None else saved
    grad_out = read_only(np.ascontiguousarray(grad_out, dtype))
    has_glse = grad_lse is not None
    glse = np.ascontiguousarray(grad_lse, dtype) if has_glse else np.zeros((1, 1, 1), dtype)
    delta = np.empty((batch, heads, length), dtype)
    if delta.size:
        delta_rows(grad_out, out, glse, has_glse, delta)
    dq = np.zeros((batch, heads, length, dim), dtype)
    dk = np.zeros((batch, kv_heads, keys, dim), dtype)
    dv = np.zeros((batch, kv_heads, keys, vdim), dtype)
    dbias = np.zeros((batch, heads, length, keys), dtype) if spec.bias is not None else None
    if length and keys:
        grads = (dq, dk, dv, dbias if dbias is not None else np.zeros((1, 1, 1, 1), dtype))
        listed = sorted_indices(spec.key_indices)
        gather_backward(listed, args, (grad_out, lse, delta), grads)
    return dq, dk, dv, dbias


# --------------------------------------------------------------------------------------
# a-priori error bounds (refattn.bounds.kernels; used by the tests: small shapes)
# --------------------------------------------------------------------------------------
def forward_error_bound(spec, weights, dtype=np.float64, rescalings=None):
    """Bound on |out - exact| (B, H, L, E) and |lse - exact| (B, H, L) of :func:`forward`:
    :func:`refattn.bounds.online_forward_bound` with one rescaling per key block of
    ``BLOCK_K`` keys; ``rescalings`` overrides that count (the CUDA kernels rescale once per
    key: S).

    ``weights`` are the float64 pre-dropout weights (B, H, L, S) of the NumPy path. n_b counts
    one rescaling per key block and, on the short-query (split) path, two per key split of
    ``SPLIT_KEYS`` keys (one rescaling each, and the splits' combination).
    """
    keys = spec.dims[DIM_KEYS]
    if rescalings is None:
        rescalings = -(-keys // BLOCK_K) + 2 * -(-keys // SPLIT_KEYS)
    return online_forward_bound(spec, weights, dtype, rescalings)


def backward_error_bound(spec, weights, grad_out, grad_lse=None, dtype=np.float64):
    """Bound on |dq|, |dk|, |dv|, |dbias| errors of :func:`backward` (shapes of the grads):
    :func:`refattn.bounds.online_backward_bound` with this kernel's query chunks."""
    batch, heads, _, length, keys, _, _ = spec.dims
    chunks = backward_chunks(batch, heads, length, keys)
    return online_backward_bound(spec, weights, grad_out, grad_lse, dtype, chunks)
