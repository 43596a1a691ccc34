"""The kernel bugs of tests/planted/bugs_2026.py planted in the torch functions with the
libraries' real signatures (tests/planted/library_2026.py): each is its library function with
one line changed (:func:`library_2026.mistake` names the line), run through the library's
preset (``--signature NAME``) with no wrapper (tests/meta/test_bugs_2026_torch.py).

* ``flash_mla_sparse_fwd_indices_off_by_one``: the sparse gather reads slot idx + 1 (a
  1-based top-k list read by a 0-based kernel); ``flash_mla_with_kvcache_indices_off_by_one``
  the same in the sparse decode;
* ``flash_mla_sparse_fwd_lse_in_base2``: the lse returned as log2 of the normaliser (FlashMLA
  documents the natural log);
* ``flash_mla_with_kvcache_scale_of_key_width``: ``softmax_scale`` ignored, 1/sqrt(576) of
  the latent key width used;
* ``flash_attn_func_qv_dropped``: FlashAttention 3's ``qv`` counted in the default scale but
  its qv.v term never added;
* ``trtllm_decode_nibbles_swapped``: packed NVFP4 bytes unpacked high nibble first.
"""

from __future__ import annotations

import functools

from tests.planted import library_2026 as lib

__all__ = [
    "flash_mla_sparse_fwd_indices_off_by_one",
    "flash_mla_with_kvcache_indices_off_by_one",
    "flash_mla_sparse_fwd_lse_in_base2",
    "flash_mla_with_kvcache_scale_of_key_width",
    "flash_attn_func_qv_dropped",
    "trtllm_decode_nibbles_swapped",
]


def _with_mistake(name, function, bug_name):
    """``function`` (same signature, same return values) making mistake ``name``."""

    @functools.wraps(function)
    def bug(*args, **kwargs):
        with lib.mistake(name):
            return function(*args, **kwargs)

    bug.__name__ = bug.__qualname__ = bug_name
    return bug


flash_mla_sparse_fwd_indices_off_by_one = _with_mistake(
    "off-by-one", lib.flash_mla_sparse_fwd, "flash_mla_sparse_fwd_indices_off_by_one"
)
flash_mla_with_kvcache_indices_off_by_one = _with_mistake(
    "off-by-one", lib.flash_mla_with_kvcache, "flash_mla_with_kvcache_indices_off_by_one"
)
flash_mla_sparse_fwd_lse_in_base2 = _with_mistake(
    "base2", lib.flash_mla_sparse_fwd, "flash_mla_sparse_fwd_lse_in_base2"
)
flash_mla_with_kvcache_scale_of_key_width = _with_mistake(
    "key-width-scale", lib.flash_mla_with_kvcache, "flash_mla_with_kvcache_scale_of_key_width"
)
flash_attn_func_qv_dropped = _with_mistake("qv", lib.flash_attn_func, "flash_attn_func_qv_dropped")
trtllm_decode_nibbles_swapped = _with_mistake(
    "nibbles", lib.trtllm_batch_decode_with_kv_cache, "trtllm_decode_nibbles_swapped"
)
