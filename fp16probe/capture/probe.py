"""The Probe: selects modules, attaches hooks that feed the recorder, and makes the Report.

Four units, one job each: :func:`select_modules` (which modules), :meth:`Probe._attach`
(hook registration, only while a step is sampled), :class:`~fp16probe.capture.recorder.Recorder`
(recording on the device), :meth:`Probe.report` (the Report). Counts stay on the device;
nothing in a hook synchronises with the host. Everything comes to the host once, in
:meth:`Probe.report`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fp16probe._version import __version__
from fp16probe.capture import distributed as _distributed
from fp16probe.capture.ceiling import CHANNEL, CeilingHooks, step_ceilings
from fp16probe.capture.history import History
from fp16probe.capture.recorder import FORWARD, ROOT_NAME, Recorder, iter_tensors
from fp16probe.capture.shadow import DEFAULT_SHADOW_EVERY, Shadow
from fp16probe.errors import ProbeError
from fp16probe.report import ACTIVATION, ACTIVATION_GRAD, KINDS, WEIGHT_GRAD, Metadata, ModuleStats, Report, json_float

__all__ = ["ROOT_NAME", "Probe", "iter_tensors", "select_modules"]

GRANULARITIES = ("module", "op")


def select_modules(model: nn.Module, patterns: Sequence[str], types: tuple[type, ...], granularity: str) -> list[str]:
    """Name the modules to hook: those matching ``patterns``/``types``; by default every leaf.

    With ``granularity="op"`` the default is every module (ops are named by their
    innermost module).
    """
    chosen = []
    for name, module in model.named_modules():
        display = name or ROOT_NAME
        if patterns:
            if not any(fnmatch.fnmatchcase(display, p) for p in patterns):
                continue
        elif not types and granularity == "module" and next(module.children(), None) is not None:
            continue
        if types and not isinstance(module, types):
            continue
        chosen.append(name)
    return chosen


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
        if not isinstance(model, nn.Module):
            raise ProbeError(f"Probe needs a torch.nn.Module, got {type(model).__name__}")
        if int(every) < 1:
            raise ProbeError(f"every must be a positive number of steps, got {every!r}")
        if not (activation_grads or weight_grads or activations or forward):
            raise ProbeError("nothing to capture: enable activation_grads, weight_grads, activations or forward")
        if granularity not in GRANULARITIES:
            raise ProbeError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        if regime not in ("autocast", "pure_fp16"):
            raise ProbeError(f"regime must be 'autocast' or 'pure_fp16', got {regime!r}")
        if target not in (None, "cuda", "cpu"):
            raise ProbeError(f"target must be 'cuda', 'cpu' or None, got {target!r}")
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            raise ProbeError(
                f"{type(model).__name__} has tensors on the meta device (shapes only, no values), so there "
                "are no gradients to count; materialise them (model.to_empty(device=...) and initialise, "
                "or load weights) before probing"
            )
        self.granularity = granularity
        self.target = target
        self.model = model
        self.every = int(every)
        self.scaler = scaler
        self._capture = {
            ACTIVATION_GRAD: bool(activation_grads),
            WEIGHT_GRAD: bool(weight_grads),
            ACTIVATION: bool(activations),
        }
        self._patterns = [modules] if isinstance(modules, str) else list(modules or [])
        self._types = tuple(types) if isinstance(types, (list, tuple)) else ((types,) if types else ())
        self.recorder = Recorder(self._capture, every=self.every, scaler=scaler, precision=precision)
        rec = self.recorder
        rec.forward = bool(forward)
        # The overflow ceiling covers every gradient backward makes, not only hooked modules'.
        self._ceiling = (
            CeilingHooks(
                lambda: rec.enabled and rec.sampling,
                rec.inv_scale,
                lambda v: rec.note_max(CHANNEL, v),
                rec.note_error,
            )
            if activation_grads or weight_grads
            else None
        )
        rec.cover = self._ceiling.cover if self._ceiling is not None else _uncounted
        self._handles: list[Any] = []
        self._params: list[tuple[str, str, nn.Parameter]] = []  # set by start()
        self._output_hooks: list[tuple[nn.Module, Any]] = []
        self._param_hooks: list[tuple[nn.Parameter, Any]] = []
        # Work out autocast's dtypes while a module-granularity forward runs, so the ceiling
        # leaves out gradients that stay fp32 (see fp16probe.capture.ops).
        # A model that trains as .half() computes every gradient in fp16: nothing is left out then.
        self._autocast_dtypes = regime == "autocast"
        self._op_captures: dict[bool, Any] = {}  # op capture objects, by whether they record rows
        self._active = False
        self._blocks = _block_capture(model, block_formats, delayed_recipes, self._patterns, rec)
        self._hooked: list[str] = select_modules(model, self._patterns, self._types, granularity)
        if not self._hooked and not weight_grads:
            raise ProbeError(
                f"no module of {type(model).__name__} matches modules={self._patterns!r} "
                f"types={[t.__name__ for t in self._types]!r}; check the names with model.named_modules()"
            )
        every_shadow = DEFAULT_SHADOW_EVERY if shadow_every is None else shadow_every
        if isinstance(every_shadow, bool) or int(every_shadow) != every_shadow or every_shadow < 0:
            raise ProbeError(f"shadow_every must be a non-negative number of sampled steps (0: off), got {shadow_every!r}")
        self._shadow: Shadow | None = None
        if every_shadow and (activation_grads or weight_grads):
            reference = Probe(model, modules=modules, types=types, activation_grads=activation_grads,
                              weight_grads=weight_grads, activations=False, scaler=None, precision="fp32",
                              granularity=granularity, target=target, shadow_every=0, history=False)
            self._shadow = Shadow(model, reference, int(every_shadow), self.recorder)
        self.history = History(rec) if history else None

    @property
    def hooked_modules(self) -> tuple[str, ...]:
        """Display names of the selected modules, in the model's order."""
        return tuple(n or ROOT_NAME for n in self._hooked)

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
        # The model as it is now: rows, parameters and output hooks, reused at every attach.
        modules = dict(self.model.named_modules())
        self._params = self._parameters(modules)
        self._register_rows(modules)
        rec = self.recorder
        self._output_hooks = [
            (modules[name], _output_hook(rec, name or ROOT_NAME, type(modules[name]).__name__)) for name in self._hooked
        ]
        rows = rec.rows[WEIGHT_GRAD].index if self._capture[WEIGHT_GRAD] else {}
        self._param_hooks = [(p, _param_hook(rec, rows[pname])) for pname, _, p in self._params if pname in rows]
        self._active = self.recorder.enabled = True
        if self._blocks is not None:
            self._blocks.start()
        if self.recorder.sampling:
            self._attach()
        if self.history is not None:
            self.history.attach([p for _, _, p in self._params])
        if self._shadow is not None and not self.recorder.defer_to_ddp:  # no reruns under DDP's collectives
            self._shadow.attach()
        return self

    def stop(self) -> "Probe":
        """Remove every hook. Collected statistics stay for :meth:`report`."""
        self._active = self.recorder.enabled = False
        self._detach()
        if self.history is not None:
            self.history.detach()
        if self._shadow is not None:
            self._shadow.detach()
        if self._blocks is not None:
            self._blocks.stop()
        return self

    @property
    def active(self) -> bool:
        """Whether the Probe is started."""
        return self._active

    # -- rows and hooks ----------------------------------------------------------------
    def _register_rows(self, modules: Mapping[str, nn.Module]) -> None:
        """Give every hooked module and parameter its row now, so rows follow the model's order."""
        rec = self.recorder
        if self.granularity == "module":
            for name in self._hooked:
                tname = type(modules[name]).__name__
                for kind in (ACTIVATION, ACTIVATION_GRAD):
                    if self._capture[kind]:
                        rec.register(kind, name or ROOT_NAME, tname)
        if self._capture[WEIGHT_GRAD]:
            for pname, tname, _ in self._params:
                rec.register(WEIGHT_GRAD, pname, tname)

    def _parameters(self, modules: Mapping[str, nn.Module]) -> list[tuple[str, str, nn.Parameter]]:
        out = []
        for pname, p in self.model.named_parameters():
            if p.requires_grad:
                owner = pname.rsplit(".", 1)[0] if "." in pname else ""
                out.append((pname, type(modules.get(owner, self.model)).__name__, p))
        return out

    def _attach(self) -> None:
        """Register the hooks (sampled steps only: unsampled steps run no hook at all)."""
        if self._handles:
            return
        rec = self.recorder
        try:
            if self.granularity == "op" and (self._capture[ACTIVATION] or self._capture[ACTIVATION_GRAD]):
                from fp16probe.capture import ops

                self._handles.extend(ops.attach(self.model, self._hooked, rec, capture=self._op_capture(True)))
            if self.granularity == "module" and self._ceiling is not None and self._autocast_dtypes:
                # Dtype tracking only: marks the nodes whose gradient autocast keeps in fp32
                # (norm internals) so the overflow ceiling leaves them out, as op capture does.
                from fp16probe.capture import ops

                tracking = self._op_capture(False)
                tracking.wanted = self._ceiling.begin_forward  # marks reused while the graph repeats
                self._handles.extend(ops.attach(self.model, (), rec, capture=tracking))
            if self.granularity == "module" and (self._capture[ACTIVATION] or self._capture[ACTIVATION_GRAD]
                                                 or rec.forward):
                for module, hook in self._output_hooks:
                    self._handles.append(module.register_forward_hook(hook))
            if self._ceiling is not None:
                ceiling = self._ceiling
                self._handles.append(self.model.register_forward_hook(_ceiling_hook(ceiling)))
                self._handles.append(ceiling)  # its remove() unhooks nodes that outlive a graph
                # Weight gradients counted at the end of backward cover their AccumulateGrad
                # nodes; under DDP they are counted after the all-reduce, so not there.
                ceiling.counted_params = frozenset(id(p) for p, _ in self._param_hooks if not rec.defer_to_ddp)
            for p, hook in self._param_hooks:
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
        except BaseException:
            self._detach()
            raise

    def _op_capture(self, record: bool) -> Any:
        """The op capture object, one per Probe and mode (its autocast answers are cached)."""
        from fp16probe.capture import ops

        if record not in self._op_captures:
            self._op_captures[record] = ops.new_capture(self.recorder, record, self.target)
        return self._op_captures[record]

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
        for capture in self._op_captures.values():
            capture.reset()  # a forward cut short by Ctrl-C left its mode on
        if self._ceiling is not None:
            self._ceiling.close_step()
        self.recorder.close_forward()
        sampled = self.recorder.sampling
        if self.history is not None:
            self.history.close_step()
        if self._blocks is not None:
            self._blocks.close_step()
        self.recorder.close_step()
        if self._shadow is not None:
            self._shadow.close_step(sampled)
        if self._active:
            if self.recorder.sampling:
                self._attach()
            else:
                self._detach()

    def discard_step(self) -> None:
        """Drop what the open step recorded so far (a step another rank never finished)."""
        for capture in self._op_captures.values():
            capture.reset()
        if self._ceiling is not None:
            self._ceiling.close_step()  # folds its pending values into the step being dropped
        if self.history is not None:
            self.history.discard_step()
        self.recorder.discard_step()

    def watch(self, loss: torch.Tensor) -> None:
        """Also cover the gradients between the model's output and ``loss`` in the overflow ceiling.

        Call it before ``loss.backward()`` when code outside the model sits between the
        model's output and the loss (the gradient at the model's output is covered
        without it). Costs no host sync.
        """
        if self._ceiling is not None and self._active:
            self._ceiling.watch(iter_tensors(loss))

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
        if self._shadow is None or not self._active:
            return False
        return self._shadow.run(compute_loss)

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
        This synchronises with the device; call it outside the training hot path.
        """
        if self._ceiling is not None:
            self._ceiling.flush()
        got = self.recorder.collect({n: i for i, n in enumerate(self.hooked_modules)}, since_step=since_step)
        trace = got.trace
        if self._ceiling is not None:
            n = len(trace)
            step_max = [
                max([hs[i].max_abs for k, hs in trace.histograms.items() if k != ACTIVATION], default=0.0)
                for i in range(n)
            ]
            trace = dataclasses.replace(
                trace, ceiling=step_ceilings(got.maxima.get(CHANNEL, (0.0,) * n), step_max, trace.found_inf)
            )
        extra_meta = dict(extra or {})
        silent, gradient_free = self._silent_modules(got.modules, len(trace))
        if silent:
            extra_meta["unrecorded_modules"] = silent
        if gradient_free:
            extra_meta["gradient_free_modules"] = gradient_free
        fp32_rows = sorted({r for c in self._op_captures.values() for r in c.autocast_fp32_rows})
        if fp32_rows:
            extra_meta["autocast_fp32_ops"] = fp32_rows
        forward_max, first_over = self.recorder.forward_maxima()
        if forward_max:
            extra_meta["forward_max"] = {
                "modules": {n: json_float(v) for n, v in forward_max.items()},
                "first_overflow_step": first_over,
                "step_max": [json_float(v) for v in got.maxima.get(FORWARD, ())],
                "source": "the largest |output| of each hooked module's forward, fp16 outputs only under autocast",
            }
        if self.recorder.sharded_weight_grads:
            extra_meta["weight_grad_sharding"] = "sharded"
        if self.recorder.scale_source is not None:
            extra_meta["scale_source"] = self.recorder.scale_source.describe
        if self.granularity != "module":
            extra_meta["granularity"] = self.granularity
        if since_step is not None:
            extra_meta["trace_since_step"] = since_step
        if self._shadow is not None:
            extra_meta["shadow"] = self._shadow_meta()
        if self.history is not None:
            scaler_settings = self.history.scaler_settings(self.scaler)
            if scaler_settings:
                extra_meta["scaler_settings"] = scaler_settings
        if self._blocks is not None:
            extra_meta["block_formats"] = self._blocks.collect()
        if got.errors:
            extra_meta["hook_errors"] = got.errors
            extra_meta["first_hook_error"] = got.first_error
        param = next(self.model.parameters(), None)
        metadata = Metadata(
            fp16probe_version=__version__,
            torch_version=torch.__version__,
            device=got.device or (str(param.device) if param is not None else "cpu"),
            model_class=type(self.model).__name__,
            precision=got.precision or "fp32",
            param_dtype=str(param.dtype) if param is not None else "none",
            steps_seen=len(got.trace),
            steps_total=got.steps_total,
            every=self.every,
            captured=tuple(k for k in KINDS if self._capture[k]),
            hooked_modules=self.hooked_modules,
            grad_scaler=self.scaler is not None,
            world_size=1,
            partial=partial,
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            extra=extra_meta,
        )
        modules = got.modules
        if fp32_rows:  # rows made at forward time for gradients that turned out to stay fp32
            drop = {m.name for m in modules if m.kind == ACTIVATION_GRAD and m.name in fp32_rows
                    and m.histogram.total == 0}
            modules = tuple(m for m in modules if not (m.kind == ACTIVATION_GRAD and m.name in drop))
            module_max = dict(trace.module_max)
            if ACTIVATION_GRAD in module_max:
                module_max[ACTIVATION_GRAD] = {
                    n: v for n, v in module_max[ACTIVATION_GRAD].items() if n not in drop
                }
            trace = dataclasses.replace(trace, module_max=module_max)
        return Report(metadata=metadata, modules=modules, trace=trace, shadow=self._shadow_report(),
                      history=None if self.history is None else self.history.collect(
                          trace, since_step, got.maxima.get(FORWARD)))

    def _shadow_meta(self) -> dict[str, Any]:
        sh = self._shadow
        assert sh is not None
        meta: dict[str, Any] = {"every": sh.every, "steps": list(sh.steps), **sh.cost(),
                                "next_step": sh.next_step()}
        if sh.discarded:  # reruns that did not run in fp32: named, never a reference
            meta["discarded"] = [dict(d) for d in sh.discarded]
        if self.recorder.defer_to_ddp:
            meta["off"] = "not under torch.distributed (a rerun would run DDP's collectives)"
        elif sh.skipped:
            meta["off"] = sh.skipped
        return meta

    def _shadow_report(self) -> Report | None:
        """The fp32 reruns as a report of their own, their steps numbered as the live run's."""
        sh = self._shadow
        if sh is None or not sh.steps:
            return None
        ref = sh.probe.report(extra={"shadow_of": "fp32 reruns of the live run's steps"})
        steps = tuple(sh.steps[: len(ref.trace)])
        return dataclasses.replace(
            ref, trace=dataclasses.replace(ref.trace, steps=steps),
            metadata=dataclasses.replace(ref.metadata, steps_total=len(steps), steps_seen=len(steps)))

    def _silent_modules(self, modules: Sequence[ModuleStats], n_steps: int) -> tuple[list[str], list[str]]:
        """Hooked modules whose output never carried a gradient: (findings, structurally gradient-free).

        Gradient-free by construction, so no finding: a module without trainable parameters
        (identity, dropout, rotary embeddings, pooling: nothing of its own for the loss scale
        to multiply, whether its forward ran, was fused away or made no differentiable
        output), and one whose every parameter is tied to a hooked module that recorded
        (T5's ``shared`` runs as ``encoder.embed_tokens``). A finding: a module with
        parameters of its own whose forward was bypassed (a parent using its weights
        directly) or whose output did not reach the loss.
        """
        if self.granularity != "module" or not self._capture[ACTIVATION_GRAD] or n_steps == 0:
            return [], []
        recorded = {m.name for m in modules if m.kind == ACTIVATION_GRAD and m.histogram.total > 0}
        named = dict(self.model.named_modules(remove_duplicate=False))
        seen_params = {id(p) for name in self._hooked if (name or ROOT_NAME) in recorded
                       for p in named[name].parameters()}
        findings, gradient_free = [], []
        for name in self._hooked:
            display = name or ROOT_NAME
            if display in recorded:
                continue
            own = [p for p in named[name].parameters() if p.requires_grad]
            tied = bool(own) and all(id(p) in seen_params for p in own)
            (gradient_free if not own or tied else findings).append(display)
        return findings, gradient_free


def _block_capture(model: nn.Module, formats: Sequence[str] | str | None, delayed: Sequence[Any] | None,
                   patterns: Sequence[str], rec: Recorder) -> Any:
    """The scaled-format collector when ``formats`` name one (else None: nothing registered)."""
    from fp16probe.blockscale import DelayedRecipe, families_for

    families = families_for(formats or ())
    if not families:
        return None
    from fp16probe.capture.blockcapture import BlockCapture

    return BlockCapture(model, families, modules=patterns, delayed=tuple(delayed or (DelayedRecipe(),)),
                        sampling=lambda: rec.enabled and rec.sampling, inv_scale=rec.inv_scale)


def _uncounted(node: Any, output_nr: int) -> None:
    """No overflow ceiling to tell (activation_grads and weight_grads off)."""


def _output_hook(rec: Recorder, name: str, type_name: str):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        # Outside the dtype-tracking mode (ops.py): the recorder's own calls (is_floating_point,
        # register_hook) make no tensor, and intercepting them cost more than recording here.
        with torch._C.DisableTorchFunction():
            rec.capture_output(name, type_name, output)

    return hook


def _ceiling_hook(ceiling: CeilingHooks):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        # Outside any torch function mode: the walk makes no tensor.
        with torch._C.DisableTorchFunction():
            ceiling.watch(iter_tensors(output), model_output=True)

    return hook


def _param_hook(rec: Recorder, i: int):
    def hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            rec.param_grad_ready(i, p)

    return hook
