"""The named alternatives of sigmoid attention (``normalizer="sigmoid"``) for the diagnosis.

Two ways an implementation of sigmoid attention (Ramapuram et al. 2024) goes wrong while
still returning plausible numbers: the bias ``b = -log(S)`` left out (every weight then about S
times too large for negative scores), and a softmax computed where the sigmoid was asked (a
kernel that ignores the switch). :func:`oracle.diagnose.diagnosis.alternatives` takes them from
here.

Examples
--------
>>> for label, _, _ in sigmoid_alternatives({"normalizer": "sigmoid", "bias": 0.0}):
...     print(label)
sigmoid without its bias (b = -log S dropped)
softmax computed where normalizer='sigmoid' was asked
"""

from __future__ import annotations

__all__ = ["sigmoid_alternatives"]


def sigmoid_alternatives(options) -> list[tuple[str, frozenset, dict]]:
    """``(label, keys, option changes)`` of each sigmoid alternative that applies."""
    if options.get("normalizer") != "sigmoid":
        return []
    found = []
    if options.get("bias") is not None:
        found.append(
            ("sigmoid without its bias (b = -log S dropped)", frozenset({"bias"}), {"bias": None})
        )
    found.append(
        (
            "softmax computed where normalizer='sigmoid' was asked",
            frozenset({"normalizer"}),
            {"normalizer": "softmax"},
        )
    )
    return found
