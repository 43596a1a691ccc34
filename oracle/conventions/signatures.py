"""Signature presets: refattn's options spoken in another library's keywords and conventions.

The oracle calls an implementation with :func:`refattn.attention`'s keyword names
(:mod:`oracle.judging.judge`). A kernel author ships a function with its library's names instead
(``softmax_scale``, ``window_size=(-1, -1)``, ``is_causal``...) and its library's conventions
(FlashAttention's causal set is bottom-right aligned, torch's and JAX's top-left). A
:class:`Signature` translates one case's options into such a call, so that function is
validated as it stands; a case the library cannot express raises NotImplementedError naming the
option and the reason (the verdict "unsupported", never a fail).

A preset is one row of :data:`PRESETS`: a layout and a framework
(:mod:`oracle.conventions.layouts`),
the alignment of its causal/window/ALiBi offsets, and a table refattn option -> rule, where a
rule is a keyword name (a rename), a :class:`Convert` (a name and a function of the value and
the call's shapes), or a :class:`Refuse` (the reason). An option missing from a preset's table
is refused too, so a keyword refattn gains later is never silently dropped; adding it to a
library is one table entry.

* ``flash_attn``: FlashAttention >= 2.1 ``flash_attn_func(q, k, v, dropout_p, softmax_scale,
  causal, window_size=(-1, -1), softcap=0.0, alibi_slopes, deterministic, return_attn_probs)``:
  (B, L, H, D) tensors; causal, window and ALiBi bottom-right (o = S - L); -1 is an unbounded
  window side; lse (B, H, L) float32 the second value when ``return_attn_probs=True``.
* ``flash_attn_varlen``: ``flash_attn_varlen_func``: packed (total, H, D) tokens with
  ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``; ragged key lengths
  as a ragged ``cu_seqlens_k``; lse (H, total_q).
* ``flash_attn_with_kvcache``: ``flash_attn_with_kvcache(q, k_cache, v_cache, ...,
  cache_seqlens, block_table, softmax_scale, causal, window_size, softcap, alibi_slopes,
  return_softmax_lse)``: a paged cache, key lengths as ``cache_seqlens``; the block table is
  ``block_table`` (FlashAttention 2) or ``page_table`` (FlashAttention 3), whichever the
  function's signature takes.
* ``torch_sdpa``: ``torch.nn.functional.scaled_dot_product_attention(query, key, value,
  attn_mask, dropout_p, is_causal, scale, enable_gqa)``: (B, H, L, D); ``is_causal`` top-left;
  a bool ``attn_mask`` (True = attend) or a float one (added); no lse.
* ``jax``: ``jax.nn.dot_product_attention(query, key, value, bias, mask, *, scale, is_causal,
  query_seq_lengths, key_value_seq_lengths, local_window_size, implementation,
  return_residual)``: (B, T, N, H) arrays; causal and window top-left; mask/bias (B, N, T, S);
  the residual (lse) (B, T, N); value and query head dims equal (D != E is refused).
* ``flashinfer``: ``flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask, ..., causal,
  kv_layout="NHD", ..., sm_scale, window_left=-1, logits_soft_cap, ..., return_lse)``: one
  sequence, (L, H, D) (NHD); causal bottom-right; a window is its left side only; its lse
  (L, H) is in base 2 (``return_lse=True``), brought to the natural log before it is judged.
* ``xformers``: ``xformers.ops.memory_efficient_attention(query, key, value, attn_bias, p,
  scale)``: (B, M, H, K) tensors, grouped-query heads in its 5-D (B, M, G, H, K) form
  (:func:`oracle.conventions.signatures_adapt.xformers_groups`); causal, window, key lengths and
  mask as
  one additive ``attn_bias`` tensor of 0 and -inf (exact in any dtype), the bias added where
  allowed; no lse.

Without a preset a function may declare its conventions (:func:`declared`): the alignment of
its ``causal`` (``causal_align="bottom_right"``) and keyword renames (``scale=softmax_scale``);
every other option keeps refattn's name.

Examples
--------
>>> import numpy as np
>>> sig = get("flash_attn")
>>> q = np.zeros((1, 2, 3, 4)); k = v = np.zeros((1, 2, 5, 4))
>>> sig.translate({"scale": 0.5, "window": (2, None)}, Call.of(q, k, v, {}))
{'softmax_scale': 0.5, 'window_size': (2, -1)}
>>> sig.translate({"causal": True}, Call.of(q, k, v, {"causal": True}))
Traceback (most recent call last):
...
NotImplementedError: flash_attn: causal, window and ALiBi are bottom-right aligned (o = S - L); \
align='top_left' with L = 3 != S = 5 cannot be expressed
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import numpy as np

from oracle.adapters import exact_cast
from oracle.catalogue.names import ATTENTION_OPTIONS
from oracle.conventions.signatures_adapt import kvcache_page_table, xformers_groups
from oracle.reading.allowed import options_allowed

__all__ = [
    "Signature",
    "Convert",
    "Refuse",
    "Call",
    "PRESETS",
    "get",
    "declared",
    "parse_keywords",
    "function_defaults",
    "add_arguments",
    "options_of",
]


@dataclass(frozen=True)
class Refuse:
    """The library cannot express this option (its value shown in the message)."""

    reason: str


@dataclass(frozen=True)
class Convert:
    """The option as keyword ``name`` with value ``convert(value, call)``; a ``name`` of None
    spreads a returned dict of keywords (one option -> several or none)."""

    name: str | None
    convert: object  # callable(value, Call) -> value (or dict of keywords when name is None)


@dataclass(frozen=True)
class Call:
    """The shapes of one call (bhld): what a conversion may need to know."""

    batch: int
    heads: int
    kv_heads: int
    length: int
    keys: int
    dim: int
    value_dim: int
    kv_lengths: tuple | None = None
    dtype: object = np.dtype(np.float64)  # q's
    options: dict = field(default_factory=dict)  # every option of the case, refattn's names

    @classmethod
    def of(cls, q, k, v, options) -> Call:
        lengths = options.get("kv_lengths")
        batch = int(np.prod(q.shape[:-3])) if q.ndim > 3 else 1
        return cls(
            batch=batch,
            heads=q.shape[-3] if q.ndim >= 3 else 1,
            kv_heads=k.shape[-3] if k.ndim >= 3 else 1,
            length=q.shape[-2],
            keys=k.shape[-2],
            dim=q.shape[-1],
            value_dim=v.shape[-1],
            kv_lengths=None if lengths is None else tuple(int(x) for x in np.ravel(lengths)),
            dtype=np.asarray(q).dtype,
            options=dict(options),
        )

    def alignment_matters(self) -> bool:
        """Whether top-left and bottom-right alignment give different problems here."""
        uses_offset = (
            bool(self.options.get("causal"))
            or self.options.get("window") is not None
            or self.options.get("alibi_slopes") is not None
        )
        keys = self.kv_lengths if self.kv_lengths is not None else (self.keys,)
        return uses_offset and any(s != self.length for s in keys)


@dataclass(frozen=True)
class Signature:
    """One library's keyword names and conventions (see the module docstring).

    Attributes
    ----------
    name : str
    library : str
        The function, as its users know it.
    layout, framework : str
        The :mod:`oracle.conventions.layouts` layout and framework it takes.
    align : {"top_left", "bottom_right"} or None
        The alignment of its causal/window/ALiBi offsets (None: it takes refattn's ``align``).
    keywords : dict
        refattn option -> keyword name, :class:`Convert` or :class:`Refuse`.
    passthrough : bool
        Options missing from ``keywords`` keep refattn's name (declared conventions) instead
        of being refused (presets).
    extra : callable(Call) -> dict, optional
        Keywords every call adds (e.g. torch's ``enable_gqa`` when H != K).
    check : callable(Call) -> str or None, optional
        A shape the library refuses (the reason), checked before the call.
    lse_axes : tuple, optional
        The permutation that brings its lse to the layout's lse axes.
    drop : tuple
        Layout keywords it does not take.
    lse_base : {"e", 2}
        The base of its lse (FlashInfer's is base 2): it is brought to refattn's natural log
        (:func:`refattn.logspace.base_factor`) before it is judged.
    adapt : callable, optional
        ``adapt(args, kwargs, call, parameters) -> (args, kwargs, back)``: the positional
        arrays and keywords reshaped for the library (xformers' 5-D grouped heads, FlashAttention
        3's ``page_table``: :mod:`oracle.conventions.signatures_adapt`), ``parameters`` the
        function's own
        parameter names, ``back(out)`` the output brought back to the layout's form.
    empty_rows : {"zero", "nan", "average"}, optional
        What the library gives rows with no allowed key when it has no option for it
        (:mod:`oracle.judging.empty_rows`); None: refattn's ``empty_rows`` option is refused
        unless it is the default.
    lse_at : int
        Where the lse is among the returned values (FlashMLA's sparse prefill returns
        (out, max_logits, lse): 2).
    always_lse : bool
        The function returns its lse whether asked or not (dropped when the case does not
        ask for it).
    fix_lse : callable, optional
        ``fix_lse(lse, options) -> lse`` (bhld axes, natural log): the library's reading of the
        lse brought to refattn's (FlashMLA: +inf on empty rows, the sink left out).
    """

    name: str
    library: str
    layout: str = "bhld"
    framework: str = "numpy"
    align: str | None = None
    keywords: dict = field(default_factory=dict)
    passthrough: bool = False
    extra: object = None
    check: object = None
    lse_axes: tuple | None = None
    drop: tuple = ()
    lse_base: object = "e"
    adapt: object = None
    empty_rows: str | None = None
    lse_at: int = 1
    always_lse: bool = False
    fix_lse: object = None

    def refuse(self, option, value, reason):
        shown = "<array>" if isinstance(value, np.ndarray) else repr(value)
        raise NotImplementedError(f"{self.name}: {option}={shown}: {reason}")

    def translate(self, options: dict, call: Call) -> dict:
        """The library's keywords for one call's ``options`` (refattn names, those equal to
        refattn's defaults left out), or NotImplementedError naming what it cannot express."""
        problem = self.check(call) if self.check else None
        if problem:
            raise NotImplementedError(f"{self.name}: {problem}")
        options = dict(options)
        align = options.pop("align", "top_left")
        kwargs = {}
        if self.align is not None:
            if align != self.align and call.alignment_matters():
                keys = call.keys if call.kv_lengths is None else f"S_b = {list(call.kv_lengths)}"
                keys = f"S = {keys}" if call.kv_lengths is None else keys
                offset = "o = S - L" if self.align == "bottom_right" else "o = 0"
                raise NotImplementedError(
                    f"{self.name}: causal, window and ALiBi are {self.align.replace('_', '-')} "
                    f"aligned ({offset}); align={align!r} with L = {call.length} != {keys} "
                    f"cannot be expressed"
                )
        elif align != "top_left":
            options["align"] = align
        for option, value in options.items():
            rule = self.keywords.get(option, option if self.passthrough else None)
            if rule is None:
                self.refuse(option, value, f"{self.library} has no keyword for it")
            elif isinstance(rule, Refuse):
                self.refuse(option, value, rule.reason)
            elif isinstance(rule, Convert):
                try:
                    converted = rule.convert(value, call)
                except NotImplementedError as err:
                    raise NotImplementedError(f"{self.name}: {err}") from None
                kwargs.update(converted if rule.name is None else {rule.name: converted})
            else:
                kwargs[rule] = value
        if self.extra:
            kwargs.update(self.extra(call))
        return kwargs

    def replace(self, **changes) -> Signature:
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# Conversions shared by the presets
# ---------------------------------------------------------------------------------------------


def _flash_window(window, call):
    """refattn (left, right), None unbounded -> FlashAttention's (left, right), -1 unbounded."""
    return tuple(-1 if side is None or side >= 2**62 else int(side) for side in window)


def _wide_window(window, call):
    """An unbounded side as a width past every distance (the same allowed set)."""
    wide = call.length + call.keys
    return tuple(wide if side is None or side >= 2**62 else int(side) for side in window)


def _when(flag_name, value_if_true):
    return Convert(None, lambda value, call: {flag_name: value_if_true} if value else {})


def _nonzero_dropout(value, call):
    if value:
        raise NotImplementedError(
            f"dropout_p={value!r}: the library draws its own random keep-mask; the case's "
            f"keep-mask (dropout_mask) cannot be passed"
        )
    return {}


def _nan_rows(value, call):
    raise NotImplementedError(
        f"empty_rows={value!r}: no option for what rows with no allowed key give"
    )


def _float32_slopes(value, call):
    return exact_cast(value, np.float32, "alibi_slopes", "FlashAttention")


_NO_DROPOUT_MASK = Refuse(
    "its dropout draws its own random keep-mask; a given one cannot be passed"
)
_NO_TILE = Refuse("query head h reads kv head h // G (refattn's gqa='interleave') only")
_NO_SINKS = Refuse("no attention-sink logits")
_NO_FP8 = Refuse("no float8 descale factors")

#: Options every preset treats the same way unless its table says otherwise.
_COMMON = {
    "dropout_mask": _NO_DROPOUT_MASK,
    "dropout_p": Convert(None, _nonzero_dropout),
    "gqa": _NO_TILE,
    "empty_rows": Convert(None, _nan_rows),
    "sinks": _NO_SINKS,
    "q_descale": _NO_FP8,
    "k_descale": _NO_FP8,
    "v_descale": _NO_FP8,
}

_FLASH = {
    **_COMMON,
    "scale": "softmax_scale",
    "causal": "causal",
    "window": Convert("window_size", _flash_window),
    "softcap": "softcap",
    "alibi_slopes": Convert("alibi_slopes", _float32_slopes),
    "mask": Refuse("FlashAttention takes no mask (only causal, window_size and key lengths)"),
    "bias": Refuse("FlashAttention takes no additive bias"),
    "kv_lengths": Refuse(
        "flash_attn_func has no per-sequence key lengths (flash_attn_varlen_func's cu_seqlens_k "
        "or flash_attn_with_kvcache's cache_seqlens carry them: --signature flash_attn_varlen "
        "or flash_attn_with_kvcache)"
    ),
    "return_lse": _when("return_attn_probs", True),
    "qv": Refuse(
        "FlashAttention 2's flash_attn_func has no qv; FlashAttention 3's (hopper) takes it: "
        "--signature flash_attn_3"
    ),
    **{
        name: Refuse(
            "FlashAttention 2 takes no float8 descales; FlashAttention 3's (hopper) "
            "flash_attn_func takes q_descale, k_descale, v_descale: --signature flash_attn_3"
        )
        for name in ("q_descale", "k_descale", "v_descale")
    },
}


def _sdpa_mask(value, call):
    return {"attn_mask": value}


def _sdpa_causal(value, call):
    """torch refuses is_causal with an attn_mask: the causal set then joins the mask."""
    if not value:
        return {}
    mask, bias = call.options.get("mask"), call.options.get("bias")
    if mask is None and bias is None:
        return {"is_causal": True}
    return {}


def _sdpa_attn_mask(call):
    """One attn_mask from mask, bias and (when both are present) the causal set."""
    mask, bias = call.options.get("mask"), call.options.get("bias")
    causal = bool(call.options.get("causal"))
    if mask is None and bias is None:
        return {}
    allowed = None if mask is None else np.asarray(mask, dtype=bool)
    if causal:
        tril = np.tril(np.ones((call.length, call.keys), dtype=bool))
        allowed = tril if allowed is None else allowed & tril
    if bias is None:
        return {"attn_mask": allowed}
    dtype = call.dtype
    bias = exact_cast(np.asarray(bias), dtype, "bias", "torch scaled_dot_product_attention")
    if allowed is not None:
        bias = np.where(allowed, bias, np.array(-np.inf, dtype=bias.dtype))
    return {"attn_mask": bias}


def _sdpa_extra(call):
    return {
        **_sdpa_attn_mask(call),
        **({"enable_gqa": True} if call.heads != call.kv_heads else {}),
    }


def _jax_lengths(value, call):
    return np.asarray(value, dtype=np.int32).reshape(-1)


def _jax_bias(value, call):
    dtype = call.dtype
    return exact_cast(np.asarray(value), dtype, "bias", "jax.nn.dot_product_attention")


def _jax_check(call):
    if call.dim != call.value_dim:
        return (
            f"value head dim E = {call.value_dim} != query/key head dim D = {call.dim}: "
            f"jax.nn.dot_product_attention requires them equal"
        )
    emptied, structural = np.broadcast_arrays(_empty_rows(call), _empty_rows(call, bias=False))
    if (emptied & ~structural).any():
        return (
            "a -inf bias leaves a query row with no allowed key: jax.nn.dot_product_attention "
            "adds the bias to its scores, so the row is NaN; rows emptied by mask, causal, "
            "window or key lengths average every value (the preset's empty_rows='average')"
        )
    return None


def _empty_rows(call, bias=True):
    """The query rows of the case with no allowed key (docs/conventions.md's set; ``bias=False``:
    a -inf bias left out), a boolean (..., L)."""
    allowed = options_allowed(call.length, call.keys, call.options, bias=bias)
    return ~np.asarray(allowed).any(axis=-1)


def _flashinfer_check(call):
    if call.batch != 1:
        return f"single_prefill_with_kv_cache takes one sequence, the case has B = {call.batch}"
    return None


def _flashinfer_window(window, call):
    left, right = window
    unbounded = right is None or right >= 2**62
    if not unbounded and not (call.options.get("causal") and right >= 0):
        raise NotImplementedError(
            f"flashinfer: window={window!r}: window_left is its only window side (the right "
            f"side is unbounded, or 0 under causal)"
        )
    return {"window_left": -1 if left is None or left >= 2**62 else int(left)}


def _xformers_extra(call):
    """causal, window, key lengths and mask as one additive attn_bias of 0 / -inf (exact)."""
    opts = call.options
    structural = any(
        opts.get(n) is not None and opts.get(n) is not False
        for n in ("causal", "window", "kv_lengths", "mask", "bias")
    )
    if not structural:
        return {}
    allowed = options_allowed(call.length, call.keys, opts, bias=False)
    dtype = call.dtype
    bias = opts.get("bias")
    if bias is not None:
        bias = exact_cast(np.asarray(bias), dtype, "bias", "xformers memory_efficient_attention")
    else:
        bias = np.zeros((), dtype=dtype)
    shape = (call.batch, call.heads, call.length, call.keys)
    allowed = np.broadcast_to(allowed, shape)
    table = np.where(allowed, bias, np.array(-np.inf, dtype=dtype)).astype(dtype)
    return {"attn_bias": np.ascontiguousarray(np.broadcast_to(table, shape))}


_ALLOWED_IN_BIAS = Convert(None, lambda value, call: {})

PRESETS = {
    "flash_attn": Signature(
        "flash_attn",
        "FlashAttention flash_attn_func",
        layout="blhd",
        framework="torch",
        align="bottom_right",
        keywords=_FLASH,
    ),
    "flash_attn_varlen": Signature(
        "flash_attn_varlen",
        "FlashAttention flash_attn_varlen_func",
        layout="packed",
        framework="torch",
        align="bottom_right",
        keywords={**_FLASH, "kv_lengths": "kv_lengths"},  # the layout makes cu_seqlens_k ragged
    ),
    "flash_attn_with_kvcache": Signature(
        "flash_attn_with_kvcache",
        "FlashAttention flash_attn_with_kvcache",
        layout="paged",
        framework="torch",
        align="bottom_right",
        keywords={
            **_FLASH,
            "kv_lengths": "kv_lengths",  # the layout passes them as cache_seqlens
            "return_lse": _when("return_softmax_lse", True),
        },
        adapt=kvcache_page_table,  # FlashAttention 3 names block_table page_table
    ),
    "torch_sdpa": Signature(
        "torch_sdpa",
        "torch.nn.functional.scaled_dot_product_attention",
        layout="bhld",
        framework="torch",
        align="top_left",
        keywords={
            **_COMMON,
            "scale": "scale",
            "causal": Convert(None, _sdpa_causal),
            "mask": _ALLOWED_IN_BIAS,  # joined into attn_mask by extra
            "bias": _ALLOWED_IN_BIAS,
            "return_lse": Refuse("scaled_dot_product_attention returns no lse (return_lse)"),
        },
        extra=_sdpa_extra,
    ),
    "jax": Signature(
        "jax",
        "jax.nn.dot_product_attention",
        layout="blhd",
        framework="jax",
        align="top_left",
        keywords={
            **_COMMON,
            "scale": "scale",
            "causal": "is_causal",
            "window": Convert("local_window_size", _wide_window),
            "mask": "mask",
            "bias": Convert("bias", _jax_bias),
            "kv_lengths": Convert("key_value_seq_lengths", _jax_lengths),
            "return_lse": _when("return_residual", True),
        },
        check=_jax_check,
        lse_axes=(0, 2, 1),  # the residual is (B, T, N)
        empty_rows="average",  # masked scores become one large finite negative
    ),
    "flashinfer": Signature(
        "flashinfer",
        "flashinfer.single_prefill_with_kv_cache",
        layout="packed",
        framework="torch",
        align="bottom_right",
        keywords={
            **_COMMON,
            "scale": "sm_scale",
            "causal": "causal",
            "window": Convert(None, _flashinfer_window),
            "softcap": "logits_soft_cap",
            "kv_lengths": "kv_lengths",  # one sequence: the layout cuts k and v to S_0
            "return_lse": _when("return_lse", True),
        },
        check=_flashinfer_check,
        lse_axes=(1, 0),  # its lse is (L, H)
        drop=("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
        lse_base=2,  # a base-2 log-sum-exp (consumers such as vLLM treat it so)
    ),
    "xformers": Signature(
        "xformers",
        "xformers.ops.memory_efficient_attention",
        layout="blhd",
        framework="torch",
        align=None,  # every offset is materialised in attn_bias
        keywords={
            **_COMMON,
            "scale": "scale",
            "causal": _ALLOWED_IN_BIAS,
            "window": _ALLOWED_IN_BIAS,
            "kv_lengths": _ALLOWED_IN_BIAS,
            "mask": _ALLOWED_IN_BIAS,
            "bias": _ALLOWED_IN_BIAS,
            "align": _ALLOWED_IN_BIAS,
            "return_lse": Refuse("memory_efficient_attention returns no lse (return_lse)"),
        },
        extra=_xformers_extra,
        adapt=xformers_groups,  # grouped heads in its 5-D (B, M, G, H, K) form
    ),
}


# the presets of the 2025-26 kernels (FlashAttention 3, FlashMLA, FlashInfer's TensorRT-LLM
# decode) live beside this table: oracle/conventions/signatures_2026.py
from oracle.conventions.signatures_2026 import MERGE_PRESETS, presets_2026  # noqa: E402

PRESETS.update(
    presets_2026(
        {
            "Signature": Signature,
            "Convert": Convert,
            "Refuse": Refuse,
            "common": _COMMON,
            "flash": _FLASH,
            "when": _when,
        }
    )
)


def get(name) -> Signature:
    """The preset called ``name`` (a :class:`Signature` is returned as is)."""
    if isinstance(name, Signature):
        return name
    if name in MERGE_PRESETS:
        raise ValueError(
            f"signature: {name!r} is a merge function's convention: use it on a merge suite "
            f"(merge-smoke, merge-default) or as merge_convention"
        )
    if name not in PRESETS:
        raise ValueError(f"signature: expected one of {list(PRESETS)}, got {name!r}")
    return PRESETS[name]


def parse_keywords(keywords) -> dict:
    """``["scale=softmax_scale", ...]`` (or a dict) -> {refattn option: the function's name}."""
    if isinstance(keywords, dict):
        pairs = dict(keywords)
    else:
        pairs = {}
        for item in [keywords] if isinstance(keywords, str) else list(keywords or ()):
            for part in str(item).split(","):
                if not part.strip():
                    continue
                name, sep, renamed = part.partition("=")
                if not sep or not name.strip() or not renamed.strip():
                    raise ValueError(
                        f"keyword: expected OPTION=NAME (e.g. scale=softmax_scale), got {part!r}"
                    )
                pairs[name.strip()] = renamed.strip()
    known = (*ATTENTION_OPTIONS, "return_lse")
    unknown = [n for n in pairs if n not in known]
    if unknown:
        raise ValueError(f"keyword: unknown refattn option(s) {unknown}; expected some of {known}")
    return pairs


def declared(layout="bhld", causal_align=None, keywords=None) -> Signature | None:
    """The conventions a function declares without a preset, or None when it declares none:
    ``causal_align`` the alignment of its ``causal`` (and window/ALiBi), ``keywords`` renames
    {refattn option: its name}; other options keep refattn's names."""
    renames = parse_keywords(keywords)
    if causal_align not in (None, "top_left", "bottom_right"):
        raise ValueError(
            f"causal_align: expected 'top_left' or 'bottom_right', got {causal_align!r}"
        )
    if causal_align is None and not renames:
        return None
    return Signature(
        "declared",
        "the function",
        layout=layout,
        align=causal_align,
        keywords=renames,
        passthrough=True,
    )


def function_defaults(impl) -> dict:
    """{refattn option: default} for the options ``impl``'s signature declares as keywords
    with a default, so the oracle passes every option that differs from *its* defaults
    (``align="bottom_right"`` declared: a top-left case passes ``align="top_left"``).

    Empty for an implementation behind a signature preset or declared renames (its options
    reach it translated, with their absence meaning refattn's default) and for one whose
    signature cannot be read."""
    convention = getattr(impl, "convention", None) or {}
    if impl is None or {"signature", "causal_align", "keywords"} & set(convention):
        return {}
    try:
        parameters = inspect.signature(impl).parameters
    except (TypeError, ValueError):
        return {}
    return {
        name: p.default
        for name, p in parameters.items()
        if name in ATTENTION_OPTIONS
        and p.default is not p.empty
        and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        and isinstance(p.default, (str, bool, int, float, type(None)))
    }


def add_arguments(parser) -> None:
    """``--signature``, ``--causal-align``, ``--empty-rows`` and ``--keyword`` of
    ``refattn-oracle validate``."""
    parser.add_argument(
        "--signature",
        choices=[*PRESETS, *MERGE_PRESETS],
        default=None,
        help="the implementation speaks this library's keywords and conventions (it brings "
        "its layout and framework; see oracle.conventions.signatures; "
        "flashinfer_merge_state / flashinfer_merge_states on merge suites)",
    )
    parser.add_argument(
        "--causal-align",
        choices=("top_left", "bottom_right"),
        default=None,
        help="without --signature: the alignment of the implementation's causal/window "
        "(FlashAttention >= 2.1: bottom_right); other cases with L != S are unsupported",
    )
    parser.add_argument(
        "--empty-rows",
        choices=("zero", "nan", "average"),
        default=None,
        help="what the implementation gives rows with no allowed key: zero (refattn's), nan "
        "(0/0) or average (the mean of v over all keys: a large finite fill); cases it cannot "
        "be judged on are unsupported (oracle.judging.empty_rows)",
    )
    parser.add_argument(
        "--keyword",
        action="append",
        metavar="OPTION=NAME",
        default=[],
        help="without --signature: the implementation's name for a refattn option "
        "(repeatable, e.g. --keyword scale=softmax_scale)",
    )


def options_of(args) -> dict:
    """The :func:`oracle.run.validate.validate` keywords of the parsed flags (only those given,
    so the keyword lists of other entry points stay as they are)."""
    found = {
        "signature": getattr(args, "signature", None),
        "causal_align": getattr(args, "causal_align", None),
        "keywords": list(getattr(args, "keyword", None) or ()),
        "empty_rows": getattr(args, "empty_rows", None),
    }
    return {name: value for name, value in found.items() if value}


# the linear-attention presets (fla_*, transformers_gated_delta_rule) join the table
from oracle.conventions.linear_presets import PRESETS as _LINEAR_PRESETS  # noqa: E402

PRESETS.update(_LINEAR_PRESETS)
