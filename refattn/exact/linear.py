"""Exact path of :func:`refattn.linear_attention` and its vjp: every element of o, of the
final state and of every gradient is the exact real result, rounded once.

Forward, first step: :func:`refattn.exact.fast.linear.fast_linear_forward` runs the recurrence
per (sequence, value head) in compiled midpoint-radius double-double arithmetic with rigorous
radii (:mod:`refattn.exact.fast.linear_kernels` states the error analysis) and decides each
element whose enclosure rounds to one value of the target format (on ordinary inputs, all of
them). Only the (sequence, value head) rows that hold an undecided element, or that the first
step could not bound (a gate above 60, inputs above 2**200), go to the referee below (up to
their last undecided o row when their final state is decided); the merged
result is bit-identical to the referee's alone (``config.LINEAR_EXACT_ENGINE = "referee"``
forces it on every row). :func:`linear_fallback_stats` counts what the referee evaluated.

Referee: the recurrence runs per row on rigorous interval enclosures (the Ziv loop of
:func:`refattn.exact.rounding.correctly_round` doubles the working precision until each
rounding is decided; the intervals widen along the recurrence, so long sequences need more
bits, never a different method), about 1 s per (head, step) at D = E = 128: a row of T = 4096
costs an hour. Elements left on a rounding boundary are evaluated on exact rationals
(:mod:`refattn.exact.numbers`) when the computation is rational: no gates, or base-2 gates at
integer values; no normalisation; ``scale`` given or ``1/sqrt(D)`` with D a square.
The gradients are formed by reverse accumulation of the same evaluator
(:mod:`refattn.exact.autodiff`) on every element (no compiled first step).

Pinned constants: the normalisation's eps is the float64 number nearest 1e-6, inside the
root; the default scale is the real number ``1/sqrt(D)``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from mpmath import mp

from .. import config
from . import fast as _fast
from . import intervals as I
from .autodiff import AutodiffOps, lift, vjp
from .numbers import INTERVAL, RATIONAL, NotRational
from .rounding import correctly_round, format_of

__all__ = ["exact_linear_attention", "exact_linear_attention_vjp", "linear_fallback_stats"]

# ``call`` below is a refattn.linear._inputs.LinearCall (the canonical call, float64 arrays).


class _IntervalArith:
    """Interval enclosures at the working precision."""

    rational = False

    @staticmethod
    def const(x):
        return I.point(x)

    @staticmethod
    def decay(g, base):
        if base == "2":
            lo, hi = g._mpi_
            value = mp.make_mpf(lo)
            if lo == hi and value == int(value) and abs(value) < 1000:
                return I.point(Fraction(2) ** int(value))  # exact: rationals stay rational
            return I.exp(g * I.log(I.point(2.0)))
        return I.exp(g)

    @staticmethod
    def inv_sqrt(x):
        return 1 / I.sqrt(x)


class _RationalArith:
    """Exact Fractions; :class:`NotRational` where an irrational value would be needed."""

    rational = True

    @staticmethod
    def const(x):
        return Fraction(x)

    @staticmethod
    def decay(g, base):
        if base == "2" and g.denominator == 1 and abs(g) < 1000:
            return Fraction(2) ** int(g)
        if g == 0:
            return Fraction(1)
        raise NotRational

    @staticmethod
    def inv_sqrt(x):
        num, den = math.isqrt(x.numerator), math.isqrt(x.denominator)
        if num * num != x.numerator or den * den != x.denominator:
            raise NotRational
        return Fraction(den, num)


class _AutodiffArith:
    """The interval or rational system with every operation recorded (leaves are Vars)."""

    def __init__(self, base):
        self.ad = AutodiffOps(INTERVAL if not base.rational else RATIONAL)
        self.base = base
        self.rational = base.rational

    def const(self, x):
        return lift(self.base.const(x))

    def decay(self, g, gate_base):
        if gate_base == "2":
            if self.rational:
                raise NotRational  # d 2**g / dg = 2**g ln 2
            return self.ad.exp(g * lift(I.log(I.point(2.0))))
        return self.ad.exp(g)

    def inv_sqrt(self, x):
        return self.ad.exp(self.ad.log(x) * lift(self.base.const(-0.5)))


def _scale(arith, call):
    """The output scale as a constant of ``arith`` (the exact 1/sqrt(D) by default)."""
    if isinstance(arith, _AutodiffArith):
        return lift(_scale(arith.base, call))
    if not call.default_scale:
        return arith.const(call.scale)
    dim = call.q.shape[-1]
    if arith.rational:
        return arith.inv_sqrt(Fraction(dim))
    return 1 / I.sqrt(I.point(float(dim)))


def _normalise(arith, x):
    total = arith.const(config.LINEAR_L2NORM_EPS)
    for value in x:
        total = total + value * value
    r = arith.inv_sqrt(total)
    return [value * r for value in x]


def _recurrence(arith, seq, scale, call):
    """(o rows (T_n lists of E numbers), final state (D lists of E)) of one sequence and value
    head; ``seq`` holds its inputs as lists of numbers of ``arith``: q, k (T_n, D), v (T_n, E),
    g (T_n or T_n x D, or None), beta (T_n or None), h0 (D x E or None)."""
    dim, edim = call.q.shape[-1], call.v.shape[-1]
    zero = arith.const(0.0)
    state = [list(row) for row in seq["h0"]] if seq["h0"] is not None else None
    if state is None:
        state = [[zero] * edim for _ in range(dim)]
    outputs = []
    for t in range(len(seq["v"])):
        q_t, k_t, v_t = seq["q"][t], seq["k"][t], seq["v"][t]
        if call.qk_l2norm:
            q_t, k_t = _normalise(arith, q_t), _normalise(arith, k_t)
        if seq["g"] is not None:
            gate = seq["g"][t]
            for d in range(dim):
                a = arith.decay(gate[d] if call.vector_gate else gate, call.gate_base)
                state[d] = [a * s for s in state[d]]
        if seq["beta"] is not None:
            for e in range(edim):
                pred = zero
                for d in range(dim):
                    pred = pred + state[d][e] * k_t[d]
                step = seq["beta"][t] * (v_t[e] - pred)
                for d in range(dim):
                    state[d][e] = state[d][e] + k_t[d] * step
        else:
            for d in range(dim):
                state[d] = [s + k_t[d] * v_t[e] for e, s in enumerate(state[d])]
        row = []
        for e in range(edim):
            read = zero
            for d in range(dim):
                read = read + state[d][e] * q_t[d]
            row.append(scale * read)
        outputs.append(row)
    return outputs, state


def _values(arith, array):
    """Nested lists of ``arith`` constants at the exact values of a float64 array."""
    if array is None:
        return None
    out = np.empty(np.shape(array), dtype=object)
    for index, x in np.ndenumerate(array):
        out[index] = arith.const(float(x))
    return out.tolist()


def _sequence(call, n: int, j: int, stop: int | None = None):
    """The float64 input slices of sequence n, value head j (its tokens before ``stop``)."""
    b, start, end = call.segments[n]
    stop = end if stop is None else stop
    return {
        "q": call.q[b, j, start:stop],
        "k": call.k[b, j, start:stop],
        "v": call.v[b, j, start:stop],
        "g": None if call.g is None else call.g[b, j, start:stop],
        "beta": None if call.beta is None else call.beta[b, j, start:stop],
        "h0": None if call.h0 is None else call.h0[n, j],
    }


def _forward_row(arith, call, n, j, stop=None):
    seq = {name: _values(arith, x) for name, x in _sequence(call, n, j, stop).items()}
    return _recurrence(arith, seq, _scale(arith, call), call)


_LAST_STATS: dict = {}


def linear_fallback_stats() -> dict:
    """Statistics of the last :func:`exact_linear_attention` call: ``rows`` (sequence, value
    head) and ``elements`` (of o and the final state) in total, ``fast_undecided_elements``
    (elements the compiled first step left undecided, those of rows it could not bound
    included), ``referee_rows`` and ``referee_elements`` (the rows the referee evaluated, and
    their elements it rounded: a row's o rows up to its last undecided one, and its final
    state when that holds an undecided element), and the ``engine`` ("fast" or "referee").

    Examples
    --------
    >>> set(linear_fallback_stats()) <= {'rows', 'elements', 'fast_undecided_elements',
    ...                                  'referee_rows', 'referee_elements', 'engine'}
    True
    """
    return dict(_LAST_STATS)


def _task_size(call, task):
    """Number of results of a referee task (n, j, stop, with_state): the o rows of sequence n,
    value head j before ``stop``, and its final state when asked for."""
    n, _, stop, with_state = task
    return (stop - call.segments[n][1]) * call.v.shape[-1] + with_state * (
        call.q.shape[-1] * call.v.shape[-1]
    )


def _referee(call, tasks, dtype):
    """The referee's correctly rounded results of ``tasks``: one flat array, task after task,
    each its o rows (T x E) then, when asked for, its final state (D x E)."""
    offsets = np.cumsum([0, *(_task_size(call, task) for task in tasks)])

    def fill(arith, subset):
        flat = []
        for n, j, stop, with_state in subset:
            values, state = _forward_row(arith, call, n, j, stop)
            flat += [x for row in values for x in row]
            flat += [x for row in state for x in row] if with_state else []
        return np.array(flat, dtype=object)

    def evaluate(prec):
        with I.workprec(prec):
            return I.endpoints(fill(_IntervalArith, tasks))

    cache = {}

    def fallback(index):
        (flat,) = index
        at = int(np.searchsorted(offsets, flat, side="right")) - 1
        if at not in cache:
            try:
                cache[at] = fill(_RationalArith, [tasks[at]])
            except NotRational:
                cache[at] = None
        return None if cache[at] is None else cache[at][flat - offsets[at]]

    return correctly_round(evaluate, dtype, fallback=fallback, what="linear_attention")


def exact_linear_attention(call, dtype):
    """(o (B, HV, T, E), final (N, HV, D, E)) correctly rounded to ``dtype``: the compiled
    first step (:func:`refattn.exact.fast.linear.fast_linear_forward`) decides what it can, the
    referee evaluates the (sequence, value head) rows that hold an undecided element, up to
    its last undecided o row when the row's final state is decided
    (``config.LINEAR_EXACT_ENGINE = "referee"``: every row, whole)."""
    fmt = format_of(dtype)
    sequences, heads = call.state_shape[:2]
    engine = config.LINEAR_EXACT_ENGINE
    if engine == "fast":
        o, final, tasks, undecided = _fast.linear.fast_linear_forward(call, fmt)
    else:
        o, final = np.zeros(call.v.shape), np.zeros(call.state_shape)
        tasks = [(n, j, call.segments[n][2], True) for n in range(sequences) for j in range(heads)]
    elements = call.v.size + int(np.prod(call.state_shape))
    tasks = [task for task in tasks if _task_size(call, task)]
    at = 0
    if tasks:
        flat = _referee(call, tasks, fmt.dtype).astype(np.float64)
        for task in tasks:
            n, j, stop, with_state = task
            b, start, _ = call.segments[n]
            size = (stop - start) * call.v.shape[-1]
            o[b, j, start:stop] = flat[at : at + size].reshape(o[b, j, start:stop].shape)
            if with_state:
                final[n, j] = flat[at + size : at + _task_size(call, task)].reshape(final.shape[2:])
            at += _task_size(call, task)
    _LAST_STATS.clear()
    _LAST_STATS.update(
        rows=sequences * heads,
        elements=elements,
        fast_undecided_elements=undecided if engine == "fast" else elements,
        referee_rows=len(tasks),
        referee_elements=at,
        engine=engine,
    )
    return o.astype(fmt.dtype), final.astype(fmt.dtype)


# --------------------------------------------------------------------------- vjp


def _vjp_row(arith_base, call, do, dht, n, h):
    """Gradients of one (sequence n, key head h) group: the G value heads reading key head h.
    Returns {name: (index tuple of the argument, nested list of gradients)} pieces."""
    ad = _AutodiffArith(arith_base)
    group = call.group
    b, start, stop = call.segments[n]
    base = _sequence(call, n, h * group)
    leaves = {
        "q": ad.ad.variables(_values(arith_base, base["q"])),
        "k": ad.ad.variables(_values(arith_base, base["k"])),
    }
    outputs, cotangents, pieces = [], [], []
    scale = _scale(ad, call)
    for j in range(h * group, (h + 1) * group):
        inputs = _sequence(call, n, j)
        seq = {"q": leaves["q"].tolist(), "k": leaves["k"].tolist()}
        for name in ("v", "g", "beta", "h0"):
            if inputs[name] is None:
                seq[name] = None
                continue
            leaf = ad.ad.variables(_values(arith_base, inputs[name]))
            seq[name] = leaf.tolist()
            pieces.append((name, j, leaf))
        values, state = _recurrence(ad, seq, scale, call)
        outputs += [x for row in values for x in row] + [x for row in state for x in row]
        cot_state = dht[n, j] if dht is not None else np.zeros(call.state_shape[2:])
        cotangents += [arith_base.const(float(x)) for x in do[b, j, start:stop].ravel()]
        cotangents += [arith_base.const(float(x)) for x in cot_state.ravel()]
    pieces = [("q", h, leaves["q"]), ("k", h, leaves["k"]), *pieces]
    variables = [x for _, _, leaf in pieces for x in np.ravel(leaf)]
    grads = vjp(outputs, cotangents, variables)
    result, at = [], 0
    for name, head, leaf in pieces:
        size = np.size(leaf)
        result.append((name, head, np.array(grads[at : at + size], dtype=object)))
        at += size
    return result


def exact_linear_attention_vjp(call, do, dht, dtype):
    """(dq, dk, dv, dg, dbeta, dh0) correctly rounded to ``dtype`` (None where absent)."""
    key_heads = call.key_heads
    b_shape = (call.q.shape[0], key_heads) + call.q.shape[2:]
    shapes = {
        "q": b_shape,
        "k": b_shape,
        "v": call.v.shape,
        "g": None if call.g is None else call.g.shape,
        "beta": None if call.beta is None else call.beta.shape,
        "h0": None if call.h0 is None else call.state_shape,
    }
    names = [name for name, shape in shapes.items() if shape is not None]
    sizes = [int(np.prod(shapes[name])) for name in names]
    offsets = dict(zip(names, np.cumsum([0, *sizes])[:-1].tolist(), strict=True))
    groups = [(n, h) for n in range(len(call.segments)) for h in range(key_heads)]

    def place(table, n, name, head, grads):
        b, start, stop = call.segments[n]
        target = table[name]
        if name == "h0":
            target[n, head] = grads.reshape(target.shape[2:])
        else:
            target[b, head, start:stop] = grads.reshape(target[b, head, start:stop].shape)

    def fill(arith, rows):
        table = {name: np.zeros(shapes[name], dtype=object) for name in names}
        for n, h in rows:
            for name, head, grads in _vjp_row(arith, call, do, dht, n, h):
                place(table, n, name, head, grads)
        return np.concatenate([table[name].ravel() for name in names]) if names else None

    def evaluate(prec):
        with I.workprec(prec):
            return I.endpoints(fill(_IntervalArith, groups))

    cache = {}

    def fallback(index):
        (flat,) = index
        name = max((n for n in names if offsets[n] <= flat), key=lambda n: offsets[n])
        local = np.unravel_index(flat - offsets[name], shapes[name])
        row = _owner(call, name, local)
        if row not in cache:
            try:
                cache[row] = fill(_RationalArith, [row])
            except NotRational:
                cache[row] = None
        return None if cache[row] is None else cache[row][flat]

    flat = correctly_round(evaluate, dtype, fallback=fallback, what="linear_attention_vjp")
    out = {}
    for name, size in zip(names, sizes, strict=True):
        out[name] = flat[offsets[name] : offsets[name] + size].reshape(shapes[name])
    return tuple(out.get(name) for name in ("q", "k", "v", "g", "beta", "h0"))


def _owner(call, name, local):
    """The (sequence, key head) group that computes a gradient element."""
    if name == "h0":
        return int(local[0]), int(local[1]) // call.group
    b, head, t = (int(x) for x in local[:3])
    key_head = head if name in ("q", "k") else head // call.group
    for n, (row, start, stop) in enumerate(call.segments):
        if row == b and start <= t < stop:
            return n, key_head
    raise IndexError(f"no sequence holds token {t} of batch row {b}")
