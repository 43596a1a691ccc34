"""The attention case families of sigmoid attention (``normalizer="sigmoid"``).

Ramapuram et al. 2024 ("Theory, Analysis, and Best Practices for Sigmoid Self-Attention"):
``out_i = sum_j sigmoid(t~_ij) v_j`` with no normaliser and, as they recommend, a bias
``b = -log(S)`` (recipe ``bias="minus-log-s"``: a (1, 1, 1, 1) bias array); cases with and
without it, with masks, windows, softcap, ALiBi, GQA, dropout, empty rows, long key sequences
(S up to 4096, a few query rows) and gradients, in every dtype. An implementation under test
receives ``normalizer="sigmoid"`` as a keyword; one that does not accept it is "unsupported".
"""

from __future__ import annotations

from oracle.catalogue.attention_entry import GRAD, MID, Entry
from oracle.catalogue.case import Shapes

__all__ = ["sigmoid_entries"]

_SIG = {"normalizer": "sigmoid"}


def _rows(gauss) -> list[tuple]:
    log_s = {**gauss, "bias": "minus-log-s"}
    br = {"causal": True, "align": "bottom_right"}
    return [
        ("sigmoid", MID, "sigmoid weights, no bias (sum of sigmoids ~ S/2)", {}, gauss),
        ("sigmoid-log-s", MID, "sigmoid with the paper's bias b = -log(S)", {}, log_s),
        (
            "sigmoid-causal-br",
            Shapes(batch=1, H=2, K=2, L=12, S=32, D=16, E=16),
            "causal bottom_right, b = -log S",
            br,
            log_s,
        ),
        (
            "sigmoid-mask-empty-rows",
            Shapes(batch=1, H=2, K=2, L=6, S=9, D=16, E=16),
            "random mask with fully masked rows (out 0)",
            {"empty_rows": "zero"},
            {**gauss, "mask": "empty-rows"},
        ),
        (
            "sigmoid-window",
            Shapes(batch=1, H=2, K=2, L=10, S=24, D=16, E=16),
            "window (4, 1), b = -log S",
            {"window": (4, 1)},
            log_s,
        ),
        (
            "sigmoid-softcap-alibi",
            MID,
            "softcap 5 then ALiBi, scores ~8",
            {"softcap": 5.0},
            {**gauss, "sigma": 2.0, "alibi": True},
        ),
        (
            "sigmoid-gqa",
            Shapes(batch=1, H=8, K=2, L=6, S=20, D=16, E=16),
            "GQA interleave, b = -log S",
            {"gqa": "interleave"},
            log_s,
        ),
        (
            "sigmoid-dropout",
            MID,
            "dropout p = 0.25, b = -log S",
            {"dropout_p": 0.25},
            {**log_s, "dropout": True},
        ),
        (
            "sigmoid-bias-plane",
            MID,
            "a Gaussian bias plane with -inf entries",
            {},
            {**gauss, "bias": "neginf"},
        ),
        (
            "sigmoid-s1024",
            Shapes(batch=1, H=2, K=2, L=4, S=1024, D=64, E=64),
            "S = 1024, 4 query rows, b = -log S",
            br,
            log_s,
        ),
        (
            "sigmoid-s4096",
            Shapes(batch=1, H=1, K=1, L=2, S=4096, D=64, E=64),
            "S = 4096, 2 query rows, b = -log S",
            br,
            log_s,
        ),
        (
            "sigmoid-s4096-nobias",
            Shapes(batch=1, H=1, K=1, L=2, S=4096, D=64, E=64),
            "S = 4096, 2 query rows, no bias",
            br,
            gauss,
        ),
    ]


def sigmoid_entries(gauss) -> list[Entry]:
    """Forward and gradient cases of ``normalizer="sigmoid"`` (every dtype, in default)."""
    rows = [
        Entry(tag, shapes, description, options={**_SIG, **options}, recipe=recipe)
        for tag, shapes, description, options, recipe in _rows(gauss)
    ]
    grads = [
        ("sigmoid-grad", "gradients, no bias", {}, gauss),
        (
            "sigmoid-grad-log-s",
            "gradients with b = -log S (dbias its sum)",
            {"causal": True},
            {**gauss, "bias": "minus-log-s"},
        ),
        (
            "sigmoid-grad-bias",
            "gradients with a Gaussian bias plane, softcap 5",
            {"softcap": 5.0},
            {**gauss, "bias": "gaussian"},
        ),
    ]
    rows += [
        Entry(tag, GRAD, description, options={**_SIG, **options}, recipe=recipe, grads=True)
        for tag, description, options, recipe in grads
    ]
    return rows
