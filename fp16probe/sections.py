"""A report's sections: what each collector measured, as typed data, and the one table that reads and writes them.

A section is a frozen record with ``to_dict()`` and ``from_dict(d, path=...)``. :data:`SECTIONS`
maps each section's JSON key to its type; :class:`fp16probe.report.Report` writes and reads every
section through it, so a new collector's result needs one :func:`register_section` line, not an
edit of the Report. The built-in sections are fields of the Report; a registered one lives in
``Report.sections`` (``"sections"`` in JSON), and one this version does not know is kept as JSON.

Reports written before sections existed kept these results in ``metadata.extra``;
:func:`split_legacy_extra` moves them into their sections when such a file loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fp16probe.errors import ReportFieldError
from fp16probe.validation import check_extra

__all__ = ["SECTIONS", "TRIAL_RUNS", "WORKLOAD_KEYS", "CaptureNotes", "ForwardSection", "PrecisionCost", "SectionType",
           "ShadowRuns", "SkipLedger", "SkippedStep", "Trial", "TrialEnd", "Workload", "register_section", "split_legacy_extra",
           "split_workload"]


def _json_float(v: float | None) -> float | str | None:
    if v is None or math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else "inf"


def _float(v: Any, path: str) -> float:
    if isinstance(v, str) and v in ("inf", "nan"):
        return float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ReportFieldError(path, f"{path}: expected a number, got {v!r}")
    return float(v)


def _mapping(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ReportFieldError(path, f"{path}: expected an object, got {type(v).__name__}")
    return v


def _typed(d: Mapping[str, Any], key: str, path: str, types: tuple[type, ...], expected: str,
           default: Any = None, *, low: float | None = None, choices: tuple[Any, ...] = ()) -> Any:
    """``d[key]`` when it is of ``types`` (never a bool for a number), at least ``low``, one of ``choices``;
    ``default`` when absent; else ReportFieldError naming ``path.key``."""
    if key not in d:
        return default
    v = d[key]
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
    ok = ok and (low is None or v is None or v >= low) and (not choices or v in choices)
    if not ok:
        raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected {expected}, got {v!r}")
    return v


def _strings(v: Any, path: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ReportFieldError(path, f"{path}: expected a list of strings")
    return tuple(v)


@dataclass(frozen=True)
class ForwardSection:
    """The forward pass's largest values (the forward headroom), and the forward audit when one ran.

    ``module_max[name]``: the largest |output| of each hooked module's forward over the run
    (fp16 outputs only under autocast); ``first_overflow_step[name]``: the first step it passed
    fp16's max; ``step_max[i]``: the largest forward value of the i-th recorded step.
    ``audit``: :meth:`fp16probe.capture.forward.ForwardAudit.result` (every op's output as the
    target run computes it), present when the profile ran in fp32.
    """

    module_max: Mapping[str, float] = field(default_factory=dict)
    first_overflow_step: Mapping[str, int] = field(default_factory=dict)
    step_max: tuple[float, ...] = ()
    audit: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {"modules": {n: _json_float(v) for n, v in self.module_max.items()},
                "first_overflow_step": dict(self.first_overflow_step),
                "step_max": [_json_float(v) for v in self.step_max],
                **({} if self.audit is None else {"audit": dict(self.audit)})}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "forward") -> "ForwardSection":
        """Build from JSON; a bad field raises ReportFieldError naming it."""
        d = _mapping(d, path)
        first = _mapping(d.get("first_overflow_step", {}), f"{path}.first_overflow_step")
        for name, s in first.items():
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ReportFieldError(f"{path}.first_overflow_step", f"{path}.first_overflow_step: {name!r} "
                                       f"expected a step number, got {s!r}")
        step_max = d.get("step_max", [])
        if not isinstance(step_max, list):
            raise ReportFieldError(f"{path}.step_max", f"{path}.step_max: expected a list of numbers")
        return cls(
            module_max={str(n): _float(v, f"{path}.modules[{n!r}]")
                        for n, v in _mapping(d.get("modules", {}), f"{path}.modules").items()},
            first_overflow_step=dict(first),
            step_max=tuple(_float(v, f"{path}.step_max[{i}]") for i, v in enumerate(step_max)),
            audit=dict(_mapping(d["audit"], f"{path}.audit")) if "audit" in d else None,
        )


def _divisors(d: Mapping[str, Any], path: str) -> tuple[float, ...]:
    """``loss_divisors``: positive numbers."""
    values = _typed(d, "loss_divisors", path, (list,), "a list", [])
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in values):
        raise ReportFieldError(f"{path}.loss_divisors", f"{path}.loss_divisors: expected a list of positive numbers")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class PrecisionCost:
    """What computing in the run's low precision cost the weight gradients, measured against the fp32 reruns.

    On each rerun step (``steps``), the live gradient (unscaled) against the fp32 rerun's of the same batch and
    weights: ``relative_l2[param][i]`` is ``||g_live - g_fp32|| / ||g_fp32||`` for one parameter, ``whole[i]``
    the same over every parameter together. None where the fp32 gradient is zero or the live one not finite.
    ``precision``: what the live run computed in (``"bf16-autocast"``...). No loss scale enters it.
    ``fp32_change[i]``: ``||g_fp32(i) - g_fp32(previous rerun)|| / ||g_fp32(i)||`` over the whole model (None
    at the first rerun): how much the gradient itself moves from batch to batch, what the cost is judged by.
    """

    precision: str
    steps: tuple[int, ...] = ()
    relative_l2: Mapping[str, tuple[float | None, ...]] = field(default_factory=dict)
    whole: tuple[float | None, ...] = ()
    fp32_change: tuple[float | None, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {"precision": self.precision, "steps": list(self.steps),
                "relative_l2": {k: list(v) for k, v in self.relative_l2.items()}, "whole": list(self.whole),
                "fp32_change": list(self.fp32_change) or [None] * len(self.steps)}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "precision_cost") -> "PrecisionCost":
        """Build from JSON; a bad field raises ReportFieldError naming it."""
        d = _mapping(d, path)
        steps = d.get("steps", [])
        if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
            raise ReportFieldError(f"{path}.steps", f"{path}.steps: expected a list of step numbers")

        def ratios(v: Any, where: str) -> tuple[float | None, ...]:
            if not isinstance(v, list) or len(v) != len(steps) or not all(
                    x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0) for x in v):
                raise ReportFieldError(where, f"{where}: expected one non-negative number or null per step")
            return tuple(None if x is None else float(x) for x in v)

        per_param = _mapping(d.get("relative_l2", {}), f"{path}.relative_l2")
        return cls(precision=_typed(d, "precision", path, (str,), "a string", ""), steps=tuple(steps),
                   relative_l2={str(k): ratios(v, f"{path}.relative_l2[{k!r}]") for k, v in per_param.items()},
                   whole=ratios(d.get("whole", []), f"{path}.whole"),
                   fp32_change=ratios(d.get("fp32_change", [None] * len(steps)), f"{path}.fp32_change"))


@dataclass(frozen=True)
class ShadowRuns:
    """The fp32 reruns' schedule and cost (their statistics are ``Report.shadow``).

    ``every``: the schedule's period in sampled steps; ``steps``: the live steps rerun;
    ``count``/``seconds``/``clock``: how many ran and their time; ``next_step``: the next one due;
    ``off``: why none could run (None when they ran or were due); ``discarded``: reruns thrown away
    because they did not run in fp32 (``step``, ``module``, ``dtype`` each); ``accumulation``: the
    micro-batches each rerun step reran (gradient accumulation; 1 without); ``loss_divisors``: what
    the reruns divided each micro-batch's loss by before its backward (empty: none recorded, or an
    older report).
    """

    every: int
    steps: tuple[int, ...] = ()
    count: int = 0
    seconds: float = 0.0
    clock: str = "host wall time"
    next_step: int | None = None
    off: str | None = None
    discarded: tuple[Mapping[str, Any], ...] = ()
    accumulation: int = 1
    loss_divisors: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {"every": self.every, "steps": list(self.steps), "count": self.count, "seconds": self.seconds,
                "clock": self.clock, "next_step": self.next_step, **({} if self.off is None else {"off": self.off}),
                **({"discarded": [dict(x) for x in self.discarded]} if self.discarded else {}),
                **({"accumulation": self.accumulation} if self.accumulation != 1 else {}),
                **({"loss_divisors": list(self.loss_divisors)} if self.loss_divisors else {})}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "shadow_runs") -> "ShadowRuns":
        """Build from JSON; a bad field raises ReportFieldError naming it."""
        d = _mapping(d, path)
        if "every" not in d:
            raise ReportFieldError(f"{path}.every", f"{path}: missing field 'every'")
        steps = d.get("steps", [])
        if not isinstance(steps, list) or any(isinstance(s, bool) or not isinstance(s, int) for s in steps):
            raise ReportFieldError(f"{path}.steps", f"{path}.steps: expected a list of step numbers")
        return cls(every=_typed(d, "every", path, (int,), "a count", low=0), steps=tuple(steps),
                   count=_typed(d, "count", path, (int,), "a count", len(steps), low=0),
                   seconds=float(_typed(d, "seconds", path, (int, float), "seconds", 0.0, low=0)),
                   clock=_typed(d, "clock", path, (str,), "a string", "host wall time"),
                   next_step=_typed(d, "next_step", path, (int, type(None)), "a step number or null"),
                   off=_typed(d, "off", path, (str,), "a string"),
                   discarded=tuple(dict(_mapping(x, f"{path}.discarded[{i}]"))
                                   for i, x in enumerate(_typed(d, "discarded", path, (list,), "a list", []))),
                   accumulation=_typed(d, "accumulation", path, (int,), "a count", 1, low=1),
                   loss_divisors=_divisors(d, path))


TRIAL_RUNS = ("autocast", "emulated")  # how the trial's low-precision runs computed: real autocast, or the emulated step


@dataclass(frozen=True)
class TrialEnd:
    """The emulated step at the weights the trial's first fp32 run ended on, judged as the profile judges its own.

    Measured when the trial left fp32's band under a verdict that raised no alarm: a harm that one step
    at the profiled weights does not show often shows near convergence (a loss floor, a loss computed in
    low precision), where the gradient has shrunk and the rounding has not. ``verdict``: that judgement's;
    ``parameter``, ``error``, ``noise``: its worst parameter (its error and batch-to-batch noise, shares of
    the gradient; None where not measured); ``fix_modules``: the modules whose kept-in-fp32 step holds
    there; ``fix_loss``: the loss computed in fp32 holds there; ``fix_error``: that fix's whole-model error;
    ``loss_error``: the whole-model error with the loss computed in fp32, where the step measured it (a
    loss that rounds in the low format), whether or not it holds.
    """

    verdict: str
    parameter: str | None = None
    error: float | None = None
    noise: float | None = None
    fix_modules: tuple[str, ...] = ()
    fix_loss: bool = False
    fix_error: float | None = None
    loss_error: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {"verdict": self.verdict, "parameter": self.parameter, "error": _json_float(self.error),
                "noise": _json_float(self.noise), "fix_modules": list(self.fix_modules), "fix_loss": self.fix_loss,
                "fix_error": _json_float(self.fix_error), "loss_error": _json_float(self.loss_error)}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "trial.end") -> "TrialEnd":
        """Build from JSON; a bad field raises ReportFieldError naming it."""
        d = _mapping(d, path)

        def number(key: str) -> float | None:
            v = d.get(key)
            return None if v is None else _float(v, f"{path}.{key}")

        verdict = _typed(d, "verdict", path, (str,), "a verdict")
        if verdict is None:
            raise ReportFieldError(f"{path}.verdict", f"{path}: missing field 'verdict'")
        return cls(verdict=verdict, parameter=_typed(d, "parameter", path, (str,), "a parameter name"),
                   error=number("error"), noise=number("noise"),
                   fix_modules=_strings(d.get("fix_modules", []), f"{path}.fix_modules"),
                   fix_loss=_typed(d, "fix_loss", path, (bool,), "true or false", False),
                   fix_error=number("fix_error"), loss_error=number("loss_error"))


@dataclass(frozen=True)
class Trial:
    """The training trial (``profile(..., trial=STEPS)``): loss curves of fp32 and low-precision training.

    From the same weights, each of ``seeds`` (a data order over the profile's ``batches`` batches)
    trained ``steps`` optimizer steps twice: in fp32 (``fp32``, one curve per seed) and in ``format``
    (``low``) with the answer's GradScaler settings ``scaler`` ({} for none), ``run`` on ``device``
    (``autocast``: the device's own autocast; ``emulated``: the emulated ``target`` step,
    :mod:`fp16probe.capture.emulate`), the modules in ``fixed`` kept in fp32 (a verdict's fix).
    ``skipped``: the steps each low-precision seed's GradScaler skipped (inf/NaN). A curve that
    met a non-finite loss ends there. ``off``: why no trial ran (the curves are then empty). Its cost:
    ``steps x len(seeds) x 2`` training steps. :func:`fp16probe.analysis.trial.judge_curves` judges it.
    ``end``: the emulated step at the first fp32 run's end weights (:class:`TrialEnd`), when the trial
    found a harm the verdict did not; None otherwise.
    """

    steps: int
    seeds: tuple[int, ...] = ()
    format: str = "fp16"
    run: str = "autocast"
    device: str = "cpu"
    target: str = "cpu"
    scaler: Mapping[str, Any] = field(default_factory=dict)
    optimizer: str = "adam"
    lr: float = 1e-3
    batches: int = 0
    fixed: tuple[str, ...] = ()
    fp32: tuple[tuple[float, ...], ...] = ()
    low: tuple[tuple[float, ...], ...] = ()
    skipped: tuple[int, ...] = ()
    off: str | None = None
    end: TrialEnd | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form (a non-finite loss as "nan" or "inf")."""
        return {"steps": self.steps, "seeds": list(self.seeds), "format": self.format, "run": self.run,
                "device": self.device, "target": self.target, "scaler": dict(self.scaler),
                "optimizer": self.optimizer, "lr": self.lr, "batches": self.batches, "fixed": list(self.fixed),
                "fp32": [[_json_float(v) for v in c] for c in self.fp32],
                "low": [[_json_float(v) for v in c] for c in self.low], "skipped": list(self.skipped),
                **({} if self.off is None else {"off": self.off}),
                **({} if self.end is None else {"end": self.end.to_dict()})}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "trial") -> "Trial":
        """Build from JSON; a bad field raises ReportFieldError naming it."""
        d = _mapping(d, path)
        if "steps" not in d:
            raise ReportFieldError(f"{path}.steps", f"{path}: missing field 'steps'")

        def ints(key: str) -> tuple[int, ...]:
            v = _typed(d, key, path, (list,), "a list of whole numbers", [])
            if any(isinstance(x, bool) or not isinstance(x, int) for x in v):
                raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected a list of whole numbers")
            return tuple(v)

        def curves(key: str) -> tuple[tuple[float, ...], ...]:
            v = _typed(d, key, path, (list,), "a list of loss curves", [])
            bad = next((i for i, c in enumerate(v) if not isinstance(c, list)), None)
            if bad is not None:
                raise ReportFieldError(f"{path}.{key}[{bad}]", f"{path}.{key}[{bad}]: expected a list of losses")
            return tuple(tuple(_float(x, f"{path}.{key}[{i}][{j}]") for j, x in enumerate(c)) for i, c in enumerate(v))

        return cls(steps=_typed(d, "steps", path, (int,), "a count", low=1), seeds=ints("seeds"),
                   format=_typed(d, "format", path, (str,), "a format name", "fp16"),
                   run=_typed(d, "run", path, (str,), f"one of {TRIAL_RUNS}", "autocast", choices=TRIAL_RUNS),
                   device=_typed(d, "device", path, (str,), "a device", "cpu"),
                   target=_typed(d, "target", path, (str,), "a device type", "cpu"),
                   scaler=dict(_mapping(d.get("scaler", {}), f"{path}.scaler")),
                   optimizer=_typed(d, "optimizer", path, (str,), "an optimizer name", "adam"),
                   lr=float(_typed(d, "lr", path, (int, float), "a learning rate", 1e-3, low=0)),
                   batches=_typed(d, "batches", path, (int,), "a count", 0, low=0),
                   fixed=_strings(d.get("fixed", []), f"{path}.fixed"), fp32=curves("fp32"), low=curves("low"),
                   skipped=ints("skipped"), off=_typed(d, "off", path, (str,), "a string"),
                   end=None if d.get("end") is None else TrialEnd.from_dict(d["end"], path=f"{path}.end"))


@dataclass(frozen=True)
class CaptureNotes:
    """What the capture itself observed about the run (each empty/None where it does not apply).

    ``unrecorded_modules``: hooked modules with parameters of their own that recorded no
    gradient; ``gradient_free_modules``: hooked modules that cannot carry one (no parameters of
    their own, or all tied); ``autocast_fp32_ops``: ops left out because autocast keeps their
    gradients in fp32; ``weight_grads_sharded``: weight gradients were shards (FSDP);
    ``scale_source``: where the loss scale was read from; ``granularity``: ``"module"`` or
    ``"op"``; ``trace_since_step``: the trace and history start at this step (a live window);
    ``scaler_settings``: the live GradScaler's growth and backoff settings; ``hook_errors``/
    ``first_hook_error``: bookkeeping errors a hook noted and carried on from;
    ``weight_grad_merge``: how the ranks' weight gradients were merged (``"replicated"``: one
    rank's kept, ``"sharded"``: summed), with ``weight_grads_identical_across_ranks`` (None
    when not compared); both None for one rank's report;
    ``removed_modules``: hooked modules the model deleted or replaced after the Probe started
    (their statistics cover only the steps before); ``compiled_modules``: modules that ran
    compiled when the Probe started (``""``: the model), ``compile_traced``: dynamo traced a hook
    of the Probe; either way module outputs inside compiled code were not read (capture/compiled.py).
    """

    unrecorded_modules: tuple[str, ...] = ()
    gradient_free_modules: tuple[str, ...] = ()
    autocast_fp32_ops: tuple[str, ...] = ()
    weight_grads_sharded: bool = False
    scale_source: str | None = None
    granularity: str = "module"
    trace_since_step: int | None = None
    scaler_settings: Mapping[str, Any] | None = None
    hook_errors: int = 0
    first_hook_error: str | None = None
    weight_grad_merge: str | None = None
    weight_grads_identical_across_ranks: bool | None = None
    removed_modules: tuple[str, ...] = ()
    compiled_modules: tuple[str, ...] = ()
    compile_traced: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form (only the fields that say something)."""
        d: dict[str, Any] = {"granularity": self.granularity}
        for key in ("unrecorded_modules", "gradient_free_modules", "autocast_fp32_ops", "removed_modules",
                    "compiled_modules"):
            if getattr(self, key):
                d[key] = list(getattr(self, key))
        if self.weight_grads_sharded:
            d["weight_grads_sharded"] = True
        if self.compile_traced:
            d["compile_traced"] = True
        for key in ("scale_source", "trace_since_step", "first_hook_error"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.scaler_settings is not None:
            d["scaler_settings"] = dict(self.scaler_settings)
        if self.hook_errors:
            d["hook_errors"] = self.hook_errors
        if self.weight_grad_merge is not None:
            d["weight_grad_merge"] = self.weight_grad_merge
            d["weight_grads_identical_across_ranks"] = self.weight_grads_identical_across_ranks
        return d

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "capture") -> "CaptureNotes":
        """Build from JSON; a bad field raises ReportFieldError naming it."""
        d = _mapping(d, path)
        return cls(
            unrecorded_modules=_strings(d.get("unrecorded_modules", []), f"{path}.unrecorded_modules"),
            gradient_free_modules=_strings(d.get("gradient_free_modules", []), f"{path}.gradient_free_modules"),
            autocast_fp32_ops=_strings(d.get("autocast_fp32_ops", []), f"{path}.autocast_fp32_ops"),
            removed_modules=_strings(d.get("removed_modules", []), f"{path}.removed_modules"),
            compiled_modules=_strings(d.get("compiled_modules", []), f"{path}.compiled_modules"),
            compile_traced=_typed(d, "compile_traced", path, (bool,), "true or false", False),
            weight_grads_sharded=_typed(d, "weight_grads_sharded", path, (bool,), "true or false", False),
            scale_source=_typed(d, "scale_source", path, (str,), "a string"),
            granularity=_typed(d, "granularity", path, (str,), "module or op", "module", choices=("module", "op")),
            trace_since_step=_typed(d, "trace_since_step", path, (int,), "a step number"),
            scaler_settings=(dict(_mapping(d["scaler_settings"], f"{path}.scaler_settings"))
                             if "scaler_settings" in d else None),
            hook_errors=_typed(d, "hook_errors", path, (int,), "a count", 0, low=0),
            first_hook_error=_typed(d, "first_hook_error", path, (str,), "a string"),
            weight_grad_merge=_typed(d, "weight_grad_merge", path, (str,), "replicated or sharded"),
            weight_grads_identical_across_ranks=_typed(d, "weight_grads_identical_across_ranks", path,
                                                       (bool, type(None)), "true, false or null"),
        )


# The workload's fields: JSON type(s) and how a bad value is described. A field is absent (None) where it
# does not apply; to_dict writes only the present ones.
_STR, _INT, _BOOL, _FLOAT = ((str,), "a string"), ((int,), "an integer"), ((bool,), "true or false"), \
    ((int, float), "a number")
_LIST, _OBJ = ((list,), "a list"), ((dict,), "an object")
WORKLOAD_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    # the model, its inputs and loss (running.profile and the CLI)
    "model_kind": _STR, "model_source": _STR, "hf_class": _STR, "weights": _STR, "family": _STR,
    "inputs": _STR, "inputs_synthetic": _BOOL, "loss": _STR, "loss_synthetic": _BOOL, "labels": _STR,
    "stand_in": _STR, "optimizer": _OBJ, "loss_scale": _FLOAT, "batches_per_rank": _STR,
    # how the run went
    "steps_requested": _INT, "nonfinite_loss_steps": _LIST, "notes": _LIST, "stopped": _STR, "error": _STR,
    "weight_update_loss": _OBJ, "verification_stopped": _STR, "ranks_in_report": _LIST, "rank_fault": _OBJ,
    # the training frameworks (integrations)
    "trainer": _STR, "global_step": _INT, "training_arguments": _OBJ, "trainer_settings": _OBJ, "loss_scaled": _BOOL,
    "grad_scaler_found_at": _STR,
}


@dataclass(frozen=True)
class Workload:
    """What was profiled and how the run went, as the package records it (``"workload"`` in JSON).

    Every field is optional (None where it does not apply). Values are JSON data as written:
    ``notes`` and ``nonfinite_loss_steps`` lists, ``optimizer`` (``{"name", "lr"}``),
    ``weight_update_loss`` (``analysis.weight_updates.WeightUpdateLoss.to_dict()`` less its
    parameters, with ``measured_on``) and ``training_arguments`` objects. ``metadata.extra``
    keeps only the user's own metadata; an older report's workload keys there move here on load.
    """

    model_kind: str | None = None  # how the model was loaded: import string, Hugging Face folder, archive, demo
    model_source: str | None = None
    hf_class: str | None = None  # the transformers class a Hugging Face folder was loaded with
    weights: str | None = None  # the weights file loaded into the model
    family: str | None = None  # the model family whose synthetic inputs and loss were used
    inputs: str | None = None  # where the batches came from
    inputs_synthetic: bool | None = None
    loss: str | None = None  # the loss as computed
    loss_synthetic: bool | None = None
    labels: str | None = None  # invented labels, when the loss needed some
    stand_in: str | None = None  # one line saying what was made up for this run
    optimizer: dict[str, Any] | None = None  # {"name", "lr"} when the run trained
    loss_scale: float | None = None  # the CLI's --loss-scale (the trace's scale is what was in force)
    batches_per_rank: str | None = None
    steps_requested: int | None = None
    nonfinite_loss_steps: list[int] | None = None
    notes: list[str] | None = None
    stopped: str | None = None  # why the run stopped early (interrupt, SIGTERM, user error)
    error: str | None = None
    weight_update_loss: dict[str, Any] | None = None
    verification_stopped: str | None = None  # why --verify did not run to the end
    ranks_in_report: list[int] | None = None  # the ranks whose steps the report holds, when not all
    rank_fault: dict[str, Any] | None = None  # which rank stopped early, each rank's finished steps
    trainer: str | None = None
    global_step: int | None = None
    training_arguments: dict[str, Any] | None = None  # Hugging Face's TrainingArguments that matter here
    trainer_settings: dict[str, Any] | None = None  # Lightning's precision, accumulation and clipping
    loss_scaled: bool | None = None
    grad_scaler_found_at: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form: the fields that are present."""
        return {k: getattr(self, k) for k in WORKLOAD_KEYS if getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "workload") -> "Workload":
        """Build from JSON; a bad field raises ReportFieldError naming it (unknown keys are ignored)."""
        d = _mapping(d, path)
        check_extra(d, path)  # the strings, string lists and step lists every summary reads
        kw = {k: _typed(d, k, path, types, expected) for k, (types, expected) in WORKLOAD_KEYS.items()}
        for k in ("optimizer", "weight_update_loss", "training_arguments", "trainer_settings", "notes",
                  "nonfinite_loss_steps", "ranks_in_report", "rank_fault"):
            if kw[k] is not None:
                kw[k] = type(kw[k])(kw[k])
        return cls(**kw)


def split_workload(extra: Mapping[str, Any]) -> tuple[Workload | None, dict[str, Any]]:
    """Split ``metadata.extra`` as the package's callers fill it into (the Workload, the user's own keys).

    The one place the run's description leaves ``metadata.extra``: ``report.with_workload`` calls it as
    a report is made, ``Report.from_dict`` for an older file. A workload key whose value is None is
    dropped (absent); one whose value is not of the field's type stays with the user's keys, so a
    caller's odd value never stops a report from being made.
    """
    good = {k: v for k, v in extra.items() if k in WORKLOAD_KEYS and v is not None and _fits(k, v)}
    rest = {k: v for k, v in extra.items() if k not in good and not (k in WORKLOAD_KEYS and v is None)}
    return (Workload.from_dict(good) if good else None), rest


def _fits(key: str, value: Any) -> bool:
    try:
        Workload.from_dict({key: value})
    except ReportFieldError:
        return False
    return True


@dataclass(frozen=True)
class SkippedStep:
    """One step whose gradients held inf or NaN: a loss scaler skipped its optimizer step.

    ``step``: the step number (0-based, as the trace's); ``scale``: the loss scale in force (None: not
    scaled, or unknown); ``sampled``: whether histograms were recorded at that step (only then are the
    modules known); ``kind``: the gradients that named the modules (``activation_grad``: the modules'
    output gradients; ``weight_grad``: the parameters'); ``modules``: the first of them in backward
    order (nearest the loss first), where the inf/NaN began; ``nonfinite_modules``: how many held inf/NaN.
    """

    step: int
    scale: float | None = None
    sampled: bool = False
    kind: str | None = None
    modules: tuple[str, ...] = ()
    nonfinite_modules: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {"step": self.step, "scale": self.scale, "sampled": self.sampled, "kind": self.kind,
                "modules": list(self.modules), "nonfinite_modules": self.nonfinite_modules}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "skips.steps[0]") -> "SkippedStep":
        """Build from JSON; a bad field raises ReportFieldError naming it."""
        d = _mapping(d, path)
        if "step" not in d:
            raise ReportFieldError(f"{path}.step", f"{path}: missing field 'step'")
        scale = _typed(d, "scale", path, (int, float, type(None)), "a number or null")
        return cls(step=_typed(d, "step", path, (int,), "a step number", low=0),
                   scale=None if scale is None else float(scale),
                   sampled=_typed(d, "sampled", path, (bool,), "true or false", False),
                   kind=_typed(d, "kind", path, (str, type(None)), "a gradient kind or null"),
                   modules=_strings(_typed(d, "modules", path, (list,), "a list", []), f"{path}.modules"),
                   nonfinite_modules=_typed(d, "nonfinite_modules", path, (int,), "a count", 0, low=0))


@dataclass(frozen=True)
class SkipLedger:
    """Every step whose gradients held inf or NaN, in order (:mod:`fp16probe.capture.skips`).

    ``source``: where the skipped steps were read: ``history`` (every step's gradients at the end of
    backward, as GradScaler checks them) or ``trace`` (the sampled steps only).
    """

    steps: tuple[SkippedStep, ...] = ()
    source: str = "history"

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {"steps": [s.to_dict() for s in self.steps], "source": self.source}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "skips") -> "SkipLedger":
        """Build from JSON; a bad field raises ReportFieldError naming it."""
        d = _mapping(d, path)
        steps = _typed(d, "steps", path, (list,), "a list", [])
        return cls(steps=tuple(SkippedStep.from_dict(x, path=f"{path}.steps[{i}]") for i, x in enumerate(steps)),
                   source=_typed(d, "source", path, (str,), "'history' or 'trace'", "history",
                                 choices=("history", "trace")))


@dataclass(frozen=True)
class SectionType:
    """How one section is read and written: its JSON key, loader and writer."""

    key: str
    load: Callable[..., Any]  # (json, *, path) -> the section
    dump: Callable[[Any], Any]  # the section -> JSON
    builtin: bool = False  # a field of Report (else kept in Report.sections)


SECTIONS: dict[str, SectionType] = {}


def register_section(key: str, load: Callable[..., Any], dump: Callable[[Any], Any] | None = None, *,
                     builtin: bool = False) -> SectionType:
    """Make ``key`` a report section read by ``load(json, path=...)`` and written by ``dump`` (default: ``to_dict``)."""
    entry = SectionType(key, load, dump or (lambda v: v.to_dict()), builtin)
    SECTIONS[key] = entry
    return entry


def unregister_section(key: str) -> None:
    """Forget a registered section (a test's own)."""
    SECTIONS.pop(key, None)


# metadata.extra keys that older reports used for what are now sections (and metadata fields)
_LEGACY_NOTES = ("unrecorded_modules", "gradient_free_modules", "autocast_fp32_ops", "scale_source",
                 "granularity", "trace_since_step", "scaler_settings", "hook_errors", "first_hook_error",
                 "weight_grad_merge", "weight_grads_identical_across_ranks")
LEGACY_KEYS = (*_LEGACY_NOTES, "weight_grad_sharding", "forward", "forward_max", "shadow", "block_formats",
               "block_advice", "target", "regime")


def split_legacy_extra(extra: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split an older report's ``metadata.extra`` into (sections' JSON by key, the rest).

    The rest keeps the user's own keys; ``target`` and ``regime`` come back among the
    sections' JSON under ``"metadata"`` (they are metadata fields now).
    """
    workload, user = split_workload(extra)
    out: dict[str, Any] = {} if workload is None else {"workload": workload.to_dict()}
    if not any(k in extra for k in LEGACY_KEYS):
        return out, user
    rest = {k: v for k, v in user.items() if k not in LEGACY_KEYS}
    notes = {k: extra[k] for k in _LEGACY_NOTES if k in extra}
    if extra.get("weight_grad_sharding") == "sharded":
        notes["weight_grads_sharded"] = True
    if notes:
        out["capture"] = notes
    fm, audit = extra.get("forward_max"), extra.get("forward")
    if isinstance(fm, Mapping) or isinstance(audit, Mapping):
        fm = fm if isinstance(fm, Mapping) else {}
        first = fm.get("first_overflow_step")
        out["forward"] = {"modules": fm.get("modules") or {}, "step_max": fm.get("step_max") or [],
                          "first_overflow_step": first if isinstance(first, Mapping) else {},
                          **({"audit": audit} if isinstance(audit, Mapping) else {})}
    if isinstance(extra.get("shadow"), Mapping):
        out["shadow_runs"] = extra["shadow"]
    if "block_formats" in extra:
        out["blocks"] = extra["block_formats"]
    if "block_advice" in extra:
        out["block_advice"] = extra["block_advice"]
    meta = {k: extra[k] for k in ("target", "regime") if isinstance(extra.get(k), str)}
    if meta:
        out["metadata"] = meta
    return out, rest
