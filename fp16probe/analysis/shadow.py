"""Judge a live fp16 or bf16 run by its fp32 shadow reruns (:mod:`fp16probe.capture.shadow`).

A live run under fp16 autocast cannot tell a flushed gradient from a structural zero: both
are exact zeros. Its shadow, the same steps rerun in fp32 with the same weights, batch and
random state, can: a value zero in both is structural, a value zero only in the live run
flushed. The verdict is the fp32 reruns' (an fp32 profile of the run's own steps), with the
split of the live run's zeros as evidence. Pure functions over report data.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fp16probe.analysis.ceiling import run_format
from fp16probe.analysis.whatif import fraction, kinds_of
from fp16probe.formatting import count, percent
from fp16probe.histogram import Histogram
from fp16probe.recommendation import Caveat, Recommendation
from fp16probe.report import Report

__all__ = ["pending_words", "reference", "with_reference", "zero_split"]


def reference(report: Report) -> Report | None:
    """The fp32 reference a live fp16/bf16 report is judged by: its shadow reruns, when any ran."""
    if report.shadow is None or run_format(str(report.metadata.precision)) is None:
        return None
    return report.shadow if len(report.shadow.trace) else None


def zero_split(report: Report, kind: str = "all") -> dict[str, Any] | None:
    """Split the live run's zeros on the shadowed steps: structural (zero in fp32 too) or flushed.

    Counts the judged kinds' values of each shadowed step that the live run also sampled and
    that holds as many values in both (not so under gradient accumulation, where the rerun
    replays the first micro-batch). Returns None when no step qualifies.
    """
    shadow = report.shadow
    if shadow is None:
        return None
    kinds = kinds_of(kind)
    live_at = {s: i for i, s in enumerate(report.trace.steps)}
    live = Histogram()
    ref = Histogram()
    steps = []
    for j, step in enumerate(shadow.trace.steps):
        i = live_at.get(step)
        if i is None:
            continue
        pairs = []
        for k in kinds:
            lh, sh = report.trace.histograms.get(k, ()), shadow.trace.histograms.get(k, ())
            if i < len(lh) and j < len(sh):
                pairs.append((lh[i], sh[j]))
        # The same values in both, or the step is left out (e.g. gradient accumulation: the
        # live step holds several micro-batches, the rerun the first one).
        if not pairs or any(a.total != b.total for a, b in pairs):
            continue
        for a, b in pairs:
            live, ref = live + a, ref + b
        steps.append(step)
    if not steps or ref.total == 0:
        return None
    flushed = max(live.zero - ref.zero, 0)
    return {"steps": steps, "live_zero_values": live.zero, "structural_zero_values": min(ref.zero, live.zero),
            "flushed_in_live_run": flushed, "flushed_fraction_in_live_run": fraction(flushed, ref.nonzero_finite),
            "values": ref.total}


def with_reference(report: Report, rec: Recommendation, kind: str = "all") -> Recommendation:
    """The reference's recommendation, told as the live run's: which steps, what its zeros were."""
    shadow = report.shadow
    assert shadow is not None
    steps = list(shadow.trace.steps)
    runs = report.shadow_runs
    next_step = None if runs is None else runs.next_step
    ev = dict(rec.evidence)
    ev["reference"] = "fp32 shadow reruns of the live run"
    ev["shadow_steps"] = steps
    ev["shadow_next_step"] = next_step
    split = zero_split(report, kind)
    words = (f"Judged on {len(steps)} fp32 rerun(s) of this run's own steps ({_steps_words(steps)}): the same "
             f"batch, weights and random state in fp32, the reference for the live {report.metadata.precision} "
             f"run.")
    if split is not None:
        for key in ("live_zero_values", "structural_zero_values", "flushed_in_live_run",
                    "flushed_fraction_in_live_run"):
            ev[key] = split[key]
        words += (f" Of the live run's {count(split['live_zero_values'])} zero gradient values on those steps, "
                  f"{count(split['structural_zero_values'])} are zero in fp32 too (structural) and "
                  f"{count(split['flushed_in_live_run'])} flushed at the scale in force "
                  f"({percent(split['flushed_fraction_in_live_run'])} of the nonzero values).")
    caveats = rec.caveats + (Caveat("rerun_steps", {"count": len(steps), "next_step": next_step}),)
    if rec.growth_interval_table and report.history is not None and len(report.history):
        caveats += (Caveat("projected_schedule", {"horizon": int(rec.growth_interval_table.get("horizon", 0)),
                                                  "history_steps": len(report.history)}),)
    return replace(rec, text=f"{words} {rec.text}", evidence=ev, caveats=caveats)  # type: ignore[arg-type]


def pending_words(report: Report) -> str:
    """For a live fp16/bf16 report with no shadow yet: why, and when one comes ("" when not applicable)."""
    runs = report.shadow_runs
    if runs is None or report.shadow is not None or run_format(str(report.metadata.precision)) is None:
        return ""
    if runs.off:
        return f" No fp32 shadow rerun could run: {runs.off}."
    nxt = runs.next_step
    when = f"the first comes at step {nxt}" if nxt is not None else "none is scheduled"
    return (f" No fp32 shadow rerun has run yet ({when}, shadow_every={runs.every}); the report after "
            "it carries a verdict.")


def _steps_words(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:8])
    return f"step {shown}" if len(steps) == 1 else f"steps {shown}{', ...' if len(steps) > 8 else ''}"

