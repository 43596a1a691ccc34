"""Input validation in one place: each message names the argument, what it got, what it needs."""

from __future__ import annotations

import numbers

import ml_dtypes
import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
PRECISIONS = ("float64", "exact")


def float_array(x, name: str, *, ndim_min: int = 0) -> np.ndarray:
    """``x`` as a NumPy array of a supported float dtype (no copy when already one)."""
    if x is None:
        raise TypeError(f"{name}: expected an array, got None")
    arr = as_array(x, name)
    if arr.dtype.name not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected a float array ({', '.join(FLOAT_DTYPES)}), "
            f"got dtype {arr.dtype.name} with shape {arr.shape}"
        )
    if arr.ndim < ndim_min:
        raise ValueError(f"{name}: expected at least {ndim_min} dimensions, got shape {arr.shape}")
    return arr


def as_array(x, name: str) -> np.ndarray:
    """``np.asarray(x)``, with NumPy's conversion errors (ragged lists, ...) naming ``name``."""
    try:
        return np.asarray(x)
    except (ValueError, TypeError, OverflowError) as error:
        raise ValueError(
            f"{name}: expected a rectangular array, got a {type(x).__name__} NumPy cannot "
            f"convert ({error})"
        ) from None


def axis(value, name: str = "axis") -> int:
    """An integer axis (bool and non-integers are a TypeError naming the argument)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    return int(value)


def as_float64(arr: np.ndarray) -> np.ndarray:
    """Exact widening of any supported float array to float64."""
    return np.asarray(arr, dtype=np.float64)


def bool_array(x, name: str) -> np.ndarray:
    arr = as_array(x, name)
    if arr.dtype != np.bool_:
        raise TypeError(
            f"{name}: expected a boolean array (True = attend/keep), "
            f"got dtype {arr.dtype.name} with shape {arr.shape}"
        )
    return arr


def choice(value, name: str, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value


def precision(value) -> str:
    return choice(value, "precision", PRECISIONS)


def real_scalar(value, name: str, *, positive: bool = False, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if not (isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind == "f"):
            raise TypeError(f"{name}: expected a real number, got {_short(value)}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(
            f"{name}: expected a number within the float64 range (|x| < 1.8e308), "
            f"got {_short(value)}"
        ) from None
    if not np.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    return value


def _short(value) -> str:
    """repr of a value, shortened (a 400-digit int is not a useful message)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:25]}...{text[-10:]} ({len(text)} chars)"


def iteration_tol(tol, precision: str, counted: str):
    """Validate an early-stopping tolerance of an iterative float64 path.

    ``counted`` names what the exact path evaluates instead (e.g. "`iters` iterations"): the
    exact path computes exactly that finite computation, so it takes no tolerance.
    """
    if tol is None:
        return None
    if precision == "exact":
        raise ValueError(f"tol: the exact path evaluates exactly {counted}; pass tol=None")
    tol = real_scalar(tol, "tol")
    if tol < 0:
        raise ValueError(f"tol: expected a number >= 0, got {tol}")
    return tol


def broadcast(arr: np.ndarray, shape: tuple, name: str, target: str) -> np.ndarray:
    """Broadcast ``arr`` to ``shape`` or raise naming both shapes."""
    try:
        return np.broadcast_to(arr, shape)
    except ValueError:
        raise ValueError(
            f"{name}: shape {arr.shape} is not broadcastable to {target} {shape}"
        ) from None


def out_dtype(value, default="float64") -> np.dtype:
    """The exact path's output dtype (float64, float32, float16, bfloat16)."""
    if value is None:
        value = default
    try:
        dt = np.dtype(value)
    except (TypeError, ValueError):
        raise TypeError(f"out_dtype: expected a float dtype, got {value!r}") from None
    if dt.name not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {list(FLOAT_DTYPES)}, got {dt.name}")
    return dt


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def finite_array(x, name: str, ndim: int) -> np.ndarray:
    """A float array of at least ``ndim`` dims with finite values only (named on failure)."""
    arr = float_array(x, name, ndim_min=ndim)
    if not np.isfinite(as_float64(arr)).all():
        raise ValueError(
            f"{name}: expected finite values (shape {arr.shape}, dtype "
            f"{arr.dtype.name}); NaN/Inf found"
        )
    return arr
