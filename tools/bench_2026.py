#!/usr/bin/env python
"""Time the 2025-26 attention workloads on refattn's Numba kernels against plain PyTorch.

Usage: python tools/bench_2026.py
           [--case dsa|dsa-full|dsa-prefill|dsa-vjp|softmax|nvfp4|nvfp4-large|all]
           [--repeat N] [--skip-exact] [--full] [--json FILE]

Cases (every figure is the best of ``--repeat`` timed calls after one warm-up call, which
compiles; ratios are of the same run, and the machine's load average is printed with them:
the machine may be shared, so compare within a run):

* ``dsa``: one DeepSeek Sparse Attention decode step, B1 H16 K1 L1 S=16384 T=512 top-k keys,
  D=576 E=512 (v the first 512 features of the latent key, MLA's absorbed form; scale
  1/sqrt(192)), float32: refattn's Numba gather kernel (``key_indices``) against a plain torch
  implementation (gather the T rows, softmax, matmul) and refattn's exact path
  (``precision="exact"``, every element rounded once to float32) against the Numba kernel;
  the Numba, torch and exact calls alternate, so that all see the same load (each after three
  untimed calls of its own, so that the other library's idle threads have stopped spinning);
* ``dsa-full`` (or ``dsa --full``): the same for the full step, B1 H128 K1 L1 S=65536 T=2048
  (not in ``all``);
* ``dsa-prefill``: a causal top-k prefill, B1 H16 K1 L=S=2048 T=512 D=E=128 float32 (row i
  lists min(T, i + 1) random keys of 0..i, -1 after them), exact against Numba; with
  ``--full`` L=S=8192 T=2048;
* ``dsa-vjp``: the backward of the ``dsa`` decode step (same shape and inputs, a Gaussian
  cotangent of out): the exact vjp by gather (``precision="exact"``, every element rounded
  once to float32; the default ``config.EXACT_SPARSE_KEYS = "gather"``: the listed keys
  compacted) against the exact vjp on the dense mask (``"mask"``) and against refattn's Numba
  gather vjp (``backend="numba"``), alternating, with each exact route's peak NumPy memory
  (``tracemalloc``, one call; the (S, D + E) dk, dv it returns included); with ``--full`` the
  ``dsa-full`` shape (not in ``all``);
* ``softmax``: float32 causal B1 H8 L=S=1024 D=E=64, the Numba kernel against
  ``torch.nn.functional.scaled_dot_product_attention`` (alternating, each after three
  untimed calls of its own, as ``dsa``);
* ``nvfp4``: an NVFP4 GQA decode step B1 H8 K2 L1 S=8192 D=E=128 (float4_e2m1fn codes with
  float8_e4m3fn scales per block of 16 features and float32 global scales per kv head): the
  Numba kernel (float64 compute, q being fp4; it dequantises each key block as it loads it)
  against a plain torch implementation (dequantise codes * block scale * global scale by
  table look-ups, then ``scaled_dot_product_attention(..., enable_gqa=True)``, in float32
  and in float64), and the exact path against the Numba kernel; ``nvfp4-large``: the same at
  B1 H32 K8 S=32768 (not part of ``all``).

torch is optional (``pip install torch``): without it the torch columns are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import tracemalloc

import numpy as np

import refattn


def _best(fn, repeat):
    fn()  # warm-up: compiles
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


#: The DSA decode shapes: (H, S, T); D 576, E 512 (MLA's absorbed latent key and value).
DSA_SHAPES = {"dsa": (16, 16384, 512), "full": (128, 65536, 2048)}


def _dsa_inputs(rng, heads=16, keys=16384, top=512, dim=576, vdim=512):
    q = rng.standard_normal((1, heads, 1, dim)).astype(np.float32)
    k = rng.standard_normal((1, 1, keys, dim)).astype(np.float32)
    v = np.ascontiguousarray(k[..., :vdim])
    idx = rng.permutation(keys)[:top].astype(np.int64)[None, None, None, :]
    return q, k, v, idx, 1 / np.sqrt(192.0)


def bench_dsa(repeat, skip_exact, shape="dsa"):
    """DSA decode step: Numba gather vs torch gather (alternating calls), and exact vs Numba."""
    heads, keys, top = DSA_SHAPES[shape]
    q, k, v, idx, scale = _dsa_inputs(np.random.default_rng(0), heads, keys, top)
    result = {"shape": f"B1 H{heads} K1 L1 S{keys} T{top} D576 E512 float32"}

    def numba():
        return refattn.attention(q, k, v, key_indices=idx, scale=scale, backend="numba")

    paths = {"numba_s": numba}
    torch = _torch()
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        tidx = torch.from_numpy(idx[0, 0, 0])

        def plain():
            with torch.inference_mode():
                keys = tk[0, 0].index_select(0, tidx)  # (T, D)
                values = tv[0, 0].index_select(0, tidx)  # (T, E)
                weights = torch.softmax((tq[0, :, 0] @ keys.T) * scale, dim=-1)  # (H, T)
                return weights @ values

        paths["torch_s"] = plain
    if not skip_exact:

        def exact():
            return refattn.attention(
                q, k, v, key_indices=idx, scale=scale, precision="exact", out_dtype="float32"
            )

        paths["exact_s"] = exact
    result.update(_alternating(paths, repeat, settle=3))
    if torch is not None:
        result["numba_over_torch"] = result["numba_s"] / result["torch_s"]
    if not skip_exact:
        result["exact_over_numba"] = result["exact_s"] / result["numba_s"]
    return result


def bench_dsa_vjp(repeat, skip_exact, shape="dsa"):
    """DSA decode step's vjp: exact by gather vs exact on the dense mask vs Numba (alternating)."""
    from refattn import config

    heads, keys, top = DSA_SHAPES[shape]
    rng = np.random.default_rng(0)
    q, k, v, idx, scale = _dsa_inputs(rng, heads, keys, top)
    do = rng.standard_normal((1, heads, 1, v.shape[-1])).astype(np.float32)
    result = {"shape": f"B1 H{heads} K1 L1 S{keys} T{top} D576 E512 float32"}

    def numba():
        return refattn.attention_vjp(q, k, v, do, key_indices=idx, scale=scale, backend="numba")

    def exact(mode):
        def run():
            saved = config.EXACT_SPARSE_KEYS
            config.EXACT_SPARSE_KEYS = mode
            try:
                return refattn.attention_vjp(
                    q,
                    k,
                    v,
                    do,
                    key_indices=idx,
                    scale=scale,
                    precision="exact",
                    out_dtype="float32",
                )
            finally:
                config.EXACT_SPARSE_KEYS = saved

        return run

    paths = {"numba_s": numba}
    if not skip_exact:
        paths["exact_gather_s"] = exact("gather")
        paths["exact_mask_s"] = exact("mask")
        same = all(
            np.array_equal(a.view(np.uint32), b.view(np.uint32))
            for a, b in zip(paths["exact_gather_s"]()[:3], paths["exact_mask_s"]()[:3], strict=True)
        )
        result["gather_bits_equal_mask"] = same
        for name in ("exact_gather_s", "exact_mask_s"):  # peak NumPy memory of one call
            tracemalloc.start()
            paths[name]()
            result[name[:-2] + "_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
    result.update(_alternating(paths, repeat, settle=1))
    if not skip_exact:
        result["mask_over_gather"] = result["exact_mask_s"] / result["exact_gather_s"]
        result["gather_over_numba"] = result["exact_gather_s"] / result["numba_s"]
    result["load"] = os.getloadavg()
    return result


def _prefill_indices(rng, length, top):
    """(1, 1, L, T) causal top-k lists: row i lists min(T, i + 1) distinct keys of 0..i."""
    idx = np.full((1, 1, length, top), -1, dtype=np.int64)
    for i in range(length):
        count = min(top, i + 1)
        idx[0, 0, i, :count] = rng.choice(i + 1, count, replace=False)
    return idx


def bench_dsa_prefill(repeat, skip_exact, full=False):
    """Causal top-k prefill: exact vs the Numba gather kernel."""
    rng = np.random.default_rng(3)
    heads, length, top, dim = (16, 8192, 2048, 128) if full else (16, 2048, 512, 128)
    q = rng.standard_normal((1, heads, length, dim)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, length, dim)).astype(np.float32) for _ in range(2))
    idx = _prefill_indices(rng, length, top)
    result = {"shape": f"B1 H{heads} K1 L=S={length} T{top} D=E={dim} float32 causal top-k"}
    options = dict(key_indices=idx, causal=True)

    def numba():
        return refattn.attention(q, k, v, backend="numba", **options)

    def exact():
        return refattn.attention(q, k, v, precision="exact", out_dtype="float32", **options)

    if skip_exact:
        result["numba_s"] = _best(numba, repeat)
    else:
        result.update(_alternating({"numba_s": numba, "exact_s": exact}, repeat))
        result["exact_over_numba"] = result["exact_s"] / result["numba_s"]
    return result


def bench_softmax(repeat):
    """float32 causal B1 H8 L=S=1024 D64: Numba vs torch SDPA, alternating within each round
    (each after three untimed calls of its own: the other library's idle OpenMP threads
    spin for a while after its calls and would be timed on a 2-core machine)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 8, 1024, 64)).astype(np.float32) for _ in range(3))
    result = {"shape": "B1 H8 L=S=1024 D=E=64 float32 causal"}
    paths = {"numba_s": lambda: refattn.attention(q, k, v, causal=True, backend="numba")}
    torch = _torch()
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run_torch():
            with torch.inference_mode():
                return sdpa(tq, tk, tv, is_causal=True)

        paths["torch_s"] = run_torch
    result.update(_alternating(paths, repeat, settle=3))
    if torch is not None:
        result["numba_over_torch"] = result["numba_s"] / result["torch_s"]
    return result


def _nvfp4_inputs(rng, heads, kv_heads, keys, dim=128):
    """fp4 q, k, v (B1, L1) with NVFP4 block scales and per-kv-head float32 global scales."""
    import ml_dtypes

    fp4, fp8 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn

    def codes(shape):
        return rng.standard_normal(shape).clip(-6, 6).astype(fp4)

    def scales(shape):
        return (rng.random(shape[:-1] + (shape[-1] // 16,)) + 0.5).astype(fp8)

    q = codes((1, heads, 1, dim))
    k, v = codes((1, kv_heads, keys, dim)), codes((1, kv_heads, keys, dim))
    return dict(
        q=q,
        k=k,
        v=v,
        q_block_scale=scales(q.shape),
        k_block_scale=scales(k.shape),
        v_block_scale=scales(v.shape),
        k_descale=(rng.random((1, kv_heads)) + 0.5).astype(np.float32),
        v_descale=(rng.random((1, kv_heads)) + 0.5).astype(np.float32),
    )


def _torch_nvfp4(torch, args, dtype):
    """A plain torch NVFP4 step: dequantise codes * block scale * global scale (table
    look-ups, in ``dtype``), then scaled_dot_product_attention with GQA."""
    import ml_dtypes

    def table(kind):
        return torch.from_numpy(np.arange(256, dtype=np.uint8).view(kind).astype(np.float64)).to(
            dtype
        )

    fp4_values = table(ml_dtypes.float4_e2m1fn)
    fp8_values = table(ml_dtypes.float8_e4m3fn)
    raw = {
        n: torch.from_numpy(np.asarray(a).view(np.uint8))
        for n, a in args.items()
        if "descale" not in n
    }
    glob = {n: torch.from_numpy(args[f"{n}_descale"].astype(np.float64)).to(dtype) for n in "kv"}

    def dequantise(name):
        x = fp4_values[raw[name].int()]
        s = fp8_values[raw[f"{name}_block_scale"].int()].repeat_interleave(16, dim=-1)
        x = x * s
        return x * glob[name][..., None, None] if name in glob else x

    def step():
        q, k, v = dequantise("q"), dequantise("k"), dequantise("v")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return step


def bench_nvfp4(repeat, skip_exact, heads=8, kv_heads=2, keys=8192):
    """NVFP4 GQA decode step B1 H8 K2 L1 S=8192 D=E=128 (NVFP4 k, v and q): the Numba kernel
    (float64 compute, q being fp4) against torch (dequantise + SDPA, float32 and float64),
    and the exact path (every element rounded once to float64) against the Numba kernel."""
    args = _nvfp4_inputs(np.random.default_rng(2), heads, kv_heads, keys)
    result = {"shape": f"B1 H{heads} K{kv_heads} L1 S{keys} D=E=128 NVFP4"}
    paths = {"numba_s": lambda: refattn.attention(**args, backend="numba")}
    torch = _torch()
    if torch is not None:
        for name, dtype in (("torch_f32_s", torch.float32), ("torch_f64_s", torch.float64)):
            paths[name] = _torch_nvfp4(torch, args, dtype)
    if not skip_exact:
        paths["exact_s"] = lambda: refattn.attention(**args, precision="exact")
    result.update(_alternating(paths, repeat))
    for name in paths:
        if name != "numba_s":
            over = "exact_over_numba" if name == "exact_s" else name[:-2] + "_over_numba"
            result[over] = result[name] / result["numba_s"]
    return result


def _alternating(paths, repeat, settle=0):
    """Best time of each path over ``repeat`` rounds, the paths timed in turn within each
    round (after one warm-up call each), so that a change of the machine's load reaches
    every path alike. ``settle`` > 0: within a round each path first runs ``settle`` untimed
    calls, so that the previous path's worker threads have gone idle (torch's and Numba's
    OpenMP pools spin for a while after a parallel region, and on a 2-core machine a
    sub-millisecond call timed right after the other library's would time that spinning);
    a decode loop calls one library at a time."""
    for fn in paths.values():
        fn()
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeat):
        for name, fn in paths.items():
            for _ in range(settle):
                fn()
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--case",
        choices=[
            "dsa",
            "dsa-full",
            "dsa-prefill",
            "dsa-vjp",
            "softmax",
            "nvfp4",
            "nvfp4-large",
            "all",
        ],
        default="all",
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per figure")
    parser.add_argument("--skip-exact", action="store_true", help="dsa, nvfp4: skip the exact path")
    parser.add_argument(
        "--full", action="store_true", help="dsa, dsa-prefill: the full-size problems"
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    cases = ["dsa", "softmax", "nvfp4"] if args.case == "all" else [args.case]
    results = {"load_before": os.getloadavg()}
    for case in cases:
        if case in ("dsa", "dsa-full"):
            shape = "full" if case == "dsa-full" or args.full else "dsa"
            results[case] = bench_dsa(args.repeat, args.skip_exact, shape)
        elif case == "dsa-vjp":
            shape = "full" if args.full else "dsa"
            results[case] = bench_dsa_vjp(args.repeat, args.skip_exact, shape)
        elif case == "dsa-prefill":
            results[case] = bench_dsa_prefill(args.repeat, args.skip_exact, args.full)
        elif case == "softmax":
            results[case] = bench_softmax(args.repeat)
        elif case == "nvfp4-large":
            results[case] = bench_nvfp4(args.repeat, args.skip_exact, 32, 8, 32768)
        else:
            results[case] = bench_nvfp4(args.repeat, args.skip_exact)
        print(case, json.dumps(results[case]), flush=True)
    results["load_after"] = os.getloadavg()
    print(
        "load average (1, 5, 15 min) before", results["load_before"], "after", results["load_after"]
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
