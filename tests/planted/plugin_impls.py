"""Implementations for the pytest plugin's supervision tests (tests/meta/test_plugin_session.py)."""

from __future__ import annotations

import ctypes
import os
import time

from oracle.reading.baseline import textbook_attention

__all__ = ["exits_on_causal", "hangs_on_causal", "segfaults_on_causal", "flash_attn_numpy"]


def exits_on_causal(q, k, v, return_lse=False, **options):
    """Correct textbook attention, except that a causal call ends the process (``os._exit``):
    run in the pytest process, it would end the whole session."""
    if options.get("causal"):
        os._exit(3)
    result = textbook_attention(q, k, v, **options)
    return (result.out, result.lse) if return_lse else result.out


def hangs_on_causal(q, k, v, return_lse=False, **options):
    """Correct textbook attention, except that a causal call never returns."""
    if options.get("causal"):
        time.sleep(3600)
    result = textbook_attention(q, k, v, **options)
    return (result.out, result.lse) if return_lse else result.out


def segfaults_on_causal(q, k, v, return_lse=False, **options):
    """Correct textbook attention, except that a causal call crashes the process (SIGSEGV)."""
    if options.get("causal"):
        ctypes.string_at(0)
    result = textbook_attention(q, k, v, **options)
    return (result.out, result.lse) if return_lse else result.out


def flash_attn_numpy(q, k, v, *, softmax_scale=None, causal=False, return_lse=False):
    """FlashAttention's keyword names and causal convention (``softmax_scale``; ``causal``
    bottom-right aligned, as FlashAttention >= 2.1) over NumPy (B, H, L, D) arrays: correct
    when declared with ``--refattn-causal-align bottom_right --refattn-keyword
    scale=softmax_scale``."""
    options = {"scale": softmax_scale, "causal": causal, "align": "bottom_right"}
    result = textbook_attention(q, k, v, **options)
    return (result.out, result.lse) if return_lse else result.out
