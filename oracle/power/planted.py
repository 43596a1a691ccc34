"""Tiled attention kernels in NumPy: a correct blocked online-softmax reference, its
FlashAttention-style variant, a split-KV variant, and deliberately broken twins.

Real attention kernels tile queries and keys (blocks of 64 or 128), stream the keys with an
online softmax (a running max ``m``, a running normaliser ``l`` and an output accumulator
``O`` rescaled by ``exp(m_old - m_new)`` whenever the max moves; Milakov & Gimelshein 2018,
Dao et al. 2022, Algorithm 1), split long rows over several workers and combine the partial
results by their log-sum-exp (split-KV decode), and accumulate in float32 or narrower. Their
bugs sit where this module puts them (``bug=``):

=====================  ======================================================================
``tile_off_by_one``    the key loop of every full tile stops one key short (``j < end - 1``)
``partial_tile``       the last, partial key tile is skipped (``S // block_k`` tiles) when
                       there is a full one
``partial_query_tile`` the last, partial query tile is never written (its rows stay 0)
                       when there is a full one
``no_late_rescale``    ``O`` is not rescaled when the running max moves (``l`` is)
``skip_rescale=n``     the same, only for the key tiles starting past ``n`` keys
``split_combine``      split-KV partial outputs combined with weights ``l_s`` (each relative
                       to its own split's max) instead of ``exp(lse_s - lse)``
``accumulate=float16`` ``O`` and ``l`` (and each tile's ``P @ V``) summed in float16 / bfloat16
``lse_log2``           lse returned in log2 units (``m log2(e) + log2(l)``, an exp2 kernel)
``causal_offset``      the bottom-right causal offset clamped at 0 (wrong when L > S)
``causal_top_left``    bottom-right causal aligned top-left (the cache offset forgotten)
``positions16``        query/key positions in int16 (wrapping past 32767) for the causal and
                       window tests and ALiBi's distances
``scale_ignored``      the ``scale`` keyword ignored (``1 / sqrt(D)`` always)
``softcap_order``      the scale applied after the softcap (``c tanh(q.k / c) * scale``)
``narrow=(t, n, w)``   the P@V accumulator (w = "pv") or the denominator (w = "l") rounded
                       to ``t`` after every tile past ``n`` keys
=====================  ======================================================================

The correct kernels (``bug=None``): :func:`tiled` (float32 scores, probabilities and sums),
:func:`flash` (the probabilities rounded to the input's 16-bit type before ``P @ V``, float32
sums: FlashAttention's tensor-core path for float16/bfloat16 inputs) and :func:`split_kv`
(keys split in chunks of 256, partial results combined correctly). Each follows
:func:`oracle.run.validate`'s calling convention ``impl(q, k, v, **options)`` and returns
``(out, lse)`` with ``return_lse=True``. Scores, probabilities and sums are float32 for the
half types (float64 for float64 inputs); every option of refattn.attention is supported but
sinks, per-row key lengths and float8 descales (NotImplementedError: the oracle reports those
cases as unsupported).
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from oracle.judging.tolerance import accumulation_dtype, allowed_positions
from oracle.reading.heads import alibi_bias, resolve_scale
from refattn.broadcast import expand_kv
from refattn.exact.rounding import format_of
from refattn.spec import OPTIONS

__all__ = ["tiled_attention", "tiled", "flash", "split_kv", "TILED_BROKEN", "POWER_BROKEN", "BUGS"]

BUGS = (
    "tile_off_by_one",
    "partial_tile",
    "partial_query_tile",
    "no_late_rescale",
    "split_combine",
    "lse_log2",
    "causal_offset",
)


#: the keywords the tiled kernels implement: the ``core`` options of refattn.spec.OPTIONS (plain
#: scaled dot-product attention); any other option (sinks, kv_lengths, float8 descales, sparse
#: indices, qv, block scales, another normaliser, ...) is refused, so a new refattn option that
#: is not ``core`` makes their cases "unsupported" without touching this module
_SUPPORTED = frozenset(row.name for row in OPTIONS if row.core)


def _prepare(q, k, v, options, acc, bug):
    """Heads expanded, the allowed set and the additive terms (bias, ALiBi) in ``acc``."""
    H, L, D = q.shape[-3:]
    S = k.shape[-2]
    gqa = options.get("gqa") or "interleave"
    k_h, v_h = expand_kv(k, H, gqa), expand_kv(v, H, gqa)
    align = options.get("align") or "top_left"
    if bug == "causal_offset" and align == "bottom_right" and L > S:
        align = "top_left"  # offset max(S - L, 0): bottom_right turns into top_left
    if bug == "causal_top_left":
        align = "top_left"  # the cache offset S - L forgotten
    bias = options.get("bias")
    structural = bug != "positions16"
    allowed = allowed_positions(
        L,
        S,
        mask=options.get("mask"),
        bias=bias,
        causal=bool(options.get("causal")) and structural,
        window=options.get("window") if structural else None,
        align=align,
    )
    additive = np.zeros((1, 1), dtype=acc)
    if bias is not None:
        additive = np.where(np.asarray(bias) == -np.inf, 0, np.asarray(bias, np.float64))
    if bug == "positions16":
        allowed, alibi = _positions16(L, S, options, align, allowed)
        additive = additive + alibi
    elif options.get("alibi_slopes") is not None:
        additive = additive + alibi_bias(
            options["alibi_slopes"], L, S, options.get("align") or "top_left"
        )
    shape = np.broadcast_shapes(q.shape[:-1] + (S,), np.shape(allowed), np.shape(additive))
    allowed = np.broadcast_to(allowed, shape)
    additive = np.broadcast_to(np.asarray(additive, dtype=np.float64).astype(acc), shape)
    return k_h, v_h, allowed, additive


def _positions16(L, S, options, align, allowed):
    """Query and key positions held in int16 (wrapping past 32767): the causal/window test
    and ALiBi's distance use the wrapped positions."""
    offset = S - L if align == "bottom_right" else 0
    wrap = lambda x: ((x + 32768) % 65536) - 32768  # noqa: E731
    rel = wrap(np.arange(S))[None, :] - wrap(np.arange(L) + offset)[:, None]
    ok = np.ones((L, S), dtype=bool)
    if options.get("causal"):
        ok &= rel <= 0
    if options.get("window") is not None:
        left, right = options["window"]
        ok &= (rel >= -left if left >= 0 else True) & (rel <= right if right >= 0 else True)
    alibi = np.zeros((1, 1))
    if options.get("alibi_slopes") is not None:
        slopes = np.asarray(options["alibi_slopes"], dtype=np.float64)
        alibi = -slopes[..., None, None] * np.abs(rel).astype(np.float64)
    return allowed & ok, alibi


def _tile_scores(q_t, k_t, add_t, scale, softcap, acc, bug=None):
    with np.errstate(all="ignore"):
        s = np.matmul(
            q_t.astype(acc), np.swapaxes(np.where(np.isfinite(k_t), k_t, 0), -1, -2).astype(acc)
        )
        if softcap is not None and bug == "softcap_order":
            c = acc.type(softcap)
            return c * np.tanh(s / c) * acc.type(scale) + add_t  # scale after the cap
        s = s * acc.type(scale)
        if softcap is not None:
            c = acc.type(softcap)
            s = c * np.tanh(s / c)
        return s + add_t


def _rounded(x, dtype):
    return x if dtype is None else x.astype(dtype).astype(x.dtype)


def _stream(q_t, k_h, v_h, allowed, additive, keys, ctx):
    """Online softmax over ``keys`` (a range) for one query tile: (m, l, O) in acc."""
    acc, bk, bug = ctx["acc"], ctx["block_k"], ctx["bug"]
    shape = q_t.shape[:-1]
    m = np.full(shape, -np.inf, dtype=acc)
    l = np.zeros(shape, dtype=acc)  # noqa: E741 - the normaliser's name in the literature
    O = np.zeros(shape + (v_h.shape[-1],), dtype=acc)
    half = ctx["accumulate"]
    start, stop = keys.start, keys.stop
    if bug == "partial_tile" and stop - start > bk:
        stop = start + (stop - start) // bk * bk  # the remainder loop is missing
    for j0 in range(start, stop, bk):
        j1 = min(j0 + bk, stop)
        if bug == "tile_off_by_one" and j1 - j0 == bk:
            j1 -= 1  # the unmasked path of full tiles stops one key short
        if j1 <= j0:
            continue
        ok = allowed[..., j0:j1]
        s = _tile_scores(
            q_t, k_h[..., j0:j1, :], additive[..., j0:j1], ctx["scale"], ctx["softcap"], acc, bug
        )
        s = np.where(ok, s, -np.inf)
        m_new = np.maximum(m, s.max(axis=-1))
        base = np.where(np.isfinite(m_new), m_new, 0)
        with np.errstate(all="ignore"):
            alpha = np.where(np.isfinite(m), np.exp(m - base), 0).astype(acc)
            p = np.where(ok, np.exp(s - base[..., None]), 0).astype(acc)
        l = alpha * l + p.sum(axis=-1, dtype=acc)  # noqa: E741
        p_mm = _rounded(p, ctx["p_dtype"])
        if ctx["keep"] is not None:
            p_mm = np.where(ctx["keep"][..., j0:j1], p_mm, 0) * ctx["rescale"]
        v_t = v_h[..., j0:j1, :]
        with np.errstate(all="ignore"):
            used = (p_mm != 0)[..., None] & ~np.isfinite(v_t[..., None, :, :])
            clean = np.where(np.isfinite(v_t), v_t, 0).astype(acc)
            if half is None:
                pv = np.matmul(p_mm, clean)
            else:  # key by key in the narrow type
                terms = (p_mm[..., :, :, None] * clean[..., None, :, :]).astype(half)
                pv = np.add.accumulate(terms, axis=-2, dtype=half)[..., -1, :].astype(acc)
            pv = np.where(used.any(axis=-2), np.nan, pv)
        skip = bug == "no_late_rescale" or j0 >= ctx["skip_rescale"]
        kept = O if skip else alpha[..., None] * O
        O = kept + pv
        if half is not None:
            O, l = _rounded(O, half), _rounded(l, half)  # noqa: E741
        narrow, depth, which = ctx["narrow"]
        if narrow is not None and j1 > depth:  # a narrow accumulator past ``depth`` keys
            if which == "pv":
                O = _rounded(O, narrow)
            else:
                l = _rounded(l, narrow)  # noqa: E741
        m = m_new
    return m, l, O


def _finish(m, l, O, ctx):
    with np.errstate(all="ignore"):
        out = O / l[..., None]
        lse = (
            (m + np.log(l))
            if ctx["bug"] != "lse_log2"
            else (m * ctx["acc"].type(1 / math.log(2)) + np.log2(l))
        )
    empty = ~(l > 0)
    fill = 0.0 if ctx["empty_rows"] == "zero" else np.nan
    out = np.where(empty[..., None], fill, out)
    lse = np.where(empty, -np.inf if ctx["empty_rows"] == "zero" else np.nan, lse)
    return out, lse


def _combine(parts, ctx):
    """Split-KV combine of (m_s, l_s, O_s) partial results."""
    ms = np.stack([p[0] for p in parts])
    ls = np.stack([p[1] for p in parts])
    Os = np.stack([p[2] for p in parts])
    with np.errstate(all="ignore"):
        local = Os / ls[..., None]  # each split's normalised output
        local = np.where((ls > 0)[..., None], local, 0)
        lse_s = np.where(ls > 0, ms + np.log(ls), -np.inf)
        top = lse_s.max(axis=0)
        top = np.where(np.isfinite(top), top, 0)
        w = np.exp(lse_s - top) if ctx["bug"] != "split_combine" else ls
        total = w.sum(axis=0)
        O = (w[..., None] * local).sum(axis=0)
        if ctx["bug"] == "split_combine":
            return ms.max(axis=0), total, O
        return top, total, O


def tiled_attention(
    q,
    k,
    v,
    *,
    block_q=64,
    block_k=64,
    bug=None,
    p_dtype=None,
    accumulate=None,
    split=None,
    return_lse=False,
    narrow=(None, 0, "pv"),
    skip_rescale=None,
    **options,
):
    """Blocked online-softmax attention (see the module docstring for ``bug``).

    ``p_dtype``: the type the probabilities are rounded to before ``P @ V`` ("input": the
    input's dtype when it is a 16-bit type); ``accumulate``: a narrower type for the ``O``
    and ``l`` accumulators (a bug); ``split``: keys per split-KV chunk (None: no split).
    """
    missing = sorted(n for n, x in options.items() if n not in _SUPPORTED and x is not None)
    if missing:
        raise NotImplementedError(f"tiled_attention: {', '.join(missing)} not supported")
    q, k, v = (np.asarray(x) for x in (q, k, v))
    single = q.ndim == 2
    if single:
        q, k, v = q[None], k[None], v[None]
    store = format_of(q.dtype).dtype
    acc = accumulation_dtype(q.dtype)
    if p_dtype == "input":
        p_dtype = store if format_of(q.dtype).p < 24 else None
    keep = options.get("dropout_mask")
    ctx = dict(
        acc=acc,
        block_k=block_k,
        bug=bug,
        softcap=options.get("softcap"),
        scale=resolve_scale(None if bug == "scale_ignored" else options.get("scale"), q.shape[-1]),
        p_dtype=None if p_dtype is None else np.dtype(p_dtype),
        accumulate=None if accumulate is None else format_of(accumulate).dtype,
        empty_rows=options.get("empty_rows") or "zero",
        keep=None,
        narrow=(None if narrow[0] is None else format_of(narrow[0]).dtype, *narrow[1:]),
        rescale=acc.type(1) / (acc.type(1) - acc.type(options.get("dropout_p") or 0.0)),
        skip_rescale=math.inf if skip_rescale is None else skip_rescale,
    )
    k_h, v_h, allowed, additive = _prepare(q, k, v, options, acc, bug)
    L, S = q.shape[-2], k.shape[-2]
    full = np.broadcast_shapes(q.shape[:-1] + (S,), allowed.shape)
    allowed = np.broadcast_to(allowed, full)
    additive = np.broadcast_to(additive, full)
    keep = None if keep is None else np.broadcast_to(np.asarray(keep, dtype=bool), full)
    q_b = np.broadcast_to(q, full[:-1] + (q.shape[-1],))
    k_h = np.broadcast_to(k_h, full[:-2] + k_h.shape[-2:])
    v_h = np.broadcast_to(v_h, full[:-2] + v_h.shape[-2:])
    out = np.zeros(full[:-1] + (v.shape[-1],), dtype=acc)
    lse = np.zeros(full[:-1], dtype=acc)
    rows = L if bug != "partial_query_tile" or L <= block_q else L // block_q * block_q
    for i0 in range(0, rows, block_q):
        i1 = min(i0 + block_q, rows)
        tile = dict(ctx, keep=None if keep is None else keep[..., i0:i1, :])
        args = (q_b[..., i0:i1, :], k_h, v_h, allowed[..., i0:i1, :], additive[..., i0:i1, :])
        chunks = (
            [range(0, S)]
            if split is None
            else [range(j, min(j + split, S)) for j in range(0, S, split)]
        )
        parts = [_stream(*args, keys, tile) for keys in chunks]
        m, l, O = parts[0] if split is None else _combine(parts, tile)  # noqa: E741
        out[..., i0:i1, :], lse[..., i0:i1] = _finish(m, l, O, tile)
    if rows < L:
        lse[..., rows:] = -np.inf
    out, lse = out.astype(store), lse.astype(store)
    if single:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


tiled = partial(tiled_attention)
tiled.__name__ = "tiled"
flash = partial(tiled_attention, p_dtype="input")
flash.__name__ = "flash"
split_kv = partial(tiled_attention, p_dtype="input", split=256)
split_kv.__name__ = "split_kv"


def _broken(**kw):
    fn = partial(tiled_attention, p_dtype="input", **kw)
    fn.__name__ = "tiled_" + "_".join(f"{v}" for v in kw.values())
    return fn


#: name -> (implementation, the dtypes it affects, the diagnosis it must receive).
TILED_BROKEN = {
    "tile_off_by_one": (_broken(bug="tile_off_by_one"), "tile"),
    "partial_tile": (_broken(bug="partial_tile"), "partial key tile"),
    "partial_query_tile": (_broken(bug="partial_query_tile"), "partial query tile"),
    "no_late_rescale": (_broken(bug="no_late_rescale"), "rescale"),
    "split_combine": (_broken(bug="split_combine", split=256), "split-KV combine"),
    "accumulate_float16": (_broken(accumulate="float16"), "float16"),
    "accumulate_bfloat16": (_broken(accumulate="bfloat16"), "bfloat16"),
    "lse_log2": (_broken(bug="lse_log2"), "log2"),
    "causal_offset": (_broken(bug="causal_offset"), "align='top_left'"),
}

#: Further planted bugs of long rows and options (``refattn-oracle power``): name ->
#: (implementation, what it does wrong).
POWER_BROKEN = {
    "causal_top_left": (_broken(bug="causal_top_left"), "bottom_right causal as top_left"),
    "positions16": (_broken(bug="positions16"), "int16 positions (wrap past 32767)"),
    "scale_ignored": (_broken(bug="scale_ignored"), "the scale keyword ignored (1/sqrt(D))"),
    "softcap_order": (_broken(bug="softcap_order"), "scale applied after the softcap"),
    **{
        f"split_combine_{n}": (
            _broken(bug="split_combine", split=n),
            f"split-KV chunks of {n} combined without their maxima",
        )
        for n in (1024, 4096)
    },
    **{
        f"no_rescale_after_{depth // 1024}k": (
            _broken(skip_rescale=depth),
            f"the accumulator not rescaled when the max moves past {depth} keys",
        )
        for depth in (1024, 4096, 8192, 32768)
    },
    **{
        f"narrow_{which}_after_{depth // 1024}k": (
            _broken(narrow=("float16", depth, which)),
            f"{'P@V' if which == 'pv' else 'denominator'} accumulated in float16 past {depth} keys",
        )
        for which in ("pv", "l")
        for depth in (1024, 4096, 8192, 32768)
    },
}
