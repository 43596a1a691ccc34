"""Adapter for ``torch.nn.attention.flex_attention.flex_attention`` on the CPU (eager).

flex_attention has no option flags: every variant is a ``score_mod(score, b, h, q_idx,
kv_idx)`` applied to the scaled score ``scale * q.k`` and a ``mask_mod(b, h, q_idx, kv_idx)``
turned into a block mask. The adapter writes them as a user would.

Option mapping (refattn -> torch 2.13 flex_attention):

=================  ==================================================================
refattn            flex_attention
=================  ==================================================================
scale              ``scale=``
mask, causal,      one ``mask_mod`` reading the allowed set (B, H, L, S) of refattn's
window, align,     spec (:meth:`refattn.spec.AttentionSpec.allowed`: mask, causal and
kv_lengths         window at the case's alignment, keys past each row's length, -inf
                   bias entries), through ``create_block_mask``
softcap            ``score_mod``: ``c * tanh(score / c)`` on the scaled score (Gemma 2)
bias (float)       ``score_mod``: ``score + bias[b, h, q_idx, kv_idx]`` (after softcap),
                   the bias in q's dtype when it converts exactly (else unsupported)
ALiBi              ``score_mod``: ``score - slope[h] * |q_idx + o - kv_idx|`` (o the
                   alignment offset; not with kv_lengths, whose offset is per row),
                   slopes in q's dtype when they convert exactly
gqa interleave     ``enable_gqa=True``
return_lse         ``return_aux=AuxRequest(lse=True)``: flex's own log-sum-exp, returned
                   as flex gives it (float32 for float16/bfloat16 inputs)
=================  ==================================================================

Unsupported (NotImplementedError): sinks, dropout, ``gqa="tile"``, float8 inputs, ALiBi with
kv_lengths, and float16 on the CPU when the eager path refuses it.

The eager path (no ``torch.compile``) materialises the scores; it warns that it is unfused,
which the adapter silences. ``.vjp`` differentiates the same call with autograd (dq, dk, dv;
no dbias: a bias is a captured score_mod tensor). torch 2.13 has no flex backward on the CPU
("FlexAttention does not support backward on CPU"), so on this device every gradient case is
"unsupported" with torch's own message.

Measured on refattn's ``default`` suite (torch 2.13.0+cpu, every dtype): no conformance
failure in either tolerance tier; the robustness cases with NaN/Inf poison at excluded keys
fail (the eager path multiplies the poisoned values by zero weights), as diagnosed.

Examples
--------
>>> from oracle.adapters import get
>>> flex = get("torch-flex")  # doctest: +SKIP
>>> import numpy as np
>>> q = np.ones((1, 2, 3, 4)); k = np.ones((1, 2, 5, 4)); v = np.ones((1, 2, 5, 6))
>>> flex(q, k, v, causal=True).shape  # doctest: +SKIP
(1, 2, 3, 6)
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from oracle.adapters import Adapter, exact_cast, reject_common
from oracle.adapters.torch import from_torch, to_torch

try:  # torch >= 2.9: return_aux; older: return_lse
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - depends on the torch version
    AuxRequest = None

__all__ = ["TorchFlexAttention"]


class TorchFlexAttention(Adapter):
    """refattn's calling convention over torch's flex_attention (CPU, eager)."""

    name = "torch-flex"
    peer = f"torch {torch.__version__} flex_attention"
    fully_masked_rows = "zero"

    def _check(self, spec):
        alibi = spec.alibi_slopes
        if alibi is not None and spec.kv_lengths is not None:
            self.unsupported(
                "alibi_slopes",
                "<slopes>",
                "the adapter's ALiBi score_mod uses "
                "one alignment offset; with kv_lengths it is per row",
            )
        # ALiBi is a score_mod here (flex's own arithmetic), not a bias folded by the adapter
        reject_common(
            self,
            spec,
            softcap=True,
            window=True,
            lse=True,
            return_lse=True,
            kv_lengths=True,
            alibi=True,
        )

    def _mods(self, spec, bias=None):
        """(score_mod or None, block_mask or None) of the spec, captured tensors on the CPU."""
        batch, heads, length = spec.q.shape[:3]
        keys = spec.k.shape[2]
        allowed = np.stack(
            [np.stack([spec.allowed(b, h) for h in range(heads)]) for b in range(batch)]
        )
        block_mask = None
        if not allowed.all():
            table = torch.from_numpy(np.ascontiguousarray(allowed))

            def mask_mod(b, h, q_idx, kv_idx):
                return table[b, h, q_idx, kv_idx]

            block_mask = create_block_mask(mask_mod, batch, heads, length, keys, device="cpu")
        cap = spec.softcap
        slopes = None
        if spec.alibi_slopes is not None:
            slopes = exact_cast(spec.alibi_slopes, spec.q.dtype, "alibi_slopes", self.peer)
            slopes = to_torch(slopes)
        offset = spec.offset
        if cap is None and bias is None and slopes is None:
            return None, block_mask

        def score_mod(score, b, h, q_idx, kv_idx):
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if bias is not None:
                score = score + bias[b, h, q_idx, kv_idx]
            if slopes is not None:
                score = score - slopes[h] * torch.abs(q_idx + offset - kv_idx)
            return score

        return score_mod, block_mask

    def _flex(self, spec, q, k, v, bias, return_lse):
        score_mod, block_mask = self._mods(spec, bias)
        kwargs = dict(
            score_mod=score_mod,
            block_mask=block_mask,
            scale=spec.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "called without torch.compile()"
            if not return_lse:
                return flex_attention(q, k, v, **kwargs), None
            if AuxRequest is not None:
                out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
                return out, aux.lse
            warnings.simplefilter("ignore", FutureWarning)  # pragma: no cover
            return flex_attention(q, k, v, return_lse=True, **kwargs)  # pragma: no cover

    def _bias(self, spec, requires_grad=False):
        if spec.bias is None:
            return None
        finite = np.where(np.isneginf(spec.bias), 0.0, spec.bias)  # -inf: in the block mask
        bias = exact_cast(finite, spec.q.dtype, "bias", self.peer)
        return to_torch(
            np.ascontiguousarray(np.broadcast_to(bias, spec.bias.shape)),
            requires_grad=requires_grad,
        )

    def _forward(self, spec, return_lse):
        self._check(spec)
        q, k, v = (to_torch(a) for a in (spec.q, spec.k, spec.v))
        try:
            with torch.no_grad():
                out, lse = self._flex(spec, q, k, v, self._bias(spec), return_lse)
        except (RuntimeError, NotImplementedError) as err:
            if "Half" in str(err) or "half" in str(err):
                self.unsupported("q", f"<{spec.q.dtype.name}>", f"eager CPU path: {err}")
            raise
        return from_torch(out), None if lse is None else from_torch(lse)

    def vjp(self, q, k, v, grad_out, **options):
        """(dq, dk, dv, dbias) of flex_attention by autograd, in the input dtype and shapes."""
        if options.pop("grad_lse", None) is not None:
            self.unsupported("grad_lse", "<cotangent>", "the adapter differentiates out only")
        spec, _ = self._canonical(q, k, v, options)
        self._check(spec)
        if spec.bias is not None:
            self.unsupported(
                "bias", "<gradient>", "the adapter gives no dbias (a captured score_mod tensor)"
            )
        shape = spec.batch_shape
        if spec.single_head or tuple(np.shape(q)[:-3]) != tuple(shape) or len(shape) != 1:
            self.unsupported(
                "q", f"<shape {np.shape(q)}>", "the adapter's vjp takes 4-D (B, H, L, D) inputs"
            )
        leaves = [to_torch(np.asarray(a), requires_grad=True) for a in (q, k, v)]
        out, _ = self._flex(spec, *leaves, None, False)
        out.backward(to_torch(np.asarray(grad_out)))
        return tuple(from_torch(t.grad) for t in leaves) + (None,)
