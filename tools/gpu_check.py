#!/usr/bin/env python
"""The GPU half of refattn's regression suite, in one run with a JSON summary.

On a CUDA machine (about 8 minutes on one H100 with the ``default`` fixtures)::

    python tools/gpu_check.py --fixtures fixtures/ --out gpu-summary/

Rehearsal on a CPU, with the numba.cuda simulator and torch on the CPU (tiny suite)::

    NUMBA_ENABLE_CUDASIM=1 python tools/gpu_check.py --rehearse --out /tmp/gpu-rehearsal/

Phases, each recorded in ``<out>/summary.json`` as soon as it ends (the file is rewritten
atomically, so a run cut short still leaves the phases it finished):

``kernels``
    refattn's numba.cuda forward and backward kernels (``--impl cuda`` of the oracle) over the
    fixtures in every dtype they take, both tolerance tiers, gradients included: the
    conformance verdict counts and every failing case.
``agreement``
    the CUDA kernels against the Numba CPU kernels on the same cases, element by element: how
    many outputs (and gradients) are bit-identical, the largest difference in units of the
    compute dtype's roundoff, and the cases that differ. The CPU kernels evaluate ``a * b + c``
    as two roundings; NVVM contracts it into one fused multiply-add, and the CPU kernels
    also sum in another order (64-key tiles, SIMD across outputs) than the one-thread-per-row
    CUDA kernels: agreement is measured, not required (both must pass the conformance cases;
    refattn's kernel error bounds hold for both). Differences are given in units of the compute
    dtype's epsilon times the array's largest magnitude. Each case also runs twice on the
    device: a bit difference between the two runs is counted as non-determinism.
``torch``
    torch's CUDA SDPA with each backend forced (flash, efficient, cuDNN, math) and compiled
    flex_attention (:mod:`tools.gpu_impls`), through ``--framework torch --device cuda`` in
    bfloat16, float16 and float32, both tiers, gradients included; plus ``determinism`` and
    ``batch-invariance`` checks in the default tier. Every failure keeps the oracle's diagnosis.
``timing``
    refattn's CUDA forward and backward against torch SDPA (flash and math) on the same GPU at
    B1 H8 L=S=4096 D128 and a GQA decode L1 S=32768 H32 K8 D128 (median of ``--repeats``
    runs after one warm-up), as ratios to SDPA math in the same run.

``--budget`` (seconds, default 450) stops starting new work when it is spent; what was skipped
is listed in the summary. Exit status 0 when refattn's kernels failed no conformance case
(torch's results are findings, not refattn's failures), 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tools"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
# the oracle's supervised workers import tools.gpu_impls by name
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
)

KERNEL_DTYPES = ("float64", "float32", "float16", "bfloat16")
TORCH_DTYPES = ("bfloat16", "float16", "float32")
TIERS = ("default", "tight")
TORCH_IMPLS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_compiled")
#: flex_attention compiles once per shape: by default it runs on these case families only
FLEX_CASES = (
    "basic-*",
    "causal-*",
    "gqa-*",
    "mask-random-*",
    "softcap-*",
    "window-*",
    "k-tile-causal-*",
    "grad-causal-br-*",
    "grad-gqa-*",
)


class Summary:
    """The JSON summary, rewritten atomically after every phase."""

    def __init__(self, out: Path, meta: dict):
        self.path = out / "summary.json"
        self.data = {"meta": meta, "phases": {}, "skipped": []}
        self.write()

    def phase(self, name: str, value) -> None:
        self.data["phases"][name] = value
        self.write()

    def skip(self, what: str, why: str) -> None:
        self.data["skipped"].append({"what": what, "why": why})
        print(f"skipped {what}: {why}", flush=True)
        self.write()

    def write(self) -> None:
        temp = self.path.with_name(self.path.name + ".tmp")
        temp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(temp, self.path)


class Clock:
    def __init__(self, budget: float):
        self.start, self.budget = time.monotonic(), budget

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)


def _report_digest(report) -> dict:
    failing = [r for r in report.results if r.verdict in ("fail", "error")]
    return {
        "counts": report.counts(),
        "conformance": report.counts("conformance"),
        "passed": bool(report.passed),
        "failures": [
            {
                "case": r.name,
                "category": r.category,
                "verdict": r.verdict,
                "message": getattr(r, "message", ""),
                "diagnosis": list(getattr(r, "diagnosis", []) or []),
            }
            for r in failing[:40]
        ],
        "failures_listed": min(len(failing), 40),
        "failures_total": len(failing),
    }


def _validate(impl, source, dtype, tier, **kw):
    from oracle.run.validate import validate

    report = validate(impl, dtype=dtype, tolerance=tier, grads=True, progress=False, **source, **kw)
    print(f"  {getattr(impl, 'name', impl)} {dtype} {tier}: {report.counts()}", flush=True)
    return report


def phase_kernels(summary, clock, source, dtypes):
    from oracle.adapters.refattn_kernels import RefattnCuda

    impl = RefattnCuda()
    results, ok = {}, True
    for dtype in dtypes:
        for tier in TIERS:
            if clock.left() <= 0:
                summary.skip(f"kernels {dtype} {tier}", "budget spent")
                continue
            started = time.monotonic()
            try:
                report = _validate(impl, source, dtype, tier, isolate=False)
            except ValueError as exc:  # no case of this dtype
                results[f"{dtype}/{tier}"] = {"error": str(exc)}
                continue
            digest = _report_digest(report)
            digest["seconds"] = round(time.monotonic() - started, 1)
            results[f"{dtype}/{tier}"] = digest
            ok &= digest["conformance"].get("fail", 0) == 0
            ok &= digest["conformance"].get("error", 0) == 0
    summary.phase("kernels", {"passed": ok, "runs": results})
    return ok


def _fixtures(source, patterns=None):
    import fnmatch

    from oracle.fixtures import golden

    if patterns:
        chosen = _fixtures(source)
        return [
            f
            for f in chosen
            if any(fnmatch.fnmatch(f.case.name.lower(), p.lower()) for p in patterns)
        ]

    if "fixtures" in source:
        fixtures = source["fixtures"]
        return golden.load(fixtures) if isinstance(fixtures, str) else fixtures
    from oracle import catalogue

    return [golden.build(c) for c in catalogue.suite(source["suite"])]


def _ulps(a, b, dtype):
    """Largest |a - b| in units of the compute dtype's epsilon times the array's largest |b|
    (an element-wise ulp count would explode where a weighted sum cancels to near zero)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(a) & np.isfinite(b)
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(b[finite]).max()), np.finfo(dtype).tiny)
    return float(np.abs(a[finite] - b[finite]).max() / (scale * np.finfo(dtype).eps))


def _same_bits(a, b) -> bool:
    import numpy as np

    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return all(
        x is None and y is None or np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(a, b, strict=True)
    )


def phase_ptx(summary):
    """What the compiler made of the kernels: fused multiply-adds, flush-to-zero, approximate
    division or transcendental instructions in the PTX of every compiled kernel."""
    from refattn.kernels import cuda as refattn_cuda

    found = {}
    for dtype, kernels in refattn_cuda._KERNELS.items():  # noqa: SLF001 (a tool's look inside)
        for name, kernel in zip(("forward", "grad_q", "grad_kv"), kernels, strict=True):
            try:
                listing = kernel.inspect_asm()
            except Exception as exc:  # the simulator has no PTX
                found[f"{dtype}/{name}"] = f"no PTX: {type(exc).__name__}"
                continue
            text = "\n".join(listing.values()) if isinstance(listing, dict) else str(listing)
            found[f"{dtype}/{name}"] = {
                "fma": text.count("fma.rn"),
                "ftz": text.count(".ftz"),
                "approx": text.count(".approx"),
                "div_full": text.count("div.full"),
            }
    summary.phase("ptx", found)


def phase_agreement(summary, clock, source):
    """CUDA vs CPU Numba kernels, bit by bit, on every attention conformance fixture."""
    import numpy as np

    from oracle.adapters.refattn_kernels import RefattnCuda, RefattnNumba
    from oracle.judging.passing import passed_options

    gpu, cpu = RefattnCuda(), RefattnNumba()
    totals = {
        "cases": 0,
        "elements": 0,
        "identical": 0,
        "max_ulps": 0.0,
        "errors": 0,
        "nondeterministic_cases": 0,
    }
    differing = []
    for fixture in _fixtures(source):
        if clock.left() <= 0:
            summary.skip("agreement (rest)", "budget spent")
            break
        case = fixture.case
        if getattr(case, "category", "") != "conformance" or "q" not in fixture.inputs:
            continue
        inputs = fixture.inputs
        options = passed_options(dict(fixture.options))
        pairs = []
        try:
            first = gpu(inputs["q"], inputs["k"], inputs["v"], **options)
            again = gpu(inputs["q"], inputs["k"], inputs["v"], **options)
            pairs.append(("out", first, cpu(inputs["q"], inputs["k"], inputs["v"], **options)))
            if "grad_out" in inputs:
                grad_options = {n: x for n, x in options.items() if n != "return_lse"}
                args = (inputs["q"], inputs["k"], inputs["v"], inputs["grad_out"])
                pairs.append(
                    ("grads", gpu.vjp(*args, **grad_options), cpu.vjp(*args, **grad_options))
                )
        except NotImplementedError:
            continue
        except Exception as exc:  # a kernel error is a finding: record it, go on
            totals["errors"] += 1
            differing.append({"case": case.name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        totals["cases"] += 1
        if not _same_bits(first, again):
            totals["nondeterministic_cases"] += 1
            differing.append({"case": case.name, "what": "out", "nondeterministic": True})
        for what, a, b in pairs:
            a_list = a if isinstance(a, tuple) else (a,)
            b_list = b if isinstance(b, tuple) else (b,)
            for x, y in zip(a_list, b_list, strict=True):
                if x is None or y is None:
                    continue
                x, y = np.asarray(x), np.asarray(y)
                same = (x.view(np.uint8) == y.view(np.uint8)).reshape(x.shape + (-1,)).all(-1)
                totals["elements"] += int(same.size)
                totals["identical"] += int(same.sum())
                if not same.all():
                    ulps = _ulps(x, y, np.float64 if x.dtype == np.float64 else np.float32)
                    totals["max_ulps"] = max(totals["max_ulps"], ulps)
                    differing.append(
                        {
                            "case": case.name,
                            "what": what,
                            "elements": int((~same).sum()),
                            "max_ulps": ulps,
                        }
                    )
    totals["bit_identical_fraction"] = (
        totals["identical"] / totals["elements"] if totals["elements"] else None
    )
    summary.phase("agreement", {**totals, "differing": differing[:60]})


def phase_torch(summary, clock, source, device, impls, dtypes, flex_cases):
    from tools.gpu_impls import IMPLS

    results = {}
    for name in impls:
        for dtype in dtypes:
            for tier in TIERS:
                if clock.left() <= 0:
                    summary.skip(f"torch {name} {dtype} {tier}", "budget spent")
                    continue
                checks = ("determinism", "batch-invariance") if tier == "default" else ()
                subset = {"cases": list(flex_cases)} if name == "flex_compiled" else {}
                started = time.monotonic()
                try:
                    report = _validate(
                        IMPLS[name],
                        source,
                        dtype,
                        tier,
                        framework="torch",
                        device=device,
                        checks=checks,
                        **subset,
                    )
                except (ImportError, ValueError) as exc:
                    results[f"{name}/{dtype}/{tier}"] = {"error": f"{type(exc).__name__}: {exc}"}
                    continue
                digest = _report_digest(report)
                digest["seconds"] = round(time.monotonic() - started, 1)
                results[f"{name}/{dtype}/{tier}"] = digest
                summary.phase("torch", results)
    summary.phase("torch", results)


def _median_time(fn, repeats, sync):
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def phase_timing(summary, clock, shapes, device, repeats):
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from refattn.kernels import cuda as refattn_cuda
    from refattn.spec import canonicalize

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for label, (batch, heads, kv_heads, length, keys, dim) in shapes.items():
        if clock.left() <= 0:
            summary.skip(f"timing {label}", "budget spent")
            continue
        rng = np.random.default_rng(0)
        q = rng.standard_normal((batch, heads, length, dim)).astype(np.float32)
        k = rng.standard_normal((batch, kv_heads, keys, dim)).astype(np.float32)
        v = rng.standard_normal((batch, kv_heads, keys, dim)).astype(np.float32)
        grad = rng.standard_normal((batch, heads, length, dim)).astype(np.float32)
        spec = canonicalize(q, k, v)
        row = {"shape": label}
        row["refattn_cuda_forward_s"] = _median_time(
            lambda spec=spec: refattn_cuda.attention(spec), repeats, sync
        )
        row["refattn_cuda_backward_s"] = _median_time(
            lambda spec=spec, grad=grad: refattn_cuda.attention_vjp(spec, grad), repeats, sync
        )
        tq, tk, tv = (torch.from_numpy(a).to(device) for a in (q, k, v))
        tgrad = torch.from_numpy(grad).to(device)
        gqa = heads != kv_heads
        for backend, tag in ((SDPBackend.MATH, "math"), (SDPBackend.FLASH_ATTENTION, "flash")):
            dtype = torch.float32 if tag == "math" else torch.bfloat16
            a, b, c, g = (t.to(dtype) for t in (tq, tk, tv, tgrad))

            def forward(a=a, b=b, c=c, backend=backend, gqa=gqa):
                with sdpa_kernel([backend]), torch.no_grad():
                    F.scaled_dot_product_attention(a, b, c, enable_gqa=gqa)

            def backward(a=a, b=b, c=c, backend=backend, gqa=gqa, g=g):
                leaves = [t.detach().requires_grad_(True) for t in (a, b, c)]
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(*leaves, enable_gqa=gqa)
                out.backward(g)

            try:
                row[f"torch_{tag}_forward_s"] = _median_time(forward, repeats, sync)
                row[f"torch_{tag}_fwd_bwd_s"] = _median_time(backward, repeats, sync)
            except RuntimeError as exc:
                row[f"torch_{tag}"] = f"refused: {exc}".splitlines()[0]
        if "torch_math_forward_s" in row:
            row["ratio_refattn_fwd_to_math"] = (
                row["torch_math_forward_s"] / row["refattn_cuda_forward_s"]
            )
        rows.append(row)
        print(f"  timing {label}: {row}", flush=True)
    summary.phase("timing", rows)


FULL_SHAPES = {
    "prefill B1 H8 L=S=4096 D128": (1, 8, 8, 4096, 4096, 128),
    "GQA decode B1 H32 K8 L1 S=32768 D128": (1, 32, 8, 1, 32768, 128),
}
REHEARSAL_SHAPES = {"tiny B1 H2 L=S=32 D16": (1, 2, 2, 32, 32, 16)}


def main(argv=None) -> int:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc.split("\n\n", 1)[1],
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--fixtures", type=Path, help="directory from `refattn-oracle generate`")
    source.add_argument("--suite", help="suite built in memory (default: default)")
    parser.add_argument("--out", type=Path, required=True, help="folder for summary.json")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds (default 450)")
    parser.add_argument(
        "--phases", default="kernels,agreement,torch,timing", help="comma list of phases"
    )
    parser.add_argument("--torch-impls", default=",".join(TORCH_IMPLS))
    parser.add_argument(
        "--flex-case",
        action="append",
        metavar="PATTERN",
        help="cases for compiled flex_attention (repeatable; default: a few families)",
    )
    parser.add_argument(
        "--case",
        action="append",
        metavar="PATTERN",
        help="only fixtures whose case name matches (repeatable; every phase)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="CPU rehearsal: smoke suite, torch on the CPU (sdpa_math only), tiny timing shape",
    )
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - {"kernels", "agreement", "torch", "timing"}
    if unknown:
        parser.error(f"--phases: unknown {sorted(unknown)}")
    if args.fixtures is not None and not (args.fixtures / "manifest.json").is_file():
        parser.error(f"--fixtures: {args.fixtures} has no manifest.json")
    args.out.mkdir(parents=True, exist_ok=True)

    from refattn.kernels import cuda as refattn_cuda

    if not refattn_cuda.available():
        print(
            "gpu_check: no CUDA device and no simulator (NUMBA_ENABLE_CUDASIM=1)", file=sys.stderr
        )
        return 2
    simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    device = "cpu" if args.rehearse else "cuda"
    src = (
        {"fixtures": str(args.fixtures)}
        if args.fixtures
        else {"suite": args.suite or ("smoke" if args.rehearse else "default")}
    )
    meta = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "source": src,
        "simulator": simulated,
        "rehearsal": args.rehearse,
    }
    try:
        import numba
        import torch

        meta.update(numba=numba.__version__, torch=torch.__version__)
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(0)
            meta["cuda"] = torch.version.cuda
    except ImportError as exc:
        meta["import_problem"] = str(exc)
    summary = Summary(args.out, meta)
    clock = Clock(args.budget)
    if "suite" in src or args.case:  # exact truths once, not once per phase, dtype and tier
        print("reading or building the fixtures", flush=True)
        src = {"fixtures": _fixtures(src, args.case)}
        if not src["fixtures"]:
            print(f"gpu_check: no fixture matches --case {args.case}", file=sys.stderr)
            return 2
    kernel_ok = True
    if "kernels" in phases:
        print("phase kernels", flush=True)
        kernel_ok = phase_kernels(summary, clock, src, KERNEL_DTYPES)
        phase_ptx(summary)
    if "agreement" in phases:
        print("phase agreement", flush=True)
        phase_agreement(summary, clock, src)
    if "torch" in phases:
        print("phase torch", flush=True)
        impls = ["sdpa_math"] if args.rehearse else args.torch_impls.split(",")
        dtypes = ("float32",) if args.rehearse else TORCH_DTYPES
        flex = tuple(args.flex_case or FLEX_CASES)
        phase_torch(summary, clock, src, device, impls, dtypes, flex)
    if "timing" in phases:
        print("phase timing", flush=True)
        shapes = REHEARSAL_SHAPES if args.rehearse else FULL_SHAPES
        phase_timing(summary, clock, shapes, device, 1 if args.rehearse else args.repeats)
    summary.data["meta"]["seconds"] = round(time.monotonic() - clock.start, 1)
    summary.data["kernels_passed"] = kernel_ok
    summary.write()
    print(f"summary: {summary.path}", flush=True)
    return 0 if kernel_ok else 1


if __name__ == "__main__":
    sys.exit(main())
