"""``profile(..., trial=STEPS)``: train copies of the model in fp32 and in the answer's precision, and keep the curves.

An alarm about one step's gradients says nothing of whether training feels it; a trial does. From
the weights the profile started from, each of :data:`TRIAL_SEEDS` data orders over the profile's
own batches (a fresh permutation of them each pass, drawn from ``seed + i``) trains ``steps``
optimizer steps twice: in fp32, and in the target format with the answer's GradScaler (the
device's own autocast when the target is the device that runs, else the emulated target step,
:func:`fp16probe.capture.emulate.emulating`), with a verdict's fix applied. Both runs of a seed see
the same batches in the same order and draw the same random numbers at each step (dropout, invented
labels). :func:`fp16probe.analysis.trial.judge_curves` judges the curves.

Cost: ``steps x TRIAL_SEEDS x 2`` forward+backward+optimizer steps, on deep copies: the user's model
(weights, buffers, ``.grad``) and the random state are left as they were. It synchronises with the
device once per step (the loss value).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fp16probe.errors import Fp16ProbeError, ModelError, message_of
from fp16probe.recommendation import Recommendation
from fp16probe.running.effect import loss_generators
from fp16probe.running.inputs import call_model
from fp16probe.running.losses import Loss
from fp16probe.running.optimizers import make_optimizer
from fp16probe.sections import Trial

__all__ = ["OFF_DISTRIBUTED", "OFF_FORMAT", "OFF_NO_BATCH", "OFF_PURE", "OFF_STOPPED", "TRIAL_OPTIMIZER", "TRIAL_SEEDS", "data_order", "run_trial", "scaler_settings"]

TRIAL_SEEDS = 3  # data orders: fp32's band needs a spread to measure; each costs 2 x steps
TRIAL_OPTIMIZER = "adam"  # when the profile named none
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# Why no trial ran (Trial.off): codes, worded in fp16probe.presentation.trial.
OFF_PURE = "pure_fp16"  # a .half() model: no autocast to train it under
OFF_FORMAT = "format"  # a format autocast cannot compute in (fp8, scaled formats)
OFF_NO_BATCH = "no_batch"
OFF_DISTRIBUTED = "distributed"  # under torch.distributed every rank would train its own copies
OFF_STOPPED = "stopped"  # Ctrl-C, SIGTERM or SIGHUP during the trial


def scaler_settings(rec: Recommendation) -> dict[str, Any]:
    """The GradScaler settings the answer trains with: its own; with no scale of its own (a forward or
    gradient-error verdict), the scale its gradients' verdict stands on; bf16 none ({}: no scaler)."""
    if rec.format != "fp16":
        return {}
    kwargs = dict(rec.grad_scaler_kwargs)
    k = rec.evidence.get("backward_log2_scale")
    if "init_scale" not in kwargs and isinstance(k, int):
        kwargs["init_scale"] = math.ldexp(1.0, k)
    return kwargs


def data_order(batches: int, steps: int, seed: int) -> list[int]:
    """Batch indices for ``steps`` steps: a fresh permutation of ``batches`` batches each pass, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < steps:
        out += torch.randperm(batches, generator=g).tolist()
    return out[:steps]


def run_trial(model: nn.Module, rec: Recommendation, batches: Sequence[Any], loss: Loss, *, steps: int,
              device: torch.device, target: str, regime: str = "autocast", seed: int = 0,
              optimizer: str | None = None, lr: float = 1e-3, ends: list[nn.Module] | None = None) -> Trial:
    """Train copies of ``model`` (as it was before the profile) in fp32 and in ``rec``'s format; return the curves.

    ``batches``: the profile's own, on ``device``; ``target``: whose autocast the low-precision
    runs use (emulated when it is not ``device``'s type). ``ends``: given, the first seed's fp32 copy as
    it ended is appended to it (the weights near convergence, :class:`fp16probe.sections.TrialEnd`).
    Fails with :class:`ModelError` naming the run and step when the model or loss raises.
    """
    name = optimizer or TRIAL_OPTIMIZER
    fixed = tuple(rec.evidence.get("fix_modules") or ()) if rec.verdict in (
        "forward_overflow", "forward_underflow", "gradient_error") else ()
    base = Trial(steps=steps, format=rec.format, run="autocast" if target == device.type else "emulated",
                 device=str(device), target=target, scaler=scaler_settings(rec), optimizer=name, lr=float(lr),
                 batches=len(batches), fixed=fixed)
    off = (OFF_PURE if regime == "pure_fp16" else OFF_FORMAT if rec.format not in _DTYPES
           else OFF_NO_BATCH if not batches else None)
    if off is not None:
        return dataclasses.replace(base, off=off)
    gens = loss_generators(loss.fn)
    seeds = tuple(seed + i for i in range(TRIAL_SEEDS))
    fp32, low, skipped = [], [], []
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        start = [g.get_state() for g in gens]
        for s in seeds:
            order = data_order(len(batches), steps, s)
            curve, _, net = _train(model, base, batches, order, loss, s, gens, start, low_precision=False)
            fp32.append(curve)
            if ends is not None and s == seeds[0]:
                ends.append(net)
            curve, k, _ = _train(model, base, batches, order, loss, s, gens, start, low_precision=True)
            low.append(curve)
            skipped.append(k)
        for g, st in zip(gens, start):
            g.set_state(st)
    return dataclasses.replace(base, seeds=seeds, fp32=tuple(fp32), low=tuple(low), skipped=tuple(skipped))


def _train(model: nn.Module, t: Trial, batches: Sequence[Any], order: list[int], loss: Loss, seed: int,
           gens: list[torch.Generator], start: list[Any], *, low_precision: bool
           ) -> tuple[tuple[float, ...], int, nn.Module]:
    """One run of a seed: its loss at each step, the steps its GradScaler skipped, and the model it trained."""
    device = torch.device(t.device)
    net = copy.deepcopy(model).to(device).float().train()
    if low_precision and t.fixed:
        from fp16probe.running.fixes import keep_in_fp32

        keep_in_fp32(net, list(t.fixed), device_type=t.target)
    opt = make_optimizer(net, t.optimizer, t.lr)
    scaler = torch.amp.GradScaler(device.type, **t.scaler) if low_precision and t.scaler else None
    for g, st in zip(gens, start):
        g.set_state(st)
    losses: list[float] = []
    skipped = 0
    for step, i in enumerate(order):
        torch.manual_seed(seed * 1_000_003 + step)  # the same dropout masks in both runs of this step
        opt.zero_grad(set_to_none=True)
        try:
            value = _forward(net, batches[i], loss, t if low_precision else None).reshape(())
            losses.append(float(value.detach()))  # the one host sync of the step
            if not math.isfinite(losses[-1]) and scaler is None:
                break  # no scaler to skip the step: the run cannot go on
            if scaler is None:
                value.backward()
                opt.step()
                continue
            scaler.scale(value).backward()
            before = scaler.get_scale()
            scaler.step(opt)  # skips the update on inf/NaN gradients
            scaler.update()
            skipped += int(scaler.get_scale() < before)
        except Fp16ProbeError:
            raise
        except Exception as e:
            run = f"{t.format} run" if low_precision else "fp32 run"
            raise ModelError(f"trial, seed {seed}, {run}, step {step + 1}: {type(e).__name__}: {message_of(e)}") from e
    return tuple(losses), skipped, net


def _forward(net: nn.Module, batch: Any, loss: Loss, t: Trial | None) -> torch.Tensor:
    """The loss of one batch: in fp32 (``t`` None), under the device's autocast, or in the emulated target step."""
    if t is None:
        return loss.fn(call_model(net, batch), batch)
    if t.run == "emulated":
        from fp16probe.capture.emulate import emulating

        with emulating(net, format=t.format, target=t.target):
            return loss.fn(call_model(net, batch), batch)
    with torch.autocast(device_type=torch.device(t.device).type, dtype=_DTYPES[t.format]):
        return loss.fn(call_model(net, batch), batch)
