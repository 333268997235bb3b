"""A PyTorch Lightning ``Callback`` that probes the LightningModule being fit.

    from fp16probe.integrations.lightning import Fp16ProbeCallback

    trainer = pl.Trainer(precision="16-mixed", callbacks=[Fp16ProbeCallback(every=10)])
    trainer.fit(module, data)   # writes fp16probe-report.json and fp16probe-recommendation.txt

Under ``precision="16-mixed"`` Lightning's precision plugin owns a ``torch.amp.GradScaler``
(``trainer.precision_plugin.scaler``) and backward runs on ``scale * loss``: gradients are
still scaled in ``on_after_backward`` and only unscaled just before
``on_before_optimizer_step``. The Probe records during backward, so the callback gives it
the plugin's scaler and every histogram is of the unscaled gradients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp16probe.integrations import ProbeCallback, finish, require

pl = require("pytorch_lightning", "lightning", "fp16probe.integrations.lightning")


__all__ = ["Fp16ProbeCallback", "lightning_accumulation", "lightning_scaler"]


def lightning_scaler(trainer: Any) -> Any:
    """The GradScaler of a Lightning Trainer's precision plugin, or None (fp32, bf16)."""
    plugin = getattr(trainer, "precision_plugin", None)
    scaler = getattr(plugin, "scaler", None)
    return scaler if scaler is not None and getattr(scaler, "is_enabled", lambda: True)() else None


def lightning_accumulation(trainer: Any) -> dict[str, Any]:
    """The Probe's ``accumulation`` for a Trainer's ``accumulate_grad_batches``: under automatic
    optimization Lightning backpropagates each micro-batch's ``training_step`` loss divided by it,
    the Probe's default ``loss_divisor``."""
    return {"accumulation": int(getattr(trainer, "accumulate_grad_batches", 1) or 1)}


class Fp16ProbeCallback(ProbeCallback, pl.Callback):
    """Probe the LightningModule during ``fit``; write the report and recommendation at its end.

    Args:
        every: sample every Nth optimizer step.
        format: the format the recommendation is for (``"fp16"``, ``"bf16"``, ...).
        dirpath: where to write (default: the Trainer's ``default_root_dir``).
        log_every: also log histograms and scalars every N optimizer steps to the Trainer's
            loggers (TensorBoardLogger, WandbLogger, MLFlowLogger); statistics reach the host
            only then (see :mod:`fp16probe.integrations.live`).
        log_modules: with ``log_every``, also each module's running histogram.
        trackers: with ``log_every``, log to these instead of the Trainer's loggers.
        **probe_options: passed to :class:`fp16probe.Probe` (``modules``, ``granularity``, ...).
    """

    def __init__(
        self, *, every: int = 1, format: str = "fp16", dirpath: str | Path | None = None,
        log_every: int | None = None, log_modules: bool = False, trackers: Any = None, **probe_options: Any
    ) -> None:
        super().__init__(every, format, log_every, log_modules, trackers, probe_options)
        self.dirpath = dirpath

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Start probing the LightningModule, unscaling with the precision plugin's scaler."""
        scaler = lightning_scaler(trainer)
        self.extra = {"trainer_settings": {"precision": str(getattr(trainer, "precision", "")),
                                           "accumulate_grad_batches": getattr(trainer, "accumulate_grad_batches", 1),
                                           "gradient_clip_val": getattr(trainer, "gradient_clip_val", None)},
                      "loss_scaled": scaler is not None}
        self._start(pl_module, scaler, main=trainer.is_global_zero, step_offset=trainer.global_step + 1,
                    trackers=lambda live: live.lightning_trackers(trainer),
                    folder=self.dirpath or trainer.default_root_dir, trainer="lightning",
                    accumulation=lightning_accumulation(trainer))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """On the Probe's rerun steps, rerun ``training_step`` on this batch in fp32, before the real one
        (each micro-batch of an accumulated step, its loss divided by ``accumulate_grad_batches``).

        Only under automatic optimization (a manual ``training_step`` steps the optimizer
        itself); ``self.log`` is silenced during the rerun so the run's metrics stay its own.
        """
        if self.probe is not None and getattr(pl_module, "automatic_optimization", True):
            self.probe.shadow(lambda: _quiet_training_step(pl_module, batch, batch_idx))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """Under torch.distributed: agree with the other ranks before DDP's all-reduce (raises when one failed)."""
        self._before_backward()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Close the Probe's step: one per optimizer step (after accumulation)."""
        self._step()  # once per optimizer step, after the (accumulated) backward passes of it

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Stop probing; merge ranks, analyse and write the report on global rank 0."""
        self._finish_ranks()
        probe = self._stop()
        if probe is None:
            return
        self.report = finish(probe, trainer="lightning", global_step=trainer.global_step,
                             is_main=trainer.is_global_zero, folder=self.dirpath or trainer.default_root_dir,
                             format=self.format, extra=self.extra)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Stop probing and remove every hook when training fails; under torch.distributed, stop every rank
        with this failure (rank 0 writes the report of the steps every rank finished)."""
        self._stop_after_failure(exception)


def _quiet_training_step(pl_module: Any, batch: Any, batch_idx: int) -> Any:
    """``training_step`` with ``log``/``log_dict`` as no-ops (instance attributes, removed after)."""
    def quiet(*args: Any, **kwargs: Any) -> None:
        return None

    saved = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}
    pl_module.log = pl_module.log_dict = quiet
    try:
        return pl_module.training_step(batch, batch_idx)
    finally:
        for name in ("log", "log_dict"):
            if name in saved:
                setattr(pl_module, name, saved[name])
            else:
                del pl_module.__dict__[name]
