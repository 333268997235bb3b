"""The Probe: builds its collectors, loops over them at each step, and makes the Report.

Each measurement is a collector (:mod:`fp16probe.capture.collector`; the built-in ones are listed in
:mod:`fp16probe.capture.setup`): the module hooks that feed the :class:`~fp16probe.capture.recorder.Recorder`,
the forward headroom, op capture, the overflow ceiling, the history, the fp32 reruns and the scaled-format
statistics. The Probe knows none of them by name: it starts, samples, closes and collects each in turn.
Counts stay on the device; no hook synchronises with the host. They come to the host once, in :meth:`Probe.report`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fp16probe.capture import distributed as _distributed
from fp16probe.capture.collector import COLLECTORS, Collected, Collector
from fp16probe.capture.modules import select_modules
from fp16probe.capture.recorder import ROOT_NAME, Recorder, iter_tensors
from fp16probe.capture.setup import BUILTIN, capture_notes, check_accumulation, check_settings, metadata_of
from fp16probe.capture.shadow import DEFAULT_SHADOW_EVERY
from fp16probe.errors import ProbeError
from fp16probe.report import ACTIVATION, ACTIVATION_GRAD, WEIGHT_GRAD, Report, with_workload

__all__ = ["ROOT_NAME", "Probe", "iter_tensors", "select_modules"]


class Probe:
    """Capture log2 histograms of a model's gradients during training.

    Args:
        model: the module to probe.
        modules: ``fnmatch`` patterns (``"encoder.*.attn*"``) of the modules to hook; default every
            leaf module (no double counting through containers). ``types``: only these classes.
        activation_grads, weight_grads, activations: capture the gradient w.r.t. each hooked
            module's output, each parameter's accumulated gradient, the forward outputs.
        forward: keep each hooked module's largest forward output (one device ``amax`` per
            output) and the step's, so the analysis sees forward values past fp16's max.
        every: sample every Nth step (counted by :meth:`step`); others cost nothing.
        scaler: what scales the loss: a ``torch.amp.GradScaler``, a DeepSpeed engine, optimizer or
            loss scaler, a Megatron loss scaler, a number, a tensor or a function returning the
            scale (:mod:`fp16probe.capture.scale`). Gradients are recorded unscaled, the scale read
            once per step without a host sync; an object with no scale to read raises ProbeError.
        precision: what the run computes in (default: detected from autocast at the first
            probed forward; "fp32" without autocast).
        granularity: ``"module"`` records each hooked module's output gradient; ``"op"`` every
            differentiable op's output inside the selected modules (``F.gelu``, residual adds),
            named ``"<module>/<op>"`` (:mod:`fp16probe.capture.ops`), every module selected.
        shadow_every: under autocast, rerun sampled steps 1, 2, 3, 5, 9, 17, 33, then every
            ``shadow_every``-th in fp32 as the verdict's reference, training left bit-identical
            (:mod:`fp16probe.capture.shadow`). Default 50; 0: off. For a loss computed outside
            the model call :meth:`shadow`.
        accumulation: micro-batches per optimizer step (gradient accumulation): a shadowed step
            reruns each of them in fp32 and accumulates their gradients, as the live step does.
        loss_divisor: what each rerun divides its micro-batch's loss (the model's, or what
            :meth:`shadow`'s function returns) by before backward, as the loop divides it: a number, or a
            function of the replayed forward's keyword arguments. Default ``accumulation``
            (accelerate's ``backward`` and Lightning divide by it); 1 where the loss is already divided.
        history: record every step's scale in force, inf/NaN and largest parameter gradient as
            device scalars (:mod:`fp16probe.capture.history`), what ``fp16probe schedule`` replays.
        target: the device whose fp16 autocast rules say which gradients stay fp32 (left out of
            the ceiling): ``"cuda"`` (default) or ``"cpu"``; None: the run's. Real autocast wins.
        regime: ``"autocast"`` (fp32 weights) or ``"pure_fp16"`` (``.half()``: every gradient fp16).
        block_formats: scaled formats (``"fp8_e4m3"``, ``"mxfp8_e4m3"``, ``"nvfp4"``...) whose
            statistics to count on the GEMM operands of every Linear-like module
            (:mod:`fp16probe.capture.blockcapture`); off by default.
        delayed_recipes: :class:`fp16probe.blockscale.DelayedRecipe` s counted live for FP8
            (default: TransformerEngine's ``DelayedScaling()``).

    Under torch.distributed (a process group of more than one rank at :meth:`start`),
    weight gradients are read once backward has finished, after DDP's all-reduce, so
    they are the gradients the optimizer steps with (see :mod:`fp16probe.capture.distributed`).

    Use as a context manager (hooks are removed on exit, also by exception) or with :meth:`start`/
    :meth:`stop`; call :meth:`step` at each optimizer step and :meth:`report` for the statistics.
    """

    def __init__(self, model: nn.Module, *, modules: Sequence[str] | str | None = None,
                 types: Sequence[type] | type | None = None, activation_grads: bool = True,
                 weight_grads: bool = True, activations: bool = False, forward: bool = True, every: int = 1,
                 scaler: Any = None, precision: str | None = None, granularity: str = "module",
                 shadow_every: int | None = None, history: bool = True, target: str | None = "cuda",
                 regime: str = "autocast", block_formats: Sequence[str] | str | None = None,
                 delayed_recipes: Sequence[Any] | None = None, accumulation: int = 1,
                 loss_divisor: Any = None) -> None:
        check_settings(model, every, activation_grads or weight_grads or activations or forward, granularity,
                        regime, target, shadow_every)
        check_accumulation(accumulation, loss_divisor)
        self.options: dict[str, Any] = dict(
            modules=modules, types=types, activation_grads=activation_grads, weight_grads=weight_grads,
            shadow_every=DEFAULT_SHADOW_EVERY if shadow_every is None else int(shadow_every), history=history,
            block_formats=block_formats, delayed_recipes=delayed_recipes, accumulation=int(accumulation),
            loss_divisor=loss_divisor)
        self.model, self.granularity, self.target, self.regime = model, granularity, target, regime
        self.every, self.scaler = int(every), scaler
        self.capture = {ACTIVATION_GRAD: bool(activation_grads), WEIGHT_GRAD: bool(weight_grads),
                        ACTIVATION: bool(activations)}
        self.patterns = [modules] if isinstance(modules, str) else list(modules or [])
        self._types = tuple(types) if isinstance(types, (list, tuple)) else ((types,) if types else ())
        self.recorder = Recorder(self.capture, every=self.every, scaler=scaler, precision=precision)
        self.recorder.forward = bool(forward)
        self.hooked: list[str] = select_modules(model, self.patterns, self._types, granularity)
        if not self.hooked and not weight_grads:
            raise ProbeError(f"no module of {type(model).__name__} matches modules={self.patterns!r} types="
                             f"{[t.__name__ for t in self._types]!r}; check the names with model.named_modules()")
        self._handles: list[Any] = []
        self._active = False
        self._stopped = False  # stop() was called: step() is an error until start() again
        self.collectors: list[Collector] = [c for make in (*BUILTIN, *COLLECTORS) if (c := make(self)) is not None]

    def add(self, collector: Collector) -> None:
        """Run ``collector`` too, after the others (before :meth:`start`)."""
        self.collectors.append(collector)

    def collector(self, key: str) -> Any:
        """The collector named ``key`` (``"ceiling"``, ``"history"``...), None when it is off."""
        for c in self.collectors:  # no generator: one left unfinished would close inside step()
            if c.key == key:
                return c
        return None

    @property
    def hooked_modules(self) -> tuple[str, ...]:
        """Display names of the selected modules, in the model's order."""
        return tuple(n or ROOT_NAME for n in self.hooked)

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> "Probe":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> "Probe":
        """Register the rows and the hooks. Calling it twice is an error; stop() first."""
        if self._active:
            raise ProbeError("this Probe is already started")
        self._stopped = False
        # DDP all-reduces weight gradients after their accumulate hooks fire: read them later.
        self.recorder.defer_to_ddp = _distributed.is_distributed()
        for c in self.collectors:
            c.start()
        self._active = self.recorder.enabled = True
        if self.recorder.sampling:
            self._attach()
        return self

    def stop(self) -> "Probe":
        """Remove every hook. Collected statistics stay for :meth:`report`."""
        self._active = self.recorder.enabled = False
        self._stopped = True
        self._detach()
        for c in reversed(self.collectors):
            c.stop()
        return self

    @property
    def active(self) -> bool:
        """Whether the Probe is started."""
        return self._active

    def _attach(self) -> None:
        """Register the step's hooks (sampled steps only: unsampled steps run no hook at all)."""
        if self._handles:
            return
        try:
            for c in self.collectors:
                c.sample(self._handles)
        except BaseException:
            self._detach()
            raise

    def _detach(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            with contextlib.suppress(Exception):  # a hook handle whose owner is gone
                h.remove()

    # -- steps -----------------------------------------------------------------------
    def step(self) -> None:
        """Mark a step boundary (call once per optimizer step).

        Closing the step is atomic: a KeyboardInterrupt anywhere in here leaves the
        step either open or closed, so a partial report is always consistent.
        After :meth:`stop` it closes what was recorded before, and raises ProbeError on an empty step.
        """
        if self._stopped and not self.recorder.step_open:
            raise ProbeError("Probe.step() after stop() would count an empty step; call start() again first")
        self.recorder.close_forward()
        sampled = self.recorder.sampling
        for c in self.collectors:
            c.close_step(sampled)
        self.recorder.close_step()
        if self._active:
            if self.recorder.sampling:
                self._attach()
            else:
                self._detach()

    def discard_step(self) -> None:
        """Drop what the open step recorded so far (a step another rank never finished)."""
        for c in self.collectors:
            c.discard_step()
        self.recorder.discard_step()

    def watch(self, loss: torch.Tensor) -> None:
        """Also cover the gradients between the model's output and ``loss`` in the overflow ceiling.

        Call it before ``loss.backward()`` when code outside the model sits between its output and the
        loss (the output's own gradient is covered without it). Costs no host sync.
        """
        ceiling = self.collector("ceiling")
        if ceiling is not None and self._active:
            ceiling.hooks.watch(iter_tensors(loss))

    def shadow(self, compute_loss: Any) -> bool:
        """Rerun this step's batch in fp32 as the reference, if this step is a shadowed one.

        ``compute_loss()`` runs the forward and the loss for the step's batch and returns the loss (the
        Probe runs it with every autocast off). Call it every step, before the optimizer step (the weights
        must be those the step used): on steps that are not shadowed it returns False at once. Called before
        the step's own forward, dropout draws the same masks in both. Only needed when the loss is computed
        outside the model. Gradients, buffers and random state are restored.
        """
        reruns = self.collector("shadow")
        if reruns is None or not self._active:
            return False
        return bool(reruns.shadow.run(compute_loss))

    @property
    def steps_seen(self) -> int:
        """Steps with data so far (the open one included when it holds data)."""
        return self.recorder.steps_seen

    # -- report ------------------------------------------------------------------------
    def report(self, *, partial: bool = False, extra: Mapping[str, Any] | None = None,
               since_step: int | None = None) -> Report:
        """Bring the statistics to the host (one transfer per table) and return a Report.

        A step still open (not yet closed by :meth:`step`) is included without closing it: no value counts
        twice. ``since_step``: the trace and history hold the steps from that one on (module totals, the
        shadow and the evidence stay whole), as :class:`~fp16probe.integrations.live.LiveLogger` asks.
        ``extra``: the caller's own metadata. This synchronises with the device: not in the hot path.
        """
        for c in self.collectors:  # each folds what the open step saw before the recorder reads
            c.flush()
        got = self.recorder.collect({n: i for i, n in enumerate(self.hooked_modules)}, since_step=since_step)
        view = Collected(trace=got.trace, modules=got.modules, maxima=got.maxima, since_step=since_step)
        sections = view.sections
        for c in self.collectors:
            sections.update(c.collect(view))
        sections["capture"] = capture_notes(self, got, view)
        metadata = metadata_of(self, got, steps_seen=len(view.trace), partial=partial, extra=extra)
        return with_workload(Report(metadata=metadata, modules=view.modules, trace=view.trace).with_sections(sections))
