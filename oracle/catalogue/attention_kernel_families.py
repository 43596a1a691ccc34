"""The kernel-scale attention case families: tile lengths, long rows, real head dims, GQA
groups, ragged batches and the input distributions that stress a tiled online softmax."""

from __future__ import annotations

from oracle.catalogue.attention_entry import ALL, HALF, KERNEL_SUITES, Entry
from oracle.catalogue.case import Shapes

__all__ = ["TILE_LENGTHS", "DEFAULT_TILE_LENGTHS", "kernel_entries"]


#: Lengths around the 64/128 tile sizes of real kernels.
TILE_LENGTHS = (1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 2049)
#: Those of them whose ``k-tile`` case is also in default (a single key, an exact tile, a tile
#: and one key, two tiles and one key, four tiles and one key: one key past a split-KV chunk).
DEFAULT_TILE_LENGTHS = (1, 64, 65, 129, 257)


#: The input distributions that stress a tiled online softmax: (tag, recipe, description).
DISTRIBUTIONS = [
    (
        "k-outlier",
        {"qkv": "outlier", "factor": 32.0, "channels": 3},
        "outlier channels: 3 dims of q and k 32x larger (LLM activations)",
    ),
    ("k-sink", {"qkv": "sink"}, "a sink key (key 0) taking most of every row's weight"),
    (
        "k-peaky-late",
        {"qkv": "late-max"},
        "peaky rows whose max moves in every tile up to the last (online rescale)",
    ),
    (
        "k-uniform",
        {"qkv": "gaussian", "sigma": 0.0625},
        "near-uniform rows (tiny logits): long sums of nearly equal terms",
    ),
    (
        "k-offset",
        {"qkv": "offset", "offset": 64.0},
        "values with a large common offset (64 + N(0,1)): cancellation in P@V",
    ),
    (
        "k-overflow16",
        {"qkv": "gaussian", "sigma": 24.0},
        "q.k beyond the float16 range unless the scale is applied first",
    ),
]

_GAUSS = {"qkv": "gaussian", "sigma": 1.0}
_BR_EMPTY = {"causal": True, "align": "bottom_right", "empty_rows": "zero"}


def kernel_entries() -> list[Entry]:
    """Kernel-scale cases: lengths around tile sizes, long rows, real head dims, GQA groups,
    ragged batches and input distributions that stress a tiled online softmax."""
    return [
        *tile_rows(),
        *offset_rows(),
        *long_key_rows(),
        *head_dim_rows(),
        *gqa_rows(),
        *ragged_rows(),
        *distribution_rows(),
        *half_accumulator_rows(),
        *distribution_default_rows(),
    ]


def _row(tag, shapes, description, options=None, recipe=None, default=False):
    """One kernel-scale row: in the kernel suite; ``default=True`` also in default and full
    (every dtype), ``default="half"`` in default and full for float16 and bfloat16 only."""
    if default == "half":  # rows for accumulators as narrow as the 16-bit input type
        return Entry(
            tag,
            shapes,
            description,
            default=HALF,
            full=HALF,
            extra=KERNEL_SUITES,
            options=dict(options or {}),
            recipe=dict(recipe or _GAUSS),
        )
    # default=True: also in default and full, every dtype (a bug class needs >= 5 cases
    # of each dtype to fail); the rest (the costly truths: S >= 16384, the 32k decode,
    # L = 257 over S = 1000/2049) only in the kernel suite
    chosen = ALL if default else ()
    return Entry(
        tag,
        shapes,
        description,
        default=chosen,
        full=chosen,
        extra=KERNEL_SUITES,
        options=dict(options or {}),
        recipe=dict(recipe or _GAUSS),
    )


def tile_rows() -> list[Entry]:
    """Lengths around the 64/128 tiles, without and with a causal diagonal."""
    rows = []
    for n in TILE_LENGTHS:
        rows.append(
            _row(
                "k-tile",
                Shapes(batch=1, H=2, K=2, L=min(n, 257), S=n, D=64, E=64),
                f"L, S around the 64/128 tiles (S = {n}): tile boundaries, partial "
                f"tiles, masked tails",
                default=n in DEFAULT_TILE_LENGTHS,
            )
        )
    for n in (63, 65, 129, 257):
        rows.append(
            _row(
                "k-tile-causal",
                Shapes(batch=1, H=2, K=2, L=n, S=n, D=64, E=64),
                f"causal, L = S = {n}: diagonal tiles cut by a tile boundary",
                {"causal": True, "align": "top_left"},
                default=n in (65, 129),
            )
        )
    return rows


def offset_rows() -> list[Entry]:
    """Several tiles of each side; causal and windows with L > S (negative diagonal offsets)."""
    return [
        _row(
            "k-tiles",
            Shapes(batch=1, H=2, K=2, L=200, S=300, D=64, E=64),
            "several query x key tiles (4 x 5), both partial; S > 256: two split-KV chunks",
            default=True,
        ),
        _row(
            "k-tiles-br",
            Shapes(batch=1, H=2, K=2, L=130, S=390, D=128, E=128),
            "causal bottom_right over several tiles, L < S",
            {"causal": True, "align": "bottom_right"},
        ),
        _row(
            "k-causal-l-gt-s",
            Shapes(batch=1, H=2, K=2, L=200, S=70, D=64, E=64),
            "causal bottom_right with L > S: a negative diagonal offset (first rows empty)",
            _BR_EMPTY,
            default=True,
        ),
        # L > S bottom_right: a kernel that clamps the diagonal offset S - L at 0 lets the
        # first rows attend; small and cheap, so every dtype has five of them
        _row(
            "k-causal-l-gt-s",
            Shapes(batch=1, H=2, K=2, L=130, S=70, D=64, E=64),
            "causal bottom_right, L = 130 > S = 70 (offset -60) over partial query and key tiles",
            _BR_EMPTY,
            default=True,
        ),
        _row(
            "k-causal-l-gt-s",
            Shapes(batch=1, H=2, K=2, L=200, S=129, D=64, E=64),
            "causal bottom_right, L = 200 > S = 129 (offset -71): several tiles of each",
            _BR_EMPTY,
            default=True,
        ),
        _row(
            "k-causal-l-gt-s",
            Shapes(batch=1, H=4, K=2, L=100, S=40, D=32, E=32),
            "causal bottom_right with L > S and GQA (offset -60)",
            {**_BR_EMPTY, "gqa": "interleave"},
            default=True,
        ),
        _row(
            "k-causal-l-gt-s",
            Shapes(batch=2, H=2, K=2, L=70, S=64, D=32, E=32),
            "causal bottom_right, L = 70 > S = 64, a batch of two (offset -6: few empty rows)",
            _BR_EMPTY,
            default=True,
        ),
        _row(
            "k-window-l-gt-s",
            Shapes(batch=1, H=2, K=2, L=150, S=100, D=32, E=32),
            "window (32, 0) bottom_right with L > S: the window follows the negative offset",
            {"window": (32, 0), "align": "bottom_right", "empty_rows": "zero"},
            default=True,
        ),
    ]


def long_key_rows() -> list[Entry]:
    """Long rows and a long decode: many key tiles, split-KV (kernel suite only)."""
    return [
        _row(
            "k-long",
            Shapes(batch=1, H=1, K=1, L=4, S=16384, D=64, E=64),
            "4 queries over 16384 keys: many key tiles, late max moves, split-KV",
        ),
        _row(
            "k-long",
            Shapes(batch=1, H=1, K=1, L=2, S=65536, D=64, E=64),
            "2 queries over 65536 keys",
        ),
        _row(
            "k-decode",
            Shapes(batch=1, H=8, K=2, L=1, S=32768, D=128, E=128),
            "GQA decode L = 1 over 32768 keys (split-KV combine)",
            {"gqa": "interleave"},
        ),
    ]


def head_dim_rows() -> list[Entry]:
    """Real and odd head dimensions; D != E."""
    rows = []
    for D in (64, 96, 128, 256, 59, 111):
        rows.append(
            _row(
                "k-headdim",
                Shapes(batch=1, H=2, K=2, L=65, S=129, D=D, E=D),
                f"head dim {D} over a partial tile: vector widths, odd dims",
                default=D in (128, 59),
            )
        )
    rows.append(
        _row(
            "k-d-ne-e",
            Shapes(batch=1, H=2, K=2, L=65, S=129, D=192, E=128),
            "D = 192, E = 128 (scale 1/sqrt(D), not E)",
        )
    )
    return rows


def gqa_rows() -> list[Entry]:
    """GQA group sizes 1, 4 and 8."""
    rows = []
    for K in (8, 2, 1):
        rows.append(
            _row(
                "k-gqa",
                Shapes(batch=1, H=8, K=K, L=65, S=200, D=64, E=64),
                f"GQA group size {8 // K} (H = 8, K = {K})",
                {"gqa": "interleave"},
                default=K == 2,
            )
        )
    return rows


def ragged_rows() -> list[Entry]:
    """Batches of different key lengths (padding masks)."""
    rows = []
    rows.append(
        _row(
            "k-ragged",
            Shapes(batch=4, H=2, K=2, L=65, S=300, D=64, E=64),
            "a batch whose rows have different key lengths (padding mask): per-row "
            "tails inside tiles",
            recipe={**_GAUSS, "mask": "padding"},
        )
    )
    rows.append(
        _row(
            "k-ragged",
            Shapes(batch=3, H=2, K=2, L=65, S=130, D=64, E=64),
            "three rows of different key lengths (padding mask) over three key tiles",
            recipe={**_GAUSS, "mask": "padding"},
            default=True,
        )
    )
    return rows


def distribution_rows() -> list[Entry]:
    """Each of :data:`DISTRIBUTIONS` over 1000 keys (kernel suite only)."""
    rows = []
    for tag, recipe, description in DISTRIBUTIONS:
        rows.append(
            _row(
                tag, Shapes(batch=1, H=2, K=2, L=65, S=1000, D=64, E=64), description, recipe=recipe
            )
        )
    return rows


def half_accumulator_rows() -> list[Entry]:
    """Float16 and bfloat16 rows that catch a 16-bit accumulator."""
    rows = []
    # a float16/bfloat16 accumulator for inputs of that type is caught (tight tier) where the
    # terms are all positive: a common value offset, a dominant sink key, small logits
    half_rows = [
        (
            "k-offset",
            Shapes(batch=1, H=2, K=2, L=65, S=129, D=64, E=64),
            {"qkv": "offset", "offset": 64.0},
            "values 64 + N(0,1) over a partial key tile: a 16-bit P@V accumulator drifts",
        ),
        (
            "k-offset",
            Shapes(batch=1, H=2, K=2, L=65, S=129, D=128, E=128),
            {"qkv": "offset", "offset": 64.0},
            "values 64 + N(0,1), D = E = 128: a 16-bit P@V accumulator drifts",
        ),
        (
            "k-sink",
            Shapes(batch=1, H=2, K=2, L=65, S=129, D=64, E=64),
            {"qkv": "sink"},
            "a sink key over a partial key tile: a 16-bit normaliser and P@V accumulator",
        ),
        (
            "k-small-logits",
            Shapes(batch=1, H=2, K=2, L=65, S=129, D=64, E=64),
            {"qkv": "gaussian", "sigma": 0.25},
            "small logits (sigma 1/4) over a partial key tile: nearly equal positive weights",
        ),
        (
            "k-small-logits",
            Shapes(batch=1, H=2, K=2, L=65, S=300, D=64, E=64),
            {"qkv": "gaussian", "sigma": 0.25},
            "small logits (sigma 1/4) over 300 keys: nearly equal positive weights",
        ),
    ]
    for tag, shapes, recipe, description in half_rows:
        rows.append(_row(tag, shapes, description, recipe=recipe, default="half"))
    return rows


def distribution_default_rows() -> list[Entry]:
    """Each of :data:`DISTRIBUTIONS` over 300 keys (default's share)."""
    rows = []
    for tag, recipe, description in DISTRIBUTIONS:
        # the same inputs over 300 keys (five key tiles, the last partial; two split-KV
        # chunks) and a partial query tile: default's share of each distribution
        rows.append(
            _row(
                tag,
                Shapes(batch=1, H=2, K=2, L=65, S=300, D=64, E=64),
                description + " (S = 300)",
                recipe=recipe,
                default=True,
            )
        )
    return rows
