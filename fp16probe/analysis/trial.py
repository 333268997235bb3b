"""Whether a low-precision loss curve stays inside fp32's own seed band: the training trial's judgement.

Pure arithmetic on loss curves (lists of floats, one per step, one curve per seed or data order);
the curves come from :mod:`fp16probe.running.trial` or from any run a caller made.

The band: each curve's mean loss over its last ``k`` steps (``k`` a fifth of the steps, at least
one), the fp32 curves' minimum and maximum of those, widened on each side by their spread (max -
min) and at least by :data:`BAND_FLOOR` of their mean. A low-precision run is inside when every one of
its curves' last-``k`` means is finite and at most the band's top: a curve that ends below fp32's
band trained at least as well (the question is whether low precision hurts training). Widening by the spread says: a
low-precision seed may differ from the fp32 seeds by as much as fp32's seeds differ among themselves;
the floor keeps a band whose fp32 seeds happen to agree closely from calling rounding a failure
(2% is a chosen value, not one fitted to the evidence of docs/evidence.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["AGREES_ALARM", "AGREES_FINE", "ALARMS", "ALARM_NOT_FELT", "BAND_FLOOR", "Band", "HURT_UNSEEN", "agreement",
           "judge_curves", "last_mean", "ran_trial", "report_agreement", "window"]

BAND_FLOOR = 0.02  # the band is at least +-2% of fp32's mean last-k loss wide


@dataclass(frozen=True)
class Band:
    """fp32's seed band and where each low-precision curve ended, over the last ``last`` steps."""

    last: int
    low: float
    high: float
    fp32: tuple[float, ...]  # each fp32 curve's last-k mean loss
    target: tuple[float, ...]  # each low-precision curve's (nan when one of its last k losses was not finite)

    @property
    def inside(self) -> bool:
        """Whether every low-precision curve ended finite and no higher than the band's top."""
        return bool(self.target) and math.isfinite(self.high) and all(
            math.isfinite(v) and v <= self.high for v in self.target)

    @property
    def paired_difference(self) -> float:
        """The mean over seeds of the low-precision last-k loss minus fp32's (same seed), nan when one is not finite."""
        pairs = list(zip(self.target, self.fp32))
        return sum(t - f for t, f in pairs) / len(pairs) if pairs else math.nan


def window(steps: int) -> int:
    """How many final steps the band averages: a fifth of them, at least one."""
    return max(1, steps // 5)


def last_mean(curve: Sequence[float], k: int) -> float:
    """The mean of ``curve``'s last ``k`` values; nan when the curve is empty or one of them is not finite."""
    tail = list(curve[-k:])
    if not tail or not all(math.isfinite(v) for v in tail):
        return math.nan
    return sum(tail) / len(tail)


def judge_curves(fp32: Sequence[Sequence[float]], target: Sequence[Sequence[float]]) -> Band:
    """fp32's seed band over its curves and each target curve's last-k mean against it.

    Curves that stopped early (a non-finite loss) count as not finite. The window is set by the
    longest fp32 curve. An fp32 curve that is not finite itself leaves no band (low = high = nan: nothing is inside).
    """
    steps = max((len(c) for c in fp32), default=0)
    k = window(steps)
    ref = tuple(last_mean(c, k) for c in fp32)
    tgt = tuple(last_mean(c, k) if len(c) == steps else math.nan for c in target)
    if not ref or not all(math.isfinite(v) for v in ref):
        return Band(k, math.nan, math.nan, ref, tgt)
    lo, hi = min(ref), max(ref)
    widen = max(hi - lo, BAND_FLOOR * abs(sum(ref) / len(ref)))
    return Band(k, lo - widen, hi + widen, ref, tgt)


# How the trial stands to the verdict (codes; fp16probe.presentation.trial words them).
AGREES_FINE = "agrees_fine"  # no alarm, and training stayed inside fp32's band
AGREES_ALARM = "agrees_alarm"  # an alarm, and training left the band
ALARM_NOT_FELT = "alarm_not_felt"  # an alarm about one step's numbers that training over the trial did not feel
HURT_UNSEEN = "hurt_unseen"  # no alarm, yet training left the band: the verdict missed a harm
ALARMS = ("forward_underflow", "forward_overflow", "gradient_error")  # verdicts that say low precision harms


def agreement(verdict: str, band: Band) -> str:
    """How the trial's band stands to ``verdict``: one of the four codes above."""
    alarm = str(verdict) in ALARMS
    if band.inside:
        return ALARM_NOT_FELT if alarm else AGREES_FINE
    return AGREES_ALARM if alarm else HURT_UNSEEN


def ran_trial(report: Any) -> tuple[Any, Band] | None:
    """A report's training trial (its ``trial`` section) and fp32's band over its stored curves; None when the
    report has none or it did not run."""
    t = report.section("trial")
    if t is None or getattr(t, "off", None) is not None or not getattr(t, "fp32", ()):
        return None
    return t, judge_curves(t.fp32, t.low)


def report_agreement(report: Any) -> str | None:
    """How a report's training trial stands to its verdict: one of the four codes above; None when the report has
    no verdict or no trial that ran (:func:`ran_trial`). Judged again from the stored curves."""
    trial = ran_trial(report)
    rec = report.recommendation
    return None if rec is None or trial is None else agreement(str(rec.verdict), trial[1])
