"""The tiled kernels (correct and planted broken ones) live in :mod:`oracle.power.planted`, where
``refattn-oracle power`` runs them; this module keeps the tests' import path."""

from oracle.power.planted import BUGS, TILED_BROKEN, flash, split_kv, tiled, tiled_attention

__all__ = ["tiled_attention", "tiled", "flash", "split_kv", "TILED_BROKEN", "BUGS"]
