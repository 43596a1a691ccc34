"""Reverse-mode differentiation of a :class:`refattn.transformer.Composition`.

A composition is a chain of a few operations (``linear``, ``activation``, ``layer_norm``,
``attention``, ``+`` of values and index maps ``.map``). :class:`Tape` is an operations object
that evaluates each operation with a base (the float64 operations or the exact path's
enclosures), records it, and afterwards runs the chain backwards with the base's
vector-Jacobian product of each operation. The same tape therefore gives the float64 gradient
(NumPy) and the enclosure of the exact gradient (intervals), which the exact path rounds once.
"""

from __future__ import annotations

import numpy as np

from .broadcast import reduce_to

__all__ = ["Tape", "Var", "backward_pass"]


class Var:
    """A value recorded on a :class:`Tape` (supports ``+`` and ``.map`` like the plain arrays
    the composition's chain also runs on)."""

    __slots__ = ("value", "tape")

    def __init__(self, value, tape):
        self.value, self.tape = value, tape

    @property
    def shape(self):
        return self.value.shape

    def __add__(self, other):
        return self.tape.add(self, other)

    def map(self, fn):
        return self.tape.map(self, fn)


def _value(var):
    return None if var is None else var.value


class Tape:
    """Operations object recording a chain for its backward pass over ``base``.

    ``base`` provides the forward operations and ``linear_vjp``, ``activation_vjp``,
    ``layer_norm_vjp``, ``attention_vjp`` and ``zeros``.
    """

    def __init__(self, base):
        self.base, self.records = base, []

    def leaf(self, value):
        return Var(value, self)

    def _record(self, value, inputs, backward):
        out = Var(value, self)
        self.records.append((out, inputs, backward))
        return out

    def linear(self, x, W, b):
        value = self.base.linear(x.value, W.value, _value(b))
        return self._record(
            value, (x, W, b), lambda g: self.base.linear_vjp(x.value, W.value, b is not None, g)
        )

    def activation(self, x, name):
        value = self.base.activation(x.value, name)
        return self._record(value, (x,), lambda g: (self.base.activation_vjp(x.value, name, g),))

    def layer_norm(self, x, p):
        plain = type(p)(_value(p.gamma), _value(p.beta), p.eps)
        value = self.base.layer_norm(x.value, plain)

        def backward(g):
            dx, dgamma, dbeta = self.base.layer_norm_vjp(x.value, plain, g)
            return dx, dgamma, dbeta

        return self._record(value, (x, p.gamma, p.beta), backward)

    def attention(self, q, k, v, kwargs):
        value = self.base.attention(q.value, k.value, v.value, kwargs)
        return self._record(
            value,
            (q, k, v),
            lambda g: self.base.attention_vjp(q.value, k.value, v.value, kwargs, g),
        )

    def add(self, a, b):
        value = a.value + b.value
        return self._record(value, (a, b), lambda g: (reduce_to(g, a.shape), reduce_to(g, b.shape)))

    def map(self, x, fn):
        """An index map (reshape, axis move): its adjoint scatters back by the same map."""
        value = fn(x.value)
        index = fn(np.arange(x.value.size).reshape(x.shape))

        def backward(g):
            out = np.empty(x.value.size, dtype=g.dtype)
            out[index.ravel()] = g.ravel()
            return (out.reshape(x.shape),)

        return self._record(value, (x,), backward)

    def backward(self, out, grad_out) -> dict:
        """Gradients (by ``id`` of the :class:`Var`) of ``sum(grad_out * out)``."""
        grads = {id(out): grad_out}
        for node, inputs, backward in reversed(self.records):
            g = grads.pop(id(node), None)
            if g is None:
                continue
            for var, grad in zip(inputs, backward(g), strict=True):
                if var is None or grad is None:
                    continue
                if np.shape(grad) != var.shape:  # an operand broadcast by the operation
                    grad = reduce_to(grad, var.shape)
                grads[id(var)] = grad if id(var) not in grads else grads[id(var)] + grad
        return grads

    def gradient(self, grads, var):
        """The gradient of a leaf (zeros when the output does not depend on it)."""
        return grads[id(var)] if id(var) in grads else self.base.zeros(var.shape)


def backward_pass(tape, chain, inputs, params, grad_out, to_leaf, map_params) -> list:
    """Run ``chain(tape, *inputs, params)`` and its backward pass from ``grad_out``.

    ``inputs`` are arrays, ``params`` a (nested) parameter dataclass whose arrays
    ``map_params(params, fn)`` visits in a fixed order; ``to_leaf`` converts an array to the
    base's number system. Returns the gradients of the inputs, then of every parameter array in
    that order, each summed back to its leaf's shape.
    """
    leaves = [tape.leaf(to_leaf(a)) for a in inputs]
    param_leaves = []

    def make(array):
        leaf = tape.leaf(to_leaf(array))
        param_leaves.append(leaf)
        return leaf

    out = chain(tape, *leaves, map_params(params, make))
    if tuple(np.shape(grad_out)) != tuple(out.shape):
        raise ValueError(
            f"grad_out: expected the shape of the output {tuple(out.shape)}, got "
            f"shape {tuple(np.shape(grad_out))}"
        )
    grads = tape.backward(out, to_leaf(grad_out))
    return [reduce_to(tape.gradient(grads, leaf), leaf.shape) for leaf in leaves + param_leaves]
