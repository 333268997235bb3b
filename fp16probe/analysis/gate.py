"""The CI gate: compare a baseline report with the current one, as pure functions.

:func:`snapshot` reduces a report to the numbers the gate looks at (the flushed fraction
at S = 1, the merged histogram, the recommended scale, the worst modules); :func:`compare`
checks two snapshots against :class:`Thresholds`; :func:`to_markdown` and :func:`to_junit`
render the result. Nothing here prints or reads the environment; the CLI does that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD, Histogram, Report

__all__ = ["Check", "GateResult", "Snapshot", "Thresholds", "compare", "snapshot", "to_junit", "to_markdown"]


@dataclass(frozen=True)
class Thresholds:
    """What counts as a regression.

    ``max_flushed_increase``: allowed rise of the flushed fraction at S = 1, in absolute
    fraction (0.01 = one percentage point). ``max_scale_shift_bits``: allowed move of the
    recommended scale, in powers of two. ``worst_n``: how many worst modules are compared.
    ``fail_on_new_overflow``: fail when the current run overflows at the baseline's scale.
    """

    max_flushed_increase: float = 0.01
    max_scale_shift_bits: int = 2
    worst_n: int = 3
    fail_on_new_overflow: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Snapshot:
    """The numbers of one report that the gate compares.

    ``histogram`` holds the analysed kind (underflow); ``overflow_histogram`` every gradient
    the loss scale multiplies, activation and weight gradients alike, as the analyzer judges
    overflow (None: the analysed kind alone).
    """

    source: str
    format: str
    kind: str
    flushed_fraction: float
    histogram: Histogram
    log2_scale: int | None
    verdict: str
    worst_modules: tuple[tuple[str, float], ...]
    overflow_histogram: Histogram | None = None

    @property
    def overflow_values(self) -> Histogram:
        return self.histogram if self.overflow_histogram is None else self.overflow_histogram

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "format": self.format,
            "kind": self.kind,
            "flushed_fraction": self.flushed_fraction,
            "max_abs": self.histogram.max_abs,
            "nonfinite": self.histogram.nonfinite,
            "overflow_max_abs": self.overflow_values.max_abs,
            "overflow_nonfinite": self.overflow_values.nonfinite,
            "log2_scale": self.log2_scale,
            "verdict": self.verdict,
            "worst_modules": [list(w) for w in self.worst_modules],
        }


@dataclass(frozen=True)
class Check:
    """One gate check: its name, whether it passed, the two values and the limit."""

    name: str
    passed: bool
    baseline: Any
    current: Any
    limit: Any
    message: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class GateResult:
    """The outcome of :func:`compare`."""

    checks: tuple[Check, ...]
    baseline: Snapshot
    current: Snapshot
    thresholds: Thresholds

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "checks": [c.to_dict() for c in self.checks],
            "baseline": self.baseline.to_dict(),
            "current": self.current.to_dict(),
            "thresholds": self.thresholds.to_dict(),
        }


def flushed_fraction(h: Histogram, fmt: str, log2_scale: int = 0) -> float:
    """Share of nonzero finite values that flush to zero at S = 2^log2_scale (0.0 when none)."""
    n = h.nonzero_finite
    return h.flushed(fmt, log2_scale) / n if n else 0.0


def worst_modules(report: Report, fmt: str, kind: str, n: int) -> tuple[tuple[str, float], ...]:
    """The ``n`` modules with the largest flushed fraction at S = 1 (only those that lose any)."""
    ranked = []
    for m in report.modules_of(kind):
        f = flushed_fraction(m.histogram, fmt)
        if f > 0:
            ranked.append((m.name, f))
    ranked.sort(key=lambda x: (-x[1], x[0]))
    return tuple(ranked[:n])


def snapshot(report: Report, recommendation: Any, *, fmt: str = "fp16", kind: str = ACTIVATION_GRAD,
             worst_n: int = 3, source: str = "") -> Snapshot:
    """Reduce a report and its recommendation (an analysis.Recommendation or its dict) to a Snapshot."""
    rec = recommendation.to_dict() if hasattr(recommendation, "to_dict") else dict(recommendation or {})
    h = report.histogram(kind)
    return Snapshot(
        source=source,
        format=fmt,
        kind=kind,
        flushed_fraction=flushed_fraction(h, fmt),
        histogram=h,
        log2_scale=rec.get("log2_scale"),
        verdict=str(rec.get("verdict", "unknown")),
        worst_modules=worst_modules(report, fmt, kind, worst_n),
        overflow_histogram=Histogram.sum(report.histogram(k) for k in (ACTIVATION_GRAD, WEIGHT_GRAD)),
    )


def compare(baseline: Snapshot, current: Snapshot, thresholds: Thresholds = Thresholds()) -> GateResult:
    """Check ``current`` against ``baseline``; every check reports both values and the limit."""
    checks = []
    fmt = current.format
    rise = current.flushed_fraction - baseline.flushed_fraction
    checks.append(Check(
        "flushed_fraction",
        rise <= thresholds.max_flushed_increase,
        baseline.flushed_fraction,
        current.flushed_fraction,
        thresholds.max_flushed_increase,
        f"flushed at S=1 went from {_pct(baseline.flushed_fraction)} to {_pct(current.flushed_fraction)} "
        f"({'+' if rise >= 0 else ''}{rise * 100:.3g} points; allowed +{thresholds.max_flushed_increase * 100:.3g})",
    ))

    # Overflow at the scale the baseline recommended: that is the scale users deploy. The
    # scale multiplies weight gradients too, so they count whatever kind is analysed.
    k = baseline.log2_scale if baseline.log2_scale is not None else 0
    b_over, c_over = baseline.overflow_values, current.overflow_values
    was = b_over.overflows(fmt, k)
    now = c_over.overflows(fmt, k)
    new_overflow = now and not was
    checks.append(Check(
        "new_overflow",
        not (new_overflow and thresholds.fail_on_new_overflow),
        was,
        now,
        "none" if thresholds.fail_on_new_overflow else "ignored",
        f"at the baseline's scale 2^{k}: overflow {'yes' if was else 'no'} before, "
        f"{'yes' if now else 'no'} now (max |g| {b_over.max_abs:.3g} -> {c_over.max_abs:.3g}, "
        f"non-finite {b_over.nonfinite} -> {c_over.nonfinite})",
    ))

    b, c = baseline.log2_scale, current.log2_scale
    if b is None and c is None:
        shift, shift_ok, text = 0, True, "no scale recommended in either run"
    elif b is None or c is None:
        shift_ok = False
        shift = None
        text = f"recommended scale changed from {_scale(b)} to {_scale(c)} (verdict {baseline.verdict} -> {current.verdict})"
    else:
        shift = c - b
        shift_ok = abs(shift) <= thresholds.max_scale_shift_bits
        text = f"recommended scale moved from 2^{b} to 2^{c} ({shift:+d} bits; allowed ±{thresholds.max_scale_shift_bits})"
    checks.append(Check("scale_shift", shift_ok, b, c, thresholds.max_scale_shift_bits, text))

    before = {name for name, _ in baseline.worst_modules}
    newcomers = [name for name, _ in current.worst_modules if name not in before]
    checks.append(Check(
        "new_worst_modules",
        not newcomers,
        [n for n, _ in baseline.worst_modules],
        [n for n, _ in current.worst_modules],
        thresholds.worst_n,
        (f"newly among the {thresholds.worst_n} worst: {', '.join(newcomers)}" if newcomers
         else f"no module newly among the {thresholds.worst_n} worst"),
    ))
    return GateResult(tuple(checks), baseline, current, thresholds)


def to_markdown(result: GateResult, title: str = "fp16probe compare") -> str:
    """A Markdown summary (for $GITHUB_STEP_SUMMARY)."""
    verdict = "passed" if result.passed else f"FAILED ({len(result.failures)} of {len(result.checks)} checks)"
    lines = [
        f"### {title}: {verdict}",
        "",
        f"Format {result.current.format}, {result.current.kind}; baseline `{result.baseline.source}`, "
        f"current `{result.current.source}`.",
        "",
        "| check | result | details |",
        "|---|---|---|",
    ]
    for c in result.checks:
        # GitHub renders an escaped pipe inside a table cell as a pipe: "max |g|" stays readable.
        lines.append(f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.message.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def to_junit(result: GateResult, suite: str = "fp16probe.analysis.gate") -> str:
    """JUnit XML: one test case per check, a failure element for each failed one."""
    cases = []
    for c in result.checks:
        body = ""
        if not c.passed:
            body = f"<failure message={quoteattr(c.message)}>{escape(c.message)}</failure>"
        cases.append(f'  <testcase classname="{suite}" name={quoteattr(c.name)}>{body}</testcase>')
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        f'<testsuite name="{suite}" tests="{len(result.checks)}" failures="{len(result.failures)}" errors="0">\n'
        + "\n".join(cases)
        + "\n</testsuite>\n"
    )


def _pct(f: float) -> str:
    return f"{f * 100:.3g}%"


def _scale(k: int | None) -> str:
    return "none" if k is None else f"2^{k}"

