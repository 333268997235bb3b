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

from fp16probe.analysis.schedule import ScheduleNote, ScheduleTable
from fp16probe.recommendation import GRADSCALER_DEFAULTS, Recommendation, Verdict

__all__ = ["MOVES", "reconcile", "schedule_choice", "verdict_note", "with_verdict_note"]

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


def verdict_note(rec: Recommendation) -> ScheduleNote:
    """The note ``fp16probe schedule`` adds for a live run: the verdict's GradScaler, and whether its moves differ.

    :func:`fp16probe.presentation.schedule.note_text` words it.
    """
    return ScheduleNote("verdict", {"verdict": rec.verdict.value, "grad_scaler_kwargs": dict(rec.grad_scaler_kwargs or {}),
                                    "differs": rec.evidence.get("one_answer") is not None})


def with_verdict_note(table: ScheduleTable, rec: Recommendation) -> ScheduleTable:
    """``table`` with :func:`verdict_note` for ``rec``, the live run's verdict, added to its notes."""
    return replace(table, notes=(*table.notes, verdict_note(rec)))
