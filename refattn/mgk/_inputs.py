"""Validation of :mod:`refattn.mgk`'s inputs (shapes, mixture weights, variances), the
allowed set (:mod:`refattn.spec`'s rule) and the option spellings."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .. import _checks, spec
from ..exact import mgk as exact
from ..logspace import logsumexp

MODES = ("soft", "hard")
BACKENDS = ("numpy", "numba")
FEATURE_MAPS = ("elu+1",)
#: ``linear_attention(mlk_form=...)``: refattn's mixture of kernels, and the two readings of
#: the public transformer-mgk code (see :func:`linear_attention`).
MLK_FORMS = ("mixture", "lra", "lm")
#: ``em_update_pi(pi_update=...)``: refattn's joint responsibilities, or the public code's
#: per-key average (see :func:`em_update_pi`).
PI_UPDATES = ("joint", "per_key")
#: ``attention(pi_form=...)``: each key's mixture weights a distribution (the notes' (N4)), or
#: free non-negative weights (the public code's rbf2keys: learnt pi_0, pi_1, clamped to [0, 1]).
PI_FORMS = ("distribution", "free")
#: The constant the public language-modelling code adds to the MLK denominator
#: (``mlk_form="lm"``), taken at its float64 value.
LM_EPS = exact.LM_EPS


class MGKGrads(NamedTuple):
    """Result of :func:`attention_vjp` and :func:`linear_attention_vjp`.

    dq : (..., L, D), dkeys : (..., S, R, D), dv : (..., S, E), each in its argument's shape.
    """

    dq: np.ndarray
    dkeys: np.ndarray
    dv: np.ndarray


def validated_inputs(q, keys, v):
    q = _checks.float_array(q, "q", ndim_min=2)
    keys = _checks.float_array(keys, "keys", ndim_min=3)
    if keys.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"keys: expected shape (..., S, R, D) with D = {q.shape[-1]} (as q "
            f"{q.shape}), got {keys.shape}"
        )
    arrays = [q.shape[:-2], keys.shape[:-3]]
    if v is not None:
        v = _checks.float_array(v, "v", ndim_min=2)
        if v.shape[-2] != keys.shape[-3]:
            raise ValueError(
                f"v: expected S = {keys.shape[-3]} rows (as keys {keys.shape}), got shape {v.shape}"
            )
        arrays.append(v.shape[:-2])
    try:
        batch = np.broadcast_shapes(*arrays)
    except ValueError:
        raise ValueError(
            f"leading (batch) dimensions do not broadcast: q {q.shape}, keys {keys.shape}"
            + ("" if v is None else f", v {v.shape}")
        ) from None
    q = np.broadcast_to(q, batch + q.shape[-2:])
    keys = np.broadcast_to(keys, batch + keys.shape[-3:])
    if v is not None:
        v = np.broadcast_to(v, batch + v.shape[-2:])
    return q, keys, v, batch


def checked_sigma2(sigma2, shape):
    """(array float64 broadcast to (..., S, R), varies over (S, R))."""
    if np.ndim(sigma2) == 0 and not isinstance(sigma2, np.ndarray):
        wide = np.asarray(_checks.real_scalar(sigma2, "sigma2"))
    else:
        wide = _checks.as_float64(_checks.float_array(sigma2, "sigma2"))
    if not np.isfinite(wide).all() or (wide <= 0).any():
        raise ValueError(
            f"sigma2: expected finite variances > 0, got min "
            f"{np.nanmin(wide)!r} (shape {wide.shape})"
        )
    wide = _checks.broadcast(wide, shape, "sigma2", "(..., S, R)")
    flat = wide.reshape(shape[:-2] + (-1,))
    return wide, bool(flat.shape[-1] > 1 and (flat != flat[..., :1]).any())


def _distribution_slack(dtype, count):
    """Tolerance on sum(pi) = 1: ``count`` roundings of the input's own format."""
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7}.get(np.dtype(dtype).name)
    return count * (eps if eps is not None else float(np.finfo(dtype).eps))


def checked_log_pi(log_pi, shape, distribution=True):
    """log pi_jr, broadcast to (..., S, R); each key's mixture must be a distribution unless
    ``distribution`` is False (then any log weights, -inf allowed, NaN and +inf not)."""
    components = shape[-1]
    if log_pi is None:
        return np.full(shape, -math.log(components)), np.float64
    arr = _checks.float_array(log_pi, "log_pi", ndim_min=2)
    wide = _checks.as_float64(arr)
    if np.isnan(wide).any() or np.isposinf(wide).any():
        raise ValueError(
            f"log_pi: NaN or +inf found (shape {wide.shape}); expected log mixture weights"
        )
    wide = _checks.broadcast(wide, shape, "log_pi", "(..., S, R)")
    if not distribution:
        return wide, arr.dtype
    totals = logsumexp(wide, axis=-1)
    slack = _distribution_slack(arr.dtype, components + 2)
    if not (np.abs(totals) <= slack).all():
        worst = totals.ravel()[np.argmax(np.abs(totals).ravel())]
        raise ValueError(
            f"log_pi: each key's weights must be a distribution over R = "
            f"{components} components (logsumexp 0 within {slack:.3g}); got a "
            f"logsumexp of {worst!r}"
        )
    return wide, arr.dtype


def checked_pi(pi, shape, distribution=True):
    arr = _checks.float_array(pi, "pi", ndim_min=2)
    wide = _checks.as_float64(arr)
    if not np.isfinite(wide).all() or (wide < 0).any():
        raise ValueError(f"pi: expected mixture weights >= 0 and finite (shape {wide.shape})")
    wide = _checks.broadcast(wide, shape, "pi", "(..., S, R)")
    if not distribution:
        return wide
    sums = wide.sum(axis=-1)
    slack = _distribution_slack(arr.dtype, shape[-1] + 1)
    if not (np.abs(sums - 1) <= slack).all():
        worst = sums.ravel()[np.argmax(np.abs(sums - 1).ravel())]
        raise ValueError(
            f"pi: each key's weights must sum to 1 over R = {shape[-1]} "
            f"components (within {slack:.3g}); got a sum of {worst!r}"
        )
    return wide


# --------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------


def finite(message, *named) -> None:
    """A ValueError ``"<name>: <message> (shape ...)"`` for the first array with NaN or Inf."""
    for name, arr in named:
        if not np.isfinite(_checks.as_float64(arr)).all():
            raise ValueError(f"{name}: {message} (shape {arr.shape})")


def gaussian_problem(q, keys, v, sigma2, log_pi, pi_form):
    """The checked ``(q, keys, v, batch, sigma2, sigma_varies, log_pi)`` of
    :func:`refattn.mgk.attention` and its vjp (arrays broadcast to the batch)."""
    if v is None:
        raise TypeError("v: expected a float array (..., S, E), got None")
    q, keys, v, batch = validated_inputs(q, keys, v)
    comp_shape = batch + keys.shape[-3:-1]
    sigma2, sigma_varies = checked_sigma2(sigma2, comp_shape)
    distribution = _checks.choice(pi_form, "pi_form", PI_FORMS) == "distribution"
    log_pi, _ = checked_log_pi(log_pi, comp_shape, distribution)
    return q, keys, v, batch, sigma2, sigma_varies, log_pi


def linear_problem(q, keys, v, pi, feature_map, mlk_form, mask, causal, window, align):
    """The checked ``(q, keys, v, batch, pi, form, allowed)`` of
    :func:`refattn.mgk.linear_attention` and its vjp (finite inputs only)."""
    _checks.choice(feature_map, "feature_map", FEATURE_MAPS)
    form = _checks.choice(mlk_form, "mlk_form", MLK_FORMS)
    if v is None:
        raise TypeError("v: expected a float array (..., S, E), got None")
    q, keys, v, batch = validated_inputs(q, keys, v)
    pi = checked_pi(pi, batch + keys.shape[-3:-1], form == "mixture")
    finite("expected finite values", ("q", q), ("keys", keys), ("v", v))
    length, units = q.shape[-2], keys.shape[-3]
    allowed = allowed_set(length, units, batch, mask, causal, window, align)
    return q, keys, v, batch, pi, form, allowed


def cotangent(grad_out, q, v, batch):
    """``grad_out`` broadcast to the output's (..., L, E), finite."""
    go = _checks.float_array(grad_out, "grad_out", ndim_min=2)
    go = _checks.broadcast(go, batch + (q.shape[-2], v.shape[-1]), "grad_out", "(..., L, E)")
    finite("the vjp expects finite values", ("grad_out", go))
    return go


def allowed_set(length, units, batch, mask, causal=False, window=None, align="top_left"):
    """The allowed set (..., L, S) of :func:`refattn.spec.allowed_mask` (the one rule),
    broadcast to the batch of q and keys."""
    return _checks.broadcast(
        spec.allowed_mask(length, units, mask=mask, causal=causal, window=window, align=align),
        batch + (length, units),
        "mask",
        "(..., L, S) of q and keys",
    )
