"""Sigmoid attention implementations for the oracle's tests: a correct one and two planted
bugs (each must fail at least 5 default cases, with its diagnosis named).

In the calling convention of :func:`oracle.run.validate` (``impl(q, k, v, **options)``), computing
in the case dtype with the oracle's textbook algorithm (float32 accumulation for the half
types). ``SIGMOID_BROKEN[name]`` is a :class:`~tests.planted.broken_impls.Broken`.
"""

from __future__ import annotations

from oracle.reading.baseline import textbook_attention, textbook_attention_vjp

from .broken_impls import Broken

__all__ = ["SIGMOID_BROKEN", "sigmoid_textbook", "sigmoid_without_bias", "softmax_for_sigmoid"]


def _out(q, k, v, options):
    options = {name: value for name, value in options.items() if name != "return_lse"}
    return textbook_attention(q, k, v, **options).out


def sigmoid_textbook(q, k, v, **options):
    """Correct: the textbook sigmoid (or softmax) attention the options ask for."""
    return _out(q, k, v, options)


def _vjp(q, k, v, grad_out, **options):
    return textbook_attention_vjp(q, k, v, grad_out, **options)[:4]


sigmoid_textbook.vjp = _vjp


def sigmoid_without_bias(q, k, v, **options):
    """Sigmoid attention that drops its bias (the paper's b = -log S never added)."""
    if options.get("normalizer") == "sigmoid":
        options = {**options, "bias": None}
    return _out(q, k, v, options)


def softmax_for_sigmoid(q, k, v, **options):
    """Accepts ``normalizer=`` and ignores it: a softmax where the sigmoid was asked."""
    return _out(q, k, v, {**options, "normalizer": "softmax"})


#: The planted sigmoid bugs: the case patterns they must fail and their named diagnosis.
SIGMOID_BROKEN = {
    "sigmoid_without_bias": Broken(
        sigmoid_without_bias,
        ("sigmoid-log-s-*", "sigmoid-causal-br-*", "sigmoid-window-*", "sigmoid-dropout-*"),
        "sigmoid without its bias",
    ),
    "softmax_for_sigmoid": Broken(
        softmax_for_sigmoid,
        ("sigmoid-H*", "sigmoid-log-s-*", "sigmoid-window-*", "sigmoid-mask-empty-rows-*"),
        "softmax computed where normalizer='sigmoid' was asked",
    ),
}
