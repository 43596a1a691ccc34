"""The float64 inputs of the variant cases, before their one rounding to the case dtype.

See the "Inputs" section of :mod:`oracle.catalogue.variants`: seeded streams, dyadic
distributions that sum to exactly 1, couplings scaled by a power of two into a contraction.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from oracle.catalogue.case import Case
from oracle.catalogue.seeding import Streams

__all__ = ["float64_inputs"]


def _distribution(stream, name, shape) -> np.ndarray:
    """Dyadic distributions over the last axis that sum to exactly 1 in every dtype.

    Integer weights c in [1, 4] for all but the last entry, the last ``2**m - sum`` (>= 1,
    < 2**(m-1) + 1: at most 7 significant bits, exact in bfloat16), divided by ``2**m``. A
    rounded float distribution would not sum to 1 within the few roundings the variants
    accept once upcast to the float64 of the baseline.
    """
    counts = 1 + (stream.uniform(name, shape) * 4).astype(np.int64)
    head = counts[..., :-1].sum(axis=-1)  # integer sums: exact, order-independent
    m = int(head.max()).bit_length() + 1 if shape[-1] > 1 else 0
    counts[..., -1] = (1 << m) - head
    return np.ldexp(counts.astype(np.float64), -m)


def _couplings(stream, shape, keep_diagonal):
    """Couplings with max row sum of |J| in (1/4, 1/2]: a power-of-two scale (exact)."""
    N, d = shape[0], shape[2] if len(shape) == 4 else 1
    J = stream.gaussian("J", shape)
    if not keep_diagonal:
        J[np.arange(N), np.arange(N)] = 0.0
    big = np.swapaxes(J, 1, 2).reshape(N * d, N * d) if len(shape) == 4 else J
    row = max(math.fsum(np.abs(r)) for r in big)
    return np.ldexp(J, -(math.frexp(row)[1] + 1))


def float64_inputs(case: Case) -> dict[str, np.ndarray]:
    n, recipe, fn = case.shapes, case.recipe, case.function
    st = Streams(case.seed)
    b, H, L, S, D, E = n.batch, n.H, n.L, n.S, n.D, n.E
    R = int(recipe.get("R", 1))
    out: dict[str, np.ndarray] = {}
    if fn == "gmm.attention":
        out["q"] = st.gaussian("q", (b, H, L, D))
        out["keys"] = st.gaussian("keys", (b, H, S, D))
        out["values"] = st.gaussian("values", (b, H, S, E))
        if recipe.get("alpha"):
            out["alpha"] = 0.125 + 0.375 * st.uniform("alpha", (b, H, S))
        if recipe.get("beta"):
            out["beta"] = 0.25 + 0.75 * st.uniform("beta", (b, H, S))
        if recipe.get("prior"):
            out["prior"] = st.gaussian("prior", (b, H, S))
        if recipe.get("v_init"):
            out["v_init"] = st.gaussian("v_init", (b, H, L, E))
    elif fn == "gmm.adapt_keys":
        out["queries"] = st.gaussian("queries", (b, H, L, D))
        out["keys0"] = st.gaussian("keys0", (b, H, S, D))
    elif fn == "gmm.adapt_priors":
        out["queries"] = st.gaussian("queries", (b, H, L, D))
        out["keys"] = st.gaussian("keys", (b, H, S, D))
        out["pi0"] = _distribution(st, "pi0", (b, H, S))
    elif fn in ("mgk.attention", "mgk.linear_attention"):
        out["q"] = st.gaussian("q", (b, H, L, D))
        out["keys"] = st.gaussian("keys", (b, H, S, R, D))
        out["v"] = st.gaussian("v", (b, H, S, E))
        if fn == "mgk.linear_attention":
            out["pi"] = _distribution(st, "pi", (b, H, S, R))
        if recipe.get("log_pi"):
            # float64 cases only: a rounded log_pi is a distribution only within its own dtype's
            # roundings, which the float64 baseline's check (float64 roundings) rejects
            # (mpmath, not libm: the same bits on every machine)
            import mpmath  # here: the catalogue's import does not load it

            pi = _distribution(st, "pi", (b, H, S, R))
            out["log_pi"] = np.vectorize(
                lambda p: float(mpmath.log(mpmath.mpf(p))), otypes=[np.float64]
            )(pi)
        if recipe.get("sigma2"):
            out["sigma2"] = np.ldexp(1.0, (st.uniform("sigma2", (b, H, S, R)) * 4).astype(int) - 1)
        if recipe.get("mask"):
            mask = st.bernoulli("mask", (b, H, L, S), Fraction(3, 4))
            mask[:, :, 1::4, :] = False  # every fourth row empty: its output is 0
            out["mask"] = mask
    elif fn in ("hopfield.retrieve", "hopfield.energy"):
        out["xi"] = st.gaussian("xi", (b, H, L, D))
        out["X"] = st.gaussian("X", (b, H, S, D))
    elif fn == "meanfield.naive_step":
        out["m"] = st.gaussian("m", (b, L, D))
        out["J"] = _couplings(st, (L, L, D, D), keep_diagonal=True)
        out["x"] = st.gaussian("x", (b, L, D))
    elif fn in ("meanfield.adaptive_tap", "meanfield.deq_attention"):
        out["x"] = st.gaussian("x", (b, L, D))
        out["J"] = _couplings(st, (L, L, D, D), keep_diagonal=bool(recipe.get("diagonal")))
        if recipe.get("prior_precision"):
            # symmetric positive definite, dyadic entries (exact in every dtype)
            out["prior_precision"] = np.diag(np.full(D, 2.0)) + np.ldexp(
                np.ones((D, D)) - np.eye(D), -1
            )
    elif fn == "meanfield.ising_tap":
        out["x"] = st.gaussian("x", (b, L))
        J = _couplings(st, (L, L), keep_diagonal=False)
        out["J"] = np.ldexp(J + J.T, -1)  # symmetric, same row-sum bound
    else:
        raise ValueError(f"make_inputs: unknown variant function {fn!r}")
    return out
