"""Judge a live run's precision cost (``Report.sections["precision_cost"]``) against the gradient's own change.

A local judgement, until the measured-effect judgement of the gradients' batch-to-batch noise
(:mod:`fp16probe.analysis.effect`) takes live data: the median over the rerun steps of the whole model's
relative L2 error against fp32 is set beside the median of the fp32 gradient's own relative change from
one rerun step to the next (another batch, weights a few steps on). An error well below that change is
lost in the noise SGD already averages; one at or above it is not. No loss scale enters either figure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from enum import Enum

from fp16probe.sections import PrecisionCost

__all__ = ["CostJudgement", "PrecisionCostVerdict", "judge_against_fp32_change"]


class CostJudgement(str, Enum):
    """How the precision cost compares with the gradient's change from batch to batch.

    ``BELOW_CHANGE``: the median error is under the median change; ``NOT_BELOW_CHANGE``: it is not;
    ``UNJUDGED``: fewer than two rerun steps (no change measured) or no finite figure.
    """

    BELOW_CHANGE = "below_change"
    NOT_BELOW_CHANGE = "not_below_change"
    UNJUDGED = "unjudged"


@dataclass(frozen=True)
class PrecisionCostVerdict:
    """The judgement and its two figures (medians over ``steps`` rerun steps; None where not measured)."""

    judgement: CostJudgement
    error: float | None
    change: float | None
    steps: int


def judge_against_fp32_change(cost: PrecisionCost) -> PrecisionCostVerdict:
    """Set the median whole-model error beside the median fp32 change between rerun steps."""
    errors = [e for e in cost.whole if e is not None]
    changes = [c for c in cost.fp32_change if c is not None]
    error = statistics.median(errors) if errors else None
    change = statistics.median(changes) if changes else None
    if error is None or change is None:
        return PrecisionCostVerdict(CostJudgement.UNJUDGED, error, change, len(cost.steps))
    kind = CostJudgement.BELOW_CHANGE if error < change else CostJudgement.NOT_BELOW_CHANGE
    return PrecisionCostVerdict(kind, error, change, len(cost.steps))
