"""Refusal cases: inputs a correct attention kernel must refuse with an error.

Bug class: a kernel that never checks its inputs' shapes reads past the end of a buffer,
silently broadcasts, or truncates to the shorter of two sizes, and returns numbers for a call
that has no meaning -- a wrong model wiring (k and v from different caches, a GQA head count
that does not divide, a mask built for another sequence length, kv_lengths past the cache)
then runs on instead of stopping. Every case here holds one such malformation in tiny shapes;
:func:`refattn.attention` refuses each with a ValueError (or TypeError) naming the argument,
its shape and what was expected.

==============================  =============================================================
``refuse-head-dim``             D_q != D_k (k's head dim is half of q's)
``refuse-gqa-heads``            H = 3 query heads over K = 2 kv heads (not a multiple)
``refuse-kv-keys``              k and v with different key counts (S_v = S_k - 1)
``refuse-kv-heads``             k and v with different kv head counts (K_v = 1, K_k = 2)
``refuse-mask-shape``           a bool mask (L, S - 1): does not broadcast to (B, H, L, S)
``refuse-bias-shape``           a bias (H + 1, L, S): does not broadcast to (B, H, L, S)
``refuse-kv-lengths-long``      kv_lengths (B,) with a length past S
``refuse-kv-lengths-negative``  kv_lengths (B,) with a negative length
``refuse-batch``                batch sizes of q (2) and k, v (3) that do not broadcast
``refuse-window-fraction``      window = (2.5, 0): a window side is a whole number of keys
==============================  =============================================================

One case per dtype, in ``default`` and ``full`` (float32 in ``smoke``). Their category is
``"refusal"``: a fixture stores the malformed inputs and no truth; its manifest entry's
``truth_kind`` is ``"refusal"`` and its contract says ``"expect": "refuse"``. The judge
(:mod:`oracle.judging.must_refuse`) passes an implementation that raises and fails one that returns
an
array. torch 2.13's ``scaled_dot_product_attention`` itself returns numbers for k and v of
different key or head counts, so a refusal failure, like a robustness one, fails a validation
only under ``--strict``.
"""

from __future__ import annotations

import numpy as np

from oracle.catalogue import attention_inputs, seeding
from oracle.catalogue.attention_entry import ALL, SMALL, Entry
from oracle.catalogue.case import Case, Shapes

__all__ = ["CATEGORY", "refusal_entries", "malformation"]

#: The category of these cases (catalogue.names.CATEGORIES).
CATEGORY = "refusal"

_BATCH2 = Shapes(batch=2, H=2, K=2, L=5, S=7, D=8, E=8)


def _gauss(stream, shape, dtype, name):
    return seeding.to_dtype(stream.gaussian(name, shape), dtype)


def _inputs(stream, case: Case) -> dict[str, np.ndarray]:
    """The malformed inputs of ``case`` (recipe ``refuse``: which malformation)."""
    n, dtype, kind = case.shapes, case.dtype, case.recipe["refuse"]
    d_k = n.D // 2 if kind == "head-dim" else n.D
    s_v = n.S - 1 if kind == "kv-keys" else n.S
    k_v = 1 if kind == "kv-heads" else n.K
    b_kv = n.batch + 1 if kind == "batch" else n.batch
    inputs = {
        "q": _gauss(stream, (n.batch, n.H, n.L, n.D), dtype, "q"),
        "k": _gauss(stream, (b_kv, n.K, n.S, d_k), dtype, "k"),
        "v": _gauss(stream, (b_kv, k_v, s_v, n.E), dtype, "v"),
    }
    if kind == "mask-shape":
        inputs["mask"] = np.ones((n.L, n.S - 1), dtype=bool)
    if kind == "bias-shape":
        inputs["bias"] = _gauss(stream, (n.H + 1, n.L, n.S), dtype, "bias")
    if kind == "kv-lengths-long":
        inputs["kv_lengths"] = np.array([n.S, n.S + 2], dtype=np.int32)
    if kind == "kv-lengths-negative":
        inputs["kv_lengths"] = np.array([-1, n.S], dtype=np.int32)
    return inputs


attention_inputs.RECIPE_INPUTS["refuse"] = _inputs


def malformation(case: Case, inputs) -> str:
    """What is wrong with the inputs of refusal case ``case``, in one line."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    kind = case.recipe["refuse"]
    if kind == "head-dim":
        return f"D_q={q.shape[-1]} != D_k={k.shape[-1]}"
    if kind == "gqa-heads":
        return f"H={q.shape[-3]} query heads is not a multiple of K={k.shape[-3]} kv heads"
    if kind == "kv-keys":
        return f"k has S={k.shape[-2]} keys, v has {v.shape[-2]}"
    if kind == "kv-heads":
        return f"k has K={k.shape[-3]} kv heads, v has {v.shape[-3]}"
    if kind in ("mask-shape", "bias-shape"):
        name = kind.split("-")[0]
        plane = (q.shape[0], q.shape[-3], q.shape[-2], k.shape[-2])
        return f"{name} of shape {inputs[name].shape} does not broadcast to (B, H, L, S) {plane}"
    if kind.startswith("kv-lengths"):
        return f"kv_lengths {inputs['kv_lengths'].tolist()} outside [0, S={k.shape[-2]}]"
    if kind == "batch":
        return f"batch sizes of q ({q.shape[0]}) and k, v ({k.shape[0]}) do not broadcast"
    return f"window={tuple(case.options['window'])}: a window side must be a whole number"


def refusal_entries() -> list[Entry]:
    """The refusal rows (every dtype in default and full, float32 in smoke)."""

    def e(kind, description, shapes=SMALL, options=None):
        return Entry(
            f"refuse-{kind}",
            shapes,
            f"must refuse: {description}",
            smoke=("float32",),
            default=ALL,
            full=ALL,
            options=dict(options or {}),
            recipe={"qkv": "refuse", "refuse": kind},
            category=CATEGORY,
        )

    return [
        e("head-dim", "head dims of q and k differ (D_q != D_k)"),
        e(
            "gqa-heads",
            "H = 3 query heads over K = 2 kv heads",
            Shapes(batch=1, H=3, K=2, L=5, S=7, D=8, E=8),
        ),
        e("kv-keys", "k and v with different key counts"),
        e("kv-heads", "k and v with different kv head counts"),
        e("mask-shape", "a mask (L, S - 1) that does not broadcast to (B, H, L, S)"),
        e("bias-shape", "a bias (H + 1, L, S) that does not broadcast to (B, H, L, S)"),
        e("kv-lengths-long", "kv_lengths with a length past S", _BATCH2),
        e("kv-lengths-negative", "kv_lengths with a negative length", _BATCH2),
        e("batch", "batch sizes of q and k, v that do not broadcast", _BATCH2),
        e("window-fraction", "window = (2.5, 0), a fractional side", options={"window": (2.5, 0)}),
    ]
