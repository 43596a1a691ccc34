"""Diagnosis of a failing linear-attention case: which alternative reading the output matches.

Each reading of :data:`oracle.reading.linear_chunked.DEVIATIONS` (the decay off by one at a
chunk boundary, the gate cumsum in bfloat16, the normalisation's eps outside the root or
missing, the triangular solve in bfloat16, no state reset at a packed-sequence boundary, beta
applied twice, exp for base-2 gates, the state transposed, the final state one step early) is
evaluated on the case's inputs in float64 (:func:`oracle.reading.linear_chunked.chunked`); a
failing output that lies much closer to a reading than to the truth is named by it. Readings
that coincide with the truth on the case (no packed sequences, no base-2 gates...) are skipped.

>>> import numpy as np
>>> from oracle import catalogue
>>> from oracle.fixtures import golden
>>> from oracle.reading.linear_chunked import chunked
>>> fixture = golden.build(catalogue.get("lin-gdn-exp2-H2K2-T65-D8E8-f64"))
>>> from oracle.catalogue.linear_inputs import arrays_of
>>> o, s = chunked(arrays_of(fixture.inputs), fixture.case.options, deviations=["exp_for_exp2"])
>>> diagnose_linear(fixture, {"o": o, "final_state": s})[0].split(":")[0]
'exp_for_exp2'
"""

from __future__ import annotations

import numpy as np

from oracle.catalogue.linear_inputs import OUTPUTS, arrays_of
from oracle.reading.linear_chunked import DEVIATIONS, chunked

__all__ = ["diagnose_linear", "readings"]

#: How much closer to a reading than to the truth an output must be to be named by it.
CLOSER = 8.0


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _distance(a, b):
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(_f64(a) - _f64(b))
    return float(np.where(np.isfinite(d), d, np.inf).max(initial=0.0))


def readings(fixture) -> list[str]:
    """The deviations that can change this case's result (the others are skipped)."""
    case, inputs = fixture.case, fixture.inputs
    names = []
    for name in DEVIATIONS:
        if name == "no_reset" and "cu_seqlens" not in inputs:
            continue
        if name == "exp_for_exp2" and str(case.options.get("gate_base", "e")) != "2":
            continue
        if name.startswith("l2norm") and not case.options.get("qk_l2norm"):
            continue
        if name in ("solve_bf16", "beta_twice") and "beta" not in inputs:
            continue
        if name in ("cumsum_bf16", "decay_off_by_one") and "g" not in inputs:
            continue
        names.append(name)
    return names


def diagnose_linear(fixture, produced) -> list[str]:
    """Names (with what they mean) of the readings the failing ``produced`` outputs match."""
    arrays = arrays_of(fixture.inputs)
    options = dict(fixture.case.options)
    truth = {n: _f64(fixture.truth[n + "_f64"]) for n in OUTPUTS}
    got = {n: produced.get(n) for n in OUTPUTS if produced.get(n) is not None}
    steps = fixture.truth.get("positions")
    if steps is not None:  # a long row: o stored at sampled steps
        got = {n: (_f64(x)[:, :, steps] if n == "o" and np.ndim(x) == 4 else x)
               for n, x in got.items()}  # fmt: skip
    got = {n: x for n, x in got.items() if np.shape(x) == truth[n].shape}
    notes = []
    for name in readings(fixture):
        alternative = dict(zip(OUTPUTS, chunked(arrays, options, deviations=[name]), strict=True))
        if steps is not None:
            alternative["o"] = alternative["o"][:, :, steps]
        matched = []
        for output, value in got.items():
            apart = _distance(alternative[output], truth[output])
            to_reading = _distance(value, alternative[output])
            if apart > 0 and to_reading * CLOSER < _distance(value, truth[output]):
                matched.append(output)
        if matched:
            notes.append(f"{name}: {' and '.join(matched)} match(es) {DEVIATIONS[name]}")
    return notes
