"""``validate(..., workers=N)`` / ``refattn-oracle validate --workers N``: cases run in N
supervised worker processes concurrently; the results (invariance checks included) come in
case order and are those of the serial run."""

from __future__ import annotations

import io

import pytest

from oracle.run.validate import validate

_CASES = ["basic-*", "causal-*", "gqa-*", "mask-*"]


def _same(result: dict) -> dict:
    """A result's dict without its wall time."""
    return {k: v for k, v in result.items() if k != "seconds"}


@pytest.mark.slow
def test_workers_give_the_serial_results_in_case_order(monkeypatch):
    options = dict(suite="smoke", dtype="float32", cases=_CASES, checks="determinism")
    serial = validate("tests.planted.broken_impls:missing_scale", progress=False, **options)
    bar = io.StringIO()
    monkeypatch.setattr("sys.stderr", bar)
    parallel = validate(
        "tests.planted.broken_impls:missing_scale", progress=True, workers=2, **options
    )
    assert [_same(r.to_dict()) for r in parallel.results] == [
        _same(r.to_dict()) for r in serial.results
    ]
    assert any(r.verdict == "fail" for r in parallel.results)
    assert any(r.name.endswith("::determinism") for r in parallel.results)
    assert "4/4" in bar.getvalue()  # the bar advanced over every case
    assert parallel.isolated


def test_workers_argument_and_in_process_callables():
    with pytest.raises(ValueError, match="workers: expected an integer >= 1"):
        validate("refattn-float64", suite="smoke", workers=0, progress=False)
    # a lambda cannot run in a worker process: it runs serially in this one
    report = validate(
        lambda q, k, v, **o: __import__("refattn").attention(q, k, v, **o),
        suite="smoke",
        dtype="float64",
        cases=["basic-*"],
        workers=2,
        progress=False,
    )
    assert [r.verdict for r in report.results] == ["pass"] and not report.isolated


def test_kept_worker_is_reused_across_runs():
    from oracle.run import worker_cache

    options = dict(suite="smoke", dtype="float64", cases=["basic-*"], progress=False)
    try:
        for _ in range(2):
            report = validate("refattn-float64", keep_worker=True, **options)
            assert [r.verdict for r in report.results] == ["pass"]
        (kept,) = worker_cache._KEPT.values()
        assert kept.starts == 1  # one worker process served both runs
    finally:
        worker_cache.close_kept()
