"""Long-row attention case families of ``default``: decode and short-prefill rows over 2k to
128k keys, in every dtype.

The bugs of long-context kernels show only past a depth: accumulators too narrow for the sum
of thousands of terms, a running maximum that moves after 4k, 8k or 32k keys without the
accumulator being rescaled, split-KV partial results combined without their maxima, 16-bit
position arithmetic past 32767 or 65535, causal offsets of a cache that is longer than the
query block. The truth of a row costs its length only, so these cases keep few query rows
(L = 1 to 16, two blocks of 64 and 128) and small head dims (D = E = 16); their inputs come
from :mod:`oracle.catalogue.attention_long_inputs` and their fixtures store no inputs (recipe
``compact``: regenerated on load and checked against their sha256, see
:mod:`oracle.fixtures.compact`). Key lengths straddle the 64/128 tiles and the split-KV chunk
sizes (4097, 8191, 32769, 20481 = 5 * 4096 + 1, ...).
"""

from __future__ import annotations

from oracle.catalogue import attention_long_inputs  # noqa: F401 - registers the "long-grid" recipe
from oracle.catalogue.attention_entry import ALL, Entry
from oracle.catalogue.case import Shapes

__all__ = ["DECODE_LENGTHS", "long_entries", "fade_entries"]

#: Key lengths of the decode rows: 2k to 128k, several one key off a power of two.
DECODE_LENGTHS = (2048, 4097, 8191, 16384, 32769, 65536, 131072)

_GRID = {"qkv": "long-grid", "compact": True}
_BR = {"causal": True, "align": "bottom_right"}
_GQA_BR = {**_BR, "gqa": "interleave"}


def _e(tag, shapes, description, options=None, recipe=None) -> Entry:
    return Entry(
        tag,
        shapes,
        description,
        default=ALL,
        full=ALL,
        options=dict(options or {}),
        recipe={**_GRID, **(recipe or {})},
    )


def _rows(L, S, H=1, K=1, batch=1) -> Shapes:
    return Shapes(batch=batch, H=H, K=K, L=L, S=S, D=16, E=16)


def long_entries() -> list[Entry]:
    """The long-row rows of default (every dtype; see the module docstring)."""
    rows = [
        _e(
            "long-decode",
            _rows(1, S, H=2),
            f"GQA decode, L = 1 over {S} keys, causal bottom_right: many key tiles and "
            "split-KV chunks, deep accumulators",
            _GQA_BR,
        )
        for S in DECODE_LENGTHS
    ]
    rows += [
        _e(
            "long-prefill",
            _rows(16, 8193),
            "short prefill: 16 queries at the end of an 8193-key cache (causal bottom_right, "
            "offset 8177)",
            _BR,
        ),
        _e(
            "long-prefill",
            _rows(4, 32768),
            "4 queries at the end of a 32768-key cache (causal bottom_right)",
            _BR,
        ),
        _e(
            "long-block",
            _rows(64, 2049),
            "a 64-query block over 2049 keys, causal bottom_right: one full query tile",
            _BR,
        ),
        _e(
            "long-block",
            _rows(128, 1025),
            "a 128-query block over 1025 keys, causal bottom_right: two query tiles of 64",
            _BR,
        ),
        _e(
            "long-window",
            _rows(4, 16384),
            "sliding window (2048, 0) bottom_right: the allowed keys start 14k deep in the row",
            {"window": (2048, 0), "align": "bottom_right"},
        ),
        _e(
            "long-window",
            _rows(2, 65537),
            "sliding window (500, 0) bottom_right over 65537 keys: 500 keys past key 65035",
            {"window": (500, 0), "align": "bottom_right"},
        ),
        _e(
            "long-kv-lengths",
            _rows(2, 32768, batch=2),
            "per-row cache lengths a few keys short of 32768 (tails inside the last tiles)",
            _BR,
            {"kv_lengths": "near-end"},
        ),
        _e(
            "long-sinks",
            _rows(1, 65536, H=2),
            "GQA decode with attention sinks over 65536 keys (the sink in the normaliser)",
            _GQA_BR,
            {"sinks": "gaussian"},
        ),
        _e(
            "long-softcap",
            _rows(4, 16385),
            "softcap 30 over 16385 keys with large logits (q, k x 4)",
            {"softcap": 30.0},
            {"sigma": 4.0},
        ),
        _e(
            "long-alibi",
            _rows(1, 70000, H=2),
            "ALiBi decode over 70000 keys, causal bottom_right: positions past 32767 and "
            "65535 (16-bit position arithmetic wraps or overflows)",
            _BR,
            {"alibi": True},
        ),
        _e(
            "long-alibi",
            _rows(2, 33000, H=2),
            "ALiBi, 2 queries over 33000 keys: positions just past 32767",
            _BR,
            {"alibi": True},
        ),
        _e(
            "long-late-max",
            _rows(2, 65536),
            "row maxima that jump at keys 4096, 8192 and 32768: a skipped rescale of the "
            "accumulator shows",
            None,
            {"jumps": [4096, 8192, 32768]},
        ),
        _e(
            "long-late-max",
            _rows(4, 9000),
            "row maxima that jump at keys 4100 and 8200 (inside tiles)",
            None,
            {"jumps": [4100, 8200]},
        ),
        _e(
            "long-late-max",
            _rows(1, 40000, H=2),
            "GQA decode, causal bottom_right, maxima jumping at keys 4096, 8192 and 32768",
            _GQA_BR,
            {"jumps": [4096, 8192, 32768]},
        ),
        *fade_entries(),
        _e(
            "long-splits",
            _rows(2, 20481),
            "20481 = 5 * 4096 + 1 keys: every split-KV chunk size of 256 to 4096 ends in a "
            "one-key chunk",
        ),
    ]
    return rows


#: (L, S, H, options, jumps) of the ``long-fade`` rows: mass before key 32768, a faint tail
#: after it, and maxima that move in the tail.
_FADES = (
    (1, 81921, 2, _GQA_BR, [36000, 38000]),
    (2, 49153, 1, None, [40000]),
    (4, 65536, 1, _BR, [33000, 50000, 60000]),
    (1, 98304, 2, _GQA_BR, [70000]),
    (1, 131072, 2, _GQA_BR, [100000, 120000]),
    (2, 73729, 2, {"gqa": "interleave"}, [50000]),
    (1, 114689, 1, _BR, [90000]),
)


def fade_entries() -> list[Entry]:
    """Rows whose mass sits in the first 32768 keys and whose faint tail (about e^-3 the
    weight per key, ``v`` shifted so the output does not cancel) a float16 accumulator past
    1k to 32k keys drops; maxima that move 33k to 120k keys deep (by 0.5 each, from a lift
    to 11) catch a rescale skipped past any of those depths."""
    return [
        _e(
            "long-fade",
            _rows(L, S, H=H),
            f"{L} quer{'y' if L == 1 else 'ies'} over {S} keys: the mass in the first 32768, "
            f"a faint tail after it (a narrow accumulator drops it), maxima moving at {jumps}",
            options,
            {"fade": 32768, "jumps": jumps, "jump_base": 11.0, "jump_step": 0.5},
        )
        for L, S, H, options, jumps in _FADES
    ]
