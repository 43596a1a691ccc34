"""Loop twin of refattn.attention: plain Python loops over mpmath numbers.

At a caller-chosen decimal precision, following docs/conventions.md literally. Nothing here
imports refattn. Slow by design: use on small shapes only.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np

from .rounding import HEAD_PREC, exact_plus_small, round_stable

__all__ = ["naive_attention", "naive_attention_rounded", "naive_attention_vjp", "score_spread"]


def _exact(x) -> mpmath.mpf:
    """An input element at its exact value (mpf inputs pass through, for finite differences)."""
    return x if isinstance(x, mpmath.mpf) else mpmath.mpf(float(x))


def naive_attention(
    q,
    k,
    v,
    *,
    scale=None,
    bias=None,
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    softcap=None,
    alibi_slopes=None,
    gqa="interleave",
    dropout_mask=None,
    dropout_p=0.0,
    empty_rows="zero",
    sinks=None,
    kv_length=None,
    dps=60,
    qv=None,
):
    """Single-batch attention by loops: q (H, L, D), k (K, S, D), v (K, S, E).

    ``qv`` (H, L, E): FlashAttention 3's latent term, ``s (q_i . k_j + qv_i . v_j)``, with the
    default scale ``1/sqrt(D + E)`` (docs/conventions.md, "Latent attention").

    Returns (out, lse, weights) as nested lists of mpf at ``dps`` decimal digits.
    bias, mask, dropout_mask must already have shape (H, L, S) (or be None). ``sinks`` (H,):
    a logit per head added to the normaliser; ``kv_length``: keys j >= it are excluded and
    "bottom_right" aligns to it.
    """
    q, k, v = (np.asarray(a) for a in (q, k, v))
    heads, length, dim = q.shape
    kv_heads, keys, vdim = v.shape
    group = heads // kv_heads
    with mpmath.workdps(dps):
        width = dim if qv is None else dim + vdim
        sc = 1 / mpmath.sqrt(width) if scale is None else _exact(scale)
        own = keys if kv_length is None else int(kv_length)
        offset = 0 if align == "top_left" else own - length
        out, lse, weights = [], [], []
        for h in range(heads):
            g = h // group if gqa == "interleave" else h % kv_heads
            out_h, lse_h, w_h = [], [], []
            for i in range(length):
                scores = {}
                for j in range(own):
                    if mask is not None and not mask[h][i][j]:
                        continue
                    if causal and j > i + offset:
                        continue
                    if window is not None:
                        left, right = window
                        if left is not None and j < i + offset - left:
                            continue
                        if right is not None and j > i + offset + right:
                            continue
                    if bias is not None and bias[h][i][j] == -math.inf:
                        continue
                    dot = mpmath.fsum(_exact(q[h, i, d]) * _exact(k[g, j, d]) for d in range(dim))
                    if qv is not None:
                        dot += mpmath.fsum(
                            _exact(qv[h][i][e]) * _exact(v[g, j, e]) for e in range(vdim)
                        )
                    s = sc * dot
                    if softcap is not None:
                        c = _exact(softcap)
                        s = c * mpmath.tanh(s / c)
                    if bias is not None:
                        s += _exact(bias[h][i][j])
                    if alibi_slopes is not None:
                        s -= _exact(alibi_slopes[h]) * abs(i + offset - j)
                    scores[j] = s
                sink = None if sinks is None else _exact(sinks[h])
                if not scores and sink is not None:
                    out_h.append([mpmath.mpf(0)] * vdim)
                    lse_h.append(sink)
                    w_h.append([mpmath.mpf(0)] * keys)
                    continue
                if not scores:
                    fill = mpmath.mpf(0) if empty_rows == "zero" else mpmath.nan
                    out_h.append([fill] * vdim)
                    lse_h.append(-mpmath.inf if empty_rows == "zero" else mpmath.nan)
                    w_h.append([fill] * keys)
                    continue
                logits = list(scores.values()) + ([] if sink is None else [sink])
                top = max(logits)
                leaders = [j for j in scores if scores[j] == top]
                sink_leads = sink is not None and sink == top  # a leader of value 0
                n_lead = len(leaders) + sink_leads
                rest = mpmath.fsum(mpmath.exp(s - top) for s in logits if s != top)
                # lse = top + log(n) + log1p(rest / n): the exact top plus a tail that may be
                # as small as exp(-1e9)
                row_lse = exact_plus_small(top, mpmath.log(n_lead) + mpmath.log1p(rest / n_lead))
                # w_j = 1 / sum_k e^{s_k - s_j}: exactly 1/n for n equal scores (exp(0) == 1),
                # so outputs that are exact rounding ties stay exact in the reference
                row_w = [
                    1 / mpmath.fsum(mpmath.exp(s - scores[j]) for s in logits)
                    if j in scores
                    else mpmath.mpf(0)
                    for j in range(keys)
                ]
                keep_scale = 1 / (1 - _exact(dropout_p))
                row_out = []
                for e in range(vdim):
                    kept = [
                        row_w[j] * keep_scale * _exact(v[g, j, e])
                        if dropout_mask is None or dropout_mask[h][i][j]
                        else mpmath.mpf(0)
                        for j in scores
                    ]
                    if not all(mpmath.isfinite(x) for x in kept):
                        row_out.append(mpmath.fsum(kept))
                        continue
                    # out = mean over the leaders + sum_j w_j (v'_j - mean): a head computed
                    # at HEAD_PREC bits and a small tail (exp(-1e9) off a midpoint, say)
                    with mpmath.workprec(HEAD_PREC):
                        values = {
                            j: (1 / (1 - _exact(dropout_p))) * _exact(v[g, j, e])
                            if dropout_mask is None or dropout_mask[h][i][j]
                            else mpmath.mpf(0)
                            for j in scores
                        }
                        head = mpmath.fsum(values[j] for j in leaders) / n_lead
                    tail = mpmath.fsum(
                        row_w[j] * (values[j] - head) for j in scores if scores[j] != top
                    )
                    if sink is not None and not sink_leads:  # the sink's value is 0
                        tail -= head / mpmath.fsum(mpmath.exp(s - sink) for s in logits)
                    row_out.append(exact_plus_small(head, tail))
                out_h.append(row_out)
                lse_h.append(row_lse)
                w_h.append(row_w)
            out.append(out_h)
            lse.append(lse_h)
            weights.append(w_h)
        return out, lse, weights


def score_spread(
    q, k, *, scale=None, bias=None, alibi_slopes=None, sinks=None, qv=None, v=None, **_
):
    """A bound on max - min of the finite attention scores (for :func:`round_stable`); with
    ``qv`` the latent term reads ``v``."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if qv is not None:  # the bound of the scores over the D + E features
        q = np.concatenate([q, np.asarray(qv, np.float64)], axis=-1)
        k = np.concatenate([k, np.asarray(v, np.float64)], axis=-1)
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else abs(float(scale))
    qn = np.abs(np.where(np.isfinite(q), q, 0)).sum(axis=-1).max(initial=0)
    kn = np.abs(np.where(np.isfinite(k), k, 0)).max(initial=0)
    with np.errstate(over="ignore"):  # beyond the float range: inf, capped by round_stable
        spread = 2 * s * qn * kn
        if bias is not None:
            b = np.asarray(bias, dtype=np.float64)
            spread += 2 * np.abs(np.where(np.isfinite(b), b, 0)).max(initial=0)
        if alibi_slopes is not None:
            spread += 2 * np.abs(alibi_slopes).max() * (q.shape[-2] + k.shape[-2])
        if sinks is not None:
            spread += 2 * np.abs(np.asarray(sinks, dtype=np.float64)).max()
    return float(spread)


def naive_attention_rounded(q, k, v, opts, dtype):
    """(out, lse, weights) of :func:`naive_attention` rounded to ``dtype`` at a precision that
    settles the rounding (:func:`naive.rounding.round_stable`); q (H, L, D), k (K, S, D)."""
    heads, length = q.shape[0], q.shape[1]
    keys = k.shape[1]
    full = dict(opts)
    for name in ("mask", "bias", "dropout_mask"):
        if name in full:
            full[name] = np.broadcast_to(full[name], (heads, length, keys))
    spread = score_spread(q, k, v=v, **full)
    return tuple(
        round_stable(lambda dps, n=n: naive_attention(q, k, v, dps=dps, **full)[n], dtype, spread)
        for n in range(3)
    )


def naive_batch_rounded(q, k, v, opts, dtype, *, sinks=None, kv_lengths=None, per_row=None):
    """:func:`naive_attention_rounded` per batch row, stacked (out, lse): ``kv_lengths[b]``
    becomes the row's ``kv_length``; ``per_row`` (name -> (B, ...) array) gives options that
    differ by batch row (a per-row bias, qv)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        row = dict(opts)
        row.update({name: value[b] for name, value in (per_row or {}).items()})
        if sinks is not None:
            row["sinks"] = sinks
        if kv_lengths is not None:
            row["kv_length"] = int(kv_lengths[b])
        out, lse, _ = naive_attention_rounded(q[b], k[b], v[b], row, dtype)
        outs.append(out)
        lses.append(lse)
    return np.stack(outs), np.stack(lses)


def naive_attention_vjp(q, k, v, grad_out, *, scale=None, dps=60):
    """(dq, dk, dv) of plain single-head attention by loops: q (L, D), k (S, D), v (S, E),
    grad_out (L, E); nested lists of mpf.

    ``dP_ij = dO_i . v_j``, ``dS_ij = P_ij sum_m P_im (dP_ij - dP_im)``,
    ``dq_i = s sum_j dS_ij k_j``, ``dk_j = s sum_i dS_ij q_i``, ``dv_j = sum_i P_ij dO_i``.
    Each weight is split as ``P_ij = A_ij + delta_ij`` with ``A_ij = 1/n_i`` on the ``n_i``
    keys tied at the row maximum (0 elsewhere, exact) and ``delta`` at ``dps`` digits (it
    may be ``exp(-1e9)``); every result is an exact head (from ``A``, at HEAD_PREC bits) plus
    a small tail (:func:`naive.rounding.exact_plus_small`).
    """
    assert scale is None or scale > 0, "naive_attention_vjp: a positive scale"
    q, k, v, grad_out = (np.asarray(a, dtype=np.float64) for a in (q, k, v, grad_out))
    length, dim = q.shape
    keys, vdim = v.shape
    with mpmath.workdps(dps):
        scores = [
            [
                mpmath.fsum(_exact(q[i, d]) * _exact(k[j, d]) for d in range(dim))
                for j in range(keys)
            ]
            for i in range(length)
        ]  # unscaled (exact at dps)
        sc = 1 / mpmath.sqrt(dim) if scale is None else _exact(scale)
        exact, delta = [], []
        for row in scores:
            top = max(row)
            leaders = [j for j in range(keys) if row[j] == top]
            n = len(leaders)
            rest = mpmath.fsum(mpmath.exp(sc * (t - top)) for t in row if t != top)
            exact.append(
                [mpmath.mpf(1) / n if j in leaders else mpmath.mpf(0) for j in range(keys)]
            )
            delta.append(
                [
                    -rest / (n * (n + rest))
                    if j in leaders
                    else mpmath.exp(sc * (row[j] - top)) / (n + rest)
                    for j in range(keys)
                ]
            )
        dp = [
            [
                mpmath.fsum(_exact(grad_out[i, e]) * _exact(v[j, e]) for e in range(vdim))
                for j in range(keys)
            ]
            for i in range(length)
        ]
        head_s, tail_s = [], []
        for i in range(length):
            a, dl = exact[i], delta[i]
            heads, tails = [], []
            for j in range(keys):
                with mpmath.workprec(HEAD_PREC):
                    t_head = mpmath.fsum(a[m] * (dp[i][j] - dp[i][m]) for m in range(keys))
                    heads.append(a[j] * t_head)
                t_tail = mpmath.fsum(dl[m] * (dp[i][j] - dp[i][m]) for m in range(keys))
                tails.append(a[j] * t_tail + dl[j] * t_head + dl[j] * t_tail)
            head_s.append(heads)
            tail_s.append(tails)

        def split_sum(pairs):
            """exact_plus_small of sum(head * f), sum(tail * f) over (head, tail, f)."""
            with mpmath.workprec(HEAD_PREC):
                head = mpmath.fsum(h * f for h, _, f in pairs)
            return head, mpmath.fsum(t * f for _, t, f in pairs)

        def scaled(pair):
            head, tail = pair
            with mpmath.workprec(HEAD_PREC):
                head = head * (1 / mpmath.sqrt(dim) if scale is None else _exact(scale))
            return exact_plus_small(head, sc * tail)

        dq = [
            [
                scaled(
                    split_sum([(head_s[i][j], tail_s[i][j], _exact(k[j, d])) for j in range(keys)])
                )
                for d in range(dim)
            ]
            for i in range(length)
        ]
        dk = [
            [
                scaled(
                    split_sum(
                        [(head_s[i][j], tail_s[i][j], _exact(q[i, d])) for i in range(length)]
                    )
                )
                for d in range(dim)
            ]
            for j in range(keys)
        ]
        dv = [
            [
                exact_plus_small(
                    *split_sum(
                        [(exact[i][j], delta[i][j], _exact(grad_out[i, e])) for i in range(length)]
                    )
                )
                for e in range(vdim)
            ]
            for j in range(keys)
        ]
    return dq, dk, dv
