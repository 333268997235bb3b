"""The profiling run: N forward+backward steps of a model under a Probe.

Library code: it returns data and raises :class:`InputError` whose message names the
parameter; the command line maps parameter names to its flags.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fp16probe.errors import InputError
from fp16probe.running.inputs import Batches, call_model, describe_batch
from fp16probe.running.losses import Loss

__all__ = ["RunResult", "RunSettings", "make_optimizer", "run_profile"]


@dataclass(frozen=True)
class RunSettings:
    """How the profiling loop runs."""

    steps: int = 10
    device: str = "cpu"
    precision: str = "fp32"  # fp32 | fp16 | bf16 (the latter two through autocast)
    loss_scale: float | None = None
    optimizer: str | None = None  # None: forward + backward only, weights unchanged
    lr: float = 1e-3


@dataclass(frozen=True)
class RunResult:
    """What the loop did: steps finished, whether Ctrl-C stopped it, non-finite losses."""

    steps_done: int
    interrupted: bool = False
    exhausted: bool = False
    nonfinite_loss_steps: tuple[int, ...] = ()
    losses: tuple[float, ...] = field(default=(), repr=False)
    # With an optimizer: the weights before the last step that updated them, and that
    # step's update (new minus old), for the weight-update check of Micikevicius et al. (arXiv:1710.03740).
    weights_before: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    updates: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_optimizer(model: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    """Build the optimizer named on the command line."""
    params = [p for p in model.parameters() if p.requires_grad]
    classes = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    return classes[name](params, lr=lr)


def run_profile(
    model: nn.Module,
    batches: Batches,
    loss: Loss,
    settings: RunSettings,
    probe: Any,
    *,
    scaler: Any = None,
    on_step: Callable[[int], None] | None = None,
) -> RunResult:
    """Run ``settings.steps`` forward+backward passes under the probe; Ctrl-C stops early.

    The loss is checked for inf/NaN each step, which synchronises with the device
    once per step; a non-finite loss is recorded (a finding), never raised.
    """
    device = torch.device(settings.device)
    optimizer = make_optimizer(model, settings.optimizer, settings.lr) if settings.optimizer else None
    nonfinite: list[int] = []
    losses: list[float] = []
    before: dict[str, torch.Tensor] | None = None
    updates: dict[str, torch.Tensor] | None = None
    done = 0
    exhausted = False
    model.train()
    try:
        for step in range(settings.steps):
            try:
                batch = next(batches.iterator)
            except StopIteration:
                exhausted = True
                break
            with _autocast(device, settings.precision):
                try:
                    output = call_model(model, batch)
                except InputError:
                    raise
                except (RuntimeError, TypeError, ValueError, IndexError) as e:
                    raise InputError(
                        f"the model rejected the input ({describe_batch(batch)}): {type(e).__name__}: "
                        f"{_first_line(e)}; pass an input_shape=/input_dtype= that forward() accepts, or batches="
                    ) from e
                try:
                    value = loss.fn(output, batch)
                except InputError:
                    raise
                except Exception as e:
                    raise InputError(f"the loss ({loss.description}) raised {type(e).__name__}: {_first_line(e)}") from e
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise InputError(
                    f"the loss ({loss.description}) returned {type(value).__name__}, expected a scalar tensor"
                )
            value = value.reshape(())
            loss_val = float(value.detach().float())  # one host sync per step, outside every hook
            losses.append(loss_val)
            if not math.isfinite(loss_val):
                nonfinite.append(step)
            if not value.requires_grad:
                raise InputError(
                    f"the loss ({loss.description}) does not depend on any trainable parameter; "
                    "check that the model's parameters require grad"
                )
            (scaler.scale(value) if scaler is not None else value).backward()
            if optimizer is not None:
                snapshot = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
                if scaler is not None:
                    scale = scaler.get_scale()
                    scaler.step(optimizer)  # skips the step itself on inf/NaN gradients
                    scaler.update()
                    taken = scaler.get_scale() >= scale  # a skipped step backs the scale off
                else:
                    taken = math.isfinite(loss_val)
                    if taken:
                        optimizer.step()
                if taken:
                    before = snapshot
            model.zero_grad(set_to_none=True)
            probe.step()
            done += 1
            if on_step is not None:
                on_step(done)
    except KeyboardInterrupt:
        interrupted = True
    else:
        interrupted = False
    if before is not None:
        # Later steps were skipped, so the weights still hold the last taken step's result.
        updates = {n: p.detach() - before[n] for n, p in model.named_parameters() if n in before}
    return RunResult(done, interrupted=interrupted, exhausted=exhausted, nonfinite_loss_steps=tuple(nonfinite),
                     losses=tuple(losses), weights_before=before, updates=updates)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
