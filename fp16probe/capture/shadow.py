"""The fp32 shadow step: the same batch recomputed in fp32, so a live fp16 run can be judged.

Under fp16 autocast a gradient that flushed is an exact zero, and so is a structural one
(the logit gradient at a sequence's last position, an embedding row no token used): the
live histograms cannot tell them apart. On a few scheduled steps (:func:`shadow_due`) the
:class:`Shadow` reruns the step's forward and backward in fp32 on the same device, with the
same weights and the same random state, and records what it sees with a second, fp32
Probe. That fp32 record is the reference the analysis judges the run by: a value zero in
both runs is structural, a value zero only in the live run flushed.

Which steps are rerun is decided from what the step computes, not from the autocast state
before the model is called: an enabled fp16/bf16 autocast around the call, one wrapped
around the forward itself (accelerate's ``convert_outputs_to_fp32(autocast(forward))``,
``torch.autocast(...)(forward)``), or low-precision outputs the live Probe already saw. A
rerun runs with every autocast context disabled, those the model enters itself included
(:func:`autocast_off`), and its outputs are checked: a rerun in which any module returned
fp16 or bf16 values, or whose loss is not fp32, is discarded with the module and dtype
named (``Shadow.discarded``), never recorded as a reference.

The rerun leaves training exactly as it was: it runs inside
:func:`fp16probe.capture.state.kept_training_state`, which puts back the parameters' ``.grad``
(the very tensors), the model's buffers (BatchNorm statistics) and the CPU and CUDA random
states, and no optimizer steps. Training with a shadow is bit-identical to training without one.

Where the batch comes from: by default the model's own forward call is replayed (its
arguments, seen by a forward pre-hook at the first forward of a shadowed step) and the
loss is the one the model returns (a 0-d tensor, ``output.loss`` or ``output["loss"]``,
as Hugging Face models return with labels). A model whose loss is computed outside it needs
``Probe.shadow(fn)``: ``fn()`` runs forward and loss for the batch (without entering
autocast itself) and returns the loss; the Probe calls it only on shadowed steps.

Gradient accumulation (``Probe(accumulation=N)``): the live step's gradients are those of N
micro-batches, each backpropagating its loss divided as the framework divides it (accelerate
and Lightning: loss / N). A shadowed step then reruns each of its first N micro-batches (each
forward the step replays, or each ``Probe.shadow(fn)`` call), each loss divided by the
``loss_divisor`` (default N) before its fp32 backward, and accumulates their gradients in
``.grad`` as training does, apart from training's own (:class:`RerunGradients`): the rerun step
holds what the live step holds, the N micro-batches' output gradients and the accumulated
weight gradients, of the loss each micro-batch backpropagates. A micro-batch whose rerun fails
or is discarded drops the whole rerun step, which then is no reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Union

import torch
from torch import nn

from fp16probe.capture.autocast_rules import around_autocast
from fp16probe.capture.collector import Collected, Collector
from fp16probe.capture.compiled import eager, runs_compiled, tracing
from fp16probe.capture.recorder import iter_tensors
from fp16probe.capture.state import kept_training_state
from fp16probe.capture.unsharded import UnshardedCopy, fsdp2_low_precision, is_fsdp2
from fp16probe.report import WEIGHT_GRAD
from fp16probe.sections import PrecisionCost, ShadowRuns

__all__ = ["DEFAULT_SHADOW_EVERY", "EARLY_SHADOWS", "LossDivisor", "RerunGradients", "Shadow", "ShadowReruns",
           "autocast_off", "divisor_of", "forward_autocast", "loss_of", "shadow_due"]

DEFAULT_SHADOW_EVERY = 50
# Sampled steps shadowed before the regular schedule starts, so a short run has a reference
# early and more than one: with every=50, sampled steps 0, 1, 2, 4, 8, 16, 32, then 50, 100, ...
EARLY_SHADOWS = (0, 1, 2, 4, 8, 16, 32)


def shadow_due(sampled: int, every: int) -> bool:
    """Whether the ``sampled``-th sampled step (0-based) is shadowed with ``shadow_every=every``.

    The early steps of :data:`EARLY_SHADOWS` below ``every``, then every ``every``-th.
    ``every=0`` never shadows.
    """
    if every <= 0:
        return False
    return sampled % every == 0 or (sampled < every and sampled in EARLY_SHADOWS)


def next_due(sampled: int, every: int) -> int | None:
    """The first sampled index at or after ``sampled`` that is shadowed (None: never)."""
    if every <= 0:
        return None
    i = sampled
    while not shadow_due(i, every):
        i += 1
    return i


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss a model's output carries: a 0-d tensor, ``.loss``, ``["loss"]``, or a 0-d first element."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 and output.is_floating_point() else None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return loss_of(output[0])
    return None


LOW_PRECISION = (torch.float16, torch.bfloat16)

# What a micro-batch's loss is divided by before its backward: a number, or a function of the
# replayed forward's keyword arguments (the Hugging Face Trainer divides only a loss the model did
# not already normalise by ``num_items_in_batch``); None: by the accumulation count.
LossDivisor = Union[float, Callable[[Mapping[str, Any]], float], None]


def divisor_of(loss_divisor: LossDivisor, accumulation: int, kwargs: Mapping[str, Any]) -> float:
    """The number a rerun divides its loss by: ``loss_divisor`` (called on the replayed ``kwargs``), else ``accumulation``."""
    if loss_divisor is None:
        return float(accumulation)
    return float(loss_divisor(kwargs) if callable(loss_divisor) else loss_divisor)


class RerunGradients:
    """The reruns' own accumulated ``.grad`` across the micro-batches of one shadowed step.

    Each micro-batch reruns inside :func:`~fp16probe.capture.state.kept_training_state`, which hands
    it ``.grad`` = None and puts training's gradients back after. :meth:`resume` gives the rerun the
    gradients the step's earlier reruns accumulated (their backward adds to them, as training's
    does), :meth:`keep` takes them before training's come back. One fp32 copy of the gradients
    lives while an accumulated step is rerun; :meth:`clear` lets it go.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    def resume(self) -> None:
        """Put the step's rerun gradients so far into ``.grad`` (inside the rerun's kept state)."""
        for p, g in self._grads:
            p.grad = g

    def keep(self) -> None:
        """Take the rerun's ``.grad`` (inside the rerun's kept state, before training's is put back)."""
        self._grads = [(p, p.grad) for p in self.model.parameters() if p.requires_grad]

    def clear(self) -> None:
        """Forget them (the rerun step closed or was dropped)."""
        self._grads = []


def forward_autocast(forward: Any) -> Any:
    """The enabled fp16/bf16 ``torch.autocast`` a forward is wrapped in, or None.

    Follows ``__func__``, ``__wrapped__`` and accelerate's ``ConvertOutputsToFp32.model_forward``
    down the chain, and looks in each function's closure for the autocast instance that
    ``torch.autocast(...)(fn)`` (and so accelerate's ``prepare``) keeps there.
    """
    fn = forward
    for _ in range(16):  # a wrapper chain longer than this is not one we know
        if fn is None:
            return None
        fn = getattr(fn, "__func__", fn)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if (isinstance(value, torch.amp.autocast_mode.autocast) and getattr(value, "_enabled", False)
                    and value.fast_dtype in LOW_PRECISION):
                return value
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "model_forward", None)
    return None


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Disable every ``torch.autocast`` entered inside, on every device, those a model enters itself too.

    ``torch.autocast(..., enabled=False)`` alone is undone by an autocast the forward enters
    inside it; here each one this thread enters while the block runs enters disabled
    (:func:`~fp16probe.capture.autocast_rules.around_autocast`: other threads' autocast is left
    as written, and the class is as it was once the last such block on any thread ends).
    """
    def disabled_enter(enter: Any, ctx: Any) -> Any:
        saved = ctx._enabled
        ctx._enabled = False
        try:
            return enter(ctx)
        finally:
            ctx._enabled = saved

    with around_autocast(disabled_enter):
        yield


class _DtypeCheck:
    """While a rerun runs: the first module whose output holds fp16 or bf16 values (a global forward hook)."""

    def __init__(self) -> None:
        self.found: dict[str, str] | None = None
        self._names: dict[int, str] = {}

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.found is not None:
            return
        for t in iter_tensors(output):
            if t.is_floating_point() and t.dtype in LOW_PRECISION:
                self.found = {"module": self._names.get(id(module), type(module).__name__),
                              "dtype": str(t.dtype).replace("torch.", "")}
                return

    @contextlib.contextmanager
    def watching(self, model: nn.Module) -> Iterator["_DtypeCheck"]:
        self._names = {id(m): (n or type(model).__name__) for n, m in model.named_modules()}
        handle = torch.nn.modules.module.register_module_forward_hook(self)
        try:
            yield self
        finally:
            handle.remove()


class Shadow:
    """Run scheduled fp32 reruns of training steps into an fp32 Probe (see the module docstring).

    Args:
        model: the probed model.
        probe: a Probe on ``model`` without scaler or shadow, recording in fp32; started
            only while a rerun runs.
        every: the schedule's period in sampled steps (:func:`shadow_due`).
        live: the live Probe's recorder, silenced while a rerun runs.
        accumulation: micro-batches per optimizer step; a shadowed step reruns each of them.
        loss_divisor: what each micro-batch's loss is divided by before its backward
            (:data:`LossDivisor`; default ``accumulation``).
    """

    def __init__(self, model: nn.Module, probe: Any, every: int, live: Any, *, accumulation: int = 1,
                 loss_divisor: LossDivisor = None) -> None:
        self.model = model
        self.probe = probe
        self.every = int(every)
        self.live = live
        self.accumulation = int(accumulation)
        self.loss_divisor = loss_divisor
        self.divisors: set[float] = set()  # the divisors the recorded reruns applied
        self._micro = 0  # micro-batches of the open step rerun so far (its rerun step is open while > 0)
        self._explicit = False  # Probe.shadow(fn) was called: forward calls are no longer replayed
        self._rerun_grads = RerunGradients(model)
        self.steps: list[int] = []  # live step numbers that were shadowed
        self.seconds = 0.0  # host time spent in reruns (CPU: the cost; CUDA: see events)
        self._events: list[tuple[Any, Any]] = []  # CUDA start/end events, read at report time
        self.skipped: str | None = None  # why the default rerun could not run, once seen
        # reruns thrown away because they did not run in fp32: {"step", "module", "dtype"} each
        self.discarded: list[dict[str, Any]] = []
        self._sampled = 0  # sampled steps closed so far
        self._done_this_step = False
        self._running = False
        self._handle: Any = None
        # the live gradients against the reruns' (PrecisionCostMeter); off under DDP (ShadowReruns.start)
        self.precision_cost: PrecisionCostMeter | None = PrecisionCostMeter(live)
        # under FSDP2: what builds the fp32 Probe on an unsharded copy (rerun_on_copy), and that copy, made at the
        # first rerun (a run that never reruns never holds the model's full weights)
        self._reference_on: Callable[[nn.Module], Any] | None = None
        self.copy: UnshardedCopy | None = None

    def rerun_on_copy(self, reference_on: Callable[[nn.Module], Any]) -> None:
        """Under FSDP2: rerun on an unsharded fp32 copy of the model (its forward replayed with the model's
        arguments), recorded by ``reference_on(copy)``; the copy is made at the first rerun."""
        self._reference_on = reference_on

    @property
    def sharded(self) -> bool:
        """Whether the reruns run on an unsharded copy (FSDP2)."""
        return self._reference_on is not None

    def _copy(self) -> UnshardedCopy:
        if self.copy is None:
            assert self._reference_on is not None
            self.copy = UnshardedCopy(self.model)
            self.probe = self._reference_on(self.copy.module)
            self._rerun_grads = RerunGradients(self.copy.module)
        return self.copy

    @property
    def rerun_model(self) -> nn.Module:
        """The module a rerun's gradients land on: the model, or under FSDP2 its unsharded copy."""
        return self.model if self.copy is None else self.copy.module

    # -- lifecycle ----------------------------------------------------------------------
    def attach(self) -> None:
        """Watch the model's forward calls, to replay the first one of a shadowed step."""
        if self._handle is None and self.every > 0:
            self._handle = self.model.register_forward_pre_hook(self._pre_hook, prepend=True, with_kwargs=True)

    def detach(self) -> None:
        """Stop watching forward calls."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def close_step(self, sampled: bool) -> None:
        """A step ended; count it when it was sampled. A rerun step still open (fewer micro-batches than
        ``accumulation``, as at an epoch's end) closes with those the live step had."""
        if self._micro:
            self._close_rerun_step()
        if sampled:
            self._sampled += 1
        self._done_this_step = False

    @property
    def due(self) -> bool:
        """Whether the open step is to be shadowed (and has not been yet, or has micro-batches left to rerun)."""
        return (not self._done_this_step and self.live.sampling and self.live.enabled
                and shadow_due(self._sampled, self.every))

    def _close_rerun_step(self) -> None:
        """Close the fp32 Probe's step over the micro-batches rerun, with their gradients in ``.grad``."""
        try:
            with kept_training_state(self.model), self._kept_copy():
                self._rerun_grads.resume()
                self.probe.step()
        finally:
            self._micro = 0
            self._rerun_grads.clear()

    def _drop_rerun_step(self) -> None:
        """A micro-batch's rerun recorded nothing (it failed, was discarded, or found no loss): drop what the
        fp32 Probe's open step holds, the step's earlier micro-batches too (they are no reference alone)."""
        self.probe.discard_step()
        if self._micro and self.steps and self.steps[-1] == self.live.step_index:
            self.steps.pop()
        self._micro = 0
        self._rerun_grads.clear()

    def next_step(self) -> int | None:
        """The live step number of the next shadowed step, from the open one on."""
        i = next_due(self._sampled + (1 if self._done_this_step else 0), self.every)
        return None if i is None else i * self.live.every

    def _kept_copy(self) -> contextlib.AbstractContextManager[None]:
        """The unsharded copy's state kept as training's is (its ``.grad`` None again after a rerun step)."""
        return contextlib.nullcontext() if self.copy is None else kept_training_state(self.copy.module)

    # -- the rerun ------------------------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if tracing():  # a module inside torch.compile: its compiled caller is replayed, or probe.shadow(fn)
            self.live.compile_seen.traced = True
            return
        if self._running or self._explicit or not self.due or not torch.is_grad_enabled():
            return
        device = _device_of(args, kwargs, module)
        if not self._computes_low_precision(module, device):
            return  # an fp32 run needs no reference; a .half() model has no fp32 weights to rerun with
        try:  # the unsharded copy too is made here, where nothing it raises can break training
            target = self._copy().module if self.sharded else _replayed(module)
            self.run(lambda: target(*args, **kwargs), device, replayed=True, kwargs=kwargs)
        except Exception as e:  # a rerun must never break training
            self.live.note_error(e)
        if self.skipped is not None:  # the model returns no loss: stop replaying its calls
            self.detach()

    def _computes_low_precision(self, module: nn.Module, device: torch.device) -> bool:
        """Whether this forward computes under fp16/bf16 autocast with fp32 weights (a rerun can judge it).

        Autocast on around the call, wrapped around the forward (accelerate, a decorator), or
        seen by the live Probe in the outputs of an earlier step (a model that enters it itself).
        """
        param = next(module.parameters(), None)
        if param is not None and param.dtype in LOW_PRECISION:
            return False  # a .half() model: no fp32 weights to rerun with
        if self.sharded and fsdp2_low_precision(module):
            return True  # FSDP2 computes in its policy's param_dtype
        if torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) in LOW_PRECISION:
            return True
        if forward_autocast(module.forward) is not None:
            return True
        return "autocast" in str(getattr(self.live, "precision", None) or "")

    def run(self, compute_loss: Callable[[], Any], device: torch.device | None = None, *,
            replayed: bool = False, kwargs: Mapping[str, Any] | None = None) -> bool:
        """Rerun one step, or one micro-batch of it, in fp32 (``compute_loss()`` returns the loss or a model
        output that carries it; ``kwargs``: the replayed forward's, for a ``loss_divisor`` function).

        Returns whether a rerun was recorded. Everything training sees is restored after.
        """
        if self._running or not self.due:
            return False
        if self.sharded and not replayed:  # fn() would call the sharded model, in its policy's dtype
            self.skipped = ("under FSDP2 the reruns replay the model's own forward on an unsharded fp32 copy; "
                            "probe.shadow(fn) calls the sharded model, which computes in the policy's param_dtype: "
                            "let the model return its loss (a 0-d tensor, .loss or ['loss']) and drop probe.shadow")
            return False
        device = device or _device_of((), {}, self.model)
        live_enabled = self.live.enabled
        timer = _Timer(device)
        divisor = divisor_of(self.loss_divisor, self.accumulation, kwargs or {})
        # The loop gives the loss itself (Probe.shadow): replaying its forward calls too would rerun a
        # micro-batch twice, so from now on only its calls rerun.
        self._explicit = self._explicit or not replayed
        self._running = True
        self._done_this_step = True
        recorded = False
        try:
            self.live.enabled = False  # the live Probe's hooks stay quiet during the rerun
            check = _DtypeCheck()
            # kept_training_state is left last: the fp32 Probe's step reads the rerun's .grad first
            # eager(): compiled code the rerun calls runs uncompiled, so the rerun's autocast state makes
            # dynamo neither recompile nor fall back to eager for the live steps (compiled.py)
            with (kept_training_state(self.model), self._kept_copy(), eager(), _quiet_compile_wrapper(),
                  autocast_off(), torch.autocast(device.type, enabled=False), check.watching(self.rerun_model)):
                if self.copy is not None:
                    self.copy.refresh()  # training's weights, whole and in fp32 (every rank: an all-gather)
                self._rerun_grads.resume()  # the step's earlier micro-batches' rerun gradients
                self.probe.start()
                try:
                    loss = loss_of(compute_loss())
                    if loss is not None and check.found is None and loss.dtype in LOW_PRECISION:
                        check.found = {"module": "the loss", "dtype": str(loss.dtype).replace("torch.", "")}
                    if check.found is not None:  # not an fp32 rerun: never a reference
                        self.discarded.append({"step": self.live.step_index, **check.found})
                    elif loss is None and replayed:
                        self.skipped = ("the model's output carries no loss (no 0-d tensor, .loss or ['loss']); "
                                        "call probe.shadow(fn) with fn() returning the loss of the batch")
                    elif loss is not None and loss.requires_grad:
                        divided_loss(loss, divisor).backward()
                        recorded = True
                        if self.precision_cost is not None:  # each micro-batch's: the last one's is compared
                            self.precision_cost.keep_reference(self.rerun_model,
                                                               last=self._micro + 1 >= self.accumulation)
                finally:
                    self.probe.stop()
                    self._end_micro_batch(recorded)
        finally:
            self.live.enabled = live_enabled
            self._running = False
            self.seconds += timer.stop(self._events)
        if recorded:
            self.divisors.add(divisor)
            self.skipped = None
            if self._micro and self._micro < self.accumulation:
                self._done_this_step = False  # the step's next micro-batch reruns too
        elif replayed and self.accumulation == 1:
            # an explicit probe.shadow(fn) may still rerun this step (not an accumulated step's later
            # micro-batch: a rerun step of some of its micro-batches is no reference)
            self._done_this_step = False
        return recorded

    def _end_micro_batch(self, recorded: bool) -> None:
        """After a micro-batch's rerun (inside its kept state): keep its gradients, close the rerun step
        after the last micro-batch; a micro-batch that recorded nothing drops the step's rerun."""
        if not recorded:  # e.g. a replay that found no loss recorded only its forward: drop it, or the
            self._drop_rerun_step()  # reference would hold a step no rerun is listed for
            return
        if not self._micro:
            self.steps.append(self.live.step_index)
        self._micro += 1
        if self._micro < self.accumulation:
            self._rerun_grads.keep()
            return
        try:
            self.probe.step()
        finally:
            self._micro = 0
            self._rerun_grads.clear()

    def cost(self) -> dict[str, Any]:
        """What the reruns cost: their number and time (CUDA: measured by events, a sync here)."""
        seconds = self.seconds
        if self._events:
            torch.cuda.synchronize()
            seconds = sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
        return {"count": len(self.steps), "seconds": seconds,
                "clock": "cuda events" if self._events else "host wall time"}


def divided_loss(loss: torch.Tensor, divisor: float) -> torch.Tensor:
    """The fp32 loss a micro-batch backpropagates: ``loss`` divided as the framework divides it."""
    loss = loss.float()
    return loss if divisor == 1 else loss / divisor


@contextlib.contextmanager
def _quiet_compile_wrapper() -> Iterator[None]:
    """Keep torch's warning about a global module hook (the rerun's dtype check) off a ``probe.shadow(fn)`` whose
    ``fn`` calls a torch.compile wrapper: the wrapper runs uncompiled here, the extra hook call is harmless."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        yield


class _Timer:
    """Wall time on the host; on CUDA a pair of events (read later, without a sync now)."""

    def __init__(self, device: torch.device) -> None:
        self.t0 = time.perf_counter()
        self.start = None
        if device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def stop(self, events: list[tuple[Any, Any]]) -> float:
        if self.start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((self.start, end))
            return 0.0
        return time.perf_counter() - self.t0


def _replayed(module: nn.Module) -> nn.Module:
    """The module a rerun calls for ``module``: through a torch.compile wrapper (the rerun runs uncompiled anyway)
    and through DDP, whose forward would run collectives (a rerun runs on this rank alone)."""
    for _ in range(4):  # DDP(torch.compile(model)) and the like: a few wrappers deep at most
        if runs_compiled(module) and isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module = module._orig_mod
        elif type(module).__name__ == "DistributedDataParallel" and isinstance(module.module, nn.Module):
            module = module.module
        else:
            break
    return module


def _device_of(args: Any, kwargs: Any, model: nn.Module) -> torch.device:
    for t in iter_tensors((args, kwargs)):
        return t.device
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _reference_probe(probe: Any, *, weight_grads: bool, model: nn.Module | None = None) -> Any:
    """The fp32 Probe the reruns record into: the live Probe's modules and kinds, no scaler, no reruns of its own
    (on ``model``, the unsharded copy under FSDP2; default the live Probe's model)."""
    o = probe.options
    reference = type(probe)(probe.model if model is None else model, modules=o["modules"], types=o["types"],
                            activation_grads=o["activation_grads"], weight_grads=weight_grads,
                            activations=False, scaler=None, precision="fp32", granularity=probe.granularity,
                            target=probe.target, shadow_every=0, history=False)
    # The reruns run uncompiled (compiled.eager): the live Probe alone says what torch.compile leaves out.
    reference.collectors = [c for c in reference.collectors if c.key != "compiled"]
    return reference


def rank_local_rerun_off(model: nn.Module) -> str | None:
    """Under torch.distributed: why an fp32 rerun cannot run on this rank alone, or None where it can.

    DDP: it can. Its collectives run in ``DistributedDataParallel.forward`` around the wrapped
    module's call and in the reducer's hooks, which act only on a backward that forward prepared;
    a rerun of the wrapped module (``ddp.module``) runs neither. FSDP2 (``fully_shard``): on an
    unsharded fp32 copy (:mod:`fp16probe.capture.unsharded`), whose weights each rerun gathers on every
    rank at once. FSDP (the first one, ``FullyShardedDataParallel``): it cannot. Its forward all-gathers
    the flattened parameters in the mixed-precision policy's dtype and its backward reduce-scatters them.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without torch.distributed: nothing is sharded
        return None
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return ("not under FSDP (FullyShardedDataParallel): a rerun would all-gather the flattened parameters, in "
                "the mixed-precision policy's dtype, and reduce-scatter their gradients; FSDP2 (fully_shard) gets "
                "reruns, or for the fp32 reference run fp16probe profile on one process with the unsharded model "
                "and the same batches")
    return None


class PrecisionCostMeter:
    """The precision cost of the live weight gradients, measured against the fp32 rerun of the same step.

    After a rerun's backward :meth:`keep_reference` clones its fp32 gradients; the live backward that
    follows, on the same batch and weights, meets them in each parameter's post-accumulate-grad hook,
    which sums ``||g_live * inv_scale - g_fp32||^2`` and ``||g_fp32||^2`` in device scalars (no host
    sync); :meth:`close_step` drops the clones. Gradient accumulation: the last backward's ``.grad``
    is compared, as the weight histograms count it. Not under DDP (the live gradients are all-reduced).
    """

    def __init__(self, live: Any) -> None:
        self.live = live
        self._reference: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
        self._handles: list[Any] = []
        self._sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # this step's, by parameter
        self.steps: list[int] = []
        self.rows: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []  # one per step in steps
        self.order: dict[str, None] = {}  # the parameters in the model's order
        self._previous: dict[str, torch.Tensor] = {}  # the last rerun's fp32 gradients
        self._step_noise: tuple[Any, Any] | None = None  # this rerun's change since the last (device scalars)
        self.noise: list[tuple[Any, Any] | None] = []  # one per step in steps

    def keep_reference(self, model: nn.Module, *, last: bool = True) -> None:
        """Clone the rerun's fp32 gradients and hook the live backward that follows.

        Also, on a step's ``last`` micro-batch (every step's, without accumulation), the fp32 gradients'
        own change since the previous rerun (another batch, weights a few steps on):
        ``||g_fp32 - g_fp32_before||^2`` and ``||g_fp32||^2``, the noise the cost is judged by. An
        earlier micro-batch's ``.grad`` holds part of the step's sum, no gradient to compare steps by.
        """
        self.drop()
        self._reference = {n: (p, p.grad.detach().float().clone()) for n, p in model.named_parameters()
                           if p.requires_grad and p.grad is not None and p.grad.layout == torch.strided
                           and type(p.grad) is torch.Tensor}
        self.order.update(dict.fromkeys(self._reference))
        if last:
            before = self._previous
            pairs = [(ref, before[n]) for n, (_, ref) in self._reference.items()
                     if n in before and before[n].shape == ref.shape]
            self._step_noise = None if not pairs or len(pairs) != len(self._reference) else (
                sum((ref - old).pow(2).sum() for ref, old in pairs), sum(ref.pow(2).sum() for ref, _ in pairs))
            self._previous = {n: ref for n, (_, ref) in self._reference.items()}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(n, ref))
                         for n, (p, ref) in self._reference.items()]

    def _hook(self, name: str, ref: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p.grad is None or not self.live.enabled:
                return
            try:
                g = p.grad.detach().float()
                inv = self.live.inv_scale(g.device)
                if inv is not None:
                    g = g * inv
                self._sums[name] = ((g - ref).pow(2).sum(), ref.pow(2).sum())
            except Exception as e:  # bookkeeping must never break training
                self.live.note_error(e)

        return hook

    def close_step(self, step: int | None) -> None:
        """Keep what the step measured (``step``: the rerun step it belongs to, None: none) and unhook."""
        if step is not None and self._sums:
            self.steps.append(step)
            self.rows.append(dict(self._sums))
            self.noise.append(self._step_noise)
        self.drop()

    def drop(self) -> None:
        """Unhook and forget the fp32 gradients kept."""
        for h in self._handles:
            h.remove()
        self._handles, self._reference, self._sums, self._step_noise = [], {}, {}, None

    def section(self, precision: str) -> PrecisionCost | None:
        """The measurements as the report's ``precision_cost`` section (one host transfer a step), or None."""
        if not self.steps:
            return None
        names = [n for n in self.order if any(n in row for row in self.rows)]
        per: dict[str, list[float | None]] = {n: [] for n in names}
        whole: list[float | None] = []
        for row in self.rows:
            values = torch.stack([torch.stack(row[n]) for n in row]).double().cpu().tolist() if row else []
            err = ref = 0.0
            got = dict(zip(row, values))
            for n in names:
                if n not in got:
                    per[n].append(None)
                    continue
                e, r = got[n]
                per[n].append(math.sqrt(e / r) if r > 0 and math.isfinite(e) else None)
                err, ref = err + e, ref + r
            whole.append(math.sqrt(err / ref) if ref > 0 and math.isfinite(err) else None)
        noise: list[float | None] = []
        for pair in self.noise:
            d, r = (None, None) if pair is None else torch.stack(pair).double().cpu().tolist()
            noise.append(math.sqrt(d / r) if r and d is not None and math.isfinite(d) else None)
        return PrecisionCost(precision=precision, steps=tuple(self.steps),
                             relative_l2={n: tuple(v) for n, v in per.items()}, whole=tuple(whole),
                             fp32_change=tuple(noise))


class ShadowReruns(Collector):
    """The fp32 reruns as a collector: the ``shadow`` section (their statistics) and ``shadow_runs`` (schedule, cost)."""

    key = "shadow"

    def __init__(self, probe: Any, every: int) -> None:
        self.probe = probe
        self.live = probe.recorder
        o = probe.options
        self.shadow = Shadow(probe.model, _reference_probe(probe, weight_grads=o["weight_grads"]), every,
                             probe.recorder, accumulation=o.get("accumulation", 1), loss_divisor=o.get("loss_divisor"))
        self.off: str | None = None  # why no rerun can run in this set-up (start())

    def start(self) -> None:
        """Watch the model's forward calls, where a rerun can run on this rank alone (:func:`rank_local_rerun_off`).

        Under DDP the reruns record no weight gradients: the live ones are averaged over the ranks by the
        all-reduce, a rank-local rerun's are this rank's alone, so they are not the same tensor. The output
        gradients are this rank's in both, and carry the reference.
        """
        self.off = rank_local_rerun_off(self.shadow.model) if self.live.defer_to_ddp else None
        if self.off is None and not self.shadow.sharded and is_fsdp2(self.shadow.model):
            self.shadow.rerun_on_copy(lambda copy: _reference_probe(self.probe, weight_grads=False, model=copy))
        if self.live.defer_to_ddp and not self.shadow.steps and self.shadow.probe.capture[WEIGHT_GRAD]:
            self.shadow.probe = _reference_probe(self.probe, weight_grads=False)
        if self.live.defer_to_ddp:  # the live weight gradients are all-reduced: not this rank's to compare
            self.shadow.precision_cost = None
        if self.off is None:
            self.shadow.attach()

    def stop(self) -> None:
        """Stop watching, and drop the fp32 gradients kept for a live backward that will not come."""
        self.shadow.detach()
        if self.shadow.precision_cost is not None:
            self.shadow.precision_cost.drop()

    def close_step(self, sampled: bool) -> None:
        """Count the step when it was sampled; keep its precision cost when it was rerun."""
        sh = self.shadow
        if sh.precision_cost is not None:
            rerun = bool(sh.steps) and sh.steps[-1] == self.live.step_index
            sh.precision_cost.close_step(self.live.step_index if rerun else None)
        sh.close_step(sampled)

    def collect(self, got: Collected) -> dict[str, Any]:
        """The reruns as a report of their own, their steps numbered as the live run's, and their schedule."""
        sh = self.shadow
        off = self.off or sh.skipped
        if off is None and not sh.steps and self.live.compile_seen.traced:
            off = ("the model's forward ran inside torch.compile, where it is not replayed; call probe.shadow(fn), "
                   "or give the Probe the torch.compile(model) wrapper")
        cost = sh.cost()
        out: dict[str, Any] = {"shadow_runs": ShadowRuns(every=sh.every, steps=tuple(sh.steps), count=cost["count"],
                                                         seconds=cost["seconds"], clock=cost["clock"],
                                                         next_step=sh.next_step(), off=off,
                                                         discarded=tuple(dict(x) for x in sh.discarded),
                                                         accumulation=sh.accumulation,
                                                         loss_divisors=tuple(sorted(sh.divisors)))}
        cost = None if sh.precision_cost is None else sh.precision_cost.section(str(self.live.precision or ""))
        if cost is not None:
            out["precision_cost"] = cost
        if sh.steps:
            ref = sh.probe.report()
            steps = tuple(sh.steps[: len(ref.trace)])
            out["shadow"] = dataclasses.replace(
                ref, trace=dataclasses.replace(ref.trace, steps=steps),
                metadata=dataclasses.replace(ref.metadata, steps_total=len(steps), steps_seen=len(steps)))
        return out
