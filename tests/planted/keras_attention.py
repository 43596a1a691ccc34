"""``keras.ops.dot_product_attention`` on Keras' numpy backend in refattn's calling
convention (docs/findings.md): (B, H, L, D) NumPy arrays in, the output out; options other
than ``scale`` and ``causal`` are refused (NotImplementedError: "unsupported", never a fail).

Keras is imported on the first call (an optional peer; its backend must be chosen before the
import)."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["attention"]


def _keras():
    os.environ.setdefault("KERAS_BACKEND", "numpy")
    import keras  # optional peer: imported on first use, after the backend is chosen

    return keras


def attention(q, k, v, scale=None, causal=False, **options):
    """keras.ops.dot_product_attention(query, key, value, scale=, is_causal=) in bhld."""
    given = {n: x for n, x in options.items() if x is not None and n != "align"}
    if given:
        raise NotImplementedError(f"keras attention: no mapping for {sorted(given)}")
    if causal and q.shape[-2] != k.shape[-2] and options.get("align") != "top_left":
        raise NotImplementedError("keras is_causal is top-left aligned")
    keras = _keras()
    blhd = [np.swapaxes(np.asarray(x), 1, 2) for x in (q, k, v)]
    out = keras.ops.dot_product_attention(*blhd, scale=scale, is_causal=bool(causal))
    return np.swapaxes(np.asarray(out), 1, 2).astype(np.asarray(q).dtype)
