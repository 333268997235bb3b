"""The CI gate: judge a current report against a baseline by what users deploy, as pure functions.

Users deploy the loss scale the baseline recommended. So the gate asks, of the current
run: how much more flushes at *that* scale, and at the scale it now recommends itself; is
its verdict worse (``Verdict.severity``); does it overflow at the deployed scale; did any
module's own flushed share rise; did its measured verification fail. The share at S = 1
and the move of the recommended scale are checked too.

:func:`compare_reports` is the gate as one call (two reports or report files in, a
:class:`GateResult` out), what ``fp16probe compare`` runs and what a pytest test calls.
:func:`snapshot` reduces a report to the numbers the gate looks at; :func:`compare` checks
two snapshots against :class:`GateThresholds` and notes where the two reports profiled
different things. Rendering (Markdown, JUnit, GitHub annotations) lives in
:mod:`fp16probe.presentation.ci`. Nothing here prints or reads the environment.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from os import PathLike
from typing import Any, Iterable, Mapping

from fp16probe.columns import HistogramColumn
from fp16probe.errors import ReportError
from fp16probe.analysis.whatif import flushed_fraction
from fp16probe.analysis.whatif import worst_modules as rank_worst_modules
from fp16probe.recommendation import Recommendation, Verdict
from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD, Histogram, Report
from fp16probe.analysis.trial import HURT_UNSEEN, report_agreement
from fp16probe.verification import Verification
from fp16probe.sections import Workload

__all__ = [
    "Check",
    "GateWarning",
    "GateResult",
    "GateThresholds",
    "Snapshot",
    "canonical_module_names",
    "check_consistency",
    "compare",
    "compare_reports",
    "flushed_fraction",
    "natural_key",
    "snapshot",
    "worst_modules",
]

# Wrappers that rename a model's modules without changing it: torch.compile's
# OptimizedModule keeps the model as ``_orig_mod``; DistributedDataParallel (and
# DataParallel) as ``module``.
_COMPILE_SEGMENT = "_orig_mod"
_DDP_PREFIX = "module"


@dataclass(frozen=True)
class GateThresholds:
    """What counts as a regression.

    ``max_flushed_increase``: allowed rise of the flushed share at S = 1 (absolute fraction,
    0.01 = one percentage point). ``max_flushed_increase_at_scale``: allowed rise of the
    share flushed at the scale users deploy (the baseline's recommendation, and each run's
    own); 0.001 = 0.1 point, the analyzer's own tolerance. ``max_module_increase``: allowed
    rise of one module's own share at the baseline's scale. ``max_scale_shift_bits``: allowed
    move of the recommended scale, in powers of two. ``worst_n``: how many regressed modules
    a message names. ``fail_on_new_overflow``: fail when the current run overflows at the
    baseline's scale and the baseline did not. ``fail_on_worse_verdict``: fail when the
    verdict's severity rose.
    """

    max_flushed_increase: float = 0.01
    max_flushed_increase_at_scale: float = 0.001
    max_module_increase: float = 0.01
    max_scale_shift_bits: int = 2
    worst_n: int = 3
    fail_on_new_overflow: bool = True
    fail_on_worse_verdict: bool = True

    def to_dict(self) -> dict[str, Any]:
        """Return the thresholds as JSON-ready data."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class Snapshot:
    """The numbers of one report that the gate compares.

    ``histogram`` holds the analysed kind (underflow); ``overflow_histogram`` every gradient
    the loss scale multiplies, activation and weight gradients alike, as the analyzer judges
    overflow (None: the analysed kind alone); ``ceiling`` the largest unscaled |g| anywhere
    in backward when the report recorded it (``math.inf`` after a non-finite value).
    ``modules`` maps each module's name, stripped of wrapper prefixes, to its histogram.
    ``workload`` says what was profiled (model, precision, inputs, loss), to notice when two
    reports profiled different things. ``verification`` is ``(held, summary)`` when the
    report carries a measured verification of its recommendation (``held`` re-judged from its
    numbers); ``verification_edited`` says the report claims it held though its numbers say not.
    ``trial`` is how the report's training trial stands to its verdict
    (:func:`fp16probe.analysis.trial.report_agreement`, judged again from the stored curves).
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
    ceiling: float | None = None
    modules: Mapping[str, Histogram] = field(default_factory=dict)
    workload: Mapping[str, Any] = field(default_factory=dict)
    verification: tuple[bool, str] | None = None
    stored_recommendation: tuple[str, int | None] | None = None
    verification_edited: bool = False
    trial: str | None = None  # how the report's training trial stands to its verdict (analysis.trial's codes)

    @property
    def overflow_values(self) -> Histogram:
        """Return the histogram whose values the loss scale multiplies (overflow is judged on it)."""
        return self.histogram if self.overflow_histogram is None else self.overflow_histogram

    @property
    def overflow_max(self) -> float:
        """Return the largest unscaled magnitude that the loss scale multiplies."""
        m = self.overflow_values.max_abs
        return m if self.ceiling is None else max(m, self.ceiling)

    @property
    def deployed_log2_scale(self) -> int:
        """Return the exponent of the scale this run's recommendation deploys (0: no scaling)."""
        return 0 if self.log2_scale is None else self.log2_scale

    @property
    def severity(self) -> int:
        """Return the verdict's severity (higher is worse); an unknown verdict counts as the worst."""
        try:
            return Verdict(self.verdict).severity
        except ValueError:
            return max(v.severity for v in Verdict) + 1

    def flushed_at(self, log2_scale: int) -> float:
        """Return the share of the analysed kind's nonzero values that flush at S = 2^log2_scale."""
        return flushed_fraction(self.histogram, self.format, log2_scale)

    def overflows_at(self, log2_scale: int) -> bool:
        """Return whether any gradient the loss scale multiplies overflows at S = 2^log2_scale."""
        if self.overflow_values.overflows(self.format, log2_scale):
            return True
        return self.ceiling is not None and _overflows(self.format, self.ceiling, log2_scale)

    def to_dict(self) -> dict[str, Any]:
        """Return the snapshot as JSON-ready data."""
        return {
            "source": self.source,
            "format": self.format,
            "kind": self.kind,
            "flushed_fraction": self.flushed_fraction,
            "flushed_fraction_at_scale": self.flushed_at(self.deployed_log2_scale),
            "max_abs": self.histogram.max_abs,
            "nonfinite": self.histogram.nonfinite,
            "overflow_max_abs": _finite_or_none(self.overflow_max),
            "overflow_nonfinite": self.overflow_values.nonfinite,
            "log2_scale": self.log2_scale,
            "verdict": self.verdict,
            "verdict_severity": self.severity,
            "worst_modules": [list(w) for w in self.worst_modules],
            "workload": dict(self.workload),
            "verification": None if self.verification is None else
            {"held": self.verification[0], "summary": self.verification[1]},
            "trial": self.trial,
        }
        # fp16probe.presentation.gate.result_dict words the summary of an edited verification.


@dataclass(frozen=True)
class Check:
    """One gate check: its name, whether it passed, the two values, the limit and its time.

    ``facts`` holds what the check's message says beyond those (the scales compared, the
    modules named, ...), keyed per check; :func:`fp16probe.presentation.gate.check_message`
    words it.
    """

    name: str
    passed: bool
    baseline: Any
    current: Any
    limit: Any
    facts: Mapping[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(frozen=True)
class GateWarning:
    """Something the two reports differ in that no check judges, as a code and its data.

    Codes: ``partial`` (``label``, ``steps``, ``requested``, ``stopped``: a run stopped early),
    ``workload`` (``label`` of the setting, ``baseline``, ``current``: what was profiled differs),
    ``modules`` (``only_baseline``, ``only_current``, ``both``: module names one report lacks),
    ``stored_recommendation`` (``label``, ``stored``, ``analysed``: a file's stored verdict and
    scale differ from their re-analysis). :func:`fp16probe.presentation.gate.warning_text` words it.
    """

    code: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GateResult:
    """The outcome of :func:`compare`: the checks, and warnings about what the two reports profiled."""

    checks: tuple[Check, ...]
    baseline: Snapshot
    current: Snapshot
    thresholds: GateThresholds
    warnings: tuple[GateWarning, ...] = ()

    @property
    def passed(self) -> bool:
        """Return whether every check passed."""
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        """Return the checks that failed."""
        return tuple(c for c in self.checks if not c.passed)

    # The JSON form, with every message and warning worded, is fp16probe.presentation.gate.result_dict.


# -- names ------------------------------------------------------------------------------------

def natural_key(name: str) -> tuple[Any, ...]:
    """Return a sort key that orders digit runs by value: ``layers.2`` before ``layers.10``."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name) if part)


def canonical_module_names(names: Iterable[str]) -> dict[str, str]:
    """Map module names to the names of the unwrapped model.

    ``_orig_mod`` segments (``torch.compile``) are dropped wherever they occur; a leading
    ``module.`` (DistributedDataParallel, DataParallel) is dropped when every name carries
    it, since a model may well have a child of its own called ``module``.
    """
    names = list(names)
    stripped = {n: ".".join(p for p in n.split(".") if p != _COMPILE_SEGMENT) for n in names}
    values = [v for v in stripped.values() if v]
    if values and all(v == _DDP_PREFIX or v.startswith(_DDP_PREFIX + ".") for v in values):
        stripped = {n: v[len(_DDP_PREFIX) + 1:] if v.startswith(_DDP_PREFIX + ".") else "" for n, v in stripped.items()}
    return stripped


# -- the numbers of one report ----------------------------------------------------------------

def worst_modules(report: Report, fmt: str, kind: str, n: int, log2_scale: int = 0) -> tuple[tuple[str, float], ...]:
    """Return the ``n`` modules with the largest flushed share at S = 2^log2_scale (only those that lose any).

    The one ranking of ``fp16probe.analysis.whatif.worst_modules``, as (name, share) pairs.
    """
    ranked = rank_worst_modules(report, fmt, log2_scale=log2_scale, kind=kind, count=n)
    return tuple((m.name, m.fraction) for m in ranked)


def check_consistency(report: Report, source: str = "report") -> None:
    """Refuse a report whose module histograms do not add up to its per-step trace.

    A probe counts every value into both, so they agree exactly; a file in which one was
    edited without the other (to pass a gate, say) does not. Raises ReportError.
    """
    for kind, per_step in report.trace.histograms.items():
        if not per_step:
            continue
        steps = per_step.total() if isinstance(per_step, HistogramColumn) else Histogram.sum(per_step)
        modules = report.histogram(kind)
        if steps.counts != modules.counts or (steps.zero, steps.inf, steps.nan) != (modules.zero, modules.inf, modules.nan):
            raise ReportError(
                f"{source}: its {kind} module histograms ({modules.total} values) do not add up to its per-step "
                f"trace ({steps.total} values); the report was edited or is corrupt: re-create it with fp16probe profile"
            )


def snapshot(report: Report, recommendation: Recommendation | None, *, fmt: str = "fp16", kind: str = ACTIVATION_GRAD,
             worst_n: int = 3, source: str = "") -> Snapshot:
    """Reduce a report and its recommendation to a Snapshot."""
    h = report.histogram(kind)
    names = canonical_module_names(m.name for m in report.modules)
    modules: dict[str, Histogram] = {}
    for m in report.modules_of(kind):
        modules[names[m.name]] = modules.get(names[m.name], Histogram()) + m.histogram
    ceiling = report.trace.ceiling
    stored = report.recommendation
    verification, edited = _verification(report)
    return Snapshot(
        source=source,
        format=fmt,
        kind=kind,
        flushed_fraction=flushed_fraction(h, fmt),
        histogram=h,
        log2_scale=None if recommendation is None else recommendation.log2_scale,
        verdict="unknown" if recommendation is None else str(recommendation.verdict),
        worst_modules=tuple((names[n], f) for n, f in worst_modules(report, fmt, kind, worst_n)),
        overflow_histogram=Histogram.sum(report.histogram(k) for k in (ACTIVATION_GRAD, WEIGHT_GRAD)),
        ceiling=max(ceiling) if ceiling else None,
        modules=modules,
        workload=_workload(report),
        verification=verification,
        stored_recommendation=None if stored is None else (str(stored.verdict), stored.log2_scale),
        verification_edited=edited,
        trial=report_agreement(report),
    )


def _workload(report: Report) -> dict[str, Any]:
    meta = report.metadata
    work = report.workload or Workload()
    return {
        "model_class": meta.model_class,
        "precision": meta.precision,
        "captured": list(meta.captured),
        "inputs": work.inputs,
        "loss": work.loss,
        "loss_scale": work.loss_scale,
        "format": None if report.recommendation is None else report.recommendation.format,
        # A run stopped early (Ctrl-C, a signal, a failure): what it holds, so the gate can say so.
        "partial": None if not meta.partial else {
            "steps": meta.steps_seen, "requested": work.steps_requested, "stopped": work.stopped,
        },
    }


def _verification(report: Report) -> tuple[tuple[bool, str] | None, bool]:
    """``(held, summary)`` of the report's measured verification, re-judged from its own numbers,
    and whether the report says it held when its numbers say it did not."""
    v = report.verification
    if v is None:
        return None, False
    judged = Verification.judge(v.predicted_overflow_steps, v.measured_overflow_steps,
                                v.predicted_zeroed_fraction, v.measured_zeroed_fraction, v.tolerance)
    return (v.held and judged, v.summary), v.held and not judged


# -- the checks -------------------------------------------------------------------------------

def compare(baseline: Snapshot, current: Snapshot, thresholds: GateThresholds = GateThresholds()) -> GateResult:
    """Check ``current`` against ``baseline``; every check reports both values and the limit."""
    checks = []
    for check in (_at_baseline_scale, _at_recommended_scale, _at_one, _verdict, _new_overflow, _scale_shift,
                  _module_regressions, _verified, _trial):
        start = time.perf_counter()
        c = check(baseline, current, thresholds)
        if c is not None:
            checks.append(Check(c.name, c.passed, c.baseline, c.current, c.limit, c.facts,
                                time.perf_counter() - start))
    return GateResult(tuple(checks), baseline, current, thresholds, _workload_warnings(baseline, current))


def _rise_check(name: str, before: float, after: float, limit: float, facts: Mapping[str, Any]) -> Check:
    return Check(name, after - before <= limit, before, after, limit, facts)


def _at_baseline_scale(b: Snapshot, c: Snapshot, t: GateThresholds) -> Check:
    k = b.deployed_log2_scale
    return _rise_check("flushed_at_baseline_scale", b.flushed_at(k), c.flushed_at(k),
                       t.max_flushed_increase_at_scale, {"log2_scale": k})


def _at_recommended_scale(b: Snapshot, c: Snapshot, t: GateThresholds) -> Check:
    kb, kc = b.deployed_log2_scale, c.deployed_log2_scale
    return _rise_check("flushed_at_recommended_scale", b.flushed_at(kb), c.flushed_at(kc),
                       t.max_flushed_increase_at_scale, {"log2_scales": (kb, kc)})


def _at_one(b: Snapshot, c: Snapshot, t: GateThresholds) -> Check:
    return _rise_check("flushed_fraction", b.flushed_fraction, c.flushed_fraction, t.max_flushed_increase, {})


def _verdict(b: Snapshot, c: Snapshot, t: GateThresholds) -> Check:
    worse = c.severity > b.severity
    return Check("verdict", not (worse and t.fail_on_worse_verdict), b.verdict, c.verdict,
                 "no worse" if t.fail_on_worse_verdict else "ignored",
                 {"severity": (b.severity, c.severity), "judged": t.fail_on_worse_verdict})


def _new_overflow(b: Snapshot, c: Snapshot, t: GateThresholds) -> Check:
    # At the scale the baseline recommended: the scale users deploy. The scale multiplies
    # weight gradients too, so they count whatever kind is analysed.
    k = b.deployed_log2_scale
    was, now = b.overflows_at(k), c.overflows_at(k)
    new = now and not was
    return Check(
        "new_overflow", not (new and t.fail_on_new_overflow), was, now,
        "none" if t.fail_on_new_overflow else "ignored",
        {"log2_scale": k, "max_abs": (b.overflow_max, c.overflow_max),
         "nonfinite": (b.overflow_values.nonfinite, c.overflow_values.nonfinite)},
    )


def _scale_shift(b: Snapshot, c: Snapshot, t: GateThresholds) -> Check:
    kb, kc = b.log2_scale, c.log2_scale
    facts = {"verdicts": (b.verdict, c.verdict)}
    if kb is None or kc is None:
        return Check("scale_shift", kb is None and kc is None, kb, kc, t.max_scale_shift_bits, facts)
    return Check("scale_shift", abs(kc - kb) <= t.max_scale_shift_bits, kb, kc, t.max_scale_shift_bits, facts)


def _module_regressions(b: Snapshot, c: Snapshot, t: GateThresholds) -> Check:
    """Judge each module by how much its own share rose at the deployed scale, not by its rank."""
    k = b.deployed_log2_scale
    rises = []
    for name in b.modules.keys() & c.modules.keys():
        before = flushed_fraction(b.modules[name], b.format, k)
        after = flushed_fraction(c.modules[name], c.format, k)
        rises.append((after - before, name, before, after))
    rises.sort(key=lambda r: (-r[0], natural_key(r[1])))
    over = [r for r in rises if r[0] > t.max_module_increase]
    shown = over[: t.worst_n]
    listed = {name: [before, after] for _, name, before, after in shown}
    facts = {"log2_scale": k, "over": len(over), "largest": (rises[0][1], rises[0][0]) if rises else None}
    return Check("module_regressions", not over, len(rises), listed, t.max_module_increase, facts)


def _verified(b: Snapshot, c: Snapshot, t: GateThresholds) -> Check | None:
    if c.verification is None:
        return None
    held, summary = c.verification
    return Check("verification", held, None if b.verification is None else b.verification[0], held, "held",
                 {"summary": summary, "edited": c.verification_edited})


def _trial(b: Snapshot, c: Snapshot, t: GateThresholds) -> Check | None:
    if c.trial is None:
        return None
    return Check("trial", c.trial != HURT_UNSEEN, b.trial, c.trial, "not " + HURT_UNSEEN, {})


# -- what the two reports profiled --------------------------------------------------------------

_WORKLOAD_KEYS = ("model_class", "precision", "captured", "inputs", "loss", "loss_scale", "format")


def _workload_warnings(b: Snapshot, c: Snapshot) -> tuple[GateWarning, ...]:
    warnings = []
    for snap, label in ((b, "baseline"), (c, "current")):
        partial = snap.workload.get("partial")
        if partial:
            warnings.append(GateWarning("partial", {"label": label, "steps": partial["steps"],
                                                    "requested": partial.get("requested"),
                                                    "stopped": partial.get("stopped")}))
    for key in _WORKLOAD_KEYS:
        vb, vc = b.workload.get(key), c.workload.get(key)
        if vb != vc:
            warnings.append(GateWarning("workload", {"label": key, "baseline": vb, "current": vc}))
    only_b = sorted(b.modules.keys() - c.modules.keys(), key=natural_key)
    only_c = sorted(c.modules.keys() - b.modules.keys(), key=natural_key)
    if only_b or only_c:
        warnings.append(GateWarning("modules", {"only_baseline": only_b, "only_current": only_c,
                                                "both": len(b.modules.keys() & c.modules.keys())}))
    for snap, label in ((b, "baseline"), (c, "current")):
        stored = snap.stored_recommendation
        same_format = snap.workload.get("format") in (None, snap.format)
        if stored is not None and same_format and (stored[0] != snap.verdict or stored[1] != snap.log2_scale):
            warnings.append(GateWarning("stored_recommendation", {"label": label, "stored": stored,
                                                                  "analysed": (snap.verdict, snap.log2_scale)}))
    return tuple(warnings)


# -- numbers ----------------------------------------------------------------------------------

def _overflows(fmt: str, magnitude: float, log2_scale: int) -> bool:
    from fp16probe.formats import get_format

    if not math.isfinite(magnitude):
        return True
    return magnitude > 0 and get_format(fmt).overflows(math.ldexp(magnitude, log2_scale))


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def compare_reports(baseline: Report | str | PathLike[str], current: Report | str | PathLike[str], *,
                    thresholds: GateThresholds = GateThresholds(), format: str | None = None,
                    kind: str | None = None) -> GateResult:
    """The CI gate in one call, as ``fp16probe compare BASELINE CURRENT`` runs it; returns the result, never prints.

    Args:
        baseline, current: a :class:`~fp16probe.report.Report` or the path of a saved one.
        thresholds: what counts as a regression (:class:`GateThresholds`; its defaults are the command's).
        format, kind: what both are judged for; default the baseline's own (its stored recommendation).

    Returns a :class:`GateResult`: ``passed``, ``failures`` (the failed :class:`Check` s) and
    ``warnings`` (where the two reports profiled different things). A report that cannot be judged
    (unreadable, inconsistent) raises :class:`fp16probe.errors.ReportError`. In a test::

        result = compare_reports("baseline.json", report)
        assert result.passed, [c.name for c in result.failures]
    """
    from fp16probe.analysis.effect import judge_report
    from fp16probe.analysis.recommend import target_of

    snaps: list[Snapshot] = []
    fmt, knd = format, kind
    for given in (baseline, current):
        report = given if isinstance(given, Report) else Report.load(given)
        source = "report" if isinstance(given, Report) else str(given)
        check_consistency(report, source)
        if not snaps:  # both are judged for the baseline's format and kind, unless given
            fmt, knd = target_of(report, format, kind)
        fmt, knd = target_of(report, fmt, knd)
        rec = judge_report(report, fmt, kind=knd)  # the emulated step's judgement kept, when it applies
        snaps.append(snapshot(report, rec, fmt=fmt, kind=knd, worst_n=thresholds.worst_n, source=source))
        del report, rec  # one report in memory at a time: a long run's is most of a gigabyte
    return compare(snaps[0], snaps[1], thresholds)
