"""Log a Probe's statistics to the user's tracker every N optimizer steps, while training runs.

    from fp16probe import Probe
    from fp16probe.integrations.live import LiveLogger
    from torch.utils.tensorboard import SummaryWriter

    probe = Probe(model, scaler=scaler).start()
    live = LiveLogger(probe, SummaryWriter("runs/exp"), log_every=50)
    for batch in data:
        ...
        scaler.step(optimizer); scaler.update()
        probe.step()
        live.step()          # every 50th call: one report() (a host sync), then the tracker
    live.close()             # sends the steps not sent yet

The hooks stay free of host synchronisation: statistics come to the host only at the
logging interval, through :meth:`fp16probe.Probe.report`. Under torch.distributed every
rank must call :meth:`LiveLogger.step` (the ranks' statistics are merged, a collective)
and the main rank logs. The callbacks take ``log_every=N`` and find the tracker
themselves: Lightning's ``trainer.loggers``, the Hugging Face Trainer's ``report_to``.
"""

from __future__ import annotations

import os
from typing import Any

from fp16probe.errors import InputError, ProbeError
from fp16probe.presentation.trackers import TrackerLog, sink_for

__all__ = ["LiveLogger", "hf_trackers", "lightning_trackers"]


class LiveLogger:
    """Send a Probe's new steps to one or more trackers every ``log_every`` calls of :meth:`step`.

    Args:
        probe: a started :class:`fp16probe.Probe`.
        trackers: a SummaryWriter, a wandb Run, ``(MlflowClient, run_id)``, a Lightning logger,
            or a list of them (see :func:`fp16probe.presentation.trackers.sink_for`).
        log_every: how many optimizer steps between two logs.
        step_offset: added to the Probe's step numbers (0-based) so they match the trainer's
            global step; the callbacks pass ``global_step + 1`` at the start of training.
        is_main: whether this process logs (ranks other than the main one only merge).
        artifacts: at :meth:`close`, attach the final report, its figures and an HTML report
            to MLflow runs (the other trackers have histograms and need no files).
        extra: what the callbacks record of the run (the framework's settings): the reports' ``workload``.
        **options: ``format``, ``kind``, ``modules``, ``axis``, ``recommend`` as for
            :class:`fp16probe.presentation.trackers.TrackerLog`. ``recommend=False`` skips
            the analysis each interval (no ``..._at_recommended_scale``).
    """

    def __init__(self, probe: Any, trackers: Any, *, log_every: int = 50, step_offset: int = 0,
                 is_main: bool = True, artifacts: bool = True, extra: dict[str, Any] | None = None,
                 **options: Any) -> None:
        if isinstance(log_every, bool) or int(log_every) != log_every or log_every < 1:
            raise ProbeError(f"log_every must be a positive number of steps, got {log_every!r}")
        self.probe = probe
        self.artifacts = artifacts
        self.extra = extra
        self.log_every = int(log_every)
        self.is_main = is_main
        targets = list(trackers) if isinstance(trackers, (list, tuple)) and not _is_mlflow_pair(trackers) else [trackers]
        self.targets = targets if is_main else []
        self.logs = [TrackerLog(t, step_offset=step_offset, **options) for t in self.targets]
        self.calls = 0
        self.reports = 0
        self._next_step: int | None = None  # the first step the next flush sends (None: from the start)

    def step(self) -> bool:
        """Count one optimizer step (call it after ``probe.step()``); log at every ``log_every``-th. Returns whether it logged."""
        self.calls += 1
        if self.calls % self.log_every:
            return False
        self.flush()
        return True

    def flush(self) -> Any:
        """Bring the steps not sent yet to the host now (a sync) and send them; return that report (None off the main rank).

        The report's trace and history hold only the steps since the last flush; its module
        histograms (and so the verdict) cover the whole run so far.
        """
        from fp16probe.capture import distributed

        # Only the steps since the last flush come over (module totals stay whole), so an
        # interval costs the same at step 100 as at step 100,000. Every rank calls it (the
        # same window on each); None off the main rank.
        since = self._next_step
        recorder = getattr(self.probe, "recorder", None)
        if recorder is not None:
            self._next_step = recorder.step_index
            report = distributed.gather_report(self.probe.report(extra=self.extra, since_step=since))
        else:
            report = distributed.gather_report(self.probe, extra=self.extra)
        self.reports += 1
        if report is None or not self.is_main:
            return None
        for log in self.logs:
            log.log(report)
        return report

    def close(self) -> None:
        """Send what is left, attach the final report's files to MLflow runs, flush the trackers.

        Writers and runs the caller made stay open.
        """
        try:
            from fp16probe.capture import distributed

            # The whole run, once (the files hold all of it); the trackers get the steps not sent yet.
            report = distributed.gather_report(self.probe, extra=self.extra)
            self.reports += 1
            if report is not None and self.is_main:
                for log in self.logs:
                    log.log(report)
            if report is not None and self.artifacts:
                for log in self.logs:
                    log.finish(report)
        finally:
            for log in self.logs:
                log.close()
            for target in self.targets:  # writers fp16probe made itself (hf_trackers' TensorBoard)
                if getattr(target, "_fp16probe_owned", False):
                    target.close()


def _is_mlflow_pair(obj: Any) -> bool:
    return isinstance(obj, tuple) and len(obj) == 2 and hasattr(obj[0], "log_batch")


def lightning_trackers(trainer: Any) -> list[Any]:
    """The loggers of a Lightning Trainer that fp16probe can write to (TensorBoard, wandb, MLflow)."""
    found, skipped = [], []
    for logger in getattr(trainer, "loggers", None) or []:
        try:
            sink_for(logger)
        except InputError:
            skipped.append(type(logger).__name__)
            continue
        found.append(logger)
    if not found:
        raise InputError(
            "log_every needs a TensorBoardLogger, WandbLogger or MLFlowLogger on the Trainer "
            f"(it has {', '.join(skipped) or 'no logger'}); add one, e.g. Trainer(logger=TensorBoardLogger('runs'))"
        )
    return found


def hf_trackers(args: Any) -> list[Any]:
    """The trackers a Hugging Face Trainer reports to (``args.report_to``) that fp16probe can write to.

    TensorBoard gets a writer of its own, in ``$TENSORBOARD_LOGGING_DIR`` when set (where the
    Trainer's TensorBoardCallback writes too), else ``args.logging_dir`` where the
    TrainingArguments have one (transformers 4), else ``<output_dir>/runs/fp16probe``, beside
    the Trainer's own ``<output_dir>/runs/<date>`` run; wandb gets its active run, MLflow its
    active run.
    """
    report_to = getattr(args, "report_to", None) or []
    if isinstance(report_to, str):
        report_to = [report_to]
    report_to = [r for r in report_to if r != "none"]
    found: list[Any] = []
    for name in report_to:
        if name == "tensorboard":
            from fp16probe.presentation.trackers import tensorboard_writer

            folder = (os.environ.get("TENSORBOARD_LOGGING_DIR") or getattr(args, "logging_dir", None)
                      or os.path.join(args.output_dir, "runs", "fp16probe"))
            found.append(tensorboard_writer(os.path.expanduser(folder)))
        elif name == "wandb":
            from fp16probe.presentation.trackers import active_wandb_run

            run = active_wandb_run()
            if run is not None:
                found.append(run)
        elif name == "mlflow":
            from fp16probe.presentation.trackers import active_mlflow_run

            pair = active_mlflow_run()
            if pair is not None:
                found.append(pair)
    if not found:
        raise InputError(
            f"log_every needs TrainingArguments(report_to=...) to name tensorboard, wandb or mlflow "
            f"(it names {', '.join(report_to) or 'none'}); or pass trackers=[...] to the callback"
        )
    return found
