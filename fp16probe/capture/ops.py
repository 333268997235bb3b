"""Op-level capture: the gradient of every differentiable op's output in a forward pass.

Module hooks see only what a module returns. A transformer block's interesting tensors
are often made by functional calls inside ``forward`` (``F.gelu``, residual adds, the
attention softmax) and never cross a module boundary. Here a ``TorchFunctionMode`` is
active while the probed model runs forward; each torch call that yields a tensor needing
a gradient gets a gradient hook, under the name ``"<module>/<op>"`` of the innermost
module it ran in (``"block.attn/softmax"``; a second ``add`` in the same call is
``"block/add.1"``). Pure layout ops (views, reshapes, copies, dtype moves) are skipped:
their gradients are the same numbers, rearranged, as the gradients of the ops next to
them. Torch functions called by other functions (``F.layer_norm`` inside a Python
function) are seen once, at the outermost torch call, because the mode is off while a
call it intercepted runs.

This is capture plumbing for :class:`fp16probe.capture.probe.Probe` (``granularity="op"``):
it names the ops and hands their outputs to the recorder through its public interface
(:meth:`~fp16probe.capture.recorder.Recorder.capture_output`); it holds no statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from fp16probe.capture.recorder import ROOT_NAME, Recorder, iter_tensors

__all__ = ["LAYOUT_OPS", "attach", "op_name"]

# Ops that move, view or copy values without computing new ones.
LAYOUT_OPS = frozenset(
    {
        "bfloat16", "chunk", "clone", "contiguous", "cpu", "cuda", "detach", "double", "expand",
        "expand_as", "flatten", "float", "get", "getitem", "half", "movedim", "narrow", "permute",
        "reshape", "reshape_as", "select", "split", "squeeze", "swapaxes", "t", "to", "transpose",
        "type", "unbind", "unflatten", "unsqueeze", "view", "view_as",
    }
)


def op_name(func: Any) -> str:
    """Name a torch callable for a report row: ``TensorBase.__getitem__`` -> ``"getitem"``."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return name


class _Frame:
    """One module call on the stack: its display name and the ops counted in it so far."""

    __slots__ = ("name", "counts", "selected")

    def __init__(self, name: str, selected: bool) -> None:
        self.name = name
        self.selected = selected
        self.counts: dict[str, int] = {}


class _OpCapture(TorchFunctionMode):
    """Hook the gradient of every differentiable op output while a forward runs."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.stack: list[_Frame] = []

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        try:
            self._capture(func, out)
        except Exception as e:  # bookkeeping must never break training
            self.recorder.note_error(e)
        return out

    def _capture(self, func: Any, out: Any) -> None:
        if not self.stack:
            return
        frame = self.stack[-1]
        if not frame.selected:
            return
        tensors = [
            t for t in iter_tensors(out)
            if t.is_floating_point() and t.grad_fn is not None and not t._is_view()
        ]
        if not tensors:
            return
        op = op_name(func)
        if op in LAYOUT_OPS:
            return
        n = frame.counts.get(op, 0)
        frame.counts[op] = n + 1
        name = f"{frame.name}/{op}" if n == 0 else f"{frame.name}/{op}.{n}"
        self.recorder.capture_output(name, op, tensors)


def attach(model: nn.Module, selected: Sequence[str], recorder: Recorder) -> list[Any]:
    """Register the hooks that run op capture on ``model``, feeding ``recorder``; return their handles.

    ``selected`` are the module names (``""`` for the root) whose ops are recorded; an op
    is recorded when the innermost selected module on the call stack is one of them,
    named after the innermost module of any kind. The Probe attaches these hooks only
    for sampled steps.
    """
    chosen = set(selected)
    mode = _OpCapture(recorder)
    handles: list[Any] = []
    depth = [0]

    def push(name: str):
        display = name or ROOT_NAME

        def pre_hook(module: nn.Module, args: Any) -> None:
            if depth[0] == 0:
                return
            parent_selected = bool(mode.stack) and mode.stack[-1].selected
            mode.stack.append(_Frame(display, name in chosen or parent_selected))

        return pre_hook

    def pop(module: nn.Module, args: Any, output: Any) -> None:
        if depth[0] and mode.stack:
            mode.stack.pop()

    def root_pre(module: nn.Module, args: Any) -> None:
        depth[0] += 1
        if depth[0] == 1 and recorder.enabled and recorder.sampling:
            mode.stack.clear()
            mode.stack.append(_Frame(ROOT_NAME, "" in chosen))
            mode.__enter__()
        elif depth[0] == 1:
            depth[0] = 0  # not recording: no mode, no stack, nothing to undo

    def root_post(module: nn.Module, args: Any, output: Any) -> None:
        if depth[0] == 0:
            return
        depth[0] -= 1
        if depth[0] == 0:
            mode.__exit__(None, None, None)
            mode.stack.clear()

    handles.append(model.register_forward_pre_hook(root_pre))
    for name, module in model.named_modules():
        if name == "":
            continue
        handles.append(module.register_forward_pre_hook(push(name)))
        handles.append(module.register_forward_hook(pop, always_call=True))
    handles.append(model.register_forward_hook(root_post, always_call=True))
    return handles
