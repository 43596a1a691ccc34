"""``python -m refattn selfcheck``: evaluate a few cases on both paths, print agreement and timing.

For each case the float64 path is compared with the exact path: the fraction of elements
that are correctly rounded, the worst distance in ulp, and whether every element lies within
the float64 path's a-priori bound (:mod:`refattn.bounds`). The exit status is 0 only when
every element is within its bound.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import __version__
from .attention import attention, attention_vjp
from .bounds import float64_forward_bound, float64_vjp_bound


def _ulps(got: np.ndarray, truth: np.ndarray) -> np.ndarray:
    spacing = np.spacing(np.abs(truth))
    with np.errstate(invalid="ignore", divide="ignore"):
        dist = np.abs(got - truth) / spacing
    return np.where(got == truth, 0.0, dist)


def _cases(rng):
    def gaussian(*shape, scale=1.0):
        return rng.standard_normal(shape) * scale

    mask = np.ones((4, 32, 48), dtype=bool)
    mask[:, 3] = False
    yield (
        "H2 L=S=64 D=E=64 (issue target)",
        (gaussian(2, 64, 64), gaussian(2, 64, 64), gaussian(2, 64, 64)),
        {},
    )
    yield (
        "GQA H4/K2 causal bottom-right L32 S48",
        (gaussian(4, 32, 16), gaussian(2, 48, 16), gaussian(2, 48, 8)),
        {"causal": True, "align": "bottom_right", "mask": mask},
    )
    yield (
        "softcap 30 + ALiBi + window, logit gaps > 40",
        (gaussian(2, 32, 16, scale=6.0), gaussian(2, 32, 16), gaussian(2, 32, 8)),
        {"softcap": 30.0, "alibi_slopes": np.array([0.5, 0.125]), "window": (8, 0)},
    )
    keep = rng.random((2, 16, 64)) < 0.9
    yield (
        "dropout p=0.1 + bias, decode-like L16 S64",
        (gaussian(2, 16, 32), gaussian(2, 64, 32), gaussian(2, 64, 32)),
        {"dropout_mask": keep, "dropout_p": 0.1, "bias": gaussian(16, 64)},
    )


def selfcheck(seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    print(f"refattn {__version__} selfcheck (seed {seed})")
    header = f"{'case':48s} {'f64 ms':>8s} {'exact s':>8s} {'CR %':>6s} {'max ulp':>8s} bound"
    print(header)
    print("-" * len(header))
    ok = True
    for name, (q, k, v), opts in _cases(rng):
        t0 = time.perf_counter()
        fast = attention(q, k, v, **opts)
        t1 = time.perf_counter()
        exact = attention(q, k, v, precision="exact", **opts)
        t2 = time.perf_counter()
        bound, _ = float64_forward_bound(q, k, v, **opts)
        within = bool((np.abs(fast - exact) <= bound).all())
        ok &= within
        ulps = _ulps(fast, exact)
        print(
            f"{name:48s} {1e3 * (t1 - t0):8.2f} {t2 - t1:8.2f} "
            f"{100 * np.mean(ulps == 0):6.1f} {ulps.max():8.0f} {'ok' if within else 'FAIL'}"
        )
    q, k, v = (rng.standard_normal((2, 16, 16)) for _ in range(3))
    grad = rng.standard_normal((2, 16, 16))
    t0 = time.perf_counter()
    fast = attention_vjp(q, k, v, grad)
    t1 = time.perf_counter()
    exact = attention_vjp(q, k, v, grad, precision="exact")
    t2 = time.perf_counter()
    bounds = float64_vjp_bound(q, k, v, grad)
    within = all(
        (np.abs(a - b) <= c).all() for a, b, c in zip(fast[:3], exact[:3], bounds[:3], strict=True)
    )
    ok &= within
    ulps = np.concatenate([_ulps(a, b).ravel() for a, b in zip(fast[:3], exact[:3], strict=True)])
    print(
        f"{'vjp H2 L=S=D=E=16 (dq, dk, dv)':48s} {1e3 * (t1 - t0):8.2f} {t2 - t1:8.2f} "
        f"{100 * np.mean(ulps == 0):6.1f} {ulps.max():8.0f} {'ok' if within else 'FAIL'}"
    )
    print(
        "CR % = float64 elements equal to the correctly rounded exact result; "
        "bound = every element within refattn.bounds"
    )
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refattn", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("selfcheck", help="compare the float64 and exact paths on a few cases")
    check.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return selfcheck(args.seed)


if __name__ == "__main__":
    sys.exit(main())
