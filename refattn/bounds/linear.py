"""A-priori error bounds of the linear-attention recurrence (:func:`refattn.linear_attention`)
computed in floating point (float64 NumPy path, Numba kernels in float64 or float32).

Running error analysis in norms (Higham, *Accuracy and Stability*, 2nd ed., Lemma 3.1 and
eq. (3.4) for the dot products), first order in the unit roundoff ``u`` of the computing dtype.
Per sequence and value head, with ``n = 2 D + 12`` (a dot product of length D, the gate's
``exp`` (within one ulp, 2u), the products and sums of the update, and with ``qk_l2norm`` the
normalisation's ``D + 4`` roundings; the rounding of the inputs to a narrower compute dtype):

* state norm ``N_t``: the computed ``||S_t||_F`` when given (``state_norms``, the "norms actually
  seen"), else the a-priori ``N_t = a_t m_t N_{t-1} + w_t ||k_t|| ||v_t||``;
* the delta rule's map ``S' -> (I - beta k k^T) S'`` has 2-norm
  ``m_t = max(1, |1 - beta_t ||k_t||^2|)``: it can amplify (``beta ||k||^2 > 2``), and the bound
  carries that amplification (``m_t = 1`` for the usual ``beta in [0, 1]``, ``||k|| <= 1``);
* local error of step t: ``l_t = gamma_n (a_t N_{t-1} (m_t + 2 b_t ||k_t||^2) + w_t ||k_t||
  ||v_t|| + N_t)`` (``a_t`` the largest decay ``base**g``, ``b_t = |beta_t|``, ``w_t = b_t`` or 1
  without beta);
* state error ``e_t = a_t m_t e_{t-1} + l_t`` (the exact map propagates the earlier errors);
* output: ``|o_tj - fl(o_tj)| <= |scale| ||q_t|| (e_t + gamma_n N_t)``.

The vjp bound follows the same scheme backwards (the adjoint state ``dS_{t-1} = diag(a_t)
M_t^T (dS_t + scale q_t do_t^T)``, its norms ``P_t`` and errors, then each step's gradient as a
bilinear form of quantities with known errors); it is uniform over each gradient's last axis.
The chunked kernel's forward and vjp have their own bounds (:func:`linear_chunked_forward_bound`,
:func:`linear_chunked_vjp_bound`, at the end of this module).
"""

from __future__ import annotations

import math

import numpy as np

from .. import config
from .unit import gamma, unit_roundoff

__all__ = [
    "linear_forward_bound",
    "linear_chunked_forward_bound",
    "linear_vjp_bound",
    "linear_chunked_vjp_bound",
    "rounding_count",
]


def rounding_count(dim: int) -> int:
    """``n`` of gamma_n for one step of the recurrence with key dimension ``dim``."""
    return 2 * int(dim) + 12


def _norm(x):
    return np.sqrt(np.einsum("...d,...d->...", x, x))


def _per_step(q, k, v, g, beta, scale, qk_l2norm, gate_base):
    """Per (B, HV, T) step: |scale| ||q||, ||k||, ||v||, largest decay, |beta| (or None),
    and the l2norm factors r_q, r_k (1 without normalisation)."""
    group = v.shape[1] // q.shape[1]
    q = np.repeat(np.asarray(q, np.float64), group, axis=1)
    k = np.repeat(np.asarray(k, np.float64), group, axis=1)
    rq = rk = np.ones(v.shape[:3])
    if qk_l2norm:
        rq = 1.0 / np.sqrt(_norm(q) ** 2 + config.LINEAR_L2NORM_EPS)
        rk = 1.0 / np.sqrt(_norm(k) ** 2 + config.LINEAR_L2NORM_EPS)
    steps = {
        "q": abs(scale) * _norm(q) * rq,
        "k": _norm(k) * rk,
        "v": _norm(np.asarray(v, np.float64)),
        "rq": rq,
        "rk": rk,
        "a": np.ones(v.shape[:3]),
        "b": None if beta is None else np.abs(np.asarray(beta, np.float64)),
    }
    if g is not None:
        g = np.asarray(g, np.float64)
        top = g if g.ndim == 3 else g.max(axis=-1)
        steps["a"] = np.exp2(top) if str(gate_base) == "2" else np.exp(top)
    return steps


def _segments(shape, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, shape[2]) for b in range(shape[0])]
    cu = [int(x) for x in cu_seqlens]
    return [(0, a, b) for a, b in zip(cu, cu[1:], strict=False)]


def _amplification(kn, b):
    """(m_t, w_t): the delta-rule map's norm and the weight of the k v^T term, from ||k_t||
    and |beta_t| (None without the delta rule)."""
    if b is None:
        return np.ones_like(kn), np.ones_like(kn)
    return np.maximum(1.0, np.abs(1.0 - b * kn * kn)), b


def _forward_pass(s, n0, norms, span, g_n):
    """Per step (norm bound N_t, error e_t) over one sequence's span, shape (HV, T_n)."""
    b_row, start, stop = span
    heads = s["v"].shape[1]
    big_n, err = np.zeros((heads, stop - start)), np.zeros((heads, stop - start))
    prev_n, prev_e = n0, g_n * n0
    for i, t in enumerate(range(start, stop)):
        a, kn, vn = s["a"][b_row, :, t], s["k"][b_row, :, t], s["v"][b_row, :, t]
        m, w = _amplification(kn, None if s["b"] is None else s["b"][b_row, :, t])
        b = 0.0 if s["b"] is None else s["b"][b_row, :, t]
        apriori = a * m * prev_n + w * kn * vn
        now = apriori if norms is None else np.minimum(apriori, norms[b_row, :, t] + prev_e)
        local = g_n * (a * prev_n * (m + 2 * b * kn * kn) + w * kn * vn + now)
        prev_e = a * m * prev_e + local
        prev_n = now
        big_n[:, i], err[:, i] = now, prev_e
    return big_n, err


def linear_forward_bound(
    q,
    k,
    v,
    g=None,
    beta=None,
    *,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    qk_l2norm=False,
    gate_base="e",
    state_norms=None,
    dtype="float64",
):
    """Bound on ``|fl(o) - o|`` per element of o (B, HV, T, E) and of the final state
    (N, HV, D, E) for the recurrence computed in ``dtype`` (see the module notes).

    ``state_norms`` (B, HV, T): the Frobenius norms of the computed states S_t (the float64
    path's, :func:`refattn.linear.forward_error_bound` passes them); without them the a-priori
    norm recurrence is used (valid, looser on long delta-rule sequences).

    >>> import numpy as np
    >>> q = k = np.ones((1, 1, 2, 1)); v = np.ones((1, 1, 2, 1))
    >>> o_bound, s_bound = linear_forward_bound(q, k, v)
    >>> bool(o_bound.shape == (1, 1, 2, 1) and (o_bound > 0).all() and (o_bound < 1e-13).all())
    True
    """
    v = np.asarray(v)
    dim = np.shape(q)[-1]
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    s = _per_step(q, k, v, g, beta, scale, qk_l2norm, gate_base)
    g_n = gamma(rounding_count(dim), dtype)
    segments = _segments(v.shape, cu_seqlens)
    h0 = None if initial_state is None else np.asarray(initial_state, np.float64)
    out = np.zeros(v.shape[:3])
    final = np.zeros((len(segments), v.shape[1]))
    for n, span in enumerate(segments):
        n0 = np.zeros(v.shape[1]) if h0 is None else _norm(h0[n].reshape(v.shape[1], -1))
        big_n, err = _forward_pass(s, n0, state_norms, span, g_n)
        b_row, start, stop = span
        out[b_row, :, start:stop] = s["q"][b_row, :, start:stop] * (err + g_n * big_n)
        final[n] = err[:, -1] if stop > start else g_n * n0
    o_shape = v.shape
    s_shape = (len(segments), v.shape[1], dim, v.shape[-1])
    return (
        np.broadcast_to(out[..., None], o_shape).copy(),
        np.broadcast_to(final[..., None, None], s_shape).copy(),
    )


def _adjoint_pass(s, span, norms_err, do_n, dht_n, g_n, log_base):
    """Per step error bounds of the step's gradients (dq_n, dk_n, dv, dbeta, dg) and of dh0;
    ``norms_err = (N_t, e_t, errors of the states before each step or None: e_{t-1})``."""
    b_row, start, stop = span
    big_n, err, err_before = norms_err
    heads = s["v"].shape[1]
    names = ("q", "k", "v", "beta", "g")
    out = {name: np.zeros((heads, stop - start)) for name in names}
    p_norm, lam = dht_n, g_n * dht_n
    for i in range(stop - start - 1, -1, -1):
        t = start + i
        a, kn, vn, qn = (s[x][b_row, :, t] for x in ("a", "k", "v", "q"))
        m, _ = _amplification(kn, None if s["b"] is None else s["b"][b_row, :, t])
        b = np.zeros(heads) if s["b"] is None else s["b"][b_row, :, t]
        n_prev = big_n[:, i - 1] if i else s["n0"]
        e_prev = (
            err_before[:, i] if err_before is not None else err[:, i - 1] if i else g_n * s["n0"]
        )
        dn = do_n[b_row, :, t]
        p_norm = p_norm + qn * dn
        lam = lam + g_n * (qn * dn + p_norm)
        u_norm = vn + a * n_prev * kn
        u_err = a * e_prev * kn + g_n * u_norm
        out["q"][:, i] = (err[:, i] + g_n * big_n[:, i]) * dn
        if s["b"] is None:
            out["k"][:, i] = lam * vn + g_n * p_norm * vn
            out["v"][:, i] = lam * kn + g_n * p_norm * kn
        else:
            du_err = b * (lam * kn + g_n * p_norm * kn)
            out["v"][:, i] = du_err
            out["beta"][:, i] = kn * (lam * u_norm + p_norm * u_err + g_n * p_norm * u_norm)
            out["k"][:, i] = b * (lam * u_norm + p_norm * u_err + g_n * p_norm * u_norm) + a * (
                e_prev * b * p_norm * kn + n_prev * du_err + g_n * n_prev * b * p_norm * kn
            )
        p_dec = m * p_norm + 2 * b * kn * kn * p_norm
        lam_dec = m * lam + g_n * p_dec
        out["g"][:, i] = a * log_base * (lam_dec * n_prev + p_dec * e_prev + g_n * p_dec * n_prev)
        p_norm, lam = a * m * p_norm, a * m * lam + g_n * a * p_dec
    return out, lam


def _options(q, scale, initial_state, cu_seqlens, qk_l2norm, gate_base, state_norms) -> dict:
    """The public bounds' keyword options as the passes read them, the scale resolved (default
    1/sqrt(D))."""
    dim = np.shape(q)[-1]
    return dict(
        scale=1.0 / math.sqrt(dim) if scale is None else float(scale),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        qk_l2norm=qk_l2norm,
        gate_base=gate_base,
        state_norms=state_norms,
    )


def linear_vjp_bound(
    q,
    k,
    v,
    g,
    beta,
    do,
    dht=None,
    *,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    qk_l2norm=False,
    gate_base="e",
    state_norms=None,
    dtype="float64",
):
    """Bounds on the float error of :func:`refattn.linear_attention_vjp`'s gradients, per
    element: a dict with dq, dk (B, H, T, D), dv (B, HV, T, E), dg, dbeta (their arguments'
    shapes, None when absent) and dh0 (N, HV, D, E). First order; see the module notes.

    >>> import numpy as np
    >>> q = k = np.ones((1, 1, 2, 1)); v = do = np.ones((1, 1, 2, 1))
    >>> bounds = linear_vjp_bound(q, k, v, None, None, do)
    >>> bool(bounds["dq"].max() < 1e-13), bounds["dg"] is None
    (True, True)
    """
    options = _options(q, scale, initial_state, cu_seqlens, qk_l2norm, gate_base, state_norms)
    return _vjp_bound((q, k, v, g, beta), do, dht, options, dtype)


def _vjp_bound(args, do, dht, options, dtype, extra=None):
    """:func:`linear_vjp_bound`; ``extra = (after, before)`` (B, HV, T): errors added to the
    forward pass's bounds on the states after and before each step (the chunked form's)."""
    q, k, v, g, beta = args
    v = np.asarray(v)
    dim, heads = np.shape(q)[-1], np.shape(q)[1]
    scale = options["scale"]
    s = _per_step(q, k, v, g, beta, scale, options["qk_l2norm"], options["gate_base"])
    g_n = gamma(rounding_count(dim), dtype)
    log_base = math.log(2.0) if str(options["gate_base"]) == "2" else 1.0
    segments = _segments(v.shape, options["cu_seqlens"])
    h0 = options["initial_state"]
    h0 = None if h0 is None else np.asarray(h0, np.float64)
    do_n = _norm(np.asarray(do, np.float64))
    steps = {name: np.zeros(v.shape[:3]) for name in ("q", "k", "v", "beta", "g")}
    dh0 = np.zeros((len(segments), v.shape[1]))
    for n, span in enumerate(segments):
        s["n0"] = np.zeros(v.shape[1]) if h0 is None else _norm(h0[n].reshape(v.shape[1], -1))
        dht_n = (
            np.zeros(v.shape[1])
            if dht is None
            else _norm(np.asarray(dht, np.float64)[n].reshape(v.shape[1], -1))
        )
        big_n, err = _forward_pass(s, s["n0"], options["state_norms"], span, g_n)
        b_row, start, stop = span
        before = None
        if extra is not None:
            shifted = np.concatenate([g_n * s["n0"][:, None], err[:, :-1]], axis=1)
            before = shifted + extra[1][b_row, :, start:stop]
            err = err + extra[0][b_row, :, start:stop]
        per, lam = _adjoint_pass(s, span, (big_n, err, before), do_n, dht_n, g_n, log_base)
        for name in steps:
            steps[name][b_row, :, start:stop] = per[name]
        dh0[n] = lam
    return _shaped(steps, s, dh0, q, v, g, beta, scale, dim, heads)


def _shaped(steps, s, dh0, q, v, g, beta, scale, dim, heads):
    """Per-element bound arrays in the gradients' shapes (the l2norm chain, the GVA sums)."""
    group = v.shape[1] // heads

    def chain(bound, r):
        # d x = r (dxn - xn (xn . dxn)): a projection scaled by r (norm <= r), so the error of
        # dxn costs r times it; its own D + 6 roundings cost gamma_{D+6} 2 r ||dxn||, at most
        # 2 r times the bound again (each step bound holds gamma_n ||dxn|| and D + 6 < n).
        return 3 * r * bound

    dq = abs(scale) * chain(steps["q"], s["rq"])
    dk = chain(steps["k"], s["rk"])
    fold = lambda x: x.reshape(x.shape[0], heads, group, -1).sum(axis=2)  # noqa: E731
    out = {
        "dq": np.broadcast_to(fold(dq)[..., None], np.shape(q)).copy(),
        "dk": np.broadcast_to(fold(dk)[..., None], np.shape(q)).copy(),
        "dv": np.broadcast_to(steps["v"][..., None], v.shape).copy(),
        "dg": None,
        "dbeta": None if beta is None else steps["beta"].copy(),
        "dh0": np.broadcast_to(dh0[..., None, None], dh0.shape + (dim, v.shape[-1])).copy(),
    }
    if g is not None:
        out["dg"] = np.broadcast_to(
            steps["g"] if np.ndim(g) == 3 else steps["g"][..., None], np.shape(g)
        ).copy()
    return out


# --- the chunked (WY / UT-transform) form -------------------------------------------------


def _log_decays(g, shape, gate_base):
    """Natural-log decays (B, HV, T, Dg): Dg = 1 for a scalar gate (zeros without gates)."""
    if g is None:
        return np.zeros(shape[:3] + (1,))
    g = np.asarray(g, np.float64)
    lg = g[..., None] if g.ndim == 3 else g
    return lg * math.log(2.0) if str(gate_base) == "2" else lg


def _chunk_terms(kv, qv, lg, beta):
    """One chunk (rows r = 0 .. L-1 of one sequence and value head), from float64 values of
    the exact quantities: Gamma_r = max_d exp(G_r), sum_r max_d |log a_r|, the largest decay
    ratios ``dmax_rj = max_d exp(G_r - G_j)`` (j <= r), ``|P|_rj = sum_d |qs_r[d] k_j[d]|
    exp(G_r - G_j)[d]`` (j <= r) and with the delta rule ``|A|_rj = |beta_r| sum_d |k_r[d]
    k_j[d]| exp(G_r - G_j)[d]`` (j < r) and ``|(I + A)^{-1}|``."""
    length = len(kv)
    cum = np.cumsum(lg, axis=0)
    lower = np.tril(np.ones((length, length), bool))
    ratio = np.exp(np.where(lower[..., None], cum[:, None, :] - cum[None, :, :], -np.inf))
    full = np.broadcast_to(ratio, ratio.shape[:2] + (kv.shape[1],))  # (r, j, D)
    terms = {
        "gamma": np.exp(cum.max(axis=1)),
        "sum": float(np.abs(lg).max(axis=1).sum()),
        "dmax": ratio.max(axis=2),
        "p": np.einsum("rd,jd,rjd->rj", np.abs(qv), np.abs(kv), full),
    }
    if beta is not None:
        signed = np.tril(beta[:, None] * np.einsum("rd,jd,rjd->rj", kv, kv, full), -1)
        terms["a"] = np.tril(
            np.abs(beta)[:, None] * np.einsum("rd,jd,rjd->rj", *[np.abs(kv)] * 2, full), -1
        )
        terms["t"] = np.abs(np.linalg.inv(np.eye(length) + signed))
    return terms


def _chunk_errors(s, x, n0, e0, dtype, dim):
    """(output error bounds (L,), the state's local error, the chunk map's prefix norms (L,))
    of one chunk given the start state's norm bound ``n0`` (see linear_chunked_forward_bound).

    x = (k rows (L, D), scaled q rows (L, D), natural log decays (L, Dg), beta (L,) or None,
    (b, j, t0))."""
    kv, qv, lg, beta, (b, j, t0) = x
    length = len(kv)
    span = slice(t0, t0 + length)
    u, eta = unit_roundoff(dtype), float(np.finfo(np.dtype(dtype)).smallest_subnormal)
    c = _chunk_terms(kv, qv, lg, beta)
    delta = (2 * gamma(length, dtype) + 4 * u) * c["sum"] + 2 * u + dim * eta
    kn, vn, qn = s["k"][b, j, span], s["v"][b, j, span], s["q"][b, j, span]
    gam = c["gamma"] + eta
    if beta is None:
        w_rows, w_err = vn, np.zeros(length)
    else:
        rho = np.abs(beta) * (vn + gam * kn * n0)  # ||R_r||
        w_rows = c["t"] @ rho
        eps_a, eps_r = gamma(dim + 2, dtype) + delta, gamma(dim + 3, dtype) + delta
        w_err = c["t"] @ ((eps_a + gamma(length, dtype)) * (c["a"] @ w_rows) + eps_r * rho)
    m, _ = _amplification(kn, None if s["b"] is None else s["b"][b, j, span])
    prefix = np.cumprod(s["a"][b, j, span] * m)
    eps_o = gamma(dim + 2, dtype) + delta + gamma(length + 1, dtype)
    out = qn * prefix * e0 + eps_o * (gam * qn * n0 + c["p"] @ w_rows) + c["p"] @ w_err
    spread = c["dmax"][-1] * kn
    local = (gamma(length + 3, dtype) + delta) * (gam[-1] * n0 + spread @ w_rows)
    return out, local + spread @ w_err, prefix


def linear_chunked_forward_bound(
    q,
    k,
    v,
    g=None,
    beta=None,
    *,
    chunk=64,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    qk_l2norm=False,
    gate_base="e",
    state_norms=None,
    dtype="float64",
):
    """Bound on ``|fl(o) - o|`` per element of o (B, HV, T, E) and of the final state
    (N, HV, D, E) for the chunked form (:mod:`refattn.kernels.linear_chunked`, chunks of
    ``chunk`` steps) computed in ``dtype``; first order in its unit roundoff u.

    Per chunk of L steps starting from a state of norm at most N_0 (the norm bounds of
    :func:`linear_forward_bound`'s pass, with the computed ``state_norms`` when given) and error
    e_0, from quantities computed at run time:

    * the decay ratios' relative error ``delta = (2 gamma_L + 4u) sum_r max_d |log a_r| + 2u``
      (the cumulative sums of L log decays, their difference, the base-2 conversion, the
      ``exp``; plus ``D eta`` for underflow): it grows with the chunk's total log decay;
    * ``Gamma_r = max_d exp(G_r)``;
    * delta rule: the triangular system ``(I + A) W = R`` solved by forward substitution
      (Higham, *Accuracy and Stability*, Thm. 8.5: ``(I + A + E) W^ = R``, ``|E| <= gamma_L
      |A|``) with A's own error ``(gamma_{D+2} + delta) |A|`` and R's ``(gamma_{D+3} + delta)
      rho``, componentwise over the rows (Skeel's condition of the solve, ``|(I + A)^{-1}|``
      computed in float64 per chunk): ``||W_r|| <= (|T| rho)_r``, ``||W^_r - W_r|| <= (|T|
      ((gamma_{D+2} + delta + gamma_L) |A| ||W|| + (gamma_{D+3} + delta) rho))_r``, with
      ``T = (I + A)^{-1}``, ``rho_r = |beta_r| (||v_r|| + Gamma_r ||k_r|| N_0)`` and ``|A|_rj =
      |beta_r| sum_d |k_r[d] k_j[d]| exp(G_r - G_j)[d]``. Without beta, ``W = V`` exactly;
    * outputs ``|o_r err| <= ||qs_r|| P_r e_0 + eps_o (Gamma_r ||qs_r|| N_0 + (|P| ||W||)_r)
      + (|P| ||W^ - W||)_r``, ``eps_o = gamma_{D+2} + delta + gamma_{L+1}``, ``|P|_rj = sum_d
      |qs_r[d] k_j[d]| exp(G_r - G_j)[d]``, with ``P_r = prod_{t <= r} a_t m_t`` the exact
      chunk map's norm bound (module notes);
    * the chunk's state: ``e_L = P_L e_0 + (gamma_{L+3} + delta) (Gamma_L N_0 + sum_j
      dmax_j ||k_j|| ||W_j||) + sum_j dmax_j ||k_j|| ||W^_j - W_j||``, ``dmax_j = max_d
      exp(G_{L-1} - G_j)[d]``.

    The rounding of the inputs to ``dtype`` (and the l2norm's) is covered by adding
    :func:`linear_forward_bound` (same ``dtype``), whose per-step perturbations include it.

    >>> import numpy as np
    >>> q = k = v = np.ones((1, 1, 3, 2)); beta = np.full((1, 1, 3), 0.5)
    >>> o_bound, s_bound = linear_chunked_forward_bound(q, k, v, None, beta, chunk=2)
    >>> bool(o_bound.shape == (1, 1, 3, 2) and 0 < o_bound.max() < 1e-13)
    True
    """
    options = _options(q, scale, initial_state, cu_seqlens, qk_l2norm, gate_base, state_norms)
    o_rec, s_rec = linear_forward_bound(q, k, v, g, beta, dtype=dtype, **options)
    out, final, _ = _chunked_pass((q, k, v, g, beta), options, chunk, dtype)
    return o_rec + out[..., None], s_rec + final[..., None, None]


def _chunked_pass(args, options, chunk, dtype):
    """The chunked form's own errors (beyond :func:`linear_forward_bound`'s): per step the
    outputs' (B, HV, T), per sequence the final state's (N, HV), and per step the chunk-start
    state's error carried by the exact map to the states after and before the step (the
    pair (B, HV, T) ``(P_r e_0, P_{r-1} e_0)`` of each chunk, ``P_{-1} = 1``)."""
    q, k, v, g, beta = args
    v = np.asarray(v)
    dim, group = np.shape(q)[-1], v.shape[1] // np.shape(q)[1]
    scale, qk_l2norm = options["scale"], options["qk_l2norm"]
    state_norms, initial_state = options["state_norms"], options["initial_state"]
    cu_seqlens, gate_base = options["cu_seqlens"], options["gate_base"]
    s = _per_step(q, k, v, g, beta, scale, qk_l2norm, gate_base)
    kv = np.repeat(np.asarray(k, np.float64), group, axis=1) * s["rk"][..., None]
    qv = np.repeat(np.asarray(q, np.float64), group, axis=1) * (abs(scale) * s["rq"][..., None])
    lg = _log_decays(g, v.shape, gate_base)
    betas = None if beta is None else np.asarray(beta, np.float64)
    h0 = None if initial_state is None else np.asarray(initial_state, np.float64)
    out, final = np.zeros(v.shape[:3]), np.zeros((len(_segments(v.shape, cu_seqlens)), v.shape[1]))
    after, before = np.zeros(v.shape[:3]), np.zeros(v.shape[:3])
    for n, (b, start, stop) in enumerate(_segments(v.shape, cu_seqlens)):
        n0 = np.zeros(v.shape[1]) if h0 is None else _norm(h0[n].reshape(v.shape[1], -1))
        big_n, _ = _forward_pass(s, n0, state_norms, (b, start, stop), gamma(rounding_count(dim)))
        for j in range(v.shape[1]):
            err = unit_roundoff(dtype) * n0[j]
            for c0 in range(start, stop, int(chunk)):
                c1 = min(c0 + int(chunk), stop)
                start_norm = n0[j] if c0 == start else big_n[j, c0 - start - 1]
                x = (
                    kv[b, j, c0:c1],
                    qv[b, j, c0:c1],
                    lg[b, j, c0:c1],
                    None if betas is None else betas[b, j, c0:c1],
                )
                o_err, local, prefix = _chunk_errors(
                    s, (*x, (b, j, c0)), start_norm, err, dtype, dim
                )
                out[b, j, c0:c1] = o_err
                after[b, j, c0:c1] = prefix * err
                before[b, j, c0:c1] = np.concatenate([[1.0], prefix[:-1]]) * err
                err = prefix[-1] * err + local
            final[n, j] = err
    return out, final, (after, before)


def linear_chunked_vjp_bound(
    q,
    k,
    v,
    g,
    beta,
    do,
    dht=None,
    *,
    chunk=64,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    qk_l2norm=False,
    gate_base="e",
    state_norms=None,
    dtype="float64",
):
    """Bounds on the float error of the chunked kernel's vjp
    (:func:`refattn.kernels.linear_chunked.chunked_backward`, chunks of ``chunk`` steps) per
    element, the dict of :func:`linear_vjp_bound`.

    The kernel takes the states at the chunk boundaries from the chunked form, then reverses
    each chunk's steps with the recurrent vjp's operations, from states recomputed step by
    step from the chunk's boundary state. Its rounding is the recurrent vjp's except for the
    boundary states, whose error is the chunked form's (:func:`linear_chunked_forward_bound`:
    ``e_rec + e_chunk`` at the chunk start). A state recomputed r steps into the chunk then errs
    by at most ``e_rec,r + P_r e_chunk`` (the recurrence's own local errors are part of
    ``e_rec,r``, the exact map carries the start error with norm ``P_r = prod a_t m_t``), so
    this is :func:`linear_vjp_bound` with those forward errors for the states after and before
    each step; the adjoint state does not depend on the forward states, so dh0's bound is the
    recurrent one.

    >>> import numpy as np
    >>> q = k = v = do = np.ones((1, 1, 5, 2)); beta = np.full((1, 1, 5), 0.5)
    >>> plain = linear_vjp_bound(q, k, v, None, beta, do)
    >>> bounds = linear_chunked_vjp_bound(q, k, v, None, beta, do, chunk=2)
    >>> bool((bounds["dk"] >= plain["dk"]).all() and bounds["dk"].max() < 1e-12)
    True
    """
    options = _options(q, scale, initial_state, cu_seqlens, qk_l2norm, gate_base, state_norms)
    extra = _chunked_pass((q, k, v, g, beta), options, chunk, dtype)[2]
    return _vjp_bound((q, k, v, g, beta), do, dht, options, dtype, extra)
