"""The assertion helpers of the test suite: one NaN/Inf rule, one failure message shape.

Every helper takes ``(value, truth, ...)`` in that order, hides its own frame from the
traceback (``__tracebackhide__``) and, on failure, names what was compared (``what``, and the
``case``), the index of the worst element, its value, its truth, its error in ulp of ``dtype``
at the truth, the threshold, and a one-line reproduction (the pytest node id of the running
test).

The NaN/Inf rule (the same for every helper): an element *agrees* when value and truth are both
NaN or are equal (equal infinities included); any other element's error is
``|value - truth|``, +inf when either side is NaN or infinite, and fails unless it is within the
threshold. An infinite error always fails: NaN against a number, a number against an
infinity and opposite infinities are never excused, whatever the threshold.

Thresholds come from the caller (oracle.judging.tolerance or refattn's bounds), never from here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import refattn
from oracle.judging.tolerance import ulp, ulp_distance
from refattn import config

__all__ = [
    "assert_same_bits",
    "assert_within",
    "assert_norm_within",
    "elementwise_error",
    "reproduction",
    "assert_rounds_derivative",
]


def reproduction() -> str:
    """``python -m pytest '<node id>'`` of the test now running ("" outside pytest)."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    node = current.rsplit(" (", 1)[0]
    return f"python -m pytest '{node}'" if node else ""


def elementwise_error(value, truth) -> np.ndarray:
    """``|value - truth|`` under the module's NaN/Inf rule: 0 where they agree, +inf where one
    side is NaN or infinite and they do not."""
    value = np.asarray(value, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        agree = (value == truth) | (np.isnan(value) & np.isnan(truth))
        error = np.abs(value - truth)
    error = np.where(np.isfinite(value) & np.isfinite(truth), error, np.inf)
    return np.where(agree, 0.0, error)


def _label(what, case) -> str:
    return f"{what} [{case}]" if case else str(what)


def _fail(lines):
    __tracebackhide__ = True
    repro = reproduction()
    raise AssertionError("\n  ".join([*lines, *([f"reproduce: {repro}"] if repro else [])]))


def _element(name, index, value, truth, dtype) -> str:
    v, t = float(value[index]), float(truth[index])
    ulps = float(ulp_distance(v, t, dtype))
    return (
        f"worst element {name}[{', '.join(map(str, index))}]: value {v!r}, truth {t!r}, "
        f"{ulps:.3g} ulp of {dtype}"
    )


def _arrays(value, truth, label):
    __tracebackhide__ = True
    value = np.asarray(value, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    if value.shape != truth.shape:
        _fail([f"{label}: shape {value.shape}, truth has shape {truth.shape}"])
    return value, truth


def assert_same_bits(value, truth, *, what, case="", check_dtype=False):
    """Bit-for-bit equality: equal values with equal signs (``-0.0 != 0.0``), NaN == NaN.

    ``check_dtype`` also requires ``value.dtype == truth.dtype`` (both arrays).
    """
    __tracebackhide__ = True
    label = _label(what, case)
    if check_dtype and np.asarray(value).dtype != np.asarray(truth).dtype:
        _fail(
            [f"{label}: dtype {np.asarray(value).dtype}, truth has dtype {np.asarray(truth).dtype}"]
        )
    value, truth = _arrays(value, truth, label)
    same = ((value == truth) & (np.signbit(value) == np.signbit(truth))) | (
        np.isnan(value) & np.isnan(truth)
    )
    if not same.all():
        index = tuple(int(i) for i in np.argwhere(~same)[0])
        _fail(
            [
                f"{label}: {int((~same).sum())} of {same.size} elements differ "
                f"(threshold: bit for bit)",
                "first " + _element(str(what), index, value, truth, "float64"),
            ]
        )


def assert_within(value, truth, bound, *, what, case="", ulps=0.0, dtype="float64"):
    """Every element within its threshold: ``error <= bound + ulps * ulp(truth, dtype)``.

    ``bound`` is a scalar or an array broadcastable to the truth; the error follows the
    module's NaN/Inf rule. The message reports the element with the largest error/threshold.
    """
    __tracebackhide__ = True
    label = _label(what, case)
    value, truth = _arrays(value, truth, label)
    threshold = np.broadcast_to(np.asarray(bound, dtype=np.float64), truth.shape)
    if ulps:
        threshold = threshold + ulps * ulp(np.where(np.isfinite(truth), truth, 0.0), dtype)
    error = elementwise_error(value, truth)
    over = ~(error <= threshold) | np.isinf(error)
    if over.any():
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(over, error / threshold, 0.0)
        ratio = np.where(np.isnan(ratio), np.inf, ratio)
        index = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), ratio.shape))
        _fail(
            [
                f"{label}: {int(over.sum())} of {over.size} elements over the threshold",
                _element(str(what), index, value, truth, dtype),
                f"error {error[index]:.3e} > threshold {threshold[index]:.3e}",
            ]
        )


def assert_norm_within(value, truth, bound, *, what, case="", per_sample=False):
    """``||value - truth||_2 <= bound``; with ``per_sample`` one norm per index of axis 0
    (``bound`` then a scalar or one bound per sample).

    NaN or Inf disagreements make the norm +inf (the module's rule). The message names the
    worst sample and its worst element.
    """
    __tracebackhide__ = True
    label = _label(what, case)
    value, truth = _arrays(value, truth, label)
    error = elementwise_error(value, truth)
    rows = error.reshape(len(error), -1) if per_sample else error.reshape(1, -1)
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.sqrt((rows * rows).sum(axis=-1))
    norms = np.where(np.isnan(norms), np.inf, norms)
    limits = np.broadcast_to(np.asarray(bound, dtype=np.float64), norms.shape)
    over = ~(norms <= limits) | np.isinf(norms)
    if over.any():
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(over, norms / limits, 0.0)
        sample = int(np.argmax(np.where(np.isnan(ratio), np.inf, ratio)))
        flat = int(np.argmax(rows[sample]))
        shape = value.shape[1:] if per_sample else value.shape
        index = ((sample,) if per_sample else ()) + tuple(
            int(i) for i in np.unravel_index(flat, shape)
        )
        where = f"sample {sample}: " if per_sample else ""
        _fail(
            [
                f"{label}: {where}2-norm error {norms[sample]:.3e} > bound {limits[sample]:.3e}",
                _element(str(what), index, value, truth, "float64"),
            ]
        )


def assert_rounds_derivative(value, derivative, *, what, case="", dtype="float64"):
    """An exact-path gradient against a numerical derivative with an error estimate.

    ``derivative`` is an object array (..., 2) of (estimate, error bound) pairs (e.g.
    ``tests.naive.mp.naive_vjp``). Where the whole interval ``estimate -+ bound`` rounds to one
    value of ``dtype`` the gradient must be that value bit for bit; elsewhere (the interval
    straddles a rounding boundary, e.g. an exact 0) it must lie within the interval.
    """
    __tracebackhide__ = True
    from tests.naive.rounding import round_to_dtype

    value = np.asarray(value, dtype=np.float64)
    label = _label(what, case)
    for index in np.ndindex(*value.shape):
        estimate, bound = derivative[index]
        low, high = round_to_dtype(estimate - bound, dtype), round_to_dtype(estimate + bound, dtype)
        got = value[index]
        if low == high and np.signbit(low) == np.signbit(high):
            if not (got == low and np.signbit(got) == np.signbit(low)):
                _fail(
                    [
                        f"{label}: element {index} is {got!r}, the derivative rounds to "
                        f"{low!r} (estimate {float(estimate)!r} +- {float(bound):.3e})"
                    ]
                )
        elif not abs(got - estimate) <= bound:
            _fail(
                [
                    f"{label}: element {index} is {got!r}, outside the derivative's interval "
                    f"{float(estimate)!r} +- {float(bound):.3e}"
                ]
            )


def assert_caught_and_named(results, name, *, at_least=5):
    """A planted bug's validation ``results`` hold at least ``at_least`` failing cases (the
    issues' "fails >= 5 cases of its suite"), and every failing one has a diagnosis line
    containing ``name``."""
    failures = [r for r in results if r.verdict == "fail"]
    assert len(failures) >= at_least, [(r.name, r.verdict) for r in results]
    unnamed = [(r.name, r.diagnosis) for r in failures if not any(name in d for d in r.diagnosis)]
    assert not unnamed, unnamed


def vjp_problem(seed=0, heads=2, kv_heads=2, length=5, keys=6, dim=4, vdim=3, batch=1):
    """(rng, q, k, v, grad_out, grad_lse): Gaussian inputs of an exact-vjp test in the
    (B, H, L, D) / (B, K, S, D) / (B, K, S, E) layout."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, length, dim))
    k = rng.standard_normal((batch, kv_heads, keys, dim))
    v = rng.standard_normal((batch, kv_heads, keys, vdim))
    do = rng.standard_normal((batch, heads, length, vdim))
    gl = rng.standard_normal((batch, heads, length))
    return rng, q, k, v, do, gl


def exact_result(engine, q, k, v, out_dtype="float64", **opts):
    """(out, lse, weights) of ``refattn.attention(..., precision="exact")`` on the exact
    ``engine`` ("fast" or "referee", ``config.EXACT_ENGINE``), restored after the call."""
    saved = config.EXACT_ENGINE
    config.EXACT_ENGINE = engine
    try:
        return refattn.attention(
            q,
            k,
            v,
            precision="exact",
            out_dtype=out_dtype,
            return_lse=True,
            return_weights=True,
            **opts,
        )
    finally:
        config.EXACT_ENGINE = saved


def general_attention(monkeypatch, light: str, *args, **kwargs):
    """refattn.attention with its light path ``light`` (``"plain_gather"`` or
    ``"plain_exact_gather"``, a name in :mod:`refattn.attention`) switched off: the general
    path's result, to compare the light path against."""
    with monkeypatch.context() as patch:
        patch.setattr(sys.modules["refattn.attention"], light, lambda call: None)
        return refattn.attention(*args, **kwargs)


def sparse_decode_problem(dtype, *, heads, kv_heads, length, keys, dim, vdim, top, seed=0):
    """(q, k, v, key_indices) of a batch of 2 for the sparse-key light paths: standard normal
    q (2, H, L, D), k (2, K, S, D), v (2, K, S, E) in ``dtype`` and int32 key indices
    (2, K, L, T) drawn from -3 .. S + 3 (-1 sentinels, repeats and entries past S, which the
    set reading ignores or merges)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, heads, length, dim)).astype(dtype)
    k = rng.standard_normal((2, kv_heads, keys, dim)).astype(dtype)
    v = rng.standard_normal((2, kv_heads, keys, vdim)).astype(dtype)
    idx = rng.integers(-3, keys + 4, size=(2, kv_heads, length, top)).astype(np.int32)
    return q, k, v, idx


def digest_with_threads(script: str, threads: int, *, flags=(), timeout=900) -> str:
    """The last line ``script`` prints (a digest of its results) when run from the repository
    root in a fresh interpreter with ``NUMBA_NUM_THREADS=threads``: the thread-count
    determinism tests compare it across thread counts."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), PYTHONPATH=str(root))
    done = subprocess.run(
        [sys.executable, *flags, "-c", script],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"digest with {threads} threads failed:\n{done.stderr[-3000:]}"
    return done.stdout.strip().splitlines()[-1]
