"""The DSA calling convention of sparse attention kernels (``--layout dsa``).

DeepSeek Sparse Attention's indexer and FlashMLA's sparse kernels take the blhd layout with
the top-k key positions per query row and kv head as ``indices`` (B, L, K, T) (query rows
before kv heads): q (B, L, H, D), k (B, S, K, D), v (B, S, K, E); out (B, L, H, E) and
optionally lse (B, H, L). Block-sparse cases pass ``block_indices`` (B, L, K, T) and
``block_size``. Every other keyword keeps refattn's name and meaning; ``mask``, ``bias`` and
``dropout_mask`` keep their (B, H, L, S) layout. refattn's keyword is ``key_indices``
(B, K, L, T) (bhld); :func:`dsa_layout` converts one to the other.

Examples
--------
>>> import numpy as np
>>> q, k, v = np.zeros((1, 2, 3, 4)), np.zeros((1, 1, 5, 4)), np.zeros((1, 1, 5, 2))
>>> args, kwargs, unpack = dsa_layout(q, k, v, {"key_indices": np.zeros((1, 1, 3, 7), int)})
>>> args[0].shape, kwargs["indices"].shape
((1, 3, 2, 4), (1, 3, 1, 7))
"""

from __future__ import annotations

import numpy as np

__all__ = ["DSA_KEYWORDS", "dsa_layout", "refused_keyword"]


def _swap(a):
    return np.ascontiguousarray(np.swapaxes(a, -3, -2))


def dsa_layout(q, k, v, options):
    """(args, kwargs, unpack) of the DSA convention from the oracle's bhld inputs."""
    kwargs = dict(options)
    indices = kwargs.pop("key_indices", None)
    if indices is not None:
        kwargs["indices"] = _swap(np.asarray(indices))
    blocks = kwargs.pop("key_block_indices", None)
    if blocks is not None:
        kwargs["block_indices"] = _swap(np.asarray(blocks))
        kwargs["block_size"] = kwargs.pop("key_block_size")

    def unpack(x, what):
        return np.asarray(x) if what == "lse" else _swap(np.asarray(x))

    return (_swap(q), _swap(k), _swap(v)), kwargs, unpack


#: The keywords the DSA convention introduces (refused ones make a case "unsupported").
DSA_KEYWORDS = ("indices", "block_indices", "block_size")


def refused_keyword(err: TypeError, layout: str) -> Exception:
    """A TypeError refusing one of the DSA keywords as NotImplementedError (the case is
    "unsupported", as for refattn's own keyword names); any other error unchanged."""
    text = str(err)
    if layout == "dsa" and "keyword argument" in text:
        for name in DSA_KEYWORDS:
            if f"'{name}'" in text:
                return NotImplementedError(f"the implementation does not accept {name}= ({text})")
    return err
