"""Signature presets of the 2025-26 attention kernels (rows of
:data:`oracle.conventions.signatures.PRESETS`).

Each maps refattn's cases to the library's real keyword names, shapes, dtypes and return
values, so the function as shipped is validated with no wrapper; what the library cannot
express is "not expressible" (unsupported), with the reason, never a fail.

* ``flash_attn_3``: FlashAttention 3's hopper ``flash_attn_func(q, k, v, softmax_scale, causal,
  qv, q_descale, k_descale, v_descale, window_size, attention_chunk, softcap, num_splits,
  pack_gqa, deterministic, sm_margin, return_attn_probs)``: (B, L, H, D) tensors, ``qv``
  (B, L, H, E), float8 q/k/v as they are with float32 descales (B, K); causal and window
  bottom-right; the lse (B, H, L) second when ``return_attn_probs=True``. No ALiBi, no
  dropout, no per-sequence lengths (``flash_attn_3_kvcache``).
* ``flash_attn_3_kvcache``: its ``flash_attn_with_kvcache(q, k_cache, v_cache, ..., qv,
  cache_seqlens, page_table, q_descale, k_descale, v_descale, softmax_scale, causal,
  window_size, softcap, num_splits, return_softmax_lse)``: the paged layout (pages of 16 or 64
  keys, reverse order, NaN where no sequence owns a slot), ``page_table`` and
  ``cache_seqlens`` the real lengths.
* ``flashmla_sparse``: FlashMLA's ``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v,
  attn_sink, topk_length) -> (out, max_logits, lse)``
  (:mod:`oracle.conventions.layouts_mla_sparse`): one latent kv, indices (s_q, K, T) with -1
  invalid, ``sm_scale`` always passed; the lse is the natural log without the sink, +inf on
  empty rows (brought to refattn's reading).
* ``flashmla_kvcache``: FlashMLA's ``flash_mla_with_kvcache(q, k_cache, block_table,
  cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale, causal,
  is_fp8_kvcache, indices, attn_sink, ...) -> (out, lse)``: the latent paged cache
  (:mod:`oracle.conventions.layouts_latent`), causal bottom-right, ``tile_scheduler_metadata``
  from ``flash_mla.get_mla_metadata()`` when FlashMLA is installed (else None). A case with
  ``key_indices`` is its sparse (DSA) decode: ``indices`` (B, s_q, topk) the keys' slots in the
  paged cache (-1 invalid; causal, window and lengths folded in), the cache in the 656-byte
  fp8 form with ``is_fp8_kvcache=True`` (its interface asserts both for sparse decode): cases
  whose latent keys are not on that grid are not expressible.
* ``flashinfer_trtllm_decode``: FlashInfer's ``trtllm_batch_decode_with_kv_cache`` on an NVFP4
  cache (:mod:`oracle.conventions.layouts_trtllm`): codes two per byte with ``kv_cache_sf``,
  ``bmm1_scale`` = q_scale * k_scale * sm_scale, ``bmm2_scale`` = v_scale, ``seq_lens``,
  ``block_tables``; no lse.

The merge functions (``flashinfer_merge_state``, ``flashinfer_merge_states``) are merge
conventions: :mod:`oracle.conventions.merge`.

Examples
--------
>>> from oracle.conventions.signatures import Call, get
>>> import numpy as np
>>> q = np.zeros((1, 2, 3, 4)); k = v = np.zeros((1, 2, 3, 4))
>>> sorted(get("flash_attn_3").translate({"qv": np.zeros((1, 3, 2, 4)), "scale": 0.5},
...                                      Call.of(q, k, v, {})))
['qv', 'softmax_scale']
"""

from __future__ import annotations

import numpy as np

from oracle.conventions.layouts_latent import fp8_latent_cache
from oracle.conventions.layouts_mla_sparse import fix_lse

__all__ = ["presets_2026", "MERGE_PRESETS"]

#: The merge presets: --signature NAME on a merge suite selects this merge convention.
MERGE_PRESETS = ("flashinfer_merge_state", "flashinfer_merge_states")


def _float32(name, library):
    def convert(value, call):
        from oracle.adapters import exact_cast

        return exact_cast(np.asarray(value), np.float32, name, library)

    return convert


def _empty_zero(value, call):
    """Rows with no allowed key give out 0 in these kernels (refattn's "zero")."""
    if value != "zero":
        raise NotImplementedError(
            f"empty_rows={value!r}: rows with no allowed key give 0 (empty_rows='zero' only)"
        )
    return {}


def _page_table(args, kwargs, call, parameters):
    """FlashAttention 3 names the block table ``page_table``."""
    kwargs = dict(kwargs)
    kwargs["page_table"] = kwargs.pop("block_table")
    return args, kwargs, lambda out: out


def _same(value, call):
    return {}


def _mla_metadata(call):
    """``tile_scheduler_metadata``: a fresh ``flash_mla.get_mla_metadata()[0]`` when FlashMLA is
    installed (its own function asserts the type), else None (a function written from its
    interface takes it and ignores it)."""
    try:  # optional: FlashMLA needs a CUDA build; the preset works without it
        import flash_mla
    except ImportError:
        return {"tile_scheduler_metadata": None}
    return {"tile_scheduler_metadata": flash_mla.get_mla_metadata()[0]}


def _sparse_decode(args, kwargs, call, parameters):
    """FlashMLA's sparse decode: with ``indices`` the cache goes in its 656-byte fp8 form and
    ``is_fp8_kvcache=True`` (``flash_mla_with_kvcache`` asserts it for sparse attention)."""
    if kwargs.get("indices") is None:
        return args, kwargs, lambda out: out
    q, cache = args
    return (q, fp8_latent_cache(cache)), {**kwargs, "is_fp8_kvcache": True}, lambda out: out


def _mla_sparse_scale(call):
    scale = call.options.get("scale")
    return {"sm_scale": float(call.dim**-0.5 if scale is None else scale)}


def _mla_sparse_check(call):
    if call.options.get("normalizer") not in (None, "softmax"):
        return "normalizer: FlashMLA's sparse kernel takes softmax only"
    return None


def _mla_fix(lse, options):
    return fix_lse(lse, options)


def _kvcache_fix(lse, options):
    """FlashMLA's decode gives +inf lse on rows with no valid key; the sink is not in it."""
    return fix_lse(lse, options)


def presets_2026(parts) -> dict:
    """{name: Signature} of the presets above; ``parts`` the pieces of
    :mod:`oracle.conventions.signatures` they are built from (Signature, Convert, Refuse,
    common, flash, when), handed over so that module's table imports this one, not the
    reverse."""
    Signature, Convert, Refuse = parts["Signature"], parts["Convert"], parts["Refuse"]
    _COMMON, _FLASH, _when = parts["common"], parts["flash"], parts["when"]
    fp8 = {n: n for n in ("q_descale", "k_descale", "v_descale")}
    fa3 = {
        **_FLASH,
        **fp8,
        "qv": "qv",
        "alibi_slopes": Refuse("FlashAttention 3 takes no alibi_slopes"),
        "kv_lengths": Refuse(
            "flash_attn_func has no per-sequence key lengths (FlashAttention 3's "
            "flash_attn_with_kvcache carries them as cache_seqlens: --signature "
            "flash_attn_3_kvcache)"
        ),
        "empty_rows": Convert(None, _empty_zero),
    }
    mla_sink = Convert("attn_sink", _float32("sinks", "FlashMLA attn_sink"))
    return {
        "flash_attn_3": Signature(
            "flash_attn_3",
            "FlashAttention 3 flash_attn_func (hopper)",
            layout="blhd",
            framework="torch",
            align="bottom_right",
            keywords=fa3,
        ),
        "flash_attn_3_kvcache": Signature(
            "flash_attn_3_kvcache",
            "FlashAttention 3 flash_attn_with_kvcache (hopper)",
            layout="paged",
            framework="torch",
            align="bottom_right",
            keywords={
                **fa3,
                "kv_lengths": "kv_lengths",  # the layout passes them as cache_seqlens
                "return_lse": _when("return_softmax_lse", True),
            },
            adapt=_page_table,
        ),
        "flashmla_sparse": Signature(
            "flashmla_sparse",
            "FlashMLA flash_mla_sparse_fwd",
            layout="mla-sparse",
            framework="torch",
            align=None,  # causal, window and lengths are folded into the indices
            keywords={
                **_COMMON,
                "scale": Convert(None, _same),  # always passed as sm_scale (extra)
                "sinks": mla_sink,
                "empty_rows": Convert(None, _empty_zero),
                "return_lse": Convert(None, _same),  # (out, max_logits, lse) always
            },
            extra=_mla_sparse_scale,
            check=_mla_sparse_check,
            lse_at=2,
            always_lse=True,
            fix_lse=_mla_fix,
        ),
        "flashmla_kvcache": Signature(
            "flashmla_kvcache",
            "FlashMLA flash_mla_with_kvcache",
            layout="latent-paged",
            framework="torch",
            align="bottom_right",
            keywords={
                **_COMMON,
                "scale": "softmax_scale",
                "causal": "causal",
                "kv_lengths": "kv_lengths",  # the layout passes them as cache_seqlens
                "sinks": mla_sink,
                "empty_rows": Convert(None, _empty_zero),
                "return_lse": Convert(None, _same),  # (out, lse) always
            },
            extra=_mla_metadata,
            adapt=_sparse_decode,
            always_lse=True,
            fix_lse=_kvcache_fix,
        ),
        "flashinfer_trtllm_decode": Signature(
            "flashinfer_trtllm_decode",
            "flashinfer.decode.trtllm_batch_decode_with_kv_cache (NVFP4 KV cache)",
            layout="trtllm-fp4",
            framework="torch",
            align="bottom_right",
            keywords={
                **_COMMON,
                "causal": Convert(None, _same),  # decode rows see their whole sequence
                "gqa": Convert(None, _interleave_only),
                "k_descale": Convert(None, _same),  # folded into bmm1_scale / bmm2_scale
                "v_descale": Convert(None, _same),
                "return_lse": Refuse("trtllm_batch_decode_with_kv_cache returns no lse"),
            },
            check=_trtllm_check,
        ),
    }


def _interleave_only(value, call):
    if value != "interleave":
        raise NotImplementedError(
            f"gqa={value!r}: query head h reads kv head h // G (gqa='interleave') only"
        )
    return {}


def _trtllm_check(call):
    if call.length != 1:
        return (
            f"L = {call.length}: the preset passes decode rows (q_len_per_req = 1); "
            f"speculative rows are not expressed"
        )
    if call.options.get("window") is not None:
        return "window: not expressed (window_left only, and the decode row sees S_b keys)"
    return None
