"""Validate an attention implementation against the oracle's cases.

:func:`validate` runs an implementation on every case of a suite (fixtures built in memory by
:func:`oracle.fixtures.golden.build`) or of a fixture directory
(:func:`oracle.fixtures.golden.load`) in one
dtype, judges each output element by the tolerance policy of :mod:`oracle.judging.tolerance`
(normalised error (T1) against the threshold (T2)), diagnoses failures
(:mod:`oracle.diagnose.diagnosis`) and returns a :class:`Report`.

Calling conventions and verdicts are those of :func:`oracle.judging.judge.check_fixture`: attention
cases call ``impl(q, k, v, **options)`` (and ``impl.vjp`` with ``grads``), variant cases
(``Case.function`` other than "attention", suites "variants-smoke" and "variants-default")
``impl(**inputs, **options)`` with the refattn function's parameter names.

Verdicts
--------
``pass`` / ``fail`` (some element over its threshold, a wrong shape, NaN where the truth is
finite...) / ``unsupported`` (the implementation raised NotImplementedError: never a pass) /
``error`` (any other exception; the message is kept). Robustness cases (NaN/Inf poison at
excluded positions) are reported in their own category and make :attr:`Report.passed` false
only with ``strict=True``: refattn guarantees poison never reaches the output, but peers
legitimately compute ``0 * NaN`` there.

Examples
--------
>>> from oracle.run.validate import validate
>>> report = validate("refattn-float64", suite="smoke", dtype="float64", cases=["basic-*"],
...                   progress=False)
>>> report.passed, [r.verdict for r in report.results]
(True, ['pass'])
"""

from __future__ import annotations

import contextlib
import fnmatch
import sys
import threading
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from oracle import catalogue
from oracle.catalogue.case import Case
from oracle.conventions.layouts import check_convention, wrap
from oracle.conventions.signatures import parse_keywords
from oracle.diagnose.budget import DEFAULT_MULTIPLE, DiagnosisBudget, set_reporter
from oracle.diagnose.guidance import FIRST_CASES, check_first_cases
from oracle.fixtures import golden
from oracle.judging import tolerance as tol
from oracle.judging.judge import check_fixture
from oracle.judging.refused import refusals_as_errors
from oracle.reading.features import KNOWN_FEATURES, case_features
from oracle.report.run_report import Report
from oracle.run.impls import adapter_located, is_module_spec, locate_impl, resolve_impl
from oracle.run.invariance import applies, check_invariance, parse_checks
from oracle.run.parallel import more_supervisors, run_in_order, start_concurrently
from oracle.run.prefetch import Prefetched
from oracle.run.progress import Progress
from oracle.run.stored import StoredCases
from oracle.run.supervise import DEFAULT_TIMEOUT, Supervisor
from oracle.run.worker_cache import kept_supervisor

__all__ = ["validate", "resolve_impl", "reproduce_command", "select_cases"]


# ---------------------------------------------------------------------------------------------
# Resolving implementations
# ---------------------------------------------------------------------------------------------


def _impl_name(impl, spec):
    if spec:
        return spec
    return getattr(impl, "name", None) or getattr(impl, "__name__", None) or type(impl).__name__


# ---------------------------------------------------------------------------------------------
# Running a suite
# ---------------------------------------------------------------------------------------------


def _select(items, dtype, cases):
    patterns = [p.lower() for p in cases]
    for item in items:
        case = item.case if hasattr(item, "case") else item
        if dtype is not None and case.dtype != dtype:
            continue
        if patterns and not any(fnmatch.fnmatchcase(case.name.lower(), p) for p in patterns):
            continue
        yield item


def _manifest_names(fixtures, dtype, cases) -> list[str] | None:
    """The names of the manifest's cases that ``dtype`` and the patterns select (None: the
    manifest is unusable, or a case's entry lacks a name or dtype)."""
    entries = _manifest_entries(fixtures, dtype, cases)
    return None if entries is None else [e["name"] for e in entries]


def _manifest_entries(fixtures, dtype, cases) -> list[dict] | None:
    """The manifest's entries of the cases that ``dtype`` and the patterns select (None: as
    :func:`_manifest_names`)."""
    manifest, problems = golden.read_manifest(Path(fixtures), kept=True)  # not changed here
    entries = None if problems or not isinstance(manifest, dict) else manifest.get("cases")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("name"), str) and "dtype" in e for e in entries
    ):
        return None
    patterns = [p.lower() for p in cases]
    return [
        e
        for e in entries
        if (dtype is None or e["dtype"] == dtype)
        and (not patterns or any(fnmatch.fnmatchcase(e["name"].lower(), p) for p in patterns))
    ]


def _stored_cases(fixtures, entries) -> StoredCases | None:
    """The selected cases for a worker that reads their fixtures itself
    (:mod:`oracle.run.stored`), or None when a manifest entry's case cannot be rebuilt (the
    fixtures are then read here, which reports the problem)."""
    try:
        cases = [Case.from_spec(e["spec"]) for e in entries]
    except Exception:  # noqa: BLE001 - golden.load names what is wrong with the manifest
        return None
    return StoredCases(fixtures, [e["name"] for e in entries], cases)


def _patterns(cases) -> list[str]:
    if cases is None:
        return []
    if isinstance(cases, str):
        return [cases]
    patterns = list(cases)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"cases: expected a pattern or a list of patterns (str), got {bad!r}")
    return patterns


def _sources(suite, fixtures, dtype, cases, stored=False):
    """(description, list of Fixture-or-Case); Cases are built lazily. ``stored``: the
    selected cases of a fixture directory as :class:`~oracle.run.stored.StoredCases`, read by
    the worker (when the manifest allows)."""
    if fixtures is not None and suite is not None:
        raise ValueError("validate: give suite= or fixtures=, not both")
    if fixtures is not None:
        if isinstance(fixtures, (str, Path)):
            # only the selected files are read (a directory holds hundreds): the manifest names
            # them; an unusable manifest is load's own clear error
            entries = _manifest_entries(fixtures, dtype, cases)
            names = None if entries is None else [e["name"] for e in entries]
            found = _stored_cases(fixtures, entries) if stored and names else None
            if found is not None:
                return f"fixtures {fixtures}", found, str(fixtures)
            chosen = golden.load(fixtures, names=names, cases=None if names else cases or None)
            items = _select(chosen, dtype, cases)
            # read in a thread while the first cases are judged (oracle.run.prefetch)
            items = Prefetched(items, len(names)) if names else list(items)
            return f"fixtures {fixtures}", items, str(fixtures)
        return "fixtures", list(_select(fixtures, dtype, cases)), None
    suite = "smoke" if suite is None else suite
    if isinstance(suite, str):
        return f"suite {suite}", list(_select(catalogue.suite(suite), dtype, cases)), suite
    return "cases", list(_select(suite, dtype, cases)), None


def select_cases(*, suite=None, fixtures=None, dtype="float32", cases=None) -> list[str]:
    """Names of the cases :func:`validate` would run with these arguments (ValueError if
    none), e.g. to split a run over several machines (:mod:`oracle.run.distribute`)."""
    patterns = _patterns(cases)
    if isinstance(fixtures, (str, Path)) and suite is None:
        names = _manifest_names(fixtures, dtype, patterns)  # names only: no file is read
        if names:
            return names
    label, items, _ = _sources(suite, fixtures, dtype, patterns)
    if not items:
        raise ValueError(
            f"validate: no case selected ({label}, dtype {dtype or 'all'}); a "
            f"run that checks nothing cannot pass"
        )
    return [(item.case if hasattr(item, "case") else item).name for item in items]


def reproduce_command(
    impl_spec,
    source_flag,
    dtype,
    name,
    grads,
    strict,
    tolerance="default",
    check=None,
    convention=None,
    extra_flags="",
):
    """The ``refattn-oracle validate`` command line that re-runs one case (or one of its
    invariance checks); ``extra_flags`` are those of an adapted implementation (a merge
    convention's ``--merge-convention``, ``--framework``)."""
    impl_part = (
        "--impl <module:function>"
        if impl_spec is None
        else (f"--impl {impl_spec}" if ":" in impl_spec else f"--adapter {impl_spec}")
    )
    extra = (
        (" --grads" if grads else "")
        + (" --strict" if strict else "")
        + (f" --tolerance {tolerance}" if tolerance != "default" else "")
        + (f" --check {check}" if check else "")
        + _convention_flags(convention)
        + extra_flags
    )
    return f"refattn-oracle validate {impl_part} {source_flag} --dtype {dtype} --case {name}{extra}"


def _convention_flags(convention) -> str:
    """The command-line flags of a calling convention (those that differ from the default;
    a preset's layout and framework are its own)."""
    convention = dict(convention or {})
    flags = []
    if "signature" in convention:
        preset = convention.pop("signature")
        flags.append(f" --signature {getattr(preset, 'name', preset)}")
        convention.pop("layout", None), convention.pop("framework", None)
    defaults = {"layout": "bhld", "framework": "numpy", "device": "cpu"}
    for name, value in convention.items():
        if name == "keywords":
            flags += [f" --keyword {a}={b}" for a, b in parse_keywords(value).items()]
        elif name == "causal_align":
            flags.append(f" --causal-align {value}")
        elif name == "empty_rows":
            flags.append(f" --empty-rows {value}")
        elif value != defaults[name]:
            flags.append(f" --{name} {value}")
    return "".join(flags)


def validate(
    impl,
    *,
    suite=None,
    fixtures=None,
    dtype="float32",
    grads=False,
    strict=False,
    tolerance="default",
    progress=True,
    cases: str | Iterable[str] | None = None,
    diagnose=True,
    diagnose_budget=DEFAULT_MULTIPLE,
    isolate=True,
    timeout=None,
    memory_limit=None,
    require=(),
    checks=(),
    layout="bhld",
    framework="numpy",
    device="cpu",
    signature=None,
    causal_align=None,
    keywords=None,
    empty_rows=None,
    strict_invariance=False,
    workers=1,
    refusals_are_errors=False,
    keep_worker=False,
    keep_arrays=True,
) -> Report:
    """Validate ``impl`` on a suite or a fixture directory in one dtype.

    Parameters
    ----------
    impl : callable or str
        ``impl(q, k, v, **options)``, ``"module:function"`` or an adapter name.
    suite : str or iterable of Case, optional
        Suite name (fixtures built in memory with :func:`oracle.fixtures.golden.build`); default
        "smoke" when neither suite nor fixtures is given.
    fixtures : path or iterable of Fixture, optional
        A directory written by ``refattn-oracle generate`` (read with
        :func:`oracle.fixtures.golden.load`), or fixtures in memory.
    dtype : {"float64", "float32", "float16", "bfloat16"} or None
        Only cases of this dtype (None: every dtype).
    grads : bool
        Also check ``impl.vjp`` on the cases that carry gradients (a case whose gradients
        cannot be checked because there is no ``vjp`` is "unsupported", never a pass).
    strict : bool
        Robustness failures fail the run too.
    tolerance : {"default", "tight", "both"}
        The tolerance tier (:mod:`oracle.judging.tolerance`): "default" (T2) is free of false alarms
        for any correct algorithm; "tight" (T7) follows the expected error of a correct
        float32-accumulating kernel on the case, so narrower accumulation fails. "both": each
        case's one call judged in both tiers; the default tier's report is returned with the
        tight tier's as its ``tight`` attribute.
    progress : bool
        A progress bar on stderr.
    cases : str or iterable of str, optional
        Only the cases whose names match one of these fnmatch patterns (case-insensitive).
    diagnose : bool
        Diagnose failing cases: which named alternative reading of the conventions (or which
        tiled-kernel bug, narrower precision...) the output matches
        (:mod:`oracle.diagnose.diagnosis`).
    diagnose_budget : float
        A failing case's diagnosis may take this many times the case's judging time
        (default :data:`oracle.diagnose.budget.DEFAULT_MULTIPLE`, 1.5; at least
        :data:`~oracle.diagnose.budget.FLOOR_SECONDS`, 1 s; ``math.inf``: unbounded), all its
        steps together (readings, precision models, where the failing rows concentrate).
        Readings are tried likeliest first and the first costly one that explains the case
        ends the search; one whose evaluation is cheap is always tried (small cases are
        diagnosed the same on any machine); a diagnosis that ran out says so in one line with
        what it tried (:mod:`oracle.diagnose.budget`).
    isolate : bool
        Run the cases in a supervised worker process (:class:`oracle.run.supervise.Supervisor`):
        an implementation that exits, hangs, crashes or exhausts memory gives that case the
        verdict "error" and the run goes on. Needs an importable implementation (a
        ``module:function`` string, an adapter name or a module-level function); other
        callables (lambdas, closures) run in this process and :attr:`Report.isolated` is
        false.
    timeout : float, optional
        Seconds one isolated case may take (default
        :data:`oracle.run.supervise.DEFAULT_TIMEOUT`, 300 s: a JIT-compiled implementation
        compiles on its first call).
    memory_limit : int, optional
        Bytes of address space the worker may use (no limit by default).
    require : str or iterable of str
        Features (see :func:`case_features`; e.g. "causal", "mask", "gqa", "long-rows",
        "gradients") that must be judged (pass or fail) on at least one case, else the run
        fails. Untested headline features are reported in any case.
    checks : str or iterable of str
        Invariance checks of :mod:`oracle.run.invariance` ("determinism", "batch-invariance",
        "padding-invariance", "decode"; a comma list is fine) run on every attention
        conformance case, each its own result ``<case>::<check>`` in category "invariance" (a
        failure fails the run; bits that differ within the tolerance are a "warning").
    layout, framework, device : str
        The implementation's calling convention (:mod:`oracle.conventions.layouts`): layout "bhld"
        (default), "blhd", "packed" (varlen with cu_seqlens) or "paged" (KV cache pages and a
        block table); framework "numpy" (default), "torch" (tensors on ``device``, "cpu" or
        "cuda") or "jax".
    signature : str, optional
        The implementation speaks a library's keywords and conventions
        (:mod:`oracle.conventions.signatures`: "flash_attn", "flash_attn_varlen",
        "flash_attn_with_kvcache", "torch_sdpa", "jax", "flashinfer", "xformers"); it brings
        its layout and framework. A case the library cannot express is "unsupported".
    causal_align : {"top_left", "bottom_right"}, optional
        Without a preset: the alignment the implementation's ``causal`` (window, ALiBi) uses;
        a case of the other alignment with L != S is "unsupported".
    keywords : dict or list of "option=name", optional
        Without a preset: the implementation's names for refattn's options
        (``{"scale": "softmax_scale"}``).
    empty_rows : {"zero", "nan", "average"}, optional
        What the implementation gives rows with no allowed key when it has no option for it
        (:mod:`oracle.judging.empty_rows`): it never receives ``empty_rows``; cases with such
        rows are judged against that reading, those it cannot be judged on (gradients under
        "nan"/"average") are "unsupported". A signature preset may bring its own.
    strict_invariance : bool
        Invariance warnings (bits that differ while the deviating run stays within the
        tolerance) fail the run too.
    workers : int
        Supervised worker processes running cases concurrently (default 1); the results,
        invariance checks included, come in case order and are those of the serial run. An
        implementation that cannot run isolated (a lambda, ``isolate=False``) runs serially in
        this process whatever ``workers`` says.
    refusals_are_errors : bool
        An implementation's refusal of a case (a ValueError "... must match" and the like,
        :mod:`oracle.judging.refused`) is "unsupported" with its message; True makes it "error".
    keep_worker : bool
        Keep the supervised worker process running after the run, for the next run of the
        same implementation in this process (:mod:`oracle.run.worker_cache`; the Dask executor
        sets it: each Dask worker keeps one child across its tasks).
    keep_arrays : bool
        Keep every check's per-element arrays (normalised errors, threshold floors) in the
        report, for :meth:`Report.to_html` with ``plots="all"`` (default). False keeps them
        for failing checks only (:meth:`oracle.judging.results.Check.lighten`; the report's
        figures are the same): a worker reading a fixture directory then sends a fraction of
        the bytes back. ``refattn-oracle validate`` sets it unless ``--plots all``.

    Options equal to :func:`refattn.attention`'s defaults are not passed to the
    implementation (:func:`passed_options`): its own defaults then apply.

    Returns
    -------
    Report
        ``.passed`` and ``.results`` (one :class:`CaseResult` per case).

    Raises
    ------
    ValueError
        No case selected (an empty suite, directory or pattern match): a run that checks
        nothing never passes.
    ImportError
        The implementation cannot be loaded: its module is missing, raises or exits at import,
        or (isolated) the worker process dies or times out loading it. With ``isolate`` a
        ``"module:function"`` is imported in the worker only.
    """
    required = _required(require)
    checks = parse_checks(checks)
    budget = DiagnosisBudget.of(diagnose_budget)  # a clear error for a bad budget
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected an integer >= 1, got {workers!r}")
    tiers = tol.TIERS if tolerance == "both" else (tol.check_tier(tolerance),)
    if dtype is not None:
        tol.unit_roundoff(dtype)  # a clear error for an unknown dtype
    convention = check_convention(
        layout, framework, device, signature, causal_align, keywords, empty_rows
    )
    unwrapped, fn, spec = _implementation(impl, isolate, convention)
    supervisor = _supervisor(
        impl, unwrapped, spec, convention, isolate, keep_worker, timeout, memory_limit
    )
    # one worker, no checks: it reads the fixtures of a directory itself (oracle.run.stored)
    stored = supervisor is not None and workers == 1 and not checks and memory_limit is None
    # the worker loads while the fixtures are read here; one that reads them itself starts
    # after the selection, with the manifest this process has parsed (golden.read_manifest)
    reads_itself = stored and isinstance(fixtures, (str, Path))
    started = None if reads_itself else _start_early(supervisor)
    try:
        label, items, source_flag = _selection(suite, fixtures, dtype, cases, stored)
    except BaseException:
        if started is not None:
            started()
        if supervisor is not None and not keep_worker:
            supervisor.close()
        raise
    if started is None:
        started = _start_early(supervisor)
    run = _Run(
        fn,
        spec,
        source_flag,
        grads,
        strict,
        tolerance,
        diagnose and budget,
        convention,
        checks,
        extra_flags=getattr(unwrapped, "reproduce_flags", ""),  # an adapted merge function's
        keep_arrays=keep_arrays,
    )
    start = time.perf_counter()
    results = _run_items(run, items, supervisor, unwrapped, workers, progress, keep_worker, started)
    if refusals_are_errors:
        refusals_as_errors(results)
    seconds = time.perf_counter() - start
    reports = [
        Report(_impl_name(fn, spec), dtype, label, strict, _of_tier(results, tier), seconds, grads)
        for tier in tiers
    ]
    for report, tier in zip(reports, tiers, strict=True):
        report.isolated = supervisor is not None
        report.required = required
        report.tolerance = tier
        report.use_layout(convention["layout"])
        report.strict_invariance = bool(strict_invariance)
    if len(reports) > 1:
        reports[0].tight = reports[1]
    return reports[0]


def _of_tier(results, tier) -> list:
    """The results of ``tier``: each case's own, or its tight twin (``tolerance="both"``;
    invariance checks have none and count in both)."""
    if tier == "default":
        return list(results)
    return [r.tight if getattr(r, "tight", None) is not None else r for r in results]


def _in_worker(convention) -> bool:
    """Whether a worker process can rebuild the convention (a Signature object cannot)."""
    return isinstance(convention.get("signature", ""), str)


def _implementation(impl, isolate, convention):
    """``(unwrapped, fn, spec)``: the implementation, wrapped in its convention, and the
    ``module:function`` or adapter name a worker resolves it from (both None when only the
    worker imports it)."""
    if isolate and _in_worker(convention) and (is_module_spec(impl) or adapter_located(impl)):
        # only the worker imports it: a module that exits, crashes or hangs at import cannot
        # end this process (with rc 0 for sys.exit(0)) or stall it; Supervisor.start says why
        locate_impl(impl)
        return None, None, impl
    unwrapped, spec = resolve_impl(impl)
    if spec is None and isinstance(impl, str):
        spec = impl
    spec = spec or getattr(unwrapped, "impl_spec", None)  # an adapted merge function's
    return unwrapped, wrap(unwrapped, **convention), spec


def _selection(suite, fixtures, dtype, cases, stored=False):
    """``(label, items, source_flag)``: the selected cases or fixtures and the command-line
    flag that selects them again (ValueError when none is selected)."""
    patterns = _patterns(cases)
    label, items, source_arg = _sources(suite, fixtures, dtype, patterns, stored)
    if not items:
        wanted = f", cases matching {patterns}" if patterns else ""
        raise ValueError(
            f"validate: no case selected ({label}, dtype {dtype or 'all'}"
            f"{wanted}); a run that checks nothing cannot pass "
            f"(see `refattn-oracle list cases`)"
        )
    if source_arg is None:
        source_flag = "<the same fixtures>"
    elif fixtures is not None:
        source_flag = f"--fixtures {source_arg}"
    else:
        source_flag = f"--suite {source_arg}"
    return label, items, source_flag


def _supervisor(impl, unwrapped, spec, convention, isolate, keep_worker, timeout, memory_limit):
    """The supervised worker that runs the cases, or None (the implementation runs in this
    process)."""
    worker_ref = _worker_ref(impl, unwrapped, spec) if isolate else None
    if not _in_worker(convention):
        worker_ref = None
    if worker_ref is not None and convention != check_convention():
        worker_ref = (worker_ref, convention)
    limits = dict(
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout, memory_limit=memory_limit
    )
    if worker_ref is None:
        return None
    if keep_worker:  # a Dask worker keeps its supervised child across tasks
        return kept_supervisor(worker_ref, **limits)
    return Supervisor(worker_ref, **limits)


@dataclass(frozen=True)
class _Run:
    """What judging one case needs: the wrapped implementation, its name for the reproduce
    command, and the settings of the run."""

    fn: object
    spec: str | None
    source_flag: str
    grads: bool
    strict: bool
    tolerance: str
    diagnose: bool
    convention: dict
    checks: tuple
    extra_flags: str = ""
    keep_arrays: bool = True

    def reproduce(self, case) -> str:
        """The command that re-runs ``case``."""
        return reproduce_command(
            self.spec,
            self.source_flag,
            case.dtype,
            case.name,
            self.grads,
            self.strict,
            self.tolerance,
            convention=self.convention,
            extra_flags=self.extra_flags,
        )

    def stored(self, items, worker):
        """The results of the :class:`~oracle.run.stored.StoredCases` ``items``, judged by
        ``worker``, which reads their fixtures (no invariance checks)."""
        return worker.run_stored(
            items,
            [self.reproduce(case) for case in items],
            grads=self.grads,
            diagnose=self.diagnose,
            tolerance=self.tolerance,
            keep_arrays=self.keep_arrays,
        )

    def item(self, item, worker) -> list:
        """The case's result and its invariance checks, run by ``worker`` (or in process)."""
        fixture = golden.build(item) if not hasattr(item, "truth") else item
        repro = self.reproduce(fixture.case)
        judged = dict(
            grads=self.grads, diagnose=self.diagnose, reproduce=repro, tolerance=self.tolerance
        )
        if worker is None:
            result = check_fixture(self.fn, fixture, **judged)
        else:
            result = worker.run(fixture, **judged)
        result.features, result.shape_classes = case_features(
            fixture.case, self.grads, fixture.inputs
        )
        found = [result]
        for check in self.checks if applies(fixture) else ():
            again = reproduce_command(
                self.spec,
                self.source_flag,
                fixture.case.dtype,
                fixture.case.name,
                False,
                False,
                check=check,
                convention=self.convention,
            )
            found.append(_invariance(self.fn, worker, fixture, check, again))
        return found


def _run_items(
    run, items, supervisor, unwrapped, workers, progress, keep_worker, started=None
) -> list:
    """Every item's results in case order, on ``workers`` supervised workers (or in process);
    the workers are closed after (but a kept one). ``started()`` waits for the first
    worker's start begun by :func:`_start_early` and returns its answer."""
    fn, spec = run.fn, run.spec
    results = []
    pool = [supervisor]
    if supervisor is not None and workers > 1:
        pool += more_supervisors(supervisor, min(workers, len(items)) - 1)
    try:
        problem = None if started is None else started()
        if len(pool) > 1 and problem is None:  # every worker loads the implementation at once
            start_concurrently(pool)
        _start_worker(supervisor, spec or _impl_name(fn, spec), problem)
        with (
            Progress(
                len(items), f"validate {_impl_name(fn, spec)}", enabled=progress, stream=sys.stderr
            ) as bar,
            _notes_to(bar, pool),
        ):

            def done(found) -> None:
                results.extend(found)
                bar.advance(f"{found[0].name}: {found[0].verdict}")
                if len(results) <= 8 * FIRST_CASES * (1 + len(run.checks)):
                    check_first_cases(
                        results, lambda: unwrapped or _importable(spec), run.convention, len(items)
                    )

            if isinstance(items, StoredCases):
                for result in run.stored(items, supervisor):
                    _figures(result)  # while the worker judges the next case
                    done([result])
            elif len(pool) > 1:
                run_in_order(items, pool, run.item, done)
            else:
                for item in items:
                    done(run.item(item, supervisor))
    finally:
        for worker in pool:
            if worker is not None and not (keep_worker and worker is supervisor):
                worker.close(wait=False)  # it exits while the report is made
    return results


def _figures(result) -> None:
    """Compute the report's figures of ``result``'s checks (and its tight twin's) now."""
    for found in (result, getattr(result, "tight", None)):
        for check in getattr(found, "checks", {}).values():
            check.figures()


@contextlib.contextmanager
def _notes_to(bar, pool):
    """Progress notes of the diagnoses (oracle.diagnose.budget), in this process or from the
    supervised workers, shown on ``bar`` while the run lasts."""
    previous = set_reporter(bar.note)
    for worker in pool:
        if worker is not None:
            worker.on_note = bar.note
    try:
        yield
    finally:
        set_reporter(previous)
        for worker in pool:
            if worker is not None:
                worker.on_note = None


def _importable(spec):
    """The implementation behind ``spec`` in this process, for guidance only (None if not)."""
    try:
        return resolve_impl(spec)[0] if spec else None
    except Exception:  # noqa: BLE001 - guidance must never replace the run's own error
        return None


def _start_early(supervisor):
    """Begin starting ``supervisor``'s worker: launched here (forked before the fixture-reading
    thread starts, :mod:`oracle.run.forked`), it loads the implementation while this process
    reads the fixtures; returns ``started()``, which waits for it and returns
    :meth:`~oracle.run.supervise.Supervisor.start`'s answer (None: no worker)."""
    if supervisor is None:
        return lambda: None
    answer: list = []

    def start() -> None:
        try:
            answer.append(supervisor.start())
        except BaseException as exc:  # noqa: BLE001 - raised again by started()
            answer.append(exc)

    try:
        supervisor.launch()
    except BaseException as exc:  # noqa: BLE001 - raised again by started()
        answer.append(exc)
        thread = None
    else:
        thread = threading.Thread(target=start, daemon=True)
        thread.start()

    def started():
        if thread is not None:
            thread.join()
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]

    return started


def _start_worker(supervisor, name, problem=None) -> None:
    """Start the worker before the first case (``problem``: the answer of a start already
    made): an implementation it cannot load (the import raised, exited or crashed, a timeout
    or the memory limit) is an ImportError naming it, never a run of "error" verdicts that
    judged nothing."""
    if problem is None and supervisor is not None:
        problem = supervisor.start()
    if problem is None:
        return
    supervisor.close()
    if not problem.startswith(("impl:", "the worker", "timeout")):
        problem = f"loading it in the worker raised {problem}"
    if supervisor.memory_limit and "Memory" in problem:
        problem += f" (under a memory limit of {supervisor.memory_limit / 2**20:g} MiB)"
    raise ImportError(problem if problem.startswith("impl:") else f"impl {name}: {problem}")


def _invariance(fn, supervisor, fixture, check, repro):
    if supervisor is None:
        return check_invariance(fn, fixture, check, reproduce=repro)
    return supervisor.run(fixture, reproduce=repro, check=check)


def _required(require) -> tuple:
    names = [require] if isinstance(require, str) else list(require or ())
    flat = [part.strip().lower() for name in names for part in str(name).split(",") if part.strip()]
    unknown = [f for f in flat if f not in KNOWN_FEATURES]
    if unknown:
        raise ValueError(
            f"require: unknown feature(s) {unknown}; expected some of {list(KNOWN_FEATURES)}"
        )
    return tuple(dict.fromkeys(flat))


def _worker_ref(impl, fn, spec):
    """What a worker process can resolve the implementation from, or None."""
    if isinstance(impl, str):
        return impl
    if spec is not None and ":" in spec and not spec.startswith("__main__:"):
        try:
            resolved, _ = resolve_impl(spec)
        except (ImportError, AttributeError, TypeError, ValueError):
            return None
        return spec if resolved is fn else None
    return None


class _CallableModule(types.ModuleType):
    """``oracle.run.validate`` is both this module and the function: importing the submodule
    (``from oracle.run.validate import Report``) rebinds the package attribute to the module, so
    the module forwards calls to :func:`validate`."""

    def __call__(self, impl, **kwargs) -> Report:
        return validate(impl, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
