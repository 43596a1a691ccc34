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


def kernel_entries() -> list[Entry]:
    """Kernel-scale cases: lengths around tile sizes, long rows, real head dims, GQA groups,
    ragged batches and input distributions that stress a tiled online softmax."""

    def e(tag, shapes, description, options=None, recipe=None, default=False):
        if default == "half":  # rows for accumulators as narrow as the 16-bit input type
            return Entry(
                tag,
                shapes,
                description,
                default=HALF,
                full=HALF,
                extra=KERNEL_SUITES,
                options=dict(options or {}),
                recipe=dict(recipe or gauss),
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
            recipe=dict(recipe or gauss),
        )

    gauss = {"qkv": "gaussian", "sigma": 1.0}
    br_empty = {"causal": True, "align": "bottom_right", "empty_rows": "zero"}
    rows = []
    for n in TILE_LENGTHS:
        rows.append(
            e(
                "k-tile",
                Shapes(1, 2, 2, min(n, 257), n, 64, 64),
                f"L, S around the 64/128 tiles (S = {n}): tile boundaries, partial "
                f"tiles, masked tails",
                default=n in DEFAULT_TILE_LENGTHS,
            )
        )
    for n in (63, 65, 129, 257):
        rows.append(
            e(
                "k-tile-causal",
                Shapes(1, 2, 2, n, n, 64, 64),
                f"causal, L = S = {n}: diagonal tiles cut by a tile boundary",
                {"causal": True, "align": "top_left"},
                default=n in (65, 129),
            )
        )
    rows += [
        e(
            "k-tiles",
            Shapes(1, 2, 2, 200, 300, 64, 64),
            "several query x key tiles (4 x 5), both partial; S > 256: two split-KV chunks",
            default=True,
        ),
        e(
            "k-tiles-br",
            Shapes(1, 2, 2, 130, 390, 128, 128),
            "causal bottom_right over several tiles, L < S",
            {"causal": True, "align": "bottom_right"},
        ),
        e(
            "k-causal-l-gt-s",
            Shapes(1, 2, 2, 200, 70, 64, 64),
            "causal bottom_right with L > S: a negative diagonal offset (first rows empty)",
            br_empty,
            default=True,
        ),
        # L > S bottom_right: a kernel that clamps the diagonal offset S - L at 0 lets the
        # first rows attend; small and cheap, so every dtype has five of them
        e(
            "k-causal-l-gt-s",
            Shapes(1, 2, 2, 130, 70, 64, 64),
            "causal bottom_right, L = 130 > S = 70 (offset -60) over partial query and key tiles",
            br_empty,
            default=True,
        ),
        e(
            "k-causal-l-gt-s",
            Shapes(1, 2, 2, 200, 129, 64, 64),
            "causal bottom_right, L = 200 > S = 129 (offset -71): several tiles of each",
            br_empty,
            default=True,
        ),
        e(
            "k-causal-l-gt-s",
            Shapes(1, 4, 2, 100, 40, 32, 32),
            "causal bottom_right with L > S and GQA (offset -60)",
            {**br_empty, "gqa": "interleave"},
            default=True,
        ),
        e(
            "k-causal-l-gt-s",
            Shapes(2, 2, 2, 70, 64, 32, 32),
            "causal bottom_right, L = 70 > S = 64, a batch of two (offset -6: few empty rows)",
            br_empty,
            default=True,
        ),
        e(
            "k-window-l-gt-s",
            Shapes(1, 2, 2, 150, 100, 32, 32),
            "window (32, 0) bottom_right with L > S: the window follows the negative offset",
            {"window": (32, 0), "align": "bottom_right", "empty_rows": "zero"},
            default=True,
        ),
        e(
            "k-long",
            Shapes(1, 1, 1, 4, 16384, 64, 64),
            "4 queries over 16384 keys: many key tiles, late max moves, split-KV",
        ),
        e("k-long", Shapes(1, 1, 1, 2, 65536, 64, 64), "2 queries over 65536 keys"),
        e(
            "k-decode",
            Shapes(1, 8, 2, 1, 32768, 128, 128),
            "GQA decode L = 1 over 32768 keys (split-KV combine)",
            {"gqa": "interleave"},
        ),
    ]
    for D in (64, 96, 128, 256, 59, 111):
        rows.append(
            e(
                "k-headdim",
                Shapes(1, 2, 2, 65, 129, D, D),
                f"head dim {D} over a partial tile: vector widths, odd dims",
                default=D in (128, 59),
            )
        )
    rows.append(
        e(
            "k-d-ne-e",
            Shapes(1, 2, 2, 65, 129, 192, 128),
            "D = 192, E = 128 (scale 1/sqrt(D), not E)",
        )
    )
    for K in (8, 2, 1):
        rows.append(
            e(
                "k-gqa",
                Shapes(1, 8, K, 65, 200, 64, 64),
                f"GQA group size {8 // K} (H = 8, K = {K})",
                {"gqa": "interleave"},
                default=K == 2,
            )
        )
    rows.append(
        e(
            "k-ragged",
            Shapes(4, 2, 2, 65, 300, 64, 64),
            "a batch whose rows have different key lengths (padding mask): per-row "
            "tails inside tiles",
            recipe={**gauss, "mask": "padding"},
        )
    )
    rows.append(
        e(
            "k-ragged",
            Shapes(3, 2, 2, 65, 130, 64, 64),
            "three rows of different key lengths (padding mask) over three key tiles",
            recipe={**gauss, "mask": "padding"},
            default=True,
        )
    )
    distributions = [
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
    for tag, recipe, description in distributions:
        rows.append(e(tag, Shapes(1, 2, 2, 65, 1000, 64, 64), description, recipe=recipe))
    # a float16/bfloat16 accumulator for inputs of that type is caught (tight tier) where the
    # terms are all positive: a common value offset, a dominant sink key, small logits
    half_rows = [
        (
            "k-offset",
            Shapes(1, 2, 2, 65, 129, 64, 64),
            {"qkv": "offset", "offset": 64.0},
            "values 64 + N(0,1) over a partial key tile: a 16-bit P@V accumulator drifts",
        ),
        (
            "k-offset",
            Shapes(1, 2, 2, 65, 129, 128, 128),
            {"qkv": "offset", "offset": 64.0},
            "values 64 + N(0,1), D = E = 128: a 16-bit P@V accumulator drifts",
        ),
        (
            "k-sink",
            Shapes(1, 2, 2, 65, 129, 64, 64),
            {"qkv": "sink"},
            "a sink key over a partial key tile: a 16-bit normaliser and P@V accumulator",
        ),
        (
            "k-small-logits",
            Shapes(1, 2, 2, 65, 129, 64, 64),
            {"qkv": "gaussian", "sigma": 0.25},
            "small logits (sigma 1/4) over a partial key tile: nearly equal positive weights",
        ),
        (
            "k-small-logits",
            Shapes(1, 2, 2, 65, 300, 64, 64),
            {"qkv": "gaussian", "sigma": 0.25},
            "small logits (sigma 1/4) over 300 keys: nearly equal positive weights",
        ),
    ]
    for tag, shapes, recipe, description in half_rows:
        rows.append(e(tag, shapes, description, recipe=recipe, default="half"))
    for tag, recipe, description in distributions:
        # the same inputs over 300 keys (five key tiles, the last partial; two split-KV
        # chunks) and a partial query tile: default's share of each distribution
        rows.append(
            e(
                tag,
                Shapes(1, 2, 2, 65, 300, 64, 64),
                description + " (S = 300)",
                recipe=recipe,
                default=True,
            )
        )
    return rows
