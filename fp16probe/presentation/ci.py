"""The CI gate's outputs: a Markdown summary, JUnit XML and GitHub Actions annotations.

Each function turns a :class:`fp16probe.analysis.gate.GateResult` into text; writing the
text (atomically) and deciding whether GitHub Actions is watching are the CLI's job.
Module names and messages are data: every string goes through
:mod:`fp16probe.presentation.escape` (Markdown for the summary, XML for JUnit, workflow-command
data for the annotations).
"""

from __future__ import annotations

import datetime
import re
from xml.sax.saxutils import escape as _xml_escape
from xml.sax.saxutils import quoteattr as _xml_quoteattr

from fp16probe.analysis.gate import GateResult
from fp16probe.presentation import escape as safe
from fp16probe.presentation.gate import check_message, warning_texts

__all__ = ["error_junit", "error_markdown", "github_annotations", "github_error_annotation", "to_junit", "to_markdown"]

SUITE = "fp16probe.compare"

# Characters XML 1.0 forbids even when escaped that the one rule (escape.text) leaves as they are: it
# already shows every control character and lone surrogate as a visible escape.
_NOT_XML = re.compile("[\ufffe\uffff]")


def escape(text: str) -> str:
    """Escape text for an XML element, replacing characters XML cannot hold with U+FFFD."""
    return _xml_escape(_NOT_XML.sub("\ufffd", safe.text(text)))


def quoteattr(text: str) -> str:
    """Quote text as an XML attribute value, replacing characters XML cannot hold with U+FFFD."""
    return _xml_quoteattr(_NOT_XML.sub("\ufffd", safe.text(text)))


def _cell(text: str) -> str:
    # GitHub renders an escaped pipe inside a table cell as a pipe: "max |g|" stays readable.
    return safe.markdown(text)


def to_markdown(result: GateResult, title: str = "fp16probe compare") -> str:
    """Return a Markdown summary (for ``$GITHUB_STEP_SUMMARY``) that ends with a blank line.

    The blank line keeps two summaries appended to one file two tables: without it the
    next summary's heading would continue the previous table outside GitHub's renderer.
    """
    n, failed = len(result.checks), len(result.failures)
    outcome = f"passed ({n} checks)" if result.passed else f"FAILED ({failed} of {n} checks)"
    lines = [
        f"### {safe.markdown(title)}: {outcome}",
        "",
        f"Format {_cell(result.current.format)}, {_cell(result.current.kind)}; baseline "
        f"`{_code(result.baseline.source)}` ({_cell(result.baseline.verdict)}), current "
        f"`{_code(result.current.source)}` ({_cell(result.current.verdict)}).",
        "",
        "| check | result | details |",
        "|---|---|---|",
    ]
    for c in result.checks:
        lines.append(f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {_cell(check_message(c))} |")
    if result.warnings:
        lines.append("")
        lines.extend(f"> **warning:** {_cell(w)}" for w in warning_texts(result))
    return "\n".join(lines) + "\n\n"


def _code(text: str) -> str:
    return safe.markdown_code(text)


def to_junit(result: GateResult, *, seconds: float | None = None, suite: str = SUITE,
             timestamp: datetime.datetime | None = None) -> str:
    """Return JUnit XML: a ``testsuites`` root, one test case per check, times, and every check's numbers.

    A failed check carries a ``failure`` element; every check, passing or not, carries its
    message (both values and the limit) in ``system-out``; warnings go to the suite's
    ``system-err``. ``seconds`` is the whole comparison's time (loading and analysis
    included); each case's time is its check's own.
    """
    total = sum(c.seconds for c in result.checks) if seconds is None else seconds
    stamp = (timestamp or datetime.datetime.now(datetime.timezone.utc)).replace(microsecond=0).isoformat()
    n, failed = len(result.checks), len(result.failures)
    counts = f'tests="{n}" failures="{failed}" errors="0" skipped="0" time="{total:.3f}"'
    out = [
        '<?xml version="1.0" encoding="utf-8"?>',
        f'<testsuites name="fp16probe" {counts}>',
        f'  <testsuite name="{suite}" {counts} timestamp="{stamp}">',
        "    <properties>",
    ]
    for name, value in (("baseline", result.baseline.source), ("current", result.current.source),
                        ("format", result.current.format), ("kind", result.current.kind),
                        ("baseline_verdict", result.baseline.verdict), ("current_verdict", result.current.verdict)):
        out.append(f"      <property name={quoteattr(name)} value={quoteattr(str(value))}/>")
    out.append("    </properties>")
    for c in result.checks:
        out.append(f'    <testcase classname="{suite}" name={quoteattr(c.name)} time="{c.seconds:.6f}">')
        message = check_message(c)
        if not c.passed:
            out.append(f"      <failure message={quoteattr(message)} type=\"regression\">{escape(message)}</failure>")
        details = "\n".join(escape(line) for line in (message, f"baseline: {c.baseline}", f"current: {c.current}",
                                                      f"limit: {c.limit}"))
        out.append(f"      <system-out>{details}</system-out>")
        out.append("    </testcase>")
    if result.warnings:
        out.append(f"    <system-err>{chr(10).join(escape(w) for w in warning_texts(result))}</system-err>")
    out += ["  </testsuite>", "</testsuites>", ""]
    return "\n".join(out)


_data = safe.workflow_data
_property = safe.workflow_property


def github_annotations(result: GateResult) -> list[str]:
    """Return GitHub Actions workflow commands: ``::error`` per failed check, ``::warning`` per warning.

    GitHub shows them as annotations on the run and the pull request.
    """
    lines = [
        f"::error title={_property('fp16probe compare: ' + c.name)}::{_data(check_message(c))}" for c in result.failures
    ]
    lines += [f"::warning title={_property('fp16probe compare')}::{_data(w)}" for w in warning_texts(result)]
    return lines


def error_markdown(message: str, title: str = "fp16probe compare") -> str:
    """Return the Markdown summary of a comparison that could not be made (a report that failed to load)."""
    return f"### {safe.markdown(title)}: ERROR\n\n{_cell(message)}\n\nNo check ran; the gate did not pass.\n\n"


def error_junit(message: str, *, seconds: float = 0.0, suite: str = SUITE,
                timestamp: datetime.datetime | None = None) -> str:
    """Return JUnit XML for a comparison that could not be made: one test case with an ``error``."""
    stamp = (timestamp or datetime.datetime.now(datetime.timezone.utc)).replace(microsecond=0).isoformat()
    counts = f'tests="1" failures="0" errors="1" skipped="0" time="{seconds:.3f}"'
    return "\n".join([
        '<?xml version="1.0" encoding="utf-8"?>',
        f'<testsuites name="fp16probe" {counts}>',
        f'  <testsuite name="{suite}" {counts} timestamp="{stamp}">',
        f'    <testcase classname="{suite}" name="load_reports" time="{seconds:.6f}">',
        f'      <error message={quoteattr(message)} type="input">{escape(message)}</error>',
        "    </testcase>",
        "  </testsuite>",
        "</testsuites>",
        "",
    ])


def github_error_annotation(message: str) -> str:
    """Return the GitHub workflow command for a comparison that could not be made."""
    return f"::error title={_property('fp16probe compare: error')}::{_data(message)}"
