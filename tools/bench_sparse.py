"""Time sparse top-k attention (``key_indices``): the exact path and the Numba kernel in one run.

Usage: python tools/bench_sparse.py [--preset dsa-decode|topk-prefill] [--rows N] [--heads N]
                                    [--skip-exact] [--json FILE]

Presets (bfloat16 inputs, the exact truth rounded once to bfloat16; Numba computes in float32
for bfloat16 inputs):

* ``dsa-decode``: one DeepSeek Sparse Attention decode step, B1 H128 K1 L1 S=65536 T=2048
  D=576 E=512 (v is the first 512 features of the latent key, as in MLA's absorbed form;
  scale 1/sqrt(192), the model's);
* ``topk-prefill``: B1 H16 K1 L=S=8192 T=2048 D=E=128 (causal bottom-right; each row's T
  indices the first T of a random permutation of its causal prefix, -1 where the prefix is
  shorter).

``--rows N`` times only the last N query rows of the prefill (the full time is the printed
time scaled by L / N: the work per row is the same, T valid keys at most) and ``--heads N``
only N heads (scaled by H / N). The machine's load average is printed with the figures (it is
shared: compare the two paths of one run, not absolute times across runs).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import ml_dtypes
import numpy as np

import refattn

PRESETS = {
    "dsa-decode": dict(B=1, H=128, K=1, L=1, S=65536, T=2048, D=576, E=512, causal=False),
    "topk-prefill": dict(B=1, H=16, K=1, L=8192, S=8192, T=2048, D=128, E=128, causal=True),
}


def _inputs(p, rows, heads, rng):
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((p["B"], heads, rows, p["D"])).astype(bf16)
    k = rng.standard_normal((p["B"], p["K"], p["S"], p["D"])).astype(bf16)
    v = k[..., : p["E"]] if p["E"] < p["D"] else rng.standard_normal(k.shape).astype(bf16)
    first = p["L"] - rows  # the last `rows` rows of the problem
    idx = np.full((p["B"], p["K"], rows, p["T"]), -1, dtype=np.int32)
    for i in range(rows):
        prefix = p["S"] - p["L"] + first + i + 1 if p["causal"] else p["S"]
        chosen = rng.permutation(prefix)[: p["T"]]
        idx[..., i, : chosen.size] = chosen
    return q, k, v, idx


def _time(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="dsa-decode")
    parser.add_argument("--rows", type=int, default=None, help="time only the last N rows")
    parser.add_argument("--heads", type=int, default=None, help="time only N heads")
    parser.add_argument("--skip-exact", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    p = PRESETS[args.preset]
    rows = args.rows or p["L"]
    heads = args.heads or p["H"]
    q, k, v, idx = _inputs(p, rows, heads, np.random.default_rng(0))
    options = dict(key_indices=idx, return_lse=True)
    if args.preset == "dsa-decode":
        options["scale"] = 1 / np.sqrt(192.0)
    if p["causal"]:
        options.update(causal=True, align="bottom_right")
    scaling = (p["L"] / rows) * (p["H"] / heads)
    # with L = S, bottom-right alignment gives the last `rows` rows their own diagonal
    results = {"preset": args.preset, "rows": rows, "heads": heads, "scaling": scaling}
    refattn.attention(
        q[:, :1, :1],
        k,
        v,
        **{
            **options,
            "key_indices": idx[:, :, :1],
            "mask": None if options.get("mask") is None else options["mask"][:, :, :1],
        },
        backend="numba",
    )  # compile
    results["numba_s"] = _time(lambda: refattn.attention(q, k, v, **options, backend="numba"))
    if not args.skip_exact:
        results["exact_s"] = _time(
            lambda: refattn.attention(q, k, v, **options, precision="exact", out_dtype="bfloat16")
        )
    results["load"] = os.getloadavg()
    for name in ("numba_s", "exact_s"):
        if name in results:
            results[name.replace("_s", "_full_s")] = results[name] * scaling
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
