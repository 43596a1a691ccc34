"""The parallel passes of the fast exact vjp (:mod:`refattn.exact.fast.vjp` states the formulas,
the error analysis and the streaming scheme; :mod:`refattn.exact.fast.vjp_rows` holds the
per-row pieces they call):

* :func:`dq_pass` (pass A), parallel over (batch, query head, block of :data:`ROW_BLOCK`
  rows): each row's dS, dT and dq (and dbias), and the O(1) row statistics of passes B, C;
* :func:`dkdv_pass` (pass B), parallel over (batch, kv head, block of :data:`KEY_BLOCK`
  keys): dk and dv, the rows' dS recomputed from the statistics bit for bit;
* :func:`dbias_pass` (pass C), parallel over key blocks: a broadcast bias's dbias slots;
* :func:`input_norms`, :func:`decide_all`, :func:`reduce_slots` / :func:`finish_slots`: the
  norms the bounds use, the rounding decision of every enclosure, the sums into dbias slots.

The passes take argument records (tuples; :func:`dq_pass` lists them), as
:mod:`refattn.kernels._args` does. Every output element is written by exactly one work item,
whose operations are in a fixed order: no bit depends on the thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._params import (
    R_ROWS_HI,
    R_ROWS_LO,
    VF_KEEP_ERR,
    VF_KEEP_HI,
    VF_KEEP_LO,
    VF_SCALE_ERR,
    VF_SCALE_HI,
    VF_SCALE_LO,
    VO_DROPOUT,
    VO_HAS_SOFTCAP,
)
from .allowed_set import allowed_row
from .doubledouble import BOUND_SAFETY, DD_REL, dd_add, two_sum
from .doubledouble import U as _U
from .rounding_decision import round_decision
from .vjp_rows import (
    SECOND_ORDER,
    UNDERFLOW_TERM,
    accumulate,
    block_ds,
    dt_of,
    row_gradients,
    single_dt,
    store_scaled,
)

__all__ = [
    "ROW_BLOCK",
    "KEY_BLOCK",
    "N_STAT",
    "SINK_REF",
    "dq_pass",
    "dkdv_pass",
    "dbias_pass",
    "input_norms",
    "decide_all",
    "reduce_slots",
    "finish_slots",
]

_JIT = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)
_SAFE = SECOND_ORDER

#: Query rows per work item of pass A and keys per work item of pass B.
ROW_BLOCK = 64
KEY_BLOCK = 64
#: Row statistics kept by pass A for pass B (float64 per row): the reference key's score
#: (3: hi, lo, error), 1/Z (hi, lo) and its relative error bound, the reference weight
#: w_r = 1 - tau (3), x_r (3) and D (3).
N_STAT = 15
#: The reference key of a row in pass A's statistics when it is the sink: outside [0, S), so
#: passes B and C (which visit the real keys only) never take a real key for it.
SINK_REF = -2


@njit(**_JIT)
def _row_ds_out(index, lo, n, bounded, allowed, ds, dbias_out):
    """Pass A's dS outputs of row ``index`` = (b, h, i) over its keys lo .. lo + n - 1: with
    ``row_sums`` the row's sum of dS (summed as :func:`reduce_slots` sums a slot, terms in
    increasing j), with ``write_ds`` every dS enclosure (``dbias_out`` of :func:`dq_pass`).
    ``bounded``: the row has errors (kind 1, not a zero row); excluded positions and
    single-key rows are exact."""
    b, h, i = index
    dsh, dsl, dse = ds
    write_ds, row_sums, dbias = dbias_out
    if row_sums:
        rs_h, rs_l, rs_e, rs_mag, rs_count = 0.0, 0.0, 0.0, 0.0, 0.0
        for t in range(n):
            rs_h, rs_l = dd_add(rs_h, rs_l, dsh[t], dsl[t])
            if allowed[t] and bounded:
                rs_e += dse[t] * BOUND_SAFETY + UNDERFLOW_TERM
            rs_mag += abs(dsh[t])
            rs_count += 1.0
        dbias[0, b, h, i, 0], dbias[1, b, h, i, 0] = rs_h, rs_l
        dbias[2, b, h, i, 0] = (rs_e + rs_count * DD_REL * rs_mag * _SAFE) * BOUND_SAFETY
    if write_ds:
        for t in range(n):
            j = lo + t
            dbias[0, b, h, i, j] = dsh[t]
            dbias[1, b, h, i, j] = dsl[t]
            dbias[2, b, h, i, j] = (
                dse[t] * BOUND_SAFETY + UNDERFLOW_TERM if allowed[t] and bounded else 0.0
            )


@njit(**_JIT)
def _row_dq(index, lo, n, row_kind, allowed, dt, checked, plane_keys, dq_row, fopts, dq, check):
    """Pass A's dq of row ``index`` = (b, h, i) from its dT enclosures ``dt`` = (hi, lo,
    error) at the keys lo .. lo + n - 1 (``plane_keys`` = the plane's (S, D) keys and their
    (D,) column sums :func:`input_norms` ``k_col``), stored scaled by
    the scale; ``row_kind`` = (kind, reference, zero row) of :func:`row_gradients`.
    ``dq_row`` = 4 (D,) work arrays. Returns ``check`` plus the row's finiteness terms
    (``checked`` = the weight and dS errors, in the key order)."""
    b, h, i = index
    kind, r, zero_row = row_kind
    sh, sl, se = dt
    we, dse = checked
    dq_h, dq_c, dq_r, dq_p = dq_row
    kp, k_col = plane_keys
    dq_h[:] = 0.0
    dq_c[:] = 0.0
    dq_r[:] = 0.0
    dq_p[:] = 0.0
    emax = 0.0
    # the real keys only: the sink's key is 0, it adds exactly nothing to dq
    for t in range(n):
        if not allowed[t]:
            continue
        check += se[t] + abs(sh[t]) + we[t] + dse[t]
        if zero_row:
            continue
        j = lo + t
        emax = max(emax, se[t])
        accumulate(sh[t], sl[t], kp[j], dq_h, dq_c, dq_r)
        for d in range(kp.shape[1]):
            dq_p[d] += se[t] * abs(kp[j, d])
    if zero_row or (kind == 2 and r == n):  # dq = 0 exactly (the sink's key is 0)
        return check
    s_hi, s_lo, s_err = fopts[VF_SCALE_HI], fopts[VF_SCALE_LO], fopts[VF_SCALE_ERR]
    for d in range(kp.shape[1]):
        xh, xl = two_sum(dq_h[d], dq_c[d])
        err = (min(emax * k_col[d], dq_p[d] * BOUND_SAFETY) + _U * dq_r[d]) * BOUND_SAFETY
        if k_col[d] == 0.0:  # a zero column of k: every product is an exact 0
            continue
        store_scaled(dq, (b, h, i, d), xh, xl, err, s_hi, s_lo, s_err)
    return check


@njit(parallel=True, **_JIT)
def dq_pass(tensors, lse_grad, rule, terms, kv_head, norms, sink, dbias_out, stats, dq, bad):
    """Pass A, parallel over (batch, query head, block of ROW_BLOCK rows): each row's dS, dT
    and dq (and the dS enclosure ``dbias`` (3, B, H, L, S) when ``write_ds``; with
    ``row_sums`` instead, for a bias broadcast along the keys, each row's sum over its keys
    ``dbias[:, b, h, i, 0]``, summed as :func:`reduce_slots` sums a slot), the row
    statistics for passes B and C (``istat`` (B, H, L, 3): kind, reference key (absolute;
    :data:`SINK_REF` for the sink), zero row; ``fstat`` (B, H, L, N_STAT)) and the
    non-finite flag of the block (``bad`` (B, H, blocks)). With a sink (``has_sink``,
    ``sinks`` (H,)) every row has it as one more entry (:func:`row_gradients`; a row with no
    allowed key is the sink alone) and its dS enclosure goes to ``dsink`` (3, B, H, L).

    Argument records: ``tensors`` = (q (B, H, L, D), k (B, K, S, D), k^T (B, K, D, S), v^T
    (B, K, E, S), dO (B, H, L, E)); ``lse_grad`` = (has grad_lse, grad_lse (B, H, L));
    ``rule`` = :meth:`refattn.exact.fast.allowed_set.AllowedRule.kernel_args`; ``terms`` =
    (ALiBi slopes, opts, fopts) (:func:`refattn.exact.fast.vjp.gradient_enclosures`);
    ``norms`` = (k_l1, v_l1, k_col, q_sum, do_sum) (:func:`input_norms`); ``sink`` = (has
    sink, sinks, dsink); ``dbias_out`` = (write_ds, row_sums, dbias); ``stats`` = (istat,
    fstat)."""
    q, k, kt, vt, do = tensors
    has_glse, glse = lse_grad
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    fopts = terms[2]
    k_l1, v_l1, k_col = norms[0], norms[1], norms[2]
    has_sink, sinks, dsink = sink
    istat, fstat = stats
    batch, heads, length, dim = q.shape
    keys = kt.shape[3]
    blocks = (length + ROW_BLOCK - 1) // ROW_BLOCK
    extra = 1 if has_sink else 0
    for item in prange(batch * heads * blocks):
        b = item // (heads * blocks)
        h = (item // blocks) % heads
        blk = item % blocks
        g = kv_head[h]
        sigma = sinks[h] if has_sink else 0.0
        row = np.empty((15, keys + extra))
        sh, sl, se, fh, fl, fe, wh, wl, we, dh, dl, de, dsh, dsl, dse = (
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            row[6],
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
            row[12],
            row[13],
            row[14],
        )
        allowed = np.empty(keys + extra, np.bool_)
        kept = np.empty(keys + extra, np.bool_)
        dq_h, dq_c, dq_r, dq_p = np.zeros(dim), np.zeros(dim), np.zeros(dim), np.zeros(dim)
        check = 0.0
        for i in range(blk * ROW_BLOCK, min(length, (blk + 1) * ROW_BLOCK)):
            lo, hi = rows_lo[b, i], rows_hi[b, i]
            istat[b, h, i, 0] = 0
            if lo >= hi and not has_sink:  # empty row: zero gradients, exactly
                continue
            n = max(hi - lo, 0)
            m = n + extra
            if n > 0:
                allowed_row(rule, b, h, i, lo, hi, allowed, kept)
            g_i = glse[b, h, i] if has_glse else 0.0
            scratch = (
                (sh[:m], sl[:m], se[:m]),
                (fh[:m], fl[:m], fe[:m]),
                (wh[:m], wl[:m], we[:m]),
                (dh[:m], dl[:m], de[:m]),
                (dsh[:m], dsl[:m], dse[:m]),
            )
            row_inputs = (q[b, h, i], kt[b, g], vt[b, g], do[b, h, i], k_l1[b, g], v_l1[b, g])
            kind, r = row_gradients(
                (b, h, i),
                lo,
                row_inputs,
                (has_glse, g_i),
                (allowed[:m], kept[:m]),
                rule,
                terms,
                scratch,
                fstat[b, h, i],
                (has_sink, sigma),
            )
            if kind == 0:  # empty row: zero gradients, exactly
                continue
            # dS = dT = 0 exactly when g = 0 and either a single key is allowed (weight 1,
            # dS = dP - dP) or no allowed key is kept (dP = Delta = 0; the sink's dp is 0)
            no_kept = True
            for t in range(n):
                if allowed[t] and kept[t]:
                    no_kept = False
            zero_row = (kind == 2 or no_kept) and (not has_glse or g_i == 0.0)
            ref = SINK_REF if r == n else lo + r
            istat[b, h, i, 0], istat[b, h, i, 1], istat[b, h, i, 2] = kind, ref, zero_row
            if has_sink:
                check += se[n] + abs(sh[n]) + we[n] + dse[n]
                if zero_row:
                    dsink[0, b, h, i], dsink[1, b, h, i], dsink[2, b, h, i] = 0.0, 0.0, 0.0
                else:
                    dsink[0, b, h, i], dsink[1, b, h, i] = dsh[n], dsl[n]
                    # a sink-only row (kind 2) is exact: dS = g
                    dsink[2, b, h, i] = dse[n] * BOUND_SAFETY + UNDERFLOW_TERM if kind == 1 else 0.0
            _row_ds_out(
                (b, h, i), lo, n, kind == 1 and not zero_row, allowed, (dsh, dsl, dse), dbias_out
            )
            dq_row = (dq_h, dq_c, dq_r, dq_p)
            check = _row_dq(
                (b, h, i),
                lo,
                n,
                (kind, r, zero_row),
                allowed,
                (sh, sl, se),
                (we, dse),
                (k[b, g], k_col[b, g]),
                dq_row,
                fopts,
                dq,
                check,
            )
        if not math.isfinite(check):
            bad[b, h, blk] = True


@njit(**_JIT)
def _store_dkdv(b, g, j0, nb, sums, col_sums, opts, fopts, dk, dv):
    """Pass B's dk (scaled by the scale) and dv (scaled by the keep scale with dropout) of
    the keys j0 .. j0 + nb - 1 of plane (b, g) from their Dot2 sums, error sums, largest
    errors and term counts ``sums`` = (dk's, dv's) and the group's column sums of q and dO
    ``col_sums`` (:func:`input_norms`)."""
    dk_h, dk_c, dk_r, dk_p, dk_emax, dk_terms = sums[0]
    dv_h, dv_c, dv_r, dv_p, dv_emax, dv_terms = sums[1]
    q_sum, do_sum = col_sums
    dim, vdim = dk_h.shape[1], dv_h.shape[1]
    dropout = opts[VO_DROPOUT]
    s_hi, s_lo, s_err = fopts[VF_SCALE_HI], fopts[VF_SCALE_LO], fopts[VF_SCALE_ERR]
    kf_h, kf_l, kf_e = fopts[VF_KEEP_HI], fopts[VF_KEEP_LO], fopts[VF_KEEP_ERR]
    for x in range(nb):
        j = j0 + x
        for d in range(dim if dk_terms[x] else 0):
            xh, xl = two_sum(dk_h[x, d], dk_c[x, d])
            err = (
                (min(dk_emax[x] * q_sum[d], dk_p[x, d] * BOUND_SAFETY) + _U * dk_r[x, d])
                * BOUND_SAFETY
                * BOUND_SAFETY
            )
            if q_sum[d] == 0.0:  # q's column d is zero in every row of the group
                continue
            store_scaled(dk, (b, g, j, d), xh, xl, err, s_hi, s_lo, s_err)
        for e in range(vdim if dv_terms[x] else 0):
            xh, xl = two_sum(dv_h[x, e], dv_c[x, e])
            err = (
                (min(dv_emax[x] * do_sum[e], dv_p[x, e] * BOUND_SAFETY) + _U * dv_r[x, e])
                * BOUND_SAFETY
                * BOUND_SAFETY
            )
            if do_sum[e] == 0.0:  # dO's column e is zero in every row of the group
                continue
            if dropout:
                store_scaled(dv, (b, g, j, e), xh, xl, err, kf_h, kf_l, kf_e)
            else:
                dv[0, b, g, j, e], dv[1, b, g, j, e] = xh, xl
                dv[2, b, g, j, e] = err * BOUND_SAFETY + UNDERFLOW_TERM


@njit(parallel=True, **_JIT)
def dkdv_pass(tensors, lse_grad, rule, terms, group, norms, stats, dk, dv):
    """Pass B, parallel over (batch, kv head, block of KEY_BLOCK keys): dk and dv of the
    block's keys, summed over the group's query heads and their rows in increasing order.
    Each row's weights, dS and dT at these keys are recomputed from the inputs and pass A's
    row statistics by the same floating-point operations as in pass A (every one elementwise
    in the key), so they and their error bounds are bit-identical to pass A's. The argument
    records are those of :func:`dq_pass`; ``group`` (K, G) the query heads of each kv head."""
    q, _, kt, vt, do = tensors
    has_glse, glse = lse_grad
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    opts, fopts = terms[1], terms[2]
    k_l1, v_l1, q_sum, do_sum = norms[0], norms[1], norms[3], norms[4]
    istat, fstat = stats
    batch, kv_heads, dim, keys = kt.shape
    length, vdim = q.shape[2], vt.shape[2]
    has_softcap = opts[VO_HAS_SOFTCAP]
    blocks = (keys + KEY_BLOCK - 1) // KEY_BLOCK
    for item in prange(batch * kv_heads * blocks):
        b = item // (kv_heads * blocks)
        g = (item // blocks) % kv_heads
        blk = item % blocks
        j0 = blk * KEY_BLOCK
        nb = min(keys, j0 + KEY_BLOCK) - j0
        row = np.empty((12, nb))
        sh, sl, se, fh, fl, fe, dh, dl, de, wh, wl, we = (
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            row[6],
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
        )
        allowed, kept = np.empty(nb, np.bool_), np.empty(nb, np.bool_)
        dk_h, dk_c, dk_r = np.zeros((nb, dim)), np.zeros((nb, dim)), np.zeros((nb, dim))
        dv_h, dv_c, dv_r = np.zeros((nb, vdim)), np.zeros((nb, vdim)), np.zeros((nb, vdim))
        dk_emax, dv_emax = np.zeros(nb), np.zeros(nb)
        # the propagated errors sum_i err(dT_ij) |q_id| (and the like for dv) term by term: a
        # sum of nonnegative products, within (1 + u)**(n + 1) <= BOUND_SAFETY of its float64
        # value; the smaller of it and the max-error form (emax * column sum) bounds the error
        dk_p, dv_p = np.zeros((nb, dim)), np.zeros((nb, vdim))
        dk_terms, dv_terms = np.zeros(nb, np.int64), np.zeros(nb, np.int64)
        for member in range(group.shape[1]):
            h = group[g, member]
            for i in range(length):
                kind, r, zero_row = istat[b, h, i, 0], istat[b, h, i, 1], istat[b, h, i, 2]
                # nothing reaches dk, dv (a sink-only row: the sink's key and value are 0)
                if kind == 0 or (zero_row and kind == 1) or (kind == 2 and r == SINK_REF):
                    continue
                a = max(j0, rows_lo[b, i])
                c = min(j0 + nb, rows_hi[b, i])
                if a >= c:
                    continue
                n = c - a
                allowed_row(rule, b, h, i, a, c, allowed, kept)
                st = fstat[b, h, i]
                g_i = glse[b, h, i] if has_glse else 0.0
                scratch = (
                    (sh[:n], sl[:n], se[:n]),
                    (fh[:n], fl[:n], fe[:n]),
                    (dh[:n], dl[:n], de[:n]),
                    (wh[:n], wl[:n], we[:n]),
                )
                row_inputs = (q[b, h, i], kt[b, g], vt[b, g], do[b, h, i], k_l1[b, g], v_l1[b, g])
                block_ds(
                    (b, h, i),
                    a,
                    (kind, r, st),
                    (has_glse, g_i),
                    row_inputs,
                    (allowed[:n], kept[:n]),
                    rule,
                    terms,
                    scratch,
                )
                for t in range(n):
                    if not allowed[t]:
                        continue
                    j = a + t
                    x = j - j0
                    w_h, w_l, w_e = 0.0, 0.0, 0.0
                    if kind == 2:  # the single allowed key: weight exactly 1, dT = g (f)
                        if kept[t]:
                            accumulate(1.0, 0.0, do[b, h, i], dv_h[x], dv_c[x], dv_r[x])
                            dv_terms[x] += 1
                        if zero_row:
                            continue
                        th, tl, te = single_dt(g_i, has_softcap, fh[t], fl[t], fe[t])
                    else:
                        w_h, w_l, w_e = wh[t], wl[t], we[t]
                        th, tl, te = dh[t], dl[t], de[t]
                        if has_softcap:
                            th, tl, te = dt_of(th, tl, te, fh[t], fl[t], fe[t])
                    accumulate(th, tl, q[b, h, i], dk_h[x], dk_c[x], dk_r[x])
                    for d in range(dim):
                        dk_p[x, d] += te * abs(q[b, h, i, d])
                    dk_terms[x] += 1
                    dk_emax[x] = max(dk_emax[x], te)
                    if kept[t] and kind == 1:
                        accumulate(w_h, w_l, do[b, h, i], dv_h[x], dv_c[x], dv_r[x])
                        for e in range(vdim):
                            dv_p[x, e] += w_e * abs(do[b, h, i, e])
                        dv_terms[x] += 1
                        dv_emax[x] = max(dv_emax[x], w_e)
        sums = (
            (dk_h, dk_c, dk_r, dk_p, dk_emax, dk_terms),
            (dv_h, dv_c, dv_r, dv_p, dv_emax, dv_terms),
        )
        _store_dkdv(b, g, j0, nb, sums, (q_sum[b, g], do_sum[b, g]), opts, fopts, dk, dv)


@njit(parallel=True, **_JIT)
def dbias_pass(tensors, lse_grad, rule, terms, kv_head, norms, stats, slots, sums):
    """Pass C (a broadcast bias), parallel over blocks of KEY_BLOCK keys: the dS enclosure of
    every position (b, h, i, j) of the block's keys, recomputed from pass A's row statistics
    as pass B does (:func:`block_ds`; bit-identical to pass A's dS and to the enclosure pass A
    writes: zeros outside a row's allowed keys, ``g`` at a single-key row's key, an error
    term for the allowed keys of kind-1 rows that are not zero rows), summed into its dbias
    slot ``slot_b[b] + h slot_st[0] + i slot_st[1] + j slot_st[2]`` as :func:`reduce_slots` does
    (``out`` (3, N) with its ``mag``, ``count`` (N,); :func:`finish_slots` completes it). A slot's
    positions share its key j (dbias's key axis has size S), so each block owns its slots,
    and they are visited in the C order of (b, h, i): the sums are those of
    ``vjp.reduce_enclosure`` on the (3, B, H, L, S) enclosure, bit for bit. The argument
    records are those of :func:`dq_pass`; ``slots`` = (slot_b, slot_st), ``sums`` = (out,
    mag, count)."""
    q, _, kt, vt, do = tensors
    has_glse, glse = lse_grad
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    k_l1, v_l1 = norms[0], norms[1]
    istat, fstat = stats
    slot_b, slot_st = slots
    out, mag, count = sums
    batch, heads, length = q.shape[0], q.shape[1], q.shape[2]
    keys = kt.shape[3]
    blocks = (keys + KEY_BLOCK - 1) // KEY_BLOCK
    for blk in prange(blocks):
        j0 = blk * KEY_BLOCK
        nb = min(keys, j0 + KEY_BLOCK) - j0
        row = np.empty((15, nb))
        sh, sl, se, fh, fl, fe, dh, dl, de, wh, wl, we, vh, vl, ve = (
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            row[6],
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
            row[12],
            row[13],
            row[14],
        )
        allowed, kept = np.empty(nb, np.bool_), np.empty(nb, np.bool_)
        for b in range(batch):
            for h in range(heads):
                g = kv_head[h]
                for i in range(length):
                    vh[:] = 0.0
                    vl[:] = 0.0
                    ve[:] = 0.0
                    kind, r, zero_row = istat[b, h, i, 0], istat[b, h, i, 1], istat[b, h, i, 2]
                    g_i = glse[b, h, i] if has_glse else 0.0
                    if kind == 2:  # the single allowed key: dS = g exactly
                        if j0 <= r < j0 + nb:
                            vh[r - j0] = g_i
                    elif kind == 1:
                        a = max(j0, rows_lo[b, i])
                        c = min(j0 + nb, rows_hi[b, i])
                        if a < c:
                            n = c - a
                            allowed_row(rule, b, h, i, a, c, allowed, kept)
                            scratch = (
                                (sh[:n], sl[:n], se[:n]),
                                (fh[:n], fl[:n], fe[:n]),
                                (dh[:n], dl[:n], de[:n]),
                                (wh[:n], wl[:n], we[:n]),
                            )
                            row_inputs = (
                                q[b, h, i],
                                kt[b, g],
                                vt[b, g],
                                do[b, h, i],
                                k_l1[b, g],
                                v_l1[b, g],
                            )
                            block_ds(
                                (b, h, i),
                                a,
                                (kind, r, fstat[b, h, i]),
                                (has_glse, g_i),
                                row_inputs,
                                (allowed[:n], kept[:n]),
                                rule,
                                terms,
                                scratch,
                            )
                            for t in range(n):
                                if not allowed[t]:
                                    continue
                                x = a + t - j0
                                vh[x], vl[x] = dh[t], dl[t]
                                if not zero_row:
                                    ve[x] = de[t] * BOUND_SAFETY + UNDERFLOW_TERM
                    base = slot_b[b] + h * slot_st[0] + i * slot_st[1] + j0 * slot_st[2]
                    for x in range(nb):
                        t = base + x * slot_st[2]
                        out[0, t], out[1, t] = dd_add(out[0, t], out[1, t], vh[x], vl[x])
                        out[2, t] += ve[x]
                        mag[t] += abs(vh[x])
                        count[t] += 1.0


@njit(parallel=True, **_JIT)
def input_norms(q, k, vt, do, group, k_l1, v_l1, k_col, q_sum, do_sum):
    """Per (batch, kv head): the row sums |k_j|, |v_j| (k_l1, v_l1 (B, K, S)), the column sums
    of |k| (k_col (B, K, D)) and of |q|, |dO| over the group's rows (q_sum, do_sum), each in
    a fixed order, times BOUND_SAFETY for the first three."""
    batch, kv_heads, keys, dim = k.shape
    length, vdim = q.shape[2], vt.shape[2]
    for unit in prange(batch * kv_heads):
        b, g = unit // kv_heads, unit % kv_heads
        for j in range(keys):
            for d in range(dim):
                k_l1[b, g, j] += abs(k[b, g, j, d])
                k_col[b, g, d] += abs(k[b, g, j, d])
        for e in range(vdim):
            for j in range(keys):
                v_l1[b, g, j] += abs(vt[b, g, e, j])
        for j in range(keys):
            k_l1[b, g, j] *= BOUND_SAFETY
            v_l1[b, g, j] *= BOUND_SAFETY
        for d in range(dim):
            k_col[b, g, d] *= BOUND_SAFETY
        for member in range(group.shape[1]):
            h = group[g, member]
            for i in range(length):
                for d in range(dim):
                    q_sum[b, g, d] += abs(q[b, h, i, d])
                for e in range(vdim):
                    do_sum[b, g, e] += abs(do[b, h, i, e])


@njit(**_JIT)
def decide_all(enc, p, emin, max_finite, out, decided):
    """(value, decided) of every enclosure of ``enc`` (3, ...) by :func:`round_decision`."""
    flat_h, flat_l, flat_e = enc[0].ravel(), enc[1].ravel(), enc[2].ravel()
    for n in range(flat_h.shape[0]):
        out[n], decided[n] = round_decision(flat_h[n], flat_l[n], flat_e[n], p, emin, max_finite)


@njit(**_JIT)
def reduce_slots(enc, index, out):
    """Sum the enclosure ``enc`` (3, ...) into the slots ``index`` (flat; -1: left out) of
    ``out`` (3, N) in the C order of its positions, then :func:`finish_slots`."""
    size = out.shape[1]
    mag = np.zeros(size)
    count = np.zeros(size)
    flat_h, flat_l, flat_e = enc[0].ravel(), enc[1].ravel(), enc[2].ravel()
    for n in range(flat_h.shape[0]):
        t = index[n]
        if t < 0:
            continue
        out[0, t], out[1, t] = dd_add(out[0, t], out[1, t], flat_h[n], flat_l[n])
        out[2, t] += flat_e[n]
        mag[t] += abs(flat_h[n])
        count[t] += 1.0
    finish_slots(out, mag, count)


@njit(**_JIT)
def finish_slots(out, mag, count):
    """The error bound of summed slots: the terms' errors plus ``DD_REL`` of the magnitudes
    per addition (``count`` additions into the slot)."""
    for t in range(out.shape[1]):
        out[2, t] = (out[2, t] + count[t] * DD_REL * mag[t] * _SAFE) * BOUND_SAFETY
