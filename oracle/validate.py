"""Validate an attention implementation against the oracle's cases.

:func:`validate` runs an implementation on every case of a suite (fixtures built in memory by
:func:`oracle.golden.build`) or of a fixture directory (:func:`oracle.golden.load`) in one
dtype, judges each output element by the tolerance policy of :mod:`oracle.tolerance`
(normalised error (T1) against the threshold (T2)), diagnoses failures
(:mod:`oracle.diagnose`) and returns a :class:`Report`.

Calling conventions and verdicts are those of :func:`oracle.judge.check_fixture`: attention
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
>>> from oracle.validate import validate
>>> report = validate("refattn-float64", suite="smoke", dtype="float64", cases=["basic-*"],
...                   progress=False)
>>> report.passed, [r.verdict for r in report.results]
(True, ['pass'])
"""

from __future__ import annotations

import fnmatch
import importlib
import sys
import time
import types
from collections.abc import Iterable
from pathlib import Path

from . import catalogue, golden
from . import tolerance as tol
from ._progress import Progress
from .judge import check_fixture
from .results import Report

__all__ = ["validate", "resolve_impl", "reproduce_command"]


# ---------------------------------------------------------------------------------------------
# Resolving implementations
# ---------------------------------------------------------------------------------------------


def resolve_impl(impl):
    """A callable from a callable, ``"module:function"`` (dots allowed after the colon) or an
    adapter name (:func:`oracle.adapters.get`). Returns ``(callable, spec_string_or_None)``."""
    if callable(impl):
        return impl, _callable_spec(impl)
    if not isinstance(impl, str):
        raise TypeError(f"impl: expected a callable, 'module:function' or an adapter name, "
                        f"got {type(impl).__name__}")
    if ":" not in impl:
        from . import adapters
        return adapters.get(impl), None
    module_name, _, attr = impl.partition(":")
    if not module_name or not attr:
        raise ValueError(f"impl: {impl!r} is not of the form 'module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"impl: cannot import module {module_name!r} of {impl!r}: {err} "
                          f"(is it on sys.path / PYTHONPATH?)") from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"impl: module {module_name!r} has no attribute {attr!r} "
                                 f"(from {impl!r})") from None
    if not callable(obj):
        raise TypeError(f"impl: {impl!r} is a {type(obj).__name__}, not a callable")
    return obj, impl


def _callable_spec(impl):
    module = getattr(impl, "__module__", None)
    qualname = getattr(impl, "__qualname__", None)
    if module and qualname and "<" not in qualname and module != "__main__":
        return f"{module}:{qualname}"
    return None


def _impl_name(impl, spec):
    if spec:
        return spec
    return getattr(impl, "name", None) or getattr(impl, "__name__", None) or type(impl).__name__


# ---------------------------------------------------------------------------------------------
# Running a suite
# ---------------------------------------------------------------------------------------------


def _select(items, dtype, cases):
    for item in items:
        case = item.case if hasattr(item, "case") else item
        if dtype is not None and case.dtype != dtype:
            continue
        if cases and not any(fnmatch.fnmatchcase(case.name, p) for p in cases):
            continue
        yield item


def _sources(suite, fixtures, dtype, cases):
    """(description, list of Fixture-or-Case); Cases are built lazily."""
    if fixtures is not None and suite is not None:
        raise ValueError("validate: give suite= or fixtures=, not both")
    if fixtures is not None:
        if isinstance(fixtures, (str, Path)):
            items = list(_select(golden.load(fixtures), dtype, cases))
            return f"fixtures {fixtures}", items, str(fixtures)
        return "fixtures", list(_select(fixtures, dtype, cases)), None
    suite = "smoke" if suite is None else suite
    if isinstance(suite, str):
        return f"suite {suite}", list(_select(catalogue.suite(suite), dtype, cases)), suite
    return "cases", list(_select(suite, dtype, cases)), None


def reproduce_command(impl_spec, source_flag, dtype, name, grads, strict):
    """The ``refattn-oracle validate`` command line that re-runs one case."""
    impl_part = "--impl <module:function>" if impl_spec is None else (
        f"--impl {impl_spec}" if ":" in impl_spec else f"--adapter {impl_spec}")
    extra = (" --grads" if grads else "") + (" --strict" if strict else "")
    return (f"refattn-oracle validate {impl_part} {source_flag} --dtype {dtype} "
            f"--case {name}{extra}")


def validate(impl, *, suite=None, fixtures=None, dtype="float32", grads=False, strict=False,
             progress=True, cases: Iterable[str] | None = None, diagnose=True) -> Report:
    """Validate ``impl`` on a suite or a fixture directory in one dtype.

    Parameters
    ----------
    impl : callable or str
        ``impl(q, k, v, **options)``, ``"module:function"`` or an adapter name.
    suite : str or iterable of Case, optional
        Suite name (fixtures built in memory with :func:`oracle.golden.build`); default
        "smoke" when neither suite nor fixtures is given.
    fixtures : path or iterable of Fixture, optional
        A directory written by ``refattn-oracle generate`` (read with
        :func:`oracle.golden.load`), or fixtures in memory.
    dtype : {"float64", "float32", "float16", "bfloat16"} or None
        Only cases of this dtype (None: every dtype).
    grads : bool
        Also check ``impl.vjp`` on the cases that carry gradients.
    strict : bool
        Robustness failures fail the run too.
    progress : bool
        A progress bar on stderr.
    cases : iterable of str, optional
        Only the cases whose names match one of these fnmatch patterns.

    Returns
    -------
    Report
        ``.passed`` and ``.results`` (one :class:`CaseResult` per case).
    """
    if dtype is not None:
        tol.unit_roundoff(dtype)  # a clear error for an unknown dtype
    fn, spec = resolve_impl(impl)
    if spec is None and isinstance(impl, str):
        spec = impl
    label, items, source_arg = _sources(suite, fixtures, dtype, list(cases or []))
    if source_arg is None:
        source_flag = "<the same fixtures>"
    elif fixtures is not None:
        source_flag = f"--fixtures {source_arg}"
    else:
        source_flag = f"--suite {source_arg}"
    results = []
    start = time.perf_counter()
    with Progress(len(items), f"validate {_impl_name(fn, spec)}", enabled=progress,
                  stream=sys.stderr) as bar:
        for item in items:
            fixture = golden.build(item) if not hasattr(item, "truth") else item
            repro = reproduce_command(spec, source_flag, fixture.case.dtype, fixture.case.name,
                                      grads, strict)
            result = check_fixture(fn, fixture, grads=grads, diagnose=diagnose,
                                   reproduce=repro)
            results.append(result)
            bar.advance(f"{result.name}: {result.verdict}")
    return Report(_impl_name(fn, spec), dtype, label, strict, results,
                  time.perf_counter() - start, grads)



class _CallableModule(types.ModuleType):
    """``oracle.validate`` is both this module and the function: importing the submodule
    (``from oracle.validate import Report``) rebinds the package attribute to the module, so
    the module forwards calls to :func:`validate`."""

    def __call__(self, impl, **kwargs) -> Report:
        return validate(impl, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
