"""Tile diagnoses of issue 25 (and the storage type a quantity is graded in): the
last key of a partial key tile, and failures that track
``S mod T`` across a run.

A tiled kernel handles full tiles of ``T`` keys (64 or 128) on one code path and the last,
partial tile (``S mod T`` keys) on another (a masked or remainder loop). Two of its bugs are
named here:

* :func:`tile_alternatives`: the remainder loop stops one key short, so key ``S - 1`` is never
  read when ``S mod T != 0`` (a named alternative of
  :func:`oracle.diagnose.diagnosis.kernel_alternatives`);
* :func:`tile_tracking`: over a whole run, the failing cases are exactly those whose ``S`` is not
  a multiple of ``T`` (a note of the report, whatever each case's own diagnosis says).

Examples
--------
>>> [a.label.split(",")[0] for a in tile_alternatives(5, 97)]
['the last key of the partial key tile of 64 is skipped (key 96']
>>> from oracle.judging.results import CaseResult
>>> results = [CaseResult(f"t-L4S{s}-f32", "conformance", "float32", v)
...            for s, v in ((64, "pass"), (128, "pass"), (97, "fail"), (65, "fail"))]
>>> tile_tracking(results)[0].split(":")[0]
'failures track S mod 64'
"""

from __future__ import annotations

import re

import numpy as np

from oracle.diagnose.alternative import Alternative
from oracle.diagnose.models import cast_to

__all__ = [
    "tile_alternatives",
    "tile_tracking",
    "case_lengths",
    "storage_dtype",
    "no_rescale_weights",
    "split_combine_weights",
    "key_concentration",
]

#: Tile sizes (keys) tried; the same as :data:`oracle.diagnose.diagnosis.TILE_SIZES`.
TILES = (64, 128)


def _drop(rule):
    def apply(options, extras):
        return options, {**extras, "drop_keys": rule}

    return apply


def tile_alternatives(L, S, *, tiles=TILES) -> list:
    """Alternatives naming the last key of a partial key tile skipped (key ``S - 1`` when
    ``S mod T != 0``); one label (the key is the same for every tile size). Where the partial
    tile is that one key, "partial key tile skipped" fits too."""
    found = []
    for size in tiles:
        if S > size and S % size:
            found.append(
                Alternative(
                    f"the last key of the partial key tile of {size} is skipped (key {S - 1}, "
                    f"S mod {size} = {S % size}: a remainder loop stopping one key short)",
                    frozenset({"kernel"}),
                    _drop(lambda j, S=S: j == S - 1),
                )
            )
            break  # the same key for every tile size: one label
    return found


def case_lengths(name: str):
    """(L, S) read from a catalogue case name (``...-L65S129-...``), or None."""
    match = re.search(r"L(\d+)S(\d+)", name)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def tile_tracking(results, *, tiles=TILES) -> list[str]:
    """A note when the failing conformance cases are exactly those whose key length ``S`` is
    not a multiple of a tile size ``T`` (at least two failures, and at least one passing case
    with ``S`` a multiple of ``T`` above ``T``: the full-tile path is shown to work)."""
    judged = [
        (r, case_lengths(r.name))
        for r in results
        if r.category == "conformance" and r.verdict in ("pass", "fail")
    ]
    judged = [(r, lengths[1]) for r, lengths in judged if lengths is not None]
    failing = [s for r, s in judged if r.verdict == "fail"]
    if len(failing) < 2:
        return []
    for size in tiles:
        ragged = np.array([s % size != 0 and s > size for _, s in judged])
        failed = np.array([r.verdict == "fail" for r, _ in judged])
        full = [s for r, s in judged if s % size == 0 and s >= size]
        if failed.sum() and np.array_equal(ragged, failed) and full:
            return [
                f"failures track S mod {size}: all {int(failed.sum())} failing cases have S "
                f"not a multiple of {size} (S > {size}), and the {len(full)} judged cases "
                f"with S a multiple of {size} pass: the partial key tile (S mod {size} keys) "
                f"is mishandled"
            ]
    return []


def storage_dtype(values, dtype) -> str:
    """The narrowest of ``dtype``, float32 and float64 that holds every finite value of
    ``values`` (float64) exactly: the type an implementation stored a quantity in (a float32
    lse returned for bfloat16 inputs is graded in float32, not bfloat16).

    >>> storage_dtype(np.array([1.0, 1.5]), "bfloat16")
    'bfloat16'
    >>> storage_dtype(np.array([1 + 2**-20]), "bfloat16")
    'float32'
    """
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    for name in dict.fromkeys((str(dtype), "float32")):
        if name == "float64":
            break
        with np.errstate(all="ignore"):
            if np.array_equal(cast_to(finite, name), finite):
                return name
    return "float64"


# the kernel models of oracle.diagnose.diagnosis.kernel_alternatives: weights (..., S) of a
# tiled kernel with the bug, from the pinned weights


def _blocks(x, size, fill):
    """``x`` (..., S) padded with ``fill`` to whole blocks of ``size`` keys, as
    (..., blocks, size): the per-block reductions below are then one vectorised pass (O(S))."""
    S = x.shape[-1]
    count = -(-S // size)
    padded = np.full(x.shape[:-1] + (count * size,), fill, dtype=x.dtype)
    padded[..., :S] = x
    return padded.reshape(x.shape[:-1] + (count, size))


def no_rescale_weights(size):
    """Weights of an online softmax whose output accumulator is not rescaled when the
    running max moves: key j is weighted ``p_j exp(M - M_t(j))``, ``M_t`` the running max
    of the log-weights after j's tile, ``M`` the row's (the normaliser is right; Milakov &
    Gimelshein 2018, the rescale of Dao et al. 2022 Algorithm 1 line 12 left out).

    >>> no_rescale_weights(2)(np.array([0.1, 0.2, 0.4, 0.3])).round(6).tolist()
    [0.2, 0.4, 0.4, 0.3]
    """

    def rule(w):
        with np.errstate(divide="ignore"):
            logw = np.log(w)
        running = np.maximum.accumulate(_blocks(logw, size, -np.inf).max(axis=-1), axis=-1)
        with np.errstate(invalid="ignore", over="ignore"):
            factor = np.repeat(np.exp(-running), size, axis=-1)[..., : w.shape[-1]]
        return w * np.where(np.isfinite(factor), factor, 0) * w.max(axis=-1, keepdims=True)

    return rule


def split_combine_weights(size):
    """Split-KV partial outputs combined by their normalisers ``l_s`` taken relative to each
    split's own max (the ``exp(m_s - m)`` correction missing): each split's weights divided
    by the split's largest, then normalised over the row.

    >>> (split_combine_weights(2)(np.array([0.1, 0.2, 0.4, 0.3])) * 6.5).round(6).tolist()
    [1.0, 2.0, 2.0, 1.5]
    """

    def rule(w):
        blocks = _blocks(w, size, 0.0)  # weights are >= 0: padding never is a block's max
        top = blocks.max(axis=-1, keepdims=True)
        out = np.divide(blocks, top, out=np.zeros_like(blocks), where=top > 0)
        out = np.ascontiguousarray(out.reshape(w.shape[:-1] + (-1,))[..., : w.shape[-1]])
        total = out.sum(axis=-1, keepdims=True)
        return np.divide(out, total, out=np.zeros_like(out), where=total > 0)

    return rule


def key_concentration(quantity, errors, limit, *, tiles=TILES) -> list[str]:
    """Where the failing keys of a per-key gradient (dk or dv, (..., K, S, D)) concentrate:
    all on the last key of full tiles of ``T`` keys (``j mod T = T - 1``: a tile loop that
    stops one key short), or all in the last, partial key tile (``j >= T floor(S / T)``: a
    dropped partial tile). Named only when the failing keys follow the pattern and other
    keys pass. Returns notes (possibly none).

    >>> errors = np.zeros((1, 2, 200, 4)); errors[..., [63, 127], :] = 1.0
    >>> note, = key_concentration("dk", errors, 0.5)
    >>> note.split(": a ")[0]
    'dk: the failing keys are all the last key of a full tile of 64 (j mod 64 = 63)'
    >>> errors = np.zeros((1, 2, 200, 4)); errors[..., 195, :] = 1.0
    >>> key_concentration("dv", errors, 0.5)[0].split(": a ")[0]
    'dv: the failing keys are all in the last, partial key tile of 64 (keys 192..199)'
    >>> key_concentration("dv", np.ones((1, 2, 200, 4)), 0.5)
    []
    """
    bad = np.asarray(errors > limit)
    if bad.ndim < 2 or not bad.any():
        return []
    keys = bad.any(axis=-1)
    S = keys.shape[-1]
    index = np.broadcast_to(np.arange(S), keys.shape)
    failing, passing = index[keys], index[~keys]
    for size in tiles:
        if S > size and (failing % size == size - 1).all() and failing.max() < size * (S // size):
            return [
                f"{quantity}: the failing keys are all the last key of a full tile of "
                f"{size} (j mod {size} = {size - 1}): a tile loop stopping one key short?"
            ]
    for size in tiles:
        start = size * (S // size)
        if S > size and start < S and (failing >= start).all() and (passing < start).any():
            return [
                f"{quantity}: the failing keys are all in the last, partial key tile of "
                f"{size} (keys {start}..{S - 1}): a dropped or mishandled partial tile?"
            ]
    return []
