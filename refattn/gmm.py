"""Gaussian-mixture attention of Movellan & Gabbur, "Probabilistic Transformers".

A database of S memory units u, each with a key xi_u (D,) and an expected value mu_u (E,),
generates query/value pairs (eqs. (1), (6)-(8))

.. math::

    p(q, v) = \\sum_u p(u)\\,\\mathcal N(q;\\,\\xi_u, \\alpha_u^{-1} I_D)\\,
              \\mathcal N(v;\\,\\mu_u, \\beta_u^{-1} I_E).

Attention is MAP inference of v given q by EM (eqs. (2)-(5), (13)-(14)); inference-time
adaptation of the keys (eqs. (25)-(29)) and of the unit priors (eqs. (30)-(34)) is EM over the
batch of queries. Equation numbers are those of the source (seed 000).

Every function has ``precision="float64"`` (NumPy, log-space: every exponential is of a
max-shifted score) and ``precision="exact"`` (each output element the exact value of the stated
finite computation -- ``iters`` EM iterations -- rounded once to ``out_dtype`` by a Ziv loop over
interval enclosures).

Pinned readings (see each function for details):

* alpha_u, beta_u may differ per unit (an extension of the paper's scalars); the Gaussian
  normalisers ``(D/2) log alpha_u`` and ``(E/2) log beta_u`` then enter the E-step (eq. (5)),
  of which eq. (14) is the equal-precision case where they cancel.
* Per-unit beta: the M-step solves eq. (12), ``v = sum w_u beta_u mu_u / sum w_u beta_u``;
  eq. (13) is its equal-beta case.
* ``v_init=None``: the first E-step uses w_u = p(u | q) (eq. (5) with the value likelihood
  marginalised out), i.e. eq. (14) with no beta term. The prior keeps its own factors: with
  ``prior="magnitude"`` the prior of eq. (15) contains ``exp(beta_u ||mu_u||^2 / 2)``, so the
  first iterate is softmax attention (eq. (20)) only when beta = 0.
* ``adapt_keys(form="paper")`` is eqs. (28)-(29) as printed; ``form="map"`` counts the Gaussian
  key prior (25) once instead of once per unit of responsibility.
* Masks: ``attention`` takes the allowed set of :mod:`refattn.masks` (``mask`` True = attend,
  ``causal``, ``window``, ``align``): excluded units get no weight in any E-step; a row with
  no allowed unit follows ``empty_rows`` ("zero" or "nan", as :func:`refattn.attention`).

Public-code readings (named options; the defaults follow the paper):

* ``attention(form="unnormalised")``: the E-step without the normalisers (D/2) log alpha_u
  and (E/2) log beta_u, the M-step the plain mean ``sum_u w_u mu_u`` (default "paper": the
  normalisers of eqs. (7)-(8) and the root of eq. (12)).
* ``adapt_keys(form="map_recentred")``: the once-counted key prior centred on the current
  keys at every iteration (the paper's eq. (25) centres it on xi^0).

Both readings are those of the authors' public code, apple/ml-probabilistic-attention,
file ``probabilisticattention.py`` (``ProbabilisticAttention.forward``: its ``update_weights``
and its key-adaptation loop). That code also adds a small epsilon to the softmax
denominators, which refattn does not model.

Vector-Jacobian products: :func:`attention_vjp`, :func:`adapt_keys_vjp`,
:func:`adapt_priors_vjp`, the derivative of the finite computation as run, on both paths.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import _checks, masks
from .exact import gmm as exact

__all__ = [
    "attention",
    "log_posterior",
    "adapt_keys",
    "adapt_priors",
    "GMMResult",
    "attention_vjp",
    "adapt_keys_vjp",
    "adapt_priors_vjp",
    "AttentionVJP",
    "AdaptKeysVJP",
    "AdaptPriorsVJP",
]

PRIORS = ("uniform", "magnitude")
ATTENTION_FORMS = ("paper", "unnormalised")
KEY_FORMS = ("paper", "map", "map_recentred")
PRIOR_FORMS = ("paper", "map")
BACKENDS = ("numpy", "numba")


class GMMResult(NamedTuple):
    """Result of :func:`attention` with ``return_trace=True``.

    values : (..., L, E) the final value estimates v_T.
    trace : (..., L, iters) log p(v_t | q) after iteration t (NaN after a row stopped on tol).
    iterations : (..., L) int, iterations performed per row.
    """

    values: np.ndarray
    trace: np.ndarray
    iterations: np.ndarray


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def unit_parameter(value, name, batch, units, *, allow_zero=False, allow_inf=False):
    """A precision/strength given as a scalar or a per-unit array (..., S).

    Returns (array float64 of shape batch + (S,), input array at exact values, varies) where
    ``varies`` says whether the value differs between units of one batch element.
    """
    if np.ndim(value) == 0 and not isinstance(value, np.ndarray):
        if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
            raise TypeError(
                f"{name}: expected a real number or a float array (..., S), got {value!r}"
            )
        try:
            arr = np.asarray(float(value))
        except OverflowError:
            raise ValueError(
                f"{name}: expected a number within the float64 range, got an "
                f"int of {len(str(abs(value)))} digits"
            ) from None
    else:
        arr = _checks.float_array(value, name)
    wide = _checks.as_float64(arr)
    bad = np.isnan(wide) | (wide < 0)
    if not allow_zero:
        bad |= wide == 0
    if not allow_inf:
        bad |= np.isinf(wide)
    if bad.any():
        need = ">= 0" if allow_zero else "> 0"
        worst = np.atleast_1d(wide)[np.atleast_1d(bad)][0]
        raise ValueError(
            f"{name}: expected values {need}{'' if allow_inf else ' and finite'}, "
            f"got {worst!r} (shape {wide.shape})"
        )
    if wide.ndim:
        wide = _checks.broadcast(wide, batch + (units,), name, "(..., S)")
    wide = np.broadcast_to(wide, batch + (units,))
    varies = bool(units > 1 and (wide != wide[..., :1]).any())
    return wide, varies


def batch_of(shapes_and_names, ranks):
    """Broadcast the leading (batch) dimensions of several arrays, naming them on failure."""
    leading = []
    for (_name, arr), rank in zip(shapes_and_names, ranks, strict=False):
        leading.append(arr.shape[: arr.ndim - rank])
    try:
        return np.broadcast_shapes(*leading)
    except ValueError:
        described = ", ".join(f"{n} {a.shape}" for (n, a) in shapes_and_names)
        raise ValueError(f"leading (batch) dimensions do not broadcast: {described}") from None


def _iters(value, name="iters"):
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


def _log_prior(prior, batch, units):
    """(kind, log p(u) float64 array or None). An array prior may be -inf (unit excluded)."""
    if isinstance(prior, str):
        return _checks.choice(prior, "prior", PRIORS), None
    arr = _checks.float_array(prior, "prior", ndim_min=1)
    wide = _checks.as_float64(arr)
    if np.isnan(wide).any() or np.isposinf(wide).any():
        raise ValueError(f"prior: log p(u) must not contain NaN or +inf (shape {wide.shape})")
    wide = _checks.broadcast(wide, batch + (units,), "prior", "(..., S)")
    if np.isneginf(wide).all(axis=-1).any():
        raise ValueError(
            "prior: log p(u) is -inf for every unit of some batch element "
            "(no unit can explain the query)"
        )
    return "array", wide


class _Model(NamedTuple):
    """Validated GMM inputs broadcast to a common batch: q (B..., L, D), keys (B..., S, D)..."""

    q: np.ndarray
    keys: np.ndarray
    values: np.ndarray | None
    alpha: np.ndarray
    alpha_varies: bool
    beta: np.ndarray
    beta_varies: bool
    kind: str
    log_prior: np.ndarray | None
    allowed: np.ndarray | None = None  # (B..., L, S) bool, True = attend; None: all
    form: str = "paper"  # "paper" or "unnormalised" (see ATTENTION_FORMS)
    empty_rows: str = "zero"


def _model(q, keys, values, alpha, beta, prior, *, need_values=True, names=("q", "keys")):
    """``names``: the caller's names for q and keys (e.g. queries, keys0), used in messages."""
    q_name, keys_name = names
    q = _checks.finite_array(q, q_name, 2)
    keys = _checks.finite_array(keys, keys_name, 2)
    arrays = [(q_name, q), (keys_name, keys)]
    if need_values:
        values = _checks.finite_array(values, "values", 2)
        arrays.append(("values", values))
        if values.shape[-2] != keys.shape[-2]:
            raise ValueError(
                f"values: expected S = {keys.shape[-2]} rows (as {keys_name} "
                f"{keys.shape}), got shape {values.shape}"
            )
    if q.shape[-1] != keys.shape[-1]:
        raise ValueError(
            f"{keys_name}: expected feature size D = {q.shape[-1]} (as {q_name} "
            f"{q.shape}), got shape {keys.shape}"
        )
    batch = batch_of(arrays, [2] * len(arrays))
    units = keys.shape[-2]
    alpha_w, alpha_varies = unit_parameter(alpha, "alpha", batch, units)
    beta_w, beta_varies = unit_parameter(beta, "beta", batch, units, allow_zero=True)
    if beta_varies and (beta_w == 0).any():
        raise ValueError(
            "beta: per-unit value precisions must all be > 0 (the normaliser "
            "beta_u^(E/2) of eq. (8) is needed when they differ)"
        )
    kind, log_prior = _log_prior(prior, batch, units)
    lengths = q.shape[-2]

    def grow(a, rank_shape):
        return np.broadcast_to(a, batch + rank_shape)

    return _Model(
        grow(q, (lengths, q.shape[-1])),
        grow(keys, keys.shape[-2:]),
        grow(values, values.shape[-2:]) if need_values else None,
        alpha_w,
        alpha_varies,
        beta_w,
        beta_varies,
        kind,
        log_prior,
    )


# --------------------------------------------------------------------------------------------
# Float64 building blocks (log-space)
# --------------------------------------------------------------------------------------------


def _float64(m: _Model) -> _Model:
    """The model with its arrays widened (exactly) to float64, for the float64 path: einsum
    and matmul do not take float16 / bfloat16 inputs uniformly."""
    return m._replace(
        q=_checks.as_float64(m.q),
        keys=_checks.as_float64(m.keys),
        values=None if m.values is None else _checks.as_float64(m.values),
    )


def _sqdist64(x, y):
    """||x_i - y_u||^2, (..., L, S), from the differences (no cancellation of large norms)."""
    diff = x[..., :, None, :] - y[..., None, :, :]
    return np.einsum("...lsd,...lsd->...ls", diff, diff)


def _query_logits64(m: _Model, q, keys):
    """log p(u) + log p(q | u) up to terms constant over u: (..., L, S).

    Logits beyond the float64 range (e.g. alpha ~ 1e308) would turn into -inf/NaN and
    silently wrong responsibilities: that is a ValueError naming alpha and beta instead.
    """
    try:
        with np.errstate(over="raise", invalid="raise"):
            return _query_logits64_unchecked(m, q, keys)
    except FloatingPointError:
        raise ValueError(
            "alpha, beta: the log-responsibilities alpha/2 |q - k|^2 (and beta/2 |v|^2) "
            f"exceed the float64 range (max alpha {float(np.max(m.alpha)):.3g}); the float64 "
            "path cannot represent them"
        ) from None


def _query_logits64_unchecked(m: _Model, q, keys):
    alpha = m.alpha[..., None, :]
    dim = q.shape[-1]
    if m.kind == "magnitude":
        # eq. (15) x eq. (7): alpha xi.q - alpha/2 ||q||^2 + beta/2 ||mu||^2 (eqs. (17)-(18))
        logits = alpha * np.einsum("...ld,...sd->...ls", q, keys)
        if m.values is not None:
            norms = np.einsum("...se,...se->...s", m.values, m.values)
            logits = logits + (m.beta * norms / 2)[..., None, :]
        if m.alpha_varies:
            logits = logits - alpha / 2 * np.einsum("...ld,...ld->...l", q, q)[..., None]
    else:
        logits = -alpha / 2 * _sqdist64(q, keys)
        if m.kind == "array":
            logits = logits + m.log_prior[..., None, :]
    if m.alpha_varies and m.form == "paper":
        logits = logits + dim / 2 * np.log(alpha)
    if m.allowed is not None:
        logits = np.where(m.allowed, logits, -np.inf)
    return logits


def _value_logits64(m: _Model, v):
    """log p(v | u) up to terms constant over u: (..., L, S)."""
    beta = m.beta[..., None, :]
    logits = -beta / 2 * _sqdist64(v, m.values)
    if m.beta_varies and m.form == "paper":
        logits = logits + v.shape[-1] / 2 * np.log(beta)
    return logits


def _lse64(x):
    return _lse_where(x, np.isfinite(x) | np.isnan(x))


def _lse_where(x, where):
    from .logspace import logsumexp

    return logsumexp(x, axis=-1, where=where)


def _softmax64(x):
    from .logspace import softmax

    return softmax(x, axis=-1, where=~np.isneginf(x))


def _value_constant(m: _Model, dim_v):
    """(E/2) log beta - (E/2) log 2 pi when beta is equal across units (else the beta part is
    already in the logits)."""
    const = -dim_v / 2 * math.log(2 * math.pi)
    if not m.beta_varies:
        const = const + dim_v / 2 * np.log(m.beta[..., :1])  # (..., 1)
    return const


def _log_posterior64(m: _Model, a, v):
    """log p(v | q) = lse(a + b(v)) - lse(a) + const (eq. (1) with (6)-(8))."""
    b = _value_logits64(m, v)
    return _lse64(a + b) - _lse64(a) + _value_constant(m, v.shape[-1])


def _em_logits64(m: _Model, a, v):
    """The E-step logits of one iteration: a + log p(v | u), plus log beta_u when the M-step
    weights the units by their value precisions (eq. (12), per-unit beta, paper form)."""
    logits = a if v is None else a + _value_logits64(m, v)
    if m.beta_varies and m.form == "paper":
        logits = logits + np.log(m.beta)[..., None, :]
    return logits


def _trace64(m: _Model, v, empty):
    """log p(v | q) of the model (always the normalised density) per row, NaN on empty rows."""
    model = m._replace(form="paper")
    with np.errstate(invalid="ignore"):
        value = _log_posterior64(model, _query_logits64(model, model.q, model.keys), v)
    return np.where(empty, np.nan, value)


def _attention64(m: _Model, v_init, iters, tol, want_trace):
    a = _query_logits64(m, m.q, m.keys)
    empty = np.isneginf(a).all(axis=-1)
    v = None if v_init is None else _checks.as_float64(v_init)
    shape = a.shape[:-1]
    active = np.ones(shape, dtype=bool)
    done = np.zeros(shape, dtype=np.int64)
    trace = np.full(shape + (iters,), np.nan) if want_trace else None
    for t in range(iters):
        new = _softmax64(_em_logits64(m, a, v)) @ m.values
        new = np.where(empty[..., None], 0.0, new)  # empty rows: out 0 (refattn's empty_rows)
        if v is not None:
            new = np.where(active[..., None], new, v)
        if tol is not None and v is not None:
            settled = np.max(np.abs(new - v), axis=-1) <= tol
        else:
            settled = np.zeros(shape, dtype=bool)
        done += active
        if want_trace:
            trace[..., t] = np.where(active, _trace64(m, new, empty), np.nan)
        v = new
        active &= ~settled
        if not active.any():
            break
    if m.empty_rows == "nan":
        v = np.where(empty[..., None], np.nan, v)
    return v, trace, done


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _allowed(m: _Model, mask, causal, window, align):
    """The allowed set (B..., L, S) of refattn.masks (one rule), or None when unrestricted."""
    if mask is None and not causal and window is None:
        _checks.choice(align, "align", masks.ALIGNS)
        return None
    if not isinstance(causal, bool | np.bool_):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    length, units = m.q.shape[-2], m.keys.shape[-2]
    want = m.q.shape[:-2] + (length, units)
    if mask is not None:
        mask = _checks.broadcast(_checks.bool_array(mask, "mask"), want, "mask", "(..., L, S)")
    allowed = masks.allowed_mask(
        length, units, mask=mask, causal=bool(causal), window=window, align=align
    )
    return np.broadcast_to(allowed, want)


def _attention_model(
    q, keys, values, alpha, beta, prior, form, mask, causal, window, align, empty_rows, v_init
):
    """(validated model with its allowed set, v_init broadcast to (B..., L, E) or None)."""
    m = _model(q, keys, values, alpha, beta, prior)
    m = m._replace(
        form=_checks.choice(form, "form", ATTENTION_FORMS),
        empty_rows=_checks.choice(empty_rows, "empty_rows", ("zero", "nan")),
    )
    m = m._replace(allowed=_allowed(m, mask, causal, window, align))
    if v_init is not None:
        v_init = _checks.finite_array(v_init, "v_init", 2)
        want = m.q.shape[:-1] + (m.values.shape[-1],)
        v_init = _checks.broadcast(v_init, want, "v_init", "(..., L, E)")
    return m, v_init


def attention(
    q,
    keys,
    values,
    *,
    alpha,
    beta=0.0,
    prior="uniform",
    v_init=None,
    iters=1,
    tol=None,
    return_trace=False,
    form="paper",
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    empty_rows="zero",
    precision="float64",
    out_dtype=None,
    backend="numpy",
):
    """Gaussian-mixture attention: MAP value inference by EM (Movellan & Gabbur eqs. (13)-(14)).

    For each query q_i the value estimate is refined ``iters`` times by

    .. math::

        v_{t+1} = \\sum_u w_u \\mu_u \\quad (13), \\qquad
        w_u \\propto p(u)\\, e^{-\\frac{\\alpha_u}{2}\\|q - \\xi_u\\|^2}
                 e^{-\\frac{\\beta_u}{2}\\|v_t - \\mu_u\\|^2}\\,
                 \\alpha_u^{D/2} \\beta_u^{E/2} \\quad (14),

    the normalisers alpha_u^(D/2) beta_u^(E/2) (eqs. (7)-(8)) cancelling when the precisions
    are equal across units, which is the paper's case. With per-unit beta the M-step is the
    root of eq. (12), ``beta_u`` inside the sum:
    ``v_{t+1} = sum_u w_u beta_u mu_u / sum_u w_u beta_u`` (eq. (13) needs equal beta; the
    unweighted mean would not be an EM step and can decrease log p(v | q)).
    With ``prior="magnitude"`` (eqs. (15)-(16)) the weights take the inner-product form
    ``w_u ∝ exp(alpha xi_u.q + beta mu_u.v_t)`` (eqs. (17)-(18)) and beta = 0 gives softmax
    attention with scale alpha (eqs. (19)-(20)).

    Parameters
    ----------
    q : array (..., L, D)
        Queries.
    keys : array (..., S, D)
        Unit keys xi_u.
    values : array (..., S, E)
        Expected values mu_u.
    alpha : float or array (..., S)
        Query precisions alpha_u > 0 (eq. (7)).
    beta : float or array (..., S)
        Value precisions beta_u >= 0 (eq. (8)); per-unit values that differ must be > 0.
    prior : {"uniform", "magnitude"} or array (..., S)
        p(u): uniform; eq. (15) ``p(u) ∝ exp(alpha_u ||xi_u||^2/2 + beta_u ||mu_u||^2/2)``; or
        an array of log p(u) (normalisation not needed: the posterior does not depend on it;
        -inf excludes a unit).
    v_init : array (..., L, E), optional
        v_0. None (default): the first E-step has **no value-likelihood term**:
        w_u = p(u | q), the value likelihood marginalised out. The first iterate is then
        plain softmax attention for the uniform prior (Gaussian scores) and for
        ``prior="magnitude"`` with beta = 0 (eq. (20)); with ``prior="magnitude"`` and
        beta > 0 the prior's ``beta_u ||mu_u||^2 / 2`` (eq. (15)) still weights the units, so
        it is not.
    iters : int >= 1
        EM iterations (the maximum when ``tol`` is given).
    tol : float, optional
        float64 path only: a row stops once ``max_e |v_{t+1} - v_t| <= tol`` (its later trace
        entries are NaN). Each row stops on its own residual, never on a batch-global one.
    return_trace : bool
        Also return log p(v_t | q) after every iteration (needs beta > 0; see
        :func:`log_posterior`), as a :class:`GMMResult`. The trace is the model's normalised
        density whatever ``form``; NaN on empty rows.
    form : {"paper", "unnormalised"}
        "paper" (default): as above. "unnormalised": the public code's reading
        (apple/ml-probabilistic-attention, ``probabilisticattention.py``): the E-step leaves
        out ``(D/2) log alpha_u`` and ``(E/2) log beta_u`` and the M-step is the plain mean
        ``v = sum_u w_u mu_u`` even for per-unit beta (that code runs one E/M step:
        ``iters=1``). Identical to "paper" when alpha and beta are equal across units.
    mask : bool array broadcastable to (..., L, S), optional
        True = query i may attend unit u (as :func:`refattn.attention`).
    causal : bool
        Allow only ``u <= i + o``.
    window : (left, right) or None
        Allow only ``i + o - left <= u <= i + o + right``.
    align : {"top_left", "bottom_right"}
        Offset o = 0 or S - L (:func:`refattn.masks.offset_of`).
    empty_rows : {"zero", "nan"}
        Rows with no allowed unit (mask, window, or a -inf prior on every allowed unit):
        values 0 or NaN (trace NaN).
    precision : {"float64", "exact"}
    out_dtype : dtype, optional
        Exact path: float64 (default), float32, float16, bfloat16.
    backend : {"numpy", "numba"}
        float64 path only (unmasked, paper form): "numba" runs the deterministic kernel
        :func:`refattn.kernels.variants.gmm_attention` (same operations, sequential sums;
        within the same error bound, bit-identical for any thread count).

    Returns
    -------
    values (..., L, E), or GMMResult(values, trace (..., L, iters), iterations (..., L)).

    Notes
    -----
    The exact path returns the exact value of ``iters`` EM iterations (not of the fixed
    point), every element rounded once. EM never decreases log p(v_t | q) (eq. (3): Dempster,
    Laird & Rubin), so the trace is non-decreasing from t = 1 on (and from t = 0 when v_init is
    given). The float64 path forms every weight as ``exp(logit - lse)`` with a max-shifted lse,
    so no weight underflows to 0/0 however negative the logits are; its error is bounded
    by :func:`refattn.bounds.mixture_bound`.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> q = np.array([[0.0, 1.0]]); keys = np.array([[0.0, 1.0], [1.0, 0.0]])
    >>> values = np.array([[1.0], [0.0]])
    >>> gmm.attention(q, keys, values, alpha=1.0).round(6).tolist()
    [[0.731059]]
    """
    precision = _checks.precision(precision)
    if _checks.choice(backend, "backend", BACKENDS) == "numba" and precision != "float64":
        raise ValueError(
            "backend: 'numba' runs the float64 path only; pass "
            "precision='float64' or backend='numpy'"
        )
    m, v_init = _attention_model(
        q, keys, values, alpha, beta, prior, form, mask, causal, window, align, empty_rows, v_init
    )
    iters = _iters(iters)
    tol = _checks.iteration_tol(tol, precision, "`iters` iterations")
    if return_trace and (m.beta == 0).any():
        raise ValueError(
            "return_trace: log p(v | q) needs beta > 0 (beta = 0 makes p(v | u) "
            "improper); pass beta > 0 or return_trace=False"
        )
    if backend == "numba" and (
        m.allowed is not None or m.form != "paper" or m.empty_rows != "zero"
    ):
        raise ValueError(
            "backend: 'numba' runs the unmasked paper form only; pass "
            "backend='numpy' for mask/causal/window, form or empty_rows"
        )
    if precision == "float64":
        m = _float64(m)
    if precision == "float64" and backend == "numba":
        from .kernels import announce_compile, variants
        from .kernels.variants import gmm_attention

        announce_compile(variants, names="gmm")
        v, trace, done = gmm_attention(m, v_init, iters, tol, return_trace)
        return GMMResult(v, trace, done) if return_trace else v
    if precision == "float64":
        v, trace, done = _attention64(m, v_init, iters, tol, return_trace)
        return GMMResult(v, trace, done) if return_trace else v
    values_out, trace = exact.attention(
        m, v_init, iters, return_trace, _checks.out_dtype(out_dtype)
    )
    if not return_trace:
        return values_out
    return GMMResult(values_out, trace, np.full(trace.shape[:-1], iters, dtype=np.int64))


def log_posterior(
    v, q, keys, values, *, alpha, beta, prior="uniform", precision="float64", out_dtype=None
):
    """log p(v | q) of the Gaussian mixture, eqs. (1), (6)-(8), (15)-(16); the EM objective.

    .. math::

        \\log p(v \\mid q) = \\log \\sum_u p(u) p(q|u) p(v|u) - \\log \\sum_u p(u) p(q|u)

    The stated constant is zero: this is the normalised density of v (including
    ``-(E/2) log 2 pi`` and ``(E/2) log beta_u``). It does not depend on the normalisation of
    p(u) or on the query normaliser, which cancel.

    Parameters
    ----------
    v : array (..., L, E)
    q, keys, values, alpha, prior : as :func:`attention`.
    beta : float or array (..., S), > 0
    precision, out_dtype : as :func:`attention`.

    Returns
    -------
    array (..., L)

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> one = np.ones((1, 1))
    >>> round(float(gmm.log_posterior(one, one, one, one, alpha=1.0, beta=1.0)[0]), 6)
    -0.918939
    """
    precision = _checks.precision(precision)
    m = _model(q, keys, values, alpha, beta, prior)
    if (m.beta == 0).any():
        raise ValueError("beta: log p(v | q) needs beta > 0 (beta = 0 is improper)")
    v = _checks.finite_array(v, "v", 2)
    v = _checks.broadcast(v, m.q.shape[:-1] + (m.values.shape[-1],), "v", "(..., L, E)")
    if precision == "float64":
        m = _float64(m)
        return _log_posterior64(m, _query_logits64(m, m.q, m.keys), _checks.as_float64(v))
    return exact.log_posterior(m, v, _checks.out_dtype(out_dtype))


# --------------------------------------------------------------------------------------------
# Inference-time adaptation
# --------------------------------------------------------------------------------------------


def _responsibilities64(m: _Model, keys, log_prior_now):
    """log w^i_k = log p(u_k | q_i) (eq. (23)), (..., L, S)."""
    if log_prior_now is not None:
        m = m._replace(kind="array", log_prior=log_prior_now)
    logits = _query_logits64(m, m.q, keys)
    from .logspace import log_softmax

    return log_softmax(logits, axis=-1, where=~np.isneginf(logits))


def _keys_update64(m: _Model, keys0, keys, gamma, form):
    """One M-step of eqs. (28)-(29) ("paper") or the once-counted MAP form ("map")."""
    log_w = _responsibilities64(m, keys, None)
    log_total = _unit_totals64(log_w)
    responsible = np.isfinite(log_total)
    safe_total = np.where(responsible, log_total, 0.0)
    share = np.exp(np.where(np.isneginf(log_w), -np.inf, log_w - safe_total[..., None, :]))
    q_bar = np.einsum("...ls,...ld->...sd", share, _checks.as_float64(m.q))  # eq. (29)
    alpha, gam = m.alpha[..., None], gamma[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        if form == "paper":
            new = (gam * keys0 + alpha * q_bar) / (alpha + gam)  # eq. (28)
        else:  # the prior counted once, centred on xi^0 ("map") or on xi^t ("map_recentred")
            centre = keys if form == "map_recentred" else keys0
            ratio = _prior_ratio64(gam, safe_total)
            new = np.where(
                np.isinf(ratio), centre, (ratio * centre + alpha * q_bar) / (ratio + alpha)
            )
    new = np.where(np.isinf(gam), keys0, new)
    return np.where(responsible[..., None], new, keys)


def _prior_ratio64(gam, log_total):
    """gamma_k / W_k (..., S, 1) from log W_k, so that the MAP forms
    ``(gamma c + alpha W q-bar) / (gamma + alpha W) = (r c + alpha q-bar) / (r + alpha)`` never
    form 0/0 when W_k underflows; inf (the key stays at its centre) when r overflows."""
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = gam * np.exp(-log_total)[..., None]
    return np.where(gam == 0, 0.0, ratio)


def _check_gamma(gamma, batch, units):
    return unit_parameter(gamma, "gamma", batch, units, allow_zero=True, allow_inf=True)[0]


def adapt_keys(
    queries,
    keys0,
    *,
    alpha,
    gamma,
    prior="uniform",
    iters=1,
    form="paper",
    precision="float64",
    out_dtype=None,
):
    """Inference-time MAP adaptation of the keys to a batch of queries (eqs. (21)-(29)).

    E-step (eq. (23)) with the current keys xi^t, then the M-step with the Gaussian key prior
    of eq. (25) centred on the **initial** keys xi^0 (not on xi^t):

    .. math::

        \\text{"paper"}:\\ \\xi_k^{t+1} = \\frac{\\gamma}{\\alpha + \\gamma}\\xi_k^0
            + \\frac{\\alpha}{\\alpha + \\gamma}\\bar q_k \\ \\ (28), \\qquad
            \\bar q_k = \\frac{\\sum_i w_k^i q_i}{\\sum_i w_k^i} \\ \\ (29)

        \\text{"map"}:\\ \\xi_k^{t+1} = \\frac{\\gamma \\xi_k^0 + \\alpha \\sum_i w_k^i q_i}
            {\\gamma + \\alpha \\sum_i w_k^i}

    Eq. (28) solves eq. (26), whose prior term sits inside the sum over queries: the log-prior
    is counted once per unit of responsibility W_k = sum_i w_k^i. The MAP form counts it once,
    as the MAP objective of eq. (21), ``log p(lambda) + sum_i log p(q_i | lambda)``, does
    (its EM step maximises ``log p(lambda) + sum_i sum_j w_j^i log p(q_i, u_j | lambda)``).
    Eq. (24) as printed does not: it puts ``log p(lambda)`` inside the double sum, where it
    is counted once per query. "paper" and "map" **coincide when W_k = 1**, when
    gamma = 0 and when gamma = inf. **gamma -> 0** (uninformative prior) gives xi_k = q̄_k in
    both forms: with ``prior="magnitude"`` this is the Double Normalized Attention (DNA) of Ding
    et al. (2020), the case the paper names. gamma = inf returns xi^0 exactly.

    ``form="map_recentred"`` is the reading of the authors' public code
    (apple/ml-probabilistic-attention, ``probabilisticattention.py``, its key-adaptation
    loop): the "map" step with the prior centred on the **current** keys xi^t instead of
    xi^0, i.e. ``iters`` chained one-iteration "map" adaptations. It equals "map" for
    ``iters=1``.

    Parameters
    ----------
    queries : array (..., L, D)
    keys0 : array (..., S, D)
        Initial keys xi^0 (also the prior's centre).
    alpha : float or array (..., S), > 0
    gamma : float or array (..., S), >= 0, inf allowed
        Key-prior precision of eq. (25).
    prior : {"uniform", "magnitude"} or array (..., S) of log p(u)
        Unit prior of the E-step. "magnitude" is ``p(u) ∝ exp(alpha ||xi^t_u||^2 / 2)`` (eq.
        (15) without values) evaluated at the current keys; the M-step, as eqs. (26)-(28),
        does not differentiate the prior.
    iters : int >= 1
    form : {"paper", "map", "map_recentred"}
    precision, out_dtype : as :func:`attention`.

    Notes
    -----
    float64: responsibilities are log-softmax values and ``q̄_k`` is formed as
    ``sum_i exp(log w_ik - log W_k) q_i`` with ``log W_k`` a max-shifted lse, so no unit's
    responsibility underflows to 0/0; one iteration errs by at most
    :func:`refattn.bounds.mixture_bound` (n = L + S, values max|q| + max|xi^0|) in the
    "paper" form, times L + 1 in the "map" forms.

    Returns
    -------
    array (..., S, D): xi^iters. A unit with no responsibility at all (W_k = 0 exactly, only
    possible with a -inf log prior) keeps its key.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> queries = np.array([[2.0, 0.0]]); keys0 = np.array([[0.0, 0.0]])
    >>> gmm.adapt_keys(queries, keys0, alpha=1.0, gamma=1.0).tolist()
    [[1.0, 0.0]]
    """
    precision = _checks.precision(precision)
    m, gamma, form, iters = _keys_problem(queries, keys0, alpha, gamma, prior, iters, form)
    if precision == "float64":
        return _keys_states64(_float64(m), gamma, form, iters)[-1]
    return exact.adapt_keys(m, gamma, form, iters, _checks.out_dtype(out_dtype))


def _keys_problem(queries, keys0, alpha, gamma, prior, iters, form):
    """Validated (model, gamma (B..., S), form, iters) of :func:`adapt_keys`."""
    form = _checks.choice(form, "form", KEY_FORMS)
    m = _model(
        queries, keys0, None, alpha, 0.0, prior, need_values=False, names=("queries", "keys0")
    )
    iters = _iters(iters)
    gamma = _check_gamma(gamma, m.keys.shape[:-2], m.keys.shape[-2])
    return m, gamma, form, iters


def _keys_states64(m: _Model, gamma, form, iters):
    """[xi^0, xi^1, ..., xi^iters] of the float64 path."""
    states = [m.keys]
    for _ in range(iters):
        states.append(_keys_update64(m, m.keys, states[-1], gamma, form))
    return states


def _check_pi0(pi0, batch, units):
    arr = _checks.float_array(pi0, "pi0", ndim_min=1)
    wide = _checks.as_float64(arr)
    if wide.shape[-1] != units:
        raise ValueError(
            f"pi0: expected S = {units} entries on the last axis, got shape {wide.shape}"
        )
    if not np.isfinite(wide).all() or (wide < 0).any():
        raise ValueError(
            f"pi0: expected a distribution over units (finite, >= 0), got "
            f"min {np.nanmin(wide)!r} (shape {wide.shape})"
        )
    sums = wide.sum(axis=-1)
    slack = units * np.finfo(arr.dtype if arr.dtype.itemsize >= 4 else np.float32).eps
    if arr.dtype.name in ("float16", "bfloat16"):
        slack = units * 2.0**-7
    if (np.abs(sums - 1) > slack).any():
        worst = sums.ravel()[np.argmax(np.abs(sums - 1).ravel())]
        raise ValueError(
            f"pi0: expected a distribution over units (sum 1 within {slack:.3g}), "
            f"got a sum of {worst!r} (shape {wide.shape})"
        )
    return _checks.broadcast(wide, batch + (units,), "pi0", "(..., S)")


def _check_eta(eta, pi0):
    if np.ndim(eta) == 0 and not isinstance(eta, np.ndarray):
        value = _checks.real_scalar(eta, "eta")
        if value < 0:
            raise ValueError(f"eta: expected a concentration >= 0, got {value}")
        return "scaled", value
    arr = _checks.as_float64(_checks.float_array(eta, "eta", ndim_min=1))
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError(f"eta: expected finite Dirichlet parameters >= 0, shape {arr.shape}")
    return "array", _checks.broadcast(arr, pi0.shape, "eta", "(..., S)")


def adapt_priors(
    queries, keys, *, alpha, eta, pi0, iters=1, form="paper", precision="float64", out_dtype=None
):
    """Inference-time adaptation of the unit priors pi with a Dirichlet prior (eqs. (30)-(34)).

    .. math::

        \\pi_k^{t+1} = \\frac{\\bar w_k (1 + \\eta_k)}{\\sum_j \\bar w_j (1 + \\eta_j)} \\ \\ (33),
        \\qquad \\bar w_j = \\sum_i w_j^i \\ \\ (34)

    with w_j^i = p(u_j | q_i, pi^t) (eq. (23), Gaussian query likelihood of precision alpha).
    ``form="map"`` is the once-counted Dirichlet MAP ``pi_k ∝ w̄_k + eta_k``: eq. (31) as
    printed multiplies the log-prior eta_k log pi_k by the responsibilities, like eq. (26).

    Parameters
    ----------
    queries : array (..., L, D)
    keys : array (..., S, D)
    alpha : float or array (..., S), > 0
    eta : float or array (..., S), >= 0
        A scalar is the constant of the paper's ``eta ∝ pi^0``: eta_k = eta * pi0_k. An array
        is eta itself.
    pi0 : array (..., S)
        Initial priors: a distribution (>= 0, summing to 1 within S units of its dtype's
        epsilon); it is used normalised exactly.
    iters : int >= 1
    form : {"paper", "map"}
    precision, out_dtype : as :func:`attention`.

    Returns
    -------
    array (..., S): pi^iters.

    Notes
    -----
    The paper's form does not tend to pi^0 as eta -> inf (it tends to ``w̄ * pi0``
    renormalised); the "map" form does. float64: w̄_k is ``exp(lse_i log w_ik)``, each
    iteration within :func:`refattn.bounds.mixture_bound` (n = L + S, value scale 2).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> queries = np.array([[0.0], [0.0], [5.0]]); keys = np.array([[0.0], [5.0]])
    >>> gmm.adapt_priors(queries, keys, alpha=100.0, eta=0.0, pi0=np.array([0.5, 0.5])).round(
    ...     6).tolist()
    [0.666667, 0.333333]
    """
    precision = _checks.precision(precision)
    m, pi0, eta_kind, eta_value, form, iters = _priors_problem(
        queries, keys, alpha, eta, pi0, iters, form
    )
    if precision == "float64":
        return _priors_states64(_float64(m), pi0, eta_kind, eta_value, form, iters)[0][-1]
    return exact.adapt_priors(
        m, pi0, eta_kind, eta_value, form, iters, _checks.out_dtype(out_dtype)
    )


def _priors_problem(queries, keys, alpha, eta, pi0, iters, form):
    """Validated (model, pi0, eta kind, eta value, form, iters) of :func:`adapt_priors`."""
    form = _checks.choice(form, "form", PRIOR_FORMS)
    m = _model(
        queries, keys, None, alpha, 0.0, "uniform", need_values=False, names=("queries", "keys")
    )
    iters = _iters(iters)
    pi0 = _check_pi0(pi0, m.keys.shape[:-2], m.keys.shape[-2])
    eta_kind, eta_value = _check_eta(eta, pi0)
    return m, pi0, eta_kind, eta_value, form, iters


def _priors_states64(m: _Model, pi0, eta_kind, eta_value, form, iters):
    """([pi^0, ..., pi^iters], eta (B..., S)) of the float64 path."""
    pi = pi0 / pi0.sum(axis=-1, keepdims=True)
    eta_arr = eta_value * pi if eta_kind == "scaled" else eta_value
    states = [pi]
    for _ in range(iters):
        w_bar = np.exp(_unit_totals64(_prior_responsibilities64(m, states[-1])))
        mass = w_bar * (1 + eta_arr) if form == "paper" else w_bar + eta_arr
        states.append(mass / mass.sum(axis=-1, keepdims=True))
    return states, eta_arr


def _prior_responsibilities64(m: _Model, pi):
    with np.errstate(divide="ignore"):
        return _responsibilities64(m, m.keys, np.log(pi))


def _unit_totals64(log_w):
    """log W_k = log sum_i w_ik (..., S), a max-shifted lse over the queries."""
    swapped = np.swapaxes(log_w, -1, -2)
    return _lse_where(swapped, ~np.isneginf(swapped))


# --------------------------------------------------------------------------------------------
# Vector-Jacobian products
# --------------------------------------------------------------------------------------------


class AttentionVJP(NamedTuple):
    """Gradients of ``sum(grad_out * attention(q, keys, values))``, shapes of the inputs."""

    dq: np.ndarray
    dkeys: np.ndarray
    dvalues: np.ndarray


class AdaptKeysVJP(NamedTuple):
    """Gradients of ``sum(grad_out * adapt_keys(queries, keys0))``, shapes of the inputs."""

    dqueries: np.ndarray
    dkeys0: np.ndarray


class AdaptPriorsVJP(NamedTuple):
    """Gradients of ``sum(grad_out * adapt_priors(queries, keys))``, shapes of the inputs."""

    dqueries: np.ndarray
    dkeys: np.ndarray


def _swap(x):
    return np.swapaxes(x, -1, -2)


def _query_logits_vjp64(m: _Model, q, keys, dlogits):
    """(dq, dkeys, dvalues or None) of :func:`_query_logits64` for the cotangent ``dlogits``
    (..., L, S), which is 0 wherever a unit is excluded (its weight is 0)."""
    scaled = m.alpha[..., None, :] * dlogits
    if m.kind == "magnitude":  # alpha xi.q (- alpha/2 |q|^2) (+ beta/2 |mu|^2)
        dq = scaled @ keys
        if m.alpha_varies:
            dq = dq - scaled.sum(axis=-1)[..., None] * q
        dkeys = _swap(scaled) @ q
        dvalues = None
        if m.values is not None:
            dvalues = (m.beta * dlogits.sum(axis=-2))[..., None] * m.values
        return dq, dkeys, dvalues
    diff = q[..., :, None, :] - keys[..., None, :, :]  # -alpha/2 |q - xi|^2
    dq = -np.einsum("...ls,...lsd->...ld", scaled, diff)
    dkeys = np.einsum("...ls,...lsd->...sd", scaled, diff)
    return dq, dkeys, None


def _softmax_vjp64(weights, dweights_times_weights):
    """d logits of a softmax over the last axis from ``c = w * dw``: c - w sum(c)."""
    c = dweights_times_weights
    return c - weights * c.sum(axis=-1, keepdims=True)


def _attention_vjp64(m: _Model, v_init, iters, grad):
    """(dq, dkeys, dvalues) of ``iters`` EM steps (eqs. (13)-(14)) by reverse accumulation."""
    a = _query_logits64(m, m.q, m.keys)
    empty = np.isneginf(a).all(axis=-1)
    iterates = [None if v_init is None else _checks.as_float64(v_init)]
    weights = []
    for _ in range(iters):
        weights.append(_softmax64(_em_logits64(m, a, iterates[-1])))
        iterates.append(weights[-1] @ m.values)
    g = np.where(empty[..., None], 0.0, grad)  # empty rows are constants
    dvalues = np.zeros_like(m.values)
    da = np.zeros_like(a)
    for t in reversed(range(iters)):
        w, new, old = weights[t], iterates[t + 1], iterates[t]
        dvalues = dvalues + _swap(w) @ g  # v = sum_u w_u mu_u
        spread = m.values[..., None, :, :] - new[..., :, None, :]  # mu_u - v_{t+1}
        dlogits = w * np.einsum("...lse,...le->...ls", spread, g)
        da = da + dlogits
        if old is None:
            break
        scaled = dlogits * m.beta[..., None, :]  # -beta_u/2 |v_t - mu_u|^2
        diff = old[..., :, None, :] - m.values[..., None, :, :]
        dvalues = dvalues + np.einsum("...ls,...lse->...se", scaled, diff)
        g = -np.einsum("...ls,...lse->...le", scaled, diff)
    dq, dkeys, dvalues_prior = _query_logits_vjp64(m, m.q, m.keys, da)
    if dvalues_prior is not None:
        dvalues = dvalues + dvalues_prior
    return dq, dkeys, dvalues


def _keys_update_vjp64(m: _Model, keys, gamma, form, grad):
    """(dqueries, dkeys0, dkeys_t) of one step of :func:`_keys_update64` at keys xi^t."""
    q, keys0 = m.q, m.keys
    log_w = _responsibilities64(m, keys, None)
    log_total = _unit_totals64(log_w)
    responsible = np.isfinite(log_total)[..., None]
    safe_total = np.where(responsible[..., 0], log_total, 0.0)
    share = np.exp(np.where(np.isneginf(log_w), -np.inf, log_w - safe_total[..., None, :]))
    alpha, gam = m.alpha[..., None], gamma[..., None]
    pinned = np.isinf(gam)
    active = responsible & ~pinned
    g = np.where(active, grad, 0.0)
    finite_gam = np.where(pinned, 0.0, gam)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if form == "paper":  # eq. (28): d/dS_k = alpha/((alpha+gamma) W_k)
            coef = alpha / (alpha + finite_gam)
            centre_coef = finite_gam / (alpha + finite_gam)
            ref = np.einsum("...ls,...ld->...sd", share, q)  # q-bar
        else:  # alpha w_ik / (gamma + alpha W_k) = alpha share_ik / (gamma / W_k + alpha)
            ratio = _prior_ratio64(finite_gam, safe_total)
            coef = np.where(np.isinf(ratio), 0.0, alpha / (ratio + alpha))
            centre_coef = np.where(np.isinf(ratio), 1.0, ratio / (ratio + alpha))
            ref = _keys_update64(m, keys0, keys, gamma, form)
    coef_share = share * _swap(coef)  # (..., L, S)
    dq = coef_share @ g
    c = coef_share * np.einsum("...lsd,...sd->...ls", q[..., :, None, :] - ref[..., None, :, :], g)
    w = np.exp(log_w)
    dq_logits, dkeys_t, _ = _query_logits_vjp64(m, q, keys, _softmax_vjp64(w, c))
    dcentre = np.where(active, centre_coef * grad, 0.0)
    dkeys0 = np.where(pinned & responsible, grad, 0.0)
    dkeys_t = dkeys_t + np.where(responsible, 0.0, grad)
    if form == "map_recentred":
        dkeys_t = dkeys_t + dcentre
    else:
        dkeys0 = dkeys0 + dcentre
    return dq + dq_logits, dkeys0, dkeys_t


def _keys_vjp64(m: _Model, gamma, form, iters, grad):
    states = _keys_states64(m, gamma, form, iters)
    dq = np.zeros_like(m.q)
    dkeys0 = np.zeros_like(m.keys)
    g = grad
    for keys in reversed(states[:-1]):
        dq_t, dkeys0_t, g = _keys_update_vjp64(m, keys, gamma, form, g)
        dq, dkeys0 = dq + dq_t, dkeys0 + dkeys0_t
    return dq, dkeys0 + g  # xi^0 is keys0


def _priors_update_vjp64(m: _Model, pi, eta, form, grad):
    """(dqueries, dkeys, dpi^t) of one step of eqs. (33)-(34) at priors pi^t."""
    log_w = _prior_responsibilities64(m, pi)
    w = np.exp(log_w)
    w_bar = np.exp(_unit_totals64(log_w))
    mass = w_bar * (1 + eta) if form == "paper" else w_bar + eta
    norm = mass.sum(axis=-1, keepdims=True)
    new = mass / norm
    dmass = (grad - (grad * new).sum(axis=-1, keepdims=True)) / norm
    dw_bar = dmass * (1 + eta) if form == "paper" else dmass
    dlogits = _softmax_vjp64(w, w * dw_bar[..., None, :])
    with np.errstate(divide="ignore"):
        array_model = m._replace(kind="array", log_prior=np.log(pi))
    dq, dkeys, _ = _query_logits_vjp64(array_model, m.q, m.keys, dlogits)
    with np.errstate(divide="ignore", invalid="ignore"):
        dpi = np.where(pi > 0, dlogits.sum(axis=-2) / pi, 0.0)  # log pi_k enters the logits
    return dq, dkeys, dpi


def _priors_vjp64(m: _Model, pi0, eta_kind, eta_value, form, iters, grad):
    states, eta = _priors_states64(m, pi0, eta_kind, eta_value, form, iters)
    dq, dkeys = np.zeros_like(m.q), np.zeros_like(m.keys)
    g = grad
    for pi in reversed(states[:-1]):
        dq_t, dkeys_t, g = _priors_update_vjp64(m, pi, eta, form, g)
        dq, dkeys = dq + dq_t, dkeys + dkeys_t
    return dq, dkeys  # pi^0 is not differentiated (a keyword argument)


def _cotangent(grad_out, shape, target, rank):
    """grad_out validated (finite, at least ``rank`` dims) and broadcast to ``shape``."""
    grad = _checks.finite_array(grad_out, "grad_out", rank)
    return _checks.broadcast(grad, shape, "grad_out", target)


def _originals(arrays):
    """The positional arrays as passed (validated, before batch broadcasting)."""
    return [(name, _checks.finite_array(arr, name, ndim)) for name, arr, ndim in arrays]


def _reduced(grads, originals):
    """float64 gradients of the broadcast problem summed back to the arguments' shapes."""
    from .broadcast import reduce_to

    return [reduce_to(g, arr.shape) for g, (_, arr) in zip(grads, originals, strict=True)]


def attention_vjp(
    q,
    keys,
    values,
    grad_out,
    *,
    alpha,
    beta=0.0,
    prior="uniform",
    v_init=None,
    iters=1,
    form="paper",
    mask=None,
    causal=False,
    window=None,
    align="top_left",
    empty_rows="zero",
    precision="float64",
    out_dtype=None,
):
    """Vector-Jacobian product of :func:`attention`: the gradients of ``sum(grad_out * v_T)``.

    The derivative of the stated finite computation, the ``iters`` EM steps of eqs. (13)-(14)
    (Movellan & Gabbur) as run, by reverse accumulation: with ``l_u`` the E-step logits,
    ``w = softmax(l)`` and ``v_{t+1} = sum_u w_u mu_u``,

    .. math::

        \\frac{\\partial L}{\\partial l_u} = w_u\\, g \\cdot (\\mu_u - v_{t+1}), \\qquad
        \\frac{\\partial L}{\\partial \\mu_u} \\mathrel{+}= w_u\\, g, \\qquad
        \\frac{\\partial L}{\\partial v_t} = -\\sum_u \\frac{\\partial L}{\\partial l_u}
            \\beta_u (v_t - \\mu_u),

    then through the query logits (eq. (14) or the magnitude prior's eqs. (17)-(18)) to q and
    the keys. v_init, alpha, beta and the prior are constants (not differentiated).

    Parameters
    ----------
    q : array (..., L, D)
    keys : array (..., S, D)
    values : array (..., S, E)
    grad_out : array (..., L, E)
        The cotangent of the output.
    alpha, beta, prior, v_init, iters, form, mask, causal, window, align, empty_rows
        As :func:`attention` (``tol``, ``return_trace`` and ``backend`` have no gradient).
    precision : {"float64", "exact"}
        "exact": each gradient element the exact derivative of the computation rounded once
        to ``out_dtype`` (the exact row evaluator differentiated as run on rigorous intervals,
        :mod:`refattn.exact.autodiff`, and the Ziv loop). "float64": the reverse pass above
        in NumPy with log-space weights; no a-priori bound is claimed. Measured against the
        exact path (300 random cases, L, S, D, E <= 5, inputs ~ N(0, s^2) with s up to 3,
        iters <= 3): errors up to 18 (attention_vjp), ~300 (adapt_keys_vjp) and 22
        (adapt_priors_vjp) times 2**-52 (max |exact gradient| + max |grad_out|), growing
        with the softmax condition 1 + 2 max|logit|; the tests hold it to a first-order
        estimate (tests/registry.py ``gmm_vjp_bound``).
    out_dtype : dtype, optional
        Exact path only.

    Returns
    -------
    AttentionVJP(dq, dkeys, dvalues), shaped as q, keys, values (gradients of arguments
    broadcast along the batch are summed). Empty rows (no allowed unit) are constants: they
    contribute nothing, whatever ``empty_rows``.

    Notes
    -----
    Exact path: one batch element is one row of the Ziv loop (all of it when an argument is
    broadcast along the batch, since its gradient sums over the batch before the rounding).
    A gradient that cancels exactly to 0 is returned as +0. A gradient that is exactly a
    rounding midpoint is settled by the rational fallback only when the batch element's
    whole computation is rational (all weights ties); otherwise the Ziv loop raises
    :class:`refattn.exact.UndecidedRoundingError` (single-unit rows and single-query key
    adaptation are evaluated exactly, so they do not).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> q = np.array([[0.0, 1.0]]); keys = np.array([[0.0, 1.0], [1.0, 0.0]])
    >>> values = np.array([[1.0], [0.0]])
    >>> gmm.attention_vjp(q, keys, values, np.ones((1, 1)), alpha=1.0).dvalues.round(6).tolist()
    [[0.731059], [0.268941]]
    """
    precision = _checks.precision(precision)
    m, v_init = _attention_model(
        q, keys, values, alpha, beta, prior, form, mask, causal, window, align, empty_rows, v_init
    )
    iters = _iters(iters)
    grad = _cotangent(grad_out, m.q.shape[:-1] + (m.values.shape[-1],), "(..., L, E)", 2)
    originals = _originals([("q", q, 2), ("keys", keys, 2), ("values", values, 2)])
    if precision == "exact":
        return AttentionVJP(
            *exact.attention_vjp(m, originals, v_init, iters, grad, _checks.out_dtype(out_dtype))
        )
    m = _float64(m)
    grads = _attention_vjp64(m, v_init, iters, _checks.as_float64(grad))
    return AttentionVJP(*_reduced(grads, originals))


def adapt_keys_vjp(
    queries,
    keys0,
    grad_out,
    *,
    alpha,
    gamma,
    prior="uniform",
    iters=1,
    form="paper",
    precision="float64",
    out_dtype=None,
):
    """Vector-Jacobian product of :func:`adapt_keys`: gradients of ``sum(grad_out * xi^T)``.

    The derivative of the ``iters`` E/M steps as run (eqs. (23), (28)-(29), or the MAP forms):
    per step, with ``S_k = sum_i w_ik q_i`` and ``W_k = sum_i w_ik``, the M-step's cotangent
    ``G_k`` gives (paper form, eq. (28))

    .. math::

        w_{ik} \\frac{\\partial L}{\\partial w_{ik}} = \\frac{\\alpha_k}{\\alpha_k + \\gamma_k}
            \\frac{w_{ik}}{W_k} (q_i - \\bar q_k) \\cdot G_k, \\qquad
        \\frac{\\partial L}{\\partial q_i} \\mathrel{+}= \\sum_k
            \\frac{\\alpha_k}{\\alpha_k + \\gamma_k} \\frac{w_{ik}}{W_k} G_k,

    (the MAP forms: ``alpha_k w_ik / (gamma_k + alpha_k W_k)`` and ``xi^{t+1}_k`` in place of
    ``q̄_k``), then through the softmax of eq. (23) to the queries and the current keys.

    Parameters
    ----------
    queries : array (..., L, D)
    keys0 : array (..., S, D)
    grad_out : array (..., S, D)
    alpha, gamma, prior, iters, form : as :func:`adapt_keys` (constants).
    precision, out_dtype : as :func:`attention_vjp`.

    Returns
    -------
    AdaptKeysVJP(dqueries, dkeys0), shaped as queries and keys0.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> queries = np.array([[2.0, 0.0]]); keys0 = np.array([[0.0, 0.0]])
    >>> gmm.adapt_keys_vjp(queries, keys0, np.ones((1, 2)), alpha=1.0, gamma=1.0).dqueries.tolist()
    [[0.5, 0.5]]
    """
    precision = _checks.precision(precision)
    m, gamma, form, iters = _keys_problem(queries, keys0, alpha, gamma, prior, iters, form)
    grad = _cotangent(grad_out, m.keys.shape, "(..., S, D)", 2)
    originals = _originals([("q", queries, 2), ("keys", keys0, 2)])
    if precision == "exact":
        return AdaptKeysVJP(
            *exact.adapt_keys_vjp(
                m, originals, gamma, form, iters, grad, _checks.out_dtype(out_dtype)
            )
        )
    grads = _keys_vjp64(_float64(m), gamma, form, iters, _checks.as_float64(grad))
    return AdaptKeysVJP(*_reduced(grads, originals))


def adapt_priors_vjp(
    queries,
    keys,
    grad_out,
    *,
    alpha,
    eta,
    pi0,
    iters=1,
    form="paper",
    precision="float64",
    out_dtype=None,
):
    """Vector-Jacobian product of :func:`adapt_priors`: gradients of ``sum(grad_out * pi^T)``.

    The derivative of the ``iters`` steps of eqs. (33)-(34) as run: with ``m_k`` the masses
    (``w̄_k (1 + eta_k)`` or ``w̄_k + eta_k``) and ``pi_k = m_k / sum_j m_j``,

    .. math::

        \\frac{\\partial L}{\\partial m_k} = \\frac{G_k - \\sum_j G_j \\pi_j}{\\sum_j m_j},
        \\qquad \\frac{\\partial L}{\\partial \\log \\pi^t_k} = \\sum_i
            \\frac{\\partial L}{\\partial l_{ik}},

    through the softmax of eq. (23) (whose logits hold log pi^t) to the queries, the keys and
    the previous priors. pi0, eta and alpha are constants.

    Parameters
    ----------
    queries : array (..., L, D)
    keys : array (..., S, D)
    grad_out : array (..., S)
    alpha, eta, pi0, iters, form : as :func:`adapt_priors`.
    precision, out_dtype : as :func:`attention_vjp`.

    Returns
    -------
    AdaptPriorsVJP(dqueries, dkeys), shaped as queries and keys.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import gmm
    >>> queries = np.array([[0.0], [1.0]]); keys = np.array([[0.0], [1.0]])
    >>> grads = gmm.adapt_priors_vjp(queries, keys, np.array([1.0, -1.0]), alpha=1.0, eta=0.0,
    ...                              pi0=np.array([0.5, 0.5]))
    >>> bool(grads.dqueries.shape == (2, 1))
    True
    """
    precision = _checks.precision(precision)
    m, pi0, eta_kind, eta_value, form, iters = _priors_problem(
        queries, keys, alpha, eta, pi0, iters, form
    )
    grad = _cotangent(grad_out, m.keys.shape[:-1], "(..., S)", 1)
    originals = _originals([("q", queries, 2), ("keys", keys, 2)])
    if precision == "exact":
        return AdaptPriorsVJP(
            *exact.adapt_priors_vjp(
                m,
                originals,
                pi0,
                eta_kind,
                eta_value,
                form,
                iters,
                grad,
                _checks.out_dtype(out_dtype),
            )
        )
    grads = _priors_vjp64(
        _float64(m), pi0, eta_kind, eta_value, form, iters, _checks.as_float64(grad)
    )
    return AdaptPriorsVJP(*_reduced(grads, originals))
