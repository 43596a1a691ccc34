"""Reports of issue 25 (item 5): the summary first, unsupported cases collapsed into one table,
ulp only where meaningful, indices in the caller's layout, the FlashAttention-style ratio, a
(query, key) map for key-position bugs, and an HTML report that stays small."""

from __future__ import annotations

import numpy as np

from oracle.judging.results import CaseResult, Check, Worst
from oracle.judging.tolerance import Threshold
from oracle.report.formats import summary_table, to_html
from oracle.report.run_report import Report
from oracle.report.summary import key_alignment, ulp_meaningful, unsupported_groups


def _check(quantity, passed, error, truth=1.0, value=None, index=(0, 1, 2, 3)):
    value = truth + error if value is None else value
    threshold = Threshold(2.0, 1e-7, 1e-6, 2**-24)
    worst = Worst(quantity, index, value, truth, error, error * 2**23, 1e-6)
    errors = np.full((1, 2, 4, 4), error)
    return Check(quantity, passed, error, 0 if passed else 16, 32, threshold, worst, errors)


def _report(layout="bhld"):
    results = [
        CaseResult(
            "ok-L4S8", "conformance", "float32", "pass", checks={"out": _check("out", True, 1e-7)}
        ),
        CaseResult(
            "bad-L4S97",
            "conformance",
            "float32",
            "fail",
            "out: 16 of 32 elements over",
            diagnosis=["matches no scale (scale=1)"],
            checks={"out": _check("out", False, 0.3)},
        ),
    ]
    for i in range(7):
        results.append(
            CaseResult(
                f"sinks-{i}",
                "conformance",
                "float32",
                "unsupported",
                "the implementation does not accept sinks= (unexpected keyword)",
            )
        )
    results.append(
        CaseResult("paged-1", "conformance", "float32", "unsupported", "no kv_lengths for 12 rows")
    )
    report = Report("demo", "float32", "suite default", False, results)
    report.use_layout(layout)
    return report


def test_summary_first_and_unsupported_collapsed():
    text = summary_table(_report())
    lines = text.splitlines()
    assert lines[2].startswith("conformance: 1 pass, 1 fail, 8 unsupported"), text
    assert text.index("Coverage") < text.index("Worst failures") < text.index("case ")
    assert not any(line.startswith("sinks-") for line in lines), text
    assert "      7  sinks=" in text and "      1  no kv_lengths for N rows" in text
    assert unsupported_groups(_report().results) == {"sinks=": 7, "no kv_lengths for N rows": 1}
    assert "x textbook" in text and "3e+06" in text  # 0.3 / baseline 1e-7


def test_ulp_only_where_meaningful():
    near_zero = Worst("out", (0,), 1e-3, 1e-9, 1e-8, 1.43e5, 1e-6)
    assert not ulp_meaningful(near_zero)
    assert "ulp not shown" in near_zero.describe()
    assert ulp_meaningful(Worst("out", (0,), 1.0 + 1e-6, 1.0, 1e-6, 8.4, 1e-7))
    row = [line for line in summary_table(_report()).splitlines() if line.startswith("ok-")][0]
    assert "ulp" not in row and "e+" not in row.split()[5], row  # passing: "-"


def test_indices_in_the_callers_layout():
    text = summary_table(_report("blhd"))
    assert "out[0, 2, 1, 3] (blhd order)" in text, text
    assert "out[0, 1, 2, 3] =" in summary_table(_report())


def test_key_alignment_names_a_dropped_key():
    rng = np.random.default_rng(0)
    L, S, E = 6, 40, 8
    v = rng.standard_normal((1, S, E))
    w = rng.random((1, L, S))
    w /= w.sum(-1, keepdims=True)
    truth = w @ v
    dropped = w.copy()
    dropped[..., 33] = 0
    dropped /= dropped.sum(-1, keepdims=True)
    grid = key_alignment(dropped @ v, truth, v)
    assert grid.shape == (L, S) and (grid.argmax(axis=-1) == 33).all()


def test_html_summary_first_and_small(tmp_path):
    report = _report()
    for i in range(40):
        check = _check("out", False, 0.5)
        check.errors = np.abs(np.random.default_rng(i).standard_normal((1, 2, 500, 64)))
        report.results.append(
            CaseResult(
                f"big-{i}",
                "conformance",
                "float32",
                "fail",
                checks={"out": check},
                key_map=np.random.default_rng(i).random((500, 300)).astype(np.float32),
            )
        )
    page = to_html(report, tmp_path / "r.html").read_text()
    assert page.index("Summary") < page.index("Coverage") < page.index("<h2>Cases")
    assert len(page) < 1_000_000, len(page)
    assert page.count("<img") <= 12


def test_unsupported_table_shows_real_shapes():
    """Every group whose message has numbers keeps one real message (its shapes) under its
    N row."""
    from types import SimpleNamespace

    from oracle.report.summary import unsupported_lines

    results = [
        SimpleNamespace(verdict="unsupported", message="k (1, 2, 40, 32): L = 5 != S = 7"),
        SimpleNamespace(verdict="unsupported", message="k (1, 2, 60, 32): L = 6 != S = 9"),
        SimpleNamespace(verdict="unsupported", message="alone: L = 3 != S = 4"),
    ]
    text = "\n".join(unsupported_lines(results))
    assert "e.g. k (1, 2, 40, 32): L = 5 != S = 7" in text
    assert "e.g. alone: L = 3 != S = 4" in text
