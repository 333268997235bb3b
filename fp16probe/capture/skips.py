"""The skip ledger: every step whose gradients held inf or NaN (the steps a loss scaler skips).

For each such step: its number, the loss scale in force, and where it was sampled the modules
whose gradients held inf/NaN first. An inf born in one module's gradient flows on through
backward into every gradient computed from it, so the ones met first in backward (nearest the
loss: the recorder's rows in model order, reversed) are where it began; the ledger keeps
:data:`MODULES_KEPT` of them and how many held inf/NaN in all.

Nothing here runs in a hook: the per-row inf/NaN flags are one small device op per gradient
kind at each sampled step's close (``Recorder.close_step``, no sync), and they come to the host
only here, when a report is asked for, and only for the skipped steps. Which steps were skipped
comes from the per-step history (every step, read where GradScaler reads it: the parameters'
gradients at the end of backward); without it, from the sampled steps' histograms.
"""

from __future__ import annotations

from typing import Any, Mapping

from fp16probe.capture.collector import Collected, Collector
from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD
from fp16probe.sections import SkipLedger, SkippedStep

__all__ = ["MODULES_KEPT", "SkipLedgerCollector"]

MODULES_KEPT = 5  # the first modules in backward order a ledger entry names


class SkipLedgerCollector(Collector):
    """The ``skips`` section: one :class:`~fp16probe.sections.SkippedStep` per step that held inf/NaN."""

    key = "skips"

    def __init__(self, probe: Any) -> None:
        self.recorder = probe.recorder

    def collect(self, got: Collected) -> Mapping[str, Any]:
        """The ledger of the report's steps (its window under ``since_step``); none when no step was skipped."""
        skipped = _skipped_steps(got)
        if not skipped:
            return {}
        flags = self.recorder.nonfinite_rows([s for s, _ in skipped])
        entries = []
        for step, scale in skipped:
            by_kind = flags.get(step)
            if by_kind is None:  # not sampled: the history saw it, no histogram did
                entries.append(SkippedStep(step=step, scale=scale, sampled=False))
                continue
            # The modules' output gradients name where it began; without them, the parameters' gradients.
            kind = ACTIVATION_GRAD if by_kind.get(ACTIVATION_GRAD) else WEIGHT_GRAD
            names = by_kind.get(kind, ())
            entries.append(SkippedStep(step=step, scale=scale, sampled=True, kind=kind if names else None,
                                       modules=tuple(names[:MODULES_KEPT]), nonfinite_modules=len(names)))
        source = "history" if got.sections.get("history") is not None else "trace"
        return {"skips": SkipLedger(steps=tuple(entries), source=source)}


def _skipped_steps(got: Collected) -> list[tuple[int, float | None]]:
    """(step, scale in force) of each step whose gradients held inf/NaN: from the history where there is
    one, else from the sampled steps' histograms."""
    history = got.sections.get("history")
    if history is not None:
        return [(step, scale) for step, scale, inf in zip(history.steps, history.scale, history.found_inf) if inf]
    trace = got.trace
    return [(int(step), trace.scale[i] if i < len(trace.scale) else None)
            for i, step in enumerate(trace.steps) if i < len(trace.found_inf) and trace.found_inf[i]]
