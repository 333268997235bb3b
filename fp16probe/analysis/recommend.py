"""From a Report to a loss-scale Recommendation: verdict, numbers, evidence, caveats (codes) and sources.

Pure functions over report data: nothing here touches a model, hooks or a device.
:func:`analyze` reads as its steps: check the parameters, measure what the profile holds,
judge whether that evidence can carry a verdict, then decide (per-tensor scaling for
formats whose casts saturate; no scaling; one scale; a schedule; no single scale), replay
the schedule. The words are rendered from the result in :mod:`fp16probe.presentation.verdict`.

Everything rests on one exact fact: multiplying by S = 2^k moves a value from bin ``e`` to
bin ``e + k`` without rounding, so the histograms answer "what flushes / overflows at S"
for every k at once. Overflow is judged against one ceiling (:mod:`.ceiling`), flushing
against the judged kinds (by default every gradient the loss scale multiplies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fp16probe.analysis.ceiling import (
    GRAD_KINDS,
    Ceiling,
    flushed_hidden_bound,
    fp32_log2_cap,
    largest_safe_log2_scale,
    run_format,
)
from fp16probe.analysis.forward import FP16_LOSS_LOG2_CAP, ForwardFindings, forward_findings
from fp16probe.analysis import interval_study, shadow
from fp16probe.analysis.replay import DEFAULT_GROWTH_INTERVALS, GrowthIntervalTable, score_growth_intervals
from fp16probe.analysis.whatif import ALL_GRADS, fraction, kinds_of, merged, per_step, worst_modules
from fp16probe.errors import AnalysisError
from fp16probe.formats import Format, get_format
from fp16probe.recommendation import Citation
from fp16probe.sources import GRADSCALER, INTERVAL_STUDY, MIXED_PRECISION_TRAINING, NVIDIA_GUIDE, TRANSFORMER_ENGINE
from fp16probe.histogram import Histogram
from fp16probe.sections import CaptureNotes, Workload
from fp16probe.recommendation import GRADSCALER_DEFAULTS, Caveat, Evidence, Recommendation, Thresholds, Verdict
from fp16probe.report import ACTIVATION_GRAD, Report
from fp16probe.validation import AUTOCAST_TARGETS

__all__ = ["VERDICTS", "analyze", "largest_safe_log2_scale", "target_of"]

VERDICTS = tuple(v.value for v in Verdict)
# An fp16 forward tensor that loses this share of its nonzero values to zero leads the answer
# (forward_underflow); a smaller share above the threshold is a caveat beside the scale verdict.
FORWARD_UNDERFLOW_VERDICT = 0.1

def target_of(report: Report, format: str | Format | None = None, kind: str | None = None) -> tuple[str, str]:
    """Return the (format, kind) a report is judged for: those given, else the stored recommendation's.

    Without a stored recommendation: the format the profile computed in (fp16 or bf16
    autocast), else fp16; every gradient (``all``). So ``show`` of a ``--format bf16``
    report judges it for bf16 again, never silently for fp16.
    """
    stored = report.recommendation
    if format is None:
        run = run_format(report.metadata.precision)
        format = stored.format if stored is not None else (run.name if run is not None else "fp16")
    if kind is None:
        kind = stored.kind if stored is not None else ALL_GRADS
    return (format if isinstance(format, str) else format.name), kind


def analyze(
    report: Report,
    format: str | Format | None = None,
    *,
    kind: str | None = None,
    margin_bits: int = 1,
    max_flushed_fraction: float = 1e-3,
    growth_factor: float = GRADSCALER_DEFAULTS["growth_factor"],
    backoff_factor: float = GRADSCALER_DEFAULTS["backoff_factor"],
    growth_intervals: Sequence[int] = DEFAULT_GROWTH_INTERVALS,
    horizon: int = 20000,
    seed: int = 0,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    worst: int = 5,
    target: str | None = None,
    forward_verdicts: bool = True,
    forward_underflow_at: float = FORWARD_UNDERFLOW_VERDICT,
) -> Recommendation:
    """Decide whether and how to scale the loss for ``format``, from a profile.

    Args:
        report: a Report from a Probe (fp32 is the reference; an fp16/bf16 autocast
            profile is judged with what it hid in mind, see ``insufficient_evidence``).
        format: the target format: ``fp16``, ``bf16``, ``fp8_e4m3``, ``fp8_e5m2``. Default
            (None): the report's stored recommendation's, else the profile's own precision
            (fp16/bf16 autocast), else fp16 (see :func:`target_of`).
        kind: whose flushing counts: ``all`` (activation and weight gradients, everything the
            loss scale multiplies), ``activation_grad`` or ``weight_grad``. Default (None):
            the stored recommendation's, else ``all``.
            Overflow is always judged on the overflow ceiling (every gradient captured,
            and the trace's backward-wide ``StepTrace.ceiling`` where the report has it).
        margin_bits: safety margin below the overflow edge: S is the largest power of two
            with S x max|g| below the format's overflow threshold, divided by 2^margin_bits.
        max_flushed_fraction: the largest share of nonzero values allowed to flush for a
            scale to count as fitting. Default 1e-3 (0.1%).
        growth_factor, backoff_factor: the schedule's factors; defaults are GradScaler's.
        growth_intervals: candidates replayed to choose growth_interval.
        horizon, seed: length and seed of the long-horizon replay over resampled steps.
        hysteresis, min_scale: DeepSpeed/Megatron variants for the replay (1 and 0:
            GradScaler's rule).
        worst: how many worst modules to list.
        target: the device whose fp16 autocast rules the prediction applies (``"cuda"``,
            ``"cpu"``); default: what the profile recorded, else CUDA.
        forward_verdicts: False: forward findings never become the verdict (their caveats and
            the fp16 loss's cap stay); :func:`fp16probe.analysis.effect.judged` asks for this
            when the emulated step shows a forward finding has no effect on the gradients.
        forward_underflow_at: the share of a tensor's values whose flush makes the verdict
            (0: any flush above ``max_flushed_fraction``, as judged() asks when the emulated
            gradients show the effect).

    Verdicts, in the order they are tried:

    * ``forward_overflow`` (fp16): a tensor that is fp16 in the target run passes fp16's
      max in the forward pass (:mod:`.forward`): inf at every loss scale. Names the first
      such op or module and the fix (keep those modules in fp32, or train in bf16).

    * ``insufficient_evidence``: nothing captured, every gradient zero, every gradient
      inf/NaN, or an fp16 profile whose exact zeros may hide more flushed values than the
      threshold allows. Never read as good news.
    * ``per_tensor_scaling``: the format's casts saturate (fp8 e4m3), so no GradScaler can
      see an overflow; scale each tensor from its measured maximum.
    * ``none_needed``: at S = 1 at most ``max_flushed_fraction`` flushes and the largest
      gradient keeps ``margin_bits`` of headroom.
    * ``constant``: at S = 2^(k_max - margin_bits) at most ``max_flushed_fraction`` flushes.
    * ``dynamic``: the constant S flushes too much, but a scale fitted to each profiled
      step would not.
    * ``no_single_scale``: even per step, the values span more than the format holds.
    * ``forward_underflow`` (fp16): some fp16 forward tensor flushes at least
      ``FORWARD_UNDERFLOW_VERDICT`` (10%) of its nonzero values to zero, which no loss scale
      brings back (a smaller share above ``max_flushed_fraction`` is a caveat).

    When the loss itself is fp16 in the target run (``-out.mean()`` under autocast, a
    ``.half()`` model), its seed gradient is S in fp16, so S is capped at 2^15.

    Every verdict that advises a scale advises it through a scaler that backs off on
    overflow (GradScaler(init_scale=S, ...)), with S capped so that GradScaler accepts it.
    """
    given = format
    format, kind = target_of(report, format, kind)
    fmt = given if isinstance(given, Format) else get_format(format)  # a Format given is not looked up again
    ref = shadow.reference(report)
    if ref is not None:  # a live fp16/bf16 run: its fp32 reruns are the profile to judge
        return shadow.checked_scale(report, shadow.with_reference(report, analyze(
            ref, fmt, kind=kind, margin_bits=margin_bits, max_flushed_fraction=max_flushed_fraction,
            growth_factor=growth_factor, backoff_factor=backoff_factor, growth_intervals=growth_intervals,
            horizon=horizon, seed=seed, hysteresis=hysteresis, min_scale=min_scale, worst=worst,
            target=target), kind))
    thresholds = _thresholds(fmt, kind, margin_bits, max_flushed_fraction, growth_factor, backoff_factor,
                             growth_intervals, horizon, seed, hysteresis, min_scale, worst)
    m = _measure(report, kind)
    ff = forward_findings(report, target, max_flushed_fraction=max_flushed_fraction) if fmt.name == "fp16" else None
    rec = _gradient_verdict(report, m, fmt, thresholds, ff)
    if ff is None or not forward_verdicts:
        return rec
    if ff.overflowing:
        return _forward_verdict(report, fmt, thresholds, ff, rec, Verdict.FORWARD_OVERFLOW)
    if (ff.flushing and ff.flushing[0].flushed_fraction >= forward_underflow_at
            and rec.verdict is not Verdict.INSUFFICIENT_EVIDENCE):
        return _forward_verdict(report, fmt, thresholds, ff, rec, Verdict.FORWARD_UNDERFLOW)
    return rec


def _gradient_verdict(report: Report, m: "_Measured", fmt: Format, thresholds: Thresholds,
                      ff: ForwardFindings | None) -> Recommendation:
    """The loss-scale verdict the gradients give (with the loss's own dtype applied)."""
    tau, margin_bits = thresholds["max_flushed_fraction"], thresholds["margin_bits"]
    evidence = _base_evidence(m, fmt)
    caveats = _caveats(report, m) + _forward_caveats(ff)
    if ff is not None:
        evidence.update(_forward_evidence(ff))
    reason = _weak_evidence(report, m, fmt, tau)
    if reason is not None:
        if reason[0] == "autocast_zeros":
            reason[1]["shadow_pending"] = shadow.pending(report)
        return _insufficient(m, fmt, evidence, thresholds, caveats, reason)
    if not fmt.has_inf or fmt.name.startswith("fp8"):
        # FP8 training scales each tensor from its own amax (Transformer Engine, torchao), e5m2's
        # gradients included: never one global loss scale.
        return _per_tensor(report, m, fmt, evidence, thresholds, caveats)
    k_max = m.ceiling.largest_safe_log2_scale(fmt)
    if k_max is None or (_flushed_at(m, fmt, 0) <= tau and k_max - int(margin_bits) >= 0):
        return _none_needed(report, m, fmt, evidence, thresholds, caveats, k_max)
    rec = _scaled(report, m, fmt, evidence, thresholds, caveats, k_max)
    if ff is not None and ff.loss_fp16 and rec.log2_scale is not None and rec.log2_scale > FP16_LOSS_LOG2_CAP:
        rec = _loss_capped(m, fmt, rec)
    return rec


# -- step 1: the parameters ---------------------------------------------------------------

def _thresholds(fmt: Format, kind: str, margin_bits: int, tau: float, growth_factor: float,
                backoff_factor: float, growth_intervals: Sequence[int], horizon: int, seed: int,
                hysteresis: int, min_scale: float, worst: int) -> Thresholds:
    kinds_of(kind)  # an unknown kind is an error before anything else
    if isinstance(margin_bits, bool) or int(margin_bits) != margin_bits or margin_bits < 0:
        raise AnalysisError(f"margin_bits must be a non-negative integer, got {margin_bits!r}")
    if not 0.0 <= tau < 1.0:
        raise AnalysisError(f"max_flushed_fraction must be in [0, 1), got {tau!r}: e.g. 1e-3 for 0.1%")
    return {
        "format": fmt.name, "kind": kind, "margin_bits": int(margin_bits), "max_flushed_fraction": tau,
        "growth_factor": growth_factor, "backoff_factor": backoff_factor,
        "growth_intervals": list(growth_intervals), "horizon": horizon, "seed": seed,
        "hysteresis": hysteresis, "min_scale": min_scale, "worst": worst,
    }


# -- step 2: what the profile holds ---------------------------------------------------------

@dataclass(frozen=True)
class _Measured:
    """The judged values and the overflow ceiling of one report."""

    kind: str
    kinds: tuple[str, ...]  # judged kinds
    hist: Histogram  # every judged value
    by_kind: Mapping[str, Histogram]  # judged kinds that hold values
    kind_steps: Sequence[Histogram] | None  # per-step judged values (None without a trace)
    ceiling: Ceiling
    scale_in_force: tuple[float, ...]  # distinct scales the trace recorded


def _measure(report: Report, kind: str) -> _Measured:
    kinds = kinds_of(kind)
    hist = merged(report, kinds)
    if kind != ALL_GRADS and hist.total == 0:
        raise AnalysisError(
            f"the report holds no {kind} values: profile with the Probe capturing them "
            f"(captured: {', '.join(report.metadata.captured) or 'nothing'}), or pass kind='all'",
            parameter="kind",
        )
    by_kind = {k: report.histogram(k) for k in kinds if report.histogram(k).total}
    scales = sorted({float(s) for s in report.trace.scale if s is not None})
    return _Measured(kind, kinds, hist, by_kind, per_step(report, kinds), Ceiling.of(report), tuple(scales))


def _flushed_at(m: _Measured, fmt: Format, k: int) -> float:
    return fraction(m.hist.flushed(fmt, k), m.hist.nonzero_finite)


def _base_evidence(m: _Measured, fmt: Format) -> Evidence:
    hist, ceiling = m.hist, m.ceiling
    max_abs = ceiling.max_abs
    k_max = ceiling.largest_safe_log2_scale(fmt)
    ev: Evidence = {
        "nonzero_values": hist.nonzero_finite,
        "zero_values": hist.zero,
        "nonfinite_values": hist.nonfinite,
        "profiled_steps": len(ceiling.steps),
        "nonfinite_steps": ceiling.intrinsic_steps,
        "max_abs": max_abs,
        "log2_max_abs": math.log2(max_abs) if max_abs > 0 else None,
        "ceiling_source": _ceiling_source(ceiling),
        "largest_safe_log2_scale": k_max,
        "flushed_fraction_at_1": _flushed_at(m, fmt, 0),
        "subnormal_fraction_at_1": fraction(hist.subnormal(fmt, 0), hist.nonzero_finite),
        "overflow_steps_at_1": ceiling.overflow_steps(fmt, 0),
        "lowest_log2": hist.lowest_exp,
        "highest_log2": hist.highest_exp,
        "scale_induced_overflow_steps": list(ceiling.scale_induced_steps),
        "by_kind": {k: _kind_evidence(h, fmt, 0) for k, h in m.by_kind.items()},
    }
    positive = [x for x in ceiling.per_step_max() if x > 0.0]
    if positive:
        ev["per_step_max_range_bits"] = math.log2(max(positive)) - math.log2(min(positive))
    return ev


def _kind_evidence(h: Histogram, fmt: Format, k: int) -> dict[str, Any]:
    n = h.nonzero_finite
    return {"nonzero_values": n, "zero_values": h.zero, "nonfinite_values": h.nonfinite, "max_abs": h.max_abs,
            "flushed_fraction_at_1": fraction(h.flushed(fmt, 0), n),
            "flushed_fraction_at_scale": fraction(h.flushed(fmt, k), n)}


def _ceiling_source(ceiling: Ceiling) -> str:
    """"measured" (over every gradient in backward) or "hooked" (the hooked modules and parameters only)."""
    return "measured" if ceiling.measured else "hooked"


# -- step 3: the limits of this evidence ------------------------------------------------------

def _caveats(report: Report, m: _Measured) -> tuple[Caveat, ...]:
    out: list[Caveat] = []
    md, scales = report.metadata, list(m.scale_in_force)
    if run_format(str(md.precision)) is not None:
        out.append(Caveat("low_precision_run", {"precision": str(md.precision), "scales": scales,
                                                "zero_values": m.hist.zero, "values": m.hist.total}))
    if not m.ceiling.measured:
        out.append(Caveat("hooked_ceiling"))
    induced = m.ceiling.scale_induced_steps
    if induced:
        steps = [report.trace.steps[i] for i in induced] if len(report.trace) else []
        out.append(Caveat("scale_induced_overflow", {"count": len(induced), "scales": scales, "steps": steps[:10]}))
    if m.ceiling.intrinsic_steps:
        out.append(Caveat("intrinsic_nonfinite", {"count": m.ceiling.intrinsic_steps}))
    if m.kind != ALL_GRADS:
        others = [k for k in GRAD_KINDS if k not in m.kinds and report.histogram(k).total]
        if others:
            out.append(Caveat("narrowed_kind", {"kind": m.kind, "others": others}))
    notes = report.capture or CaptureNotes()
    gradient_free = set(notes.gradient_free_modules)  # no finding: see ModuleHooks.silent_modules
    silent = list(notes.unrecorded_modules) or [
        x.name for x in report.modules_of(ACTIVATION_GRAD) if x.histogram.total == 0 and x.name not in gradient_free]
    if silent and md.steps_seen:
        out.append(Caveat("silent_modules", {"count": len(silent), "modules": silent[:5]}))
    fp32_ops = list(notes.autocast_fp32_ops)
    if fp32_ops:
        out.append(Caveat("autocast_fp32_ops", {"count": len(fp32_ops), "ops": fp32_ops[:5]}))
    if md.partial:
        work = report.workload or Workload()
        out.append(Caveat("partial_run", {"stopped": work.stopped, "steps_seen": md.steps_seen,
                                          "steps_requested": work.steps_requested or md.steps_total}))
    return tuple(out)


def _hidden_flush_matters(report: Report, fmt: Format) -> bool:
    """Whether values the run itself flushed could matter for ``fmt`` (fp16 run, non-bf16 target)."""
    run = run_format(report.metadata.precision)
    return run is not None and run.name != "bf16" and fmt.name != "bf16"


def _weak_evidence(report: Report, m: _Measured, fmt: Format, tau: float) -> tuple[str, dict[str, Any]] | None:
    """Return (reason code, the numbers it is worded from) when the profile cannot carry a verdict, else None."""
    h = m.hist
    if h.total == 0:
        return ("nothing_captured", {"captured": list(report.metadata.captured)})
    if _hidden_flush_matters(report, fmt):
        hidden = flushed_hidden_bound([h])
        if hidden > tau:
            return ("autocast_zeros", {"precision": str(report.metadata.precision), "scales": list(m.scale_in_force),
                                       "zero_fraction": hidden})
    if h.nonzero_finite == 0 and h.nonfinite == 0:
        return ("all_zero", {"values": h.total})
    every_step_broken = bool(m.ceiling.steps) and m.ceiling.intrinsic_steps == len(m.ceiling.steps)
    if h.nonzero_finite == 0 or every_step_broken:
        if m.ceiling.scale_induced_steps and not every_step_broken:
            return ("all_nonfinite", {"overflowed_at_scale": True, "scales": list(m.scale_in_force)})
        return ("all_nonfinite", {"overflowed_at_scale": False, "nonfinite_values": h.nonfinite})
    return None


# -- step 4: the verdicts -------------------------------------------------------------------

def _citations(verdict: Verdict) -> tuple[Citation, ...]:
    if verdict in (Verdict.NONE_NEEDED, Verdict.INSUFFICIENT_EVIDENCE):
        return (MIXED_PRECISION_TRAINING,)
    if verdict is Verdict.PER_TENSOR_SCALING:
        return (MIXED_PRECISION_TRAINING, TRANSFORMER_ENGINE)
    return (MIXED_PRECISION_TRAINING, NVIDIA_GUIDE, GRADSCALER)


def _worst(report: Report, m: _Measured, fmt: Format, k: int, n: int) -> tuple[tuple[str, float], ...]:
    return tuple((w.name, w.fraction) for w in worst_modules(report, fmt, log2_scale=k, kind=m.kind, count=n))


def _insufficient(m: _Measured, fmt: Format, ev: Evidence, th: Thresholds, caveats: tuple[Caveat, ...],
                  reason: tuple[str, dict[str, Any]]) -> Recommendation:
    ev["insufficient_reason"], ev["insufficient_data"] = reason
    return Recommendation(
        verdict=Verdict.INSUFFICIENT_EVIDENCE, format=fmt.name, log2_scale=None, scale=None, grad_scaler_kwargs={},
        flushed_fraction_at_1=ev["flushed_fraction_at_1"] if m.hist.nonzero_finite else None,
        flushed_fraction_at_scale=None, overflow_steps_at_scale=None, headroom_bits=None, worst_modules=(),
        evidence=ev, thresholds=th, citations=_citations(Verdict.INSUFFICIENT_EVIDENCE),
        kind=m.kind, caveats=caveats,
    )


def _none_needed(report: Report, m: _Measured, fmt: Format, ev: Evidence, th: Thresholds,
                 caveats: tuple[Caveat, ...], k_max: int | None) -> Recommendation:
    ev.update(_at_scale(m, fmt, 0))
    return Recommendation(
        verdict=Verdict.NONE_NEEDED, format=fmt.name, log2_scale=0, scale=1.0, grad_scaler_kwargs={},
        flushed_fraction_at_1=ev["flushed_fraction_at_1"], flushed_fraction_at_scale=ev["flushed_fraction_at_1"],
        overflow_steps_at_scale=ev["overflow_steps_at_1"], headroom_bits=k_max,
        worst_modules=_worst(report, m, fmt, 0, th["worst"]), evidence=ev, thresholds=th,
        citations=_citations(Verdict.NONE_NEEDED), kind=m.kind, caveats=caveats,
    )


def _at_scale(m: _Measured, fmt: Format, k: int) -> Evidence:
    n = m.hist.nonzero_finite
    by_kind = {name: _kind_evidence(h, fmt, k) for name, h in m.by_kind.items()}
    return {
        "log2_scale": k,
        "flushed_fraction_at_scale": fraction(m.hist.flushed(fmt, k), n),
        "subnormal_fraction_at_scale": fraction(m.hist.subnormal(fmt, k), n),
        "overflow_steps_at_scale": m.ceiling.overflow_steps(fmt, k),
        "by_kind": by_kind,
    }


def _capped(k: int, max_abs: float, margin_bits: int) -> tuple[int, bool]:
    cap = fp32_log2_cap(max_abs, margin_bits)
    return (cap, True) if k > cap else (k, False)


def _scaled(report: Report, m: _Measured, fmt: Format, ev: Evidence, th: Thresholds,
            caveats: tuple[Caveat, ...], k_max: int) -> Recommendation:
    tau, margin = th["max_flushed_fraction"], th["margin_bits"]
    k, capped = _capped(k_max - margin, m.ceiling.max_abs, margin)
    ev.update(_at_scale(m, fmt, k))
    oracle = _per_step_oracle(m, fmt, margin)
    ev["per_step_scale_flushed_fraction"] = oracle
    needed, available = _spans(m.hist, fmt, m.ceiling.max_abs, tau, margin)
    ev["needed_span_bits"] = needed
    ev["format_span_bits"] = available

    if _flushed_at(m, fmt, k) <= tau:
        verdict = Verdict.CONSTANT
    elif oracle is not None and oracle <= tau:
        verdict = Verdict.DYNAMIC
    else:
        verdict = Verdict.NO_SINGLE_SCALE
        ev["limiting_modules"] = _limiting_modules(report, fmt, 3)
        ev["flushing_modules_at_scale"] = [[n, f] for n, f in _worst(report, m, fmt, k, th["worst"])]

    table = _replay(report, m, fmt, k, th)
    if table is not None:
        c = table.chosen
        ev["simulated_growth_interval"] = c.growth_interval
        ev["simulated_skipped_steps"] = c.skipped_steps
        ev["simulated_skipped_fraction"] = c.skipped_fraction
        ev["simulated_mean_flushed_fraction"] = c.mean_flushed_fraction
        ev["simulated_final_scale"] = c.final_scale
        ev["simulated_meets_threshold"] = c.meets_threshold
        ev["simulated_candidates_tied"] = _candidates_tied(table)
        growth_interval = c.growth_interval
        study = interval_study.evidence(report, m.ceiling.per_step_max())
        if study:
            ev["interval_study"] = study
            if ev["simulated_candidates_tied"] and study["within_range"]:
                # the run's own replay cannot choose an interval; the study measured one on runs that drift as it does
                growth_interval = int(study["growth_interval"])
                ev["growth_interval_from_study"] = True
    else:
        growth_interval = GRADSCALER_DEFAULTS["growth_interval"]
    kwargs = {"init_scale": math.ldexp(1.0, k), "growth_factor": float(th["growth_factor"]),
              "backoff_factor": float(th["backoff_factor"]), "growth_interval": int(growth_interval)}
    if capped:
        ev["fp32_capped_from_log2_scale"] = k_max - margin
    cites = _citations(verdict) + ((INTERVAL_STUDY,) if "interval_study" in ev else ())
    return Recommendation(
        verdict=verdict, format=fmt.name, log2_scale=k, scale=math.ldexp(1.0, k), grad_scaler_kwargs=kwargs,
        flushed_fraction_at_1=ev["flushed_fraction_at_1"], flushed_fraction_at_scale=ev["flushed_fraction_at_scale"],
        overflow_steps_at_scale=ev["overflow_steps_at_scale"], headroom_bits=k_max - k,
        worst_modules=_worst(report, m, fmt, 0, th["worst"]), evidence=ev, thresholds=th,
        citations=cites, kind=m.kind,
        growth_interval_table=None if table is None else table.to_dict(), caveats=caveats,
    )


def _replay(report: Report, m: _Measured, fmt: Format, k: int, th: Thresholds) -> GrowthIntervalTable | None:
    if m.kind_steps is None:
        return None
    return score_growth_intervals(
        report.trace, fmt, init_scale=math.ldexp(1.0, k), candidates=th["growth_intervals"],
        horizon=th["horizon"], seed=th["seed"], growth_factor=th["growth_factor"],
        backoff_factor=th["backoff_factor"], hysteresis=th["hysteresis"], min_scale=th["min_scale"],
        kind=m.kind, ceiling=m.ceiling, max_flushed_fraction=th["max_flushed_fraction"],
    )


def _per_step_oracle(m: _Measured, fmt: Format, margin_bits: int) -> float | None:
    """Flushed fraction if every step had its own S = 2^(k_max(step) - margin_bits).

    A bound on what any schedule of one scale per step can reach; None without a trace.
    """
    steps = m.kind_steps
    if steps is None or len(steps) != len(m.ceiling.steps):
        return None
    flushed = total = 0
    for h, c in zip(steps, m.ceiling.steps):
        if c.intrinsic:
            continue
        k = largest_safe_log2_scale(fmt, c.effective_max)
        total += h.nonzero_finite
        if k is not None:
            flushed += h.flushed(fmt, k - margin_bits)
    return fraction(flushed, total)


def _spans(hist: Histogram, fmt: Format, max_abs: float, tau: float,
           margin_bits: int) -> tuple[float | None, float]:
    """Bits from the smallest value that must survive to the largest, and bits the format holds."""
    available = math.log2(fmt.overflow_threshold) - fmt.log2_flush_threshold - margin_bits
    n = hist.nonzero_finite
    lowest, highest = hist.lowest_exp, hist.highest_exp
    if n == 0 or max_abs <= 0 or lowest is None or highest is None:
        return None, available
    # Largest e with at most tau*n values at or below 2^e: everything above 2^e must survive.
    e = lowest - 1
    while hist.at_most(e + 1) <= tau * n and e + 1 < highest:
        e += 1
    return math.log2(max_abs) - e, available


def _limiting_modules(report: Report, fmt: Format, n: int) -> list[list[Any]]:
    """The modules whose largest gradients set the ceiling on S: [name, log2 max, largest safe k]."""
    rows: list[list[Any]] = []
    for kd in GRAD_KINDS:
        for mod in report.modules_of(kd):
            if mod.histogram.max_abs > 0:
                rows.append([mod.name, math.log2(mod.histogram.max_abs),
                             largest_safe_log2_scale(fmt, mod.histogram.max_abs)])
    rows.sort(key=lambda r: -r[1])
    return rows[:n]


def _per_tensor(report: Report, m: _Measured, fmt: Format, ev: Evidence, th: Thresholds,
                caveats: tuple[Caveat, ...]) -> Recommendation:
    """Saturating casts: one scale per tensor from its measured max, as FP8 recipes do."""
    margin = th["margin_bits"]
    flushed = nonzero = saturated = 0
    per_tensor = []
    for kd in m.kinds:
        for mod in report.modules_of(kd):
            h = mod.histogram
            k_t = largest_safe_log2_scale(fmt, h.max_abs)
            if k_t is None or not h.nonzero_finite:
                continue
            k_t -= margin
            f = h.flushed(fmt, k_t)
            flushed += f
            nonzero += h.nonzero_finite
            saturated += _saturated(h, fmt, k_t)
            per_tensor.append([mod.name, k_t, fraction(f, h.nonzero_finite)])
    k_max = m.ceiling.largest_safe_log2_scale(fmt)
    k = 0 if k_max is None else k_max - margin
    ev.update(_at_scale(m, fmt, k))
    ev["per_tensor_scale_log2"] = k
    ev["per_tensor_scales"] = per_tensor
    ev["per_tensor_flushed_fraction"] = fraction(flushed, nonzero)
    ev["saturated_fraction_at_scale"] = fraction(saturated, nonzero)
    ev["single_scale_saturated_fraction"] = fraction(_saturated(m.hist, fmt, k), m.hist.nonzero_finite)
    return Recommendation(
        verdict=Verdict.PER_TENSOR_SCALING, format=fmt.name, log2_scale=k, scale=math.ldexp(1.0, k),
        grad_scaler_kwargs={}, flushed_fraction_at_1=ev["flushed_fraction_at_1"],
        flushed_fraction_at_scale=ev["flushed_fraction_at_scale"], overflow_steps_at_scale=ev["overflow_steps_at_scale"],
        headroom_bits=None if k_max is None else k_max - k, worst_modules=_worst(report, m, fmt, 0, th["worst"]),
        evidence=ev, thresholds=th, citations=_citations(Verdict.PER_TENSOR_SCALING), kind=m.kind,
        caveats=caveats,
    )


def _saturated(h: Histogram, fmt: Format, k: int) -> int:
    """Values beyond the format's max at S = 2^k: exact from max_abs when none, else an upper bound by bins."""
    if h.max_abs == 0.0 or not fmt.overflows(math.ldexp(h.max_abs, k)):
        return 0
    return h.nonzero_finite - h.at_most(math.floor(math.log2(fmt.overflow_threshold)) - k - 1)


def _candidates_tied(table: GrowthIntervalTable) -> bool:
    """Whether the replay cannot tell the candidates apart on underflow, only on growth probes.

    True when every candidate meets the threshold, their flushed shares differ by less than a
    tenth of it, and either all skip as many steps, or the longest is chosen with skipped steps
    falling as the interval grows: the only skips are growth probes that overflow, so the
    replay is saying "hold S", not choosing a schedule.
    """
    rows = sorted(table.rows, key=lambda r: r.growth_interval)
    if len(rows) < 2 or not all(r.meets_threshold for r in rows):
        return False
    flushed = [r.mean_flushed_fraction or 0.0 for r in rows]
    if max(flushed) - min(flushed) > table.max_flushed_fraction / 10:
        return False
    skipped = [r.skipped_steps for r in rows]
    return len(set(skipped)) == 1 or (table.chosen is rows[-1] and skipped == sorted(skipped, reverse=True))


# -- the forward pass and the loss's dtype (fp16probe.analysis.forward) ----------------------

def _forward_evidence(ff: ForwardFindings) -> Evidence:
    ev: Evidence = {
        "target": ff.target, "regime": ff.regime, "forward_source": ff.source,
        "forward_overflow": [t.to_dict() for t in ff.overflowing[:20]],
        "forward_low_headroom": [t.to_dict() for t in ff.low_headroom[:10]],
        "forward_flushing": [t.to_dict() for t in ff.flushing[:10]],
        "custom_functions": list(ff.custom_functions),
    }
    if ff.loss_fp16 is not None:
        ev["loss_fp16"] = ff.loss_fp16
    return ev


def _forward_caveats(ff: ForwardFindings | None) -> tuple[Caveat, ...]:
    if ff is None:
        return ()
    run = {"regime": ff.regime, "target": ff.target}
    out = [Caveat("pure_fp16")] if ff.regime == "pure_fp16" else []
    if ff.source == "modules":
        out.append(Caveat("forward_modules_only"))
    if ff.low_headroom and not ff.overflowing:
        out.append(Caveat("forward_low_headroom", {**run, "tensors": [
            [t.name, t.headroom_bits or 0.0] for t in ff.low_headroom[:5]]}))
    if ff.flushing and ff.flushing[0].flushed_fraction < FORWARD_UNDERFLOW_VERDICT:
        out.append(Caveat("forward_flushing", {**run, "count": len(ff.flushing), "tensors": [
            [t.name, t.flushed_fraction] for t in ff.flushing[:4]]}))
    if ff.custom_functions:
        out.append(Caveat("custom_functions", {"functions": list(ff.custom_functions[:5])}))
    if ff.loss_fp16:
        out.append(Caveat("loss_fp16", run))
    return tuple(out)


def _loss_capped(m: "_Measured", fmt: Format, rec: Recommendation) -> Recommendation:
    """The scale verdict with S capped at 2^15 because the loss is fp16 in the target run."""
    import dataclasses

    k, cap = rec.log2_scale, FP16_LOSS_LOG2_CAP
    assert k is not None
    ev: Evidence = dict(rec.evidence)  # type: ignore[assignment]
    ev["log2_scale_without_loss_cap"] = k
    ev["before_loss_cap"] = {key: ev[key] for key in (
        "flushed_fraction_at_scale", "subnormal_fraction_at_scale", "overflow_steps_at_scale", "by_kind",
        "largest_safe_log2_scale") if key in ev}
    ev.update(_at_scale(m, fmt, cap))
    k_max = ev.get("largest_safe_log2_scale")
    if k_max is not None:
        ev["largest_safe_log2_scale"] = min(int(k_max), cap)
    kwargs = dict(rec.grad_scaler_kwargs)
    kwargs["init_scale"] = math.ldexp(1.0, cap)
    return dataclasses.replace(
        rec, log2_scale=cap, scale=math.ldexp(1.0, cap), grad_scaler_kwargs=kwargs,
        flushed_fraction_at_scale=ev["flushed_fraction_at_scale"], overflow_steps_at_scale=ev["overflow_steps_at_scale"],
        headroom_bits=None if k_max is None else min(int(k_max), cap) - cap, evidence=ev)


def fix_modules(ff: ForwardFindings, verdict: Verdict) -> list[str]:
    """The modules to keep in fp32 for a forward verdict, in forward order (empty: the model's own code)."""
    rows = ff.overflowing if verdict is Verdict.FORWARD_OVERFLOW else ff.flushing
    names: list[str] = []
    for t in rows:
        module = t.module
        if module and module != "(model)" and module not in names:
            names.append(module)
    # A module inside another one already listed is covered by it.
    return [n for n in names if not any(n != o and n.startswith(o + ".") for o in names)]


def _forward_verdict(report: Report, fmt: Format, th: Thresholds, ff: ForwardFindings, inner: Recommendation,
                     verdict: Verdict) -> Recommendation:
    ev: Evidence = dict(inner.evidence)  # type: ignore[assignment]
    ev.update(_forward_evidence(ff))
    ev["backward_verdict"] = inner.verdict.value
    ev["backward_log2_scale"] = inner.log2_scale
    modules = fix_modules(ff, verdict)
    ev["fix_modules"] = modules  # presentation writes the code from these and fix_device
    ev["fix_device"] = ff.target if ff.target in AUTOCAST_TARGETS else "cuda"
    rows = ff.overflowing if verdict is Verdict.FORWARD_OVERFLOW else ff.flushing
    ev["fix_top_level"] = [t.name for t in rows if t.module == "(model)"][:3]
    ev["forward_overflow_count"] = len(ff.overflowing)
    ev["forward_flushing_count"] = len(ff.flushing)
    ev["forward_tensors"] = ff.tensors
    caveats = inner.caveats
    if verdict is Verdict.FORWARD_OVERFLOW:  # the inf came from the forward, not from the scale in force
        caveats = tuple(c for c in caveats if c.code != "scale_induced_overflow")
    return Recommendation(
        verdict=verdict, format=fmt.name, log2_scale=None, scale=None, grad_scaler_kwargs={},
        flushed_fraction_at_1=inner.flushed_fraction_at_1, flushed_fraction_at_scale=None,
        overflow_steps_at_scale=None, headroom_bits=None, worst_modules=inner.worst_modules, evidence=ev,
        thresholds=th, citations=(MIXED_PRECISION_TRAINING,), kind=inner.kind, caveats=caveats,
    )
