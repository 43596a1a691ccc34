"""First-case guidance: when the first cases of a run all raise or return the wrong shape, name
the calling-convention flag that is likely missing.

A function written for another convention fails every case the same way (a torch function
handed NumPy arrays: ``ValueError: axes don't match array``; a (B, L, H, D) function handed
(B, H, L, D): ``Number of heads in key and value must divide...`` or an output of the
transposed shape; FlashAttention's ``softmax_scale`` handed ``scale=``). Instead of a run of
identical errors, :func:`validate <oracle.run.validate.validate>` stops after the first cases with
a :class:`ConventionError` that says what was passed, what the function seems to expect and
the flag to try. Only a recognised pattern stops a run: a function that fails for another
reason is judged on every case as before.

Examples
--------
>>> def torch_style(q, k, v, *, softmax_scale=None, causal=False):
...     return q.transpose(1, 2)
>>> print(hint(torch_style, ["error: ValueError: axes don't match array"],
...            {"layout": "bhld", "framework": "numpy", "device": "cpu"}))
the function seems to take torch tensors (it calls tensor methods on the NumPy arrays it was \
passed: ValueError: axes don't match array): try --framework torch (passed: --framework numpy); \
its keywords look like FlashAttention's flash_attn_func: try --signature flash_attn
"""

from __future__ import annotations

import inspect
import re

from oracle.judging.refused import REFUSED

__all__ = ["ConventionError", "FIRST_CASES", "hint", "check_first_cases"]

#: How many first attention cases must all fail alike before the run stops with guidance.
FIRST_CASES = 3

#: (message fragment, flag, value, what the function seems to expect)
_MESSAGES = (
    (
        "axes don't match array",
        "framework",
        "torch",
        "torch tensors (it calls tensor methods on the NumPy arrays it was passed",
    ),
    ("must be Tensor, not numpy", "framework", "torch", "torch tensors (torch refused NumPy"),
    ("has no attribute 'contiguous'", "framework", "torch", "torch tensors (NumPy has no"),
    ("has no attribute 'float'", "framework", "torch", "torch tensors (NumPy has no"),
    ("has no attribute 'device'", "framework", "torch", "torch tensors (NumPy has no"),
    ("has no attribute 'at'", "framework", "jax", "jax arrays (NumPy has no"),
    (
        "Number of heads in key and value must divide",
        "layout",
        "blhd",
        "(B, L, H, D) tensors (torch read the sequence axis as the head axis",
    ),
    ("cu_seqlens", "layout", "packed", "packed tokens with cu_seqlens (it asked for"),
    ("block_table", "layout", "paged", "a paged KV cache (it asked for"),
    ("k_cache", "layout", "paged", "a paged KV cache (it asked for"),
)

#: Parameter names that give a library's signature away (checked in order).
_PARAMETERS = (
    # the 2025-26 kernels first: their names overlap the older ones' (k_cache, sm_scale)
    ({"kv", "indices", "sm_scale", "d_v"}, "flashmla_sparse", "FlashMLA's flash_mla_sparse_fwd"),
    (
        {"head_dim_v", "tile_scheduler_metadata"},
        "flashmla_kvcache",
        "FlashMLA's flash_mla_with_kvcache",
    ),
    (
        {"kv_cache", "bmm1_scale", "bmm2_scale"},
        "flashinfer_trtllm_decode",
        "FlashInfer's trtllm_batch_decode_with_kv_cache",
    ),
    (
        {"v_a", "s_a", "v_b", "s_b"},
        "flashinfer_merge_state",
        "FlashInfer's merge_state (a merge: on merge suites, or --merge-convention "
        "flashinfer_merge_state)",
    ),
    ({"page_table", "qv"}, "flash_attn_3_kvcache", "FlashAttention 3's flash_attn_with_kvcache"),
    ({"qv", "q_descale", "softmax_scale"}, "flash_attn_3", "FlashAttention 3's flash_attn_func"),
    ({"cu_seqlens_q", "softmax_scale"}, "flash_attn_varlen", "flash_attn_varlen_func"),
    ({"k_cache"}, "flash_attn_with_kvcache", "flash_attn_with_kvcache"),
    ({"cache_seqlens", "softmax_scale"}, "flash_attn_with_kvcache", "flash_attn_with_kvcache"),
    ({"softmax_scale"}, "flash_attn", "flash_attn_func"),
    ({"window_size"}, "flash_attn", "flash_attn_func"),
    ({"local_window_size"}, "jax", "jax.nn.dot_product_attention"),
    ({"is_causal", "attn_mask"}, "torch_sdpa", "scaled_dot_product_attention"),
    ({"sm_scale"}, "flashinfer", "single_prefill_with_kv_cache"),
    ({"attn_bias"}, "xformers", "memory_efficient_attention"),
)


_MERGE_STATES = (
    (
        {"merge_states"},
        "flashinfer_merge_states",
        "FlashInfer's merge_states (a merge: on merge suites, or --merge-convention "
        "flashinfer_merge_states)",
    ),
)


class ConventionError(ValueError):
    """The first cases all failed in a way that names a calling-convention flag."""


def _parameters(impl) -> set:
    try:
        return set(inspect.signature(impl).parameters)
    except (TypeError, ValueError):
        return set()


def hint(impl, messages, convention) -> str | None:
    """The guidance for a run whose first cases gave ``messages`` ("verdict: message"), or
    None when no pattern is recognised. ``impl`` may be None (not importable here)."""
    parts = []
    seen = set()
    for fragment, flag, value, expect in _MESSAGES:
        hit = next((m for m in messages if fragment in m), None)
        if hit is None or flag in seen or convention.get(flag) == value:
            continue
        seen.add(flag)
        detail = hit.split(": ", 1)[-1]
        parts.append(
            f"the function seems to take {expect}: {detail}): try --{flag} {value} "
            f"(passed: --{flag} {convention.get(flag)})"
        )
    if any("transposed" in m for m in messages) and "layout" not in seen:
        seen.add("layout")
        parts.append(
            "its output has the (B, L, H, E) shape where (B, H, L, E) was expected: try "
            f"--layout blhd (passed: --layout {convention.get('layout')})"
        )
    names = _parameters(impl) if impl is not None else set()
    if "signature" not in convention:
        if {"v", "s"} == names & {"v", "s"} and len(names) == 2:  # merge_states(v, s)
            names = names | {"merge_states"}
        for needed, preset, library in _MERGE_STATES + _PARAMETERS:
            if needed <= names:
                parts.append(
                    f"its keywords look like {_library(library)}: try --signature {preset}"
                )
                break
    return "; ".join(parts) or None


def _library(name):
    return f"FlashAttention's {name}" if name.startswith("flash_attn") else name


def _shape_note(result) -> str:
    """ "fail: transposed" when a wrong output shape is the layout's transposition."""
    message = result.message or ""
    if "has shape" in message:
        shapes = re.findall(r"\(([\d, ]+)\)", message)
        if len(shapes) >= 2:
            got, want = (tuple(int(x) for x in s.split(",") if x.strip()) for s in shapes[:2])
            if len(got) == len(want) == 4 and got == (want[0], want[2], want[1], want[3]):
                return f"{result.verdict}: transposed {message}"
    return f"{result.verdict}: {message}"


def _said_no(message) -> bool:
    """A refused keyword or a refusal (:mod:`oracle.judging.refused`; it may name a convention)."""
    return "does not accept" in (message or "") or (message or "").startswith(REFUSED)


def check_first_cases(results, load_impl, convention, total) -> None:
    """Raise :class:`ConventionError` when the first :data:`FIRST_CASES` attention results
    (of ``total`` selected) all raised or returned a wrong shape and :func:`hint` names a
    flag; otherwise return. ``load_impl()`` gives the implementation (or None), called only
    then."""
    ran = [r for r in results if r.category != "invariance"]
    # an option the function lacks says nothing about its convention; a keyword it refuses does;
    # a refusal case (oracle.judging.must_refuse) passes by raising: it says nothing either
    first = [
        r
        for r in ran
        if r.category != "refusal" and (r.verdict != "unsupported" or _said_no(r.message))
    ][:FIRST_CASES]
    if not first or (len(first) < FIRST_CASES and len(ran) < total):
        return
    broken = all(r.verdict == "error" or (r.verdict == "unsupported") for r in first)
    if not broken:
        return
    messages = [_shape_note(r) for r in first]
    guidance = hint(load_impl(), messages, convention)
    if guidance:
        raise ConventionError(
            f"the first {len(first)} cases all failed alike ({messages[0]}); {guidance}"
        )
