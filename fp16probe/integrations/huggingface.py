"""A Hugging Face ``transformers.TrainerCallback`` that probes the Trainer's model.

    from fp16probe.integrations.huggingface import Fp16ProbeCallback

    trainer = Trainer(model=model, args=args, train_dataset=data)
    Fp16ProbeCallback(every=10).attach(trainer)
    trainer.train()   # writes fp16probe-report.json and fp16probe-recommendation.txt to args.output_dir

Under ``fp16=True`` the Trainer's backward runs on ``scale * loss`` (accelerate keeps the
``torch.amp.GradScaler`` at ``trainer.accelerator.scaler``); the callback hands that scaler
to the Probe so every histogram is of the unscaled gradients. A callback passed as
``Trainer(callbacks=[...])`` never sees the Trainer object itself, so ``attach`` (or
``trainer=``) is how it finds the scaler; under fp16 without it, training stops with an
error rather than recording gradients 65536 times too large.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp16probe.integrations import finish, require

transformers = require("transformers", "hf", "fp16probe.integrations.huggingface")

from fp16probe.errors import Fp16ProbeError  # noqa: E402
from fp16probe.capture.probe import Probe  # noqa: E402

__all__ = ["Fp16ProbeCallback", "trainer_scaler"]


def trainer_scaler(trainer: Any) -> Any:
    """The GradScaler a Trainer scales its loss with, or None (fp32, bf16, or none made)."""
    accelerator = getattr(trainer, "accelerator", None)
    return getattr(accelerator, "scaler", None)


class Fp16ProbeCallback(transformers.TrainerCallback):
    """Probe the Trainer's model and write the report and recommendation when training ends.

    Args:
        every: sample every Nth optimizer step.
        format: the format the recommendation is for (``"fp16"``, ``"bf16"``, ...).
        output_dir: where to write (default: the Trainer's ``args.output_dir``).
        trainer: the Trainer, to find its GradScaler (or call :meth:`attach`).
        scaler: a GradScaler to unscale with, when it is not the Trainer's.
        log_every: also log histograms and scalars every N optimizer steps to the trackers
            ``args.report_to`` names (tensorboard, wandb, mlflow); statistics reach the host
            only then (see :mod:`fp16probe.integrations.live`).
        log_modules: with ``log_every``, also each module's running histogram.
        trackers: with ``log_every``, log to these instead (SummaryWriter, wandb Run, ...).
        **probe_options: passed to :class:`fp16probe.Probe` (``modules``, ``granularity``, ...).
    """

    def __init__(
        self,
        *,
        every: int = 1,
        format: str = "fp16",
        output_dir: str | Path | None = None,
        trainer: Any = None,
        scaler: Any = None,
        log_every: int | None = None,
        log_modules: bool = False,
        trackers: Any = None,
        **probe_options: Any,
    ) -> None:
        self.every = every
        self.format = format
        self.output_dir = output_dir
        self.trainer = trainer
        self.scaler = scaler
        self.probe_options = probe_options
        self.probe: Probe | None = None
        self.report = None  # on the main process, once training ends: the report as written
        self.log_every, self.log_modules, self.trackers = log_every, log_modules, trackers
        self.live: Any = None

    def attach(self, trainer: Any) -> "Fp16ProbeCallback":
        """Add this callback to ``trainer`` (once) and remember the Trainer for its scaler."""
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    def _scaler(self, args: Any) -> Any:
        if self.scaler is not None:
            return self.scaler
        if self.trainer is not None:
            return trainer_scaler(self.trainer)
        if getattr(args, "fp16", False):
            raise Fp16ProbeError(
                "TrainingArguments(fp16=True) scales the loss, and Fp16ProbeCallback cannot reach the "
                "Trainer's GradScaler to unscale the gradients it records; add the callback with "
                "Fp16ProbeCallback(...).attach(trainer), or pass trainer= or scaler="
            )
        return None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise Fp16ProbeError("the Trainer passed no model to on_train_begin; nothing to probe")
        self.probe = Probe(model, every=self.every, scaler=self._scaler(args), **self.probe_options).start()
        if self.log_every:
            from fp16probe.integrations.live import LiveLogger, hf_trackers

            main = state.is_world_process_zero
            trackers = (self.trackers or hf_trackers(args)) if main else []
            self.live = LiveLogger(self.probe, trackers, log_every=self.log_every, step_offset=state.global_step + 1,
                                   is_main=main, format=self.format, modules=self.log_modules)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.probe is not None:
            self.probe.step()
            if self.live is not None:
                self.live.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        live, self.live = self.live, None
        if live is not None:
            live.close()
        probe, self.probe = self.probe, None
        if probe is None:
            return
        self.report = finish(probe, trainer="transformers", global_step=state.global_step,
                             is_main=state.is_world_process_zero, folder=self.output_dir or args.output_dir,
                             format=self.format)
