"""Human-readable output for the command line: the only module that imports rich.

rich is imported inside the functions, so importing fp16probe never loads it. Consoles
are made per command (:func:`make_console`), so NO_COLOR and captured output in tests work.
Recommendations are the typed ``fp16probe.recommendation.Recommendation``, read by attribute.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

from fp16probe.formats import get_format
from fp16probe.recommendation import Recommendation
from fp16probe.report import Histogram, Report

__all__ = [
    "grad_scaler_code",
    "make_console",
    "print_compare",
    "print_error",
    "print_profile_summary",
    "print_recommendation",
    "print_show",
    "precision_caveat",
    "progress",
]


def make_console(stderr: bool = True) -> Any:
    """A rich Console on stderr (human output never goes to stdout)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def _get(rec: Recommendation | None, name: str, default: Any = None) -> Any:
    if rec is None:
        return default
    return getattr(rec, name, default)


def grad_scaler_code(rec: Any, device: str = "cuda") -> str:
    """Ready-to-paste Python for the recommended GradScaler (or why none is needed)."""
    verdict = _get(rec, "verdict")
    kwargs = dict(_get(rec, "grad_scaler_kwargs") or {})
    if verdict == "none_needed":
        return f'scaler = torch.amp.GradScaler("{device}", enabled=False)  # no loss scaling needed'
    if not kwargs:
        return f"# no GradScaler to paste: the verdict is {verdict}; follow the text above"
    args = ", ".join(f"{k}={_py(v)}" for k, v in kwargs.items())
    return f'scaler = torch.amp.GradScaler("{device}", {args})'


def _py(v: Any) -> str:
    if isinstance(v, float):
        if v.is_integer() and abs(v) >= 2**10:
            k = int(math.log2(v)) if v > 0 else None
            if k is not None and 2.0**k == v:
                return f"2.0**{k}"
        return repr(v)
    return repr(v)


def _pct(num: int | float, den: int | float) -> str:
    if not den:
        return "-"
    f = num / den
    if f == 0:
        return "0%"
    if f < 1e-4:
        return f"{f * 100:.2g}%"
    return f"{f * 100:.3g}%"


def _frac(f: float | None) -> str:
    if f is None:
        return "-"
    return _pct(f, 1.0)


def print_error(console: Any, message: str) -> None:
    """One line: what was wrong and what to do."""
    from rich.text import Text

    console.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)


@contextlib.contextmanager
def progress(console: Any, total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar on a terminal; a no-op elsewhere. Yields ``update(steps_done)``."""
    if not enabled or not console.is_terminal:
        yield lambda done: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("steps", total=total)
        yield lambda done: bar.update(task, completed=done)


# -- tables ---------------------------------------------------------------------------


def _distribution_table(h: Histogram, fmt_name: str, log2_scale: int | None, title: str) -> Any:
    from rich.table import Table

    fmt = get_format(fmt_name)
    n = h.nonzero_finite
    table = Table(title=title, title_justify="left")
    table.add_column("range (|g|, at S = 1)")
    table.add_column("values", justify="right")
    table.add_column("share of nonzero", justify="right")
    ks = [0] + ([log2_scale] if log2_scale not in (None, 0) else [])
    for k in ks[1:]:
        table.add_column(f"at S = 2^{k}", justify="right")
    rows = [
        (f"normal (> 2^{fmt.log2_min_normal})", lambda k: n - h.at_most(fmt.log2_min_normal - k)),
        (f"subnormal (2^{fmt.log2_flush_threshold}, 2^{fmt.log2_min_normal}]", lambda k: h.subnormal(fmt, k)),
        (f"flushed to 0 (<= 2^{fmt.log2_flush_threshold})", lambda k: h.flushed(fmt, k)),
    ]
    for label, count in rows:
        cells = [label, f"{count(0):,}", _pct(count(0), n)]
        cells += [_pct(count(k), n) for k in ks[1:]]
        table.add_row(*cells)
    table.add_row("exact zeros", f"{h.zero:,}", "", *[""] * (len(ks) - 1))
    table.add_row("inf / NaN", f"{h.inf:,} / {h.nan:,}", "", *[""] * (len(ks) - 1))
    over = ["yes" if h.overflows(fmt, k) else "no" for k in ks]
    table.add_row(f"overflow past {fmt.max:g}", f"max |g| {h.max_abs:.3g}", over[0], *over[1:])
    return table


def _bins_table(h: Histogram, fmt_name: str, rows: int = 24) -> Any:
    """Occupied log2 bins, grouped so at most ``rows`` show, with the format's bounds marked."""
    from rich.table import Table

    fmt = get_format(fmt_name)
    lo, hi = h.lowest_exp, h.highest_exp
    table = Table(title="log2 histogram (bin e holds |g| in (2^(e-1), 2^e])", title_justify="left")
    table.add_column("bins")
    table.add_column("values", justify="right")
    table.add_column("", min_width=20)
    table.add_column(f"{fmt.name} at S = 1")
    if lo is None:
        return table
    width = max(1, math.ceil((hi - lo + 1) / rows))
    # Bin e lies wholly beyond max from here on: its lower edge 2^(e-1) is past max.
    first_overflow = math.ceil(math.log2(fmt.max)) + 1
    # A group never straddles a bound, so every bin in it has the region it is labelled with.
    cuts = (fmt.log2_flush_threshold, fmt.log2_min_normal, first_overflow - 1)
    groups = []
    e = hi
    while e >= lo:
        bottom = max([lo, e - width + 1] + [c + 1 for c in cuts if c < e])
        groups.append((bottom, e, h.between(bottom - 1, e)))
        e = bottom - 1
    peak = max(c for _, _, c in groups) or 1
    for bottom, top, c in groups:
        if top <= fmt.log2_flush_threshold:
            region = "[red]flushed[/red]"
        elif top <= fmt.log2_min_normal:
            region = "[yellow]subnormal[/yellow]"
        elif top >= first_overflow:
            region = "[red]overflow[/red]"
        else:
            region = "normal"
        label = f"2^{top}" if bottom == top else f"2^{bottom}..2^{top}"
        table.add_row(label, f"{c:,}", "#" * round(20 * c / peak), region)
    return table


def _worst_table(report: Report, kind: str, fmt: str, log2_scale: int | None, top: int) -> Any:
    from rich.table import Table

    table = Table(title=f"worst modules ({kind})", title_justify="left")
    # Fold, never truncate: a name cut to "transformer.h.1…" no longer says which module.
    table.add_column("module", overflow="fold")
    table.add_column("type")
    table.add_column("values", justify="right")
    table.add_column("flushed at S = 1", justify="right")
    if log2_scale not in (None, 0):
        table.add_column(f"at S = 2^{log2_scale}", justify="right")
    table.add_column("max |g|", justify="right")
    ranked = sorted(
        report.modules_of(kind),
        key=lambda m: -(m.histogram.flushed(fmt, 0) / m.histogram.nonzero_finite if m.histogram.nonzero_finite else 0),
    )
    for m in ranked[:top]:
        h = m.histogram
        cells = [m.name, m.module_type, f"{h.nonzero_finite:,}", _pct(h.flushed(fmt, 0), h.nonzero_finite)]
        if log2_scale not in (None, 0):
            cells.append(_pct(h.flushed(fmt, log2_scale), h.nonzero_finite))
        cells.append(f"{h.max_abs:.3g}")
        table.add_row(*cells)
    return table


def _verdict_lines(rec: Any) -> list[str]:
    verdict = _get(rec, "verdict")
    fmt = _get(rec, "format")
    k = _get(rec, "log2_scale")
    lines = [f"[bold]verdict ({fmt}):[/bold] {verdict}" + (f", S = 2^{k}" if k is not None else "")]
    at1 = _get(rec, "flushed_fraction_at_1")
    at_s = _get(rec, "flushed_fraction_at_scale")
    lines.append(f"flushed at S = 1: {_frac(at1)}" + (f"; at the recommended scale: {_frac(at_s)}" if at_s is not None else ""))
    over = _get(rec, "overflow_steps_at_scale")
    head = _get(rec, "headroom_bits")
    if over is not None or head is not None:
        lines.append(f"overflowing steps at that scale: {over if over is not None else '-'}; "
                     f"headroom below the format's max: {head if head is not None else '-'} bits")
    return lines


def print_recommendation(console: Any, rec: Any, device: str = "cuda") -> None:
    """The verdict, its explanation, and the GradScaler line to paste."""
    from rich.markup import escape

    for line in _verdict_lines(rec):
        console.print(line)
    text = _get(rec, "text")
    if text:
        console.print(escape(str(text)))
    # Plain and unwrapped, so the line can be copied as it is.
    console.print(grad_scaler_code(rec, device), markup=False, highlight=False, soft_wrap=True)
    cites = _get(rec, "citations") or ()
    for c in cites:
        console.print(f"[dim]source: {escape(str(c))}[/dim]")


def print_show(console: Any, report: Report, rec: Any, *, fmt: str, kind: str, top: int = 10) -> None:
    """Distribution against the format's bounds, the worst modules, and the verdict with evidence."""
    from rich.markup import escape

    meta = report.metadata
    console.print(
        f"[bold]{escape(meta.model_class)}[/bold]: {meta.steps_seen} step(s) in {meta.precision} on {meta.device}"
        + (" [yellow](partial)[/yellow]" if meta.partial else "")
    )
    _print_run_context(console, meta)
    _print_precision_caveat(console, report, kind)
    h = report.histogram(kind)
    k = _get(rec, "log2_scale")
    console.print(_distribution_table(h, fmt, k, f"{kind}: {h.total:,} values against {fmt}"))
    console.print(_bins_table(h, fmt))
    console.print(_worst_table(report, kind, fmt, k, top))
    evidence = _get(rec, "evidence") or {}
    if evidence:
        from rich.table import Table

        table = Table(title="evidence", title_justify="left")
        table.add_column("quantity")
        table.add_column("value", justify="right")
        for name, value in evidence.items():
            table.add_row(escape(str(name)), escape(f"{value:.4g}" if isinstance(value, float) else str(value)))
        console.print(table)
    print_recommendation(console, rec)


def precision_caveat(report: Report, kind: str) -> str | None:
    """Why a profile taken in reduced precision understates the underflow (None for fp32).

    A gradient that flushed while the run computed in fp16 is already an exact zero in the
    report, indistinguishable from a true zero; the analysis counts only the nonzero values
    that survived, so its flushed fractions are lower bounds and ``none_needed`` can be wrong.
    """
    precision = str(report.metadata.precision)
    if precision.startswith("fp32"):
        return None
    h = report.histogram(kind)
    scale = report.metadata.extra.get("loss_scale")
    at = f"S = {scale:g}" if isinstance(scale, (int, float)) else "S = 1"
    return (
        f"this run computed in {precision} at {at}: gradients that flushed during it are already exact zeros "
        f"({h.zero:,} of {h.total:,} {kind} values are zero, true zeros included), so the flushed shares "
        "below count only what survived and understate the loss; profile with --precision fp32 (the "
        "default) for the recommendation"
    )


def _print_precision_caveat(console: Any, report: Report, kind: str) -> None:
    from rich.markup import escape

    caveat = precision_caveat(report, kind)
    if caveat:
        console.print(f"[yellow]caveat: {escape(caveat)}[/yellow]")


def _print_run_context(console: Any, meta: Any) -> None:
    """Say where the inputs and loss came from, flag a loss that went inf/NaN, and give the
    weight-update check when the run trained."""
    from rich.markup import escape

    for key in ("inputs", "loss"):
        if key in meta.extra:
            console.print(f"  {key}: {escape(str(meta.extra[key]))}")
    bad = meta.extra.get("nonfinite_loss_steps")
    if bad:
        console.print(f"[red]finding: the loss was inf/NaN at step(s) {bad}; see the report[/red]")
    wul = meta.extra.get("weight_update_loss")
    if wul:
        console.print(f"weight updates ({escape(str(wul['measured_on']))}): {escape(str(wul['text']))}")


def print_profile_summary(console: Any, report: Report, rec: Any, *, fmt: str, kind: str, out: str) -> None:
    """A short summary after a profile run."""
    from rich.markup import escape

    meta = report.metadata
    h = report.histogram(kind)
    n = h.nonzero_finite
    state = "[yellow]partial (interrupted)[/yellow] " if meta.partial else ""
    console.print(
        f"profiled {state}{escape(meta.model_class)}: {meta.steps_seen} step(s), {len(meta.hooked_modules)} "
        f"module(s), {n:,} nonzero {kind} values, precision {meta.precision}"
    )
    _print_run_context(console, meta)
    _print_precision_caveat(console, report, kind)
    console.print(_worst_table(report, kind, fmt, _get(rec, "log2_scale"), 5))
    print_recommendation(console, rec)
    console.print(f"report written to {escape(out)}")


def print_compare(console: Any, result: Any) -> None:
    """The gate's checks as a table and the overall outcome."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="fp16probe compare", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("details")
    for c in result.checks:
        table.add_row(c.name, "pass" if c.passed else "[bold red]FAIL[/bold red]", escape(c.message))
    console.print(table)
    for w in getattr(result, "warnings", ()):
        console.print(f"[yellow]warning:[/yellow] {escape(w)}", soft_wrap=True)
    if result.passed:
        console.print("[green]no regression[/green]")
    else:
        console.print(f"[bold red]regression: {len(result.failures)} check(s) failed[/bold red]")


def print_verification(console: Any, v: Any) -> None:
    """Print a Verification: the recommended setting run for real, predicted against measured."""
    from rich.table import Table

    scaler = ("no loss scaler" if not v.scaler_kwargs else
              "GradScaler(" + ", ".join(f"{k}={val!r}" for k, val in v.scaler_kwargs.items()) + ")")
    console.print(f"verification: the recommendation run for real: {v.precision} autocast on {v.device}, "
                  f"{v.steps} steps on the profiled batches, {scaler}", markup=False, soft_wrap=True)
    table = Table()
    table.add_column("")
    table.add_column("predicted", justify="right")
    table.add_column("measured", justify="right")
    table.add_row("steps that overflowed", f"{v.predicted_overflow_steps} of {v.steps}",
                  f"{v.measured_overflow_steps} of {v.steps}")
    table.add_row(f"{v.kind} values zeroed", _percent(v.predicted_zeroed_fraction), _percent(v.measured_zeroed_fraction))
    for kind, counts in v.by_kind.items():  # the other kinds, measured only: the prediction judged v.kind
        if kind != v.kind and kind != "all":
            table.add_row(f"{kind} values zeroed", "not judged", _percent(counts.get("zeroed_fraction", 0.0)))
    console.print(table)
    console.print(
        f"zeroed: of the fp32 run's {v.nonzero_values:,} nonzero {v.kind} values on the same batches, the "
        f"{v.zeroed_values:,} that came out exactly 0 in the {v.precision} run; tolerance "
        f"±{_percent(v.tolerance)}", markup=False, soft_wrap=True)
    verdict = "held" if v.held else "did NOT hold"
    console.print(f"prediction {verdict}: {v.measured_overflow_steps} overflowing step(s) against "
                  f"{v.predicted_overflow_steps} predicted, zeroed share off by "
                  f"{_percent(abs(v.measured_zeroed_fraction - v.predicted_zeroed_fraction))} "
                  f"(this proves these {v.steps} steps on these batches, not a whole training run)",
                  markup=False, soft_wrap=True, style=None if v.held else "bold red")
    for note in v.notes:
        console.print(f"note: {note}", markup=False, soft_wrap=True)


def _percent(x: float) -> str:
    """A share as a percentage with enough digits to tell small shares apart."""
    if x == 0:
        return "0%"
    return f"{x:.3%}" if x >= 1e-3 else f"{x * 100:.3g}%"
