"""Validation of :mod:`refattn.gmm`'s inputs: the model every path (float64, exact, Numba)
evaluates, broadcast to a common batch, and its allowed set (:mod:`refattn.spec`'s rule)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _checks, spec

PRIORS = ("uniform", "magnitude")
ATTENTION_FORMS = ("paper", "unnormalised")
KEY_FORMS = ("paper", "map", "map_recentred")
PRIOR_FORMS = ("paper", "map")
BACKENDS = ("numpy", "numba")


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


def iteration_count(value, name="iters"):
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


class Model(NamedTuple):
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
    # adapt_keys only: values v_i (B..., L, E) whose likelihood enters the key E-step
    v_init: np.ndarray | None = None


def build_model(q, keys, values, alpha, beta, prior, *, need_values=True, names=("q", "keys")):
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

    return Model(
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


def allowed_set(m: Model, mask, causal, window, align):
    """The allowed set (B..., L, S) by :func:`refattn.spec.allowed_mask` (the one rule), or
    None when unrestricted (every unit allowed: the Numba kernel needs it so)."""
    length, units = m.q.shape[-2], m.keys.shape[-2]
    if mask is None and not causal and window is None:
        spec.offset_of(align, length, units)  # validates align
        return None
    if not isinstance(causal, bool | np.bool_):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    want = m.q.shape[:-2] + (length, units)
    if mask is not None:
        mask = _checks.broadcast(_checks.bool_array(mask, "mask"), want, "mask", "(..., L, S)")
    allowed = spec.allowed_mask(
        length, units, mask=mask, causal=bool(causal), window=window, align=align
    )
    return np.broadcast_to(allowed, want)


def cotangent(grad_out, shape, target, rank):
    """grad_out validated (finite, at least ``rank`` dims) and broadcast to ``shape``."""
    grad = _checks.finite_array(grad_out, "grad_out", rank)
    return _checks.broadcast(grad, shape, "grad_out", target)


def passed_arrays(arrays):
    """The positional arrays as passed (validated, before batch broadcasting)."""
    return [(name, _checks.finite_array(arr, name, ndim)) for name, arr, ndim in arrays]


def summed_to_arguments(grads, originals):
    """float64 gradients of the broadcast problem summed back to the arguments' shapes."""
    from ..broadcast import reduce_to

    return [reduce_to(g, arr.shape) for g, (_, arr) in zip(grads, originals, strict=True)]
