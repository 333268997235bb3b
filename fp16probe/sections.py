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

__all__ = ["SECTIONS", "CaptureNotes", "ForwardSection", "SectionType", "ShadowRuns", "register_section",
           "split_legacy_extra"]


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


@dataclass(frozen=True)
class ShadowRuns:
    """The fp32 reruns' schedule and cost (their statistics are ``Report.shadow``).

    ``every``: the schedule's period in sampled steps; ``steps``: the live steps rerun;
    ``count``/``seconds``/``clock``: how many ran and their time; ``next_step``: the next one due;
    ``off``: why none could run (None when they ran or were due); ``discarded``: reruns thrown away
    because they did not run in fp32 (``step``, ``module``, ``dtype`` each).
    """

    every: int
    steps: tuple[int, ...] = ()
    count: int = 0
    seconds: float = 0.0
    clock: str = "host wall time"
    next_step: int | None = None
    off: str | None = None
    discarded: tuple[Mapping[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {"every": self.every, "steps": list(self.steps), "count": self.count, "seconds": self.seconds,
                "clock": self.clock, "next_step": self.next_step, **({} if self.off is None else {"off": self.off}),
                **({"discarded": [dict(x) for x in self.discarded]} if self.discarded else {})}

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
                                   for i, x in enumerate(_typed(d, "discarded", path, (list,), "a list", []))))


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
    ``removed_modules``: hooked modules the model deleted or replaced after the Probe started
    (their statistics cover only the steps before).
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
    removed_modules: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form (only the fields that say something)."""
        d: dict[str, Any] = {"granularity": self.granularity}
        for key in ("unrecorded_modules", "gradient_free_modules", "autocast_fp32_ops", "removed_modules"):
            if getattr(self, key):
                d[key] = list(getattr(self, key))
        if self.weight_grads_sharded:
            d["weight_grads_sharded"] = True
        for key in ("scale_source", "trace_since_step", "first_hook_error"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.scaler_settings is not None:
            d["scaler_settings"] = dict(self.scaler_settings)
        if self.hook_errors:
            d["hook_errors"] = self.hook_errors
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
            weight_grads_sharded=_typed(d, "weight_grads_sharded", path, (bool,), "true or false", False),
            scale_source=_typed(d, "scale_source", path, (str,), "a string"),
            granularity=_typed(d, "granularity", path, (str,), "module or op", "module", choices=("module", "op")),
            trace_since_step=_typed(d, "trace_since_step", path, (int,), "a step number"),
            scaler_settings=(dict(_mapping(d["scaler_settings"], f"{path}.scaler_settings"))
                             if "scaler_settings" in d else None),
            hook_errors=_typed(d, "hook_errors", path, (int,), "a count", 0, low=0),
            first_hook_error=_typed(d, "first_hook_error", path, (str,), "a string"),
        )


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
                 "granularity", "trace_since_step", "scaler_settings", "hook_errors", "first_hook_error")
LEGACY_KEYS = (*_LEGACY_NOTES, "weight_grad_sharding", "forward", "forward_max", "shadow", "block_formats",
               "target", "regime")


def split_legacy_extra(extra: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split an older report's ``metadata.extra`` into (sections' JSON by key, the rest).

    The rest keeps the user's own keys; ``target`` and ``regime`` come back among the
    sections' JSON under ``"metadata"`` (they are metadata fields now).
    """
    if not any(k in extra for k in LEGACY_KEYS):
        return {}, dict(extra)
    rest = {k: v for k, v in extra.items() if k not in LEGACY_KEYS}
    out: dict[str, Any] = {}
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
    meta = {k: extra[k] for k in ("target", "regime") if isinstance(extra.get(k), str)}
    if meta:
        out["metadata"] = meta
    return out, rest
