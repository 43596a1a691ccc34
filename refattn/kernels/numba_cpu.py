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

* scores ``q_i . k_j``: sequential over the D axis (one fused multiply-add per term);
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
is the same sequential chain of fused multiply-adds.

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
(``_forward_units.inspect_asm(_forward_units.signatures[0])``, with the cache off): 512-bit
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
from numba import njit, parallel_chunksize, prange

from ..bounds.kernels import online_backward_bound, online_forward_bound
from ._args import kernel_arguments
from ._simd import (
    JIT,
    KERNEL_OPTIONS,
    exp_float32,
    exp_float64,
    fma,
    lanes,
    vadd,
    vbest,
    vexp,
    vfma,
    vkeep,
    vload,
    vmax,
    vmul,
    vmuls,
    vstore,
    vsubs,
    vsum,
    vzero,
)

__all__ = [
    "BLOCK_Q",
    "BLOCK_K",
    "SPLIT_KEYS",
    "split_keys",
    "compute_dtype",
    "forward",
    "backward",
    "exp_float64",
    "exp_float32",
]

#: Query rows per work unit / tile (a multiple of the 4-row register tile).
BLOCK_Q = 64
#: Keys per streamed block (a multiple of four 64-byte vectors of either dtype).
BLOCK_K = 64
#: Keys per split of the short-query (decode) path: a fixed size, so that the number of
#: splits and the order they are combined in depend on the key length only.
SPLIT_KEYS = 1024
#: Vectors per row of the register tile of the micro-kernels (4 rows x 4 vectors); value
#: and feature columns are padded to a multiple of this many vectors.
_TILE_VECTORS = 4
#: Minimum number of backward work units (shape-derived, never thread-derived). Whole
#: heads are the cheapest units (no dk/dv partials to store and add); query chunks are only
#: added when there are fewer (batch, head) pairs than this.
_MIN_BACKWARD_UNITS = 8

_OPTS = KERNEL_OPTIONS


def compute_dtype(dtype) -> np.dtype:
    """Compute dtype of the kernels for an input dtype: float64 stays, all else is float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


if JIT:
    from numba import types
    from numba.core.extending import overload

    def _exp(x):  # dispatched on the compute dtype below
        raise NotImplementedError

    @overload(_exp)
    def _exp_overload(x):
        if x == types.float64:
            return lambda x: exp_float64(x)
        if x == types.float32:
            return lambda x: exp_float32(x)
        return None

else:  # pragma: no cover

    def _exp(x):
        with np.errstate(all="ignore"):
            return exp_float64(x) if isinstance(x, np.float64 | float) else exp_float32(x)


# --------------------------------------------------------------------------------------
# micro-kernels: C[r, c:c+4W] += sum_x A(x, r) * Bm[x, c:c+4W], a 4 x 4W register tile,
# x sequential (the fixed reduction order), lanes = independent outputs.
# --------------------------------------------------------------------------------------
@njit(**_OPTS)
def _tile4x4_t(a, bm, count, row, col, out, fresh):
    """out[row:row+4, col:col+4W] += a[:count, row:row+4].T @ bm[:count, col:col+4W]."""
    width = lanes(bm)
    col1 = col + 1 * width
    col2 = col + 2 * width
    col3 = col + 3 * width
    o0 = out[row + 0]
    o1 = out[row + 1]
    o2 = out[row + 2]
    o3 = out[row + 3]
    c00 = vzero(o0) if fresh else vload(o0, col)
    c01 = vzero(o0) if fresh else vload(o0, col1)
    c02 = vzero(o0) if fresh else vload(o0, col2)
    c03 = vzero(o0) if fresh else vload(o0, col3)
    c10 = vzero(o1) if fresh else vload(o1, col)
    c11 = vzero(o1) if fresh else vload(o1, col1)
    c12 = vzero(o1) if fresh else vload(o1, col2)
    c13 = vzero(o1) if fresh else vload(o1, col3)
    c20 = vzero(o2) if fresh else vload(o2, col)
    c21 = vzero(o2) if fresh else vload(o2, col1)
    c22 = vzero(o2) if fresh else vload(o2, col2)
    c23 = vzero(o2) if fresh else vload(o2, col3)
    c30 = vzero(o3) if fresh else vload(o3, col)
    c31 = vzero(o3) if fresh else vload(o3, col1)
    c32 = vzero(o3) if fresh else vload(o3, col2)
    c33 = vzero(o3) if fresh else vload(o3, col3)
    for x in range(count):
        brow = bm[x]
        b0, b1, b2, b3 = vload(brow, col), vload(brow, col1), vload(brow, col2), vload(brow, col3)
        arow = a[x]
        a0 = arow[row + 0]
        c00 = vfma(a0, b0, c00)
        c01 = vfma(a0, b1, c01)
        c02 = vfma(a0, b2, c02)
        c03 = vfma(a0, b3, c03)
        a1 = arow[row + 1]
        c10 = vfma(a1, b0, c10)
        c11 = vfma(a1, b1, c11)
        c12 = vfma(a1, b2, c12)
        c13 = vfma(a1, b3, c13)
        a2 = arow[row + 2]
        c20 = vfma(a2, b0, c20)
        c21 = vfma(a2, b1, c21)
        c22 = vfma(a2, b2, c22)
        c23 = vfma(a2, b3, c23)
        a3 = arow[row + 3]
        c30 = vfma(a3, b0, c30)
        c31 = vfma(a3, b1, c31)
        c32 = vfma(a3, b2, c32)
        c33 = vfma(a3, b3, c33)
    vstore(o0, col, c00)
    vstore(o0, col1, c01)
    vstore(o0, col2, c02)
    vstore(o0, col3, c03)
    vstore(o1, col, c10)
    vstore(o1, col1, c11)
    vstore(o1, col2, c12)
    vstore(o1, col3, c13)
    vstore(o2, col, c20)
    vstore(o2, col1, c21)
    vstore(o2, col2, c22)
    vstore(o2, col3, c23)
    vstore(o3, col, c30)
    vstore(o3, col1, c31)
    vstore(o3, col2, c32)
    vstore(o3, col3, c33)


@njit(**_OPTS)
def _tile4x4_n(a, bm, count, row, col, out):
    """out[row:row+4, col:col+4W] += a[row:row+4, :count] @ bm[:count, col:col+4W]."""
    width = lanes(bm)
    col1 = col + 1 * width
    col2 = col + 2 * width
    col3 = col + 3 * width
    o0 = out[row + 0]
    r0 = a[row + 0]
    o1 = out[row + 1]
    r1 = a[row + 1]
    o2 = out[row + 2]
    r2 = a[row + 2]
    o3 = out[row + 3]
    r3 = a[row + 3]
    c00, c01, c02, c03 = vload(o0, col), vload(o0, col1), vload(o0, col2), vload(o0, col3)
    c10, c11, c12, c13 = vload(o1, col), vload(o1, col1), vload(o1, col2), vload(o1, col3)
    c20, c21, c22, c23 = vload(o2, col), vload(o2, col1), vload(o2, col2), vload(o2, col3)
    c30, c31, c32, c33 = vload(o3, col), vload(o3, col1), vload(o3, col2), vload(o3, col3)
    for x in range(count):
        brow = bm[x]
        b0, b1, b2, b3 = vload(brow, col), vload(brow, col1), vload(brow, col2), vload(brow, col3)
        a0 = r0[x]
        c00 = vfma(a0, b0, c00)
        c01 = vfma(a0, b1, c01)
        c02 = vfma(a0, b2, c02)
        c03 = vfma(a0, b3, c03)
        a1 = r1[x]
        c10 = vfma(a1, b0, c10)
        c11 = vfma(a1, b1, c11)
        c12 = vfma(a1, b2, c12)
        c13 = vfma(a1, b3, c13)
        a2 = r2[x]
        c20 = vfma(a2, b0, c20)
        c21 = vfma(a2, b1, c21)
        c22 = vfma(a2, b2, c22)
        c23 = vfma(a2, b3, c23)
        a3 = r3[x]
        c30 = vfma(a3, b0, c30)
        c31 = vfma(a3, b1, c31)
        c32 = vfma(a3, b2, c32)
        c33 = vfma(a3, b3, c33)
    vstore(o0, col, c00)
    vstore(o0, col1, c01)
    vstore(o0, col2, c02)
    vstore(o0, col3, c03)
    vstore(o1, col, c10)
    vstore(o1, col1, c11)
    vstore(o1, col2, c12)
    vstore(o1, col3, c13)
    vstore(o2, col, c20)
    vstore(o2, col1, c21)
    vstore(o2, col2, c22)
    vstore(o2, col3, c23)
    vstore(o3, col, c30)
    vstore(o3, col1, c31)
    vstore(o3, col2, c32)
    vstore(o3, col3, c33)


@njit(**_OPTS)
def _row_t(a, bm, count, row, col, out, fresh):
    """One row of :func:`_tile4x4_t` over 2W columns (the same operations, so the same bits
    per element)."""
    width = lanes(bm)
    col2 = col + width
    orow = out[row]
    c0 = vzero(orow) if fresh else vload(orow, col)
    c1 = vzero(orow) if fresh else vload(orow, col2)
    for x in range(count):
        brow = bm[x]
        ax = a[x, row]
        c0, c1 = vfma(ax, vload(brow, col), c0), vfma(ax, vload(brow, col2), c1)
    vstore(orow, col, c0)
    vstore(orow, col2, c1)


@njit(**_OPTS)
def _row_n(a, bm, count, row, col, out):
    """One row of :func:`_tile4x4_n` over 2W columns (the same operations, so the same bits
    per element)."""
    width = lanes(bm)
    col2 = col + width
    orow, arow = out[row], a[row]
    c0, c1 = vload(orow, col), vload(orow, col2)
    for x in range(count):
        brow = bm[x]
        ax = arow[x]
        c0, c1 = vfma(ax, vload(brow, col), c0), vfma(ax, vload(brow, col2), c1)
    vstore(orow, col, c0)
    vstore(orow, col2, c1)


@njit(**_OPTS)
def _matmul_t(a, bm, count, rows, cols, out, fresh=False):
    """out[:rows, :cols] += a[:count, :rows].T @ bm[:count, :cols] (``=`` with ``fresh``:
    the tiles start from zero registers); 4 x 4-vector tiles, then rows one at a time (a
    decode step has one query row). ``cols`` is a multiple of four vectors."""
    step = 2 * lanes(bm)
    full = rows - rows % 4
    for row in range(0, full, 4):
        for col in range(0, cols, 2 * step):
            _tile4x4_t(a, bm, count, row, col, out, fresh)
    for row in range(full, rows):
        for col in range(0, cols, step):
            _row_t(a, bm, count, row, col, out, fresh)


@njit(**_OPTS)
def _matmul_n(a, bm, count, rows, cols, out):
    """out[:rows, :cols] += a[:rows, :count] @ bm[:count, :cols]; 4 x 4-vector tiles, then
    rows one at a time. ``cols`` is a multiple of four vectors."""
    step = 2 * lanes(bm)
    full = rows - rows % 4
    for row in range(0, full, 4):
        for col in range(0, cols, 2 * step):
            _tile4x4_n(a, bm, count, row, col, out)
    for row in range(full, rows):
        for col in range(0, cols, step):
            _row_n(a, bm, count, row, col, out)


@njit(**_OPTS)
def _row_sum(row, count):
    """sum(row[:count]) in the documented lane order (row padded with zeros to a vector)."""
    width = lanes(row)
    acc = vzero(row)
    for c in range(0, count, width):
        acc = vadd(acc, vload(row, c))
    return vsum(acc)


@njit(**_OPTS)
def _row_max(row, count):
    """max(row[:count]) ignoring NaN (-inf when all are -inf or NaN); order-free."""
    width = lanes(row)
    acc = vload(row, 0)
    for c in range(width, count, width):
        acc = vmax(acc, vload(row, c))
    return vbest(acc)


# --------------------------------------------------------------------------------------
# shared pieces of forward and backward
# --------------------------------------------------------------------------------------
@njit(**_OPTS)
def _row_range(i, keys, offset, causal, left, right):
    """Structural allowed keys [lo, hi] of query row i (lo > hi: none)."""
    diag = i + offset
    lo = 0
    hi = keys - 1
    if causal:
        hi = min(hi, diag)
    if left >= 0:
        lo = max(lo, diag - left)
    if right >= 0:
        hi = min(hi, diag + right)
    return lo, hi


@njit(**_OPTS)
def _load_rows_t(src, start, count, out):
    """out[:, :count] = src[start:start+count].T; the remaining columns are zeroed."""
    width = out.shape[0]
    pad = out.shape[1]
    for x in range(width):
        orow = out[x]
        for c in range(count):
            orow[c] = src[start + c, x]
        for c in range(count, pad):
            orow[c] = 0


@njit(**_OPTS)
def _load_rows(src, start, count, out, zero_nonfinite=False):
    """out[:count, :F] = src[start:start+count]; padding rows/columns are zeroed; returns
    whether every loaded value is finite (with ``zero_nonfinite`` non-finite values are
    stored as 0)."""
    feats = src.shape[1]
    finite = True
    for c in range(count):
        orow = out[c]
        srow = src[start + c]
        for x in range(feats):
            value = srow[x]
            ok = math.isfinite(value)
            orow[x] = value if ok or not zero_nonfinite else 0
            finite &= ok
        for x in range(feats, out.shape[1]):
            orow[x] = 0
    for c in range(count, out.shape[0]):
        out[c, :] = 0
    return finite


@njit(**_OPTS)
def _raw_scores_suffice(nr, nc, r0, c0, dims, opts, fopts, width):
    """Whether a q.k tile needs nothing but the scale (no option, every position allowed,
    a finite positive scale): its users then multiply each loaded score by the scale
    themselves (the same product, so the same bits) instead of a separate pass."""
    if opts[4] != 0 or opts[5] != 0 or opts[6] != 0 or opts[7] != 0 or nc != width:
        return False
    scale = fopts[0]
    if not (scale > 0 and scale < np.inf):  # scaling keeps -inf (overflowed q.k) as -inf
        return False
    keys, offset, causal, left, right = dims[4], opts[0], opts[1] != 0, opts[2], opts[3]
    _, hi_first = _row_range(r0, keys, offset, causal, left, right)
    lo_last, _ = _row_range(r0 + nr - 1, keys, offset, causal, left, right)
    return lo_last <= c0 and hi_first >= c0 + nc - 1


@njit(**_OPTS)
def _row_max_scaled(row, count, factor):
    """max(row[:count] * factor) ignoring NaN, as :func:`_row_max` of the scaled row."""
    width = lanes(row)
    acc = vmuls(vload(row, 0), factor)
    for c in range(width, count, width):
        acc = vmax(acc, vmuls(vload(row, c), factor))
    return vbest(acc)


@njit(**_OPTS)
def _finish_scores(
    s, nr, nc, r0, c0, b, h, dims, opts, fopts, bias, bstr, mask, mstr, slopes, deriv
):
    """Turn raw q.k tile into final scores in place; -inf marks excluded positions.

    Returns True when the tile has no excluded position (the fast paths may then skip
    per-element checks). ``deriv`` receives d(softcap)/d(raw) when softcap is active.
    """
    keys, offset = dims[4], opts[0]
    causal, left, right = opts[1] != 0, opts[2], opts[3]
    has_softcap, has_bias, has_mask, has_alibi = (
        opts[4] != 0,
        opts[5] != 0,
        opts[6] != 0,
        opts[7] != 0,
    )
    scale, cap = fopts[0], fopts[1]
    neg_inf = fopts[3]
    lo_first, hi_first = _row_range(r0, keys, offset, causal, left, right)
    lo_last, hi_last = _row_range(r0 + nr - 1, keys, offset, causal, left, right)
    full = lo_last <= c0 and hi_first >= c0 + nc - 1
    general = has_softcap or has_bias or has_mask or has_alibi
    width = s.shape[1]
    if not general and full and nc == width:
        lane_count = lanes(s)
        for r in range(nr):
            row = s[r]
            for c in range(0, width, lane_count):
                vstore(row, c, vmuls(vload(row, c), scale))
        return full
    if not general:
        for r in range(nr):
            row = s[r]
            lo, hi = _row_range(r0 + r, keys, offset, causal, left, right)
            jl = lo - c0
            jh = hi - c0
            for c in range(width):
                scaled = row[c] * scale
                row[c] = scaled if (c >= jl and c <= jh and c < nc) else neg_inf
        return full
    slope = slopes[h] if has_alibi else 0.0
    clean = True
    for r in range(nr):
        i = r0 + r
        row = s[r]
        lo, hi = _row_range(i, keys, offset, causal, left, right)
        for c in range(width):
            j = c0 + c
            allowed = c < nc and j >= lo and j <= hi
            if allowed and has_mask:
                allowed = mask[mstr[0] * b + mstr[1] * h + mstr[2] * i + mstr[3] * j] != 0
            t = -np.inf
            if allowed:
                t = row[c] * scale
                if has_softcap:
                    th = math.tanh(t / cap)
                    t = cap * th
                    deriv[r, c] = 1.0 - th * th
                if has_bias:
                    bv = bias[bstr[0] * b + bstr[1] * h + bstr[2] * i + bstr[3] * j]
                    if bv == -np.inf:
                        allowed = False
                        t = -np.inf
                    else:
                        t = t + bv
                if allowed and has_alibi:
                    t = t - slope * abs(i + offset - j)
            clean &= allowed or c >= nc
            row[c] = t
    return clean


@njit(**_OPTS)
def _dropout_weights(p, pd, nr, nc, r0, c0, b, h, drop, dstr):
    for r in range(nr):
        i = r0 + r
        for c in range(nc):
            keep = drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * (c0 + c)] != 0
            pd[r, c] = p[r, c] if keep else 0


# --------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------
@njit(parallel=True, **_OPTS)
def _pack_keys(k, v, k_t, v_blk, v_finite):
    """Pack every key block once per (batch, kv head): k_t[b, g, n] = K block n transposed
    (D, BLOCK_K), v_blk[b, g, n] = V block n (BLOCK_K, E padded), zero-padded; v_finite[b,
    g, n] says whether the block's values are all finite. Pure copies (no arithmetic)."""
    batch, kv_heads, keys = k.shape[0], k.shape[1], k.shape[2]
    nkb = k_t.shape[2]
    for unit in prange(batch * kv_heads * nkb):
        b = unit // (kv_heads * nkb)
        g = (unit // nkb) % kv_heads
        n = unit % nkb
        c0 = n * BLOCK_K
        nc = min(BLOCK_K, keys - c0)
        _load_rows_t(k[b, g], c0, nc, k_t[b, g, n])
        v_finite[b, g, n] = _load_rows(v[b, g], c0, nc, v_blk[b, g, n])


@njit(**_OPTS)
def _forward_unit(
    q,
    k_pack,
    v_pack,
    v_fin,
    kv_head,
    unit,
    nqb,
    dims,
    opts,
    fopts,
    bias,
    bstr,
    mask,
    mstr,
    drop,
    dstr,
    slopes,
    out,
    lse,
):
    heads, length, keys, dim, vdim = dims[1], dims[2], dims[4], dims[5], dims[6]
    b = unit // (heads * nqb)
    h = (unit // nqb) % heads
    r0 = (unit % nqb) * BLOCK_Q
    nr = min(BLOCK_Q, length - r0)
    rows = nr  # short blocks (decode: L = 1) compute their live rows only
    g = kv_head[h]
    dt = q.dtype
    width = lanes(q)
    epad = v_pack.shape[4]
    q_t = np.empty((dim, BLOCK_Q), dt)
    s = np.empty((BLOCK_Q, BLOCK_K), dt)
    p = np.zeros((BLOCK_Q, BLOCK_K), dt)
    pd = np.zeros((BLOCK_Q, BLOCK_K), dt)
    deriv = np.empty((BLOCK_Q, BLOCK_K), dt)
    acc = np.zeros((BLOCK_Q, epad), dt)
    m = np.full(BLOCK_Q, -np.inf, dt)
    total = np.zeros(BLOCK_Q, dt)
    one = np.ones(1, dt)[0]
    _load_rows_t(q[b, h], r0, nr, q_t)
    causal, left, right = opts[1] != 0, opts[2], opts[3]
    has_drop = opts[8] != 0
    lo_first, _ = _row_range(r0, keys, opts[0], causal, left, right)
    _, hi_last = _row_range(r0 + nr - 1, keys, opts[0], causal, left, right)
    first = max(lo_first, 0) // BLOCK_K * BLOCK_K
    for c0 in range(first, min(hi_last + 1, keys), BLOCK_K):
        nc = min(BLOCK_K, keys - c0)
        kb = c0 // BLOCK_K
        k_t = k_pack[b, g, kb]
        v_blk = v_pack[b, g, kb]
        v_finite = v_fin[b, g, kb]
        _matmul_t(q_t, k_t, dim, rows, BLOCK_K, s, True)
        factor = one  # x * 1 is x: the scores in s are final
        if _raw_scores_suffice(nr, nc, r0, c0, dims, opts, fopts, BLOCK_K):
            clean, factor = True, fopts[0]
        else:
            clean = _finish_scores(
                s, nr, nc, r0, c0, b, h, dims, opts, fopts, bias, bstr, mask, mstr, slopes, deriv
            )
        for r in range(nr):
            row = s[r]
            prow = p[r]
            m_old = m[r]
            m_new = max(m_old, _row_max_scaled(row, BLOCK_K, factor))
            if m_new == -np.inf:
                prow[:] = 0
                continue
            # exp of the tile row, lane-parallel; the lane sums in the _row_sum order
            part = vzero(prow)
            for c in range(0, BLOCK_K, width):
                e = vexp(vsubs(vmuls(vload(row, c), factor), m_new))
                vstore(prow, c, e)
                part = vadd(part, e)
            row_total = vsum(part)
            if m_new != m_old:
                alpha = _exp(m_old - m_new)
                total[r] = total[r] * alpha
                arow = acc[r]
                for e0 in range(0, epad, width):
                    vstore(arow, e0, vmuls(vload(arow, e0), alpha))
                m[r] = m_new
            total[r] = total[r] + row_total
        weights = p
        if has_drop:
            _dropout_weights(p, pd, nr, nc, r0, c0, b, h, drop, dstr)
            weights = pd
        if v_finite or (clean and not has_drop):
            _matmul_n(weights, v_blk, nc, rows, epad, acc)
        else:
            # a non-finite value row may only reach the rows that keep it
            for r in range(nr):
                for c in range(nc):
                    if s[r, c] == -np.inf:
                        continue
                    j = c0 + c
                    if (
                        has_drop
                        and drop[dstr[0] * b + dstr[1] * h + dstr[2] * (r0 + r) + dstr[3] * j] == 0
                    ):
                        continue
                    w = weights[r, c]
                    for e in range(vdim):
                        acc[r, e] = fma(w, v_blk[c, e], acc[r, e])
    keep_scale = fopts[2]
    nan_rows = opts[9] != 0
    for r in range(nr):
        i = r0 + r
        orow = out[b, h, i]
        if m[r] == -np.inf:
            fill = np.nan if nan_rows else 0.0
            for e in range(vdim):
                orow[e] = fill
            lse[b, h, i] = np.nan if nan_rows else -np.inf
            continue
        inv = keep_scale / total[r]
        arow = acc[r]
        for e in range(vdim):
            orow[e] = arow[e] * inv
        lse[b, h, i] = m[r] + math.log(total[r])


@njit(parallel=True, **_OPTS)
def _forward_units(
    q,
    k_pack,
    v_pack,
    v_fin,
    kv_head,
    dims,
    opts,
    fopts,
    bias,
    bstr,
    mask,
    mstr,
    drop,
    dstr,
    slopes,
    out,
    lse,
):
    batch, heads, length = dims[0], dims[1], dims[2]
    nqb = -(-length // BLOCK_Q)
    for unit in prange(batch * heads * nqb):
        _forward_unit(
            q,
            k_pack,
            v_pack,
            v_fin,
            kv_head,
            np.int64(unit),
            nqb,
            dims,
            opts,
            fopts,
            bias,
            bstr,
            mask,
            mstr,
            drop,
            dstr,
            slopes,
            out,
            lse,
        )


def split_keys(heads: int, kv_heads: int, length: int, keys: int) -> int:
    """Key splits of the short-query path (0: the query-block path runs); shapes only.

    The short-query path runs when the query rows of a whole kv-head group fit one tile
    (``(H / K) * L <= BLOCK_Q``) and there is more than one split of :data:`SPLIT_KEYS` keys.

    Examples
    --------
    >>> split_keys(32, 8, 1, 8192), split_keys(8, 8, 1024, 1024)
    (8, 0)
    """
    if (heads // kv_heads) * length > BLOCK_Q or keys <= SPLIT_KEYS:
        return 0
    return -(-keys // SPLIT_KEYS)


def _forward(
    q, k, v, kv_head, dims, opts, fopts, bias, bstr, mask, mstr, drop, dstr, slopes, out, lse
):
    """Short queries: key splits (:func:`_split_forward`); otherwise pack the key blocks
    (:func:`_pack_keys`) and run the query-block units."""
    batch, heads, length, kv_heads, keys = (int(x) for x in dims[:5])
    nsplit = split_keys(heads, kv_heads, length, keys)
    if nsplit:
        group_heads = np.array(
            [[h for h in range(heads) if kv_head[h] == g] for g in range(kv_heads)], np.int64
        )
        with parallel_chunksize(1):
            _split_forward(
                q,
                k,
                v,
                group_heads,
                nsplit,
                dims,
                opts,
                fopts,
                bias,
                bstr,
                mask,
                mstr,
                drop,
                dstr,
                slopes,
                out,
                lse,
            )
        return
    k_pack, v_pack, v_fin = _packed_keys(k, v)
    with parallel_chunksize(1):
        _forward_units(
            q,
            k_pack,
            v_pack,
            v_fin,
            kv_head,
            dims,
            opts,
            fopts,
            bias,
            bstr,
            mask,
            mstr,
            drop,
            dstr,
            slopes,
            out,
            lse,
        )


@njit(**_OPTS)
def _split_unit(
    q,
    k,
    v,
    group_heads,
    unit,
    nsplit,
    dims,
    opts,
    fopts,
    bias,
    bstr,
    mask,
    mstr,
    drop,
    dstr,
    slopes,
    part_m,
    part_total,
    part_acc,
):
    """One (batch, kv head, key split) of the short-query path: the L rows of every query
    head of the group form one tile, so each key block is loaded once per group."""
    kv_heads, length, keys, dim, vdim = dims[3], dims[2], dims[4], dims[5], dims[6]
    group = group_heads.shape[1]
    b = unit // (kv_heads * nsplit)
    g = (unit // nsplit) % kv_heads
    split = unit % nsplit
    rows = group * length
    dt = q.dtype
    width = lanes(q)
    epad = part_acc.shape[4]
    q_t = np.zeros((dim, BLOCK_Q), dt)
    k_t = np.empty((dim, BLOCK_K), dt)
    v_blk = np.empty((BLOCK_K, epad), dt)
    s = np.empty((BLOCK_Q, BLOCK_K), dt)
    p = np.zeros((BLOCK_Q, BLOCK_K), dt)
    pd = np.zeros((BLOCK_Q, BLOCK_K), dt)
    deriv = np.empty((BLOCK_Q, BLOCK_K), dt)
    acc = np.zeros((BLOCK_Q, epad), dt)
    m = np.full(BLOCK_Q, -np.inf, dt)
    total = np.zeros(BLOCK_Q, dt)
    for t in range(group):
        src = q[b, group_heads[g, t]]
        for i in range(length):
            for x in range(dim):
                q_t[x, t * length + i] = src[i, x]
    causal, left, right = opts[1] != 0, opts[2], opts[3]
    has_drop = opts[8] != 0
    first_row = np.int64(0)  # not a literal: one compiled _row_range, _finish_scores, ...
    lo_first, _ = _row_range(first_row, keys, opts[0], causal, left, right)
    _, hi_last = _row_range(length - 1, keys, opts[0], causal, left, right)
    start = max(split * SPLIT_KEYS, max(lo_first, 0) // BLOCK_K * BLOCK_K)
    stop = min((split + 1) * SPLIT_KEYS, hi_last + 1, keys)
    for c0 in range(start, stop, BLOCK_K):
        nc = min(BLOCK_K, keys - c0)
        _load_rows_t(k[b, g], c0, nc, k_t)
        v_finite = _load_rows(v[b, g], c0, nc, v_blk)
        _matmul_t(q_t, k_t, dim, rows, BLOCK_K, s, True)
        clean = True
        for t in range(group):
            r0 = t * length
            clean &= _finish_scores(
                s[r0 : r0 + length],
                length,
                nc,
                first_row,
                c0,
                b,
                group_heads[g, t],
                dims,
                opts,
                fopts,
                bias,
                bstr,
                mask,
                mstr,
                slopes,
                deriv[r0 : r0 + length],
            )
        for r in range(rows):
            row = s[r]
            prow = p[r]
            m_old = m[r]
            m_new = max(m_old, _row_max(row, BLOCK_K))
            if m_new == -np.inf:
                prow[:] = 0
                continue
            part = vzero(prow)
            for c in range(0, BLOCK_K, width):
                e = vexp(vsubs(vload(row, c), m_new))
                vstore(prow, c, e)
                part = vadd(part, e)
            row_total = vsum(part)
            if m_new != m_old:
                alpha = _exp(m_old - m_new)
                total[r] = total[r] * alpha
                arow = acc[r]
                for e0 in range(0, epad, width):
                    vstore(arow, e0, vmuls(vload(arow, e0), alpha))
                m[r] = m_new
            total[r] = total[r] + row_total
        weights = p
        if has_drop:
            for t in range(group):
                r0 = t * length
                _dropout_weights(
                    p[r0 : r0 + length],
                    pd[r0 : r0 + length],
                    length,
                    nc,
                    first_row,
                    c0,
                    b,
                    group_heads[g, t],
                    drop,
                    dstr,
                )
            weights = pd
        if v_finite or (clean and not has_drop):
            _matmul_n(weights, v_blk, nc, rows, epad, acc)
        else:
            for r in range(rows):
                h, i = group_heads[g, r // length], r % length
                for c in range(nc):
                    if s[r, c] == -np.inf:
                        continue
                    if (
                        has_drop
                        and drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * (c0 + c)] == 0
                    ):
                        continue
                    w = weights[r, c]
                    for e in range(vdim):
                        acc[r, e] = fma(w, v_blk[c, e], acc[r, e])
    for r in range(rows):
        h, i = group_heads[g, r // length], r % length
        part_m[b, h, i, split] = m[r]
        part_total[b, h, i, split] = total[r]
        for e in range(epad):
            part_acc[b, h, i, split, e] = acc[r, e]


@njit(parallel=True, **_OPTS)
def _split_forward(
    q,
    k,
    v,
    group_heads,
    nsplit,
    dims,
    opts,
    fopts,
    bias,
    bstr,
    mask,
    mstr,
    drop,
    dstr,
    slopes,
    out,
    lse,
):
    """Short-query forward: key splits of SPLIT_KEYS keys per (batch, kv head) run as
    independent units; their partial (max, sum, accumulator) are then combined per row in
    increasing split order (the split size is fixed, so the order depends on the shapes
    only)."""
    batch, heads, length, kv_heads, vdim = dims[0], dims[1], dims[2], dims[3], dims[6]
    dt = q.dtype
    epad = _pad(vdim, lanes(q))
    part_m = np.empty((batch, heads, length, nsplit), dt)
    part_total = np.empty((batch, heads, length, nsplit), dt)
    part_acc = np.empty((batch, heads, length, nsplit, epad), dt)
    zero = np.zeros(1, dt)
    for unit in prange(batch * kv_heads * nsplit):
        _split_unit(
            q,
            k,
            v,
            group_heads,
            np.int64(unit),
            nsplit,
            dims,
            opts,
            fopts,
            bias,
            bstr,
            mask,
            mstr,
            drop,
            dstr,
            slopes,
            part_m,
            part_total,
            part_acc,
        )
    keep_scale = fopts[2]
    nan_rows = opts[9] != 0
    for row in prange(batch * heads * length):
        b = row // (heads * length)
        h = (row // length) % heads
        i = row % length
        best = part_m[b, h, i, 0]  # never NaN (row maxima skip NaN)
        for t in range(1, nsplit):
            best = max(best, part_m[b, h, i, t])
        orow = out[b, h, i]
        if best == -np.inf:
            fill = np.nan if nan_rows else 0.0
            for e in range(vdim):
                orow[e] = fill
            lse[b, h, i] = np.nan if nan_rows else -np.inf
            continue
        total = zero[0]
        for e in range(vdim):
            orow[e] = 0
        for t in range(nsplit):
            m_t = part_m[b, h, i, t]
            if m_t == -np.inf:
                continue
            alpha = _exp(m_t - best)
            total = fma(alpha, part_total[b, h, i, t], total)
            for e in range(vdim):
                orow[e] = fma(alpha, part_acc[b, h, i, t, e], orow[e])
        inv = keep_scale / total
        for e in range(vdim):
            orow[e] = orow[e] * inv
        lse[b, h, i] = best + math.log(total)


@njit(**_OPTS)
def _pad(features, width):
    """Features padded to a multiple of four vectors of ``width`` lanes (the register tile's
    width; at least one tile)."""
    tile = _TILE_VECTORS * width
    return max(tile, -(-features // tile) * tile)


def _padded(features, dtype):
    """:func:`_pad` for a dtype's 64-byte vectors."""
    width = 64 // np.dtype(dtype).itemsize
    return max(
        _TILE_VECTORS * width, -(-features // (_TILE_VECTORS * width)) * _TILE_VECTORS * width
    )


def _packed_keys(k, v):
    batch, kv_heads, keys, dim = k.shape
    nkb = -(-keys // BLOCK_K)
    k_pack = np.empty((batch, kv_heads, nkb, dim, BLOCK_K), k.dtype)
    v_pack = np.empty((batch, kv_heads, nkb, BLOCK_K, _padded(v.shape[3], v.dtype)), v.dtype)
    v_fin = np.empty((batch, kv_heads, nkb), np.bool_)
    if k_pack.size or v_pack.size:
        _pack_keys(k, v, k_pack, v_pack, v_fin)
    return k_pack, v_pack, v_fin


# --------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------
@njit(**_OPTS)
def _backward_unit(
    q,
    kt_pack,
    k_pack,
    vt_pack,
    kv_head,
    grad_out,
    lse,
    delta,
    unit,
    nchunks,
    dims,
    opts,
    fopts,
    bias,
    bstr,
    mask,
    mstr,
    drop,
    dstr,
    slopes,
    dq,
    dk_part,
    dv_part,
    dbias,
):
    heads, length, keys, dim, vdim = dims[1], dims[2], dims[4], dims[5], dims[6]
    nqb = -(-length // BLOCK_Q)
    b = unit // (heads * nchunks)
    h = (unit // nchunks) % heads
    chunk = unit % nchunks
    per_chunk = -(-nqb // nchunks)
    g = kv_head[h]
    dt = q.dtype
    width = lanes(q)
    dpad = _pad(dim, width)
    epad = _pad(vdim, width)
    q_t = np.empty((dim, BLOCK_Q), dt)
    q_blk = np.empty((BLOCK_Q, dpad), dt)
    do_t = np.empty((vdim, BLOCK_Q), dt)
    do_blk = np.empty((BLOCK_Q, epad), dt)
    s = np.empty((BLOCK_Q, BLOCK_K), dt)
    dp = np.empty((BLOCK_Q, BLOCK_K), dt)
    p = np.zeros((BLOCK_Q, BLOCK_K), dt)
    ds = np.zeros((BLOCK_Q, BLOCK_K), dt)
    deriv = np.empty((BLOCK_Q, BLOCK_K), dt)
    dq_acc = np.empty((BLOCK_Q, dpad), dt)
    causal, left, right = opts[1] != 0, opts[2], opts[3]
    has_softcap, has_bias, has_drop = opts[4] != 0, opts[5] != 0, opts[8] != 0
    scale, keep_scale = fopts[0], fopts[2]
    plain = not (has_softcap or has_bias or has_drop)
    one = np.ones(1, dt)[0]
    dk_out, dv_out = dk_part[b, h, chunk], dv_part[b, h, chunk]
    dk_out[:, :] = 0
    dv_out[:, :] = 0
    for qb in range(chunk * per_chunk, min(nqb, (chunk + 1) * per_chunk)):
        r0 = qb * BLOCK_Q
        nr = min(BLOCK_Q, length - r0)
        rows = nr
        _load_rows_t(q[b, h], r0, nr, q_t)
        # a non-finite q or k at an allowed position already makes dS non-finite there;
        # zeroing it here keeps it out of the rows/keys that exclude it (0 * NaN)
        _load_rows(q[b, h], r0, nr, q_blk, True)
        _load_rows_t(grad_out[b, h], r0, nr, do_t)
        _load_rows(grad_out[b, h], r0, nr, do_blk)
        for r in range(nr):
            if lse[b, h, r0 + r] == -np.inf:  # empty row: zero gradients
                q_blk[r, :] = 0
                do_blk[r, :] = 0
                q_t[:, r] = 0
                do_t[:, r] = 0
        dq_acc[:, :] = 0
        lo_first, _ = _row_range(r0, keys, opts[0], causal, left, right)
        _, hi_last = _row_range(r0 + nr - 1, keys, opts[0], causal, left, right)
        first = max(lo_first, 0) // BLOCK_K * BLOCK_K
        for c0 in range(first, min(hi_last + 1, keys), BLOCK_K):
            nc = min(BLOCK_K, keys - c0)
            kb = c0 // BLOCK_K
            k_t, k_blk, v_t = kt_pack[b, g, kb], k_pack[b, g, kb], vt_pack[b, g, kb]
            _matmul_t(q_t, k_t, dim, rows, BLOCK_K, s, True)
            factor = one  # x * 1 is x: the scores in s are final
            if plain and _raw_scores_suffice(nr, nc, r0, c0, dims, opts, fopts, BLOCK_K):
                factor = scale
            else:
                _finish_scores(
                    s,
                    nr,
                    nc,
                    r0,
                    c0,
                    b,
                    h,
                    dims,
                    opts,
                    fopts,
                    bias,
                    bstr,
                    mask,
                    mstr,
                    slopes,
                    deriv,
                )
            _matmul_t(do_t, v_t, vdim, rows, BLOCK_K, dp, True)
            for r in range(nr):
                i = r0 + r
                row_lse = lse[b, h, i]
                srow, prow, dsrow, dprow = s[r], p[r], ds[r], dp[r]
                if row_lse == -np.inf:
                    prow[:] = 0
                    dsrow[:] = 0
                    continue
                d_i = delta[b, h, i]
                if plain:
                    # P, dS = P (dP z - delta), dropout scale and softmax scale, lane-parallel
                    # (the same operations per element as the general branch below)
                    for c in range(0, BLOCK_K, width):
                        sv = vmuls(vload(srow, c), factor)
                        pv = vexp(vsubs(sv, row_lse))
                        grad = vmul(pv, vsubs(vmuls(vload(dprow, c), keep_scale), d_i))
                        vstore(dsrow, c, vmuls(vkeep(sv, grad), scale))
                        vstore(prow, c, vmuls(pv, keep_scale))
                    continue
                for c in range(0, BLOCK_K, width):
                    vstore(prow, c, vexp(vsubs(vload(srow, c), row_lse)))
                for c in range(BLOCK_K):
                    grad = prow[c] * (dprow[c] * keep_scale - d_i)
                    dsrow[c] = grad if srow[c] != -np.inf else 0
                if has_drop:
                    for c in range(nc):
                        j = c0 + c
                        if drop[dstr[0] * b + dstr[1] * h + dstr[2] * i + dstr[3] * j] == 0:
                            dsrow[c] = (0 - prow[c] * d_i) if srow[c] != -np.inf else 0
                            prow[c] = 0
                        else:
                            prow[c] = prow[c] * keep_scale
                else:
                    for c in range(BLOCK_K):
                        prow[c] = prow[c] * keep_scale
                if has_bias:
                    for c in range(nc):
                        dbias[b, h, i, c0 + c] = dsrow[c]
                if has_softcap:
                    for c in range(nc):
                        if srow[c] != -np.inf:
                            dsrow[c] = dsrow[c] * deriv[r, c]
                for c in range(BLOCK_K):
                    dsrow[c] = dsrow[c] * scale
            _matmul_n(ds, k_blk, nc, rows, dpad, dq_acc)
            _matmul_t(ds, q_blk, nr, BLOCK_K, dpad, dk_out[c0 : c0 + BLOCK_K])
            _matmul_t(p, do_blk, nr, BLOCK_K, epad, dv_out[c0 : c0 + BLOCK_K])
        for r in range(nr):
            dq[b, h, r0 + r, :] = dq_acc[r, :dim]


@njit(parallel=True, **_OPTS)
def _pack_keys_backward(k, v, kt_pack, k_pack, vt_pack):
    """Pack every key block once per (batch, kv head): K transposed (D, BLOCK_K), K with
    non-finite values stored as 0 (BLOCK_K, D padded), V transposed (E, BLOCK_K)."""
    batch, kv_heads, keys = k.shape[0], k.shape[1], k.shape[2]
    nkb = kt_pack.shape[2]
    for unit in prange(batch * kv_heads * nkb):
        b = unit // (kv_heads * nkb)
        g = (unit // nkb) % kv_heads
        n = unit % nkb
        c0 = n * BLOCK_K
        nc = min(BLOCK_K, keys - c0)
        _load_rows_t(k[b, g], c0, nc, kt_pack[b, g, n])
        _load_rows(k[b, g], c0, nc, k_pack[b, g, n], True)
        _load_rows_t(v[b, g], c0, nc, vt_pack[b, g, n])


@njit(parallel=True, **_OPTS)
def _backward_units(
    q,
    kt_pack,
    k_pack,
    vt_pack,
    kv_head,
    grad_out,
    lse,
    delta,
    nchunks,
    dims,
    opts,
    fopts,
    bias,
    bstr,
    mask,
    mstr,
    drop,
    dstr,
    slopes,
    dq,
    dk_part,
    dv_part,
    dbias,
):
    batch, heads = dims[0], dims[1]
    for unit in prange(batch * heads * nchunks):
        _backward_unit(
            q,
            kt_pack,
            k_pack,
            vt_pack,
            kv_head,
            grad_out,
            lse,
            delta,
            np.int64(unit),
            nchunks,
            dims,
            opts,
            fopts,
            bias,
            bstr,
            mask,
            mstr,
            drop,
            dstr,
            slopes,
            dq,
            dk_part,
            dv_part,
            dbias,
        )


def _backward(q, k, v, kv_head, *rest):
    """Pack the key blocks (:func:`_pack_keys_backward`), then run the query-chunk units."""
    batch, kv_heads, keys, dim = k.shape
    vdim = v.shape[3]
    nkb = -(-keys // BLOCK_K)
    kt_pack = np.empty((batch, kv_heads, nkb, dim, BLOCK_K), k.dtype)
    k_pack = np.empty((batch, kv_heads, nkb, BLOCK_K, _padded(dim, k.dtype)), k.dtype)
    vt_pack = np.empty((batch, kv_heads, nkb, vdim, BLOCK_K), v.dtype)
    _pack_keys_backward(k, v, kt_pack, k_pack, vt_pack)
    with parallel_chunksize(1):
        _backward_units(q, kt_pack, k_pack, vt_pack, kv_head, *rest)


@njit(parallel=True, **_OPTS)
def _delta(grad_out, out, grad_lse, has_grad_lse, delta):
    """delta_i = dO_i . O_i - dlse_i, sequential over E (FlashAttention-2, Algorithm 2)."""
    batch, heads, length, vdim = out.shape
    for bh in prange(batch * heads):
        b, h = bh // heads, bh % heads
        for i in range(length):
            delta[b, h, i] = 0
            for e in range(vdim):
                delta[b, h, i] = fma(grad_out[b, h, i, e], out[b, h, i, e], delta[b, h, i])
            if has_grad_lse:
                delta[b, h, i] = delta[b, h, i] - grad_lse[b, h, i]


@njit(parallel=True, **_OPTS)
def _reduce_parts(part, kv_head, kv_heads, feats, result):
    """result[b, g] = sum over (h with kv_head[h] == g, chunk) in increasing order."""
    batch, heads, nchunks, keys = part.shape[0], part.shape[1], part.shape[2], result.shape[2]
    for bg in prange(batch * kv_heads):
        b, g = bg // kv_heads, bg % kv_heads
        for h in range(heads):
            if kv_head[h] != g:
                continue
            for chunk in range(nchunks):
                for j in range(keys):
                    for x in range(feats):
                        result[b, g, j, x] += part[b, h, chunk, j, x]


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
    dtype = compute_dtype(spec.q.dtype) if dtype is None else np.dtype(dtype)
    return _run_forward(spec, kernel_arguments(spec, dtype), dtype)


def _run_forward(spec, args, dtype):
    batch, heads, _, length, _, _, vdim = spec.dims
    out = np.empty((batch, heads, length, vdim), dtype)
    lse = np.empty((batch, heads, length), dtype)
    if lse.size:
        _forward(*args, out, lse)
    return out, lse


def saved_forward(spec, dtype=None):
    """(out, lse) as the backward pass needs them: lse = -inf on empty rows whatever
    ``empty_rows`` says (a NaN lse then only marks rows poisoned by NaN inputs)."""
    dtype = compute_dtype(spec.q.dtype) if dtype is None else np.dtype(dtype)
    args = kernel_arguments(spec, dtype)
    zero_rows = args[5].copy()
    zero_rows[9] = 0
    return _run_forward(spec, args[:5] + (zero_rows,) + args[6:], dtype)


def backward_chunks(batch: int, heads: int, length: int, keys: int = 0) -> int:
    """Query chunks per (batch, head) of the backward pass (a function of the shape only).

    Enough chunks for :data:`_MIN_BACKWARD_UNITS` work units, but at most ``max(8, 2**19 /
    S)`` per head: each chunk keeps its own (S, D) and (S, E) partials of dk and dv, which
    are then added in chunk order (memory traffic that one chunk per head avoids).

    Examples
    --------
    >>> backward_chunks(1, 8, 1024, 1024), backward_chunks(1, 1, 65536, 65536)
    (1, 8)
    """
    nqb = -(-length // BLOCK_Q)
    wanted = -(-_MIN_BACKWARD_UNITS // max(1, batch * heads))
    cap = max(8, 2**19 // max(1, keys))
    return max(1, min(nqb, wanted, cap))


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
    dtype = compute_dtype(spec.q.dtype) if dtype is None else np.dtype(dtype)
    args = kernel_arguments(spec, dtype)
    q, k, v, kv_head, dims, opts, fopts, bias, bstr, mask, mstr, drop, dstr, slopes = args
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    out, lse = saved_forward(spec, dtype) if saved is None else saved
    grad_out = np.ascontiguousarray(grad_out, dtype)
    has_glse = grad_lse is not None
    glse = np.ascontiguousarray(grad_lse, dtype) if has_glse else np.zeros((1, 1, 1), dtype)
    delta = np.empty((batch, heads, length), dtype)
    if delta.size:
        _delta(grad_out, out, glse, has_glse, delta)
    dpad, epad = _padded(dim, dtype), _padded(vdim, dtype)
    kpad = -(-keys // BLOCK_K) * BLOCK_K
    nchunks = backward_chunks(batch, heads, length, keys)
    # every unit zeroes its own partials and writes all its dq rows (in parallel)
    dq = (np.empty if keys else np.zeros)((batch, heads, length, dim), dtype)
    dk_part = np.empty((batch, heads, nchunks, kpad, dpad), dtype)
    dv_part = np.empty((batch, heads, nchunks, kpad, epad), dtype)
    dbias = np.zeros((batch, heads, length, keys), dtype) if spec.bias is not None else None
    if length and keys:
        _backward(
            q,
            k,
            v,
            kv_head,
            grad_out,
            lse,
            delta,
            nchunks,
            dims,
            opts,
            fopts,
            bias,
            bstr,
            mask,
            mstr,
            drop,
            dstr,
            slopes,
            dq,
            dk_part,
            dv_part,
            dbias if dbias is not None else np.zeros((1, 1, 1, 1), dtype),
        )
    dk = _sum_parts(dk_part, kv_head, kv_heads, keys, dim, length)
    dv = _sum_parts(dv_part, kv_head, kv_heads, keys, vdim, length)
    return dq, dk, dv, dbias


def _sum_parts(part, kv_head, kv_heads, keys, feats, length):
    """(B, K, S, F): the partials summed over the query heads of each kv head and the query
    chunks in increasing (head, chunk) order; one partial per kv head is the result itself
    (no copy when unpadded)."""
    batch, heads, nchunks = part.shape[:3]
    result = np.zeros((batch, kv_heads, keys, feats), part.dtype)
    if not (length and result.size):  # no unit ran: the partials were never written
        return result
    if heads == kv_heads and nchunks == 1:  # kv_head is the identity then
        whole = part[:, :, 0, :keys, :feats]
        return whole if whole.flags.c_contiguous else np.ascontiguousarray(whole)
    _reduce_parts(part, kv_head, kv_heads, feats, result)
    return result


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
    keys = spec.dims[4]
    if rescalings is None:
        rescalings = -(-keys // BLOCK_K) + 2 * -(-keys // SPLIT_KEYS)
    return online_forward_bound(spec, weights, dtype, rescalings)


def backward_error_bound(spec, weights, grad_out, grad_lse=None, dtype=np.float64):
    """Bound on |dq|, |dk|, |dv|, |dbias| errors of :func:`backward` (shapes of the grads):
    :func:`refattn.bounds.online_backward_bound` with this kernel's query chunks."""
    batch, heads, _, length, keys, _, _ = spec.dims
    chunks = backward_chunks(batch, heads, length, keys)
    return online_backward_bound(spec, weights, grad_out, grad_lse, dtype, chunks)
