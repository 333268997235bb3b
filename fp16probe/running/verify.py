"""``fp16probe.verify``: run the recommended setting for real and set it beside the prediction.

After an fp32 profile and its recommendation, the same model (from the same weights) runs the
same batches twice, step by step: once in fp32 (the reference) and once under autocast in the
target format with the recommended ``torch.amp.GradScaler`` (CPU autocast where there is no
GPU). Every gradient the loss scale multiplies is compared value by value: the output
gradient of each module the profile hooked and every weight gradient. A value nonzero in the
fp32 run and exactly zero in the scaled run was lost; a step whose scaled gradients held
inf/NaN overflowed (the GradScaler backs off and skips it). This proves the recommendation for
these steps on these batches, not for a whole training run.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fp16probe.errors import Fp16ProbeError, InputError, ModelError, message_of
from fp16probe.formats import get_format
from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD, Report
from fp16probe.running.effect import loss_generators
from fp16probe.running.inputs import call_model, map_tensors, move_to
from fp16probe.running.losses import Loss, as_loss
from fp16probe.running.optimizers import OPTIMIZERS, make_optimizer
from fp16probe.verification import VALUE_TOLERANCE, Verification, tolerance_for

__all__ = ["VERIFIABLE_FORMATS", "verify"]

VERIFIABLE_FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16}  # what autocast can compute in
ALL_KINDS = "all"


def verify(
    model: nn.Module,
    report: Report,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | Loss | None = None,
    *,
    device: str | torch.device | None = None,
    tolerance: float | None = None,
    seed: int = 0,
    target: str | None = None,
) -> Verification:
    """Run ``report``'s recommendation for real on ``batches`` and return predicted against measured.

    Args:
        model: the model as it was before the profile (same weights); it is copied, never changed.
        report: an fp32 profile with its recommendation (``fp16probe.profile``'s result).
        batches: the batches the profile ran (one step each; as many steps as batches).
        loss_fn: the profile's loss (default: as in :func:`fp16probe.profile`).
        device: where to run (default: where the model's parameters are).
        tolerance: how far the measured zeroed share may lie from the predicted one (default:
            :func:`fp16probe.verification.tolerance_for` the prediction: 10% of it, at least 0.0001).
        seed: seeds the random number generators identically for both runs of each step
            (dropout draws the same masks in fp32 and in the target format).
        target: the device whose autocast the run is for (default: the one it runs on). Another
            device's (CUDA predicted from a CPU) runs the emulated step
            (:func:`fp16probe.capture.emulate.emulating`) in place of that autocast, and says so.

    The run uses the profile's optimizer (``report.workload.optimizer``) when it had one;
    otherwise the weights stay as they are. It synchronises with the device once per step.
    """
    rec, dtype = _checked(report, tolerance)
    loss = as_loss(loss_fn)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    batch_list = [move_to(b, dev) for b in batches]
    if not batch_list:
        raise InputError("batches: no batch to verify on")
    plan = _plan(report, dev, target, tolerance)
    reference, run_model = _models(model, dev, plan)
    tally = _run(reference, run_model, report, plan, batch_list, loss, seed, dev, dtype)
    return _verification(plan, tally, dev, len(batch_list))


@dataclasses.dataclass
class _Plan:
    """What the target run is (settled before any model is copied); ``notes`` and ``kwargs`` grow as it is set up."""

    rec: Any
    notes: list[str]
    kwargs: dict[str, Any]  # the GradScaler's settings the verification reports
    pure: bool  # a .half() model, no autocast
    fix: list[str]  # modules kept in fp32 (a forward verdict's fix)
    emulate: str | None  # the autocast device emulated, when it is not the one that runs
    predicted_zeroed: float
    predicted_overflow: int
    tolerance: float
    pure_scale: float | None = None
    kwargs_run: dict[str, Any] = dataclasses.field(default_factory=dict)  # the GradScaler's settings it runs with


@dataclasses.dataclass
class _Tally:
    """What the two runs measured, step by step."""

    counts: dict[str, list[int]]  # kind -> [nonzero in fp32, of those zero in target]
    errors: dict[str, list[float]]  # kind -> [sum |fp16 - fp32|, sum |fp32|]
    watch: "_FirstNonfinite"
    overflow_steps: int = 0
    scales: list[float] = dataclasses.field(default_factory=list)
    # module -> [fp32 nonzero, of those zero in target, of those above the flush threshold at S in fp32], the
    # modules in backward order (the first step's; the two runs' graphs are the same)
    module_zeros: dict[str, list[int]] = dataclasses.field(default_factory=dict)


def _checked(report: Report, tolerance: float | None) -> tuple[Any, torch.dtype]:
    """The recommendation to verify and its dtype; refuse a report or tolerance that cannot be verified."""
    rec = report.recommendation
    if rec is None:
        raise InputError("report: it has no recommendation to verify; profile it with fp16probe.profile first")
    dtype = VERIFIABLE_FORMATS.get(rec.format)
    if dtype is None:
        raise InputError(
            f"format={rec.format!r}: verification runs the model under torch.autocast, which computes in "
            f"{' or '.join(VERIFIABLE_FORMATS)} only"
        )
    if tolerance is not None and not (isinstance(tolerance, (int, float)) and 0 <= tolerance <= 1):
        raise InputError(f"tolerance={tolerance!r}: expected a fraction in [0, 1], e.g. 0.01")
    return rec, dtype


def _plan(report: Report, dev: torch.device, target: str | None, tolerance: float | None) -> _Plan:
    """The regime, fix, emulated device, predictions and tolerance of the run, with their notes."""
    rec = report.recommendation
    notes: list[str] = []
    pure = report.metadata.regime == "pure_fp16"
    fix = (list(rec.evidence.get("fix_modules") or ())
           if rec.verdict in ("forward_overflow", "forward_underflow", "gradient_error") else [])
    emulate = target if target is not None and target != dev.type and not pure else None
    if emulate is not None:
        notes.append(f"emulated {rec.format} autocast on {emulate} (fp16probe.capture.emulate: every value that "
                     f"target holds in {rec.format} rounded to it) on {dev.type}: no {emulate} device ran")
    if rec.log2_scale is None and not fix:
        notes.append(f"the verdict is {rec.verdict}: there is no recommended scale, so this ran without a loss scaler")
    predicted_zeroed = rec.flushed_fraction_at_scale if rec.flushed_fraction_at_scale is not None else (
        rec.flushed_fraction_at_1 or 0.0)
    return _Plan(rec, notes, dict(rec.grad_scaler_kwargs), pure, fix, emulate, predicted_zeroed,
                 int(rec.overflow_steps_at_scale or 0),
                 tolerance if tolerance is not None else tolerance_for(predicted_zeroed))


def _models(model: nn.Module, dev: torch.device, plan: _Plan) -> tuple[nn.Module, nn.Module]:
    """Copies of ``model``: the fp32 reference and the target run's (its fix applied, .half() for a pure fp16 run)."""
    reference = copy.deepcopy(model).to(dev).float().train()
    target = copy.deepcopy(model).to(dev).float().train()
    if plan.fix:
        from fp16probe.running.fixes import keep_in_fp32

        keep_in_fp32(target, plan.fix, device_type=plan.emulate or dev.type)
        plan.notes.append(f"ran the fix the verdict prints: {', '.join(plan.fix)} kept in fp32 (autocast off inside)")
        backward_k = plan.rec.evidence.get("backward_log2_scale")
        if backward_k:
            plan.kwargs = {"init_scale": math.ldexp(1.0, int(backward_k))}
    if plan.pure:  # the user's regime: a .half() model, no autocast, loss.float() * S as DeepSpeed's fp16 mode does
        target = target.half()
        plan.pure_scale = float(plan.kwargs.get("init_scale", 1.0))
        plan.notes.append(f"ran as the model came: .half(), no autocast, loss.float() * {plan.pure_scale:g}, "
                          "no master weights")
        plan.kwargs_run = {}
    else:
        plan.kwargs_run = plan.kwargs
    return reference, target


def _run(reference: nn.Module, target: nn.Module, report: Report, plan: _Plan, batch_list: list[Any], loss: Loss,
         seed: int, dev: torch.device, dtype: torch.dtype) -> _Tally:
    """Run both models over the batches, step by step, and tally the gradients lost and their error."""
    scaler = torch.amp.GradScaler(dev.type, **plan.kwargs_run) if plan.kwargs_run else None
    optimizer_spec = None if report.workload is None else report.workload.optimizer
    if isinstance(optimizer_spec, Mapping) and optimizer_spec.get("name") not in OPTIMIZERS:
        plan.notes.append(f"the profile's optimizer {optimizer_spec.get('name')} is not rebuilt here; both runs kept "
                          "the weights they started from")
    ref_opt = _optimizer(reference, optimizer_spec)
    # GradScaler.step needs an optimizer; without one in the profile, SGD at lr 0 leaves the weights as they are.
    tgt_opt = _optimizer(target, optimizer_spec) or torch.optim.SGD(
        [p for p in target.parameters() if p.requires_grad], lr=0.0)
    names = [n for n in report.metadata.hooked_modules]
    tally = _Tally({ACTIVATION_GRAD: [0, 0], WEIGHT_GRAD: [0, 0]}, {ACTIVATION_GRAD: [0.0, 0.0], WEIGHT_GRAD: [0.0, 0.0]},
                   _FirstNonfinite(target))
    watch = tally.watch
    pure, pure_scale = plan.pure, plan.pure_scale
    # A loss that draws its own labels (the default's invented ones) draws the same ones for both runs of a step
    gens = loss_generators(loss.fn)
    with _OutputGrads(reference, names) as ref_grads, _OutputGrads(target, names) as tgt_grads, watch:
        for step, batch in enumerate(batch_list):
            states = [g.get_state() for g in gens]
            ref_w = _run_step(reference, batch, loss, step, seed, dev, None, None)
            for g, s in zip(gens, states):
                g.set_state(s)
            tally.scales.append(float(scaler.get_scale()) if scaler is not None else (pure_scale or 1.0))
            watch.step = step
            tgt_w = _run_step(target, batch, loss, step, seed, dev, None if pure else dtype, scaler,
                              pure_scale=pure_scale, watch=watch, emulate=plan.emulate)
            overflowed = _finish_target_step(target, scaler, None if pure else tgt_opt)
            tally.overflow_steps += int(overflowed)
            pairs = {
                ACTIVATION_GRAD: _pair(ref_grads.take(), tgt_grads.take(), plan.notes, "module output gradients"),
                WEIGHT_GRAD: _pair(ref_w, tgt_w, plan.notes, "weight gradients"),
            }
            if not overflowed:  # zeros and errors are counted on finite steps only
                _add_step(tally, pairs, scaler is not None, get_format(plan.rec.format).flush_threshold)
            if ref_opt is not None:
                ref_opt.step()
            reference.zero_grad(set_to_none=True)
            target.zero_grad(set_to_none=True)
    return tally


def _add_step(tally: _Tally, pairs: Mapping[str, list[tuple[str, torch.Tensor, torch.Tensor]]], scaled_step: bool,
              flush_threshold: float) -> None:
    """Add one finite step's lost values and error, by kind, and the output gradients' zeros by module."""
    for kind, named in pairs.items():
        # the computed zeros are counted on the output gradients, which the target run holds scaled
        rows = _compare(named, tally.scales[-1], flush_threshold if kind == ACTIVATION_GRAD else None)
        tally.counts[kind][0] += sum(r[0] for r in rows.values())
        tally.counts[kind][1] += sum(r[1] for r in rows.values())
        if kind == ACTIVATION_GRAD:
            for name, row in rows.items():
                acc = tally.module_zeros.setdefault(name, [0, 0, 0])
                for i, v in enumerate(row):
                    acc[i] += v
        # GradScaler.step unscaled the weight gradients in place; the rest are still scaled.
        unscaled = kind == WEIGHT_GRAD and scaled_step
        diff, size = _error([(r, t) for _, r, t in named], 1.0 if unscaled else 1.0 / tally.scales[-1])
        tally.errors[kind][0] += diff
        tally.errors[kind][1] += size


def _verification(plan: _Plan, tally: _Tally, dev: torch.device, steps: int) -> Verification:
    """Judge the measured figures against the prediction."""
    rec, notes, counts, errors = plan.rec, plan.notes, tally.counts, tally.errors
    by_kind = {k: _measured(counts[k], errors[k]) for k in counts}
    by_kind[ALL_KINDS] = _measured([sum(c) for c in zip(*counts.values())], [sum(e) for e in zip(*errors.values())])
    notes.extend(tally.watch.causes(tally.overflow_steps, steps, rec))
    kind = rec.kind if rec.kind in counts else ALL_KINDS
    measured = by_kind[kind]
    if measured["nonzero_values"] == 0:
        notes.append(f"the fp32 run had no nonzero {kind} values to compare")
    if plan.fix:  # the fix is proven when the run is finite on every step
        held = tally.overflow_steps == 0 and tally.watch.first_loss_step is None
    else:
        held = rec.log2_scale is not None and Verification.judge(
            plan.predicted_overflow, tally.overflow_steps, plan.predicted_zeroed, measured["zeroed_fraction"],
            plan.tolerance)
    error = measured.get("relative_error")
    if error is not None and error > VALUE_TOLERANCE:
        held = False
        notes.append(f"the fp16 run's {kind} gradients are {error * 100:.3g}% off the fp32 run's (sum of |fp16 - fp32| "
                     f"over sum of |fp32|, finite steps; tolerance {VALUE_TOLERANCE * 100:g}%): the run computes "
                     "different gradients, not only fewer")
    return Verification(
        precision=rec.format, device=str(dev) if plan.emulate is None else f"{dev}, emulating {plan.emulate}",
        steps=steps, scaler_kwargs=plan.kwargs, kind=kind,
        predicted_overflow_steps=plan.predicted_overflow, measured_overflow_steps=tally.overflow_steps,
        predicted_zeroed_fraction=float(plan.predicted_zeroed), measured_zeroed_fraction=measured["zeroed_fraction"],
        tolerance=float(plan.tolerance), held=held, nonzero_values=measured["nonzero_values"],
        zeroed_values=measured["zeroed_values"], by_kind=by_kind, scales=tuple(tally.scales), notes=tuple(notes),
        zeroed_by_module=tuple((n, *c) for n, c in tally.module_zeros.items() if c[1]),
    )


def _measured(count: list[int], error: list[float]) -> dict[str, Any]:
    """One kind's figures from [nonzero in fp32, of those zero in target] and [sum |fp16 - fp32|, sum |fp32|]."""
    nz, zeroed = count
    return {"nonzero_values": nz, "zeroed_values": zeroed, "zeroed_fraction": zeroed / nz if nz else 0.0,
            "relative_error": error[0] / error[1] if error[1] else None}


def _optimizer(model: nn.Module, spec: Any) -> torch.optim.Optimizer | None:
    if not isinstance(spec, Mapping) or spec.get("name") not in OPTIMIZERS:
        return None
    return make_optimizer(model, spec["name"], float(spec["lr"]))


def _run_step(model: nn.Module, batch: Any, loss: Loss, step: int, seed: int, device: torch.device,
              dtype: torch.dtype | None, scaler: Any, *, pure_scale: float | None = None,
              watch: "_FirstNonfinite | None" = None, emulate: str | None = None) -> dict[str, torch.Tensor]:
    """One forward and backward; return the weight gradients (scaled ones stay scaled: zeros are zeros)."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + step)
        try:
            if pure_scale is not None:
                half = map_tensors(batch, lambda t: t.half() if t.dtype == torch.float32 else t)
                value = loss.fn(call_model(model, half), half)
            elif dtype is None:
                value = loss.fn(call_model(model, batch), batch)
            elif emulate is not None:
                from fp16probe.capture.emulate import emulating

                fmt = "bf16" if dtype == torch.bfloat16 else "fp16"
                with emulating(model, format=fmt, target=emulate):
                    value = loss.fn(call_model(model, batch), batch)
            else:
                with torch.autocast(device_type=device.type, dtype=dtype):
                    value = loss.fn(call_model(model, batch), batch)
            value = value.reshape(())
            if watch is not None:
                watch.loss(value)
            if pure_scale is not None:
                (value.float() * pure_scale).backward()
            else:
                (scaler.scale(value) if scaler is not None else value).backward()
        except Fp16ProbeError:
            raise
        except Exception as e:  # the profile ran these batches; a failure now is the model's
            where = "fp32 reference" if dtype is None else f"{str(dtype).removeprefix('torch.')} run"
            raise ModelError(f"verification step {step + 1} ({where}): {type(e).__name__}: {message_of(e)}") from e
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _finish_target_step(model: nn.Module, scaler: Any, optimizer: torch.optim.Optimizer | None) -> bool:
    """Step the target run through its scaler; return whether its gradients held inf/NaN."""
    if scaler is not None and optimizer is not None:
        before = scaler.get_scale()
        scaler.step(optimizer)  # skips the update on inf/NaN
        scaler.update()
        return scaler.get_scale() < before  # GradScaler backs off exactly when it found inf/NaN
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bad = bool(torch.stack([~torch.isfinite(g).all() for g in grads]).any()) if grads else False
    if not bad and optimizer is not None:
        optimizer.step()
    return bad


def _error(pairs: list[tuple[torch.Tensor, torch.Tensor]], inv: float) -> tuple[float, float]:
    """Sum of |fp16 * inv - fp32| (the fp16 gradients unscaled by ``inv``) and of |fp32| over matched gradients."""
    if not pairs:
        return 0.0, 0.0
    diff = torch.zeros((), dtype=torch.float64, device=pairs[0][0].device)
    size = torch.zeros_like(diff)
    for r, t in pairs:
        r64 = r.double()
        diff += (t.to(r.device).double() * inv - r64).abs().sum()
        size += r64.abs().sum()
    return float(diff), float(size)  # one host sync per step


class _FirstNonfinite:
    """Watch the target run for the first cause it can see: a non-finite loss, a module output that held inf."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.step = 0
        self.first_loss_step: int | None = None
        self.loss_dtype: torch.dtype | None = None
        self.first_module: tuple[int, str] | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> "_FirstNonfinite":
        for name, module in self.model.named_modules():
            if name:
                self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.first_module is not None:
                return
            for t in _floating(output):
                if t.dtype in (torch.float16, torch.bfloat16) and not bool(torch.isfinite(t).all()):
                    self.first_module = (self.step, name)  # a sync per output: verification only
                    return

        return hook

    def loss(self, value: torch.Tensor) -> None:
        self.loss_dtype = value.dtype
        if self.first_loss_step is None and not bool(torch.isfinite(value.detach()).all()):
            self.first_loss_step = self.step

    def causes(self, overflow_steps: int, steps: int, rec: Any) -> list[str]:
        """The causes seen, in words (empty when the run stayed finite)."""
        out: list[str] = []
        if self.first_loss_step is not None:
            out.append(f"cause: the fp16 run's loss was inf/NaN from step {self.first_loss_step + 1}")
        if self.first_module is not None:
            out.append(f"cause: the first module whose fp16 forward output held inf/NaN was {self.first_module[1]} "
                       f"(step {self.first_module[0] + 1})")
        if self.loss_dtype == torch.float16 and overflow_steps and rec.log2_scale is not None and rec.log2_scale > 15:
            out.append("cause: the loss was fp16 in this run, so its seed gradient S overflows from 65520")
        if overflow_steps:
            out.append(f"{overflow_steps} of {steps} step(s) held inf/NaN gradients; zeroed shares and errors are "
                       "counted on the finite steps only")
        return out


def _pair(ref: Mapping[str, Any], tgt: Mapping[str, Any], notes: list[str], what: str) -> list[tuple[str, Any, Any]]:
    """Match the two runs' gradients by name (and call order), each pair with its name; note what does not match."""
    pairs = []
    for name, r in ref.items():
        t = tgt.get(name)
        rs = r if isinstance(r, list) else [r]
        ts = t if isinstance(t, list) else ([] if t is None else [t])
        if len(rs) != len(ts) or any(a.shape != b.shape for a, b in zip(rs, ts)):
            note = f"{what} of {name} differ in number or shape between the runs; left out"
            if note not in notes:
                notes.append(note)
            continue
        pairs.extend((name, a, b) for a, b in zip(rs, ts))
    return pairs


def _compare(named: list[tuple[str, torch.Tensor, torch.Tensor]], scale: float,
             flush_threshold: float | None) -> dict[str, list[int]]:
    """Per name, in order: the fp32 nonzero values, of those the ones the target run made exactly zero, and of
    those the ones fp32 puts above ``flush_threshold`` at ``scale`` (rounding the value once at S keeps them: the
    low-precision run computed them as zero; 0 without a threshold). One host read per step."""
    if not named:
        return {}
    sums: dict[str, torch.Tensor] = {}
    for name, r, t in named:
        nz = (r != 0) & torch.isfinite(r)
        zeroed = nz & (t.to(r.device) == 0)
        computed = (torch.count_nonzero(zeroed & (r.abs() * scale > flush_threshold)) if flush_threshold is not None
                    else torch.zeros((), dtype=torch.int64, device=r.device))
        row = torch.stack([torch.count_nonzero(nz), torch.count_nonzero(zeroed), computed])
        sums[name] = row if name not in sums else sums[name] + row
    return dict(zip(sums, torch.stack(list(sums.values())).tolist()))


class _OutputGrads:
    """Collect the gradient of each named module's floating outputs, per forward call, until taken."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        modules = dict(model.named_modules())
        self.modules = {n: modules[n] for n in names if n in modules}
        self.grads: dict[str, list[torch.Tensor]] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> "_OutputGrads":
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_hook(self._forward_hook(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def _forward_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for t in _floating(output):
                if t.requires_grad:
                    t.register_hook(lambda g, name=name: self.grads.setdefault(name, []).append(g.detach()))
        return hook

    def take(self) -> dict[str, list[torch.Tensor]]:
        """Return this step's gradients and start afresh."""
        grads, self.grads = self.grads, {}
        return grads


def _floating(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _floating(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _floating(v)]
    return []

