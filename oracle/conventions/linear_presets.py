"""Signature presets of the linear-attention libraries (``--signature fla_gated_delta_rule``...).

The oracle calls a linear-attention implementation in refattn's convention
(:mod:`oracle.judging.linear`: q, k (B, H, T, D), v (B, HV, T, E), gates (B, HV, T[, D]),
states (N, HV, D, E), keywords ``initial_state``, ``cu_seqlens``, ``output_final_state``,
``qk_l2norm``, ``gate_base``, ``scale``). A preset (:class:`LinearSignature`) speaks it in a
library's instead:

* ``fla_gated_delta_rule``, ``fla_kda``, ``fla_gla``, ``fla_simple_gla``: flash-linear-
  attention's ``chunk_*`` and ``fused_recurrent_*`` functions of ``fla.ops.gated_delta_rule``,
  ``kda``, ``gla``, ``simple_gla``: torch tensors in its [B, T, H, K] layout (v [B, T, HV, V],
  g [B, T, HV] or [B, T, HV, K], beta [B, T, HV]); keywords ``scale``, ``initial_state``
  ([N, HV, K, V], float32), ``output_final_state``, ``cu_seqlens`` (int64, B = 1) and, for the
  delta-rule forms, ``use_qk_l2norm_in_kernel``; value head j reads key head ``j // (HV /
  H)`` (its ``i_h = i_hv // (HV // H)``); gates are natural logs; returns ``(o, final_state)``.
  GLA's vector gate goes in the fourth argument (``g`` of ``chunk_gla``, ``gk`` of
  ``fused_recurrent_gla``).
* ``transformers_gated_delta_rule``: transformers' qwen3_next ``torch_chunk_gated_delta_rule``
  / ``torch_recurrent_gated_delta_rule(query, key, value, g, beta, [chunk_size,]
  initial_state, output_final_state, use_qk_l2norm_in_kernel)``: [B, T, H, K] tensors, the
  scale always ``1/sqrt(K)``, no packed sequences; returns ``(core_attn_out,
  last_recurrent_state)`` ([B, HV, K, V], float32).

A case a library cannot express (another form, base-2 gates, a scale or packed sequences it
has no keyword for) raises NotImplementedError naming why (the verdict "unsupported").

>>> get("fla_kda").form, get("transformers_gated_delta_rule").library
('kda', 'transformers qwen3_next torch_*_gated_delta_rule')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = ["LinearSignature", "PRESETS", "get", "wrap", "is_linear"]

#: form -> (gate kind, takes beta)
_FORMS = {
    "gdn": ("scalar", True),
    "kda": ("vector", True),
    "gla": ("vector", False),
    "simple_gla": ("scalar", False),
}
_BIT_VIEWS = {"bfloat16": (np.uint16, "bfloat16")}


@dataclass(frozen=True)
class LinearSignature:
    """A linear-attention library's convention (see the module docstring); a row of
    :data:`oracle.conventions.signatures.PRESETS` like the softmax presets.

    ``layout`` and ``framework`` name what the library takes (for
    :func:`oracle.conventions.layouts.check_convention`); ``form`` the recurrence the function
    computes (gdn, kda, gla, simple_gla); ``has_scale``, ``has_varlen``, ``has_l2norm`` which
    of refattn's options it can express.
    """

    name: str
    library: str
    layout: str = "blhd"
    framework: str = "torch"
    form: str = "gdn"
    has_scale: bool = True
    has_varlen: bool = True
    has_l2norm: bool = True
    linear: bool = True


def _unsupported(preset, what):
    raise NotImplementedError(f"{preset.name}: {what} cannot be expressed in {preset.library}")


def _check(preset, g, beta, options):
    gate, takes_beta = _FORMS[preset.form]
    kind = None if g is None else ("vector" if np.ndim(g) == 4 else "scalar")
    if kind != gate or (beta is not None) != takes_beta:
        _unsupported(preset, f"the form (gate {kind}, beta {beta is not None})")
    if str(options.get("gate_base", "e")) != "e":
        _unsupported(preset, "gate_base='2' (its gates are natural logs)")
    if options.get("qk_l2norm") and not preset.has_l2norm:
        _unsupported(preset, "qk_l2norm=True")
    if options.get("cu_seqlens") is not None and not preset.has_varlen:
        _unsupported(preset, "cu_seqlens (packed sequences)")


class _Torch:
    """NumPy <-> torch, bit for bit (bfloat16 through its bit pattern)."""

    def __init__(self, device):
        import torch  # optional peer framework

        self.torch, self.device = torch, device

    def to(self, a, dtype=None):
        if a is None:
            return None
        a = np.array(a, copy=True, order="C")
        if a.dtype.name in _BIT_VIEWS:
            bits, name = _BIT_VIEWS[a.dtype.name]
            tensor = self.torch.from_numpy(a.view(bits)).view(getattr(self.torch, name))
        else:
            tensor = self.torch.from_numpy(a)
        if dtype is not None:
            tensor = tensor.to(dtype)
        return tensor.to(self.device)

    def back(self, t):
        if t is None:
            return None
        t = t.detach().to("cpu")
        if t.dtype == self.torch.bfloat16:
            return t.contiguous().view(self.torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()


def _blhd(t, torch):
    return None if t is None else torch.movedim(t, 2, 1).contiguous() if t.ndim == 4 else t


def _keywords(preset, options, bridge, state_dtype):
    kwargs = {"output_final_state": True}
    h0 = options.get("initial_state")
    if h0 is not None:
        kwargs["initial_state"] = bridge.to(h0, state_dtype)
    if options.get("cu_seqlens") is not None:
        kwargs["cu_seqlens"] = bridge.to(np.asarray(options["cu_seqlens"], dtype=np.int64))
    if preset.has_l2norm and options.get("qk_l2norm"):
        kwargs["use_qk_l2norm_in_kernel"] = True
    if preset.has_scale and options.get("scale") is not None:
        kwargs["scale"] = float(options["scale"])
    return kwargs


def _checked(preset, q, g, beta, options):
    _check(preset, g, beta, options)
    if options.get("scale") is not None and not preset.has_scale:
        default = 1.0 / math.sqrt(np.shape(q)[-1])
        if float(options["scale"]) != default:
            _unsupported(preset, f"scale={options['scale']!r} (it uses 1/sqrt(K))")


def _leaves(bridge, arrays, grad):
    """Torch tensors of the (B, H, T, ...) arrays in the [B, T, H, ...] layout; with ``grad``
    the leaves that the gradients are taken with respect to."""
    torch = bridge.torch
    leaves = {}
    for name, x in arrays.items():
        tensor = bridge.to(x)
        if tensor is not None and grad:
            tensor.requires_grad_(True)
        leaves[name] = tensor
    moved = {
        n: None if t is None else torch.movedim(t, 2, 1).contiguous() for n, t in leaves.items()
    }
    return leaves, moved


def _run(impl, preset, bridge, arrays, options, grad=False):
    torch = bridge.torch
    state_dtype = torch.float64 if np.asarray(arrays["q"]).dtype == np.float64 else torch.float32
    leaves, moved = _leaves(bridge, arrays, grad)
    args = [moved[n] for n in ("q", "k", "v", "g", "beta") if moved[n] is not None]
    kwargs = _keywords(preset, options, bridge, state_dtype)
    if grad and "initial_state" in kwargs:
        kwargs["initial_state"].requires_grad_(True)
        leaves["initial_state"] = kwargs["initial_state"]
    o, state = impl(*args, **kwargs)[:2]
    return leaves, o, state


def wrap(impl, preset, device="cpu"):
    """``impl`` (in ``preset``'s convention) as a function of refattn's convention, with a
    ``.vjp`` in refattn's (torch autograd through ``impl``)."""
    preset = get(preset)

    def forward(q, k, v, g=None, beta=None, *, output_final_state=False, **options):
        _checked(preset, q, g, beta, options)
        bridge = _Torch(device)
        arrays = dict(q=q, k=k, v=v, g=g, beta=beta)
        _, o, state = _run(impl, preset, bridge, arrays, options)
        o = bridge.back(bridge.torch.movedim(o, 1, 2).contiguous())
        return (o, bridge.back(state)) if output_final_state else o

    def vjp(q, k, v, g, beta, do, dht=None, **options):
        _checked(preset, q, g, beta, options)
        bridge = _Torch(device)
        torch = bridge.torch
        arrays = dict(q=q, k=k, v=v, g=g, beta=beta)
        with torch.enable_grad():
            leaves, o, state = _run(impl, preset, bridge, arrays, options, grad=True)
            outputs, cotangents = [o], [torch.movedim(bridge.to(do), 2, 1).to(o.dtype)]
            if dht is not None:
                outputs.append(state)
                cotangents.append(bridge.to(dht).to(state.dtype))
            wanted = [t for t in leaves.values() if t is not None]
            found = torch.autograd.grad(outputs, wanted, cotangents, allow_unused=True)
        by_name = dict(zip([n for n, t in leaves.items() if t is not None], found, strict=True))
        return tuple(
            None if by_name.get(n) is None else bridge.back(by_name[n])
            for n in ("q", "k", "v", "g", "beta", "initial_state")
        )

    forward.__name__ = getattr(impl, "__name__", "linear")
    forward.vjp = vjp
    forward.convention = {"signature": preset.name}
    return forward


def _fla(name, form, module, l2norm):
    return LinearSignature(
        name,
        f"flash-linear-attention fla.ops.{module} chunk_/fused_recurrent_{module}",
        layout="blhd",
        framework="torch",
        form=form,
        has_l2norm=l2norm,
    )


PRESETS = {
    "fla_gated_delta_rule": _fla("fla_gated_delta_rule", "gdn", "gated_delta_rule", True),
    "fla_kda": _fla("fla_kda", "kda", "kda", True),
    "fla_gla": _fla("fla_gla", "gla", "gla", False),
    "fla_simple_gla": _fla("fla_simple_gla", "simple_gla", "simple_gla", False),
    "transformers_gated_delta_rule": LinearSignature(
        "transformers_gated_delta_rule",
        "transformers qwen3_next torch_*_gated_delta_rule",
        layout="blhd",
        framework="torch",
        form="gdn",
        has_scale=False,
        has_varlen=False,
    ),
}


def get(name) -> LinearSignature:
    """The linear preset called ``name`` (a :class:`LinearSignature` is returned as is)."""
    if isinstance(name, LinearSignature):
        return name
    if name not in PRESETS:
        raise ValueError(f"signature: expected one of {list(PRESETS)}, got {name!r}")
    return PRESETS[name]


def is_linear(signature) -> bool:
    """Whether ``signature`` (a name or a preset) is a linear-attention preset."""
    if isinstance(signature, str):
        return signature in PRESETS
    return isinstance(signature, LinearSignature)
