"""Op-level capture: the gradient of every differentiable op's output in a forward pass.

Module hooks see only what a module returns. A transformer block's interesting tensors
are often made by functional calls inside ``forward`` (``F.gelu``, residual adds, the
attention softmax) and never cross a module boundary. Here a ``TorchFunctionMode`` is
active while the probed model runs forward; each torch call that yields a tensor needing
a gradient gets a gradient hook, under the name ``"<module>/<op>"`` of the innermost
module it ran in (``"block.attn/softmax"``; a second ``add`` in the same call is
``"block/add.1"``). Pure layout ops (views, reshapes, copies, dtype moves) are skipped:
their gradients are the same numbers, rearranged, as the gradients of the ops next to
them. A compute op whose output happens to be a view of a tensor it made itself is
recorded (a biased ``nn.Linear`` on 3-D input returns a view of its ``addmm``); an
output that views one of the op's inputs is layout. Torch functions called by other
functions (``F.layer_norm`` inside a Python function) are seen once, at the outermost
torch call, because the mode is off while a call it intercepted runs.

**Ops that autocast computes in fp32.** Under fp16 autocast some ops run in fp32 whatever
their inputs (losses, and on CUDA norms and softmax), and ops on fp32 inputs stay in fp32
(an RMSNorm that calls ``.float()``). Their gradients are fp32 in the real run, so an fp16
bound does not apply to them. The dtype each op would get under autocast is worked out
while the forward runs: an op's class is asked of autocast itself, once per op and device
(the op is run on fp16 copies of its inputs under ``torch.autocast``, on copies so nothing
of the model changes: fp32 out means autocast keeps it in fp32; then on fp32 copies: fp16
out means autocast lowers it), and dtypes flow through the other ops by type promotion
and explicit casts. An op whose output would be fp32 and whose every consumer computes in
fp32 (no lowered op, no cast) never holds an fp16 gradient: it is left out of the
histograms and the overflow ceiling, and named in the report
(the report's ``capture.autocast_fp32_ops``). When the profile itself runs under autocast the
real dtypes are used.

This is capture plumbing for :class:`fp16probe.capture.probe.Probe` (``granularity="op"``):
it names the ops and hands their outputs to the recorder through its public interface
(:meth:`~fp16probe.capture.recorder.Recorder.capture_output`); it holds no statistics.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fp16probe.capture.autocast_rules import CAST_OPS, cast_is_low, op_name, output_is_low
from fp16probe.capture.collector import Collected, Collector
from fp16probe.capture.ceiling import CAST_VIEW, FP32_ONLY, mark_covered
from fp16probe.capture.compiled import compiled_modules, tracing
from fp16probe.capture.recorder import ROOT_NAME, Recorder, detect_precision, iter_tensors
from fp16probe.capture.tracking import DtypeTracker, ModuleStack, leave_mode
from fp16probe.report import ACTIVATION, ACTIVATION_GRAD

__all__ = ["LAYOUT_OPS", "attach", "leave_mode", "new_capture", "op_name"]

# Ops that move, view or copy values without computing new ones.
LAYOUT_OPS = frozenset(
    {
        "T", "H", "mT", "mH", "alias", "as_strided", "bfloat16", "broadcast_to", "chunk", "clone",
        "contiguous", "cpu", "cuda", "detach", "diagonal", "double", "dsplit", "expand", "expand_as",
        "flatten", "float", "get", "getitem", "half", "hsplit", "movedim", "moveaxis", "narrow",
        "permute", "ravel", "reshape", "reshape_as", "select", "split", "split_with_sizes", "squeeze",
        "swapaxes", "swapdims", "t", "tensor_split", "to", "transpose", "type", "unbind", "unflatten",
        "unfold", "unsqueeze", "view", "view_as", "vsplit",
    }
)

_LOW, _FP32, _PASS = "lower", "fp32", "pass"  # what autocast does with an op
_HERE = "here"  # the one target op capture tracks: the run it predicts (``target``, or the profile's device)


class _Out:
    """One captured op output: its row, whether it would be fp32 under autocast, whether an
    op that computes in fp16 (or a cast) consumed it."""

    __slots__ = ("name", "fp32", "exposed", "node")

    def __init__(self, name: str, fp32: bool, node: Any) -> None:
        self.name = name
        self.fp32 = fp32
        self.exposed = False
        self.node = node


# Results of torch calls that hold no tensor: such a call needs no dtype or capture bookkeeping.
_NO_TENSORS = (bool, int, float, str, type(None), torch.device, torch.dtype, torch.utils.hooks.RemovableHandle)


class _OpCapture(TorchFunctionMode):
    """Hook the gradient of every differentiable op output while a forward runs."""

    def __init__(self, recorder: Recorder, record: bool = True, target: str | None = None) -> None:
        super().__init__()
        self.recorder = recorder
        # The device whose autocast rules decide (fp16probe.capture.autocast_rules); None: the
        # device the profile runs on, asked of autocast itself.
        self.target = target
        self.record = record  # False: only work out autocast dtypes, to mark nodes for the ceiling
        self.wanted: Any = None  # record=False: a callable saying whether this forward needs the marks
        self.depth = [0]  # nesting of the probed model's forward calls (the mode is on while > 0)
        self.stack = ModuleStack()
        self.classes: dict[tuple[Any, str, bool], str] = {}  # (op, device type, fp32 run) -> class
        # Per forward: the would-be-under-autocast dtype of tensors made in it, and the
        # captured outputs by id (a weakref guards against a reused id).
        self.dtypes = DtypeTracker((_HERE,))
        self.outs: dict[int, tuple[weakref.ref, _Out]] = {}
        self.entries: list[_Out] = []  # every captured output of the forward, freed or not
        self.fp32_only: set[str] = set()  # rows whose gradient never held fp16 in any forward
        self.fp16_rows: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, _NO_TENSORS):
            # The probe's own calls in forward hooks (is_floating_point, register_hook, dim):
            # no tensor out, so nothing to track; skip the bookkeeping (most calls on small layers).
            return out
        try:
            if self.stack and args and out is args[0] and isinstance(out, torch.Tensor) and out.is_floating_point():
                # x.to(torch.float32) on an fp32 profile returns x itself, but under autocast it
                # would make a new fp32 tensor from an fp16 x: give the result its own identity
                # (a view, the same values and storage) so the two can carry different dtypes.
                op = op_name(func)
                if op in CAST_OPS:
                    low = self._cast_low(op, args, kwargs or {})
                    if low is not None and low != self._is_low(out):
                        out = out.view_as(out)
                        if out.grad_fn is not None:
                            out.grad_fn.metadata[CAST_VIEW] = True  # not in untracked graphs
        except Exception as e:
            self.recorder.note_error(e)
        try:
            self._capture(func, args, kwargs or {}, out)
        except Exception as e:  # bookkeeping must never break training
            self.recorder.note_error(e)
        return out

    # -- the dtype an op would have under autocast -----------------------------------
    def _is_low(self, t: torch.Tensor) -> bool:
        """Whether ``t`` would be fp16 under autocast (tensors not made in this forward: their dtype)."""
        return self.dtypes.is_low(t, _HERE)

    def _class(self, func: Any, args: Sequence[Any], kwargs: Any, device: torch.device, fp32_run: bool) -> str:
        """Ask autocast what it does with ``func`` (cached per op and device)."""
        key = (func, device.type, fp32_run)
        got = self.classes.get(key)
        if got is None:
            got = self.classes[key] = _ask_autocast(func, args, kwargs, device, fp32_run)
        return got

    def _cast_low(self, op: str, args: Sequence[Any], kwargs: Any) -> bool | None:
        """What an explicit conversion makes, fp16/bf16 (True) or not (False); None: no dtype change."""
        return cast_is_low(op, args, kwargs, self._is_low)

    def _output_low(self, op: str, func: Any, args: Sequence[Any], kwargs: Any, out: torch.Tensor,
                    inputs: list[torch.Tensor]) -> bool:
        if _autocast_on(out.device.type):  # the profile runs under autocast: real dtypes
            return out.dtype in (torch.float16, torch.bfloat16)
        if op in CAST_OPS:
            low = self._cast_low(op, args, kwargs)
            if low is not None:
                return low
        if op in LAYOUT_OPS or op in CAST_OPS:
            return bool(inputs) and self._is_low(inputs[0])
        if self.target is not None:
            return output_is_low(func, args, kwargs, self._is_low, self.target)
        floats = [t for t in inputs if t.is_floating_point()]
        if self._class(func, args, kwargs, out.device, False) == _FP32:
            return False
        if all(self._is_low(t) for t in floats if t.dim() > 0) and floats:
            return True  # fp16 in, not an fp32 op: fp16 out
        # Some input would be fp32: a lowered op still gives fp16, any other op promotes.
        return self._class(func, args, kwargs, out.device, True) == _LOW

    # -- capture -----------------------------------------------------------------------
    def _capture(self, func: Any, args: Sequence[Any], kwargs: Any, out: Any) -> None:
        if not self.stack:
            return
        outs = [t for t in iter_tensors(out) if t.is_floating_point()]
        if not outs:
            return
        op = op_name(func)
        inputs = [t for t in iter_tensors(list(args) + list(kwargs.values())) if isinstance(t, torch.Tensor)]
        low = self._track_dtype(op, func, args, kwargs, outs, inputs)
        if op in LAYOUT_OPS or not (self.stack.top.selected or not self.record):
            return
        tensors = _computed(outs, inputs)
        if not tensors:
            return
        if self.record:
            self._record(op, tensors, low)
            return
        for t in tensors:  # dtypes only: no row, the op's name is enough to settle it
            if t.requires_grad:
                self._keep(op, t, low)

    def _track_dtype(self, op: str, func: Any, args: Sequence[Any], kwargs: Any, outs: list[torch.Tensor],
                     inputs: list[torch.Tensor]) -> bool:
        """Mark what the op's outputs would be under autocast, and its inputs as exposed when it runs in fp16."""
        low = self._output_low(op, func, args, kwargs, outs[0], inputs)
        for t in outs:
            self.dtypes.mark(t, {_HERE: low})
        # A consumer that computes in fp16 (or casts) gives its fp32 inputs' gradients an
        # fp16 pass in the real run.
        if low or op in CAST_OPS:
            for t in inputs:
                entry = self.outs.get(id(t))
                if entry is not None and entry[0]() is t:  # not a freed tensor's reused id
                    entry[1].exposed = True
        return low

    def _keep(self, name: str, t: torch.Tensor, low: bool) -> _Out:
        """Keep an output that needs a gradient, to settle at the end of the forward."""
        entry = _Out(name, not low, t.grad_fn)
        self.outs[id(t)] = (weakref.ref(t), entry)
        self.entries.append(entry)
        return entry

    def _record(self, op: str, tensors: list[torch.Tensor], low: bool) -> None:
        """Name the op's row and feed its outputs (and, by a hook, their gradients) to the recorder."""
        name = self.stack.name_op(op)
        rec = self.recorder
        if rec.precision is None:
            rec.precision = detect_precision(tensors)
        act_i = rec.register(ACTIVATION, name, op) if rec.capture[ACTIVATION] else None
        grad_i = rec.register(ACTIVATION_GRAD, name, op) if rec.capture[ACTIVATION_GRAD] else None
        for t in tensors:
            if act_i is not None:
                rec.record(ACTIVATION, act_i, t)
            if t.requires_grad:
                entry = self._keep(name, t, low)
                if grad_i is not None:
                    t.register_hook(self._grad_hook(grad_i, entry))
                    if not entry.fp32:  # fp32-only outputs are left unrecorded (and unhooked by the ceiling)
                        mark_covered(t)

    def _grad_hook(self, i: int, entry: _Out):
        rec = self.recorder

        def hook(grad: torch.Tensor) -> None:
            if rec.enabled and not (entry.fp32 and not entry.exposed):
                rec.record(ACTIVATION_GRAD, i, grad)

        return hook

    def end_forward(self) -> None:
        """Settle which outputs stay fp32 under autocast; mark their nodes for the ceiling."""
        for o in self.entries:
            if o.fp32 and not o.exposed:
                self.fp32_only.add(o.name)
                try:
                    o.node.metadata[FP32_ONLY] = True
                except Exception:  # a node without metadata: it simply counts
                    pass
            else:
                self.fp16_rows.add(o.name)
        self.dtypes.clear()
        self.outs.clear()
        self.entries = []

    def reset(self) -> None:
        """Leave the mode if a forward was cut short (KeyboardInterrupt skips the closing hook).

        Called between steps and when the hooks are removed, never while a forward runs.
        """
        if self.depth[0]:
            self.depth[0] = 0
            try:
                self.__exit__(None, None, None)
            except Exception:  # not on the mode stack any more
                pass
            self.stack.clear()
            self.end_forward()

    def remove(self) -> None:
        """Handle protocol: removing the hooks also leaves the mode (see :meth:`reset`)."""
        self.reset()

    @property
    def autocast_fp32_rows(self) -> list[str]:
        """Rows whose gradient stays fp32 under autocast in every forward seen."""
        return sorted(self.fp32_only - self.fp16_rows) if self.record else []


def _computed(outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs the op computed: in a graph, and not a view of one of its inputs.

    A view of an input is layout; a view of what the op made itself (a biased Linear on 3-D
    input returns a view of its addmm) is the op's output.
    """
    input_ids = {id(t) for t in inputs} | {id(t._base) for t in inputs if t._base is not None}
    return [t for t in outs if t.grad_fn is not None and not (t._is_view() and id(t._base) in input_ids)]


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


def _copy_args(obj: Any, float_dtype: torch.dtype) -> Any:
    """Copies of the tensors in ``obj`` (floats cast to ``float_dtype``): the op may write to its inputs."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.to(float_dtype, copy=True) if t.is_floating_point() else t.clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_args(v, float_dtype) for v in obj) if not hasattr(obj, "_fields") else obj
    if isinstance(obj, dict):
        return {k: _copy_args(v, float_dtype) for k, v in obj.items()}
    return obj


def _ask_autocast(func: Any, args: Sequence[Any], kwargs: Any, device: torch.device, fp32_run: bool) -> str:
    """Run ``func`` on copies of its inputs under fp16 autocast and read the class off the output dtype.

    ``fp32_run=False``: fp16 inputs; an fp32 output means autocast runs the op in fp32.
    ``fp32_run=True``: fp32 inputs; an fp16 output means autocast lowers the op.
    Runs once per op and device, on copies (nothing of the model changes) with the RNG
    state restored. An op that cannot be asked (in place, fails on copies) counts as
    lowered: its gradient is then judged as fp16, the safe side.
    """
    name = op_name(func)
    if name.endswith("_") or "out" in kwargs:  # in place: never run twice
        return _LOW
    try:
        dtype = torch.float32 if fp32_run else torch.float16
        devices = [device] if device.type == "cuda" else []
        # The probing calls are not the model's: no other torch function mode sees them.
        with torch._C.DisableTorchFunction():
            a, k = _copy_args(tuple(args), dtype), _copy_args(dict(kwargs), dtype)
            with torch.random.fork_rng(devices=devices), torch.no_grad(), torch.autocast(device.type,
                                                                                          dtype=torch.float16):
                got = func(*a, **k)
        first = next((t for t in iter_tensors(got) if t.is_floating_point()), None)
    except Exception:
        return _LOW
    if first is None:
        return _LOW
    if fp32_run:
        return _LOW if first.dtype == torch.float16 else _PASS
    return _FP32 if first.dtype == torch.float32 else _PASS


def new_capture(recorder: Recorder, record: bool = True, target: str | None = None) -> _OpCapture:
    """Make the capture object :func:`attach` uses; keep it to reuse its cache across attaches.

    ``target``: the device whose fp16 autocast rules decide which outputs stay fp32
    (``"cuda"``, ``"cpu"``); None asks autocast on the device the profile runs on.
    """
    return _OpCapture(recorder, record, target)


def attach(model: nn.Module, selected: Sequence[str], recorder: Recorder, *, capture: Any = None,
           record: bool = True) -> list[Any]:
    """Register the hooks that run op capture on ``model``, feeding ``recorder``; return their handles.

    ``record=False`` records nothing: it only works out which ops' gradients stay fp32
    under autocast and marks their autograd nodes, so that the overflow ceiling of a
    module-granularity Probe leaves them out too.

    ``capture``: an object from :func:`new_capture` to use (the Probe keeps one, so that
    autocast is asked about each op once, and reads its ``autocast_fp32_rows``).

    ``selected`` are the module names (``""`` for the root) whose ops are recorded; an op
    is recorded when the innermost selected module on the call stack is one of them,
    named after the innermost module of any kind. The Probe attaches these hooks only
    for sampled steps.
    """
    chosen = set(selected)
    mode = capture if capture is not None else _OpCapture(recorder, record)
    handles: list[Any] = []
    depth = mode.depth

    def push(name: str):
        display = name or ROOT_NAME

        def pre_hook(module: nn.Module, args: Any) -> None:
            if tracing() or depth[0] == 0:
                return
            mode.stack.push(display, name in chosen)

        return pre_hook

    def pop(module: nn.Module, args: Any, output: Any) -> None:
        if not tracing() and depth[0]:
            mode.stack.pop()

    # A torch function mode around compiled code would be traced into it (compiled.py): under
    # torch.compile no mode is entered, and a hook dynamo traces does nothing.
    compiled = bool(compiled_modules(model))

    def root_pre(module: nn.Module, args: Any) -> None:
        if tracing():
            recorder.compile_seen.traced = True
            return
        depth[0] += 1
        if depth[0] == 1 and not compiled and recorder.enabled and recorder.sampling and (
                mode.wanted is None or mode.wanted()):
            mode.stack.reset(ROOT_NAME, "" in chosen)
            mode.__enter__()
        elif depth[0] == 1:
            depth[0] = 0  # not recording, or the marks are reused: no mode, no stack, nothing to undo

    def root_post(module: nn.Module, args: Any, output: Any) -> None:
        if tracing() or depth[0] == 0:
            return
        depth[0] -= 1
        if depth[0] == 0:
            leave_mode(mode)  # safe when a signal took the mode off the stack inside torch's dispatch
            mode.stack.clear()
            mode.end_forward()

    handles.append(model.register_forward_pre_hook(root_pre))
    for name, module in model.named_modules():
        if name == "" or not mode.record:  # dtypes only: no op is named, one frame is enough
            continue
        handles.append(module.register_forward_pre_hook(push(name)))
        handles.append(module.register_forward_hook(pop, always_call=True))
    handles.append(model.register_forward_hook(root_post, always_call=True))
    handles.append(mode)  # its remove() leaves the mode if an interrupted forward left it on
    return handles


class OpRecording(Collector):
    """Op granularity as a collector: every differentiable op's output gradient inside the selected modules."""

    key = "ops"

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.capture = new_capture(probe.recorder, True, probe.target)

    def sample(self, handles: list[Any]) -> None:
        """Run the mode over this step's forward."""
        handles.extend(attach(self.probe.model, self.probe.hooked, self.probe.recorder, capture=self.capture))

    def close_step(self, sampled: bool) -> None:
        """Leave the mode if a forward was cut short."""
        self.capture.reset()

    def discard_step(self) -> None:
        """Leave the mode if a forward was cut short."""
        self.capture.reset()

    def collect(self, got: Collected) -> dict[str, Any]:
        """Drop the rows of gradients that autocast kept in fp32 (made at forward time, never filled), and note them."""
        fp32_rows = self.capture.autocast_fp32_rows
        if not fp32_rows:
            return {}
        got.notes["autocast_fp32_ops"] = tuple(fp32_rows)
        drop = {m.name for m in got.modules if m.kind == ACTIVATION_GRAD and m.name in fp32_rows
                and m.histogram.total == 0}
        got.modules = tuple(m for m in got.modules if not (m.kind == ACTIVATION_GRAD and m.name in drop))
        module_max = dict(got.trace.module_max)
        if ACTIVATION_GRAD in module_max:
            module_max[ACTIVATION_GRAD] = {n: v for n, v in module_max[ACTIVATION_GRAD].items() if n not in drop}
        got.trace = dataclasses.replace(got.trace, module_max=module_max)
        return {}
