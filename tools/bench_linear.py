"""Benchmark refattn.linear_attention: float64 NumPy against the Numba CPU kernels, same run.

Cases (Gated DeltaNet: scalar gate, beta, qk_l2norm):

* prefill: B=1, H=16, T=4096, D=E=128 (``--length``, ``--heads``, ``--dim`` change it);
* decode: one step from a cached state, B=1, H=32, T=1, D=E=128;
* exact: a small case (B=1, H=1, T=4, D=E=4) on the exact path (float64 and bfloat16 outputs).

Prefill also times the chunked kernel (``backend="numba-chunked"``, chunks of 64 steps)
against the recurrent one (``--skip-numpy`` leaves the NumPy recurrence out of prefill).

``--vjp`` times only the vjp of the prefill case: the recurrent kernel
(``backend="numba"``) against the chunked one (``backend="numba-chunked"``), same run.

Prints the machine load (``os.getloadavg``) before and after, the best of ``--repeat`` wall
times and the NumPy / Numba ratio of each case. The first Numba call compiles (or loads the
on-disk cache) and is timed separately.

Figures (each flag runs that figure only, all given figures in the same run):

* ``--exact-prefill``: the exact path (``precision="exact"``) against ``backend="numba"`` on the
  GDN prefill. The exact path is timed on the subset ``--exact-heads`` x ``--exact-length``
  (default 1 head, T = 256), or with ``--exact-full`` on the full shape, and printed as
  measured, with its rate per (head, step) and per output element and the number of elements
  the referee evaluated (``refattn.exact.linear.linear_fallback_stats``); Numba is timed on
  that subset and on the full shape. No extrapolation is printed as a measurement.
* ``--exact-decode``: exact against Numba on one decode step from a cached state (B=1,
  ``--decode-heads`` heads, T = 1, ``initial_state``, ``output_final_state``).
* ``--transformers``: ``backend="numba"`` and ``"numba-chunked"`` against transformers'
  qwen3_next ``torch_recurrent_gated_delta_rule`` and ``torch_chunk_gated_delta_rule`` on the
  GDN prefill, float32 inputs, torch threads = Numba threads (``--threads``, default Numba's
  count); needs torch and transformers. refattn's public kernels compute in float64, the torch
  functions in float32.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import refattn


def _gdn(batch, heads, length, dim, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, length, dim))
    k = rng.standard_normal((batch, heads, length, dim))
    v = rng.standard_normal((batch, heads, length, dim))
    g = -rng.uniform(0.0, 1.0, (batch, heads, length))
    beta = rng.uniform(0.0, 1.0, (batch, heads, length))
    return q, k, v, g, beta


def _best(function, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def _load():
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def _compare(name, args, options, repeat, backends=("numpy", "numba")):
    def run(backend):
        return refattn.linear_attention(*args, qk_l2norm=True, backend=backend, **options)

    times = {}
    for backend in backends:
        if backend != "numpy":
            start = time.perf_counter()
            run(backend)
            first = time.perf_counter() - start
            print(f"{name}: {backend} first call {first:.2f} s")
        times[backend] = _best(lambda backend=backend: run(backend), repeat)
    shown = ", ".join(f"{b} {t * 1e3:.2f} ms" for b, t in times.items())
    ratios = ", ".join(
        f"{b}/{c} {times[b] / times[c]:.2f}x"
        for b, c in (("numpy", "numba"), ("numba", "numba-chunked"))
        if b in times and c in times
    )
    print(f"{name}: {shown}; {ratios}")


def vjp_figures(heads, length, dim, repeat):
    """The vjp of the GDN prefill (B1, ``heads``, ``length``, D=E=``dim``): numba against
    numba-chunked in the same run, with the load before and after."""
    args = _gdn(1, heads, length, dim)
    do = np.random.default_rng(4).standard_normal(args[2].shape)
    name = f"GDN vjp B1 H{heads} T{length} D=E={dim}"
    print(_load())
    times = {}
    for backend in ("numba", "numba-chunked"):

        def run(backend=backend):
            return refattn.linear_attention_vjp(*args, do, qk_l2norm=True, backend=backend)

        start = time.perf_counter()
        run()
        print(f"{name}: {backend} first call {time.perf_counter() - start:.2f} s")
        times[backend] = _best(run, repeat)
    shown = ", ".join(f"{b} {t:.2f} s" for b, t in times.items())
    print(f"{name}: {shown}; numba/numba-chunked {times['numba'] / times['numba-chunked']:.2f}x")
    print(_load())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="prefill T (default 4096)")
    parser.add_argument("--heads", type=int, default=16, help="prefill heads (default 16)")
    parser.add_argument("--decode-heads", type=int, default=32, help="decode heads (default 32)")
    parser.add_argument("--dim", type=int, default=128, help="D = E (default 128)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per case (best of)")
    parser.add_argument("--skip-prefill", action="store_true", help="decode and exact only")
    parser.add_argument("--skip-numpy", action="store_true", help="prefill: the Numba kernels only")
    parser.add_argument("--vjp", action="store_true", help="the prefill vjp only (two kernels)")
    _figure_flags(parser)
    args = parser.parse_args(argv)
    if args.vjp:
        vjp_figures(args.heads, args.length, args.dim, args.repeat)
        return
    if _figures(args):
        return
    print(_load())
    if not args.skip_prefill:
        prefill = _gdn(1, args.heads, args.length, args.dim)
        backends = ("numba", "numba-chunked")
        _compare(
            f"GDN prefill B1 H{args.heads} T{args.length} D=E={args.dim}",
            prefill,
            {},
            args.repeat,
            backends if args.skip_numpy else ("numpy", *backends),
        )
    q, k, v, g, beta = _gdn(1, args.decode_heads, 1, args.dim, seed=1)
    state = np.random.default_rng(2).standard_normal((1, args.decode_heads, args.dim, args.dim))
    _compare(
        f"GDN decode B1 H{args.decode_heads} T1 D=E={args.dim}",
        (q, k, v, g, beta),
        {"initial_state": state},
        max(args.repeat, 20),
    )
    small = _gdn(1, 1, 4, 4, seed=3)
    for dtype in ("float64", "bfloat16"):
        seconds = _best(
            lambda dtype=dtype: refattn.linear_attention(
                *small, qk_l2norm=True, precision="exact", out_dtype=dtype
            ),
            args.repeat,
        )
        print(f"exact B1 H1 T4 D=E=4 -> {dtype}: {seconds * 1e3:.1f} ms")
    print(_load())


# --- figures: exact vs Numba, Numba vs transformers -------------------------------------------


def _figure_flags(parser):
    figures = parser.add_argument_group("figures (each runs that figure only)")
    figures.add_argument("--exact-prefill", action="store_true", help="exact vs Numba, prefill")
    figures.add_argument("--exact-decode", action="store_true", help="exact vs Numba, decode")
    figures.add_argument(
        "--transformers",
        action="store_true",
        help="Numba vs transformers' torch_*_gated_delta_rule",
    )
    figures.add_argument("--exact-heads", type=int, default=1, help="exact prefill subset heads")
    figures.add_argument("--exact-length", type=int, default=256, help="exact prefill subset T")
    figures.add_argument(
        "--exact-full", action="store_true", help="exact prefill on the full shape (no subset)"
    )
    figures.add_argument("--threads", type=int, default=None, help="Numba (and torch) threads")


def _figures(args):
    """Run the figures the flags ask for; False when none is asked."""
    chosen = [
        (args.exact_prefill, _exact_prefill_figure),
        (args.exact_decode, _exact_decode_figure),
        (args.transformers, _transformers_figure),
    ]
    if not any(flag for flag, _ in chosen):
        return False
    import numba  # for its thread count only

    threads = numba.get_num_threads()
    numba.set_num_threads(threads if args.threads is None else args.threads)
    print(f"{_load()}; numba threads {numba.get_num_threads()}; cores {os.cpu_count()}")
    try:
        for flag, figure in chosen:
            if flag:
                figure(args)
                print(_load(), flush=True)
    finally:
        numba.set_num_threads(threads)
    return True


def _timed(function, repeat):
    """(seconds of the first call, best of ``repeat`` further calls)."""
    start = time.perf_counter()
    function()
    first = time.perf_counter() - start
    return first, _best(function, repeat) if repeat else first


def _linear(arrays, options, **how):
    return refattn.linear_attention(*arrays, qk_l2norm=True, **options, **how)


def _referee_share():
    """The referee's share of the last exact call (refattn.exact.linear.linear_fallback_stats)."""
    from refattn.exact.linear import linear_fallback_stats

    stats = linear_fallback_stats()
    return (
        f"referee: {stats['referee_elements']} of {stats['elements']} elements "
        f"({stats['referee_rows']} of {stats['rows']} rows; first step left "
        f"{stats['fast_undecided_elements']} undecided)"
    )


def _exact_prefill_figure(args):
    shape = f"B1 H{args.heads} T{args.length} D=E={args.dim}"
    heads, length = min(args.exact_heads, args.heads), min(args.exact_length, args.length)
    if args.exact_full:
        heads, length = args.heads, args.length
    full = _gdn(1, args.heads, args.length, args.dim)
    subset = tuple(a[:, :heads, :length] for a in full)
    options = {"output_final_state": True}
    first, numba_full = _timed(lambda: _linear(full, options, backend="numba"), args.repeat)
    print(f"exact-prefill: numba {shape}: {numba_full:.3f} s (first call {first:.2f} s)")
    _, numba_sub = _timed(lambda: _linear(subset, options, backend="numba"), args.repeat)
    part = f"B1 H{heads} T{length} D=E={args.dim}"
    which = "full shape" if args.exact_full else "subset"
    print(f"exact-prefill: numba {part} ({which}): {numba_sub * 1e3:.2f} ms", flush=True)
    _linear(tuple(a[:, :1, :2] for a in full), options, precision="exact")  # compile or load
    print(f"exact-prefill: exact {part} ({which}) started, {_load()}", flush=True)
    exact, _ = _timed(lambda: _linear(subset, options, precision="exact"), 0)
    steps = heads * length
    print(
        f"exact-prefill: exact {part} ({which}, measured, one run): {exact:.1f} s "
        f"= {exact / steps * 1e3:.3f} ms per (head, step) = "
        f"{exact / (steps * args.dim) * 1e6:.2f} us per output element; exact / numba "
        f"{exact / numba_sub:.1f}x; {_referee_share()}; {_load()}"
    )


def _exact_decode_figure(args):
    heads, dim = args.decode_heads, args.dim
    step = _gdn(1, heads, 1, dim, seed=1)
    state = np.random.default_rng(2).standard_normal((1, heads, dim, dim))
    options = {"initial_state": state, "output_final_state": True}
    shape = f"B1 H{heads} T1 D=E={dim}"
    first, numba_s = _timed(lambda: _linear(step, options, backend="numba"), max(args.repeat, 20))
    print(f"exact-decode: numba {shape}: {numba_s * 1e3:.3f} ms (first call {first:.2f} s)")
    first, exact = _timed(lambda: _linear(step, options, precision="exact"), args.repeat)
    elements = heads * dim * (dim + 1)
    print(
        f"exact-decode: exact {shape} (measured, best of {args.repeat}; first call "
        f"{first:.2f} s): {exact * 1e3:.1f} ms = {exact / elements * 1e6:.3f} us per output "
        f"element (o and final state); exact / numba {exact / numba_s:.0f}x; {_referee_share()}"
    )


def _transformers_figure(args):
    import numba  # thread count
    import torch  # optional peer, only for this figure
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    threads = torch.get_num_threads()
    torch.set_num_threads(numba.get_num_threads())
    try:
        _transformers_runs(args, torch, qwen3_next)
    finally:
        torch.set_num_threads(threads)


def _transformers_runs(args, torch, qwen3_next):
    arrays = tuple(a.astype(np.float32) for a in _gdn(1, args.heads, args.length, args.dim))
    q, k, v, g, beta = (
        torch.from_numpy(np.ascontiguousarray(np.moveaxis(a, 2, 1))) for a in arrays
    )
    shape = f"B1 H{args.heads} T{args.length} D=E={args.dim} float32"
    print(f"transformers: {shape}; torch {torch.__version__} threads {torch.get_num_threads()}")
    options = {"output_final_state": True}
    runs = {
        "refattn numba": lambda: _linear(arrays, options, backend="numba"),
        "refattn numba-chunked": lambda: _linear(arrays, options, backend="numba-chunked"),
    }
    for which in ("recurrent", "chunk"):
        function = getattr(qwen3_next, f"torch_{which}_gated_delta_rule")
        runs[f"transformers torch_{which}"] = lambda function=function: function(
            q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
    times, outputs = {}, {}
    with torch.inference_mode():
        for name, run in runs.items():
            first, times[name] = _timed(run, args.repeat)
            out = run()[0]
            outputs[name] = out if isinstance(out, np.ndarray) else np.moveaxis(out.numpy(), 1, 2)
            print(
                f"transformers: {name}: {times[name]:.3f} s (first call {first:.2f} s)", flush=True
            )
    base = outputs["refattn numba"]
    for name, out in outputs.items():
        gap = float(np.max(np.abs(out.astype(np.float64) - base)))
        print(
            f"transformers: {name} / refattn numba {times[name] / times['refattn numba']:.2f}x; "
            f"max |o - o_numba| {gap:.2e}"
        )


if __name__ == "__main__":
    main()
