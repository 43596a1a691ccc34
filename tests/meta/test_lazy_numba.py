"""Numba is imported by the first call that runs a kernel, not by ``import refattn`` nor by the
oracle's command line (its start-up, 0.4 s, is most of a validation's start-up), while every
public name of :mod:`refattn.kernels` and :mod:`refattn.exact.fast` still resolves; so are the
exact engine's mpmath and the variants (gmm, mgk, meanfield, hopfield, transformer) and their
bounds, whose names resolve on first access."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import refattn
from refattn import _numba_cache

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    """The output of ``code`` in a fresh interpreter importing this checkout."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_refattn_and_the_oracle_cli_leave_numba_out():
    found = _run("""
        import sys
        import refattn, oracle.cli
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite")))
    """)
    assert found == "[]"


def test_import_refattn_and_the_oracle_cli_leave_the_exact_engine_and_the_variants_out():
    found = _run("""
        import sys
        import refattn, oracle.cli
        heavy = ("mpmath", "refattn.transformer", "refattn.gmm", "refattn.meanfield",
                 "refattn.mgk", "refattn.hopfield", "refattn.bounds.transformer")
        print([m for m in heavy if m in sys.modules])
    """)
    assert found == "[]"


def test_the_lazy_names_are_the_modules_own():
    import refattn.bounds as bounds
    from oracle.judging import tolerance
    from refattn.exact.rounding import UndecidedRoundingError
    from refattn.transformer import decoder_block

    assert refattn.decoder_block is decoder_block
    assert refattn.UndecidedRoundingError is UndecidedRoundingError
    assert {"gmm", "decoder_block", "merge_states"} <= set(dir(refattn)) | set(refattn.__all__)
    assert tolerance.mixture_bound is bounds.mixture_bound
    assert "transformer_forward_bound" in dir(bounds)
    with pytest.raises(AttributeError):
        tolerance.not_a_bound  # noqa: B018


def test_the_float64_forward_and_its_judging_leave_numba_out(tmp_path):
    from oracle import catalogue
    from oracle.fixtures import golden

    golden.generate(
        "smoke",
        tmp_path,
        progress=False,
        cases=[catalogue.get("basic-H2K2-L5S7-D8E8-f64")],
    )
    found = _run(f"""
        import sys
        from oracle.fixtures import golden
        from oracle.judging.judge import check_fixture
        from oracle.run.impls import resolve_impl

        impl, _ = resolve_impl("refattn-float64")
        (fixture,) = golden.load({str(tmp_path)!r})
        result = check_fixture(impl, fixture, tolerance="both")
        print(result.verdict, result.tight.verdict, "numba" in sys.modules)
    """)
    assert found == "pass pass False"


def test_the_cache_guard_runs_before_numba_is_imported():
    found = _run("""
        import builtins, sys
        seen = []
        real = builtins.__import__

        def spy(name, *args, **kwargs):
            if name.split(".")[0] == "numba" and not seen:
                seen.append("refattn._numba_cache" in sys.modules)
            return real(name, *args, **kwargs)

        builtins.__import__ = spy
        import refattn.kernels.numba_cpu
        print(seen)
    """)
    assert found == "[True]"


def test_public_names_resolve_on_first_access():
    from refattn import exact, kernels, spec

    for name in kernels.__all__:
        assert getattr(kernels, name) is not None, name
    assert kernels.numba_cpu.__name__ == "refattn.kernels.numba_cpu"
    assert exact.fast.fast_exact_forward.__module__ == "refattn.exact.fast.forward"
    for name in exact.fast.__all__:
        assert getattr(exact.fast, name) is not None, name
    assert set(kernels.__all__) <= set(dir(kernels))
    assert refattn.kernels is kernels
    # the compiled rule is the plain one, compiled once
    assert spec.key_interval_jit is spec.key_interval_jit
    args = (3, 0, 10, True, -1, -1)
    assert spec.key_interval_jit(*args) == spec.key_interval(*args)
    assert kernels.attention.__module__ == "refattn.kernels._dispatch"


def test_missing_names_raise_attribute_error():
    from refattn import exact, kernels

    for module in (refattn, kernels, exact.fast):
        try:
            module.no_such_name  # noqa: B018 - the access is the test
        except AttributeError as err:
            assert "no_such_name" in str(err)
        else:
            raise AssertionError(f"{module.__name__}.no_such_name resolved")


def test_the_cache_guard_still_sees_the_lazy_packages_imports():
    # the packages' imports under TYPE_CHECKING stay edges of the guard's import graph
    root = Path(refattn.__file__).parent
    kernels = {full for _, full in _numba_cache._imports(root, "refattn", "kernels/__init__.py")}
    fast = {full for _, full in _numba_cache._imports(root, "refattn", "exact/fast/__init__.py")}
    assert "refattn.kernels._dispatch.attention" in kernels
    assert "refattn.exact.fast.forward.fast_exact_forward" in fast
