"""A FlashMLA-style implementation in the ``latent-paged`` convention
(oracle.conventions.layouts_latent):
it gathers each sequence's rows of the one latent cache through the block table, reads the
first ``head_dim_v`` features as values and calls refattn on them; ``values_from_the_end``
reads the *last* ``head_dim_v`` features as values (it must fail)."""

from __future__ import annotations

import numpy as np

import refattn

__all__ = ["flashmla_like", "values_from_the_end"]


def _run(q, cache, head_dim_v, block_table, cache_seqlens, options, from_end=False):
    return_lse = options.pop("return_lse", False)
    outs, lses = [], []
    for b in range(q.shape[0]):
        rows = cache[block_table[b]].reshape(-1, cache.shape[-1])[: int(cache_seqlens[b])]
        values = rows[:, -head_dim_v:] if from_end else rows[:, :head_dim_v]
        out, lse = refattn.attention(
            np.swapaxes(q[b], 0, 1), rows[None], values[None], return_lse=True,
            **options,
        )  # fmt: skip
        outs.append(np.swapaxes(out, 0, 1))
        lses.append(lse)
    out, lse = np.stack(outs), np.stack(lses)
    return (out, lse) if return_lse else out


def flashmla_like(q, cache, *, head_dim_v, block_table, cache_seqlens, **options):
    """q (B, L, H, D), cache (P, page, 1, D) -> out (B, L, H, head_dim_v) [, lse (B, H, L)]."""
    return _run(q, cache, head_dim_v, block_table, cache_seqlens, options)


def values_from_the_end(q, cache, *, head_dim_v, block_table, cache_seqlens, **options):
    """Takes the values from the cache row's last head_dim_v features (the rope part too)."""
    return _run(q, cache, head_dim_v, block_table, cache_seqlens, options, from_end=True)
