"""A function's declared reading of rows with no allowed key (``empty_rows=``).

refattn gives a query row with no allowed key (every key masked, a causal row before the first
key, ``kv_lengths`` 0, ...) the output 0 and the lse ``-inf`` (``empty_rows="zero"``, the
default; docs/conventions.md). Libraries differ, and most have no option to change it:

* ``"zero"``: refattn's reading (FlashAttention, xformers, torch SDPA's flash and
  efficient kernels);
* ``"nan"``: ``0/0``: the row's output and lse are NaN (a ``-inf`` fill: torch's math path and
  ``nn.MultiheadAttention``'s weights, OpenVINO, Paddle, tinygrad, ONNX Runtime);
* ``"average"``: masked scores replaced or shifted by one large finite negative number, so
  every score of an empty row is the same and the row gets uniform weights ``1/S``: the
  output is the mean of ``v`` over **all** ``S`` keys of the call (padding keys included),
  and the lse depends on the library's fill value (transformers' eager path, Keras, Flax,
  ``jax.nn.dot_product_attention``).

:func:`declare` marks an implementation with its reading (``validate(..., empty_rows="nan")``,
``refattn-oracle validate --empty-rows nan``, the pytest plugin's ``--refattn-empty-rows``, or
a signature preset's ``empty_rows``). The judge (:func:`oracle.judging.judge.check_fixture`)
then reads each case through :func:`read_case`:

* the ``empty_rows`` option is never passed to the function (its behaviour is fixed);
* on a case with empty rows (and no attention sinks: a row with a sink is never empty) the
  expected output and lse of those rows become the declared reading's: 0 and ``-inf``; NaN and
  NaN; the mean of ``v`` and -- the lse of an averaged row being the fill value's, which no
  convention pins -- no lse check on that case (noted in the result's message). The
  baseline and the thresholds of the other rows are computed under the same reading;
* sigmoid attention (``normalizer="sigmoid"``) has no normaliser: a masked score's weight
  ``sigmoid(fill)`` is 0 for a ``-inf`` or a large finite fill alike, so its empty rows are
  expected 0 under every reading;
* a case the reading cannot be judged on is "not expressible" (the verdict "unsupported",
  never a pass): gradients of a case with empty rows under ``"nan"`` or ``"average"`` (a NaN
  row poisons dk and dv; an averaged row gives every key a share of ``dO``).

Examples
--------
>>> import numpy as np
>>> def nan_rows(q, k, v, mask=None):
...     return np.full(q.shape[:-1] + v.shape[-1:], np.nan)
>>> declare(nan_rows, "nan").empty_rows_reading
'nan'
>>> check_reading("mean")
Traceback (most recent call last):
...
ValueError: empty_rows: expected one of ['zero', 'nan', 'average'], got 'mean'
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from oracle.reading.baseline import dequantised_inputs, textbook_attention
from oracle.reading.heads import with_heads
from refattn.broadcast import expand_kv
from refattn.exact.rounding import format_of

__all__ = ["READINGS", "check_reading", "declare", "reading_of", "empty_rows", "read_case"]

#: What a function may give a row with no allowed key (see the module docstring).
READINGS = ("zero", "nan", "average")

#: The prefix of the message of a case a declared reading cannot be judged on.
NOT_EXPRESSIBLE = "not expressible"


def check_reading(reading) -> str | None:
    """``reading`` if it is None or one of :data:`READINGS`, else a ValueError naming it."""
    if reading is not None and reading not in READINGS:
        raise ValueError(f"empty_rows: expected one of {list(READINGS)}, got {reading!r}")
    return reading


def _without_empty_rows(function):
    """``function`` called without the ``empty_rows`` keyword (its reading is fixed)."""

    @functools.wraps(function)
    def call(*args, **options):
        options.pop("empty_rows", None)
        return function(*args, **options)

    return call


def declare(impl, reading):
    """``impl`` marked with its reading of empty rows (``impl`` itself when ``reading`` is
    None); the result never receives ``empty_rows`` and keeps ``impl``'s ``vjp``."""
    if check_reading(reading) is None:
        return impl
    marked = _without_empty_rows(impl)
    if hasattr(impl, "vjp"):
        marked.vjp = _without_empty_rows(impl.vjp)
    marked.empty_rows_reading = reading
    return marked


def reading_of(impl) -> str | None:
    """The reading ``impl`` declares (None: refattn's, with the ``empty_rows`` option)."""
    return getattr(impl, "empty_rows_reading", None)


def empty_rows(fixture) -> np.ndarray:
    """Boolean (..., H, L), or (L,) for a single head: the rows with no allowed key and no sink."""
    options = {n: x for n, x in fixture.options.items() if n not in ("return_lse", "empty_rows")}
    inputs = fixture.inputs
    allowed = textbook_attention(
        inputs["q"], inputs["k"], inputs["v"], dtype="float64", **options
    ).allowed
    empty = ~np.asarray(allowed).any(axis=-1)
    if options.get("sinks") is not None:
        empty = np.zeros_like(empty)
    return np.broadcast_to(empty, np.shape(fixture.truth["out"])[:-1])


def _mean_of_values(fixture) -> np.ndarray:
    """The mean of v over all S keys per query head, float64, shaped like a row of out."""
    inputs = fixture.inputs
    _, _, v, _ = dequantised_inputs(inputs["q"], inputs["k"], inputs["v"], fixture.options)
    v = np.asarray(v).astype(np.float64)
    if np.ndim(inputs["q"]) == 2:
        return v.mean(axis=-2, keepdims=True)
    heads = np.shape(fixture.truth["out"])[-3]
    gqa = fixture.options.get("gqa") or "interleave"
    return expand_kv(with_heads(v, "v"), heads, gqa).mean(axis=-2, keepdims=True)


def _rows_set(truth, rows, value, dtype=None):
    """``truth`` with the ``rows`` (a boolean of its leading axes) set to ``value``."""
    array = np.asarray(truth)
    wanted = np.asarray(value, dtype=np.float64)
    if dtype is not None:
        wanted = wanted.astype(format_of(dtype).dtype)
    mask = rows if array.ndim == rows.ndim else rows[..., None]
    return np.where(mask, wanted, array.astype(wanted.dtype)).astype(array.dtype)


def _refuse(function, reason):
    @functools.wraps(function)
    def refuse(*args, **options):
        raise NotImplementedError(f"{NOT_EXPRESSIBLE}: {reason}")

    return refuse


def read_case(fixture, impl, grads=False):
    """``(fixture, impl, note)``: the case read under ``impl``'s declared reading (see the
    module docstring): the expected values of the empty rows, the options the baseline sees,
    the implementation called without ``empty_rows`` (or refusing a case it cannot be judged
    on), and a note for the result's message ("" when none)."""
    reading = reading_of(impl)
    if reading is None:
        return fixture, impl, ""
    if fixture.options.get("normalizer") == "sigmoid":
        reading = "zero"  # no normaliser: sigmoid(fill) is 0 for a -inf or large finite fill
    rows = empty_rows(fixture)
    if not rows.any():
        return fixture, impl, ""
    gradients = grads and fixture.truth.get("dq") is not None
    if gradients and reading != "zero":
        reason = (
            f"the function gives rows with no allowed key {reading!r} (empty_rows={reading!r}); "
            f"its gradients there are not refattn's and cannot be judged"
        )
        return fixture, _refuse(impl, reason), ""
    truth = dict(fixture.truth)
    dtype = fixture.case.dtype
    note = ""
    if reading == "average":
        mean = _mean_of_values(fixture)
        truth["out"] = _rows_set(truth["out"], rows, mean, dtype)
        if "out_f64" in truth:
            truth["out_f64"] = _rows_set(truth["out_f64"], rows, mean)
        for name in ("lse", "lse_f64"):
            truth.pop(name, None)
        note = "lse not checked: the lse of an averaged empty row is the library's fill value's"
    else:
        fill, lse = (0.0, -np.inf) if reading == "zero" else (np.nan, np.nan)
        for name, value in (("out", fill), ("lse", lse)):
            if truth.get(name) is not None:
                truth[name] = _rows_set(truth[name], rows, value)
            if truth.get(f"{name}_f64") is not None:
                truth[f"{name}_f64"] = _rows_set(truth[f"{name}_f64"], rows, value)
    options = {**fixture.options, "empty_rows": reading}
    return dataclasses.replace(fixture, options=options, truth=truth), impl, note
