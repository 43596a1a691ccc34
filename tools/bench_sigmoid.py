"""Time sigmoid attention (``normalizer="sigmoid"``, causal, bias -log S): the Numba CPU kernels
against a plain torch implementation and the exact path against the Numba kernels, as
same-run ratios, with the machine's load.

Per repeat the Numba forward and the torch forward run back to back (alternating; the best of
``--repeats`` each): torch is ``sigmoid(q k^T s + b)`` masked to the causal set, ``@ v``, in
the same dtype as the Numba kernel computes (float32 inputs: float32; float64: float64), on
as many threads as Numba uses. The exact forward (``precision="exact"``, ``out_dtype`` the
input dtype) runs the whole shape on the fast engine (the compiled double-double first step;
the referee only for undecided rows); ``--referee-rows`` also times that many full rows on the
referee engine alone and extrapolates it (stated as such). ``--backward`` adds the Numba vjp.

    python tools/bench_sigmoid.py --heads 4 --length 512 --dtype float32
    python tools/bench_sigmoid.py --heads 8 --length 2048 --dtype float64 --repeats 2
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import time

import numpy as np

import refattn
from refattn import config
from refattn.exact.fast.sigmoid import sigmoid_fallback_stats


def _uptime() -> str:
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:  # pragma: no cover
        return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _torch_forward(q, k, v, bias):
    """The plain torch sigmoid attention (None without torch)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    import numba

    torch.set_num_threads(numba.get_num_threads())
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    length, keys = q.shape[-2], k.shape[-2]
    allowed = torch.ones(length, keys, dtype=torch.bool).tril(keys - length)
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        with torch.no_grad():
            scores = (tq @ tk.transpose(-1, -2)) * scale + bias
            return (torch.where(allowed, torch.sigmoid(scores), 0.0) @ tv).numpy()

    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--length", type=int, default=512, help="L = S (default %(default)s)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-exact", action="store_true", help="skip the exact forward")
    parser.add_argument("--referee-rows", type=int, default=0, help="rows timed on the referee")
    parser.add_argument("--backward", action="store_true", help="also time the Numba vjp")
    args = parser.parse_args(argv)
    B, H, L, D = args.batch, args.heads, args.length, args.dim
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D)).astype(dtype) for _ in range(3))
    bias = -math.log(L)
    opts = dict(normalizer="sigmoid", bias=np.float64(bias), causal=True)
    print(f"shape B{B} H{H} L=S={L} D{D} {dtype}, causal, bias -log S")
    print("before:", _uptime())

    def numba_fwd():
        return refattn.attention(q, k, v, backend="numba", **opts)

    def exact_fwd():
        return refattn.attention(q, k, v, precision="exact", out_dtype=dtype, **opts)

    torch_fwd = _torch_forward(q, k, v, bias)
    numba_fwd()  # compile / load the caches
    for warm in (dtype, np.float64):  # compile / load both first steps (float32: two)
        refattn.attention(q[:, :, :4], k, v, precision="exact", out_dtype=warm, **opts)
    best = {"numba": math.inf, "torch": math.inf, "exact": math.inf}
    for _ in range(args.repeats):
        best["numba"] = min(best["numba"], _timed(numba_fwd)[0])
        if torch_fwd is not None:
            best["torch"] = min(best["torch"], _timed(torch_fwd)[0])
        if not args.no_exact:
            elapsed, exact = _timed(exact_fwd)
            best["exact"] = min(best["exact"], elapsed)
    fwd = best["numba"]
    print(f"numba forward  {fwd * 1e3:10.1f} ms (whole shape, best of {args.repeats})")
    if torch_fwd is not None:
        print(f"torch forward  {best['torch'] * 1e3:10.1f} ms ({dtype}, plain: sigmoid masked @ v)")
        print(f"numba speed-up over torch: {best['torch'] / fwd:.2f}x")
    if not args.no_exact:
        stats = sigmoid_fallback_stats()
        print(
            f"exact forward  {best['exact'] * 1e3:10.1f} ms (fast engine, whole shape; "
            f"{stats['referee_rows']} of {stats['rows']} rows on the referee)"
        )
        print(f"exact / numba forward: {best['exact'] / fwd:.2f}x")
    if args.backward:
        grad = rng.standard_normal((B, H, L, D)).astype(dtype)
        refattn.attention_vjp(q, k, v, grad, backend="numba", **opts)
        bwd = min(
            _timed(lambda: refattn.attention_vjp(q, k, v, grad, backend="numba", **opts))[0]
            for _ in range(args.repeats)
        )
        print(f"numba backward {bwd * 1e3:10.1f} ms (whole shape, best of {args.repeats})")
    if args.referee_rows:
        rows = args.referee_rows
        sub = dict(opts, align="bottom_right")  # the last rows read every key
        saved = config.SIGMOID_EXACT_ENGINE
        config.SIGMOID_EXACT_ENGINE = "referee"
        try:
            elapsed, _ = _timed(
                lambda: refattn.attention(
                    q[0, 0, L - rows :], k[0, 0], v[0, 0], precision="exact", **sub
                )
            )
        finally:
            config.SIGMOID_EXACT_ENGINE = saved
        total = elapsed / rows * B * H * L / 2  # causal: about S / 2 keys a row on average
        print(f"referee alone  {elapsed / rows:10.2f} s per full row; ~{total:.0f} s extrapolated")
    print("after: ", _uptime())


if __name__ == "__main__":
    main()
