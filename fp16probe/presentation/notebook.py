"""Rich and Jupyter renderings of a Report and a Recommendation.

Presentation only: numbers come from the report's histograms and the analyzer. rich is
imported inside the functions that need it, matplotlib (through ``fp16probe.presentation.figures``)
only when an inline figure is asked for, so importing this module costs nothing.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping
from typing import Any

from fp16probe.formats import Format, get_format
from fp16probe.recommendation import Recommendation
from fp16probe.report import ACTIVATION_GRAD, Histogram, Report

__all__ = [
    "field",
    "flushed_fraction",
    "recommendation_html",
    "recommendation_rich",
    "report_html",
    "report_rich",
    "resolve_recommendation",
    "summary_rows",
    "worst_modules",
]

_VERDICT_WORDS = {
    "none_needed": "no loss scaling needed",
    "constant": "a constant loss scale is enough",
    "dynamic": "use dynamic loss scaling",
    "no_single_scale": "no single loss scale fits",
    "per_tensor_scaling": "scale per tensor, not with a loss scaler",
    "insufficient_evidence": "not enough evidence for a verdict",
}
_VERDICT_COLORS = {"none_needed": "#2e7d32", "constant": "#1565c0", "dynamic": "#ef6c00",
                   "no_single_scale": "#c62828", "per_tensor_scaling": "#6a1b9a", "insufficient_evidence": "#616161"}


# -- shared look-ups ---------------------------------------------------------------------
def field(obj: Recommendation | None, name: str, default: Any = None) -> Any:
    """Read a field of a Recommendation, or ``default`` when there is none."""
    if obj is None:
        return default
    return getattr(obj, name, default)


def resolve_recommendation(report: Report | None, recommendation: Any = None,
                           format: str | Format = "fp16", kind: str = ACTIVATION_GRAD) -> Any:
    """Return the recommendation to show: the one given, the report's own, or a fresh one.

    The report's stored recommendation is used when it is for ``format``; otherwise
    ``fp16probe.analysis.analyze`` runs on the report (None when it has no ``kind``
    records, or the analyzer is not installed).
    """
    if recommendation is not None or report is None:
        return recommendation
    fmt = get_format(format)
    stored = report.recommendation
    if stored is not None and get_format(field(stored, "format", fmt.name)) == fmt:
        return stored
    if not report.modules_of(kind):
        return None
    try:
        from fp16probe.analysis.recommend import analyze
    except ImportError:
        return None
    return analyze(report, fmt.name, kind=kind)


def _pct(fraction: float | None) -> str:
    if fraction is None:
        return "n/a"
    return "0%" if fraction == 0 else f"{100 * fraction:.3g}%"


def flushed_fraction(h: Histogram, fmt: str | Format, log2_scale: int = 0) -> float:
    """Share of the nonzero finite values that become 0 when cast at S = 2^log2_scale."""
    n = h.nonzero_finite
    return h.flushed(fmt, log2_scale) / n if n else 0.0


def summary_rows(report: Report, format: str | Format = "fp16") -> list[dict[str, Any]]:
    """One row per kind of value captured: counts and what happens in ``format`` at S = 1."""
    fmt = get_format(format)
    rows = []
    for kind in report.kinds:
        h = report.histogram(kind)
        rows.append({
            "kind": kind,
            "values": h.total,
            "zeros": h.zero / h.total if h.total else 0.0,
            "flushed": flushed_fraction(h, fmt),
            "subnormal": h.subnormal(fmt) / h.nonzero_finite if h.nonzero_finite else 0.0,
            "max_abs": h.max_abs,
            "nonfinite": h.nonfinite,
            "overflows": h.overflows(fmt),
        })
    return rows


def worst_modules(report: Report, format: str | Format = "fp16", kind: str = ACTIVATION_GRAD,
                  n: int = 5) -> list[tuple[str, str, float]]:
    """The ``n`` modules with the largest flushed share at S = 1: (name, type, share)."""
    fmt = get_format(format)
    ranked = sorted(((m.name, m.module_type, flushed_fraction(m.histogram, fmt))
                     for m in report.modules_of(kind)), key=lambda r: -r[2])
    return [r for r in ranked[:n] if r[2] > 0]


def _scaler_call(kwargs: Mapping[str, Any]) -> str:
    args = ", ".join(f"{k}={_number(v)}" for k, v in kwargs.items())
    return f'torch.amp.GradScaler("cuda", {args})'


def _number(v: Any) -> str:
    if isinstance(v, float) and v > 0 and math.log2(v).is_integer() and abs(v) >= 1024:
        return f"2.0**{int(math.log2(v))}"
    return repr(v)


# -- HTML (Jupyter) ----------------------------------------------------------------------
_STYLE = ("<style>.fp16probe table{border-collapse:collapse;margin:4px 0}"
          ".fp16probe td,.fp16probe th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}"
          ".fp16probe td:first-child,.fp16probe th:first-child{text-align:left}"
          ".fp16probe .verdict{font-weight:bold;padding:2px 6px;border-radius:3px;color:white}"
          "</style>")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def recommendation_html(rec: Any, *, standalone: bool = True) -> str:
    """Render a Recommendation (or its dict) as an HTML fragment."""
    verdict = str(field(rec, "verdict", "?"))
    fmt = field(rec, "format", "?")
    k = field(rec, "log2_scale")
    color = _VERDICT_COLORS.get(verdict, "#555555")
    parts = [
        f"<p><span class='verdict' style='background:{color}'>{html.escape(verdict)}</span> "
        f"{html.escape(_VERDICT_WORDS.get(verdict, ''))} for {html.escape(str(fmt))}</p>"
    ]
    rows = [["flushed to zero at S = 1", _pct(field(rec, "flushed_fraction_at_1"))]]
    if k is not None:
        rows.insert(0, ["loss scale S", f"2^{k} = {2.0 ** k:g}"])
        rows.append([f"flushed to zero at S = 2^{k}", _pct(field(rec, "flushed_fraction_at_scale"))])
        rows.append(["steps that overflow at S", str(field(rec, "overflow_steps_at_scale", "n/a"))])
        rows.append(["headroom below max (bits)", str(field(rec, "headroom_bits", "n/a"))])
    parts.append(_table(["", "value"], rows))
    kwargs = field(rec, "grad_scaler_kwargs") or {}
    if kwargs:
        parts.append(f"<pre>{html.escape(_scaler_call(kwargs))}</pre>")
    worst = list(field(rec, "worst_modules", ()) or ())
    if worst:
        parts.append("<p>worst modules (flushed share at S = 1):</p>"
                     + _table(["module", "flushed"], [[n, _pct(f)] for n, f in worst]))
    text = field(rec, "text")
    if text:
        parts.append(f"<p style='white-space:pre-wrap'>{html.escape(str(text))}</p>")
    cites = list(field(rec, "citations", ()) or ())
    if cites:
        parts.append("<p>sources:</p><ul>" + "".join(f"<li>{html.escape(str(c))}</li>" for c in cites)
                     + "</ul>")
    body = "".join(parts)
    if standalone:
        return f"{_STYLE}<div class='fp16probe'><h4>fp16probe recommendation</h4>{body}</div>"
    return body


def _figure_png(report: Report, rec: Any, fmt: Format, kind: str) -> str:
    from fp16probe.presentation.figures import plot_distribution

    ax = plot_distribution(report, fmt, recommendation=rec, kind=kind)
    buf = io.BytesIO()
    ax.figure.savefig(buf, format="png", dpi=90)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def report_html(report: Report, format: str | Format = "fp16", *, kind: str = ACTIVATION_GRAD,
                recommendation: Any = None, figure: bool = True) -> str:
    """Render a Report as HTML: where it came from, per-kind summary, worst modules,
    the recommendation and (``figure=True``) the Figure 3 view inline as a PNG."""
    fmt = get_format(format)
    md = report.metadata
    rec = resolve_recommendation(report, recommendation, fmt, kind)
    source = (f"{md.model_class} on {md.device}, {md.precision}; {md.steps_seen} of "
              f"{md.steps_total} steps profiled (every {md.every}); "
              f"{len(md.hooked_modules)} modules hooked"
              + ("; gradients recorded unscaled from a GradScaler" if md.grad_scaler else "")
              + ("; PARTIAL report" if md.partial else ""))
    rows = [[r["kind"], f"{r['values']:,}", _pct(r["zeros"]), _pct(r["flushed"]),
             _pct(r["subnormal"]), f"{r['max_abs']:.3g}", f"{r['nonfinite']:,}",
             "yes" if r["overflows"] else "no"] for r in summary_rows(report, fmt)]
    parts = [f"<h4>fp16probe report: {html.escape(md.model_class)}</h4>",
             f"<p>{html.escape(source)}</p>",
             _table(["values", "count", "zeros", f"flushed in {fmt.name}", "subnormal",
                     "max |x|", "inf/NaN", "overflows at S=1"], rows)]
    worst = worst_modules(report, fmt, kind)
    if worst:
        parts.append(f"<p>modules losing the most {html.escape(kind)} values to zero in "
                     f"{fmt.name} at S = 1:</p>"
                     + _table(["module", "type", "flushed"], [[n, t, _pct(f)] for n, t, f in worst]))
    if rec is not None:
        parts.append("<h4>recommendation</h4>" + recommendation_html(rec, standalone=False))
    if figure and report.modules_of(kind):
        png = _figure_png(report, rec, fmt, kind)
        parts.append(f"<img alt='{html.escape(kind)} distribution vs {fmt.name}' "
                     f"src='data:image/png;base64,{png}'/>")
    return f"{_STYLE}<div class='fp16probe'>{''.join(parts)}</div>"


# -- rich (terminal) ---------------------------------------------------------------------
def recommendation_rich(rec: Any) -> Any:
    """Render a Recommendation (or its dict) as a rich Panel."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    verdict = str(field(rec, "verdict", "?"))
    k = field(rec, "log2_scale")
    head = Text.assemble((verdict, f"bold {_VERDICT_COLORS.get(verdict, 'white')}"),
                         f"  {_VERDICT_WORDS.get(verdict, '')} for {field(rec, 'format', '?')}")
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column(justify="right")
    if k is not None:
        table.add_row("loss scale S", f"2^{k} = {2.0 ** k:g}")
    table.add_row("flushed to zero at S = 1", _pct(field(rec, "flushed_fraction_at_1")))
    if k is not None:
        table.add_row(f"flushed to zero at S = 2^{k}", _pct(field(rec, "flushed_fraction_at_scale")))
        table.add_row("steps that overflow at S", str(field(rec, "overflow_steps_at_scale", "n/a")))
    items: list[Any] = [head, table]
    kwargs = field(rec, "grad_scaler_kwargs") or {}
    if kwargs:
        items.append(Text(_scaler_call(kwargs), style="cyan"))
    text = field(rec, "text")
    if text:
        items.append(Text(str(text)))
    cites = list(field(rec, "citations", ()) or ())
    if cites:
        items.append(Text("sources: " + "; ".join(map(str, cites)), style="dim"))
    return Panel(Group(*items), title="fp16probe recommendation", expand=False)


def report_rich(report: Report, format: str | Format = "fp16", *, kind: str = ACTIVATION_GRAD,
                recommendation: Any = None) -> Any:
    """Render a Report as rich renderables: summary table, worst modules, recommendation."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    fmt = get_format(format)
    md = report.metadata
    items: list[Any] = [Text.assemble(
        ("fp16probe report: ", "bold"), md.model_class,
        f" ({md.steps_seen} of {md.steps_total} steps, {md.precision}, {md.device})"
        + (" PARTIAL" if md.partial else ""))]
    summary = Table(title=f"what happens in {fmt.name} at S = 1", title_justify="left")
    for col in ("values", "count", "zeros", "flushed", "subnormal", "max |x|", "inf/NaN", "overflows"):
        summary.add_column(col, justify="left" if col == "values" else "right")
    for r in summary_rows(report, fmt):
        summary.add_row(r["kind"], f"{r['values']:,}", _pct(r["zeros"]), _pct(r["flushed"]),
                        _pct(r["subnormal"]), f"{r['max_abs']:.3g}", f"{r['nonfinite']:,}",
                        "yes" if r["overflows"] else "no")
    items.append(summary)
    worst = worst_modules(report, fmt, kind)
    if worst:
        t = Table(title=f"modules losing the most {kind} values", title_justify="left")
        t.add_column("module", overflow="fold")
        t.add_column("type")
        t.add_column("flushed", justify="right")
        for n, typ, f in worst:
            t.add_row(n, typ, _pct(f))
        items.append(t)
    rec = resolve_recommendation(report, recommendation, fmt, kind)
    if rec is not None:
        items.append(recommendation_rich(rec))
    return Group(*items)
