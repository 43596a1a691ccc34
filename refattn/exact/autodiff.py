"""Reverse-mode differentiation of exact row evaluators, in the number systems they run on.

An exact row evaluator (:mod:`refattn.exact.rows`) is written against a number system ``ops``
(:mod:`refattn.exact.numbers`: rigorous intervals or exact rationals). :class:`AutodiffOps`
wraps such a system so that the *same* evaluator records the finite computation it performs
(every ``+ - * /``, ``exp``, ``log``, ``lse`` and ``softmax``) on a tape of :class:`Var` nodes;
:func:`vjp` then runs the tape backwards. Every local derivative is formed in the wrapped
number system, so on intervals the result is a rigorous enclosure of the exact derivative of
the computation as run (the Ziv loop of :func:`refattn.exact.rows.exact_rows` narrows it), and
on rationals it is the exact rational derivative (or :class:`~refattn.exact.numbers.NotRational`).

Example: d/dx (x * x + x) at x = 3 is 7.

>>> from fractions import Fraction
>>> from refattn.exact.numbers import RATIONAL
>>> ops = AutodiffOps(RATIONAL)
>>> x = ops.variable(Fraction(3))
>>> y = x * x + x
>>> vjp([y], [Fraction(1)], [x])
[Fraction(7, 1)]

Primitives with a closed-form local derivative (``lse``, ``softmax``) are recorded as one node,
so the rational system can differentiate ties exactly (weights 1/n) where composing them from
``exp`` and ``log`` would need transcendental numbers.
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["Var", "AutodiffOps", "vjp", "primal"]

_counter = itertools.count()


class Var:
    """A number of the wrapped system with its place on the tape.

    ``parents`` is a tuple of (parent Var, local derivative) pairs; constants have none and are
    never differentiated (``active`` False).
    """

    __slots__ = ("value", "parents", "active", "order")

    def __init__(self, value, parents=(), active=None):
        self.value = value
        self.parents = parents
        self.active = bool(parents) if active is None else active
        self.order = next(_counter)

    # -- arithmetic ---------------------------------------------------------------------
    def __add__(self, other):
        other = lift(other)
        return _node(self.value + other.value, ((self, 1), (other, 1)))

    __radd__ = __add__

    def __sub__(self, other):
        other = lift(other)
        return _node(self.value - other.value, ((self, 1), (other, -1)))

    def __rsub__(self, other):
        return lift(other) - self

    def __neg__(self):
        return _node(-self.value, ((self, -1),))

    def __mul__(self, other):
        other = lift(other)
        return _node(self.value * other.value, ((self, other.value), (other, self.value)))

    __rmul__ = __mul__

    def __truediv__(self, other):
        other = lift(other)
        quotient = self.value / other.value
        return _node(quotient, ((self, 1 / other.value), (other, -quotient / other.value)))

    def __rtruediv__(self, other):
        return lift(other) / self

    def __repr__(self):
        return f"Var({self.value!r})"


def lift(x) -> Var:
    """``x`` as a Var (a constant unless it already is one)."""
    return x if isinstance(x, Var) else Var(x, active=False)


def primal(x):
    """The value of a Var (anything else unchanged)."""
    return x.value if isinstance(x, Var) else x


def _node(value, parents):
    live = tuple((p, d) for p, d in parents if p.active)
    return Var(value, live, active=bool(live))


class AutodiffOps:
    """The number system ``base`` with every result recorded for :func:`vjp`.

    ``array``/``scalar`` give constants; :meth:`variables` gives the inputs to differentiate.
    """

    def __init__(self, base):
        self.base = base
        self.rational = base.rational

    def array(self, x) -> np.ndarray:
        return self.constants(self.base.array(x))

    @staticmethod
    def constants(values) -> np.ndarray:
        out = np.empty(np.shape(values), dtype=object)
        for index, value in np.ndenumerate(values):
            out[index] = lift(value)
        return out

    def variables(self, values) -> np.ndarray:
        """Differentiable leaves holding ``values`` (numbers of the base system)."""
        out = np.empty(np.shape(values), dtype=object)
        for index, value in np.ndenumerate(values):
            out[index] = self.variable(primal(value))
        return out

    @staticmethod
    def variable(value) -> Var:
        return Var(value, active=True)

    def scalar(self, x):
        return lift(self.base.scalar(x))

    def exp(self, x):
        x = lift(x)
        value = self.base.exp(x.value)
        return _node(value, ((x, value),))

    def log(self, x):
        x = lift(x)
        return _node(self.base.log(x.value), ((x, 1 / x.value),))

    def log_2pi(self):
        return lift(self.base.log_2pi())

    def lse(self, terms):
        """log sum exp over the non-None terms; d lse / d t_u = softmax_u."""
        present = [lift(t) for t in terms if t is not None]
        if not present:
            return None
        value = self.base.lse([t.value for t in present])
        weights = self.base.softmax([t.value for t in present])
        return _node(value, tuple(zip(present, weights, strict=True)))

    def softmax(self, terms):
        """Softmax over the non-None terms (0 for None); d w_u / d t_v = w_u (delta_uv - w_v)."""
        raw = [None if t is None else lift(t).value for t in terms]
        weights = self.base.softmax(raw)
        present = [(lift(t), w) for t, w in zip(terms, weights, strict=True) if t is not None]
        out = []
        for t, w in zip(terms, weights, strict=True):
            if t is None:
                out.append(0)
                continue
            t = lift(t)
            local = tuple((p, (w - w * wp) if p is t else -w * wp) for p, wp in present)
            out.append(_node(w, local))
        return out


def vjp(outputs, cotangents, inputs):
    """sum_j cotangent_j * d output_j / d input, for every input Var (0 where independent).

    Outputs may be plain numbers (constants): they contribute nothing.
    """
    adjoint: dict[int, object] = {}
    nodes: dict[int, Var] = {}
    for out, cot in zip(outputs, cotangents, strict=True):
        if isinstance(out, Var) and out.active:
            adjoint[id(out)] = adjoint.get(id(out), 0) + cot
            nodes[id(out)] = out
    _collect(list(nodes.values()), nodes)
    for node in sorted(nodes.values(), key=lambda n: n.order, reverse=True):
        grad = adjoint.get(id(node))
        if grad is None:
            continue
        for parent, local in node.parents:
            adjoint[id(parent)] = adjoint.get(id(parent), 0) + grad * local
    return [adjoint.get(id(x), 0) for x in inputs]


def _collect(stack, nodes):
    """Every active node reachable from ``stack`` into ``nodes`` (iterative: tapes are deep)."""
    while stack:
        node = stack.pop()
        for parent, _ in node.parents:
            if id(parent) not in nodes:
                nodes[id(parent)] = parent
                stack.append(parent)
