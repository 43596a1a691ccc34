"""Fast first step of the exact VJP: double-double enclosures in Numba kernels (the host side).

Every gradient element of :func:`refattn.attention_vjp` is computed in double-double (dd)
arithmetic (:mod:`refattn.exact.fast.doubledouble`) together with a rigorous bound on its absolute
error, then rounded by :func:`refattn.exact.rounding.decide_dd`; elements whose bound
straddles a rounding boundary (ties, heavy cancellation, underflow) are left to the referee
(:class:`refattn.exact.attention_vjp.ExactVJP`, the Ziv loop with exact tie handling).

Formulas (the referee's, :func:`refattn.attention_vjp`): with ``t`` the scores, ``w`` the
pre-dropout weights, ``kappa`` the keep-mask and ``kf = 1/(1-p)``,

* ``dp_ij = dO_i . v_j``, ``dP_ij = kappa_ij kf dp_ij``, ``Delta_i = sum_j w_ij dP_ij``;
* ``dS_ij = w_ij (dP_ij - Delta_i + g_i)`` on allowed positions (dbias = dS);
* ``dT = dS (1 - tanh^2(x/c))`` with softcap ``c`` (``x`` the scaled score before it);
* ``dq_i = s sum_j dT_ij k_j``, ``dk_j = s sum_{h in group, i} dT_ij q_i``,
  ``dv_j = kf sum_{h, i} kappa_ij w_ij dO_i``.

Error analysis (``u = 2**-53``; every bound below is an upper bound of the exact error):

* dot products of exact inputs (``q_i . k_j``, ``dO_i . v_j``) use the compensated scheme
  ``(p, e) = two_prod``, ``(s, e') = two_sum(s, p)``, ``c += e + e'``; over n terms the pair
  ``(s, c)`` is within ``dot_bound(n) A`` of the exact sum
  (:func:`refattn.exact.fast.doubledouble.dot_bound`, about ``2 n^2 u^2``), ``A = sum |a_k b_k|``
  bounded by ``max_k |a_k| * sum_k |b_k|``;
* the accumulations of dq, dk, dv (dd factor ``a_h + a_l`` times a float64 ``b``) use the same
  scheme with the low word folded in by one fma, ``e = fma(a_l, b, fma(a_h, b, -p))``, and a
  *running* error bound: TwoProd and TwoSum are exact, and the three roundings of a step
  (the outer fma, ``z = e + e'``, ``c + z``) err by at most ``u (|e| + |z| + |c_new|)``. A
  sum whose terms are exact (an input times a weight ``1 = 1.0 + 0.0``, sums of a few
  float32 inputs in float64) thus carries no rounding error at all, where the a-priori
  ``dot_bound(n) A`` (``~2**-97 A`` for n = 16) would hide a result ``e^-64`` from a rounding
  midpoint;
* the errors of the factors carried into dq, dk, dv (``err(dS_ij)`` times ``|k_jd|``, and the
  like): the smaller of the max-error form ``max_j err(dS_ij) * sum_j |k_jd|`` and the term-by-
  term sum ``sum_j err(dS_ij) |k_jd|`` (nonnegative products summed in float64: within
  ``(1 + u)**(n + 1) <= 1 + 2**-20`` of the exact sum); the second is the tighter where one
  key's error dominates (the reference key's), as on Gaussian rows;
* every other dd operation errs by at most ``DD_REL = 2**-100`` of its result (four times the
  largest JMP bound, :mod:`refattn.exact.fast.doubledouble`);
* scores: the scale (a dd for 1/sqrt(D)), softcap via ``E = exp(-2|y|)``,
  ``tanh|y| = (1 - E)/(1 + E)`` (absolute error ``2 eE + 22 DD_REL``) and
  ``1 - tanh^2 = 4E/(1 + E)^2`` (absolute error ``4 eE + 27 DD_REL`` of itself), bias and
  ALiBi (``slope * distance`` exact by two_prod) one ``DD_REL`` each;
* weights, relative to a reference key ``r`` of each row (the largest dd score, first on
  ties): ``e_ij = exp(t_ij - t_ir)`` for ``j != r`` has relative error
  ``EXP_FAST_REL + expm1(err t_ij + err t_ir)`` (below ``EXP_MIN_ARG``: 0 with absolute error
  ``2**-894``), ``e_ir = 1`` exactly; ``sigma_i = sum_{j != r} e_ij`` is a compensated sum
  (error: the smaller of ``dot_bound(S)`` of its magnitude and the running bound
  ``u sum_k (|t_k| + |c_k|)`` of the two roundings of each compensation update
  ``c_k = c_{k-1} + t_k``, ``t_k = lo_k + e'_k``, TwoSum being exact: about ``S u^2`` of
  the magnitude where the a-priori bound is ``2 S^2 u^2``), ``Z_i = 1 + sigma_i``,
  ``w_ij = e_ij (1/Z_i)`` and
  ``w_ir = 1 - tau_i`` with ``tau_i = sigma_i (1/Z_i)`` (the exact ``1 - tau_h`` by TwoSum,
  then one rounding of at most ``u`` of the low word): no weight is ever ``e_ir / Z_i``, so
  the error of every weight is relative to the weights of the other keys (a top weight
  ``1 - e^-64`` is known to about ``2**-92 e^-64``, not to ``2**-94``);
* ``dP_ij - Delta_i`` (the softmax Jacobian in ``dS`` above) in the cancellation-free
  reference-key form: with ``x_j = kappa_ij dp_ij`` and ``y_j = x_j - x_r`` (``y_r = 0``
  exactly; error ``err x_j + err x_r + DD_REL |y_j|``), ``sum_j w_ij = 1`` gives
  ``x_j - sum_k w_ik x_k = y_j - D_i`` with ``D_i = sum_{k != r} w_ik y_k`` (a compensated
  sum: the products' first-order errors plus ``DD_REL`` of the sum of magnitudes plus the
  summation's error, bounded as sigma's). ``dS_ir = -w_ir D_i``, and the errors of every
  ``dS_ij`` are in proportion to the non-reference weights, where the direct
  ``dP_ir - Delta_i`` with ``w_ir ~ 1`` would carry ``Delta_i``'s absolute error
  (``~2**-94 |dP|``, the top weight's) against a result ``~e^-64 |dP|``: no correct rounding
  could be decided from it. ``kf``
  multiplies ``y_j - D_i`` afterwards (one dd product); the further steps are dd products
  and sums whose errors are the first-order JMP bounds plus the products of the operands'
  errors;
* every bound computed in float64 is multiplied by ``1 + 2**-20`` (it is a sum/product of
  fewer than ``2**25`` non-negative terms, so its own rounding stays below ``2**-26``
  relative), and ``2**-600`` is added for underflow: the fast step is used only when every
  input is finite with magnitude below ``2**60`` (and the scale, softcap and slopes are in
  range), so an intermediate's underflow loss (``<= 2**-1070`` per operation, fewer than
  ``2**40`` operations per element) is amplified by less than ``2**420`` on its way to an
  output.

Any non-finite intermediate in a (batch, kv head) unit marks the whole unit undecided.

Sinks (``spec.sinks`` (H,), finite, below :data:`INPUT_LIMIT`) are native, with the semantics
of :func:`refattn.spec.fold` (one more key with key 0, value 0 and score exactly the logit
``sigma_h``: no scale, softcap, bias or ALiBi) but no (B, H, L, S + 1) array: pass A's scratch
row of the keys ``lo .. hi`` (length n) gets the sink as entry n (always allowed and kept,
score ``(sigma_h, 0)`` with error 0, softcap derivative 1, ``dp = 0`` exactly), and the
weights, ``D_i``, dS and dT run over the n + 1 entries unchanged (:func:`~.vjp_rows.row_gradients`),
so the error analysis above holds with the sink as one more key (``sigma_i`` and ``D_i`` still sum
at most S terms: the reference entry is left out). The sink may be the reference key: pass A then
stores :data:`SINK_REF` (outside [0, S)) as its index and passes B and C, which visit real
keys only, read its score ``(sigma_h, 0, 0)`` and ``x_r = 0`` from the row statistics. A row
with no allowed key has the sink alone (kind 2: weight 1, ``dS = g_i`` exactly, dq = 0,
nothing reaches dk, dv). The sink adds exactly nothing to dq (its key is 0) and its dk is
discarded; its dS enclosure per row (3, B, H, L) is summed over (b, i) into dsinks (3, H) by
:func:`reduce_enclosure` in the C order of (b, h, i).

Streaming (no (L, S) array; memory O(L D + S D) per head plane, plus a (B, H, L, S) dS
enclosure only where dbias has that size or for a folded spec's slots: see pass C): each
row's allowed and kept sets are computed on the fly into a length-S scratch row from its
structural key interval ``[lo, hi)`` (causal, window, key length) and, only where present, the
explicit mask, the -inf positions of the bias and the dropout keep-mask, read through their
un-broadcast arrays and strides (:mod:`refattn.exact.fast.allowed_set`); every key loop runs over
``[lo, hi)`` only (causal halves the work), in increasing key order, so the values are those of
the full loops. Two passes, in the manner of FlashAttention-2's backward:

* pass A (:func:`~.vjp_passes.dq_pass`), parallel over (batch, query head, block of
  :data:`ROW_BLOCK` rows): each row's scores, weights, ``D_i``, dS and dT and its dq (and dbias); it
  stores per row only O(1) statistics (the reference key ``r`` and its score enclosure, ``1/Z_i``
  and its relative error bound, the reference weight ``w_ir``, ``x_ir`` and ``D_i`` with their
  bounds, the row kind);
* pass B (:func:`~.vjp_passes.dkdv_pass`), parallel over (batch, kv head, block of :data:`KEY_BLOCK`
  keys): the group's query heads and their rows in increasing order; for each row it recomputes the
  scores and ``dp`` of the block's keys, then ``e_ij``, ``w_ij = e_ij (1/Z_i)``, ``y_j``, dS and
  dT from the stored statistics, and accumulates dk, dv of its keys. Error analysis of the
  recomputation: every one of these steps is elementwise in the key (the dot products of one
  key, the exponential of one score difference, the product with the stored ``1/Z_i``) and is
  executed by the same compiled functions on the same operands (the stored statistics are the
  very floats pass A used), so each recomputed value and error bound is bit-identical to pass
  A's, whose bounds are those above: pass B adds no error term, and dk, dv accumulate the
  same terms in the same order (heads of the group, rows, increasing) as a single pass would.
* pass C (:func:`~.vjp_passes.dbias_pass`, a bias broadcast over batch, heads or rows with its key
  axis of size S), parallel over blocks of :data:`KEY_BLOCK` keys: the dS enclosure of every (b, h,
  i) at the block's keys, recomputed as in pass B (:func:`~.vjp_rows.block_ds`), summed into its
  dbias slot in the C order of (b, h, i); each slot holds one key's positions, so a block owns its
  slots, and the sums and bounds are those of :func:`reduce_enclosure` on pass A's
  (3, B, H, L, S) enclosure, bit for bit (the path kept for a full bias, where the sum is the
  identity, and for a folded spec's slots). A bias broadcast along the keys (dbias without a
  key axis of size S) has one slot per row at most: pass A sums each row's dS over its keys
  (in increasing order, with the bound of :func:`~.vjp_passes.reduce_slots`: the terms' errors plus
  ``DD_REL`` of the magnitudes per addition) into a (3, B, H, L) array, which
  :func:`reduce_enclosure` then sums into the slots; the enclosures differ in their last bits from
  the dS-then-reduce path's, the decided roundings do not.

Every output element is written by exactly one work item, whose operations are in a fixed
order: the results depend on the shapes alone (not on the thread count).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from .._fixed import to_fixed
from ..rounding import round_exact
from ._params import VJP_FOPTS, VJP_OPTS, VO_OFFSETS, frozen
from .allowed_set import allowed_rule, compact_view
from .doubledouble import dd_of_exact, dd_of_fraction, dot_bound
from .vjp_passes import (
    N_STAT,
    ROW_BLOCK,
    dbias_pass,
    decide_all,
    dkdv_pass,
    dq_pass,
    finish_slots,
    input_norms,
    reduce_slots,
)
from .vjp_rows import UNDERFLOW_TERM

__all__ = [
    "INPUT_LIMIT",
    "UNDERFLOW_TERM",
    "fast_inputs_ok",
    "gradient_enclosures",
    "reduce_enclosure",
    "decide",
]

#: Inputs (and the scale, softcap, ALiBi terms) must be below this magnitude for the fast step.
INPUT_LIMIT = 2.0**60


def decide(enc: np.ndarray, fmt):
    """(values, decided) of an enclosure array (3, ...) = (hi, lo, error bound) rounded to
    ``fmt`` (:func:`refattn.exact.fast.rounding_decision.round_decision`); an enclosure of radius 0
    is the exact value ``hi + lo``, rounded exactly (:func:`refattn.exact.rounding.round_exact`)
    where it lies on a rounding boundary (a tie)."""
    shape = enc.shape[1:]
    out = np.empty(int(np.prod(shape)))
    decided = np.empty(out.shape, np.bool_)
    flat = np.ascontiguousarray(enc).reshape(3, out.size)  # (3, N): a 0-d dbias too
    decide_all(flat, fmt.p, fmt.emin, float(fmt.max_finite), out, decided)
    exact = (flat[2] == 0.0) & np.isfinite(flat[0]) & np.isfinite(flat[1])
    for n in np.flatnonzero(~decided & exact):  # an exact value: rounded exactly (ties too)
        out[n] = round_exact(Fraction(flat[0, n]) + Fraction(flat[1, n]), fmt)
        decided[n] = True
    return out.reshape(shape), decided.reshape(shape)


def _alibi_offsets(spec) -> np.ndarray:
    """ALiBi's offset o_b of each batch row (int64 (B,))."""
    return np.array([spec.alibi_offset(b) for b in range(spec.dims[0])], dtype=np.int64)


def fast_inputs_ok(spec, grad_out, grad_lse) -> bool:
    """Whether the fast step applies: every input finite and below :data:`INPUT_LIMIT` (ALiBi's
    largest term included)."""
    arrays = [spec.q, spec.k, spec.v, grad_out]
    if grad_lse is not None:
        arrays.append(grad_lse)
    if spec.sinks is not None:
        arrays.append(spec.sinks)
    if spec.bias is not None:  # the un-broadcast elements only (never a (B, H, L, S) copy)
        core, _ = compact_view(spec.bias, np.float64)
        arrays.append(np.where(np.isneginf(core), 0.0, core))
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        if a.size and not (np.abs(a) < INPUT_LIMIT).all():
            return False
    _, _, _, length, keys, _, _ = spec.dims
    reach = int(np.abs(_alibi_offsets(spec)).max(initial=0))
    if (
        spec.alibi_slopes is not None
        and not (np.abs(spec.alibi_slopes) * (length + keys + reach + 1) < INPUT_LIMIT).all()
    ):
        return False
    scale = abs(spec.scale_float)
    if scale != 0.0 and not 2.0**-60 < scale < INPUT_LIMIT:
        return False
    if spec.softcap is not None and not 2.0**-60 < spec.softcap < INPUT_LIMIT:
        return False
    return True


def _dbias_stream_slots(spec):
    """(slot_b (B,), strides (3,)) with ``slot_b[b] + h st[0] + i st[1] + j st[2]`` the dbias
    slot of position (b, h, i, j) (:meth:`AttentionSpec.dbias_slots`), or None where pass C
    does not apply: no bias, a full (B, H, L, S) bias (the reduction is the identity), a
    bias broadcast along the keys (a slot would span key blocks), a folded spec's
    ``dbias_index`` or an empty problem."""
    if spec.bias is None or spec.dbias_index is not None:
        return None
    batch, heads, _, length, keys, _, _ = spec.dims
    shape = tuple(spec.bias_shape)
    size = int(np.prod(shape))
    if not shape or shape[-1] != keys or size == 0 or size == batch * heads * length * keys:
        return None
    full = tuple(spec.batch_shape) + (heads, length, keys)
    index = np.broadcast_to(np.arange(size, dtype=np.int64).reshape(shape), full)
    strides = np.array([st // index.itemsize for st in index.strides[-3:]], np.int64)
    slot_b = np.ascontiguousarray(index[..., 0, 0, 0], np.int64).reshape(-1)
    if slot_b.shape != (batch,):
        return None
    return frozen(slot_b), frozen(strides)


def _exact_row_sums(glse, nonempty, index, shape):
    """dbias of a bias broadcast along the keys without sinks, exactly: a row's dS sums to
    ``sum_j w_ij (dP_ij - Delta_i + g_i) = g_i`` (``sum_j w_ij = 1``, ``Delta_i = sum_j w_ij
    dP_ij``: whatever the dropout and softcap) when it has an allowed key, to 0 when it has
    none, so each slot is the exact sum of its rows' ``g_i`` (0 without grad_lse), in integers.
    Returned as an enclosure (3,) + shape: the nearest double-double and a radius of 0 where
    it is exact (:func:`decide` then rounds ties exactly too)."""
    size = int(np.prod(shape))
    out = np.zeros((3, size))
    if glse is not None:
        fixed = to_fixed(np.where(nonempty, glse, 0.0))  # exact: ints * 2**exp
        totals = np.zeros(size, dtype=object)
        np.add.at(totals, np.broadcast_to(index, nonempty.shape).ravel(), fixed.ints.ravel())
        for t, total in enumerate(totals):
            value = Fraction(int(total)) * Fraction(2) ** fixed.exp
            hi = float(value)
            rest = value - Fraction(hi)
            lo = float(rest)
            out[0, t], out[1, t] = hi, lo
            out[2, t] = 0.0 if Fraction(lo) == rest else math.ulp(lo)
    return out.reshape((3,) + tuple(shape))


def _along_keys(spec) -> bool:
    """Whether dbias has no key axis of its own (a bias broadcast along the keys, S > 1): every
    key of a row then adds to one slot, and pass A sums each row (``row_sums``)."""
    if spec.bias is None or spec.dbias_index is not None:
        return False
    keys = spec.dims[4]
    shape = tuple(spec.bias_shape)
    return keys > 1 and (not shape or shape[-1] == 1)


def _vjp_options(spec):
    """The vjp kernels' ``opts`` (int64: :data:`~refattn.exact.fast._params.VJP_OPTS`, then the
    ALiBi offset of each batch row) and ``fopts`` (float64:
    :data:`~refattn.exact.fast._params.VJP_FOPTS`; the dot-product bounds per length: D
    (scores), E (dp), S (dq), G L (dk, dv))."""
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    # ALiBi applies to keys j < alibi_keys (a folded sink has none) with the offset o_b of
    # batch row b (the B offsets follow the named slots)
    alibi_keys = keys if spec.alibi_keys is None else spec.alibi_keys
    flags = dict(
        has_bias=spec.bias is not None,
        has_alibi=spec.alibi_slopes is not None,
        has_softcap=spec.softcap is not None,
        alibi_keys=alibi_keys,
        dropout=spec.dropout_p != 0,
        has_mask=spec.mask is not None,
        has_dropout_mask=spec.dropout_mask is not None,
    )
    named = np.array([flags[name] for name in VJP_OPTS[:VO_OFFSETS]], np.int64)
    opts = np.concatenate([named, _alibi_offsets(spec)])
    scale_dd, keep_dd = dd_of_exact(spec.scale_exact), dd_of_fraction(spec.keep_scale)
    floats = dict(
        scale_hi=scale_dd[0],
        scale_lo=scale_dd[1],
        scale_err=scale_dd[2],
        softcap=spec.softcap or 1.0,
        keep_hi=keep_dd[0],
        keep_lo=keep_dd[1],
        keep_err=keep_dd[2],
        dot_d=dot_bound(dim),
        dot_e=dot_bound(vdim),
        dot_s=dot_bound(keys),
        dot_gl=dot_bound(heads // kv_heads * length),
    )
    fopts = np.array([floats[name] for name in VJP_FOPTS])
    return opts, fopts


def gradient_enclosures(spec, grad_out, grad_lse, *, stream_dbias=True):
    """dd enclosures (3, ...) of dq (B, H, L, D), dk (B, K, S, D), dv (B, K, S, E), dbias
    (3,) + :meth:`AttentionSpec.dbias_slots`'s shape (None without bias) and dsinks (3, H)
    (None without sinks), and a (B, K) array of units to hand to the referee.

    Sinks (``spec.sinks``) are native: each row has its head's sink as one more entry
    (:func:`refattn.exact.fast.vjp_rows.row_gradients`), its dS enclosure per row (3, B, H, L) is
    summed over batch and rows by :func:`reduce_enclosure` into dsinks; dbias is the caller's bias's
    alone (no sink slots).

    Streaming (module docstring): besides the inputs and the outputs, the memory is O(L + S +
    D + E) per head plane (row statistics, row intervals, norms; with sinks the (B, H, L)
    sink dS) and a scratch row of length S (S + 1 with a sink) per worker; no (L, S) array
    is formed unless the caller's mask, keep-mask or bias is one (they are read
    un-broadcast). dbias: a bias broadcast over batch, heads or rows (its key axis of size S)
    is summed by pass C (:func:`refattn.exact.fast.vjp_passes.dbias_pass`) with no (B, H, L, S)
    array; a full bias's dbias is the dS enclosure itself, written by pass A; a bias broadcast along
    the keys is summed per row by pass A (``row_sums``, (3, B, H, L)) and then into its slots;
    otherwise (a folded spec's slots, or ``stream_dbias=False``) pass A writes the
    (3, B, H, L, S) dS enclosure and :func:`reduce_enclosure` sums it, with the same bits as
    pass C.
    """
    batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
    f64 = np.float64
    # the inputs the passes only read, read-only (one specialisation of each pass)
    q = frozen(spec.q, f64)
    k = frozen(spec.k, f64)
    kt = frozen(np.swapaxes(k, 2, 3))
    vt = frozen(np.swapaxes(np.asarray(spec.v, f64), 2, 3))
    do = frozen(grad_out, f64)
    glse = frozen(grad_lse if grad_lse is not None else np.zeros((1, 1, 1)), f64)
    rule = allowed_rule(spec).kernel_args()
    slopes = frozen(spec.alibi_slopes if spec.alibi_slopes is not None else np.zeros(1), f64)
    group = frozen(np.array([np.flatnonzero(spec.kv_head == g) for g in range(kv_heads)], np.int64))
    opts, fopts = (frozen(a) for a in _vjp_options(spec))
    dq = np.zeros((3, batch, heads, length, dim))
    dk = np.zeros((3, batch, kv_heads, keys, dim))
    dv = np.zeros((3, batch, kv_heads, keys, vdim))
    slots = _dbias_stream_slots(spec) if stream_dbias else None
    along = stream_dbias and slots is None and _along_keys(spec)
    exact_rows = along and spec.sinks is None  # sum_j dS_ij = g_i exactly (_exact_row_sums)
    row_sums = along and not exact_rows
    write_ds = spec.bias is not None and slots is None and not along
    dbias = np.zeros((3, batch, heads, length, keys)) if write_ds else np.zeros((3, 1, 1, 1, 1))
    if row_sums:
        dbias = np.zeros((3, batch, heads, length, 1))
    if slots is not None:
        dbias_shape = tuple(spec.bias_shape)
        reduced = np.zeros((3, int(np.prod(dbias_shape))))
    has_sink = spec.sinks is not None
    sinks = frozen(spec.sinks if has_sink else np.zeros(1), f64)
    dsink = np.zeros((3, batch, heads, length)) if has_sink else np.zeros((3, 1, 1, 1))
    bad = np.zeros((batch, kv_heads), np.bool_)
    if batch and heads and length and (keys or has_sink):
        k_l1, v_l1 = np.zeros((batch, kv_heads, keys)), np.zeros((batch, kv_heads, keys))
        k_col = np.zeros((batch, kv_heads, dim))
        q_sum, do_sum = np.zeros((batch, kv_heads, dim)), np.zeros((batch, kv_heads, vdim))
        input_norms(q, k, vt, do, group, k_l1, v_l1, k_col, q_sum, do_sum)
        tensors = (q, k, kt, vt, do)
        lse_grad = (grad_lse is not None, glse)
        terms = (slopes, opts, fopts)
        norms = (k_l1, v_l1, k_col, q_sum, do_sum)
        kv_head = frozen(spec.kv_head, np.int64)
        istat = np.zeros((batch, heads, length, 3), np.int64)
        fstat = np.zeros((batch, heads, length, N_STAT))
        bad_rows = np.zeros((batch, heads, -(-length // ROW_BLOCK)), np.bool_)
        stats = (istat, fstat)
        dq_pass(
            tensors,
            lse_grad,
            rule,
            terms,
            kv_head,
            norms,
            (has_sink, sinks, dsink),
            (write_ds, row_sums, dbias),
            stats,
            dq,
            bad_rows,
        )
        dkdv_pass(tensors, lse_grad, rule, terms, group, norms, stats, dk, dv)
        if slots is not None:
            mag, count = np.zeros(reduced.shape[1]), np.zeros(reduced.shape[1])
            sums = (reduced, mag, count)
            dbias_pass(tensors, lse_grad, rule, terms, kv_head, norms, stats, slots, sums)
            finish_slots(reduced, mag, count)
        for h in range(heads):
            bad[:, kv_head[h]] |= bad_rows[:, h].any(axis=1)
    dsinks = None
    if has_sink:  # the sink's dS of every (b, h, i) into slot h, in their C order
        index = np.broadcast_to(
            np.arange(heads, dtype=np.int64)[None, :, None], (batch, heads, length)
        )
        dsinks = reduce_enclosure(dsink, index, (heads,))
    if spec.bias is None:
        return dq, dk, dv, None, dsinks, bad
    if slots is not None:
        return dq, dk, dv, reduced.reshape((3,) + dbias_shape), dsinks, bad
    index, shape = spec.dbias_slots()
    if exact_rows:
        nonempty = (
            istat[..., 0] != 0
            if batch and heads and length and keys
            else np.zeros((batch, heads, length), np.bool_)
        )
        return (
            dq,
            dk,
            dv,
            _exact_row_sums(glse if grad_lse is not None else None, nonempty, index[..., 0], shape),
            dsinks,
            bad,
        )
    if row_sums:  # every key of a row shares the row's slot: the row sums into their slots
        return dq, dk, dv, reduce_enclosure(dbias[..., 0], index[..., 0], shape), dsinks, bad
    return dq, dk, dv, reduce_enclosure(dbias, index, shape), dsinks, bad


def reduce_enclosure(enc, index, shape):
    """Sum a (3, B, H, L, S) enclosure into the slots ``index`` (B, H, L, S) of an array of
    ``shape`` (:meth:`refattn.spec.AttentionSpec.dbias_slots`; -1: left out), in the fixed
    C order of the (B, H, L, S) positions (any other (3,) + shape with its index: the sinks'
    (3, B, H, L) into (H,))."""
    shape = tuple(shape)
    size = int(np.prod(shape))
    flat = np.ascontiguousarray(np.broadcast_to(index, enc.shape[1:])).ravel()
    if flat.size == size and np.array_equal(flat, np.arange(size)):  # nothing to sum
        return enc.reshape((3,) + shape)
    out = np.zeros((3, size))
    if flat.size:
        reduce_slots(np.ascontiguousarray(enc), frozen(flat), out)
    return out.reshape((3,) + shape)
