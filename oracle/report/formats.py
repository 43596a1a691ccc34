"""Reports of a validation run: text summary, JSON, JUnit XML, HTML (with optional plots).

Every format carries, per failing case, the worst element (quantity, index, value, truth,
normalised error, ulp), the threshold and how it was formed (T2 of :mod:`oracle.judging.tolerance`),
the diagnosis and a one-line reproduction command.

The HTML report draws error heatmaps and histograms with matplotlib, an optional dependency
(``pip install refattn[plot]``); without it the HTML has the tables and says what to install.

Examples
--------
>>> from oracle.judging.results import CaseResult
>>> from oracle.report.run_report import Report
>>> report = Report("demo", "float32", "suite smoke", False,
...                 [CaseResult("basic-f32", "conformance", "float32", "pass")])
>>> print(summary_table(report).splitlines()[0])
refattn oracle: demo on suite smoke, dtype float32: PASSED
"""

from __future__ import annotations

import base64
import io
import json
import math
import shutil
import textwrap
from pathlib import Path

import numpy as np

from oracle.catalogue.names import STRICT_ONLY
from oracle.diagnose.key_map import max_pool
from oracle.diagnose.tiles import tile_tracking
from oracle.judging.tolerance import FAILURE_PROBABILITY, K_BACKWARD, K_FORWARD
from oracle.report.summary import ulp_meaningful, unsupported_lines, worst_failures

__all__ = [
    "summary_table",
    "grade_lines",
    "to_dict",
    "to_json",
    "to_junit",
    "to_html",
    "PLOT_HINT",
    "ROBUSTNESS_NOTE",
    "REFUSAL_NOTE",
    "plotting_available",
]

_TERMINAL = 120  # assumed width when stdout is not a terminal
_NOTE_WIDTH = 40  # narrowest column the reasons are wrapped to
PLOT_HINT = "install matplotlib for error heatmaps and histograms: pip install refattn[plot]"

ROBUSTNESS_NOTE = (
    "Robustness cases put NaN/Inf into key, value or bias positions that no query may attend. "
    "refattn guarantees such poison never reaches the output; peers legitimately differ "
    "(0 * NaN = NaN in a dense weights @ v), so these cases fail a run only with --strict."
)
#: Printed when a run holds refusal cases (oracle.judging.must_refuse).
REFUSAL_NOTE = (
    "Refusal cases hold malformed inputs (q and k of different head dims, k and v of different "
    "key counts, masks that do not broadcast, kv_lengths past S...) that a kernel must refuse "
    "with an error; an implementation that returns an array fails them. Real peers do not "
    "refuse them all, so they fail a run only with --strict."
)
_CATEGORIES = ("conformance", "robustness", "refusal", "invariance")


def _ratio_text(result) -> str:
    worst = result.worst
    if worst is None:
        return "-"
    if worst.threshold <= 0:
        return "inf"
    ratio = worst.error / worst.threshold
    return "inf" if not math.isfinite(ratio) else f"{ratio:.3g}"


def _ulp_text(result) -> str:
    """The worst element's ulp distance, only on a failing case and where the truth is not far
    below the element's scale (near a cancellation "1e+05 ulp" says nothing)."""
    worst = result.worst
    if worst is None or not result.failed or not ulp_meaningful(worst):
        return "-"
    return f"{worst.ulp:.3g}"


def _textbook_text(result) -> str:
    """The FlashAttention-style ratio of the worst check: its max error over the same-dtype
    textbook's ("-" without a baseline)."""
    worst = result.worst
    check = None if worst is None else result.checks.get(worst.quantity)
    ratio = None if check is None else check.textbook_ratio
    return "-" if ratio is None else f"{ratio:.3g}"


def _headline(report) -> str:
    verdict = "PASSED" if report.passed else "FAILED"
    dtype = report.dtype or "all dtypes"
    tier = "" if report.tolerance == "default" else f", tolerance {report.tolerance}"
    return f"refattn oracle: {report.impl} on {report.source}, dtype {dtype}{tier}: {verdict}"


def _num(x, fmt=".3g"):
    return "-" if x is None else x if isinstance(x, str) else format(x, fmt)


def grade_lines(report) -> list[str]:
    """Accuracy grades per dtype and quantity (:meth:`Report.grades`): fraction correctly
    rounded, error in ulp (median, p99, max), rms normalised error and the error models it
    is consistent with."""
    grades = report.grades()
    if not grades:
        return []
    lines = ["Accuracy grades (passing conformance cases; x textbook: FlashAttention's ratio):"]
    for dtype, by_name in grades.items():
        for name, g in by_name.items():
            rounded = g["correctly_rounded"]
            share = "-" if rounded is None else f"{100 * rounded:.1f}%"
            ratio = g.get("textbook_ratio")
            textbook = "" if ratio is None else f" ({_num(ratio)}x the {dtype} textbook's)"
            lines.append(
                f"  {dtype} {name}: {share} correctly rounded, ulp median "
                f"{_num(g['ulp_median'])} p99 {_num(g['ulp_p99'])} max "
                f"{_num(g['ulp_max'])}, rms error {_num(g['rms_error'])}{textbook}"
            )
            if g["models"]:
                fits = (
                    ", ".join(g["consistent_with"])
                    or "none of the models (nearest: " + _nearest(g) + ")"
                )
                lines += textwrap.wrap(
                    f"consistent with: {fits}",
                    _TERMINAL,
                    initial_indent="    ",
                    subsequent_indent="      ",
                )
    return lines


def _nearest(g) -> str:
    rms = g["rms_error"] or 0.0
    finite = {m: x for m, x in g["models"].items() if isinstance(x, float) and x > 0}
    if not finite or not rms:
        return "-"
    label = min(finite, key=lambda m: abs(math.log(rms / finite[m])))
    return f"{label}, {rms / finite[label]:.2g}x its error"


_COLUMNS = ("case", "category", "verdict", "err/thr", "x textbook", "ulp", "diagnosis / message")


def _case_rows(report) -> list[tuple]:
    """One row per judged or errored case (the unsupported ones are collapsed elsewhere)."""
    rows = []
    for r in report.results:
        if r.verdict == "unsupported":
            continue
        note = "; ".join(r.diagnosis) or (r.message if r.verdict != "pass" else "")
        rows.append(
            (
                r.name,
                r.category,
                r.verdict,
                _ratio_text(r),
                _textbook_text(r),
                _ulp_text(r),
                note,
            )
        )
    return rows


def verdict_lines(report) -> list[str]:
    """Verdict counts per category, then the run's notes (robustness, S mod T tracking)."""
    lines = []
    for category in _CATEGORIES:
        counts = report.counts(category)
        if sum(counts.values()):
            lines.append(
                f"{category}: "
                + ", ".join(f"{n} {v}" for v, n in counts.items() if n or v != "warning")
            )
    warnings = report.counts("invariance")["warning"]
    if warnings:
        fails = "fail the run (--strict-invariance)" if report.strict_invariance else "pass"
        lines.append(
            f"invariance warnings: {warnings} (bits differ, within the tolerance: these {fails})"
        )
    if any(r.category == "robustness" for r in report.results):
        lines.append(f"note: {ROBUSTNESS_NOTE}" + (" (strict: on)" if report.strict else ""))
    if any(r.category == "refusal" for r in report.results):
        lines.append(f"note: {REFUSAL_NOTE}" + (" (strict: on)" if report.strict else ""))
    lines += [f"note: {note}" for note in tile_tracking(report.results)]
    return lines


def worst_lines(report, n=5) -> list[str]:
    """The worst failures, one line each: case, err/thr, FlashAttention ratio, diagnosis."""
    worst = worst_failures(report.results, n)
    if not worst:
        return []
    failing = sum(r.failed for r in report.results)
    lines = [f"Worst failures ({len(worst)} of {failing}; {len(report.failures)} fail the run):"]
    for r in worst:
        note = "; ".join(r.diagnosis) or r.message
        lines.append(
            f"  {r.name}: {r.verdict}, err/thr {_ratio_text(r)}, x textbook "
            f"{_textbook_text(r)}" + (f": {note}" if note else "")
        )
    return lines


def summary_table(report, *, details=True) -> str:
    """Plain text: the summary first (verdict counts, coverage, grades, worst failures), then
    one row per judged case, the unsupported cases as one table, and the failures' details."""
    lines = [_headline(report), "", *verdict_lines(report), "", *coverage_lines(report)]
    grades = grade_lines(report)
    if grades:
        lines += ["", *grades]
    worst = worst_lines(report)
    if worst:
        lines += ["", *worst]
    rows = [_COLUMNS, *_case_rows(report)]
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    indent = sum(widths) + 2 * 6
    # the full reason, wrapped under its column (never cut)
    room = max(_NOTE_WIDTH, shutil.get_terminal_size((_TERMINAL, 24)).columns - indent)
    lines.append("")
    for i, row in enumerate(rows):
        wrapped = textwrap.wrap(row[6], room, break_on_hyphens=False) or [""]
        lines.append(
            ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  ")
            + wrapped[0]
        )
        lines += [" " * indent + more for more in wrapped[1:]]
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 20)
    unsupported = unsupported_lines(report.results)
    if unsupported:
        lines += ["", *unsupported]
    lines.append(f"time: {report.seconds:.2f} s")
    if details:
        failing = [r for r in report.results if r.failed]
        if failing:
            lines += ["", "Failures:"]
            lines += [r.explain() for r in failing]
    return "\n".join(line.rstrip() for line in lines)


def coverage_lines(report) -> list[str]:
    """The coverage table (judged / unsupported / error per feature, dtype and shape class)
    and, prominently, the headline features no case judged."""
    lines = ["Coverage (cases judged / unsupported / error):"]
    for group, rows in report.coverage().items():
        if rows:
            cells = [
                f"{name} {r['judged']}/{r['unsupported']}/{r['error']}" for name, r in rows.items()
            ]
            lines += textwrap.wrap(
                f"{group + ':':9}" + ", ".join(cells), _TERMINAL, subsequent_indent=" " * 9
            )
    untested = report.untested
    if untested:
        required = [f for f in untested if f in report.required]
        lines.append("!" * 60)
        reasons = "; ".join(f"{f} ({report.untested_reason(f)})" for f in untested)
        lines += textwrap.wrap(f"WARNING: NOT TESTED: {reasons}", _TERMINAL)
        if required:
            lines.append(f"FAILED: required by --require: {', '.join(required)}")
        lines.append("!" * 60)
    return lines


def to_dict(report) -> dict:
    """JSON-ready dictionary of the whole run."""
    return {
        "impl": report.impl,
        "dtype": report.dtype,
        "source": report.source,
        "strict": report.strict,
        "grads": report.grads,
        "passed": report.passed,
        "seconds": round(report.seconds, 3),
        "counts": {c: report.counts(c) for c in _CATEGORIES},
        "coverage": report.coverage(),
        "untested": report.untested,
        "required": list(report.required),
        "isolated": report.isolated,
        "tolerance": report.tolerance,
        "grades": report.grades(),
        "policy": {
            "k_forward": K_FORWARD,
            "k_backward": K_BACKWARD,
            "failure_probability": FAILURE_PROBABILITY,
            "threshold": "max(k * baseline_error, floor) + u_out (oracle.judging.tolerance, T2)",
        },
        "results": [r.to_dict() for r in report.results],
    }


def _write(text, path):
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def to_json(report, path=None) -> str:
    """JSON text of :func:`to_dict` (written to ``path`` when given): indented, each case's
    result on one line (``json``'s indenting encoder is pure Python: a run's few hundred
    results took as long as a fast implementation's calls on a tenth of them)."""
    found = to_dict(report)
    results = found.pop("results")
    head = json.dumps(found, indent=2, allow_nan=False)
    lines = ",\n".join("    " + json.dumps(r, allow_nan=False) for r in results)
    body = f"[\n{lines}\n  ]" if results else "[]"
    return _write(f'{head[:-2]},\n  "results": {body}\n}}\n', path)


def to_junit(report, path=None) -> str:
    """JUnit XML: one testcase per case; robustness and refusal failures without ``strict`` are
    skipped
    (with the failure text) so that CI dashboards agree with :attr:`Report.passed`."""
    from xml.etree import ElementTree as ET  # here: a run that writes no JUnit file skips it

    suite = ET.Element(
        "testsuite",
        name=f"refattn-oracle {report.impl}",
        tests=str(len(report.results)),
        time=f"{report.seconds:.3f}",
    )
    n_fail = n_error = n_skip = 0
    for r in report.results:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"refattn_oracle.{r.category}",
            name=r.name,
            time=f"{r.seconds:.4f}",
        )
        text = r.explain()
        if r.verdict == "unsupported":
            ET.SubElement(case, "skipped", message=f"unsupported: {r.message}")
            n_skip += 1
        elif r.failed and r.category in STRICT_ONLY and not report.strict:
            ET.SubElement(
                case, "skipped", message=f"{r.category} failure (fails only with --strict)"
            ).text = text
            n_skip += 1
        elif r.verdict == "fail":
            ET.SubElement(case, "failure", message=r.message[:200]).text = text
            n_fail += 1
        elif r.verdict == "error":
            ET.SubElement(case, "error", message=r.message[:200]).text = text
            n_error += 1
    suite.set("failures", str(n_fail))
    suite.set("errors", str(n_error))
    suite.set("skipped", str(n_skip))
    ET.indent(suite)
    return _write(ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n", path)


def plotting_available() -> bool:
    """Whether the HTML report can draw its plots (matplotlib is installed)."""
    return _matplotlib() is not None


def _matplotlib():
    try:
        # optional package (plot extra)
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    return Figure


#: Failing cases plotted in the HTML report by default (the worst ones): the page stays under
#: ~1 MB and its drawing under the run's own time.
MAX_PLOTS = 12
#: Largest side of a heatmap (errors are max-pooled to it: a failing element never vanishes).
MAX_SIDE = 64


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=48)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _heatmap(ax, grid, limit, cmap, title):
    """log10(error / threshold), max-pooled to :data:`MAX_SIDE`; NaN/Inf in cyan."""
    bad = ~np.isfinite(grid)
    pooled = _pool2(np.where(bad, np.inf, np.where(grid > 0, grid, 0.0)), MAX_SIDE)
    with np.errstate(divide="ignore", invalid="ignore"):
        shown = np.ma.masked_invalid(np.log10(np.where(pooled > 0, pooled, np.nan) / limit))
    shown = np.ma.masked_where(~np.isfinite(pooled), shown)
    image = ax.imshow(shown, aspect="auto", cmap=cmap, interpolation="nearest")
    ax.set_title(title + (f"; {int(bad.sum())} NaN/Inf (cyan)" if bad.any() else ""), fontsize=8)
    return image


def _pool2(grid, size):
    return max_pool(np.asarray(grid, dtype=np.float64), size)


def _plots(Figure, result, every=False) -> list[str]:
    """One figure per case (its worst failing check; every check with ``every``): the heatmap
    (rows x last axis, max-pooled), for a failing output the (query, key) map of
    :func:`oracle.report.summary.key_alignment` (a key-position bug lights up its column),
    and the histogram of log10 normalised error. Non-finite errors (failures) are drawn in a
    loud colour and counted, never left blank as if they passed."""
    from html import escape  # here, as in to_html

    tags = []
    checks = list(result.checks.values())
    if not every:  # the worst failing check only: one figure per case keeps the page fast
        failing = [c for c in checks if not c.passed and c.errors is not None]
        worst = result.worst
        checks = [c for c in failing if worst is not None and c.quantity == worst.quantity][:1]
        checks = checks or failing[:1]
    for check in checks:
        if (check.passed and not every) or check.errors is None:
            continue
        errors = np.asarray(check.errors, dtype=np.float64)
        limit = float(np.max(check.threshold.value))
        bad = ~np.isfinite(errors)
        keys = result.key_map if check.quantity == "out" and not check.passed else None
        fig = Figure(figsize=(10 if keys is not None else 7.5, 2.6))
        axes = fig.subplots(1, 3 if keys is not None else 2)
        grid = errors.reshape(-1, errors.shape[-1]) if errors.ndim >= 2 else errors[None]
        cmap = matplotlib_colormap("magma").with_extremes(bad="#00e0ff")
        image = _heatmap(axes[0], grid, limit, cmap, f"{check.quantity}: rows x last axis")
        fig.colorbar(image, ax=axes[0], label="log10(err/thr)")
        if keys is not None:
            shown = axes[1].imshow(keys, aspect="auto", cmap="viridis", vmin=0, vmax=1)
            axes[1].set_xlabel("key (pooled)", fontsize=8)
            axes[1].set_ylabel("query (pooled)", fontsize=8)
            axes[1].set_title("|cos(error_i, v_j - out_i)|, worst head", fontsize=8)
            fig.colorbar(shown, ax=axes[1])
        ax_hist = axes[-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            finite = errors[~bad]
            values = np.log10(finite[finite > 0])
        if values.size:
            ax_hist.hist(values, bins=30, color="#4060a0")
        ax_hist.axvline(math.log10(limit), color="red", label="threshold")
        if bad.any():
            ax_hist.axvline(
                math.log10(limit) + 1,
                color="#00e0ff",
                linewidth=4,
                label=f"{int(bad.sum())} NaN/Inf (fail)",
            )
        ax_hist.set_xlabel("log10(normalised error)", fontsize=8)
        ax_hist.set_title("FAIL" if not check.passed else "pass", fontsize=8)
        ax_hist.legend(fontsize=7)
        fig.subplots_adjust(left=0.06, right=0.98, bottom=0.2, top=0.88, wspace=0.35)
        tags.append(
            f'<img alt="{escape(check.quantity)} errors" src="data:image/png;base64,{_png(fig)}">'
        )
    return tags


def matplotlib_colormap(name):
    """A copy of matplotlib's colormap ``name`` (safe to modify)."""
    # optional package (plot extra)
    import matplotlib

    return matplotlib.colormaps[name].copy()


def _table(header, rows, classes=None) -> str:
    from html import escape as esc  # here, as in to_html

    cells = ["<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(rows):
        style = f" class='{esc(classes[i])}'" if classes and classes[i] else ""
        cells.append(f"<tr{style}>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>")
    return "".join(cells) + "</table>"


def to_html(report, path, *, plots="failures", max_plots=MAX_PLOTS) -> Path:
    """A standalone HTML page: the summary first (verdict counts, coverage, accuracy grades,
    worst failures), then the case table (every link has its anchor), the unsupported cases
    as one table, and one section per case with the details and plots of failing cases.

    ``plots``: "failures" (default; the ``max_plots`` worst failing cases, their failing
    checks), "all" (every check of every case, no cap) or "none".
    """
    if plots not in ("failures", "all", "none"):
        raise ValueError(f"plots: expected 'failures', 'all' or 'none', got {plots!r}")
    from html import escape as esc  # here: only an HTML report needs it

    Figure = _matplotlib() if plots != "none" else None
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(_headline(report))}"
        "</title><style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}"
        "tr.fail{background:#fdd}tr.error{background:#fcb}tr.unsupported{color:#888}"
        "pre{background:#f4f4f4;padding:6px}</style></head><body>",
        f"<h1>{esc(_headline(report))}</h1>",
        f"<h2>Summary</h2><pre>{esc(chr(10).join(verdict_lines(report)))}</pre>",
    ]
    if report.untested:
        parts.append(
            f"<p class='fail'><strong>NOT TESTED: {esc(', '.join(report.untested))}</strong></p>"
        )
    coverage = [
        (group, esc(name), row["judged"], row["unsupported"], row["error"])
        for group, rows in report.coverage().items()
        for name, row in rows.items()
    ]
    parts.append("<h2>Coverage</h2>")
    parts.append(
        _table(
            ("kind", "name", "judged", "unsupported", "error"),
            coverage,
            ["fail" if row[2] == 0 else "" for row in coverage],
        )
    )
    grades = grade_lines(report)
    if grades:
        parts.append(f"<h2>Accuracy grades</h2><pre>{esc(chr(10).join(grades))}</pre>")
    worst = worst_lines(report)
    if worst:
        parts.append(f"<h2>Worst failures</h2><pre>{esc(chr(10).join(worst[1:]))}</pre>")
    if Figure is None and plots != "none":
        parts.append(f"<p><em>{esc(PLOT_HINT)}</em></p>")
    rows = _case_rows(report)
    parts.append("<h2>Cases</h2>")
    parts.append(
        _table(
            _COLUMNS,
            [
                (f"<a href='#{_anchor(row[0])}'>{esc(row[0])}</a>", *map(esc, row[1:]))
                for row in rows
            ],
            [row[2] for row in rows],
        )
    )
    unsupported = unsupported_lines(report.results)
    if unsupported:
        parts.append(f"<h2>Unsupported</h2><pre>{esc(chr(10).join(unsupported))}</pre>")
    plotted = (
        {r.name for r in worst_failures(report.results, max_plots)}
        if plots == "failures"
        else {r.name for r in report.results}
    )
    if plots == "failures" and len(report.failures) > len(plotted):
        parts.append(
            f"<p><em>plots for the {len(plotted)} worst failures "
            f"(to_html(max_plots=...) draws more)</em></p>"
        )
    for r in report.results:
        if r.verdict == "unsupported":
            continue
        parts.append(
            f"<h3 id='{_anchor(r.name)}'>{esc(r.name)}: {esc(r.verdict)}</h3>"
            + (f"<pre>{esc(r.explain())}</pre>" if r.verdict != "pass" else "")
        )
        if Figure is not None and r.name in plotted and (r.failed or plots == "all"):
            parts += _plots(Figure, r, every=plots == "all")
    parts.append("</body></html>")
    path = Path(path)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _anchor(name: str) -> str:
    """An HTML id for a case name (names are ASCII words, dashes and dots)."""
    return "case-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
