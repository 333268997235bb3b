"""The module collector: which modules are hooked, their output and parameter hooks, and the forward headroom.

:func:`select_modules` names the modules; :class:`ModuleHooks` gives each its rows in the recorder
and hooks their outputs (module granularity) and their parameters' accumulated gradients;
:class:`ForwardHeadroom` turns the recorder's forward maxima into the report's ``forward`` section.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any, Mapping

import torch
from torch import nn

from fp16probe.capture.collector import Collected, Collector
from fp16probe.capture.compiled import tracing
from fp16probe.capture.recorder import FORWARD, ROOT_NAME, Recorder
from fp16probe.report import ACTIVATION, ACTIVATION_GRAD, WEIGHT_GRAD, ModuleStats
from fp16probe.sections import ForwardSection

__all__ = ["ForwardHeadroom", "ModuleHooks", "select_modules"]


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


class ModuleHooks(Collector):
    """The hooked modules' outputs and the parameters' gradients, fed to the recorder."""

    key = "modules"

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.model: nn.Module = probe.model
        self.recorder: Recorder = probe.recorder
        self.capture: Mapping[str, bool] = probe.capture
        self.params: list[tuple[str, str, nn.Parameter]] = []  # set by start()
        self._output_hooks: list[tuple[nn.Module, Any]] = []
        self.param_hooks: list[tuple[nn.Parameter, Any]] = []
        self.at_start: dict[str, nn.Module] = {}  # the hooked modules as start() found them

    def start(self) -> None:
        """Give every hooked module and parameter its row now, so rows follow the model's order."""
        modules = dict(self.model.named_modules())
        self.at_start = {name: modules[name] for name in self.probe.hooked if name in modules}
        self.params = []
        for pname, p in self.model.named_parameters():
            if p.requires_grad:
                owner = pname.rsplit(".", 1)[0] if "." in pname else ""
                self.params.append((pname, type(modules.get(owner, self.model)).__name__, p))
        rec = self.recorder
        if self.probe.granularity == "module":
            for name in self.probe.hooked:
                for kind in (ACTIVATION, ACTIVATION_GRAD):
                    if self.capture[kind]:
                        rec.register(kind, name or ROOT_NAME, type(modules[name]).__name__)
        if self.capture[WEIGHT_GRAD]:
            for pname, tname, _ in self.params:
                rec.register(WEIGHT_GRAD, pname, tname)
        self._output_hooks = [(modules[name], _output_hook(rec, name or ROOT_NAME, type(modules[name]).__name__))
                              for name in self.probe.hooked]
        rows = rec.rows[WEIGHT_GRAD].index if self.capture[WEIGHT_GRAD] else {}
        self.param_hooks = [(p, _param_hook(rec, rows[pname])) for pname, _, p in self.params if pname in rows]

    def sample(self, handles: list[Any]) -> None:
        """Hook the outputs (module granularity) and the parameters' gradient accumulation."""
        if self.probe.granularity == "module" and (self.capture[ACTIVATION] or self.capture[ACTIVATION_GRAD]
                                                   or self.recorder.forward):
            handles.extend(module.register_forward_hook(hook) for module, hook in self._output_hooks)
        handles.extend(p.register_post_accumulate_grad_hook(hook) for p, hook in self.param_hooks)

    def counted_params(self) -> frozenset[int]:
        """The parameters whose gradients are counted at the end of their accumulation (not under DDP)."""
        return frozenset() if self.recorder.defer_to_ddp else frozenset(id(p) for p, _ in self.param_hooks)

    def collect(self, got: Collected) -> Mapping[str, Any]:
        """Note the hooked modules that recorded no gradient (see :func:`silent_modules`)."""
        silent, gradient_free = self.silent_modules(got.modules, len(got.trace))
        got.notes.update(unrecorded_modules=tuple(silent), gradient_free_modules=tuple(gradient_free),
                         removed_modules=tuple(self.removed_modules()))
        return {}

    def removed_modules(self) -> list[str]:
        """Hooked modules that are no longer in the model (it replaced or deleted them after start())."""
        now = {id(m) for m in self.model.modules()}
        return [name or ROOT_NAME for name, m in self.at_start.items() if id(m) not in now]

    def silent_modules(self, modules: Sequence[ModuleStats], n_steps: int) -> tuple[list[str], list[str]]:
        """Hooked modules whose output never carried a gradient: (findings, structurally gradient-free).

        Gradient-free by construction, so no finding: a module without trainable parameters
        (identity, dropout, rotary embeddings, pooling: nothing of its own for the loss scale
        to multiply, whether its forward ran, was fused away or made no differentiable
        output), and one whose every parameter is tied to a hooked module that recorded
        (T5's ``shared`` runs as ``encoder.embed_tokens``). A finding: a module with
        parameters of its own whose forward was bypassed (a parent using its weights
        directly) or whose output did not reach the loss.
        """
        if self.probe.granularity != "module" or not self.capture[ACTIVATION_GRAD] or n_steps == 0:
            return [], []
        if self.recorder.compile_seen.traced:  # outputs inside compiled code are not read (compiled.py)
            return [], []
        recorded = {m.name for m in modules if m.kind == ACTIVATION_GRAD and m.histogram.total > 0}
        # The modules as start() hooked them: one the model dropped since is judged as it was.
        named = {**self.at_start, **dict(self.model.named_modules(remove_duplicate=False))}
        hooked = self.probe.hooked
        seen_params = {id(p) for name in hooked if (name or ROOT_NAME) in recorded for p in named[name].parameters()}
        findings, gradient_free = [], []
        for name in hooked:
            display = name or ROOT_NAME
            if display in recorded:
                continue
            own = [p for p in named[name].parameters() if p.requires_grad]
            tied = bool(own) and all(id(p) in seen_params for p in own)
            (gradient_free if not own or tied else findings).append(display)
        return findings, gradient_free


class ForwardHeadroom(Collector):
    """Each hooked module's largest forward output and the step's largest: the report's ``forward`` section."""

    key = "forward"

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def collect(self, got: Collected) -> Mapping[str, Any]:
        """One transfer: the modules' maxima and the first step each passed fp16's max."""
        module_max, first_over = self.recorder.forward_maxima()
        if not module_max:
            return {}
        return {"forward": ForwardSection(module_max=module_max, first_overflow_step=first_over,
                                          step_max=tuple(got.maxima.get(FORWARD, ())))}


def _output_hook(rec: Recorder, name: str, type_name: str):
    seen = rec.compile_seen

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if tracing():  # inside torch.compile: read nothing, or the compiled program changes (compiled.py)
            seen.traced = True
            return
        # Outside the dtype-tracking mode (ops.py): the recorder's own calls (is_floating_point,
        # register_hook) make no tensor, and intercepting them cost more than recording here.
        with torch._C.DisableTorchFunction():
            rec.capture_output(name, type_name, output)

    return hook


def _param_hook(rec: Recorder, i: int):
    def hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            rec.param_grad_ready(i, p)

    return hook
