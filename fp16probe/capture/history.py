"""The per-step history: a few device scalars on every training step, sampled or not.

Histograms stay on sampled steps; a loss-scale schedule is judged on what happens at every
step. So on each step :class:`History` keeps, in preallocated device buffers written by
index (no host sync, no allocation per step but a doubling now and then):

* ``scale``: the loss scale in force (the one the step's gradients were multiplied by);
* ``grad_max``: the largest |g| over the parameters' gradients at the end of backward,
  unscaled (inf or NaN when one was): the values GradScaler's overflow check reads, so
  ``found_inf`` (a non-finite ``grad_max``) is exactly the step the scaler skipped;
* ``forward_max``: the forward headroom per step (the largest forward output the Probe's
  forward capture saw), on sampled steps; None on the others and where it is off.

Three float32 scalars a step: a 100,000-step run keeps its whole history in 1.2 MB of
device memory. It comes to the host in :meth:`History.collect`, with the report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fp16probe.capture import distributed as _distributed
from fp16probe.capture import engine
from fp16probe.capture.collector import Collected, Collector
from fp16probe.capture.recorder import FORWARD
from fp16probe.report import StepHistory, StepTrace

__all__ = ["History"]

_FIRST_CAPACITY = 1024
_TRIGGERS = 16  # parameters whose gradient accumulation queues the end-of-backward read


class History(Collector):
    """Per-step scale, found_inf and largest gradient, kept on the device (see the module docstring)."""

    key = "history"

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.recorder = probe.recorder
        self._params: list[torch.Tensor] = []
        self._handles: list[Any] = []
        self._buf: torch.Tensor | None = None  # [capacity, 3] float32: scale, grad_max, forward_max
        self._written = -1  # the highest step index written
        self._queued_for = -1  # the step whose end-of-backward callback is queued
        self._start_step = 0

    # -- hooks ----------------------------------------------------------------------------
    def start(self) -> None:
        """Hook the gradient accumulation of a few of the probed parameters; the first to
        fire in a backward queues the read, which reads every parameter's gradient.

        A hook per parameter would cost a Python call per parameter and step (0.8 ms a step
        on a 200-parameter MLP) to learn what the first call says. A backward in which none
        of the ``_TRIGGERS`` spread-out parameters gets a gradient records no row (its step
        reads as unknown, never as a wrong value).
        """
        if self._handles:
            return
        self._params = [p for _, _, p in self.probe.collector("modules").params]
        self._start_step = self.recorder.step_index if self._buf is None else self._start_step
        n = len(self._params)
        picks = sorted({round(k * (n - 1) / (_TRIGGERS - 1)) for k in range(_TRIGGERS)}) if n > _TRIGGERS else range(n)
        for k in picks:
            self._handles.append(self._params[k].register_post_accumulate_grad_hook(self._grad_ready))

    def stop(self) -> None:
        """Remove the hooks; what was recorded stays."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _grad_ready(self, p: torch.Tensor) -> None:
        rec = self.recorder
        if not rec.enabled or self._queued_for == rec.step_index:
            return
        try:
            self._queued_for = rec.step_index
            _distributed.after_backward(self._read, ddp=rec.defer_to_ddp)
        except Exception as e:
            rec.note_error(e)

    def _read(self) -> None:
        """At the end of backward: write the step's scale and largest unscaled |g| (device ops only)."""
        rec = self.recorder
        try:
            self._queued_for = -1  # a second backward in the step (accumulation) reads again
            if self._read_host():
                return
            grads = [p.grad for p in self._params if p.grad is not None]
            grads = [g.to_local() if type(g) is not torch.Tensor and hasattr(g, "to_local") else g for g in grads]
            grads = [g for g in grads if g.is_floating_point() and not g.is_sparse and g.numel()]
            if not grads:
                return
            device = grads[0].device
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for g in grads:
                by_device.setdefault(g.device, []).append(g)
            raw = torch.stack([engine.largest_abs(gs).to(device, non_blocking=True) for gs in by_device.values()]).max()
            scale = rec.scale_source.tensor() if rec.scale_source is not None else None
            row = self._row(rec.step_index - self._start_step, device)
            if scale is None:
                row[0] = float("nan")
                row[1] = raw
            else:
                s = scale.to(device, non_blocking=True).float().reshape(())
                row[0] = s
                row[1] = (raw.double() / s.double()).float()  # inf and NaN stay what they are
            self._written = max(self._written, rec.step_index - self._start_step)
        except Exception as e:
            rec.note_error(e)

    def _read_host(self) -> bool:
        """:meth:`_read` for fp32 CPU gradients of an unscaled run: the row written through a numpy view of
        the buffer. False, having written nothing, for anything else (a scaled run's row divides by the
        scale on the device: reading it here would be a host read).

        In a sampled step whose weight counts read every gradient (``Recorder.take_weight_largest``), their
        largest is the row's; otherwise one compiled read of them all."""
        if self.recorder.scale_source is not None:
            return False
        grads = [p.grad for p in self._params]
        raw = self.recorder.take_weight_largest(grads)
        if raw is None:
            raw = engine.largest_abs_host(grads)
        if raw is None:
            return False
        i = self.recorder.step_index - self._start_step
        row = self._row(i, torch.device("cpu")).numpy()
        row[0], row[1] = math.nan, raw
        self._written = max(self._written, i)
        return True

    def _row(self, i: int, device: torch.device) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.device != device:
            buf = self._buf = torch.full((_FIRST_CAPACITY, 3), -1.0, device=device)
        if i >= buf.shape[0]:
            grown = torch.full((max(2 * buf.shape[0], i + 1), 3), -1.0, device=device)
            grown[: buf.shape[0]] = buf
            buf = self._buf = grown
        return buf[i]

    def close_step(self, sampled: bool = True) -> None:
        """A step ended (nothing to do on the device: the row was written at the end of backward)."""
        self._queued_for = -1

    def discard_step(self) -> None:
        """Forget the open step's row (a step cut short that the report drops, see Probe.discard_step)."""
        self._queued_for = -1
        i = self.recorder.step_index - self._start_step
        if self._written >= i:
            self._written = i - 1
            if self._buf is not None and i < self._buf.shape[0]:
                self._buf[i] = -1.0

    def memory_bytes(self) -> int:
        """Device memory the history holds."""
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()

    # -- to the host --------------------------------------------------------------------------
    def collect(self, got: Collected) -> Mapping[str, Any]:
        """The ``history`` section (the sampled steps' ceilings and forward maxima folded in); the
        live GradScaler's settings go to the capture notes."""
        settings = self.scaler_settings(self.probe.scaler)
        if settings:
            got.notes["scaler_settings"] = settings
        history = self.steps(got.trace, got.since_step, got.maxima.get(FORWARD))
        return {} if history is None else {"history": history}

    def steps(self, trace: StepTrace, since_step: int | None = None,
              forward: Sequence[float] | None = None) -> StepHistory | None:
        """Bring the history to the host (one transfer); fold in the sampled steps' ceilings.

        ``since_step``: only the steps from that one on. ``forward``: the largest forward
        output of each step of ``trace`` (the Probe's forward maxima, sampled steps only).
        """
        end = self._written + 1
        lo = 0 if since_step is None else min(max(since_step - self._start_step, 0), max(end, 0))
        n = end - lo
        if self._buf is None or n <= 0:
            return None
        rows = self._buf[lo:end].cpu().tolist()
        scale: list[float | None] = []
        grad_max: list[float | None] = []
        for s, g, _ in rows:
            recorded = g != -1.0
            scale.append(None if (not recorded or math.isnan(s)) else s)
            grad_max.append(g if recorded else None)
        ceiling: list[float | None] = [None] * n
        if trace.ceiling is not None:
            for step, c in zip(trace.steps, trace.ceiling):
                i = step - self._start_step - lo
                if 0 <= i < n:
                    ceiling[i] = c
        forward_max: list[float | None] | None = None
        if forward:
            forward_max = [None] * n
            for step, f in zip(trace.steps, forward):
                i = step - self._start_step - lo
                if 0 <= i < n:
                    forward_max[i] = f
        return StepHistory(first_step=self._start_step + lo, scale=tuple(scale), grad_max=tuple(grad_max),
                           ceiling=tuple(ceiling), forward_max=None if forward_max is None else tuple(forward_max))

    @staticmethod
    def scaler_settings(scaler: Any) -> dict[str, Any] | None:
        """A GradScaler's growth and backoff settings (host numbers), for replaying it."""
        if scaler is None or not hasattr(scaler, "_growth_interval") or not hasattr(scaler, "_backoff_factor"):
            return None
        return {"growth_factor": float(scaler._growth_factor), "backoff_factor": float(scaler._backoff_factor),
                "growth_interval": int(scaler._growth_interval), "init_scale": float(scaler._init_scale),
                "source": type(scaler).__name__}
