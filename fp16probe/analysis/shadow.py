"""Judge a live fp16 or bf16 run by its fp32 shadow reruns (:mod:`fp16probe.capture.shadow`).

A live run under fp16 autocast cannot tell a flushed gradient from a structural zero: both
are exact zeros. Its shadow, the same steps rerun in fp32 with the same weights, batch and
random state, can: a value zero in both is structural, a value zero only in the live run
flushed. The verdict is the fp32 reruns' (an fp32 profile of the run's own steps), with the
split of the live run's zeros as evidence. Pure functions over report data.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from fp16probe.analysis.ceiling import run_format
from fp16probe.analysis.whatif import fraction, kinds_of
from fp16probe.histogram import Histogram
from fp16probe.recommendation import Caveat, Recommendation, Verdict
from fp16probe.report import Report

__all__ = ["SCALE_TOLERANCE_LOG2", "checked_scale", "discarded_reruns", "pending", "reference", "scale_check",
           "with_reference", "zero_split"]


# How far the live gradients' largest value per tensor, divided by the claimed scale, may sit from
# the fp32 rerun's before the scale is called wrong: 2^0.5. fp16 arithmetic moves a tensor's
# largest gradient by well under that (about 1% here); a wrong scale moves it by a whole power of two or more.
SCALE_TOLERANCE_LOG2 = 0.5


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
    ev["reference"] = "fp32_shadow_reruns"
    ev["shadow_steps"] = steps
    ev["shadow_next_step"] = next_step
    ev["live_precision"] = str(report.metadata.precision)
    split = zero_split(report, kind)
    if split is not None:
        for key in ("live_zero_values", "structural_zero_values", "flushed_in_live_run",
                    "flushed_fraction_in_live_run"):
            ev[key] = split[key]
    caveats = rec.caveats + (Caveat("rerun_steps", {"count": len(steps), "next_step": next_step}),)
    discarded = discarded_reruns(report)
    if discarded:
        caveats += (Caveat("reruns_discarded", {"count": len(discarded), "first": discarded[0]}),)
    if rec.growth_interval_table and report.history is not None and len(report.history):
        caveats += (Caveat("projected_schedule", {"horizon": int(rec.growth_interval_table.get("horizon", 0)),
                                                  "history_steps": len(report.history)}),)
    one = _one_answer(report, rec, kind)
    if one is not None:  # fp16probe schedule advises other moves: say why, and which to paste
        ev["one_answer"] = one
        caveats += (Caveat("schedule_differs", one),)
    return replace(rec, evidence=ev, caveats=caveats)  # type: ignore[arg-type]


def _one_answer(report: Report, rec: Recommendation, kind: str) -> dict[str, Any] | None:
    """Where ``fp16probe schedule`` on this run's history advises other moves than the verdict: the one paste."""
    from fp16probe.analysis.one_answer import reconcile
    from fp16probe.analysis.schedule import judge_schedules
    from fp16probe.errors import AnalysisError

    if report.history is None or not len(report.history):
        return None
    try:
        table = judge_schedules(report, rec.format, kind=kind)
    except AnalysisError:
        return None
    return reconcile(rec, table)


def discarded_reruns(report: Report) -> list[dict[str, Any]]:
    """The reruns thrown away because they did not run in fp32 (step, module, dtype each)."""
    return [] if report.shadow_runs is None else [dict(d) for d in report.shadow_runs.discarded]


def pending(report: Report) -> dict[str, Any] | None:
    """For a live fp16/bf16 report with no shadow yet: why (``off``, or ``discarded`` with the ``first``), or when one comes.

    None when not applicable (an fp32 report, or one already judged on its reruns).
    """
    runs = report.shadow_runs
    if runs is None or report.shadow is not None or run_format(str(report.metadata.precision)) is None:
        return None
    if runs.off:
        return {"off": runs.off}
    discarded = discarded_reruns(report)
    if discarded:
        return {"discarded": len(discarded), "first": discarded[0]}
    return {"next_step": runs.next_step, "every": runs.every}



def scale_check(report: Report) -> dict[str, Any] | None:
    """Whether the live gradients carry the scale the scaler claimed, measured against the fp32 reruns.

    For every tensor (module output gradient, weight gradient) recorded on a shadowed step
    that the live run sampled without inf/NaN, compares its largest magnitude in the live
    run (already divided by the claimed scale) with the fp32 rerun's: the median of
    log2(live / fp32) over the tensors is the measured ratio (0: the gradients carry the
    claimed scale). None when the run claims no scale, no tensor is nonzero in both, or the trace
    keeps its per-module maxima per block of steps (``module_block`` > 1).
    """
    shadow = report.shadow
    if shadow is None or not report.metadata.grad_scaler or report.trace.module_block > 1:
        return None  # per-module maxima kept per block of steps: no step's own to compare
    trace = report.trace
    live_at = {s: i for i, s in enumerate(trace.steps)}
    logs: list[float] = []
    steps: list[int] = []
    for j, step in enumerate(shadow.trace.steps):
        i = live_at.get(step)
        if i is None or (i < len(trace.found_inf) and trace.found_inf[i]):
            continue
        before = len(logs)
        for kind, ref_modules in shadow.trace.module_max.items():
            live_modules = trace.module_max.get(kind, {})
            for name, ref_vals in ref_modules.items():
                live_vals = live_modules.get(name, ())
                if i < len(live_vals) and j < len(ref_vals):
                    a, b = live_vals[i], ref_vals[j]
                    if 0 < a < math.inf and 0 < b < math.inf:
                        logs.append(math.log2(a / b))
        if len(logs) > before:
            steps.append(step)
    if not logs:
        return None
    logs.sort()
    median = logs[len(logs) // 2]
    claimed = sorted({float(v) for s in steps if live_at[s] < len(trace.scale)
                      for v in (trace.scale[live_at[s]],) if v is not None})
    return {"log2_ratio": median, "tensors": len(logs), "steps": steps, "claimed_scales": claimed,
            "carried": abs(median) <= SCALE_TOLERANCE_LOG2, "tolerance_log2": SCALE_TOLERANCE_LOG2}


def checked_scale(report: Report, rec: Recommendation) -> Recommendation:
    """``rec`` with the scale check as evidence; no verdict when the gradients do not carry the claimed scale.

    The live histograms were divided by the claimed scale, so where the gradients carry
    another one every live figure is off by the ratio: rather than judge them, the answer
    is no verdict, with the ratio measured and the fp32 reruns' own scale as evidence.
    """
    check = scale_check(report)
    if check is None:
        return rec
    ev: dict[str, Any] = dict(rec.evidence)
    ev["scale_check"] = check
    if check["carried"]:
        return replace(rec, evidence=ev)  # type: ignore[arg-type]
    ev["insufficient_reason"] = "scale_not_carried"
    ev["fp32_reference_log2_scale"] = rec.log2_scale
    ratio = check["log2_ratio"]
    caveats = rec.caveats + (Caveat("scale_not_carried", {"log2_ratio": ratio, "claimed_scales": check["claimed_scales"],
                                                          "steps": check["steps"]}),)
    return replace(rec, verdict=Verdict.INSUFFICIENT_EVIDENCE, log2_scale=None, scale=None,
                   grad_scaler_kwargs={}, flushed_fraction_at_scale=None, overflow_steps_at_scale=None,
                   headroom_bits=None, worst_modules=(), growth_interval_table=None, evidence=ev,  # type: ignore[arg-type]
                   caveats=caveats)
