"""Fast exact attention forward: compiled first steps, the referee for the rest (the host side).

``precision="exact"`` means every element of out, lse and weights is the exact real result
rounded once to ``out_dtype``. This module decides almost every element with a Numba kernel
(:mod:`refattn.exact.fast.forward_kernels`) in double-double arithmetic
(:mod:`refattn.exact.fast.doubledouble`) that carries a rigorous error bound, and sends the
rows it cannot decide to the arbitrary-precision engine
(:class:`refattn.exact.attention.ExactForward`, "the referee") -- Ziv's strategy with a compiled
first step. The results are bit-identical to the referee's.

Per query row i of a (batch, head) plane, streaming: no (L, S) array is ever built (only the
weights, when asked for, are an (L, S) output). Working memory is the float64 inputs, their
row norms, O(L) per plane of status and results, and O(S) per row in flight. The allowed set
is read on the fly (:mod:`refattn.exact.fast.allowed_set`): a key interval
``lo_i <= j < hi_i`` per row from causal, window and key length, and, only where the caller
passed them, the mask, ``bias == -inf`` and the dropout keep-mask read from their
un-broadcast arrays; it equals :meth:`AttentionSpec.allowed`, the one rule of
:mod:`refattn.masks`. The keys outside the interval are never visited, so causal rows cost
about half. The first steps run in parallel over the rows (blocks of :data:`D_ROW_BLOCK` rows)
of every plane at once -- a decode call (L = 1, many heads) is as parallel as a prefill -- and
each row's arithmetic is fixed by the shapes alone, so no bit depends on the thread count.

1. Scores. ``q_i . k_j`` is summed as ``(s, c)`` with TwoProd and TwoSum (Dot2-like):
   ``|s + c - q_i . k_j| <= dot_bound(D) |q_i|.|k_j| <= dot_bound(D) ||q_i|| ||k_j||``
   (Cauchy-Schwarz; the norms are float upper bounds). Inputs of every dtype are taken at their
   exact binary values; TwoProd is exact because nonzero magnitudes are kept in
   [SAFE_MIN, SAFE_MAX] (other planes go to the referee). Then ``t = s_dd * scale_dd``
   (``scale_dd`` a double-double with a bound from exact integers), softcap
   ``c tanh(t / c)`` (tanh is 1-Lipschitz, ``TANH_ABS`` absolute), ``+ bias``, ``+ ALiBi``
   (``-slope |i + o_b - j|`` by TwoProd, exact; none on a folded sink's key). Each
   double-double operation adds ``DD_REL |result|`` to an absolute error bound ``delta_ij``
   of the score.
2. Shift. ``m_i = max_j hi(t_ij)`` over the allowed keys (any number works: it cancels in
   ``out = N / Z`` and ``lse = m + log Z`` adds it back), ``x_ij = t_ij - m_i`` with
   ``|error| <= delta_ij + DD_REL |x_ij|``. A sink ``sigma_h`` (``spec.sinks``) is one more
   logit, exact, in the max and in Z (added after the keys, and counted in the sums' bounds)
   with no value: a row with no allowed key holds it alone (out 0, lse = sigma_h), and the
   weights stay those of the keys. Nothing is folded: the referee alone folds the sink into
   one more key (:func:`refattn.spec.fold`), for the rows it is given.
3. Exponentials. ``e_ij = exp_dd_fast(x_ij)`` (``x <= 0``: a 1024-entry table) with relative error
   ``rho_ij <= (EXP_FAST_REL + 2 err(x_ij)) (1 + 2**-20)`` (``|e^d - 1| <= 2|d|`` for |d| <= 1;
   rows with an error above 2**-20 are left to the referee). Keys with ``x < CUT`` (-400)
   have ``0 <= e < TINY`` (2**-575) and enter as that absolute radius only.
4. Sums. ``Z = sum_j e_ij`` and ``N_e = sum_j kappa_ij e_ij v_je`` with TwoProd/TwoSum and a
   compensation word: ``|N - N^| <= (dot_bound(2S) + rho_i) A_e + TINY sum |v_je|`` with
   ``A_e = sum_j e_ij |v_je| <= max_j |v_je| min(Z + rZ, (1 + rho_i)(1 + 2**-20) zv)``
   (``rho_i = max_j rho_ij``; ``zv`` the float sum of the valued keys' ``hi(e_ij)``, which
   is what bounds N when a sink holds most of Z; the same for Z with A = Z).
5. Results. ``out = N / Z * keep_scale`` (double-double division; the quotient of enclosures
   ``(rN + |N/Z| rZ) / (Z - rZ)``), ``lse = m + log_dd(Z)`` (``-log(1 - rZ/Z)`` for Z's
   radius), ``w_ij = exp_dd_fast(x_ij - log Z)``.
6. Rounding decision. :func:`refattn.exact.rounding.decide_dd` (compiled, per element in the
   kernels: ``decide_one``) rounds both ends of each enclosure exactly; where they differ (a
   rounding boundary within the radius: ties at the max, weights exactly 1/n on a midpoint,
   exact zeros, overflow) the whole row goes to the referee, restricted to those rows
   (:func:`row_spec`: a spec of the row run, with the offset shifted so causal/window/ALiBi
   use the original row indices).

7. Refined step. The rows still undecided run again in
   :mod:`refattn.exact.fast.forward_refine` (the same arithmetic, sums over keys bounded by
   64-key blocks: about 2**-90 of ``A_e`` instead of ``dot_bound(2S)``, which grows like
   ``S**2``; exact dot products where :func:`exactness_scales` proves them) before the
   referee; rows of :data:`~refattn.exact.fast.forward_refine.REFINE_KEYS` keys or more go to
   it at once, reading quantised k and v from their codes for a float64 target.

For targets of at most 24 bits (float32, float16, bfloat16) a cheaper double-precision first
step runs before the double-double one
(:func:`refattn.exact.fast.forward_kernels.forward_d`): the dot products are fma chains
(``|error| <= gamma_D |q_i|.|k_j|``, Higham 2002, eq. (3.5); zero where
:func:`exactness_scales` proves every partial sum representable, as for float16/bfloat16
inputs), each later rounding is bounded by ``1.01 u |result|``, ``e = exp_d(x)`` has relative
error ``EXP_D_REL`` (2**-48.5), and the sums over keys are blocked (:data:`SUM_BLOCK` keys per
block, ``gamma_{B + S/B}``, Higham 2002, sec. 4.2) with ``|N - N^| <= (gamma + rho) A_e``,
``A_e <= min(max_j |v_je| Z, (sum_j e_j^2)^(1/2) ||v_e||)`` (Cauchy-Schwarz; no second pass
over V). Its radii are about 2**-40 relative to ``sum_j w_j |v_je|``, ample for 24-bit
targets. Where every key of a row is kept and neither softcap, ALiBi nor the weights apply
(prefill, causal or not), a row's scores, maximum, exponentials and sums are computed from its
dot products in one pass while the row is in cache
(:func:`refattn.exact.fast.forward_exps.plain_row`; the same values as the general path); the
set-up is one compiled parallel pass over q, K and V (:func:`refattn.exact.fast.facts.
input_facts`: float64 copies, K^T, the facts; bfloat16 read as its bits).
The rows the double step leaves undecided (a few percent for float32: 451 of 8192 at causal
L = S = 1024, D = 64) run a second pass of the same step with tighter bounds: the dot products
as fma chains over blocks of 32 features with the float sum ``sab`` of the magnitudes of every
rounded partial result, ``|error| <= u sab`` (each rounding errs by at most u times its
result's magnitude, Higham 2002, eq. (2.5), summed as in the running error bound of sec. 3.1;
:mod:`refattn.exact.fast.dense_dots`), some 4 bits tighter than ``gamma_D ||q_i|| ||k_j||`` at
D = 64, and ``A_e = sum_j e_j |v_je|`` summed beside N from |V| by the same blocked sums (410
of those 451 rows are decided there); it takes each plane's rows D_ROW_BLOCK at a time,
consecutive or not (:func:`redo_blocks`). Only what is left then runs in double-double, and then
goes to the referee. Float64 targets use the double-double step alone. The rounding decisions
of both steps first try :func:`~refattn.exact.fast.rounding_decision.decide_quick` (one
Veltkamp split), then :func:`~refattn.exact.fast.rounding_decision.decide_one`.

Planes with NaN/Inf in q, k or v, magnitudes outside [SAFE_MIN, SAFE_MAX], or a softcap or ALiBi
slope outside it go to the referee whole; rows with an allowed bias outside that range, and
empty rows, go to the referee row by row; their semantics are not re-derived.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..._kv_codes import with_values
from ...spec import AttentionSpec
from ..attention import exact_forward
from ..rounding import format_of
from . import doubledouble as D
from ._params import P_ALIBI_OFFSET, P_SINK, P_SLOPE, PRM, frozen
from .allowed_set import allowed_rule
from .codes_inputs import codes_inputs
from .decode import decode_first_step
from .facts import input_facts, row_facts
from .forward_kernels import (
    D_ROW_BLOCK,
    KEY_TILE,
    OK,
    SUM_BLOCK,
    UNDECIDED,
    WORKERS,
    forward_d,
    forward_dd,
)
from .forward_refine import REFINE_KEYS, code_planes, forward_refine

__all__ = [
    "fast_exact_forward",
    "fallback_stats",
    "row_spec",
    "rounds_to_zero",
    "exactness_scales",
    "kernel_params",
    "finish_forward",
    "referee_runs",
]

_LAST_STATS: dict = {}


def rounds_to_zero(tiny: np.ndarray, fmt) -> np.ndarray:
    """Where a weight flagged by the kernels (1: 0 < w < 2**-288, 2: 0 < w < 2**-1154)
    rounds to +0 in ``fmt``.

    >>> from refattn.exact.rounding import FORMATS
    >>> rounds_to_zero(np.array([0, 1, 2]), FORMATS["float64"]).tolist()
    [False, False, True]
    """
    return (tiny == 2) | ((tiny == 1) & (fmt.p < 53))


def exactness_scales(x: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Per row of x, ``norms / 2**g`` with g the exponent of the row's lowest set bit.

    The fma chain of ``q_i . k_j`` is exact when ``sq_i * sk_j < 2**52`` (sq, sk the scales of
    q's and k's rows): every product and partial sum is then a multiple of ``2**(g_i + g_j)``
    of magnitude ``<= ||q_i|| ||k_j|| < 2**53 * 2**(g_i + g_j)`` (the factor 2 covers the
    rounding of the scales' product). True for float16/bfloat16 inputs of moderate range.

    >>> exactness_scales(np.array([[0.5, 1.5], [0.0, 0.0]]), np.array([2.0, 0.0])).tolist()
    [4.0, 0.0]
    """
    frac, exps = np.frexp(x)
    mant = (np.abs(frac) * 2.0**53).astype(np.int64)
    nonzero = mant != 0
    trailing = np.log2(np.where(nonzero, mant & -mant, 1)).astype(np.int64)  # exact
    low = np.where(nonzero, exps.astype(np.int64) - 53 + trailing, np.iinfo(np.int64).max)
    g = low.min(axis=1, initial=np.iinfo(np.int64).max)
    g = np.where(g == np.iinfo(np.int64).max, 0, g)  # a zero row: its products are all 0
    with np.errstate(over="ignore"):
        return np.ldexp(norms, -g)


def row_spec(spec: AttentionSpec, b: int, h: int, start: int, stop: int) -> AttentionSpec:
    """The spec of query rows ``start:stop`` of plane (b, h) alone: one batch, one head, the
    kv head it reads, and the offset shifted by ``start`` so causal, window and ALiBi see the
    original row indices (``i' + o' = i + o``). Its bias shape is its own rows' (1, 1, n, S)
    and it keeps head h's sink.

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((4, 2)), np.zeros((4, 2)), np.zeros((4, 1)), causal=True)
    >>> sub = row_spec(spec, 0, 0, 2, 4)
    >>> sub.q.shape, sub.offset
    ((1, 1, 2, 2), 2)
    """
    g = int(spec.kv_head[h])

    def rows(a):
        return None if a is None else a[b : b + 1, h : h + 1, start:stop]

    mask = rows(spec.mask)
    if spec.kv_lengths is not None:  # the row's own key length becomes part of the mask
        own = np.arange(spec.k.shape[-2]) < spec.kv_lengths[b]
        mask = np.broadcast_to(own, (1, 1, stop - start, own.size)) if mask is None else mask & own
    return dataclasses.replace(
        spec,
        q=spec.q[b : b + 1, h : h + 1, start:stop],
        k=spec.k[b : b + 1, g : g + 1],
        v=spec.v[b : b + 1, g : g + 1],
        batch_shape=(1,),
        single_head=False,
        bias=rows(spec.bias),
        mask=mask,
        dropout_mask=rows(spec.dropout_mask),
        bias_shape=None if spec.bias is None else (1, 1, stop - start, spec.bias.shape[-1]),
        alibi_slopes=None if spec.alibi_slopes is None else spec.alibi_slopes[h : h + 1],
        sinks=None if spec.sinks is None else spec.sinks[h : h + 1],
        kv_head=np.zeros(1, dtype=np.int64),
        offset=spec.row_offset(b) + start,
        kv_lengths=None,
        dbias_index=None,
        alibi_offsets=None
        if spec.alibi_offsets is None
        else np.array([spec.alibi_offsets[b] + start], dtype=np.int64),
    )


def redo_blocks(redo: np.ndarray):
    """The work items (n, 4) = (b, h, offset, row count <= D_ROW_BLOCK) and the row list of
    :func:`~refattn.exact.fast.forward_kernels.forward_d`'s second pass covering the rows where
    ``redo`` (B, H, L) holds: each plane's rows in ascending order, D_ROW_BLOCK at a time
    (consecutive or not), a block's rows being entries offset .. offset + count - 1 of the list.

    >>> items, rows = redo_blocks(np.array([[[True, True, False, True]]]))
    >>> items.tolist(), rows.tolist()
    ([[0, 0, 0, 3]], [0, 1, 3])
    """
    items = []
    lists = []
    offset = 0
    for b, h in np.argwhere(redo.any(axis=2)):
        rows = np.flatnonzero(redo[b, h])
        lists.append(rows)
        for first in range(0, rows.size, D_ROW_BLOCK):
            items.append((b, h, offset + first, min(D_ROW_BLOCK, rows.size - first)))
        offset += rows.size
    items = np.array(items, dtype=np.int64).reshape(-1, 4)
    row_list = np.concatenate(lists).astype(np.int64) if lists else np.zeros(0, np.int64)
    # forward_d's lane w takes items w, w + lanes, ...: ordered so that each lane's items are
    # consecutive ones of one plane where possible (K^T and V stay in cache between them)
    lanes = min(len(items), WORKERS)
    if lanes:
        chunk = -(-len(items) // lanes)
        order = np.arange(chunk * lanes).reshape(lanes, chunk).T.reshape(-1)
        items = items[order[order < len(items)]]
    return items, row_list


def _runs(rows: np.ndarray):
    """Maximal runs (start, stop) of consecutive sorted row indices."""
    if rows.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [rows.size]])
    return [(int(rows[a]), int(rows[z - 1]) + 1) for a, z in zip(starts, stops, strict=True)]


def referee_runs(spec, status, out_dtype, results, asked, sub_spec, referee=None) -> int:
    """The rows the first steps left (``status`` not OK) by the referee, run by run of rows of
    each plane (``sub_spec(spec, b, h, start, stop)`` the run's spec), written into
    ``results`` = (out, lse, weights) (``asked`` = (return_lse, return_weights)); returns
    their count. ``referee``: the exact forward to call (default
    :func:`refattn.exact.attention.exact_forward`; the sigmoid step passes its own)."""
    referee = exact_forward if referee is None else referee
    out, lse, weights = results
    return_lse, return_weights = asked
    count = 0
    for b, h in np.argwhere((status != OK).any(axis=2)):
        rows = np.flatnonzero(status[b, h] != OK)
        count += rows.size
        for start, stop in _runs(rows):
            sub = sub_spec(spec, int(b), int(h), start, stop)
            o, g, w = referee(sub, out_dtype, return_lse=return_lse, return_weights=return_weights)
            out[b, h, start:stop] = o[0, 0]
            if return_lse:
                lse[b, h, start:stop] = g[0, 0]
            if return_weights:
                weights[b, h, start:stop] = w[0, 0]
    return count


def finish_forward(results, dtype, rows, step_rows, referee_rows):
    """``results`` = (out, lse or None, weights or None) cast to ``dtype``, after recording
    what :func:`fallback_stats` returns: ``rows`` = (row count, elements per row),
    ``step_rows`` the rows each first step ran, ``referee_rows`` the referee's (the dense and
    the gathered-keys engines end alike)."""
    total, per_row = rows
    _LAST_STATS.clear()
    _LAST_STATS.update(
        rows=total,
        referee_rows=referee_rows,
        elements=total * per_row,
        referee_elements=referee_rows * per_row,
        double_rows=step_rows["double"],
        double_magnitude_rows=step_rows.get("double-magnitude", 0),
        double_double_rows=step_rows["double-double"],
        decode_rows=step_rows.get("decode", 0),
        refine_rows=step_rows.get("refine", 0),
    )
    out, lse, weights = results
    return (
        out.astype(dtype),
        None if lse is None else lse.astype(dtype),
        None if weights is None else weights.astype(dtype),
    )


def kernel_params(spec: AttentionSpec):
    """(B, H, 16) scalar parameters of every plane's kernel and the (B, H) planes whose
    parameters are in range (the others go to the referee).

    Per plane: ``[scale hi, lo, error, dot_bound(D), softcap (0: off), ALiBi slope, ALiBi
    offset, dot_bound(2 (S + sink)), keep_scale hi, lo, error, gamma(D), gamma of the blocked
    sums, ALiBi key count, has sink, sink logit]``."""
    batch, heads, _, _, keys, dim, _ = spec.dims
    scale_hi, scale_lo, scale_err = D.dd_of_exact(spec.scale_exact)
    cap = 0.0 if spec.softcap is None else float(spec.softcap)
    slopes = (
        np.zeros(heads)
        if spec.alibi_slopes is None
        else np.asarray(spec.alibi_slopes, dtype=np.float64)
    )
    keep_hi, keep_lo, keep_err = D.dd_of_fraction(spec.keep_scale)
    alibi_keys = keys if spec.alibi_keys is None else spec.alibi_keys

    def in_range(x):
        return (x == 0) | ((np.abs(x) >= D.SAFE_MIN) & (np.abs(x) <= D.SAFE_MAX))

    ok = np.broadcast_to(
        in_range(slopes) & bool(in_range(scale_hi) and in_range(cap)), (batch, heads)
    )
    sink = spec.sinks is not None  # one more term in Z: the sums' bounds count it
    sinks = np.zeros(heads) if not sink else np.asarray(spec.sinks, dtype=np.float64)
    ok = ok & in_range(sinks)[None, :]
    values = dict(
        scale_hi=scale_hi,
        scale_lo=scale_lo,
        scale_err=scale_err,
        dot_rel=D.dot_bound(dim),
        softcap=cap,
        slope=0.0,
        alibi_offset=0.0,
        sum_rel=D.dot_bound(2 * (keys + sink)),
        keep_hi=keep_hi,
        keep_lo=keep_lo,
        keep_err=keep_err,
        gamma_dim=D.gamma_up(dim),
        gamma_sum=D.gamma_up(SUM_BLOCK + keys // SUM_BLOCK + 2 + sink),
        alibi_keys=float(alibi_keys),
        has_sink=float(sink),
        sink=0.0,
    )
    prm = np.empty((batch, heads, len(PRM)))
    prm[...] = [values[name] for name in PRM]
    prm[:, :, P_SINK] = sinks[None, :]
    prm[:, :, P_SLOPE] = slopes[None, :]
    offsets = np.array([spec.alibi_offset(b) for b in range(batch)], dtype=np.float64)
    prm[:, :, P_ALIBI_OFFSET] = offsets[:, None]
    return prm, ok


def _kernel_source(a: np.ndarray) -> np.ndarray:
    """``a`` as :func:`~refattn.exact.fast.facts.input_facts` reads it: C-contiguous float32 or
    float64 as it is, bfloat16 as its uint16 bits, any other dtype widened to float64 (exact
    for every float format of at most 53 bits)."""
    if a.dtype == np.float32 or a.dtype == np.float64:
        return frozen(a)
    if a.dtype.name == "bfloat16" and a.dtype.itemsize == 2:
        return frozen(a).view(np.uint16)
    return frozen(a, np.float64)


class _Inputs:
    """Float64 inputs of every plane, their norms and scales, and the planes the first steps
    take (the others go to the referee whole)."""

    def __init__(self, spec: AttentionSpec, kv=None, store=True):
        batch, heads, _, length, keys, _, _ = spec.dims
        self.kvh = np.ascontiguousarray(spec.kv_head, dtype=np.int64)
        self.prm, ok = kernel_params(spec)
        vdim = spec.v.shape[3]
        epad = max(KEY_TILE, -(-vdim // KEY_TILE) * KEY_TILE)
        lead = spec.q.shape[:3]
        q_ok, self.qn, self.qs = (np.empty(lead, dtype) for dtype in (np.bool_, float, float))
        if kv:  # k, v as codes (refattn._kv_codes): one compiled pass each, the same facts
            # the dense step's layout: KEY_TILE zero keys past S, E zero-padded to whole tiles
            # (store False: the facts alone, the refined step reading the codes themselves)
            self.kT, v, k_facts, v_facts = codes_inputs(*kv, batch, KEY_TILE, store)
            (k_ok, self.kn, self.ks), (v_ok, self.vnorm, self.vmax) = k_facts, v_facts
            self.v = v
            if epad != vdim:
                self.v = np.zeros(v.shape[:3] + (epad,))
                self.v[..., :vdim] = v
            self.q = np.ascontiguousarray(spec.q, dtype=np.float64)
            flat = frozen(self.q.reshape(int(np.prod(lead)), self.q.shape[3]))
            if flat.shape[0]:
                facts = (q_ok.reshape(-1), self.qn.reshape(-1), self.qs.reshape(-1))
                row_facts(flat, flat.view(np.int64), facts[1], facts[2], facts[0])
        else:  # one compiled pass over q, K and V: float64 copies, K^T, the facts
            kshape = spec.k.shape
            self.q = np.empty(spec.q.shape)
            # K^T with KEY_TILE zero keys past S, V with zero features up to a multiple of
            # KEY_TILE (whole register tiles)
            self.kT = np.empty(kshape[:2] + (kshape[3], kshape[2] + KEY_TILE))
            self.kT[..., kshape[2] :] = 0.0
            self.v = np.empty(spec.v.shape[:3] + (epad,))
            k_ok = np.empty(kshape[:3], np.bool_)
            self.kn, self.ks = np.empty(kshape[:3]), np.empty(kshape[:3])
            v_ok = np.empty(spec.v.shape[:2] + (vdim,), np.bool_)
            self.vnorm, self.vmax = np.empty(v_ok.shape), np.empty(v_ok.shape)
            input_facts(
                tuple(_kernel_source(a) for a in (spec.q, spec.k, spec.v)),
                (self.q, self.kT, self.v),
                ((q_ok, self.qn, self.qs), (k_ok, self.kn, self.ks), (v_ok, self.vnorm, self.vmax)),
            )
        kv_ok = k_ok.all(axis=2) & v_ok.all(axis=2)
        self.ok = ok & q_ok.all(axis=2) & kv_ok[:, self.kvh] & (length > 0) & (keys > 0)
        self.rule = allowed_rule(spec)


def fast_exact_forward(
    spec: AttentionSpec, out_dtype, *, return_lse=False, return_weights=False, kv=None
):
    """Correctly rounded (out, lse, weights) in the flat (B, H, ...) layout, bit-identical to
    :func:`refattn.exact.attention.exact_forward` (see the module docstring).

    The first steps run in parallel over the query rows (blocks of D_ROW_BLOCK rows) of every
    plane at once; each row's arithmetic depends on the shapes alone, so the bits do not
    depend on the thread count. ``kv``: k and v as :class:`refattn.quantized.QuantisedRows`
    (``spec.k``, ``spec.v`` then placeholders: :func:`refattn._kv_codes.streamed_codes`); the
    first steps read them through :func:`~refattn.exact.fast.codes_inputs.codes_inputs`, the
    referee through their values.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((2, 2)), np.array([[1.0], [2.0]]))
    >>> out, _, _ = fast_exact_forward(spec, np.float64)
    >>> out.tolist()
    [[[[1.5]]]]
    """
    fmt = format_of(out_dtype)
    batch, heads, _, length, keys, _, vdim = spec.dims
    out = np.zeros((batch, heads, length, vdim))
    lse = np.zeros((batch, heads, length))
    weights = np.zeros((batch, heads, length, keys) if return_weights else (1, 1, 1, 1))
    status = np.full((batch, heads, length), UNDECIDED, dtype=np.int8)
    step_rows = {"double": 0, "double-magnitude": 0, "double-double": 0}
    results = (out, lse, weights, status)
    asked = (return_lse, return_weights)
    # a few query rows against long keys: the decode step reads k, v in place (the dense
    # steps below take only the rows it leaves undecided)
    decoded = decode_first_step(spec, kv, fmt, asked, results, kernel_params) if lse.size else 0
    step_rows["decode"] = decoded
    if (out.size or lse.size) and not (decoded and (status != UNDECIDED).all()):
        # long rows of codes to a float64 target: the refined step alone, reading the codes
        direct = bool(kv) and keys >= REFINE_KEYS and fmt.p > 24
        x = _Inputs(spec, kv, store=not direct)
        inputs = tuple(
            frozen(a)
            for a in (x.q, x.kT, x.v, x.qn, x.kn, x.qs, x.ks, x.vmax, x.vnorm, x.prm, x.kvh)
        )
        rule = x.rule.kernel_args()
        target = (return_lse, return_weights, fmt.p, fmt.emin, float(fmt.max_finite))
        planes = np.argwhere(x.ok)
        if fmt.p <= 24 and planes.size and not decoded:
            starts = np.arange(0, length, D_ROW_BLOCK)
            blocks = np.empty((planes.shape[0] * starts.size, 4), dtype=np.int64)
            blocks[:, :2] = np.repeat(planes, starts.size, axis=0)
            blocks[:, 2] = np.tile(starts, planes.shape[0])
            blocks[:, 3] = np.minimum(D_ROW_BLOCK, length - blocks[:, 2])
            # the first pass: consecutive rows, |V| and the row list unread
            first = (False, frozen(np.zeros((1, 1, 1, 1))), np.zeros(0, np.int64))
            forward_d(blocks, inputs, rule, target, results, first)
            step_rows["double"] = planes.shape[0] * length
        if fmt.p <= 24 and planes.size:  # after the first pass or the decode step
            redo = x.ok[:, :, None] & (status == UNDECIDED)
            blocks, row_list = redo_blocks(redo)
            if blocks.size:  # the rows left, again with magnitude-sum bounds
                second = (True, frozen(np.abs(x.v)), row_list)
                forward_d(blocks, inputs, rule, target, results, second)
                step_rows["double-magnitude"] = int(redo.sum())
                redo = x.ok[:, :, None] & (status == UNDECIDED)
        else:
            redo = np.broadcast_to(x.ok[:, :, None], status.shape)
        items = np.ascontiguousarray(np.argwhere(redo))  # argwhere's rows: one kernel layout
        if items.size and keys < REFINE_KEYS:  # long rows: the refined step at once
            forward_dd(items, inputs, rule, target, results)
            step_rows["double-double"] = items.shape[0]
            items = np.ascontiguousarray(np.argwhere(x.ok[:, :, None] & (status == UNDECIDED)))
        if items.size:  # the refined double-double step (sum bounds linear in S)
            codes = code_planes(kv if direct else None, batch)
            forward_refine(items, inputs, rule, target, results, codes)
        step_rows["refine"] = items.shape[0]
    referee_rows = 0
    if kv and (status != OK).any():  # the referee reads the values themselves
        spec = with_values(spec, kv)
    referee_rows += referee_runs(
        spec, status, out_dtype, (out, lse, weights), (return_lse, return_weights), row_spec
    )
    rows = batch * heads * length, vdim + return_lse + keys * return_weights
    asked = (out, lse if return_lse else None, weights if return_weights else None)
    return finish_forward(asked, fmt.dtype, rows, step_rows, referee_rows)


def fallback_stats() -> dict:
    """Statistics of the last :func:`fast_exact_forward` call: ``rows`` and ``elements`` in
    total, ``double_rows``, ``double_magnitude_rows`` and ``double_double_rows`` (rows
    evaluated by each first step: the double-precision step, its second pass with
    magnitude-sum bounds, the double-double step), ``decode_rows`` (rows the decode step of
    :mod:`refattn.exact.fast.decode` evaluated in place of the double step's first pass: a few
    query rows, k and v read in place; the rows it leaves go on to the second pass),
    ``refine_rows`` (rows the double-double step left to the refined step,
    :mod:`refattn.exact.fast.forward_refine`), ``referee_rows`` and ``referee_elements`` (those
    of the rows recomputed by the referee engine).

    Examples
    --------
    >>> set(fallback_stats()) <= {'rows', 'elements', 'referee_rows', 'referee_elements',
    ...                           'double_rows', 'double_magnitude_rows', 'double_double_rows',
    ...                           'decode_rows', 'refine_rows'}
    True
    """
    return dict(_LAST_STATS)


#: the sigmoid engine (:mod:`refattn.exact.fast.sigmoid`) reads the same inputs
DenseInputs = _Inputs
