"""The forward pass as the target fp16 run computes it: headroom, underflow and the loss's dtype.

A loss scale acts only on backward. The forward pass of an fp16 run (autocast, or a model
converted with ``.half()``) has its own failures that no scale fixes: an op whose fp16
output passes 65504 becomes inf and the loss NaN (the trained-T5 feed-forward, attention
logits ``q @ k.T``), values that autocast casts to fp16 at or below 2^-25 become zero (the
layer's output and its weight gradient with them), and a loss computed in fp16 makes its
seed gradient, the loss scale S itself, an fp16 number that overflows from S = 65520 on.

:class:`ForwardAudit` watches a forward and its loss as they run in the profile (fp32, any
device) through a ``TorchFunctionMode``. For every op it works out the dtype its output
would have in the target run (:mod:`fp16probe.capture.autocast_rules`: CUDA or CPU
autocast, or pure fp16), and for every tensor that would be fp16 there (an op's output, or
an fp32 input that autocast casts to fp16 for a lowered op, weights included) it measures,
on the tensor's device and without a host sync: the largest magnitude, and how many nonzero
values would overflow (|x| >= 65520), flush to zero (|x| <= 2^-25) or go subnormal
(2^-25 < |x| < 2^-14 - 2^-25), the rounding edges of a cast from fp32. Values that are inf
or fp32's own max in the fp32 run (an additive attention mask of ``finfo.min``) are
sentinels the fp32 run holds as well: they are left out of the maximum and of the overflow. Names are
``"<module>/<op>"`` for op outputs (the innermost module the op ran in) and
``"<module>/<op>:in"`` for casts into a lowered op (role ``input``) and for fp16 tensors a
module takes in from another module (role ``consumer``: the same values as their producer's,
named so that a fix knows which modules consume an overflowing tensor). Everything comes to the host in
:meth:`ForwardAudit.result`, as JSON for the report's ``forward.audit``.

It also finds custom ``torch.autograd.Function`` nodes in the graph: their backward is
opaque to the overflow ceiling (only what flows in and out of them is seen).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fp16probe.capture.autocast_rules import (CAST_OPS, REGIMES, TARGETS, around_autocast, cast_is_low, op_name,
                                              output_is_low)
from fp16probe.capture.collector import Collected, Collector
from fp16probe.capture.ops import LAYOUT_OPS, leave_mode
from fp16probe.formats import get_format
from fp16probe.capture.recorder import ROOT_NAME, iter_tensors
from fp16probe.sections import ForwardSection

__all__ = ["FLUSH_AT", "OVERFLOW_AT", "SUBNORMAL_BELOW", "ForwardAudit", "custom_functions"]

# Rounding edges of an fp32 -> fp16 cast (round to nearest even): 2^-25 is a tie that goes to
# 0; 2^-14 - 2^-25 is a tie that goes up to the smallest normal; 65520 is a tie that goes to inf.
_FP16 = get_format("fp16")
FLUSH_AT = _FP16.min_subnormal / 2  # 2^-25
SUBNORMAL_BELOW = _FP16.min_normal - _FP16.min_subnormal / 2  # 2^-14 - 2^-25
OVERFLOW_AT = _FP16.overflow_threshold  # 65520
_FP32_MAX = torch.finfo(torch.float32).max

# Ops that move or view values without computing new ones: op capture's list less its casts
# (which change the dtype here), plus repeat (a copy of the same values).
_LAYOUT = (LAYOUT_OPS - CAST_OPS) | {"repeat"}
_NO_TENSORS = (bool, int, float, str, type(None), torch.device, torch.dtype, torch.Size)


class _Entry:
    """One named fp16 tensor of the forward, over the audited steps."""

    __slots__ = ("name", "module", "op", "role", "targets", "order", "steps")

    def __init__(self, name: str, module: str, op: str, role: str, order: int) -> None:
        self.name, self.module, self.op, self.role, self.order = name, module, op, role, order
        self.targets: set[str] = set()
        self.steps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # step -> (amax, [nonzero, flushed, sub, over])


class _Mode(TorchFunctionMode):
    def __init__(self, audit: "ForwardAudit") -> None:
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, _NO_TENSORS):
            return out
        try:
            out = self.audit._observe(func, args, kwargs, out)
        except Exception as e:  # bookkeeping must never break the run
            self.audit.errors += 1
            self.audit.first_error = self.audit.first_error or f"{type(e).__name__}: {e}"
        return out


@contextlib.contextmanager
def _watch_autocast(frames: list[tuple[str, bool]]) -> Iterator[None]:
    """Keep ``frames`` as the stack of autocast contexts the audited code enters, in this thread.

    The profile runs without autocast, so a region the model runs with autocast off (a
    ``torch.autocast(device, enabled=False)`` block, as :func:`fp16probe.keep_in_fp32` and
    hand-written fp32 islands use) changes no state the audit could read. Entering and leaving
    ``torch.autocast`` (its subclasses and its decorator form go through these two methods) is
    noted instead: ``(device_type, enabled)``, innermost last.
    """
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


class ForwardAudit(Collector):
    """Measure what the target fp16 run computes in forward; see the module docstring.

    A collector (:meth:`fp16probe.capture.probe.Probe.add`): its result joins the report's
    ``forward`` section as ``audit``. The caller enters :meth:`step` around each step's forward
    and loss, and hands it the loss (:meth:`note_loss`).

    Args:
        model: the module whose forward is audited (names come from its ``named_modules``).
        regime: ``"autocast"`` (fp32 weights, fp16 autocast) or ``"pure_fp16"`` (a model
            converted with ``.half()``: every tensor fp16 unless explicitly cast up).
        targets: the devices whose autocast rules to apply (``"cuda"``, ``"cpu"``).
    """

    key = "forward_audit"

    def __init__(self, model: nn.Module, *, regime: str = "autocast", targets: Sequence[str] = TARGETS) -> None:
        if regime not in REGIMES:
            raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
        self.model = model
        self.regime = regime
        self.targets = tuple(t for t in targets if t in TARGETS)
        self._names = {id(m): (n or ROOT_NAME) for n, m in model.named_modules()}
        self._params = {id(p): n for n, p in model.named_parameters()}
        self._stack: list[list[Any]] = []  # [module name, op counts]
        self._autocast: list[tuple[str, bool]] = []  # autocast contexts the model entered: (device, enabled)
        self._low: dict[int, tuple[weakref.ref, dict[str, bool]]] = {}
        self._seen: dict[int, tuple[weakref.ref, str, torch.Tensor, torch.Tensor]] = {}  # id -> (ref, module, amax, stats)
        self.entries: dict[str, _Entry] = {}
        self.step_index = -1
        self.steps: list[int] = []
        self.loss_low: dict[str, bool] = {}
        self.custom: list[str] = []
        self.errors = 0
        self.first_error: str | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int) -> Iterator["ForwardAudit"]:
        """Audit the forward and loss run inside this block, as step ``step``."""
        self.step_index = step
        self.steps.append(step)
        self._stack = [[ROOT_NAME, {}]]
        pre = nn.modules.module.register_module_forward_pre_hook(self._push)
        post = nn.modules.module.register_module_forward_hook(self._pop, always_call=True)
        mode = _Mode(self)
        try:
            with _watch_autocast(self._autocast):
                mode.__enter__()
                try:
                    yield self
                finally:
                    leave_mode(mode)
        finally:
            pre.remove()
            post.remove()
            self._low.clear()
            self._seen.clear()

    def note_loss(self, loss: torch.Tensor) -> None:
        """Record the dtype ``loss`` would have in the target run, and custom Functions behind it."""
        try:
            low = self._low_map(loss)
            for t in self.targets:
                self.loss_low[t] = self.loss_low.get(t, False) or low[t]
            if not self.custom and loss.grad_fn is not None:
                self.custom = custom_functions(loss)
        except Exception as e:
            self.errors += 1
            self.first_error = self.first_error or f"{type(e).__name__}: {e}"

    def _push(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is not None and name != ROOT_NAME:
            self._stack.append([name, {}])

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name is not None and name != ROOT_NAME and len(self._stack) > 1:
            self._stack.pop()

    # -- dtypes -----------------------------------------------------------------------------
    def _initial_low(self, t: torch.Tensor) -> bool:
        if t.dtype in (torch.float16, torch.bfloat16):
            return True
        return self.regime == "pure_fp16" and t.dtype == torch.float32

    def _low_map(self, t: torch.Tensor) -> dict[str, bool]:
        got = self._low.get(id(t))
        if got is not None and got[0]() is t:
            return got[1]
        base = self._initial_low(t)
        return {target: base for target in self.targets}

    def _regime_here(self, target: str) -> str:
        """The regime of the op running now on ``target``: autocast, unless the model switched it off here."""
        if self.regime == "autocast":
            for device, enabled in reversed(self._autocast):
                if device == target:
                    return "autocast" if enabled else "pure_fp16"  # off: type promotion alone decides
        return self.regime

    def _set_low(self, t: torch.Tensor, low: dict[str, bool]) -> None:
        self._low[id(t)] = (weakref.ref(t), low)

    # -- observing ----------------------------------------------------------------------------
    def _observe(self, func: Any, args: Sequence[Any], kwargs: Any, out: Any) -> Any:
        outs = [t for t in iter_tensors(out) if t.is_floating_point()]
        if not outs:
            return out
        op = op_name(func)
        inputs = [t for t in iter_tensors(list(args) + list(kwargs.values())) if isinstance(t, torch.Tensor)]
        floats_in = [t for t in inputs if t.is_floating_point()]
        lows_in = [self._low_map(t) for t in floats_in]
        low: dict[str, bool] = {}
        if op in CAST_OPS:
            changed = False
            for target in self.targets:
                c = cast_is_low(op, args, kwargs, lambda t, _target=target: self._low_map(t)[_target])
                low[target] = (lows_in[0][target] if floats_in else False) if c is None else c
                changed = changed or c is not None
            if args and out is args[0] and isinstance(out, torch.Tensor) and changed:
                if low != self._low_map(out):
                    out = out.view_as(out)  # the real run makes a new tensor here: give it its own identity
                    outs = [out]
        elif op in _LAYOUT or op.endswith("_") or (args and out is args[0]):
            for target in self.targets:
                low[target] = bool(lows_in) and lows_in[0][target]
        else:
            for target in self.targets:
                def is_low(t: torch.Tensor, _target: str = target) -> bool:
                    return self._low_map(t)[_target]

                low[target] = output_is_low(func, args, kwargs, is_low, target, self._regime_here(target))
        for t in outs:
            self._set_low(t, low)
        if op in _LAYOUT or (op in CAST_OPS and not any(low.values())):
            return out
        frame = self._stack[-1] if self._stack else [ROOT_NAME, {}]
        counts = frame[1]
        n = counts.get(op, 0)
        counts[op] = n + 1
        name = f"{frame[0]}/{op}" if n == 0 else f"{frame[0]}/{op}.{n}"
        fp16_targets = {t for t, v in low.items() if v}
        if fp16_targets:
            for t in outs:
                self._measure(t, name, frame[0], op, "output", fp16_targets)
        if fp16_targets and op not in CAST_OPS:
            for t, lin in zip(floats_in, lows_in):
                if t.dim() == 0:
                    continue
                cast_to = {target for target in fp16_targets
                           if not lin[target] and self._regime_here(target) == "autocast"}
                if cast_to:  # autocast casts this fp32 input to fp16 for the op
                    pname = self._params.get(id(t))
                    label = pname if pname is not None else f"{name}:in"
                    self._measure(t, label, frame[0], op, "weight" if pname is not None else "input", cast_to)
                    continue
                # An fp16 input made in another module: this module consumes it (an overflow
                # there is this module's problem too, whoever made it).
                seen = self._seen.get(id(t))
                if seen is not None and seen[0]() is t and seen[1] != frame[0]:
                    self._record(f"{name}:in", frame[0], op, "consumer", fp16_targets, seen[2], seen[3])
        return out

    def _measure(self, t: torch.Tensor, name: str, module: str, op: str, role: str, targets: set[str]) -> None:
        if t.numel() == 0 or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t:
            return
        with torch.no_grad(), torch._C.DisableTorchFunction():
            a = t.detach().abs().float()
            # inf and fp32's own max are sentinels the fp32 run holds too (an additive mask of
            # finfo.min, masked_fill(-inf)): not values that fp16 would make overflow.
            real = a < _FP32_MAX
            amax = torch.where(real, a, 0.0).amax()
            nonzero = a > 0
            stats = torch.stack([
                nonzero.sum(),
                (nonzero & (a <= FLUSH_AT)).sum(),
                ((a > FLUSH_AT) & (a < SUBNORMAL_BELOW)).sum(),
                ((a >= OVERFLOW_AT) & real).sum(),
            ])
        self._seen[id(t)] = (weakref.ref(t), module, amax, stats)
        self._record(name, module, op, role, targets, amax, stats)

    def _record(self, name: str, module: str, op: str, role: str, targets: set[str], amax: torch.Tensor,
                stats: torch.Tensor) -> None:
        entry = self.entries.get(name)
        if entry is None:
            entry = self.entries[name] = _Entry(name, module, op, role, len(self.entries))
        entry.targets |= targets
        old = entry.steps.get(self.step_index)
        if old is not None:  # the same name twice in a step (a module called twice): add up
            with torch._C.DisableTorchFunction():
                amax, stats = torch.maximum(old[0], amax), old[1] + stats
        entry.steps[self.step_index] = (amax, stats)

    # -- results ----------------------------------------------------------------------------
    def collect(self, got: Collected) -> dict[str, Any]:
        """The ``forward`` section with this audit in it."""
        forward = got.sections.get("forward") or ForwardSection()
        return {"forward": dataclasses.replace(forward, audit=self.result())}

    def result(self) -> dict[str, Any]:
        """Bring everything to the host (one transfer) as the JSON of the report's ``forward.audit``."""
        entries = sorted(self.entries.values(), key=lambda e: e.order)
        flat_max: list[torch.Tensor] = []
        flat_stats: list[torch.Tensor] = []
        for e in entries:
            for s in self.steps:
                got = e.steps.get(s)
                if got is not None:
                    flat_max.append(got[0].reshape(()).cpu())
                    flat_stats.append(got[1].cpu())
        maxes = torch.stack(flat_max).tolist() if flat_max else []
        stats = torch.stack(flat_stats).tolist() if flat_stats else []
        it_max, it_stats = iter(maxes), iter(stats)
        tensors = []
        for e in entries:
            per_step_max: list[float | None] = []  # None: the tensor was not made that step
            nonzero = flushed = sub = over = 0
            first_overflow: int | None = None
            for s in self.steps:
                if s not in e.steps:
                    per_step_max.append(None)
                    continue
                per_step_max.append(float(next(it_max)))  # finite: inf and fp32's max are left out in _measure
                nz, fl, sb, ov = (int(v) for v in next(it_stats))
                nonzero, flushed, sub, over = nonzero + nz, flushed + fl, sub + sb, over + ov
                if ov and first_overflow is None:
                    first_overflow = s
            seen = [m for m in per_step_max if m is not None]
            tensors.append({
                "name": e.name, "module": e.module, "op": e.op, "role": e.role,
                "fp16_on": sorted(e.targets),
                "max_abs": max(seen) if seen else None,
                "per_step_max": per_step_max,
                "nonzero": nonzero, "flushed": flushed, "subnormal": sub, "overflowed": over,
                "first_overflow_step": first_overflow,
            })
        return {
            "source": "fp16probe.capture.forward.ForwardAudit: the profile's own forward and loss, with the "
                      "target run's dtypes worked out op by op",
            "regime": self.regime,
            "targets": list(self.targets),
            "steps": list(self.steps),
            "loss_fp16_on": sorted(t for t, v in self.loss_low.items() if v),
            "custom_functions": list(self.custom),
            "tensors": tensors,
            "errors": self.errors,
            **({"first_error": self.first_error} if self.first_error else {}),
        }


def custom_functions(loss: torch.Tensor, limit: int = 100_000) -> list[str]:
    """Names of the custom ``torch.autograd.Function`` nodes in the graph behind ``loss``."""
    found: list[str] = []
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            name = type(node).__name__
            if name not in found:
                found.append(name)
        stack.extend(fn for fn, _ in node.next_functions)
    return found
