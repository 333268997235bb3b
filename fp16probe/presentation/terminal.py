"""Everything fp16probe shows in a terminal: the only module that imports rich.

The CLI's summaries and the ``__rich__`` views of a Report and a Recommendation are one
renderable (:class:`Fitted`) built for the width it is printed at, so ``profile``, ``show``,
``recommend`` and ``rich.print(report)`` agree and survive 80 columns and pipes: lines are
broken at spaces, module names after dots, URLs never, numbers never. Module names and
other report text are passed to rich as ``Text``, never parsed as markup. rich is imported
inside the functions; consoles are made per command, so NO_COLOR and tests work.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fp16probe.blockadvice import BlockAdvice
from fp16probe.analysis.gate import GateResult
from fp16probe.analysis.whatif import numerically_zero, worst_modules
from fp16probe.formats import Format, get_format
from fp16probe import formatting as num
from fp16probe.presentation import escape
from fp16probe.presentation.escape import GuardedStream
from fp16probe.presentation.gate import check_message, warning_texts
from fp16probe.presentation.schedule import FRAMEWORK_FORMS, framework_snippets, framework_sources, note_text, rule_label, schedule_answer
from fp16probe.presentation.cite import cite
from fp16probe.presentation.verdict import replay_table
from fp16probe.presentation.answer import (
    verification_cause,
    section_lines,
    brief_answer,
    evidence_rows,
    explanation_text,
    KIND_WORDS,
    fit_name,
    numerically_zero_sentence,
    recommendation_for,
    run_header,
    short_answer,
    stacked_table,
    weight_update_words,
    wrap_text,
)
from fp16probe.recommendation import Recommendation, Verdict
from fp16probe.report import ACTIVATION_GRAD, Histogram, Report, StepTrace
from fp16probe.verification import Verification

__all__ = [
    "Fitted",
    "make_console",
    "one_line",
    "print_compare",
    "print_error",
    "print_recommendation",
    "print_schedule",
    "print_summary",
    "progress",
    "recommendation_view",
    "report_view",
    "summary_view",
]

_STYLES = {"verdict": "bold", "todo": "bold", "caveat": "yellow", "invented": "yellow", "finding": "red", "code": "cyan"}


def make_console(stderr: bool = True) -> Any:
    """Return a rich Console on stderr (human output never goes to stdout) that prints report text safely.

    Every piece of text it prints is escaped by :func:`fp16probe.presentation.escape.text`
    (rich's own styles and cursor moves are not text and pass), and every line it writes goes
    through a :class:`~fp16probe.presentation.escape.GuardedStream`, so no line starts with
    ``::``: a renderer that forgets to escape a report string still cannot reach the terminal raw.
    The stream is the one in place now, bound: while third-party output is held back
    (:func:`fp16probe.running.thirdparty.held_back` swaps ``sys.stderr``), ours still shows.
    """
    import sys

    return _safe_console_class()(file=GuardedStream(sys.stderr if stderr else sys.stdout), highlight=False,
                                 soft_wrap=False)


_SAFE_CONSOLE: list[type] = []


def _safe_console_class() -> type:
    """rich's Console with every text segment escaped as it is rendered (made once, when rich is first needed)."""
    if not _SAFE_CONSOLE:
        from rich.console import Console
        from rich.segment import Segment

        class SafeConsole(Console):
            def render(self, renderable: Any, options: Any = None) -> Iterator[Any]:
                for seg in super().render(renderable, options):
                    # Line breaks are rich's own (text is split into lines before it is laid out).
                    if seg.control or seg.text == "\n" or not seg.text:
                        yield seg
                    else:
                        yield Segment("\n".join(escape.text(part) for part in seg.text.split("\n")),
                                      seg.style, seg.control)

        _SAFE_CONSOLE.append(SafeConsole)
    return _SAFE_CONSOLE[0]


def print_error(console: Any, message: str) -> None:
    """Print one line: what was wrong and what to do (control characters escaped, see :func:`one_line`)."""
    from rich.text import Text

    console.print(Text.assemble(("error: ", "bold red"), one_line(message)), soft_wrap=True)


def one_line(message: str) -> str:
    """``message`` as one safe line: :func:`fp16probe.presentation.escape.text` (a newline shows as ``\\n``).

    A path or a name with a newline in it would otherwise split the one error line, or
    forge a second ``error:`` line for a script that reads them.
    """
    return escape.text(message)


@contextlib.contextmanager
def progress(console: Any, total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """Show a progress bar with elapsed and remaining time on a terminal (a no-op elsewhere); yield ``update(steps_done)``."""
    if not enabled or not console.is_terminal:
        yield lambda done: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("elapsed,"), TimeRemainingColumn(), TextColumn("left"),
                  console=console, transient=True,
                  # stderr is not redirected through the bar: what libraries write there while the
                  # model runs stays held back (fp16probe.running.thirdparty), not printed above the bar.
                  redirect_stderr=False) as bar:
        task = bar.add_task("steps", total=total)
        yield lambda done: bar.update(task, completed=done)


class Fitted:
    """A rich renderable that builds its lines and tables for the width it is printed at."""

    def __init__(self, build: Callable[[int], Iterable[Any]]) -> None:
        self._build = build

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        yield from self._build(options.max_width)


def _lines(lines: Iterable[str], style: str = "") -> list[Any]:
    """Pre-fitted lines as Text that rich neither wraps, cuts nor reads as markup."""
    from rich.text import Text

    return [Text(line, style=style, no_wrap=True, overflow="ignore") for line in lines]


def _para(text: str, width: int, style: str = "", indent: str = "") -> list[Any]:
    return _lines(wrap_text(text, width, indent), style)


# -- views ---------------------------------------------------------------------------------
def summary_view(report: Report, rec: Recommendation | None, *, kind: str = ACTIVATION_GRAD,
                 explain: bool = False, top: int = 5, distribution: bool = False,
                 out: str | None = None, device: str | None = None) -> Fitted:
    """Return the summary of a report: the short answer first, then tables; ``explain`` adds
    the run's provenance, the histogram, the evidence, the reasoning, the replay and sources."""

    def build(width: int) -> Iterator[Any]:
        yield from _para(run_header(report), width)
        if rec is None:
            yield from _para("no recommendation stored in this report: fp16probe show REPORT, or "
                             "fp16probe.analysis.recommend.analyze(report), makes one", width, "yellow")
        else:
            yield from _answer(report, rec, width, device)
        fmt = get_format(rec.format if rec is not None else "fp16")
        k = rec.log2_scale if rec is not None else None
        if explain:
            yield from _run_context(report, width)
        if distribution or explain:
            yield _distribution_table(report.histogram(kind), fmt, k, kind)
        if explain:
            yield _bins_table(report.histogram(kind), fmt)
        judged = rec is None or rec.verdict is not Verdict.INSUFFICIENT_EVIDENCE
        if top and report.modules_of(kind) and judged:
            yield from _worst_table(report, kind, fmt, k, top, width)
        blocked = module_block_words(report.trace)
        if blocked:
            yield from _para(blocked, width)
        for line in section_lines(report):
            yield from _para(line, width)
        if explain and report.verification is not None:
            yield from _verification(report.verification, width)
        if explain and rec is not None:
            yield from _explanation(rec, width, fmt)
        if out is not None:
            yield from _para(f"report written to {out}", width)
        if not explain:
            yield from _para("--explain adds the reasoning, evidence, replay and sources", width, "dim")

    return Fitted(build)


def module_block_words(trace: StepTrace) -> str | None:
    """What a long trace keeps per module (its maxima per block of steps), or None when it keeps every step's."""
    b = trace.module_block
    if b <= 1:
        return None
    n = len(trace)
    return (f"per-module trace: each module's largest |g| kept as the max over each block of {num.count(b)} steps "
            f"({num.count(-(-n // b))} blocks over the {num.count(n)} steps); every whole-model figure (histogram, "
            "scale, overflow, ceiling) is kept for every step")


def recommendation_view(rec: Recommendation, report: Report | None = None, *,
                        device: str | None = None, explain: bool = False) -> Fitted:
    """Return the recommendation: the short answer, then (``explain``) its reasoning and sources.

    Without ``explain`` (the ``__rich__`` view) nothing in it is wider than the console, so
    a console that crops lines cuts nothing; the CLI prints the reasoning without cropping.
    """

    def build(width: int) -> Iterator[Any]:
        yield from _answer(report, rec, width, device)
        if explain:
            yield from _explanation(rec, width)

    return Fitted(build)


def report_view(report: Report) -> Fitted:
    """Return the ``__rich__`` view of a report: the summary with its distribution table."""
    return summary_view(report, recommendation_for(report), distribution=True)


def print_summary(console: Any, report: Report, rec: Recommendation | None, **options: Any) -> None:
    """Print :func:`summary_view` (``profile`` and ``show``); a URL longer than a line stays whole."""
    console.print(summary_view(report, rec, **options), soft_wrap=True)


def print_answers(console: Any, report: Report, rec: Recommendation | None, advice: BlockAdvice | None, *,
                  out: str | None = None, **options: Any) -> None:
    """Print the report's answers: the loss-scale one (:func:`print_summary`) and the scaled-format one.

    A scaled format with no loss scale to judge (MXFP8, NVFP4: ``rec`` None) prints the
    per-layer answer alone; fp8 with block statistics prints both.
    """
    if rec is None and advice is not None:
        print_block_advice(console, report, out=out, advice=advice)
        return
    print_summary(console, report, rec, out=out, **options)
    if advice is not None:
        print_block_advice(console, report, header=False, advice=advice)


def print_block_advice(console: Any, report: Report, *, header: bool = True, out: str | None = None,
                       advice: BlockAdvice | None = None) -> None:
    """Print the scaled-format answer (``advice``, default: the one stored in ``report``)."""
    from fp16probe.presentation.blockview import block_advice_lines

    advice = report.block_advice if advice is None else advice
    if advice is None:
        return
    lines = ([run_header(report)] if header else []) + block_advice_lines(advice, top=20, width=console.width)
    if out is not None:
        lines.append(f"report written to {out}")
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def print_recommendation(console: Any, rec: Recommendation, report: Report | None = None,
                         device: str | None = None, explain: bool = False) -> None:
    """Print ``recommend``'s answer: the verdict and the code to paste in a few lines; ``explain``
    adds the caveats, the reasoning, the evidence and the sources."""
    if explain:
        console.print(recommendation_view(rec, report, device=device, explain=True), soft_wrap=True)
        return

    def build(width: int) -> Iterator[Any]:
        for line in brief_answer(report, rec, width=width, device=device):
            if line.kind == "code":
                yield from _lines(line.text.splitlines(), _STYLES["code"])
            else:
                yield from _para(line.text, width, "dim" if line.kind == "more" else _STYLES.get(line.kind, ""),
                                 "" if line.kind == "more" else "  ")

    console.print(Fitted(build), soft_wrap=True)


def _answer(report: Report | None, rec: Recommendation, width: int, device: str | None) -> Iterator[Any]:
    for line in short_answer(report, rec, width=width, device=device):
        if line.kind == "code":
            yield from _lines(line.text.splitlines(), _STYLES["code"])
        elif line.kind == "verification":
            held = report is None or report.verification is None or report.verification.held
            yield from _para(line.text, width, "green" if held else "bold red", "  ")
        else:
            yield from _para(line.text, width, _STYLES.get(line.kind, ""), "  ")


def _run_context(report: Report, width: int) -> Iterator[Any]:
    """Where the inputs and loss came from, and the weight-update check in full."""
    work = report.workload
    if work is None:
        return
    for key, value in (("inputs", work.inputs), ("loss", work.loss)):
        if value is not None:
            yield from _para(f"{key}: {value}", width, indent="  ")
    wul = work.weight_update_loss
    if wul:
        yield from _para(f"weight updates ({wul['measured_on']}): {weight_update_words(wul)}", width, indent="  ")


def _verification(v: Verification, width: int) -> Iterator[Any]:
    """The recommended setting run for real: predicted against measured, and what it proves."""
    from rich.table import Table

    from fp16probe.presentation.paste import grad_scaler_args

    args = grad_scaler_args(v.scaler_kwargs)  # written as code: GradScaler's own arguments, checked, or words
    scaler = ("no loss scaler" if not v.scaler_kwargs else "a GradScaler whose stored arguments are not GradScaler's"
              if args is None else "GradScaler(" + ", ".join(f"{k}={val}" for k, val in args.items()) + ")")
    yield from _para(f"verification: the recommendation run for real: {v.precision} autocast on {v.device}, "
                     f"{v.steps} steps on the profiled batches, {scaler}", width)
    table = Table()
    for col in ("", "predicted", "measured"):
        table.add_column(col, justify="right" if col else "left", no_wrap=bool(col))
    table.add_row(*_cells(["steps that overflowed", f"{v.predicted_overflow_steps} of {v.steps}",
                           f"{v.measured_overflow_steps} of {v.steps}"]))
    table.add_row(*_cells([f"{v.kind} values zeroed", num.percent(v.predicted_zeroed_fraction),
                           num.percent(v.measured_zeroed_fraction)]))
    for kind, counts in v.by_kind.items():  # the other kinds, measured only: the prediction judged v.kind
        if kind not in (v.kind, "all"):
            table.add_row(*_cells([f"{kind} values zeroed", "not judged",
                                   num.percent(counts.get("zeroed_fraction", 0.0))]))
    yield table
    yield from _para(f"zeroed: of the fp32 run's {num.count(v.nonzero_values)} nonzero {v.kind} values on the "
                     f"same batches, the {num.count(v.zeroed_values)} that came out exactly 0 in the "
                     f"{v.precision} run; tolerance ±{num.percent(v.tolerance)}; this proves these {v.steps} "
                     "steps on these batches, not a whole training run", width)
    cause = verification_cause(v)
    if cause:
        yield from _para(cause, width, indent="  ")
    for note in v.notes:
        yield from _para(f"note: {note}", width, indent="  ")


def _explanation(rec: Recommendation, width: int, fmt: Format | None = None) -> Iterator[Any]:
    from rich.table import Table

    yield from _lines(["", "why:"], "bold")
    yield from _para(explanation_text(rec, fmt), width)
    evidence = evidence_rows(rec.evidence)
    if evidence:
        table = Table(title="evidence", title_justify="left")
        table.add_column("quantity", no_wrap=True)
        room = max(width - max(len(n) for n, _ in evidence) - 7, 16)
        table.add_column("value", width=room)
        for name, value in evidence:
            table.add_row(*_cells([name, "\n".join(wrap_text(value, room))]))
        yield table
    if rec.growth_interval_table and rec.growth_interval_table.get("rows"):
        title, heads, rows, notes = replay_table(rec.growth_interval_table)
        table = Table(title=title, title_justify="left")
        for col in heads:
            table.add_column(col, justify="right", no_wrap=True)
        for row in rows:
            table.add_row(*_cells(row))
        yield table
        yield from _lines([ln for n in notes for ln in wrap_text(n, width, "  ")], "dim")
    if rec.citations:
        yield from _lines(["sources:"], "bold")
        yield from _lines([ln for c in rec.citations for ln in wrap_text(f"- {cite(c)}", width, "  ")], "dim")


def schedule_view(table: Any, width: int = 100) -> Iterator[Any]:
    """The schedule replay (:class:`fp16probe.analysis.schedule.ScheduleTable`): the table, then the answer.

    When the table is wider than ``width``, each rule's figures go on the line under its name,
    under short headers with a legend, so an 80-column CI log shows every number whole.
    """
    from rich.table import Table

    flush = table.flush_reference is not None
    title = (f"loss-scale rules replayed over this run's {num.count(table.steps)} recorded steps "
             f"({table.format})")
    threshold = num.percent(table.max_flushed_fraction)
    rows = []
    for r in table.rows:
        over = "n/a" if r.steps_over_threshold is None else num.count(r.steps_over_threshold)
        if r.recovery_steps_mean is None:
            recovery = "no backoff" if not r.backoffs else "not recovered"
        else:
            recovery = f"{r.recovery_steps_mean:.0f} / {r.recovery_steps_max}"
        rows.append([rule_label(r.name), num.count(r.skipped_steps), over,
                     num.percent(r.mean_flushed_fraction) if flush else "n/a",
                     num.percent(r.worst_flushed_fraction) if flush else "n/a",
                     recovery, num.magnitude(r.final_scale)])
    columns = ["rule", "skipped", "flushing > " + threshold, "mean flushed", "worst flushed",
               "recovery mean/max", "final S"]
    # rich's box: each column is its widest cell plus a space either side and a border; one border closes.
    natural = sum(max([len(h)] + [len(r[i]) for r in rows]) + 3 for i, h in enumerate(columns)) + 1
    if natural > width:
        yield from _lines(wrap_text(title, width), "italic")
        legend = [("skip", "steps skipped (overflow)"), (f">{threshold}", f"steps flushing more than {threshold}"),
                  ("mean, worst", "flushed share of nonzero values over the steps"),
                  ("recovery", "steps to regain S after a backoff, mean / max"), ("final S", "the scale at the end")]
        yield from _lines(stacked_table(["rule", "skip", f">{threshold}", "mean", "worst", "recovery", "final S"],
                                        rows, width, legend))
    else:
        t = Table(title=title, title_justify="left")
        for i, col in enumerate(columns):
            t.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
        for cells in rows:
            t.add_row(*_cells(cells))
        yield t
    if table.reproduced is not None:
        yield from _para(("check: the run's own settings reproduce its recorded scale on every step and its "
                          "skipped steps exactly") if table.reproduced else
                         "check: the run's own settings do NOT reproduce its recorded scales (see the note)",
                         width, "dim" if table.reproduced else "yellow")
    yield from _lines([""])
    yield from _para(schedule_answer(table), width)
    for note in table.notes:
        yield from _para(note_text(note), width, "yellow")
    snippets = framework_snippets(table, width=width)
    yield from _lines(["", f"{snippets['rule']} in each framework's own form:"])
    for fw, text in snippets["settings"].items():
        if text is None:
            yield from _para(f"{FRAMEWORK_FORMS[fw]}: cannot be written ({snippets['cannot'][fw]})", width, "dim")
        else:
            yield from _lines([f"{FRAMEWORK_FORMS[fw]}:"] + text.split("\n"))
            for note in snippets["notes"].get(fw, ()):
                yield from _para(f"note: {note}", width, "dim", "  ")
    yield from _lines(["", "the frameworks' shipped rules, from:"], "dim")
    for line in framework_sources():
        yield from _para(line, width, "dim", "  ")


def print_schedule(console: Any, table: Any) -> None:
    """Print the schedule replay table and its answer."""
    from rich.console import Group

    console.print(Group(*schedule_view(table, console.width)))


# -- tables ----------------------------------------------------------------------------------
def _cells(values: Iterable[str]) -> list[Any]:
    """Table cells as Text: report strings (module names) are data, never markup."""
    from rich.text import Text

    # A cell's own line breaks (a name fitted after its dots) are kept; the data in it was escaped before fitting.
    return [Text("\n".join(escape.text(line) for line in str(v).split("\n"))) for v in values]


def _distribution_table(h: Histogram, fmt: Format, log2_scale: int | None, kind: str) -> Any:
    from rich.table import Table

    n = h.nonzero_finite
    table = Table(title=f"{kind}: {num.count(h.total)} values against {fmt.name}", title_justify="left")
    table.add_column("|g| at S = 1")
    ks = [0] + ([log2_scale] if log2_scale not in (None, 0) else [])
    for col in ["values", "of nonzero"] + [f"at S = 2^{k}" for k in ks[1:]]:
        table.add_column(col, justify="right", no_wrap=True)
    rows = [
        (f"normal (> 2^{fmt.log2_min_normal})", lambda k: n - h.at_most(fmt.log2_min_normal - k)),
        (f"subnormal (2^{fmt.log2_flush_threshold}, 2^{fmt.log2_min_normal}]", lambda k: h.subnormal(fmt, k)),
        (f"flushed to 0 (<= 2^{fmt.log2_flush_threshold})", lambda k: h.flushed(fmt, k)),
    ]
    for label, count in rows:
        table.add_row(*_cells([label, num.count(count(0))] + [num.share(count(k), n) for k in ks]))
    blank = [""] * (len(ks) - 1)
    table.add_row(*_cells(["exact zeros", num.count(h.zero), ""] + blank))
    table.add_row(*_cells(["inf / NaN", f"{num.count(h.inf)} / {num.count(h.nan)}", ""] + blank))
    over = ["yes" if h.overflows(fmt, k) else "no" for k in ks]
    table.add_row(*_cells([f"overflows past {fmt.max:g}", f"max {num.magnitude(h.max_abs)}"] + over))
    return table


def _bins_table(h: Histogram, fmt: Format, rows: int = 24) -> Any:
    """Occupied log2 bins, grouped so at most ``rows`` show, with the format's bounds marked."""
    from rich.table import Table
    from rich.text import Text

    lo, hi = h.lowest_exp, h.highest_exp
    table = Table(title="log2 histogram (bin e holds |g| in (2^(e-1), 2^e])", title_justify="left")
    table.add_column("bins", no_wrap=True)
    table.add_column("values", justify="right", no_wrap=True)
    table.add_column("", min_width=20)
    table.add_column(f"{fmt.name} at S = 1", no_wrap=True)
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
            region = Text("flushed", style="red")
        elif top <= fmt.log2_min_normal:
            region = Text("subnormal", style="yellow")
        elif top >= first_overflow:
            region = Text("overflow", style="red")
        else:
            region = Text("normal")
        label = f"2^{top}" if bottom == top else f"2^{bottom}..2^{top}"
        table.add_row(label, num.count(c), "#" * round(20 * c / peak), region)
    return table


def _worst_table(report: Report, kind: str, fmt: Format, log2_scale: int | None, top: int,
                 width: int) -> Iterator[Any]:
    """The modules that flush the most, names wrapped after dots to the room the numbers leave."""
    from rich.table import Table

    ranked = [report.module(w.name, w.kind) for w in worst_modules(report, fmt, kind=kind, count=top)]
    if not ranked:
        yield from _para(f"no module's values flush in {fmt.name} at S = 1 ({kind})", width)
        return
    at_s = log2_scale not in (None, 0)
    header = ["type", "S = 1"] + ([f"S = 2^{log2_scale}"] if at_s else []) + ["max |g|"]
    rows = []
    for m in ranked:
        h = m.histogram
        shares = [num.share(h.flushed(fmt, k), h.nonzero_finite) for k in ([0, log2_scale] if at_s else [0])]
        rows.append([m.module_type, *shares, num.magnitude(h.max_abs)])
    fixed = [max([len(head)] + [len(r[i]) for r in rows]) for i, head in enumerate(header)]
    # Each column costs its width plus a space either side and a border; one border closes.
    room = max(width - sum(w + 3 for w in fixed) - 4, 12)
    # The title as a paragraph: rich would not wrap a title wider than a narrow table.
    yield from _para(f"modules that flush the most: share of their nonzero {KIND_WORDS.get(kind, kind)} "
                     f"flushed in {fmt.name}", width, "italic")
    table = Table()
    cancelled = numerically_zero(report)
    marks = {m.name: " *" if m.name in cancelled else "" for m in ranked}
    table.add_column("module", width=min(room, max([len("module")] + [len(escape.text(m.name) + marks[m.name])
                                                                      for m in ranked])))
    for head, w in zip(header, fixed):
        table.add_column(head, justify="left" if head == "type" else "right", no_wrap=True, min_width=w)
    for m, cells in zip(ranked, rows):
        table.add_row(*_cells(["\n".join(fit_name(escape.text(m.name) + marks[m.name], room))] + cells))
    yield table
    shown = {m.name: cancelled[m.name] for m in ranked if m.name in cancelled}
    if shown:
        yield from _para(numerically_zero_sentence(shown), width, "dim", "  ")


def print_compare(console: Any, result: GateResult) -> None:
    """Print the gate's checks as a table and the overall outcome."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="fp16probe compare", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("details")
    for c in result.checks:
        table.add_row(Text(escape.text(c.name)), Text("pass") if c.passed else Text("FAIL", style="bold red"),
                      Text(escape.text(check_message(c))))
    console.print(table)
    for w in warning_texts(result):
        console.print(Group(*_para(f"warning: {escape.text(w)}", console.width, "yellow", "  ")))
    if result.passed:
        console.print(Text("no regression", style="green"))
    else:
        console.print(Text(f"regression: {len(result.failures)} check(s) failed", style="bold red"))

