"""Tile-shaped attention cases: what a kernel restricted to whole tiles can run.

Many kernels (Triton's fused-attention tutorial, hand-written CUDA/Metal kernels, early
FlashAttention ports) take only ``L == S``, lengths that are a multiple of 64, no mask, no
bias, causal top-left or none and ``D == E``. Almost every other case of ``default`` has a
partial tile, a mask or ``L != S`` somewhere, so such a kernel would be judged on one case.
The ``tile-*`` cases are exactly what it can run (``refattn-oracle validate --case 'tile-*'``;
docs/tile-kernels.md), 21 in every dtype of default and full:

=========================  ====================================================================
``tile``, ``tile-causal``  ``D = E = 64``: ``L = S`` in {64, 128, 192, 256} (192: three tiles,
                           not a power of two) with and without causal, 512 without, 1024
                           causal (top-left = bottom-right when ``L = S``); H = K = 2 at 64,
                           one head from 128 on
``tile``  (D = 128)        ``L = S`` in {64, 128}, ``D = E = 128``, both causal settings
``tile-gqa[-causal]``      ``H = 2, K = 1`` (GQA, refattn's ``gqa="interleave"`` default),
                           ``L = S = 128`` both causal settings, 256 without
``tile-outlier``           outlier channels (3 dims of q and k 32x larger), 256 x 256
``tile-peaky-late-causal`` a row max that moves in every key tile (online rescale), causal
``tile-sink``              a sink key taking most of every row's weight, 128 x 128
``tile-uniform``           near-uniform rows (tiny logits): long sums of nearly equal terms
=========================  ====================================================================

No option beyond ``causal`` (and its ``align``, which does not matter when ``L = S``) is set,
so an implementation without ``mask``/``bias``/``gqa``/``empty_rows`` keywords receives none
of them (options equal to refattn's defaults are not passed). Every tile case is a compact
fixture (:mod:`oracle.fixtures.compact`: no stored inputs): load them with ``oracle.load``.
"""

from __future__ import annotations

from oracle.catalogue.attention_entry import ALL, Entry
from oracle.catalogue.case import Shapes

__all__ = ["TILE_SIZES", "tile_entries"]

#: The square lengths of the tile cases (whole 64-tiles).
TILE_SIZES = (64, 128, 192, 256, 512, 1024)

_GAUSS = {"qkv": "gaussian", "sigma": 1.0}
_CAUSAL = {"causal": True, "align": "top_left"}


def _entry(tag, shapes, description, causal, recipe=None) -> Entry:
    recipe = dict(recipe or _GAUSS)
    if shapes.L >= _COMPACT_FROM:  # inputs regenerated on load (oracle.fixtures.compact)
        recipe["compact"] = True
    return Entry(
        f"{tag}-causal" if causal else tag,
        shapes,
        description + (", causal" if causal else ""),
        default=ALL,
        full=ALL,
        options=dict(_CAUSAL if causal else {}),
        recipe=recipe,
    )


#: From this length on a tile case's fixture stores no inputs (they are regenerated from the
#: seed on load: every tile case), and from :data:`_ONE_KV_HEAD_FROM` on it has one kv head
#: (two query heads with GQA). The exact truth costs ``H L S D`` and its storage ``H L D``
#: (twice: in the case dtype and in float64): the 84 tile fixtures take 18.9 MB and 7.4 s of
#: CPU to generate (the 88 of the previous selection, with 2 x 1024, 2 x 512, 2 x GQA 512 and
#: stored inputs below 256, took 33.4 MB and 9.5 s; measured on one worker).
_COMPACT_FROM = 64
_ONE_KV_HEAD_FROM = 128

#: (L = S, D = E, causal settings) of the plain and GQA rows: every length in both causal
#: settings up to 256, then one setting each (the two largest hold most of the cost).
_PLAIN = (
    *((n, 64, (False, True)) for n in (64, 128, 192, 256)),
    (512, 64, (False,)),
    (1024, 64, (True,)),
    *((n, 128, (False, True)) for n in (64, 128)),
)
_GQA = ((128, (False, True)), (256, (False,)))


def _square(n, D, H=2, K=2) -> Shapes:
    if n >= _ONE_KV_HEAD_FROM:
        H, K = H // K, 1
    return Shapes(batch=1, H=H, K=K, L=n, S=n, D=D, E=D)


def tile_entries() -> list[Entry]:
    """The tile-shaped rows (every dtype, default and full; see the module docstring)."""
    rows = []
    for n, D, settings in _PLAIN:
        for causal in settings:
            rows.append(_entry("tile", _square(n, D), f"L = S = {n}, D = E = {D}", causal))
    for n, settings in _GQA:
        shapes = _square(n, 64, H=4)
        for causal in settings:
            description = f"GQA H = {shapes.H}, K = {shapes.K}, L = S = {n}"
            rows.append(_entry("tile-gqa", shapes, description, causal))
    adversarial = [
        (
            "tile-outlier",
            256,
            False,
            {"qkv": "outlier", "factor": 32.0, "channels": 3},
            "outlier channels: 3 dims of q and k 32x larger",
        ),
        (
            "tile-peaky-late",
            256,
            True,
            {"qkv": "late-max"},
            "peaky rows whose max moves in every key tile",
        ),
        ("tile-sink", 128, False, {"qkv": "sink"}, "a sink key taking most of every row's weight"),
        (
            "tile-uniform",
            256,
            False,
            {"qkv": "gaussian", "sigma": 0.0625},
            "near-uniform rows (tiny logits)",
        ),
    ]
    for tag, n, causal, recipe, description in adversarial:
        rows.append(_entry(tag, _square(n, 64), f"{description}, L = S = {n}", causal, recipe))
    return rows
