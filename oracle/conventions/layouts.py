"""Calling conventions of implementations under test: layouts and frameworks.

The oracle's own convention is ``impl(q, k, v, **options)`` on NumPy arrays in the ``bhld``
layout (q (B, H, L, D), k (B, K, S, D), v (B, K, S, E); out (B, H, L, E), lse (B, H, L)).
:func:`wrap` turns an implementation written for another convention into that one, so a kernel
author validates the function they ship, with no wrapper of their own:

``layout="blhd"``
    q (B, L, H, D), k (B, S, K, D), v (B, S, K, E); returns out (B, L, H, E) and optionally
    lse (B, H, L) (FlashAttention's ``flash_attn_func`` layout and lse).
``layout="packed"``
    Variable-length batches packed along the tokens: q (B*L, H, D), k (sum S_b, K, D),
    v (sum S_b, K, E) with keywords ``cu_seqlens_q``, ``cu_seqlens_k`` (int32 (B + 1,), the
    cumulative lengths), ``max_seqlen_q``, ``max_seqlen_k``; returns out (B*L, H, E) and
    optionally lse (H, B*L) (``flash_attn_varlen_func``). A case's ``kv_lengths`` make the
    key sequences ragged (sequence b packs its first S_b keys, ``cu_seqlens_k`` their
    cumulative sum): the keyword itself is not passed.
``layout="paged"``
    A paged KV cache: q (B, L, H, D); ``k`` and ``v`` are the caches (P, page, K, D) and
    (P, page, K, E) with keywords ``block_table`` (int32 (B, pages per sequence)) and
    ``cache_seqlens`` (int32 (B,): the case's ``kv_lengths``, else S); returns out
    (B, L, H, E), optionally lse (B, H, L) (``flash_attn_with_kvcache``). The page size is
    the case's (16 keys for S < 256, else 64); pages are stored in reverse order behind one
    unused page, and every slot no sequence owns (past S_b too) holds NaN, so a kernel that
    ignores the block table or the lengths fails.

``layout="dsa"``
    blhd with sparse ``indices`` (B, L, K, T) (:mod:`oracle.conventions.layouts_sparse`).

``layout="fp4-paged"``
    A paged fp4 KV cache packed two e2m1 codes per uint8 (low nibble first) with paged block
    scales (:mod:`oracle.conventions.layouts_fp4`); only cases with fp4 k and v.

``layout="latent-paged"``
    FlashMLA's latent cache: ``impl(q, cache, head_dim_v=, block_table=, cache_seqlens=)``
    with one cache (P, page, 1, D) whose first E features are the values
    (:mod:`oracle.conventions.layouts_latent`).

``framework="torch"`` (with ``device="cpu"`` or ``"cuda"``) passes torch tensors on the device
(bfloat16 and float8 reinterpreted bit for bit, never converted by value; float4_e2m1fn as
torch.uint8 codes, one per byte; masks as torch.bool,
indices as torch.int32) and brings the results back; ``framework="jax"`` passes ``jax.Array``
(float64 needs ``jax_enable_x64``, which :func:`wrap` turns on for float64 inputs).

Every other keyword (``causal``, ``scale``, ``window``, ``align``, ``softcap``, ``gqa``,
``alibi_slopes``...) keeps refattn's name and meaning. ``mask``, ``bias`` and ``dropout_mask``
keep their (B, H, L, S) layout in ``bhld``/``blhd``; ``packed`` and ``paged`` carry no such
per-position arrays (a case that needs one is "unsupported" with the message
:data:`NOT_EXPRESSIBLE`). ``signature=`` (:mod:`oracle.conventions.signatures`) renames and
converts the
options into a library's own keywords and conventions. Gradients (``impl.vjp(q, k, v,
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
import inspect

import ml_dtypes
import numpy as np

from oracle.conventions import linear_presets
from oracle.conventions.expressible import NOT_EXPRESSIBLE
from oracle.conventions.layouts_fp4 import fp4_paged
from oracle.conventions.layouts_latent import latent_paged_layout
from oracle.conventions.layouts_mla_sparse import mla_sparse_layout
from oracle.conventions.layouts_sparse import (  # layout="dsa": blhd with indices (B, L, K, T)
    dsa_layout,
    refused_keyword,
)
from oracle.conventions.layouts_trtllm import trtllm_fp4_layout
from oracle.conventions.signatures import Call, declared, get
from oracle.judging.empty_rows import check_reading, declare
from refattn.logspace import base_factor

__all__ = [
    "LAYOUTS",
    "FRAMEWORKS",
    "DEVICES",
    "NOT_EXPRESSIBLE",
    "wrap",
    "page_size",
    "check_convention",
]

LAYOUTS = (
    "bhld",
    "blhd",
    "packed",
    "paged",
    "dsa",
    "fp4-paged",
    "latent-paged",
    "mla-sparse",
    "trtllm-fp4",
)
FRAMEWORKS = ("numpy", "torch", "jax")
DEVICES = ("cpu", "cuda")
_PER_POSITION = ("mask", "bias", "dropout_mask")


def check_convention(
    layout="bhld",
    framework="numpy",
    device="cpu",
    signature=None,
    causal_align=None,
    keywords=None,
    empty_rows=None,
) -> dict:
    """The convention as a dict, or ValueError naming the bad argument.

    ``empty_rows`` declares what the function gives rows with no allowed key ("zero", "nan",
    "average": :mod:`oracle.judging.empty_rows`); a preset may bring its own.

    ``signature`` (a preset of :mod:`oracle.conventions.signatures`) brings its layout and framework
    (an explicit other one is an error); ``causal_align`` and ``keywords`` declare a
    function's own conventions without a preset (:func:`oracle.conventions.signatures.declared`).
    The dict has those keys only when they are given.
    """
    extra = {}
    if signature is not None:
        preset = get(signature)
        if causal_align is not None or keywords:
            raise ValueError(
                f"signature: {preset.name!r} fixes the keywords and the alignment; "
                f"causal_align / keywords are for a function without a preset"
            )
        for name, value, own in (
            ("layout", layout, preset.layout),
            ("framework", framework, preset.framework),
        ):
            if value not in (own, {"layout": "bhld", "framework": "numpy"}[name]):
                raise ValueError(
                    f"{name}: {value!r} conflicts with signature {preset.name!r}, which takes "
                    f"{name} {own!r} (leave --{name} out)"
                )
        layout, framework = preset.layout, preset.framework
        extra["signature"] = signature
    elif causal_align is not None or keywords:
        declared(layout, causal_align, keywords)  # a clear error for a bad declaration
        if causal_align is not None:
            extra["causal_align"] = causal_align
        if keywords:
            extra["keywords"] = keywords
    empty_rows = check_reading(empty_rows)
    if empty_rows is None and signature is not None:
        empty_rows = getattr(get(signature), "empty_rows", None)
    if empty_rows is not None:
        extra["empty_rows"] = empty_rows
    for name, value, allowed in (
        ("layout", layout, LAYOUTS),
        ("framework", framework, FRAMEWORKS),
        ("device", device, DEVICES),
    ):
        if value not in allowed:
            raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")
    if device != "cpu" and framework != "torch":
        raise ValueError(f"device: {device!r} needs framework='torch' (got {framework!r})")
    return {"layout": layout, "framework": framework, "device": device, **extra}


def page_size(keys: int) -> int:
    """Keys per page of the paged layout for a case with ``keys`` keys."""
    return 16 if keys < 256 else 64


def wrap(
    impl,
    *,
    layout="bhld",
    framework="numpy",
    device="cpu",
    signature=None,
    causal_align=None,
    keywords=None,
    empty_rows=None,
):
    """``impl`` in the given convention, as an ``impl(q, k, v, **options)`` of the oracle's.

    Parameters
    ----------
    impl : callable
        The implementation under test, in ``layout`` and ``framework``.
    layout : {"bhld", "blhd", "packed", "paged"}
    framework : {"numpy", "torch", "jax"}
    device : {"cpu", "cuda"}
        Where torch tensors live (torch only).
    signature : str or oracle.conventions.signatures.Signature, optional
        A library's keyword names and conventions (:mod:`oracle.conventions.signatures`); it brings
        its
        layout and framework.
    causal_align, keywords
        A function's own declared conventions without a preset
        (:func:`oracle.conventions.signatures.declared`).
    empty_rows : {"zero", "nan", "average"}, optional
        What the function gives rows with no allowed key (:mod:`oracle.judging.empty_rows`):
        it then never receives ``empty_rows`` and the judge reads such rows its way.

    Returns
    -------
    callable
        Taking and returning NumPy arrays in ``bhld``; ``.vjp`` too when ``impl`` has one and
        the layout is ``bhld`` or ``blhd``.
    """
    convention = check_convention(
        layout, framework, device, signature, causal_align, keywords, empty_rows
    )
    if linear_presets.is_linear(signature):
        return linear_presets.wrap(impl, signature, device)  # oracle.conventions.linear_presets
    layout, framework = convention["layout"], convention["framework"]
    speaks = _speaker(convention, impl)
    if layout == "bhld" and framework == "numpy" and speaks is None:
        return declare(impl, convention.get("empty_rows"))
    bridge = _Bridge(framework, device)

    @functools.wraps(impl)
    def forward(q, k, v, **options):
        try:
            args, kwargs, unpack = _LAYOUT_IN[layout](q, k, v, options)
            back = _same
            if speaks is not None:
                kwargs = speaks(q, k, v, options, kwargs)
                args, kwargs, back = speaks.adapt(args, kwargs, q, k, v, options)
        except Exception as err:
            err.oracle_conversion = True  # raised here, not by impl (oracle.judging.must_refuse)
            raise
        try:
            result = impl(
                *(bridge.to(a) for a in args), **{n: bridge.to(a) for n, a in kwargs.items()}
            )
        except TypeError as err:  # a DSA keyword refused: "unsupported"
            raise refused_keyword(err, layout) from err
        try:
            return read_back(result, unpack, back, options)
        except Exception as err:
            err.oracle_returned = (
                True  # impl returned something unreadable (oracle.judging.must_refuse)
            )
            raise

    def read_back(result, unpack, back, options):
        at = 1 if speaks is None else speaks.lse_at
        out, lse = (
            (result[0], result[at] if len(result) > at else None)
            if isinstance(result, (tuple, list))
            else (result, None)
        )
        out = unpack(back(bridge.back(out)), "out")
        if lse is None or (speaks is not None and speaks.always_lse and not wants_lse(options)):
            return out
        lse = bridge.back(lse)
        if speaks is not None and speaks.lse_axes is not None:
            lse = np.transpose(lse, speaks.lse_axes)
        if speaks is not None and speaks.lse_factor != 1.0:  # a base-2 lse: to natural log
            lse = (np.asarray(lse, dtype=np.float64) * speaks.lse_factor).astype(lse.dtype)
        lse = unpack(lse, "lse")
        if speaks is not None and speaks.fix_lse is not None:
            lse = speaks.fix_lse(lse, options)
        return out, lse

    if hasattr(impl, "vjp") and layout in ("bhld", "blhd") and speaks is None:

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
    forward.convention = convention
    return declare(forward, convention.get("empty_rows"))


def _speaker(convention, impl=None):
    """None, or ``speak(q, k, v, options, kwargs) -> kwargs`` putting the layout's keywords
    and the options (refattn's names) into the function's own keywords
    (:mod:`oracle.conventions.signatures`)."""
    if "signature" in convention:
        preset = get(convention["signature"])
    else:
        preset = declared(
            convention["layout"], convention.get("causal_align"), convention.get("keywords")
        )
    if preset is None:
        return None

    def speak(q, k, v, options, kwargs):
        # the layout's own keywords (cu_seqlens, block_table...) pass as they are; options it
        # consumed (kv_lengths as ragged lengths) are gone from kwargs
        own = {n: x for n, x in kwargs.items() if n in options}
        layout_words = {n: x for n, x in kwargs.items() if n not in options}
        spoken = preset.translate(own, Call.of(q, k, v, options))
        for name in preset.drop:
            layout_words.pop(name, None)
        return {**spoken, **layout_words}

    speak.lse_axes = preset.lse_axes
    speak.lse_at, speak.always_lse, speak.fix_lse = preset.lse_at, preset.always_lse, preset.fix_lse
    speak.lse_factor = base_factor(preset.lse_base)
    parameters = _parameter_names(impl) if preset.adapt is not None else set()

    def adapt(args, kwargs, q, k, v, options):
        if preset.adapt is None:
            return args, kwargs, _same
        return preset.adapt(args, kwargs, Call.of(q, k, v, options), parameters)

    speak.adapt = adapt
    return speak


def wants_lse(options) -> bool:
    """Whether the case asks for the lse (``return_lse``)."""
    return bool(options.get("return_lse"))


def _parameter_names(impl) -> set:
    try:
        return set(inspect.signature(impl).parameters)
    except (TypeError, ValueError):
        return set()


# ---------------------------------------------------------------------------------------------
# Layouts: (args, kwargs, unpack(result, "out" | "lse")) from bhld NumPy inputs
# ---------------------------------------------------------------------------------------------


def _same(a):
    return a


def _to_blhd(a):
    return np.ascontiguousarray(np.swapaxes(a, -3, -2))


def _bhld(q, k, v, options):
    return (q, k, v), dict(options), lambda x, what: x


#: Options laid out per query row (B, H, L, X) or per key (B, K, S, X) beside q, k, v: every
#: layout moves them with the tensor they belong to (q's rows: qv, q_block_scale, and the
#: per-row index lists key_indices / key_block_indices (B, K, L, T); k's and v's keys: the
#: block scales). The (B, H, L, S) mask, bias and dropout_mask are not among them.
PER_ROW = ("qv", "q_block_scale", "key_indices", "key_block_indices")
PER_KEY = {"k_block_scale": "k", "v_block_scale": "v"}


def _moved(options, move_row, move_key=None):
    """``options`` with every per-row array through ``move_row`` and every per-key one through
    ``move_key`` (None: per-key arrays as they are)."""
    moved = dict(options)
    for name in PER_ROW:
        if moved.get(name) is not None:
            moved[name] = move_row(np.asarray(moved[name]))
    if move_key is not None:
        for name in PER_KEY:
            if moved.get(name) is not None:
                moved[name] = move_key(np.asarray(moved[name]))
    return moved


def _blhd(q, k, v, options):
    def unpack(x, what):
        return x if what == "lse" else _to_blhd(x)

    kwargs = _moved(options, _to_blhd, _to_blhd)
    return (_to_blhd(q), _to_blhd(k), _to_blhd(v)), kwargs, unpack


def _no_per_position(options, layout):
    present = [n for n in _PER_POSITION if options.get(n) is not None]
    if present:
        raise NotImplementedError(
            f"{', '.join(present)}: {NOT_EXPRESSIBLE} ({layout} carries no (B, H, L, S) arrays)"
        )


def _ragged(options, batch, keys):
    """Each sequence's key count: ``kv_lengths`` (B,), consumed here, or S for all."""
    lengths = options.pop("kv_lengths", None)
    if lengths is None:
        return np.full(batch, keys, dtype=np.int32)
    return np.broadcast_to(np.asarray(lengths, dtype=np.int32).reshape(-1), (batch,)).copy()


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
    options = dict(options)
    q, k, v = _dense4(q, k, v)
    batch, heads, rows, _ = q.shape
    lengths = _ragged(options, batch, k.shape[-2])  # ragged keys: sequence b packs S_b of them
    cu_q = np.arange(batch + 1, dtype=np.int32) * rows
    cu_k = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

    def pack(a, counts=None):
        tokens = np.swapaxes(a, 1, 2)  # (B, len, heads, .)
        if counts is not None:
            tokens = np.concatenate([tokens[b, : counts[b]] for b in range(batch)])
        return np.ascontiguousarray(tokens.reshape(-1, *a.shape[1:2], a.shape[3]))

    def pack_rows(a):
        return pack(np.broadcast_to(a, (batch, *a.shape[-3:])))

    def pack_keys(a):
        return pack(np.broadcast_to(a, (batch, *a.shape[-3:])), lengths)

    options = _moved(options, pack_rows, pack_keys)
    kwargs = dict(
        options,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=rows,
        max_seqlen_k=int(lengths.max(initial=0)),
    )

    def unpack(x, what):
        if what == "lse":  # (H, B*L)
            return np.ascontiguousarray(
                np.asarray(x).reshape(heads, batch, rows).transpose(1, 0, 2)
            )
        return np.ascontiguousarray(
            np.asarray(x).reshape(batch, rows, heads, -1).transpose(0, 2, 1, 3)
        )

    return (pack(q), pack(k, lengths), pack(v, lengths)), kwargs, unpack


def _paged(q, k, v, options):
    _no_per_position(options, "paged")
    options = dict(options)
    q, k, v = _dense4(q, k, v)
    batch, heads, rows, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    lengths = _ragged(options, batch, keys)  # slots past S_b stay NaN
    page = page_size(keys)
    per_seq = -(-keys // page)
    pages = batch * per_seq + 1  # page 0 is never used
    # logical page p of sequence b lives at physical page pages - 1 - (b * per_seq + p)
    table = pages - 1 - (np.arange(batch)[:, None] * per_seq + np.arange(per_seq)[None, :])

    def paged(a):
        a = np.broadcast_to(a, (batch, *a.shape[-3:]))
        cache = np.full((pages, page, a.shape[1], a.shape[-1]), _unowned(a.dtype), a.dtype)
        seq = np.swapaxes(a, 1, 2)  # (B, S, K, .)
        for b in range(batch):
            for p in range(per_seq):
                chunk = seq[b, p * page : min((p + 1) * page, lengths[b])]
                cache[table[b, p], : len(chunk)] = chunk
        return cache

    caches = [paged(k), paged(v)]
    assert caches[0].shape[2] == kv_heads
    options = _moved(options, lambda a: _to_blhd(np.broadcast_to(a, (batch, *a.shape[-3:]))), paged)
    kwargs = dict(
        options,
        block_table=table.astype(np.int32),
        cache_seqlens=lengths,
    )

    def unpack(x, what):
        return np.asarray(x) if what == "lse" else _to_blhd(np.asarray(x))

    return (_to_blhd(q), caches[0], caches[1]), kwargs, unpack


def _unowned(dtype):
    """What a slot no sequence owns holds: NaN, or for a format without NaN (float4 codes,
    e8m0 scales have one: 0xFF) its NaN code, else the largest value."""
    dtype = np.dtype(dtype)
    if dtype.name == "float8_e4m3fn":
        return np.array(0x7F, np.uint8).view(dtype)
    if dtype.name == "float8_e8m0fnu":
        return np.array(0xFF, np.uint8).view(dtype)
    if dtype.name == "float4_e2m1fn":
        return np.array(0, np.uint8).view(dtype)
    return np.nan


def _dsa(q, k, v, options):
    """The DSA convention, the per-row arrays (qv, q's block scales) and per-key ones (k's
    and v's block scales) moved to blhd with q, k, v."""
    moved = {n: x for n, x in options.items() if n not in ("key_indices", "key_block_indices")}
    moved = _moved(moved, _to_blhd, _to_blhd)
    rest = {n: options[n] for n in ("key_indices", "key_block_indices") if n in options}
    return dsa_layout(q, k, v, {**moved, **rest})


_LAYOUT_IN = {"bhld": _bhld, "blhd": _blhd, "packed": _packed, "paged": _paged, "dsa": _dsa}
_LAYOUT_IN["fp4-paged"] = fp4_paged  # a packed fp4 KV cache (oracle/conventions/layouts_fp4.py)
_LAYOUT_IN["mla-sparse"] = mla_sparse_layout  # FlashMLA's sparse prefill
_LAYOUT_IN["trtllm-fp4"] = trtllm_fp4_layout  # FlashInfer's TensorRT-LLM NVFP4 decode
_LAYOUT_IN["latent-paged"] = latent_paged_layout(
    _paged
)  # FlashMLA: oracle.conventions.layouts_latent


# ---------------------------------------------------------------------------------------------
# Frameworks
# ---------------------------------------------------------------------------------------------

_BIT_VIEWS = {
    "bfloat16": (np.int16, "bfloat16"),
    "float8_e4m3fn": (np.uint8, "float8_e4m3fn"),
    "float8_e5m2": (np.uint8, "float8_e5m2"),
    "float8_e8m0fnu": (np.uint8, "float8_e8m0fnu"),
    "float4_e2m1fn": (np.uint8, "uint8"),  # torch has no unpacked fp4: one code per byte
}


class _Bridge:
    """NumPy <-> framework arrays, bit for bit."""

    def __init__(self, framework, device):
        self.framework, self.device = framework, device
        if framework == "torch":
            try:
                # optional package (torch extra)
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
                # optional package (jax extra)
                import jax
                import jax.numpy as jnp
            except ImportError:
                raise ImportError("framework 'jax' needs jax: pip install -e \".[jax]\"") from None
            self.jax, self.jnp = jax, jnp

    def to(self, a):
        if isinstance(a, tuple):  # (k_cache, v_cache) pairs (FlashInfer's kv_cache)
            return tuple(self.to(x) for x in a)
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
