"""Callbacks that attach a Probe to the training loops people already run.

The frameworks are optional extras, imported only when a callback module is imported:
``fp16probe.integrations.huggingface`` (``pip install fp16probe[hf]``) and
``fp16probe.integrations.lightning`` (``pip install fp16probe[lightning]``).
"""

from __future__ import annotations

import warnings

from pathlib import Path
from typing import Any

from fp16probe.errors import require

__all__ = ["REPORT_NAME", "RECOMMENDATION_NAME", "ProbeCallback", "finish", "require", "write_outputs"]

REPORT_NAME = "fp16probe-report.json"  # the command line's default too
RECOMMENDATION_NAME = "fp16probe-recommendation.txt"


def write_outputs(report: Any, folder: str | Path) -> Any:
    """Write ``report`` (REPORT_NAME) and its answer (RECOMMENDATION_NAME: the short answer with its
    findings and caveats, then the reasoning, as ``fp16probe show`` words them) into ``folder``.

    Returns the report as written.
    """
    from fp16probe.presentation.answer import answer_text
    from fp16probe.report import atomic_write_text

    folder = Path(folder)
    report.save(folder / REPORT_NAME)
    rec = report.recommendation
    atomic_write_text(folder / RECOMMENDATION_NAME, "\n" if rec is None else answer_text(report, rec))
    return report


def finish(probe: Any, *, trainer: str, global_step: int, is_main: bool, folder: str | Path,
           format: str = "fp16", extra: dict[str, Any] | None = None) -> Any:
    """Stop ``probe``, merge every rank's statistics, analyse and write them on the main process.

    The same last step as :func:`fp16probe.profile` (``running.profile.conclude``). Every rank
    must call it (the merge is a collective). Returns the report as written on the main
    process, None elsewhere.
    """
    from fp16probe.running.profile import conclude

    probe.stop()
    meta = {"trainer": trainer, "global_step": int(global_step), **(extra or {})}
    report = conclude(probe, extra=meta, format=format)
    if report is None or not is_main:
        return None
    return write_outputs(report, folder)


class ProbeCallback:
    """What both training-framework callbacks keep and do: the Probe, its live logger, the report."""

    def __init__(self, every: int, format: str, log_every: int | None, log_modules: bool, trackers: Any,
                 probe_options: dict[str, Any]) -> None:
        self.every, self.format, self.probe_options = every, format, probe_options
        self.probe: Any = None
        self.report: Any = None  # on the main process, once training ends: the report as written
        self.log_every, self.log_modules, self.trackers = log_every, log_modules, trackers
        self.live: Any = None
        self.extra: dict[str, Any] = {}  # what the report records of the run (the framework's settings)
        self.guard: Any = None  # under torch.distributed: the ranks' guard (fp16probe.integrations.guard)
        self.steps = 0  # optimizer steps this rank finished
        self.folder: Path | None = None  # where the main process writes
        self.trainer_name = ""

    def _start(self, model: Any, scaler: Any, *, main: bool, step_offset: int, trackers: Any,
               folder: str | Path, trainer: str, accumulation: Any = None) -> None:
        """Start the Probe; with ``log_every``, its live logger (``trackers(live)``: the framework's own,
        from :mod:`fp16probe.integrations.live`, imported only then). Under torch.distributed every
        rank first joins the ranks' guard (a collective, which refuses models that differ).

        ``accumulation``: the framework's gradient accumulation, as the Probe's ``accumulation`` and
        ``loss_divisor`` (what the reruns replay); options the caller gave the callback win."""
        from fp16probe.capture.probe import Probe
        from fp16probe.integrations.guard import rank_guard

        self.folder, self.trainer_name, self.steps = Path(folder), trainer, 0
        self.guard = rank_guard(model)
        options = {**(accumulation or {}), **self.probe_options}
        self.probe = Probe(model, every=self.every, scaler=scaler, **options).start()
        if self.log_every:
            from fp16probe.integrations import live

            self.live = live.LiveLogger(self.probe, (self.trackers or trackers(live)) if main else [],
                                        log_every=self.log_every, step_offset=step_offset, is_main=main,
                                        format=self.format, modules=self.log_modules, extra=self.extra)

    def _step(self) -> None:
        """Close the Probe's step (one per optimizer step) and log when it is time."""
        if self.probe is not None:
            self.probe.step()
            self.steps += 1
            if self.live is not None:
                self.live.step()

    def _before_backward(self) -> None:
        """Under torch.distributed: agree that every rank got here; raise the failing rank's error if one did not."""
        if self.guard is not None and self.probe is not None:
            self.guard.check(self.steps, self._settle)

    def _failed(self, error: BaseException) -> None:
        """This rank's training raised: under torch.distributed, stop every rank with it (rank 0 writes).

        The failure the ranks settled on is added to ``error`` as a note (Python 3.11+).
        """
        if self.guard is None or self.probe is None:
            return
        settled = self.guard.failed(self.steps, error, self._settle)
        if settled is not None and hasattr(error, "add_note"):
            # The framework raises its own error (a collective's timeout, say); the note names the failing rank.
            error.add_note(f"fp16probe: {settled}")

    def _stop_after_failure(self, error: BaseException) -> None:
        """Training raised on this rank: settle the ranks (:meth:`_failed`), then stop probing; never masks the
        run's own failure with a bookkeeping one, and makes no final flush (a collective, and the run is failing)."""
        try:
            self._failed(error)
        except Exception as e:
            warnings.warn(f"fp16probe could not settle the ranks after the failure: {e}", stacklevel=3)
        if self.guard is not None:
            self.guard.close()
        self.live = None
        if self.probe is not None:
            self.probe.stop()
            self.probe = None

    def _finish_ranks(self) -> None:
        """At the end of training: agree that every rank finished; raise the failing rank's error if one did not."""
        if self.guard is not None:
            self.guard.check(self.steps, self._settle)
            self.guard.close()

    def _settle(self, error: BaseException | None, statuses: tuple[int, ...], finished: tuple[int, ...]) -> Any:
        """A rank stopped: stop the Probe, and make and write the report of the steps every rank finished."""
        from fp16probe.running.profile import conclude

        self.live = None  # no final flush: it is a collective on the default group, which may be broken
        probe, self.probe = self.probe, None
        probe.discard_step()  # a step some rank did not finish is no step every rank finished
        probe.stop()
        self.guard.close()
        meta = {"trainer": self.trainer_name, "global_step": self.steps, **self.extra}

        def report(extra: dict[str, Any], group: Any) -> Any:
            notes = [*meta.get("notes", ()), *extra.pop("notes", ())]
            return conclude(probe, partial=True, extra={**meta, **extra, **({"notes": notes} if notes else {})},
                            format=self.format, group=group)

        def write(made: Any) -> Path:
            self.report = write_outputs(made, self.folder or Path("."))
            return (self.folder or Path(".")) / REPORT_NAME

        return self.guard.settle(error, statuses, finished, done=self.steps, report=report, write=write)

    def _stop(self) -> Any:
        """Close the live logger (its last flush) and hand over the Probe, or None if none ran."""
        live, self.live = self.live, None
        if live is not None:
            live.close()
        probe, self.probe = self.probe, None
        return probe
