"""A Hugging Face ``transformers.TrainerCallback`` that probes the Trainer's model.

    from fp16probe.integrations.huggingface import Fp16ProbeCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Fp16ProbeCallback(every=10)])
    trainer.train()   # writes fp16probe-report.json and fp16probe-recommendation.txt to args.output_dir

Under ``fp16=True`` on a GPU the Trainer's backward runs on ``scale * loss``: accelerate
keeps the ``torch.amp.GradScaler`` on the optimizer it hands every callback event
(``AcceleratedOptimizer.scaler``, the same object as ``trainer.accelerator.scaler``). The
callback finds it there and gives it to the Probe, so every histogram is of the unscaled
gradients. Where accelerate made no scaler (fp32, bf16, or fp16 on a CPU, where it does not
scale the loss) there is nothing to unscale. Only a run that scales the loss with a scaler
the callback cannot find (fp16 without accelerate's optimizer) is refused, rather than
recording gradients 65536 times too large; pass ``scaler=`` there. The report records the
TrainingArguments that decide precision and steps (``report.workload.training_arguments``).

Under torchrun the ranks agree before each backward (a forward hook on the model); the Trainer
tells a callback of no failure, so for the run the callback also wraps the Trainer's
``training_step``, its gradient clipping, its optimizer's and LR scheduler's ``step`` and its logging and
saving: a rank that raises in ``compute_loss``, backward, clipping, either step or a save stops every rank,
and rank 0 writes the partial report (see docs/distributed.md).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from fp16probe.integrations import ProbeCallback, finish, require

transformers = require("transformers", "hf", "fp16probe.integrations.huggingface")

from fp16probe.errors import Fp16ProbeError  # noqa: E402

__all__ = ["Fp16ProbeCallback", "trainer_accumulation", "trainer_scaler"]


# The TrainingArguments that decide what the gradients are: precision, accumulation, clipping.
TRAINING_ARGUMENTS = (
    "fp16", "bf16", "half_precision_backend", "fp16_opt_level", "gradient_accumulation_steps",
    "per_device_train_batch_size", "max_grad_norm", "learning_rate", "optim", "torch_compile",
)


def trainer_scaler(trainer: Any) -> Any:
    """Return the GradScaler a Trainer scales its loss with, or None (fp32, bf16, or none made)."""
    accelerator = getattr(trainer, "accelerator", None)
    return getattr(accelerator, "scaler", None)


def training_arguments(args: Any) -> dict[str, Any]:
    """Return the TrainingArguments that matter to gradients, as JSON-ready values."""
    out: dict[str, Any] = {}
    for name in TRAINING_ARGUMENTS:
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


def trainer_accumulation(args: Any, trainer: Any = None) -> dict[str, Any]:
    """The Probe's ``accumulation`` and ``loss_divisor`` for ``gradient_accumulation_steps``.

    The Trainer backpropagates each micro-batch's loss divided by the accumulation count unless it is
    already normalised over the accumulated batch: when the model takes loss keyword arguments it is
    called with ``num_items_in_batch`` (the tokens of all the step's micro-batches) and divides
    itself. So a replayed forward that carries ``num_items_in_batch`` is divided by 1, another by the
    count; a Trainer given here whose ``loss_is_scaled_for_ga`` is set decides it instead.
    """
    n = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None) if trainer is not None else None
    if scaled is not None:
        return {"accumulation": n, "loss_divisor": 1.0 if scaled else float(n)}

    def divisor(kwargs: Any) -> float:
        return 1.0 if kwargs.get("num_items_in_batch") is not None else float(n)

    return {"accumulation": n, "loss_divisor": divisor}


class Fp16ProbeCallback(ProbeCallback, transformers.TrainerCallback):
    """Probe the Trainer's model and write the report and recommendation when training ends.

    Args:
        every: sample every Nth optimizer step.
        format: the format the recommendation is for (``"fp16"``, ``"bf16"``, ...).
        output_dir: where to write (default: the Trainer's ``args.output_dir``).
        trainer: the Trainer (optional: the scaler is found on the optimizer every event receives).
        scaler: a GradScaler (or any scale the Probe reads) to unscale with, when it is not the Trainer's.
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
        super().__init__(every, format, log_every, log_modules, trackers, probe_options)
        self.output_dir, self.trainer, self.scaler = output_dir, trainer, scaler
        self._wrapped: list[tuple[Any, str, Any]] = []  # (owner, name, its own attribute or _ABSENT) to put back

    def attach(self, trainer: Any) -> "Fp16ProbeCallback":
        """Add this callback to ``trainer`` (once); ``Trainer(callbacks=[...])`` works as well."""
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    def _scaler(self, args: Any, optimizer: Any) -> tuple[Any, str | None]:
        """Return the scaler the run multiplies its loss by, and where it was found."""
        if self.scaler is not None:
            return self.scaler, "scaler="
        if self.trainer is not None:
            return trainer_scaler(self.trainer), "trainer.accelerator.scaler"
        if optimizer is not None and hasattr(optimizer, "scaler"):
            # accelerate's AcceleratedOptimizer: its GradScaler, or None where the loss is not scaled
            return optimizer.scaler, "optimizer.scaler"
        if getattr(args, "fp16", False):
            raise Fp16ProbeError(
                "TrainingArguments(fp16=True) may scale the loss, and Fp16ProbeCallback found no GradScaler "
                f"(the optimizer it was given, {type(optimizer).__name__}, carries none) to unscale the "
                "gradients it records; pass Fp16ProbeCallback(scaler=...) or trainer="
            )
        return None, None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Start probing the Trainer's model, unscaling with the scaler the run uses."""
        if model is None:
            raise Fp16ProbeError("the Trainer passed no model to on_train_begin; nothing to probe")
        scaler, found_at = self._scaler(args, kwargs.get("optimizer"))
        self.extra = {"training_arguments": training_arguments(args), "loss_scaled": scaler is not None,
                      "grad_scaler_found_at": found_at if scaler is not None else None}
        self._start(model, scaler, main=state.is_world_process_zero, step_offset=state.global_step + 1,
                    trackers=lambda live: live.hf_trackers(args), folder=self.output_dir or args.output_dir,
                    trainer="transformers", accumulation=trainer_accumulation(args, self.trainer))
        if self.guard is not None:
            # The Trainer tells a callback of no failure: torch runs this hook even when the forward
            # raises, so the failing rank joins the agreement from there (see fp16probe.integrations.guard).
            self.guard.hook_forward(model, self._after_forward)
            # Outside the forward (compute_loss, backward, clipping, the optimizer and LR scheduler steps,
            # logging and saving) nothing of the Trainer's runs on the way out; what runs them does, wrapped.
            self._watch(self.trainer or _calling_trainer(self), kwargs.get("optimizer"), kwargs.get("lr_scheduler"))

    def _watch(self, trainer: Any, optimizer: Any, lr_scheduler: Any = None) -> None:
        """Wrap the Trainer's ``training_step`` (compute_loss and backward), ``_clip_grad_norm`` (max_grad_norm)
        and ``_maybe_log_save_evaluate``, the optimizer's and the LR scheduler's ``step`` (instance attributes,
        put back at the end; one this Trainer lacks is left out) so that what they raise stops every rank as a
        failing forward does."""
        for owner, name in ((trainer, "training_step"), (trainer, "_clip_grad_norm"), (optimizer, "step"),
                            (lr_scheduler, "step"), (trainer, "_maybe_log_save_evaluate")):
            call = getattr(owner, name, None) if owner is not None else None
            if call is None:
                continue
            self._wrapped.append((owner, name, owner.__dict__.get(name, _ABSENT)))
            setattr(owner, name, self._guarded(call))

    def _guarded(self, call: Any) -> Any:
        @functools.wraps(call)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            except Exception as e:
                self._on_failure(e)
                raise
        return guarded

    def _on_failure(self, error: BaseException) -> None:
        """Training raised on this rank: stop every rank with it (rank 0 writes what every rank finished,
        or its own steps, marked), then remove every hook and wrapper, as Lightning's ``on_exception``."""
        try:
            self._stop_after_failure(error)
        finally:
            self._unwatch()

    def _unwatch(self) -> None:
        """Put back what :meth:`_watch` wrapped."""
        wrapped, self._wrapped = self._wrapped, []
        for owner, name, own in reversed(wrapped):
            if own is _ABSENT:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, own)

    def _after_forward(self, error: BaseException | None) -> None:
        """After each training forward (before backward): agree with the other ranks, or stop them with ``error``."""
        if error is None:
            self._before_backward()
        else:
            self._failed(error)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the Probe's step: one per optimizer step (after gradient accumulation)."""
        self._step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Stop probing; merge ranks, analyse and write the report on the main process."""
        self._unwatch()
        self._finish_ranks()
        probe = self._stop()
        if probe is None:
            return
        ran = str(probe.recorder.precision or "fp32")
        if getattr(args, "fp16", False) and not ran.startswith("fp16"):
            # accelerate makes no fp16 autocast on a CPU: the run was fp32, whatever the arguments said
            note = (f"TrainingArguments(fp16=True) had no effect: the run computed in {ran} (accelerate does not "
                    "autocast to fp16 on a CPU), so the recommendation comes from unscaled fp32 gradients, as an "
                    "fp32 profile's does; train on a GPU to profile fp16 as it runs")
            self.extra = {**self.extra, "notes": [*self.extra.get("notes", ()), note]}
        self.report = finish(probe, trainer="transformers", global_step=state.global_step,
                             is_main=state.is_world_process_zero, folder=self.output_dir or args.output_dir,
                             format=self.format, extra=self.extra)


_ABSENT = object()


def _calling_trainer(callback: Any) -> Any:
    """The Trainer calling ``callback``'s event, found up the call stack, or None.

    The Trainer hands its callbacks no reference to itself; the event's caller is its method.
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, transformers.Trainer) and any(
                c is callback for c in getattr(owner.callback_handler, "callbacks", ())):
            return owner
        frame = frame.f_back
    return None
