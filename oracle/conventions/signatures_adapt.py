"""Reshaping a preset's call where renaming keywords is not enough
(:mod:`oracle.conventions.signatures`).

A :class:`~oracle.conventions.signatures.Signature` may carry ``adapt(args, kwargs, call,
parameters) ->
(args, kwargs, back)``: the positional arrays (already in the preset's layout) and keywords
reshaped for the library, and ``back(out)`` bringing its output to the layout's form again.

* :func:`kvcache_page_table`: FlashAttention 3's ``flash_attn_with_kvcache`` calls the block
  table ``page_table`` (FlashAttention 2: ``block_table``); the function's own parameters
  decide which name it gets.
* :func:`xformers_groups`: xformers' ``memory_efficient_attention`` takes grouped-query heads
  in its 5-D form, query (B, M, G, H, K) and key/value (B, N, G, H, K) with the key/value
  heads repeated along H, ``attn_bias`` (B, G, H, M, N): G = K kv heads, H = H_q / K query
  heads per group, so query head h = g H + j reads kv head g = h // (H_q / K) (refattn's
  ``gqa="interleave"``). The output (B, M, G, H, E) is read back as (B, M, H_q, E).

Examples
--------
>>> import numpy as np
>>> from oracle.conventions.signatures import Call
>>> q = np.zeros((1, 4, 3, 8)); k = v = np.zeros((1, 2, 5, 8))  # bhld: H = 4, K = 2
>>> blhd = [np.swapaxes(a, 1, 2) for a in (q, k, v)]
>>> (q5, k5, v5), _, back = xformers_groups(blhd, {}, Call.of(q, k, v, {}), set())
>>> q5.shape, k5.shape, back(np.zeros((1, 3, 2, 2, 8))).shape
((1, 3, 2, 2, 8), (1, 5, 2, 2, 8), (1, 3, 4, 8))
"""

from __future__ import annotations

import numpy as np

__all__ = ["kvcache_page_table", "xformers_groups"]


def _same(out):
    return out


def kvcache_page_table(args, kwargs, call, parameters):
    """``block_table`` passed as ``page_table`` to a function that takes that name and not
    ``block_table`` (FlashAttention 3)."""
    if "block_table" in kwargs and "page_table" in parameters and "block_table" not in parameters:
        kwargs = dict(kwargs)
        kwargs["page_table"] = kwargs.pop("block_table")
    return args, kwargs, _same


def xformers_groups(args, kwargs, call, parameters):
    """Grouped heads (H_q != K) in xformers' 5-D BMGHK form (see the module docstring)."""
    if call.heads == call.kv_heads:
        return args, kwargs, _same
    q, k, v = (np.asarray(a) for a in args)  # (B, L, H_q, D), (B, S, K, D), (B, S, K, E)
    groups, per = call.kv_heads, call.heads // call.kv_heads
    q5 = np.ascontiguousarray(q.reshape(*q.shape[:2], groups, per, q.shape[-1]))
    k5, v5 = (
        np.ascontiguousarray(np.broadcast_to(a[:, :, :, None, :], (*a.shape[:3], per, a.shape[-1])))
        for a in (k, v)
    )
    bias = kwargs.get("attn_bias")
    if bias is not None:
        bias = np.asarray(bias)
        shaped = bias.reshape(bias.shape[0], groups, per, *bias.shape[-2:])
        kwargs = {**kwargs, "attn_bias": np.ascontiguousarray(shaped)}

    def back(out):
        out = np.asarray(out)
        return out.reshape(*out.shape[:2], groups * per, out.shape[-1])

    return (q5, k5, v5), kwargs, back
