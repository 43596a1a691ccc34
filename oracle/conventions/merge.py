"""Calling conventions of a merge implementation under test.

The merge cases (:mod:`oracle.catalogue.merge_families`) call the stacked convention
``impl(outs=(P, ..., L, E), lses=(P, ..., L), **options)`` (refattn's). A pairwise
implementation ``impl(out_a, lse_a, out_b, lse_b, **options)`` (FlashInfer's ``merge_state``)
is adapted by :func:`stacked`, which folds the P states left to right; associativity of the
exact merge makes the fold's truth the same, and each step's rounding is what the tolerance's
``gamma_{4P+8}`` floor allows for.

Examples
--------
>>> import numpy as np
>>> def pair(out_a, lse_a, out_b, lse_b):
...     return (out_a + out_b) / 2, np.logaddexp(lse_a, lse_b)
>>> out, lse = stacked(pair)(outs=np.ones((3, 1, 1, 2)), lses=np.zeros((3, 1, 1)))
>>> out.tolist()
[[[1.0, 1.0]]]
"""

from __future__ import annotations

import numpy as np

__all__ = ["CONVENTIONS", "stacked", "adapt"]

#: The merge conventions (CLI ``--merge-convention``).
CONVENTIONS = ("stacked", "pair")


def stacked(pair):
    """The stacked-convention function of a pairwise merge ``pair(out_a, lse_a, out_b,
    lse_b, **options)``."""

    def merge(outs, lses, **options):
        out, lse = outs[0], lses[0]
        for p in range(1, len(outs)):
            out, lse = pair(out, lse, outs[p], lses[p], **options)
        return out, lse

    merge.__name__ = f"stacked({getattr(pair, '__name__', 'pair')})"
    return merge


def adapt(impl, convention: str = "stacked", framework: str = "numpy", device: str = "cpu"):
    """``impl`` as a NumPy function in the stacked convention: a pairwise ``impl`` folded by
    :func:`stacked`; a torch ``impl`` (``framework="torch"``) given tensors on ``device``
    (bit for bit, bfloat16 through an int16 view) and its results brought back."""
    if convention not in CONVENTIONS:
        raise ValueError(
            f"merge convention: expected one of {list(CONVENTIONS)}, got {convention!r}"
        )
    if framework not in ("numpy", "torch"):
        raise ValueError(f"framework: merge cases take 'numpy' or 'torch', got {framework!r}")
    fn = impl if framework == "numpy" else _torch_bridge(impl, device)
    return fn if convention == "stacked" else stacked(fn)


def _torch_bridge(impl, device):
    try:
        # optional package (torch extra)
        import torch
    except ImportError:
        raise ImportError("framework 'torch' needs torch: pip install -e \".[torch]\"") from None

    def to(a):
        if not isinstance(a, np.ndarray):
            return a
        own = np.array(a, copy=True, order="C")
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(own.view(np.int16)).view(torch.bfloat16).to(device)
        return torch.from_numpy(own).to(device)

    def back(x):
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            return x.float().numpy() if x.dtype == torch.bfloat16 else x.numpy()
        return np.asarray(x)

    def merge(*args, **kwargs):
        result = impl(*(to(a) for a in args), **{k: to(v) for k, v in kwargs.items()})
        return tuple(back(x) for x in result)

    merge.__name__ = getattr(impl, "__name__", "merge")
    return merge
