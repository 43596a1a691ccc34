"""oracle.run.validate, reports, the refattn-oracle CLI and the pytest plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np
import pytest

import oracle
from oracle import catalogue
from oracle.cli import main
from oracle.fixtures import golden
from oracle.judging.judge import check_fixture
from oracle.report.run_report import Report
from oracle.run.validate import resolve_impl, validate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from tests.planted.broken_impls import missing_scale, textbook  # noqa: E402


@pytest.fixture(scope="module")
def smoke():
    return [golden.build(case) for case in catalogue.suite("smoke") if case.function == "attention"]


def _first(fixtures, category="conformance", dtype="float32"):
    return next(f for f in fixtures if f.case.category == category and f.case.dtype == dtype)


def test_pass_and_report_fields(smoke):
    report = validate(textbook, fixtures=smoke, dtype="float32", progress=False)
    assert isinstance(report, Report) and report.passed, report.summary()
    result = report.results[0]
    assert result.verdict == "pass" and result.worst is not None
    assert result.worst.error <= result.worst.threshold, result.explain()
    assert set(result.checks) >= {"out", "lse"}, result.checks


def test_oracle_validate_is_callable_after_submodule_import():
    report = oracle.validate("refattn-float64", suite="smoke", dtype="float64", progress=False)
    assert report.passed and report.results, report


def test_unsupported_is_never_a_pass(smoke):
    def impl(q, k, v, **options):
        raise NotImplementedError("no such option here")

    result = check_fixture(impl, _first(smoke))
    assert result.verdict == "unsupported" and "no such option" in result.message, result


def test_error_keeps_the_message(smoke):
    def impl(q, k, v, **options):
        raise ValueError("boom at row 3")

    result = check_fixture(impl, _first(smoke))
    assert result.verdict == "error" and "ValueError: boom at row 3" in result.message
    report = Report("x", "float32", "test", False, [result])
    assert not report.passed


def test_wrong_shape_fails(smoke):
    def impl(q, k, v, return_lse=False, **options):
        return textbook(q, k, v, **options)[..., :-1]

    result = check_fixture(impl, _first(smoke))
    assert result.verdict == "error" and "shape" in result.message, result.explain()


def test_impl_without_return_lse(smoke):
    def impl(
        q,
        k,
        v,
        *,
        scale=None,
        causal=False,
        align="top_left",
        gqa="interleave",
        mask=None,
        bias=None,
        empty_rows="zero",
    ):
        return textbook(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            align=align,
            gqa=gqa,
            mask=mask,
            bias=bias,
            empty_rows=empty_rows,
        )

    result = check_fixture(impl, _first(smoke))
    assert result.verdict == "pass" and "lse" not in result.checks, result.explain()


def test_failure_reports_worst_element(smoke):
    fixture = _first(smoke)
    result = check_fixture(missing_scale, fixture, reproduce="cmd")
    worst = result.checks["out"].worst
    assert result.verdict == "fail" and worst.error > worst.threshold, result.explain()
    assert worst.ulp > 1 and len(worst.index) == 4, worst
    truth = fixture.truth.get("out_f64", fixture.truth["out"])
    assert worst.truth == float(np.asarray(truth)[worst.index]), worst
    text = result.explain()
    for piece in ("truth", "threshold", "diagnosis: matches no scale", "reproduce: cmd"):
        assert piece in text, text


def _leaky(q, k, v, return_lse=False, **options):
    """Dense weights @ v: 0 * NaN poison leaks into the output (as many peers do)."""
    out = textbook(q, k, v, **options)
    if any(not np.isfinite(np.asarray(x, dtype=np.float64)).all() for x in (k, v)):
        out = np.full_like(out, np.nan)
    return out


def test_robustness_fails_only_when_strict(smoke):
    lenient = validate(_leaky, fixtures=smoke, dtype="float32", progress=False)
    strict = validate(_leaky, fixtures=smoke, dtype="float32", strict=True, progress=False)
    robust = [r for r in lenient.results if r.category == "robustness"]
    assert robust and all(r.verdict == "fail" for r in robust), lenient.summary()
    assert lenient.passed and not strict.passed, (lenient.summary(), strict.summary())
    assert "--strict" in lenient.summary()


def test_resolve_impl_errors():
    with pytest.raises(ImportError, match="no_such_module"):
        resolve_impl("no_such_module:f")
    with pytest.raises(AttributeError, match="nope"):
        resolve_impl("tests.planted.broken_impls:nope")
    with pytest.raises(ValueError, match="module:function"):
        resolve_impl("tests.planted.broken_impls:")
    with pytest.raises(KeyError, match="unknown adapter"):
        resolve_impl("no-such-adapter")


def test_reports_json_junit_html(smoke, tmp_path):
    report = validate(missing_scale, fixtures=smoke, dtype="float32", progress=False)
    data = json.loads(report.to_json(tmp_path / "r.json"))
    assert data["passed"] is False and json.loads((tmp_path / "r.json").read_text()) == data
    failing = [r for r in data["results"] if r["verdict"] == "fail"]
    assert failing and failing[0]["worst"]["index"] and failing[0]["reproduce"], failing[0]
    root = ET.fromstring(report.to_junit(tmp_path / "r.xml"))
    n_conformance = sum(r.category == "conformance" for r in report.results)
    assert int(root.get("failures")) == n_conformance, root.attrib
    path = report.to_html(tmp_path / "r.html")
    page = path.read_text()
    assert report.results[0].name in page
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "pip install refattn[plot]" in page
    else:
        assert "data:image/png;base64," in page


def test_cli_validate_exit_codes(tmp_path, capsys):
    args = ["validate", "--suite", "smoke", "--dtype", "float32", "--quiet"]
    assert main([*args, "--impl", "tests.planted.broken_impls:textbook"]) == 0
    assert (
        main(
            [
                *args,
                "--impl",
                "tests.planted.broken_impls:missing_scale",
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
        == 1
    )
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is False
    out = capsys.readouterr().out
    assert (
        "reproduce: refattn-oracle validate --impl tests.planted.broken_impls:missing_scale" in out
    ), out
    assert main([*args, "--impl", "no_such_module:f"]) == 2
    assert "cannot import module 'no_such_module'" in capsys.readouterr().err
    assert main([*args, "--adapter", "no-such"]) == 2
    assert (
        main(
            [
                "validate",
                "--impl",
                "tests.planted.broken_impls:textbook",
                "--fixtures",
                str(tmp_path / "missing"),
            ]
        )
        == 2
    )


def test_cli_generate_verify_validate_fixtures(tmp_path, capsys):
    out = tmp_path / "fx"
    assert (
        main(["generate", "--suite", "smoke", "--out", str(out), "--dtype", "float32", "--quiet"])
        == 0
    )
    assert main(["verify", str(out)]) == 0
    assert (
        main(
            [
                "validate",
                "--impl",
                "tests.planted.broken_impls:textbook",
                "--fixtures",
                str(out),
                "--dtype",
                "float32",
                "--quiet",
            ]
        )
        == 0
    )
    assert main(["list", "cases", "--suite", "smoke"]) == 0
    assert "basic-" in capsys.readouterr().out


def _plugin_args():
    """``-p oracle.pytest_plugin`` from a checkout; nothing once the pytest11 entry point is
    installed (registering the module twice is an error in pluggy)."""
    from importlib.metadata import entry_points

    installed = any(ep.name == "refattn_oracle" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "oracle.pytest_plugin"]


def _pytest(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("REFATTN_IMPL", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_pytest_plugin(tmp_path):
    base = [*_plugin_args(), "--pyargs", "oracle", "-q", "--refattn-suite", "smoke"]
    inert = _pytest(*base)
    assert inert.returncode == 0 and "1 skipped" in inert.stdout, inert.stdout
    good = _pytest(*base, "--refattn-impl", "tests.planted.broken_impls:textbook")
    assert good.returncode == 0 and "passed" in good.stdout, good.stdout
    bad = _pytest(*base, "--refattn-impl", "tests.planted.broken_impls:missing_scale", "-rf")
    assert bad.returncode == 1 and "matches no scale" in bad.stdout, bad.stdout
    assert "test_case[basic-H" in bad.stdout, bad.stdout
    skips = tmp_path / "skips.txt"
    skips.write_text("# everything but the robustness case\n*-f32  # all float32\n")
    skipped = _pytest(
        *base,
        "--refattn-impl",
        "tests.planted.broken_impls:missing_scale",
        "--refattn-skips",
        str(skips),
    )
    assert skipped.returncode == 0 and "skipped" in skipped.stdout, skipped.stdout
    wrong = _pytest(*base, "--refattn-impl", "no_such_module:f")
    assert wrong.returncode != 0 and "no_such_module" in wrong.stdout + wrong.stderr


@pytest.mark.slow
def test_pytest_plugin_is_inert_in_other_runs(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    run = _pytest(*_plugin_args(), "-q", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout


def test_python_m_oracle_in_a_fresh_interpreter():
    """`python -m oracle` (= refattn-oracle) with nothing imported beforehand."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "oracle",
            "validate",
            "--impl",
            "tests.planted.broken_impls:missing_scale",
            "--suite",
            "smoke",
            "--quiet",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1 and "matches no scale" in run.stdout, (run.stdout, run.stderr)


_EXIT_SCRIPT = """
import atexit, sys, threading
from oracle.cli import exit_now
atexit.register(lambda: sys.stdout.write("handler ran\\n"))
sys.stdout.write("x" * 100000 + "\\n")  # buffered: written by the flush before the exit
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: None).start()
    threading.Thread(target=threading.Event().wait, args=(0.5,)).start()
exit_now(3)
sys.stdout.write("not reached\\n")
"""


@pytest.mark.parametrize("mode", ["alone", "thread"])
def test_exit_now_runs_the_exit_handlers_and_flushes_first(mode):
    """The command line ends its process without the interpreter's teardown: with the exit
    code, the exit handlers run once and the buffered output written; with another thread
    running, by the usual exit (which waits for it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 3, run.stderr
    assert run.stdout == "x" * 100000 + "\nhandler ran\n", run.stderr


def test_leaked_poison_is_not_diagnosed_as_a_convention():
    """A dense implementation (scores + -inf at excluded positions, then weights @ v) leaks
    NaN from excluded keys; no alternative convention may "explain" that by admitting the
    poisoned key."""
    from oracle.run import validate

    def dense(
        q,
        k,
        v,
        *,
        causal=False,
        window=None,
        align="top_left",
        mask=None,
        bias=None,
        scale=None,
        return_lse=False,
        **options,
    ):
        import refattn

        allowed = refattn.allowed_mask(
            q.shape[-2],
            k.shape[-2],
            mask=mask,
            bias=bias,
            causal=causal,
            window=window,
            align=align,
        )
        q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
        s = (q64 @ np.swapaxes(k64, -1, -2)) * (scale or q.shape[-1] ** -0.5)
        with np.errstate(all="ignore"):
            s = s + np.where(allowed, 0.0, -np.inf) + (0.0 if bias is None else bias)
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            out = (w / w.sum(axis=-1, keepdims=True)) @ v64
        return out.astype(q.dtype)

    report = validate(
        dense, suite="default", dtype="float32", cases=["poison-nan-causal-*"], progress=False
    )
    (result,) = report.results
    assert result.verdict == "fail"
    assert not any("matches" in d for d in result.diagnosis), result.diagnosis
    assert any("poison" in d for d in result.diagnosis), result.diagnosis
