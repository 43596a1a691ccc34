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

import ml_dtypes
import numpy as np

__all__ = ["CONVENTIONS", "FLASHINFER", "stacked", "adapt", "flashinfer"]

#: The merge conventions (CLI ``--merge-convention``; the FlashInfer ones also as
#: ``--signature``).
CONVENTIONS = ("stacked", "pair", "flashinfer_merge_state", "flashinfer_merge_states")
#: The conventions that are a library's own functions (torch, base-2 lse).
FLASHINFER = ("flashinfer_merge_state", "flashinfer_merge_states")


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
    if convention in FLASHINFER:
        fn, framework = flashinfer(impl, convention, device), "torch"
    else:
        fn = impl if framework == "numpy" else _torch_bridge(impl, device)
        fn = fn if convention == "stacked" else stacked(fn)
    # what a reproduce line must repeat (oracle.run.validate.reproduce_command)
    fn.reproduce_flags = (
        f" --merge-convention {convention}"
        + (f" --framework {framework}" if framework != "numpy" else "")
        + (f" --device {device}" if device != "cpu" else "")
    )
    return fn


#: unit roundoffs of the case's output dtype by which converting a natural lse to FlashInfer's
#: float32 base-2 s may move it (and so each state's weight) before the case is not expressible
CONVERSION_ROUNDOFFS = 16


def _float32_base2(lses, base, out_dtype):
    """The case's lses (P, ..., L) as FlashInfer's s: float32, base 2. A base-2 case's lses
    convert exactly (or the case is not expressible: a float64 lse); a natural-log case's are
    multiplied by log2(e) in float64 and rounded once to float32 (the conversion any base-e
    caller of FlashInfer makes). That rounding moves each lse by up to |lse| 2**-24 (natural
    units) and the states' weights ``e^(lse_p - LSE)`` with it: when a weight moves by more
    than :data:`CONVERSION_ROUNDOFFS` unit roundoffs of ``out_dtype`` the merge would be
    judged on inputs it was not given, and the case is not expressible (merge-large-pos and
    merge-large-neg, |lse| ~ 1e4, in float32)."""
    lses = np.asarray(lses)
    if lses.dtype == np.float64:
        raise NotImplementedError(
            "not expressible in this layout: FlashInfer's merge takes float32 lse (s); the "
            "case's lses are float64"
        )
    wide = lses.astype(np.float64)
    if base == 2:
        return wide.astype(np.float32)
    with np.errstate(invalid="ignore"):
        s = (wide * np.log2(np.e)).astype(np.float32)
        moved = np.abs(_weights(s.astype(np.float64) * np.log(2.0)) - _weights(wide))
    allowed = CONVERSION_ROUNDOFFS * float(ml_dtypes.finfo(out_dtype).eps) / 2
    if moved.size and np.nanmax(moved, initial=0.0) > allowed:
        raise NotImplementedError(
            "not expressible in this layout: FlashInfer's merge takes base-2 float32 s; "
            f"converting this case's natural lses to it moves a state's weight by "
            f"{np.nanmax(moved):.3g}, more than {CONVERSION_ROUNDOFFS} unit roundoffs of its "
            f"{np.dtype(out_dtype).name} outputs ({allowed:.3g})"
        )
    return s


def _fold_expressible(s, out_dtype):
    """``merge_state`` folded left to right hands each intermediate S back as float32 (its
    return dtype): not expressible when rounding one moves a state's weight by more than
    :data:`CONVERSION_ROUNDOFFS` unit roundoffs of ``out_dtype`` (|S| ~ 1e4: merge-large-*),
    the fold being the oracle's, not the function's."""
    ln2 = np.log(2.0)
    wide = s.astype(np.float64)
    partial = wide[0]
    allowed = CONVERSION_ROUNDOFFS * float(ml_dtypes.finfo(out_dtype).eps) / 2
    with np.errstate(invalid="ignore", over="ignore"):
        for p in range(1, wide.shape[0] - 1):
            partial = np.logaddexp2(partial, wide[p])
            rounded = partial.astype(np.float32).astype(np.float64)
            rest = wide[p + 1 :]
            exact = _weights(np.concatenate([partial[None], rest]) * ln2)
            moved = np.abs(_weights(np.concatenate([rounded[None], rest]) * ln2) - exact)
            if np.nanmax(moved, initial=0.0) > allowed:
                raise NotImplementedError(
                    "not expressible in this layout: merge_state folded left to right "
                    "returns each intermediate S in float32; rounding one moves a state's "
                    f"weight by {np.nanmax(moved):.3g}, more than {CONVERSION_ROUNDOFFS} unit "
                    f"roundoffs of the {np.dtype(out_dtype).name} outputs ({allowed:.3g})"
                )


def _weights(lses):
    """Each state's weight ``e^(lse_p - LSE)`` (P, ...) of natural lses (P, ...); 0 where a
    row's states are all empty."""
    top = np.max(lses, axis=0)
    top = np.where(np.isfinite(top), top, 0.0)
    raw = np.exp(lses - top)
    total = raw.sum(axis=0)
    return np.where(total > 0, raw / np.where(total > 0, total, 1.0), 0.0)


def flashinfer(impl, convention, device="cpu"):
    """FlashInfer's ``merge_state(v_a, s_a, v_b, s_b) -> (V, S)`` (folded left to right) or
    ``merge_states(v, s) -> (V, S)`` as a stacked-convention NumPy function: v (seq, heads,
    dim) / (seq, states, heads, dim), s float32 base-2 (seq, heads) / (seq, states, heads),
    seq = the case's B * L rows; S brought back to the case's base."""
    bridge = _torch_bridge(lambda *a: a, device)  # its to / back only

    def merge(outs, lses, lse_base="e", **options):
        if options:
            raise NotImplementedError(f"{convention}: no keyword for {sorted(options)}")
        outs = np.asarray(outs)
        states, heads, rows = outs.shape[0], outs.shape[-3], outs.shape[-2]
        v = np.moveaxis(outs.reshape(states, -1, heads, rows, outs.shape[-1]), 3, 2)
        v = np.ascontiguousarray(v.reshape(states, -1, heads, outs.shape[-1]))  # (P, seq, H, E)
        s = _float32_base2(lses, lse_base, outs.dtype)
        s = np.ascontiguousarray(
            np.moveaxis(s.reshape(states, -1, heads, rows), 3, 2).reshape(states, -1, heads)
        )
        if convention == "flashinfer_merge_states":
            big_v = np.ascontiguousarray(np.moveaxis(v, 0, 1))
            merged, merged_s = impl(bridge.to(big_v), bridge.to(np.moveaxis(s, 0, 1).copy()))
        else:
            _fold_expressible(s, outs.dtype)
            merged, merged_s = bridge.to(v[0]), bridge.to(s[0])
            for p in range(1, states):
                merged, merged_s = impl(merged, merged_s, bridge.to(v[p]), bridge.to(s[p]))
        out, lse = bridge.back(merged), bridge.back(merged_s).astype(np.float64)
        if lse_base != 2:
            lse = lse * np.log(2.0)
        shape = outs.shape[1:-3]
        out = np.moveaxis(out.reshape(*shape, rows, heads, -1), -2, -3)
        lse = np.moveaxis(lse.reshape(*shape, rows, heads), -1, -2)
        return out, lse

    merge.__name__ = f"{convention}({getattr(impl, '__name__', 'merge')})"
    return merge


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

    merge.to, merge.back = to, back
    merge.__name__ = getattr(impl, "__name__", "merge")
    return merge
