"""One answer for a live run: the loss-scale verdict and ``fp16probe schedule`` reconciled.

The two judge different things. The verdict (from the fp32 shadow reruns) is about underflow
at the scale in force; the schedule replays loss-scale rules over the run's own recorded
steps and counts skipped steps and steps that flushed too much. Where the schedule's choice
moves the scale differently from the verdict's GradScaler, both say so in one line, and
both name the verdict's GradScaler as the one to paste: it is the one judged against fp32
gradients, and the schedule's table stays there for tuning how the scale moves.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fp16probe.analysis.schedule import ScheduleTable
from fp16probe.recommendation import GRADSCALER_DEFAULTS, Recommendation, Verdict

__all__ = ["MOVES", "reconcile", "schedule_choice", "schedule_note", "with_verdict_note"]

MOVES = ("growth_factor", "backoff_factor", "growth_interval")  # what the schedule decides


def schedule_choice(table: ScheduleTable) -> tuple[str, dict[str, Any]]:
    """The row the schedule advises (GradScaler's defaults when they are already fine) and its rule."""
    row = table.rows[0] if table.defaults_fine else table.row(table.best)
    return row.name, dict(row.rule)


def reconcile(rec: Recommendation, table: ScheduleTable) -> dict[str, Any] | None:
    """How the schedule's choice differs from the verdict's GradScaler, and what to paste; None when they agree.

    Only a verdict that advises a GradScaler is compared; a schedule whose choice is a
    hysteresis rule (DeepSpeed's, Megatron's) always differs from a GradScaler.
    """
    if rec.verdict not in (Verdict.CONSTANT, Verdict.DYNAMIC) or not rec.grad_scaler_kwargs:
        return None
    name, rule = schedule_choice(table)
    defaults: dict[str, Any] = dict(GRADSCALER_DEFAULTS)
    mine = {k: rec.grad_scaler_kwargs.get(k, defaults[k]) for k in MOVES}
    hysteresis = int(rule.get("hysteresis", 1)) != 1 or bool(rule.get("consecutive_hysteresis"))
    theirs = {k: rule[k] for k in MOVES if k in rule}
    if not hysteresis and all(float(mine[k]) == float(theirs.get(k, mine[k])) for k in MOVES):
        return None
    paste = dict(rec.grad_scaler_kwargs)
    return {"schedule_choice": name, "defaults_fine": table.defaults_fine, "history_steps": table.steps,
            "schedule_moves": theirs, "paste": paste, "hysteresis_rule": hysteresis}


def schedule_note(rec: Recommendation) -> str:
    """The line ``fp16probe schedule`` adds for a live run: the verdict's GradScaler, and whether its moves differ."""
    if not rec.grad_scaler_kwargs:
        return (f"The loss-scale verdict for this run (fp16probe analyze) is {rec.verdict.value}: it advises no "
                "GradScaler; this table judges only how a scale would have moved over the recorded steps.")
    paste = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.grad_scaler_kwargs.items())
    if rec.evidence.get("one_answer") is None:
        return (f"The loss-scale verdict (fp16probe analyze) pastes GradScaler({paste}), which moves the scale as "
                "this table advises: paste that one.")
    return (f"The loss-scale verdict (fp16probe analyze) pastes GradScaler({paste}), which this table's choice "
            "moves differently: the verdict judges underflow at the scale in force against fp32 reruns, this table "
            "skipped steps over the run's history. Paste the verdict's; use this table to tune how the scale moves.")


def with_verdict_note(table: ScheduleTable, rec: Recommendation) -> ScheduleTable:
    """``table`` with :func:`schedule_note` for ``rec``, the live run's verdict, added to its notes."""
    return replace(table, notes=(*table.notes, schedule_note(rec)))
