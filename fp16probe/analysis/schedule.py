"""Judge loss-scale schedules on a run's own recorded history (``fp16probe schedule``).

A Probe left on in training records every step's scale in force, whether its gradients held
inf/NaN and their largest |g| (:class:`fp16probe.report.StepHistory`). Over that history this
module replays GradScaler's defaults, the run's own settings and a grid of candidates
(growth_interval, growth and backoff factors; DeepSpeed's and Megatron's hysteresis rules)
and tabulates what each would have cost: skipped steps, steps spent at a scale that flushes
more than the threshold, the mean and worst flushed share, and the time to recover after a
backoff.

What a candidate scale S would have done at step t, from what was recorded there (scale
``s``, largest unscaled gradient ``g``, and on sampled steps the backward-wide ceiling ``c``):

* the step overflowed at ``s``: it overflows at every ``S >= s`` (known); below ``s`` its
  true maximum is unknown (at least the format's max / s) and the step counts as clean
  there: an optimistic reading, counted in ``uncertain_steps``;
* the step was clean at ``s``: it is clean at every ``S <= s`` (known); above, it overflows
  when ``max(c, g) x S`` passes the format's overflow threshold (an estimate: on unsampled
  steps only the parameters' gradients are recorded, not every gradient backward made).

So the run's own rule, replayed from the run's first scale, meets only known cases and
reproduces the real scale on every step and the real skipped steps exactly
(:attr:`ScheduleTable.reproduced` checks it). The flushed share at S comes from a reference
histogram: the latest fp32 one at or before t (a shadow rerun, or the step itself in an fp32
run), moved by the change in the largest gradient since then (the distribution is assumed to
move as a whole with its maximum). Without one, the flushed columns are None.

This is the run's past. The future of a run is not its past: gradients drift as training goes
on, so profile again at later checkpoints before carrying a schedule to another run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

import numpy as np

from fp16probe.analysis import interval_study
from fp16probe.analysis.ceiling import run_format
from fp16probe.analysis.replay import ScalerRule, _ScalerState
from fp16probe.analysis.whatif import kinds_of
from fp16probe.errors import AnalysisError
from fp16probe.formats import Format, get_format
from fp16probe.histogram import Histogram
from fp16probe.recommendation import GRADSCALER_DEFAULTS
from fp16probe.report import Report, StepHistory

__all__ = ["DEFAULTS", "FRAMEWORK_RULES", "OWN", "ScheduleNote", "ScheduleRow", "ScheduleTable", "candidate_rules", "judge_schedules"]

# The names of the two rules every table starts with (fp16probe.presentation.schedule labels them);
# the grid's names say their settings ("interval 500"), DeepSpeed's and Megatron's their source.
DEFAULTS = "defaults"
OWN = "own"

GRID_INTERVALS = (100, 500, 2000)  # beside the run's own interval, a quarter and four times it
GRID_FACTORS = ((2.0, 0.25), (4.0, 0.5))  # beside x2/x0.5, at the run's own interval (else 2000)
# DeepSpeed's and Megatron's dynamic loss scalers (their defaults: REFERENCE.md, from their sources).
DEEPSPEED = ScalerRule(init_scale=2.0**16, growth_interval=1000, hysteresis=2, min_scale=1.0, deepspeed_window=True)
MEGATRON = ScalerRule(init_scale=2.0**32, growth_interval=1000, hysteresis=2, min_scale=1.0)
# The RL frameworks' shipped settings (REFERENCE.md): verl builds ShardedGradScaler(growth_interval=400)
# with GradScaler's other defaults; Relax passes Megatron initial_loss_scale=32768, min_loss_scale=1 and
# keeps Megatron's window and hysteresis. Oat uses DeepSpeed's stock scaler (DEEPSPEED).
VERL = ScalerRule(growth_interval=400)
RELAX = ScalerRule(init_scale=2.0**15, growth_interval=1000, hysteresis=2, min_scale=1.0)
FRAMEWORK_RULES = (("verl (interval 400)", VERL), ("DeepSpeed (hysteresis 2)", DEEPSPEED),
                   ("Megatron (hysteresis 2)", MEGATRON), ("Relax (hysteresis 2)", RELAX))


@dataclass(frozen=True)
class ScheduleRow:
    """What one rule would have done over the recorded steps."""

    name: str
    rule: Mapping[str, Any]
    skipped_steps: int
    steps_over_threshold: int | None  # applied steps whose flushed share passed the threshold
    mean_flushed_fraction: float | None  # over applied steps with a reference
    worst_flushed_fraction: float | None
    recovery_steps_mean: float | None  # steps from a backoff until the scale is back where it was
    recovery_steps_max: int | None
    unrecovered_backoffs: int  # backoffs the run ended before recovering from
    backoffs: int
    growths: int
    final_scale: float
    uncertain_steps: int  # overflowed at the recorded scale, replayed below it (read as clean)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["rule"] = dict(self.rule)
        return d


@dataclass(frozen=True)
class ScheduleNote:
    """Something the table's reader must know, as a code and its data.

    Codes: ``not_reproduced`` (``steps``: where the run's own rule missed its recorded scale),
    ``verdict`` (``verdict``, ``grad_scaler_kwargs``, ``differs``: the live run's loss-scale
    verdict, added by :func:`fp16probe.analysis.one_answer.with_verdict_note`), ``interval_study``
    (the run's drift against the growth-interval study's families:
    :func:`fp16probe.analysis.interval_study.evidence`).
    """

    code: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScheduleTable:
    """Rules replayed over one run's history, the best one and whether GradScaler's defaults are fine.

    ``flush_reference`` says where the flushed shares come from: ``"shadow"`` (the fp32 shadow
    reruns), ``"fp32_run"`` (the run's own fp32 steps) or None. The plain-words answer is
    :func:`fp16probe.presentation.schedule.schedule_answer`; the JSON form with it,
    :func:`fp16probe.presentation.schedule.schedule_dict`.
    """

    rows: tuple[ScheduleRow, ...]
    steps: int
    first_step: int
    format: str
    max_flushed_fraction: float
    reproduced: bool | None  # the run's own rule reproduced its scales and skipped steps (None: no settings)
    mismatched_steps: tuple[int, ...]  # where it did not (the first few)
    flush_reference: str | None  # where the flushed shares come from (None: not available)
    best: str
    defaults_fine: bool
    notes: tuple[ScheduleNote, ...] = field(default=())

    def row(self, name: str) -> ScheduleRow:
        """Return the row called ``name``; KeyError when none is."""
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)


def candidate_rules(run: Mapping[str, Any] | None, init_scale: float) -> list[tuple[str, ScalerRule]]:
    """The rules to judge: GradScaler's defaults, the run's own, a grid, and the frameworks' shipped rules.

    The grid starts from the run's first scale: growth_interval 100, 500, 2000 and a quarter and
    four times the run's own (growth x2, backoff x0.5), and at the run's own interval (else 2000)
    growth x2 with backoff x0.25 ("/x4") and growth x4 with backoff x0.5. The frameworks' rules
    (:data:`FRAMEWORK_RULES`: verl, DeepSpeed, Megatron, Relax) start from their own initial scales.
    """
    out: list[tuple[str, ScalerRule]] = [(DEFAULTS, ScalerRule())]
    own_interval = None
    if run:
        own = ScalerRule(init_scale, float(run["growth_factor"]), float(run["backoff_factor"]),
                         int(run["growth_interval"]))
        own_interval = own.growth_interval
        out.append((OWN, own))
    intervals = set(GRID_INTERVALS)
    if own_interval is not None:
        intervals |= {max(own_interval // 4, 1), own_interval * 4}
    for g in sorted(intervals):
        out.append((f"interval {g}", ScalerRule(init_scale, 2.0, 0.5, g)))
    at = own_interval if own_interval is not None else int(GRADSCALER_DEFAULTS["growth_interval"])
    for gf, bf in GRID_FACTORS:
        out.append((f"interval {at} x{gf:g} /x{1 / bf:g}", ScalerRule(init_scale, gf, bf, at)))
    out.extend(FRAMEWORK_RULES)
    return out


@dataclass(frozen=True)
class _Steps:
    """The recorded history as arrays, and per step its reference histogram (index) and shift base."""

    scale: np.ndarray  # float64 [T]; nan where not scaled
    found: np.ndarray  # bool [T]
    est_max: np.ndarray  # float64 [T]: max(ceiling, grad_max) on clean steps; 0 where nothing recorded
    ref: np.ndarray  # int64 [T]: index into refs, -1 for none
    ref_ratio_bits: np.ndarray  # int64 [T]: round(log2(grad_max_t / grad_max_ref))
    refs: tuple[Histogram, ...]


def _arrays(history: StepHistory, refs: Sequence[tuple[int, Histogram]]) -> _Steps:
    n = len(history)
    scale = np.asarray([math.nan if s is None else s for s in history.scale], dtype=np.float64)
    gmax = [g for g in history.grad_max]
    found = np.asarray([g is not None and not math.isfinite(g) for g in gmax], dtype=bool)
    est = np.zeros(n, dtype=np.float64)
    for i, (g, c) in enumerate(zip(gmax, history.ceiling or (None,) * n)):
        if g is not None and math.isfinite(g):
            est[i] = max(g, c if c is not None and math.isfinite(c) else 0.0)
    ref = np.full(n, -1, dtype=np.int64)
    bits = np.zeros(n, dtype=np.int64)
    ordered = sorted((s - history.first_step, h) for s, h in refs if 0 <= s - history.first_step < n)
    j = -1
    for i in range(n):
        while j + 1 < len(ordered) and ordered[j + 1][0] <= i:
            j += 1
        k = j if j >= 0 else (0 if ordered else -1)
        if k < 0:
            continue
        ref[i] = k
        g_ref, g_now = gmax[ordered[k][0]], gmax[i]
        if g_ref and g_now and math.isfinite(g_ref) and math.isfinite(g_now) and g_ref > 0 and g_now > 0:
            bits[i] = round(math.log2(g_now / g_ref))
    return _Steps(scale, found, est, ref, bits, tuple(h for _, h in ordered))


def _flush_refs(report: Report, kind: str) -> tuple[list[tuple[int, Histogram]], str | None]:
    """fp32 per-step histograms to read flushed shares from: the shadow's, or an fp32 run's own."""
    kinds = kinds_of(kind)
    source = report.shadow if report.shadow is not None else (
        report if run_format(str(report.metadata.precision)) is None else None)
    if source is None or not len(source.trace):
        return [], None
    out = []
    for i, step in enumerate(source.trace.steps):
        h = Histogram.sum(source.trace.histograms[k][i] for k in kinds if k in source.trace.histograms)
        if h.nonzero_finite:
            out.append((step, h))
    code = "shadow" if source is report.shadow else "fp32_run"
    return out, (code if out else None)


def _replay(steps: _Steps, fmt: Format, rule: ScalerRule, tau: float, flush: bool) -> tuple[ScheduleRow, list[float], list[bool]]:
    state = _ScalerState(rule)
    n = len(steps.scale)
    scales: list[float] = []
    skipped: list[bool] = []
    fractions: list[float] = []
    over = uncertain = 0
    drops: list[tuple[int, float]] = []  # (step, scale before the backoff) awaiting recovery
    recoveries: list[int] = []
    with np.errstate(over="ignore"):
        for t in range(n):
            S = state.scale
            s_rec = float(steps.scale[t])
            known_scale = not math.isnan(s_rec)
            if steps.found[t]:
                overflow = bool(S >= s_rec) if known_scale else True
                if known_scale and not overflow:
                    uncertain += 1
            elif known_scale and S <= s_rec:
                overflow = False
            else:
                m = float(steps.est_max[t])
                overflow = m > 0.0 and fmt.overflows(m * S)
            scales.append(S)
            skipped.append(overflow)
            if not overflow and flush and steps.ref[t] >= 0:
                h = steps.refs[steps.ref[t]]
                k = math.frexp(S)[1] - 1 + int(steps.ref_ratio_bits[t])
                f = h.flushed(fmt, k) / h.nonzero_finite
                fractions.append(f)
                over += f > tau
            before = state.scale
            state.update(overflow)
            if state.scale < before:
                drops.append((t, before))
            drops_left = []
            for t0, level in drops:
                if state.scale >= level:
                    recoveries.append(t + 1 - t0)
                else:
                    drops_left.append((t0, level))
            drops = drops_left
    row = ScheduleRow(
        name="", rule=rule.to_dict(), skipped_steps=sum(skipped),
        steps_over_threshold=over if fractions else None,
        mean_flushed_fraction=float(np.mean(fractions)) if fractions else None,
        worst_flushed_fraction=max(fractions) if fractions else None,
        recovery_steps_mean=float(np.mean(recoveries)) if recoveries else None,
        recovery_steps_max=max(recoveries) if recoveries else None, unrecovered_backoffs=len(drops),
        backoffs=state.backoffs, growths=state.growths, final_scale=state.scale, uncertain_steps=uncertain)
    return row, scales, skipped


def judge_schedules(
    report: Report,
    format: str | Format = "fp16",
    *,
    max_flushed_fraction: float = 1e-3,
    kind: str = "all",
    rules: Sequence[tuple[str, ScalerRule]] | None = None,
) -> ScheduleTable:
    """Replay loss-scale rules over ``report``'s per-step history and tabulate their cost.

    Args:
        report: a report from a Probe left on in training (it has ``report.history``).
        format: the format the gradients are cast to (default fp16).
        max_flushed_fraction: the flushed share above which a step counts as flushing too much.
        kind: whose flushing counts, as for :func:`fp16probe.analysis.recommend.analyze`.
        rules: ``(name, ScalerRule)`` pairs to judge; default :func:`candidate_rules`, and where the
            run's drift of the gradient scale can be set against the growth-interval study's families
            (:func:`fp16probe.analysis.interval_study.evidence`) and lies inside the families' range,
            the interval the study measured for the nearest family, from the run's first scale (its
            note says so).
    """
    history = report.history
    if history is None or not len(history):
        raise AnalysisError(
            "this report has no per-step history: record it with a Probe left on in training "
            "(Probe(model, scaler=scaler), probe.step() every optimizer step) and fp16probe 0.x or later")
    if not 0.0 <= max_flushed_fraction < 1.0:
        raise AnalysisError(f"max_flushed_fraction must be in [0, 1), got {max_flushed_fraction!r}: e.g. 1e-3 for 0.1%")
    fmt = format if isinstance(format, Format) else get_format(format)
    refs, reference = _flush_refs(report, kind)
    steps = _arrays(history, refs)
    first = next((s for s in history.scale if s is not None), None)
    init_scale = first if first is not None else float(GRADSCALER_DEFAULTS["init_scale"])
    settings = None if report.capture is None else report.capture.scaler_settings
    run = settings if isinstance(settings, Mapping) and first is not None else None
    study = interval_study.evidence(report)
    chosen = list(rules) if rules is not None else candidate_rules(run, init_scale)
    if rules is None and study and study["within_range"]:  # the study's interval for the nearest family's drift
        gi = int(study["growth_interval"])
        label = "never grow" if gi >= interval_study.NEVER_GROWS else f"interval {gi}"
        chosen.append((f"study: {label}",
                       ScalerRule(init_scale, float(study["growth_factor"]), float(study["backoff_factor"]), gi)))
    rows: list[ScheduleRow] = []
    reproduced: bool | None = None
    mismatched: tuple[int, ...] = ()
    for name, rule in chosen:
        row, scales, skipped = _replay(steps, fmt, rule, max_flushed_fraction, reference is not None)
        rows.append(ScheduleRow(**{**row.to_dict(), "name": name}))
        if name == OWN:
            bad = [history.first_step + t for t in range(len(history))
                   if history.scale[t] is not None
                   and (scales[t] != history.scale[t] or skipped[t] != bool(steps.found[t]))]
            reproduced, mismatched = not bad, tuple(bad[:10])
    notes: tuple[ScheduleNote, ...] = (
        (ScheduleNote("not_reproduced", {"steps": mismatched}),) if reproduced is False else ())
    if study:
        notes += (ScheduleNote("interval_study", study),)
    best, fine = _best(rows)
    return ScheduleTable(tuple(rows), len(history), history.first_step, fmt.name, max_flushed_fraction,
                         reproduced, mismatched, reference, best, fine, notes)


def _key(r: ScheduleRow) -> tuple[float, float]:
    return (r.steps_over_threshold if r.steps_over_threshold is not None else 0, r.skipped_steps)


def _best(rows: Sequence[ScheduleRow]) -> tuple[str, bool]:
    """The best row's name by (steps over the threshold, skipped steps), and whether the defaults are fine:
    no row does at least as well on both and better on one."""
    best = min(rows, key=_key)
    defaults = rows[0]
    fine = not any(_key(r)[0] <= _key(defaults)[0] and _key(r)[1] <= _key(defaults)[1] and _key(r) != _key(defaults)
                   for r in rows)
    return best.name, fine
