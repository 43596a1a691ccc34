"""Named alternatives seen on real peers and simple slips (issue 25, item 4).

================================================  ==============================================
label                                             alternative
================================================  ==============================================
``scale squared``                                 the scale applied twice (``scale**2``)
``rows with no allowed key average v with the     the mask added as a large finite negative in
softmax weights of every key``                    a wider type than the value (keras / HF eager
                                                  float16): the shift cancels in the softmax and
                                                  a row with no allowed key holds a *weighted*
                                                  (not uniform) average of v
``causal top-left except a full last row``        onnxruntime MultiHeadAttention
                                                  ``unidirectional=1`` with L != S: row i sees
                                                  keys 0..i, the last row every key
================================================  ==============================================

Each is an :class:`oracle.diagnose.diagnosis.Alternative` that rewrites the options only (an
explicit
mask), so the float64 textbook evaluates it as it does any other.

Examples
--------
>>> labels = [a.label for a in peer_alternatives({"causal": True}, L=3, S=5, D=4,
...                                               has_empty=False)]
>>> labels[0]
'scale squared (the scale applied twice)'
>>> labels[1].startswith("causal top-left except a full last row")
True
"""

from __future__ import annotations

import numpy as np

from oracle.diagnose.alternative import Alternative
from oracle.reading.allowed import options_allowed
from oracle.reading.heads import resolve_scale

__all__ = ["peer_alternatives"]


def _explicit(options, mask):
    return {
        **options,
        "mask": mask,
        "causal": False,
        "window": None,
        "align": None,
        "kv_lengths": None,
    }


def _empty_rows_see_all(L, S):
    def apply(options, extras):
        allowed = np.asarray(options_allowed(L, S, options), dtype=bool)
        empty = ~allowed.any(axis=-1, keepdims=True)
        return _explicit(options, allowed | empty), extras

    return apply


def _last_row_full(L, S):
    def apply(options, extras):
        rule = {**options, "align": "top_left"}
        allowed = np.array(options_allowed(L, S, rule))
        allowed[..., -1, :] = True
        mask = options.get("mask")
        if mask is not None:
            allowed = allowed & np.asarray(mask, dtype=bool)
        return _explicit(options, allowed), extras

    return apply


def peer_alternatives(options, *, L, S, D, has_empty) -> list:
    """The alternatives of this module that can change the result of a case."""
    found = []
    scale = resolve_scale(options.get("scale"), D)
    if scale not in (0.0, 1.0, -1.0):
        found.append(
            Alternative(
                "scale squared (the scale applied twice)",
                frozenset({"scale"}),
                lambda o, e, s=scale * scale: ({**o, "scale": s}, e),
            )
        )
    if options.get("causal") and options.get("window") is None and L != S:
        found.append(
            Alternative(
                "causal top-left except a full last row (row i sees keys 0..i, the last row "
                "all S keys: onnxruntime MultiHeadAttention unidirectional=1 with L != S)",
                frozenset({"causal", "align", "mask"}),
                _last_row_full(L, S),
            )
        )
    if has_empty:
        found.append(
            Alternative(
                "rows with no allowed key hold a weighted average of v with the softmax weights "
                "of every key (the mask added as a large finite negative in a wider type: the "
                "shift cancels; keras / HF eager float16)",
                frozenset({"empty_rows"}),
                _empty_rows_see_all(L, S),
            )
        )
    return found
