"""Judge a live run's precision cost (``Report.sections["precision_cost"]``) as the profile judges its emulated step.

The median over the rerun steps of the whole model's relative L2 error against fp32 is the error; the
gradients' own batch-to-batch noise is read from the median of the fp32 gradient's relative change from one
rerun step to the next (another batch, weights a few steps on). That change is the difference of two
draws, about sqrt(2) times one draw's spread, so the noise is the change / sqrt(2). The error is felt by
training, as in :mod:`fp16probe.analysis.effect`, only when it is above both ``TOLERANCE`` and
``NOISE_SHARE`` times that noise. No loss scale enters either figure.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from enum import Enum

from fp16probe.analysis.effect import NOISE_SHARE, TOLERANCE
from fp16probe.sections import PrecisionCost

__all__ = ["CostJudgement", "PrecisionCostVerdict", "judge_against_fp32_change"]


class CostJudgement(str, Enum):
    """What the precision cost means for training, by the profile's rule.

    ``WITHIN_TOLERANCE``: the median error is at most ``TOLERANCE``; ``WITHIN_NOISE``: above it, but at most
    ``NOISE_SHARE`` of the gradients' noise; ``FELT``: above both; ``UNJUDGED``: no finite error measured, or an
    error above ``TOLERANCE`` with fewer than two rerun steps (no noise measured).
    """

    WITHIN_TOLERANCE = "within_tolerance"
    WITHIN_NOISE = "within_noise"
    FELT = "felt"
    UNJUDGED = "unjudged"


@dataclass(frozen=True)
class PrecisionCostVerdict:
    """The judgement and its figures (medians over ``steps`` rerun steps; None where not measured):
    ``error``, the fp32 ``change`` between rerun steps, and the ``noise`` it gives (change / sqrt(2))."""

    judgement: CostJudgement
    error: float | None
    change: float | None
    steps: int
    noise: float | None = None


def judge_against_fp32_change(cost: PrecisionCost) -> PrecisionCostVerdict:
    """Judge the median whole-model error by TOLERANCE and by NOISE_SHARE of the noise between rerun steps."""
    errors = [e for e in cost.whole if e is not None]
    changes = [c for c in cost.fp32_change if c is not None]
    error = statistics.median(errors) if errors else None
    change = statistics.median(changes) if changes else None
    noise = None if change is None else change / math.sqrt(2)
    steps = len(cost.steps)
    if error is None:
        return PrecisionCostVerdict(CostJudgement.UNJUDGED, error, change, steps, noise)
    if error <= TOLERANCE:
        return PrecisionCostVerdict(CostJudgement.WITHIN_TOLERANCE, error, change, steps, noise)
    if noise is None:
        return PrecisionCostVerdict(CostJudgement.UNJUDGED, error, change, steps, noise)
    kind = CostJudgement.WITHIN_NOISE if error <= NOISE_SHARE * noise else CostJudgement.FELT
    return PrecisionCostVerdict(kind, error, change, steps, noise)
