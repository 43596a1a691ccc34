#!/usr/bin/env python
"""Compare the fast exact engine with the referee on the catalogue's attention cases.

Small cases (at most ``--full-below`` multiply-adds per plane set) are compared whole: out, lse
and, for gradient cases, dq, dk, dv and dbias/dsinks from ``config.EXACT_ENGINE`` /
``EXACT_VJP_ENGINE`` "fast" against "referee". Larger cases -- the kernel-scale ones, where the
referee would take hours -- are compared on sampled query rows: every output row depends on
its own query row only, and so does every dq row, so the referee run on a one-row spec
(:func:`refattn.exact.fast.row_spec`) gives the exact rounded values of those rows.
The sampled rows are the rows at and next to the 64- and 128-row tile boundaries, the first
and last rows and ``--random-rows`` more per plane, on up to ``--planes`` (batch, head)
planes. dk and dv of large cases sum over every row and are not compared here.

Prints one line per case and a summary; exits 1 on any difference::

    python tools/engine_agreement.py --suite default --suite kernel --jobs 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np


def _same(a, b) -> bool:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return a.shape == b.shape and bool(
        ((a == b) & (np.signbit(a) == np.signbit(b)) | (np.isnan(a) & np.isnan(b))).all()
    )


def _spec(case, inputs):
    from oracle.fixtures.golden import call_options
    from refattn.spec import canonicalize

    options = call_options(case, inputs)
    spec = canonicalize(inputs["q"], inputs["k"], inputs["v"], **options)
    return spec


def _sample_rows(length: int, rng, extra: int) -> list[int]:
    rows = {0, length - 1}
    for edge in (64, 128, 256):
        rows |= {edge - 1, edge}
    rows = {i for i in rows if 0 <= i < length}
    rows |= {int(i) for i in rng.integers(0, length, extra)} if length else set()
    return sorted(rows)


def _whole(case, inputs) -> list[str]:
    """Names of the truths where the fast engine differs from the referee (whole case)."""
    from oracle.fixtures.golden import call_options
    from refattn import attention, attention_vjp, config

    options = call_options(case, inputs)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    got = {}
    for engine in ("fast", "referee"):
        config.EXACT_ENGINE = config.EXACT_VJP_ENGINE = engine
        for dtype in dict.fromkeys([case.dtype, "float64"]):
            out, lse = attention(
                q, k, v, **options, return_lse=True, precision="exact", out_dtype=dtype
            )
            got[engine, "out", dtype], got[engine, "lse", dtype] = out, lse
            if case.grads:
                grads = attention_vjp(
                    q,
                    k,
                    v,
                    inputs["grad_out"],
                    grad_lse=inputs.get("grad_lse"),
                    **options,
                    precision="exact",
                    out_dtype=dtype,
                )
                for name in ("dq", "dk", "dv", "dbias", "dsinks"):
                    value = getattr(grads, name, None)
                    if value is not None:
                        got[engine, name, dtype] = value
    config.EXACT_ENGINE = config.EXACT_VJP_ENGINE = "fast"
    return [
        f"{name}[{dtype}]"
        for (engine, name, dtype) in got
        if engine == "fast" and not _same(got[engine, name, dtype], got["referee", name, dtype])
    ]


def _sampled(case, inputs, planes: int, extra: int) -> tuple[list[str], int]:
    """Differences on sampled rows, and the number of rows compared."""
    from refattn.exact.attention import exact_forward
    from refattn.exact.attention_vjp import exact_vjp
    from refattn.exact.fast import fast_exact_forward, row_spec

    spec = _spec(case, inputs)
    batch, heads, _, length, _, _, vdim = spec.dims
    rng = np.random.default_rng(abs(hash(case.name)) % 2**32)
    chosen = [(b, h) for b in range(batch) for h in range(heads)]
    if len(chosen) > planes:
        chosen = [chosen[int(n)] for n in sorted(rng.choice(len(chosen), planes, replace=False))]
    diffs, count = [], 0
    do = dl = None
    if case.grads:
        do = np.asarray(inputs["grad_out"], np.float64).reshape(batch, heads, length, vdim)
        if inputs.get("grad_lse") is not None:
            dl = np.asarray(inputs["grad_lse"], np.float64).reshape(batch, heads, length)
    for dtype in dict.fromkeys([case.dtype, "float64"]):
        out, lse, _ = fast_exact_forward(spec, dtype, return_lse=True)
        dq = None
        if case.grads:
            dq = exact_vjp(spec, do, dl, out.dtype, engine="fast")[0]
        for b, h in chosen:
            for i in _sample_rows(length, rng, extra):
                sub = row_spec(spec, b, h, i, i + 1)
                o, g, _ = exact_forward(sub, dtype, return_lse=True)
                count += 1
                if not _same(o[0, 0, 0], out[b, h, i]) or not _same(g[0, 0, 0], lse[b, h, i]):
                    diffs.append(f"out/lse[{dtype}] row {(b, h, i)}")
                if dq is not None:  # dbias of the one-row spec has the row's own shape
                    sub = dataclasses.replace(
                        sub, bias_shape=None if sub.bias is None else sub.bias.shape
                    )
                    ref = exact_vjp(
                        sub,
                        do[b : b + 1, h : h + 1, i : i + 1],
                        None if dl is None else dl[b : b + 1, h : h + 1, i : i + 1],
                        out.dtype,
                        engine="referee",
                    )[0]
                    if not _same(ref[0, 0, 0], dq[b, h, i]):
                        diffs.append(f"dq[{dtype}] row {(b, h, i)}")
    return diffs, count


def _check(name: str, full_below: int, planes: int, extra: int, sample: str = ""):
    from oracle import catalogue

    case = catalogue.get(name)
    inputs = catalogue.make_inputs(case)
    n = case.shapes
    macs = n.batch * n.H * n.L * n.S * (n.D + n.E)
    start = time.perf_counter()
    if macs <= full_below and not (sample and sample in name):
        diffs, how = _whole(case, inputs), "whole"
    else:
        diffs, rows = _sampled(case, inputs, planes, extra)
        how = f"{rows} sampled rows"
    return name, how, diffs, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="append", default=None)
    parser.add_argument(
        "--full-below",
        type=int,
        default=2_000_000,
        help="multiply-adds below which a case is compared whole",
    )
    parser.add_argument("--planes", type=int, default=4)
    parser.add_argument("--random-rows", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--match", default="", help="only cases whose name contains this")
    parser.add_argument(
        "--sample",
        default="",
        help="compare cases whose name contains this on sampled rows only "
        "(e.g. grad-gap: the referee's whole vjp takes minutes)",
    )
    args = parser.parse_args(argv)
    from oracle import catalogue

    names = []
    for suite in args.suite or ["default"]:
        for case in catalogue.suite(suite):
            if case.function == "attention" and args.match in case.name and case.name not in names:
                names.append(case.name)
    print(f"{len(names)} attention cases; load {os.getloadavg()[0]:.1f}", flush=True)
    bad = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [
            pool.submit(_check, name, args.full_below, args.planes, args.random_rows, args.sample)
            for name in names
        ]
        for future in futures:
            name, how, diffs, seconds = future.result()
            bad += bool(diffs)
            print(
                f"{'DIFF' if diffs else 'same'} {name}: {how}, {seconds:.1f} s"
                + (f": {diffs[:5]}" if diffs else ""),
                flush=True,
            )
    print(f"{len(names) - bad} of {len(names)} cases identical; load {os.getloadavg()[0]:.1f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
