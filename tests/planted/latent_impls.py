"""Planted latent-attention bugs (docs/conventions.md, "Latent attention"): each a plain
``impl(q, k, v, **options)`` computing in the case dtype (the oracle's textbook algorithm with
one thing wrong), with the case patterns it must fail and the diagnosis it must receive.

``textbook`` (tests/planted/broken_impls.py) is the correct counterpart: it passes them all.
"""

from __future__ import annotations

import math

from tests.planted.broken_impls import Broken, _forward

__all__ = ["BROKEN_LATENT", "scale_of_key_width", "qv_ignored"]


def scale_of_key_width(q, k, v, **options):
    """Ignores the caller's scale and takes 1/sqrt of the whole key width (MLA: 576, not the
    model's 192; with qv: D + E)."""
    width = q.shape[-1] + (v.shape[-1] if options.get("qv") is not None else 0)
    return _forward(q, k, v, **{**options, "scale": 1 / math.sqrt(width)})


def qv_ignored(q, k, v, **options):
    """Drops FlashAttention 3's qv . v term (keeps the scale it would have used)."""
    qv = options.pop("qv", None)
    if qv is not None and options.get("scale") is None:
        options["scale"] = 1 / math.sqrt(q.shape[-1] + v.shape[-1])
    return _forward(q, k, v, **options)


BROKEN_LATENT = {
    "scale_of_key_width": Broken(
        scale_of_key_width, ("mla-decode-*", "qv-mla-form-*"), "scale of the key width"
    ),
    "qv_ignored": Broken(qv_ignored, ("qv-H*", "qv-causal-gqa-*", "qv-mla-form-*"), "qv term"),
}
