"""``refattn-oracle``: generate and verify golden fixtures, validate implementations.

Commands::

    refattn-oracle generate --suite NAME --out DIR [--dtype D ...] [--workers N] [--wait]
                            [--executor dask --scheduler ADDRESS]
    refattn-oracle verify DIR
    refattn-oracle validate (--adapter NAME | --impl module:function) ...
                            (--suite NAME | --fixtures DIR) [--dtype D] [--case PATTERN ...]
                            [--json F] [--junit F] [--html F [--plots WHICH]] [--strict]
                            [--grads] [--require FEATURE ...] [--timeout SECONDS]
                            [--memory-limit MIB] [--in-process] [--workers N]
                            [--refusals-are-errors]
                            [--executor dask --scheduler ADDRESS]
    refattn-oracle list [suites | cases --suite NAME | adapters]

``generate`` takes an exclusive lock on DIR (a second writer fails, or waits with ``--wait``)
and exits with 2 and a one-line message for an unusable destination (empty, a file, not
writable, full disk), ``--workers`` below 1 or an unknown suite; a rerun into DIR resumes and
removes the temporary files of a run killed with SIGKILL; ``verify`` prints one line per
problem and exits with 1, never a traceback. ``validate`` runs each case in a supervised
worker process (reused from case to case): an implementation that exits, hangs past
``--timeout``, crashes or exhausts ``--memory-limit`` gets the verdict "error" for that case
and the run goes on. Case patterns are case-insensitive; a selection of zero cases is a usage
error. ``validate`` exits with 0 only when no case fails (robustness and refusal cases count only
with ``--strict``), 1 when some case fails and 2 with one ``refattn-oracle: error:`` line on a
usage error: a bad ``--impl`` path or a module that raises, has a syntax error or exits at
import (a run that judged no case never exits 0), an unknown adapter, suite, feature or check, a
missing directory, an unusable report path (``--json``/``--junit``/``--html``: checked before
the run) or an interrupt (Ctrl-C). Progress goes to
stderr, the summary to stdout. An implementation that raises KeyboardInterrupt inside a case
gets the verdict "error" for it (the worker ignores SIGINT, so only the implementation can raise
it there); with ``--in-process`` it cannot be told from Ctrl-C and aborts the run (exit 2), and
nothing protects the run from ``os._exit``. ``--impl``/``--adapter`` may be repeated and mixed:
each implementation gets its own summary (headed ``== <impl>: passed|FAILED`` with ``--quiet``)
and report files ``NAME-<impl>.json``..., and the exit code is 1 if any fails. ``--executor dask
--scheduler ADDRESS`` runs the cases (generate) or the (implementation, case) pairs (validate) on
a Dask cluster (:mod:`oracle.run.distribute`); the fixtures are byte-identical to local ones.
``list cases`` with an unknown suite is exit 2 too.

Examples
--------
>>> main(["list", "suites"])  # doctest: +ELLIPSIS
smoke ...
0
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from pathlib import Path

from oracle import adapters, catalogue
from oracle.catalogue.names import DTYPES
from oracle.cli.export import add_export_parser, run_export_command
from oracle.conventions import signatures
from oracle.conventions.layouts import LAYOUTS
from oracle.conventions.merge import CONVENTIONS as MERGE_CONVENTIONS
from oracle.conventions.merge import FLASHINFER as MERGE_FLASHINFER
from oracle.conventions.merge import adapt
from oracle.diagnose.budget import DEFAULT_MULTIPLE
from oracle.fixtures import golden
from oracle.power import add_parser as add_power_parser
from oracle.power import run_command
from oracle.report.formats import PLOT_HINT, coverage_lines, plotting_available
from oracle.run import validate as V  # the module (callable), see oracle/__init__.py
from oracle.run.distribute import dask_runner, validate_many
from oracle.run.impls import locate_impl
from oracle.run.invariance import CHECKS as INVARIANCE_CHECKS
from oracle.run.supervise import MAX_TIMEOUT

__all__ = ["main", "console", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (the usage text stays behind ``--help``)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="refattn-oracle",
        description="Golden fixtures for attention and validation of implementations against "
        "refattn's exact truth.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _add_generate(sub)
    _add_verify(sub)
    _add_validate(sub)
    _add_list(sub)
    add_export_parser(sub)
    add_power_parser(sub)
    return parser


def _add_generate(sub) -> None:
    """The ``generate`` command."""
    gen = sub.add_parser("generate", help="write one .npz per case and manifest.json")
    gen.add_argument("--suite", default="default", help="suite name (default: %(default)s)")
    gen.add_argument("--out", required=True, help="output directory")
    gen.add_argument(
        "--dtype",
        action="append",
        choices=DTYPES,
        help="only these dtypes (repeatable; default: all)",
    )
    gen.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes (default: %(default)s; the bytes do not depend on "
        "it; try the number of cores, os.cpu_count())",
    )
    gen.add_argument(
        "--wait",
        action="store_true",
        help="wait for another generate writing into --out instead of failing",
    )
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    _executor_args(gen, "cases, and blocks of one large case,")


def _add_verify(sub) -> None:
    """The ``verify`` command."""
    ver = sub.add_parser("verify", help="check the sha256 of every fixture in DIR")
    ver.add_argument("directory")


def _add_validate(sub) -> None:
    """The ``validate`` command (its options in the order of ``--help``)."""
    val = sub.add_parser("validate", help="validate an implementation")
    _validate_selection_args(val)
    _validate_report_args(val)
    _validate_judging_args(val)
    _validate_convention_args(val)
    _validate_check_args(val)
    _validate_run_args(val)


def _validate_selection_args(val) -> None:
    """What is validated: implementations, cases and the dtype."""
    val.add_argument(
        "--adapter",
        action="append",
        default=[],
        help="adapter name (see `refattn-oracle list adapters`; repeatable)",
    )
    val.add_argument(
        "--impl",
        action="append",
        default=[],
        help="module:function of impl(q, k, v, **options) (repeatable)",
    )
    src = val.add_mutually_exclusive_group()
    src.add_argument("--suite", help="suite built in memory (default: smoke)")
    src.add_argument("--fixtures", help="directory written by `refattn-oracle generate`")
    val.add_argument(
        "--dtype",
        default="float32",
        choices=(*DTYPES, "all"),
        help="implementation dtype (default: %(default)s)",
    )
    val.add_argument(
        "--case",
        action="append",
        metavar="PATTERN",
        help="only cases matching this fnmatch pattern (repeatable)",
    )


def _validate_report_args(val) -> None:
    """Report files."""
    val.add_argument("--json", metavar="FILE", help="write a JSON report")
    val.add_argument("--junit", metavar="FILE", help="write a JUnit XML report")
    val.add_argument(
        "--html", metavar="FILE", help="write an HTML report (plots need refattn[plot])"
    )
    val.add_argument(
        "--plots",
        choices=("failures", "all", "none"),
        default="failures",
        help="plots in the HTML report: the 12 worst failing cases (default), every case, or none",
    )


def _validate_judging_args(val) -> None:
    """How cases are judged: strictness, tolerance tier, gradients, required features."""
    val.add_argument(
        "--strict", action="store_true", help="robustness and refusal failures fail the run"
    )
    val.add_argument(
        "--tolerance",
        choices=("default", "tight", "both"),
        default="default",
        help="tolerance tier: default (no false alarm on any correct algorithm) "
        "or tight (the expected error of a correct float32-accumulating "
        "kernel: narrower accumulation fails), or both (one call per case, a report "
        "per tier); see oracle.judging.tolerance",
    )
    val.add_argument(
        "--grads",
        action="store_true",
        help="also check impl.vjp (gradient cases are 'unsupported' without one)",
    )
    val.add_argument(
        "--require",
        action="append",
        metavar="FEATURE",
        default=[],
        help="fail unless some case with FEATURE was judged (repeatable or comma "
        "list: causal, mask, gqa, long-rows, gradients, window, bias, ...)",
    )


def _validate_convention_args(val) -> None:
    """The implementation's conventions: layout, framework, device, signature, merge."""
    val.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="bhld",
        help="the implementation's layout (default: %(default)s; see oracle.conventions.layouts)",
    )
    val.add_argument(
        "--framework",
        choices=("numpy", "torch", "jax"),
        default="numpy",
        help="arrays the implementation takes (default: %(default)s)",
    )
    val.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="device of torch tensors (default: %(default)s)",
    )
    signatures.add_arguments(val)
    val.add_argument(
        "--merge-convention",
        choices=MERGE_CONVENTIONS,
        default=None,
        help="merge cases (suites merge-*): impl(outs, lses), impl(out_a, lse_a, out_b, "
        "lse_b), or FlashInfer's merge_state / merge_states (torch, base-2 lse; also as "
        "--signature); runs in process (see oracle.conventions.merge)",
    )


def _validate_check_args(val) -> None:
    """Invariance checks."""
    val.add_argument(
        "--check",
        action="append",
        metavar="CHECK",
        default=[],
        help="invariance checks on every conformance case, each its own verdict "
        "(comma list or repeatable): " + ", ".join(INVARIANCE_CHECKS) + "; bits that differ "
        "within the tolerance are a warning",
    )
    val.add_argument(
        "--strict-invariance",
        action="store_true",
        help="invariance warnings (bits differ, within the tolerance) fail the run",
    )


def _validate_run_args(val) -> None:
    """How the run goes: timeouts, memory, workers, executor, refusals."""
    val.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds one case may take before it is an error (default: 300; "
        "each case runs in a supervised worker process)",
    )
    val.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        metavar="MIB",
        help="address space of the worker process in MiB (default: no limit)",
    )
    val.add_argument(
        "--in-process",
        action="store_true",
        help="run the implementation in this process (no timeout or crash "
        "protection; for debugging with pdb)",
    )
    val.add_argument(
        "--diagnose-budget",
        type=float,
        default=DEFAULT_MULTIPLE,
        metavar="MULTIPLE",
        help="a failing case's diagnosis may take MULTIPLE times its judging time "
        "(default: %(default)g; inf: unbounded); a diagnosis that ran out says what it "
        "tried (see oracle.diagnose.budget)",
    )
    val.add_argument("--quiet", action="store_true", help="no progress bar, failures only")
    _executor_args(val, "(implementation, case) pairs")
    val.add_argument(
        "--refusals-are-errors",
        action="store_true",
        help="an implementation's refusal of a case (ValueError '... must match', "
        "'not supported'...; see oracle.judging.refused) is an error, not 'unsupported'",
    )
    val.add_argument(
        "--workers",
        type=int,
        default=1,
        help="supervised worker processes running cases concurrently (default: "
        "%(default)s; results in case order, as a serial run's)",
    )


def _add_list(sub) -> None:
    """The ``list`` command."""
    lst = sub.add_parser("list", help="list suites, cases or adapters")
    lst.add_argument("what", nargs="?", default="suites", choices=("suites", "cases", "adapters"))
    lst.add_argument("--suite", default="default")
    lst.add_argument("--dtype", choices=DTYPES)


def _executor_args(parser, what: str) -> None:
    parser.add_argument(
        "--executor",
        choices=("local", "dask"),
        default="local",
        help=f"where {what} run: local processes (default) or a Dask cluster "
        f"(needs refattn[dask] and --scheduler)",
    )
    parser.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="Dask scheduler address, e.g. tcp://host:8786 (--executor dask)",
    )


def _executor_problem(args) -> str | None:
    if args.executor == "dask" and not args.scheduler:
        return "--executor dask needs --scheduler ADDRESS (e.g. tcp://host:8786)"
    if args.executor != "dask" and args.scheduler:
        return "--scheduler is used only with --executor dask"
    return None


def _err(message) -> int:
    print(f"refattn-oracle: error: {message}", file=sys.stderr)
    return 2


def _generate(args) -> int:
    if args.workers < 1:
        return _err(f"--workers: expected an integer >= 1, got {args.workers}")
    problem = _executor_problem(args)
    if problem:
        return _err(problem)
    runner = None
    if args.executor == "dask":
        runner = dask_runner(args.scheduler)
    try:
        path = golden.generate(
            args.suite,
            args.out,
            dtypes=args.dtype,
            workers=args.workers,
            progress=not args.quiet,
            wait=args.wait,
            runner=runner,
        )
    except ImportError as err:
        return _err(str(err))
    except (golden.FixtureError, ValueError, KeyError) as err:
        return _err(str(err).strip('"'))
    except OSError as err:
        where = f" ({err.filename})" if err.filename else ""
        return _err(
            f"writing fixtures into {args.out!r} failed: {err.strerror or err}{where}; "
            f"the files already written are complete and a rerun resumes"
        )
    print(f"fixtures written to {path}")
    return 0


def _verify(args) -> int:
    problems = golden.verify(args.directory)
    for problem in problems:
        print(problem)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 0 if not problems else 1


def _validate(args) -> int:
    specs = [*args.impl, *args.adapter]
    if not specs:
        return _err("give the implementation: --adapter NAME or --impl module:function")
    problem = _executor_problem(args) or _limits_problem(args, MAX_TIMEOUT)
    if args.tolerance == "both" and args.executor == "dask":
        problem = "--tolerance both: not with --executor dask (run each tier)"
    if problem:
        return _err(problem)
    if args.impl and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # console scripts do not put the cwd on sys.path
    for spec in specs:
        try:  # isolated runs import the module in the worker only (oracle.run.supervise)
            (V.resolve_impl if args.in_process else locate_impl)(spec)
        except (ImportError, AttributeError, TypeError, ValueError, KeyError) as err:
            return _err(str(err).strip('"'))
    if args.fixtures is not None and not Path(args.fixtures).is_dir():
        return _err(
            f"--fixtures {args.fixtures}: no such directory "
            f"(write one with `refattn-oracle generate --out {args.fixtures}`)"
        )
    problem = _report_paths_problem(args, specs)
    if problem:
        return _err(problem)
    memory = None if args.memory_limit is None else int(args.memory_limit * 2**20)
    options = dict(
        suite=args.suite,
        fixtures=args.fixtures,
        dtype=None if args.dtype == "all" else args.dtype,
        grads=args.grads,
        strict=args.strict,
        cases=args.case,
        isolate=not args.in_process,
        timeout=args.timeout,
        memory_limit=memory,
        require=args.require,
        checks=args.check,
        layout=args.layout,
        framework=args.framework,
        device=args.device,
        tolerance=args.tolerance,
        **signatures.options_of(args),
        strict_invariance=args.strict_invariance,
        diagnose_budget=args.diagnose_budget,
    )
    if not args.diagnose_budget > 0:  # NaN too
        return _err(f"--diagnose-budget: expected a multiple > 0, got {args.diagnose_budget:g}")
    if args.workers < 1:
        return _err(f"--workers: expected an integer >= 1, got {args.workers}")
    if args.executor != "dask":
        options["workers"] = args.workers
    if args.refusals_are_errors:
        options["refusals_are_errors"] = True
    if not (args.html and args.plots == "all"):  # no plot of a passing check is drawn
        options["keep_arrays"] = False
    if (
        args.merge_convention
        or (args.suite or "").startswith("merge")
        or (args.signature in MERGE_FLASHINFER)
    ):
        problem = _merge_problem(args)
        if problem:
            return _err(problem)
        specs, options = _merge_specs(args, specs, options, V.resolve_impl)
    try:
        if args.executor == "dask":
            reports = validate_many(specs, scheduler=args.scheduler, **options)
        else:
            reports = {
                spec: V.validate(
                    specs[spec] if isinstance(specs, dict) else spec,
                    progress=not args.quiet,
                    **options,
                )
                for spec in specs
            }
    except ImportError as err:
        return _err(str(err))
    except (KeyError, ValueError) as err:
        return _err(str(err).strip('"'))
    if args.tolerance == "both":  # one call per case judged in both tiers: a report per tier
        reports = {
            f"{s}@{t}": r
            for s, x in reports.items()
            for t, r in (("default", x), ("tight", x.tight))
        }
    for spec, report in reports.items():
        problem = _print_report(args, report, spec if len(reports) > 1 else None)
        if problem:
            return _err(problem)
    return 0 if all(report.passed for report in reports.values()) else 1


def _merge_problem(args) -> str | None:
    """Why the flags cannot run merge cases (an attention preset on a merge suite)."""
    if args.signature is not None and args.signature not in MERGE_FLASHINFER:
        return (
            f"--signature {args.signature} is an attention preset; merge suites take "
            f"--merge-convention or --signature {' / '.join(MERGE_FLASHINFER)}"
        )
    if args.signature and args.merge_convention and args.signature != args.merge_convention:
        return f"--signature {args.signature} conflicts with --merge-convention"
    return None


def _merge_specs(args, specs, options, resolve_impl):
    """The implementations in the stacked convention, and the validate options for them."""

    convention = args.merge_convention or args.signature or "stacked"
    framework = "torch" if convention in MERGE_FLASHINFER else args.framework
    adapted = {}
    for spec in specs:
        fn = adapt(resolve_impl(spec)[0], convention, framework, args.device)
        fn.impl_spec = spec  # the reproduce line names it, with the merge flags
        adapted[spec] = fn
    options = {n: x for n, x in options.items() if n != "signature"}
    options.update(isolate=False, framework="numpy", layout="bhld")
    return adapted, options


def _limits_problem(args, max_timeout: float) -> str | None:
    # `not x > 0` is also true for NaN; inf overflows the clock / the int of RLIMIT_AS
    if args.timeout is not None and not 0 < args.timeout <= max_timeout:
        return f"--timeout: expected seconds in (0, {max_timeout:g}], got {args.timeout:g}"
    if args.memory_limit is not None and not 0 < args.memory_limit < 2**43:
        return f"--memory-limit: expected MiB in (0, {2**43:g}), got {args.memory_limit:g}"
    return None


_REPORT_FLAGS = ("json", "junit", "html")


def _report_paths_problem(args, specs) -> str | None:
    """Why a report file cannot be written, checked before the run (a run of hours must not
    end in a traceback at the last step)."""
    for flag in _REPORT_FLAGS:
        path = getattr(args, flag)
        if path is None:
            continue
        for spec in specs if len(specs) > 1 else [None]:
            problem = _output_file_problem(_per_impl(path, spec))
            if problem:
                return f"--{flag} {path or repr(path)}: {problem}"
    return None


def _output_file_problem(path: str) -> str | None:
    if not path:
        return "expected a file path, got an empty string"
    file = Path(path)
    if file.is_dir():
        return "is a directory; expected a file path"
    folder = file.parent
    if not folder.is_dir():
        return f"folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK) or (file.exists() and not os.access(file, os.W_OK)):
        return "not writable"
    return None


def _print_report(args, report, spec) -> str | None:
    """Summary and report files of one implementation (``spec`` names it when there are
    several: each file name gets ``-<spec>`` before its suffix); why a file could not be
    written, or None."""
    if args.quiet and spec is not None:  # several implementations: say whose lines follow
        print(f"== {spec}: {'passed' if report.passed else 'FAILED'}")
    print(
        report.summary()
        if not args.quiet
        else "\n".join(r.explain() for r in report.failures) or "no failures"
    )
    if args.quiet and report.untested:
        print("\n".join(coverage_lines(report)[-4:]))
    for flag in _REPORT_FLAGS:
        if getattr(args, flag) is None:
            continue
        path = _per_impl(getattr(args, flag), spec)
        try:
            if flag == "html":
                report.to_html(path, plots=args.plots)
            else:
                getattr(report, f"to_{flag}")(path)
        except OSError as err:  # checked before the run; the disk can still fill up
            return f"--{flag} {path}: cannot write the report ({err.strerror or err})"
    if args.html:
        if not plotting_available():
            print(f"refattn-oracle: {PLOT_HINT}", file=sys.stderr)
    return None


def _per_impl(path: str, spec) -> str:
    if spec is None:
        return path
    tag = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)
    file = Path(path)
    return str(file.with_name(f"{file.stem}-{tag}{file.suffix}"))


def _list(args) -> int:
    if args.what == "suites":
        for name in catalogue.suite_names():
            print(f"{name} {len(catalogue.suite(name))} cases")
    elif args.what == "cases":
        try:
            cases = catalogue.suite(args.suite)
        except (KeyError, ValueError) as err:
            return _err(str(err).strip('"'))
        for case in cases:
            if args.dtype is None or case.dtype == args.dtype:
                grads = " grads" if case.grads else ""
                print(f"{case.name}  [{case.category}{grads}]  {case.description}")
    else:
        usable = set(adapters.available())
        for name in adapters.names():
            print(f"{name}  {'available' if name in usable else 'not installed'}")
    return 0


def _power(args) -> int:
    try:
        return run_command(args)
    except (golden.FixtureError, ValueError, KeyError) as err:
        return _err(str(err).strip('"'))


def main(argv=None) -> int:
    """Entry point of ``refattn-oracle`` (returns the exit code)."""
    args = build_parser().parse_args(argv)
    handler = {
        "generate": _generate,
        "verify": _verify,
        "validate": _validate,
        "list": _list,
        "export": run_export_command,
        "power": _power,
    }[args.command]
    try:
        return handler(args)
    except OSError as err:  # a path that vanished or became unusable mid-run: one line
        where = f" ({err.filename})" if err.filename else ""
        return _err(f"{err.strerror or err}{where}")
    except KeyboardInterrupt:  # Ctrl-C (or, with --in-process, raised by the implementation)
        return _err("interrupted")


def console() -> None:
    """Entry point of the ``refattn-oracle`` script and ``python -m oracle``: :func:`main`,
    then the process ends with its exit code (:func:`exit_now`)."""
    exit_now(main())


def exit_now(code) -> None:
    """End the process with ``code`` once the exit handlers have run and stdout and stderr are
    flushed, without tearing the interpreter down: freeing every module and object of a
    validation (NumPy, numba, refattn, the fixtures) took 0.1-0.15 s after its report was
    written, a tenth of a fast implementation's run of ``default`` in one dtype. Every file
    the commands write is closed by then (:mod:`oracle.fixtures.atomic`, the reports) and the
    workers are stopped. With another Python thread still running (a Dask client), or a
    stream that cannot be flushed (a closed pipe), the interpreter exits as usual instead
    (it waits for the thread; it reports the stream's error)."""
    if isinstance(code, int) and threading.active_count() == 1:
        try:
            atexit._run_exitfuncs()  # they are cleared: the usual exit below does not rerun them
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
        except Exception:  # noqa: BLE001 - the usual exit reports it
            pass
        else:
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    console()
