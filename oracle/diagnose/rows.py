"""Two failures that need words, not models: errors under one ulp, and rows with no key.

* :func:`within_one_ulp`: in the tight tier ((T7) of :mod:`oracle.judging.tolerance`) an
  element can fail while lying within one ulp of the exact truth: (T7) asks for the expected
  error of a correct float32-accumulating kernel on that element, which for well-conditioned
  elements is below one rounding of the output dtype. No precision model explains such a
  failure (an implementation off by less than one ulp did not accumulate in a narrower type),
  so it is named as what it is. The default tier never fails such an element: its threshold
  is at least ``3u`` of the natural scale ``s >= |out|``, and one ulp is at most ``2u |out|``.
* :func:`mark_empty_row`: a row with no allowed key has natural scale 0, so its normalised
  error is divided by the dtype's smallest normal number (1e37 in float32, 1e307 in float64):
  the worst element of such a row is shown as "row has no allowed key: expected 0, got ...".
"""

from __future__ import annotations

import numpy as np

from oracle.judging import tolerance as tol

__all__ = ["within_one_ulp", "mark_empty_row"]


def within_one_ulp(tier, failing, values, truths, dtypes) -> str | None:
    """The diagnosis of a tight-tier failure whose every failing element is within one ulp of
    the exact truth, or None.

    ``failing`` are the failing checks, ``values`` / ``truths`` / ``dtypes`` map their
    quantity ("out", "lse") to the implementation's value, the float64 truth and the dtype it
    is stored in.

    >>> from types import SimpleNamespace
    >>> check = SimpleNamespace(quantity="out", errors=np.array([1e-7]),
    ...                         threshold=SimpleNamespace(value=np.array([1e-8])))
    >>> within_one_ulp("tight", [check], {"out": np.array([1.0 + 2**-23])},
    ...                {"out": np.array([1.0 + 2**-25])}, {"out": "float32"})[:16]
    'within one ulp: '
    """
    if tier != "tight" or not failing:
        return None
    largest = 0.0
    for check in failing:
        name = check.quantity
        if name not in values or values[name] is None or check.errors is None:
            return None
        over = check.errors > np.broadcast_to(np.asarray(check.threshold.value), check.errors.shape)
        value = np.reshape(np.asarray(values[name], dtype=np.float64), check.errors.shape)
        ulps = tol.ulp_distance(value[over], np.asarray(truths[name])[over], dtypes[name])
        if not ulps.size or not (ulps < 1).all():
            return None
        largest = max(largest, float(ulps.max()))
    names = ", ".join(sorted({c.quantity for c in failing}))
    return (
        f"within one ulp: every element of {names} over the threshold is within one ulp of "
        f"the exact truth (largest {largest:.3g} ulp): it passes the default tier and fails "
        f"the tight tier's rule, which asks these elements for the expected error of a correct "
        f"float32-accumulating kernel, below one rounding of the output (no narrower "
        f"accumulation is implied)"
    )


def mark_empty_row(check, empty, options, reading="zero") -> None:
    """Mark ``check``'s worst element when its row has no allowed key (and no sink), so it is
    shown as such rather than as a normalised error of 1e37-1e307 (:class:`Worst`).

    ``empty`` marks the rows with no allowed key (the allowed set's ``~allowed.any(-1)``, kept
    with the fixture's forward judging part: :func:`oracle.judging.parts.forward_part`)."""
    if check is None or check.errors is None or options.get("sinks") is not None:
        return
    rows_shape = check.errors.shape[:-1] if check.quantity == "out" else check.errors.shape
    empty = np.asarray(empty, dtype=bool)
    try:
        empty = np.broadcast_to(empty, rows_shape)
    except ValueError:  # a layout the rows cannot be matched in: shown as before
        return
    index = tuple(check.worst.index)
    row = index[:-1] if check.quantity == "out" else index
    if len(row) == empty.ndim and bool(empty[row]):
        check.worst.empty_row = reading
