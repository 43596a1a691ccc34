"""Adapter for ``torch.nn.functional.scaled_dot_product_attention`` on the CPU.

Option mapping (refattn -> torch 2.13 SDPA):

=================  ==================================================================
refattn            torch
=================  ==================================================================
scale              ``scale=`` (a Python float: torch keeps it in double)
mask (bool)        ``attn_mask`` (bool, True = attend)
bias (float)       ``attn_mask`` (float, added); -inf excludes. Needs q's dtype: a bias
                   that does not convert exactly is unsupported
mask and bias      ``attn_mask = where(mask, bias, -inf)`` (torch takes one attn_mask; this
                   is what torch itself does with a bool mask)
causal, top_left   ``is_causal=True``
causal, bottom     ``attn_mask=torch.nn.attention.bias.causal_lower_right(L, S)``
causal + mask/bias torch forbids is_causal with attn_mask: the causal set is materialised as
                   a bool mask by refattn.spec (``spec.structural()``: j <= i + o, o = 0 or
                   S - L, the set torch itself builds for is_causal / causal_lower_right)
                   and intersected with the mask
gqa interleave     ``enable_gqa=True`` (torch repeats kv heads with repeat_interleave)
kv_lengths         a bool ``attn_mask`` (B, 1, L, S): keys j < S_b, intersected with the
                   causal set of each row's own alignment (offset S_b - L under
                   bottom_right); SDPA has no per-row lengths, the mask states the same set
=================  ==================================================================

Unsupported (NotImplementedError): softcap, window, return_lse (SDPA returns no lse), ALiBi,
dropout (torch draws its own random mask), ``gqa="tile"``, sinks (SDPA has no attention-sink
option), float8 inputs.

Measured behaviour passed through unchanged (torch 2.13.0+cpu): fully masked rows give 0
(torch's math path uses ``_safe_softmax``) in float64, float32, float16 and bfloat16, also for
``causal_lower_right`` with L > S, where torch warns that the output "will produce NaNs" (the
adapter silences that warning; the oracle judges the output).

``.vjp`` differentiates the same call with autograd: bias is a leaf of its own shape,
broadcast inside torch, so dbias is torch's own reduction over the broadcast dimensions.

Examples
--------
>>> import numpy as np
>>> from oracle.adapters import get
>>> sdpa = get("torch")  # doctest: +SKIP
>>> q = np.ones((2, 3, 4)); k = np.ones((2, 5, 4)); v = np.ones((2, 5, 6))
>>> sdpa(q, k, v, causal=True).shape  # doctest: +SKIP
(2, 3, 6)
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from oracle.adapters import Adapter, exact_cast, reject_common

__all__ = ["TorchSDPA", "to_torch", "from_torch"]

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def to_torch(array: np.ndarray, *, requires_grad: bool = False) -> torch.Tensor:
    """NumPy -> torch CPU tensor with the same bits (bfloat16 through a 16-bit view)."""
    array = np.ascontiguousarray(array)
    if array.dtype == _BFLOAT16:
        tensor = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array.copy())
    return tensor.requires_grad_(requires_grad)


def from_torch(tensor: torch.Tensor) -> np.ndarray:
    """torch tensor -> NumPy array with the same bits (bfloat16 -> ml_dtypes.bfloat16)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_BFLOAT16)
    return tensor.numpy()


class TorchSDPA(Adapter):
    """refattn's calling convention over torch SDPA (CPU)."""

    name = "torch"
    peer = f"torch {torch.__version__} scaled_dot_product_attention"
    fully_masked_rows = "zero"

    def _check(self, spec, return_lse):
        reject_common(self, spec, return_lse=return_lse, kv_lengths=True)

    def _sdpa(self, spec, q, k, v, bias):
        """SDPA on 4-D tensors; ``bias`` a float tensor broadcastable to (B, H, L, S) or None."""
        length, keys = q.shape[2], k.shape[2]
        mask = None if spec.mask is None else torch.from_numpy(np.array(spec.mask, copy=True))
        is_causal = False
        if spec.kv_lengths is not None:
            # per-row key lengths: the row's own allowed set (keys j < S_b, causal aligned to
            # S_b under bottom_right) as a bool mask, (B, 1, L, S)
            rows = np.stack([spec.structural(b=b) for b in range(q.shape[0])])[:, None]
            rows = torch.from_numpy(rows)
            mask = rows if mask is None else mask & rows
        elif spec.causal:
            if mask is None and bias is None:
                if spec.offset == 0:
                    is_causal = True
                else:
                    with warnings.catch_warnings():
                        # torch warns that L > S "will produce NaNs"; the oracle judges what
                        # it really produces (the warning would be an error under -W error).
                        warnings.simplefilter("ignore", UserWarning)
                        mask = causal_lower_right(length, keys)
            else:
                # refattn.spec's causal set (j <= i + o) as a bool mask, (L, S)
                structural = torch.from_numpy(spec.structural())
                mask = structural if mask is None else mask & structural
        if bias is not None and mask is not None:
            attn_mask = torch.where(mask, bias, torch.tensor(-torch.inf, dtype=bias.dtype))
        else:
            attn_mask = bias if bias is not None else mask
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=spec.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    def _bias_tensor(self, spec, bias_leaf=None):
        if spec.bias is None:
            return None
        if bias_leaf is not None:
            return bias_leaf
        return to_torch(exact_cast(spec.bias, spec.q.dtype, "bias", self.peer))

    def _forward(self, spec, return_lse):
        self._check(spec, return_lse)
        q, k, v = (to_torch(a) for a in (spec.q, spec.k, spec.v))
        with torch.no_grad():
            out = self._sdpa(spec, q, k, v, self._bias_tensor(spec))
        return from_torch(out), None

    def vjp(self, q, k, v, grad_out, **options):
        """(dq, dk, dv, dbias) of torch SDPA by autograd, in the input dtype and shapes.

        dbias is None without bias. ``grad_lse`` is unsupported (SDPA returns no lse).
        """
        if options.pop("grad_lse", None) is not None:
            self.unsupported("grad_lse", "<cotangent>", "it does not return the log-sum-exp")
        spec, return_lse = self._canonical(q, k, v, options)
        self._check(spec, return_lse)
        leaves = [to_torch(np.asarray(a), requires_grad=True) for a in (q, k, v)]
        bias_leaf = None
        if spec.bias is not None:
            bias = exact_cast(np.asarray(options["bias"]), spec.q.dtype, "bias", self.peer)
            bias_leaf = to_torch(bias, requires_grad=True)
        flat = [
            _flatten(t, spec, s.shape[1:])
            for t, s in zip(leaves, (spec.q, spec.k, spec.v), strict=True)
        ]
        bias_4d = None
        if bias_leaf is not None:
            bias_4d = _flatten_plane(bias_leaf, spec)
        out = self._sdpa(spec, *flat, bias_4d)
        out = out.reshape(tuple(spec.batch_shape) + tuple(out.shape[1:]))
        if spec.single_head:
            out = out[0]
        out.backward(to_torch(np.asarray(grad_out)))
        grads = [from_torch(t.grad) for t in leaves]
        dbias = None if bias_leaf is None else from_torch(bias_leaf.grad)
        return tuple(grads) + (dbias,)


def _flatten(tensor, spec, tail):
    """(..., X, Y, Z) or 2-D tensor -> (B, X, Y, Z) inside autograd."""
    if spec.single_head:
        tensor = tensor[None]
    full = torch.broadcast_to(tensor, tuple(spec.batch_shape) + tuple(tail))
    return full.reshape((-1,) + tuple(tail)) if spec.batch_shape else full[None]


def _flatten_plane(tensor, spec):
    heads, length, keys = spec.q.shape[1], spec.q.shape[2], spec.k.shape[2]
    tail = (heads, length, keys)
    full = torch.broadcast_to(tensor, tuple(spec.batch_shape) + tail)
    return full.reshape((-1,) + tail) if spec.batch_shape else full[None]
