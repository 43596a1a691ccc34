"""The public functions of the linear-attention family: signature, docstring, dispatch."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _checks
from ..bounds.linear import (
    linear_chunked_forward_bound,
    linear_chunked_vjp_bound,
    linear_forward_bound,
    linear_vjp_bound,
)
from . import _float64
from ._inputs import BACKENDS, canonicalize, cotangents, fold_heads

__all__ = [
    "linear_attention",
    "linear_attention_vjp",
    "LinearAttentionGrads",
    "forward_error_bound",
    "vjp_error_bound",
]


class LinearAttentionGrads(NamedTuple):
    """Cotangents of :func:`linear_attention`'s inputs, each in its argument's shape:
    dq, dk (B, H, T, D) (summed over the value heads sharing a key head), dv (B, HV, T, E),
    dg (g's shape, None without g), dbeta (B, HV, T, None without beta), dh0 (N, HV, D, E,
    None without initial_state)."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dg: np.ndarray | None
    dbeta: np.ndarray | None
    dh0: np.ndarray | None


def _call(q, k, v, g, beta, options):
    return canonicalize(
        q,
        k,
        v,
        g,
        beta,
        scale=options["scale"],
        initial_state=options["initial_state"],
        cu_seqlens=options["cu_seqlens"],
        qk_l2norm=options["qk_l2norm"],
        gate_base=options["gate_base"],
    )


def _backend(backend, precision):
    _checks.choice(backend, "backend", BACKENDS)
    if backend != "numpy" and precision == "exact":
        raise ValueError(
            f"backend={backend!r}: the exact path has one implementation; "
            "pass backend='numpy' with precision='exact'"
        )


def linear_attention(
    q,
    k,
    v,
    g=None,
    beta=None,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    qk_l2norm=False,
    gate_base="e",
    precision="float64",
    out_dtype=None,
    backend="numpy",
):
    """Linear attention with gates and the delta rule: one recurrence over a state S (D, E).

    Per sequence and value head, for t = 1 .. T (S_0 = ``initial_state`` or 0):

    .. math::

        S'_t = \\mathrm{diag}(b^{g_t})\\, S_{t-1}, \\qquad
        S_t = S'_t + \\beta_t k_t (v_t - S_t'^{\\top} k_t)^{\\top} \\ \\text{(delta rule)}
        \\quad\\text{or}\\quad S_t = S'_t + k_t v_t^{\\top}, \\qquad
        o_t = \\mathrm{scale}\\; S_t^{\\top} q_t

    (b = e or 2). The named forms are argument patterns of this one function:

    ==========================  ===================  ==========
    form                        g                    beta
    ==========================  ===================  ==========
    Gated DeltaNet (GDN)        (B, HV, T) scalar    (B, HV, T)
    Kimi Delta Attention (KDA)  (B, HV, T, D) vector (B, HV, T)
    DeltaNet                    None                 (B, HV, T)
    GLA                         (B, HV, T, D) vector None
    simple GLA, RetNet,         (B, HV, T) scalar    None
    Lightning Attention
    linear attention            None                 None
    ==========================  ===================  ==========

    Sources: the delta rule (Schlag, Irie & Schmidhuber 2021, "Linear Transformers Are Secretly
    Fast Weight Programmers"; parallelised by Yang et al. 2024, "Parallelizing Linear
    Transformers with the Delta Rule over Sequence Length"); the gated delta rule (Yang, Kautz &
    Hatamizadeh 2024, "Gated Delta Networks", the update ``S_t = S_{t-1}(alpha_t (I - beta_t
    k_t k_t^T)) + beta_t v_t k_t^T`` written there with the state as (E, D), the transpose of
    refattn's); GLA (Yang et al. 2023, "Gated Linear Attention Transformers with
    Hardware-Efficient Training", ``S_t = diag(alpha_t) S_{t-1} + k_t v_t^T``); RetNet (Sun et
    al. 2023, "Retentive Network", the recurrent retention with a fixed per-head decay gamma);
    Kimi Delta Attention (Kimi Team 2025, "Kimi Linear", the gated delta rule with a per-key-
    channel decay). The state is stored (D, E) (key rows, value columns) as
    flash-linear-attention and transformers' qwen3_next store it.

    Parameters
    ----------
    q, k : array (B, H, T, D)
        Queries and keys (float16, bfloat16, float32, float64; taken at their exact values).
    v : array (B, HV, T, E)
        Values; HV a multiple of H. Value head j reads key head ``j // (HV // H)``
        (flash-linear-attention's ``i_h = i_hv // (HV // H)``, transformers' qwen3_next
        ``repeat_interleave``); the other order, ``j % H``, is what a ``repeat``/tile
        expansion gives (expand the keys yourself to get it).
    g : array (B, HV, T) or (B, HV, T, D), optional
        Log decay gates, base ``gate_base``; None: no decay (a = 1).
    beta : array (B, HV, T), optional
        Delta-rule step sizes; None: the plain additive update.
    scale : float, optional
        Output scale, default ``1 / sqrt(D)`` (the exact real number on the exact path).
    initial_state : array (N, HV, D, E), optional
        S_0 per sequence (N = B, or ``len(cu_seqlens) - 1``).
    output_final_state : bool
        Also return the states S_T (N, HV, D, E).
    cu_seqlens : 1-D int array, optional
        Packed sequences along T (B must be 1): sequence n is tokens
        ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1``; the state restarts at every boundary.
        Empty sequences are allowed (their final state is their initial state).
    qk_l2norm : bool
        Normalise q and k first: ``x / sqrt(sum x^2 + 1e-6)`` (eps inside the root, as
        flash-linear-attention's ``use_qk_l2norm_in_kernel``). The other placement,
        ``x / (||x|| + eps)``, is not offered; it differs by at most ``eps / ||x||`` relative.
    gate_base : {"e", "2"}
        The decay is ``exp(g)`` or ``2**g`` (kernels that keep gates in log2).
    precision : {"float64", "exact"}
        "float64": the NumPy (or Numba) recurrence, within
        :func:`refattn.linear.forward_error_bound`. "exact": every element of o and of the
        final state is the exact real result rounded once to ``out_dtype``.
    out_dtype : dtype, optional
        The exact path's output dtype (float64, float32, float16, bfloat16); default float64.
    backend : {"numpy", "numba", "numba-chunked", "cuda"}
        The float64 path's implementation: NumPy, refattn's deterministic Numba CPU kernel of
        the recurrence (:mod:`refattn.kernels.linear_cpu`, float64 compute), or the chunked
        (WY / UT-transform) form of flash-linear-attention's chunk kernels
        (:mod:`refattn.kernels.linear_chunked`, chunks of 64 steps, float64 compute), within
        :func:`refattn.linear.forward_error_bound` with the same ``backend``; or the
        numba.cuda kernel of the recurrence (:mod:`refattn.kernels.linear_cuda`, one thread
        block per sequence and value head, float64 compute; on the device, or the simulator
        with ``NUMBA_ENABLE_CUDASIM=1``), bit-identical to "numba". Each has a vjp
        (:func:`linear_attention_vjp`).

    Returns
    -------
    o : (B, HV, T, E)
    final_state : (N, HV, D, E), when ``output_final_state``

    Notes
    -----
    Conventions pinned (docs/conventions.md, "Linear attention"): the state is (D, E); the
    output reads the state *after* step t's update; ``scale`` multiplies the output (FLA scales
    q, the same real number); the gates act on S's key rows. Chunked kernels compute the same
    recurrence from within-chunk cumulative gate sums; that form is an implementation detail
    (its low-precision cumsum is a known source of error) and not part of the semantics.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> q = k = np.ones((1, 1, 2, 1)); v = np.array([[[[1.0], [3.0]]]])
    >>> refattn.linear_attention(q, k, v, scale=1.0)[0, 0, :, 0].tolist()  # plain: cumulative
    [1.0, 4.0]
    >>> beta = np.ones((1, 1, 2))  # delta rule, beta = 1, ||k|| = 1: S holds the last value
    >>> refattn.linear_attention(q, k, v, beta=beta, scale=1.0)[0, 0, :, 0].tolist()
    [1.0, 3.0]
    >>> g = np.full((1, 1, 2), -1.0)  # gate 2**-1: S_2 = S_1 / 2 + 3
    >>> refattn.linear_attention(q, k, v, g, scale=1.0, gate_base="2")[0, 0, :, 0].tolist()
    [1.0, 3.5]
    """
    _checks.precision(precision)
    _backend(backend, precision)
    dtype = _checks.out_dtype(out_dtype)
    options = dict(
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        qk_l2norm=qk_l2norm,
        gate_base=gate_base,
    )
    call = _call(q, k, v, g, beta, options)
    if precision == "exact":
        from ..exact.linear import exact_linear_attention

        _finite(call)
        out, final = exact_linear_attention(call, dtype)
    elif backend == "numba":
        from . import _kernels

        out, final = _kernels.forward(call)
    elif backend == "numba-chunked":
        from . import _kernels

        out, final = _kernels.chunked_forward(call)
    elif backend == "cuda":
        from . import _kernels

        out, final = _kernels.cuda_forward(call)
    else:
        out, final = _float64.forward(call)
    return (out, final) if output_final_state else out


def linear_attention_vjp(
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
    precision="float64",
    out_dtype=None,
    backend="numpy",
) -> LinearAttentionGrads:
    """Vector-Jacobian product of :func:`linear_attention`: the gradients of
    ``sum(do * o) + sum(dht * final_state)`` with respect to every input.

    Reverse mode through the recurrence (states recomputed per block of ~sqrt(T) steps from
    checkpoints; ``backend="numba-chunked"``: per chunk of 64 steps from the chunk's start
    state computed by the chunked form); with ``qk_l2norm`` the gradient flows through the
    normalisation. The gate gradient is with respect to g as given (for ``gate_base="2"``,
    ``d 2**g / dg = 2**g ln 2``).

    Parameters
    ----------
    q, k, v, g, beta : as :func:`linear_attention` (g and beta may be None)
    do : array (B, HV, T, E)
        Cotangent of o.
    dht : array (N, HV, D, E), optional
        Cotangent of the final state.
    scale, initial_state, cu_seqlens, qk_l2norm, gate_base, backend :
        As :func:`linear_attention`. ``backend="numba"``: the Numba CPU kernel's reverse pass;
        ``"numba-chunked"``: the chunked kernel's (boundary states from the chunked forward,
        each chunk reversed step by step), within :func:`refattn.linear.vjp_error_bound` with
        ``backend="numba-chunked"``; ``"cuda"``: the numba.cuda reverse recurrence,
        bit-identical to ``"numba"``.
    precision, out_dtype :
        "float64" (within :func:`refattn.linear.vjp_error_bound` with the same ``backend``)
        or "exact" (every gradient
        element the exact derivative rounded once to ``out_dtype``).

    Returns
    -------
    LinearAttentionGrads
        (dq, dk, dv, dg, dbeta, dh0); dg, dbeta, dh0 are None when g, beta, initial_state are.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> q = k = np.ones((1, 1, 1, 1)); v = np.full((1, 1, 1, 1), 2.0)
    >>> do = np.ones((1, 1, 1, 1))
    >>> grads = refattn.linear_attention_vjp(q, k, v, None, None, do, scale=1.0)
    >>> grads.dq.item(), grads.dk.item(), grads.dv.item(), grads.dg
    (2.0, 2.0, 1.0, None)
    """
    _checks.precision(precision)
    _backend(backend, precision)
    dtype = _checks.out_dtype(out_dtype)
    options = dict(
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        qk_l2norm=qk_l2norm,
        gate_base=gate_base,
    )
    call = _call(q, k, v, g, beta, options)
    do, dht = cotangents(call, do, dht)
    if precision == "exact":
        from ..exact.linear import exact_linear_attention_vjp

        _finite(call)
        return LinearAttentionGrads(*exact_linear_attention_vjp(call, do, dht, dtype))
    if backend != "numpy":
        from . import _kernels

        kernel = {
            "numba": _kernels.backward,
            "numba-chunked": _kernels.chunked_backward,
            "cuda": _kernels.cuda_backward,
        }[backend]
        grads = kernel(call, do, dht)
    else:
        grads = _float64.backward(call, do, dht)
    return _assemble(call, grads)


def _assemble(call, grads) -> LinearAttentionGrads:
    """Value-head gradients of the normalised, scaled q and of k -> the arguments' gradients."""
    dq, dk = grads["q"] * call.scale, grads["k"]
    if call.qk_l2norm:
        _, rq = _float64.normalized(call.q)
        _, rk = _float64.normalized(call.k)
        dq = _float64.l2norm_backward(call.q, rq, dq)
        dk = _float64.l2norm_backward(call.k, rk, dk)
    return LinearAttentionGrads(
        dq=fold_heads(dq, call.key_heads),
        dk=fold_heads(dk, call.key_heads),
        dv=grads["v"],
        dg=grads["g"],
        dbeta=grads["beta"],
        dh0=None if call.h0 is None else grads["h0"],
    )


def _finite(call):
    """The exact path takes finite inputs only (named on failure)."""
    for name in ("q", "k", "v", "g", "beta", "h0"):
        array = getattr(call, name)
        if array is not None and not np.isfinite(array).all():
            shown = "initial_state" if name == "h0" else name
            raise ValueError(
                f"{shown}: precision='exact' needs finite values (shape {array.shape}); "
                "NaN/Inf found"
            )


def _bound_options(options):
    return {
        key: options[key]
        for key in ("scale", "initial_state", "cu_seqlens", "qk_l2norm", "gate_base")
    }


def forward_error_bound(q, k, v, g=None, beta=None, *, dtype="float64", backend="numpy", **options):
    """Per-element bounds (o (B, HV, T, E), final state (N, HV, D, E)) on the error of the
    float64 path (or a kernel computing in ``dtype``), from
    :func:`refattn.bounds.linear_forward_bound` with the norms of the float64 path's states;
    ``backend="numba-chunked"``: the chunked form's bound
    (:func:`refattn.bounds.linear.linear_chunked_forward_bound`, chunks of 64 steps: the
    cumulative gate sums, the decay ratios and the triangular solve's conditioning).

    >>> import numpy as np
    >>> q = k = v = np.ones((1, 1, 3, 2))
    >>> o_bound, s_bound = forward_error_bound(q, k, v, beta=np.ones((1, 1, 3)))
    >>> bool(o_bound.max() < 1e-13)
    True
    >>> beta = np.ones((1, 1, 3))
    >>> o_chunked, _ = forward_error_bound(q, k, v, beta=beta, backend="numba-chunked")
    >>> bool(o_bound.max() < o_chunked.max() < 1e-11)
    True
    """
    _checks.choice(backend, "backend", BACKENDS)
    full = dict(scale=None, initial_state=None, cu_seqlens=None, qk_l2norm=False, gate_base="e")
    full.update(options)
    call = _call(q, k, v, g, beta, full)
    norms = _float64.forward(call, keep_norms=True)[2]
    bound = linear_chunked_forward_bound if backend == "numba-chunked" else linear_forward_bound
    return bound(q, k, v, g, beta, state_norms=norms, dtype=dtype, **_bound_options(full))


def vjp_error_bound(q, k, v, g, beta, do, dht=None, *, dtype="float64", backend="numpy", **options):
    """Per-element bounds (a dict dq, dk, dv, dg, dbeta, dh0) on the error of the float64
    :func:`linear_attention_vjp`, from :func:`refattn.bounds.linear_vjp_bound` with the norms
    of the float64 path's states (the bound of backends "numpy", "numba" and "cuda");
    ``backend="numba-chunked"``: the chunked kernel's
    (:func:`refattn.bounds.linear.linear_chunked_vjp_bound`, chunks of 64 steps: the recurrent
    bound with the chunked form's errors of the states at the chunk boundaries).

    >>> import numpy as np
    >>> q = k = v = do = np.ones((1, 1, 3, 2))
    >>> bool(vjp_error_bound(q, k, v, None, None, do)["dk"].max() < 1e-12)
    True
    >>> chunked = vjp_error_bound(q, k, v, None, None, do, backend="numba-chunked")
    >>> bool(chunked["dk"].max() < 1e-12)
    True
    """
    _checks.choice(backend, "backend", BACKENDS)
    full = dict(scale=None, initial_state=None, cu_seqlens=None, qk_l2norm=False, gate_base="e")
    full.update(options)
    call = _call(q, k, v, g, beta, full)
    norms = _float64.forward(call, keep_norms=True)[2]
    bound = linear_chunked_vjp_bound if backend == "numba-chunked" else linear_vjp_bound
    bounds = bound(
        q, k, v, g, beta, do, dht, state_norms=norms, dtype=dtype, **_bound_options(full)
    )
    if call.h0 is None:
        bounds["dh0"] = None
    return bounds
