"""Reports of a validation run: text summary, JSON, JUnit XML, HTML (with optional plots).

Every format carries, per failing case, the worst element (quantity, index, value, truth,
normalised error, ulp), the threshold and how it was formed (T2 of :mod:`oracle.tolerance`),
the diagnosis and a one-line reproduction command.

The HTML report draws error heatmaps and histograms with matplotlib, an optional dependency
(``pip install refattn[plot]``); without it the HTML has the tables and says what to install.

Examples
--------
>>> from oracle.results import Report, CaseResult
>>> report = Report("demo", "float32", "suite smoke", False,
...                 [CaseResult("basic-f32", "conformance", "float32", "pass")])
>>> print(summary_table(report).splitlines()[0])
refattn oracle: demo on suite smoke, dtype float32: PASSED
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import shutil
import textwrap
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np

__all__ = [
    "summary_table",
    "grade_lines",
    "to_dict",
    "to_json",
    "to_junit",
    "to_html",
    "PLOT_HINT",
    "ROBUSTNESS_NOTE",
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


def _ratio_text(result) -> str:
    worst = result.worst
    if worst is None:
        return "-"
    if worst.threshold <= 0:
        return "inf"
    ratio = worst.error / worst.threshold
    return "inf" if not math.isfinite(ratio) else f"{ratio:.3g}"


def _ulp_text(result) -> str:
    worst = result.worst
    return "-" if worst is None else f"{worst.ulp:.3g}"


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
    lines = ["Accuracy grades (conformance cases judged):"]
    for dtype, by_name in grades.items():
        for name, g in by_name.items():
            rounded = g["correctly_rounded"]
            share = "-" if rounded is None else f"{100 * rounded:.1f}%"
            lines.append(
                f"  {dtype} {name}: {share} correctly rounded, ulp median "
                f"{_num(g['ulp_median'])} p99 {_num(g['ulp_p99'])} max "
                f"{_num(g['ulp_max'])}, rms error {_num(g['rms_error'])}"
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


def summary_table(report, *, details=True) -> str:
    """A plain-text table (one row per case) plus details of every failing case."""
    rows = [("case", "category", "verdict", "err/thr", "ulp", "diagnosis / message")]
    for r in report.results:
        note = "; ".join(r.diagnosis) or r.message
        rows.append((r.name, r.category, r.verdict, _ratio_text(r), _ulp_text(r), note))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    indent = sum(widths) + 2 * 5
    # the full reason, wrapped under its column (never cut)
    room = max(_NOTE_WIDTH, shutil.get_terminal_size((_TERMINAL, 24)).columns - indent)
    lines = [_headline(report), ""]
    for i, row in enumerate(rows):
        wrapped = textwrap.wrap(row[5], room, break_on_hyphens=False) or [""]
        lines.append(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
            + "  "
            + wrapped[0]
        )
        lines += [" " * indent + more for more in wrapped[1:]]
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 20)
    lines.append("")
    for category in ("conformance", "robustness", "invariance"):
        counts = report.counts(category)
        if sum(counts.values()):
            lines.append(f"{category}: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    if any(r.category == "robustness" for r in report.results):
        lines.append(f"note: {ROBUSTNESS_NOTE}" + (" (strict: on)" if report.strict else ""))
    lines += ["", *coverage_lines(report)]
    grades = grade_lines(report)
    if grades:
        lines += ["", *grades]
    lines.append(f"time: {report.seconds:.2f} s")
    if details:
        failing = [r for r in report.results if r.failed]
        if failing:
            lines += ["", "Failures:"]
            lines += [r.explain() for r in failing]
    return "\n".join(lines)


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
    from .tolerance import FAILURE_PROBABILITY, K_BACKWARD, K_FORWARD

    return {
        "impl": report.impl,
        "dtype": report.dtype,
        "source": report.source,
        "strict": report.strict,
        "grads": report.grads,
        "passed": report.passed,
        "seconds": round(report.seconds, 3),
        "counts": {c: report.counts(c) for c in ("conformance", "robustness", "invariance")},
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
            "threshold": "max(k * baseline_error, floor) + u_out (oracle.tolerance, T2)",
        },
        "results": [r.to_dict() for r in report.results],
    }


def _write(text, path):
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def to_json(report, path=None) -> str:
    """JSON text of :func:`to_dict` (written to ``path`` when given)."""
    return _write(json.dumps(to_dict(report), indent=2, allow_nan=False) + "\n", path)


def to_junit(report, path=None) -> str:
    """JUnit XML: one testcase per case; robustness failures without ``strict`` are skipped
    (with the failure text) so that CI dashboards agree with :attr:`Report.passed`."""
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
        elif r.failed and r.category == "robustness" and not report.strict:
            ET.SubElement(
                case, "skipped", message="robustness failure (fails only with --strict)"
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
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    return Figure


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _plots(Figure, result, every=False) -> list[str]:
    """Heatmap (rows x last axis) and histogram of log10 normalised error per check, as <img>
    tags: the failing checks, or every check with ``every``. Non-finite errors (NaN or Inf
    where the truth is finite: failures) are drawn in a loud colour and counted in the title,
    never left blank as if they passed."""
    tags = []
    for check in result.checks.values():
        if (check.passed and not every) or check.errors is None:
            continue
        errors = np.asarray(check.errors, dtype=np.float64)
        limit = float(np.max(check.threshold.value))
        bad = ~np.isfinite(errors)
        fig = Figure(figsize=(9, 3.2))
        ax_map, ax_hist = fig.subplots(1, 2)
        grid = errors.reshape(-1, errors.shape[-1]) if errors.ndim >= 2 else errors[None]
        cmap = matplotlib_colormap("magma").with_extremes(bad="#00e0ff")
        with np.errstate(divide="ignore", invalid="ignore"):
            shown = np.ma.masked_invalid(np.log10(np.where(grid > 0, grid, np.nan) / limit))
            shown = np.ma.masked_where(~np.isfinite(grid), shown)
            image = ax_map.imshow(shown, aspect="auto", cmap=cmap, interpolation="nearest")
            finite = errors[~bad]
            values = np.log10(finite[finite > 0])
        fig.colorbar(image, ax=ax_map, label="log10(error / threshold)")
        title = f"{check.quantity}: rows x last axis"
        if bad.any():
            title += f"; {int(bad.sum())} NaN/Inf (cyan: FAIL)"
        ax_map.set_title(title)
        if values.size:
            ax_hist.hist(values, bins=40, color="#4060a0")
        ax_hist.axvline(math.log10(limit), color="red", label="threshold")
        if bad.any():
            ax_hist.axvline(
                math.log10(limit) + 1,
                color="#00e0ff",
                linewidth=4,
                label=f"{int(bad.sum())} NaN/Inf (fail)",
            )
        ax_hist.set_xlabel("log10(normalised error)")
        ax_hist.set_title("FAIL" if not check.passed else "pass")
        ax_hist.legend()
        tags.append(
            f'<img alt="{html.escape(check.quantity)} errors" '
            f'src="data:image/png;base64,{_png(fig)}">'
        )
    return tags


def matplotlib_colormap(name):
    """A copy of matplotlib's colormap ``name`` (safe to modify)."""
    import matplotlib

    return matplotlib.colormaps[name].copy()


def to_html(report, path, *, plots="failures") -> Path:
    """A standalone HTML page: summary table, one section per case (every table link has its
    anchor), details of failing cases and plots.

    ``plots``: "failures" (default; every failing check), "all" (every check of every case)
    or "none".
    """
    if plots not in ("failures", "all", "none"):
        raise ValueError(f"plots: expected 'failures', 'all' or 'none', got {plots!r}")
    Figure = _matplotlib() if plots != "none" else None
    esc = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(_headline(report))}"
        "</title><style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}"
        "tr.fail{background:#fdd}tr.error{background:#fcb}tr.unsupported{color:#888}"
        "pre{background:#f4f4f4;padding:6px}</style></head><body>",
        f"<h1>{esc(_headline(report))}</h1>",
    ]
    if Figure is None and plots != "none":
        parts.append(f"<p><em>{esc(PLOT_HINT)}</em></p>")
    parts.append(
        "<table><tr><th>case</th><th>category</th><th>verdict</th><th>err/thr</th>"
        "<th>ulp</th><th>diagnosis / message</th></tr>"
    )
    for r in report.results:
        note = "; ".join(r.diagnosis) or r.message
        parts.append(
            f"<tr class='{esc(r.verdict)}'><td><a href='#{_anchor(r.name)}'>"
            f"{esc(r.name)}</a></td><td>{esc(r.category)}</td><td>{esc(r.verdict)}"
            f"</td><td>{_ratio_text(r)}</td><td>{_ulp_text(r)}</td><td>{esc(note)}"
            f"</td></tr>"
        )
    parts.append("</table>")
    text = summary_table(report, details=False).split("\n\n")[-2:]
    parts.append(f"<pre>{esc(chr(10).join(text))}</pre>")
    parts.append(
        "<h2>Coverage</h2><table><tr><th>kind</th><th>name</th><th>judged</th>"
        "<th>unsupported</th><th>error</th></tr>"
    )
    for group, rows in report.coverage().items():
        for name, row in rows.items():
            style = " class='fail'" if row["judged"] == 0 else ""
            parts.append(
                f"<tr{style}><td>{group}</td><td>{esc(name)}</td><td>{row['judged']}"
                f"</td><td>{row['unsupported']}</td><td>{row['error']}</td></tr>"
            )
    parts.append("</table>")
    grades = grade_lines(report)
    if grades:
        parts.append(f"<h2>Accuracy grades</h2><pre>{esc(chr(10).join(grades[1:]))}</pre>")
    if report.untested:
        parts.append(
            f"<p class='fail'><strong>NOT TESTED: {esc(', '.join(report.untested))}</strong></p>"
        )
    for r in report.results:
        parts.append(
            f"<h2 id='{_anchor(r.name)}'>{esc(r.name)}: {esc(r.verdict)}</h2>"
            f"<pre>{esc(r.explain())}</pre>"
        )
        if Figure is not None and (r.failed or plots == "all"):
            parts += _plots(Figure, r, every=plots == "all")
    parts.append("</body></html>")
    path = Path(path)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _anchor(name: str) -> str:
    """An HTML id for a case name (names are ASCII words, dashes and dots)."""
    return "case-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
