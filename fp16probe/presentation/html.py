"""The notebook's HTML view of a Report and a Recommendation (``_repr_html_``).

It says what the terminal says (the short answer from ``answer``, caveats in sight, then
tables) and keeps the reasoning, evidence, replay and sources in an expandable section.
Every string from a report is escaped; module names may wrap only after their dots,
numbers and URLs never. matplotlib loads (through ``figures``) only for the inline figure.
"""

from __future__ import annotations

import base64
import io
import re

from fp16probe.analysis.whatif import worst_modules
from fp16probe.errors import MissingExtraError
from fp16probe.formats import Format, get_format
from fp16probe.presentation.cite import cite
from fp16probe.presentation.verdict import replay_table
from fp16probe import formatting as num
from fp16probe.presentation.answer import (
    evidence_rows,
    explanation_text,
    recommendation_for,
    run_header,
    short_answer,
)
from fp16probe.presentation import escape
from fp16probe.recommendation import Recommendation
from fp16probe.report import ACTIVATION_GRAD, Report

__all__ = ["recommendation_html", "report_html"]

_VERDICT_COLORS = ("#2e7d32", "#1565c0", "#ef6c00", "#6a1b9a", "#c62828", "#555555")  # by severity
_STYLE = ("<style>.fp16probe table{border-collapse:collapse;margin:4px 0}"
          ".fp16probe td,.fp16probe th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right;"
          "white-space:nowrap}"
          ".fp16probe td:first-child,.fp16probe th:first-child{text-align:left}"
          ".fp16probe td.name{white-space:normal;overflow-wrap:normal;word-break:keep-all}"
          ".fp16probe a{white-space:nowrap}.fp16probe .caveat{color:#8a4b00}"
          ".fp16probe .verdict{font-weight:bold;padding:2px 6px;border-radius:3px;color:white}"
          "</style>")
_URL = re.compile(r"(https?://\S+?)([.,;)]?(?:\s|$))")


def _escape(text: str) -> str:
    """Report text for HTML: the one rule (:func:`fp16probe.presentation.escape.xml`)."""
    return escape.xml(text)


def _esc(text: object) -> str:
    """Escape report text; URLs become links that do not break."""
    return _URL.sub(lambda m: f"<a href='{m.group(1)}'>{m.group(1)}</a>{m.group(2)}", _escape(str(text)))


def _name(name: str) -> str:
    """A module name that may wrap only after its dots."""
    return ".<wbr>".join(_escape(part) for part in name.split("."))


def _table(header: list[str], rows: list[list[str]], names: int | None = None) -> str:
    """An HTML table of escaped cells; column ``names`` holds module names."""
    head = "".join(f"<th>{_escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td class='name'>{_name(c)}</td>" if i == names else f"<td>{_esc(c)}</td>"
                         for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _answer(rec: Recommendation, report: Report | None) -> str:
    color = _VERDICT_COLORS[min(rec.verdict.severity, len(_VERDICT_COLORS) - 1)]
    parts = []
    for line in short_answer(report, rec, width=80):
        if line.kind == "verdict":
            parts.append(f"<p><span class='verdict' style='background:{color}'>{_escape(str(rec.verdict))}"
                         f"</span> {_esc(line.text)}</p>")
        elif line.kind == "code":  # real lines: escaped one by one, so a newline stays a newline to copy
            parts.append("<pre>" + "\n".join(_escape(code) for code in line.text.splitlines()) + "</pre>")
        elif line.kind in ("caveat", "invented"):
            parts.append(f"<p class='caveat'>{_esc(line.text)}</p>")
        else:
            parts.append(f"<p>{_esc(line.text)}</p>")
    return "".join(parts)


def _explanation(rec: Recommendation, fmt: Format | None = None) -> str:
    parts = [f"<p style='white-space:pre-wrap'>{_esc(explanation_text(rec, fmt))}</p>"]
    evidence = evidence_rows(rec.evidence)
    if evidence:
        parts.append(_table(["evidence", "value"], [list(r) for r in evidence]))
    if rec.growth_interval_table and rec.growth_interval_table.get("rows"):
        title, heads, rows, notes = replay_table(rec.growth_interval_table)
        parts.append(f"<p>{_esc(title)}</p>" + _table(heads, rows) + "".join(f"<p>{_esc(n)}</p>" for n in notes))
    if rec.citations:
        parts.append("<p>sources:</p><ul>" + "".join(f"<li>{_esc(cite(c))}</li>" for c in rec.citations) + "</ul>")
    return ("<details><summary>why: the reasoning, evidence, replay and sources</summary>"
            + "".join(parts) + "</details>")


def recommendation_html(rec: Recommendation, report: Report | None = None, *, standalone: bool = True) -> str:
    """Render a Recommendation as HTML: the short answer, then the reasoning to expand."""
    body = _answer(rec, report) + _explanation(rec)
    if standalone:
        return f"{_STYLE}<div class='fp16probe'><h4>fp16probe recommendation</h4>{body}</div>"
    return body


def report_html(report: Report, format: str | Format | None = None, *, kind: str = ACTIVATION_GRAD,
                recommendation: Recommendation | None = None, figure: bool = True) -> str:
    """Render a Report as HTML: what was profiled, the answer, a summary per kind, the modules
    that flush the most, the reasoning to expand and (``figure=True``) the Figure 3 view.

    The recommendation shown is the one given, else the report's stored one (for ``format``
    when given); the analyzer is never run here.
    """
    md = report.metadata
    rec = recommendation if recommendation is not None else recommendation_for(report, format and get_format(format).name)
    fmt = get_format(format or (rec.format if rec is not None else "fp16"))
    parts = [f"<h4>fp16probe report: {_escape(md.model_class)}</h4>",
             f"<p>{_esc(run_header(report))}"
             + ("; gradients recorded unscaled from a GradScaler" if md.grad_scaler else "") + "</p>"]
    if rec is not None:
        parts.append(_answer(rec, report))
    else:
        parts.append("<p class='caveat'>no recommendation stored in this report: "
                     "fp16probe.analysis.recommend.analyze(report) makes one</p>")
    rows = []
    for k in report.kinds:
        h = report.histogram(k)
        n = h.nonzero_finite
        rows.append([k, num.count(h.total), num.percent(h.zero / h.total if h.total else 0.0),
                     num.percent(h.flushed(fmt, 0) / n if n else 0.0),
                     num.percent(h.subnormal(fmt, 0) / n if n else 0.0), num.magnitude(h.max_abs),
                     num.count(h.nonfinite), "yes" if h.overflows(fmt) else "no"])
    parts.append(_table(["values", "count", "zeros", f"flushed in {fmt.name}", "subnormal", "max |x|",
                         "inf/NaN", "overflows at S = 1"], rows))
    worst = worst_modules(report, fmt, kind=kind, count=5)
    if worst:
        parts.append(f"<p>modules that flush the most ({_escape(kind)}) in {fmt.name} at S = 1:</p>"
                     + _table(["module", "type", "flushed"],
                              [[w.name, w.module_type, num.percent(w.fraction)] for w in worst], names=0))
    if rec is not None:
        parts.append(_explanation(rec, fmt))
    if figure and report.modules_of(kind):
        try:
            parts.append(f"<img alt='{_escape(kind)} distribution vs {fmt.name}' "
                         f"src='data:image/png;base64,{_figure_png(report, rec, kind)}'/>")
        except MissingExtraError as e:  # no matplotlib: the tables above are the whole answer
            parts.append(f"<p>(no figure: {_escape(str(e))})</p>")
    return f"{_STYLE}<div class='fp16probe'>{''.join(parts)}</div>"


def _figure_png(report: Report, rec: Recommendation | None, kind: str) -> str:
    from fp16probe.presentation.figures import figure

    fig = figure(report, which="distribution", recommendation=rec, kind=kind,
                 format=rec.format if rec is not None else "fp16")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return base64.b64encode(buf.getvalue()).decode("ascii")
