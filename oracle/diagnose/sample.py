"""A sample of a failing case's query rows, on which the diagnosis readings are evaluated first.

A reading costs about rows x S x (D + E) multiply-adds (:mod:`oracle.diagnose.diagnosis`); on a
case with thousands of query rows most of them repeat what a few show. :func:`choose_rows`
picks at most :data:`SAMPLE_ROWS` query indices that cover the failing pattern: the worst
failing rows, rows spread evenly over the failing ones (first to last), and a few passing rows
(a reading that explains the failure must leave them right); every batch row and head of
each chosen index is kept, so every failing head is in the sample. :class:`RowView` restricts
a reading to those rows: q's rows are selected, and every option that depends on the row
index (causal, window and their alignment, ALiBi's distances) is first made explicit for the
whole case (the allowed set as a mask, ALiBi as an additive bias, refattn.spec's rule through
:func:`oracle.reading.allowed.allowed_positions`) and then sliced, so a row of the sample gets
exactly the scores it gets in the whole case.

A reading "explains" the sample when every sampled element fits (the rule of
:func:`oracle.diagnose.diagnosis.diagnose`, restricted to the sample).

Examples
--------
>>> import numpy as np
>>> errors = np.zeros((1, 2, 200)); errors[0, 1, 150:] = 1.0
>>> rows = choose_rows(errors > 0.5, errors)
>>> int(rows.size) <= SAMPLE_ROWS, bool((rows >= 150).sum() >= 16), int(rows.min()) < 150
(True, True, True)
"""

from __future__ import annotations

import numpy as np

from oracle.reading.allowed import allowed_positions
from oracle.reading.heads import alibi_bias

__all__ = ["SAMPLE_ROWS", "choose_rows", "RowView", "can_sample"]

#: Most query indices in a sample (every batch row and head of each is kept).
SAMPLE_ROWS = 64
#: Of which: the worst failing rows, failing rows spread over their range, passing rows.
_WORST, _SPREAD, _PASSING = 16, 32, 16
#: Options a row view can restrict (the others make a case evaluated whole).
_ROW_OPTIONS = frozenset(
    {
        "scale",
        "causal",
        "window",
        "align",
        "mask",
        "bias",
        "alibi_slopes",
        "softcap",
        "dropout_p",
        "dropout_mask",
        "gqa",
        "sinks",
        "empty_rows",
        "normalizer",
    }
)


def can_sample(q, k, v, options) -> bool:
    """Whether the readings of this case can be restricted to query rows (plain float inputs
    and only the options of :data:`_ROW_OPTIONS`)."""
    plain = all(np.asarray(x).dtype.kind == "f" for x in (q, k, v))
    return plain and all(x is None or n in _ROW_OPTIONS for n, x in options.items())


def _spread(indices, count):
    if indices.size <= count:
        return indices
    return indices[np.unique(np.linspace(0, indices.size - 1, count).round().astype(int))]


def choose_rows(failing, errors) -> np.ndarray:
    """Sorted query indices (at most :data:`SAMPLE_ROWS`) covering the failing rows.

    ``failing`` (..., L) marks the failing (batch, head, query) rows, ``errors`` (..., L)
    their largest normalised error; both reduce over the leading axes to query indices."""
    failing = np.asarray(failing).reshape(-1, np.shape(failing)[-1]).any(axis=0)
    worst = np.nan_to_num(np.asarray(errors, np.float64), nan=np.inf)
    worst = worst.reshape(-1, worst.shape[-1]).max(axis=0)
    bad, good = np.flatnonzero(failing), np.flatnonzero(~failing)
    chosen = np.concatenate(
        [
            bad[np.argsort(-worst[bad], kind="stable")[:_WORST]],
            _spread(bad, _SPREAD),
            _spread(good, _PASSING),
        ]
    )
    return np.unique(chosen)[:SAMPLE_ROWS]


def _rows_of(x, rows, L):
    """``x`` restricted to ``rows`` on its query axis (-2) when it has one of length L."""
    if x is None or np.ndim(x) < 2 or np.shape(x)[-2] != L:
        return x
    return np.asarray(x)[..., rows, :]


class RowView:
    """A case's readings restricted to the query ``rows`` of an L x S case."""

    def __init__(self, rows, L, S):
        self.rows, self.L, self.S = np.asarray(rows), L, S
        self._views = {}  # id(options) -> (options, their view): one view dict per options dict

    def q(self, q):
        return np.asarray(q)[..., self.rows, :]

    def output(self, x):
        """An output-shaped array (…, L, E), or a per-row limit, on the sample."""
        return _rows_of(x, self.rows, self.L)

    def reading(self, options, extras):
        """(options, extras) of the same reading on the sampled rows."""
        if "zero_rows" in extras:  # rows from index `first` on: from its place in the sample
            first = int(np.searchsorted(self.rows, extras["zero_rows"]))
            extras = {**extras, "zero_rows": first}
        kept = self._views.get(id(options))
        if kept is None:  # the options are kept with their view: their identity stays unique
            kept = self._views[id(options)] = (options, self._options(options))
        return kept[1], extras

    def _options(self, options):
        L, S = self.L, self.S
        allowed = allowed_positions(
            L,
            S,
            mask=options.get("mask"),
            causal=bool(options.get("causal")),
            window=options.get("window"),
            align=options.get("align") or "top_left",
        )
        bias = options.get("bias")
        if options.get("alibi_slopes") is not None:
            alibi = alibi_bias(options["alibi_slopes"], L, S, options.get("align") or "top_left")
            bias = alibi if bias is None else np.asarray(bias, np.float64) + alibi
        return {
            **options,
            "mask": _rows_of(allowed, self.rows, L),
            "causal": False,
            "window": None,
            "align": None,
            "alibi_slopes": None,
            "bias": _rows_of(bias, self.rows, L),
            "dropout_mask": _rows_of(options.get("dropout_mask"), self.rows, L),
        }
