"""The FlashMLA-style latent paged cache convention (``layout="latent-paged"``) of
:func:`oracle.conventions.layouts.wrap`.

The implementation is called as ``impl(q, cache, *, head_dim_v, block_table, cache_seqlens,
**options)`` with q (B, L, H, D) and one latent cache (P, page, 1, D) (MLA's absorbed decode:
576 = 512 latent + 64 rope features per key, a single kv head); the values are the first
``head_dim_v`` features of each cache row (FlashMLA's ``flash_mla_with_kvcache``). It returns
out (B, L, H, E) and optionally lse (B, H, L). Pages are laid out as in the ``paged`` layout
(reverse order behind one unused page, NaN in every slot no sequence owns); a case's
``kv_lengths`` become ``cache_seqlens`` (else every sequence holds S keys). Only cases whose
v is k's first E features with K = 1 fit (others are "unsupported").
"""

from __future__ import annotations

import numpy as np

__all__ = ["latent_paged_layout"]


def latent_paged_layout(paged):
    """The layout function of ``latent-paged``, built on the ``paged`` one (``paged(q, k, v,
    options) -> (args, kwargs, unpack)``)."""

    def layout(q, k, v, options):
        k, v = np.asarray(k), np.asarray(v)
        width = v.shape[-1]
        if k.shape[-3] != 1 or not np.array_equal(k[..., :width], v, equal_nan=True):
            raise NotImplementedError(
                "the latent-paged layout needs one kv head and v = k[..., :head_dim_v] "
                f"(k {k.shape}, v {v.shape})"
            )
        rest = {n: x for n, x in options.items() if n != "kv_lengths"}
        (q_blhd, cache, _), kwargs, unpack = paged(q, k, k, rest)
        kwargs["head_dim_v"] = width
        if options.get("kv_lengths") is not None:
            kwargs["cache_seqlens"] = np.asarray(options["kv_lengths"], dtype=np.int32)
        return (q_blhd, cache), kwargs, unpack

    return layout
