"""Implementations that misbehave in every way the oracle must survive (tests/meta fuzz).

Module-level functions so that the supervised worker process can import them by name.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import numpy as np

from tests.planted.broken_impls import textbook


def _out(q, k, v, options):
    return textbook(q, k, v, **{n: x for n, x in options.items() if n != "return_lse"})


def good(q, k, v, **options):
    return _out(q, k, v, options)


def calls_sys_exit(q, k, v, **options):
    sys.exit(0)


def calls_os_exit(q, k, v, **options):
    os._exit(0)


def hangs(q, k, v, **options):
    time.sleep(3600)


def segfaults(q, k, v, **options):
    ctypes.string_at(0)


def eats_memory(q, k, v, **options):
    return np.ones(1 << 40, dtype=np.uint8)


def complex_out(q, k, v, **options):
    return _out(q, k, v, options).astype(np.complex128)


def int_out(q, k, v, **options):
    return _out(q, k, v, options).astype(np.int64)


def object_out(q, k, v, **options):
    return _out(q, k, v, options).astype(object)


def list_out(q, k, v, **options):
    return _out(q, k, v, options).tolist()


def none_out(q, k, v, **options):
    return None


def scalar_out(q, k, v, **options):
    return 0.5


def wrong_shape(q, k, v, **options):
    return _out(q, k, v, options)[..., :-1]


def empty_tuple(q, k, v, **options):
    return ()


def nan_out(q, k, v, **options):
    return np.full_like(_out(q, k, v, options), np.nan)


def raises_keyboard_free(q, k, v, **options):
    raise RuntimeError("boom")


def minimal_bottom_right(q, k, v, scale=None, causal=False):
    """The documented minimal contract (q, k, v, scale, causal) with causal aligned at the
    bottom-right corner: a bug that only cases without an explicit align= can reveal."""
    return textbook(q, k, v, scale=scale, causal=causal, align="bottom_right")


def minimal(q, k, v, scale=None, causal=False):
    return textbook(q, k, v, scale=scale, causal=causal)
