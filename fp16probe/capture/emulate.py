"""The target run's step, emulated: every value the target holds in fp16 (or bf16) rounded to it.

A profile counts fp32 values against the bounds of a format; a real fp16 run is judged by
its gradients. This module runs one training step (forward, loss, backward) on any device,
in fp32 arithmetic, with every tensor that is low-precision in the target run rounded to
that format where the target rounds it:

- each op's output dtype in the target run comes from :mod:`fp16probe.capture.autocast_rules`
  (torch's own autocast dispatch asked on fake tensors of the target device, CUDA or CPU, or
  plain type promotion for a ``.half()`` model, ``regime="pure_fp16"``);
- an op the target's autocast lowers gets its fp32 inputs rounded (autocast's cast), and a
  low-precision output is rounded after the op computes in fp32 (what fp16 kernels do with
  their fp32 "opmath");
- a tensor an op saves for backward and returns is saved as the target saves it, rounded
  (``saved_tensors_hooks``): tanh, sigmoid, exp and softmax compute their gradients from their
  own output, and GELU-tanh written out (``gelu_new``) then gets exactly 0 where fp16's tanh
  is -1, as the real run does, not fp32's tiny 1 - t^2;
- every rounded tensor's gradient is rounded in backward too (:class:`RoundTo`: the gradient
  of an fp16 tensor is an fp16 tensor), so a loss held in fp16 gets its seed gradient, the
  loss scale S, as an fp16 number (inf from S = 65520 on), as the real run does;
- the scale is applied as ``torch.amp.GradScaler`` applies it: ``loss * S`` with S an fp32
  tensor, backward, then the fp32 gradients multiplied by 1/S; a ``.half()`` model's
  gradients are fp16 and rounded once more at the end;
- inside ``torch.autocast(target, enabled=False)`` (:func:`fp16probe.keep_in_fp32`, or the
  model's own fp32 islands) ops follow type promotion and nothing is cast; a module named in
  ``keep_fp32`` runs unrounded, as that fix would run it, without the fix applied;
- the ops outside the model (the loss) are emulated too; with :data:`fp16probe.emulation.LOSS` in
  ``keep_fp32`` they run unrounded, reading autocast off, as a loss computed in fp32 on the
  model's output runs;
- code that reads the autocast state (``torch.is_autocast_enabled``, ``torch.get_autocast_dtype``:
  a loss written to compute in the run's precision, an attention casting to the autocast dtype)
  reads the target run's (:func:`~fp16probe.capture.autocast_rules.answering_autocast_state`), and
  what it then casts to the low format is rounded like any explicit cast.

What it does not model: the order in which a fused kernel or a GEMM accumulates (fp32 in
both, but not the same order), gradients summed in fp16 across a tensor's uses (summed here
in fp32, then rounded once), stochastic
rounding, and fp8. docs/fp16-run.md gives the agreement measured against real CPU autocast.

The pass is a ``TorchFunctionMode``; it costs one Python call per op and one rounding per
low-precision tensor, so the profile runs it on a few batches only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fp16probe.capture.autocast_rules import (
    CAST_OPS,
    REGIMES,
    TARGETS,
    answering_autocast_state,
    cast_is_low,
    op_name,
    output_is_low,
)
from fp16probe.capture.ops import LAYOUT_OPS
from fp16probe.capture.recorder import ROOT_NAME, iter_tensors
from fp16probe.capture.state import kept_training_state
from fp16probe.emulation import LOSS
from fp16probe.capture.tracking import DtypeTracker, ModuleStack, watched_forward

__all__ = ["EmulatedStep", "RoundTo", "emulated_step", "emulating", "measure_effect", "merged_setting", "reference_step"]

_LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_LAYOUT = (LAYOUT_OPS - CAST_OPS) | {"repeat"}
_NO_TENSORS = (bool, int, float, str, type(None), torch.device, torch.dtype, torch.Size)


class RoundTo(torch.autograd.Function):
    """Round a tensor to ``dtype`` and back (nearest even, overflow to inf); its gradient likewise."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        """Round ``x``'s values."""
        ctx.low = dtype
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        """Round the gradient."""
        return grad.to(ctx.low).to(grad.dtype), None


class _Saved:
    """A tensor autograd saved for backward while an emulated op ran; the emulator may swap in its rounded value."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @staticmethod
    def packed(t: torch.Tensor, saved: list["_Saved"]) -> "_Saved":
        s = _Saved(t)
        saved.append(s)
        return s

    @staticmethod
    def unpacked(s: "_Saved") -> torch.Tensor:
        return s.tensor


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.requires_grad and torch.is_grad_enabled():
        return RoundTo.apply(t, dtype)
    return t.to(dtype).to(t.dtype)


@dataclass(frozen=True)
class EmulatedStep:
    """One step's gradients (fp32, unscaled) and what it saw; tensors stay on their device.

    ``grads``: parameter name -> gradient (None where the step gave it none). ``order``: the
    parameters in the order the forward first used them. ``module_order``: modules in the
    order their forward began. ``loss_low``: whether the loss was held in the low format.
    ``ops``/``rounded``: ops seen and tensors rounded (how much of the step was emulated).
    """

    grads: dict[str, torch.Tensor | None]
    order: tuple[str, ...]
    module_order: tuple[str, ...]
    loss: float
    loss_low: bool
    scale: float
    ops: int
    rounded: int
    rounded_outside: int
    # module name -> its first floating output (the reference step, with keep_outputs), or
    # [||out_emulated - out_fp32||^2, ||out_fp32||^2] (the emulated step given those), in the order
    # the modules' forwards finished
    outputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class _Mode(TorchFunctionMode):
    def __init__(self, em: "_Emulator") -> None:
        super().__init__()
        self.em = em

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        return self.em.call(func, tuple(args), dict(kwargs or {}))


class _Emulator:
    """The state of one emulated forward: which tensors are low, the module stack, the order seen."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, target: str, regime: str, keep: set[str],
                 reference: dict[str, torch.Tensor] | None = None) -> None:
        self.reference = reference or {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.dtype, self.target, self.regime = dtype, target, regime
        self.names = {id(m): (n or ROOT_NAME) for n, m in model.named_modules()}
        self.kept_ids = {id(m) for n, m in model.named_modules() if n in keep}
        self.params = {id(p): n for n, p in model.named_parameters()}
        self.dtypes = DtypeTracker((target,), self._initial_low)
        self.stack = ModuleStack()  # a frame is selected inside a module kept in fp32
        self.stack.reset("", False)  # outside the model (the loss); the model's root is pushed like any module
        self.loss_kept = LOSS in keep  # the root's frame runs unrounded, the model's modules in it do not
        self.order: dict[str, None] = {}
        self.module_order: dict[str, None] = {}
        self.ops = 0
        self.rounded = 0
        self.rounded_outside = 0

    # -- module stack ---------------------------------------------------------------------
    @property
    def outside(self) -> bool:
        """Whether the op running now is outside the model's forward (the root's frame: the loss)."""
        return not self.stack.top.name

    @property
    def kept(self) -> bool:
        """Whether the op running now is inside a module kept in fp32 (or outside the model, the loss kept)."""
        return self.stack.top.selected or (self.loss_kept and self.outside)

    def push(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.module_order.setdefault(name, None)
            self.stack.push(name, id(module) in self.kept_ids)

    def pop(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.pop()
        out = _first_float(output)
        if out is not None and out.requires_grad and self.is_low(out):
            # global forward hooks run before a module's own: a gradient hook registered later on
            # this output (verify's) reads the gradient rounded, as the target run has it
            out.register_hook(self.round_grad)
        ref = self.reference.get(name) if name is not None else None
        if ref is not None and name not in self.outputs:
            if out is not None and out.shape == ref.shape:
                with torch.no_grad(), torch._C.DisableTorchFunction():
                    d = out.detach().double() - ref.double()
                    self.outputs[name] = torch.stack([d.square().sum(), ref.double().square().sum()])

    def autocast_state(self, device: str, what: str) -> Any:
        """What code reading the autocast state of ``device`` reads in the target run: on the target, the
        low dtype, and autocast on except where the model switched it off or a module is kept in fp32."""
        if device.split(":")[0] != self.target:
            return None
        if what == "dtype":
            return self.dtype
        return not (self.kept or self.dtypes.autocast_off(self.target))

    # -- dtypes ---------------------------------------------------------------------------
    def is_low(self, t: torch.Tensor) -> bool:
        return self.dtypes.is_low(t, self.target)

    def _initial_low(self, t: torch.Tensor) -> bool:
        if t.dtype in (torch.float16, torch.bfloat16):
            return True
        # A .half() model holds its weights and inputs in fp16: an fp32 tensor from outside
        # the step is low there (rounded where it is first used).
        return self.regime == "pure_fp16" and t.dtype == torch.float32 and not self.kept

    def round_grad(self, g: torch.Tensor) -> torch.Tensor:
        """A gradient as the target holds it for a low-precision tensor."""
        return g.to(self.dtype).to(g.dtype)

    def mark(self, t: torch.Tensor, low: bool) -> None:
        self.dtypes.mark(t, {self.target: low})

    def held(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the target holds it in the low format (rounded, with a rounding gradient)."""
        r = _round(t, self.dtype)
        self.rounded += 1
        if self.outside:
            self.rounded_outside += 1
        self.mark(r, True)
        return r

    # -- ops ------------------------------------------------------------------------------
    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.ops += 1
        for t in iter_tensors(list(args) + list(kwargs.values())):
            name = self.params.get(id(t))
            if name is not None:
                self.order.setdefault(name, None)
        op = op_name(func)
        if self.kept:  # autocast off, fp32 inputs: the op runs as it is written
            out = func(*args, **kwargs)
            for t in iter_tensors(out):
                if t.is_floating_point():
                    self.mark(t, t.dtype in (torch.float16, torch.bfloat16))
            return out
        if op in CAST_OPS:
            return self._cast(func, op, args, kwargs)
        if op in _LAYOUT or op.endswith("_") or "out" in kwargs:
            out = func(*args, **kwargs)
            if isinstance(out, _NO_TENSORS):
                return out
            first = next((t for t in iter_tensors(list(args)) if t.is_floating_point()), None)
            low = first is not None and self.is_low(first)
            outs = [t for t in iter_tensors(out) if t.is_floating_point()]
            if low and op not in _LAYOUT and outs and outs[0].dtype == torch.float32:
                with torch.no_grad():  # an in-place op on a low tensor writes low values
                    for t in outs:
                        t.copy_(t.to(self.dtype))
            for t in outs:
                self.mark(t, low)
            return out
        off = self.regime == "autocast" and self.dtypes.autocast_off(self.target)
        low = output_is_low(func, args, kwargs, self.is_low, self.target, "pure_fp16" if off else self.regime)
        if low and not off:  # with autocast off, an op is low only when all its inputs are: nothing to cast
            args, kwargs = self._lowered_inputs(args, kwargs)
        if not (low and torch.is_grad_enabled()):
            out = func(*args, **kwargs)
            return out if isinstance(out, _NO_TENSORS) else self._outputs(out, low)
        # The op may save its own output for backward (tanh, sigmoid, exp, softmax, sqrt): the
        # target saves it in the low format, as it returns it. Autograd would save the fp32 value
        # computed here, before the rounding below: tanh's 1 - t^2 of an unrounded t near -1 is a
        # small gradient where the target's t is exactly -1 and its gradient 0.
        saved: list[_Saved] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved.packed(t, saved), _Saved.unpacked):
            out = func(*args, **kwargs)
        if isinstance(out, _NO_TENSORS):
            return out
        rounded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        out = self._outputs(out, low, rounded)
        for s in saved:  # a saved output is held as the target holds it: rounded
            got = rounded.get(id(s.tensor))
            if got is not None and got[0] is s.tensor:
                s.tensor = got[1]
        return out

    def _lowered_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The op's inputs as the target passes them: fp32 ones autocast casts, and outside values, rounded."""
        def conv(obj: Any, depth: int = 0) -> Any:
            if isinstance(obj, torch.Tensor):
                if not obj.is_floating_point() or obj.dtype != torch.float32:
                    return obj
                if self.dtypes.known(obj) and self.is_low(obj):
                    return obj  # made in the step and already held low
                if obj.dim() == 0 and self.regime == "autocast":
                    return obj  # a 0-d fp32 operand does not decide the dtype and is not cast
                return self.held(obj)
            if depth < 3 and isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
                return type(obj)(conv(v, depth + 1) for v in obj)
            return obj

        return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}

    def _outputs(self, out: Any, low: bool, rounded: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
        """Mark the op's floating outputs; round the low fp32 ones (each noted in ``rounded``: id -> (it, rounded))."""
        if isinstance(out, torch.Tensor):
            if not out.is_floating_point():
                return out
            if low and out.dtype == torch.float32:
                r = self.held(out)
                if rounded is not None:
                    rounded[id(out)] = (out, r.detach())
                return r
            self.mark(out, low)
            return out
        if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
            return type(out)(self._outputs(v, low, rounded) for v in out)
        for t in iter_tensors(out):
            if t.is_floating_point():
                self.mark(t, low)
        return out

    def _cast(self, func: Any, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An explicit conversion: to a low dtype it rounds (and stays fp32 here); up, it passes."""
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        c = cast_is_low(op, args, kwargs, self.is_low)
        if src is None or not src.is_floating_point():
            return func(*args, **kwargs)
        if c is None:  # .to(device) and the like: the dtype stays
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                if out is src:
                    return out
                self.mark(out, self.is_low(src))
            return out
        if c:
            base = src if src.dtype == torch.float32 else src.float()
            if self.dtypes.known(src) and self.is_low(src):
                out = base.view_as(base)  # already held low: the cast changes nothing
                self.mark(out, True)
                return out
            return self.held(base)
        # up to fp32 (or fp64): exact from a low value
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            if out is src:
                out = src.view_as(src)
            self.mark(out, False)
        return out


def _step_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Each trainable parameter's ``.grad`` by name: the step's own, read inside ``kept_training_state``."""
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _first_float(obj: Any) -> torch.Tensor | None:
    return next((t for t in iter_tensors(obj) if t.is_floating_point()), None)


def reference_step(model: nn.Module, run: Callable[[], torch.Tensor], *, keep_outputs: bool = False) -> EmulatedStep:
    """The fp32 step the emulated one is compared with: ``run()`` (forward and loss), backward, the gradients.

    The model's buffers, its ``.grad`` and the random state are as they were afterwards.
    ``keep_outputs``: also keep each module's first floating output (a copy, for
    :func:`emulated_step`'s ``reference_outputs``): a later in-place op (``ReLU(inplace=True)``
    after a BatchNorm) would otherwise change the output the emulated step is compared with.
    """
    names_of = {id(m): (n or ROOT_NAME) for n, m in model.named_modules()}
    outputs: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        name = names_of.get(id(module))
        out = _first_float(output)
        if name is not None and name not in outputs and out is not None:
            outputs[name] = out.detach().clone()  # as the module returned it, before any in-place op after it

    hook = nn.modules.module.register_module_forward_hook(keep) if keep_outputs else None
    try:
        with kept_training_state(model):
            loss = run()
            loss.backward()
            grads = _step_grads(model)
    finally:
        if hook is not None:
            hook.remove()
    names = tuple(grads)
    return EmulatedStep(grads=grads, order=names, module_order=(), loss=float(loss.detach()), loss_low=False,
                        scale=1.0, ops=0, rounded=0, rounded_outside=0, outputs=outputs)


@contextlib.contextmanager
def emulating(model: nn.Module, *, format: str = "fp16", target: str = "cuda", regime: str = "autocast",
              keep_fp32: Sequence[str] = (), reference_outputs: dict[str, torch.Tensor] | None = None
              ) -> Iterator["_Emulator"]:
    """Compute the forward run inside this block as the target run does (see the module docstring).

    A forward-only context, the emulated counterpart of ``torch.autocast``: the backward of
    what it made, run afterwards, rounds every low-precision tensor's gradient. Arguments as
    :func:`emulated_step`'s. Module outputs held low also round their gradient where a hook
    registered on them later reads it (a module output gradient is fp16 in the target run).
    """
    if format not in _LOW_DTYPES:
        raise ValueError(f"format must be one of {tuple(_LOW_DTYPES)}, got {format!r}")
    if target not in TARGETS or regime not in REGIMES:
        raise ValueError(f"target must be one of {TARGETS} and regime one of {REGIMES}, got {target!r}, {regime!r}")
    em = _Emulator(model, _LOW_DTYPES[format], target, regime, set(keep_fp32), reference_outputs)
    state = answering_autocast_state(em.autocast_state) if regime == "autocast" else contextlib.nullcontext()
    with state, watched_forward(em.push, em.pop, _Mode(em), em.dtypes):
        yield em


def emulated_step(model: nn.Module, run: Callable[[], torch.Tensor], *, format: str = "fp16",
                  target: str = "cuda", regime: str = "autocast", scale: float = 1.0,
                  keep_fp32: Sequence[str] = (), reference_outputs: dict[str, torch.Tensor] | None = None
                  ) -> EmulatedStep:
    """Run ``run()`` (forward and loss, in fp32 and without autocast) as the target run computes it.

    Args:
        model: the model (fp32 weights); its weights, buffers, ``.grad`` and the random state
            are as they were afterwards.
        run: makes the loss for one batch (the forward and the loss function).
        format: ``"fp16"`` or ``"bf16"``: the low format.
        target: the device whose autocast rules apply (``"cuda"``, ``"cpu"``), whatever device runs.
        regime: ``"autocast"`` or ``"pure_fp16"`` (a ``.half()`` model).
        scale: the loss scale S, applied as GradScaler applies it (1.0: none).
        keep_fp32: module names run in fp32 (as :func:`fp16probe.keep_in_fp32` runs them).
        reference_outputs: the fp32 step's module outputs (``reference_step(keep_outputs=True)``):
            each module's output error against them is kept in ``outputs``, on the device.

    Returns the unscaled fp32 gradients. Synchronises with the device once (the loss).
    """
    with kept_training_state(model):
        with emulating(model, format=format, target=target, regime=regime, keep_fp32=keep_fp32,
                       reference_outputs=reference_outputs) as em:
            loss = run()
            loss = loss.reshape(())
            loss_low = em.is_low(loss)
            if regime == "pure_fp16":
                loss = loss.float()  # DeepSpeed's fp16 engine: loss.float() * cur_scale
        s = torch.full((1,), float(scale), dtype=torch.float32, device=loss.device)
        (loss * s).backward()
        raw = _step_grads(model)
    inv = 1.0 / float(scale)
    grads: dict[str, torch.Tensor | None] = {}
    with torch.no_grad():
        for n, g in raw.items():
            if g is None:
                grads[n] = None
                continue
            if regime == "pure_fp16":
                g = g.to(em.dtype).float()  # a .half() model's gradients are fp16
            grads[n] = g * inv  # GradScaler.unscale_: fp32 multiplication by 1/S
    order = tuple(em.order) + tuple(n for n in grads if n not in em.order)
    return EmulatedStep(grads=grads, order=order, module_order=tuple(em.module_order), loss=float(loss.detach()),
                        loss_low=loss_low, scale=float(scale), ops=em.ops, rounded=em.rounded,
                        rounded_outside=em.rounded_outside, outputs=em.outputs)


def _compare(emulated: EmulatedStep, reference: EmulatedStep, names: Sequence[str]) -> torch.Tensor:
    """Per parameter: [||e - r||^2, ||r||^2, zeroed, nonzero, non-finite] (float64, on the gradients' device)."""
    rows = []
    for n in names:
        e, r = emulated.grads.get(n), reference.grads.get(n)
        if r is None:
            r = torch.zeros(()) if e is None else torch.zeros_like(e)
        if e is None:
            e = torch.zeros_like(r)
        r64, e64 = r.double(), e.double()
        nonzero = r != 0
        rows.append(torch.stack([
            (e64 - r64).square().sum(), r64.square().sum(),
            torch.count_nonzero(nonzero & (e == 0)).double(), torch.count_nonzero(nonzero).double(),
            torch.count_nonzero(~torch.isfinite(e)).double(),
        ]))
    return torch.stack([t.to(rows[0].device) for t in rows]) if rows else torch.zeros((0, 5), dtype=torch.float64)


def merged_setting(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two of :func:`measure_effect`'s settings (same S, same modules, other batches) as one over both batches.

    The sums add (an error that was not finite in either stays None); the module outputs are ``a``'s.
    """
    def add(x: Any, y: Any) -> Any:
        return None if x is None or y is None else x + y

    rows = [[add(p[0], q[0]), add(p[1], q[1]), p[2] + q[2], p[3] + q[3], p[4] + q[4]]
            for p, q in zip(a["params"], b["params"])]
    return {**a, "batches": a["batches"] + b["batches"], "loss_low": a["loss_low"] or b["loss_low"],
            "ops": a["ops"] + b["ops"], "rounded": a["rounded"] + b["rounded"],
            "rounded_outside": a.get("rounded_outside", 0) + b.get("rounded_outside", 0), "params": rows}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON holds no inf/NaN: None says "not finite"


def measure_effect(model: nn.Module, runs: Sequence[Callable[[], torch.Tensor]], *, format: str = "fp16",
                   target: str = "cuda", regime: str = "autocast",
                   settings: Sequence[tuple[int, Sequence[str]]] = ((0, ()),)) -> dict[str, Any]:
    """Emulated steps against fp32 steps on the same batches, as the JSON of the report's ``emulation`` section (fp16probe.emulation.Emulation).

    ``runs``: one call per batch, each making that batch's loss. ``settings``: (log2 of the loss
    scale, modules kept in fp32) pairs, each emulated on every batch. Per setting and parameter
    (parameters in the order the forward first used them) the sums over the batches of
    ``||g_emulated - g_fp32||^2`` and ``||g_fp32||^2``, the values nonzero in fp32 and zero in
    the emulated step, the nonzero values, and the non-finite ones. One host transfer per setting.
    """
    # the first batch's module outputs are kept to place a forward error (a module's output off fp32's)
    refs = [reference_step(model, run, keep_outputs=i == 0) for i, run in enumerate(runs)]
    order: tuple[str, ...] = ()
    out = []
    for log2_scale, keep in settings:
        total: torch.Tensor | None = None
        loss_low = False
        ops = rounded = outside = 0
        outputs: list[Any] = []
        for run, ref in zip(runs, refs):
            em = emulated_step(model, run, format=format, target=target, regime=regime,
                               scale=float(2.0**log2_scale), keep_fp32=keep, reference_outputs=ref.outputs or None)
            if em.outputs:
                names_out = list(em.outputs)
                outputs = [[n, v] for n, v in zip(names_out, torch.stack(list(em.outputs.values())).tolist())]
            if not order:
                order = tuple(n for n in em.order if n in ref.grads)
            rows = _compare(em, ref, order)
            total = rows if total is None else total + rows
            loss_low = loss_low or em.loss_low
            ops, rounded, outside = ops + em.ops, rounded + em.rounded, outside + em.rounded_outside
        rows_host = total.tolist() if total is not None else []
        out.append({"log2_scale": int(log2_scale), "keep_fp32": list(keep), "loss_low": loss_low, "batches": len(runs),
                    "ops": ops, "rounded": rounded, "rounded_outside": outside,
                    # the first batch's module outputs, in the order their forwards finished:
                    # [name, [||out - out_fp32||^2, ||out_fp32||^2]]
                    "outputs": [[n, [_finite(a), _finite(b)]] for n, (a, b) in outputs],
                    # the error of a gradient that held inf/NaN is None: its non-finite count says it
                    "params": [[_finite(r[0]), _finite(r[1]), int(r[2]), int(r[3]), int(r[4])]
                               for r in rows_host]})
    return {
        "source": "fp16probe.capture.emulate: the profile's model and batches stepped with every value the target run "
                  "holds in the low format rounded to it, against an fp32 step of the same weights and batches",
        "format": format, "target": target, "regime": regime, "batches": len(runs),
        "parameters": list(order), "settings": out,
    }
