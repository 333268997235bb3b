"""The Probe: builds its collectors, loops over them at each step, and makes the Report.

Each measurement is a collector (:mod:`fp16probe.capture.collector`): the module hooks that feed
the :class:`~fp16probe.capture.recorder.Recorder`, the forward headroom, op capture, the overflow
ceiling, the history, the fp32 reruns and the scaled-format statistics. The Probe knows none of
them by name: it starts, samples, closes and collects each in turn. Counts stay on the device;
nothing in a hook synchronises with the host. Everything comes to the host once, in
:meth:`Probe.report`.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fp16probe._version import __version__
from fp16probe.capture import distributed as _distributed
from fp16probe.capture.overflow import CeilingCollector
from fp16probe.capture.collector import COLLECTORS, Collected, Collector
from fp16probe.capture.history import History
from fp16probe.capture.modules import ForwardHeadroom, ModuleHooks, select_modules
from fp16probe.capture.ops import OpRecording
from fp16probe.capture.recorder import ROOT_NAME, Recorder, iter_tensors
from fp16probe.capture.shadow import DEFAULT_SHADOW_EVERY, ShadowReruns
from fp16probe.errors import ProbeError
from fp16probe.report import ACTIVATION, ACTIVATION_GRAD, KINDS, WEIGHT_GRAD, Metadata, Report
from fp16probe.sections import CaptureNotes

__all__ = ["ROOT_NAME", "Probe", "iter_tensors", "select_modules"]

GRANULARITIES = ("module", "op")


class Probe:
    """Capture log2 histograms of a model's gradients during training.

    Args:
        model: the module to probe.
        modules: name patterns (``fnmatch``, e.g. ``"encoder.*.attn*"``) of the modules
            to hook. Default: every leaf module (no double counting through containers).
        types: hook only modules of these classes (combined with ``modules``).
        activation_grads: capture the gradient w.r.t. each hooked module's output.
        weight_grads: capture each parameter's accumulated gradient.
        activations: also capture histograms of forward outputs.
        forward: keep each hooked module's largest forward output (one ``amax`` per output,
            on the device) and the step's largest, so the analysis can see forward values
            that pass fp16's max (inf at every loss scale). On by default.
        every: sample every Nth step (counted by :meth:`step`); others cost nothing.
        scaler: what scales the loss, when something does: a ``torch.amp.GradScaler``,
            a DeepSpeed engine, its fp16 optimizer (``loss_scale``: the current dynamic
            scale) or its loss scaler (``cur_scale``), a Megatron (``scale``) loss scaler, a fixed
            number or tensor, or a function returning the scale (see
            :mod:`fp16probe.capture.scale`). Gradients seen in backward are then scaled;
            the Probe records them unscaled, reading the scale once per step without a
            host sync. An object it cannot read a scale from raises ProbeError here.
        precision: what the run computes in, for the report (default: detected from
            autocast at the first probed forward; "fp32" without autocast).
        granularity: ``"module"`` records the gradient of each hooked module's output;
            ``"op"`` records the gradient of every differentiable op's output inside
            the selected modules (functional calls too: ``F.gelu``, residual adds,
            softmax), named ``"<module>/<op>"`` (see :mod:`fp16probe.capture.ops`). With
            ``"op"`` the default selection is every module, not only leaves.
        shadow_every: under fp16 or bf16 autocast, rerun the first sampled step, the 2nd,
            3rd, 5th, 9th, 17th and 33rd, then every ``shadow_every``-th sampled step in fp32
            (same batch, weights and random state; training is left bit-identical) and record
            it as the reference the verdict is judged by (see :mod:`fp16probe.capture.shadow`).
            Default 50; 0 turns it off. The model's own forward call is replayed and its
            returned loss used; for a loss computed outside the model call :meth:`shadow`.
        history: record on every step, sampled or not, the scale in force, whether a
            gradient was inf/NaN and the largest |g| of the parameters' gradients, as device
            scalars (see :mod:`fp16probe.capture.history`); what ``fp16probe schedule`` replays.
        target: the device whose fp16 autocast rules decide which gradients stay fp32 (left
            out of the overflow ceiling): ``"cuda"`` (default, where fp16 training runs) or
            ``"cpu"``; None asks autocast on the device the run is on. A run under real
            autocast uses the real dtypes.
        regime: ``"autocast"`` (fp32 weights under fp16 autocast) or ``"pure_fp16"`` (a model
            trained as ``.half()``: every gradient is fp16, none is left out of the ceiling).
        block_formats: scaled formats to gather statistics for (``"fp8_e4m3"``,
            ``"mxfp8_e4m3"``, ``"nvfp4"``...; see :mod:`fp16probe.capture.blockcapture`):
            the GEMM operands of every Linear-like module, counted on the same pass. Off by
            default: without it nothing of that module is registered.
        delayed_recipes: :class:`fp16probe.blockscale.DelayedRecipe` s counted live for FP8
            (default: TransformerEngine's ``DelayedScaling()``).

    Under torch.distributed (a process group of more than one rank at :meth:`start`),
    weight gradients are read once backward has finished, after DDP's all-reduce, so
    they are the gradients the optimizer steps with (see :mod:`fp16probe.capture.distributed`).

    Use as a context manager (hooks are removed on exit, also by exception) or with
    :meth:`start`/:meth:`stop`; call :meth:`step` at each optimizer step and
    :meth:`report` to bring the statistics to the host.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        modules: Sequence[str] | str | None = None,
        types: Sequence[type] | type | None = None,
        activation_grads: bool = True,
        weight_grads: bool = True,
        activations: bool = False,
        forward: bool = True,
        every: int = 1,
        scaler: Any = None,
        precision: str | None = None,
        granularity: str = "module",
        shadow_every: int | None = None,
        history: bool = True,
        target: str | None = "cuda",
        regime: str = "autocast",
        block_formats: Sequence[str] | str | None = None,
        delayed_recipes: Sequence[Any] | None = None,
    ) -> None:
        _check_settings(model, every, activation_grads or weight_grads or activations or forward, granularity,
                        regime, target, shadow_every)
        self.options: dict[str, Any] = dict(
            modules=modules, types=types, activation_grads=activation_grads, weight_grads=weight_grads,
            shadow_every=DEFAULT_SHADOW_EVERY if shadow_every is None else int(shadow_every), history=history,
            block_formats=block_formats, delayed_recipes=delayed_recipes)
        self.model, self.granularity, self.target, self.regime = model, granularity, target, regime
        self.every = int(every)
        self.scaler = scaler
        self.capture = {ACTIVATION_GRAD: bool(activation_grads), WEIGHT_GRAD: bool(weight_grads),
                        ACTIVATION: bool(activations)}
        self.patterns = [modules] if isinstance(modules, str) else list(modules or [])
        self._types = tuple(types) if isinstance(types, (list, tuple)) else ((types,) if types else ())
        self.recorder = Recorder(self.capture, every=self.every, scaler=scaler, precision=precision)
        self.recorder.forward = bool(forward)
        self.hooked: list[str] = select_modules(model, self.patterns, self._types, granularity)
        if not self.hooked and not weight_grads:
            raise ProbeError(
                f"no module of {type(model).__name__} matches modules={self.patterns!r} "
                f"types={[t.__name__ for t in self._types]!r}; check the names with model.named_modules()"
            )
        self._handles: list[Any] = []
        self._active = False
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
            try:
                h.remove()
            except Exception:  # a hook handle whose owner is gone
                pass

    # -- steps -----------------------------------------------------------------------
    def step(self) -> None:
        """Mark a step boundary (call once per optimizer step).

        Closing the step is atomic: a KeyboardInterrupt anywhere in here leaves the
        step either open or closed, so a partial report is always consistent.
        """
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

        Call it before ``loss.backward()`` when code outside the model sits between the
        model's output and the loss (the gradient at the model's output is covered
        without it). Costs no host sync.
        """
        ceiling = self.collector("ceiling")
        if ceiling is not None and self._active:
            ceiling.hooks.watch(iter_tensors(loss))

    def shadow(self, compute_loss: Any) -> bool:
        """Rerun this step's batch in fp32 as the reference, if this step is a shadowed one.

        ``compute_loss()`` runs the forward and the loss for the step's batch and returns
        the loss; it must not enter autocast itself (the Probe runs it with autocast off).
        Call it every step, before the optimizer step (the weights must be those the step
        used): on steps that are not shadowed it returns False at once, without calling
        ``compute_loss``. Called before the step's own forward, dropout draws the same masks
        in both. Only needed when the loss is computed outside the model; a model that
        returns its loss is rerun without it. The gradients, buffers and random state are
        restored after.
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

        A step still open (recorded but not yet closed by :meth:`step`) is included
        without closing it, so calling report() twice, or mid-step and then again after
        :meth:`step`, never counts a value twice.
        ``since_step``: the per-step trace and history hold only the steps from that one on
        (module totals, the shadow and the verdict's evidence stay whole), as
        :class:`~fp16probe.integrations.live.LiveLogger` asks at each interval.
        ``extra``: the caller's own metadata (``metadata.extra``).
        This synchronises with the device; call it outside the training hot path.
        """
        for c in self.collectors:  # the ceiling folds what the open step saw before the recorder reads
            if isinstance(c, CeilingCollector):
                c.hooks.flush()
        got = self.recorder.collect({n: i for i, n in enumerate(self.hooked_modules)}, since_step=since_step)
        view = Collected(trace=got.trace, modules=got.modules, maxima=got.maxima, since_step=since_step)
        sections = view.sections
        for c in self.collectors:
            sections.update(c.collect(view))
        rec = self.recorder
        sections["capture"] = CaptureNotes(
            weight_grads_sharded=rec.sharded_weight_grads, granularity=self.granularity, trace_since_step=since_step,
            scale_source=None if rec.scale_source is None else rec.scale_source.describe,
            hook_errors=got.errors, first_hook_error=got.first_error if got.errors else None, **view.notes)
        param = next(self.model.parameters(), None)
        metadata = Metadata(
            fp16probe_version=__version__,
            torch_version=torch.__version__,
            device=got.device or (str(param.device) if param is not None else "cpu"),
            model_class=type(self.model).__name__,
            precision=got.precision or "fp32",
            param_dtype=str(param.dtype) if param is not None else "none",
            steps_seen=len(view.trace),
            steps_total=got.steps_total,
            every=self.every,
            captured=tuple(k for k in KINDS if self.capture[k]),
            hooked_modules=self.hooked_modules,
            grad_scaler=self.scaler is not None,
            world_size=1,
            partial=partial,
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            target=self.target,
            regime=self.regime,
            extra=dict(extra or {}),
        )
        return Report(metadata=metadata, modules=view.modules, trace=view.trace).with_sections(sections)


def _check_settings(model: Any, every: int, capturing: bool, granularity: str, regime: str, target: str | None,
                    shadow_every: int | None) -> None:
    """Refuse a setting the Probe cannot run with, naming it (ProbeError)."""
    if not isinstance(model, nn.Module):
        raise ProbeError(f"Probe needs a torch.nn.Module, got {type(model).__name__}")
    if int(every) < 1:
        raise ProbeError(f"every must be a positive number of steps, got {every!r}")
    if not capturing:
        raise ProbeError("nothing to capture: enable activation_grads, weight_grads, activations or forward")
    if granularity not in GRANULARITIES:
        raise ProbeError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if regime not in ("autocast", "pure_fp16"):
        raise ProbeError(f"regime must be 'autocast' or 'pure_fp16', got {regime!r}")
    if target not in (None, "cuda", "cpu"):
        raise ProbeError(f"target must be 'cuda', 'cpu' or None, got {target!r}")
    if shadow_every is not None and (isinstance(shadow_every, bool) or int(shadow_every) != shadow_every
                                     or shadow_every < 0):
        raise ProbeError(f"shadow_every must be a non-negative number of sampled steps (0: off), got {shadow_every!r}")
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ProbeError(
            f"{type(model).__name__} has tensors on the meta device (shapes only, no values), so there "
            "are no gradients to count; materialise them (model.to_empty(device=...) and initialise, "
            "or load weights) before probing"
        )


def _ops(probe: Probe) -> Collector | None:
    wanted = probe.capture[ACTIVATION] or probe.capture[ACTIVATION_GRAD]
    return OpRecording(probe) if probe.granularity == "op" and wanted else None


def _ceiling(probe: Probe) -> Collector | None:
    # The overflow ceiling covers every gradient backward makes, not only hooked modules'.
    return CeilingCollector(probe) if probe.capture[ACTIVATION_GRAD] or probe.capture[WEIGHT_GRAD] else None


def _shadow(probe: Probe) -> Collector | None:
    every = probe.options["shadow_every"]
    return ShadowReruns(probe, every) if every and (probe.capture[ACTIVATION_GRAD] or probe.capture[WEIGHT_GRAD]) \
        else None


def _blocks(probe: Probe) -> Collector | None:
    """The scaled-format collector when ``block_formats`` name one (else None: nothing registered)."""
    from fp16probe.blockscale import DelayedRecipe, families_for

    families = families_for(probe.options["block_formats"] or ())
    if not families:
        return None
    from fp16probe.capture.blockcapture import BlockCapture

    rec = probe.recorder
    return BlockCapture(probe.model, families, modules=probe.patterns,
                        delayed=tuple(probe.options["delayed_recipes"] or (DelayedRecipe(),)),
                        sampling=lambda: rec.enabled and rec.sampling, inv_scale=rec.inv_scale)


# The built-in collectors, in the order the Probe runs them: op capture's mode and the module hooks
# before the ceiling's walk from the model's output; the ceiling before the history, which reads its trace.
BUILTIN: tuple[Any, ...] = (
    _ops,
    ModuleHooks,
    _ceiling,
    lambda probe: ForwardHeadroom(probe.recorder),
    lambda probe: History(probe) if probe.options["history"] else None,
    _shadow,
    _blocks,
)
