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
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np

__all__ = ["summary_table", "to_dict", "to_json", "to_junit", "to_html", "PLOT_HINT",
           "ROBUSTNESS_NOTE", "plotting_available"]

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
    return f"refattn oracle: {report.impl} on {report.source}, dtype {dtype}: {verdict}"


def summary_table(report, *, details=True) -> str:
    """A plain-text table (one row per case) plus details of every failing case."""
    rows = [("case", "category", "verdict", "err/thr", "ulp", "diagnosis / message")]
    for r in report.results:
        note = "; ".join(r.diagnosis) or r.message
        rows.append((r.name, r.category, r.verdict, _ratio_text(r), _ulp_text(r),
                     note[:70] + ("..." if len(note) > 70 else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [_headline(report), ""]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
                     + "  " + row[5])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 20)
    lines.append("")
    for category in ("conformance", "robustness"):
        counts = report.counts(category)
        if sum(counts.values()):
            lines.append(f"{category}: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    if any(r.category == "robustness" for r in report.results):
        lines.append(f"note: {ROBUSTNESS_NOTE}" + (" (strict: on)" if report.strict else ""))
    lines.append(f"time: {report.seconds:.2f} s")
    if details:
        failing = [r for r in report.results if r.failed]
        if failing:
            lines += ["", "Failures:"]
            lines += [r.explain() for r in failing]
    return "\n".join(lines)


def to_dict(report) -> dict:
    """JSON-ready dictionary of the whole run."""
    from .tolerance import FAILURE_PROBABILITY, K_BACKWARD, K_FORWARD

    return {
        "impl": report.impl, "dtype": report.dtype, "source": report.source,
        "strict": report.strict, "grads": report.grads, "passed": report.passed,
        "seconds": round(report.seconds, 3),
        "counts": {c: report.counts(c) for c in ("conformance", "robustness")},
        "policy": {"k_forward": K_FORWARD, "k_backward": K_BACKWARD,
                   "failure_probability": FAILURE_PROBABILITY,
                   "threshold": "max(k * baseline_error, floor) + u_out (oracle.tolerance, T2)"},
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
    suite = ET.Element("testsuite", name=f"refattn-oracle {report.impl}",
                       tests=str(len(report.results)), time=f"{report.seconds:.3f}")
    n_fail = n_error = n_skip = 0
    for r in report.results:
        case = ET.SubElement(suite, "testcase", classname=f"refattn_oracle.{r.category}",
                             name=r.name, time=f"{r.seconds:.4f}")
        text = r.explain()
        if r.verdict == "unsupported":
            ET.SubElement(case, "skipped", message=f"unsupported: {r.message}")
            n_skip += 1
        elif r.failed and r.category == "robustness" and not report.strict:
            ET.SubElement(case, "skipped", message="robustness failure (fails only with "
                                                   "--strict)").text = text
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


def _plots(Figure, result) -> list[str]:
    """Heatmap (max over leading axes) and histogram of log10 normalised error per failing
    check, as <img> tags."""
    tags = []
    for check in result.checks.values():
        if check.passed or check.errors is None:
            continue
        errors = np.asarray(check.errors, dtype=np.float64)
        limit = float(np.max(check.threshold.value))
        finite = np.where(np.isfinite(errors), errors, np.nan)
        fig = Figure(figsize=(9, 3.2))
        ax_map, ax_hist = fig.subplots(1, 2)
        grid = finite.reshape(-1, errors.shape[-1]) if errors.ndim >= 2 else finite[None]
        with np.errstate(divide="ignore", invalid="ignore"):
            image = ax_map.imshow(np.log10(grid / limit), aspect="auto", cmap="magma",
                                  interpolation="nearest")
            values = np.log10(finite[np.isfinite(finite) & (finite > 0)])
        fig.colorbar(image, ax=ax_map, label="log10(error / threshold)")
        ax_map.set_title(f"{check.quantity}: rows x last axis (NaN/Inf blank)")
        if values.size:
            ax_hist.hist(values, bins=40, color="#4060a0")
        ax_hist.axvline(math.log10(limit), color="red", label="threshold")
        ax_hist.set_xlabel("log10(normalised error)")
        ax_hist.legend()
        tags.append(f'<img alt="{html.escape(check.quantity)} errors" '
                    f'src="data:image/png;base64,{_png(fig)}">')
    return tags


def to_html(report, path) -> Path:
    """A standalone HTML page: summary, failing cases with details and plots."""
    Figure = _matplotlib()
    esc = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(_headline(report))}"
             "</title><style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}"
             "tr.fail{background:#fdd}tr.error{background:#fcb}tr.unsupported{color:#888}"
             "pre{background:#f4f4f4;padding:6px}</style></head><body>",
             f"<h1>{esc(_headline(report))}</h1>"]
    if Figure is None:
        parts.append(f"<p><em>{esc(PLOT_HINT)}</em></p>")
    parts.append("<table><tr><th>case</th><th>category</th><th>verdict</th><th>err/thr</th>"
                 "<th>ulp</th><th>diagnosis / message</th></tr>")
    for r in report.results:
        note = "; ".join(r.diagnosis) or r.message
        parts.append(f"<tr class='{esc(r.verdict)}'><td><a href='#{esc(r.name)}'>{esc(r.name)}"
                     f"</a></td><td>{esc(r.category)}</td><td>{esc(r.verdict)}</td>"
                     f"<td>{_ratio_text(r)}</td><td>{_ulp_text(r)}</td><td>{esc(note)}</td></tr>")
    parts.append("</table>")
    text = summary_table(report, details=False).split("\n\n")[-1]
    parts.append(f"<pre>{esc(text)}</pre>")
    for r in report.results:
        if not r.failed:
            continue
        parts.append(f"<h2 id='{esc(r.name)}'>{esc(r.name)}</h2><pre>{esc(r.explain())}</pre>")
        if Figure is not None:
            parts += _plots(Figure, r)
    parts.append("</body></html>")
    path = Path(path)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
