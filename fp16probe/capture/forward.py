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
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fp16probe.capture.autocast_rules import CAST_OPS, REGIMES, TARGETS, cast_is_low, op_name, output_is_low
from fp16probe.capture.collector import Collected, Collector
from fp16probe.capture.ops import LAYOUT_OPS
from fp16probe.formats import get_format
from fp16probe.capture.recorder import ROOT_NAME, iter_tensors
from fp16probe.capture.tracking import DtypeTracker, ModuleStack, watched_forward
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
        self._modules = ModuleStack()
        self._dtypes = DtypeTracker(self.targets, self._initial_low)
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
        self._modules.reset(ROOT_NAME)
        try:
            with watched_forward(self._push, self._pop, _Mode(self), self._dtypes):
                yield self
        finally:
            self._dtypes.clear()
            self._seen.clear()

    def note_loss(self, loss: torch.Tensor) -> None:
        """Record the dtype ``loss`` would have in the target run, and custom Functions behind it."""
        try:
            low = self._dtypes.lows(loss)
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
            self._modules.push(name)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name is not None and name != ROOT_NAME:
            self._modules.pop()

    # -- dtypes -----------------------------------------------------------------------------
    def _initial_low(self, t: torch.Tensor) -> bool:
        if t.dtype in (torch.float16, torch.bfloat16):
            return True
        return self.regime == "pure_fp16" and t.dtype == torch.float32

    # -- observing ----------------------------------------------------------------------------
    def _observe(self, func: Any, args: Sequence[Any], kwargs: Any, out: Any) -> Any:
        """Work out the op's output dtype on each target; measure what would be fp16 there."""
        outs = [t for t in iter_tensors(out) if t.is_floating_point()]
        if not outs:
            return out
        op = op_name(func)
        inputs = [t for t in iter_tensors(list(args) + list(kwargs.values())) if isinstance(t, torch.Tensor)]
        floats_in = [t for t in inputs if t.is_floating_point()]
        lows_in = [self._dtypes.lows(t) for t in floats_in]
        out, outs, low = self._output_lows(func, op, args, kwargs, out, outs, lows_in)
        for t in outs:
            self._dtypes.mark(t, low)
        if op in _LAYOUT or (op in CAST_OPS and not any(low.values())):
            return out
        name = self._modules.name_op(op)
        module = self._modules.top.name
        fp16_targets = {t for t, v in low.items() if v}
        if fp16_targets:
            for t in outs:
                self._measure(t, name, module, op, "output", fp16_targets)
            if op not in CAST_OPS:
                self._observe_inputs(name, module, op, floats_in, lows_in, fp16_targets)
        return out

    def _output_lows(self, func: Any, op: str, args: Sequence[Any], kwargs: Any, out: Any, outs: list[torch.Tensor],
                     lows_in: list[dict[str, bool]]) -> tuple[Any, list[torch.Tensor], dict[str, bool]]:
        """What the op's output would be on each target (and the output, given its own identity by a cast)."""
        if op in CAST_OPS:
            return self._cast(op, args, kwargs, out, outs, lows_in)
        if op in _LAYOUT or op.endswith("_") or (args and out is args[0]):  # the first input's dtype passes
            return out, outs, {target: bool(lows_in) and lows_in[0][target] for target in self.targets}
        return out, outs, self._computed(func, args, kwargs)

    def _cast(self, op: str, args: Sequence[Any], kwargs: Any, out: Any, outs: list[torch.Tensor],
              lows_in: list[dict[str, bool]]) -> tuple[Any, list[torch.Tensor], dict[str, bool]]:
        """An explicit conversion: what it makes on each target (and the output, given its own identity if needed)."""
        low: dict[str, bool] = {}
        changed = False
        for target in self.targets:
            c = cast_is_low(op, args, kwargs, lambda t, _target=target: self._dtypes.is_low(t, _target))
            low[target] = (lows_in[0][target] if lows_in else False) if c is None else c
            changed = changed or c is not None
        if args and out is args[0] and isinstance(out, torch.Tensor) and changed:
            if low != self._dtypes.lows(out):
                out = out.view_as(out)  # the real run makes a new tensor here: give it its own identity
                outs = [out]
        return out, outs, low

    def _computed(self, func: Any, args: Sequence[Any], kwargs: Any) -> dict[str, bool]:
        """A computing op: its output's dtype on each target, by that target's rules in force here."""
        low: dict[str, bool] = {}
        for target in self.targets:
            def is_low(t: torch.Tensor, _target: str = target) -> bool:
                return self._dtypes.is_low(t, _target)

            low[target] = output_is_low(func, args, kwargs, is_low, target,
                                        self._dtypes.regime_here(target, self.regime))
        return low

    def _observe_inputs(self, name: str, module: str, op: str, floats_in: list[torch.Tensor],
                        lows_in: list[dict[str, bool]], fp16_targets: set[str]) -> None:
        """The inputs of an op that computes in fp16: casts autocast makes, and fp16 tensors from other modules."""
        for t, lin in zip(floats_in, lows_in):
            if t.dim() == 0:
                continue
            cast_to = {target for target in fp16_targets
                       if not lin[target] and self._dtypes.regime_here(target, self.regime) == "autocast"}
            if cast_to:  # autocast casts this fp32 input to fp16 for the op
                pname = self._params.get(id(t))
                label = pname if pname is not None else f"{name}:in"
                self._measure(t, label, module, op, "weight" if pname is not None else "input", cast_to)
                continue
            # An fp16 input made in another module: this module consumes it (an overflow
            # there is this module's problem too, whoever made it).
            seen = self._seen.get(id(t))
            if seen is not None and seen[0]() is t and seen[1] != module:
                self._record(f"{name}:in", module, op, "consumer", fp16_targets, seen[2], seen[3])

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
            stats = torch.stack([  # count_nonzero: a third to half the CPU time of a boolean .sum()
                torch.count_nonzero(nonzero),
                torch.count_nonzero(nonzero & (a <= FLUSH_AT)),
                torch.count_nonzero((a > FLUSH_AT) & (a < SUBNORMAL_BELOW)),
                torch.count_nonzero((a >= OVERFLOW_AT) & real),
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
