"""The Report: plain, immutable data that a Probe hands over, and its JSON file.

Nothing here touches a model or a device; everything is host-side Python numbers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import threading
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Mapping, Sequence, TypedDict

import numpy as np

from fp16probe import columns, validation
from fp16probe.errors import InputError, ReportError, ReportFieldError
from fp16probe.histogram import Histogram
from fp16probe.blockscale import BlockStats
from fp16probe.reading import read_report
from fp16probe.recommendation import Recommendation
from fp16probe.blockadvice import BlockAdvice
from fp16probe.emulation import Emulation
from fp16probe.sections import (
    SECTIONS,
    CaptureNotes,
    ForwardSection,
    PrecisionCost,
    ShadowRuns,
    SkipLedger,
    Trial,
    Workload,
    register_section,
    split_legacy_extra,
    split_workload,
)
from fp16probe.verification import Verification

__all__ = [
    "ALL_GRADS",
    "GRAD_KINDS",
    "KINDS",
    "SCHEMA_VERSION",
    "Histogram",
    "Metadata",
    "MetadataExtra",
    "ModuleStats",
    "Report",
    "StepHistory",
    "StepTrace",
    "append_text",
    "atomic_write_text",
]

SCHEMA_VERSION = 1

ACTIVATION_GRAD = "activation_grad"
WEIGHT_GRAD = "weight_grad"
ACTIVATION = "activation"
KINDS = (ACTIVATION_GRAD, WEIGHT_GRAD, ACTIVATION)
GRAD_KINDS = (ACTIVATION_GRAD, WEIGHT_GRAD)
ALL_GRADS = "all"  # activation and weight gradients together: every value the loss scale multiplies


def kinds_named(kind: str) -> tuple[str, ...]:
    """Return the record kinds ``kind`` names: itself, or both gradient kinds for ``all``."""
    return GRAD_KINDS if kind == ALL_GRADS else (kind,)


@dataclass(frozen=True)
class ModuleStats:
    """One module's (or parameter's) histogram of one kind over all profiled steps."""

    name: str
    kind: str
    module_type: str
    order: int
    histogram: Histogram

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {
            "name": self.name,
            "kind": self.kind,
            "module_type": self.module_type,
            "order": self.order,
            "histogram": self.histogram.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, path: str = "module") -> "ModuleStats":
        """Build a module record from its JSON; a bad field raises ReportFieldError naming it."""
        validation.check_module(d, path)
        return cls(
            name=d["name"],
            kind=d["kind"],
            module_type=d["module_type"],
            order=d["order"],
            histogram=Histogram.from_dict(d["histogram"], path=f"{path}.histogram"),
        )


@dataclass(frozen=True)
class StepTrace:
    """What a scale simulator needs, per profiled step.

    ``histograms[kind][i]`` is the histogram of all values of that kind at step
    ``steps[i]``; ``module_max[kind][name][i]`` the largest finite magnitude a module
    saw in it (0.0 when it saw nothing); ``scale[i]`` the GradScaler scale in force
    (None without a scaler); ``found_inf[i]`` whether any gradient held inf or NaN.
    ``ceiling[i]`` is the overflow ceiling: the largest unscaled |g| that backward made
    anywhere at that step (every autograd node's gradient: the gradient at the model's
    output, functional ops, module internals, weight gradients), ``math.inf`` when any
    gradient held inf or NaN (written as the string ``"inf"`` in JSON); None in reports
    made before it was recorded.

    ``module_block``: how many steps each per-module entry covers. 1 (one entry a step) unless
    the trace was written with more than ``columns.MODULE_STEPS`` steps: then
    ``module_max[kind][name][j]`` is the largest over steps ``steps[j * module_block]`` to
    ``steps[min((j + 1) * module_block, len) - 1]`` (:meth:`module_span`), exactly, and every
    other field still has one entry a step.
    """

    # Tuples, or read-only columns over arrays where the trace was read packed (fp16probe.columns).
    steps: Sequence[int] = ()
    histograms: Mapping[str, Sequence[Histogram]] = field(default_factory=dict)
    module_max: Mapping[str, Mapping[str, Sequence[float]]] = field(default_factory=dict)
    scale: Sequence[float | None] = ()
    found_inf: Sequence[bool] = ()
    ceiling: Sequence[float] | None = None
    module_block: int = 1

    def __len__(self) -> int:
        return len(self.steps)

    def module_span(self, j: int) -> tuple[int, int]:
        """The first and last step numbers that per-module entry ``j`` covers."""
        b = self.module_block
        return int(self.steps[j * b]), int(self.steps[min((j + 1) * b, len(self)) - 1])

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form (the ceiling only when recorded): lists per step, or packed columns
        (:mod:`fp16probe.columns`) for more than ``columns.PACK_FROM`` steps, the per-module maxima
        then kept per block of steps beyond ``columns.MODULE_STEPS`` steps."""
        if len(self) > columns.PACK_FROM or self.module_block > 1:
            return self._packed()
        return {
            "steps": list(self.steps),
            "histograms": {k: [h.to_dict() for h in hs] for k, hs in self.histograms.items()},
            "module_max": {k: {n: list(v) for n, v in m.items()} for k, m in self.module_max.items()},
            "scale": list(self.scale),
            "found_inf": list(self.found_inf),
            **({} if self.ceiling is None else {"ceiling": ["inf" if math.isinf(c) else c for c in self.ceiling]}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, path: str = "trace") -> "StepTrace":
        """Build the trace from its JSON; a bad field or a list of the wrong length raises ReportFieldError."""
        if columns.is_packed(d):
            return cls._unpacked(d, path)
        validation.check_trace(d, path)
        steps = tuple(d["steps"])
        histograms = {
            k: tuple(Histogram.from_dict(h, path=f"{path}.histograms[{k!r}][{i}]") for i, h in enumerate(hs))
            for k, hs in d["histograms"].items()
        }
        module_max = {
            k: {name: tuple(float(v) for v in vals) for name, vals in m.items()}
            for k, m in d["module_max"].items()
        }
        scale = tuple(None if s is None else float(s) for s in d["scale"])
        found_inf = tuple(d["found_inf"])
        ceiling = None if d.get("ceiling") is None else tuple(float(c) for c in d["ceiling"])
        return cls(steps, histograms, module_max, scale, found_inf, ceiling)

    def _packed(self) -> dict[str, Any]:
        names = {k: list(m) for k, m in self.module_max.items()}
        entries = -(-len(self) // self.module_block)
        return columns.pack_trace(
            steps=_array(self.steps, np.int64), histograms=self.histograms, names=names,
            module_max={k: np.stack([_array(m[n]) for n in names[k]]) if names[k] else np.zeros((0, entries))
                        for k, m in self.module_max.items()},
            scale=self.scale, found_inf=_array(self.found_inf, bool),
            ceiling=None if self.ceiling is None else _array(self.ceiling), module_block=self.module_block)

    @classmethod
    def _unpacked(cls, d: Any, path: str) -> "StepTrace":
        """Read the packed form (:mod:`fp16probe.columns`), checking what ``check_trace`` checks of the lists."""
        d = _packed_object(d, path, ("steps", "histograms", "module_max", "scale", "found_inf"))
        steps = columns.unpack(d["steps"], f"{path}.steps")
        if steps.dtype.kind not in "ui" or (steps.size and int(steps.min()) < 0):
            raise ReportFieldError(f"{path}.steps", f"{path}.steps: expected non-negative integers")
        n = len(steps)
        histograms = {}
        for kind, packed in _object_of(d["histograms"], f"{path}.histograms").items():
            validation.check_kind(kind, f"{path}.histograms")
            histograms[kind] = columns.unpack_histograms(packed, f"{path}.histograms[{kind!r}]", n)
        block = d.get("module_block", 1)
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= max(n, 1):
            raise ReportFieldError(f"{path}.module_block",
                                   f"{path}.module_block: expected an integer from 1 to the {n} steps, got {block!r:.40}")
        entries = -(-n // block)
        module_max: dict[str, dict[str, Sequence[float]]] = {}
        for kind, packed in _object_of(d["module_max"], f"{path}.module_max").items():
            validation.check_kind(kind, f"{path}.module_max")
            where = f"{path}.module_max[{kind!r}]"
            packed = _object_of(packed, where)
            names = packed.get("names")
            if not isinstance(names, list) or not all(isinstance(x, str) for x in names) or len(set(names)) != len(names):
                raise ReportFieldError(f"{where}.names", f"{where}.names: expected a list of distinct module names")
            values = columns.unpack_floats(packed.get("values"), f"{where}.values", len(names) * entries, nullable=False)
            matrix = values.array.reshape(len(names), entries)
            module_max[kind] = {name: columns.Column(matrix[j]) for j, name in enumerate(names)}
        scale = columns.unpack_floats(d["scale"], f"{path}.scale", n, nullable=True)
        found = columns.unpack(d["found_inf"], f"{path}.found_inf", n)
        if found.dtype.kind != "u" or (found.size and int(found.max()) > 1):
            raise ReportFieldError(f"{path}.found_inf", f"{path}.found_inf: expected 0 or 1 per step (|u1)")
        ceiling = (None if d.get("ceiling") is None
                   else columns.unpack_floats(d["ceiling"], f"{path}.ceiling", n, nullable=False, nonfinite="inf"))
        return cls(columns.Column(steps), histograms, module_max, scale, columns.Column(found.astype(bool)), ceiling,
                   block)


@dataclass(frozen=True)
class StepHistory:
    """Every training step from ``first_step`` on, sampled or not (:mod:`fp16probe.capture.history`).

    ``scale[i]`` is the loss scale in force at step ``first_step + i`` (None: not scaled, or
    no backward at that step); ``grad_max[i]`` the largest unscaled |g| over the parameters'
    gradients at the end of its backward (``math.inf``/NaN when one was inf/NaN; None: no
    backward); ``ceiling[i]`` the backward-wide overflow ceiling on sampled steps (None on the
    others); ``forward_max[i]`` the largest forward output on sampled steps (None on the others;
    the whole field None where the Probe's forward capture is off). In JSON, non-finite values are the strings ``"inf"`` and
    ``"nan"``.
    """

    first_step: int = 0
    # Tuples, or read-only columns over arrays where the history was read packed (fp16probe.columns).
    scale: Sequence[float | None] = ()
    grad_max: Sequence[float | None] = ()
    ceiling: Sequence[float | None] = ()
    forward_max: Sequence[float | None] | None = None

    def __len__(self) -> int:
        return len(self.scale)

    @property
    def steps(self) -> tuple[int, ...]:
        """The step numbers, one per entry."""
        return tuple(range(self.first_step, self.first_step + len(self.scale)))

    @property
    def found_inf(self) -> tuple[bool, ...]:
        """Whether each step's gradients held inf or NaN: the steps a GradScaler skipped."""
        return tuple(g is not None and not math.isfinite(g) for g in self.grad_max)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form: lists per step, or packed columns for more than ``columns.PACK_FROM`` steps."""
        if len(self) > columns.PACK_FROM:
            return columns.pack_history(self.first_step, self.scale, self.grad_max, self.ceiling, self.forward_max)
        return {
            "first_step": self.first_step,
            "scale": list(self.scale),
            "grad_max": [json_float(g) for g in self.grad_max],
            "ceiling": [json_float(c) for c in self.ceiling],
            "forward_max": None if self.forward_max is None else [json_float(f) for f in self.forward_max],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, path: str = "history") -> "StepHistory":
        """Build the history from its JSON; a bad field raises ReportFieldError naming it."""
        if columns.is_packed(d):
            d = _packed_object(d, path, ("first_step", "scale", "grad_max"))
            first = validation.check_first_step(d["first_step"], f"{path}.first_step")
            scale = columns.unpack_floats(d["scale"], f"{path}.scale", None, nullable=True)
            n = len(scale)

            def column(key: str) -> columns.Column:
                return columns.unpack_floats(d[key], f"{path}.{key}", n, nullable=True, nonfinite="inf nan")

            return cls(first_step=first, scale=scale, grad_max=column("grad_max"),
                       ceiling=column("ceiling") if d.get("ceiling") is not None else (None,) * n,
                       forward_max=column("forward_max") if d.get("forward_max") is not None else None)
        validation.check_history(d, path)
        fwd = d.get("forward_max")
        return cls(
            first_step=int(d["first_step"]),
            scale=tuple(None if s is None else float(s) for s in d["scale"]),
            grad_max=tuple(_fromjson_float(g) for g in d["grad_max"]),
            ceiling=tuple(_fromjson_float(c) for c in d.get("ceiling") or [None] * len(d["scale"])),
            forward_max=None if fwd is None else tuple(_fromjson_float(f) for f in fwd),
        )


def _array(values: Sequence[Any], dtype: Any = np.float64) -> np.ndarray:
    """A per-step field as an array: a packed column's own, else converted."""
    if isinstance(values, columns.Column):
        return values.array.astype(dtype, copy=False)
    return np.asarray(values, dtype=dtype)


def _object_of(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ReportFieldError(path, f"{path}: expected an object, got {type(v).__name__}")
    return dict(v)


def _packed_object(d: Any, path: str, required: Sequence[str]) -> Mapping[str, Any]:
    """A packed section's JSON, its ``layout`` and required fields checked."""
    obj = _object_of(d, path)
    if obj.get("layout") != columns.LAYOUT:
        raise ReportFieldError(f"{path}.layout", f"{path}.layout: expected {columns.LAYOUT!r}, got {obj.get('layout')!r:.40}")
    for key in required:
        if key not in obj:
            raise ReportFieldError(f"{path}.{key}", f"{path}: missing field {key!r}")
    return obj


def json_float(v: float | None) -> float | str | None:
    """A float for JSON: itself, None, or "nan" / "inf" (JSON has neither)."""
    if v is None or math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else "inf"


def _fromjson_float(v: Any) -> float | None:
    return None if v is None else float(v)


class MetadataExtra(TypedDict, total=False):
    """``Metadata.extra`` is the user's own metadata (free-form JSON): the package writes no key there.

    What a collector measured is a typed section of the Report (:mod:`fp16probe.sections`), what
    was profiled and how the run went its :class:`~fp16probe.sections.Workload`. Reports from
    older versions kept those in ``extra``; they move into their sections when the file loads.
    A documentation type: ``Metadata.extra`` stays a plain mapping so that keys a user adds load.
    """


@dataclass(frozen=True)
class Metadata:
    """Where a report came from; ``extra``'s keys are documented by :class:`MetadataExtra`."""

    fp16probe_version: str
    torch_version: str
    device: str
    model_class: str
    precision: str = "fp32"
    param_dtype: str = "torch.float32"
    steps_seen: int = 0
    steps_total: int = 0
    every: int = 1
    captured: tuple[str, ...] = ()
    hooked_modules: tuple[str, ...] = ()
    grad_scaler: bool = False
    world_size: int = 1
    partial: bool = False
    created: str = ""
    target: str | None = None  # the device whose fp16 autocast rules the prediction applies
    regime: str = "autocast"  # "autocast" (fp32 weights) or "pure_fp16" (a .half() model)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["captured"] = list(self.captured)
        d["hooked_modules"] = list(self.hooked_modules)
        d["extra"] = dict(self.extra)
        if self.target is None:  # as reports made before it was a field read
            del d["target"]
        if self.regime == "autocast":
            del d["regime"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, path: str = "metadata") -> "Metadata":
        """Build metadata from its JSON; a field of the wrong type raises ReportFieldError naming it."""
        validation.check_metadata(d, path)
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        known["captured"] = tuple(known.get("captured", ()))
        known["hooked_modules"] = tuple(known.get("hooked_modules", ()))
        known["extra"] = dict(known.get("extra", {}))
        return cls(**known)


@dataclass(frozen=True)
class Report:
    """Everything a Probe measured, on the host, ready to analyse, save or merge."""

    metadata: Metadata
    modules: tuple[ModuleStats, ...] = ()
    trace: StepTrace = field(default_factory=StepTrace)
    recommendation: Recommendation | None = None
    schema_version: int = SCHEMA_VERSION
    verification: Verification | None = None  # the recommended setting run for real (profile --verify)
    # The sections, one per collector (fp16probe.sections.SECTIONS reads and writes each):
    shadow: "Report | None" = None  # fp32 reruns of some live steps: the reference (capture.shadow)
    history: StepHistory | None = None  # every step's scale, found_inf and largest gradient
    forward: ForwardSection | None = None  # the forward headroom (and the forward audit)
    blocks: BlockStats | None = None  # scaled-format statistics (FP8, MXFP8, NVFP4)
    shadow_runs: ShadowRuns | None = None  # the reruns' schedule and cost
    capture: CaptureNotes | None = None  # what the capture noticed (silent modules, fp32 ops, errors)
    workload: Workload | None = None  # what was profiled and how the run went (model, inputs, loss, notes, stop)
    block_advice: BlockAdvice | None = None  # the scaled-format answer (FP8 recipes, MXFP8, NVFP4), per layer
    sections: Mapping[str, Any] = field(default_factory=dict)  # registered sections that are not fields

    # -- accessors -----------------------------------------------------------------
    @property
    def kinds(self) -> tuple[str, ...]:
        """Return the kinds that have module records, in KINDS order."""
        present = {m.kind for m in self.modules}
        return tuple(k for k in KINDS if k in present)

    def modules_of(self, kind: str = ACTIVATION_GRAD) -> tuple[ModuleStats, ...]:
        """Return the module records of one kind (``all``: both gradient kinds), in forward (hook) order."""
        kinds = kinds_named(kind)
        return tuple(sorted((m for m in self.modules if m.kind in kinds), key=lambda m: m.order))

    def module(self, name: str, kind: str = ACTIVATION_GRAD) -> ModuleStats:
        """Return the record of module ``name`` for ``kind``; KeyError when there is none."""
        for m in self.modules:
            if m.name == name and m.kind == kind:
                return m
        raise KeyError(f"no {kind} record for module {name!r}")

    def histogram(self, kind: str = ACTIVATION_GRAD) -> Histogram:
        """Return all values of one kind (``all``: both gradient kinds), over every module and step."""
        kinds = kinds_named(kind)
        return Histogram.sum(m.histogram for m in self.modules if m.kind in kinds)

    def with_recommendation(self, recommendation: Recommendation | None) -> "Report":
        """Return a copy of this report carrying ``recommendation``."""
        return replace(self, recommendation=recommendation)

    def with_verification(self, verification: Verification | None) -> "Report":
        """Return a copy of this report carrying ``verification``."""
        return replace(self, verification=verification)

    def section(self, key: str) -> Any:
        """Return the section ``key`` (a field or a registered one), None when the report has none."""
        entry = SECTIONS.get(key)
        if entry is not None and entry.builtin:
            return getattr(self, key)
        return self.sections.get(key)

    def with_sections(self, sections: Mapping[str, Any]) -> "Report":
        """Return a copy carrying ``sections`` (by key): fields for the built-in ones, the rest in ``sections``."""
        fields = {k: v for k, v in sections.items() if k in SECTIONS and SECTIONS[k].builtin}
        others = {**self.sections, **{k: v for k, v in sections.items() if k not in fields}}
        return replace(self, **fields, sections=others)

    # -- presentation (matplotlib and rich load only when these are called) ---------
    def plot(self, which: str = "all", **kwargs: Any) -> Any:
        """Return a matplotlib Figure of this report; see ``fp16probe.presentation.figures.figure``."""
        from fp16probe.presentation.figures import figure

        return figure(self, which=which, **kwargs)

    def __repr__(self) -> str:
        from fp16probe.presentation.answer import report_summary

        return report_summary(self)

    __str__ = __repr__

    def _repr_html_(self) -> str:
        from fp16probe.presentation.html import report_html

        return report_html(self)

    def __rich__(self) -> Any:
        from fp16probe.presentation.terminal import report_view

        return report_view(self)

    # -- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {
            "schema_version": self.schema_version,
            "metadata": self.metadata.to_dict(),
            "modules": [m.to_dict() for m in self.modules],
            "trace": self.trace.to_dict(),
            "recommendation": None if self.recommendation is None else self.recommendation.to_dict(),
            **({} if self.verification is None else {"verification": self.verification.to_dict()}),
            **_sections_json(self),
        }

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "report") -> "Report":
        """Build a Report from its JSON form; a bad field raises ReportError naming it."""
        if not isinstance(d, dict):
            raise ReportError(f"{source}: expected a JSON object at the top level, got {type(d).__name__}")
        version = d.get("schema_version")
        if version is None:
            raise ReportError(f"{source}: no schema_version; this is not an fp16probe report")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise ReportError(
                f"{source}: schema_version {version!r} is not supported (this fp16probe reads "
                f"version {SCHEMA_VERSION}); re-create the report with this version of fp16probe"
            )
        try:
            _check_report_fields(d)
            legacy, metadata = _legacy_sections(d["metadata"])
            report = cls(
                metadata=Metadata.from_dict(metadata),
                modules=tuple(ModuleStats.from_dict(m, path=f"modules[{i}]") for i, m in enumerate(d["modules"])),
                trace=StepTrace.from_dict(d["trace"]),
                recommendation=(None if d.get("recommendation") is None
                                else Recommendation.from_dict(d["recommendation"])),
                schema_version=version,
                verification=(None if d.get("verification") is None
                              else Verification.from_dict(d["verification"])),
            )
            return report.with_sections(_sections_of({**legacy, **d}, source))
        except ReportError as e:
            raise ReportError(f"{source}: {e}; the file is corrupt or was edited: re-create it with fp16probe profile") from e
        except RecursionError as e:
            raise ReportError(f"{source}: nested too deeply to be an fp16probe report") from e
        except KeyError as e:
            raise ReportError(f"{source}: malformed report, missing field {e.args[0]!r}") from e
        except (TypeError, ValueError, AttributeError, OverflowError) as e:
            raise ReportError(f"{source}: malformed report: {e}") from e

    def to_json(self, indent: int | None = None) -> str:
        """Return the report as JSON text (strict: no NaN or Infinity)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the report as JSON, atomically: a crash never leaves half a file."""
        path = Path(path)
        atomic_write_text(path, self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Report":
        """Read a report file; a bad file (not a regular file, over the size cap, malformed) raises ReportError naming the problem."""
        path = Path(path)
        text, lifted = read_report(path)  # a regular file, at most FP16PROBE_MAX_REPORT_MB; long arrays decoded
        if not text.strip():
            raise ReportError(f"{path}: the report file is empty")

        def put_back(obj: dict[str, Any]) -> dict[str, Any]:
            token = obj.get("zlib")
            if isinstance(token, str) and token in lifted:
                obj["zlib"] = lifted.pop(token)
            return obj

        try:
            data = json.loads(text, object_hook=put_back if lifted else None)
            del text
        except json.JSONDecodeError as e:
            raise ReportError(
                f"{path}: not valid JSON (truncated or corrupt?) at line {e.lineno} column {e.colno}: {e.msg}"
            ) from e
        except RecursionError as e:  # json's parser recurses once per level of nesting
            raise ReportError(f"{path}: JSON nested too deeply to be an fp16probe report (at most 32 levels)") from e
        except ValueError as e:  # an integer literal longer than Python's int-conversion limit
            raise ReportError(f"{path}: not a readable report: {' '.join(str(e).split())}") from e
        return cls.from_dict(data, source=str(path))

    # -- merging -------------------------------------------------------------------
    def merge(self, *others: "Report", how: str = "auto") -> "Report":
        """Combine reports from several runs or ranks.

        ``how="ranks"`` treats them as ranks of one run over the same steps: per-step
        histograms add up and maxima take the max. ``how="runs"`` appends the traces
        one after another. ``"auto"`` picks ranks when every report has the same steps;
        separate runs that happen to cover the same step numbers look the same, so pass
        ``how="runs"`` for them.
        Module histograms add up either way.
        """
        return merge_reports((self, *others), how=how)


def merge_reports(reports: Sequence[Report], *, how: str = "auto") -> Report:
    """Combine reports; see :meth:`Report.merge`."""
    if not reports:
        raise ValueError("nothing to merge")
    if how not in ("auto", "ranks", "runs"):
        raise ValueError(f"how must be 'auto', 'ranks' or 'runs', got {how!r}")
    first = reports[0]
    if how == "auto":
        how = "ranks" if all(r.trace.steps == first.trace.steps for r in reports) else "runs"
    if how == "ranks":
        for i, r in enumerate(reports[1:], 1):
            if len(r.trace.steps) != len(first.trace.steps):
                raise InputError(
                    f"merge(how='ranks') needs the ranks of one run, over the same steps: report 0 holds "
                    f"{len(first.trace.steps)} step(s), report {i} {len(r.trace.steps)}; merge separate runs "
                    "with how='runs'"
                )

    blocked = [i for i, r in enumerate(reports) if r.trace.module_block > 1]
    if blocked:
        raise InputError(
            f"report {blocked[0]} keeps its per-module maxima per block of {reports[blocked[0]].trace.module_block} "
            "steps (a long trace), so its steps cannot be lined up with another report's: merge the reports "
            "before they are saved"
        )

    by_key: dict[tuple[str, str], ModuleStats] = {}
    for r in reports:
        for m in r.modules:
            key = (m.name, m.kind)
            prev = by_key.get(key)
            by_key[key] = m if prev is None else replace(prev, histogram=prev.histogram + m.histogram)

    trace = _merge_traces([r.trace for r in reports], how)
    meta = first.metadata
    hooked = list(meta.hooked_modules)
    for r in reports[1:]:
        hooked += [n for n in r.metadata.hooked_modules if n not in hooked]
    metadata = replace(
        meta,
        steps_seen=meta.steps_seen if how == "ranks" else sum(r.metadata.steps_seen for r in reports),
        steps_total=meta.steps_total if how == "ranks" else sum(r.metadata.steps_total for r in reports),
        world_size=sum(r.metadata.world_size for r in reports) if how == "ranks" else meta.world_size,
        partial=any(r.metadata.partial for r in reports),
        hooked_modules=tuple(hooked),
        captured=tuple(k for k in KINDS if any(k in r.metadata.captured for r in reports)),
    )
    # The collectors' sections as the first report holds them (per-run results, not summed).
    return Report(metadata=metadata, modules=tuple(by_key.values()), trace=trace, forward=first.forward,
                  blocks=first.blocks, shadow_runs=first.shadow_runs, capture=first.capture, sections=first.sections)


def _merge_traces(traces: Sequence[StepTrace], how: str) -> StepTrace:
    """Runs one after another (``"runs"``: their steps in a row), or ranks of one run (their steps summed)."""
    return _concat_traces(traces) if how == "runs" else _combine_traces(traces)


def _concat_traces(traces: Sequence[StepTrace]) -> StepTrace:
    """The steps of runs one after another; a part a run lacks is empty (histograms) or 0 (maxima) there."""
    kinds = {k for t in traces for k in t.histograms}
    histograms = {k: tuple(h for t in traces for h in t.histograms.get(k, ((Histogram(),) * len(t))))
                  for k in kinds}
    module_max: dict[str, dict[str, tuple[float, ...]]] = {}
    for k in {k for t in traces for k in t.module_max}:
        names = {n for t in traces for n in t.module_max.get(k, {})}
        module_max[k] = {
            n: tuple(v for t in traces for v in t.module_max.get(k, {}).get(n, (0.0,) * len(t)))
            for n in names
        }
    return StepTrace(
        steps=tuple(s for t in traces for s in t.steps),
        histograms=histograms,
        module_max=module_max,
        scale=tuple(s for t in traces for s in t.scale),
        found_inf=tuple(f for t in traces for f in t.found_inf),
        ceiling=(
            None if any(t.ceiling is None for t in traces)
            else tuple(c for t in traces for c in (t.ceiling or ()))
        ),
    )


def _combine_traces(traces: Sequence[StepTrace]) -> StepTrace:
    """The ranks of one run, step by step: histograms summed, maxima and ceilings the max, an inf on any rank."""
    first = traces[0]
    n = len(first)
    kinds = {k for t in traces for k in t.histograms}
    histograms = {}
    for k in kinds:
        per_step = [Histogram()] * n
        for t in traces:
            for i, h in enumerate(t.histograms.get(k, ())):
                per_step[i] = per_step[i] + h
        histograms[k] = tuple(per_step)
    module_max = {k: _max_by_name([t.module_max.get(k, {}) for t in traces], n)
                  for k in {k for t in traces for k in t.module_max}}
    found_inf = tuple(any(t.found_inf[i] for t in traces) for i in range(n))
    return StepTrace(first.steps, histograms, module_max, first.scale, found_inf, merge_ceilings(traces))


def _max_by_name(maxima: Sequence[Mapping[str, Sequence[float]]], n: int) -> dict[str, tuple[float, ...]]:
    """Per name, the step-by-step max over ``maxima`` (``n`` steps; a step a rank lacks counts 0)."""
    merged: dict[str, list[float]] = {}
    for by_name in maxima:
        for name, vals in by_name.items():
            cur = merged.setdefault(name, [0.0] * n)
            for i, v in enumerate(vals):
                cur[i] = max(cur[i], v)
    return {name: tuple(v) for name, v in merged.items()}


def merge_ceilings(traces: Sequence[StepTrace]) -> tuple[float, ...] | None:
    """Per-step ceilings of traces over the same steps (ranks): the max; None if any lacks one."""
    if not traces or any(t.ceiling is None for t in traces):
        return None
    return tuple(max(vals) for vals in zip(*(t.ceiling for t in traces)))


def merge_histories(histories: Sequence[StepHistory | None]) -> StepHistory | None:
    """The per-step histories of the ranks of one run: the first rank's scale, the max of the rest.

    A rank's inf/NaN wins (the step was skipped everywhere); None when a rank has none or the
    ranks recorded different steps.
    """
    if not histories or any(h is None for h in histories):
        return None
    hs = [h for h in histories if h is not None]
    first = hs[0]
    if any(h.first_step != first.first_step or len(h) != len(first) for h in hs):
        return None

    def top(values: Sequence[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        if not present:
            return None
        bad = [v for v in present if not math.isfinite(v)]
        return (math.nan if any(math.isnan(v) for v in bad) else math.inf) if bad else max(present)

    def column(get: Any) -> tuple[float | None, ...]:
        return tuple(top(vals) for vals in zip(*(get(h) for h in hs)))

    forward = None if any(h.forward_max is None for h in hs) else column(lambda h: h.forward_max)
    return StepHistory(first.first_step, first.scale, column(lambda h: h.grad_max), column(lambda h: h.ceiling),
                       forward)


def _check_report_fields(d: Mapping[str, Any]) -> None:
    """Check the top level of a report's JSON: the parts' types, unique modules, free-form nesting."""
    for key in ("metadata", "modules", "trace"):
        if key not in d:
            raise KeyError(key)
    validation.check_modules(d["modules"])
    validation.check_steps_agree(d["metadata"], d["trace"])
    if d.get("recommendation") is not None:
        validation.check_recommendation(d["recommendation"])
    if d.get("verification") is not None:
        validation.check_depth(d["verification"], "verification")


def append_text(path: str | os.PathLike[str], text: str) -> None:
    """Append ``text`` to ``path``: a regular file is rewritten whole (atomically), a device or FIFO written in place."""
    from fp16probe.outputs import output_target, write_in_place

    target = output_target(path)
    if target.in_place:
        write_in_place(target, text.encode("utf-8"), append=True)
        return
    with _folder_locked(target.path.parent):  # read, add, rename: two appends at once would keep one
        old = target.path.read_text(encoding="utf-8") if target.path.exists() else ""
        atomic_write_text(target.path, old + text)


@contextlib.contextmanager
def _folder_locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder`` (so no lock file is left behind) while the block runs.

    Other processes' appends into that folder wait; where ``fcntl`` or a folder lock is not
    available (Windows, some network file systems) the block runs unlocked, as before.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _mode_for(path: Path) -> int:
    """The permission bits ``open(path, "w")`` would leave: the replaced file's, else 0666 less the umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        pass
    with _UMASK_LOCK:  # os.umask can only be read by setting it; restore it at once
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


_UMASK_LOCK = threading.Lock()


def atomic_write_text(path: str | os.PathLike[str], text: str | bytes) -> None:
    """Write ``text`` (or bytes: a figure) to ``path`` through a temporary file and a rename.

    The file gets the mode an ordinary ``open(path, "w")`` would give it (the user's
    umask, or the mode of the file it replaces), not the temporary file's private 0600.
    A symlink's target is the file replaced; a device, a FIFO or ``/dev/stdout`` is
    written in place, never replaced, and a directory is refused (see :mod:`fp16probe.outputs`).
    """
    from fp16probe.outputs import output_target, write_in_place

    target = output_target(path)
    if target.in_place:
        write_in_place(target, text if isinstance(text, bytes) else text.encode("utf-8"))
        return
    path = target.path
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, mode)
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _legacy_sections(metadata: Any) -> tuple[dict[str, Any], Any]:
    """An older report's sections, out of its ``metadata.extra``: (their JSON by key, the metadata's JSON without them)."""
    extra = metadata.get("extra") if isinstance(metadata, Mapping) else None
    if not isinstance(extra, Mapping):
        return {}, metadata  # the metadata's own check names what is wrong
    legacy, user_extra = split_legacy_extra(extra)
    return legacy, {**metadata, **legacy.pop("metadata", {}), "extra": user_extra}


def _sections_json(report: Report) -> dict[str, Any]:
    """Every section the report holds, by key: built-in ones at the top level, the others under ``sections``."""
    out: dict[str, Any] = {}
    for key, entry in SECTIONS.items():
        value = getattr(report, key) if entry.builtin else None
        if value is not None:
            out[key] = entry.dump(value)
    others = {key: value if key not in SECTIONS else SECTIONS[key].dump(value)  # unknown: kept as it was read
              for key, value in report.sections.items()}
    return {**out, **({"sections": others} if others else {})}


def _sections_of(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Read every section of a report's JSON through SECTIONS (a section this version does not know stays JSON)."""
    out: dict[str, Any] = {}
    for key, entry in SECTIONS.items():
        if entry.builtin and d.get(key) is not None:
            out[key] = entry.load(d[key], path=f"{source} shadow" if key == "shadow" else key)
    others = d.get("sections") or {}
    if not isinstance(others, Mapping):
        raise ReportFieldError("sections", f"sections: expected an object, got {type(others).__name__}")
    for key, raw in others.items():
        known = SECTIONS.get(key)
        out[key] = raw if known is None or known.builtin else known.load(raw, path=f"sections.{key}")
    return out


register_section("shadow", lambda d, path: Report.from_dict(d, source=path), builtin=True)
register_section("history", StepHistory.from_dict, builtin=True)
register_section("forward", ForwardSection.from_dict, builtin=True)
register_section("blocks", BlockStats.from_dict, builtin=True)
register_section("shadow_runs", ShadowRuns.from_dict, builtin=True)
register_section("capture", CaptureNotes.from_dict, builtin=True)
register_section("workload", Workload.from_dict, builtin=True)
register_section("block_advice", BlockAdvice.from_dict, builtin=True)
register_section("precision_cost", PrecisionCost.from_dict)  # the live run's precision cost (capture.shadow)
register_section("emulation", Emulation.from_dict)  # the emulated target step (fp16probe.running.effect)
register_section("trial", Trial.from_dict)  # the training trial (fp16probe.running.trial)
register_section("skips", SkipLedger.from_dict)  # the skip ledger (fp16probe.capture.skips)


def with_workload(report: Report) -> Report:
    """``report`` with the run's description moved out of ``metadata.extra`` into its :class:`Workload` section.

    Called where a report is made from a caller's ``extra`` (``Probe.report``, and
    ``capture.distributed.gather_report`` for a Report made elsewhere): ``metadata.extra`` then
    holds the user's metadata only.
    """
    workload, user = split_workload(report.metadata.extra)
    if workload is None and user == dict(report.metadata.extra):
        return report
    if workload is not None and report.workload is not None:
        workload = Workload.from_dict({**report.workload.to_dict(), **workload.to_dict()})
    return replace(report, workload=workload or report.workload, metadata=replace(report.metadata, extra=user))

