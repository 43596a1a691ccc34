"""Calling conventions of implementations under test: layouts and frameworks.

The oracle's own convention is ``impl(q, k, v, **options)`` on NumPy arrays in the ``bhld``
layout (q (B, H, L, D), k (B, K, S, D), v (B, K, S, E); out (B, H, L, E), lse (B, H, L)).
:func:`wrap` turns an implementation written for another convention into that one, so a kernel
author validates the function they ship, with no wrapper of their own:

``layout="blhd"``
    q (B, L, H, D), k (B, S, K, D), v (B, S, K, E); returns out (B, L, H, E) and optionally
    lse (B, H, L) (FlashAttention's ``flash_attn_func`` layout and lse).
``layout="packed"``
    Variable-length batches packed along the tokens: q (B*L, H, D), k (B*S, K, D),
    v (B*S, K, E) with keywords ``cu_seqlens_q``, ``cu_seqlens_k`` (int32 (B + 1,), the
    cumulative lengths), ``max_seqlen_q``, ``max_seqlen_k``; returns out (B*L, H, E) and
    optionally lse (H, B*L) (``flash_attn_varlen_func``).
``layout="paged"``
    A paged KV cache: q (B, L, H, D); ``k`` and ``v`` are the caches (P, page, K, D) and
    (P, page, K, E) with keywords ``block_table`` (int32 (B, pages per sequence)) and
    ``cache_seqlens`` (int32 (B,)); returns out (B, L, H, E), optionally lse (B, H, L)
    (``flash_attn_with_kvcache``). The page size is the case's (16 keys for S < 256, else 64);
    pages are stored in reverse order behind one unused page, and every slot no sequence owns
    holds NaN, so a kernel that ignores the block table or the lengths fails.

``layout="latent-paged"``
    FlashMLA's latent cache: ``impl(q, cache, head_dim_v=, block_table=, cache_seqlens=)``
    with one cache (P, page, 1, D) whose first E features are the values
    (:mod:`oracle.layouts_latent`).

``framework="torch"`` (with ``device="cpu"`` or ``"cuda"``) passes torch tensors on the device
(bfloat16 and float8 reinterpreted bit for bit, never converted by value; masks as torch.bool,
indices as torch.int32) and brings the results back; ``framework="jax"`` passes ``jax.Array``
(float64 needs ``jax_enable_x64``, which :func:`wrap` turns on for float64 inputs).

Every other keyword (``causal``, ``scale``, ``window``, ``align``, ``softcap``, ``gqa``,
``alibi_slopes``...) keeps refattn's name and meaning. ``mask``, ``bias`` and ``dropout_mask``
keep their (B, H, L, S) layout in ``bhld``/``blhd``; ``packed`` and ``paged`` carry no such
per-position arrays (a case that needs one is "unsupported"). Gradients (``impl.vjp(q, k, v,
grad_out, **options)``, grads in the impl's layout) are converted for ``bhld``/``blhd``.

Examples
--------
>>> import numpy as np
>>> from refattn import attention
>>> def blhd_attention(q, k, v, **options):  # an implementation in the (B, L, H, D) layout
...     out = attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
...                     v.transpose(0, 2, 1, 3), **options)
...     return out.transpose(0, 2, 1, 3)
>>> impl = wrap(blhd_attention, layout="blhd")
>>> q = np.ones((1, 2, 3, 4)); k = v = np.ones((1, 2, 5, 4))
>>> impl(q, k, v).shape
(1, 2, 3, 4)
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from .layouts_latent import latent_paged_layout

__all__ = ["LAYOUTS", "FRAMEWORKS", "DEVICES", "wrap", "page_size", "check_convention"]

LAYOUTS = ("bhld", "blhd", "packed", "paged", "latent-paged")
FRAMEWORKS = ("numpy", "torch", "jax")
DEVICES = ("cpu", "cuda")
_PER_POSITION = ("mask", "bias", "dropout_mask")


def check_convention(layout="bhld", framework="numpy", device="cpu") -> dict:
    """The convention as a dict, or ValueError naming the bad argument."""
    for name, value, allowed in (
        ("layout", layout, LAYOUTS),
        ("framework", framework, FRAMEWORKS),
        ("device", device, DEVICES),
    ):
        if value not in allowed:
            raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")
    if device != "cpu" and framework != "torch":
        raise ValueError(f"device: {device!r} needs framework='torch' (got {framework!r})")
    return {"layout": layout, "framework": framework, "device": device}


def page_size(keys: int) -> int:
    """Keys per page of the paged layout for a case with ``keys`` keys."""
    return 16 if keys < 256 else 64


def wrap(impl, *, layout="bhld", framework="numpy", device="cpu"):
    """``impl`` in the given convention, as an ``impl(q, k, v, **options)`` of the oracle's.

    Parameters
    ----------
    impl : callable
        The implementation under test, in ``layout`` and ``framework``.
    layout : {"bhld", "blhd", "packed", "paged"}
    framework : {"numpy", "torch", "jax"}
    device : {"cpu", "cuda"}
        Where torch tensors live (torch only).

    Returns
    -------
    callable
        Taking and returning NumPy arrays in ``bhld``; ``.vjp`` too when ``impl`` has one and
        the layout is ``bhld`` or ``blhd``.
    """
    check_convention(layout, framework, device)
    if layout == "bhld" and framework == "numpy":
        return impl
    bridge = _Bridge(framework, device)

    @functools.wraps(impl)
    def forward(q, k, v, **options):
        args, kwargs, unpack = _LAYOUT_IN[layout](q, k, v, options)
        result = impl(*(bridge.to(a) for a in args), **{n: bridge.to(a) for n, a in kwargs.items()})
        out, lse = (
            (result[0], result[1] if len(result) > 1 else None)
            if isinstance(result, (tuple, list))
            else (result, None)
        )
        out = unpack(bridge.back(out), "out")
        return out if lse is None else (out, unpack(bridge.back(lse), "lse"))

    if hasattr(impl, "vjp") and layout in ("bhld", "blhd"):

        def vjp(q, k, v, grad_out, **options):
            to = _to_blhd if layout == "blhd" else _same
            grads = impl.vjp(
                *(bridge.to(to(a)) for a in (q, k, v, grad_out)),
                **{n: bridge.to(a) for n, a in options.items()},
            )
            back = [None if g is None else bridge.back(g) for g in grads]
            for i in range(min(3, len(back))):
                if back[i] is not None:
                    back[i] = to(back[i])
            return type(grads)(*back) if hasattr(grads, "_fields") else tuple(back)

        forward.vjp = vjp
    forward.convention = {"layout": layout, "framework": framework, "device": device}
    return forward


# ---------------------------------------------------------------------------------------------
# Layouts: (args, kwargs, unpack(result, "out" | "lse")) from bhld NumPy inputs
# ---------------------------------------------------------------------------------------------


def _same(a):
    return a


def _to_blhd(a):
    return np.ascontiguousarray(np.swapaxes(a, -3, -2))


def _bhld(q, k, v, options):
    return (q, k, v), dict(options), lambda x, what: x


def _blhd(q, k, v, options):
    def unpack(x, what):
        return x if what == "lse" else _to_blhd(x)

    return (_to_blhd(q), _to_blhd(k), _to_blhd(v)), dict(options), unpack


def _no_per_position(options, layout):
    present = [n for n in _PER_POSITION if options.get(n) is not None]
    if present:
        raise NotImplementedError(
            f"the {layout} layout carries no per-position arrays ({', '.join(present)})"
        )


def _dense4(q, k, v):
    batch = max(q.shape[0], k.shape[0], v.shape[0]) if q.ndim == 4 else 1
    q, k, v = (
        np.broadcast_to(a, (batch, *a.shape[-3:]))
        if a.ndim >= 3
        else np.broadcast_to(a, (batch, 1, *a.shape))
        for a in (q, k, v)
    )
    return q, k, v


def _packed(q, k, v, options):
    _no_per_position(options, "packed")
    q, k, v = _dense4(q, k, v)
    batch, heads, rows, _ = q.shape
    keys = k.shape[-2]
    cu_q = np.arange(batch + 1, dtype=np.int32) * rows
    cu_k = np.arange(batch + 1, dtype=np.int32) * keys

    def pack(a):
        return np.ascontiguousarray(np.swapaxes(a, 1, 2).reshape(-1, *a.shape[1:2], a.shape[3]))

    kwargs = dict(
        options, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=rows, max_seqlen_k=keys
    )

    def unpack(x, what):
        if what == "lse":  # (H, B*L)
            return np.ascontiguousarray(
                np.asarray(x).reshape(heads, batch, rows).transpose(1, 0, 2)
            )
        return np.ascontiguousarray(
            np.asarray(x).reshape(batch, rows, heads, -1).transpose(0, 2, 1, 3)
        )

    return (pack(q), pack(k), pack(v)), kwargs, unpack


def _paged(q, k, v, options):
    _no_per_position(options, "paged")
    q, k, v = _dense4(q, k, v)
    batch, heads, rows, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    page = page_size(keys)
    per_seq = -(-keys // page)
    pages = batch * per_seq + 1  # page 0 is never used
    # logical page p of sequence b lives at physical page pages - 1 - (b * per_seq + p)
    table = pages - 1 - (np.arange(batch)[:, None] * per_seq + np.arange(per_seq)[None, :])
    caches = []
    for a in (k, v):
        cache = np.full((pages, page, kv_heads, a.shape[-1]), np.nan, dtype=a.dtype)
        seq = np.swapaxes(a, 1, 2)  # (B, S, K, .)
        for b in range(batch):
            for p in range(per_seq):
                chunk = seq[b, p * page : (p + 1) * page]
                cache[table[b, p], : len(chunk)] = chunk
        caches.append(cache)
    kwargs = dict(
        options,
        block_table=table.astype(np.int32),
        cache_seqlens=np.full(batch, keys, dtype=np.int32),
    )

    def unpack(x, what):
        return np.asarray(x) if what == "lse" else _to_blhd(np.asarray(x))

    return (_to_blhd(q), caches[0], caches[1]), kwargs, unpack


_LAYOUT_IN = {"bhld": _bhld, "blhd": _blhd, "packed": _packed, "paged": _paged}
_LAYOUT_IN["latent-paged"] = latent_paged_layout(_paged)  # FlashMLA: oracle.layouts_latent


# ---------------------------------------------------------------------------------------------
# Frameworks
# ---------------------------------------------------------------------------------------------

_BIT_VIEWS = {
    "bfloat16": (np.int16, "bfloat16"),
    "float8_e4m3fn": (np.uint8, "float8_e4m3fn"),
    "float8_e5m2": (np.uint8, "float8_e5m2"),
}


class _Bridge:
    """NumPy <-> framework arrays, bit for bit."""

    def __init__(self, framework, device):
        self.framework, self.device = framework, device
        if framework == "torch":
            try:
                import torch
            except ImportError:
                raise ImportError(
                    "framework 'torch' needs torch: pip install -e \".[torch]\""
                ) from None
            if device == "cuda" and not torch.cuda.is_available():
                raise ValueError("device: 'cuda' asked for but torch.cuda.is_available() is False")
            self.torch = torch
        elif framework == "jax":
            try:
                import jax
                import jax.numpy as jnp
            except ImportError:
                raise ImportError("framework 'jax' needs jax: pip install -e \".[jax]\"") from None
            self.jax, self.jnp = jax, jnp

    def to(self, a):
        if not isinstance(a, np.ndarray):
            return a
        if self.framework == "numpy":
            return a
        if self.framework == "jax":
            if a.dtype == np.float64:
                self.jax.config.update("jax_enable_x64", True)
            return self.jnp.asarray(a)
        torch = self.torch
        name = a.dtype.name
        own = np.array(a, copy=True, order="C")  # writable, and the caller's stays untouched
        if name in _BIT_VIEWS:
            bits, torch_name = _BIT_VIEWS[name]
            tensor = torch.from_numpy(own.view(bits)).view(getattr(torch, torch_name))
        else:
            tensor = torch.from_numpy(own)
        return tensor.to(self.device)

    def back(self, x):
        if self.framework == "torch" and isinstance(x, self.torch.Tensor):
            x = x.detach().cpu()
            name = str(x.dtype).removeprefix("torch.")
            if name in _BIT_VIEWS:
                bits, _ = _BIT_VIEWS[name]
                return (
                    x.view(getattr(self.torch, np.dtype(bits).name))
                    .numpy()
                    .view(getattr(ml_dtypes, name))
                )
            return x.numpy()
        return np.asarray(x)
