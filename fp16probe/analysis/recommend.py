"""From a Report to a loss-scale recommendation, with its evidence and honest provenance.

Pure functions over report data: nothing here touches a model, hooks or a device,
except :func:`weight_update_loss`, which takes weight and update tensors.

Everything rests on one exact fact: multiplying by S = 2^k moves a value from bin ``e`` to
bin ``e + k`` without rounding, so the histograms answer "what flushes / overflows at S"
for every k at once (``Histogram.flushed`` / ``Histogram.overflows``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping, Sequence

import torch

from fp16probe.errors import AnalysisError
from fp16probe.formats import Format, get_format
from fp16probe.analysis.provenance import (
    BF16_NO_SCALER,
    CITATION_GRADSCALER,
    CITATION_LIT011,
    CITATION_NVIDIA_GUIDE,
    CONSTANT_RULE,
    DEFAULTS_STANDING,
    SIMULATION_CAVEAT,
    UNDERFLOW_MECHANISM,
    WEIGHT_UPDATE_RULE,
)
from fp16probe.analysis.replay import (
    DEFAULT_GROWTH_INTERVALS,
    GRAD_KINDS,
    GRADSCALER_DEFAULTS,
    GrowthIntervalTable,
    score_growth_intervals,
)
from fp16probe.recommendation import Recommendation, Verdict
from fp16probe.report import ACTIVATION_GRAD, KINDS, Histogram, Report

__all__ = [
    "ALL_GRADS",
    "VERDICTS",
    "ParameterUpdateLoss",
    "Recommendation",
    "WeightUpdateLoss",
    "WhatIfRow",
    "WhatIfTable",
    "analyze",
    "largest_safe_log2_scale",
    "weight_update_loss",
    "what_if",
]

NONE_NEEDED = Verdict.NONE_NEEDED
CONSTANT = Verdict.CONSTANT
DYNAMIC = Verdict.DYNAMIC
NO_SINGLE_SCALE = Verdict.NO_SINGLE_SCALE
VERDICTS = tuple(v.value for v in (NONE_NEEDED, CONSTANT, DYNAMIC, NO_SINGLE_SCALE))  # what analyze returns
ALL_GRADS = "all"  # activation and weight gradients together: every value the loss scale multiplies


# -- what-if tables --------------------------------------------------------------------------

@dataclass(frozen=True)
class WhatIfRow:
    """What happens to the values at S = 2^log2_scale.

    Fractions are of the nonzero finite values; ``overflow_steps`` counts profiled steps
    in which some value lands past the format's max (or already was inf/NaN).
    """

    log2_scale: int
    flushed_fraction: float
    subnormal_fraction: float
    overflow_steps: int
    flushed: int = 0
    subnormal: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WhatIfRow":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class WhatIfTable:
    """The what-if rows for one format and kind: globally (``rows``) and per module."""

    format: str
    kind: str
    steps: int
    nonzero: int
    rows: tuple[WhatIfRow, ...]
    modules: Mapping[str, tuple[WhatIfRow, ...]] = field(default_factory=dict)

    def row(self, log2_scale: int) -> WhatIfRow:
        for r in self.rows:
            if r.log2_scale == log2_scale:
                return r
        raise KeyError(f"log2_scale {log2_scale} is not in this table")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "kind": self.kind,
            "steps": self.steps,
            "nonzero": self.nonzero,
            "rows": [r.to_dict() for r in self.rows],
            "modules": {n: [r.to_dict() for r in rs] for n, rs in self.modules.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WhatIfTable":
        return cls(
            format=str(d["format"]),
            kind=str(d["kind"]),
            steps=int(d["steps"]),
            nonzero=int(d["nonzero"]),
            rows=tuple(WhatIfRow.from_dict(r) for r in d["rows"]),
            modules={n: tuple(WhatIfRow.from_dict(r) for r in rs) for n, rs in d.get("modules", {}).items()},
        )


def _kinds_of(kind: str) -> tuple[str, ...]:
    if kind == ALL_GRADS:
        return GRAD_KINDS
    if kind not in KINDS:
        raise AnalysisError(f"unknown kind {kind!r}: expected one of {', '.join(KINDS + (ALL_GRADS,))}")
    return (kind,)


def _merged(report: Report, kinds: Sequence[str]) -> Histogram:
    return Histogram.sum(report.histogram(k) for k in kinds)


def _per_step(report: Report, kinds: Sequence[str]) -> list[Histogram] | None:
    """Per-step histograms of ``kinds`` summed, or None when the trace has none."""
    present = [report.trace.histograms[k] for k in kinds if report.trace.histograms.get(k)]
    if not present:
        return None
    return [Histogram.sum(hs) for hs in zip(*present)]


def _fraction(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _rows(hist: Histogram, step_overflows, fmt: Format, log2_scales: Iterable[int]) -> tuple[WhatIfRow, ...]:
    n = hist.nonzero_finite
    out = []
    for k in log2_scales:
        flushed = hist.flushed(fmt, k)
        sub = hist.subnormal(fmt, k)
        out.append(WhatIfRow(int(k), _fraction(flushed, n), _fraction(sub, n), step_overflows(k), flushed, sub))
    return tuple(out)


def what_if(
    report: Report,
    format: str | Format = "fp16",
    *,
    kind: str = ACTIVATION_GRAD,
    log2_scales: Iterable[int] = range(-8, 41),
    modules: bool = True,
) -> WhatIfTable:
    """Tabulate flushed and subnormal fractions and overflowing steps for each S = 2^k.

    Exact, from the histograms. Globally, overflow is counted per profiled step from the
    trace (a report without a trace counts as one step). Per module, it counts the steps
    in which the module's largest finite value overflows; a module whose histogram holds
    inf/NaN counts at least one such step.
    """
    fmt = get_format(format)
    kinds = _kinds_of(kind)
    scales = [int(k) for k in log2_scales]
    merged = _merged(report, kinds)
    steps = _per_step(report, kinds) or [merged]

    def global_overflows(k: int) -> int:
        return sum(h.overflows(fmt, k) for h in steps)

    table_modules: dict[str, tuple[WhatIfRow, ...]] = {}
    if modules:
        for k_ in kinds:
            maxima = report.trace.module_max.get(k_, {})
            for m in report.modules_of(k_):
                per_step = maxima.get(m.name)
                hist = m.histogram

                def module_overflows(k: int, per_step=per_step, hist=hist) -> int:
                    if per_step is None:
                        return int(hist.overflows(fmt, k))
                    n = sum(1 for v in per_step if v > 0.0 and fmt.overflows(math.ldexp(v, k)))
                    return max(n, 1) if hist.nonfinite else n

                table_modules[m.name] = _rows(hist, module_overflows, fmt, scales)
    return WhatIfTable(fmt.name, kind, len(steps), merged.nonzero_finite,
                       _rows(merged, global_overflows, fmt, scales), table_modules)


# -- the recommendation ----------------------------------------------------------------------

def largest_safe_log2_scale(fmt: str | Format, max_abs: float) -> int | None:
    """The largest k with ``max_abs * 2^k`` still below the format's overflow threshold."""
    fmt = get_format(fmt)
    if not max_abs > 0.0:
        return None
    k = math.floor(math.log2(fmt.overflow_threshold) - math.log2(max_abs))
    while fmt.overflows(math.ldexp(max_abs, k)):
        k -= 1
    while not fmt.overflows(math.ldexp(max_abs, k + 1)):
        k += 1
    return k


def analyze(
    report: Report,
    format: str | Format = "fp16",
    *,
    kind: str = ACTIVATION_GRAD,
    margin_bits: int = 1,
    max_flushed_fraction: float = 1e-3,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_intervals: Sequence[int] = DEFAULT_GROWTH_INTERVALS,
    horizon: int = 20000,
    seed: int = 0,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    worst: int = 5,
) -> Recommendation:
    """Decide whether and how to scale the loss for ``format``, from a profile.

    Args:
        report: a Report from a Probe (fp32 or any precision; scaled runs are unscaled).
        format: the target format: ``fp16`` (default), ``bf16``, ``fp8_e4m3``, ``fp8_e5m2``.
        kind: whose underflow counts: ``activation_grad`` (default), ``weight_grad`` or
            ``all``. Overflow is always judged on every gradient the loss scale multiplies
            (activation and weight gradients, as captured).
        margin_bits: safety margin below the overflow edge: S is the largest power of two
            with S x max|g| below the format's overflow threshold, divided by 2^margin_bits.
            Default 1 (one doubling of the largest gradient is absorbed).
        max_flushed_fraction: the largest share of nonzero values allowed to flush for a
            scale to count as fitting. Default 1e-3 (0.1%).
        growth_factor, backoff_factor: the schedule's factors; defaults 2.0 and 0.5, the
            values of NVIDIA's guide that GradScaler ships (not measured here).
        growth_intervals: candidates replayed to choose growth_interval.
        horizon, seed: length and seed of the long-horizon replay over resampled steps.
        hysteresis, min_scale: DeepSpeed/Megatron variants for the replay (1 and 0:
            GradScaler's rule).
        worst: how many worst modules to list.

    Verdicts, in the order they are tried:

    * ``none_needed``: at S = 1 at most ``max_flushed_fraction`` flushes and the largest
      gradient keeps ``margin_bits`` of headroom.
    * ``constant``: at S = 2^(k_max - margin_bits), where k_max is the largest k with
      max|g| x 2^k below the overflow threshold (LIT-011's rule made exact), at most
      ``max_flushed_fraction`` flushes.
    * ``dynamic``: the constant S flushes too much, but a scale chosen per profiled step by
      the same rule from that step's own max would not: the range moves over the profile
      more than one constant can absorb.
    * ``no_single_scale``: even per step, the values span more than the format holds.
    """
    fmt = get_format(format)
    kinds = _kinds_of(kind)
    thresholds = {
        "format": fmt.name, "kind": kind, "margin_bits": margin_bits,
        "max_flushed_fraction": max_flushed_fraction, "growth_factor": growth_factor,
        "backoff_factor": backoff_factor, "growth_intervals": list(growth_intervals),
        "horizon": horizon, "seed": seed, "hysteresis": hysteresis, "min_scale": min_scale,
        "worst": worst,
    }
    if isinstance(margin_bits, bool) or int(margin_bits) != margin_bits or margin_bits < 0:
        raise AnalysisError(f"margin_bits must be a non-negative integer, got {margin_bits!r}")
    if not 0.0 <= max_flushed_fraction < 1.0:
        raise AnalysisError(
            f"max_flushed_fraction must be in [0, 1), got {max_flushed_fraction!r}: e.g. 1e-3 for 0.1%"
        )
    margin_bits = int(margin_bits)

    hist = _merged(report, kinds)
    if hist.total == 0:
        raise AnalysisError(
            f"the report holds no {kind} values: profile with the Probe capturing them "
            f"(captured: {', '.join(report.metadata.captured) or 'nothing'}), or pass kind=..."
        )
    over_kinds = [k for k in GRAD_KINDS if report.histogram(k).total or report.trace.histograms.get(k)]
    over_steps = _per_step(report, over_kinds) or [_merged(report, over_kinds)]
    kind_steps = _per_step(report, kinds)
    step_max = [h.max_abs for h in over_steps]
    max_abs = max(step_max + [report.histogram(k).max_abs for k in over_kinds])
    nonfinite_steps = sum(1 for h in over_steps if h.nonfinite)
    n = hist.nonzero_finite

    def flushed_at(k: int) -> float:
        return _fraction(hist.flushed(fmt, k), n)

    def overflow_steps(k: int) -> int:
        return sum(h.overflows(fmt, k) for h in over_steps)

    k_max = largest_safe_log2_scale(fmt, max_abs)
    evidence: dict[str, Any] = {
        "nonzero_values": n,
        "zero_values": hist.zero,
        "nonfinite_values": hist.nonfinite,
        "profiled_steps": len(over_steps),
        "nonfinite_steps": nonfinite_steps,
        "max_abs": max_abs,
        "log2_max_abs": math.log2(max_abs) if max_abs > 0 else None,
        "largest_safe_log2_scale": k_max,
        "flushed_fraction_at_1": flushed_at(0),
        "subnormal_fraction_at_1": _fraction(hist.subnormal(fmt, 0), n),
        "overflow_steps_at_1": overflow_steps(0),
        "lowest_log2": hist.lowest_exp,
        "highest_log2": hist.highest_exp,
    }
    positive = [m for m in step_max if m > 0.0]
    if positive:
        evidence["per_step_max_range_bits"] = math.log2(max(positive)) - math.log2(min(positive))
    worst_modules = _worst_modules(report, kinds, fmt, 0, worst)
    common = dict(format=fmt.name, kind=kind, thresholds=thresholds, worst_modules=worst_modules,
                  flushed_fraction_at_1=flushed_at(0))

    if n == 0 or k_max is None or (flushed_at(0) <= max_flushed_fraction and k_max - margin_bits >= 0):
        k = 0
        evidence.update(_at_scale(hist, fmt, k, overflow_steps))
        headroom = None if k_max is None else k_max
        text = _text_none_needed(fmt, evidence, headroom, max_flushed_fraction)
        return Recommendation(verdict=NONE_NEEDED, log2_scale=0, scale=1.0, grad_scaler_kwargs={},
                              flushed_fraction_at_scale=flushed_at(0), overflow_steps_at_scale=overflow_steps(0),
                              headroom_bits=headroom, evidence=evidence,
                              citations=_citations(NONE_NEEDED), text=text, **common)

    k_c = k_max - margin_bits
    evidence.update(_at_scale(hist, fmt, k_c, overflow_steps))
    oracle = _per_step_oracle(kind_steps, over_steps, fmt, margin_bits)
    evidence["per_step_scale_flushed_fraction"] = oracle
    needed, available = _spans(hist, fmt, max_abs, max_flushed_fraction, margin_bits)
    evidence["needed_span_bits"] = needed
    evidence["format_span_bits"] = available

    if flushed_at(k_c) <= max_flushed_fraction:
        verdict = CONSTANT
    elif oracle is not None and oracle <= max_flushed_fraction:
        verdict = DYNAMIC
    else:
        verdict = NO_SINGLE_SCALE
        evidence["limiting_modules"] = _limiting_modules(report, over_kinds, fmt, 3)
        evidence["flushing_modules_at_scale"] = [
            [name, frac] for name, frac in _worst_modules(report, kinds, fmt, k_c, worst)
        ]

    table: GrowthIntervalTable | None = None
    if kind_steps is not None:
        table = score_growth_intervals(
            report.trace, fmt, init_scale=math.ldexp(1.0, k_c), candidates=growth_intervals,
            horizon=horizon, seed=seed, growth_factor=growth_factor, backoff_factor=backoff_factor,
            hysteresis=hysteresis, min_scale=min_scale, kind=kind, overflow_kinds=over_kinds,
            max_flushed_fraction=max_flushed_fraction,
        )
        chosen = table.chosen
        growth_interval = chosen.growth_interval
        evidence.update(
            simulated_growth_interval=growth_interval,
            simulated_skipped_steps=chosen.skipped_steps,
            simulated_skipped_fraction=chosen.skipped_fraction,
            simulated_mean_flushed_fraction=chosen.mean_flushed_fraction,
            simulated_final_scale=chosen.final_scale,
            simulated_meets_threshold=chosen.meets_threshold,
        )
    else:
        growth_interval = int(GRADSCALER_DEFAULTS["growth_interval"])
    kwargs = {"init_scale": math.ldexp(1.0, k_c), "growth_factor": float(growth_factor),
              "backoff_factor": float(backoff_factor), "growth_interval": int(growth_interval)}
    text = _TEXTS[verdict](fmt, k_c, margin_bits, evidence, kwargs, table, max_flushed_fraction)
    return Recommendation(
        verdict=verdict, log2_scale=k_c, scale=math.ldexp(1.0, k_c), grad_scaler_kwargs=kwargs,
        flushed_fraction_at_scale=flushed_at(k_c), overflow_steps_at_scale=overflow_steps(k_c),
        headroom_bits=k_max - k_c, evidence=evidence, citations=_citations(verdict), text=text,
        growth_interval_table=None if table is None else table.to_dict(), **common,
    )


def _at_scale(hist: Histogram, fmt: Format, k: int, overflow_steps) -> dict[str, Any]:
    n = hist.nonzero_finite
    return {
        "log2_scale": k,
        "flushed_fraction_at_scale": _fraction(hist.flushed(fmt, k), n),
        "subnormal_fraction_at_scale": _fraction(hist.subnormal(fmt, k), n),
        "overflow_steps_at_scale": overflow_steps(k),
    }


def _per_step_oracle(kind_steps, over_steps, fmt: Format, margin_bits: int) -> float | None:
    """Flushed fraction if every step had its own S = 2^(k_max(step) - margin_bits).

    A bound on what any schedule of one scale per step can reach; None without a trace.
    """
    if kind_steps is None or len(kind_steps) != len(over_steps):
        return None
    flushed = total = 0
    for h, o in zip(kind_steps, over_steps):
        k = largest_safe_log2_scale(fmt, o.max_abs)
        total += h.nonzero_finite
        if k is None:
            continue
        flushed += h.flushed(fmt, k - margin_bits)
    return _fraction(flushed, total)


def _spans(hist: Histogram, fmt: Format, max_abs: float, tau: float, margin_bits: int):
    """Bits from the smallest value that must survive to the largest, and bits the format holds."""
    available = math.log2(fmt.overflow_threshold) - fmt.log2_flush_threshold - margin_bits
    n = hist.nonzero_finite
    if n == 0 or max_abs <= 0:
        return None, available
    # Largest e with at most tau*n values at or below 2^e: everything above 2^e must survive.
    e = hist.lowest_exp - 1
    while hist.at_most(e + 1) <= tau * n and e + 1 < hist.highest_exp:
        e += 1
    return math.log2(max_abs) - e, available


def _worst_modules(report: Report, kinds, fmt: Format, k: int, count: int) -> tuple[tuple[str, float], ...]:
    scored = []
    for kd in kinds:
        for m in report.modules_of(kd):
            nz = m.histogram.nonzero_finite
            if nz:
                frac = m.histogram.flushed(fmt, k) / nz
                if frac > 0:
                    scored.append((m.name, frac))
    scored.sort(key=lambda x: -x[1])
    return tuple(scored[: max(int(count), 0)])


def _limiting_modules(report: Report, kinds, fmt: Format, count: int) -> list[list[Any]]:
    """The modules whose largest gradients set the ceiling on S: [name, log2 max, largest safe k]."""
    rows = []
    for kd in kinds:
        for m in report.modules_of(kd):
            if m.histogram.max_abs > 0:
                rows.append([m.name, math.log2(m.histogram.max_abs), largest_safe_log2_scale(fmt, m.histogram.max_abs)])
    rows.sort(key=lambda r: -r[1])
    return rows[:count]


def _citations(verdict: str) -> tuple[str, ...]:
    if verdict == NONE_NEEDED:
        return (CITATION_LIT011,)
    return (CITATION_LIT011, CITATION_NVIDIA_GUIDE, CITATION_GRADSCALER)


# -- the words -------------------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"


def _overflow_words(fmt: Format) -> str:
    if fmt.has_inf:
        return "overflow to inf"
    return "land beyond the max finite value (saturated or NaN, depending on the cast)"


def _nonfinite_note(evidence: Mapping[str, Any]) -> str:
    n = evidence["nonfinite_steps"]
    if not n:
        return ""
    return (f" {n} profiled step(s) already held inf/NaN gradients; no scale fixes those, and they "
            "count as overflowing at every S.")


def _text_none_needed(fmt: Format, ev: Mapping[str, Any], headroom: int | None, tau: float) -> str:
    if ev["nonzero_values"] == 0 and ev["nonfinite_values"]:
        return (f"No loss scale can be judged for {fmt.name}: every captured gradient value was zero, inf or "
                f"NaN ({ev['nonfinite_values']} inf/NaN values in {ev['nonfinite_steps']} of "
                f"{ev['profiled_steps']} step(s)), so the profiled run overflowed before any cast to "
                f"{fmt.name}. Loss scaling cannot fix that: find the divergence (learning rate, loss, "
                "inputs) and profile again.")
    flushed = ev["flushed_fraction_at_1"]
    parts = [f"No loss scaling needed for {fmt.name}: at S = 1, {_pct(flushed)} of the nonzero "
             f"gradient values flush to zero (threshold {_pct(tau)})"]
    if headroom is None:
        parts[0] += " and there are no nonzero gradient values to overflow."
    else:
        parts[0] += (f" and the largest gradient ({ev['max_abs']:.4g}) sits {headroom} bit(s) below "
                     f"where values would {_overflow_words(fmt)}.")
    if fmt.name == "bf16":
        parts.append(BF16_NO_SCALER + " This was measured on the profile, not assumed.")
    parts.append(UNDERFLOW_MECHANISM)
    return " ".join(parts) + _nonfinite_note(ev)


def _bf16_surprise(fmt: Format) -> str:
    if fmt.name != "bf16":
        return ""
    return (" Unexpected for bf16, which has fp32's exponent range: values this small are near "
            "fp32's own limits, so look for a bug or a loss that is far too small.")


def _schedule_words(kwargs: Mapping[str, Any], table: GrowthIntervalTable | None, ev: Mapping[str, Any]) -> str:
    if table is None:
        return (f" growth_interval={kwargs['growth_interval']} is GradScaler's default, not chosen from "
                "data: this report has no per-step trace to replay.")
    c = table.chosen
    return (f" growth_interval={c.growth_interval} was chosen by replaying the candidates "
            f"{[r.growth_interval for r in table.rows]} over {table.horizon} simulated steps: it skipped "
            f"{c.skipped_steps} step(s) ({_pct(c.skipped_fraction)}) and left {_pct(c.mean_flushed_fraction)} "
            f"of values flushed, the fewest skipped steps among candidates within the threshold (or the "
            f"least underflow when none is). {SIMULATION_CAVEAT}")


def _kwargs_words(kwargs: Mapping[str, Any]) -> str:
    k = int(math.log2(kwargs["init_scale"]))
    return (f"GradScaler(init_scale=2.0**{k}, growth_factor={kwargs['growth_factor']}, "
            f"backoff_factor={kwargs['backoff_factor']}, growth_interval={kwargs['growth_interval']})")


def _text_constant(fmt, k, margin, ev, kwargs, table, tau) -> str:
    return (
        f"Use a constant loss scale S = 2^{k} for {fmt.name}. At S = 1, {_pct(ev['flushed_fraction_at_1'])} "
        f"of the nonzero gradient values flush to zero; at S = 2^{k}, {_pct(ev['flushed_fraction_at_scale'])} "
        f"do (threshold {_pct(tau)}) and {ev['overflow_steps_at_scale']} of {ev['profiled_steps']} profiled "
        f"steps {_overflow_words(fmt)}. The largest gradient seen ({ev['max_abs']:.4g}) allows up to "
        f"S = 2^{ev['largest_safe_log2_scale']}; S keeps {margin} bit(s) of headroom below that. "
        f"{CONSTANT_RULE} {UNDERFLOW_MECHANISM}{_bf16_surprise(fmt)} "
        f"To hold S fixed, multiply the loss by S, divide the gradients by S before clipping or the "
        f"optimizer, and skip any step whose gradients hold inf/NaN. With GradScaler, which cannot hold a "
        f"scale fixed (it requires growth_factor > 1), use {_kwargs_words(kwargs)}: it starts at S and "
        f"probes upward only every growth_interval steps.{_schedule_words(kwargs, table, ev)} "
        f"{DEFAULTS_STANDING}{_nonfinite_note(ev)}"
    )


def _text_dynamic(fmt, k, margin, ev, kwargs, table, tau) -> str:
    caveat = ""
    if ev.get("simulated_meets_threshold") is False:
        caveat = (f" In the replay no candidate schedule got the flushed share down to {_pct(tau)}: "
                  "with the profiled steps in random order, a scale that follows the range only "
                  "catches slow drift, not jumps from one step to the next; if your range jumps "
                  "like this, per-tensor scaling or bf16 is the sturdier fix.")
    return (
        f"Use a dynamic loss-scale schedule for {fmt.name}: {_kwargs_words(kwargs)}. The largest "
        f"gradient moves over the profile by {ev.get('per_step_max_range_bits', 0.0):.3g} bits from step to "
        f"step, more than one constant scale absorbs: the constant S = 2^{k} that no profiled step "
        f"overflows at (with {margin} bit(s) of margin) leaves {_pct(ev['flushed_fraction_at_scale'])} of "
        f"the nonzero values flushed (threshold {_pct(tau)}), while a scale fitted to each step leaves "
        f"{_pct(ev['per_step_scale_flushed_fraction'])}. At S = 1, {_pct(ev['flushed_fraction_at_1'])} flush. "
        f"init_scale = 2^{k} comes from the data: the largest power of two, less the margin, at which no "
        f"profiled step overflows, so the schedule starts without skipped steps.{_schedule_words(kwargs, table, ev)}"
        f"{caveat} "
        f"{CONSTANT_RULE} {UNDERFLOW_MECHANISM}{_bf16_surprise(fmt)} {DEFAULTS_STANDING}{_nonfinite_note(ev)}"
    )


def _text_no_single_scale(fmt, k, margin, ev, kwargs, table, tau) -> str:
    limiting = ", ".join(f"{n} (max 2^{lg:.1f})" for n, lg, _ in ev.get("limiting_modules", [])) or "none"
    flushing = ", ".join(f"{n} ({_pct(f)})" for n, f in ev.get("flushing_modules_at_scale", [])) or "none"
    needed = ev.get("needed_span_bits")
    needed_words = "" if needed is None else f" The values that matter span {needed:.3g} bits;"
    return (
        f"No single loss scale fits {fmt.name}.{needed_words} {fmt.name} holds about "
        f"{ev['format_span_bits']:.3g} bits between its flush threshold and its max (less {margin} bit(s) of "
        f"margin). The best constant, S = 2^{k}, still leaves {_pct(ev['flushed_fraction_at_scale'])} of the "
        f"nonzero values flushed (threshold {_pct(tau)}), and even a scale fitted to each profiled step "
        f"leaves {_pct(ev['per_step_scale_flushed_fraction'])}. The ceiling on S is set by: {limiting}. "
        f"The most values flush in: {flushing}. Options: train in bf16 (fp32's exponent range); scale per "
        f"layer or per tensor, as FP8 recipes do; keep the responsible layers in fp32. If you keep one "
        f"scale, the least bad is {_kwargs_words(kwargs)}.{_schedule_words(kwargs, table, ev)} "
        f"{CONSTANT_RULE} {UNDERFLOW_MECHANISM} {DEFAULTS_STANDING}{_nonfinite_note(ev)}"
    )


_TEXTS = {CONSTANT: _text_constant, DYNAMIC: _text_dynamic, NO_SINGLE_SCALE: _text_no_single_scale}


# -- weight updates without fp32 master weights -----------------------------------------------

@dataclass(frozen=True)
class ParameterUpdateLoss:
    """One parameter: how many of its nonzero updates vanish when added in the format."""

    name: str
    elements: int
    nonzero_updates: int
    lost: int
    rule_lost: int

    @property
    def lost_fraction(self) -> float:
        return _fraction(self.lost, self.nonzero_updates)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["lost_fraction"] = self.lost_fraction
        return d


@dataclass(frozen=True)
class WeightUpdateLoss:
    """Updates lost when weights are kept in ``format`` without fp32 master copies.

    ``lost`` counts elements with a nonzero update u where ``fmt(fmt(w) + fmt(u)) == fmt(w)``,
    measured by casting; ``rule_lost`` counts LIT-011's rule of thumb,
    ``|w| >= 2^(mantissa bits + 1) |u|`` (2^11 for fp16), for comparison.
    """

    format: str
    parameters: tuple[ParameterUpdateLoss, ...]
    text: str = ""

    @property
    def elements(self) -> int:
        return sum(p.elements for p in self.parameters)

    @property
    def nonzero_updates(self) -> int:
        return sum(p.nonzero_updates for p in self.parameters)

    @property
    def lost(self) -> int:
        return sum(p.lost for p in self.parameters)

    @property
    def rule_lost(self) -> int:
        return sum(p.rule_lost for p in self.parameters)

    @property
    def lost_fraction(self) -> float:
        return _fraction(self.lost, self.nonzero_updates)

    @property
    def rule_lost_fraction(self) -> float:
        return _fraction(self.rule_lost, self.nonzero_updates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "elements": self.elements,
            "nonzero_updates": self.nonzero_updates,
            "lost": self.lost,
            "lost_fraction": self.lost_fraction,
            "rule_lost": self.rule_lost,
            "rule_lost_fraction": self.rule_lost_fraction,
            "parameters": [p.to_dict() for p in self.parameters],
            "text": self.text,
        }


def weight_update_loss(
    weights: torch.nn.Module | Mapping[str, torch.Tensor],
    updates: Mapping[str, torch.Tensor] | None = None,
    *,
    lr: float | None = None,
    format: str | Format = "fp16",
) -> WeightUpdateLoss:
    """Count the parameter elements whose update would vanish in ``format`` without fp32 master weights.

    ``updates`` maps parameter names to the optimizer's update tensors (new minus old
    weight). Without it, the update is plain SGD's ``-lr * grad`` from each parameter's
    ``.grad`` (a Module is required then); parameters without a gradient are left out.
    This reads tensors (one host sync per parameter); call it outside the training loop.
    """
    fmt = get_format(format)
    if isinstance(weights, torch.nn.Module):
        named = {n: p for n, p in weights.named_parameters() if p.requires_grad}
    else:
        named = dict(weights)
    if updates is None:
        if lr is None:
            raise AnalysisError("give the optimizer's updates or a learning rate (lr=...) to derive SGD's -lr*grad")
        updates = {n: -float(lr) * p.grad for n, p in named.items() if getattr(p, "grad", None) is not None}
        if not updates:
            raise AnalysisError("no parameter has a .grad: run a backward pass first, or pass updates=...")
    ratio = math.ldexp(1.0, fmt.mantissa_bits + 1)
    rows = []
    for name, u in updates.items():
        if name not in named:
            raise AnalysisError(f"update for {name!r} has no matching weight: expected names from {sorted(named)[:5]}...")
        w = named[name].detach().float()
        u = u.detach().float()
        if u.shape != w.shape:
            raise AnalysisError(f"update for {name!r} has shape {tuple(u.shape)}, weight has {tuple(w.shape)}")
        w_low = w.to(fmt.dtype)
        summed = (w_low.float() + u.to(fmt.dtype).float()).to(fmt.dtype)
        moved = u != 0
        lost = moved & (summed.float() == w_low.float())
        rule = moved & (w.abs() >= ratio * u.abs())
        rows.append(ParameterUpdateLoss(name, w.numel(), int(moved.sum()), int(lost.sum()), int(rule.sum())))
    result = WeightUpdateLoss(fmt.name, tuple(rows))
    text = (f"Without fp32 master weights, {_pct(result.lost_fraction)} of the {result.nonzero_updates} nonzero "
            f"parameter updates would be lost when added to {fmt.name} weights (measured by casting); the "
            f"|w| >= 2^{fmt.mantissa_bits + 1} |update| rule predicts {_pct(result.rule_lost_fraction)}. "
            f"{WEIGHT_UPDATE_RULE}")
    return WeightUpdateLoss(fmt.name, tuple(rows), text)
