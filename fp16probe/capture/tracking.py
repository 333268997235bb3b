"""What the capture modes share while a forward runs: the module stack and the low-precision map.

Op capture (:mod:`fp16probe.capture.ops`), the forward audit (:mod:`fp16probe.capture.forward`)
and the emulated step (:mod:`fp16probe.capture.emulate`) each run a ``TorchFunctionMode`` over
the probed model's forward and need the same two things:

- :class:`ModuleStack`, the module calls the running op is inside, innermost last, each frame
  counting the ops named in it (``"block.attn/softmax"``, a second ``add`` ``"block/add.1"``)
  and saying whether it is inside a selected module (op capture's selection, the emulation's
  modules kept in fp32);
- :class:`DtypeTracker`, for each tensor made in the forward, whether it would be low
  precision (fp16/bf16) in the target run, per target device, keyed by the tensor's id with a
  weakref that guards against a reused id; and the ``torch.autocast`` regions the model
  entered (a region with autocast off leaves type promotion alone to decide).

The modes call their methods and write none of their attributes.

Why not ``torch.utils.module_tracker.ModuleTracker`` (which ``flop_counter`` reuses): its
``parents`` is a set, so the innermost module an op ran in is not known; it names modules by
class (``"Linear"``, ``"Sequential.0"``), not by the probed model's ``named_modules``; and it
registers multi-grad hooks on every module's inputs and outputs, autograd nodes in the very
graph the overflow ceiling walks and the probe's gradient hooks fill.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from torch import nn
from torch.overrides import TorchFunctionMode

from fp16probe.capture.autocast_rules import around_autocast

__all__ = ["DtypeTracker", "Frame", "ModuleStack", "is_low_dtype", "leave_mode", "watched_forward"]

_LOW_DTYPES = (torch.float16, torch.bfloat16)


def is_low_dtype(t: torch.Tensor) -> bool:
    """Whether ``t`` is fp16 or bf16 as it is: the low-precision answer for a tensor not made in the forward."""
    return t.dtype in _LOW_DTYPES


class Frame:
    """One module call on the stack: its display name, whether it is selected, the ops counted in it."""

    __slots__ = ("name", "counts", "selected")

    def __init__(self, name: str, selected: bool) -> None:
        self.name = name
        self.selected = selected
        self.counts: dict[str, int] = {}


class ModuleStack:
    """The module calls a forward is inside, innermost last; the bottom frame is the root's.

    ``push``/``pop`` come from module hooks (registered with ``always_call=True``, so a module
    that raises still pops); ``pop`` never takes the root frame, which ``reset`` sets.
    """

    __slots__ = ("_frames",)

    def __init__(self) -> None:
        self._frames: list[Frame] = []

    def __bool__(self) -> bool:
        return bool(self._frames)

    def reset(self, root: str, selected: bool = True) -> None:
        """Start a forward: only the root's frame."""
        self._frames = [Frame(root, selected)]

    def clear(self) -> None:
        """End a forward: no frame."""
        self._frames.clear()

    def push(self, name: str, selected: bool = False) -> None:
        """Enter a module call; it is selected when ``selected`` or the module it runs in is."""
        parent = bool(self._frames) and self._frames[-1].selected
        self._frames.append(Frame(name, selected or parent))

    def pop(self) -> None:
        """Leave the innermost module call (the root's frame stays)."""
        if len(self._frames) > 1:
            self._frames.pop()

    @property
    def top(self) -> Frame:
        """The innermost module call (call only while a forward runs: the root's frame is there)."""
        return self._frames[-1]

    def name_op(self, op: str) -> str:
        """The row name of the next ``op`` in the innermost module: ``"<module>/<op>"``, ``".<n>"`` from the second."""
        frame = self._frames[-1]
        n = frame.counts.get(op, 0)
        frame.counts[op] = n + 1
        return f"{frame.name}/{op}" if n == 0 else f"{frame.name}/{op}.{n}"


class DtypeTracker:
    """Whether each tensor of a forward would be low precision in the target run, per target device.

    Args:
        targets: the target devices (``"cuda"``, ``"cpu"``), or one key for a single answer.
        initial: the answer for a tensor the forward did not make (a weight, an input), the same
            on every target; default: its own dtype is fp16 or bf16.
    """

    __slots__ = ("targets", "_initial", "_low", "_autocast")

    def __init__(self, targets: Sequence[str], initial: Callable[[torch.Tensor], bool] = is_low_dtype) -> None:
        self.targets = tuple(targets)
        self._initial = initial
        self._low: dict[int, tuple[weakref.ref, Any]] = {}
        self._autocast: list[tuple[str, bool]] = []  # autocast contexts the model entered: (device, enabled)

    # -- the map ------------------------------------------------------------------------------
    def lows(self, t: torch.Tensor) -> dict[str, bool]:
        """Whether ``t`` would be low precision, by target."""
        got = self._low.get(id(t))
        if got is not None and got[0]() is t:
            return got[1]
        base = self._initial(t)
        return {target: base for target in self.targets}

    def is_low(self, t: torch.Tensor, target: str) -> bool:
        """Whether ``t`` would be low precision on ``target``."""
        got = self._low.get(id(t))
        if got is not None and got[0]() is t:
            return got[1][target]
        return self._initial(t)

    def known(self, t: torch.Tensor) -> bool:
        """Whether ``t`` was made in this forward (marked), as opposed to answered by its dtype."""
        got = self._low.get(id(t))
        return got is not None and got[0]() is t

    def mark(self, t: torch.Tensor, lows: Mapping[str, bool]) -> None:
        """Note what ``t`` would be, by target."""
        self._low[id(t)] = (weakref.ref(t), lows)

    def clear(self) -> None:
        """Forget the forward's tensors."""
        self._low.clear()

    # -- autocast regions -----------------------------------------------------------------------
    def autocast_off(self, target: str) -> bool:
        """Whether the model switched ``target``'s autocast off around the op running now."""
        for device, enabled in reversed(self._autocast):
            if device == target:
                return not enabled
        return False

    def regime_here(self, target: str, regime: str) -> str:
        """The regime of the op running now on ``target``: ``regime``, or ``"pure_fp16"`` where the model
        switched autocast off (type promotion alone decides there)."""
        return "pure_fp16" if regime == "autocast" and self.autocast_off(target) else regime

    @contextlib.contextmanager
    def watching_autocast(self) -> Iterator[None]:
        """Keep the stack of autocast contexts the code run inside this block enters, in this thread.

        The profile runs without autocast, so a region the model runs with autocast off (a
        ``torch.autocast(device, enabled=False)`` block, as :func:`fp16probe.keep_in_fp32` and
        hand-written fp32 islands use) changes no state a mode could read. Entering and leaving
        ``torch.autocast`` (its subclasses and its decorator form go through these two methods)
        is noted instead: ``(device_type, enabled)``, innermost last.
        """
        frames = self._autocast
        thread = threading.get_ident()
        entered: set[int] = set()

        def watched_enter(enter: Any, ctx: Any) -> Any:
            got = enter(ctx)
            if threading.get_ident() == thread:
                frames.append((str(ctx.device), bool(ctx._enabled)))
                entered.add(id(ctx))
            return got

        def watched_exit(leave: Any, ctx: Any, *exc: Any) -> Any:
            if id(ctx) in entered and frames:
                entered.discard(id(ctx))
                frames.pop()
            return leave(ctx, *exc)

        try:
            with around_autocast(watched_enter, watched_exit):
                yield
        finally:
            frames.clear()


def leave_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off the torch function mode stack, if it is still there.

    A signal (Ctrl-C, SIGHUP) raised at the wrong moment inside torch's own dispatch, between
    its taking the running mode off the stack and putting it back, leaves the mode off the
    stack: a plain ``with mode:`` would then raise "trying to pop from empty mode stack" on the
    way out and hide the signal behind a RuntimeError.
    """
    try:
        stack = torch.overrides._get_current_function_mode_stack()
    except Exception:  # a torch without the helper: leave as a with statement would
        stack = [mode]
    if stack and stack[-1] is mode:
        mode.__exit__(None, None, None)
    elif mode in stack:  # modes entered inside ours and left on (an interrupted forward): ours goes too
        while stack and stack[-1] is not mode:
            stack[-1].__exit__(None, None, None)
            stack = torch.overrides._get_current_function_mode_stack()
        mode.__exit__(None, None, None)


@contextlib.contextmanager
def watched_forward(push: Callable[..., Any], pop: Callable[..., Any], mode: TorchFunctionMode,
                    dtypes: "DtypeTracker") -> Iterator[None]:
    """Run the block with ``push``/``pop`` on every module's forward, ``mode`` entered and autocast watched.

    The forward audit and the emulated step watch a forward this one way; every hook and the mode
    are undone on the way out, also by an exception or a signal (:func:`leave_mode`).
    """
    pre = nn.modules.module.register_module_forward_pre_hook(push)
    post = nn.modules.module.register_module_forward_hook(pop, always_call=True)
    try:
        with dtypes.watching_autocast():
            mode.__enter__()
            try:
                yield
            finally:
                leave_mode(mode)
    finally:
        pre.remove()
        post.remove()
