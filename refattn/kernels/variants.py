"""Deterministic Numba CPU kernels for the hot loops of the probabilistic variants.

Two kernels, selected with ``backend="numba"`` on the float64 path of

* :func:`refattn.gmm.attention` -- the EM iteration of Movellan & Gabbur (seed 000), eqs.
  (13)-(14) (uniform or array prior) and (17)-(18) (``prior="magnitude"``): per query row the
  query logits ``a_u`` once, then ``iters`` times the value logits, a log-space softmax over
  the units and the value update

  .. math::

      a_u = \\log p(u) - \\tfrac{\\alpha_u}{2}\\|q - \\xi_u\\|^2 + \\tfrac{D}{2}\\log\\alpha_u,
      \\qquad
      v_{t+1} = \\sum_u \\operatorname{softmax}_u\\big(a_u - \\tfrac{\\beta_u}{2}
          \\|v_t - \\mu_u\\|^2 + \\ldots\\big)\\,\\mu_u \\quad (13)\\text{-}(14);

* :func:`refattn.mgk.attention` -- Transformer-MGK (seed 001, displays (N6)-(N7), hard form
  (N9)): per query row and key the max-shifted ``lse`` over the R components, then the masked
  log-space softmax over the keys and the weighted values

  .. math::

      s_{ij} = \\operatorname{lse}_r\\Big(\\log\\pi_{jr}
          - \\frac{\\|q_i - k_{jr}\\|^2}{2\\sigma^2_{jr}}\\Big), \\qquad
      h_i = \\sum_{j \\in A_i} e^{s_{ij} - \\operatorname{lse}_{j' \\in A_i} s_{ij'}}\\, v_j .

Scores and logits are formed by exactly the operations of the NumPy float64 path, term for
term in the same order (the per-unit constants even by the same NumPy expressions, in the
wrappers); only the order of the *sums* differs (sequential here, pairwise/BLAS in NumPy). The
softmax and the weighted sum use the streaming form

.. math::

    \\sum_j w_j v_j = \\frac{\\sum_j e^{s_j - m} v_j}{1 + \\sum_{j \\ne j^*} e^{s_j - m}},
    \\qquad m = s_{j^*} = \\max_j s_j,

one exponential per key/unit (the NumPy path forms ``exp(s_j - lse)``). Every weight still
carries one rounding of the subtraction and one of the exponential, at most ``u`` absolute
each (``w |s - m| <= 1/e``), and the two sums of n terms ``gamma_n``, so the kernels lie within
the NumPy path's documented bound, :func:`refattn.bounds.mixture_bound` (per EM step for
GMM), of the exact result.

Numerics and determinism
------------------------
* Log-space: every exponential is ``exp(x - top)`` with ``top`` the largest included term;
  the lse over components (MGK) and of the GMM trace is ``top + log1p(sum_{j != top}
  exp(x_j - top))`` (the Blanchard-Higham form of :func:`refattn.logspace.logsumexp`). An
  exponential of an unshifted score is never formed.
* Work units are fixed by the shapes alone: ``prange`` over (batch, block of
  :data:`ROW_BLOCK` query rows) for MGK, over (batch, row) for GMM. Every row is computed by
  one thread from start to end, every reduction in an order fixed by the shapes (squared
  distances and dot products sequential over D or E; sums over components, keys and units in
  increasing index). ``fastmath`` is off, so the compiler may neither re-associate nor
  contract; SIMD lanes run over independent outputs only (key components, units, value
  columns). Results are therefore bit-identical for any thread count and any run.
* Memory: MGK streams over key blocks of :data:`KEY_BLOCK` keys (each block serves all the
  rows of a unit while it is in cache); per row it keeps the scores of its keys (S floats)
  and one block of component distances, so a call needs O(L*E + S*R*D) memory plus
  O(ROW_BLOCK * S) per thread: no (L, S) or (L, S, R) array is formed (the mask, when given,
  is the caller's own (..., L, S) array). GMM keeps the S query logits of
  the row being processed.
* Masked keys (MGK) are never read in any sum: a NaN/Inf in an excluded key or value never
  reaches the output; one in an allowed key, value or in q makes the row NaN (the NumPy
  path's rule).

Conventions pinned here
-----------------------
* A logit equal to -inf (a -inf log prior, or a squared distance that overflows) is an
  excluded unit/key, as on the NumPy path.
* A query row with no included key or unit gives +0.

numba is imported when this module is imported; :mod:`refattn.gmm` and :mod:`refattn.mgk`
import it only when ``backend="numba"`` is requested, so ``import refattn`` stays light.
"""

from __future__ import annotations

import math

import numpy as np

try:
    from numba import njit, prange
except ImportError as error:  # pragma: no cover - numba is a core dependency
    raise ImportError(
        "refattn.kernels.variants needs numba (pip install numba); use backend='numpy' without it"
    ) from error

from .. import _checks
from ..spec import check_window, key_interval_jit, offset_of, window_sides

__all__ = [
    "KEY_BLOCK",
    "ROW_BLOCK",
    "UNIT_BLOCK",
    "mgk_attention",
    "gmm_attention",
    "mgk_flops",
    "gmm_flops",
]

#: Keys per streamed MGK block (the block's R * KEY_BLOCK distances stay in L1).
KEY_BLOCK = 64
#: Query rows per MGK work unit (they share every key and value block).
ROW_BLOCK = 16
#: Units per block of the GMM logits.
UNIT_BLOCK = 256

_OPTS = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)


# --------------------------------------------------------------------------------------------
# Shared log-space pieces
# --------------------------------------------------------------------------------------------


@njit(**_OPTS)
def _top(x, n, skip_posinf):
    """(index, value) of the first largest included entry of x[:n]; index -1 if none.

    -inf is always excluded (a removed unit/key); +inf too when ``skip_posinf``.
    """
    index = -1
    top = -math.inf
    for j in range(n):
        s = x[j]
        if s == -math.inf or (skip_posinf and s == math.inf):
            continue
        if index < 0 or s > top:
            index = j
            top = s
    return index, top


@njit(**_OPTS)
def _lse(x, n, skip_posinf):
    """Max-shifted log1p-form logsumexp of the included entries of x[:n] (-inf if none)."""
    index, top = _top(x, n, skip_posinf)
    if index < 0:
        return -math.inf
    total = 0.0
    for j in range(n):
        s = x[j]
        if j == index or s == -math.inf or (skip_posinf and s == math.inf):
            continue
        total += math.exp(s - top)
    return top + math.log1p(total)


@njit(**_OPTS)
def _softmax_mix(x, n, rows, out):
    """out = sum_j softmax(x)_j rows[j] over the included j < n (x_j > -inf); +0 if none.

    ``w_j = exp(x_j - top) / Z`` with ``Z = 1 + sum_{j != top} exp(x_j - top)`` (the top's
    exponential is exactly 1): one exponential per entry, the weighted rows summed in index
    order, one division per output element at the end.
    """
    E = out.shape[0]
    for e in range(E):
        out[e] = 0.0
    index, top = _top(x, n, False)
    if index < 0:
        return
    total = 0.0
    for j in range(n):
        s = x[j]
        if s == -math.inf:
            continue
        weight = 1.0
        if j != index:
            weight = math.exp(s - top)
            total += weight
        row = rows[j]
        for e in range(E):  # lanes over independent value columns
            out[e] += weight * row[e]
    scale = 1.0 + total
    for e in range(E):
        out[e] = out[e] / scale


# --------------------------------------------------------------------------------------------
# MGK
# --------------------------------------------------------------------------------------------


@njit(inline="always", **_OPTS)  # called per (row, key): a call would cost more than the work
def _mgk_key_score(dist, first, j, b, two_sigma2, log_pi, norm, hard, use_norm, terms):
    """s_ij from the R squared distances dist[first:first+R] of key j (the NumPy term order:
    -dist / (2 sigma2), + log pi (soft), - (D/2) log(2 pi sigma2) (normalized, varying))."""
    R = terms.shape[0]
    for r in range(R):
        c = j * R + r
        t = -dist[first + r] / two_sigma2[b, c]
        if not hard:
            t = t + log_pi[b, c]
        if use_norm:
            t = t - norm[b, c]
        terms[r] = t
    if hard:
        best = terms[0]
        for r in range(1, R):
            if terms[r] > best:
                best = terms[r]
        return best
    # _lse(terms, R, False) written out: this runs once per (row, key)
    index = -1
    top = -math.inf
    for r in range(R):
        if terms[r] != -math.inf and (index < 0 or terms[r] > top):
            index = r
            top = terms[r]
    if index < 0:
        return -math.inf
    total = 0.0
    for r in range(R):
        if r != index and terms[r] != -math.inf:
            total += math.exp(terms[r] - top)
    return top + math.log1p(total)


@njit(**_OPTS)
def _mgk_rows(b, i0, i1, q, v, components, poison, mask, has_mask, rule, form, out):
    """Rows i0 <= i < i1 of batch element b, one key block at a time for all the rows, so a
    block of keys (and then of values) is loaded once per row block, not once per row. Every
    row still does exactly the operations, in exactly the order, of a row on its own.

    ``components`` = (keys_t, two_sigma2, log_pi, norm); ``poison`` = (bad_q, bad_key);
    ``rule`` = (offset, causal, left, right) of :func:`refattn.spec.key_interval`; ``form`` =
    (hard, use_norm)."""
    keys_t, two_sigma2, log_pi, norm = components
    bad_q, bad_key = poison
    offset, causal, left, right = rule
    hard, use_norm = form
    D = q.shape[2]
    S = v.shape[1]
    E = v.shape[2]
    R = keys_t.shape[2] // S
    rows = i1 - i0
    lo = np.empty(rows, dtype=np.int64)
    hi = np.empty(rows, dtype=np.int64)
    live = np.zeros(rows, dtype=np.bool_)
    block_lo, block_hi = S, 0
    for r in range(rows):
        i = i0 + r
        lo[r], hi[r] = key_interval_jit(i, offset, S, causal, left, right)
        poisoned = bad_q[b, i]
        for j in range(lo[r], hi[r]):
            if bad_key[b, j] and (not has_mask or mask[b, i, j]):
                poisoned = True
        orow = out[b, i]
        for e in range(E):
            orow[e] = math.nan if poisoned else 0.0
        if not poisoned and lo[r] < hi[r]:
            live[r] = True
            block_lo = min(block_lo, lo[r])
            block_hi = max(block_hi, hi[r])
    scores = np.empty((rows, S))
    # four rows share every key load (the distance loop is bound by loads and stores)
    dist0, dist1 = np.empty(KEY_BLOCK * R), np.empty(KEY_BLOCK * R)
    dist2, dist3 = np.empty(KEY_BLOCK * R), np.empty(KEY_BLOCK * R)
    terms = np.empty(R)
    for j0 in range(block_lo, block_hi, KEY_BLOCK):
        for g in range(0, rows, 4):
            start, stop = j0 + KEY_BLOCK, j0
            for r in range(g, min(g + 4, rows)):
                if live[r]:
                    start = min(start, max(j0, lo[r]))
                    stop = max(stop, min(j0 + KEY_BLOCK, hi[r]))
            if start >= stop:
                continue
            # rows past the end of the block repeat the last row (computed, never used)
            q0, q1 = q[b, i0 + g], q[b, i0 + min(g + 1, rows - 1)]
            q2, q3 = q[b, i0 + min(g + 2, rows - 1)], q[b, i0 + min(g + 3, rows - 1)]
            c0 = start * R
            count = (stop - start) * R
            for c in range(count):
                dist0[c] = 0.0
                dist1[c] = 0.0
                dist2[c] = 0.0
                dist3[c] = 0.0
            for d in range(D):
                x0, x1, x2, x3 = q0[d], q1[d], q2[d], q3[d]
                # a slice indexed from 0: numba then knows no index is negative and emits no
                # wrap-around select, so LLVM vectorises the lanes (independent components;
                # each dist[c] still sums d = 0, 1, ... in order, whatever the row grouping)
                krow = keys_t[b, d, c0 : c0 + count]
                for c in range(count):
                    k = krow[c]
                    y0, y1, y2, y3 = x0 - k, x1 - k, x2 - k, x3 - k
                    dist0[c] += y0 * y0
                    dist1[c] += y1 * y1
                    dist2[c] += y2 * y2
                    dist3[c] += y3 * y3
            for r in range(g, min(g + 4, rows)):
                if not live[r]:
                    continue
                dist = (dist0, dist1, dist2, dist3)[r - g]
                i = i0 + r
                for j in range(max(j0, lo[r]), min(j0 + KEY_BLOCK, hi[r])):
                    if has_mask and not mask[b, i, j]:
                        scores[r, j] = -math.inf
                        continue
                    scores[r, j] = _mgk_key_score(
                        dist, (j - start) * R, j, b, two_sigma2, log_pi, norm, hard, use_norm, terms
                    )
    # softmax over the keys and the weighted values (_softmax_mix, value blocks shared by the
    # rows): w_j = exp(s_j - top) / (1 + sum_{j != top} exp(s_j - top)), index order
    top_index = np.full(rows, -1, dtype=np.int64)
    top = np.empty(rows)
    total = np.zeros(rows)
    for r in range(rows):
        if live[r]:
            top_index[r], top[r] = _top(scores[r, lo[r] : hi[r]], hi[r] - lo[r], False)
    for j0 in range(block_lo, block_hi, KEY_BLOCK):
        for r in range(rows):
            if top_index[r] < 0:
                continue
            orow = out[b, i0 + r]
            for j in range(max(j0, lo[r]), min(j0 + KEY_BLOCK, hi[r])):
                s = scores[r, j]
                if s == -math.inf:
                    continue
                weight = 1.0
                if j - lo[r] != top_index[r]:
                    weight = math.exp(s - top[r])
                    total[r] += weight
                vrow = v[b, j]
                for e in range(E):  # lanes over independent value columns
                    orow[e] += weight * vrow[e]
    for r in range(rows):
        if top_index[r] >= 0:
            orow = out[b, i0 + r]
            scale = 1.0 + total[r]
            for e in range(E):
                orow[e] = orow[e] / scale


@njit(parallel=True, **_OPTS)
def _mgk_kernel(q, v, components, poison, mask, has_mask, rule, form, out):
    B, L = q.shape[0], q.shape[1]
    blocks = (L + ROW_BLOCK - 1) // ROW_BLOCK
    for n in prange(B * blocks):  # work units fixed by the shapes alone, never by threads
        b = n // blocks
        i0 = (n - b * blocks) * ROW_BLOCK
        i1 = min(i0 + ROW_BLOCK, L)
        _mgk_rows(b, i0, i1, q, v, components, poison, mask, has_mask, rule, form, out)


def _flat(x, tail):
    """float64, C-contiguous, writeable, batch flattened: shape (B,) + tail."""
    return np.array(
        np.reshape(_checks.as_float64(x), (-1,) + tuple(tail)), dtype=np.float64, order="C"
    )


def _clean(x):
    return np.where(np.isfinite(x), x, 0.0)


def mgk_attention(
    q,
    keys,
    v,
    *,
    log_pi,
    sigma2,
    sigma_varies,
    mode="soft",
    normalized=False,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
):
    """The Numba kernel of :func:`refattn.mgk.attention` (float64; same semantics).

    Called by ``refattn.mgk.attention(..., backend="numba")`` after its validation.

    Parameters
    ----------
    q : array (B..., L, D)
    keys : array (B..., S, R, D)
    v : array (B..., S, E)
        Already broadcast to one batch shape B... (any float dtype; taken at exact value).
    log_pi, sigma2 : float64 arrays (B..., S, R)
        Validated log mixture weights and variances.
    sigma_varies : bool
        sigma2 differs between components (the Gaussian constant is then kept).
    mode, normalized, mask, causal, window, align
        As :func:`refattn.mgk.attention`.

    Returns
    -------
    float64 array (B..., L, E)

    Examples
    --------
    >>> import numpy as np
    >>> q = np.zeros((1, 1)); keys = np.array([[[0.0]], [[2.0]]]); v = np.array([[1.0], [0.0]])
    >>> pi = np.zeros((2, 1)); s2 = np.ones((2, 1))
    >>> mgk_attention(q, keys, v, log_pi=pi, sigma2=s2, sigma_varies=False).round(6).tolist()
    [[0.880797]]
    """
    batch = q.shape[:-2]
    L, D = q.shape[-2:]
    S, R = keys.shape[-3:-1]
    E = v.shape[-1]
    q64 = _flat(q, (L, D))
    keys64 = _flat(keys, (S, R, D))
    v64 = _flat(v, (S, E))
    bad_q = ~np.isfinite(q64).all(axis=-1)
    bad_key = ~np.isfinite(keys64).all(axis=(-1, -2)) | ~np.isfinite(v64).all(axis=-1)
    # (B, D, S*R): component c = j R + r contiguous, so the distance lanes load contiguously
    keys_t = np.ascontiguousarray(np.swapaxes(_clean(keys64).reshape(-1, S * R, D), -1, -2))
    sigma2 = np.broadcast_to(sigma2, batch + (S, R))
    two_sigma2 = _flat(2 * sigma2, (S * R,))
    log_pi = _flat(np.broadcast_to(log_pi, batch + (S, R)), (S * R,))
    use_norm = bool(normalized and sigma_varies)
    norm = _flat(D / 2 * np.log(2 * math.pi * sigma2), (S * R,)) if use_norm else np.zeros((1, 1))
    offset = offset_of(align, L, S)
    left, right = window_sides(check_window(window))
    if mask is None:
        mask_arr, has_mask = np.ones((1, 1, 1), dtype=np.bool_), False
    else:
        mask_arr = _checks.broadcast(
            _checks.bool_array(mask, "mask"), batch + (L, S), "mask", "(..., L, S) of q and keys"
        )
        mask_arr, has_mask = np.array(mask_arr.reshape(-1, L, S), order="C"), True
    out = np.zeros((q64.shape[0], L, E))
    _mgk_kernel(
        _clean(q64),
        _clean(v64),
        (keys_t, two_sigma2, log_pi, norm),
        (bad_q, bad_key),
        mask_arr,
        has_mask,
        (offset, bool(causal), left, right),
        (mode == "hard", use_norm),
        out,
    )
    return out.reshape(batch + (L, E))


def mgk_flops(L, S, R, D, E, B=1):
    """Arithmetic count of one MGK forward: 3 flops per (i, j, r, d) for the squared distance,
    2 per (i, j, e) for the weighted values (exponentials and logs not counted)."""
    return float(B) * L * S * (3 * R * D + 2 * E)


# --------------------------------------------------------------------------------------------
# GMM
# --------------------------------------------------------------------------------------------


@njit(**_OPTS)
def _gmm_query_logits(b, qrow, keys_t, query_terms, acc, a):
    """a_u of eqs. (14)/(17): coef_a * (||q - xi||^2 or q . xi) [+ add1] [- alpha/2 ||q||^2]
    [+ (D/2) log alpha], the NumPy path's order; ``query_terms`` = (coef_a, add1, half_alpha,
    add2, magnitude, has_add1, sub_qq, has_add2)."""
    coef_a, add1, half_alpha, add2, magnitude, has_add1, sub_qq, has_add2 = query_terms
    D = qrow.shape[0]
    S = a.shape[0]
    qq = 0.0
    if sub_qq:
        for d in range(D):
            qq += qrow[d] * qrow[d]
    for u0 in range(0, S, UNIT_BLOCK):
        count = min(UNIT_BLOCK, S - u0)
        for u in range(count):
            acc[u] = 0.0
        for d in range(D):
            qd = qrow[d]
            krow = keys_t[b, d, u0 : u0 + count]  # slice from 0: vectorisable (see _mgk_row)
            if magnitude:
                for u in range(count):
                    acc[u] += qd * krow[u]
            else:
                for u in range(count):
                    diff = qd - krow[u]
                    acc[u] += diff * diff
        for u in range(count):
            k = u0 + u
            x = coef_a[b, k] * acc[u]
            if has_add1:
                x = x + add1[b, k]
            if sub_qq:
                x = x - half_alpha[b, k] * qq
            if has_add2:
                x = x + add2[b, k]
            a[k] = x


@njit(**_OPTS)
def _gmm_value_logits(b, vrow, values_t, coef_b, add3, has_add3, a, acc, out):
    """out_u = a_u + (-beta_u/2 ||v - mu_u||^2 [+ (E/2) log beta_u]) (eq. (14))."""
    E = vrow.shape[0]
    S = a.shape[0]
    for u0 in range(0, S, UNIT_BLOCK):
        count = min(UNIT_BLOCK, S - u0)
        for u in range(count):
            acc[u] = 0.0
        for e in range(E):
            ve = vrow[e]
            mrow = values_t[b, e, u0 : u0 + count]
            for u in range(count):
                diff = ve - mrow[u]
                acc[u] += diff * diff
        for u in range(count):
            k = u0 + u
            x = coef_b[b, k] * acc[u]
            if has_add3:
                x = x + add3[b, k]
            out[k] = a[k] + x


@njit(**_OPTS)
def _gmm_row(b, i, model, query_terms, value_terms, init, stopping, tracing, results):
    """The EM iterations of query row i of batch element b: ``model`` = (q, keys_t, values,
    values_t); ``query_terms`` as :func:`_gmm_query_logits`; ``value_terms`` = (coef_b, add3,
    add4, has_add3, has_add4); ``init`` = (v_init, has_init); ``stopping`` = (iters, tol,
    has_tol); ``tracing`` = (want_trace, trace_const); ``results`` = (out, trace, done)."""
    q, keys_t, values, values_t = model
    coef_b, add3, add4, has_add3, has_add4 = value_terms
    v_init, has_init = init
    iters, tol, has_tol = stopping
    want_trace, trace_const = tracing
    out, trace, done = results
    S = values.shape[1]
    E = values.shape[2]
    a = np.empty(S)
    logits = np.empty(S)
    acc = np.empty(min(S, UNIT_BLOCK))
    v = np.zeros(E)
    new = np.empty(E)
    _gmm_query_logits(b, q[b, i], keys_t, query_terms, acc, a)
    have_v = has_init
    if has_init:
        for e in range(E):
            v[e] = v_init[b, i, e]
    lse_a = _lse(a, S, True) if want_trace else 0.0
    for t in range(iters):
        if have_v:
            _gmm_value_logits(b, v, values_t, coef_b, add3, has_add3, a, acc, logits)
        else:  # eq. (14) with the value likelihood marginalised out: w_u = p(u | q)
            for u in range(S):
                logits[u] = a[u]
        if has_add4:  # per-unit beta: M-step weights w_u beta_u (eq. (12))
            for u in range(S):
                logits[u] = logits[u] + add4[b, u]
        _softmax_mix(logits, S, values[b], new)
        settled = False
        if has_tol and have_v:
            settled = True
            for e in range(E):
                if not abs(new[e] - v[e]) <= tol:
                    settled = False
        done[b, i] += 1
        if want_trace:  # log p(v | q) = lse(a + b(v)) - lse(a) + const
            _gmm_value_logits(b, new, values_t, coef_b, add3, has_add3, a, acc, logits)
            trace[b, i, t] = _lse(logits, S, True) - lse_a + trace_const[b]
        for e in range(E):
            v[e] = new[e]
        have_v = True
        if settled:
            break
    for e in range(E):
        out[b, i, e] = v[e]


@njit(parallel=True, **_OPTS)
def _gmm_kernel(model, query_terms, value_terms, init, stopping, tracing, results):
    """Every (batch, row) of :func:`_gmm_row` as one work unit (the arguments are its own)."""
    B, L = model[0].shape[0], model[0].shape[1]
    for n in prange(B * L):
        b = n // L
        _gmm_row(b, n - b * L, model, query_terms, value_terms, init, stopping, tracing, results)


def _per_unit(x, batch, S):
    return _flat(np.broadcast_to(x, batch + (S,)), (S,))


def gmm_attention(model, v_init, iters, tol, want_trace):
    """The Numba kernel of :func:`refattn.gmm.attention` (float64; same semantics).

    Called by ``refattn.gmm.attention(..., backend="numba")`` with its validated model (the
    inputs broadcast to one batch shape, the per-unit precisions and the prior).

    Parameters
    ----------
    model : refattn.gmm's validated model
        Fields q (B..., L, D), keys (B..., S, D), values (B..., S, E), alpha, beta (B..., S),
        alpha_varies, beta_varies, kind ("uniform", "magnitude", "array"), log_prior.
    v_init : array (B..., L, E) or None
    iters : int >= 1
    tol : float or None
    want_trace : bool

    Returns
    -------
    (values (B..., L, E), trace (B..., L, iters) or None, iterations (B..., L) int64), as the
    NumPy path's ``_attention64``.
    """
    m = model
    batch = m.q.shape[:-2]
    L, D = m.q.shape[-2:]
    S, E = m.values.shape[-2:]
    q64 = _flat(m.q, (L, D))
    keys64 = _flat(m.keys, (S, D))
    values = _flat(m.values, (S, E))
    keys_t = np.ascontiguousarray(np.swapaxes(keys64, -1, -2))
    values_t = np.ascontiguousarray(np.swapaxes(values, -1, -2))
    alpha, beta = m.alpha, m.beta
    magnitude = m.kind == "magnitude"
    dummy = np.zeros((1, 1))
    # the per-unit constants by the NumPy path's own expressions (refattn.gmm._query_logits64)
    coef_a = _per_unit(alpha if magnitude else -alpha / 2, batch, S)
    add1 = dummy
    if magnitude:
        add1 = _per_unit(beta * np.einsum("...se,...se->...s", m.values, m.values) / 2, batch, S)
    elif m.kind == "array":
        add1 = _per_unit(m.log_prior, batch, S)
    sub_qq = bool(magnitude and m.alpha_varies)
    half_alpha = _per_unit(alpha / 2, batch, S) if sub_qq else dummy
    add2 = _per_unit(D / 2 * np.log(alpha), batch, S) if m.alpha_varies else dummy
    coef_b = _per_unit(-beta / 2, batch, S)
    add3 = add4 = dummy
    if m.beta_varies:
        add3 = _per_unit(E / 2 * np.log(beta), batch, S)
        add4 = _per_unit(np.log(beta), batch, S)
    trace_const = dummy[0]
    if want_trace:
        const = -E / 2 * math.log(2 * math.pi)
        if not m.beta_varies:
            const = const + E / 2 * np.log(beta[..., :1])
        trace_const = _flat(np.broadcast_to(const, batch + (1,)), ())
    has_init = v_init is not None
    init = _flat(v_init, (L, E)) if has_init else np.zeros((1, 1, 1))
    B = q64.shape[0]
    out = np.empty((B, L, E))
    trace = np.full((B, L, iters) if want_trace else (1, 1, 1), np.nan)
    done = np.zeros((B, L), dtype=np.int64)
    _gmm_kernel(
        (q64, keys_t, values, values_t),
        (
            coef_a,
            add1,
            half_alpha,
            add2,
            magnitude,
            m.kind != "uniform",
            sub_qq,
            bool(m.alpha_varies),
        ),
        (coef_b, add3, add4, bool(m.beta_varies), bool(m.beta_varies)),
        (init, has_init),
        (int(iters), 0.0 if tol is None else float(tol), tol is not None),
        (bool(want_trace), trace_const),
        (out, trace, done),
    )
    return (
        out.reshape(batch + (L, E)),
        trace.reshape(batch + (L, iters)) if want_trace else None,
        done.reshape(batch + (L,)),
    )


def gmm_flops(L, S, D, E, iters, B=1, trace=False, v_init=False):
    """Arithmetic count of one GMM forward: 3 flops per (i, u, d) for the query logits; per
    iteration 3 per (i, u, e) for the value logits (not in the first iteration without
    ``v_init``: it uses w_u = p(u | q)), 2 per (i, u, e) for the value update, and 3 more per
    (i, u, e) with ``trace`` (exponentials and logs not counted)."""
    logit_iters = iters if v_init else iters - 1
    per_row_unit = 3 * D + 3 * E * logit_iters + 2 * E * iters + (3 * E * iters if trace else 0)
    return float(B) * L * S * per_row_unit
