"""The host side of the exact linear-attention forward's compiled first step.

:func:`fast_linear_forward` runs :func:`refattn.exact.fast.linear_kernels.linear_rows` (the
recurrence per (sequence, value head) on double-double enclosures; its module docstring holds
the error analysis) and decides each element of o and of the final state with
:func:`refattn.exact.fast.rounding_decision.decide_dd_fast`. It returns the decided values and
the (sequence, value head) rows that hold an undecided element (or that the kernel could not
bound): :func:`refattn.exact.linear.exact_linear_attention` sends only those rows to the
arbitrary-precision referee.
"""

from __future__ import annotations

import numpy as np
from mpmath import mp

from ... import config
from ._params import frozen
from .doubledouble import dd_of_exact
from .linear_kernels import INPUT_MAX, LINEAR_PRM, linear_rows
from .rounding_decision import decide_dd_fast

__all__ = ["fast_linear_forward", "linear_enclosures", "LN2_DD"]


def _ln2_dd() -> tuple[float, float, float]:
    """ln 2 as (hi, lo, err) with |hi + lo - ln 2| <= err (mpmath at 200 bits, err rounded up
    with a 2**-190 margin for the 200-bit value itself)."""
    with mp.workprec(200):
        value = mp.log(2)
        hi = float(value)
        lo = float(value - hi)
        err = float(abs(value - hi - lo) + mp.mpf(2) ** -190)
    return hi, lo, float(np.nextafter(err, np.inf))


#: ln 2 as a double-double with its error bound.
LN2_DD = _ln2_dd()


def _params(call) -> np.ndarray:
    dim = call.q.shape[-1]
    if call.default_scale:
        scale = dd_of_exact(("invsqrt", dim))
    else:
        scale = (float(call.scale), 0.0, 0.0)
    values = {
        "gated": call.g is not None,
        "delta": call.beta is not None,
        "l2norm": call.qk_l2norm,
        "base2": call.gate_base == "2",
        "scale_hi": scale[0],
        "scale_lo": scale[1],
        "scale_err": scale[2],
        "eps": config.LINEAR_L2NORM_EPS,
        "ln2_hi": LN2_DD[0],
        "ln2_lo": LN2_DD[1],
        "ln2_err": LN2_DD[2],
    }
    return np.array([float(values[name]) for name in LINEAR_PRM])


def linear_enclosures(call):
    """(out (3, B, HV, T, E), state (3, N, HV, D, E), ok (N, HV)) from the kernel."""
    batch, heads, length, _ = call.q.shape
    g = call.g
    if g is None:
        g = np.zeros((batch, heads, length, 1))
    elif g.ndim == 3:
        g = g[..., None]
    beta = np.zeros((batch, heads, length)) if call.beta is None else call.beta
    h0 = np.zeros(call.state_shape) if call.h0 is None else call.h0
    seg = np.array(call.segments, dtype=np.int64).reshape(-1, 3)
    out = np.zeros((3,) + call.v.shape)
    state = np.zeros((3,) + call.state_shape)
    ok = np.zeros(call.state_shape[:2], dtype=np.bool_)
    arrays = [frozen(x, np.float64) for x in (call.q, call.k, call.v, g, beta, h0)]
    linear_rows(*arrays, frozen(seg), frozen(_params(call)), out, state, ok)
    return out, state, ok


def fast_linear_forward(call, fmt):
    """(o values, final-state values, referee tasks, undecided count): float64 arrays of o
    (B, HV, T, E) and of the final state (N, HV, D, E) holding the correctly rounded value of
    every decided element (the values of ``fmt``); the referee's tasks ``(n, j, stop,
    with_state)``, one per (sequence n, value head j) row that holds an undecided element or
    that the compiled step could not bound: the row's tokens before ``stop`` (one past its last
    undecided o row, or the sequence's end when its final state is undecided: ``with_state``);
    and the number of elements left undecided (every element of a row it could not bound).
    ``fmt`` a :class:`refattn.exact.rounding.Format`."""
    sequences, heads = call.state_shape[:2]
    o = np.zeros(call.v.shape)
    final = np.zeros(call.state_shape)
    whole = [(n, j, call.segments[n][2], True) for n in range(sequences) for j in range(heads)]
    if call.q.shape[-1] >= 2**20 or not abs(call.scale) <= INPUT_MAX:
        return o, final, whole, o.size + final.size
    out, state, ok = linear_enclosures(call)
    o, o_decided = decide_dd_fast(out[0], out[1], out[2], fmt)
    final, final_decided = decide_dd_fast(state[0], state[1], state[2], fmt)
    token_decided = o_decided.all(axis=-1)  # (B, HV, T)
    tasks, undecided = [], 0
    for n, j, end, _ in whole:
        b, start, _ = call.segments[n]
        if not ok[n, j]:
            tasks.append((n, j, end, True))
            undecided += final_decided[n, j].size + o_decided[b, j, start:end].size
            continue
        state_undecided = int((~final_decided[n, j]).sum())
        late = np.flatnonzero(~token_decided[b, j, start:end])
        if state_undecided or late.size:
            stop = end if state_undecided else start + int(late[-1]) + 1
            tasks.append((n, j, stop, bool(state_undecided)))
            undecided += state_undecided + int((~o_decided[b, j, start:end]).sum())
    return o, final, tasks, undecided
