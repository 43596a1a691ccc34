"""The chunked (WY / UT-transform) form of the linear-attention recurrence, with named deviations.

Chunked kernels (flash-linear-attention's ``chunk_*``, transformers' ``torch_chunk_gated_delta_
rule``) compute docs/conventions.md's recurrence a chunk of C steps at a time. Within a chunk,
with ``G_i`` the cumulative sum of the (vector) log gates up to step i, the new values
``U_i = beta_i (v_i - S_{i-1}'^T k_i)`` solve the unit lower-triangular system

.. math::

    (I + \\mathrm{diag}(\\beta) A)\\, U = \\mathrm{diag}(\\beta)\\,(V - (e^{G} \\odot K) S_0),
    \\qquad A_{ij} = \\textstyle\\sum_d k_{id} k_{jd} e^{G_{id} - G_{jd}} \\ (j < i)

(Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks", the WY representation of their
Sec. 3; Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule", eqs. (6)-(8)
for beta's UT transform), then ``o_i = (e^{G_i} q_i)^T S_0 + sum_{j<=i} (q_i . (k_j e^{G_i -
G_j})) U_j`` and the carried state ``S_C = e^{G_C} S_0 + sum_j (k_j e^{G_C - G_j}) U_j^T``.
Without beta, ``U = V``.

:func:`chunked` evaluates it in a compute dtype, optionally storing the normalised q and k,
the solve's inverse, the WY factors and the state at chunk boundaries in a storage dtype (as
flash-linear-attention does in the input dtype), and with *deviations*: the alternative
readings the diagnosis names and the planted kernels of :mod:`oracle.power.linear_planted`
(:data:`DEVIATIONS`).

>>> import numpy as np, refattn
>>> rng = np.random.default_rng(0)
>>> q, k = rng.standard_normal((2, 1, 1, 70, 4)); v = rng.standard_normal((1, 1, 70, 3))
>>> g = -rng.uniform(0, 1, (1, 1, 70)); beta = rng.uniform(0, 1, (1, 1, 70))
>>> arrays = dict(q=q, k=k, v=v, g=g, beta=beta)
>>> o, s = chunked(arrays, {"qk_l2norm": True}, compute="float64")
>>> ref = refattn.linear_attention(q, k, v, g, beta, qk_l2norm=True, output_final_state=True)
>>> bool(np.allclose(o, ref[0], atol=1e-12) and np.allclose(s, ref[1], atol=1e-12))
True
"""

from __future__ import annotations

import math

import numpy as np

from oracle.catalogue import seeding
from oracle.reading.linear_baseline import L2NORM_EPS, segments_of

__all__ = ["chunked", "DEVIATIONS", "CHUNK"]

#: The chunk size of the model (flash-linear-attention's and transformers' default).
CHUNK = 64

#: name -> what the deviation does (an alternative reading of the semantics).
DEVIATIONS = {
    "decay_off_by_one": "the state carried over a chunk boundary is decayed by the chunk's "
    "gates up to its second-to-last step (the last step's decay is dropped)",
    "cumsum_bf16": "the within-chunk cumulative gate sums are accumulated in bfloat16",
    "l2norm_eps_outside": "q and k normalised as x / (||x|| + eps) (eps outside the root)",
    "l2norm_no_eps": "q and k normalised as x / ||x|| (no eps)",
    "solve_bf16": "the triangular solve (I + beta A)^-1 computed in bfloat16 arithmetic",
    "no_reset": "the state is not reset at a cu_seqlens boundary (it carries over)",
    "beta_twice": "beta applied twice (to the keys and again to the new values)",
    "exp_for_exp2": "base-2 gates exponentiated with exp (the ln 2 factor dropped)",
    "state_transposed": "the state read and written as (E, D) instead of (D, E)",
    "final_early": "the final state taken one step early (before the last token's update)",
}


def _to(x, dtype):
    """``x`` rounded to ``dtype`` (None: unchanged), kept as float64 values."""
    if dtype is None:
        return x
    return np.asarray(seeding.to_dtype(np.asarray(x, dtype=np.float64), dtype), dtype=np.float64)


def _normalise(x, deviations):
    norm2 = (x * x).sum(-1, keepdims=True)
    if "l2norm_eps_outside" in deviations:
        return x / (np.sqrt(norm2) + L2NORM_EPS)
    if "l2norm_no_eps" in deviations:
        return x / np.sqrt(norm2)
    return x / np.sqrt(norm2 + L2NORM_EPS)


def _cumsum(g, deviations, compute):
    if "cumsum_bf16" not in deviations:
        return np.cumsum(g, axis=1).astype(compute)
    total = np.zeros_like(g[:, :1])
    parts = []
    for i in range(g.shape[1]):
        total = _to(total + _to(g[:, i : i + 1], "bfloat16"), "bfloat16")
        parts.append(total)
    return np.concatenate(parts, axis=1).astype(compute)


def _inverse(lower, deviations, compute):
    """(I + L)^-1 of a strictly lower-triangular L (H, C, C) by forward substitution."""
    size = lower.shape[-1]
    narrow = "solve_bf16" in deviations
    inv = np.zeros_like(lower)
    for i in range(size):
        row = -np.einsum("hj,hjk->hk", lower[:, i, :i], inv[:, :i, :]) if i else 0.0
        inv[:, i, :] = row
        inv[:, i, i] = 1.0
        if narrow:
            inv[:, i, :] = _to(inv[:, i, :], "bfloat16")
    return inv.astype(compute)


def _chunk(state, q, k, v, g, beta, ctx):
    """One chunk: (outputs (H, C, E), carried state (H, D, E))."""
    compute, store, deviations = ctx["compute"], ctx["store"], ctx["deviations"]
    G = _cumsum(g, deviations, compute)  # (H, C, D)
    diff = G[:, :, None, :] - G[:, None, :, :]  # (H, C_i, C_j, D)
    causal = np.tril(np.ones(diff.shape[1:3], dtype=bool))
    decay = np.exp(np.where(causal[None, :, :, None], diff, -np.inf))
    if beta is None:
        new = v
    else:
        lower = np.einsum("hid,hjd,hijd->hij", k, k, decay) * np.tril(causal, -1)
        inv = _to(_inverse(beta[:, :, None] * lower, deviations, compute), store)
        w = _to(inv @ (beta[:, :, None] * np.exp(G) * k), store)
        u = _to(inv @ (beta[:, :, None] * v), store)
        new = u - w @ state
        if "beta_twice" in deviations:
            new = new * beta[:, :, None]
    scores = np.einsum("hid,hjd,hijd->hij", q, k, decay)
    out = np.einsum("hid,hde->hie", q * np.exp(G), state) + scores @ new
    last = G[:, -1]
    carried_decay = (
        (G[:, -2] if G.shape[1] > 1 else np.zeros_like(last))
        if "decay_off_by_one" in deviations
        else last
    )
    carried = np.exp(carried_decay)[:, :, None] * state
    carried = carried + np.einsum("hjd,hje->hde", k * np.exp(last[:, None, :] - G), new)
    return out, _to(carried, store)


def _sequence(state, q, k, v, g, beta, ctx):
    """Outputs (H, T, E) and final state of one sequence, chunk by chunk."""
    length = q.shape[1]
    outs = []
    for a in range(0, length, ctx["chunk"]):
        b = min(a + ctx["chunk"], length)
        part = (x if x is None else x[:, a:b] for x in (q, k, v, g, beta))
        out, state = _chunk(state, *part, ctx)
        outs.append(out)
    out = np.concatenate(outs, axis=1) if outs else np.zeros(v.shape)
    return out, state


def _prepared(arrays, options, deviations, compute, store):
    heads = np.shape(arrays["v"])[1]
    group = heads // np.shape(arrays["q"])[1]

    def cast(name):
        x = arrays.get(name)
        return None if x is None else np.asarray(x, dtype=np.float64).astype(compute)

    q, k = (np.repeat(cast(n), group, axis=1) for n in ("q", "k"))
    if options.get("qk_l2norm"):
        q, k = _to(_normalise(q, deviations), store), _to(_normalise(k, deviations), store)
    scale = options.get("scale")
    q = q * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    g = cast("g")
    if g is not None:
        if str(options.get("gate_base", "e")) == "2" and "exp_for_exp2" not in deviations:
            g = g * math.log(2.0)
        if g.ndim == 3:
            g = np.broadcast_to(g[..., None], g.shape + (q.shape[-1],))
    else:
        g = np.zeros(q.shape, dtype=compute)
    return q, k, cast("v"), g, cast("beta"), cast("initial_state")


def chunked(arrays, options, *, compute="float64", store=None, deviations=(), chunk=CHUNK):
    """(o (B, HV, T, E), final states (N, HV, D, E)) of the chunked form in ``compute``
    (values stored in ``store`` where a chunked kernel stores them; None: not rounded), with
    the named ``deviations`` (:data:`DEVIATIONS`). Outputs are float64 arrays."""
    deviations = set(deviations)
    unknown = deviations - set(DEVIATIONS)
    if unknown:
        raise ValueError(f"chunked: unknown deviations {sorted(unknown)}")
    compute = np.dtype(compute)
    q, k, v, g, beta, h0 = _prepared(arrays, options, deviations, compute, store)
    ctx = dict(compute=compute, store=store, deviations=deviations, chunk=chunk)
    heads, dim, edim = v.shape[1], q.shape[-1], v.shape[-1]
    out = np.zeros(v.shape)
    segments = segments_of(arrays)
    final = np.zeros((len(segments), heads, dim, edim))
    carry = None
    for n, (b, start, stop) in enumerate(segments):
        state = np.zeros((heads, dim, edim)) if h0 is None else h0[n]
        if "no_reset" in deviations and carry is not None:
            state = carry
        if "state_transposed" in deviations:
            state = np.swapaxes(state, -1, -2)
        part = [x if x is None else x[b, :, start:stop] for x in (q, k, v, g, beta)]
        out[b, :, start:stop], state = _sequence(state.astype(compute), *part, ctx)
        if "final_early" in deviations and stop > start:
            early = [x if x is None else x[:, :-1] for x in part]
            before = h0[n] if h0 is not None else np.zeros((heads, dim, edim))
            _, state = _sequence(before.astype(compute), *early, ctx)
        carry = state
        final[n] = np.swapaxes(state, -1, -2) if "state_transposed" in deviations else state
    return out, final
