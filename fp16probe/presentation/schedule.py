"""``fp16probe schedule``'s words: the rules' names, the plain-words answer, the notes and the JSON form.

:mod:`fp16probe.analysis.schedule` returns the replayed rows, the best rule, whether
GradScaler's defaults are fine, where the flushed shares come from (a code) and coded notes;
this module words them once for the terminal and the JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fp16probe.analysis.one_answer import schedule_choice
from fp16probe.analysis.schedule import DEFAULTS, OWN, ScheduleNote, ScheduleRow, ScheduleTable
from fp16probe.formatting import count, percent
from fp16probe.presentation.paste import FRAMEWORKS, form_notes, framework_settings
from fp16probe.presentation.verdict import study_words

__all__ = ["RULE_LABELS", "framework_snippets", "framework_sources", "note_text", "rule_label", "schedule_answer", "schedule_dict"]

RULE_LABELS = {DEFAULTS: "GradScaler defaults", OWN: "this run's settings"}
REFERENCES = {"shadow": "the fp32 shadow reruns", "fp32_run": "the run's own fp32 steps"}


def rule_label(name: str) -> str:
    """Return a rule's name as shown: the two fixed rules' labels; any other name (the grid's, a caller's) as is."""
    return RULE_LABELS.get(name, name)


def _reference(code: str | None) -> str | None:
    """Where the flushed shares come from, in words (a stored phrase is shown as stored)."""
    return None if code is None else REFERENCES.get(code, code)


def _row_words(r: ScheduleRow, n: int, tau: float) -> str:
    s = f"skipped {count(r.skipped_steps)} step(s)"
    if r.steps_over_threshold is None:
        return s
    if r.steps_over_threshold == 0:
        return s + f" and never flushed more than {percent(tau)}"
    return s + (f" and spent {percent(r.steps_over_threshold / n)} of steps flushing more than {percent(tau)} "
                f"(worst {percent(r.worst_flushed_fraction)})")


def schedule_answer(table: ScheduleTable) -> str:
    """Return the plain-words answer: the run's own rule, GradScaler's defaults, the best rule, and the limits."""
    n, tau = table.steps, table.max_flushed_fraction
    own = next((r for r in table.rows if r.name == OWN), None)
    parts = [f"Over this run's {count(n)} recorded steps,"]
    if own is not None:
        parts.append(f"its own settings (growth_interval={own.rule['growth_interval']}) {_row_words(own, n, tau)};")
    parts.append(f"GradScaler's defaults would have {_row_words(table.rows[0], n, tau)}.")
    if table.defaults_fine:
        parts.append("The defaults are already fine for this run: no candidate flushes less without skipping more.")
    else:
        parts.append(f"{rule_label(table.best)} would have {_row_words(table.row(table.best), n, tau)}.")
    reference = _reference(table.flush_reference)
    if reference is None:
        parts.append("Flushed shares need an fp32 reference (a shadow rerun, or an fp32 run); this report has none, "
                     "so only skipped steps are compared.")
    else:
        parts.append(f"Flushed shares come from {reference}, moved with each step's largest gradient.")
    parts.append("This is the run's past, not its future: gradients drift as training goes on, so profile again at "
                 "later checkpoints.")
    return " ".join(parts)


def _not_reproduced(d: Mapping[str, Any]) -> str:
    return ("The run's own settings replayed from its first scale do not reproduce its scales at steps "
            f"{', '.join(map(str, d['steps']))}: the Probe may have started after the scaler's first "
            "step (its growth tracker was not 0), or the scaler was changed during the run.")


def _verdict(d: Mapping[str, Any]) -> str:
    kwargs = d["grad_scaler_kwargs"]
    if not kwargs:
        return (f"The loss-scale verdict for this run (fp16probe analyze) is {d['verdict']}: it advises no "
                "GradScaler; this table judges only how a scale would have moved over the recorded steps.")
    paste = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in kwargs.items())
    if not d["differs"]:
        return (f"The loss-scale verdict (fp16probe analyze) pastes GradScaler({paste}), which moves the scale as "
                "this table advises: paste that one.")
    return (f"The loss-scale verdict (fp16probe analyze) pastes GradScaler({paste}), which this table's choice "
            "moves differently: the verdict judges underflow at the scale in force against fp32 reruns, this table "
            "skipped steps over the run's history. Paste the verdict's; use this table to tune how the scale moves.")


def _study(d: Mapping[str, Any]) -> str:
    return study_words({"interval_study": d}).strip()


_NOTES: dict[str, Callable[[Mapping[str, Any]], str]] = {"not_reproduced": _not_reproduced, "verdict": _verdict,
                                                         "interval_study": _study}


def note_text(note: ScheduleNote) -> str:
    """Return one of the table's notes in words."""
    return _NOTES[note.code](note.data)


FRAMEWORK_FORMS = {"torch": "torch.amp.GradScaler", "verl": "verl (FSDP ShardedGradScaler)",
                   "deepspeed": 'DeepSpeed config "fp16" block', "megatron": "Megatron-LM flags"}
_CANNOT = {
    "torch": "GradScaler has no hysteresis and no floor on the scale",
    "verl": "ShardedGradScaler has GradScaler's arguments only: no hysteresis, no floor on the scale",
    "deepspeed": "DeepSpeed's config grows x2 and backs off /2 only, from a power-of-two initial scale "
                 "(initial_scale_power)",
    "megatron": "Megatron's dynamic scaler grows x2 and backs off /2 only",
}


def framework_sources() -> list[str]:
    """Where the frameworks' shipped rules in the table come from, one cited line each."""
    from fp16probe.presentation.cite import cite
    from fp16probe.sources import FRAMEWORK_SOURCES, FP16_RL

    return [cite(c) for c in (*FRAMEWORK_SOURCES.values(), FP16_RL)]


def framework_snippets(table: ScheduleTable, device: str = "cuda", width: int | None = None) -> dict[str, Any]:
    """The advised rule (the best one, or GradScaler's defaults where they are already fine:
    :func:`fp16probe.analysis.one_answer.schedule_choice`) in each framework's own form, or why that
    form cannot express it.

    Returns ``{"rule": label, "settings": {framework: text or None}, "cannot": {framework: reason},
    "notes": {framework: [what its form does differently]}}`` over
    :data:`fp16probe.presentation.paste.FRAMEWORKS`; every text comes from paste.py's checked builders.
    """
    name, rule = schedule_choice(table)
    settings = {fw: framework_settings(rule, fw, device, width) for fw in FRAMEWORKS}
    notes = {fw: form_notes(rule, fw) for fw, text in settings.items() if text is not None}
    return {"rule": rule_label(name), "settings": settings,
            "cannot": {fw: _CANNOT[fw] for fw, text in settings.items() if text is None},
            "notes": {fw: n for fw, n in notes.items() if n}}


def schedule_dict(table: ScheduleTable) -> dict[str, Any]:
    """Return the table as the JSON ``fp16probe schedule --json`` prints: rule labels, the answer and notes worded."""
    rows = []
    for r in table.rows:
        d = r.to_dict()
        d["name"] = rule_label(r.name)
        rows.append(d)
    return {
        "rows": rows, "steps": table.steps, "first_step": table.first_step,
        "format": table.format, "max_flushed_fraction": table.max_flushed_fraction,
        "reproduced": table.reproduced, "mismatched_steps": list(table.mismatched_steps),
        "flush_reference": _reference(table.flush_reference), "answer": schedule_answer(table),
        "best": rule_label(table.best), "defaults_fine": table.defaults_fine,
        "notes": [note_text(n) for n in table.notes],
        "frameworks": framework_snippets(table), "framework_sources": framework_sources(),
    }
