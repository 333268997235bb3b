"""The overflow ceiling: per profiled step, the largest gradient the loss scale multiplies.

One ceiling serves the recommendation, the what-if table and the replay, so that the
what-if table's first overflowing scale is the recommendation's limit.

Per step it is the largest of: the trace's backward-wide ``StepTrace.ceiling`` when the
report has one (every gradient in backward, functional ops and the loss side included),
and the largest finite value of the captured activation and weight gradients. Without
``StepTrace.ceiling`` only hooked modules and parameters are seen, and the ceiling says so.

A step that held inf/NaN is read by where it was recorded:

* *scale-induced*: the run computed in fp16/bf16, or a loss scaler was in force. The
  step overflowed at the scale ``s`` in force (1 without a scaler), so its largest
  unscaled gradient was at least ``threshold / s`` of the run's format: it overflows at
  S >= s (for the run's format), not at every S.
* *intrinsic*: an fp32 run without a scaler. No loss scale explains or fixes it; the
  step is counted apart and left out of the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from fp16probe.columns import HistogramColumn
from fp16probe.formats import Format, get_format
from fp16probe.histogram import Histogram
from fp16probe.report import GRAD_KINDS, Report, StepTrace

__all__ = ["GRAD_KINDS", "Ceiling", "StepCeiling", "largest_safe_log2_scale", "run_format"]

# fp32's largest power of two: a GradScaler scale lives in an fp32 tensor.
FP32_LOG2_MAX = 127


def largest_safe_log2_scale(fmt: str | Format, max_abs: float) -> int | None:
    """Return the largest k with ``max_abs * 2^k`` still below the format's overflow threshold."""
    fmt = fmt if isinstance(fmt, Format) else get_format(fmt)
    if not max_abs > 0.0 or not math.isfinite(max_abs):
        return None
    k = math.floor(math.log2(fmt.overflow_threshold) - math.log2(max_abs))
    while fmt.overflows(math.ldexp(max_abs, k)):
        k -= 1
    while not fmt.overflows(math.ldexp(max_abs, k + 1)):
        k += 1
    return k


def run_format(precision: str) -> Format | None:
    """Return the format a run computed its gradients in (None for fp32), from Metadata.precision."""
    p = str(precision).lower()
    if p.startswith("fp16") or p.startswith("float16"):
        return get_format("fp16")
    if p.startswith("bf16") or p.startswith("bfloat16"):
        return get_format("bf16")
    return None


@dataclass(frozen=True, slots=True)  # one per profiled step: 10^6 in a long run
class StepCeiling:
    """One step: its largest finite |g| and what its inf/NaN values (if any) say.

    ``overflow_bound`` (scale-induced steps) is ``threshold / s``: the step's largest
    unscaled gradient was at least this. ``intrinsic`` marks inf/NaN that no scale explains.
    """

    max_abs: float
    overflow_bound: float | None = None
    intrinsic: bool = False

    @property
    def effective_max(self) -> float:
        """Return the largest |g| this step is known to reach (finite max or overflow bound)."""
        return max(self.max_abs, self.overflow_bound or 0.0)

    def overflows(self, fmt: Format, log2_scale: int) -> bool:
        """Return whether the step overflows ``fmt`` at S = 2^log2_scale (intrinsic steps: always)."""
        if self.intrinsic:
            return True
        m = self.effective_max
        return m > 0.0 and fmt.overflows(math.ldexp(m, log2_scale))


@dataclass(frozen=True)
class Ceiling:
    """The overflow ceiling of a profile, step by step, and where it was read from."""

    steps: tuple[StepCeiling, ...]
    measured: bool  # True when the trace's backward-wide ceiling was part of it
    run_format: str | None = None
    scale_in_force: tuple[float | None, ...] = ()

    @classmethod
    def of(cls, report: Report) -> "Ceiling":
        """Build the ceiling of ``report`` from its trace, its histograms and its precision."""
        if len(report.trace) == 0:
            run_fmt = run_format(report.metadata.precision)
            hist = Histogram.sum(report.histogram(k) for k in GRAD_KINDS)
            step = _step(hist.max_abs, bool(hist.nonfinite), None, run_fmt)
            return cls((step,), measured=False,
                       run_format=None if run_fmt is None else run_fmt.name)
        # Module histograms hold every captured value: a kind the trace has no per-step
        # histograms of still bounds every step's ceiling through them.
        missing = [k for k in GRAD_KINDS if not report.trace.histograms.get(k) and report.histogram(k).total]
        floor = max((report.histogram(k).max_abs for k in missing), default=0.0)
        return cls.from_trace(report.trace, report.metadata.precision, floor=floor)

    @classmethod
    def from_trace(cls, trace: StepTrace, precision: str = "fp32", *, floor: float = 0.0) -> "Ceiling":
        """Build the ceiling from a trace alone; ``floor`` is a known lower bound on every step's max."""
        run_fmt = run_format(precision)
        kinds = [k for k in GRAD_KINDS if trace.histograms.get(k)]
        recorded = trace.ceiling
        steps = []
        # A packed trace's per-step max_abs and inf/NaN as arrays: no Histogram built per step to read two fields.
        tops = [(hs.max_abs.tolist(), hs.nonfinite.tolist()) if isinstance(hs, HistogramColumn)
                else ([h.max_abs for h in hs], [h.nonfinite for h in hs]) for hs in (trace.histograms[k] for k in kinds)]
        for i in range(len(trace)):
            finite = max([floor] + [top[0][i] for top in tops])
            nonfinite = any(top[1][i] for top in tops)
            if recorded is not None:
                c = float(recorded[i])
                if math.isfinite(c):
                    finite = max(finite, c)
                else:
                    nonfinite = True
            if i < len(trace.found_inf) and trace.found_inf[i]:
                nonfinite = True
            scale = trace.scale[i] if i < len(trace.scale) else None
            steps.append(_step(finite, nonfinite, scale, run_fmt))
        return cls(tuple(steps), measured=recorded is not None,
                   run_format=None if run_fmt is None else run_fmt.name,
                   scale_in_force=tuple(trace.scale))

    # -- accessors ---------------------------------------------------------------------
    @property
    def max_abs(self) -> float:
        """Return the largest |g| known over all non-intrinsic steps (0.0 when none)."""
        return max((s.effective_max for s in self.steps if not s.intrinsic), default=0.0)

    @property
    def intrinsic_steps(self) -> int:
        """Return the number of steps whose inf/NaN no loss scale explains."""
        return sum(s.intrinsic for s in self.steps)

    @property
    def scale_induced_steps(self) -> tuple[int, ...]:
        """Return the indices of steps that overflowed at the scale in force."""
        return tuple(i for i, s in enumerate(self.steps) if s.overflow_bound is not None)

    def overflow_steps(self, fmt: Format, log2_scale: int) -> int:
        """Return how many steps overflow at S = 2^log2_scale, intrinsic inf/NaN steps left out."""
        return sum(1 for s in self.steps if not s.intrinsic and s.overflows(fmt, log2_scale))

    def largest_safe_log2_scale(self, fmt: Format) -> int | None:
        """Return the largest k at which no step overflows (None when no step bounds it)."""
        m = self.max_abs
        return largest_safe_log2_scale(fmt, m) if m > 0.0 else None

    def per_step_max(self) -> list[float]:
        """Return each step's effective max (intrinsic steps as 0.0)."""
        return [0.0 if s.intrinsic else s.effective_max for s in self.steps]


def _step(finite: float, nonfinite: bool, scale: float | None, run_fmt: Format | None) -> StepCeiling:
    if not nonfinite:
        return StepCeiling(finite)
    if scale is None and run_fmt is None:
        return StepCeiling(finite, intrinsic=True)
    threshold = run_fmt.overflow_threshold if run_fmt is not None else math.ldexp(1.0, FP32_LOG2_MAX + 1)
    s = 1.0 if scale is None or not scale > 0 else float(scale)
    return StepCeiling(finite, overflow_bound=threshold / s)


def fp32_log2_cap(max_abs: float, margin_bits: int) -> int:
    """Return the largest k for which GradScaler accepts 2^k and 2^k * max(1, max|g|) stays finite in fp32."""
    top = math.ceil(math.log2(max_abs)) if max_abs > 1.0 else 0
    return FP32_LOG2_MAX - margin_bits - top


def flushed_hidden_bound(hists: Sequence[Histogram]) -> float:
    """Return the share of exact zeros among finite values: an upper bound on what an fp16 run hid."""
    zero = sum(h.zero for h in hists)
    finite = sum(h.zero + h.nonzero_finite for h in hists)
    return zero / finite if finite else 0.0
